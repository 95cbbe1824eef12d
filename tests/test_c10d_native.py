"""The native C++ torch.distributed Backend (``ringlet.distributed._native``), on real
processes, against gloo in the same run: which door a group takes (and the
Python ``ProcessGroup`` fallback), ``cpu:ringlet,cuda:gloo``, issue order
between operations that take the C ABI and operations the Python group runs,
``shrink_group`` after a rank is killed (a DDP training continues to the
result a fresh gloo run on the survivors gives), ``_set_pg_timeout``, and
``torch.ops.ringlet.all_reduce_``.

The first test that needs the extension builds it (conftest's session
fixture does it before any rank starts); tests of the native path skip, with
the reason, where it cannot be built."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, launch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def _native_or_skip() -> None:
    from ringlet.distributed import _native

    if _native.load() is None:
        pytest.skip(f"the native backend is not available here: {_native.reason()}")


def _init(rank: int, world: int, port: int, backend: str = "ringlet") -> None:
    import ringlet  # noqa: F401  (registers the backend)

    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )


def _ints(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers (sums and products stay exact in every dtype)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randint(1, 4, (n,), generator=g).to(dtype)


# -- which door ------------------------------------------------------------------


def _identity_job(rank: int, world: int, port: int, spec: str) -> dict[str, Any]:
    from ringlet.distributed.c10d import backend_kind, python_group

    _init(rank, world, port, spec)
    pg = dist.group.WORLD
    # A Python ProcessGroup has no Backend to return (torch raises)
    cpu = pg._get_backend(torch.device("cpu")) if backend_kind() == "native" else None
    gloo = dist.new_group(backend="gloo")
    t, ref = torch.arange(6.0) * (rank + 1), torch.arange(6.0) * (rank + 1)
    dist.all_reduce(t)
    dist.all_reduce(ref, group=gloo)
    assert torch.equal(t, ref)
    # the in-place operator, on either group, called straight into torch's C++ entry
    u = torch.arange(3.0) * (rank + 1)
    torch.ops.ringlet.all_reduce_(u)
    assert torch.equal(u, torch.arange(3.0) * (world * (world + 1) // 2)), u
    out = {
        "op_packet": type(torch.ops.ringlet.all_reduce_).__name__,
        "kind": backend_kind(), "group_type": type(pg).__name__,
        "cpu_backend": type(cpu).__name__, "repr": repr(cpu),
        "python_repr": repr(python_group()), "backend": dist.get_backend(),
        "devices": sorted(d.type for d in pg._device_types),
    }
    dist.destroy_process_group()
    return out


def test_the_native_backend_is_the_groups_cpu_backend() -> None:
    """``init_process_group("ringlet")`` builds torch's own ProcessGroup with
    ringlet's C++ Backend for the CPU (what ``_get_backend`` returns, so
    ``shrink_group`` and ``"cpu:ringlet,cuda:nccl"`` work); the Python group
    behind it says so."""
    _native_or_skip()
    out = launch(2, _identity_job, free_port(), "ringlet", init=False, timeout=120)
    for r in range(2):
        o = out[r]
        assert o["kind"] == "native" and o["group_type"] == "ProcessGroup", o
        assert o["cpu_backend"] == "RingletBackend", o
        assert o["op_packet"] == "_DirectPacket", o
        assert o["repr"].startswith(f"RingletBackend(native, rank={r}, size=2"), o
        assert "backend='native'" in o["python_repr"], o
        assert o["backend"] == "ringlet" and o["devices"] == ["cpu"], o


def test_mixed_backend_string_puts_cpu_tensors_on_ringlet() -> None:
    """``cpu:ringlet,cuda:gloo`` (CI has no GPU; on a GPU machine
    ``cpu:ringlet,cuda:nccl`` works the same way): the CPU backend is
    ringlet's, the CUDA one gloo's."""
    _native_or_skip()
    out = launch(2, _identity_job, free_port(), "cpu:ringlet,cuda:gloo", init=False, timeout=120)
    for r in range(2):
        assert out[r]["cpu_backend"] == "RingletBackend", out[r]
        assert out[r]["devices"] == ["cpu", "cuda"], out[r]
        assert out[r]["backend"] == "cpu:ringlet,cuda:gloo", out[r]


def test_python_process_group_fallback_says_so() -> None:
    """With ``RINGLET_NATIVE=0`` (as where nothing can compile the C++
    Backend) the group is the Python ProcessGroup and says which it is."""
    out = launch(2, _identity_job, free_port(), "ringlet", init=False, timeout=120,
                 env={"RINGLET_NATIVE": "0"})
    for r in range(2):
        o = out[r]
        assert o["kind"] == "python" and o["group_type"] == "ProcessGroupRinglet", o
        assert o["op_packet"] == "_DirectPacket", o
        assert "backend='python'" in o["python_repr"], o


_FIRST_USE = """
import pathlib, time, torch, torch.distributed as dist
import ringlet.distributed.c10d
from ringlet.distributed import _native
_native._PREBUILT = pathlib.Path("/nonexistent")  # as a torch the wheel has no library for
t = time.monotonic()
dist.init_process_group("ringlet", store=dist.HashStore(), rank=0, world_size=1)
x = torch.arange(4.0)
dist.all_reduce(x)
assert x.tolist() == [0.0, 1.0, 2.0, 3.0], x
print(ringlet.distributed.c10d.backend_kind(), round(time.monotonic() - t, 3), _native.reason(),
      sep="|")
