"""The time model of ringlet's collectives across hosts, and its predictions:
``python -m ringlet.bench model``.

A job of H hosts with L ranks each (p = H L) all-reduces S bytes. Each host
has one link of ``rate`` bytes/s each way, of which TCP carries a fraction
``eta`` as payload (1448 of every 1514 bytes on the wire at MTU 1500: 0.956),
a message takes ``alpha`` seconds from one rank's send to its peer's receive
(wire, kernel and wake-up), and each message costs ``o`` seconds of CPU at
each end. Within a host the shared-memory steps copy at ``mem`` bytes/s per
rank.

ringlet (rust/ringlet-core/src/hierarchy): the agreement check (up to 3 ranks
one descriptor exchange with every rank; above, a recursive-doubling
all-reduce of the descriptors' digest bounds, log2 p rounds of one message
for a power of two, floor(log2 p) + 2 otherwise), then
pieces of P bytes flow through three stages that overlap: a reduce-scatter
within the host, the cross-host step (2 hosts: one exchange between the owners
of each channel; 3 or more: a reduce-scatter and an all-gather among them,
each one message to every other host; small runs on 8 or more hosts: recursive
doubling, log2 H exchanges), and an all-gather within the host. The slowest
stage sets the pace; the first piece's reduce-scatter and the last piece's
all-gather, and one cross step's latency, do not overlap::

    T = A(p)                                       (agreement: alpha + (p - 1) o
                                                    up to 3 ranks, else
                                                    d(p) (alpha + 2 o), d(p) the
                                                    doubling rounds)
      + 2 (3 P / L) / mem + s alpha                (pipeline fill and drain)
      + max(2 S (H - 1) / H / (eta rate),           (link: the least any
                                                     all-reduce sends per host)
            K s f 2 o,                              (message costs, K pieces)
            3 S / (L mem))                          (host memory steps)

with s cross steps per piece of f messages each (H = 2: s = f = 1; H >= 3:
s = 2, f = H - 1; recursive doubling: s = ceil(log2 H) + 2, f = 1), and K =
ceil(S / P) pieces.

A flat ring over all p ranks (gloo's large all-reduce, with the ranks of a
host next to each other in the ring): 2 (p - 1) steps, each one message, and
every host link carries 2 S (p - 1) / p each way::

    T_ring = 2 (p - 1) (alpha + 2 o) + 2 S (p - 1) / p / (eta rate)

Example:
  python -m ringlet.bench model                       # this machine's 2 Gbit links
  python -m ringlet.bench model --rate 100gbit --alpha-us 10 --per-host 8
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from .netns import parse_rate

PIECE_MIN = 256 << 10
PIECE_MAX = 256 << 10
MESSAGE_MIN = 16 << 10


@dataclass
class Link:
    """The machine and network a prediction is for.

    Args:
      rate (float): Bytes/s each way of every host's link.
      alpha (float): Seconds from one rank's send to the peer's receive.
      o (float): CPU seconds per message at each end.
      mem (float): Bytes/s one rank copies within its host.
      eta (float): Fraction of the wire that TCP carries as payload.

    Example:
      >>> Link(rate=250e6, alpha=60e-6, o=4e-6, mem=4e9)
    """

    rate: float
    alpha: float
    o: float
    mem: float
    eta: float = 1448 / 1514



def agreement(p: int, link: Link) -> float:
    """Seconds of one collective's agreement check over TCP: up to 3 ranks a
    descriptor to every peer at once, above a recursive-doubling all-reduce
    of the digest bounds (``doubling_rounds(p)`` rounds, one message
    each)."""
    if p <= 3:
        return link.alpha + (p - 1) * link.o
    return doubling_rounds(p) * (link.alpha + 2 * link.o)


def doubling_rounds(p: int) -> int:
    """Rounds of a recursive-doubling all-reduce over ``p`` ranks: log2 p for
    a power of two; otherwise the first 2 (p - q) ranks fold in pairs and
    unfold at the end around the log2 q rounds of the q participants (q the
    largest power of two below p)."""
    if p < 2:
        return 0
    q = 1 << (p.bit_length() - 1)
    return q.bit_length() - 1 + (0 if p == q else 2)

@dataclass
class Store:
    """The job's store server as start-up sees it (torch's TCPStore).

    Args:
      op (float): Seconds the server spends on one operation.
      bw (float): Bytes/s the server sends out.
      record (float): Bytes of one rank's record in a group's table (its
        address, host and machine ids, as JSON).
      base (float): Seconds of a process's own work to set a group up
        (native communicator, Python), every rank in parallel.
      poll (float): The longest pause between a small group's polls
        (``core.store.poll_floor``: 1 ms with a CPU per rank, 10 ms on a
        crowded machine), for groups made after start-up. Default: 0.001

    Example:
      >>> Store(op=30e-6, bw=1e9, record=120, base=0.02)
    """

    op: float
    bw: float
    record: float
    base: float
    poll: float = 1e-3


def start_up(hosts: int, per_host: int, link: Link, store: Store, block: bool = True,
             ranks_per_core: float = 1.0) -> float:
    """Seconds from the last rank's ``init_process_group`` to its first 4 KiB
    all_reduce done (the protocol's cost; the processes' own start comes on
    top), or, with ``block=False``, of a later group's creation
    (``new_group``) to its first all_reduce:

    * each process's own work (``store.base``: native communicator, Backend,
      Python), in parallel where every rank has a core; where a machine runs
      more ranks than it has cores and they start together, the machine
      does it for all of them, ``ranks_per_core`` x base;

    * the group's table: every rank sets its record, rank 0 reads them in
      one ``multi_get`` and sets the table, every rank gets it. At start-up
      the waits block on the store (``core.store.await_keys``): one ``wait`` per
      rank, which the server answers when the last key is set, so 3 p + 1
      operations at the server and no pause. A later group polls: 2 p + 1
      operations, and the waits' last poll (half the poll interval, which
      grows with p) twice: rank 0 for the records, the others for the table.
      Either way the table (p compressed records) goes to p ranks;
    * with several ranks per host, each host's group the same way (H tables
      of L records);
    * the first collective: streams open on demand, one dial (a round trip,
      2 alpha) per doubling round of the agreement, then the 4 KiB
      all_reduce itself (``two_level``).

    Args:
      hosts (int): H.
      per_host (int): L.
      link (Link): The network.
      store (Store): The store server.
      block (bool, optional): The waits block (start-up) rather than poll
        (a later group). Default: True.
      ranks_per_core (float, optional): Ranks a machine runs per core, where
        above 1 (this bench's logical and namespace hosts on 2 cores).
        Default: 1.0.

    Returns:
      Seconds.

    Example:
      >>> start_up(1024, 8, Link(12.5e9, 10e-6, 2e-6, 8e9), Store(30e-6, 1e9, 120, 0.02))
    """
    p = hosts * per_host

    def group(n: int, groups: int) -> float:
        """n ranks in all, in ``groups`` groups of n / groups, each its table."""
        table = n * (n // groups) * store.record / store.bw
        if block:
            return (3 * n + groups) * store.op + table
        poll = max(store.poll, n // groups * 2e-5)  # core.store.await_keys' longest pause
        return (2 * n + groups) * store.op + table + poll

    world = group(p, 1)
    levels = group(p, hosts) if per_host > 1 and hosts > 1 else 0.0
    first = doubling_rounds(p) * 2 * link.alpha + two_level(4096, hosts, per_host, link)
    return store.base * max(1.0, ranks_per_core) + world + levels + first


def piece_bytes(s: float, hosts: int, per_host: int) -> float:
    """The pipeline's piece size for ``s`` bytes (as the engine picks it).

    Args:
      s (float): Bytes of the whole tensor.
      hosts (int): H.
      per_host (int): L (channels = L on even hosts).

    Returns:
      Bytes per piece.

    Example:
      >>> piece_bytes(64 << 20, 2, 2)
      262144
    """
    floor = max(PIECE_MIN, MESSAGE_MIN * per_host * hosts)
    return min(max(s / 4, floor), max(PIECE_MAX, floor))


def two_level(s: float, hosts: int, per_host: int, link: Link) -> float:
    """Predicted seconds of ringlet's all-reduce of ``s`` bytes: the module's
    ``T``.

    Args:
      s (float): S, the bytes each rank all-reduces; cut into pieces of
        :func:`piece_bytes`.
      hosts (int): H (at least 2); picks the cross-host step: one exchange
        (2), a reduce-scatter and all-gather among the hosts (3 or more), or
        recursive doubling (small pieces on 8 or more).
      per_host (int): L, the ranks of each host; they share each piece and
        the host's memory steps.
      link (Link): The machine; every field counts.

    Returns:
      Seconds: the agreement, the pipeline's fill and drain, and the slowest
      of link, message costs and host memory steps.

    Example:
      64 MiB on 2 hosts of 2 ranks, 2 Gbit links:

      >>> two_level(64 << 20, 2, 2, Link(250e6, 60e-6, 4e-6, 4e9))
      0.2810...
    """
    p = hosts * per_host
    piece = min(piece_bytes(s, hosts, per_host), s)
    pieces = math.ceil(s / piece)
    if hosts == 2:
        steps, fan = 1, 1
    elif hosts >= 8 and piece / per_host <= 64 << 10:
        steps, fan = math.ceil(math.log2(hosts)) + 2, 1  # recursive doubling
    else:
        steps, fan = 2, hosts - 1
    agree = agreement(p, link)
    fill = 2 * (3 * piece / per_host) / link.mem + steps * link.alpha
    wire = 2 * s * (hosts - 1) / hosts / (link.eta * link.rate)
    messages = pieces * steps * fan * 2 * link.o
    memory = 3 * s / (per_host * link.mem)
    return agree + fill + max(wire, messages, memory)


def ring(s: float, hosts: int, per_host: int, link: Link) -> float:
    """Predicted seconds of a flat ring all-reduce over all ranks: the
    module's ``T_ring``.

    Args:
      s (float): S, all in one run (the ring has no pieces).
      hosts (int): H; the ring sees only p = H L ranks.
      per_host (int): L; so 4 x 1 and 2 x 2 predict the same.
      link (Link): Its ``alpha``, ``o``, ``eta`` and ``rate`` (no memory
        steps: ``mem`` is not used).

    Returns:
      Seconds: 2 (p - 1) steps of one message each, plus the link's time for
      the 2 S (p - 1) / p bytes each host sends.

    Example:
      :func:`two_level`'s job, 1.5 times as long on the ring:

      >>> link = Link(250e6, 60e-6, 4e-6, 4e9)
      >>> ring(64 << 20, 2, 2, link), ring(64 << 20, 4, 1, link)
      (0.4214..., 0.4214...)
    """
    p = hosts * per_host
    return 2 * (p - 1) * (link.alpha + 2 * link.o) + 2 * s * (p - 1) / p / (
        link.eta * link.rate)


def table(link: Link, per_host: int, hosts: list[int], sizes: list[int]) -> str:
    """Markdown table of both predictions (ms) and their ratio.

    Args:
      link (Link): The machine.
      per_host (int): L.
      hosts (list[int]): Values of H.
      sizes (list[int]): Values of S in bytes.

    Returns:
      The table.

    Example:
      >>> print(table(Link(250e6, 60e-6, 4e-6, 4e9), 2, [2, 16], [1 << 20]))
    """
    head = "| H | p | " + " | ".join(
        f"{_fmt(s)} two-level | {_fmt(s)} ring | x" for s in sizes) + " |"
    rule = "|---:|---:|" + "---:|---:|---:|" * len(sizes)
    rows = [head, rule]
    for h in hosts:
        cells = []
        for s in sizes:
            a, b = two_level(s, h, per_host, link), ring(s, h, per_host, link)
            cells.append(f"{a * 1e3:.3g} | {b * 1e3:.3g} | {b / a:.2f}")
        rows.append(f"| {h} | {h * per_host} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _fmt(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    """Prints the model's predictions (``python -m ringlet.bench model``)."""
    ap = argparse.ArgumentParser(prog="ringlet.bench model", description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="2gbit", help="each host link, each way (tc units)")
    ap.add_argument("--alpha-us", type=float, default=60.0, help="one message's latency")
    ap.add_argument("--o-us", type=float, default=4.0, help="CPU per message at each end")
    ap.add_argument("--mem-gbs", type=float, default=4.0, help="GB/s one rank copies")
    ap.add_argument("--eta", type=float, default=1448 / 1514, help="TCP payload fraction")
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--hosts", default="2,3,4,16,64,256")
    ap.add_argument("--sizes", default="4096,1048576,67108864,1073741824")
    ap.add_argument("--store-op-us", type=float, default=10.0,
                    help="the store server's time per operation")
    ap.add_argument("--store-gbs", type=float, default=1.0, help="GB/s the store server sends")
    ap.add_argument("--record-bytes", type=float, default=7.0,
                    help="compressed bytes of one rank's record in a table")
    ap.add_argument("--base-ms", type=float, default=4.0,
                    help="a process's own work to set the world up")
    ap.add_argument("--ranks-per-core", type=float, default=1.0,
                    help="ranks a machine runs per core (above 1: their own work queues)")
    ap.add_argument("--poll-ms", type=float, default=1.0,
                    help="the longest pause between a small group's polls, for a "
                         "new_group (10 on a machine with more ranks than CPUs)")
    a = ap.parse_args()
    rate = parse_rate(a.rate)
    if rate is None:
        raise SystemExit("--rate needs a number (the model has no unlimited link)")
    link = Link(rate, a.alpha_us * 1e-6, a.o_us * 1e-6, a.mem_gbs * 1e9, a.eta)
    print(f"all_reduce, {a.per_host} ranks per host, links {a.rate} each way, alpha "
          f"{a.alpha_us:g} us, o {a.o_us:g} us, {a.mem_gbs:g} GB/s per rank; ms")
    print()
    hosts = [int(h) for h in a.hosts.split(",")]
    print(table(link, a.per_host, hosts, [int(s) for s in a.sizes.split(",")]))
    store = Store(a.store_op_us * 1e-6, a.store_gbs * 1e9, a.record_bytes, a.base_ms * 1e-3,
                  a.poll_ms * 1e-3)
    print()
    print(f"start-up (last rank's init_process_group to its first 4 KiB all_reduce), s; "
          f"store {a.store_op_us:g} us per operation, {a.store_gbs:g} GB/s, "
          f"{a.record_bytes:g} bytes per record")
    print()
    print("| H | p | start-up s | new_group s |")
    print("|---:|---:|---:|---:|")
    crowd = a.ranks_per_core
    for h in hosts:
        print(f"| {h} | {h * a.per_host} | {start_up(h, a.per_host, link, store, True, crowd):.3g}"
              f" | {start_up(h, a.per_host, link, store, False, crowd):.3g} |")


if __name__ == "__main__":
    main()
