"""ringlet.rpc against torch.distributed.rpc, in the same test run.

Each scenario runs once with ``torch.distributed.rpc`` and once with
``ringlet.rpc`` (shared memory and TCP), on real processes with a hard
timeout; results and error types must agree. ringlet-only checks (reference
counting, malformed frames, the job token, dead workers) follow.
"""

from __future__ import annotations

import gc
import importlib
import os
import socket
import struct
import threading
import time
import warnings
from typing import Any

import pytest
import torch

import ringlet.rpc as rrpc

from conftest import free_port, launch

# ----------------------------------------------------------- remote functions


def _kw(a: int, b: int = 0) -> int:
    return a * 10 + b


def _whoami(rpc_name: str) -> str:
    rpc = importlib.import_module(rpc_name)
    return str(rpc.get_worker_info().name)


def my_script_add(t1, t2):
    return torch.add(t1, t2)


with warnings.catch_warnings():  # torch.jit.script is deprecated in torch 2.13
    warnings.simplefilter("ignore")
    my_script_add = torch.jit.script(my_script_add)


def _raise_value() -> None:
    raise ValueError("bad value 42")


def _wait(seconds: float) -> float:
    threading.Event().wait(seconds)  # the callee is slow on purpose
    return seconds


def _nested(rpc_name: str, to: str, x: torch.Tensor) -> torch.Tensor:
    rpc = importlib.import_module(rpc_name)
    return rpc.rpc_sync(to, torch.add, args=(x, 1)) * 2


def _async_add_chained(rpc_name: str, to: str, x: torch.Tensor, y: int, z: int) -> Any:
    rpc = importlib.import_module(rpc_name)
    return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


class Counter:
    def __init__(self, start: int) -> None:
        self.n = start

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def get(self) -> int:
        return self.n


def _rref_sum(rref: Any) -> float:
    return float(rref.to_here().sum())


def _make_rref(rpc_name: str, v: float) -> Any:
    rpc = importlib.import_module(rpc_name)
    return rpc.RRef(torch.full((3,), v))


def _rref_is_owner(rref: Any) -> tuple[bool, float]:
    return rref.is_owner(), float(rref.local_value().sum()) if rref.is_owner() else -1.0


@torch.distributed.rpc.functions.async_execution
def _chained_torch(rpc_name: str, to: str, x: torch.Tensor, y: int, z: int) -> Any:
    return _async_add_chained(rpc_name, to, x, y, z)


@rrpc.functions.async_execution
def _chained_ringlet(rpc_name: str, to: str, x: torch.Tensor, y: int, z: int) -> Any:
    return _async_add_chained(rpc_name, to, x, y, z)


def _echo(x: Any) -> Any:
    return x


def _err(f: Any) -> tuple[str, bool, str]:
    try:
        f()
    except Exception as e:
        return (type(e).__name__, isinstance(e, RuntimeError), str(e))
    return ("none", False, "")


# ---------------------------------------------------------------- scenario


