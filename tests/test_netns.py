"""Two real hosts: two network namespaces joined by a veth pair, one torchrun
node in each (``--nnodes 2 --nproc_per_node 2``); every collective checked,
then the link is cut mid-collective. Needs root (CI runs as root)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from test_errors import shm_entries

from conftest import free_port

HERE = Path(__file__).parent


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the ip tool (iproute2) is not installed"
    probe = f"rlprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"ip netns add is not allowed here: {e}"
    _ip("netns", "del", probe)
    return None


class TwoHosts:
    """Namespaces ``a`` and ``b`` with a veth pair 10.231.<k>.1 <-> .2."""

    def __init__(self) -> None:
        k = os.getpid() % 250 + 1
        self.a, self.b = f"rla{os.getpid()}", f"rlb{os.getpid()}"
        self.va, self.vb = f"rlva{k}", f"rlvb{k}"
        self.addr_a, self.addr_b = f"10.231.{k}.1", f"10.231.{k}.2"

    def __enter__(self) -> TwoHosts:
        try:
            _ip("netns", "add", self.a)
            _ip("netns", "add", self.b)
            _ip("link", "add", self.va, "type", "veth", "peer", "name", self.vb)
            _ip("link", "set", self.va, "netns", self.a)
            _ip("link", "set", self.vb, "netns", self.b)
            for ns, dev, addr in ((self.a, self.va, self.addr_a), (self.b, self.vb, self.addr_b)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def cut(self) -> None:
        _ip("-n", self.a, "link", "set", self.va, "down")

    def __exit__(self, *exc: object) -> None:
        for ns in (self.a, self.b):  # deleting a namespace deletes its veth end
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _wait_for(out: Path, names: list[str], deadline: float, procs: list) -> None:
    while not all((out / n).exists() for n in names):
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise AssertionError(f"torchrun exited with {p.returncode}: {p.stdout.read()}")
        if time.monotonic() > deadline:
            missing = [n for n in names if not (out / n).exists()]
            raise AssertionError(f"no {missing} in time")
        time.sleep(0.05)  # polling for files, with a deadline


def test_two_hosts_then_cut_link() -> None:
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    timeout = 3.0
    before = shm_entries()
    out = Path(tempfile.mkdtemp(prefix="ringlet-netns-"))
    procs: list[subprocess.Popen] = []
    with TwoHosts() as net:
        port = free_port()
        try:
            for node, (ns, host) in enumerate(((net.a, "netns-host-a"), (net.b, "netns-host-b"))):
                env = {**os.environ, "RINGLET_HOST_ID": host, "RINGLET_TIMEOUT": str(timeout),
                       "RINGLET_TEST_OUT": str(out), "OMP_NUM_THREADS": "1"}
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                     "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(node),
                     "--master_addr", net.addr_a, "--master_port", str(port),
                     str(HERE / "netns_job.py")],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    start_new_session=True,
                ))
            _wait_for(out, [f"running{r}.json" for r in range(4)], time.monotonic() + 120, procs)
            ok = {r: json.loads((out / f"ok{r}.json").read_text()) for r in range(4)}
            net.cut()
            cut_at = time.monotonic()
            _wait_for(out, [f"cut{r}.json" for r in range(4)], cut_at + 4 * timeout + 10, procs)
            cut = {r: json.loads((out / f"cut{r}.json").read_text()) for r in range(4)}
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
                if p.stdout is not None:
                    p.stdout.close()
    shutil.rmtree(out, ignore_errors=True)
    for r, o in ok.items():
        assert o["layout"] == [[0, 1], [2, 3]], o
        assert o["transport"] == "tcp", o
        mate = r ^ 1
        assert o["peers"][str(mate)].startswith("shm"), o
        assert all(o["peers"][str(q)] == "tcp" for q in range(4) if q // 2 != r // 2), o
        assert {"_engine_all_reduce", "_engine_all_gather", "_engine_reduce_scatter",
                "_engine_broadcast"} <= set(o["two_level"]), o
    for r, c in cut.items():
        across = {2, 3} if r < 2 else {0, 1}
        assert c["culprit"] in across, (r, c)
        assert c["cause"] in ("timeout", "unreachable"), (r, c)
        assert f"rank {c['culprit']}" in c["msg"], c
        assert c["after"] < timeout + 4.0, (r, c)  # timeout, blame grace, slack for load
    assert shm_entries() <= before
