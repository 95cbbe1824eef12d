"""Code-free serialisation of common state and sharded objects.

Values become JSON. JSON types are written as they are; everything else is an
object with a single ``"__ringlet__"`` tag naming the type (tuple, bytes,
tensor, ...). Tensors are not put in the JSON: they are handed to a sink that
stores them in a safetensors file, and the JSON keeps only their name there.
Loading never executes code: only the tags below are understood.
"""

from __future__ import annotations

import argparse
import base64
import enum
import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .core import CheckpointingException

TAG = "__ringlet__"

# Placeholder for list positions whose value is stored elsewhere (a sharded entry).
HOLE_TAG = "hole"


class _Hole:
    """Marker for a list position whose value was sharded (or local) at save time."""

    def __repr__(self) -> str:
        return "<hole>"


HOLE = _Hole()  # the only instance

_DTYPE_NAMES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "uint16",
        "uint32",
        "uint64",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_to_name(dtype: torch.dtype) -> str:
    """Name of a torch dtype as written in checkpoint metadata (``"float32"``)."""
    name = str(dtype).replace("torch.", "", 1)
    if _DTYPE_NAMES.get(name) != dtype:
        raise CheckpointingException(f"dtype {dtype} cannot be stored in a checkpoint")
    return name


def name_to_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_to_name`; rejects unknown names."""
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise CheckpointingException(f"unknown dtype {name!r} in checkpoint metadata") from None


TensorSink = Callable[[torch.Tensor], str]
TensorSource = Callable[[str], torch.Tensor]


def _tagged(kind: str, **fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {TAG: kind}
    out.update(fields)
    return out


def encode(value: Any, sink: TensorSink | None, path: str = "<root>") -> Any:
    """Turn ``value`` into JSON-compatible data; tensors go to ``sink``.

    ``HOLE`` encodes as a hole tag. Unsupported types raise
    ``CheckpointingException`` naming ``path``.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        raise CheckpointingException(
            f"cannot store enum {value!r} at {path} without executing code on load"
        )
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return _tagged("float", v=repr(value))
    if isinstance(value, _Hole):
        return _tagged(HOLE_TAG)
    if isinstance(value, complex):
        return _tagged(
            "complex", re=encode(value.real, sink, path), im=encode(value.imag, sink, path)
        )
    if isinstance(value, list):
        return [encode(v, sink, f"{path}/{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return _tagged("tuple", items=[encode(v, sink, f"{path}/{i}") for i, v in enumerate(value)])
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode(v, sink, f"{path}/{k}") for k, v in value.items()}
        return _tagged(
            "dict",
            items=[
                [encode(k, sink, path), encode(v, sink, f"{path}/{k}")] for k, v in value.items()
            ],
        )
    if isinstance(value, (set, frozenset)):
        kind = "set" if isinstance(value, set) else "frozenset"
        return _tagged(kind, items=[encode(v, sink, path) for v in value])
    if isinstance(value, (bytes, bytearray)):
        kind = "bytes" if isinstance(value, bytes) else "bytearray"
        return _tagged(kind, b64=base64.b64encode(bytes(value)).decode("ascii"))
    if isinstance(value, torch.dtype):
        return _tagged("dtype", v=dtype_to_name(value))
    if isinstance(value, torch.Size):
        return _tagged("size", items=list(value))
    if isinstance(value, torch.device):
        return _tagged("device", v=str(value))
    if isinstance(value, torch.Tensor):
        if sink is None:
            raise CheckpointingException(f"a tensor cannot be stored at {path}")
        if value.is_sparse or value.layout != torch.strided:
            raise CheckpointingException(
                f"only strided tensors can be stored (found {value.layout} at {path})"
            )
        dtype_to_name(value.dtype)
        return _tagged(
            "tensor", name=sink(value), device=str(value.device), grad=bool(value.requires_grad)
        )
    if isinstance(value, np.ndarray):
        if value.dtype == object or sink is None:
            raise CheckpointingException(
                f"numpy array of dtype {value.dtype} cannot be stored at {path}"
            )
        return _tagged(
            "ndarray",
            name=sink(torch.from_numpy(np.ascontiguousarray(value))),
            dtype=value.dtype.str,
        )
    if isinstance(value, np.generic):
        if isinstance(value, (np.bool_, np.number)):
            return _tagged("npscalar", dtype=value.dtype.str, v=encode(value.item(), sink, path))
        raise CheckpointingException(
            f"numpy scalar of type {type(value).__name__} cannot be stored at {path}"
        )
    if isinstance(value, argparse.Namespace):
        return _tagged("namespace", items=encode(dict(vars(value)), sink, path))
    if isinstance(value, pathlib.PurePath):
        return _tagged("path", v=str(value))
    raise CheckpointingException(
        f"value of type {type(value).__name__} at {path} cannot be stored in a checkpoint "
        "(supported: None, bool, int, float, complex, str, bytes, list, tuple, dict, set, "
        "torch.Tensor, torch.dtype, torch.Size, numpy arrays and scalars, argparse.Namespace, "
        "paths)"
    )


def decode(data: Any, source: TensorSource | None) -> Any:
    """Inverse of :func:`encode`; tensors are fetched from ``source`` by name."""
    if isinstance(data, list):
        return [decode(v, source) for v in data]
    if not isinstance(data, dict):
        return data
    kind = data.get(TAG)
    if kind is None:
        return {k: decode(v, source) for k, v in data.items()}
    if kind == HOLE_TAG:
        return HOLE
    if kind == "float":
        return float(data["v"])
    if kind == "complex":
        return complex(decode(data["re"], source), decode(data["im"], source))
    if kind == "tuple":
        return tuple(decode(v, source) for v in data["items"])
    if kind == "dict":
        return {_hashable(decode(k, source)): decode(v, source) for k, v in data["items"]}
    if kind == "set":
        return {_hashable(decode(v, source)) for v in data["items"]}
    if kind == "frozenset":
        return frozenset(_hashable(decode(v, source)) for v in data["items"])
    if kind == "bytes":
        return base64.b64decode(data["b64"])
    if kind == "bytearray":
        return bytearray(base64.b64decode(data["b64"]))
    if kind == "dtype":
        return name_to_dtype(data["v"])
    if kind == "size":
        return torch.Size(int(v) for v in data["items"])
    if kind == "device":
        return torch.device(data["v"])
    if kind in ("tensor", "ndarray"):
        if source is None:
            raise CheckpointingException("tensor reference found where no tensor file exists")
        tensor = source(str(data["name"]))
        if kind == "ndarray":
            return tensor.numpy().astype(_numeric_dtype(data["dtype"]), copy=False)
        if data.get("grad") and tensor.is_floating_point():
            tensor.requires_grad_(True)
        return tensor
    if kind == "npscalar":
        return _numeric_dtype(data["dtype"]).type(decode(data["v"], source))
    if kind == "namespace":
        return argparse.Namespace(**decode(data["items"], source))
    if kind == "path":
        return pathlib.Path(data["v"])
    raise CheckpointingException(f"unknown tag {kind!r} in stored data")


def _numeric_dtype(name: Any) -> np.dtype:
    """A numpy dtype from stored data; only booleans and numbers are accepted."""
    try:
        dtype = np.dtype(str(name))
    except (TypeError, ValueError) as err:
        raise CheckpointingException(f"invalid numpy dtype {name!r} in stored data") from err
    if dtype.kind not in "biufc":
        raise CheckpointingException(f"numpy dtype {name!r} in stored data is not numeric")
    return dtype


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, dict, set)):
        raise CheckpointingException(
            f"stored data has an unhashable dict key or set item: {value!r}"
        )
    return value


def dumps(data: Any) -> bytes:
    """Encode already-encoded data as compact UTF-8 JSON (no NaN literals)."""
    return json.dumps(data, allow_nan=False, separators=(",", ":")).encode("utf-8")


def loads(raw: bytes, what: str) -> Any:
    """Parse JSON written by :func:`dumps`, reporting ``what`` on failure."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointingException(
            f"{what} is not valid JSON (damaged or truncated?): {err}"
        ) from err
