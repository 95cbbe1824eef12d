"""The native C++ ``torch.distributed`` Backend: prebuilt in the wheel, or
built at first use.

``csrc/backend.cpp`` (a ``c10d::Backend`` subclass, its ``Work``, and the
operator ``torch.ops.ringlet.all_reduce_``) is compiled against one torch
release. A process finds it, in this order:

1. **Prebuilt**, in the package (``ringlet/distributed/_prebuilt/<tag>/``,
   put there by ``.ci/wheel.sh`` before the wheel is built): used when the
   installed torch's version and C++ ABI are exactly the ones it was built
   against (``<tag>`` is ``torch<version>-cxx11abi<0|1>``) and the file name
   (a hash of the sources, the torch version and the Python version) matches.
   No compiler is needed.
2. **Built earlier** by this machine, in torch's extension directory
   (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``).
3. **Built now** with ``torch.utils.cpp_extension`` (ninja and a C++
   compiler): for a torch the wheel carries no library for. libtorch's C++
   ABI (its class layouts, the virtual methods of ``c10d::Backend``) changes
   between torch versions, so the Backend must be compiled against the torch
   that loads it.

The Rust engine is reached through a C ABI table whose address Python hands
over (``ringlet._core.capi_table()``), so the C++ library does not link
against the engine's and does not depend on its build.

``RINGLET_NATIVE`` chooses: ``auto`` (default: native when a library is
found; otherwise one build starts in a background process and groups are
Python ones until it is done, so no ``init_process_group`` ever waits for a
compiler), ``0`` (always the Python group), ``1`` (native or an error; the
first use builds in the foreground). A background build that fails is
remembered (``<name>.failed`` beside its log ``<name>.log`` in the extension
directory) and not tried again until the environment it failed in changes
(ringlet's version, the compiler found, ninja, ``CXX``/``CC``/flags).
Whenever groups run on the Python ProcessGroup for any reason but
``RINGLET_NATIVE=0``, rank 0's first ``init_process_group`` logs one warning
on the ``ringlet`` logger with the reason, what the Python group lacks and
how to fix it. :func:`build` builds in the foreground
(``python -c "from ringlet.distributed import _native; _native.build()"``).

Example:
  >>> from ringlet.distributed import _native
  >>> ext = _native.load()          # None, with _native.reason(), when it cannot be had
  >>> ext is None or hasattr(ext, "RingletBackend")
  True
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import torch

from .. import _core

__all__ = [
    "backend_class",
    "build",
    "fallback_message",
    "library_name",
    "load",
    "mode",
    "prebuilt_tags",
    "reason",
    "status",
    "wrap",
]

_log = logging.getLogger("ringlet")
_SRC = Path(__file__).parent / "csrc"
_SOURCES = ("backend.cpp", "ringlet_capi.h", "glibc_compat.cpp")
# glibc_compat.cpp: without it a build on glibc >= 2.32 needs GLIBC_2.32 (see the file)
_CFLAGS = ["-O2", "-D__libc_single_threaded=ringlet_libc_single_threaded"]
# Where .ci/wheel.sh puts the library it builds for the wheel's torch (git-ignored).
_PREBUILT = Path(__file__).parent / "_prebuilt"
_lock = threading.Lock()
_module: Optional[ModuleType] = None
_origin: Optional[str] = None  # "prebuilt", "cache" or "built": where _module came from
_failure: Optional[str] = None
_failure_exc: Optional[BaseException] = None
_prebuilt_error: Optional[str] = None


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


def _torch_version() -> str:
    """The installed torch's version (what a library must have been built
    against; the tests replace this function to act out another torch)."""
    return str(torch.__version__)


def _abi_tag() -> str:
    """The prebuilt directory name for the installed torch:
    ``torch<version>-cxx11abi<0|1>``."""
    return f"torch{_torch_version()}-cxx11abi{int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))}"


def library_name() -> str:
    """The extension's name: the sources', torch's and Python's fingerprint.

    Returns:
      A valid module name such as ``ringlet_native_3f9c0a1b2c4d``.
    """
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((_SRC / name).read_bytes())
    h.update(" ".join(_CFLAGS).encode())
    h.update(_torch_version().encode())
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


def prebuilt_tags() -> list[str]:
    """The torch releases this installation carries a prebuilt library for.

    Returns:
      Directory names such as ``["torch2.13.0+cpu-cxx11abi1"]`` (empty for a
      source checkout where ``.ci/wheel.sh`` has not run).
    """
    if not _PREBUILT.is_dir():
        return []
    return sorted(p.name for p in _PREBUILT.iterdir() if any(p.glob("ringlet_native_*.so")))


def _describe(tag: str) -> str:
    """``torch2.13.0+cpu-cxx11abi1`` as ``torch 2.13.0+cpu``, with the ABI
    only when it is the old one."""
    version, _, abi = tag.removeprefix("torch").rpartition("-cxx11abi")
    return f"torch {version}" + ("" if abi == "1" else " (pre-C++11 ABI)")


def _prebuilt_path(name: str) -> Path:
    return _PREBUILT / _abi_tag() / f"{name}.so"


def status() -> dict[str, Any]:
    """Where the native Backend stands in this process, for reports
    (``python -m ringlet info``). Does not load or build anything.

    Returns:
      ``mode``, ``loaded`` (bool), ``origin`` (``"prebuilt"``, ``"cache"``,
      ``"built"`` or None), ``reason`` (why not loaded, or None),
      ``library`` (its name), ``torch_tag``, ``prebuilt_tags`` (what the
      package carries), ``prebuilt`` (the matching file, or None),
      ``cache`` (the directory a build goes to), ``failed_marker`` and
      ``log`` (paths of a remembered failed build, or None).

    Example:
      >>> status()["mode"] in ("auto", "0", "1")
      True
    """
    name = library_name()
    pre = _prebuilt_path(name)
    root = _build_directory(name).parent
    failed = root / f"{name}.failed"
    log = root / f"{name}.log"
    return {
        "mode": mode(),
        "loaded": _module is not None,
        "origin": _origin,
        "reason": reason(),
        "library": name,
        "torch_tag": _abi_tag(),
        "prebuilt_tags": prebuilt_tags(),
        "prebuilt": str(pre) if pre.is_file() else None,
        "cache": str(_build_directory(name)),
        "failed_marker": str(failed) if failed.is_file() else None,
        "log": str(log) if log.is_file() else None,
    }


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


def _import_file(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_prebuilt(name: str) -> Optional[ModuleType]:
    """The wheel's library, when it was built for exactly this torch (its
    version and C++ ABI: the directory) and these sources and Python (the
    file name). One that fails to load (a system older than the one it was
    built for) is noted in the reason and skipped."""
    global _prebuilt_error
    path = _prebuilt_path(name)
    if not path.is_file():
        return None
    try:
        return _import_file(name, path)
    except Exception as e:  # e.g. a libstdc++ or glibc older than the build machine's
        _prebuilt_error = f"the prebuilt library {path} did not load: {type(e).__name__}: {e}"
        _log.info("ringlet: %s", _prebuilt_error)
        return None


def _import_built(name: str) -> Optional[ModuleType]:
    """The cached library, if an earlier process built it."""
    path = _build_directory(name) / f"{name}.so"
    if not path.is_file():
        from torch.utils.cpp_extension import _get_build_directory

        path = Path(_get_build_directory(name, False)) / f"{name}.so"  # torch's own rule
    if not path.is_file():
        return None
    return _import_file(name, path)


def _build(name: str, build_directory: Optional[str] = None) -> ModuleType:
    """Compiles the extension (ranks that start together wait for one build)."""
    from torch.utils import cpp_extension

    _log.info(
        "ringlet: building the native torch.distributed backend %s (once per torch "
        "version; about 30 s on two cores)",
        name,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the compiler ABI notes torch prints
        return cpp_extension.load(
            name=name,
            sources=[str(_SRC / "backend.cpp"), str(_SRC / "glibc_compat.cpp")],
            extra_include_paths=[str(_SRC)],
            extra_cflags=_CFLAGS,
            build_directory=build_directory,
            verbose=os.environ.get("RINGLET_NATIVE_VERBOSE") == "1",
        )


# -- why a build failed, and remembering it ------------------------------------------

_COMMAND = re.compile(r"(^|\s)-c\s+\S+.*\s-o\s|\s-MMD\s|^\S*(c\+\+|g\+\+|gcc|clang\+*)\s+-")
_ERROR = re.compile(
    r"\berror\b|not found|no such file|cannot|permission denied|fatal", re.IGNORECASE
)


def _compiler_output(e: BaseException) -> str:
    """All a failed build said: the exception's text and, for a compiler
    that failed when torch asked its version, that command's output."""
    parts = [str(e)]
    for attr in ("output", "stderr"):
        extra = getattr(e, attr, None)
        if isinstance(extra, bytes):
            extra = extra.decode(errors="replace")
        if extra:
            parts.append(str(extra))
    return "\n".join(p for p in parts if p.strip())


