"""The job's rendezvous on a key-value store (a torch ``TCPStore``): opening
it without hanging on a port another process holds, waiting for keys
without flooding the server, and the one exchange a group's members make to
learn each other's addresses. :mod:`.connection` connects groups with it.

Example:
  >>> store = make_store("127.0.0.1", 29500, rank, world, timeout=60.0)
  >>> await_keys(store, ["ready/0", "ready/1"], timeout=60.0)
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
import zlib
from datetime import timedelta
from typing import Any, Callable, Optional

from ..errors import CollectiveTimeoutError


def cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def make_store(addr: str, port: int, rank: int, world: int, timeout: float) -> Any:
    from torch.distributed import TCPStore

    td = timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent hosts the store; every worker is a client.
        return open_store(
            lambda: TCPStore(addr, port, None, False, td, wait_for_workers=False),
            addr,
            port,
            rank,
            False,
            timeout,
        )
    return open_store(
        lambda: TCPStore(
            addr, port, world, rank == 0, td, wait_for_workers=False, multi_tenant=True
        ),
        addr,
        port,
        rank,
        rank == 0,
        timeout,
    )


def open_store(
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
            holder = port_holder(addr, port, min(1.0, timeout / 2))
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


def accepts(addr: str, port: int, timeout: float) -> bool:
    """Whether something accepts TCP connections at ``addr:port``."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_holder(addr: str, port: int, timeout: float) -> str:
    """What holds ``port`` at ``addr``, in words, found within about
    2 x ``timeout`` s: another job's torch store (it answers a store client),
    a program that accepts connections and does not answer as one, or one
    that has the port without accepting connections at ``addr``."""
    if not accepts(addr, port, timeout):
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


def timed_out(mine: int, who: int, timeout: float, key: str, why: str) -> CollectiveTimeoutError:
    # " Timed out " as torch's backends say it (its tests and log scrapers
    # look for it), then ringlet's rank and culprit.
    err = CollectiveTimeoutError(
        f"rank {mine}: Timed out waiting for rank {who}: rank {who} did not join "
        f"within {timeout:g}s (connecting {key!r}): {why}"
    )
    err.rank, err.culprit, err.cause = mine, who, "timeout"
    return err


def store_address(store: Any) -> str:
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
    why = f"the store{store_address(store)} answers, but rank {who} never registered in it"
    if first:
        why += (
            f": rank {who} did not start, failed before joining (see its error), or could "
            "not listen on the port because another job holds it, and this store is that "
            "job's: pick another MASTER_PORT"
        )
    return timed_out(mine, who, timeout, key, why)


def poll_floor() -> float:
    """The longest pause between polls of a small group's wait: 1 ms where
    the launcher says this machine runs no more of the job's ranks than the
    process has CPUs (``LOCAL_WORLD_SIZE`` from torchrun,
    ``OMPI_COMM_WORLD_LOCAL_SIZE`` from Open MPI), else 10 ms: ranks still
    starting on a crowded machine would lose turns to the polls (and where
    the launcher does not say, the machine may be crowded)."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        raw = os.environ.get(name, "")
        if raw.isdigit() and int(raw) > 0:  # the launcher's, not ours: never raise on it
            return 1e-3 if int(raw) <= cores() else 1e-2
    return 1e-2


def await_keys(store: Any, keys: list[str], timeout: float, waiters: int = 1,
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
    and then at most every 1 or 10 ms (``poll_floor``), or every
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
    most = max(poll_floor(), waiters * 2e-5)
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(keys)} key(s) from {keys[0]!r} not set within {timeout:g}s")
        time.sleep(pause)
        pause = min(2 * pause, most)


def get_all(store: Any, keys: list[str]) -> list[bytes]:
    """``store.multi_get`` (one round trip), or one get per key where the
    store has none."""
    try:
        return [bytes(v) for v in store.multi_get(keys)]
    except (AttributeError, NotImplementedError, RuntimeError):
        return [bytes(store.get(k)) for k in keys]


def pack(table: dict[str, Any]) -> bytes:
    """A group's table as the store keeps it: JSON, compressed (records of
    ranks on one host differ in little but the port: at 8,192 ranks about 7
    bytes a rank instead of 120, and every rank reads the whole table)."""
    return zlib.compress(json.dumps(table).encode(), 6)


def exchange(
    store: Any, key: str, group_rank: int, group_size: int, me: dict[str, str],
    timeout: float, members: Optional[list[int]] = None, block: bool = False,
) -> tuple[list[dict[str, str]], int]:
    """Every rank's record (address, host, machine) to every rank of the
    group, and the group's token, in a constant number of store operations
    per rank: the others set their record, rank 0 waits for all of them,
    reads them in one ``multi_get`` and publishes the table under one key,
    which the others wait for and read (compressed, see ``pack``; 3
    operations on rank 0, 2 on the others, plus the polls of one check
    while waiting; before, every
    rank polled and read every other rank's key: 2p^2 operations on one
    server per group). A rank that never sets its record is named by rank 0
    in the table, so every rank raises naming it; a missing rank 0 is named
    by the others' own wait. With ``block`` the waits are blocking
    ``wait``s (see ``await_keys``)."""
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
            await_keys(store, keys, timeout, group_size, block)
        except TimeoutError as e:
            late = next((r for r in range(1, group_size)
                         if not store.check([f"{key}/peer/{r}"])), 1)
            store.set(table, pack({"missing": late, "why": str(e)}))
            raise timed_out(mine, glob[late], timeout, key, str(e)) from None
        peers = [me] + [json.loads(v) for v in get_all(store, keys)]
        store.set(table, pack({"peers": peers, "token": token}))
        return peers, token
    try:
        await_keys(store, [table], timeout, group_size, block)
    except TimeoutError as e:
        if not store.check([f"{key}/peer/0"]):
            # Rank 0 never registered: no verdict of its own is coming.
            raise _never_registered(store, mine, glob[0], timeout, key, block) from None
        # Rank 0 is there: its verdict on a missing rank arrives before this
        # wait gives up on rank 0 itself.
        try:
            await_keys(store, [table], min(5.0, 1.0 + 0.1 * timeout), group_size, block)
        except TimeoutError:
            raise timed_out(mine, glob[0], timeout, key, str(e)) from None
    got = json.loads(zlib.decompress(bytes(store.get(table))))
    if "missing" in got:
        raise timed_out(mine, glob[int(got["missing"])], timeout, key, str(got["why"]))
    return list(got["peers"]), int(got["token"])
