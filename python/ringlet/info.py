"""``python -m ringlet info``: what ringlet finds on this machine and what it will do here.

In the spirit of DeepSpeed's ``ds_report`` and ``torch.utils.collect_env``: one
command whose output goes into a bug report, and which answers the questions a
first run raises. It reports

- the versions of ringlet, torch and Python, and how ringlet was installed (the
  wheel's tag, or an editable / source build);
- which process group ``init_process_group("ringlet")`` will use here (the
  native C++ Backend or the Python ``ProcessGroup``) and why, with the native
  library's build status and cache path;
- the transports this machine allows: shared memory (a memfd another process
  opens), cross-memory attach (Yama's ``ptrace_scope`` and a real
  ``process_vm_readv`` from a second process), the network interfaces and the
  address ringlet would listen on;
- the SIMD variant each vector kernel selected on this CPU;
- the configuration variables that are set (every ``RINGLET_*`` one, a name
  ringlet never reads flagged as a likely typo, and the launcher's and torch's
  variables that change what ringlet does).

It builds nothing, starts no job and changes nothing: the probes are a memory
file, a mapping and one short child process.

Example:
  >>> import torch
  >>> from ringlet import info
  >>> report = info.collect()
  >>> report["torch"]["version"] == torch.__version__
  True
  >>> print(info.render(report))              # what `python -m ringlet info` prints
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

__all__ = ["collect", "describe_transport", "main", "render"]

# Variables other than RINGLET_* that change what ringlet does, and why.
_OTHER_VARIABLES = {
    "MASTER_ADDR": "the store's host; ringlet listens on the address the route to it leaves from",
    "MASTER_PORT": "the store's port (29500 when unset)",
    "RANK": "this process's rank (torchrun sets it)",
    "WORLD_SIZE": "the number of ranks (torchrun sets it)",
    "LOCAL_RANK": "the rank on this host (torchrun sets it)",
    "LOCAL_WORLD_SIZE": "ranks on this host (torchrun sets it)",
    "TORCHELASTIC_USE_AGENT_STORE": "torchrun's agent runs the store",
    "GLOO_SOCKET_IFNAME": "gloo's interface; ringlet does not read it (set RINGLET_ADDR)",
    "TORCH_EXTENSIONS_DIR": "where the native Backend's library is built and cached",
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0 stops torch from registering 'ringlet' at import",
    "CXX": "the C++ compiler the native Backend's build uses (c++ when unset)",
    "MAX_JOBS": "parallel compile jobs of the native Backend's build",
    "OMP_NUM_THREADS": "torch's intra-op threads, which compete with waiting ranks for cores",
    "TORCH_DISTRIBUTED_DEBUG": "torch.distributed's own checks (DETAIL adds collective checks)",
}

# What the Python ProcessGroup cannot do that the native Backend can.
_PYTHON_LACKS = (
    "mixed backend strings ('cpu:ringlet,cuda:nccl'), dist.shrink_group, _set_pg_timeout, "
    "and torch.ops.ringlet.all_reduce_ in C++"
)


def _package_dir() -> Path:
    return Path(__file__).resolve().parent


# -- versions and installation ---------------------------------------------------


def _installation() -> dict[str, Any]:
    """How ringlet got here: the wheel's tag from its ``WHEEL`` metadata, or an
    editable / source build (PEP 610's ``direct_url.json``)."""
    out: dict[str, Any] = {"location": str(_package_dir())}
    try:
        dist = metadata.distribution("ringlet")
    except metadata.PackageNotFoundError:
        out.update(
            install="not installed (imported from a source tree)", wheel_tag=None, dist_version=None
        )
        return out
    out["dist_version"] = dist.version
    tags = re.findall(r"^Tag:\s*(\S+)", dist.read_text("WHEEL") or "", re.M)
    direct: dict[str, Any] = {}
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        pass
    source = direct.get("url", "")
    if direct.get("dir_info", {}).get("editable"):
        out.update(install=f"editable/source build ({source})", wheel_tag=None)
    elif "dir_info" in direct:
        out.update(install=f"source build ({source})", wheel_tag=", ".join(tags) or None)
    else:
        out.update(install="wheel", wheel_tag=", ".join(tags) or None)
    return out


def _ringlet_section() -> dict[str, Any]:
    from . import _core

    out: dict[str, Any] = {"version": getattr(_core, "__version__", "unknown")}
    out.update(_installation())
    return out


def _torch_section() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "version": torch.__version__,
        "location": str(Path(torch.__file__).resolve().parent),
        "cuda": torch.version.cuda,
        "distributed": bool(torch.distributed.is_available()),
    }
    try:
        found = metadata.entry_points()
        points = (  # Python 3.9's entry_points() is a dict of groups
            found.select(group="torch.backends")
            if hasattr(found, "select")
            else found.get("torch.backends", [])  # type: ignore[attr-defined]
        )
        out["registers_ringlet_at_import"] = any(p.name == "ringlet" for p in points) and (
            os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "0"
        )
    except Exception:  # an unusual metadata layout: not worth failing the report
        out["registers_ringlet_at_import"] = None
    return out


