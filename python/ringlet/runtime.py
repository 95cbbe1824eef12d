"""Process-group bootstrap: who am I, who are my peers, how are we connected.

Under ``torchrun`` :func:`init` needs no arguments: it reads ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` and exchanges listening
addresses through the key-value store torchrun already runs (PyTorch's
``TCPStore``), under a ``ringlet/`` prefix of its own, so ringlet and
``torch.distributed`` can be initialised side by side in one job.
"""

from __future__ import annotations

import atexit
import math
import os
import secrets
import socket
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

from . import _core
from .core import store as _store
from .errors import NotInitializedError

# The rendezvous (ringlet.core.store), by the names runtime gave its functions.
_accepts = _store.accepts
_await = _store.await_keys
_cores = _store.cores
_exchange = _store.exchange
_get_all = _store.get_all
_make_store = _store.make_store
_open_store = _store.open_store
_pack = _store.pack
_poll_floor = _store.poll_floor
_port_holder = _store.port_holder
_store_address = _store.store_address
_timed_out = _store.timed_out

__all__ = [
    "abort",
    "get_local_ordinal",
    "get_ordinal",
    "host_layout",
    "init",
    "is_initialized",
    "local_world_size",
    "peer_transports",
    "shutdown",
    "transport",
    "world_size",
]

_DEFAULT_TIMEOUT = 300.0


@dataclass
class _State:
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
    # ranks of this host over shared memory; see _hierarchy). Kept for its
    # transport and size: the engine runs it inside the world's collectives.
    hier: Optional[_core.Communicator] = None
    # Rank 0 of an explicit init runs the key-value store in its own process.
    hosts_store: bool = False
    # Every communicator of this rank in this job fails together (a failure in
    # one, or abort(), trips all of them; see rust/ringlet-core/src/fault.rs).
    domain: int = 0


_state: Optional[_State] = None
_lock = threading.Lock()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None


# A waiting rank spins this many times, then on for up to _LONG_SPIN_US µs in
# all for a peer inside the operation, and for up to _SPIN_US µs for one that
# may not have entered it yet while other tasks want the CPUs, before it parks
# on a futex the writer wakes; that when every rank of the host has a core of
# its own. With more ranks than cores on a host a spinning rank takes the core
# a peer it waits for needs, so it spins briefly and parks. It never yields by
# default: a yield hands a busy neighbour (another job, data-loader workers,
# the caller's own threads) the core for its whole scheduler slice
# (docs/design.md, "Waiting on busy cores").
_SPINS_DEDICATED = 2000
_SPINS_SHARED = 30
_SPIN_US = 50
_LONG_SPIN_US = 2000



def _engine_options(local_ranks: int = 1, crowded: bool = False) -> dict[str, Any]:
    """Engine settings from the environment; ``local_ranks`` (the group's
    ranks on this host) picks the default spin budgets, ``crowded`` (more of
    the job's ranks on this machine than it has CPUs, with network traffic
    between them: hosts simulated on one machine) makes a waiting rank park
    after a short spin, since a spinning rank would keep the CPU from the
    ranks and the network stack it waits for."""
    dedicated = local_ranks <= _cores() and not crowded
    mode = os.environ.get("RINGLET_TRANSPORT", "auto").lower()
    if mode not in ("auto", "tcp", "shm"):
        raise ValueError(f"RINGLET_TRANSPORT={mode!r}: expected 'auto', 'shm' or 'tcp'")
    return {
        "force_tcp": mode == "tcp",
        "slot_bytes": _env_int("RINGLET_SHM_SLOT_BYTES", 1 << 20),
        "cma": os.environ.get("RINGLET_CMA", "1") not in ("0", "false", "False"),
        # Unset: collectives never read peers' memory directly (the staged
        # path is faster here at every size; see DEFAULT_CMA_THRESHOLD in group.rs).
        "cma_threshold": _env_int("RINGLET_CMA_THRESHOLD", (1 << 64) - 1),
        "small_bytes": _env_int("RINGLET_SMALL_BYTES", 2 << 10),
        "spins": _env_int("RINGLET_SPIN", _SPINS_DEDICATED if dedicated else _SPINS_SHARED),
        "spin_us": _env_int("RINGLET_SPIN_US", _SPIN_US if dedicated else 0),
        "long_spin_us": _env_int("RINGLET_LONG_SPIN_US", _LONG_SPIN_US if dedicated else 0),
        "yield_us": _env_int("RINGLET_YIELD_US", 0),
    }


