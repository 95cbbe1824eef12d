"""Type stubs of the native module built from ``rust/ringlet-py``."""

from typing import Any, Callable, Optional

__version__: str

class Listener:
    """A listening TCP socket bound to ``addr`` (``host:port``, port 0 = any)."""

    def __init__(self, addr: str) -> None: ...
    @property
    def port(self) -> int: ...

class Plan:
    """Where a group's ranks sit across hosts: the one plan that both the
    engine's two-level collectives and Bagua's hierarchical algorithms take
    (``rust/ringlet-core/src/plan.rs``).

    Args:
      hosts (list[str]): Each group rank's host identity, by group rank.
      rank (int): The group rank the plan is seen from.

    Example:
      >>> p = Plan(["a", "b", "b", "b"], 2)
      >>> p.layout, p.host, p.index, p.leaders, p.even, p.flat
      ([[0], [1, 2, 3]], 1, 1, [0, 1], False, False)
    """

    def __init__(self, hosts: list[str], rank: int) -> None: ...
    @property
    def layout(self) -> list[list[int]]:
        """The group ranks of each host, hosts in order of their lowest rank."""
    @property
    def host(self) -> int:
        """This rank's host (its place in ``layout``)."""
    @property
    def index(self) -> int:
        """This rank's index among its host's ranks."""
    @property
    def local(self) -> list[int]:
        """The group ranks on this rank's host."""
    @property
    def leaders(self) -> list[int]:
        """Each host's first rank, hosts in order."""
    @property
    def even(self) -> bool:
        """Whether every host holds the same number of ranks."""
    @property
    def has_channels(self) -> bool:
        """Whether Bagua's levels have channel communicators (the ranks at one
        index on every host): two hosts or more, each of the same number of
        ranks, more than one."""
    @property
    def channels(self) -> int:
        """Channels per cross-host buffer: the lcm of the hosts' rank counts."""
    @property
    def flat(self) -> bool:
        """Whether the group's collectives stay on one level: one host, one
        rank on every host, or more channels than the engine cuts buffers into."""

class Communicator:
    """One rank's endpoint in a group of ranks."""

    @staticmethod
    def single(domain: int = 0) -> Communicator: ...
    @staticmethod
    def connect(
        listener: Listener,
        rank: int,
        addrs: list[str],
        hosts: list[str],
        token: int,
        timeout_s: float,
        force_tcp: bool = False,
        slot_bytes: int = ...,
        cma: bool = True,
        cma_threshold: int = ...,
        small_bytes: int = ...,
        spins: int = 2000,
        spin_us: int = 50,
        long_spin_us: int = 2000,
        yield_us: int = 0,
        members: list[int] = ...,
        name: str = "",
        domain: int = 0,
    ) -> Communicator: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def transport(self) -> str: ...
    def open_streams(self) -> int: ...
    def all_reduce(self, ptr: int, nbytes: int, dtype_name: str, op_name: str) -> None: ...
    def all_reduce_into(
        self, in_ptr: int, out_ptr: int, nbytes: int, dtype_name: str, op_name: str
    ) -> None: ...
    def all_gather(
        self, in_ptr: int, in_nbytes: int, out_ptr: int, out_nbytes: int, dtype_name: str
    ) -> None: ...
    def reduce_scatter(
        self,
        in_ptr: int,
        in_nbytes: int,
        out_ptr: int,
        out_nbytes: int,
        dtype_name: str,
        op_name: str,
    ) -> None: ...
    def broadcast(self, ptr: int, nbytes: int, dtype_name: str, root: int) -> None: ...
    def all_to_all_v(
        self,
        in_ptr: int,
        in_nbytes: int,
        send_counts: list[int],
        out_ptr: int,
        out_nbytes: int,
        recv_counts: list[int],
        dtype_name: str,
    ) -> None: ...
    def send(self, ptr: int, nbytes: int, dtype_name: str, peer: int, tag: int) -> None: ...
    def recv(self, ptr: int, nbytes: int, dtype_name: str, peer: int, tag: int) -> None: ...
    def attach_levels(self, local: Communicator, layout: list[list[int]]) -> None: ...
    def host_layout(self) -> list[list[int]] | None: ...
    def barrier(self) -> None: ...
    def pending_message(self, peer: int) -> Optional[tuple[int, int, str]]: ...
    def wait_message(self, peer: int) -> tuple[int, int, str]: ...
    def failed(self) -> bool: ...
    def timeout(self) -> float:
        """The longest wait for a peer without progress, in seconds."""
    def set_timeout(self, timeout_s: float) -> None:
        """Changes that wait for the operations that start from now on."""
    def close(self) -> None: ...

def host_identity() -> str: ...
def simd_kernels() -> dict[str, str]: ...
def abort_domain(domain: int, rank: int) -> None: ...

# ---- C ABI for the native torch.distributed Backend (ringlet-core/src/capi.rs) ----
def capi_table() -> int:
    """The address of the engine's C ABI table, for the C++ Backend."""