def _cpu_flags() -> dict[str, bool]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    found = re.search(r"^flags\s*:(.*)$", text, re.M)
    flags = set(found.group(1).split()) if found else set()
    return {f: f in flags for f in ("sse2", "avx2", "f16c", "avx512f")}


def _machine_section() -> dict[str, Any]:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    model = None
    try:
        found = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
        model = found.group(1).strip() if found else None
    except OSError:
        pass
    try:
        load: Optional[list[float]] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "platform": platform.platform(),
        "cpu": model,
        "cpus_usable": cpus,
        "cpus_online": os.cpu_count(),
        "load_average": load,
        "cpu_flags": _cpu_flags(),
    }


# -- the process group ------------------------------------------------------------


def _which_compiler() -> dict[str, Optional[str]]:
    cxx = os.environ.get("CXX", "c++")
    ninja = shutil.which("ninja")
    if ninja is None:
        try:  # the ninja wheel (a dependency of ringlet's) keeps its binary beside itself
            import ninja as ninja_package

            path = Path(ninja_package.BIN_DIR) / "ninja"
            ninja = str(path) if path.is_file() else None
        except Exception:
            ninja = None
    return {"compiler": shutil.which(cxx), "compiler_name": cxx, "ninja": ninja}


def _plain(value: Any) -> Any:
    """A JSON-friendly copy (paths and other objects as strings)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _remembered_failure(native: Any, name: str) -> tuple[Optional[str], Optional[str]]:
    """A failed build the native module remembers for this same environment
    (its ``<name>.failed`` marker, whose digest matches), read without
    touching it: ``(cause, log path)``, or ``(None, None)``. Tolerates a
    ``_native`` that keeps no such record."""
    digest_of = getattr(native, "_env_digest", None)
    environment = getattr(native, "_environment", None)
    if not (callable(digest_of) and callable(environment)):
        return None, None
    marker = native._build_directory(name).parent / f"{name}.failed"
    try:
        record = json.loads(marker.read_text())
        if record.get("digest") != digest_of(environment(name)):
            return None, None  # another environment's: the next use builds again
        return str(record.get("cause")), record.get("log")
    except (OSError, ValueError, AttributeError):
        return None, None


def _native_state(native: Any) -> dict[str, Any]:
    """Where the native library stands, without loading or building it:
    ``_native.status()`` where the installed version has it, and the cache,
    a running background build and a remembered failure, read from files."""
    import time

    state: dict[str, Any] = {"mode": native.mode()}
    status = getattr(native, "status", None)
    if callable(status):
        try:
            got = status()
            state.update(
                {
                    k: _plain(got.get(k))
                    for k in ("library", "torch_tag", "prebuilt_tags", "prebuilt")
                }
            )
        except Exception as e:  # a probe must not break the report
            state["status_error"] = f"{type(e).__name__}: {e}"
    name = state.get("library") or native.library_name()
    directory = native._build_directory(name)
    library = directory / f"{name}.so"
    marker = directory.parent / f"{name}.building"
    try:  # the native module takes a marker older than ten minutes for a dead build
        building = time.time() - marker.stat().st_mtime <= 600
    except OSError:
        building = False
    failure, log = _remembered_failure(native, name)
    state.update(
        library=name,
        cache_path=str(library),
        cached=library.is_file(),
        building=building,
        failed_build=failure,
        build_log=log,
    )
    return state


def _process_group_section() -> dict[str, Any]:
    """Which ProcessGroup ``init_process_group("ringlet")`` gets here, and why,
    decided in the order ``ringlet.distributed._native`` decides it (turned
    off, the wheel's prebuilt library, the cache, a remembered failure, a
    build), without building or loading anything."""
    import torch

    if not torch.distributed.is_available():
        return {"kind": "none", "why": "this torch was built without torch.distributed"}
    try:
        from .distributed import _native

        native = _native_state(_native)
    except Exception as e:  # no sources (a broken install) or an unexpected _native
        why = f"the native Backend's status cannot be read: {type(e).__name__}: {e}"
        return {
            "kind": "python",
            "why": f"{why} (the Python ProcessGroup lacks {_PYTHON_LACKS})",
            "native": {},
        }
    native.update(_which_compiler())
    missing = " and ".join(
        what
        for what, ok in (
            (f"C++ compiler ({native['compiler_name']})", native["compiler"] is not None),
            ("ninja", native["ninja"] is not None),
        )
        if not ok
    )
    build_now = 'python -c "from ringlet.distributed import _native; _native.build()"'
    mode = native["mode"]
    if mode == "0":
        kind, why = "python", "RINGLET_NATIVE=0 turns the native Backend off"
    elif native.get("prebuilt"):
        kind, why = "native", f"the wheel's prebuilt library for {native.get('torch_tag')}"
    elif native["cached"]:
        kind, why = "native", "the library built for this torch is in the cache"
    elif native["failed_build"] and mode != "1":
        kind, why = "python", f"a build failed earlier here: {native['failed_build']}"
    elif mode == "1" and not missing:
        kind, why = (
            "native",
            (
                "RINGLET_NATIVE=1: the first init_process_group builds it in the foreground "
                "(about 30 s); later processes load it from the cache"
            ),
        )
    elif mode == "1":
        kind, why = (
            "none",
            (
                f"RINGLET_NATIVE=1 and no {missing} to build the native "
                "Backend: init_process_group raises"
            ),
        )
    elif native["building"]:
        kind, why = (
            "python",
            (
                "a background build of the native Backend is running; "
                "processes that start after it ends use it"
            ),
        )
    elif not missing:
        tags = native.get("prebuilt_tags")
        prebuilt = (
            f"the wheel's prebuilt library is for {', '.join(tags)}, not this torch; "
            if tags
            else ""
        )
        kind, why = (
            "python",
            (
                f"{prebuilt}the library is not built for this torch yet: the first "
                "init_process_group starts a background build (about 30 s) and later processes "
                f"use it; to have it from the first process, run: {build_now}"
            ),
        )
    else:
        kind, why = "python", f"no prebuilt library for this torch, and no {missing} to build one"
    if kind == "python":
        why += f" (the Python ProcessGroup lacks {_PYTHON_LACKS})"
    return {"kind": kind, "why": why, "native": native}


# -- transports -------------------------------------------------------------------

# The child of the probe: opens the parent's memory file as a peer rank does
# (/proc/<pid>/fd/<fd>, then a shared mapping) and reads the parent's memory
# with process_vm_readv, as the engine's cross-memory attach does. A child is
# not the parent's ancestor, so Yama's ptrace_scope = 1 refuses it as it
# refuses two sibling ranks.
_PROBE = r"""
import ctypes, json, mmap, os, sys
pid, fd, addr = (int(a) for a in sys.argv[1:4])
magic = bytes.fromhex(sys.argv[4])
n = len(magic)
out = {}
try:
    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        m = mmap.mmap(f, 4096)
        out["shm"] = "ok" if m[:n] == magic else "the mapping read back other bytes"
        m.close()
    finally:
        os.close(f)
