"""The benchmark entry point runs (tiny sizes, 2 ranks) and its tables hold
the numbers it measured; speed itself is never asserted."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import free_port, launch


def _job(rank: int, world: int, port: int) -> list[str]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    import ringlet
    from ringlet.bench import c10d, collectives, cuda, dtypes, fronts

    peer = collectives._Gloo()
    first = collectives.first_calls(4096, peer, 20)
    assert all(first[k] > 0 for k in ("ringlet_first_us", "ringlet_steady_us",
                                      "peer_first_us", "peer_steady_us"))
    assert "| ringlet | 1.0 |" in collectives.first_table(first, peer.name, (1e-3, 2e-3))
    rows = collectives.run(list(collectives.OPS), [4096, 65536], 0.01, peer)
    text = collectives.table(rows, world, ringlet.transport(), peer.name)
    group = collectives._c10d_group("gloo")
    by_front = fronts.run(fronts.calls(torch.ones(1024), peer, group), peer.barrier, 1, 20,
                          1e-4)
    assert len(by_front) == 4 and all(a > 0 and b > 0 for a, b in by_front.values())
    assert "| `torch.ops.ringlet.all_reduce(t)` |" in fronts.table(by_front, 4096, world, 100)
    peer.close()
    dist.init_process_group("ringlet")
    gloo = dist.new_group(backend="gloo")
    rows2 = c10d.collectives(c10d.OPS, [4096], 0.01, gloo)
    train = c10d.training(2, 32, 2, 2, gloo)
    dist.destroy_process_group()
    assert len(rows) == 8 and len(rows2) == 5 and len(train) == 2
    assert all(r["ringlet_us"] > 0 and r["peer_us"] > 0 for r in rows)
    by_type = dtypes.run([torch.float32, torch.bfloat16], [1 << 16], 2)
    assert len(by_type) == 1 and by_type[0]["float32"] > 0 and by_type[0]["bfloat16"] > 0
    assert "bfloat16 / float32" in dtypes.table(by_type, ["float32", "bfloat16"], world)
    staged = cuda.run(["cpu"], [1 << 16], 2)  # checks each bucket's sum itself
    assert [(d, b) for d, b, _ in staged] == [("cpu", 1 << 16)] and staged[0][2] > 0
    assert "| cpu | 0 MiB |" in cuda.table(staged, world)
    return text.splitlines()


def test_bench_collectives_and_c10d_run() -> None:
    out = launch(2, _job, free_port(), timeout=240)
    lines = out[0]
    assert lines[0].startswith("world size 2")
    assert sum(1 for ln in lines if ln.startswith("| all_reduce |")) == 2


def test_bench_entry_point_names_the_choices() -> None:
    res = subprocess.run([sys.executable, "-m", "ringlet.bench", "nonsense"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "collectives" in res.stderr and "c10d" in res.stderr




def test_bench_algorithms_runs_on_one_host() -> None:
    """``ringlet.bench algorithms`` end to end on one host (tiny model): every
    way asked for is timed; the accuracy table's time-to-target logic."""
    res = subprocess.run(
        [sys.executable, "-m", "ringlet.bench", "algorithms", "--layout", "2", "--modes",
         "local,ddp-gloo,bytegrad-hook,bytegrad,low_precision_decentralized,qadam,async",
         "--width", "32", "--layers", "1", "--steps", "2", "--rounds", "2"],
        capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("| ")]
    for way in ("local", "ddp-gloo", "bytegrad-hook", "bytegrad", "qadam", "async"):
        assert any(r.startswith(f"| {way} |") for r in rows), res.stdout
    from ringlet.bench.algorithms import tables, time_to

    curve = [(1.0, 0.5), (2.0, 0.9), (3.0, 0.95)]
    assert time_to(curve, 0.9) == 2.0 and time_to(curve, 0.99) is None
    result = {"config": {"part": "accuracy", "rate": "100mbit", "hidden": 8, "epochs": 3,
                         "batch": 4}, "layout": [2, 2], "torch": "x",
              "curves": {"ddp-gloo": [(2.0, 0.5), (4.0, 0.9)], "bytegrad": curve}}
    text = tables(result)
    assert "| bytegrad | 0.950 | 2.00 | 2.00x |" in text, text


