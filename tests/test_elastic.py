"""An elastic job across hosts: ``torchrun --nnodes 1:3 --max-restarts 3
--rdzv-backend c10d`` with two ranks per host, on the ringlet backend. As root
the hosts are network namespaces on a bridge (real addresses, each agent with
``--local-addr``); otherwise logical hosts by ``RINGLET_HOST_ID`` over
loopback. A host crashes (on namespace hosts its link goes down, then every
process inside it is killed: no connection is closed cleanly; on logical
hosts its agent and workers get SIGKILL), the survivors restart in a world of
one host and resume from the last ``torch.distributed.checkpoint``; a new
host joins, and the job restarts in a world of two hosts again and finishes.
The result equals plain torch's, every round started clean, and no
shared-memory segment is left."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ringlet.bench import netns
from test_errors import shm_entries

from conftest import free_port

JOB = Path(__file__).with_name("elastic_job.py")
TOTAL = 12
TIMEOUT = "10"  # what a survivor waits for a host whose link went down


def _host(h: int) -> str:
    """Host ``h``'s name: its ``RINGLET_HOST_ID``, in its agent's log file and
    its workers' pid files."""
    return f"host-{'abc'[h]}"


def _kill_workers(work: Path, pattern: str) -> None:
    """SIGKILLs the workers whose pid files (``pids/<host>.<pid>``) match."""
    for pid in (int(p.suffix[1:]) for p in (work / "pids").glob(pattern)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class _Hosts:
    """Where the agents run: namespace hosts on a bridge (``net`` given) or
    logical hosts on loopback."""

    def __init__(self, work: Path, port: int, net: Optional[netns.Hosts]) -> None:
        self.work, self.port, self.net = work, port, net
        self.endpoint = net.addrs[0] if net is not None else "127.0.0.1"

    def agent(self, h: int) -> subprocess.Popen[bytes]:
        host = _host(h)
        # torch 2.13's shared rendezvous store never gives a host that joins a
        # later round the master's address (the round's rank 0 publishes it
        # only in its first round): the workers host their own store instead
        env = {**os.environ, "RINGLET_HOST_ID": host, "OMP_NUM_THREADS": "1",
               "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        prefix: list[str] = []
        local: list[str] = []
        conf = "last_call_timeout=1,join_timeout=90"
        if self.net is not None:
            # the machine's hostname resolves to no address inside a namespace:
            # each agent names its own, and the first says it serves the store
            prefix, local = self.net.exec_argv(h), ["--local-addr", self.net.addrs[h]]
            conf += f",is_host={int(h == 0)}"
        cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:3",
               "--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{self.endpoint}:{self.port}", "--rdzv-id",
               "ringlet-elastic", "--rdzv-conf", conf,
               "--monitor-interval", "0.2", *local, str(JOB), str(self.work), str(TOTAL), TIMEOUT]
        with open(self.work / f"agent-{host}.log", "wb") as log:  # the child keeps a copy
            return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def listening(self) -> bool:
        """Whether the first host's rendezvous store accepts connections."""
        if self.net is None:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        probe = f"exec 3<>/dev/tcp/{self.endpoint}/{self.port}"
        return subprocess.run([*self.net.exec_argv(0), "bash", "-c", probe],
                              stderr=subprocess.DEVNULL).returncode == 0

    def crash(self, h: int, agent: subprocess.Popen[bytes]) -> None:
        """Host ``h`` goes away at once, agent and workers."""
        if self.net is not None:
            self.net.cut(h)  # first the link: the peers see no FIN or RST
            netns._kill_inside(self.net.names[h])
        else:  # torchrun starts the workers in sessions of their own
            os.killpg(agent.pid, signal.SIGKILL)
            _kill_workers(self.work, f"{_host(h)}.*")
        agent.wait()


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


def _reference(steps: int) -> torch.Tensor:
    sys.path.insert(0, str(JOB.parent))
    from elastic_job import LR, ROWS, problem

    x, y = problem()
    w = torch.zeros(x.shape[1], dtype=torch.float64)
    for _ in range(steps):
        w = w - LR * (x.T @ (x @ w - y)) / ROWS
    return w


def test_an_elastic_job_loses_a_host_gains_one_and_resumes(tmp_path: Path) -> None:
    # namespace hosts where this runs as root; logical hosts otherwise (the
    # same job and checks, over loopback)
    if netns.why_not(rate=False):
        _run_job(_Hosts(tmp_path, free_port(), None))
        return
    with netns.Hosts(3, rate=None, tag="rlelastic") as net:
        _run_job(_Hosts(tmp_path, free_port(), net))
    assert not set(net.names) & set(netns.list_namespaces())


def _run_job(hosts: _Hosts) -> None:
    work = hosts.work
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
        agents["a"] = hosts.agent(0)  # hosts the rendezvous store
        _until("host a's rendezvous store", hosts.listening, work)
        agents["b"] = hosts.agent(1)
        # two hosts x 2 ranks (if host a started a round alone first, it
        # restarts when host b arrives)
        _until("a world of 4", lambda: any(r["world"] == 4 for r in starts()), work)
        release(4)
        _until("4 steps in a world of 4", lambda: last_step() >= 4, work)
        assert {r["world"] for r in _records(work) if r["event"] == "step"} <= {2, 4}
        n = len(starts())

        # host b crashes: the survivors' next collective raises (at once on
        # a reset connection, at the timeout behind a dead link)
        hosts.crash(1, agents.pop("b"))
        release(7)
        _until("a restart in a world of 2",
               lambda: any(r["world"] == 2 for r in starts()[n:]), work)
        _until("7 steps", lambda: last_step() >= 7, work)
        shrunk = [r for r in starts()[n:] if r["world"] == 2]
        assert shrunk[0]["step"] == 4 and shrunk[0]["attempt"] >= 1, starts()
        n = len(starts())

        # host c joins: the job grows back to two hosts
        agents["c"] = hosts.agent(2)
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
        _kill_workers(work, "*")

    # the survivors' collective named a rank of the lost host (host a's
    # agent logs its workers' errors; host b held ranks 2 and 3)
    log = (work / "agent-host-a.log").read_text(errors="replace")
    assert re.search(r"PeerLostError: rank [01]: all_reduce .* lost rank [23]", log), log[-3000:]
    steps = [r for r in _records(work) if r["event"] == "step"]
    # every step done once, in order, across the rounds (a round resumes
    # where the last checkpoint left it)
    assert [r["step"] for r in steps] == list(range(1, TOTAL + 1)), steps
    assert [r["world"] for r in steps][-1] == 4
    # every round's workers met at the address of one of its hosts
    addrs = hosts.net.addrs if hosts.net is not None else ["localhost", "127.0.0.1"]
    assert all(r["master"] in addrs for r in starts()), starts()
    got = torch.load(work / "result.pt")
    torch.testing.assert_close(got, _reference(TOTAL), rtol=1e-12, atol=1e-12)
    assert shm_entries() <= before