def _scenario(rank: int, world: int, rpc_name: str, port: int) -> dict[str, Any]:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc = importlib.import_module(rpc_name)
    chained = _chained_ringlet if rpc_name == "ringlet.rpc" else _chained_torch
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=30)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    out: dict[str, Any] = {}
    if rank == 0:
        nxt, last = "worker1", f"worker{world - 1}"
        # The seed's examples as written.
        out["seed_sync"] = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        fut1 = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
        fut2 = rpc.rpc_async("worker1", min, args=(1, 2))
        out["seed_async"] = fut1.wait() + fut2.wait()
        rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        out["seed_remote"] = rref1.to_here() + rref2.to_here()
        out["seed_script"] = _err(lambda: rpc.rpc_sync("worker1", my_script_add,
                                                       args=(torch.ones(2), 3)))[:2]
        out["script"] = rpc.rpc_sync("worker1", my_script_add,
                                     args=(torch.ones(2), torch.ones(2)))
        # Ways to name the callee, kwargs, builtins.
        out["kwargs"] = rpc.rpc_sync(1, _kw, args=(4,), kwargs={"b": 2})
        out["by_info"] = rpc.rpc_sync(rpc.get_worker_info(nxt), _whoami, args=(rpc_name,))
        out["info"] = (rpc.get_worker_info().name, rpc.get_worker_info().id,
                       rpc.get_worker_info(last).id)
        out["max"] = rpc.rpc_sync(nxt, max, args=([3, 9, 4],))
        out["none"] = rpc.rpc_sync(nxt, _echo, args=(None,))
        # Nested calls: a third worker, and back to the caller.
        out["nested_third"] = rpc.rpc_sync(nxt, _nested, args=(rpc_name, last, torch.zeros(2)))
        out["nested_back"] = rpc.rpc_sync(nxt, _nested, args=(rpc_name, "worker0", torch.ones(2)))
        out["async_exec"] = rpc.rpc_sync(nxt, chained,
                                         args=(rpc_name, last, torch.ones(2), 1, 1))
        # Errors.
        name, is_rt, text = _err(lambda: rpc.rpc_sync(nxt, _raise_value))
        out["remote_exc"] = (is_rt, "bad value 42" in text, "Traceback" in text)
        out["remote_exc_type"] = name
        t0 = time.monotonic()
        name, is_rt, text = _err(lambda: rpc.rpc_sync(nxt, _wait, args=(3.0,), timeout=0.3))
        out["timeout"] = (is_rt, "timeout" in text, time.monotonic() - t0 < 2.5)
        name, is_rt, text = _err(lambda: rpc.rpc_async(nxt, _wait, args=(3.0,),
                                                        timeout=0.3).wait())
        out["timeout_async"] = (is_rt, "timeout" in text)
        out["timeout_zero"] = rpc.rpc_sync(nxt, _wait, args=(0.05,), timeout=0)
        out["unknown_name"] = _err(lambda: rpc.rpc_sync("nope", min, args=(1, 2)))[:2]
        out["unknown_rank"] = _err(lambda: rpc.rpc_sync(99, min, args=(1, 2)))[:2]
        out["unknown_info"] = _err(lambda: rpc.get_worker_info("nope"))[:2]
        out["meta_tensor"] = _err(lambda: rpc.rpc_sync(
            nxt, torch.add, args=(torch.ones(2, device="meta"), 1)))[:2]
        # Tensors of many sizes, dtypes and layouts.
        g = torch.Generator().manual_seed(0)
        ts = [torch.randn(n, generator=g) for n in (0, 1, 256, 1 << 18, 4 << 20)]
        ts += [torch.randn(64, 64, generator=g).double().t(),  # not contiguous
               torch.randn(1000, generator=g).bfloat16(), torch.arange(7) % 2 == 0,
               torch.randint(-100, 100, (33,), generator=g, dtype=torch.int8),
               torch.ones(2, 3, requires_grad=True)]
        back = rpc.rpc_sync(nxt, _echo, args=(ts,))
        out["echo"] = all(torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape
                          for a, b in zip(ts, back))
        out["echo_requires_grad"] = back[-1].requires_grad
        out["echo_struct"] = rpc.rpc_sync(nxt, _echo, args=({"a": (1, [ts[2]]), "b": "x"},))
        # RRefs.
        r = rpc.remote(nxt, torch.add, args=(torch.ones(2), 3))
        out["rref"] = (r.to_here(), r.owner_name(), r.owner().id, r.is_owner())
        # torch 2.13 answers False here now and then (its confirmation races
        # the fetch); ringlet's to_here waits for it. Checked, not compared.
        out["rref_confirmed"] = r.confirmed_by_owner()
        out["rref_local_value_user"] = _err(r.local_value)[:2]
        local = rpc.RRef(torch.ones(4))
        out["rref_local"] = (local.is_owner(), local.local_value().sum().item(),
                             local.to_here().sum().item(), local.owner_name())
        out["rref_arg_back_to_owner"] = rpc.rpc_sync(nxt, _rref_sum, args=(local,))
        out["rref_arg_to_owner"] = rpc.rpc_sync(nxt, _rref_is_owner, args=(r,))
        counter = rpc.remote(nxt, Counter, args=(5,))
        out["proxy_sync"] = counter.rpc_sync().add(3)
        out["proxy_async"] = counter.rpc_async().add(2).wait()
        out["proxy_remote"] = counter.remote().get().to_here()
        res = rpc.rpc_sync(nxt, _make_rref, args=(rpc_name, 2.0))
        out["rref_result"] = (res.to_here().sum().item(), res.owner_name())
        if world >= 3:
            out["rref_third"] = rpc.rpc_sync(last, _rref_sum, args=(res,))
        # Many calls in flight, and many threads at once.
        futs = [rpc.rpc_async(nxt, torch.add, args=(torch.full((2,), float(i)), 1))
                for i in range(2500)]
        out["in_flight"] = sum(float(f.wait()[0]) for f in futs)
        results: dict[int, list[int]] = {}

        def worker(k: int) -> None:
            results[k] = [rpc.rpc_sync(1 + (k % (world - 1)), _kw, args=(k, i))
                          for i in range(40)]

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["threads"] = [results[k] for k in range(8)]
        del r, counter, res, rref1, rref2
    rpc.shutdown()
    return _to_plain(out)


