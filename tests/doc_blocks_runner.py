"""Runs documented code blocks one after another in this process (see
``tests/test_doc_blocks.py``, which launches it).

``python doc_blocks_runner.py SPEC`` where ``SPEC`` is a JSON list of
``{"name": ..., "code": ..., "dir": ...}``: each block runs in a fresh
``__main__`` module, in its own working directory, then
the process is torn down (``torch.distributed``'s groups destroyed,
``ringlet.shutdown()``) before the next block starts. Under ``torchrun`` each
block gets a store of its own, served as torchrun's agent serves its store
(rank 0 holds it; its port reaches the others through the agent's store), so
that no block sees the keys of the one before; the ranks meet in the agent's
store before and after each teardown. After each block rank 0 prints a line
``DOC-BLOCK-OK <name> (<seconds> s)``; a block that raises prints its
traceback and exits 1 at once (torchrun then ends the other ranks).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import types
from datetime import timedelta
from typing import Any


def _agent_store() -> Any:
    """torchrun's agent store (None outside torchrun, or for a world of one)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        False,
        timedelta(seconds=60),
    )


def _meet(store: Any, key: str) -> None:
    """Every rank arrives at ``key`` before any leaves."""
    if store is None:
        return
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store.set(f"doc-blocks/{key}/{rank}", "1")
    store.wait([f"doc-blocks/{key}/{r}" for r in range(world)])


def _fresh_store(agent: Any, key: str) -> Any:
    """A store for the next block, served as torchrun's agent serves its
    own: rank 0 holds a new ``TCPStore`` server on a free port and every
    rank's ``MASTER_PORT`` names it (``TORCHELASTIC_USE_AGENT_STORE`` stays
    set, so the block's process groups connect to it as clients). Returns
    the server (on rank 0; None elsewhere), to keep until the block is over."""
    if agent is None:
        return None
    import torch.distributed as dist

    server = None
    if os.environ["RANK"] == "0":
        server = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            0,
            int(os.environ["WORLD_SIZE"]),
            True,
            timedelta(seconds=60),
            wait_for_workers=False,
        )
        agent.set(f"doc-blocks/{key}/port", str(server.port))
    os.environ["MASTER_PORT"] = agent.get(f"doc-blocks/{key}/port").decode()
    return server


def _teardown() -> None:
    """Leaves no group behind: torch.distributed's and ringlet's."""
    import torch.distributed as dist

    import ringlet

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    ringlet.shutdown()  # Bagua's groups too (the hook its door registers)


def main() -> None:
    with open(sys.argv[1]) as f:
        blocks = json.load(f)
    import torch

    torch.set_num_threads(1)  # the ranks share the machine's cores
    agent = _agent_store()
    for i, block in enumerate(blocks):
        start = time.monotonic()
        server = _fresh_store(agent, str(i))
        os.makedirs(block["dir"], exist_ok=True)
        os.chdir(block["dir"])
        # A fresh ``__main__`` for each block: what it defines pickles by
        # reference (RPC's functions, torch.multiprocessing's targets) and is
        # found there by the other processes' runs of the same block.
        module = types.ModuleType("__main__")
        module.__file__ = block["name"]
        sys.modules["__main__"] = module
        try:
            exec(compile(block["code"], block["name"], "exec"), module.__dict__)
        except BaseException:
            print(
                f"DOC-BLOCK-FAILED {block['name']} (rank {os.environ.get('RANK', '0')}):",
                flush=True,
            )
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        _meet(agent, f"{i}/ran")
        _teardown()
        _meet(agent, f"{i}/down")
        del server
        if os.environ.get("RANK", "0") == "0":
            print(f"DOC-BLOCK-OK {block['name']} ({time.monotonic() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
