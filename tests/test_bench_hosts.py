"""``python -m ringlet.bench hosts`` and the namespace hosts it runs on
(``ringlet.bench.netns``): the link-limit formulas and the tables anywhere;
as root, the hosts' links, their removal on an exception, a signal and after a
crash, and one small end-to-end run. Speed itself is never asserted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ringlet.bench import hosts, netns

S = 1 << 20
TAG = f"rlt{os.getpid()}x"  # this test run's namespaces: the tag, then a process id


def _need_namespaces(rate: bool = True) -> None:
    why = netns.why_not(rate)
    if why:
        pytest.skip(why)


def _ours(prefix: str = TAG) -> list[str]:
    return [n for n in netns.list_namespaces() if n.startswith(prefix)]


def test_link_limit_formulas() -> None:
    b = hosts.busiest_link_bytes
    assert b("all_reduce", S, [2, 2]) == S
    assert b("all_reduce", S, [1, 3]) == S  # two hosts: S whatever the layout
    assert b("all_reduce", S, [2, 2, 2]) == pytest.approx(4 * S / 3)
    assert b("all_reduce", S, [2, 2, 2, 2]) == pytest.approx(3 * S / 2)
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert b(op, S, [2, 2]) == S / 2
        assert b(op, S, [1, 3]) == 3 * S / 4  # the 1-rank host receives 3 of 4 shares
        assert b(op, S, [2, 2, 2]) == pytest.approx(2 * S / 3)
    assert b("broadcast", S, [2, 2, 2]) == S
    assert b("all_to_all_single", S, [2, 2]) == S  # 2 ranks x half their input
    assert b("all_to_all_single", S, [1, 3]) == 3 * S / 4
    assert b("all_to_all_single", S, [2, 2, 2]) == pytest.approx(4 * S / 3)
    assert b("all_reduce", S, [4]) == 0.0
    rate = netns.parse_rate("2gbit")
    assert rate == 2e9 / 8
    assert hosts.link_limit_s("all_reduce", 64 << 20, [2, 2], rate) == pytest.approx(0.268435456)
    assert hosts.link_limit_s("broadcast", S, [2, 2], None) is None
    assert netns.parse_rate("500mbit") == 62.5e6
    assert netns.parse_rate("1gbps") == 1e9
    assert netns.parse_rate("none") is None and netns.parse_rate(None) is None
    with pytest.raises(ValueError, match="cannot read the rate"):
        netns.parse_rate("fast")
    assert hosts.bus_factor("all_reduce", 4) == 1.5
    assert hosts.bus_factor("broadcast", 4) == 1.0
    assert hosts.bus_factor("all_to_all_single", 4) == 0.75


def test_layout_and_op_arguments() -> None:
    assert hosts.parse_layout(None, None, None) == [2, 2]
    assert hosts.parse_layout("1,3", None, None) == [1, 3]
    assert hosts.parse_layout(None, 3, 1) == [1, 1, 1]
    with pytest.raises(ValueError, match="names 2 hosts"):
        hosts.parse_layout("2,2", 3, None)
    with pytest.raises(ValueError, match="at least 2 hosts"):
        hosts.parse_layout("4", None, None)
    assert hosts.parse_ops("all") == list(hosts.OPS)
    assert hosts.parse_ops("all_reduce,all_gather,all_to_all") == [
        "all_reduce", "all_gather_into_tensor", "all_to_all_single"]
    with pytest.raises(ValueError, match="unknown op"):
        hosts.parse_ops("gossip")


def test_inputs_give_exact_answers() -> None:
    import torch

    p = 4
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        want = hosts._inputs("all_reduce", 4096, p, 1, dtype)[1]
        total = sum(hosts._inputs("all_reduce", 4096, p, r, dtype)[0].double() for r in range(p))
        assert torch.equal(total.to(dtype), want)
        blocks = [hosts._inputs("all_to_all_single", 64, p, q, dtype)[0] for q in range(p)]
        got = torch.cat([blocks[q].view(p, -1)[2] for q in range(p)])
        assert torch.equal(got, hosts._inputs("all_to_all_single", 64, p, 2, dtype)[1])
        shards = [hosts._inputs("all_gather_into_tensor", 64, p, q, dtype)[0] for q in range(p)]
        assert torch.equal(torch.cat(shards), hosts._inputs("all_gather_into_tensor", 64, p, 0,
                                                            dtype)[1])


def _fake_result(rate: str | None) -> dict[str, Any]:
    def cell(op: str, size: int, ms: float, ok: bool = True) -> dict[str, Any]:
        good = {"ok": True, "samples_ms": [ms], "median_ms": ms, "reps": 1}
        bad = {"ok": False, "samples_ms": [], "median_ms": None, "reps": 0}
        return {"op": op, "bytes": size, "nbytes": size, "elements": size // 4,
                "ringlet": good, "xla": good if ok else bad, "gloo": {**good, "median_ms": 2 * ms}}

    return {
        "config": {"layout": [2, 2], "rate": rate, "ops": ["all_reduce", "broadcast"],
                   "sizes": [4096, S], "budget": 0.1, "dtype": "float32"},
        "layout": [2, 2], "rate_bytes_per_s": netns.parse_rate(rate), "host_layout": [[0, 1]],
        "cells": [cell("all_reduce", 4096, 0.5), cell("all_reduce", S, 8.0),
                  cell("broadcast", 4096, 0.3, ok=False), cell("broadcast", S, 5.0)],
    }


def test_tables_and_plot(tmp_path: Path) -> None:
    text = hosts.tables(_fake_result("2gbit"))
    assert "each host link 2gbit each way" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| 1 MiB | 8.000 |"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    # size, ringlet, xla, gloo, speedup, limit, % ringlet, % xla, % gloo, algbw, busbw, gloo busbw
    assert cols[4] == "2.00x" and cols[5] == "4.194" and cols[6] == "52"  # 1 MiB at 2 Gbit
    assert float(cols[10]) == pytest.approx(S / 8e-3 / 1e9 * 1.5, abs=1e-3)
    assert "| 4 KiB | 0.300 | WRONG | 0.600 |" in text
    raw = hosts.tables(_fake_result(None))
    assert "raw veth" in raw and "| 1 MiB | 8.000 | 8.000 | 16.000 | 2.00x | - | - | - | - |" in raw
    pytest.importorskip("matplotlib")
    hosts.plot(_fake_result("2gbit"), str(tmp_path / "t.png"))
    hosts.plot(_fake_result("2gbit"), str(tmp_path / "l.png"), metric="limit")
    assert (tmp_path / "t.png").stat().st_size > 0 and (tmp_path / "l.png").stat().st_size > 0


def test_not_root_is_said_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sys, "argv", ["ringlet.bench hosts", "--sizes", "4096"])
    with pytest.raises(SystemExit) as e:
        hosts.main()
    assert str(e.value) == hosts.NEED_ROOT
    assert "root" in str(netns.why_not())


@pytest.mark.timeout(120)
def test_hosts_are_removed_after_an_exception() -> None:
    _need_namespaces()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="boom"), netns.Hosts(3, rate="1gbit", tag=TAG) as net:
        made = [*net.names, net.bridge]
        assert set(made) <= set(netns.list_namespaces())
        assert "tbf" in net.qdiscs(0) and "rate 1Gbit" in net.qdiscs(2)
        bridge_ports = subprocess.run(["tc", "-n", str(net.bridge), "qdisc", "show"],
                                      capture_output=True, text=True, timeout=30).stdout
        assert bridge_ports.count("tbf") == 3  # what each host receives
        raise RuntimeError("boom")
    assert _ours() == []
    assert signal.getsignal(signal.SIGTERM) == before


_ECHO = textwrap.dedent("""
    import socket, sys
    s = socket.create_server((sys.argv[1], 0))
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept()
    c.sendall(c.recv(16))
