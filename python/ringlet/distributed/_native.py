"""The native C++ ``torch.distributed`` Backend, built at first use.

``csrc/backend.cpp`` (a ``c10d::Backend`` subclass, its ``Work``, and the
operator ``torch.ops.ringlet.all_reduce_``) is compiled against the torch
installed in this environment the first time a process needs it, with
``torch.utils.cpp_extension`` (ninja and a C++ compiler), and cached in
torch's extension directory (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) under a name that holds the hash of the
sources, the torch version and the Python version: later processes import
the cached library at once, and a new torch or ringlet builds afresh.

Why at first use and not when the wheel is built: ringlet's wheel accepts a
range of torch versions, and libtorch's C++ ABI (its class layouts, the
virtual methods of ``c10d::Backend``) changes between them, so the Backend
must be compiled against the torch that will load it. The Rust engine is
reached through a C ABI table whose address Python hands over
(``ringlet._core.capi_table()``), so the C++ library does not link against
the engine's and does not depend on its build.

``RINGLET_NATIVE`` chooses: ``auto`` (default: native when the library is
built; on first use the build starts in a background process and groups are
Python ones until it is done, so no ``init_process_group`` ever waits for a
compiler), ``0`` (always the Python group), ``1`` (native or an error; the
first use builds in the foreground). :func:`build` builds in the foreground
(``python -c "from ringlet import _native; _native.build()"`` after
installing, to have native groups from the first process on). Without a
compiler, ninja or torch's C++ headers the build fails, the reason is
logged, and process groups are Python ones
(``ringlet.c10d.backend_kind(group)`` says which).

Example:
  >>> from ringlet import _native
  >>> ext = _native.load()          # None, with _native.reason(), when it cannot build
  >>> ext is None or hasattr(ext, "RingletBackend")
  True
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import torch

from .. import _core

__all__ = ["backend_class", "build", "library_name", "load", "mode", "reason", "wrap"]

_log = logging.getLogger("ringlet")
_SRC = Path(__file__).parent / "csrc"
_SOURCES = ("backend.cpp", "ringlet_capi.h")
_lock = threading.Lock()
_module: Optional[ModuleType] = None
_failure: Optional[str] = None


def mode() -> str:
    """``RINGLET_NATIVE`` as one of ``"auto"``, ``"0"``, ``"1"``.

    Returns:
      The mode; unknown values read as ``"auto"``.
    """
    value = os.environ.get("RINGLET_NATIVE", "auto").strip().lower()
    if value in ("0", "off", "false", "no", "python"):
        return "0"
    if value in ("1", "on", "true", "yes", "native"):
        return "1"
    return "auto"


def library_name() -> str:
    """The extension's name: the sources', torch's and Python's fingerprint.

    Returns:
      A valid module name such as ``ringlet_native_3f9c0a1b2c4d``.
    """
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((_SRC / name).read_bytes())
    h.update(torch.__version__.encode())
    h.update(f"{sys.version_info[:2]}{getattr(sys, 'abiflags', '')}".encode())
    return f"ringlet_native_{h.hexdigest()[:12]}"


def reason() -> Optional[str]:
    """Why the native Backend is not in use in this process, if it is not.

    Returns:
      ``None`` while it loads (or was not tried), else the reason.
    """
    if mode() == "0":
        return "RINGLET_NATIVE=0"
    return _failure


def _build_directory(name: str) -> Path:
    """Where ``torch.utils.cpp_extension`` builds extension ``name``: its
    own rule, written out, because importing that module costs about 0.2 s
    of every process's start-up (seconds of CPU on a machine running many
    ranks) just to find a file that is usually there."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch import _appdirs

        base = os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))
        if torch.version.hip is not None:
            accel = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accel = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accel = "cpu"
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(base, f"{py}_{accel}")
    return Path(root) / name


