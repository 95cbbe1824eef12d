"""``python -m ringlet info`` and the main job's report.

The report's fields are checked against values computed here independently
(torch's and Python's versions, the interfaces, ``/proc/cpuinfo``, the
variables set in the child's environment), and the decision about the process
group is checked in each of its cases with a scratch extension directory. The
main job (``examples/train_ddp.py`` under ``torchrun``) must print a falling
loss and lines that parse, with an algorithm bandwidth that is its bytes over
its time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

import ringlet
from ringlet import info

from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], env: dict[str, str], timeout: float = 60) -> str:
    """``cmd``'s output; fails on a non-zero exit or past ``timeout`` (the
    whole session killed)."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} did not finish within {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"{cmd} exited with {proc.returncode}:\n{out}\n{err}"
    return out


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RINGLET_") and k not in ("MASTER_ADDR", "MASTER_PORT")
    }
    env.update(TORCH_EXTENSIONS_DIR=str(tmp / "ext"), PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``python -m ringlet info --json`` with a few variables set."""
    tmp = tmp_path_factory.mktemp("info")
    env = _env(
        tmp,
        RINGLET_TIMEOUT="123",
        RINGLET_TIMOUT="9",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29577",
        RINGLET_NATIVE="0",
    )
    out = _run([sys.executable, "-m", "ringlet", "info", "--json"], env)
    return json.loads(out)  # type: ignore[no-any-return]


def test_versions_and_installation(report: dict[str, Any]) -> None:
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["distributed"] is torch.distributed.is_available()
    assert report["python"]["version"] == sys.version
    assert report["python"]["executable"] == sys.executable
    assert report["ringlet"]["version"] == ringlet.__version__
    assert Path(report["ringlet"]["location"]) == Path(ringlet.__file__).resolve().parent
    try:
        dist = metadata.distribution("ringlet")
    except metadata.PackageNotFoundError:
        assert report["ringlet"]["install"].startswith("not installed")
        return
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    tags = re.findall(r"^Tag: (\S+)", dist.read_text("WHEEL") or "", re.M)
    if direct.get("dir_info", {}).get("editable"):
        assert report["ringlet"]["install"].startswith("editable/source build")
        assert report["ringlet"]["wheel_tag"] is None
    else:
        assert report["ringlet"]["wheel_tag"] == ", ".join(tags)


def test_configuration_variables(report: dict[str, Any]) -> None:
    config = report["configuration"]
    assert config["ringlet"] == {
        "RINGLET_NATIVE": "0",
        "RINGLET_TIMEOUT": "123",
        "RINGLET_TIMOUT": "9",
    }
    assert config["not_read_by_ringlet"] == ["RINGLET_TIMOUT"]  # the typo, and only it
    assert config["other"]["MASTER_ADDR"] == "127.0.0.1"
    assert config["other"]["MASTER_PORT"] == "29577"
    assert report["process_group"]["kind"] == "python"
    assert "RINGLET_NATIVE=0" in report["process_group"]["why"]


def test_transports(report: dict[str, Any]) -> None:
    tr = report["transports"]
    assert set(tr) == {
        "between_ranks_on_this_host",
        "between_hosts",
        "shared_memory",
        "cross_memory_attach",
        "tcp",
    }
    assert tr["shared_memory"]["available"] is True  # Linux with memfd_create: every CI host
    cma = tr["cross_memory_attach"]
    assert isinstance(cma["available"], bool) and cma["detail"] and cma["enabled"] is True
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except OSError:
        scope = None
    assert cma["ptrace_scope"] == scope
    if scope is not None and scope >= 2:
        assert cma["available"] is False
    words = info.describe_transport("shm+cma" if cma["available"] else "shm")
    assert tr["between_ranks_on_this_host"] == words
    names = {i["name"] for i in tr["tcp"]["interfaces"]}
    assert names == {name for _, name in socket.if_nameindex()}
    assert {"name": "lo", "ipv4": "127.0.0.1", "up": True, "loopback": True} in (
        tr["tcp"]["interfaces"]
    )
    # MASTER_ADDR is 127.0.0.1: ringlet listens on the loopback
    assert tr["tcp"]["listens_on"]["address"] == "127.0.0.1"
    assert tr["tcp"]["listens_on"]["interface"] == "lo"


def test_simd_kernels_follow_the_cpu(report: dict[str, Any]) -> None:
    flags = set(
        re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split()
    )  # type: ignore[union-attr]
    simd = report["simd"]
    avx2, f16c, avx512 = "avx2" in flags, "f16c" in flags, "avx512f" in flags
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("the variants below are x86-64's")
    f16 = (
        "avx512f+f16c"
        if avx512 and avx2 and f16c
        else "avx2+f16c"
        if avx2 and f16c
        else ("portable")
    )
    assert simd["float16 reduce"] == f16
    assert simd["minmax_uint8 codec"] == f16
    assert simd["float16 convert"] == ("avx2+f16c" if avx2 and f16c else "portable")
    assert simd["bfloat16 convert"] == ("avx2" if avx2 else "portable")
    assert simd["bfloat16 reduce"] == (
        "avx512f" if avx512 and avx2 and f16c else "avx2" if avx2 else "portable"
    )
    assert simd["float32/float64/integer reduce"].endswith("(compiled in)")


def test_text_report(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The plain report (``python -m ringlet info``, run here in this process
    through ``ringlet.__main__``) names what the JSON holds, one line a fact;
    a RINGLET_ADDR is the listener's address."""
    from ringlet.__main__ import main

    monkeypatch.setenv("RINGLET_SPIN", "77")
    monkeypatch.setenv("RINGLET_ADDR", "127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for section in (
        "versions",
        "machine",
        "process group",
        "transports",
        "SIMD kernels (selected on this CPU)",
        "configuration (variables set)",
    ):
        assert f"--- {section}\n" in out
    assert re.search(rf"^torch\s+: {re.escape(torch.__version__)}$", out, re.M)
    assert re.search(r"^RINGLET_SPIN\s+: 77$", out, re.M)
    assert re.search(r"^GLOO_SOCKET_IFNAME\s+: lo .*ringlet does not read it", out, re.M)
    assert re.search(r"^TCP listener address\s+: 127\.0\.0\.1 on lo \(RINGLET_ADDR\)$", out, re.M)
    assert re.search(r'^init_process_group\("ringlet"\) uses : ', out, re.M)


def test_usage_and_unknown_command() -> None:
    from ringlet.__main__ import main

    assert main(["--help"]) == 0
    assert main(["nonsense"]) == 2


# -- which process group, case by case (in this process, with a scratch cache) ----------


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty extension cache, and a torch version no wheel carries a
    prebuilt library for (``_native`` reads torch's version through
    ``_torch_version``, which its own tests replace the same way)."""
    from ringlet.distributed import _native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for k in ("RINGLET_NATIVE", "CXX"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(_native, "_torch_version", lambda: "0.0.1+info-test", raising=False)
    return tmp_path


def _prebuilt() -> bool:
    from ringlet.distributed import _native

    status = getattr(_native, "status", None)
    return bool(callable(status) and status().get("prebuilt"))


def test_process_group_decision(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ringlet.distributed import _native

    name = _native.library_name()
    monkeypatch.setenv("RINGLET_NATIVE", "0")
    assert info._process_group_section()["kind"] == "python"
    monkeypatch.setenv("RINGLET_NATIVE", "auto")
    pg = info._process_group_section()
    assert pg["native"]["cache_path"] == str(scratch / name / f"{name}.so")
    if _prebuilt():
        assert pg["kind"] == "native" and "prebuilt" in pg["why"]
        return
    assert pg["kind"] == "python" and not pg["native"]["cached"]
    if pg["native"]["compiler"] and pg["native"]["ninja"]:
        assert "background build" in pg["why"] and "_native.build()" in pg["why"]
    # RINGLET_NATIVE=1 without a compiler: init_process_group would raise
    monkeypatch.setenv("RINGLET_NATIVE", "1")
    monkeypatch.setenv("CXX", "no-such-compiler-x")
    pg = info._process_group_section()
    assert pg["kind"] == "none" and "no-such-compiler-x" in pg["why"]
    monkeypatch.delenv("CXX")
    # a build another process is running, then one it left in the cache
    monkeypatch.setenv("RINGLET_NATIVE", "auto")
    (scratch / f"{name}.building").touch()
    pg = info._process_group_section()
    assert pg["kind"] == "python" and pg["native"]["building"] is True
    (scratch / name).mkdir()
    (scratch / name / f"{name}.so").write_bytes(b"")
    pg = info._process_group_section()
    assert pg["kind"] == "native" and pg["native"]["cached"] is True


def test_process_group_remembers_a_failed_build(
    scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ringlet.distributed import _native

    if _prebuilt() or not hasattr(_native, "_env_digest"):
        pytest.skip("a prebuilt library for this torch, or a _native without remembered failures")
    name = _native.library_name()
    digest = _native._env_digest(_native._environment(name))
    record = {
        "digest": digest,
        "cause": "fatal error: Python.h: No such file",
        "log": str(scratch / f"{name}.log"),
    }
    (scratch / f"{name}.failed").write_text(json.dumps(record))
    pg = info._process_group_section()
    assert pg["kind"] == "python" and "Python.h: No such file" in pg["why"]
    assert pg["native"]["build_log"] == record["log"]
    record["digest"] = "another environment"
    (scratch / f"{name}.failed").write_text(json.dumps(record))
    pg = info._process_group_section()
    assert pg["native"]["failed_build"] is None and "Python.h" not in pg["why"]
    assert (scratch / f"{name}.failed").exists()  # read, never removed by the report


def test_describe_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RINGLET_CMA", "RINGLET_CMA_THRESHOLD", "RINGLET_TRANSPORT"):
        monkeypatch.delenv(k, raising=False)
    shm_cma = "shared memory (staged copies; cross-memory attach available)"
    assert info.describe_transport("shm+cma") == shm_cma
    assert info.describe_transport("shm") == (
        "shared memory (staged copies; cross-memory attach not permitted between these processes)"
    )
    assert info.describe_transport("tcp") == "TCP"
    monkeypatch.setenv("RINGLET_CMA", "0")
    assert "turned off by RINGLET_CMA=0" in info.describe_transport("shm")
    monkeypatch.setenv("RINGLET_CMA_THRESHOLD", "1048576")
    assert "single-copy reads from there" in info.describe_transport("shm+cma")
    monkeypatch.setenv("RINGLET_TRANSPORT", "tcp")
    assert info.describe_transport("tcp") == "TCP (forced by RINGLET_TRANSPORT=tcp)"
    assert info.describe_transport("local") == "no transport (a world of one process)"


# -- the main job ---------------------------------------------------------------------


def test_main_job_says_what_it_measured(tmp_path: Path) -> None:
    """``torchrun --nproc_per_node 2 examples/train_ddp.py``: a falling loss,
    the transport in words, the all-reduce's time alone and its algorithm
    bandwidth (the gradients' bytes over that time), and the wait apart."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(ROOT / "examples" / "train_ddp.py"),
    ]
    out = _run(cmd, _env(tmp_path, OMP_NUM_THREADS="1"), timeout=120)
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\d+\.\d+)$", out, re.M)]
    assert len(losses) == 7 and losses[-1] < losses[0] / 5, out
    (world,) = re.findall(r"^world 2 over (.+)$", out, re.M)
    assert world in {info.describe_transport(t) for t in ("shm+cma", "shm")}, world
    (line,) = re.findall(r"^all-reduce of the gradients .*$", out, re.M)
    m = re.fullmatch(
        r"all-reduce of the gradients \((\d+\.\d+) MB per step, one coalesced call\): "
        r"(\d+\.\d+) ms per step in communication alone \(median of 60\), "
        r"algorithm bandwidth (\d+\.\d+) GB/s \(bytes / time\)",
        line,
    )
    assert m, line
    mb, ms, gbps = (float(g) for g in m.groups())
    params = (32 * 256 + 256) + (256 * 256 + 256) + (256 + 1)  # the example's MLP
    assert mb == round(params * 4 / 1e6, 2)
    assert ms > 0 and gbps == pytest.approx(params * 4 / (ms * 1e-3) / 1e9, rel=0.05, abs=0.01)
    assert re.search(
        r"^waiting for the slower rank before it \(a barrier, not counted "
        r"above\): \d+\.\d+ ms per step \(mean\)$",
        out,
        re.M,
    ), out


def test_transports_without_cross_memory_attach(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a second process may not read this one's memory (Yama's
    ptrace_scope 1 between sibling ranks, a seccomp profile), the report says
    so, and warns that ringlet.rpc's single-copy path needs RINGLET_CMA=0."""
    denied = {"shm": "ok", "cma": "process_vm_readv: Operation not permitted"}
    monkeypatch.setattr(info, "_probe_peer_access", lambda: denied)
    for k in ("RINGLET_CMA", "RINGLET_TRANSPORT"):
        monkeypatch.delenv(k, raising=False)
    tr = info._transports_section()
    assert tr["between_ranks_on_this_host"] == info.describe_transport("shm")
    cma = tr["cross_memory_attach"]
    assert cma["available"] is False and cma["detail"] == denied["cma"]
    assert "RINGLET_CMA=0" in cma["note"]
    monkeypatch.setenv("RINGLET_CMA", "0")
    cma = info._transports_section()["cross_memory_attach"]
    assert cma["enabled"] is False and cma["note"] is None
