"""ringlet as a ``torch.distributed`` backend: ``init_process_group("ringlet")``.

Importing ringlet registers the backend ``"ringlet"`` for CPU tensors (and the
package's ``torch.backends`` entry point registers it when torch is imported,
so ``pip install ringlet`` alone is enough). torch's own collectives, DDP,
FSDP2, DTensor, tensor parallelism, functional collectives and
``torch.distributed.checkpoint`` then run on ringlet's engine.

Each process group connects its own communicator through the store that
``init_process_group`` / ``new_group`` hands it (no second rendezvous), the
first time it is used, by its members only. Operations run in issue order on
the group's progress thread (``ringlet._core.Progress``, in the Rust core);
``Work.wait()`` blocks with the GIL released, and a caller that waits for an
operation nobody has started yet runs it itself, so a synchronous call costs
no thread switch. Point-to-point messages run on a queue per direction and
peer, so sends and receives in any order between any ranks never deadlock.

Example:
  >>> import torch, torch.distributed as dist, ringlet
  >>> dist.init_process_group("ringlet")          # under torchrun
  >>> t = torch.ones(4) * (dist.get_rank() + 1)
  >>> dist.all_reduce(t)                            # 1 + 2 on 2 ranks
  >>> t
  tensor([3., 3., 3., 3.])

This module registers the backend (:func:`register`, :func:`_create`), answers
the native C++ Backend's calls (:func:`native_error`, :func:`backend_of`) and
fixes torch's sharded tensors for ringlet's groups; the rest lives by job, and
its names are importable from here too: the process group in
:mod:`ringlet.distributed.process_group` (its collectives in ``_pg_collectives``,
its point-to-point messages in ``_pg_p2p``), :class:`Work` in
:mod:`ringlet.distributed.work`, the patches to torch's functions in
:mod:`ringlet.distributed.patches`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.util
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import _core
from . import _native, patches
from .process_group import BACKEND_NAME, ProcessGroupRinglet, _live, backend_kind, python_group
from .work import Work, _DistErrors
from .work import runtime_rank as runtime_rank  # re-exported (a name this module had)

__all__ = ["BACKEND_NAME", "ProcessGroupRinglet", "Work", "backend_kind", "python_group",
           "register"]


_SHARDED = "torch.distributed._shard.sharded_tensor"
_sharded_device_done = False
_sharded_hook: Optional[_AfterImport] = None


def _sharded_tensors_on_cpu() -> None:
    """A ``ShardedTensor`` with no local shard names the CPU as its device
    when its group is ringlet's, as torch's own op does for gloo's groups (it
    asks CUDA for any other backend's: DCP's load of an FSDP1 sharded state
    dict failed on a rank holding no part of a small parameter)."""
    global _sharded_device_done
    if _sharded_device_done:
        return
    _sharded_device_done = True
    try:
        from torch.distributed._shard.sharded_tensor import _ops  # noqa: F401  (fills the table)
        from torch.distributed._shard.sharded_tensor.api import _SHARDED_OPS
    except ImportError:  # torch without the (deprecated) sharded tensors
        return
    key = torch.Tensor.device.__get__  # type: ignore[attr-defined]
    torch_op = _SHARDED_OPS.get(key)
    if torch_op is None:
        return

    def device(types: Any, args: Any = (), kwargs: Any = None, pg: Any = None) -> Any:
        st = args[0] if args else None
        if not getattr(st, "_local_shards", True) and python_group(pg) is not None:
            return torch.device("cpu")
        return torch_op(types, args, kwargs, pg)

    _SHARDED_OPS[key] = device


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_sharded_tensors_on_cpu` right after torch's sharded
    tensors are imported: importing them costs a process about 15 ms at
    start-up (on every rank, before its first collective), and only a job
    that uses them (FSDP1, DCP) needs the fix."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        global _sharded_hook
        if name != _SHARDED:
            return None
        with contextlib.suppress(ValueError):  # once: the real finders from here on
            sys.meta_path.remove(self)
        _sharded_hook = None
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _sharded_tensors_on_cpu()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _sharded_tensors_on_cpu_when_used() -> None:
    """The fix now if torch's sharded tensors are loaded, else once they are."""
    global _sharded_hook
    if _sharded_device_done or _sharded_hook is not None:
        return
    if _SHARDED in sys.modules:
        _sharded_tensors_on_cpu()
        return
    _sharded_hook = _AfterImport()
    sys.meta_path.insert(0, _sharded_hook)


def _create(opts: Any, pg_options: Any = None) -> ProcessGroupRinglet:
    _sharded_tensors_on_cpu_when_used()
    pg = ProcessGroupRinglet(
        opts.store, opts.group_rank, opts.group_size, opts.timeout,
        list(opts.global_ranks_in_group) or None,
    )
    if not dist.is_initialized():
        # The job's default group, made inside init_process_group, where
        # every rank waits for the others anyway (gloo connects its mesh
        # there): it meets its peers now, on the main thread, before any
        # other group of this process exists, so its waits on the store can
        # block instead of polling (core.store.await_keys). The streams still open
        # on demand. A later group connects on first use, polling: a
        # blocking wait there could stall another group's thread that a
        # peer needs.
        try:
            pg._world(block=True)
        except BaseException:
            pg.abort()
            raise
    # The native C++ Backend around the Python group when it builds, else
    # the Python group itself (see ringlet.distributed._native).
    return _native.wrap(pg)


def register() -> None:
    """Registers the backend ``"ringlet"`` with ``torch.distributed`` for CPU
    tensors (done by ``import ringlet`` and by the package's entry point;
    calling it again does nothing). It also bounds the wait for the store of
    ``init_process_group("ringlet")``'s ``tcp://`` and ``env://`` methods by the
    group's timeout (``patches._create_c10d_store``; other backends' start-up is left
    as torch has it).

    Example:
      >>> import ringlet.distributed.c10d
      >>> ringlet.distributed.c10d.register()
      >>> dist.init_process_group("ringlet")      # or "cpu:ringlet"
    """
    if not dist.is_available():
        return
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
    patches.install()


def _close_all() -> None:
    for pg in list(_live):
        try:
            pg.shutdown()
        except Exception:
            pass


atexit.register(_close_all)


# -- the native Backend's calls (csrc/backend.cpp imports this module for them) --


def native_error(err: int) -> BaseException:
    """The exception the Python group would raise for an engine error the
    C ABI returned to the C++ Backend (called by it; ``err`` is taken)."""
    return _DistErrors.convert(_core.native_error(err))


def backend_of(name: str) -> Any:
    """The native Backend of the c10d group named ``name`` ("" for the
    default group), for ``torch.ops.ringlet.all_reduce_`` (called by it).

    Raises:
      ValueError: No such group, or its CPU backend is not ringlet's native one.
    """
    where = f"group {name!r}" if name else "the default process group"
    try:
        if not name:
            pg = dist.distributed_c10d._get_default_group()
        else:
            pg = dist.distributed_c10d._resolve_process_group(name)
        backend = pg._get_backend(torch.device("cpu"))
    except Exception as e:
        raise ValueError(f"torch.ops.ringlet.all_reduce_: {where}: {e}") from None
    native = _native.backend_class()
    if native is None or not isinstance(backend, native):
        raise ValueError(
            f"torch.ops.ringlet.all_reduce_: the CPU backend of {where} is not ringlet's native "
            f"Backend ({backend_kind(pg) or type(backend).__name__}); use "
            "init_process_group('ringlet') with the native backend available"
        )
    return backend