dist.destroy_process_group()
"""


def test_first_use_builds_in_the_background_and_later_processes_go_native(tmp_path: Any) -> None:
    """With no library built for this torch (a fresh extension directory, and
    the wheel's prebuilt library out of sight), the first group does not wait
    for a compiler: it runs on the Python
    ProcessGroup, says why, and one detached build starts; a process that
    starts after that build is done gets the native Backend."""
    import subprocess
    import sys

    from ringlet.distributed import _native

    if _native.load() is None:
        pytest.skip(f"the native backend is not available here: {_native.reason()}")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), RINGLET_NATIVE="auto")

    def run() -> list[str]:
        done = subprocess.run([sys.executable, "-c", _FIRST_USE], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1].split("|")

    kind, secs, why = run()
    assert kind == "python" and "background" in why, (kind, why)
    assert float(secs) < 20, secs  # no compile on the way (a compile takes 25 s and more)
    name = _native.library_name()
    marker = tmp_path / f"{name}.building"
    deadline = time.monotonic() + 300
    while marker.exists() and time.monotonic() < deadline:  # the build's own end marks it
        time.sleep(0.5)
    assert not marker.exists(), "the background build did not finish within 300 s"
    assert (tmp_path / name / f"{name}.so").is_file(), sorted(p.name for p in tmp_path.iterdir())
    kind, _, why = run()
    assert kind == "native", (kind, why)


# -- without the native Backend: said once, with the reason; a failed build remembered --

_FAKE_CXX = """#!/bin/sh
case "$1" in --version|-v|-dumpversion) echo "g++ (fake) 12.2.0"; exit 0;; esac
echo "$0" >> "$(dirname "$0")/calls"
echo "backend.cpp:1:1: error: simulated compiler failure" >&2
exit 1
"""


def _fake_compiler(tmp_path: Any) -> Any:
    """A ``CXX`` that answers torch's version check and fails every compile
    with its own error line, counting the compiles in ``calls`` beside it."""
    cxx = tmp_path / "bin" / "cxx"
    cxx.parent.mkdir()
    cxx.write_text(_FAKE_CXX)
    cxx.chmod(0o755)
    return cxx


def _compiles(cxx: Any) -> int:
    calls = cxx.parent / "calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def _wait_for_background_build(cache: Any) -> None:
    """Until the detached build's own marker (``<name>.building``) is gone."""
    deadline = time.monotonic() + 120
    while any(cache.glob("*.building")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(cache.glob("*.building")), "the background build did not end within 120 s"


_OTHER_TORCH = "2.12.0+cpu"


def _other_torch_job(rank: int, world: int, port: int) -> dict[str, Any]:
    """Acts out a torch the wheel has no library for (``_native`` compares
    ``_torch_version()``), keeps the ``ringlet`` logger's warnings, makes the
    default group and one more ringlet group, and runs a collective."""
    import logging

    from ringlet.distributed import _native
    from ringlet.distributed.c10d import backend_kind

    _native._torch_version = lambda: _OTHER_TORCH
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                said.append(record.getMessage())

    logging.getLogger("ringlet").addHandler(Keep())
    _init(rank, world, port)
    sub = dist.new_group(backend="ringlet")
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=sub)
    assert t.tolist() == [3.0] * 3, t
    out = {"said": said, "kind": backend_kind(), "reason": _native.reason()}
    dist.destroy_process_group()
    return out


