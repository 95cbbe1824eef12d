"""Exceptions raised by ringlet.

Every failure inside a collective surfaces as a subclass of
:class:`RingletError`, which also derives from the closest built-in exception,
so ``except TimeoutError`` or ``except ConnectionError`` work as expected.
Invalid arguments (wrong dtype, shape, device, layout) raise plain
:class:`ValueError` / :class:`TypeError` before any communication starts.
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicatorAbortedError",
    "NotInitializedError",
    "PeerLostError",
    "RingletError",
]


class RingletError(RuntimeError):
    """Base class of every error raised by ringlet's communication engine."""


class NotInitializedError(RingletError):
    """A collective was called before :func:`ringlet.init`."""


class CollectiveMismatchError(RingletError, ValueError):
    """Ranks called the same collective with different arguments (operation,
    element count, dtype, reduce type or root). Raised on every rank, before
    any data moves; the communicator stays usable."""


class CollectiveTimeoutError(RingletError, TimeoutError):
    """A peer did not reach the collective within the timeout
    (``RINGLET_TIMEOUT`` / ``init(timeout=...)``). The message names it."""


class PeerLostError(RingletError, ConnectionError):
    """A peer's process exited or its connection broke mid-collective."""


class CommunicatorAbortedError(RingletError):
    """The communicator failed earlier (timeout, lost peer) and cannot be
    reused; call :func:`ringlet.shutdown` and re-initialise."""
