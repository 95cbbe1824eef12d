"""Process-group bootstrap: who am I, who are my peers, how are we connected.

Under ``torchrun`` :func:`init` needs no arguments: it reads ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` and exchanges listening
addresses through the key-value store torchrun already runs (PyTorch's
``TCPStore``), under a ``ringlet/`` prefix of its own, so ringlet and
``torch.distributed`` can be initialised side by side in one job.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import secrets
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

from . import _core
from .errors import CollectiveTimeoutError, NotInitializedError

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


def _cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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


def _make_store(addr: str, port: int, rank: int, world: int, timeout: float) -> Any:
    from torch.distributed import TCPStore

    td = timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent hosts the store; every worker is a client.
        return _open_store(
            lambda: TCPStore(addr, port, None, False, td, wait_for_workers=False),
            addr,
            port,
            rank,
            False,
            timeout,
        )
    return _open_store(
        lambda: TCPStore(
            addr, port, world, rank == 0, td, wait_for_workers=False, multi_tenant=True
        ),
        addr,
        port,
        rank,
        rank == 0,
        timeout,
    )


def _open_store(
    make: Callable[[], Any], addr: str, port: int, rank: int, hosts: bool, timeout: float
) -> Any:
    """``make()`` (a torch ``TCPStore`` at ``addr:port``, hosted by this
    process when ``hosts``), which returns or raises within ``timeout`` s
    with an error naming the address and the likely cause.

    torch's client waits for the server's answer to its first request with
    no limit: a port held by a program that accepts connections and never
    answers (or whose queue takes them and nobody accepts) kept a rank
    waiting until it was killed, whatever the timeout, and gloo's
    ``init_process_group`` waits the same way; and while nothing listens it
    retries for up to twice the timeout. So a client first waits, on its own
    socket, until something accepts a connection at the address, then makes
    torch's client on a thread of its own, and gives up at the deadline (the
    thread ends when that program closes the connection, or with the
    process; a thread still retrying torch's connect when the process exits
    could abort it).
    Errors are torch's ``DistNetworkError``, as torch raises when no store
    answers (a connection refused until the timeout) or when the server
    cannot listen."""
    if hosts:
        try:
            return make()
        except RuntimeError as e:
            text = str(e)
            if "EADDRINUSE" not in text and "address already in use" not in text.lower():
                raise
            holder = _port_holder(addr, port, min(1.0, timeout / 2))
            raise type(e)(
                f"rank {rank}: could not listen on port {port} to host the store: "
                f"address in use: {holder}; pick another MASTER_PORT (or master_port=, "
                f"init_method=) for this job, or end that program ({text.splitlines()[0]})"
            ) from None
    from torch.distributed import DistNetworkError

    deadline = time.monotonic() + timeout
    if not _await_listener(addr, port, deadline):
        raise DistNetworkError(
            f"rank {rank}: Timed out after {timeout:g}s waiting for the store at "
            f"{addr}:{port}: nothing accepts connections there: rank 0, which hosts the "
            "store, has not started, exited, or could not listen on that port (see its "
            "error); check MASTER_ADDR and MASTER_PORT"
        )
    # Something listens: torch's client now either gets its answer or waits
    # for good, so it runs on a thread the deadline does not wait for.
    done = threading.Event()
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, make()))
        except BaseException as e:  # handed to the caller below
            box.append((False, e))
        finally:
            done.set()

    threading.Thread(target=run, name="ringlet-store-connect", daemon=True).start()
    if done.wait(max(deadline - time.monotonic(), 0.0)):
        ok, got = box[0]
        if ok:
            return got
        raise got
    raise DistNetworkError(
        f"rank {rank}: Timed out after {timeout:g}s waiting for the store at {addr}:{port}: "
        "it accepts connections but does not answer as a torch store: another program "
        "holds the port (pick another MASTER_PORT for this job), or the store's host is "
        "too busy to answer"
    )


def _await_listener(addr: str, port: int, deadline: float) -> bool:
    """Whether something accepts a TCP connection at ``addr:port`` before
    ``deadline`` (a ``time.monotonic`` value), trying again as torch's
    client does while nothing listens (rank 0 may start later). An address
    that does not resolve counts as listening: torch's client names it."""
    pause = 0.01
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((addr, port), timeout=min(left, 1.0)):
                return True
        except socket.gaierror:
            return True
        except OSError:
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(2 * pause, 0.2)


