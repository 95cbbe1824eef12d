"""Real hosts: network namespaces (a veth pair for two, a bridge for three),
one torchrun node in each. Every collective is checked against plain torch on
the two-level paths for even, uneven and three-host layouts, and on sixteen
one-rank hosts on a bridge (one dtype per class there); then, on two
hosts, the link is cut in the middle of pipelined all-reduces and every rank
must name a rank across the cut within the timeout. Needs root (CI runs as
root); skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ringlet.bench import netns
from test_errors import shm_entries

from conftest import free_port

HERE = Path(__file__).parent


def _launch(net: netns.Hosts, layout: list[int], out: Path, env: dict[str, str],
            job: str = "netns_job.py") -> list[subprocess.Popen]:
    port = free_port()
    procs: list[subprocess.Popen] = []
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    for h, lh in enumerate(layout):
        e = {**base, **env, "RINGLET_HOST_ID": f"netns-host-{h}", "RINGLET_TEST_OUT": str(out),
             "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [*net.exec_argv(h), sys.executable, "-m", "torch.distributed.run",
             "--nnodes", str(len(layout)), "--nproc_per_node", str(lh), "--node_rank", str(h),
             "--master_addr", net.addrs[0], "--master_port", str(port),
             str(HERE / job)],
            env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        ))
    return procs


def _wait_for(out: Path, names: list[str], deadline: float, procs: list) -> None:
    while not all((out / n).exists() for n in names):
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise AssertionError(f"torchrun exited with {p.returncode}: {p.stdout.read()}")
        if time.monotonic() > deadline:
            missing = [n for n in names if not (out / n).exists()]
            raise AssertionError(f"no {missing} in time")
        time.sleep(0.05)  # polling for files, with a deadline


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
        p.wait(timeout=30)
        if p.stdout is not None:
            p.stdout.close()


def _check_ok(ok: dict[int, dict], layout: list[int]) -> None:
    hosts, at = [], 0
    for lh in layout:
        hosts.append(list(range(at, at + lh)))
        at += lh
    # one rank per host: no second level (flat TCP), and no layout attached
    levels = None if all(lh == 1 for lh in layout) else hosts
    for r, o in ok.items():
        assert o["layout"] == hosts and o["engine_layout"] == levels, o
        assert o["c10d_layout"] == levels, o
        assert o["transport"] == "tcp", o
        mine = next(g for g in hosts if r in g)
        for q in range(sum(layout)):
            if q != r:
                want = "shm" if q in mine else "tcp"
                assert o["peers"][str(q)].startswith(want), (r, q, o)


@pytest.mark.parametrize("layout", [[2, 2, 2], [1, 3], [1] * 16],
                         ids=["3hosts-bridge", "uneven-1+3", "16hosts-bridge"])
def test_collectives_across_namespace_hosts(layout: list[int]) -> None:
    why = netns.why_not(rate=False)
    if why:
        pytest.skip(why)
    before = shm_entries()
    out = Path(tempfile.mkdtemp(prefix="ringlet-netns-"))
    n = sum(layout)
    # 16 hosts: every collective, one dtype per class (32 processes on 2 cores)
    env = {"RINGLET_TIMEOUT": "60", **({"RINGLET_TEST_MANY": "1"} if n > 8 else {})}
    with netns.Hosts(len(layout), rate=None, tag="rltest") as net:
        procs = _launch(net, layout, out, env)
        try:
            _wait_for(out, [f"ok{r}.json" for r in range(n)], time.monotonic() + 300, procs)
            for p in procs:
                assert p.wait(timeout=120) == 0
        finally:
            _stop(procs)
    ok = {r: json.loads((out / f"ok{r}.json").read_text()) for r in range(n)}
    shutil.rmtree(out, ignore_errors=True)
    _check_ok(ok, layout)
    assert shm_entries() <= before
    assert not [s for s in netns.list_namespaces() if s.startswith(f"rltest{os.getpid()}")]


def test_two_hosts_then_cut_link_mid_pipeline() -> None:
    why = netns.why_not(rate=False)
    if why:
        pytest.skip(why)
    timeout = 3.0
    before = shm_entries()
    out = Path(tempfile.mkdtemp(prefix="ringlet-netns-"))
    with netns.Hosts(2, rate=None, tag="rltest") as net:
        procs = _launch(net, [2, 2], out, {"RINGLET_TIMEOUT": str(timeout),
                                           "RINGLET_TEST_CUT": "1"})
        try:
            _wait_for(out, [f"running{r}.json" for r in range(4)], time.monotonic() + 300, procs)
            ok = {r: json.loads((out / f"ok{r}.json").read_text()) for r in range(4)}
            net.cut(0)
            cut_at = time.monotonic()
            _wait_for(out, [f"cut{r}.json" for r in range(4)], cut_at + 4 * timeout + 10, procs)
            cut = {r: json.loads((out / f"cut{r}.json").read_text()) for r in range(4)}
        finally:
            _stop(procs)
    shutil.rmtree(out, ignore_errors=True)
    _check_ok(ok, [2, 2])
    for r, c in cut.items():
        across = {2, 3} if r < 2 else {0, 1}
        assert c["culprit"] in across, (r, c)
        assert c["cause"] in ("timeout", "unreachable"), (r, c)
        assert f"rank {c['culprit']}" in c["msg"], c
        assert c["after"] < timeout + 4.0, (r, c)  # timeout, blame grace, slack for load
    assert shm_entries() <= before


@pytest.mark.parametrize("layout", [[2, 2], [1, 3]], ids=["2x2", "uneven-1+3"])
def test_bagua_algorithms_across_namespace_hosts(layout: list[int]) -> None:
    """ByteGrad (hierarchical and flat) and decentralized SGD across real
    hosts match the plain-torch references (tests/netns_algorithms_job.py)."""
    why = netns.why_not(rate=False)
    if why:
        pytest.skip(why)
    before = shm_entries()
    out = Path(tempfile.mkdtemp(prefix="ringlet-netns-alg-"))
    n = sum(layout)
    with netns.Hosts(len(layout), rate=None, tag="rltest") as net:
        procs = _launch(net, layout, out, {"RINGLET_TIMEOUT": "60"}, "netns_algorithms_job.py")
        try:
            _wait_for(out, [f"alg{r}.json" for r in range(n)], time.monotonic() + 300, procs)
            for p in procs:
                assert p.wait(timeout=120) == 0
        finally:
            _stop(procs)
    got = {r: json.loads((out / f"alg{r}.json").read_text()) for r in range(n)}
    shutil.rmtree(out, ignore_errors=True)
    assert all(g["layout"] == layout for g in got.values()), got
    assert shm_entries() <= before