def _to_plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, v.tolist())
    if isinstance(v, (list, tuple)):
        return type(v)(_to_plain(x) for x in v)
    if isinstance(v, dict):
        return {k: _to_plain(x) for k, x in v.items()}
    return v


@pytest.mark.parametrize("world", [2, 4])
def test_same_as_torch(world: int) -> None:
    ref = launch(world, _scenario, "torch.distributed.rpc", free_port(), init=False,
                 timeout=150)[0]
    for transport in ("shm", "tcp"):
        got = launch(world, _scenario, "ringlet.rpc", free_port(), init=False,
                     transport=transport, timeout=150)[0]
        assert set(got) == set(ref)
        for key in ref:
            if key == "rref_confirmed":
                continue
            assert got[key] == ref[key], (transport, key, got[key], ref[key])
        assert got["remote_exc_type"] == "ValueError"
        assert got["timeout"] == (True, True, True)
        assert got["echo"] and got["rref_confirmed"]
        assert got["in_flight"] == sum(i + 1.0 for i in range(2500))


# ------------------------------------------- errors, proxies, shutdown


class MyErr(Exception):
    pass


class MyVE(ValueError):
    pass


_EXC = {"key": KeyError, "my": MyErr, "myve": MyVE, "idx": IndexError, "os": OSError,
        "type": TypeError, "rt": RuntimeError}


def _raise(kind: str, delay: float = 0.0) -> None:
    threading.Event().wait(delay)  # the fetch may overtake the failing creation
    raise _EXC[kind]("boom")


def _script_raise(x: torch.Tensor) -> torch.Tensor:
    if bool(x.sum() > 0):
        raise ValueError("script raised")
    return x


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _script_raise = torch.jit.script(_script_raise)


@torch.distributed.rpc.functions.async_execution
def _not_a_future(x: int) -> int:
    return x + 1


class _Obj:
    def boom(self) -> None:
        raise ValueError("objboom")

    def get(self) -> int:
        return 5

    @torch.distributed.rpc.functions.async_execution
    def async_add(self, rpc_name: str, to: str, x: torch.Tensor) -> Any:
        rpc = importlib.import_module(rpc_name)
        return rpc.rpc_async(to, torch.add, args=(x, 1))


def _make_obj(delay: float = 0.0) -> _Obj:
    threading.Event().wait(delay)
    return _Obj()


def _slow(seconds: float, v: int) -> int:
    threading.Event().wait(seconds)
    return v


def _exc(f: Any) -> tuple[str, bool, bool, bool, str]:
    """The exception's type name, whether it is a RuntimeError / ValueError /
    TypeError, and its message's first line."""
    try:
        f()
    except Exception as e:
        lines = str(e).splitlines()
        return (type(e).__name__, isinstance(e, RuntimeError), isinstance(e, ValueError),
                isinstance(e, TypeError), lines[0][:45] if lines else "")
    return ("none", False, False, False, "")


def _etype(f: Any) -> str:
    try:
        f()
    except Exception as e:
        return type(e).__name__
    return "none"


