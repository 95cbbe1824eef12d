"""The communicators of one algorithm instance over some of the job's ranks
(the *members*): all of them on one communicator, and, where asked, Bagua's
two levels (the members on this rank's host; the hosts' first members; with
even hosts, the members at this rank's position on every host) as the
engine's :class:`ringlet._core.Comms`. Collective over the members: every
member connects the same key, in the same order relative to other such
connections."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

from .. import _core
from .connection import connect_bagua_levels, connect_group, local_ip, new_domain


@dataclass
class MemberComms:
    """What :func:`connect_members` connected: the engine's ``comms`` for an
    algorithm, the communicator of all the members (``flat``; None where it
    was not asked for) and everything to close."""

    comms: Any
    flat: Optional[Any]
    closers: list[Any] = field(default_factory=list)

    def close(self) -> None:
        """Closes every communicator (idempotent)."""
        for c in self.closers:
            c.close()
        self.closers = []


def store_host(store: Any) -> Optional[str]:
    """The host of a TCPStore (through any nested PrefixStores), or None."""
    while store is not None:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
    return None


def group_timeout(pg: Any) -> float:
    """The default timeout, in seconds, of a torch process group's backend
    (30 minutes where torch has none for it; at least 1 s).

    Args:
      pg (torch.distributed.ProcessGroup): The group.

    Returns:
      float: Seconds.

    Example:
      >>> group_timeout(dist.group.WORLD)
      1800.0
    """
    import torch.distributed as dist

    try:
        t = dist.distributed_c10d._get_default_timeout(dist.get_backend(pg))
    except Exception:
        t = timedelta(minutes=30)
    return max(float(t.total_seconds()), 1.0)


def local_address(store: Any) -> str:
    """The address this rank's peers reach it at: ``RINGLET_ADDR``, else the
    local address of the route to ``MASTER_ADDR`` (or the store's host).

    Args:
      store (torch.distributed.Store): The job's store.

    Returns:
      str: An IPv4 address.

    Example:
      >>> local_address(dist.distributed_c10d._get_default_store())
      '127.0.0.1'
    """
    return local_ip(os.environ.get("MASTER_ADDR") or store_host(store) or "127.0.0.1")


def connect_members(store: Any, key: str, members: list[int], me: int, *, addr: str,
                    timeout: float, name: str, domain: Optional[int] = None,
                    hierarchical: bool = True, hosts: Optional[list[str]] = None,
                    flat: bool = True) -> MemberComms:
    """Connects the global ranks ``members`` (``me`` among them) under ``key``.

    Args:
      store (torch.distributed.Store): Where the members meet.
      key (str): Unique to this instance (the same on every member).
      members (list[int]): Global ranks, in group order.
      me (int): This rank's global rank.
      addr (str): This rank's address (:func:`local_address`).
      timeout (float): Seconds to wait for the members, and the
        communicators' timeout.
      name (str): What the communicators are for, in error messages.
      domain (int, optional): The fault domain (communicators that fail
        together); default: a new one.
      hierarchical (bool): Bagua's two levels (exact within a host).
      hosts (list[str], optional): Each member's host, where known; else
        learned by connecting all of them.
      flat (bool): Also connect all the members on one communicator (always
        done when ``hosts`` is not given).

    Returns:
      MemberComms: The engine's ``Comms`` and the communicators.

    Example:
      >>> mc = connect_members(store, "algo/1", [0, 1], 0, addr="127.0.0.1", timeout=60,
      ...                      name="my algorithm")
      >>> mc.comms  # for CentralizedOp / OuterSync
    """
    domain = new_domain() if domain is None else domain
    out = MemberComms(None, None)
    if flat or hosts is None or not hierarchical:
        out.flat, found = connect_group(store, f"{key}/g", members, me, addr, timeout, name,
                                        domain)
        out.closers.append(out.flat)
        hosts = hosts if hosts is not None else found
    if hierarchical and len(members) > 1:
        assert hosts is not None
        intra, inter, plan, channel = connect_bagua_levels(
            store, key, members, me, hosts, addr, timeout, name, domain)
        out.closers.extend(c for c in (intra, inter, channel) if c is not None)
        out.comms = _core.Comms.hierarchical(intra, inter, plan, channel)
    else:
        out.comms = _core.Comms.flat(out.flat)
    return out
