"""Run by .ci/wheel.sh in the venv that holds only the built wheel, with no C++ compiler
and no Rust on PATH (CXX points nowhere).

``torchrun --nproc_per_node 2 wheel_native_check.py native``: ``init_process_group("ringlet")``
runs on the native C++ Backend at its first call (the wheel's prebuilt library: nothing is
compiled), ``dist.new_group(backend="cpu:ringlet,cuda:gloo")`` (a mixed string: the Python
ProcessGroup cannot stand in one; torch refuses a device-less ``cpu:ringlet,gloo``) reduces
CPU tensors on ringlet, and ``dist.shrink_group``
gives rank 0 a working group of itself once rank 1 has left.

``python wheel_native_check.py fallback <cache>`` (one process, run twice): under a torch
whose version differs from the wheel's (simulated), the group is the Python ProcessGroup and
rank 0 warns once with the reason; the second run, after the background build failed for
want of a compiler, names the compiler's own error ("c++: not found") and its log.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def native() -> None:
    from ringlet.distributed import _native
    from ringlet.distributed.c10d import backend_kind

    dist.init_process_group("ringlet")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    status = _native.status()
    assert backend_kind() == "native", (backend_kind(), _native.reason())
    assert status["origin"] == "prebuilt", status
    cpu = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert type(cpu).__name__ == "RingletBackend", cpu
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 5, t

    mixed = dist.new_group(backend="cpu:ringlet,cuda:gloo")
    backend = mixed._get_backend(torch.device("cpu"))
    assert type(backend).__name__ == "RingletBackend", backend
    x = torch.arange(6.0) * (rank + 1)
    dist.all_reduce(x, group=mixed)
    assert torch.equal(x, torch.arange(6.0) * 3), x

    dist.barrier()
    if rank == 1:  # leaves the job; torchrun's store outlives it
        sys.stdout.flush()
        os._exit(0)
    smaller = dist.shrink_group([1])
    assert dist.group.WORLD is smaller and dist.get_world_size() == 1, dist.get_world_size()
    assert backend_kind() == "native", backend_kind()
    y = torch.arange(3.0)
    dist.all_reduce(y)
    assert y.tolist() == [0.0, 1.0, 2.0], y
    print(
        f"wheel check: native Backend ({status['prebuilt']}); cpu:ringlet,cuda:gloo and "
        "shrink_group work",
        flush=True,
    )
    dist.destroy_process_group()


def fallback(cache: str) -> None:
    from ringlet.distributed import _native
    from ringlet.distributed.c10d import backend_kind

    _native._torch_version = lambda: "2.12.0+cpu"  # a torch the wheel has no library for
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                said.append(record.getMessage())

    logging.getLogger("ringlet").addHandler(Keep())
    dist.init_process_group("ringlet", store=dist.HashStore(), rank=0, world_size=1)
    dist.new_group(backend="ringlet")
    x = torch.ones(2)
    dist.all_reduce(x)
    assert backend_kind() == "python", backend_kind()
    assert len(said) == 1, said
    dist.destroy_process_group()
    deadline = time.monotonic() + 120  # the background build this run may have started
    while any(Path(cache).glob("*.building")) and time.monotonic() < deadline:
        time.sleep(0.2)
    print(json.dumps({"message": said[0]}))


if __name__ == "__main__":
    if sys.argv[1] == "native":
        native()
    else:
        fallback(sys.argv[2])
