"""torch's own distributed test suite, built as PyTorch's CI builds it, on ringlet.

PyTorch's CI runs ``torch/testing/_internal/distributed/distributed_test.py``
(shipped in the torch wheel) through a small spawn driver
(``test/distributed/test_distributed_spawn.py``): with ``BACKEND``,
``WORLD_SIZE`` and ``TEMP_DIR`` in the environment it builds one unittest
class from ``TestDistBackend`` and ``DistributedTest._DistTestBase`` whose
``setUp`` spawns ``WORLD_SIZE`` processes per test. This module is that
driver, for ``BACKEND=ringlet`` (and ``gloo``, the reference), with one more
mode:

``RINGLET_SUITE_GATES=gloo``
  The suite runs as if ``BACKEND`` were ``gloo``: its skip gates (decorators
  evaluated at import, many naming gloo literally: ``BACKEND != "gloo"``,
  ``require_backend_is_available({"gloo"})``) and its test bodies'
  branches (``if BACKEND == "gloo": ...``, which the gated tests need) read
  gloo's name, while every process group is ringlet's: in each rank,
  ``init_process_group`` and ``new_group`` given ``gloo`` (or
  ``cpu:gloo``) build ringlet groups instead. Tests that compare
  ``get_backend()`` with the suite's ``BACKEND`` see ``ringlet`` there.
  Any backend name works the same way: ``RINGLET_SUITE_GATES=mpi`` runs
  the suite's MPI-only CPU tests (``all_to_all``, ``all_to_all_single``)
  on ringlet groups.

``RINGLET_SUITE_START=fork``
  Each test's ranks start by ``fork`` from this process (which has imported
  torch, ringlet and the suite) instead of ``spawn`` (PyTorch CI's: every
  rank a fresh interpreter that imports them again, several seconds of CPU
  each). The tests run the same; the whole suite takes minutes instead of
  hours on a small machine. ``tests/test_torch_suite.py`` uses it.

Environment (read at import, in the parent and in every spawned rank):
  ``BACKEND`` (default ``ringlet``), ``WORLD_SIZE`` (default 2), ``TEMP_DIR``
  (default: a fresh temporary directory), ``INIT_METHOD`` (default
  ``env://``, as the suite's), ``RINGLET_SUITE_GATES``,
  ``RINGLET_SUITE_START`` (``spawn``, the default, or ``fork``), and torch's
  ``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT`` (seconds per test, default 300).

Usage::

  BACKEND=ringlet WORLD_SIZE=2 python tests/torch_suite/driver.py \\
      [--select NAME ...] [--json-out results.json] [--list]

``--select`` takes test method names (``test_all_reduce_sum``) or shell
patterns (``test_monitored_barrier_*``); none runs the whole suite.
``--json-out`` writes ``{"tests": {name: {"outcome", "seconds", "detail"}},
"counts": {...}}`` with outcomes ``passed``, ``failed``, ``error`` and
``skipped``. ``tests/test_torch_suite.py`` runs it for ringlet and gloo and
compares them.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

BACKEND = os.environ.setdefault("BACKEND", "ringlet")
os.environ.setdefault("WORLD_SIZE", "2")
if not os.environ.get("TEMP_DIR"):
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="ringlet-torch-suite-")
GATES = os.environ.get("RINGLET_SUITE_GATES", "")
START = os.environ.get("RINGLET_SUITE_START", "") or "spawn"
if START not in ("spawn", "fork"):
    raise SystemExit(f"RINGLET_SUITE_START={START!r}: use 'spawn' or 'fork'")

import torch  # noqa: E402

import ringlet  # noqa: E402, F401  (registers the backend in every spawned rank)


def _backend_in_place_of(name: str, backend: str) -> None:
    """Makes ``init_process_group`` and ``new_group`` build ``backend``'s
    groups wherever they are asked for ``name``'s (``"gloo"``,
    ``Backend.GLOO``, ``"cpu:gloo"``)."""
    import functools
    import inspect

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def swap(value: object) -> object:
        if isinstance(value, str) and name in value.lower():
            text = value.lower()
            return backend if text == name else text.replace(f":{name}", f":{backend}")
        return value

    def wrap(original: Any) -> Any:
        sig = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args: object, **kwargs: object) -> object:
            bound = sig.bind_partial(*args, **kwargs)
            if "backend" in bound.arguments:
                bound.arguments["backend"] = swap(bound.arguments["backend"])
            return original(*bound.args, **bound.kwargs)

        return wrapper

    for attr in ("init_process_group", "new_group"):
        wrapper = wrap(getattr(c10d, attr))
        setattr(c10d, attr, wrapper)
        setattr(dist, attr, wrapper)


if GATES:
    os.environ["BACKEND"] = GATES  # the suite reads this name at import
    _backend_in_place_of(GATES, BACKEND)
try:
    from torch.testing._internal.distributed import distributed_test as _suite
finally:
    os.environ["BACKEND"] = BACKEND

TestDistBackend = _suite.TestDistBackend
DistributedTest = _suite.DistributedTest

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """torch CI's class (test_distributed_spawn.py), for any ``BACKEND``;
    its ranks forked instead of spawned under ``RINGLET_SUITE_START=fork``."""

    def setUp(self) -> None:
        super().setUp()
        if START == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def test_names() -> list[str]:
    """Every test method of the suite, in its order (unittest's: sorted).

    Returns:
      list[str]: method names such as ``"test_all_reduce_sum"``.

    Example:
      >>> "test_barrier" in test_names()
      True
    """
    import unittest

    return list(unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn))


def run(select: list[str], json_out: str = "") -> dict:
    """Runs the selected tests (all for an empty ``select``) and returns
    their outcomes; writes them as JSON to ``json_out`` when given.

    Args:
      select (list[str]): Method names or shell patterns.
      json_out (str): Where to write the results ("" for nowhere).

    Returns:
      dict: ``{"config": {...}, "tests": {name: {"outcome", "seconds",
      "detail"}}, "counts": {outcome: n}}``.

    Example:
      >>> run(["test_barrier"])["tests"]["test_barrier"]["outcome"]
      'passed'
    """
    import fnmatch
    import json
    import time
    import traceback
    import unittest

    names = test_names()
    if select:
        names = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in select)]
    results: dict[str, dict] = {}

    class Recorder(unittest.TextTestResult):
        def startTest(self, test: unittest.TestCase) -> None:
            self._t0 = time.monotonic()
            super().startTest(test)

        def _put(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
            name = test.id().rsplit(".", 1)[-1]
            results[name] = {"outcome": outcome, "seconds": round(time.monotonic() - self._t0, 2),
                             "detail": detail[-4000:]}

        def addSuccess(self, test: unittest.TestCase) -> None:
            super().addSuccess(test)
            self._put(test, "passed")

        def addFailure(self, test: unittest.TestCase, err: object) -> None:
            super().addFailure(test, err)  # type: ignore[arg-type]
            self._put(test, "failed", "".join(traceback.format_exception(*err)))  # type: ignore[misc]

        def addError(self, test: unittest.TestCase, err: object) -> None:
            super().addError(test, err)  # type: ignore[arg-type]
            self._put(test, "error", "".join(traceback.format_exception(*err)))  # type: ignore[misc]

        def addSkip(self, test: unittest.TestCase, reason: str) -> None:
            super().addSkip(test, reason)
            self._put(test, "skipped", reason)

        def addExpectedFailure(self, test: unittest.TestCase, err: object) -> None:
            super().addExpectedFailure(test, err)  # type: ignore[arg-type]
            self._put(test, "passed", "expected failure")

        def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
            super().addUnexpectedSuccess(test)
            self._put(test, "failed", "unexpected success")

    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=Recorder)
    runner.run(suite)
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    out = {"config": {"backend": BACKEND, "gates": GATES or BACKEND, "start": START,
                      "world_size": int(os.environ["WORLD_SIZE"]),
                      "init_method": os.environ.get("INIT_METHOD", "env://"),
                      "torch": torch.__version__},
           "tests": results, "counts": counts}
    if json_out:
        with open(json_out, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
    return out


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--select", nargs="*", default=[], help="test names or patterns")
    parser.add_argument("--json-out", default="", help="write the outcomes here")
    parser.add_argument("--list", action="store_true", help="print the test names")
    args, _ = parser.parse_known_args(argv)
    if args.list:
        print("\n".join(test_names()))
        return 0
    out = run(args.select, args.json_out)
    print(out["config"], out["counts"], file=sys.stderr)
    return 0 if not (out["counts"].get("failed") or out["counts"].get("error")) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