class _HostTable(list):  # type: ignore[type-arg]
    """Each group rank's host identity (a ``list[str]``), and how many of the
    group's ranks run on this machine (``machine_ranks``: hosts simulated
    with ``RINGLET_HOST_ID`` may share one)."""

    machine_ranks: int = 1


def _host_id() -> str:
    return os.environ.get("RINGLET_HOST_ID") or _core.host_identity()


def _local_ip(master_addr: str) -> str:
    explicit = os.environ.get("RINGLET_ADDR")
    if explicit:
        return explicit
    if master_addr in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))  # no packet is sent for UDP connect
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"




# The process's listening sockets, by bind address: one for all its groups.
_listeners: dict[str, Any] = {}
_listeners_lock = threading.Lock()  # _connect may run under _lock


def _listener(bind: str) -> Any:
    """The listening socket of this process on ``bind``, made on first use
    and shared by every group it connects: each connection's hello names its
    group by the group's token, and the core hands it to that group whichever
    group accepted it (the lobby in rust/ringlet-core/src/transport/tcp). One
    socket a process instead of one a group."""
    with _listeners_lock:
        listener = _listeners.get(bind)
        if listener is None:
            listener = _listeners[bind] = _core.Listener(f"{bind}:0")
        return listener


def _connect(
    store: Any,
    key: str,
    group_rank: int,
    group_size: int,
    addr: str,
    timeout: float,
    members: Optional[list[int]] = None,
    name: str = "",
    domain: int = 0,
    crowded: Optional[bool] = None,
    block: bool = False,
) -> tuple[_core.Communicator, _HostTable]:
    """Exchanges listening addresses under ``key`` and connects a group.
    ``members`` (global ranks, by group rank) name peers in errors, ``name``
    names the group, and communicators with the same ``domain`` fail
    together. ``crowded`` (see _engine_options) defaults to: the group spans
    hosts and runs more ranks on this machine than it has CPUs. ``block``:
    see ``_await``."""
    host = _host_id()
    machine = _core.host_identity()
    bind = "127.0.0.1" if addr.startswith("127.") else "0.0.0.0"
    listener = _listener(bind)
    me = {"addr": f"{addr}:{listener.port}", "host": host, "machine": machine}
    peers, token = _exchange(store, key, group_rank, group_size, me, timeout, members, block)
    hosts = _HostTable(p["host"] for p in peers)
    hosts.machine_ranks = sum(1 for p in peers if p.get("machine") == machine)
    if crowded is None:
        crowded = hosts.machine_ranks > _cores() and len(set(hosts)) > 1
    comm = _core.Communicator.connect(
        listener,
        group_rank,
        [p["addr"] for p in peers],
        [p["host"] for p in peers],
        token,
        timeout,
        members=list(members) if members is not None else list(range(group_size)),
        name=name or f"a group of {group_size} ranks",
        domain=domain,
        **_engine_options(sum(1 for p in peers if p["host"] == host), crowded),
    )
    return comm, hosts


def _connect_members(
    store: Any, key: str, members: list[int], me: int, addr: str, timeout: float,
    name: str, domain: int, levels: bool = True, crowded: Optional[bool] = None,
) -> tuple[_core.Communicator, _HostTable]:
    """Connects the global ranks ``members`` (``me`` among them) under
    ``key``; with ``levels``, a group spanning hosts with several ranks on
    some host runs its collectives in two levels. A one-rank group needs no
    network."""
    if len(members) == 1:
        hosts = _HostTable([_host_id()])
        return _core.Communicator.single(domain), hosts
    i = members.index(me)
    comm, hosts = _connect(store, key, i, len(members), addr, timeout, members=list(members),
                           name=name, domain=domain, crowded=crowded)
    if levels:
        local = _hierarchy(store, key, i, hosts, addr, timeout, domain, members=list(members))
        if local is not None:
            comm.attach_levels(local, _layout(hosts))
    return comm, hosts