except OSError as e:
    out["shm"] = f"open /proc/{pid}/fd/{fd}: {e.strerror}"
class Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
try:
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.process_vm_readv
    call.restype = ctypes.c_ssize_t
    call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                     ctypes.c_ulong, ctypes.c_ulong]
    buf = ctypes.create_string_buffer(n)
    local, remote = Iov(ctypes.addressof(buf), n), Iov(addr, n)
    got = call(pid, ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0)
    if got == n and buf.raw == magic:
        out["cma"] = "ok"
    else:
        out["cma"] = "process_vm_readv: " + (os.strerror(ctypes.get_errno()) if got < 0 else
                                             f"read {got} of {n} bytes")
except (OSError, AttributeError) as e:
    out["cma"] = f"process_vm_readv: {e}"
print(json.dumps(out))
"""


def _probe_peer_access() -> dict[str, str]:
    """Runs :data:`_PROBE` against this process: what a peer rank could do."""
    import ctypes
    import mmap

    magic = secrets.token_bytes(16)
    try:
        fd = os.memfd_create("ringlet-info", os.MFD_CLOEXEC)
    except (AttributeError, OSError) as e:
        return {"shm": f"memfd_create: {e}", "cma": "not probed (no memory file)"}
    try:
        os.ftruncate(fd, 4096)
        with mmap.mmap(fd, 4096) as m:
            m[: len(magic)] = magic
        buf = ctypes.create_string_buffer(magic, len(magic))
        try:
            done = subprocess.run(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-c",
                    _PROBE,
                    str(os.getpid()),
                    str(fd),
                    str(ctypes.addressof(buf)),
                    magic.hex(),
                ],
                capture_output=True,
                text=True,
                timeout=20,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"shm": f"the probe process failed: {e}", "cma": "not probed"}
        try:
            return {str(k): str(v) for k, v in json.loads(done.stdout).items()}
        except ValueError:
            err = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return {"shm": f"the probe process failed: {err}", "cma": "not probed"}
    finally:
        os.close(fd)


# Collectives stage through shared memory unless RINGLET_CMA_THRESHOLD is set, but
# ringlet.rpc reads large tensors of a worker on the same host from its memory
# (rust/ringlet-core/src/rpc/agent.rs) without checking that it may.
_RPC_NOTE = (
    "collectives stage through shared memory and do not need it (unless "
    "RINGLET_CMA_THRESHOLD is set), but ringlet.rpc reads tensors of 64 KiB or more "
    "(RINGLET_RPC_SINGLE_COPY_MIN) from a worker on this host with process_vm_readv, "
    "which fails here: set RINGLET_CMA=0 for RPC jobs"
)


def _ptrace_scope() -> Optional[int]:
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


_SCOPES = {
    0: "0 (classic: processes of one user may read each other)",
    1: "1 (restricted: only a process's ancestors may read it, so sibling ranks may not)",
    2: "2 (admin only: reading another process needs CAP_SYS_PTRACE)",
    3: "3 (no process may read another)",
}


def _ipv4_interfaces() -> list[dict[str, Any]]:
    """Every interface with its IPv4 address (``SIOCGIFADDR``) and flags."""
    import fcntl
    import struct

    out = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return out
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), 0x8913, req)[16:18])[0]
            except OSError:
                flags = 0
            try:
                addr: Optional[str] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
            except OSError:  # no IPv4 address
                addr = None
            out.append(
                {"name": name, "ipv4": addr, "up": bool(flags & 0x1), "loopback": bool(flags & 0x8)}
            )
    return out


def _picked_address(interfaces: list[dict[str, Any]]) -> dict[str, Any]:
    """The address ringlet's TCP listener binds (``core.connection.local_ip``)."""
    from .core import connection

    master = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    local_ip = getattr(connection, "local_ip", None)
    address = local_ip(master) if callable(local_ip) else None
    if os.environ.get("RINGLET_ADDR"):
        why = "RINGLET_ADDR"
    elif master in ("localhost", "127.0.0.1", "::1"):
        why = (
            f"MASTER_ADDR is {master}" if os.environ.get("MASTER_ADDR") else "MASTER_ADDR is unset"
        ) + ": a job on this host; set RINGLET_ADDR to choose"
    else:
        why = f"the interface the route to MASTER_ADDR={master} leaves from"
    names = [i["name"] for i in interfaces if i["ipv4"] == address]
    return {"address": address, "interface": names[0] if names else None, "why": why}