def _parity(rank: int, world: int, rpc_name: str, port: int) -> dict[str, Any]:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc = importlib.import_module(rpc_name)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    if rank == 1:
        rpc.rpc_sync("worker0", _wait_parity_done, timeout=0)  # until worker0 is done
        time.sleep(2.5)
        rpc.shutdown(graceful=False)
        return out
    nxt = "worker1"
    # rpc_sync / rpc_async: ValueError, TypeError or RuntimeError("<Type>: ...");
    # remote().to_here(): the remote type.
    for kind in _EXC:
        a = (kind,)
        out[f"sync_{kind}"] = _exc(lambda a=a: rpc.rpc_sync(nxt, _raise, args=a))
        out[f"async_{kind}"] = _exc(lambda a=a: rpc.rpc_async(nxt, _raise, args=a).wait())
        out[f"remote_{kind}"] = _exc(lambda a=a: rpc.remote(nxt, _raise, args=a).to_here())
        out[f"self_{kind}"] = _exc(lambda a=a: rpc.rpc_sync("worker0", _raise, args=a))
    out["remote_late_myve"] = _exc(lambda: rpc.remote(nxt, _raise, args=("myve", 0.3)).to_here())
    f = rpc.rpc_async(nxt, _raise, args=("key",))
    _exc(f.wait)
    out["value_key"] = _exc(f.value)
    out["then_value"] = "ValueError: ValueError: On" in _exc(lambda: rpc.rpc_async(
        nxt, _raise, args=("myve",)).then(lambda x: x.value()).wait())[4]
    out["script"] = _exc(lambda: rpc.rpc_sync(nxt, _script_raise, args=(torch.ones(1),)))
    bad = (torch.ones(2), torch.ones(3))
    out["builtin_op"] = (_exc(lambda: rpc.rpc_sync(nxt, torch.add, args=bad)),
                         _exc(lambda: rpc.rpc_async(nxt, torch.add, args=bad).wait()))
    out["not_a_future"] = _exc(lambda: rpc.rpc_sync(nxt, _not_a_future, args=(1,)))[:4]
    # RRef proxies.
    o = rpc.remote(nxt, _make_obj)
    out["proxy_sync_boom"] = _exc(lambda: o.rpc_sync().boom())
    out["proxy_async_boom"] = _exc(lambda: o.rpc_async().boom().wait())
    out["proxy_remote_boom"] = _exc(lambda: o.remote().boom().to_here())
    out["proxy_missing"] = _exc(lambda: o.rpc_sync().nope())
    out["proxy_get"] = (o.rpc_sync().get(), o.rpc_async().get().wait(),
                        o.remote().get().to_here())
    one = torch.ones(1)
    out["proxy_async_exec"] = (o.rpc_sync().async_add(rpc_name, "worker0", one),
                               o.rpc_async().async_add(rpc_name, "worker0", one).wait(),
                               o.remote().async_add(rpc_name, "worker0", one).to_here())
    o2 = rpc.remote(nxt, _make_obj)
    out["get_type"] = (o2._get_type(timeout=5, blocking=True) is _Obj, o2._get_type() is _Obj)
    # A remote() whose creation timed out fails at once.
    late = rpc.remote(nxt, _make_obj, args=(1.5,), timeout=0.3)
    time.sleep(0.6)
    t0 = time.monotonic()
    out["timed_out_to_here"] = _exc(late.to_here)
    out["timed_out_proxy"] = _exc(lambda: late.rpc_sync().get())
    out["timed_out_fast"] = time.monotonic() - t0 < 0.5
    time.sleep(1.2)
    # WorkerInfo is read-only and handed out as a copy.
    out["info_setattr"] = _etype(lambda: setattr(rpc.get_worker_info(), "name", "renamed"))
    out["info_same"] = rpc.get_worker_info() is rpc.get_worker_info()
    out["info_after"] = (rpc.get_worker_info().name, rpc.get_worker_info(nxt).id)
    if rpc_name == "ringlet.rpc":  # still catchable as the remote type
        try:
            rpc.rpc_sync(nxt, _raise, args=("key",))
        except KeyError as e:
            out["catch_key"] = isinstance(e, RuntimeError)
        try:
            rpc.rpc_async(nxt, _raise, args=("my",)).wait()
        except MyErr as e:
            out["catch_my"] = isinstance(e, RuntimeError)
    # An abrupt shutdown fails the calls still pending at once; then RPC is
    # uninitialized.
    _parity_done.set()
    pending = rpc.rpc_async(nxt, _slow, args=(2.0, 7))
    time.sleep(0.2)
    rpc.shutdown(graceful=False)
    out["ungraceful_done"] = pending.done()
    out["ungraceful_wait"] = _exc(pending.wait)[:4]
    out["second_shutdown"] = _exc(rpc.shutdown)[:4]
    return _to_plain(out)


_parity_done = threading.Event()


def _wait_parity_done() -> None:
    _parity_done.wait(100)


def test_errors_proxies_shutdown_as_torch() -> None:
    ref = launch(2, _parity, "torch.distributed.rpc", free_port(), init=False, timeout=120)[0]
    got = launch(2, _parity, "ringlet.rpc", free_port(), init=False, timeout=120)[0]
    assert set(got) == set(ref) | {"catch_key", "catch_my"}
    for key in ref:
        assert got[key] == ref[key], (key, got[key], ref[key])
    assert got["sync_key"][:4] == ("RuntimeError", True, False, False)
    assert got["sync_key"][4].startswith("KeyError: ")
    assert got["async_myve"][:4] == ("ValueError", False, True, False)
    assert got["remote_late_myve"][:3] == ("MyVE", False, True)
    assert got["proxy_sync_boom"][:3] == ("ValueError", False, True)
    assert got["proxy_missing"][0] == "AttributeError"
    assert got["proxy_async_exec"] == (("tensor", torch.float32, [2.0]),) * 3
    assert got["timed_out_to_here"][0] == "RuntimeError" and got["timed_out_fast"]
    assert got["info_setattr"] == "AttributeError" and got["info_same"] is False
    assert got["catch_key"] and got["catch_my"]
    assert got["ungraceful_done"] and got["ungraceful_wait"][:2] == ("RuntimeError", True)
    assert got["second_shutdown"][:2] == ("RuntimeError", True)