def _bagua_levels(
    store: Any, key: str, members: list[int], me: int, hosts: list[str], addr: str,
    timeout: float, name: str, domain: int,
) -> tuple[_core.Communicator, Optional[_core.Communicator], int,
           Optional[_core.Communicator]]:
    """Bagua's two levels over ``members`` (global ranks, ``hosts[i]`` the
    host of ``members[i]``): the members on this rank's host, and the first
    member of each host (``None`` on other ranks); the number of hosts; and,
    when every host holds the same number of members, the *channel* of the
    members at this rank's position on every host (the first members'
    channel is the second level itself), else ``None``. Collective over the
    members."""
    by_host: dict[str, list[int]] = {}
    for r, h in zip(members, hosts):
        by_host.setdefault(h, []).append(r)
    groups = list(by_host.values())
    leaders = [g[0] for g in groups]
    local = by_host[hosts[members.index(me)]]
    host = leaders.index(local[0])
    # A host's other ranks wait in the host level while its first rank talks
    # across hosts: on a machine with more of the job's ranks than CPUs they
    # park at once instead of yielding in a loop.
    crowded = getattr(hosts, "machine_ranks", 0) > _cores()
    intra, _ = _connect_members(store, f"{key}/intra{host}", local, me, addr, timeout,
                                f"host {host} of {name}", domain, levels=False,
                                crowded=crowded)
    inter = None
    if me == local[0]:
        inter, _ = _connect_members(store, f"{key}/inter", leaders, me, addr, timeout,
                                    f"the hosts' first ranks of {name}", domain, levels=False)
    channel = None
    even = len({len(g) for g in groups}) == 1
    if even and len(groups) > 1 and len(local) > 1:
        i = local.index(me)
        if i == 0:
            channel = inter
        else:
            channel, _ = _connect_members(
                store, f"{key}/chan{i}", [g[i] for g in groups], me, addr, timeout,
                f"the hosts' rank {i} of {name}", domain, levels=False)
    return intra, inter, len(leaders), channel