def describe_transport(transport: str) -> str:
    """Words for a transport's short name (``ringlet.transport()``'s ``"shm+cma"``,
    ``"shm"``, ``"tcp"``, ``"local"``), as the main job and ``python -m ringlet
    info`` print it. Reads ``RINGLET_CMA``, ``RINGLET_CMA_THRESHOLD`` and
    ``RINGLET_TRANSPORT`` from the environment, where the engine read them.

    Args:
      transport (str): The short name.

    Returns:
      str: For example ``"shared memory (staged copies; cross-memory attach
      available)"``; an unknown name is returned as it is.

    Example:
      >>> describe_transport("shm+cma")
      'shared memory (staged copies; cross-memory attach available)'
    """
    threshold = os.environ.get("RINGLET_CMA_THRESHOLD")
    cma_off = os.environ.get("RINGLET_CMA", "1") in ("0", "false", "False")
    if transport == "shm+cma":
        copies = (
            f"staged copies below {threshold} bytes, single-copy reads from there"
            if threshold
            else "staged copies"
        )
        return f"shared memory ({copies}; cross-memory attach available)"
    if transport == "shm":
        why = "turned off by RINGLET_CMA=0" if cma_off else "not permitted between these processes"
        return f"shared memory (staged copies; cross-memory attach {why})"
    if transport == "tcp":
        forced = os.environ.get("RINGLET_TRANSPORT", "auto").lower() == "tcp"
        return "TCP (forced by RINGLET_TRANSPORT=tcp)" if forced else "TCP"
    if transport == "local":
        return "no transport (a world of one process)"
    return transport


