"""Coordination between the ranks of a save or load: rank, world size, all-gather.

Without ringlet initialised the job is one process (rank 0 of 1) and nothing is
exchanged; otherwise bytes travel through the xla door's ``rendezvous``. Every
call gets a tag of its own from a counter that all ranks advance in step.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from ..core import groups
from ..xla.xla_model import rendezvous
from .core import CheckpointingException

__all__ = ["Comm", "describe", "raise_if_failed"]

_CALL_COUNTER = itertools.count()


class Comm:
    """Rank, world size and an all-gather of bytes; one process without ringlet initialised."""

    def __init__(self) -> None:
        self._engine = groups.is_initialized()
        if not self._engine:
            self.rank, self.world_size = 0, 1
        else:
            self.rank, self.world_size = int(groups.get_ordinal()), int(groups.world_size())

    def allgather(self, name: str, payload: bytes) -> list[bytes]:
        if not self._engine:
            return [payload]
        tag = f"ringlet.checkpoint.{name}.{next(_CALL_COUNTER)}"
        return [bytes(p) for p in rendezvous(tag, payload)]

    def allgather_status(
        self, name: str, error: BaseException | None, extra: Any = None
    ) -> list[dict[str, Any]]:
        """Gather (ok, message, extra) from all ranks; every rank calls it, failed or not."""
        payload = {
            "ok": error is None,
            "error": None if error is None else describe(error),
            "extra": extra,
        }
        return [
            json.loads(raw.decode("utf-8"))
            for raw in self.allgather(name, json.dumps(payload).encode("utf-8"))
        ]


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def raise_if_failed(statuses: list[dict[str, Any]], error: BaseException | None, what: str) -> None:
    if error is not None:
        if isinstance(error, CheckpointingException):
            raise error
        raise CheckpointingException(f"{what} failed: {describe(error)}") from error
    failed = [(r, s["error"]) for r, s in enumerate(statuses) if not s["ok"]]
    if failed:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise CheckpointingException(f"{what} failed on rank(s) {[r for r, _ in failed]}: {detail}")