def test_bench_scale_reports_both_backends() -> None:
    res = subprocess.run([sys.executable, "-m", "ringlet.bench", "scale", "--ranks", "2",
                          "--repeat", "1", "--iters", "5"],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    main, phases = res.stdout.split("\n\n", 1)
    rows = [ln.split("|") for ln in main.splitlines() if ln.startswith("| 2 |")]
    assert [r[2].strip() for r in rows] == ["ringlet", "gloo"], res.stdout
    ours = rows[0]
    # start-up (slowest rank, then the last arrival's, no more than it), store
    # operations (set, wait and get; rank 0's multi_get and table)
    assert float(ours[3]) >= float(ours[4]) > 0 and 3 <= int(ours[6]) <= 4, res.stdout
    assert all(float(c) > 0 for r in rows for c in r[8:10]), res.stdout  # 4 KiB, 1 MiB
    # the last arrival's start-up by phase: the phases add up to its total,
    # the start-up column of the first table (s there, ms here)
    row = next(ln for ln in phases.splitlines() if ln.startswith("| 2 |")).split("|")
    before, exchange, first, total = (float(c) for c in row[2:6])
    assert min(before, exchange, first) >= 0, phases
    assert abs(before + exchange + first - total) <= 0.3, phases
    assert abs(total - 1e3 * float(ours[4])) <= 0.6, res.stdout


def test_doors_table_subtracts_the_floor_measured_after_the_engine_call() -> None:
    # torch's floor in the conditions of a real call is (group engine + floor) - group
    # engine; the native door's net cost subtracts that, beside the back-to-back floor
    from ringlet.bench import c10d

    row = {"dtype": "float32", "bytes": 1 << 20, "ringlet op": 110.0, "engine call": 111.0,
           "group engine": 106.0, "dist native": 121.0, "dist python": 123.0,
           "torch floor": 4.0, "group engine + floor": 119.0, "deepspeed op": 150.0}
    table = c10d._doors_table([row], 2)
    last = table.splitlines()[-1].split(" | ")
    # ratio, op - engine, native - engine, native - engine - floor, floor after, net after,
    # and the two paired columns (not in this row)
    assert last[-8:] == ["1.36x", "-1.00", "+10.00", "+6.00", "13.00", "+2.00", "-", "- |"]
    assert "floor after the engine call" in table
    no_floor = {k: v for k, v in row.items() if k != "group engine + floor"}
    assert c10d._doors_table([no_floor], 2).splitlines()[-1].endswith("| - | - | - | - |")
    paired = c10d._doors_table([{**row, "paired ratio": 1.25, "paired net": 0.5}], 2)
    assert paired.splitlines()[-1].endswith("| 1.25x | +0.50 |")


def test_doors_pairs_each_rounds_doors() -> None:
    # the paired columns: the median of each round's ratio / difference
    from ringlet.bench import c10d

    assert c10d._paired({"a": [2.0, 4.0, 30.0], "b": [1.0, 2.0, 10.0]}, "a", "b", ratio=True) \
        == 2.0
    assert c10d._paired({"a": [2.0, 4.0, 30.0], "b": [1.0, 2.0, 10.0]}, "a", "b") == 2e6


def test_doors_run_in_a_shuffled_order_the_same_on_every_rank() -> None:
    # each round a permutation seeded by the round (every rank agrees on it), and over
    # the rounds every door runs right after every other door: no door always follows
    # the same neighbour (whose cache footprint it would pay for every round)
    from ringlet.bench import c10d

    doors = ["ringlet op", "engine call", "dist python", "dist native", "group engine",
             "torch floor", "group engine + floor", "deepspeed op"]
    assert c10d._round_order(doors, 7) == c10d._round_order(list(doors), 7)
    follows: dict[tuple[str, str], int] = {}
    last = None
    for r in range(201):
        order = c10d._round_order(doors, r)
        assert sorted(order) == sorted(doors)
        for door in order:
            if last is not None:
                follows[(last, door)] = follows.get((last, door), 0) + 1
            last = door
    pairs = [(a, b) for a in doors for b in doors if a != b]
    assert all(follows.get(p, 0) >= 10 for p in pairs), min(follows.get(p, 0) for p in pairs)
    # the native door is not mostly run right after the Python group's
    assert follows[("dist python", "dist native")] < 201 / 3