def _new_domain() -> int:
    return secrets.randbits(63) | 1


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
        rank = _env_int("RANK", 0) if rank is None else int(rank)
        world = _env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
        wait = _env_float("RINGLET_TIMEOUT", _DEFAULT_TIMEOUT) if timeout is None else timeout
        if world < 1:
            raise ValueError(f"world_size must be at least 1, got {world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is out of range for world_size {world}")
        if not wait > 0:
            raise ValueError(f"timeout must be positive, got {wait}")
        _engine_options()  # validate the environment early
        domain = _new_domain()
        if world == 1:
            _state = _State(
                0, 1, [_host_id()], float(wait), _core.Communicator.single(domain), domain=domain
            )
            return
        addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        given = store is not None
        if not given:
            port = int(master_port if master_port is not None else _env_int("MASTER_PORT", 29500))
            store = _make_store(addr, port, rank, world, float(wait))
        # Every rank of a job counts its arrival in the store; the count tells
        # all of them the same generation, however often each process
        # initialised before (a store may outlive a job).
        arrivals = int(store.add(f"ringlet/arrivals/{world}", 1))
        prefix = f"ringlet/w{world}/g{(arrivals - 1) // world}"
        my_addr = _local_ip(addr)
        # On the main thread, before any other group of this job: the
        # waits block on the store (see _await)
        comm, hosts = _connect(
            store, f"{prefix}/world", rank, world, my_addr, float(wait),
            name=f"the world ({world} ranks)", domain=domain, block=True,
        )
        hier = _hierarchy(store, prefix, rank, hosts, my_addr, float(wait), domain, block=True)
        if hier is not None:
            comm.attach_levels(hier, _layout(hosts))
            # The host groups connect through the store in groups that exclude
            # some ranks: no rank may return (and, on rank 0 of an explicit
            # init, take the store down with it) before every rank has
            # connected its own.
            comm.barrier()
        _state = _State(
            rank, world, hosts, float(wait), comm, store, prefix, my_addr, hier=hier,
            hosts_store=(rank == 0 and not given
                         and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"),
            domain=domain,
        )


def _layout(hosts: list[str]) -> list[list[int]]:
    order: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        order.setdefault(h, []).append(r)
    return list(order.values())


def _hierarchy(
    store: Any, prefix: str, rank: int, hosts: list[str], addr: str, timeout: float,
    domain: int = 0, members: Optional[list[int]] = None, block: bool = False,
) -> Optional[_core.Communicator]:
    """For a group spanning several hosts with more than one rank on some
    host, connects the ranks of this rank's host (shared memory); the caller
    hands it to the group's communicator (``attach_levels``), whose
    collectives then run in two levels inside the engine: each byte crosses
    a host's link once per host instead of once per rank, all of a host's
    ranks carry their share, and the shared-memory steps overlap the network
    (see rust/ringlet-core/src/hierarchy). Hosts may hold different numbers
    of ranks. Every rank takes the same decision from the same host table.
    ``members`` maps group ranks to the global ranks errors name.
    ``RINGLET_HIERARCHY=0`` turns it off (flat TCP between all ranks).
    ``block``: see ``_await``."""
    if os.environ.get("RINGLET_HIERARCHY", "1") in ("0", "false", "False"):
        return None
    if os.environ.get("RINGLET_TRANSPORT", "auto").lower() == "tcp":
        return None
    layout = _layout(hosts)
    channels = 1
    for g in layout:
        channels = channels * len(g) // math.gcd(channels, len(g))
    if len(layout) < 2 or all(len(g) == 1 for g in layout) or channels > _MAX_CHANNELS:
        return None
    h = next(i for i, g in enumerate(layout) if rank in g)
    i = layout[h].index(rank)
    glob = members if members is not None else list(range(len(hosts)))
    # Hosts simulated on one machine with more ranks than CPUs: the host
    # level parks its waits (the network stack needs the CPUs too).
    crowded = getattr(hosts, "machine_ranks", 0) > _cores()
    local, _ = _connect(
        store, f"{prefix}/hier/local/{h}", i, len(layout[h]), addr, timeout,
        members=[glob[r] for r in layout[h]],
        name=f"the ranks of host {h} {[glob[r] for r in layout[h]]}", domain=domain,
        crowded=crowded, block=block,
    )
    return local


# Hosts whose rank counts have a least common multiple above this stay flat
# (the engine cuts cross-host buffers into that many channels).
_MAX_CHANNELS = 1024


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
      >>> from ringlet import runtime
      >>> runtime.on_shutdown(close_modules)
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


def _leave_store(state: _State) -> None:
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


def _require() -> _State:
    state = _state
    if state is None:
        raise _not_initialized()
    return state


def _solo() -> None:
    """Before :func:`init`, the rank queries answer for a world of one, which
    is true only without a launcher: under one (``WORLD_SIZE`` > 1) they
    raise :class:`NotInitializedError`, so no collective silently runs on one
    rank while the launcher started several. The one choke point every front
    end passes through (with :func:`_require`)."""
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
    state = _state
    if state is None:
        _solo()
        return 0
    return state.rank


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
    state = _state
    if state is None:
        _solo()
        return 1
    return state.world_size


def host_layout() -> list[list[int]]:
    """Returns the global ranks on each host, hosts in order of their lowest rank.

    Returns:
      A list with one list of ranks per host, e.g. ``[[0, 1], [2, 3]]``;
      ``[[0]]`` before :func:`init`.
    """
    state = _state
    if state is None:
        _solo()
        return [[0]]
    return _layout(state.hosts)


def get_local_ordinal() -> int:
    """Returns this process's index among the processes on its host.

    Example:
      >>> ringlet.get_local_ordinal()
      0
    """
    if _state is None:
        _solo()
        return 0
    return next(g.index(_state.rank) for g in host_layout() if _state.rank in g)


def local_world_size() -> int:
    """Returns the number of processes on this host."""
    if _state is None:
        _solo()
        return 1
    return next(len(g) for g in host_layout() if _state.rank in g)


def transport() -> str:
    """Returns how the world communicator is connected: ``"local"`` (one
    process), ``"shm+cma"`` (shared memory with single-copy reads), ``"shm"``
    or ``"tcp"``."""
    return _require().comm.transport


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
    state = _require()
    mine = next(g for g in _layout(state.hosts) if state.rank in g)
    local = state.hier.transport if state.hier is not None else state.comm.transport
    return {
        r: (local if r in mine else state.comm.transport)
        for r in range(state.world_size)
        if r != state.rank
    }


def _world() -> _core.Communicator:
    return _require().comm


def _group(groups: Optional[list[list[int]]]) -> _core.Communicator:
    """The communicator of this rank's replica group (created once, cached)."""
    state = _require()
    if not groups:
        return state.comm
    key = _validate_groups(groups, state.world_size, state.rank)
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
                comm, hosts = _connect(
                    state.store, at, mine.index(state.rank), len(mine), state.addr,
                    state.timeout, members=list(mine), name=f"replica group {list(mine)}",
                    domain=state.domain,
                )
                # A replica group spanning hosts runs in two levels too.
                local = _hierarchy(state.store, at, mine.index(state.rank), hosts, state.addr,
                                   state.timeout, state.domain, members=list(mine))
                if local is not None:
                    comm.attach_levels(local, _layout(hosts))
            state.groups[key] = comm
    return comm


def _pair(peer: int) -> tuple[_core.Communicator, int]:
    """The two-rank communicator shared with ``peer`` (connected by the two
    ranks the first time either needs it; cached) and ``peer``'s rank in it."""
    state = _require()
    lo, hi = sorted((state.rank, peer))
    with _lock:
        comm = state.pairs.get(peer)
        if comm is None:
            comm, _ = _connect(
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


def _validate_groups(groups: Any, world: int, rank: int) -> tuple[tuple[int, ...], ...]:
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