def test_a_torch_without_a_prebuilt_library_falls_back_once_with_the_reason(
    tmp_path: Any,
) -> None:
    """2 ranks under a torch whose version differs from the wheel's
    (simulated): both run on the Python ProcessGroup; rank 0 alone says so,
    once for its two groups, with the reason (no library for that torch, a
    build under way and its log), what the Python group lacks and how to fix
    it; rank 1 says nothing."""
    cache = tmp_path / "ext"
    cxx = _fake_compiler(tmp_path)
    out = launch(2, _other_torch_job, free_port(), init=False, timeout=120,
                 env={"TORCH_EXTENSIONS_DIR": str(cache), "CXX": str(cxx),
                      "RINGLET_NATIVE": "auto"})
    _wait_for_background_build(cache)  # the one build the ranks started, failing at once
    assert out[0]["kind"] == out[1]["kind"] == "python", out
    assert len(out[0]["said"]) == 1 and out[1]["said"] == [], out
    msg = out[0]["said"][0]
    assert "runs on the Python ProcessGroup" in msg and out[0]["reason"] in msg, msg
    assert f"torch {_OTHER_TORCH}" in msg and "background process" in msg, msg
    assert f"log: {cache}" in msg, msg
    for lacks in ("'cpu:ringlet,cuda:nccl'", "dist.shrink_group", "RINGLET_NATIVE=0"):
        assert lacks in msg, (lacks, msg)
    assert _compiles(cxx) >= 1  # the background build did run the compiler


_ONE_RANK = """
import json, sys, torch, torch.distributed as dist
import ringlet.distributed.c10d
from ringlet.distributed import _native
_native._torch_version = lambda: "2.12.0+cpu"
try:
    dist.init_process_group("ringlet", store=dist.HashStore(), rank=0, world_size=1)
except RuntimeError as e:
    print(json.dumps({"raised": str(e)}))
    sys.exit(0)
dist.new_group(backend="ringlet")
x = torch.arange(4.0)
dist.all_reduce(x)
assert x.tolist() == [0.0, 1.0, 2.0, 3.0], x
print(json.dumps({"kind": ringlet.distributed.c10d.backend_kind(), "reason": _native.reason()}))
dist.destroy_process_group()
"""