def _transports_section() -> dict[str, Any]:
    probe = _probe_peer_access()
    scope = _ptrace_scope()
    cma_on = os.environ.get("RINGLET_CMA", "1") not in ("0", "false", "False")
    forced_tcp = os.environ.get("RINGLET_TRANSPORT", "auto").lower() == "tcp"
    shm_ok = probe.get("shm") == "ok"
    cma_ok = probe.get("cma") == "ok"
    interfaces = _ipv4_interfaces()
    if forced_tcp:
        same_host = describe_transport("tcp")
    elif not shm_ok:
        same_host = "TCP (shared memory is not available here)"
    else:
        same_host = describe_transport("shm+cma" if cma_ok and cma_on else "shm")
    return {
        "between_ranks_on_this_host": same_host,
        "between_hosts": "TCP",
        "shared_memory": {
            "available": shm_ok,
            "detail": (
                "a memory file (memfd) that another process opens and maps"
                if shm_ok
                else probe.get("shm")
            ),
        },
        "cross_memory_attach": {
            "available": cma_ok,
            "enabled": cma_on,
            "ptrace_scope": scope,
            "detail": (
                "process_vm_readv from another process works" if cma_ok else probe.get("cma")
            ),
            "note": None if cma_ok or not cma_on else _RPC_NOTE,
        },
        "tcp": {"interfaces": interfaces, "listens_on": _picked_address(interfaces)},
    }


# -- SIMD and configuration -------------------------------------------------------


