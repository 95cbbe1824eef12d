"""Shared helpers: launch real ranks as processes, with a hard timeout."""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import pytest
import torch.multiprocessing as mp

TRANSPORTS = ["shm", "tcp"]


@pytest.fixture(scope="session", autouse=True)
def _native_backend_built() -> None:
    """Builds the native torch.distributed Backend (or finds it in torch's
    extension cache) once, before any test starts ranks: no rank pays the
    first-use compile (about 30 s) inside a test's timeout. Where it
    cannot be built, process groups fall back to the Python ProcessGroup and
    the native tests skip with the reason."""
    from ringlet.distributed import _native

    _native.build()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What a rank's process has imported before it starts: torch (which imports
# ringlet through its backend entry point), torch.distributed, pytest and this
# module. A spawned rank pays those imports again (2-3 s a rank on this 2-core
# machine, 5-9 s a 4-rank launch); a rank forked from a server that imported them
# once starts in a few milliseconds.
_PRELOAD = ["torch", "torch.distributed", "pytest", "conftest"]
# The key (never set in a rank's environment) that marks a launch's env as complete.
_ENV_COMPLETE = "<the launching process's whole environment>"


def start_context() -> Any:
    """The multiprocessing context ``launch`` starts ranks with (and tests that
    start processes of their own): ``forkserver`` with ``_PRELOAD`` imported in
    the server (started at the first launch, after the session's native Backend
    build), or ``spawn`` where RINGLET_TEST_START=spawn asks for fresh
    interpreters. Either way a process gets the working directory and
    ``sys.path`` of the test at its start and nothing else of its state; a rank
    of ``launch`` gets the test's whole environment too, while a process a test
    starts itself from a forkserver has the server's (the session's at the
    first launch)."""
    method = os.environ.get("RINGLET_TEST_START", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"RINGLET_TEST_START={method!r}: expected 'forkserver' or 'spawn'")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    env: dict[str, str],
    init: bool,
    timeout: float,
    results: Any,
    extra: tuple[Any, ...],
) -> None:
    # ``env`` is the launching process's whole environment plus the launch's own
    # variables (marked complete): a rank forked from the preloaded server
    # (``start_context``) would otherwise see the server's environment, not the test's.
    if env.pop(_ENV_COMPLETE, None) is not None:
        for name in set(os.environ) - set(env):
            del os.environ[name]
    os.environ.update(env)
    try:
        import torch

        # The ranks share the machine's cores: one intra-op thread each. (An
        # OMP_NUM_THREADS set here comes too late: torch is imported already,
        # and its idle OpenMP workers spin-wait on the cores the other ranks need.)
        torch.set_num_threads(1)
        import ringlet

        if init:
            ringlet.init(
                rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                timeout=timeout,
            )
        out = fn(rank, world, *extra)
        results.put((rank, "ok", out))
    except BaseException as e:  # report everything, including assertion errors
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            import ringlet

            ringlet.shutdown()
        except Exception:
            pass


def launch(
    world: int,
    fn: Callable[..., Any],
    *extra: Any,
    transport: str = "shm",
    env: dict[str, str] | None = None,
    timeout: float = 240.0,
    comm_timeout: float = 60.0,
    init: bool = True,
    expect_dead: tuple[int, ...] = (),
    per_rank_env: list[dict[str, str]] | None = None,
) -> dict[int, Any]:
    """Runs ``fn(rank, world, *extra)`` on ``world`` processes; returns
    ``{rank: result}``. Raises if any rank fails or the run outlives
    ``timeout`` (then every process is killed). Ranks in ``expect_dead`` may
    die without reporting."""
    ctx = start_context()
    results = ctx.Queue()
    port = free_port()
    full_env = {
        **os.environ,
        "RINGLET_TRANSPORT": "tcp" if transport == "tcp" else "auto",
        **(env or {}),
        _ENV_COMPLETE: "1",
    }
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                fn, r, world, port, {**full_env, **(per_rank_env[r] if per_rank_env else {})},
                init, comm_timeout, results, extra,
            ),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    failed: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                live_done = all(r in out or r in failed or r in expect_dead
                                for r in range(world))
                dead_gone = all(not procs[r].is_alive() for r in expect_dead)
                if live_done and dead_gone:
                    break  # every rank that was to live has reported
                crashed = [r for r in range(world) if r not in out and r not in failed
                           and r not in expect_dead and procs[r].exitcode not in (None, 0)]
                if crashed:  # died without reporting: no use waiting for the timeout
                    for r in crashed:
                        failed.add(r)
                        errors.append(f"rank {r}: died with exit code {procs[r].exitcode}")
                    continue
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks did not finish within {timeout}s; finished: {sorted(out)}"
                    ) from None
                continue
            if status == "ok":
                out[rank] = value
            else:
                failed.add(rank)
                errors.append(f"rank {rank}: {value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        pytest.fail("\n".join(errors))
    return out
