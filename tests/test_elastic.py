"""An elastic job across hosts: ``torchrun --nnodes 1:3 --max-restarts 3
--rdzv-backend c10d`` with two ranks per host (logical hosts, by
``RINGLET_HOST_ID``), on the ringlet backend. A host is killed (its agent and
workers, SIGKILL: a crashed machine), the survivors restart in a world of
one host and resume from the last ``torch.distributed.checkpoint``; a new host joins, and the job
restarts in a world of two hosts again and finishes. The result equals plain
torch's, every round started clean, and no shared-memory segment is left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from test_errors import shm_entries

from conftest import free_port

JOB = Path(__file__).with_name("elastic_job.py")
TOTAL = 12


def _agent(work: Path, port: int, host: str) -> subprocess.Popen[bytes]:
    # torch 2.13's shared rendezvous store never gives a host that joins a
    # later round the master's address (the round's rank 0 publishes it
    # only in its first round): the workers host their own store instead
    env = {**os.environ, "RINGLET_HOST_ID": host, "OMP_NUM_THREADS": "1",
           "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:3",
           "--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ringlet-elastic",
           "--rdzv-conf", "last_call_timeout=1,join_timeout=90",
           "--monitor-interval", "0.2", str(JOB), str(work), str(TOTAL)]
    with open(work / f"agent-{host}.log", "wb") as log:  # the child keeps its own copy
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _records(work: Path) -> list[dict[str, Any]]:
    p = work / "progress"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _until(what: str, ok: Callable[[], bool], work: Path, limit: float = 90) -> None:
    deadline = time.monotonic() + limit
    while not ok():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                             for p in sorted(work.glob("agent-*.log")))
            raise AssertionError(f"waited {limit:g}s for {what}; progress: "
                                 f"{_records(work)}\n{logs}")
        time.sleep(0.05)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _reference(steps: int) -> torch.Tensor:
    sys.path.insert(0, str(JOB.parent))
    from elastic_job import LR, ROWS, problem

    x, y = problem()
    w = torch.zeros(x.shape[1], dtype=torch.float64)
    for _ in range(steps):
        w = w - LR * (x.T @ (x @ w - y)) / ROWS
    return w


def test_an_elastic_job_loses_a_host_gains_one_and_resumes(tmp_path: Path) -> None:
    work, port = tmp_path, free_port()
    (work / "release").write_text("2")
    before = shm_entries()
    agents: dict[str, subprocess.Popen[bytes]] = {}

    def release(n: int) -> None:
        (work / "release.tmp").write_text(str(n))
        os.replace(work / "release.tmp", work / "release")

    def starts() -> list[dict[str, Any]]:
        return [r for r in _records(work) if r["event"] == "start"]

    def last_step() -> int:
        return max((r["step"] for r in _records(work) if r["event"] == "step"), default=0)

    try:
        agents["a"] = _agent(work, port, "host-a")  # hosts the rendezvous store
        _until("host a's rendezvous store", lambda: _listening(port), work)
        agents["b"] = _agent(work, port, "host-b")
        # two hosts x 2 ranks (if host a started a round alone first, it
        # restarts when host b arrives)
        _until("a world of 4", lambda: any(r["world"] == 4 for r in starts()), work)
        release(4)
        _until("4 steps in a world of 4", lambda: last_step() >= 4, work)
        assert {r["world"] for r in _records(work) if r["event"] == "step"} <= {2, 4}
        n = len(starts())

        # host b crashes: its agent and workers die at once (torchrun starts
        # the workers in sessions of their own)
        crashed = agents.pop("b")
        os.killpg(crashed.pid, signal.SIGKILL)
        crashed.wait()
        for pid in (int(p.suffix[1:]) for p in (work / "pids").glob("host-b.*")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        release(7)
        _until("a restart in a world of 2",
               lambda: any(r["world"] == 2 for r in starts()[n:]), work)
        _until("7 steps", lambda: last_step() >= 7, work)
        shrunk = [r for r in starts()[n:] if r["world"] == 2]
        assert shrunk[0]["step"] == 4 and shrunk[0]["attempt"] >= 1, starts()
        n = len(starts())

        # host c joins: the job grows back to two hosts
        agents["c"] = _agent(work, port, "host-c")
        _until("a restart in a world of 4",
               lambda: any(r["world"] == 4 for r in starts()[n:]), work)
        grown = [r for r in starts()[n:] if r["world"] == 4]
        assert grown[0]["step"] == 7, starts()
        release(TOTAL)
        for name in ("a", "c"):
            assert agents[name].wait(timeout=90) == 0, (work / f"agent-host-{name}.log").read_text()
    finally:
        for proc in agents.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in (int(p.suffix[1:]) for p in (work / "pids").glob("*")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    steps = [r for r in _records(work) if r["event"] == "step"]
    # every step done once, in order, across the rounds (a round resumes
    # where the last checkpoint left it)
    assert [r["step"] for r in steps] == list(range(1, TOTAL + 1)), steps
    assert [r["world"] for r in steps][-1] == 4
    got = torch.load(work / "result.pt")
    torch.testing.assert_close(got, _reference(TOTAL), rtol=1e-12, atol=1e-12)
    assert shm_entries() <= before