def _cause(text: str) -> str:
    """The line of a failed build's output that says why: the compiler's
    own first error (``/bin/sh: 1: c++: not found``, ``backend.cpp:12:3:
    error: ...``), not ninja's progress lines or the compile command."""
    lines = []
    for raw in text.splitlines():
        line = re.sub(r"^Error building extension '[^']*':\s*", "", raw.strip())
        if (
            not line
            or re.match(r"^\[\d+/\d+\]", line)
            or line.startswith("FAILED:")
            or line.startswith("ninja: build stopped")
            or _COMMAND.search(line)
        ):
            continue
        lines.append(line)
    for line in lines:
        if _ERROR.search(line):
            return line
    if lines:
        return lines[0]
    return text.strip().splitlines()[0] if text.strip() else "no output"


def _which(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        return f"{program} (not found)"
    try:
        st = os.stat(path)
        return f"{os.path.realpath(path)} {st.st_size} {int(st.st_mtime)}"
    except OSError:
        return path


_ENV_KEYS = (
    "CXX",
    "CC",
    "CFLAGS",
    "CXXFLAGS",
    "CPPFLAGS",
    "LDFLAGS",
    "CPATH",
    "CPLUS_INCLUDE_PATH",
    "LIBRARY_PATH",
    "TORCH_CUDA_ARCH_LIST",
)


def _environment(name: str) -> dict[str, str]:
    """What a build's outcome depends on beyond ``name`` (which holds the
    sources, torch's version and Python's): ringlet's version, the compiler
    and ninja that would run, and the variables torch's build reads."""
    env = {k: os.environ[k] for k in _ENV_KEYS if k in os.environ}
    return {
        "library": name,
        "ringlet": str(getattr(_core, "__version__", "?")),
        "compiler": _which(os.environ.get("CXX", "c++")),
        "ninja": _which("ninja"),
        **{f"env:{k}": v for k, v in sorted(env.items())},
    }


def _env_digest(env: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]


def _remember_failure(name: str, env: dict[str, str], e: BaseException) -> str:
    """Writes the full output of a failed build to ``<name>.log`` and the
    marker ``<name>.failed`` (the environment it failed in and the cause);
    returns the reason to give."""
    root = _build_directory(name).parent
    text = _compiler_output(e)
    cause = _cause(text)
    log = root / f"{name}.log"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"\n--- {type(e).__name__} ---\n{text}\n")
        record = {
            "digest": _env_digest(env),
            "environment": env,
            "cause": cause,
            "error": type(e).__name__,
            "log": str(log),
        }
        tmp = root / f"{name}.failed.{os.getpid()}"
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, root / f"{name}.failed")
    except OSError as oe:
        _log.info("ringlet: could not record the failed build in %s: %s", root, oe)
    return f"building the native backend failed: {cause} (full log: {log})"


