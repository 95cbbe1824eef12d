"""Exceptions raised by ringlet.

Every failure inside a collective surfaces as a subclass of
:class:`RingletError`, which also derives from the closest built-in exception,
so ``except TimeoutError`` or ``except ConnectionError`` work as expected.
Invalid arguments (wrong dtype, shape, device, layout) raise plain
:class:`ValueError` / :class:`TypeError` before any communication starts;
invalid meshes and partition specs raise :class:`ShardingSpecError`.
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicatorAbortedError",
    "NotInitializedError",
    "PeerLostError",
    "ReplicaGroupError",
    "RingletError",
    "ShardingSpecError",
    "TensorRegistrationError",
    "TensorStateError",
]


class RingletError(RuntimeError):
    """Base class of every error raised by ringlet's communication engine.

    Failures during a collective carry, besides the message, attributes an
    operator can act on (``None`` where they do not apply): ``rank`` (the
    rank raising), ``culprit`` (the rank the failure started from, not the
    neighbour that gave up in reaction), ``cause`` (``"exited"``,
    ``"unreachable"``, ``"timeout"``, ``"aborted"``, ``"left"``,
    ``"failed"``), ``op`` (the collective), ``group`` (the communicator, e.g.
    ``"the world (4 ranks)"`` or ``"replica group [0, 2]"``) and
    ``reported_by`` (the rank whose abort notice told this rank, ``None`` when
    it saw the failure itself).
    """

    rank: int | None = None
    culprit: int | None = None
    cause: str | None = None
    op: str | None = None
    group: str | None = None
    reported_by: int | None = None


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
    """A peer is gone for this collective: its process exited or was killed,
    the network to it is down, or it gave up (``ringlet.abort()``). ``culprit``
    and the message name the rank the failure started from."""


class CommunicatorAbortedError(RingletError):
    """The communicator failed earlier (timeout, lost peer) and cannot be
    reused; call :func:`ringlet.shutdown` and re-initialise."""


class ShardingSpecError(ValueError, AssertionError):
    """An invalid mesh or partition spec, where torch_xla fails an ``assert``.

    Raised for a mesh whose axis names, device ids or size do not fit its
    shape, a partition spec with an out-of-range, repeated or nested axis, a
    ``HybridMesh`` whose ICI and DCN shapes differ in length, and a
    ``mark_sharding`` whose mesh does not match the job or whose spec length
    differs from the tensor rank. It is both a :class:`ValueError` and an
    :class:`AssertionError`, so ``pytest.raises(ValueError)`` and tests ported
    from torch_xla that expect ``AssertionError`` both catch it. The message
    names the problem.

    Example:
        >>> try:
        ...     Mesh([0, 1], (2, 1), ("x", "x"))
        ... except AssertionError as err:
        ...     print(type(err).__name__)
        ShardingSpecError
    """


class TensorRegistrationError(ValueError, AssertionError):
    """A tensor-API registration that Bagua refuses with ``assert``: renaming
    a ringlet tensor, moving it to another module, or a ``setter_closure``
    without a ``getter_closure``. Both a :class:`ValueError` and an
    :class:`AssertionError`, so ringlet code and code ported from Bagua catch it.

    Example:
        >>> t = torch.zeros(1).ensure_ringlet_tensor("a")
        >>> try:
        ...     t.ensure_ringlet_tensor("b")
        ... except AssertionError as err:
        ...     print(type(err).__name__)
        TensorRegistrationError
    """


class ReplicaGroupError(ValueError, AssertionError):
    """Replica groups of different sizes where torch_xla ``assert``-s equal
    ones (``all_gather`` with ``pin_layout=False``, an ``output`` or a list
    input, ``reduce_scatter`` and their bucketized forms). Both a
    :class:`ValueError` and an :class:`AssertionError`.

    Example:
        >>> try:   # on 3 ranks
        ...     ringlet.all_gather(t, groups=[[0], [1, 2]], pin_layout=False)
        ... except AssertionError as err:
        ...     print(type(err).__name__)
        ReplicaGroupError
    """


class TensorStateError(RuntimeError, AssertionError):
    """A tensor-API call the tensor's registration does not allow, where
    Bagua fails an ``assert``: ``bagua_setter_closure`` on a tensor without a
    setter, marking a tensor ready that belongs to no module. Both a
    :class:`RuntimeError` and an :class:`AssertionError`.

    Example:
        >>> t = torch.zeros(1).ensure_ringlet_tensor("a")   # no module_name
        >>> try:
        ...     t.ringlet_mark_communication_ready()
        ... except AssertionError as err:
        ...     print(type(err).__name__)
        TensorStateError
    """