def test_a_failed_build_is_remembered_until_the_environment_changes(tmp_path: Any) -> None:
    """A compiler that fails (``CXX`` a script that prints an error and exits
    1) in a fresh extension directory: the first process starts the
    background build, which fails and leaves ``<name>.failed``; the next
    process is not built for again and warns once with the compiler's own
    error line and the log's path; ``RINGLET_NATIVE=0`` silences it;
    changing the environment (``CXXFLAGS``) builds again;
    ``RINGLET_NATIVE=1`` raises with the compiler's error, not its command."""
    import json
    import subprocess
    import sys

    cache = tmp_path / "ext"
    cxx = _fake_compiler(tmp_path)
    base = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache), CXX=str(cxx),
                RINGLET_NATIVE="auto")
    warning = "runs on the Python ProcessGroup"

    def run(**extra: str) -> tuple[dict[str, Any], str]:
        done = subprocess.run([sys.executable, "-c", _ONE_RANK], env={**base, **extra},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr

    out, err = run()
    assert out["kind"] == "python" and "background process" in out["reason"], out
    assert err.count(warning) == 1, err
    _wait_for_background_build(cache)
    first = _compiles(cxx)
    assert first >= 1 and len(list(cache.glob("*.failed"))) == 1, sorted(cache.iterdir())
    log = next(cache.glob("*.log"))
    assert "simulated compiler failure" in log.read_text()

    out, err = run()  # the same environment: remembered, not built again
    assert out["kind"] == "python", out
    assert "failed earlier" in out["reason"], out
    assert "backend.cpp:1:1: error: simulated compiler failure" in out["reason"], out
    assert "-MMD" not in out["reason"] and f"full log: {log}" in out["reason"], out
    assert err.count(warning) == 1 and "simulated compiler failure" in err, err
    assert not any(cache.glob("*.building")) and _compiles(cxx) == first

    out, err = run(RINGLET_NATIVE="0")
    assert out["kind"] == "python" and warning not in err, err

    out, _ = run(RINGLET_NATIVE="1")  # asked for: the error carries the cause
    assert "simulated compiler failure" in out["raised"], out
    assert "-MMD" not in out["raised"] and "full log:" in out["raised"], out
    assert _compiles(cxx) > first
    tried = _compiles(cxx)

    out, err = run(CXXFLAGS="-DRINGLET_SOMETHING_ELSE")  # another environment: built again
    assert "background process" in out["reason"], out
    _wait_for_background_build(cache)
    assert _compiles(cxx) > tried


# -- issue order between the doors ---------------------------------------------------


def _sequence(rank: int, world: int, group: Any, n: int, sequential: bool) -> list[torch.Tensor]:
    """Operations whose every input is an earlier one's output, alternating
    asynchronous work (the Python group runs it on its queue), synchronous
    collectives (the C ABI on the native backend, queued behind the earlier
    work when the queue is busy) and Python-only operations (objects,
    point-to-point, lists): any reordering changes the result. Only
    operations read a tensor an asynchronous operation still writes; with
    ``sequential`` each asynchronous operation is waited for at once (issue
    order by construction: the reference)."""
    R = dist.ReduceOp
    works: list[Any] = []

    def issued(work: Any) -> None:
        if sequential:
            work.wait()
        works.append(work)

    x = _ints(rank, n, torch.float32, seed=n)
    issued(dist.all_reduce(x, group=group, async_op=True))
    dist.all_reduce(x, op=R.MAX, group=group)  # after the sum above
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, float(x[:5].sum()), group=group)
    x.add_(torch.tensor(objs).sum())
    issued(dist.broadcast(x, group_src=1, group=group, async_op=True))
    full = torch.empty(n * world)
    dist.all_gather_into_tensor(full, x, group=group)  # sees the broadcast
    issued(dist.all_reduce(full, op=R.MIN, group=group, async_op=True))
    part = torch.empty(n)
    dist.reduce_scatter_tensor(part, full, group=group)
    peer = (rank + 1) % world
    got = torch.empty(n)
    if rank % 2 == 0:
        dist.send(part, dst=peer, group=group)
        dist.recv(got, src=(rank - 1) % world, group=group)
    else:
        dist.recv(got, src=(rank - 1) % world, group=group)
        dist.send(part, dst=peer, group=group)
    part.add_(got)
    gathered = [torch.empty(n) for _ in range(world)]
    dist.all_gather(gathered, part, group=group)  # the list form: the C ABI too
    y = torch.stack(gathered).sum(0)
    issued(dist.all_reduce(y, group=group, async_op=True))
    dist.barrier(group=group)
    a2a = torch.empty(n * world)
    dist.all_to_all_single(a2a, full.remainder(5), group=group)
    dist.all_reduce(y, op=R.MIN, group=group)
    for w in works:
        w.wait()
    return [x, full, part, y, a2a]


def _order_job(rank: int, world: int, port: int) -> dict[str, int]:
    _init(rank, world, port)
    gloo = dist.new_group(backend="gloo")
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    before = backend.native_calls
    for rnd in range(12):
        n = (1 << 18) if rnd % 3 == 0 else 7 + rnd  # 1 MiB: async work still running
        mine = _sequence(rank, world, dist.group.WORLD, n, sequential=False)
        ref = _sequence(rank, world, gloo, n, sequential=True)
        for i, (a, b) in enumerate(zip(mine, ref)):
            assert torch.equal(a, b), f"round {rnd} result {i}: {a[:8]} != {b[:8]}"
    calls = backend.native_calls - before
    dist.destroy_process_group()
    return {"native_calls": calls}