def _remembered_failure(name: str, env: dict[str, str]) -> Optional[str]:
    """The reason a build failed in this same environment, if one did;
    a marker from another environment is removed (that build is retried)."""
    marker = _build_directory(name).parent / f"{name}.failed"
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if record.get("digest") != _env_digest(env):
        marker.unlink(missing_ok=True)
        return None
    return (
        f"building the native backend failed earlier in this environment: "
        f"{record.get('cause')} (full log: {record.get('log')}; not retried until the "
        f"compiler, ninja, CXX/CC/flags or ringlet's version change)"
    )


# -- loading ------------------------------------------------------------------------


def load() -> Optional[ModuleType]:
    """The native extension when it can be had; None when it is turned off
    (``RINGLET_NATIVE=0``), not built yet (``auto``: this call starts the
    build in a background process and returns at once), or cannot be built
    (see :func:`reason`). ``RINGLET_NATIVE=1`` builds in the foreground.

    Returns:
      The extension module (``RingletBackend``, ``NoopBackend``; loading it
      registers ``torch.ops.ringlet.all_reduce_``), or None.

    Raises:
      RuntimeError: ``RINGLET_NATIVE=1`` and the build failed (the message
        holds the compiler's own error and the path of the full log).

    Example:
      >>> ext = load()
    """
    return _load(foreground=mode() == "1")


