"""The cross-host time model (``python -m ringlet.bench model``): its terms
behave as the formulas in its docstring say."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ringlet.bench import model

LINK = model.Link(rate=250e6, alpha=60e-6, o=4e-6, mem=4e9)


def test_two_hosts_large_messages_approach_the_link_and_a_third_of_the_ring() -> None:
    s = 1 << 30
    t = model.two_level(s, 2, 2, LINK)
    wire = s / (LINK.eta * LINK.rate)  # S crosses each way
    assert wire < t < 1.01 * wire
    # A flat ring over 4 ranks sends 1.5 S each way: 1.5x longer.
    assert model.ring(s, 2, 2, LINK) / t == pytest.approx(1.5, rel=0.01)


def test_three_hosts_send_four_thirds() -> None:
    s = 1 << 30
    t = model.two_level(s, 3, 2, LINK)
    assert t == pytest.approx(4 / 3 * s / (LINK.eta * LINK.rate), rel=0.01)
    assert model.ring(s, 3, 2, LINK) / t == pytest.approx((2 * 5 / 6) / (4 / 3), rel=0.01)


def test_small_messages_on_many_hosts_take_log_steps() -> None:
    # 4 KiB on 256 hosts: recursive doubling, 10 steps, not 2 x 255 messages.
    t = model.two_level(4096, 256, 2, LINK)
    assert t < 12 * LINK.alpha + 511 * LINK.o + 1e-3
    assert model.ring(4096, 256, 2, LINK) > 20 * t


def test_piece_sizes_follow_the_engine() -> None:
    assert model.piece_bytes(64 << 20, 2, 2) == 256 << 10
    assert model.piece_bytes(1 << 20, 2, 2) == 256 << 10
    assert model.piece_bytes(1 << 30, 256, 8) == (16 << 10) * 8 * 256


def test_entry_point_prints_the_table() -> None:
    res = subprocess.run([sys.executable, "-m", "ringlet.bench", "model", "--hosts", "2,16",
                          "--sizes", "4096,1048576"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "| 16 | 32 |" in res.stdout and "1 MiB two-level" in res.stdout


def test_start_up_terms() -> None:
    """Start-up: the store's operations grow with p, the table it sends with
    p^2 (every rank reads all p records), the dials with log2 p; 1,024 hosts
    x 8 ranks on 100 Gbit start within 10 s with the defaults of the CLI.
    A later group polls where start-up's waits block."""
    fast = model.Link(rate=12.5e9, alpha=10e-6, o=2e-6, mem=8e9)
    store = model.Store(op=10e-6, bw=1e9, record=7, base=0.02)
    t = model.start_up(1024, 8, fast, store)
    p = 8192
    table = p * p * 7 / 1e9
    # set, wait and get per rank, rank 0's multi_get and table; the same in
    # each host's group
    ops = (3 * p + 1 + 3 * p + 1024) * 10e-6
    assert table + ops < t < table + ops + 0.02 + 0.01
    assert t < 10
    # two ranks: the base and a first all_reduce; nothing polls
    small = model.start_up(2, 1, fast, store)
    assert 0.02 < small < 0.021
    # a new_group polls: a crowded machine's 10 ms floor instead of 1 ms is
    # 9 ms more for a small group; at 8,192 ranks only the hosts' groups of 8
    # wait longer (the world's pause is p x 20 us either way). Start-up does
    # not poll, so no floor changes it
    crowded = model.Store(op=10e-6, bw=1e9, record=7, base=0.02, poll=0.01)
    group = model.start_up(2, 1, fast, store, block=False)
    assert model.start_up(2, 1, fast, crowded, block=False) - group == pytest.approx(
        0.009, rel=1e-6)
    assert model.start_up(1024, 8, fast, crowded, block=False) - model.start_up(
        1024, 8, fast, store, block=False) == pytest.approx(0.009, rel=1e-6)
    assert model.start_up(1024, 8, fast, crowded) == t
    # polling costs the pauses and saves the waits' operations
    polled = model.start_up(1024, 8, fast, store, block=False)
    assert polled - t == pytest.approx(p * 2e-5 + 1e-3 - (2 * p) * 10e-6, rel=1e-6)
    # 16 ranks on 2 cores started together: the machine does their own work
    # 8 times over
    assert model.start_up(16, 1, fast, store, ranks_per_core=8) - model.start_up(
        16, 1, fast, store) == pytest.approx(7 * 0.02, rel=1e-6)
    assert model.start_up(16, 1, fast, store, ranks_per_core=0.5) == model.start_up(
        16, 1, fast, store)
    # doubling the records' bytes adds the world's table and the hosts' tables again
    bigger = model.start_up(1024, 8, fast, model.Store(op=10e-6, bw=1e9, record=14, base=0.02))
    assert bigger - t == pytest.approx(table + p * 8 * 7 / 1e9, rel=1e-6)


def test_the_agreement_takes_the_rounds_of_recursive_doubling() -> None:
    """The agreement's rounds: log2 p for a power of two, the fold and the
    unfold around the largest power of two below p otherwise (the pairing
    of the core's `doubling_peers`)."""
    assert [model.doubling_rounds(p) for p in (1, 2, 4, 5, 8, 12, 16, 17, 1024)] == \
        [0, 1, 2, 4, 3, 5, 4, 6, 10]
    link = model.Link(1e9, 1e-5, 1e-6, 1e9)
    assert model.agreement(3, link) == pytest.approx(link.alpha + 2 * link.o)
    assert model.agreement(16, link) == pytest.approx(4 * (link.alpha + 2 * link.o))
    assert model.agreement(12, link) == pytest.approx(5 * (link.alpha + 2 * link.o))
