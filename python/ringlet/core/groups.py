"""The job's world: bootstrap (who am I, who are my peers), the world,
replica-group and pair communicators, shutdown and abort.

Under ``torchrun`` :func:`init` needs no arguments: it reads ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` and exchanges listening
addresses through the key-value store torchrun already runs (PyTorch's
``TCPStore``), under a ``ringlet/`` prefix of its own, so ringlet and
``torch.distributed`` can be initialised side by side in one job.

The doors read the world through this module's public names (the old path
``ringlet.runtime`` is this module, deprecated); a door that holds
communicators of the job registers what closes them with :func:`on_shutdown`.

Example:
  >>> from ringlet.core import groups
  >>> groups.init(); groups.world_comm().all_reduce(ptr, nbytes, "float32", "sum")
"""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

from .. import _core
from ..errors import NotInitializedError
from .connection import (
    connect,
    connect_host_level,
    engine_options,
    env_float,
    env_int,
    host_id,
    local_ip,
    new_domain,
    ranks_by_host,
)
from .store import make_store

__all__ = [
    "WorldState",
    "abort",
    "get_local_ordinal",
    "get_ordinal",
    "group_comm",
    "host_layout",
    "init",
    "is_initialized",
    "local_world_size",
    "on_shutdown",
    "pair_comm",
    "peer_transports",
    "require_state",
    "shutdown",
    "transport",
    "validate_groups",
    "world_comm",
    "world_size",
]

_DEFAULT_TIMEOUT = 300.0


@dataclass
class WorldState:
    """This process's place in the job (between :func:`init` and :func:`shutdown`)."""

    rank: int
    world_size: int
    hosts: list[str]
    timeout: float
    comm: _core.Communicator
    store: Any = None
    prefix: str = ""
    addr: str = "127.0.0.1"
    groups: dict[tuple[tuple[int, ...], ...], _core.Communicator] = field(default_factory=dict)
    pairs: dict[int, _core.Communicator] = field(default_factory=dict)
    # Multi-host jobs: the host level the world communicator took over (the
    # ranks of this host over shared memory; see connect_host_level). Kept for its
    # transport and size: the engine runs it inside the world's collectives.
    hier: Optional[_core.Communicator] = None
    # Rank 0 of an explicit init runs the key-value store in its own process.
    hosts_store: bool = False
    # Every communicator of this rank in this job fails together (a failure in
    # one, or abort(), trips all of them; see rust/ringlet-core/src/fault.rs).
    domain: int = 0


_state: Optional[WorldState] = None
_lock = threading.Lock()


