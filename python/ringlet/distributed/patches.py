"""ringlet's patches to torch functions that serve only torch's own backends,
installed by :func:`ringlet.distributed.c10d.register` (:func:`install`):
``torch.distributed.monitored_barrier`` (torch's accepts gloo groups only),
``distributed_c10d._set_pg_timeout`` (torch's sets gloo's and NCCL's only),
``rendezvous._create_c10d_store`` (bounded by the group's timeout for
``init_process_group("ringlet")``) and ``DistributedDataParallel``'s logging
data (whose ``backend_name`` torch takes from its ``ProcessGroup``, which
names every registered backend ``"custom"``; gloo's says ``"gloo"``). Each
passes any other backend's call to torch's own function.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..core.store import open_store
from .process_group import BACKEND_NAME, python_group

_original_monitored_barrier: Optional[Callable[..., Any]] = None
_original_set_pg_timeout: Optional[Callable[..., Any]] = None


def _set_pg_timeout(timeout: timedelta, group: Any = None) -> None:
    """``torch.distributed.distributed_c10d._set_pg_timeout`` for ringlet
    groups (torch's own sets gloo's and NCCL's only and warns for any
    other): the operations issued from now on wait ``timeout`` for a peer."""
    pg = python_group(group)
    if pg is None:
        assert _original_set_pg_timeout is not None
        return _original_set_pg_timeout(timeout, group)
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"Expected timeout argument to be of type datetime.timedelta, got {timeout}"
        )
    torch_group = group if group is not None else dist.distributed_c10d._get_default_group()
    if pg._kind == "native":  # the C++ Backend's own limit too (it tells the Python group)
        torch_group._get_backend(torch.device("cpu"))._set_default_timeout(timeout)
    else:
        pg._set_default_timeout(timeout)
    return None


def _monitored_barrier(
    group: Any = None, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False
) -> Any:
    """``torch.distributed.monitored_barrier`` for ringlet groups (torch's own
    accepts only gloo groups); any other group goes to torch's."""
    pg = python_group(group)
    if pg is not None:
        # torch's own checks and defaults (which gloo's groups get)
        if timeout is None:
            timeout = dist.distributed_c10d.default_pg_timeout
        elif isinstance(timeout, float):
            import warnings

            warnings.warn(
                "Please specify timeout arg as a timedelta. "
                f"Converting current value of {timeout} assuming it represents seconds",
                stacklevel=2,
            )
            timeout = timedelta(seconds=timeout)
        if not isinstance(timeout, timedelta):
            raise TypeError(
                f"Expected timeout argument to be of type datetime.timedelta, got {timeout}"
            )
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
    assert _original_monitored_barrier is not None
    return _original_monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


_original_create_c10d_store: Optional[Callable[..., Any]] = None
_original_ddp_logging_data: Optional[Callable[..., Any]] = None


def _ddp_logging_data(self: Any) -> dict[str, Any]:
    """``DistributedDataParallel._get_ddp_logging_data`` whose
    ``backend_name`` is the group's backend (``dist.get_backend``:
    ``"ringlet"``) on a ringlet group, as gloo's is ``"gloo"``: torch's logger
    reads the name off its C++ ``ProcessGroup``, which says ``"custom"`` for
    any registered backend."""
    assert _original_ddp_logging_data is not None
    data = _original_ddp_logging_data(self)
    group = getattr(self, "process_group", None)
    if data.get("backend_name") == "custom" and python_group(group) is not None:
        data["backend_name"] = dist.get_backend(group)
    return data


def _for_ringlet() -> bool:
    """Whether the ``init_process_group`` call that is making a store asked
    for ringlet (its ``backend`` argument names it): only ringlet's start-up
    is bounded by :func:`_create_c10d_store`, other backends' are torch's."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "init_process_group" and "distributed_c10d" in code.co_filename:
            backend = frame.f_locals.get("backend")
            return isinstance(backend, str) and BACKEND_NAME in backend.lower()
        frame = frame.f_back
    return False


def _create_c10d_store(
    hostname: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: timedelta,
    use_libuv: bool = True,
) -> Any:
    """torch's ``rendezvous._create_c10d_store`` (the store of
    ``init_process_group``'s ``tcp://`` and ``env://`` methods), bounded by
    ``timeout`` when the backend asked for is ringlet: torch's client waits with no limit for
    the first answer of a port held by a program that accepts connections and
    never answers, and a rank that cannot listen on a taken port says what
    holds it (``open_store``). Same store, same error types
    (``DistNetworkError``) as torch's."""
    assert _original_create_c10d_store is not None
    make = functools.partial(
        _original_create_c10d_store, hostname, port, rank, world_size, timeout, use_libuv
    )
    if not _for_ringlet():  # another backend's start-up stays torch's own
        return make()
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else 0.0
    if secs <= 0 or not 0 <= port < 2**16:  # torch's own answer (no limit, bad port)
        return make()
    return open_store(make, hostname, port, rank, rank == 0 and not agent, secs)


def install() -> None:
    """Puts ringlet's versions of ``monitored_barrier``, ``_set_pg_timeout``,
    ``_create_c10d_store`` and DDP's ``_get_ddp_logging_data`` in torch's
    place (once; calling it again does nothing). Each passes any other
    backend's call to torch's own.

    Example:
      >>> from ringlet.distributed import patches
      >>> patches.install()
    """
    global _original_monitored_barrier, _original_set_pg_timeout, _original_create_c10d_store
    global _original_ddp_logging_data
    if _original_monitored_barrier is None:
        _original_monitored_barrier = dist.monitored_barrier
        dist.monitored_barrier = _monitored_barrier
        dist.distributed_c10d.monitored_barrier = _monitored_barrier
    if _original_set_pg_timeout is None:
        _original_set_pg_timeout = dist.distributed_c10d._set_pg_timeout
        dist.distributed_c10d._set_pg_timeout = _set_pg_timeout
    if _original_create_c10d_store is None:
        rdzv = importlib.import_module("torch.distributed.rendezvous")
        _original_create_c10d_store = rdzv._create_c10d_store
        rdzv._create_c10d_store = _create_c10d_store
    if _original_ddp_logging_data is None:
        ddp = torch.nn.parallel.DistributedDataParallel
        _original_ddp_logging_data = ddp._get_ddp_logging_data
        ddp._get_ddp_logging_data = _ddp_logging_data