def native_group(queue: Progress, comm: Communicator) -> int:
    """A C ABI handle over a group's queue and communicator (the caller
    owns it and frees it with the table's ``group_free``)."""
def native_error(err: int) -> BaseException:
    """The Python exception for an error address the C ABI returned (taken
    and freed; only for the C++ Backend)."""

class Progress:
    """An ordered queue of jobs run by one thread (a process group's
    progress thread); a waiter runs queued jobs itself when none is running."""

    def __init__(self, name: str) -> None: ...
    def submit(self, job: Callable[[], Any], wake: bool = True) -> int: ...
    def run_now(self, job: Callable[[], Any]) -> bool: ...
    def all_reduce_now(
        self, comm: Communicator, ptr: int, nbytes: int, dtype_name: str, op_name: str
    ) -> bool: ...
    def submit_engine(
        self, comm: Communicator, call: str, buffers: list[tuple[int, int]], dtype_name: str,
        arg: Any = None, keep: Any = None, wake: bool = True,
        before: list[tuple[int, int, int]] = ..., after: list[tuple[int, int, int]] = ...,
        divide: int = 0,
    ) -> Optional[NativeJob]:
        """Queues one engine call itself (no Python callable runs for it):
        ``all_reduce`` / ``broadcast`` in place on ``[(ptr, nbytes)]``,
        ``all_gather`` / ``reduce_scatter`` from the first buffer into the
        second, ``all_to_all_v`` likewise (``arg``: the send and receive
        counts), ``list`` on a list form's inputs then outputs (``arg``:
        ``(kind, inputs, root, reduce op name)``; staged through buffers the
        running thread keeps), ``barrier`` on none; ``arg`` otherwise the
        reduce op name or the root.
        The job runs the byte copies ``before`` (``(from_ptr, to_ptr,
        nbytes)``) first and, once the call succeeded, divides its result by
        ``divide`` (non-zero: ReduceOp.AVG) and runs the copies ``after``.
        ``keep`` owns every buffer and is held until the job ended. With
        ``wake=False`` on an idle queue it runs at once here and returns None."""
    def is_done(self, ticket: int) -> bool: ...
    def wait(
        self, ticket: int, timeout_s: Optional[float] = None, run_queued: bool = True
    ) -> bool: ...
    def pending(self) -> int: ...
    def close(self) -> None: ...

class NativeJob:
    """An engine call queued on a ``Progress`` queue as it is."""

    @property
    def ticket(self) -> int: ...
    def error(self) -> Optional[BaseException]:
        """The exception the call failed with, or None; raises RuntimeError
        before the ticket is done."""

class TensorModule:
    """Registered tensors of one model, their buckets and the worker thread
    that runs bucket operations in bucket order (see ``ringlet.parallel.tensor``)."""

    def __init__(
        self,
        name: str,
        # name -> (data_ptr, numel, dtype_name, device, tensor, mirror_ptr, mirror):
        # mirror, for a device tensor, a page-locked host tensor of its size to
        # stage it through (None, with mirror_ptr 0, for none)
        resolver: Callable[[str], tuple[int, int, str, str, Any, int, Any]],
        stager: Callable[[Any, int, int, bool], None],
    ) -> None: ...
    @property
    def name(self) -> str: ...
    def register(self, name: str, numel: int, dtype_name: str, device: str) -> int: ...
    def names(self) -> list[str]: ...
    def tensor(self, name: str) -> tuple[int, str, str]: ...
    def plan(self, names: list[str], cap_bytes: int) -> list[list[str]]: ...
    def set_buckets(self, groups: list[list[str]]) -> None: ...
    def buckets(self) -> list[list[str]]: ...
    def bucket_layout(self, index: int, alignment: int) -> tuple[list[int], int, int]: ...
    def set_all_reduce(self, comm: Communicator, average: bool) -> None: ...
    def set_op(self, op: Callable[[int, list[str]], None]) -> None: ...
    def set_always_ready(self, name: str) -> None: ...
    def set_bucket_ops(self, lists: list[list[Any]]) -> None:
        """Bucket i runs lists[i] in order: algorithm operations
        (CentralizedOp, DecentralizedOp, LowPrecisionOp, AsyncAverager)
        or callables op(bucket_index, names)."""
    def mark_ready(self, name: str, event: Optional[Any] = None) -> None: ...
    def is_ready(self, name: str) -> bool: ...
    def pending(self) -> int: ...
    def wait_pending(self) -> None: ...
    def close(self) -> None: ...

# ---- Bagua's algorithms (rust/ringlet-core/src/algorithms) ----
class Comms:
    """The communicators of one algorithm instance."""

    @staticmethod
    def flat(comm: Communicator) -> Comms: ...
    @staticmethod
    def hierarchical(
        intra: Communicator,
        inter: Optional[Communicator],
        plan: Plan,
        channel: Optional[Communicator] = None,
    ) -> Comms: ...

