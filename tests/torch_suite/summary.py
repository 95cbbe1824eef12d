"""Counts of torch's distributed suite runs, as a Markdown table.

Reads the JSON files ``tests/test_torch_suite.py`` (with
``RINGLET_TORCH_SUITE_OUT=DIR``) or ``driver.py --json-out`` wrote::

  python tests/torch_suite/summary.py DIR

prints one row per run (backend, gates, ranks: passed / failed / errors /
skipped) and, per world size, the tests gloo passes that a ringlet run does
not, with their outcome.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(directory: str) -> list[dict]:
    """Every run in ``directory`` (files ``*.json`` with a ``config``).

    Args:
      directory (str): Where the runs' JSON files are.

    Returns:
      list[dict]: the runs, sorted by world size, backend and gates.

    Example:
      >>> [r["config"]["backend"] for r in load("out")]
      ['gloo', 'ringlet', 'ringlet']
    """
    runs = []
    for f in sorted(Path(directory).glob("*.json")):
        data = json.loads(f.read_text())
        if "config" in data and "tests" in data:
            runs.append(data)
    return sorted(runs, key=lambda r: (r["config"]["world_size"], r["config"]["backend"],
                                       r["config"]["gates"]))


def table(runs: list[dict]) -> str:
    """The Markdown table of ``runs``' counts and differences from gloo.

    Args:
      runs (list[dict]): As :func:`load` returns them.

    Returns:
      str: the table, then the tests gloo passes that a ringlet run does not.

    Example:
      >>> print(table(load("out")))  # doctest: +SKIP
    """
    lines = ["| backend | suite's BACKEND (gates) | ranks | start | tests | passed | failed "
             "| errors | skipped |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        c, n = r["config"], r["counts"]
        lines.append(f"| {c['backend']} | {c['gates']} | {c['world_size']} "
                     f"| {c.get('start', 'spawn')} | {len(r['tests'])} "
                     f"| {n.get('passed', 0)} | {n.get('failed', 0)} | {n.get('error', 0)} "
                     f"| {n.get('skipped', 0)} |")
    notes = []
    for world in sorted({r["config"]["world_size"] for r in runs}):
        gloo = [r for r in runs if r["config"]["world_size"] == world
                and r["config"]["backend"] == "gloo"]
        if not gloo:
            continue
        passed = {n for n, t in gloo[0]["tests"].items() if t["outcome"] == "passed"}
        for r in runs:
            c = r["config"]
            if c["world_size"] != world or c["backend"] == "gloo":
                continue
            diff = {n: r["tests"][n]["outcome"] for n in sorted(passed)
                    if n in r["tests"] and r["tests"][n]["outcome"] != "passed"}
            kinds: dict[str, int] = {}
            for o in diff.values():
                kinds[o] = kinds.get(o, 0) + 1
            notes.append(f"- {c['backend']} (BACKEND={c['gates']}), {world} ranks: of gloo's "
                         f"{len(passed)} passes, {len(passed) - len(diff)} pass"
                         + (f"; not passed: {kinds} {sorted(diff)}" if diff else ""))
    return "\n".join([*lines, "", *notes])


if __name__ == "__main__":
    print(table(load(sys.argv[1] if len(sys.argv) > 1 else ".")))