def build() -> Optional[ModuleType]:
    """Builds the native extension now, in this process (or loads it when it
    is prebuilt or built already), whatever ``RINGLET_NATIVE`` says other
    than ``0``; a remembered failure is tried again.

    Returns:
      The extension module, or None when it is turned off or cannot be
      built (see :func:`reason`).

    Raises:
      RuntimeError: ``RINGLET_NATIVE=1`` and the build failed.

    Example:
      >>> from ringlet.distributed import _native
      >>> _native.build() is not None     # with the wheel's torch, or a C++ compiler and ninja
      True
    """
    return _load(foreground=True)


def _load(foreground: bool) -> Optional[ModuleType]:
    global _module, _origin, _failure, _failure_exc
    if mode() == "0":
        _python_op()
        return None
    if _module is not None:
        return _module
    with _lock:
        if _module is None and (_failure is None or (foreground and _failure_exc is None)):
            _failure, _failure_exc = None, None
            import torch.distributed  # noqa: F401  (the Backend's base class)

            name = ""
            env: dict[str, str] = {}
            try:
                name = library_name()  # reads the sources: missing from a broken install
                env = _environment(name)
                _module, _origin = _import_prebuilt(name), "prebuilt"
                if _module is None:
                    try:
                        _module, _origin = _import_built(name), "cache"
                    except Exception:  # half written by a build in progress
                        _module = None
                if _module is None:
                    _origin = None
                    remembered = None if foreground else _remembered_failure(name, env)
                    if remembered is not None:
                        _failure = remembered
                    elif foreground:
                        _module, _origin = _build(name), "built"
                        _build_directory(name).parent.joinpath(f"{name}.failed").unlink(
                            missing_ok=True
                        )
                    else:
                        _failure = _build_in_background(name, env)
            except Exception as e:  # no sources, compiler, ninja or headers; a bad build
                _failure_exc = e
                if name:
                    _failure = _remember_failure(name, env, e)
                else:
                    _failure = (
                        f"the native backend's sources are missing ({type(e).__name__}: "
                        f"{e}); reinstall ringlet"
                    )
                _log.info("ringlet: %s", _failure)
            if _module is None and _prebuilt_error is not None and _failure is not None:
                _failure += f"; {_prebuilt_error}"
    if _module is None and mode() == "1":
        raise RuntimeError(f"ringlet: RINGLET_NATIVE=1 but {_failure}") from _failure_exc
    if _module is None:
        _python_op()
    else:
        _direct_call()
    return _module


