"""The replicas an outer algorithm (DiLoCo, LocalSGD) averages over: the
members of a process group, their engine communicators (flat, or Bagua's two
levels: exact within a host, compressed across), agreement on arguments
through the group's store, and the survivors' new communicators after a
replica is lost."""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import torch.distributed as dist

from ..core import connect_members, group_timeout, groups, local_address
from ..core.store import await_keys, get_all
from ..errors import CollectiveMismatchError, CollectiveTimeoutError, PeerLostError


class Replicas:
    """The members of ``group`` and the communicators an outer average runs
    on. Collective over the group's members (each creates it, in the same
    order relative to other such objects)."""

    def __init__(self, group: Any, what: str, hierarchical: bool,
                 timeout: Optional[float] = None) -> None:
        torch_group = dist.is_available() and dist.is_initialized() and (
            group is None or isinstance(group, dist.ProcessGroup))
        if torch_group:
            pg = group if group is not None else dist.group.WORLD
            self.members = [int(r) for r in dist.get_process_group_ranks(pg)]
            self.me = dist.get_rank()
            self.store = dist.distributed_c10d._get_default_store()
            default_timeout = group_timeout(pg)
            self.addr = local_address(self.store)
            prefix = ""
        elif groups.is_initialized() and (group is None or hasattr(group, "ranks")):
            # ringlet's own runtime (ringlet.init, Bagua's init_process_group):
            # the world, or a Bagua process group's ranks.
            state = groups.require_state()
            self.members = ([int(r) for r in group.ranks] if group is not None
                            else list(range(state.world_size)))
            self.me, self.store, self.addr = state.rank, state.store, state.addr
            default_timeout = state.timeout
            prefix = f"{state.prefix}/" if state.prefix else ""
        else:
            raise RuntimeError(
                f"{what} needs a process group: call torch.distributed.init_process_group "
                "first (any backend: 'ringlet', 'gloo', ...), or ringlet.init(); got group "
                f"{group!r}"
            )
        if self.me not in self.members:
            raise ValueError(f"rank {self.me} is not in the {what} group {self.members}")
        self.what = what
        self.hierarchical = hierarchical
        self.timeout = float(timeout) if timeout else default_timeout
        base = ",".join(map(str, self.members))
        count = int(self.store.add(f"{prefix}ringlet/outer/{base}/{self.me}", 1))
        self.key = f"{prefix}ringlet/outer/{base}/{count}"
        self.epoch = 0
        self.comms: Any = None
        self._connect()

    @property
    def size(self) -> int:
        """The number of replicas."""
        return len(self.members)

    @property
    def index(self) -> int:
        """This rank's place among the replicas."""
        return self.members.index(self.me)

    def _connect(self) -> None:
        self._connected = connect_members(
            self.store, f"{self.key}/e{self.epoch}", self.members, self.me, addr=self.addr,
            timeout=self.timeout, name=f"{self.what} over ranks {self.members}",
            hierarchical=self.hierarchical)
        self.comms, self.flat = self._connected.comms, self._connected.flat

    def agree(self, topic: str, value: Any) -> None:
        """Checks that every replica passes the same ``value`` (JSON-able)
        for ``topic``; raises :class:`CollectiveMismatchError` naming the
        ranks that differ, on every rank, or a timeout naming those that
        never came."""
        key = f"{self.key}/e{self.epoch}/agree/{topic}"
        mine = json.dumps(value, sort_keys=True)
        self.store.set(f"{key}/{self.me}", mine)
        keys = [f"{key}/{r}" for r in self.members]
        try:
            await_keys(self.store, keys, self.timeout, waiters=len(keys))
        except TimeoutError:
            missing = [r for r, k in zip(self.members, keys) if not self.store.check([k])]
            raise CollectiveTimeoutError(
                f"rank {self.me}: {self.what}: rank(s) {missing} did not reach the agreement on "
                f"{topic} within {self.timeout:g}s"
            ) from None
        got = [v.decode() for v in get_all(self.store, keys)]
        if len(set(got)) > 1:
            values = [json.loads(v) for v in got]
            if all(isinstance(v, dict) for v in values):  # name the fields that differ
                fields = sorted({k for v in values for k in v
                                 if any(w.get(k) != v.get(k) for w in values)})
                got = [", ".join(f"{k}={v.get(k)!r}" for k in fields) for v in values]
            by: dict[str, list[int]] = {}
            for r, v in zip(self.members, got):
                by.setdefault(v, []).append(r)
            listing = "; ".join(f"ranks {rs}: {v}" for v, rs in by.items())
            raise CollectiveMismatchError(
                f"rank {self.me}: {self.what}: the replicas disagree on {topic} ({listing})"
            )

    def survivors(self, error: BaseException) -> list[int]:
        """After ``error`` (a lost replica) on this rank: agrees with the other
        survivors on who is left, connects them, and returns the ranks lost.
        Raises ``error`` again where this rank is not among the survivors or
        the store is gone too."""
        lost_seen = set()
        culprit = getattr(error, "culprit", None)
        if isinstance(culprit, int) and culprit in self.members and culprit != self.me:
            lost_seen.add(culprit)
        key = f"{self.key}/e{self.epoch}/survivors"
        self.store.set(f"{key}/alive/{self.me}", json.dumps(sorted(lost_seen)))
        # Wait until every member has either said it is alive or been named
        # lost by a survivor; the first to see that settles the list for all.
        deadline = time.monotonic() + self.timeout
        decided = f"{key}/decided"
        pause = 1e-3
        while not self.store.check([decided]):
            alive, named = [], set()
            for r in self.members:
                k = f"{key}/alive/{r}"
                if self.store.check([k]):
                    alive.append(r)
                    named.update(json.loads(bytes(self.store.get(k)).decode()))
            done = all(r in alive or r in named for r in self.members)
            if done or time.monotonic() > deadline:
                keep = [r for r in alive if r not in named]
                self.store.compare_set(decided, "", json.dumps(keep))
                break
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        keep = json.loads(bytes(self.store.get(decided)).decode())
        if self.me not in keep:
            raise error
        gone = [r for r in self.members if r not in keep]
        try:
            self._connected.close()
        except Exception:
            pass
        self.members = keep
        self.epoch += 1
        self._connect()
        return gone

    def close(self) -> None:
        """Closes the communicators (idempotent)."""
        self._connected.close()


def lost_replica(error: BaseException) -> bool:
    """Whether ``error`` is a replica lost (its process gone, or it gave up)."""
    return isinstance(error, (PeerLostError, CollectiveTimeoutError)) or (
        getattr(error, "cause", None) in ("exited", "unreachable", "left", "aborted", "timeout")
    )