def _import_built(name: str) -> Optional[ModuleType]:
    """The cached library, if an earlier process built it."""
    path = _build_directory(name) / f"{name}.so"
    if not path.is_file():
        from torch.utils.cpp_extension import _get_build_directory

        path = Path(_get_build_directory(name, False)) / f"{name}.so"  # torch's own rule
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str) -> ModuleType:
    """Compiles the extension (ranks that start together wait for one build)."""
    from torch.utils import cpp_extension

    _log.info("ringlet: building the native torch.distributed backend %s (once per torch "
              "version; about 30 s on two cores)", name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the compiler ABI notes torch prints
        return cpp_extension.load(
            name=name,
            sources=[str(_SRC / "backend.cpp")],
            extra_include_paths=[str(_SRC)],
            extra_cflags=["-O2"],
            verbose=os.environ.get("RINGLET_NATIVE_VERBOSE") == "1",
        )


def load() -> Optional[ModuleType]:
    """The native extension when it is built; None when it is turned off
    (``RINGLET_NATIVE=0``), not built yet (``auto``: this call starts the
    build in a background process and returns at once) or cannot be built
    (see :func:`reason`). ``RINGLET_NATIVE=1`` builds in the foreground.

    Returns:
      The extension module (``RingletBackend``, ``NoopBackend``; loading it
      registers ``torch.ops.ringlet.all_reduce_``), or None.

    Raises:
      RuntimeError: ``RINGLET_NATIVE=1`` and the build failed.

    Example:
      >>> ext = load()
    """
    return _load(foreground=mode() == "1")


def build() -> Optional[ModuleType]:
    """Builds the native extension now, in this process (or loads it when it
    is built already), whatever ``RINGLET_NATIVE`` says other than ``0``.

    Returns:
      The extension module, or None when it is turned off or cannot be
      built (see :func:`reason`).

    Raises:
      RuntimeError: ``RINGLET_NATIVE=1`` and the build failed.

    Example:
      >>> from ringlet import _native
      >>> _native.build() is not None     # where a C++ compiler and ninja exist
      True
    """
    return _load(foreground=True)


def _load(foreground: bool) -> Optional[ModuleType]:
    global _module, _failure
    if mode() == "0":
        _python_op()
        return None
    if _module is not None:
        return _module
    with _lock:
        if _module is None and (_failure is None or (foreground and _failure == _BACKGROUND)):
            _failure = None
            import torch.distributed  # noqa: F401  (the Backend's base class)

            try:
                name = library_name()  # reads the sources: missing from a broken install
                try:
                    _module = _import_built(name)
                except Exception:  # half written by a build in progress
                    _module = None
                if _module is None and foreground:
                    _module = _build(name)
                elif _module is None:
                    _build_in_background(name)
                    _failure = _BACKGROUND
            except Exception as e:  # no sources, compiler, ninja or headers; a bad build
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                _failure = f"building the native backend failed: {type(e).__name__}: {first}"
                _log.warning("ringlet: %s; process groups run on the Python ProcessGroup "
                             "(set RINGLET_NATIVE=0 to skip the attempt)", _failure)
    if _module is None and mode() == "1":
        raise RuntimeError(f"ringlet: RINGLET_NATIVE=1 but {_failure}")
    if _module is None:
        _python_op()
    return _module


_BACKGROUND = ("the native backend is being built in a background process (its first use "
               "with this torch); processes that start after it is built use it")


def _build_in_background(name: str) -> None:
    """Starts one detached, low-priority build of the extension unless one
    is running (a marker file in torch's extension directory; one older
    than ten minutes is taken for a build that died)."""
    import subprocess
    import time

    root = _build_directory(name).parent
    root.mkdir(parents=True, exist_ok=True)
    marker = root / f"{name}.building"
    try:
        if time.time() - marker.stat().st_mtime > 600:
            marker.unlink(missing_ok=True)
    except OSError:
        pass
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    script = ("import os, pathlib\n"
              "os.nice(10)\n"
              "try:\n"
              "    from ringlet.distributed import _native\n"
              "    _native.build()\n"
              "finally:\n"
              f"    pathlib.Path({str(marker)!r}).unlink(missing_ok=True)\n")
    env = dict(os.environ, RINGLET_NATIVE="auto")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, close_fds=True)
    _log.info("ringlet: %s", _BACKGROUND)


_op_lib: Optional[torch.library.Library] = None
_REDUCE = {"sum": "SUM", "mul": "PRODUCT", "product": "PRODUCT", "min": "MIN", "max": "MAX",
           "and": "BAND", "band": "BAND", "or": "BOR", "bor": "BOR", "xor": "BXOR",
           "bxor": "BXOR"}


def _python_op() -> None:
    """``torch.ops.ringlet.all_reduce_`` where the C++ extension is not in
    use: the same schema, run through ``dist.all_reduce`` (one Python hop
    more than the C++ kernel)."""
    global _op_lib
    if _op_lib is not None:
        return
    import torch.distributed as dist

    lib = torch.library.Library("ringlet", "FRAGMENT")
    lib.define("all_reduce_(Tensor(a!) x, str reduce_op='sum', str group='') -> ()")

    def cpu(x: torch.Tensor, reduce_op: str = "sum", group: str = "") -> None:
        op = _REDUCE.get(reduce_op)
        if op is None:
            raise ValueError(f"torch.ops.ringlet.all_reduce_: unknown reduce_op {reduce_op!r} "
                             "(expected one of sum, mul, min, max, and, or, xor)")
        pg = dist.distributed_c10d._resolve_process_group(group) if group else None
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=pg)

    def meta(x: torch.Tensor, reduce_op: str = "sum", group: str = "") -> None:
        return None

    lib.impl("all_reduce_", cpu, "CPU")
    lib.impl("all_reduce_", meta, "Meta")
    _op_lib = lib


# -- process groups ------------------------------------------------------------


def wrap(pg: Any) -> Any:
    """What the ``"ringlet"`` creator hands torch for the Python group ``pg``:
    a native ``RingletBackend`` around it when the extension loads (torch
    then builds its own ``ProcessGroup`` with it as the CPU backend), else
    ``pg`` itself (torch uses a Python ``ProcessGroup`` as the whole group).
    Logs which one, once per process at INFO.

    Args:
      pg (ringlet.c10d.ProcessGroupRinglet): The new group.

    Returns:
      The Backend, or ``pg``.
    """
    global _told
    ext = load()
    pg._kind = "python" if ext is None else "native"
    if not _told:
        _told = True
        how = ("the native C++ Backend (cpu:ringlet, beside any other device's backend)"
               if ext is not None else f"the Python ProcessGroup ({reason()})")
        _log.info("ringlet: rank %d: torch.distributed process groups run on %s",
                  pg.rank(), how)
    if ext is None:
        return pg
    return ext.RingletBackend(pg, _core.capi_table(), pg._timeout)


_told = False


def backend_class() -> Optional[type]:
    """The built C++ ``RingletBackend`` class, or None while the native backend
    is not loaded in this process."""
    return None if _module is None else _module.RingletBackend