def _simd_section() -> dict[str, str]:
    from . import _core

    kernels = getattr(_core, "simd_kernels", None)
    if not callable(kernels):
        return {"unknown": "this build of ringlet._core predates simd_kernels()"}
    return dict(kernels())


def _known_ringlet_variables() -> set[str]:
    """Every ``RINGLET_*`` name in ringlet's Python sources and its compiled
    engine (whose reads are string constants in the library)."""
    names: set[str] = set()
    pattern = r"RINGLET_[A-Z0-9_]+"
    package = _package_dir()
    for path in package.rglob("*.py"):
        try:
            names.update(re.findall(pattern, path.read_text(errors="replace")))
        except OSError:
            pass
    for path in package.glob("_core*.so"):
        try:
            names.update(n.decode() for n in re.findall(pattern.encode(), path.read_bytes()))
        except OSError:
            pass
    return names


def _configuration_section() -> dict[str, Any]:
    known = _known_ringlet_variables()
    ringlet_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith("RINGLET_")}
    return {
        "ringlet": ringlet_vars,
        "not_read_by_ringlet": sorted(k for k in ringlet_vars if k not in known),
        "other": {k: os.environ[k] for k in _OTHER_VARIABLES if k in os.environ},
    }


# -- the report ---------------------------------------------------------------------


def collect() -> dict[str, Any]:
    """Gathers the report (see the module's description).

    Returns:
      dict: Sections ``ringlet``, ``torch``, ``python``, ``machine``,
      ``process_group``, ``transports``, ``simd`` and ``configuration``, each a
      dict of plain values (``json.dumps`` takes it as it is).

    Example:
      >>> collect()["process_group"]["kind"] in ("native", "python", "none")
      True
    """
    report: dict[str, Any] = {
        "ringlet": _ringlet_section(),
        "torch": _torch_section(),
        "python": {"version": sys.version, "executable": sys.executable},
        "machine": _machine_section(),
        "process_group": _process_group_section(),
        "transports": _transports_section(),
        "simd": _simd_section(),
        "configuration": _configuration_section(),
    }
    return _plain(report)  # type: ignore[no-any-return]


def _yes(value: Any) -> str:
    return {True: "yes", False: "no", None: "unknown"}.get(value, str(value))


