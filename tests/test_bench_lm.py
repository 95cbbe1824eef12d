"""``python -m ringlet.bench algorithms --part lm`` on one host (2 ranks on
loopback, no namespaces, no root): a tiny LM, a few steps per mode; the
result's structure, falling finite losses, and the report's arithmetic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ringlet.bench import lm

TINY = ["--d-model", "32", "--layers", "2", "--heads", "2", "--ctx", "32", "--corpus-mb",
        "0.3", "--steps", "12", "--target-steps", "6", "--eval-every", "3", "--sync-every", "4",
        "--fragments", "2", "--delay", "1", "--lr", "3e-3"]


def test_lm_part_runs_on_one_host(tmp_path: Path) -> None:
    """Every mode asked for runs on 2 ranks: a curve from step 0 to its last
    step with finite, falling eval losses; the table has a row per mode."""
    modes = ["ddp-ringlet", "local", "diloco-hand-gloo"]
    try:  # ringlet's own DiLoCo, where this checkout has it
        from ringlet.algorithms import DiLoCo  # noqa: F401

        modes += ["diloco", "streaming-int4"]
    except ImportError:
        pass
    out = tmp_path / "lm.json"
    res = subprocess.run(
        [sys.executable, "-m", "ringlet.bench", "algorithms", "--part", "lm", "--layout", "2",
         "--modes", ",".join(modes), *TINY, "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["runs"]) == modes
    assert result["world"] == 2 and result["layout"] == [2]
    assert result["parameters"] == sum(
        p.numel() for p in lm.char_lm(result["config"]).parameters())
    for mode, run in result["runs"].items():
        want_steps = 6 if mode == "ddp-ringlet" else 12
        assert run["steps"] == want_steps
        assert [c[0] for c in run["curve"]] == list(range(0, want_steps + 1, 3)), mode
        losses = [c[2] for c in run["curve"]]
        assert all(math.isfinite(v) for v in losses), (mode, losses)
        assert losses[-1] < losses[0] - 0.2, (mode, losses)  # from ln 256 = 5.5 down
        secs = [c[1] for c in run["curve"]]
        assert secs == sorted(secs) and run["total_s"] >= secs[-1] > 0
        assert run["host_tx_bytes"] == {"host0": None}  # no namespace: no link counted
    # DDP and the hand-written DiLoCo start from the same weights and batches:
    # rank 0's model after DiLoCo's first sync differs from local's.
    ddp, local = result["runs"]["ddp-ringlet"], result["runs"]["local"]
    assert ddp["curve"][0][2] == local["curve"][0][2]
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("| ")]
    for mode in modes:
        assert any(r.startswith(f"| {mode} | ") for r in rows), res.stdout


def _fake(curves: dict[str, list[list[float]]], totals: dict[str, float],
          tx: dict[str, int], syncs: dict[str, float]) -> dict:
    runs = {m: {"curve": c, "steps": int(c[-1][0]), "total_s": totals[m],
                "host_tx_bytes": {"host0": tx[m], "host1": tx[m] // 2}, "syncs": syncs[m]}
            for m, c in curves.items()}
    cfg = {**lm.DEFAULTS, "rate": "20mbit", "modes": list(runs)}
    return {"runs": runs, "config": cfg, "layout": [2, 2], "parameters": 1_902_976,
            "corpus_bytes": 4_000_000, "torch": "x"}


def test_lm_report_arithmetic() -> None:
    """Target, time to target, speed-ups, the floor and bytes per sync,
    computed by hand on a made-up result."""
    result = _fake(
        {"ddp-ringlet": [[0, 0, 5.5, None], [30, 90, 3.0, 3.1], [60, 180, 2.5, 2.6]],
         "local": [[0, 0, 5.5, None], [60, 30, 3.2, 3.3], [120, 60, 2.9, 3.0]],
         "diloco-hand-gloo": [[0, 0, 5.5, None], [60, 45, 2.6, 2.7], [120, 90, 2.4, 2.5]],
         "diloco": [[0, 0, 5.5, None], [60, 33, 2.6, 2.7], [120, 66, 2.2, 2.3]]},
        {"ddp-ringlet": 180.0, "local": 60.0, "diloco-hand-gloo": 90.0, "diloco": 66.0},
        {"ddp-ringlet": 600_000_000, "local": 0, "diloco-hand-gloo": 60_000_000,
         "diloco": 12_000_000},
        {"ddp-ringlet": 60, "local": 0, "diloco-hand-gloo": 6, "diloco": 6})
    assert lm.target_loss(result) == 2.5
    s = lm.summary(result)
    assert s["ddp-ringlet"]["to_target_s"] == 180 and s["ddp-ringlet"]["vs_ddp_ringlet"] == 1.0
    assert s["local"]["to_target_s"] is None
    assert s["diloco-hand-gloo"]["to_target_s"] == 90
    assert s["diloco"]["to_target_s"] == 66 and s["diloco"]["to_target_step"] == 120
    assert s["diloco"]["vs_ddp_ringlet"] == pytest.approx(180 / 66)
    assert s["diloco"]["vs_hand_gloo"] == pytest.approx(90 / 66)
    assert s["diloco"]["vs_floor"] == pytest.approx(66 / 60)
    assert s["ddp-ringlet"]["vs_floor"] == pytest.approx(180 / 30)  # local at step 60: 30 s
    assert s["diloco"]["bytes_per_sync"] == 2_000_000  # the busier host, per full sync
    assert s["diloco"]["fewer_than_fp32"] == pytest.approx(5.0)
    assert s["ddp-ringlet"]["fewer_than_fp32"] is None
    assert s["diloco"]["host_mb"] == {"host0": 12.0, "host1": 6.0}
    text = lm.tables({**result, "command": "x"})
    assert "| diloco | 120 | 2.200 | 66.0 (step 120) | 2.73x | 1.36x | 66.0 | 1.10x |" in text
    result["config"]["target"] = 2.3
    assert lm.summary(result)["ddp-ringlet"]["to_target_s"] is None


def test_lm_model_and_data() -> None:
    """The default LM's size, its fragments, and the corpus from the
    standard library (no site-packages)."""
    model = lm.char_lm(lm.DEFAULTS)
    n = sum(p.numel() for p in model.parameters())
    assert 1.8e6 < n < 2.0e6
    frags = lm.fragments_of(model, 4)
    ids = [id(p) for f in frags for p in f.parameters()]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="--fragments"):
        lm.fragments_of(model, 5)
    assert not any("site-packages" in str(p) for p in lm.stdlib_sources())
    text = lm.load_corpus(0.2)
    assert len(text) == 200_000 and b"def " in text
