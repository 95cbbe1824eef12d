"""torchft on ringlet: ``ringlet.torchft.ProcessGroupRinglet`` under torchft's
Manager, against torchft's own ``ProcessGroupGloo`` in the same run.

Two replica groups (one process each) train the same model; replica 1 is
killed (SIGKILL) mid-training and started again, heals from replica 0, and
both finish. The final parameters must be the same on both replicas and the
same as gloo's, bit for bit (the data of each step is a function of the
step; the killed step is not committed on either backend)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

import torchft_job

STEPS, DIE_AT = 6, 3


@pytest.mark.parametrize("mode", ["ddp", "allreduce"])
def test_killed_replica_heals_and_training_equals_gloo(mode: str) -> None:
    """``ddp``: torchft's DistributedDataParallel, replica 1 killed between
    steps (as torchft's own recovery tests). ``allreduce``: gradients through
    ``manager.allreduce``, replica 1 killed after its forward pass, so
    replica 0's allreduce loses its peer: ringlet's error reaches
    ``should_commit`` (the step is not committed) and the next quorum heals."""
    pytest.importorskip("torchft", reason="optional: pip install 'ringlet[torchft]'")
    runs = {b: torchft_job.run(b, STEPS, DIE_AT, mode=mode, timeout=240)
            for b in ("gloo", "ringlet")}
    for backend, r in runs.items():
        res = r["results"]
        assert r["exitcode"] == -signal.SIGKILL and r["restarts"] == 1, (backend, r["exitcode"])
        assert res[0]["pg"] == f"torchft-{backend}"
        assert res[0]["step"] == res[1]["step"] == STEPS, backend
        # the replacement started at the step it healed to, not at 0
        assert res[1]["times"][0][0] == DIE_AT, (backend, res[1]["times"])
        assert res[0]["state"] == res[1]["state"], f"{backend}: replicas differ after healing"
        # the step the kill interrupted was retried, not committed
        uncommitted = [s for s, _, committed in res[0]["times"] if not committed]
        assert uncommitted == ([DIE_AT] if mode == "allreduce" else []), (backend, uncommitted)
    mine, gloo = runs["ringlet"]["results"][0]["state"], runs["gloo"]["results"][0]["state"]
    assert mine.keys() == gloo.keys()
    for k in mine:
        assert mine[k] == gloo[k], f"{k}: ringlet's training differs from gloo's"


def test_import_without_torchft_names_the_package() -> None:
    code = ("import sys; sys.modules['torchft'] = sys.modules['torchft.process_group'] = None\n"
            "try:\n    import ringlet.torchft\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "ringlet.torchft needs torchft: pip install torchft" in out.stdout, out