""")
_CALL = textwrap.dedent("""
    import socket, sys
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
    except OSError as e:
        print("unreachable", e.errno); sys.exit(3)
    c.sendall(b"hello"); print(c.recv(16).decode())
""")


@pytest.mark.timeout(120)
def test_hosts_reach_each_other_over_the_bridge_until_cut() -> None:
    _need_namespaces(rate=False)
    with netns.Hosts(3, rate=None, tag=TAG) as net:
        server = subprocess.Popen([*net.exec_argv(2), sys.executable, "-c", _ECHO, net.addrs[2]],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            port = server.stdout.readline().strip()  # listening once it prints
            got = subprocess.run([*net.exec_argv(0), sys.executable, "-c", _CALL, net.addrs[2],
                                  port], capture_output=True, text=True, timeout=60)
            assert got.stdout.strip() == "hello", got
            server.wait(timeout=30)
            net.cut(0)
            cut = subprocess.run([*net.exec_argv(0), sys.executable, "-c", _CALL, net.addrs[1],
                                  port], capture_output=True, text=True, timeout=60)
            assert cut.returncode == 3 and "unreachable" in cut.stdout, cut
        finally:
            if server.poll() is None:
                server.kill()
            server.wait(timeout=30)
            if server.stdout is not None:
                server.stdout.close()
    assert _ours() == []


@pytest.mark.timeout(120)
def test_hosts_are_removed_on_sigterm() -> None:
    _need_namespaces(rate=False)
    script = textwrap.dedent(f"""
        import sys
        from ringlet.bench.netns import Hosts
        with Hosts(2, rate=None, tag={TAG!r}) as net:
            print(" ".join(net.names), flush=True)
            sys.stdin.readline()  # until the test's signal
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        names = p.stdout.readline().split()
        assert len(names) == 2 and set(names) <= set(netns.list_namespaces())
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
        for f in (p.stdin, p.stdout):
            if f is not None:
                f.close()
    assert not set(names) & set(netns.list_namespaces())


