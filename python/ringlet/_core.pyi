"""Type stubs of the native module built from ``rust/ringlet-py``."""

__version__: str

class Listener:
    """A listening TCP socket bound to ``addr`` (``host:port``, port 0 = any)."""

    def __init__(self, addr: str) -> None: ...
    @property
    def port(self) -> int: ...

class Communicator:
    """One rank's endpoint in a group of ranks."""

    @staticmethod
    def single() -> Communicator: ...
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
    ) -> Communicator: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def transport(self) -> str: ...
    def all_reduce(self, ptr: int, nbytes: int, dtype_name: str, op_name: str) -> None: ...
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
    def barrier(self) -> None: ...
    def close(self) -> None: ...

def host_identity() -> str: ...