def test_operations_of_both_doors_run_in_issue_order() -> None:
    """Asynchronous work, synchronous C ABI collectives and Python-only
    operations interleaved on one group give gloo's results exactly, 12
    rounds, small and 1 MiB tensors, 3 ranks; the synchronous collectives
    took the C ABI."""
    _native_or_skip()
    out = launch(3, _order_job, free_port(), init=False, timeout=240)
    for r in range(3):
        # 7 synchronous collectives per round take the C ABI (all_reduce
        # MAX, all_gather_into_tensor, reduce_scatter_tensor, all_gather of a
        # list, barrier, all_to_all_single, all_reduce MIN); the first
        # round's first ones may not (the group connects in its first,
        # asynchronous, work)
        assert out[r]["native_calls"] >= 7 * 11, out[r]


def _list_forms_job(rank: int, world: int, port: int) -> str:
    _init(rank, world, port)
    gloo = dist.new_group(backend="gloo")
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    last = world - 1

    def run(group: Any) -> list[torch.Tensor]:
        x = _ints(rank, 5, torch.float32, seed=1)
        ag = [torch.empty(5) for _ in range(world)]
        dist.all_gather(ag, x, group=group)
        # the input is one of the outputs (the engine stages the lists)
        al = [torch.full((3,), -1, dtype=torch.int64) for _ in range(world)]
        al[rank] = torch.arange(3) + 10 * rank
        dist.all_gather(al, al[rank], group=group)
        g = [torch.empty(4, dtype=torch.bfloat16) for _ in range(world)] if rank == last else None
        dist.gather(_ints(rank, 4, torch.bfloat16, seed=2), g, dst=last, group=group)
        sc = torch.empty(3, dtype=torch.int32)
        dist.scatter(sc, [torch.full((3,), r + 1, dtype=torch.int32) * 7 for r in range(world)]
                     if rank == 0 else None, src=0, group=group)
        a2a = [torch.empty(2, dtype=torch.float64) for _ in range(world)]
        dist.all_to_all(a2a, [torch.full((2,), 10.0 * rank + j, dtype=torch.float64)
                              for j in range(world)], group=group)
        rs = torch.empty(6, dtype=torch.int64)
        dist.reduce_scatter(rs, [_ints(rank, 6, torch.int64, seed=3 + j) for j in range(world)],
                            op=dist.ReduceOp.MAX, group=group)
        return [*ag, *al, *(g or []), sc, *a2a, rs]

    dist.barrier()  # the group's first collective connects it (through Python)
    before = backend.native_calls
    mine = run(None)
    took = backend.native_calls - before
    ref = run(gloo)
    for i, (a, b) in enumerate(zip(mine, ref)):
        assert torch.equal(a, b), f"list form result {i}: {a} != {b}"
    assert took == 6, took  # one C ABI call each
    # ragged all_gather (gloo refuses it): rank r's block holds r + 1 elements
    ragged = [torch.empty(r + 1) for r in range(world)]
    dist.all_gather(ragged, torch.full((rank + 1,), float(rank)))
    assert [t.tolist() for t in ragged] == [[float(r)] * (r + 1) for r in range(world)]
    # a non-contiguous output: the Python group's path, the same result
    before = backend.native_calls
    wide = torch.zeros(world, 10)
    cols = [wide[r, ::2] for r in range(world)]
    dist.all_gather(cols, torch.full((5,), float(rank)))
    assert backend.native_calls == before
    assert torch.equal(wide[:, ::2], torch.arange(float(world)).repeat_interleave(5).view(world, 5))
    # sizes that do not fit across ranks: an error naming the collective on
    # every rank, and the group stays usable
    got = [torch.empty(2) for _ in range(world)] if rank == last else None
    with pytest.raises(RuntimeError, match="gather: the ranks' tensor sizes do not fit"):
        dist.gather(torch.ones(2 + (rank == 0)), got, dst=last)
    with pytest.raises(RuntimeError, match="all_to_all: the ranks' tensor sizes do not fit"):
        dist.all_to_all([torch.empty(2) for _ in range(world)],
                        [torch.ones(2 + (rank == 0)) for _ in range(world)])
    ok = torch.ones(1)
    dist.all_reduce(ok)
    assert ok.item() == world
    dist.destroy_process_group()
    return "ok"