def render(report: dict[str, Any]) -> str:
    """The report as text, one ``name: value`` line per fact, by section.

    Args:
      report (dict): What :func:`collect` returned.

    Returns:
      str: The text ``python -m ringlet info`` prints.

    Example:
      >>> print(render(collect()))
    """
    lines: list[str] = []

    def section(title: str, rows: list[tuple[str, Any]]) -> None:
        lines.append(f"--- {title}")
        width = max((len(k) for k, _ in rows), default=0)
        lines.extend(f"{k:<{width}} : {'-' if v is None else v}" for k, v in rows)
        lines.append("")

    r, t, m = report["ringlet"], report["torch"], report["machine"]
    section(
        "versions",
        [
            ("ringlet", r["version"]),
            ("installed as", r["install"]),
            ("wheel tag", r["wheel_tag"] or "none (not installed from a wheel)"),
            ("ringlet location", r["location"]),
            ("torch", t["version"]),
            ("torch location", t["location"]),
            ("torch CUDA", t["cuda"] or "none (CPU build)"),
            ("torch.distributed", _yes(t["distributed"])),
            ("'ringlet' registered at import torch", _yes(t["registers_ringlet_at_import"])),
            ("python", report["python"]["version"].replace("\n", " ")),
            ("python executable", report["python"]["executable"]),
        ],
    )
    flags = ", ".join(f for f, on in m["cpu_flags"].items() if on) or "unknown"
    section(
        "machine",
        [
            ("platform", m["platform"]),
            ("cpu", m["cpu"]),
            ("cpus usable / online", f"{m['cpus_usable']} / {m['cpus_online']}"),
            (
                "load average (1, 5, 15 min)",
                ", ".join(map(str, m["load_average"])) if m["load_average"] else None,
            ),
            ("vector extensions", flags),
        ],
    )
    pg = report["process_group"]
    native = pg.get("native", {})
    rows: list[tuple[str, Any]] = [
        (
            'init_process_group("ringlet") uses',
            {
                "native": "the native C++ Backend (RingletBackend)",
                "python": "the Python ProcessGroup (ProcessGroupRinglet)",
                "none": "no process group (it raises)",
            }.get(pg["kind"], pg["kind"]),
        ),
        ("why", pg["why"]),
    ]
    if native:
        labels = {
            "mode": "RINGLET_NATIVE",
            "library": "native library",
            "torch_tag": "torch tag",
            "prebuilt_tags": "prebuilt for",
            "prebuilt": "prebuilt library",
            "cache_path": "cache path",
            "cached": "built and cached",
            "building": "background build running",
            "failed_build": "failed build remembered",
            "build_log": "build log",
            "compiler": "C++ compiler",
            "ninja": "ninja",
            "status_error": "status() failed",
        }
        for key, label in labels.items():
            if key not in native:
                continue
            value = native[key]
            if key == "compiler" and value is None:
                value = f"not found ({native.get('compiler_name')})"
            elif key == "ninja" and value is None:
                value = "not found"
            elif key == "prebuilt_tags":
                value = ", ".join(value) or "none in this installation"
            elif isinstance(value, bool):
                value = _yes(value)
            rows.append((label, value))
    section("process group", rows)
    tr = report["transports"]
    shm, cma, tcp = tr["shared_memory"], tr["cross_memory_attach"], tr["tcp"]
    scope = cma["ptrace_scope"]
    rows = [
        ("ranks on this host", tr["between_ranks_on_this_host"]),
        ("ranks on other hosts", tr["between_hosts"]),
        ("shared memory", f"{_yes(shm['available'])}: {shm['detail']}"),
        (
            "cross-memory attach",
            f"{_yes(cma['available'])}: {cma['detail']}"
            + ("" if cma["enabled"] else " (turned off by RINGLET_CMA=0)"),
        ),
        (
            "yama ptrace_scope",
            _SCOPES.get(scope, str(scope))
            if scope is not None
            else "no Yama (processes of one user may read each other)",
        ),
    ]
    if cma.get("note"):
        rows.append(("note", cma["note"]))
    for i in tcp["interfaces"]:
        state = ", ".join(x for x, on in (("up", i["up"]), ("loopback", i["loopback"])) if on)
        rows.append(
            (
                f"interface {i['name']}",
                f"{i['ipv4'] or 'no IPv4 address'}" + (f" ({state})" if state else " (down)"),
            )
        )
    pick = tcp["listens_on"]
    rows.append(
        (
            "TCP listener address",
            f"{pick['address']}"
            + (f" on {pick['interface']}" if pick["interface"] else "")
            + f" ({pick['why']})",
        )
    )
    section("transports", rows)
    section("SIMD kernels (selected on this CPU)", sorted(report["simd"].items()))
    c = report["configuration"]
    typo = "  <- ringlet reads no variable of this name: a typo?"
    rows = [
        (k, f"{v}{typo if k in c['not_read_by_ringlet'] else ''}") for k, v in c["ringlet"].items()
    ] or [("RINGLET_*", "none set (defaults)")]
    rows += [(k, f"{v}  ({_OTHER_VARIABLES[k]})") for k, v in c["other"].items()]
    section("configuration (variables set)", rows)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ringlet info [--json]``.

    Args:
      argv (list of str, optional): The arguments after ``info``; default
        ``sys.argv[2:]``-style, read by argparse.

    Returns:
      int: The exit status (0).

    Example:
      >>> main(["--json"])       # prints the report as JSON
      0
    """
    parser = argparse.ArgumentParser(
        prog="python -m ringlet info",
        description="What ringlet finds on this machine and what it will do here "
        "(paste it into bug reports).",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report), end="")
    return 0
