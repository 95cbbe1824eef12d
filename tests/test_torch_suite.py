"""torch's own distributed test suite (distributed_test.py) on ringlet, against gloo.

``tests/torch_suite/driver.py`` builds the suite's unittest class as
PyTorch's CI does; this file runs it in subprocesses for gloo and for ringlet
(``BACKEND=ringlet``, and with the suite's literal gloo gates lifted:
``RINGLET_SUITE_GATES=gloo``), on the same machine in the same run, and
compares: every test that passes on gloo passes on ringlet with the gates
lifted, and nothing that passes on gloo fails on ringlet (with
``BACKEND=ringlet`` the gloo-gated tests skip).

The default run is a fixed, cheap part (about 25 s on 2 cores): at 2 ranks,
gloo and both ringlet modes on collectives, point-to-point, objects, DDP,
and the gloo-gated barrier and monitored_barrier timeouts; at 4 ranks,
ringlet with the gates lifted on two tests gloo passes there. The whole
suite, every test at 2 and 4 ranks, gloo and both ringlet modes (about
9 minutes on 2 cores)::

  RINGLET_TORCH_SUITE=all RINGLET_TORCH_SUITE_OUT=suite-out \
      python -m pytest -q tests/test_torch_suite.py
  python tests/torch_suite/summary.py suite-out

(``-k 2ranks`` or ``-k 4ranks`` for one world size). The ranks start by
``fork`` from the driver, which has imported torch and the suite once, so a
test costs its own time, not two interpreters' start; PyTorch's CI spawns
them (``RINGLET_SUITE_START=spawn`` here: 10 to 20 times slower on small
machines, same outcomes). ``RINGLET_TORCH_SUITE_OUT=DIR`` keeps each
configuration's outcomes and log there (``docs/torch-suite.md`` has
the counts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("expecttest", reason="torch's suite imports it: pip install expecttest")

DRIVER = Path(__file__).parent / "torch_suite" / "driver.py"
ALL = os.environ.get("RINGLET_TORCH_SUITE", "") == "all"
START = os.environ.get("RINGLET_SUITE_START", "fork")

# The default run: deterministic, CPU, well under a second each (fork).
SUBSET = {
    2: ["test_all_reduce_sum", "test_send_recv", "test_scatter",
        "test_all_gather_object_default_pg", "test_DistributedDataParallelCPU",
        "test_barrier_timeout_full_group", "test_monitored_barrier_gloo_rank_0_timeout"],
    4: ["test_all_reduce_sum", "test_gather_object_subgroup"],
}
# The gloo-gated tests in SUBSET[2] (``BACKEND != "gloo"``, and backend sets
# naming gloo such as ``backend_feature["gpu"]``): they run with the gates
# lifted, and skip without.
GATED = {"test_barrier_timeout_full_group", "test_monitored_barrier_gloo_rank_0_timeout",
         "test_all_gather_object_default_pg"}
# With the gates lifted the suite believes it runs gloo: these compare the
# group's backend name (ringlet's) with "gloo". They pass with BACKEND=ringlet.
NAME_CHECKS = {"test_get_backend"}


def run_suite(backend: str, world: int, gates: str, select: list[str], out_dir: Path,
              timeout: float) -> dict:
    """Runs the driver in a fresh interpreter (the suite reads its
    environment at import); returns its JSON outcomes."""
    tag = f"{backend}{'-gates-' + gates if gates else ''}-{world}"
    out = out_dir / f"{tag}.json"
    temp = tempfile.mkdtemp(prefix=f"torch-suite-{tag}-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RINGLET_"))}
    env.update(BACKEND=backend, WORLD_SIZE=str(world), TEMP_DIR=temp,
               RINGLET_SUITE_GATES=gates, RINGLET_SUITE_START=START)
    env.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "300")
    cmd = [sys.executable, str(DRIVER), "--json-out", str(out)]
    if select:
        cmd += ["--select", *select]
    with open(out_dir / f"{tag}.log", "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                       check=False)
    assert out.exists(), f"{tag}: the driver wrote no results; see {out_dir / (tag + '.log')}"
    return json.loads(out.read_text())


def _outcomes(res: dict) -> dict[str, str]:
    return {name: t["outcome"] for name, t in res["tests"].items()}


def _details(res: dict, names: object) -> dict[str, str]:
    return {n: res["tests"][n]["detail"][-1500:] for n in names}  # type: ignore[attr-defined]


@pytest.mark.timeout(6 * 3600 if ALL else 300)
@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_ringlet_passes_what_gloo_passes(world: int, tmp_path: Path) -> None:
    out_dir = Path(os.environ.get("RINGLET_TORCH_SUITE_OUT", "") or tmp_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    timeout = 4 * 3600 if ALL else 240
    if not ALL and world == 4:
        # Default run at 4 ranks: ringlet with the gates lifted only (every
        # test gloo runs); the full run compares these two with gloo too.
        lifted_res = run_suite("ringlet", world, "gloo", SUBSET[4], out_dir, timeout)
        lifted = _outcomes(lifted_res)
        bad = {n: o for n, o in lifted.items() if o != "passed"}
        assert sorted(lifted) == sorted(SUBSET[4]) and not bad, (
            lifted, _details(lifted_res, bad))
        return
    select = [] if ALL else SUBSET[world]
    gloo = _outcomes(run_suite("gloo", world, "", select, out_dir, timeout))
    plain_res = run_suite("ringlet", world, "", select, out_dir, timeout)
    plain = _outcomes(plain_res)
    lifted_res = run_suite("ringlet", world, "gloo", select, out_dir, timeout)
    lifted = _outcomes(lifted_res)
    assert set(gloo) == set(plain) == set(lifted)
    if not ALL:
        assert set(gloo) == set(select), sorted(gloo)
        assert all(o == "passed" for o in gloo.values()), gloo
    gloo_passed = sorted(n for n, o in gloo.items() if o == "passed")
    assert gloo_passed, "gloo passed nothing: the driver is broken"
    # With the gates lifted, whatever gloo passes, ringlet passes.
    lost = {n: lifted[n] for n in gloo_passed if lifted[n] != "passed" and n not in NAME_CHECKS}
    assert not lost, (f"passed on gloo, not on ringlet (gates lifted): {lost}\n"
                      f"{_details(lifted_res, lost)}")
    # BACKEND=ringlet: gloo-gated tests skip; none that passes on gloo fails.
    failed = {n: plain[n] for n in gloo_passed if plain[n] in ("failed", "error")}
    assert not failed, (f"passed on gloo, failed on ringlet (BACKEND=ringlet): {failed}\n"
                        f"{_details(plain_res, failed)}")
    for n in NAME_CHECKS & set(gloo_passed):
        assert plain[n] == "passed", (n, plain[n])
    # Nothing ringlet runs fails, in either mode, where gloo's outcome is a skip.
    for mode, got in (("BACKEND=ringlet", plain), ("gates lifted", lifted)):
        bad = {n: o for n, o in got.items() if o in ("failed", "error") and gloo[n] != "failed"
               and not (got is lifted and n in NAME_CHECKS)}
        assert not bad, f"{mode}: {bad}"
    if not ALL:
        # the subset's gloo-gated tests ran with the gates lifted, and skipped without
        assert {n: plain[n] for n in select} == {
            n: "skipped" if n in GATED else "passed" for n in select}, plain
