"""How the job's communicators connect: listening addresses exchanged through
the key-value store (:mod:`.store`), the engine's settings from the
environment, this process's one listening socket, and the two levels of a
group spanning hosts (the ranks of this host over shared memory, run inside
the engine). :mod:`.groups` connects the world, replica groups and pairs with
it; :mod:`.members` an algorithm's members.

Example:
  >>> from ringlet.core import connection
  >>> comm, hosts = connection.connect(store, "algo/1/g", 0, 2, "127.0.0.1", 60.0)
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from typing import Any, Optional

from .. import _core
from .store import cores, exchange

__all__ = [
    "HostTable",
    "connect",
    "connect_bagua_levels",
    "connect_group",
    "connect_host_level",
    "engine_options",
    "env_float",
    "env_int",
    "host_id",
    "local_ip",
    "new_domain",
    "ranks_by_host",
]


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def env_float(name: str, default: float) -> float:
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


def engine_options(local_ranks: int = 1, crowded: bool = False) -> dict[str, Any]:
    """Engine settings from the environment; ``local_ranks`` (the group's
    ranks on this host) picks the default spin budgets, ``crowded`` (more of
    the job's ranks on this machine than it has CPUs, with network traffic
    between them: hosts simulated on one machine) makes a waiting rank park
    after a short spin, since a spinning rank would keep the CPU from the
    ranks and the network stack it waits for."""
    dedicated = local_ranks <= cores() and not crowded
    mode = os.environ.get("RINGLET_TRANSPORT", "auto").lower()
    if mode not in ("auto", "tcp", "shm"):
        raise ValueError(f"RINGLET_TRANSPORT={mode!r}: expected 'auto', 'shm' or 'tcp'")
    return {
        "force_tcp": mode == "tcp",
        "slot_bytes": env_int("RINGLET_SHM_SLOT_BYTES", 1 << 20),
        "cma": os.environ.get("RINGLET_CMA", "1") not in ("0", "false", "False"),
        # Unset: collectives never read peers' memory directly (the staged
        # path is faster here at every size; see DEFAULT_CMA_THRESHOLD in group.rs).
        "cma_threshold": env_int("RINGLET_CMA_THRESHOLD", (1 << 64) - 1),
        "small_bytes": env_int("RINGLET_SMALL_BYTES", 4 << 10),
        "spins": env_int("RINGLET_SPIN", _SPINS_DEDICATED if dedicated else _SPINS_SHARED),
        "spin_us": env_int("RINGLET_SPIN_US", _SPIN_US if dedicated else 0),
        "long_spin_us": env_int("RINGLET_LONG_SPIN_US", _LONG_SPIN_US if dedicated else 0),
        "yield_us": env_int("RINGLET_YIELD_US", 0),
    }


class HostTable(list):  # type: ignore[type-arg]
    """Each group rank's host identity (a ``list[str]``), and how many of the
    group's ranks run on this machine (``machine_ranks``: hosts simulated
    with ``RINGLET_HOST_ID`` may share one)."""

    machine_ranks: int = 1


def host_id() -> str:
    """This process's host identity (``RINGLET_HOST_ID``, else the machine's)."""
    return os.environ.get("RINGLET_HOST_ID") or _core.host_identity()


def local_ip(master_addr: str) -> str:
    """The address peers reach this process at: ``RINGLET_ADDR``, else the
    local address of the route to ``master_addr``."""
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
_listeners_lock = threading.Lock()  # connect may run under groups' lock


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


def connect(
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
) -> tuple[_core.Communicator, HostTable]:
    """Exchanges listening addresses under ``key`` and connects a group.
    ``members`` (global ranks, by group rank) name peers in errors, ``name``
    names the group, and communicators with the same ``domain`` fail
    together. ``crowded`` (see engine_options) defaults to: the group spans
    hosts and runs more ranks on this machine than it has CPUs. ``block``:
    see :func:`.store.await_keys`."""
    host = host_id()
    machine = _core.host_identity()
    bind = "127.0.0.1" if addr.startswith("127.") else "0.0.0.0"
    listener = _listener(bind)
    me = {"addr": f"{addr}:{listener.port}", "host": host, "machine": machine}
    peers, token = exchange(store, key, group_rank, group_size, me, timeout, members, block)
    hosts = HostTable(p["host"] for p in peers)
    hosts.machine_ranks = sum(1 for p in peers if p.get("machine") == machine)
    if crowded is None:
        crowded = hosts.machine_ranks > cores() and len(set(hosts)) > 1
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
        **engine_options(sum(1 for p in peers if p["host"] == host), crowded),
    )
    return comm, hosts


def connect_group(
    store: Any, key: str, members: list[int], me: int, addr: str, timeout: float,
    name: str, domain: int, levels: bool = True, crowded: Optional[bool] = None,
) -> tuple[_core.Communicator, HostTable]:
    """Connects the global ranks ``members`` (``me`` among them) under
    ``key``; with ``levels``, a group spanning hosts with several ranks on
    some host runs its collectives in two levels. A one-rank group needs no
    network."""
    if len(members) == 1:
        hosts = HostTable([host_id()])
        return _core.Communicator.single(domain), hosts
    i = members.index(me)
    comm, hosts = connect(store, key, i, len(members), addr, timeout, members=list(members),
                           name=name, domain=domain, crowded=crowded)
    if levels:
        local = connect_host_level(store, key, i, hosts, addr, timeout, domain,
                                   members=list(members))
        if local is not None:
            comm.attach_levels(local, ranks_by_host(hosts))
    return comm, hosts


def connect_bagua_levels(
    store: Any, key: str, members: list[int], me: int, hosts: list[str], addr: str,
    timeout: float, name: str, domain: int,
) -> tuple[_core.Communicator, Optional[_core.Communicator], _core.Plan,
           Optional[_core.Communicator]]:
    """Connects Bagua's two levels over ``members``, laid out by the one plan
    the engine's own two levels take (:class:`ringlet._core.Plan`).

    Args:
      store (Any): The key-value store.
      key (str): The prefix of the levels' keys.
      members (list[int]): The global ranks, by group rank.
      me (int): This process's global rank, one of ``members``.
      hosts (list[str]): ``hosts[i]``: the host of ``members[i]``.
      addr (str): The address peers reach this process at.
      timeout (float): Seconds to wait for the peers.
      name (str): What the levels are for, in error messages.
      domain (int): The fault domain.

    Returns:
      tuple: The members on this rank's host; the first member of each host
      (``None`` on other ranks); the plan (``_core.Plan``, seen from this
      rank: what ``Comms.hierarchical`` checks them against); and, when the plan has
      channels (every host holds the same number of members, more than one),
      the *channel* of the members at this rank's position on every host (the
      first members' channel is the second level itself), else ``None``.
      Collective over the members.

    Example:
      >>> intra, inter, plan, channel = connect_bagua_levels(
      ...     store, "algo/1", [0, 1, 2, 3], 0, ["a", "a", "b", "b"], "127.0.0.1", 60.0,
      ...     "my algorithm", new_domain())
    """
    plan = _core.Plan(list(hosts), members.index(me))
    local = [members[r] for r in plan.local]
    leaders = [members[r] for r in plan.leaders]
    host = plan.host
    # A host's other ranks wait in the host level while its first rank talks
    # across hosts: on a machine with more of the job's ranks than CPUs they
    # park at once instead of yielding in a loop.
    crowded = getattr(hosts, "machine_ranks", 0) > cores()
    intra, _ = connect_group(store, f"{key}/intra{host}", local, me, addr, timeout,
                                f"host {host} of {name}", domain, levels=False,
                                crowded=crowded)
    inter = None
    if me == local[0]:
        inter, _ = connect_group(store, f"{key}/inter", leaders, me, addr, timeout,
                                    f"the hosts' first ranks of {name}", domain, levels=False)
    channel = None
    if plan.has_channels:
        i = plan.index
        if i == 0:
            channel = inter
        else:
            channel, _ = connect_group(
                store, f"{key}/chan{i}", [members[g[i]] for g in plan.layout], me, addr,
                timeout, f"the hosts' rank {i} of {name}", domain, levels=False)
    return intra, inter, plan, channel


def new_domain() -> int:
    """A new fault domain (communicators of one domain fail together)."""
    return secrets.randbits(63) | 1


def ranks_by_host(hosts: list[str]) -> list[list[int]]:
    """The group ranks on each host, from the engine's plan
    (:class:`ringlet._core.Plan`).

    Args:
      hosts (list[str]): ``hosts[r]``: group rank ``r``'s host.

    Returns:
      list[list[int]]: Each host's ranks, hosts in order of their lowest rank.

    Example:
      >>> ranks_by_host(["a", "b", "a"])
      [[0, 2], [1]]
    """
    return _core.Plan(list(hosts), 0).layout if hosts else []


def connect_host_level(
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
    ``block``: see :func:`.store.await_keys`."""
    if os.environ.get("RINGLET_HIERARCHY", "1") in ("0", "false", "False"):
        return None
    if os.environ.get("RINGLET_TRANSPORT", "auto").lower() == "tcp":
        return None
    plan = _core.Plan(list(hosts), rank)
    if plan.flat:
        return None
    h, i, ranks = plan.host, plan.index, plan.local
    glob = members if members is not None else list(range(len(hosts)))
    # Hosts simulated on one machine with more ranks than CPUs: the host
    # level parks its waits (the network stack needs the CPUs too).
    crowded = getattr(hosts, "machine_ranks", 0) > cores()
    local, _ = connect(
        store, f"{prefix}/hier/local/{h}", i, len(ranks), addr, timeout,
        members=[glob[r] for r in ranks],
        name=f"the ranks of host {h} {[glob[r] for r in ranks]}", domain=domain,
        crowded=crowded, block=block,
    )
    return local