def init(
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    timeout: Optional[float] = None,
    store: Any = None,
) -> None:
    """Joins this process to the job's communicator.

    With no arguments, reads torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``). Without any of it, the process is a world
    of one (no network). Calling it again while initialised does nothing.

    Args:
      rank (int, optional): This process's rank. Default: ``$RANK`` or 0.
      world_size (int, optional): Number of processes. Default:
        ``$WORLD_SIZE`` or 1.
      master_addr (str, optional): Host of the key-value store (rank 0 hosts
        it unless torchrun's agent does). Default: ``$MASTER_ADDR`` or
        ``127.0.0.1``.
      master_port (int, optional): Port of the key-value store. Default:
        ``$MASTER_PORT`` or 29500.
      timeout (float, optional): Seconds a rank waits for a peer before
        raising. Default: ``$RINGLET_TIMEOUT`` or 300.
      store (torch.distributed.Store, optional): A key-value store every
        rank shares, used instead of connecting to ``master_addr``
        (``rank`` and ``world_size`` then come from the arguments or the
        environment as usual). Default: None.

    Example:
      >>> import ringlet
      >>> ringlet.init()            # under torchrun
      >>> ringlet.get_ordinal(), ringlet.world_size()
      (0, 2)
    """
    global _state
    with _lock:
        if _state is not None:
            return
        rank = env_int("RANK", 0) if rank is None else int(rank)
        world = env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
        wait = env_float("RINGLET_TIMEOUT", _DEFAULT_TIMEOUT) if timeout is None else timeout
        if world < 1:
            raise ValueError(f"world_size must be at least 1, got {world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is out of range for world_size {world}")
        if not wait > 0:
            raise ValueError(f"timeout must be positive, got {wait}")
        engine_options()  # validate the environment early
        domain = new_domain()
        if world == 1:
            _state = WorldState(
                0, 1, [host_id()], float(wait), _core.Communicator.single(domain), domain=domain
            )
            return
        addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        given = store is not None
        if not given:
            port = int(master_port if master_port is not None else env_int("MASTER_PORT", 29500))
            store = make_store(addr, port, rank, world, float(wait))
        # Every rank of a job counts its arrival in the store; the count tells
        # all of them the same generation, however often each process
        # initialised before (a store may outlive a job).
        arrivals = int(store.add(f"ringlet/arrivals/{world}", 1))
        prefix = f"ringlet/w{world}/g{(arrivals - 1) // world}"
        my_addr = local_ip(addr)
        # On the main thread, before any other group of this job: the
        # waits block on the store (see await_keys)
        comm, hosts = connect(
            store, f"{prefix}/world", rank, world, my_addr, float(wait),
            name=f"the world ({world} ranks)", domain=domain, block=True,
        )
        hier = connect_host_level(store, prefix, rank, hosts, my_addr, float(wait), domain,
                                  block=True)
        if hier is not None:
            comm.attach_levels(hier, ranks_by_host(hosts))
            # The host groups connect through the store in groups that exclude
            # some ranks: no rank may return (and, on rank 0 of an explicit
            # init, take the store down with it) before every rank has
            # connected its own.
            comm.barrier()
        _state = WorldState(
            rank, world, hosts, float(wait), comm, store, prefix, my_addr, hier=hier,
            hosts_store=(rank == 0 and not given
                         and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"),
            domain=domain,
        )


_shutdown_hooks: list[Callable[[], None]] = []


def on_shutdown(hook: Callable[[], None]) -> Callable[[], None]:
    """Registers ``hook`` to run at every :func:`shutdown`, before this
    process's own connections close: a door whose workers or groups own
    communicators of the job closes them there. Registering a hook twice
    runs it once.

    Args:
      hook (Callable[[], None]): Closes what the door holds; must do nothing
        when it holds nothing.

    Returns:
      Callable[[], None]: ``hook`` itself (usable as a decorator).

    Example:
      >>> from ringlet.core import groups
      >>> groups.on_shutdown(close_modules)
    """
    if hook not in _shutdown_hooks:
        _shutdown_hooks.append(hook)
    return hook


def shutdown() -> None:
    """Closes every connection of this process; :func:`init` may be called again.

    Example:
      >>> ringlet.shutdown()
      >>> ringlet.is_initialized()
      False
    """
    global _state
    # The doors' workers and groups own communicators of this job: they close
    # first (hooks the doors registered with on_shutdown, in import order).
    for hook in list(_shutdown_hooks):
        hook()
    with _lock:
        state, _state = _state, None
    if state is None:
        return
    _leave_store(state)
    for comm in [*state.groups.values(), *state.pairs.values()]:
        comm.close()
    state.comm.close()


# Longest the store's host waits at shutdown for the other ranks to leave.
_LEAVE_WAIT_S = 30.0


def _leave_store(state: WorldState) -> None:
    """Counts this rank out of the job's key-value store. Groups and pairs
    connect lazily through the store, so the rank whose process hosts it
    (rank 0 of an explicit init) waits until every rank has counted out
    before it may exit: a rank still connecting a group must not lose the
    store under it. It does not wait when the job has already failed (a lost
    or late peer would never count out), and never longer than
    ``min(timeout, 30 s)``."""
    if state.store is None or state.world_size == 1:
        return
    done = f"{state.prefix}/left/all"
    try:
        if int(state.store.add(f"{state.prefix}/left", 1)) == state.world_size:
            state.store.set(done, "1")
        if state.hosts_store and not state.comm.failed():
            state.store.wait([done], timedelta(seconds=min(state.timeout, _LEAVE_WAIT_S)))
    except Exception:  # the store is gone, or a rank never left: nothing to keep alive for
        pass


def abort() -> None:
    """Gives up on every communicator of this process, as ``ncclCommAbort``.

    A thread blocked in a collective raises within milliseconds (the main
    thread too when this runs in a signal handler); every later collective
    raises :class:`CommunicatorAbortedError`; peers blocked on this rank raise
    :class:`PeerLostError` saying that this rank called ``abort()``. Call
    :func:`shutdown` and :func:`init` to start over. Safe from any thread and
    from signal handlers; does nothing before :func:`init`.

    Example:
      >>> import signal
      >>> signal.signal(signal.SIGTERM, lambda *_: ringlet.abort())
      >>> threading.Timer(60, ringlet.abort).start()   # a watchdog
    """
    state = _state
    if state is not None:
        _core.abort_domain(state.domain, state.rank)


def _exit_shutdown() -> None:
    if _state is not None:
        shutdown()


atexit.register(_exit_shutdown)


def is_initialized() -> bool:
    """Returns whether :func:`init` has run (and :func:`shutdown` has not)."""
    return _state is not None


def _launcher_world() -> int:
    """The world size the launcher announced in ``WORLD_SIZE`` (1 without one)."""
    try:
        return int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return 1


def _not_initialized() -> NotInitializedError:
    world = _launcher_world()
    if world > 1:
        rank = os.environ.get("RANK", "?")
        return NotInitializedError(
            f"rank {rank}: the launcher started {world} ranks (WORLD_SIZE={world}) but "
            "ringlet is not initialized, so this process would compute as a world of "
            "one: call ringlet.init() first (under torchrun it needs no arguments)"
        )
    return NotInitializedError(
        "ringlet is not initialized: call ringlet.init() first "
        "(under torchrun it needs no arguments)"
    )


def require_state() -> WorldState:
    """The world's state; :class:`NotInitializedError` before :func:`init`."""
    state = _state
    if state is None:
        raise _not_initialized()
    return state


def _state_or_solo() -> Optional[WorldState]:
    """The world's state, or None before :func:`init` (after :func:`_solo`'s
    check): what the rank queries answer from."""
    state = _state
    if state is None:
        _solo()
    return state


def _solo() -> None:
    """Before :func:`init`, the rank queries answer for a world of one, which
    is true only without a launcher: under one (``WORLD_SIZE`` > 1) they
    raise :class:`NotInitializedError`, so no collective silently runs on one
    rank while the launcher started several. The one choke point every front
    end passes through (with :func:`require_state`)."""
    if _launcher_world() > 1:
        raise _not_initialized()


def get_ordinal() -> int:
    """Returns this process's global rank (0 when not initialised).

    Raises:
      NotInitializedError: before :func:`init` when a launcher set
        ``WORLD_SIZE`` > 1 (the answer 0 would describe a world of one).

    Example:
      >>> ringlet.get_ordinal()
      0
    """
    state = _state_or_solo()
    return 0 if state is None else state.rank


def world_size() -> int:
    """Returns the number of processes in the job (1 when not initialised).

    Raises:
      NotInitializedError: before :func:`init` when a launcher set
        ``WORLD_SIZE`` > 1: a collective never runs on a world of one while
        the launcher started several ranks.

    Example:
      >>> ringlet.world_size()
      2
    """
    state = _state_or_solo()
    return 1 if state is None else state.world_size


def host_layout() -> list[list[int]]:
    """Returns the global ranks on each host, hosts in order of their lowest rank.

    Returns:
      A list with one list of ranks per host, e.g. ``[[0, 1], [2, 3]]``;
      ``[[0]]`` before :func:`init`.
    """
    state = _state_or_solo()
    return [[0]] if state is None else ranks_by_host(state.hosts)


def get_local_ordinal() -> int:
    """Returns this process's index among the processes on its host.

    Example:
      >>> ringlet.get_local_ordinal()
      0
    """
    state = _state_or_solo()
    if state is None:
        return 0
    return next(g.index(state.rank) for g in host_layout() if state.rank in g)


def local_world_size() -> int:
    """Returns the number of processes on this host."""
    state = _state_or_solo()
    if state is None:
        return 1
    return next(len(g) for g in host_layout() if state.rank in g)


def transport() -> str:
    """Returns how the world communicator is connected: ``"local"`` (one
    process), ``"shm+cma"`` (shared memory with single-copy reads), ``"shm"``
    or ``"tcp"``."""
    return require_state().comm.transport


def peer_transports() -> dict[int, str]:
    """Returns, for every other rank, the transport that carries this rank's
    bytes to it on the fastest path: ``"shm+cma"`` / ``"shm"`` for ranks on
    this host (on multi-host jobs: in the two-level collectives' host level;
    point-to-point messages use TCP to every peer), ``"tcp"`` for ranks on
    other hosts.

    Returns:
      dict[int, str]: peer rank -> transport; empty in a world of one.

    Example:
      >>> ringlet.peer_transports()     # 2 hosts x 2 ranks, on rank 0
      {1: 'shm+cma', 2: 'tcp', 3: 'tcp'}
    """
    state = require_state()
    mine = next(g for g in ranks_by_host(state.hosts) if state.rank in g)
    local = state.hier.transport if state.hier is not None else state.comm.transport
    return {
        r: (local if r in mine else state.comm.transport)
        for r in range(state.world_size)
        if r != state.rank
    }


def world_comm() -> _core.Communicator:
    """The world's communicator; :class:`NotInitializedError` before :func:`init`."""
    return require_state().comm


def group_comm(groups: Optional[list[list[int]]]) -> _core.Communicator:
    """The communicator of this rank's replica group (created once, cached)."""
    state = require_state()
    if not groups:
        return state.comm
    key = validate_groups(groups, state.world_size, state.rank)
    mine = next(g for g in key if state.rank in g)
    if len(mine) == state.world_size and list(mine) == list(range(state.world_size)):
        return state.comm
    with _lock:
        comm = state.groups.get(key)
        if comm is None:
            if len(mine) == 1:
                comm = _core.Communicator.single(state.domain)
            else:
                tag = "/".join(",".join(map(str, g)) for g in key)
                at = f"{state.prefix}/group/{tag}/{key.index(mine)}"
                comm, hosts = connect(
                    state.store, at, mine.index(state.rank), len(mine), state.addr,
                    state.timeout, members=list(mine), name=f"replica group {list(mine)}",
                    domain=state.domain,
                )
                # A replica group spanning hosts runs in two levels too.
                local = connect_host_level(state.store, at, mine.index(state.rank), hosts,
                                           state.addr, state.timeout, state.domain,
                                           members=list(mine))
                if local is not None:
                    comm.attach_levels(local, ranks_by_host(hosts))
            state.groups[key] = comm
    return comm


def pair_comm(peer: int) -> tuple[_core.Communicator, int]:
    """The two-rank communicator shared with ``peer`` (connected by the two
    ranks the first time either needs it; cached) and ``peer``'s rank in it."""
    state = require_state()
    lo, hi = sorted((state.rank, peer))
    with _lock:
        comm = state.pairs.get(peer)
        if comm is None:
            comm, _ = connect(
                state.store,
                f"{state.prefix}/pair/{lo}-{hi}",
                0 if state.rank == lo else 1,
                2,
                state.addr,
                state.timeout,
                members=[lo, hi],
                name=f"the send/recv pair [{lo}, {hi}]",
                domain=state.domain,
            )
            state.pairs[peer] = comm
    return comm, 1 if state.rank == lo else 0


def validate_groups(groups: Any, world: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """``groups`` (replica groups: lists of ranks that cover ``world`` once) as a
    tuple of tuples; ValueError naming what is wrong, from ``rank``'s view."""
    if not isinstance(groups, (list, tuple)) or not all(
        isinstance(g, (list, tuple)) for g in groups
    ):
        raise ValueError(f"rank {rank}: groups must be a list of lists of ranks, got {groups!r}")
    seen: dict[int, int] = {}
    for gi, g in enumerate(groups):
        if len(g) == 0:
            raise ValueError(f"rank {rank}: replica group {gi} is empty")
        for r in g:
            if not isinstance(r, int) or isinstance(r, bool):
                raise ValueError(f"rank {rank}: replica group {gi} holds {r!r}, not a rank")
            if not 0 <= r < world:
                raise ValueError(
                    f"rank {rank}: replica group {gi} names rank {r}, "
                    f"out of range for world size {world}"
                )
            if r in seen:
                raise ValueError(
                    f"rank {rank}: rank {r} appears in replica groups {seen[r]} and {gi}"
                )
            seen[r] = gi
    missing = sorted(set(range(world)) - set(seen))
    if missing:
        raise ValueError(f"rank {rank}: ranks {missing} are in no replica group of {groups!r}")
    return tuple(tuple(g) for g in groups)