def _accepts(addr: str, port: int, timeout: float) -> bool:
    """Whether something accepts TCP connections at ``addr:port``."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False


def _port_holder(addr: str, port: int, timeout: float) -> str:
    """What holds ``port`` at ``addr``, in words, found within about
    2 x ``timeout`` s: another job's torch store (it answers a store client),
    a program that accepts connections and does not answer as one, or one
    that has the port without accepting connections at ``addr``."""
    if not _accepts(addr, port, timeout):
        return f"another program has port {port} but does not accept connections at {addr}:{port}"
    from torch.distributed import TCPStore

    done = threading.Event()

    def probe() -> None:
        try:
            TCPStore(addr, port, None, False, timedelta(seconds=timeout), wait_for_workers=False)
            done.set()
        except BaseException:  # not a store: told by the unset event
            pass

    threading.Thread(target=probe, name="ringlet-port-probe", daemon=True).start()
    if done.wait(timeout):
        return (
            f"a torch store (TCPStore) already answers at {addr}:{port}, probably "
            "another job's (its other ranks would join that job's store)"
        )
    return (
        f"a program that accepts connections at {addr}:{port} but does not answer "
        "as a torch store holds it"
    )


def _timed_out(mine: int, who: int, timeout: float, key: str, why: str) -> CollectiveTimeoutError:
    # " Timed out " as torch's backends say it (its tests and log scrapers
    # look for it), then ringlet's rank and culprit.
    err = CollectiveTimeoutError(
        f"rank {mine}: Timed out waiting for rank {who}: rank {who} did not join "
        f"within {timeout:g}s (connecting {key!r}): {why}"
    )
    err.rank, err.culprit, err.cause = mine, who, "timeout"
    return err


def _store_address(store: Any) -> str:
    """`` at host:port`` of the TCPStore under (possibly nested) prefix
    stores, or ``""`` for another store."""
    inner = store
    while inner is not None:
        host, port = getattr(inner, "host", None), getattr(inner, "port", None)
        if isinstance(host, str) and host and isinstance(port, int):
            return f" at {host}:{port}"
        inner = getattr(inner, "underlying_store", None)
    return ""


def _never_registered(
    store: Any, mine: int, who: int, timeout: float, key: str, first: bool
) -> CollectiveTimeoutError:
    """The error of a rank whose group's rank 0 never set its record in the
    store. At start-up (``first``) the likely cause is a store that is not
    this job's: rank 0 could not listen on the port (another job holds it)
    and this rank joined that job's live store."""
    why = f"the store{_store_address(store)} answers, but rank {who} never registered in it"
    if first:
        why += (
            f": rank {who} did not start, failed before joining (see its error), or could "
            "not listen on the port because another job holds it, and this store is that "
            "job's: pick another MASTER_PORT"
        )
    return _timed_out(mine, who, timeout, key, why)