def _build_in_background(name: str, env: dict[str, str]) -> str:
    """Starts one detached, low-priority build of the extension unless one
    is running (a marker file in torch's extension directory; one older
    than ten minutes is taken for a build that died); its output goes to
    ``<name>.log`` there, and a failure to the marker ``<name>.failed``.
    Returns the reason groups are Python ones meanwhile."""
    import subprocess
    import time

    root = _build_directory(name).parent
    root.mkdir(parents=True, exist_ok=True)
    marker = root / f"{name}.building"
    log = root / f"{name}.log"
    have = prebuilt_tags()
    why = (
        f"the wheel's prebuilt library is for {', '.join(_describe(t) for t in have)}, "
        f"not {_describe(_abi_tag())}"
        if have
        else f"no prebuilt library for {_describe(_abi_tag())} in this installation"
    )
    reason_ = (
        f"{why}; the native backend is being built in a background process (its first "
        f"use with this torch; log: {log}); processes that start after it is built use it"
    )
    try:
        if time.time() - marker.stat().st_mtime > 600:
            marker.unlink(missing_ok=True)
    except OSError:
        pass
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return reason_
    script = (
        "import os, sys\n"
        "os.nice(10)\n"
        "from ringlet.distributed import _native\n"
        "_native._background_build(sys.argv[1], sys.argv[2], sys.argv[3])\n"
    )
    child_env = dict(os.environ, RINGLET_NATIVE="auto")
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), child_env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    with open(log, "w") as out:
        subprocess.Popen(
            [sys.executable, "-c", script, name, json.dumps(env), str(marker)],
            env=child_env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            close_fds=True,
        )
    _log.info("ringlet: %s", reason_)
    return reason_


def _background_build(name: str, env_json: str, marker: str) -> None:
    """The background build's process: builds ``name``; on failure writes
    the marker ``<name>.failed`` with the environment its parent saw (so
    the parent's next run matches it), and always removes ``marker``."""
    try:
        try:
            _build(name)
            _build_directory(name).parent.joinpath(f"{name}.failed").unlink(missing_ok=True)
        except Exception as e:
            print(f"ringlet: {_remember_failure(name, json.loads(env_json), e)}", flush=True)
    finally:
        Path(marker).unlink(missing_ok=True)


def _prebuild(dest: Optional[Path] = None) -> Path:
    """Puts the library for the installed torch into the package's
    ``_prebuilt/<tag>/`` (``.ci/wheel.sh`` runs it before ``maturin build``):
    the lazy build's own output (``build()``; taken from torch's extension
    cache when an earlier build is there).

    Args:
      dest: The ``_prebuilt`` root (default: this package's).

    Returns:
      The path of the placed library.
    """
    import torch.distributed  # noqa: F401  (the Backend's base class)

    name = library_name()
    src = _build_directory(name) / f"{name}.so"
    if not src.is_file():
        built = _build(name)  # raises with the compiler's output
        src = Path(str(built.__file__))
    target = (dest or _PREBUILT) / _abi_tag() / f"{name}.so"
    if target.parent.is_dir():
        shutil.rmtree(target.parent)  # one library per torch: no stale names
    target.parent.mkdir(parents=True)
    shutil.copy2(src, target)
    return target


_op_lib: Optional[torch.library.Library] = None
_REDUCE = {
    "sum": "SUM",
    "mul": "PRODUCT",
    "product": "PRODUCT",
    "min": "MIN",
    "max": "MAX",
    "and": "BAND",
    "band": "BAND",
    "or": "BOR",
    "bor": "BOR",
    "xor": "BXOR",
    "bxor": "BXOR",
}


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
            raise ValueError(
                f"torch.ops.ringlet.all_reduce_: unknown reduce_op {reduce_op!r} "
                "(expected one of sum, mul, min, max, and, or, xor)"
            )
        pg = dist.distributed_c10d._resolve_process_group(group) if group else None
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=pg)

    def meta(x: torch.Tensor, reduce_op: str = "sum", group: str = "") -> None:
        return None

    lib.impl("all_reduce_", cpu, "CPU")
    lib.impl("all_reduce_", meta, "Meta")
    _op_lib = lib
    _direct_call()