# --------------------------------------------------------- ringlet-only


def _owner_table_size() -> int:
    from ringlet.rpc import rref

    gc.collect()
    return len(rref._owners)


def _refused() -> int:
    return int(rrpc._get_current_rpc_agent().refused())


def _my_port() -> int:
    return int(rrpc._get_current_rpc_agent().port)


def _exit_now() -> None:
    os._exit(3)


def _relay(to: str) -> Any:
    return rrpc.rpc_sync(to, _exit_now)


def _good_header(payload_len: int) -> bytes:
    """A valid request header (same check word as rust/ringlet-core/src/rpc/frame.rs)."""
    words = [1, 0, 7, payload_len, 0, 0]
    x = 0x9E3779B97F4A7C15
    for w in words:
        x = ((x ^ w) * 0x100000001B3) & (2**64 - 1)
        x = ((x << 29) | (x >> 35)) & (2**64 - 1)
    return struct.pack("<IBBHQQIIQQ", 0x52504331, 1, 0, 0, 7, payload_len, 0, 0, 0, x)


def _ringlet_only(rank: int, world: int, port: int) -> dict[str, Any]:
    from ringlet.rpc import rref as rref_mod

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    out: dict[str, Any] = {}
    rrpc.init_rpc(f"w{rank}", rank=rank, world_size=world)
    if rank == 0:
        # Reference counting: the owner frees the value once nobody holds it.
        base = rrpc.rpc_sync("w1", _owner_table_size)
        held = [rrpc.remote("w1", torch.ones, args=(3,)) for _ in range(5)]
        for h in held:
            h.to_here()
        out["held"] = rrpc.rpc_sync("w1", _owner_table_size) - base
        shared = held[0]
        out["forked"] = rrpc.rpc_sync("w2", _rref_sum, args=(shared,))
        del held, h, shared
        rref_mod._release_all(10.0)
        out["released"] = rrpc.rpc_sync("w1", _owner_table_size) - base
        # A malformed request fails that call only.
        out["malformed"] = _err(lambda: rrpc.api._send_raw("w1", b"\x80garbage").wait())[:2]
        out["after_malformed"] = rrpc.rpc_sync("w1", min, args=(4, 5))
        # A connection without the token is refused (the server closes it).
        port1 = rrpc.rpc_sync("w1", _my_port)
        before = rrpc.rpc_sync("w1", _refused)
        with socket.create_connection(("127.0.0.1", port1), timeout=10) as s:
            s.sendall(struct.pack("<4Q", 0x5249_4E47_5250_4301, 12345, 0, os.getpid()))
            out["bad_token_eof"] = s.recv(16) == b""
        out["refused"] = rrpc.rpc_sync("w1", _refused) - before
        out["after_refused"] = rrpc.rpc_sync("w1", min, args=(7, 5))
        # With the token: garbage after the greeting, then a truncated frame.
        st = rrpc.api._require()
        token = int(bytes(st.store.get(f"{st.prefix}/token")).decode())
        hello = struct.pack("<4Q", 0x5249_4E47_5250_4301, token, 0, os.getpid())
        for junk in (b"\xff" * 48, _good_header(payload_len=1 << 33) + b"\x80\x05 only part"):
            with socket.create_connection(("127.0.0.1", port1), timeout=10) as s:
                s.sendall(hello)
                s.recv(32)  # the server's greeting
                s.sendall(junk)
                if junk[0] == 0xFF:
                    out["garbage_closed"] = s.recv(16) == b""
        out["after_junk"] = rrpc.rpc_sync("w1", min, args=(8, 9))
        # A worker that dies fails the calls that depend on it, everywhere.
        victim = rrpc.remote("w2", torch.ones, args=(2,))
        victim.to_here()
        t0 = time.monotonic()
        out["relay"] = _err(lambda: rrpc.rpc_sync("w1", _relay, args=("w2",)))
        out["direct"] = _err(lambda: rrpc.rpc_sync("w2", min, args=(1, 2)))[:2]
        out["rref_fetch"] = _err(victim.to_here)
        out["fault_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        _done.set()
        rrpc.shutdown(graceful=False)
        out["ungraceful_s"] = time.monotonic() - t0
    elif rank == 1:
        # Stays up until rank 0 is done with it, then leaves at once.
        try:
            rrpc.rpc_sync("w0", _wait_for_rank0_done)
        except RuntimeError:
            pass  # w0 may close first
        rrpc.shutdown(graceful=False)
    else:
        threading.Event().wait(60)  # killed by w1's relayed call long before
    return out


_done = threading.Event()


def _wait_for_rank0_done() -> None:
    # w0's ungraceful shutdown closes the connection: the call fails then.
    _done.wait(30)


def test_ringlet_only_refcount_frames_token_faults() -> None:
    out = launch(3, _ringlet_only, free_port(), init=False, expect_dead=(1, 2),
                 timeout=120)
    r = out[0]
    assert r["held"] == 5
    assert r["forked"] == 3.0
    assert r["released"] == 0
    assert r["malformed"][1] is True
    assert r["after_malformed"] == 4
    assert r["bad_token_eof"] and r["refused"] == 1 and r["after_refused"] == 5
    assert r["garbage_closed"] and r["after_junk"] == 8
    _name, is_rt, text = r["relay"]
    assert is_rt and "w2" in text, r["relay"]
    assert r["direct"][1] is True
    assert r["rref_fetch"][1] and "w2" in r["rref_fetch"][2], r["rref_fetch"]
    assert r["fault_s"] < 10
    assert r["ungraceful_s"] < 2


def test_init_errors() -> None:
    with pytest.raises(RuntimeError):
        rrpc.init_rpc("bad name!", rank=0, world_size=1)
    with pytest.raises(RuntimeError):
        rrpc.init_rpc("x" * 128, rank=0, world_size=1)
    with pytest.raises(RuntimeError):
        rrpc.get_worker_info()
    with pytest.raises(RuntimeError, match="has not been initialized"):
        rrpc.shutdown()  # before init_rpc, as torch


def test_constants_and_options_as_torch() -> None:
    import torch.distributed.rpc as trpc
    import torch.distributed.rpc.constants as tconst

    from ringlet.rpc import constants

    names = [n for n in dir(tconst) if n.isupper() or n.startswith("_D") or n.startswith("_U")]
    assert {n: getattr(constants, n) for n in names} == {n: getattr(tconst, n) for n in names}
    ours, theirs = rrpc.TensorPipeRpcBackendOptions(), trpc.TensorPipeRpcBackendOptions()
    assert (ours.device_maps, ours.devices) == (theirs.device_maps, theirs.devices) == ({}, [])
    ours.set_device_map("w1", {"cpu": "cpu"})
    theirs.set_device_map("w1", {"cpu": "cpu"})
    assert ours.device_maps == theirs.device_maps
    assert rrpc.autograd.is_available() is True


def _dup(rank: int, world: int, port: int) -> str:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        rrpc.init_rpc("same", rank=rank, world_size=world)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_duplicate_name() -> None:
    out = launch(2, _dup, free_port(), init=False, timeout=60)
    assert all("unique" in v for v in out.values()), out


# ------------------------- init checks, agent helpers, tensor layouts


def _non_cont(t_view: torch.Tensor, t_cont: torch.Tensor) -> tuple[Any, ...]:
    return (t_view.is_contiguous(), t_view.stride(), t_cont.is_contiguous(),
            torch.equal(t_view, t_cont))


def _layout(*ts: torch.Tensor) -> list[Any]:
    ptrs = [t.untyped_storage().data_ptr() for t in ts]
    return [(tuple(t.stride()), t.storage_offset(), t.untyped_storage().nbytes(),
             ptrs.index(p), t.tolist()) for t, p in zip(ts, ptrs)]


def _bump_first(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    a.add_(100)  # b shares a's storage on arrival as at the caller
    return b.tolist()


def _ret_view() -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.arange(10.0)
    return base[2:5], base.view(2, 5).t()


def _ret_lock() -> Any:
    return threading.Lock()


class _DieBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise ValueError("backward boom")


def _die_back(x: torch.Tensor) -> torch.Tensor:
    return _DieBack.apply(x)


def _known_ids(rpc_name: str, ag_name: str, cid: int) -> tuple[int, ...]:
    ag = importlib.import_module(ag_name)
    return tuple(sorted(ag._retrieve_context(cid)._known_worker_ids()))


def _init_agent_tensors(rank: int, world: int, rpc_name: str, store_file: str) -> dict[str, Any]:
    rpc = importlib.import_module(rpc_name)
    ag_name = ("torch.distributed.autograd" if rpc_name.startswith("torch")
               else "ringlet.rpc.autograd")
    ag = importlib.import_module(ag_name)
    name = f"worker{rank}"
    out: dict[str, Any] = {}
    # Before init_rpc: argument checks and helpers.
    out["pre_set"] = rpc._is_current_rpc_agent_set()
    out["pre_timeout"] = _exc(rpc.get_rpc_timeout)[:2]
    out["pre_agent"] = _exc(rpc._get_current_rpc_agent)
    out["pre_rref"] = _exc(lambda: rpc.RRef(1))
    out["bad_backend"] = _exc(lambda: rpc.init_rpc(name, backend="TENSORPIPE", rank=rank,
                                                    world_size=world))
    out["bad_options"] = _exc(lambda: rpc.init_rpc(
        name, rank=rank, world_size=world, rpc_backend_options={"init_method": "env://"}))

    class Foo(rpc.RpcBackendOptions):
        def __init__(self) -> None:
            rpc.RpcBackendOptions.__init__(self)
            self.init_method = f"file://{store_file}.foo"

    out["foo_options"] = _exc(lambda: rpc.init_rpc(name, rank=rank, world_size=world,
                                                    rpc_backend_options=Foo()))
    out["foo_options_tp"] = _exc(lambda: rpc.init_rpc(
        name, backend=rpc.BackendType.TENSORPIPE, rank=rank, world_size=world,
        rpc_backend_options=Foo()))
    out["names"] = [_exc(lambda n=n: rpc.WorkerInfo(n, 0)) for n in ("abc*", " ", "", "a" * 500)]
    out["backend_repr"] = repr(rpc.BackendType.TENSORPIPE)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=9, rpc_timeout=25,
                                           init_method=f"file://{store_file}")
    rpc.init_rpc(name, backend=rpc.BackendType.TENSORPIPE, rank=rank, world_size=world,
                 rpc_backend_options=opts)
    out["twice"] = _exc(lambda: rpc.init_rpc(name, rank=rank, world_size=world,
                                             rpc_backend_options=opts))[:2]
    out["is_set"] = rpc._is_current_rpc_agent_set()
    out["timeout"] = rpc.get_rpc_timeout()
    agent = rpc._get_current_rpc_agent()
    out["threads"] = agent.get_debug_info()["agent.thread_pool_size"]
    out["infos"] = sorted((w.name, w.id) for w in agent.get_worker_infos())
    out["info"] = (agent.get_worker_info().name, agent.get_worker_info("worker1").id,
                   agent.get_worker_info(1).name)
    out["all_gather"] = rpc.api._all_gather((rank, name))
    rpc.api._wait_all_workers()
    rpc.api._barrier([f"worker{r}" for r in range(world)])
    if rank == 0:
        w1 = "worker1"
        rpc._set_rpc_timeout(7.5)
        out["set_timeout"] = rpc.get_rpc_timeout()
        t0 = time.monotonic()
        out["negative_timeout"] = _exc(lambda: rpc.rpc_sync(w1, _slow, args=(0.5, 1),
                                                            timeout=-5))[:2]
        out["negative_fast"] = time.monotonic() - t0 < 0.45
        out["timeout_zero"] = rpc.rpc_sync(w1, _slow, args=(0.05, 2), timeout=0)
        # Tensors keep their layout: the whole storage travels (views share
        # it) unless it is large and mostly unused.
        t = torch.rand(5, 5)
        out["non_cont"] = rpc.rpc_sync(w1, _non_cont, args=(t.narrow(1, 2, 2),
                                                            t.narrow(1, 2, 2).contiguous()))
        back = rpc.rpc_sync(w1, _echo, args=(t.narrow(1, 2, 2),))
        out["non_cont_back"] = (back.is_contiguous(), back.stride(),
                                torch.equal(back, t.narrow(1, 2, 2)))
        base = torch.arange(12.0)
        big = torch.arange(4096.0)
        out["layout"] = rpc.rpc_sync(w1, _layout, args=(
            base[2:5], base.view(3, 4).t(), base, torch.ones(3, 1).expand(3, 4),
            big[10:20], big[::2], torch.ones(2, dtype=torch.complex64).conj()))
        out["shared_storage"] = rpc.rpc_sync(w1, _bump_first, args=(base[:4], base[2:6]))
        out["ret_view"] = [(v.stride(), v.storage_offset(), v.tolist())
                           for v in rpc.rpc_sync(w1, _ret_view)]
        # A result that cannot be pickled: RuntimeError("<Type>: ...") everywhere.
        out["unpicklable"] = (_exc(lambda: rpc.rpc_sync(w1, _ret_lock)),
                              _exc(lambda: rpc.rpc_async(w1, _ret_lock).wait()),
                              _exc(lambda: rpc.remote(w1, _ret_lock).to_here()))
        # RRefs.
        out["type_hint"] = _exc(lambda: rpc.RRef(3, type_hint=int))
        r = rpc.remote(w1, torch.mul, args=(torch.ones(2, requires_grad=True), 2))
        out["user_backward"] = _exc(r.backward)
        bad = rpc.remote(w1, _raise, args=("my",))
        out["failed_to_here"] = _exc(bad.to_here)[0]
        out["failed_confirmed"] = bad.confirmed_by_owner()
        # dist_autograd's context helpers and an error two nodes away.
        out["no_context"] = _exc(ag._current_context)[:2]
        out["max_id"] = ag._get_max_id() == (1 << 48) - 1
        x = torch.ones(2, requires_grad=True)
        with ag.context() as cid:
            out["ctx_id"] = ag._current_context()._context_id() == cid
            out["ctx_retrieve"] = ag._retrieve_context(cid)._context_id() == cid
            rpc.rpc_sync(w1, torch.add, args=(torch.ones(1), 1))  # no context: no grad
            out["known_ids_builtin"] = sorted(ag._current_context()._known_worker_ids())
            out["known_ids_w1"] = rpc.rpc_sync(w1, _known_ids, args=(rpc_name, ag_name, cid))
            out["known_ids"] = sorted(ag._current_context()._known_worker_ids())
            loss = rpc.rpc_sync(w1, _die_back, args=(x,)).sum()
            out["backward_error"] = _exc(lambda: ag.backward(cid, [loss]))
        out["ctx_gone"] = _exc(lambda: ag._retrieve_context(cid))
        del r, bad
    rpc.shutdown()
    out["post_set"] = rpc._is_current_rpc_agent_set()
    return _to_plain(out)


def test_init_agent_tensors_as_torch(tmp_path: Any) -> None:
    ref = launch(2, _init_agent_tensors, "torch.distributed.rpc", str(tmp_path / "t"),
                 init=False, timeout=120)
    got = launch(2, _init_agent_tensors, "ringlet.rpc", str(tmp_path / "r"), init=False,
                 timeout=120)
    for rank in (0, 1):
        assert set(got[rank]) == set(ref[rank])
        for key in ref[rank]:
            if key == "failed_confirmed":
                continue  # torch's confirmation races the failed fetch; checked below
            if key in ("pre_agent", "pre_rref", "names", "unpicklable", "type_hint",
                       "user_backward", "backward_error", "ctx_gone", "bad_backend",
                       "bad_options", "foo_options", "foo_options_tp"):
                # ringlet's wording may differ after the first words; the type
                # and what the message starts with agree.
                for a, b in zip(got[rank][key] if key in ("names", "unpicklable") else
                                [got[rank][key]],
                                ref[rank][key] if key in ("names", "unpicklable") else
                                [ref[rank][key]]):
                    assert a[:4] == b[:4] and a[4][:25] == b[4][:25], (key, a, b)
                continue
            assert got[rank][key] == ref[rank][key], (rank, key, got[rank][key], ref[rank][key])
    r = got[0]
    assert r["bad_backend"][:2] == ("TypeError", False)
    assert r["foo_options"][4].startswith("Could not infer backend")
    assert [n[0] for n in r["names"]] == ["RuntimeError"] * 4
    assert r["timeout"] == 25.0 and r["set_timeout"] == 7.5 and r["threads"] == "9"
    assert r["all_gather"] == {"worker0": (0, "worker0"), "worker1": (1, "worker1")}
    assert r["negative_timeout"] == ("RuntimeError", True) and r["negative_fast"]
    assert r["non_cont"] == (False, (5, 1), True, True)
    assert r["layout"][1][0] == (1, 4) and r["layout"][0][3] == r["layout"][2][3]
    assert r["shared_storage"] == [102.0, 103.0, 4.0, 5.0]
    assert r["unpicklable"][2][:2] == ("RuntimeError", True)
    assert r["unpicklable"][2][4].startswith("TypeError: cannot pickle")
    assert r["failed_confirmed"] is True
    assert r["backward_error"][4] == "Error on Node 0: Error on Node 1: backward bo"
    assert r["known_ids_builtin"] == [] and r["known_ids"] == [1] and r["known_ids_w1"] == ()