@pytest.mark.timeout(120)
def test_cleanup_stale_deletes_only_dead_runs() -> None:
    _need_namespaces(rate=False)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    dead, live = f"{TAG}{gone.pid}h0", f"{TAG}{os.getppid()}h0"
    try:
        for ns in (dead, live):
            subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
        assert netns.cleanup_stale(TAG) == [dead]
        assert _ours() == [live]
    finally:
        for ns in (dead, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    assert _ours() == []


@pytest.mark.timeout(180)
def test_bench_hosts_end_to_end(tmp_path: Path) -> None:
    _need_namespaces(rate=False)
    raw = tmp_path / "hosts.json"
    res = subprocess.run(
        [sys.executable, "-m", "ringlet.bench", "hosts", "--rate", "none",
         "--sizes", "4096,262144", "--ops", "all_reduce,all_gather_into_tensor",
         "--budget", "0.05", "--tag", TAG, "--json", str(raw)],
        capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _ours() == []
    text = res.stdout
    assert text.startswith("2 hosts, ranks per host [2, 2]"), text
    assert "**all_reduce**" in text and "**all_gather_into_tensor**" in text
    rows = [ln for ln in text.splitlines() if ln.startswith(("| 4 KiB |", "| 256 KiB |"))]
    assert len(rows) == 4, text
    for row in rows:
        cols = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(c) > 0 for c in cols[1:4]), row  # ringlet, xla, gloo ms
        assert cols[5] == "-", row  # no link limit on the raw veth
    result = json.loads(raw.read_text())
    assert result["host_layout"] == [[0, 1], [2, 3]]
    assert all(c[b]["ok"] and len(c[b]["samples_ms"]) >= 3
               for c in result["cells"] for b in hosts.BACKENDS)