def _direct_call() -> None:
    """Makes ``torch.ops.ringlet.all_reduce_(...)`` call torch's C++ operator
    entry directly. torch's ``OpOverloadPacket.__call__`` is a Python frame
    whose only work is to divert TorchBind arguments (this schema has none);
    it cost about 0.5 µs of a 4 KiB call's 2-4 µs in one process and
    0.17-0.24 µs per call back to back on 2 ranks. The
    packet stays the same object, an ``OpOverloadPacket``, only its class
    changes (as ``ringlet.ops``' functional operators do), so ``.default``,
    ``torch.compile`` and references taken earlier work as before. Left as
    torch made it where the packet is not what this expects (another torch)."""
    global _DirectPacket
    packet = getattr(torch.ops.ringlet, "all_reduce_", None)
    base = torch._ops.OpOverloadPacket
    entry = getattr(packet, "_op", None)
    if (type(packet) is not base or not callable(entry)
            or getattr(packet, "_has_torchbind_op_overload", True)):
        return
    # a class of this module's (found by name, as torch's own packet class is)
    _DirectPacket = type("_DirectPacket", (base,), {
        "__call__": staticmethod(entry),
        "__doc__": "``torch.ops.ringlet.all_reduce_``, called straight into torch's C++ entry.",
    })
    packet.__class__ = _DirectPacket


_DirectPacket: Optional[type] = None


# -- process groups ------------------------------------------------------------


def wrap(pg: Any) -> Any:
    """What the ``"ringlet"`` creator hands torch for the Python group ``pg``:
    a native ``RingletBackend`` around it when the extension loads (torch
    then builds its own ``ProcessGroup`` with it as the CPU backend), else
    ``pg`` itself (torch uses a Python ``ProcessGroup`` as the whole group).
    Logs which one, once per process at INFO; when it is the Python group for
    any reason but ``RINGLET_NATIVE=0``, global rank 0 also logs one WARNING
    (see :func:`fallback_message`).

    Args:
      pg (ringlet.distributed.c10d.ProcessGroupRinglet): The new group.

    Returns:
      The Backend, or ``pg``.
    """
    global _told
    ext = load()
    pg._kind = "python" if ext is None else "native"
    if not _told:
        _told = True
        how = (
            "the native C++ Backend (cpu:ringlet, beside any other device's backend)"
            if ext is not None
            else f"the Python ProcessGroup ({reason()})"
        )
        _log.info("ringlet: rank %d: torch.distributed process groups run on %s", pg.rank(), how)
        if ext is None and mode() != "0" and _global_rank(pg) == 0:
            _log.warning("%s", fallback_message())
    if ext is None:
        return pg
    return ext.RingletBackend(pg, _core.capi_table(), pg._timeout)


def _global_rank(pg: Any) -> int:
    """This process's rank in the job (the default group's rank; a group made
    inside ``init_process_group`` is the default group)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return int(dist.get_rank())
    return int(pg.rank())


def fallback_message() -> str:
    """The warning rank 0 logs when ``init_process_group("ringlet")`` runs on
    the Python ProcessGroup: why, what that group lacks, and how to fix it.

    Returns:
      The message (it names :func:`reason`).

    Example:
      >>> "RINGLET_NATIVE=0" in fallback_message()
      True
    """
    why = reason() or "the native backend did not load"
    have = prebuilt_tags()
    fixes = []
    if "background process" not in why:
        fixes.append(
            "install a C++ compiler and ninja (e.g. `apt-get install g++`; the build "
            "is retried when the compiler or CXX changes) or build it now with "
            '`python -c "from ringlet.distributed import _native; _native.build()"`'
        )
    if have and _abi_tag() not in have:
        fixes.append(
            f"install the torch this wheel carries the library for "
            f"({', '.join(_describe(t) for t in have)})"
        )
    fixes.append("set RINGLET_NATIVE=0 to use the Python ProcessGroup without this message")
    return (
        "ringlet: init_process_group('ringlet') runs on the Python ProcessGroup, not the "
        f"native C++ Backend: {why}. Collectives work, but the Python ProcessGroup lacks what "
        "only a c10d Backend gives: mixed device strings such as 'cpu:ringlet,cuda:nccl' "
        "(a Python group cannot stand beside another backend), dist.shrink_group, "
        "split_group and group._get_backend(torch.device('cpu')); "
        "torch.ops.ringlet.all_reduce_ runs through Python. To fix: " + "; or ".join(fixes) + "."
    )


_told = False


def backend_class() -> Optional[type]:
    """The built C++ ``RingletBackend`` class, or None while the native backend
    is not loaded in this process."""
    return None if _module is None else _module.RingletBackend