@pytest.mark.parametrize("world", [2, 3])
def test_list_forms_take_the_c_abi(world: int) -> None:
    """all_gather into a list, gather, scatter, all_to_all of lists and
    reduce_scatter of a list, synchronous on plain tensors: one C ABI call
    each (the engine stages the lists, which may alias), gloo's results; a
    ragged all_gather; a non-contiguous output through the Python group; size
    mismatches named on every rank."""
    _native_or_skip()
    out = launch(world, _list_forms_job, free_port(), init=False, timeout=180)
    assert out == {r: "ok" for r in range(world)}


# -- shrink_group -----------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)


def _train(model: torch.nn.Module, group: Any, steps: range, rank: int,
           opt_state: Any = None) -> None:
    """DDP steps on ``group`` (SGD with momentum, from ``opt_state``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    if opt_state is not None:
        opt.load_state_dict(copy.deepcopy(opt_state))  # SGD steps its buffers in place
    for step in steps:
        x, y = _batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _shrink_job(rank: int, world: int, port: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringlet.distributed.c10d import backend_kind

    _init(rank, world, port)
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        if step == 3 and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # dies between steps
        x, y = _batch(step, rank)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if step < 3:
            loss.backward()
            opt.step()
            continue
        with pytest.raises(RuntimeError) as failed:  # the step loses its peer
            loss.backward()
    # Resume from the last completed step (this step took none).
    state, opt_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    del ddp, opt
    smaller = dist.shrink_group([world - 1])
    assert dist.group.WORLD is smaller and dist.get_world_size() == world - 1
    assert dist.get_rank() == rank and backend_kind() == "native"
    gloo = dist.new_group(backend="gloo")  # a fresh run on the survivors
    mine, ref = _model(), _model()
    mine.load_state_dict(state)
    ref.load_state_dict(state)
    _train(mine, None, range(3, 8), rank, opt_state)
    _train(ref, gloo, range(3, 8), rank, opt_state)
    for a, b in zip(mine.parameters(), ref.parameters()):
        assert torch.equal(a, b), (a, b)
    flat = torch.cat([p.detach().reshape(-1) for p in mine.parameters()])
    other = flat.clone()
    dist.broadcast(other, group_src=0)
    assert torch.equal(flat, other)  # the survivors agree
    assert not torch.equal(flat, torch.cat([v.reshape(-1) for v in state.values()]))
    dist.destroy_process_group()
    return {"failure": str(failed.value), "sum": float(flat.sum())}


def test_shrink_group_after_a_killed_rank_continues_ddp_training() -> None:
    """3 ranks train with DDP; rank 2 is SIGKILLed between steps; the
    survivors' step fails naming it, ``dist.shrink_group([2])`` gives them a
    working 2-rank default group, and DDP on it reaches bit for bit the
    parameters of the same steps on a gloo group of the survivors."""
    _native_or_skip()
    out = launch(3, _shrink_job, free_port(), init=False, timeout=180, expect_dead=(2,))
    assert "rank 2" in out[0]["failure"] and "rank 2" in out[1]["failure"], out
    assert out[0]["sum"] == out[1]["sum"]


# -- _set_pg_timeout ------------------------------------------------------------------


def _timeout_job(rank: int, world: int, port: int) -> dict[str, Any]:
    _init(rank, world, port)
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(4)
    dist.all_reduce(t)  # connected, with the group's 60 s timeout
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=1))
    out: dict[str, Any] = {}
    if rank == 0:  # rank 1 stays away until rank 0 has given up
        start = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            dist.all_reduce(t)
        out["waited"] = time.monotonic() - start
        out["error"] = f"{type(e.value).__name__}: {e.value}"
        out["timeout_error"] = isinstance(e.value, TimeoutError)
        store.set("rank0-gave-up", "1")
    else:
        store.wait(["rank0-gave-up"], timedelta(seconds=60))
        # Whether rank 0's abandoned contribution is still there to finish
        # with is a race; either way this rank's new limit bounds the wait.
        start = time.monotonic()
        with contextlib.suppress(RuntimeError):
            dist.all_reduce(t)
        out["waited"] = time.monotonic() - start
    return out


@pytest.mark.parametrize("door", ["native", "python"])
def test_set_pg_timeout_sets_the_engines_wait(door: str) -> None:
    """``_set_pg_timeout`` (torch's sets gloo's and NCCL's only) gives the
    group's later operations the new limit: a peer that stays away times out
    after about 1 s instead of the group's 60 s."""
    if door == "native":
        _native_or_skip()
    out = launch(2, _timeout_job, free_port(), init=False, timeout=120,
                 env={"RINGLET_NATIVE": "1" if door == "native" else "0"})
    assert out[0]["timeout_error"] and " Timed out " in out[0]["error"], out[0]
    assert out[0]["waited"] < 15 and out[1]["waited"] < 15, out


# -- torch.ops.ringlet.all_reduce_ -------------------------------------------------------


def _op_job(rank: int, world: int, port: int) -> str:
    _init(rank, world, port)
    gloo = dist.new_group(backend="gloo")
    R = dist.ReduceOp
    ops = {"sum": R.SUM, "mul": R.PRODUCT, "min": R.MIN, "max": R.MAX,
           "and": R.BAND, "or": R.BOR, "xor": R.BXOR}
    for dtype in DTYPES:
        for name, op in ops.items():
            if dtype.is_floating_point and name in ("and", "or", "xor"):
                continue
            if dtype == torch.bool and name in ("sum", "mul"):
                continue
            for n in (0, 5, 3000):
                x = _ints(rank, n, dtype, seed=n)
                ref = x.clone()
                assert torch.ops.ringlet.all_reduce_(x, name) is None  # the result is in x
                try:
                    dist.all_reduce(ref, op=op, group=gloo)
                except RuntimeError:  # gloo lacks this dtype: ringlet's c10d group
                    dist.all_reduce(ref, op=op)
                assert torch.equal(x, ref), (dtype, name, n, x[:5], ref[:5])
    # the default: a sum over the default group; a non-contiguous tensor
    m = _ints(rank, 24, torch.float32, seed=1).view(4, 6)
    x, ref = m.t(), m.t().contiguous()
    torch.ops.ringlet.all_reduce_(x)
    dist.all_reduce(ref, group=gloo)
    assert torch.equal(x, ref) and not x.is_contiguous()
    # another group, by name
    sub = dist.new_group(list(range(world)))
    y = _ints(rank, 9, torch.int32, seed=2)
    ref = y.clone()
    torch.ops.ringlet.all_reduce_(y, "max", sub.group_name)
    dist.all_reduce(ref, op=R.MAX, group=gloo)
    assert torch.equal(y, ref)
    with pytest.raises(ValueError, match="reduce_op"):
        torch.ops.ringlet.all_reduce_(torch.ones(2), "avg")
    with pytest.raises(ValueError, match="not ringlet's native"):
        torch.ops.ringlet.all_reduce_(torch.ones(2), "sum", gloo.group_name)
    # under torch.compile: one graph, the result of eager mode

    def step(t: torch.Tensor) -> torch.Tensor:
        y = t * 2
        torch.ops.ringlet.all_reduce_(y, "sum")
        return y + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    z = _ints(rank, 16, torch.float32, seed=3)
    assert torch.equal(compiled(z.clone()), step(z.clone()))
    # called straight into torch's C++ entry (no Python frame), still torch's packet
    packet = torch.ops.ringlet.all_reduce_
    assert isinstance(packet, torch._ops.OpOverloadPacket)
    assert type(packet).__name__ == "_DirectPacket"
    w = _ints(rank, 7, torch.int64, seed=4)
    ref = w.clone()
    packet.default(w, reduce_op="max")
    dist.all_reduce(ref, op=R.MAX, group=gloo)
    assert torch.equal(w, ref)
    with pytest.raises(RuntimeError, match="all_reduce_"):
        packet(w, "sum", "", "one too many")
    dist.destroy_process_group()
    return "ok"


def test_inplace_operator_matches_gloo() -> None:
    """``torch.ops.ringlet.all_reduce_(t, reduce_op="sum", group="")``:
    every dtype and reduce op against gloo, empty and non-contiguous
    tensors, a group by name, argument errors, and ``torch.compile``."""
    _native_or_skip()
    out = launch(2, _op_job, free_port(), init=False, timeout=240)
    assert out == {0: "ok", 1: "ok"}