class CentralizedOp:
    def __init__(
        self,
        comms: Comms,
        average: bool,
        compression: Optional[str] = None,
        error_feedback: bool = False,
    ) -> None: ...
    def apply(self, ptr: int, nbytes: int, dtype_name: str, key: int) -> None: ...
    def residuals(self, key: int) -> Optional[tuple[bytes, bytes]]: ...

class DecentralizedOp:
    def __init__(
        self,
        comms: Comms,
        peer_selection_mode: str,
        peer_ptr: int,
        peer_nbytes: int,
        dtype_name: str,
        peer_owner: Any,
    ) -> None: ...
    def share_peer_weight(self) -> None: ...
    @property
    def step(self) -> int: ...

class LowPrecisionOp:
    def __init__(
        self,
        comms: Comms,
        weight: tuple[int, int, Any],
        left: tuple[int, int, Any],
        right: tuple[int, int, Any],
        dtype_name: str,
    ) -> None: ...

class AsyncAverager:
    def __init__(
        self, comm: Communicator, ptr: int, nbytes: int, dtype_name: str, owner: Any
    ) -> None: ...
    def start(self, interval_ms: float) -> None: ...
    def abort(self) -> None: ...
    def reset(self) -> None: ...
    def lock_weight(self) -> None: ...
    def unlock_weight(self) -> None: ...
    def status(self) -> str: ...
    @property
    def rounds(self) -> int: ...

def minmax_uint8_compress(
    in_ptr: int, nbytes: int, dtype_name: str, out_ptr: int, out_nbytes: int
) -> None: ...
def minmax_uint8_decompress(
    in_ptr: int, in_nbytes: int, out_ptr: int, nbytes: int, dtype_name: str
) -> None: ...
def minmax_uint8_compressed_len(dtype_name: str, elements: int) -> int: ...
def shift_one_peer(rank: int, n: int, step: int) -> int: ...

class OuterSync:
    """DiLoCo's outer average of one flat bucket, on a thread of its own."""
    def __init__(
        self,
        comms: Comms,
        dtype_name: str,
        pseudo: tuple[int, int, Any],
        avg: tuple[int, int, Any],
        compression: Optional[str] = None,
        error_feedback: bool = False,
    ) -> None: ...
    def start(self) -> None: ...
    def wait(self) -> None: ...
    def running(self) -> bool: ...

def pseudo_gradient(
    flat: tuple[int, int], params: list[tuple[int, int]], out: tuple[int, int], dtype_name: str
) -> None: ...
def flat_scatter(flat: tuple[int, int], params: list[tuple[int, int]]) -> None: ...
def flat_gather(params: list[tuple[int, int]], flat: tuple[int, int]) -> None: ...
def codec_compress(
    codec: str, in_ptr: int, nbytes: int, dtype_name: str, out_ptr: int, out_nbytes: int
) -> None: ...
def codec_decompress(
    codec: str, in_ptr: int, in_nbytes: int, out_ptr: int, nbytes: int, dtype_name: str
) -> None: ...
def codec_compressed_len(codec: str, dtype_name: str, elements: int) -> int: ...

# ---- RPC message layer (rust/ringlet-core/src/rpc) ----
RPC_OK: int
RPC_ERROR: int
RPC_TIMEOUT: int
RPC_PEER_LOST: int
RPC_SHUTDOWN: int

class RpcReply:
    @property
    def peer(self) -> int: ...

class RpcMessage:
    @property
    def id(self) -> int: ...
    @property
    def sender(self) -> int: ...
    @property
    def status(self) -> int: ...
    @property
    def tensor_lens(self) -> list[int]: ...
    def payload(self) -> bytes: ...
    def fetch(self, i: int, ptr: int, nbytes: int) -> None: ...
    def release(self) -> None: ...
    def reply_to(self) -> Optional[RpcReply]: ...

class RpcAgent:
    def __init__(
        self,
        rank: int,
        token: int,
        bind_addr: str,
        on_request: Callable[[RpcMessage], None],
        on_response: Callable[[RpcMessage], None],
        request_threads: int = 16,
        completion_threads: int = 4,
        single_copy_min: int = 65536,
    ) -> None: ...
    @property
    def port(self) -> int: ...
    def set_peers(self, addrs: list[str], same_host: list[bool]) -> None: ...
    def call(
        self, to: int, payload: bytes, tensors: list[tuple[int, int]], timeout_s: float, keep: Any
    ) -> int: ...
    def call_wait(
        self, to: int, payload: bytes, tensors: list[tuple[int, int]], timeout_s: float, keep: Any
    ) -> RpcMessage: ...
    def respond(
        self,
        reply: RpcReply,
        status: int,
        payload: bytes,
        tensors: list[tuple[int, int]],
        keep: Any,
    ) -> None: ...
    def pending(self) -> int: ...
    def refused(self) -> int: ...
    def shutdown(self) -> None: ...
