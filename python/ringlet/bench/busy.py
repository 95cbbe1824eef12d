"""Busy neighbours for the benchmarks: K processes that spin on the CPU beside
the job, as a neighbour's job, CPU-bound data-loader workers or another
process's threads would, so a benchmark shows what a waiting rank does when
its core is wanted by someone else (``--busy K``).

Only the first rank of each host starts them (``LOCAL_RANK`` 0, or rank 0
without a launcher), so K is per host, not per rank; they stop when the
benchmark leaves the ``with`` block, and with the process that started them
(their parent's death ends them too, so a killed benchmark leaves none behind).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

# Spins until its parent is gone (checked every few million iterations:
# os.getppid is a system call), so a benchmark killed by a signal or a
# launcher's timeout leaves no busy process behind.
_LOOP = (
    "import os\n"
    "p = os.getppid()\n"
    "while os.getppid() == p:\n"
    "    for _ in range(2_000_000):\n"
    "        pass\n"
)


def _first_on_host() -> bool:
    local = os.environ.get("LOCAL_RANK") or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
    if local is not None:
        return int(local) == 0
    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0


@contextlib.contextmanager
def neighbours(k: int) -> Iterator[list[int]]:
    """Runs ``k`` busy processes on this host while the block runs.

    Args:
      k (int): Busy processes (0: none). Started by the host's first rank only.

    Returns:
      Iterator[list[int]]: The busy processes' pids (empty on the other ranks).

    Example:
      >>> with neighbours(1):
      ...     rows = run(...)  # timed with one process spinning beside the job
    """
    if k < 0:
        raise ValueError(f"--busy {k}: expected 0 or more busy processes")
    procs = []
    if k and _first_on_host():
        procs = [subprocess.Popen([sys.executable, "-c", _LOOP]) for _ in range(k)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