def _poll_floor() -> float:
    """The longest pause between polls of a small group's wait: 1 ms where
    the launcher says this machine runs no more of the job's ranks than the
    process has CPUs (``LOCAL_WORLD_SIZE`` from torchrun,
    ``OMPI_COMM_WORLD_LOCAL_SIZE`` from Open MPI), else 10 ms: ranks still
    starting on a crowded machine would lose turns to the polls (and where
    the launcher does not say, the machine may be crowded)."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        raw = os.environ.get(name, "")
        if raw.isdigit() and int(raw) > 0:  # the launcher's, not ours: never raise on it
            return 1e-3 if int(raw) <= _cores() else 1e-2
    return 1e-2


def _await(store: Any, keys: list[str], timeout: float, waiters: int = 1,
           block: bool = False) -> None:
    """Blocks until every key in ``keys`` is set (``TimeoutError`` after
    ``timeout`` s).

    With ``block``: one ``wait`` on the store, which the server answers the
    moment the last key is set; nothing polls, so a crowded machine loses
    no turns and the last rank to arrive learns the table at once. Only
    for the group a job connects at start-up, on the main thread, before
    any other group of this process exists. torch's client holds its lock
    for the whole wait, so a thread of this process that connects another
    group meanwhile would stall, and one whose peer needs it (the two
    directions of a point-to-point pair, each on its own queue) would wait
    on this one for good. torch prints two warnings when such a wait times
    out; that happens only on the way to an error.

    Otherwise it polls one ``check`` of all of them, every 0.1 ms at first
    and then at most every 1 or 10 ms (``_poll_floor``), or every
    ``waiters`` x 20 us when that many ranks poll the same server (8,192
    ranks: 164 ms): at most about 50,000 polls a second at the server, one
    round trip each, whatever the number of keys. Not a loop of short
    waits: torch's client stalled for 5 s in a loop of 1 ms ones. Not a
    blocking wait on a client of its own (``Store.clone``): with 16 ranks
    cloning at once, torch's store stalled other ranks' operations for 5 s."""
    deadline, pause = time.monotonic() + timeout, 1e-4
    if block:
        try:
            store.wait(keys, timedelta(seconds=timeout))
            return
        except RuntimeError as e:  # torch's DistStoreError on a timeout
            if "timeout" in str(e).lower():
                raise TimeoutError(f"{len(keys)} key(s) from {keys[0]!r} not set within "
                                   f"{timeout:g}s") from None
            # Anything else: a store with no blocking wait of its own (a
            # Python Store that implements set, get and check) is polled
            # below; a broken one raises there.
        except AttributeError:  # no wait at all (NotImplementedError is a RuntimeError)
            pass
    most = max(_poll_floor(), waiters * 2e-5)
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(keys)} key(s) from {keys[0]!r} not set within {timeout:g}s")
        time.sleep(pause)
        pause = min(2 * pause, most)


def _get_all(store: Any, keys: list[str]) -> list[bytes]:
    """``store.multi_get`` (one round trip), or one get per key where the
    store has none."""
    try:
        return [bytes(v) for v in store.multi_get(keys)]
    except (AttributeError, NotImplementedError, RuntimeError):
        return [bytes(store.get(k)) for k in keys]


def _pack(table: dict[str, Any]) -> bytes:
    """A group's table as the store keeps it: JSON, compressed (records of
    ranks on one host differ in little but the port: at 8,192 ranks about 7
    bytes a rank instead of 120, and every rank reads the whole table)."""
    return zlib.compress(json.dumps(table).encode(), 6)


def _exchange(
    store: Any, key: str, group_rank: int, group_size: int, me: dict[str, str],
    timeout: float, members: Optional[list[int]] = None, block: bool = False,
) -> tuple[list[dict[str, str]], int]:
    """Every rank's record (address, host, machine) to every rank of the
    group, and the group's token, in a constant number of store operations
    per rank: the others set their record, rank 0 waits for all of them,
    reads them in one ``multi_get`` and publishes the table under one key,
    which the others wait for and read (compressed, see ``_pack``; 3
    operations on rank 0, 2 on the others, plus the polls of one check
    while waiting; before, every
    rank polled and read every other rank's key: 2p^2 operations on one
    server per group). A rank that never sets its record is named by rank 0
    in the table, so every rank raises naming it; a missing rank 0 is named
    by the others' own wait. With ``block`` the waits are blocking
    ``wait``s (see ``_await``)."""
    glob = members if members is not None else list(range(group_size))
    mine = glob[group_rank]
    table = f"{key}/table"
    # Rank 0 sets its record too, with the group's token: it says the group
    # is being connected (a receive from any source looks for a sender's
    # pair this way).
    token = secrets.randbits(63) if group_rank == 0 else 0
    store.set(f"{key}/peer/{group_rank}",
              json.dumps({**me, "token": token} if group_rank == 0 else me))
    if group_rank == 0:
        keys = [f"{key}/peer/{r}" for r in range(1, group_size)]
        try:
            _await(store, keys, timeout, group_size, block)
        except TimeoutError as e:
            late = next((r for r in range(1, group_size)
                         if not store.check([f"{key}/peer/{r}"])), 1)
            store.set(table, _pack({"missing": late, "why": str(e)}))
            raise _timed_out(mine, glob[late], timeout, key, str(e)) from None
        peers = [me] + [json.loads(v) for v in _get_all(store, keys)]
        store.set(table, _pack({"peers": peers, "token": token}))
        return peers, token
    try:
        _await(store, [table], timeout, group_size, block)
    except TimeoutError as e:
        if not store.check([f"{key}/peer/0"]):
            # Rank 0 never registered: no verdict of its own is coming.
            raise _never_registered(store, mine, glob[0], timeout, key, block) from None
        # Rank 0 is there: its verdict on a missing rank arrives before this
        # wait gives up on rank 0 itself.
        try:
            _await(store, [table], min(5.0, 1.0 + 0.1 * timeout), group_size, block)
        except TimeoutError:
            raise _timed_out(mine, glob[0], timeout, key, str(e)) from None
    got = json.loads(zlib.decompress(bytes(store.get(table))))
    if "missing" in got:
        raise _timed_out(mine, glob[int(got["missing"])], timeout, key, str(got["why"]))
    return list(got["peers"]), int(got["token"])


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
