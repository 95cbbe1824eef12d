"""Draws the plots of docs/benchmarks/ from the tables on those pages.

Each plot comes from a measured table (the page says which command made it, on
which machine); this script reads that Markdown table and hands its rows to
``ringlet.bench.collectives.plot``, the function behind ``ringlet.bench
collectives --plot``, so a plot and its table cannot disagree. Needs matplotlib
(the ``bench`` extra). Run from the repository root:

  python docs/benchmarks/plots.py
"""

from __future__ import annotations

import pathlib
from typing import Any

from ringlet.bench.collectives import plot

HERE = pathlib.Path(__file__).parent
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}

# (page, the sentence that introduces the table, the peer's column prefix, image)
PLOTS = [
    ("collectives.md", "Shared memory vs gloo", "gloo", "shm-vs-gloo.png"),
    ("open-mpi.md", "ringlet's collectives against Open MPI", "Open MPI", "shm-vs-mpi.png"),
]


def table_after(text: str, intro: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table after the line starting with ``intro``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(intro))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    header = [c.strip() for c in lines[first].strip("|").split("|")]
    rows = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def size_bytes(size: str) -> int:
    value, unit = size.split()
    return int(float(value) * UNITS[unit])


def rows_for_plot(rows: list[dict[str, str]], peer: str) -> list[dict[str, Any]]:
    return [
        {
            "op": r["op"],
            "bytes": size_bytes(r["size"]),
            "ringlet_busbw": float(r["ringlet busbw GB/s"]),
            "peer_busbw": float(r[f"{peer} busbw GB/s"]),
        }
        for r in rows
    ]


def main() -> None:
    (HERE / "img").mkdir(exist_ok=True)
    for page, intro, peer, image in PLOTS:
        rows = table_after((HERE / page).read_text(), intro)
        plot(rows_for_plot(rows, peer), str(HERE / "img" / image), peer)
        print(f"{page} -> img/{image} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
