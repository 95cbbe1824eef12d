"""Files: a streaming safetensors writer, atomic small-file writes, directory swaps."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .core import CheckpointingException

# safetensors dtype codes (see the safetensors format description).
_ST_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, name): code
    for name, code in (
        ("float64", "F64"),
        ("float32", "F32"),
        ("float16", "F16"),
        ("bfloat16", "BF16"),
        ("int64", "I64"),
        ("int32", "I32"),
        ("int16", "I16"),
        ("int8", "I8"),
        ("uint8", "U8"),
        ("bool", "BOOL"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
        ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
        ("complex64", "C64"),
        ("uint16", "U16"),
        ("uint32", "U32"),
        ("uint64", "U64"),
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}

_PARTIAL = ".partial"


def fsync_dir(path: str) -> None:
    """Flush a directory entry to disk (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.to("cpu").contiguous()


def write_safetensors(
    path: str,
    tensors: Sequence[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    hook: Callable[[str], None] | None = None,
) -> int:
    """Write ``tensors`` as one safetensors file, streaming and atomically.

    Tensors are copied to host memory one at a time, so the peak extra memory is
    one tensor, not the whole file. The data goes to ``path + '.partial'``, is
    fsynced, then renamed to ``path``. Returns the file size in bytes.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, tensor in tensors:
        if tensor.dtype not in _ST_DTYPES:
            raise CheckpointingException(
                f"dtype {tensor.dtype} of {name!r} cannot be stored in safetensors"
            )
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    tmp = path + _PARTIAL
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for i, (_, tensor) in enumerate(tensors):
            host = _to_host(tensor)
            if host.numel():
                f.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
            if on_bytes is not None:
                on_bytes(host.numel() * host.element_size())
            if hook is not None and i == 0:
                hook("mid_write")
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    os.replace(tmp, path)
    return size


def write_bytes_atomic(path: str, data: bytes) -> int:
    """Write ``data`` to ``path`` through a fsynced temporary file and a rename."""
    tmp = path + _PARTIAL
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(data)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2() -> Any | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange_dirs(a: str, b: str) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the call is unavailable or refused by the filesystem, so
    that the caller can fall back to two renames.
    """
    fn = _renameat2()
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def list_dir(path: str) -> list[str]:
    """Names in ``path``; empty when it cannot be listed."""
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []
