"""Training a language model across slow links: ``python -m ringlet.bench
algorithms --part lm`` (as root).

A character-level transformer LM (byte vocabulary of 256, ``--d-model 192``,
``--layers 4``, ``--heads 6``, context ``--ctx 128``: 1.90 M parameters) learns
the Python standard library's own source (the ``*.py`` files under
``os.path.dirname(os.__file__)``, site-packages left out, in sorted order, the
first ``--corpus-mb`` MB: nothing is downloaded). The last 10% of the text is
held out: the eval loss is the mean cross-entropy (nats per byte) of rank 0's
model on ``--eval-batches`` fixed windows of it. Every rank draws its own
batches (``--batch`` windows a step, seeded by rank: the same batches in every
mode), and every mode starts from the same weights (``--seed``) with the same
inner optimizer: AdamW (``--lr``, weight decay 0.01).

The launcher makes hosts of network namespaces joined by tbf rate-limited
links (:mod:`ringlet.bench.netns`; ``--rate``, default 20mbit, ``--layout``,
default 2,2) and runs ``torchrun`` inside each, as the other parts do
(``--layout N``: one host, no namespaces, no root). The modes:

* ``local``: no communication at all (the floor);
* ``ddp-gloo``, ``ddp-ringlet``: torch's DDP on gloo, on ringlet;
* ``bytegrad``: torch DDP on ringlet with ringlet's ByteGrad hook
  (:class:`ringlet.distributed.hooks.ByteGradState`, 8-bit across hosts,
  error feedback);
* ``diloco-hand-gloo``: DiLoCo written by hand over plain
  ``dist.all_reduce`` on the gloo group (blocking, one call per parameter,
  unquantized: the torchft way), H = ``--sync-every`` (20);
* ``diloco``: ringlet's :class:`ringlet.algorithms.DiLoCo`, H = 20, int8;
* ``streaming-int8``, ``streaming-int4``: ringlet's Streaming DiLoCo, 4
  fragments (``--fragments``: embeddings and block 0, block 1, block 2,
  block 3 and the head), ``fragment_sync_delay`` ``--delay`` (2), int8 or
  int4, one outer optimizer per fragment;
* ``localsgd``: ringlet's :class:`ringlet.algorithms.LocalSGD`, H = 20;
* not run by default (``--modes``): ``diloco-fp32`` (ringlet's DiLoCo
  unquantized) and ``diloco-hand-ringlet`` (the hand-written DiLoCo over
  ``dist.all_reduce`` on ringlet's group).

The outer optimizer of every DiLoCo mode is DiLoCo's: SGD, lr ``--outer-lr``
(0.7), momentum 0.9, Nesterov. DDP modes (``ddp-*``, ``bytegrad``) run
``--target-steps`` steps (60), every other mode ``--steps`` (120).

Per mode the bench records the eval loss every ``--eval-every`` steps (5)
against the training time so far (rank 0's clock; the eval itself is not
timed: rank 0 copies its weights at each eval point, in a few milliseconds
off the clock, and evaluates every copy after the mode), the total time of
the mode's steps (the slowest rank's, waiting for the last sync included),
and the bytes each host sent on its link (``tx_bytes`` of the host's
interface in ``/proc/net/dev``, read inside the host's namespace before and
after the mode: every byte, TCP/IP headers and retransmissions included).

The report: the target loss is ``ddp-ringlet``'s eval loss after
``--target-steps`` steps (``--target LOSS`` to set it; without
``ddp-ringlet``, the first DDP mode's), and per mode the time it first
reached it (at an eval point, within 0.001), its speed-up over ``ddp-ringlet`` and
``diloco-hand-gloo``, its total time over the ``local`` floor's for the same
number of steps, the MB each host sent, and the bytes a host sent per full
sync (all the weights once: every step for the DDP modes, every H steps for
the DiLoCo modes, F fragment syncs for the streaming ones) and how many times
fewer that is than unquantized DiLoCo (``diloco-fp32`` when run, else
``diloco-hand-gloo``).

Options: ``--rate`` (default 20mbit; ``none``: raw veth), ``--layout``
(2,2), ``--modes`` (comma list), ``--steps``, ``--target-steps``,
``--target``, ``--eval-every``, ``--eval-batches`` (64), ``--batch`` (8),
``--ctx``, ``--d-model``, ``--layers``, ``--heads``, ``--lr`` (2e-3),
``--outer-lr``, ``--sync-every``, ``--fragments``, ``--delay``,
``--corpus-mb`` (4), ``--seed``, ``--timeout`` (seconds for the whole run),
``--json FILE`` (the raw result), ``--plot FILE`` (eval loss over training
time per mode; needs matplotlib, skipped with a message without it),
``--tag`` (namespace prefix), ``--keep DIR`` (the run's directory and logs).

Example:
  sudo python -m ringlet.bench algorithms --part lm --plot lm.png --json lm.json
  sudo python -m ringlet.bench algorithms --part lm --rate 50mbit --modes local,ddp-ringlet,diloco
  python -m ringlet.bench algorithms --part lm --layout 2 --steps 20 --target-steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from . import netns
from .hosts import finish_worker, launch, layout_and_rate, report

PROGRESS = "ringlet.bench algorithms:"
NEED_ROOT = "ringlet.bench algorithms needs root to create network namespaces (run it with sudo)"

MODES = ("ddp-ringlet", "local", "ddp-gloo", "bytegrad", "diloco-hand-gloo", "diloco",
         "streaming-int8", "streaming-int4", "localsgd")
"""The default modes, in the order they run (``ddp-ringlet`` first: it sets the target)."""

EXTRA_MODES = ("diloco-fp32", "diloco-hand-ringlet")
"""Modes run only when asked for with ``--modes``."""

DDP_MODES = ("ddp-gloo", "ddp-ringlet", "bytegrad")
"""Modes that talk every step: they run ``--target-steps`` steps."""

DEFAULTS: dict[str, Any] = {
    "steps": 120, "target_steps": 60, "target": None, "eval_every": 5, "eval_batches": 64,
    "batch": 8, "ctx": 128, "d_model": 192, "layers": 4, "heads": 6, "lr": 2e-3,
    "outer_lr": 0.7, "sync_every": 20, "fragments": 4, "delay": 2, "corpus_mb": 4.0,
    "seed": 0,
}
"""The bench's defaults (the keys of the config the workers read)."""


# --- the data and the model ------------------------------------------------------------------


def stdlib_sources() -> list[Path]:
    """The standard library's ``*.py`` files in sorted order (site-packages
    and dist-packages left out).

    Returns:
      Paths under ``os.path.dirname(os.__file__)``.

    Example:
      >>> stdlib_sources()[0].name
      '__future__.py'
    """
    root = Path(os.path.dirname(os.__file__))
    return sorted((p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)),
                  key=lambda p: p.relative_to(root).as_posix())


def load_corpus(megabytes: float) -> bytes:
    """The first ``megabytes`` MB of the standard library's source, the files
    of :func:`stdlib_sources` concatenated.

    Args:
      megabytes (float): How much text (1 MB = 1e6 bytes).

    Returns:
      The bytes (fewer when the library is smaller).

    Example:
      >>> len(load_corpus(0.5))
      500000
    """
    want = int(megabytes * 1e6)
    if want <= 0:
        raise ValueError(f"--corpus-mb must be positive, got {megabytes}")
    parts, have = [], 0
    for path in stdlib_sources():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        parts.append(data[:want - have])
        have += len(parts[-1])
        if have >= want:
            break
    return b"".join(parts)


def char_lm(cfg: dict[str, Any]) -> Any:
    """The character-level transformer LM of the bench (pre-norm
    ``nn.TransformerEncoderLayer`` blocks with a causal mask, learned
    positions, byte vocabulary).

    Args:
      cfg (dict): ``d_model``, ``layers``, ``heads``, ``ctx`` (see
        :data:`DEFAULTS`).

    Returns:
      An ``nn.Module`` mapping ``(batch, T)`` byte indices to ``(batch, T,
      256)`` logits, with ``emb``, ``pos``, ``blocks``, ``norm`` and
      ``head`` submodules.

    Example:
      >>> sum(p.numel() for p in char_lm(DEFAULTS).parameters())
      1902976
    """
    import torch
    from torch import nn

    d, n_layers, heads, ctx = cfg["d_model"], cfg["layers"], cfg["heads"], cfg["ctx"]

    class CharLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(256, d)
            self.pos = nn.Embedding(ctx, d)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True) for _ in range(n_layers))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, 256)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx),
                                 persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.shape[1]
            z = self.emb(x) + self.pos(torch.arange(t, device=x.device))
            for block in self.blocks:
                z = block(z, src_mask=self.mask[:t, :t], is_causal=True)
            return self.head(self.norm(z))

    return CharLM()


def fragments_of(model: Any, count: int) -> list[Any]:
    """Splits the LM into ``count`` fragments of whole blocks for Streaming
    DiLoCo: the embeddings go with the first, the final norm and the head
    with the last.

    Args:
      model: A :func:`char_lm` model.
      count (int): Fragments, from 1 to the number of blocks.

    Returns:
      ``count`` ``nn.ModuleList``s that together hold every parameter once.

    Example:
      >>> [len(f) for f in fragments_of(char_lm(DEFAULTS), 4)]
      [3, 1, 1, 3]
    """
    from torch import nn

    blocks = list(model.blocks)
    if not 1 <= count <= len(blocks):
        raise ValueError(f"--fragments must be between 1 and the {len(blocks)} blocks, "
                         f"got {count}")
    cuts = [round(i * len(blocks) / count) for i in range(count + 1)]
    frags = [list(blocks[a:b]) for a, b in zip(cuts, cuts[1:])]
    frags[0] = [model.emb, model.pos, *frags[0]]
    frags[-1] = [*frags[-1], model.norm, model.head]
    return [nn.ModuleList(f) for f in frags]


class Batches:
    """Every rank's training windows and the held-out eval windows.

    Args:
      text (bytes): The corpus (the last 10% is held out).
      cfg (dict): ``ctx``, ``batch``, ``eval_batches``, ``seed``.
      rank (int): This rank (its own stream of batches).

    Example:
      >>> b = Batches(load_corpus(1), DEFAULTS, rank=0)
      >>> x, y = b.train(step=1); x.shape
      torch.Size([8, 128])
    """

    def __init__(self, text: bytes, cfg: dict[str, Any], rank: int) -> None:
        import torch

        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        cut = int(len(data) * 0.9)
        self.ctx, self.batch, self.rank, self.seed = cfg["ctx"], cfg["batch"], rank, cfg["seed"]
        self.train_data, held = data[:cut], data[cut:]
        if len(held) < 2 * (self.ctx + 1):
            raise ValueError(f"corpus of {len(data)} bytes is too small for --ctx {self.ctx}")
        n = cfg["eval_batches"]
        starts = torch.linspace(0, len(held) - self.ctx - 1, n).long()
        rows = torch.stack([held[s:s + self.ctx + 1] for s in starts.tolist()])
        self.eval_x, self.eval_y = rows[:, :-1], rows[:, 1:]

    def train(self, step: int) -> tuple[Any, Any]:
        """The windows this rank trains on at ``step`` (the same in every mode)."""
        import torch

        g = torch.Generator().manual_seed((self.seed * 1000 + self.rank) * 100_003 + step)
        starts = torch.randint(0, len(self.train_data) - self.ctx - 1, (self.batch,),
                               generator=g)
        rows = torch.stack([self.train_data[s:s + self.ctx + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


def lm_loss(model: Any, x: Any, y: Any) -> Any:
    """Mean cross-entropy of the next byte (nats)."""
    import torch.nn.functional as F

    return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


def eval_loss(model: Any, batches: Batches, chunk: int = 8) -> float:
    """The model's mean loss on the held-out windows."""
    import torch

    total, n = 0.0, len(batches.eval_x)
    with torch.no_grad():
        for i in range(0, n, chunk):
            x, y = batches.eval_x[i:i + chunk], batches.eval_y[i:i + chunk]
            total += float(lm_loss(model, x, y)) * len(x)
    return total / n


# --- the modes -------------------------------------------------------------------------------


class HandDiLoCo:
    """DiLoCo written by hand, the way torchft's ``DiLoCo`` does it over a
    process group: every ``sync_every`` inner steps, for each parameter in
    turn, the pseudo-gradient (global - local) is averaged by a blocking
    ``dist.all_reduce`` (unquantized), then the global weights are restored
    and the outer optimizer steps them with the average as gradient.

    Args:
      model: The replica.
      outer: The outer optimizer over ``model``'s parameters.
      sync_every (int): H, inner steps between syncs.
      group: The process group of the all-reduces.

    Example:
      >>> hand = HandDiLoCo(model, outer, 20, gloo)
      >>> inner.step(); hand.after_step()
    """

    def __init__(self, model: Any, outer: Any, sync_every: int, group: Any) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.backup = [p.detach().clone() for p in self.params]
        self.outer, self.sync_every, self.group = outer, sync_every, group
        self.steps = 0
        self.bytes_sent = 0  # the payload handed to all_reduce, per rank

    def after_step(self) -> None:
        """Counts an inner step; syncs every ``sync_every``."""
        import torch
        import torch.distributed as dist

        self.steps += 1
        if self.steps % self.sync_every:
            return
        world = dist.get_world_size(self.group)
        for p, b in zip(self.params, self.backup):
            g = b - p.detach()
            dist.all_reduce(g, group=self.group)
            p.grad = g.div_(world)
            self.bytes_sent += g.numel() * g.element_size()
        with torch.no_grad():
            for p, b in zip(self.params, self.backup):
                p.copy_(b)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, b in zip(self.params, self.backup):
                b.copy_(p)


class Mode:
    """One mode set up on a fresh model: ``step(x, y)`` trains one inner step
    and returns the loss; ``ctx`` wraps the steps (ringlet's DiLoCo and
    LocalSGD hook the optimizer inside it); ``syncs_per_step`` counts full
    syncs (all the weights once) per inner step."""

    def __init__(self, model: Any, net: Any, opt: Any, ctx: Any = None, hand: Any = None,
                 syncs_per_step: float = 0.0) -> None:
        self.model, self.net, self.opt, self.hand = model, net, opt, hand
        self.ctx = ctx if ctx is not None else contextlib.nullcontext()
        self.syncs_per_step = syncs_per_step

    def step(self, x: Any, y: Any) -> float:
        loss = lm_loss(self.net, x, y)
        loss.backward()
        self.opt.step()
        if self.hand is not None:
            self.hand.after_step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def bytes_sent(self) -> Optional[int]:
        """Bytes this rank's algorithm says it sent (None when it does not say)."""
        for obj in (self.hand, self.ctx):
            v = getattr(obj, "bytes_sent", None)
            if isinstance(v, (int, float)):
                return int(v)
        return None


def make_mode(mode: str, cfg: dict[str, Any]) -> Mode:
    """Builds ``mode`` on a fresh :func:`char_lm` (seeded ``cfg["seed"]``:
    the same weights in every mode and on every rank).

    Args:
      mode (str): One of :data:`MODES` or :data:`EXTRA_MODES`.
      cfg (dict): The bench's config (:data:`DEFAULTS` keys).

    Returns:
      The :class:`Mode`.

    Example:
      >>> m = make_mode("diloco-hand-gloo", DEFAULTS)
      >>> m.step(*batches.train(1))
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(cfg["seed"])
    model = char_lm(cfg)

    def inner(params: Any) -> Any:
        return torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.01)

    def outer(params: Any) -> Any:
        return torch.optim.SGD(params, lr=cfg["outer_lr"], momentum=0.9, nesterov=True)

    h = cfg["sync_every"]
    if mode == "local":
        return Mode(model, model, inner(model.parameters()))
    if mode in DDP_MODES:
        if mode == "ddp-gloo":
            ddp = DDP(model, process_group=dist.new_group(backend="gloo"))
        else:
            ddp = DDP(model)
        if mode == "bytegrad":
            from ringlet.distributed import hooks

            ddp.register_comm_hook(hooks.ByteGradState(), hooks.bytegrad_hook)
        return Mode(model, ddp, inner(ddp.parameters()), syncs_per_step=1.0)
    if mode in ("diloco-hand-gloo", "diloco-hand-ringlet"):
        group = dist.new_group(backend="gloo") if mode == "diloco-hand-gloo" else None
        opt = inner(model.parameters())
        hand = HandDiLoCo(model, outer(model.parameters()), h, group)
        return Mode(model, model, opt, hand=hand, syncs_per_step=1.0 / h)
    from ringlet.algorithms import DiLoCo, LocalSGD  # ringlet's own: imported when asked for

    opt = inner(model.parameters())
    if mode == "localsgd":
        return Mode(model, model, opt, ctx=LocalSGD(model, opt, h), syncs_per_step=1.0 / h)
    if mode in ("diloco", "diloco-fp32"):
        ctx = DiLoCo([model], opt, outer(model.parameters()), h,
                     quantization="int8" if mode == "diloco" else None)
        return Mode(model, model, opt, ctx=ctx, syncs_per_step=1.0 / h)
    if mode in ("streaming-int8", "streaming-int4"):
        frags = fragments_of(model, cfg["fragments"])
        ctx = DiLoCo(frags, opt, [outer(f.parameters()) for f in frags], h,
                     fragment_sync_delay=cfg["delay"], quantization=mode.split("-")[1])
        return Mode(model, model, opt, ctx=ctx, syncs_per_step=1.0 / h)
    raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES + EXTRA_MODES)}")


# --- the worker ------------------------------------------------------------------------------


def tx_bytes(ifname: Optional[str]) -> Optional[int]:
    """Bytes the interface ``ifname`` has sent, from ``/proc/net/dev`` (this
    process's network namespace).

    Args:
      ifname (str, optional): The interface; ``None`` gives ``None``.

    Returns:
      The counter, or ``None`` when there is no such interface.

    Example:
      >>> tx_bytes("lo") > 0
      True
    """
    if not ifname:
        return None
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, sep, rest = line.partition(":")
                if sep and name.strip() == ifname:
                    return int(rest.split()[8])  # rx: 8 fields, then tx bytes
    except (OSError, ValueError, IndexError):
        return None
    return None


def run_mode(mode: str, cfg: dict[str, Any], batches: Batches, gloo: Any) -> dict[str, Any]:
    """Trains one mode on every rank (collective) and returns what rank 0
    reports of it.

    Args:
      mode (str): The mode.
      cfg (dict): The bench's config.
      batches (Batches): This rank's data.
      gloo: A gloo group of every rank (barriers and the gathering of results).

    Returns:
      ``{"mode", "steps", "curve": [[step, seconds, eval_loss, train_loss]],
      "total_s", "per_rank_total_s", "host_tx_bytes": {host: bytes},
      "bytes_sent": [per rank or None], "syncs"}``.

    Example:
      >>> run_mode("local", cfg, batches, gloo)["curve"][-1]
      [120, 58.1, 2.31, 2.35]
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    steps = cfg["target_steps"] if mode in DDP_MODES else cfg["steps"]
    m = make_mode(mode, cfg)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") if cfg.get("count_bytes", True) else None
    local0 = os.environ.get("LOCAL_RANK", "0") == "0"
    snaps: list[tuple[int, float, dict[str, Any], float]] = []
    snap0 = {k: v.detach().clone() for k, v in m.model.state_dict().items()}
    ctx = m.ctx
    ctx.__enter__()
    try:
        dist.barrier(group=gloo)
        tx0 = tx_bytes(ifname) if local0 else None
        elapsed, train_sum, train_n = 0.0, 0.0, 0
        t = time.perf_counter()
        for step in range(1, steps + 1):
            x, y = batches.train(step)
            train_sum += m.step(x, y)
            train_n += 1
            if rank == 0 and (step % cfg["eval_every"] == 0 or step == steps):
                elapsed += time.perf_counter() - t
                snap = {k: v.detach().clone() for k, v in m.model.state_dict().items()}
                snaps.append((step, elapsed, snap, train_sum / train_n))
                if step % (6 * cfg["eval_every"]) == 0:
                    print(f"{PROGRESS} {mode}: step {step}/{steps}, {elapsed:.1f} s, train "
                          f"loss {train_sum / train_n:.3f}", flush=True)
                train_sum, train_n = 0.0, 0
                t = time.perf_counter()
        if rank != 0:
            elapsed += time.perf_counter() - t
            t = time.perf_counter()
    except BaseException as e:
        ctx.__exit__(type(e), e, e.__traceback__)
        raise
    ctx.__exit__(None, None, None)  # waits for a sync still under way: timed
    total = elapsed + (time.perf_counter() - t)
    dist.barrier(group=gloo)
    tx1 = tx_bytes(ifname) if local0 else None
    mine = {"host": os.environ.get("RINGLET_HOST_ID", "host0"), "local0": local0,
            "tx": None if tx0 is None or tx1 is None else tx1 - tx0,
            "total": total, "bytes_sent": m.bytes_sent()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=gloo)
    curve = []
    if rank == 0:
        model = char_lm(cfg)
        model.load_state_dict(snap0)
        curve.append([0, 0.0, eval_loss(model, batches), None])
        for step, secs, snap, tr in snaps:
            model.load_state_dict(snap)
            curve.append([step, secs, eval_loss(model, batches), tr])
    dist.barrier(group=gloo)
    hosts = {e["host"]: e["tx"] for e in every if e["local0"]}
    res = {"mode": mode, "steps": steps, "curve": curve,
           "total_s": max(e["total"] for e in every),
           "per_rank_total_s": [e["total"] for e in every],
           "host_tx_bytes": hosts, "bytes_sent": [e["bytes_sent"] for e in every],
           "syncs": steps * m.syncs_per_step}
    del m, snaps
    torch.manual_seed(cfg["seed"])
    return res


def run_all(cfg: dict[str, Any], gloo: Any) -> dict[str, Any]:
    """Runs every mode of ``cfg["modes"]`` in turn (collective; the LM part's
    worker logic, without the process group set-up).

    Args:
      cfg (dict): The bench's config (:data:`DEFAULTS` keys, ``modes``).
      gloo: A gloo group of every rank.

    Returns:
      ``{"runs": {mode: run_mode(...)}, "parameters", "corpus_bytes"}`` (the
      runs filled on rank 0).

    Example:
      >>> run_all({**DEFAULTS, "modes": ["local"]}, gloo)["runs"]["local"]["total_s"]
      58.1
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    text = load_corpus(cfg["corpus_mb"])
    batches = Batches(text, cfg, rank)
    runs: dict[str, Any] = {}
    for mode in cfg["modes"]:
        res = run_mode(mode, cfg, batches, gloo)
        runs[mode] = res
        if rank == 0:
            last = res["curve"][-1]
            mb = sum(v or 0 for v in res["host_tx_bytes"].values()) / 1e6
            print(f"{PROGRESS} {mode}: eval loss {last[2]:.3f} after {last[0]} steps, "
                  f"{res['total_s']:.1f} s, {mb:.1f} MB sent by the hosts", flush=True)
    params = sum(p.numel() for p in char_lm(cfg).parameters())
    return {"runs": runs, "parameters": params, "corpus_bytes": len(text)}


def worker(out: Path) -> None:
    """One rank of the LM bench (under the launcher's torchrun, inside a
    host or on this machine).

    Args:
      out (Path): The run's directory: ``config.json`` in, ``result.json``
        out from rank 0.
    """
    import torch.distributed as dist

    import ringlet

    cfg = json.loads((out / "config.json").read_text())
    dist.init_process_group("ringlet")
    gloo = dist.new_group(backend="gloo")
    ringlet.init()  # for ringlet.host_layout() in the result
    result = run_all(cfg, gloo)
    finish_worker(out, cfg, result, gloo)


# --- the report ------------------------------------------------------------------------------


def target_loss(result: dict[str, Any]) -> Optional[float]:
    """The target loss: ``config["target"]`` when set, else ``ddp-ringlet``'s
    eval loss after its last step (``--target-steps``), else the first DDP
    mode's.

    Args:
      result (dict): The bench's result.

    Returns:
      The loss, or ``None`` without a DDP mode.
    """
    if result["config"].get("target") is not None:
        return float(result["config"]["target"])
    runs = result["runs"]
    for mode in ("ddp-ringlet", *DDP_MODES):
        if mode in runs and runs[mode]["curve"]:
            return float(runs[mode]["curve"][-1][2])
    return None


TARGET_TOL = 1e-3
"""A loss within this of the target counts as reaching it (DDP on gloo and on
ringlet differ by rounding: 5e-5 after 60 steps)."""


def time_to(curve: list[list[Any]], target: float,
            tol: float = TARGET_TOL) -> Optional[tuple[int, float]]:
    """The first eval point (step, seconds) at which ``curve`` reached
    ``target`` (eval loss at most the target + ``tol``)."""
    for step, secs, loss, _ in curve:
        if step > 0 and loss <= target + tol:
            return int(step), float(secs)
    return None


def floor_at(result: dict[str, Any], steps: int) -> Optional[float]:
    """The ``local`` floor's training time after ``steps`` steps (its curve,
    interpolated between eval points; its total when ``steps`` is its last)."""
    run = result["runs"].get("local")
    if run is None:
        return None
    pts = [(s, t) for s, t, _, _ in run["curve"]]
    if steps >= pts[-1][0]:
        return run["total_s"] * steps / pts[-1][0] if steps > pts[-1][0] else run["total_s"]
    for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
        if s0 <= steps <= s1:
            return t0 + (t1 - t0) * (steps - s0) / (s1 - s0)
    return None


def summary(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per mode: the numbers of the report's table.

    Args:
      result (dict): The bench's result.

    Returns:
      ``{mode: {"final_loss", "steps", "to_target_s", "to_target_step",
      "vs_ddp_ringlet", "vs_hand_gloo", "total_s", "vs_floor", "host_mb",
      "bytes_per_sync", "fewer_than_fp32"}}`` (``None`` where it does not
      apply).
    """
    runs = result["runs"]
    target = target_loss(result)
    out: dict[str, dict[str, Any]] = {}
    for mode, run in runs.items():
        hit = time_to(run["curve"], target) if target is not None else None
        host = {h: (None if v is None else v / 1e6) for h, v in run["host_tx_bytes"].items()}
        known = [v for v in run["host_tx_bytes"].values() if v is not None]
        per_sync = (max(known) / run["syncs"]) if known and run["syncs"] else None
        floor = floor_at(result, run["steps"])
        out[mode] = {"final_loss": run["curve"][-1][2], "steps": run["steps"],
                     "to_target_step": hit[0] if hit else None,
                     "to_target_s": hit[1] if hit else None,
                     "total_s": run["total_s"],
                     "vs_floor": run["total_s"] / floor if floor else None,
                     "host_mb": host, "bytes_per_sync": per_sync}
    for mode, row in out.items():
        for key, ref in (("vs_ddp_ringlet", "ddp-ringlet"), ("vs_hand_gloo", "diloco-hand-gloo")):
            base = out.get(ref, {}).get("to_target_s")
            row[key] = base / row["to_target_s"] if base and row["to_target_s"] else None
        ref = out.get("diloco-fp32") or out.get("diloco-hand-gloo") or {}
        rb, mb = ref.get("bytes_per_sync"), row["bytes_per_sync"]
        row["fewer_than_fp32"] = rb / mb if rb and mb and mode not in DDP_MODES else None
    return out


def tables(result: dict[str, Any]) -> str:
    """The report as Markdown: the run's conditions, then one row per mode.

    Args:
      result (dict): The bench's result (or its ``--json`` file).

    Returns:
      Markdown text.
    """
    cfg = result["config"]
    layout = result["layout"]
    if len(layout) == 1:
        head = f"one host, {layout[0]} ranks (no link limit)"
    else:
        head = (f"{len(layout)} hosts {layout}, link {cfg['rate'] or 'raw veth'} each way "
                f"(tbf burst {netns.BURST} latency {netns.LATENCY})")
    target = target_loss(result)
    how = ("set by --target" if cfg.get("target") is not None
           else f"ddp-ringlet's eval loss after {cfg['target_steps']} steps"
           if target is not None else "no DDP mode ran: none")
    ref = "diloco-fp32" if "diloco-fp32" in result["runs"] else "diloco-hand-gloo"
    lines = [
        f"`{result.get('command', '')}`", "",
        f"{head}; torch {result.get('torch')}, {result.get('cpus') or '?'} CPUs. Char-level "
        f"transformer LM, {result['parameters'] / 1e6:.2f} M parameters ({cfg['layers']} "
        f"layers, d {cfg['d_model']}, context {cfg['ctx']}), {result['corpus_bytes'] / 1e6:.1f} "
        f"MB of the standard library's source, batch {cfg['batch']} per rank, AdamW lr "
        f"{cfg['lr']}; H = {cfg['sync_every']}, outer SGD lr {cfg['outer_lr']} Nesterov 0.9; "
        f"streaming: {cfg['fragments']} fragments, delay {cfg['delay']}. Target loss "
        + ("-" if target is None else f"{target:.3f}") + f" ({how}); times are training "
        "time (eval excluded), time to target at the first eval point "
        f"(every {cfg['eval_every']} steps) at or below it (+{TARGET_TOL}).", "",
        "| mode | steps | final eval loss | time to target (s) | vs ddp-ringlet | "
        "vs diloco-hand-gloo | total (s) | total / local floor | MB sent per host | "
        f"bytes per full sync | fewer than {ref} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]

    def f(v: Optional[float], fmt: str, suffix: str = "") -> str:
        return "-" if v is None else format(v, fmt) + suffix

    for mode, row in summary(result).items():
        hit = ("-" if target is None else "not reached" if row["to_target_s"] is None
               else f"{row['to_target_s']:.1f} (step {row['to_target_step']})")
        host = " / ".join(f(v, ".1f") for v in row["host_mb"].values()) or "-"
        per_sync = "-" if row["bytes_per_sync"] is None else _fmt_bytes(row["bytes_per_sync"])
        lines.append(
            f"| {mode} | {row['steps']} | {row['final_loss']:.3f} | {hit} | "
            f"{f(row['vs_ddp_ringlet'], '.2f', 'x')} | {f(row['vs_hand_gloo'], '.2f', 'x')} | "
            f"{row['total_s']:.1f} | {f(row['vs_floor'], '.2f', 'x')} | {host} | {per_sync} | "
            f"{f(row['fewer_than_fp32'], '.2f', 'x')} |")
    return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def plot(result: dict[str, Any], path: str) -> None:
    """Draws the eval loss over training time per mode, the target dashed
    (needs matplotlib).

    Args:
      result (dict): The bench's result.
      path (str): The PNG to write.

    Example:
      >>> plot(result, "lm.png")
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for mode, run in result["runs"].items():
        pts = [(t, loss) for _, t, loss, _ in run["curve"]]
        ax.plot([t for t, _ in pts], [v for _, v in pts], marker=".", label=mode,
                ls="--" if "gloo" in mode or mode == "local" else "-")
    target = target_loss(result)
    if target is not None:
        ax.axhline(target, color="k", lw=0.8, ls=":", label=f"target {target:.3f}")
    ax.set_xlim(left=0)
    ax.set_ylim(top=4.8)  # the first steps fall from ln 256 = 5.5: the race is below
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("eval loss (nats per byte)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    layout = result["layout"]
    ax.set_title(f"char LM, {len(layout)} hosts {layout}, link {cfg['rate'] or 'none'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- the launcher ----------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """The command line of ``--part lm`` (see the module documentation)."""
    p = argparse.ArgumentParser(prog="python -m ringlet.bench algorithms --part lm",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="lm", choices=["lm"])
    p.add_argument("--layout", default="2,2",
                   help="ranks per host (default 2,2); one number: one host, no namespaces")
    p.add_argument("--rate", default="20mbit",
                   help="tbf rate of each host link, each way (default 20mbit; 'none': raw veth)")
    p.add_argument("--modes", default=None,
                   help=f"comma list (default: {','.join(MODES)}; also {','.join(EXTRA_MODES)})")
    for key, value in DEFAULTS.items():
        if key == "target":
            p.add_argument("--target", type=float, default=None,
                           help="target eval loss (default: ddp-ringlet's after --target-steps)")
            continue
        p.add_argument("--" + key.replace("_", "-"), type=type(value), default=value,
                       help=f"default {value}")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--json", default=None, help="save the raw result here")
    p.add_argument("--plot", default=None, help="draw eval loss over time here (PNG)")
    p.add_argument("--tag", default=netns.PREFIX, help="namespace name prefix")
    p.add_argument("--keep", default=None, help="keep the run's directory (logs) here")
    return p


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of ``python -m ringlet.bench algorithms --part lm`` (and,
    with ``--worker DIR``, of each rank under torchrun).

    Args:
      argv (list[str], optional): The arguments (default: ``sys.argv[1:]``).

    Example:
      >>> main(["--layout", "2", "--steps", "10", "--target-steps", "5"])
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) > 1 and argv[0] == "--worker":
        worker(Path(argv[1]))
        return
    args = parser().parse_args(argv)
    modes = MODES if args.modes is None else tuple(m.strip() for m in args.modes.split(",")
                                                   if m.strip())
    bad = [m for m in modes if m not in MODES + EXTRA_MODES]
    if bad or not modes:
        raise SystemExit(f"{PROGRESS} unknown modes {bad}: choose from "
                         f"{', '.join(MODES + EXTRA_MODES)}")
    if args.eval_every < 1 or args.steps < 1 or args.target_steps < 1:
        raise SystemExit(f"{PROGRESS} --steps, --target-steps and --eval-every must be >= 1")
    if args.sync_every % args.fragments:
        raise SystemExit(f"{PROGRESS} --sync-every {args.sync_every} must be divisible by "
                         f"--fragments {args.fragments}")
    if not 0 <= args.delay < args.sync_every // args.fragments:
        raise SystemExit(f"{PROGRESS} --delay {args.delay} must be in [0, --sync-every // "
                         f"--fragments = {args.sync_every // args.fragments})")
    if args.d_model % args.heads:
        raise SystemExit(f"{PROGRESS} --d-model {args.d_model} must be divisible by "
                         f"--heads {args.heads}")
    rate = None if netns.parse_rate(args.rate) is None else args.rate
    layout, rate = layout_and_rate(args.layout, rate, args.tag, PROGRESS, NEED_ROOT)
    cfg: dict[str, Any] = {k: getattr(args, k) for k in DEFAULTS}
    cfg.update(part="lm", layout=layout, rate=rate, modes=list(modes))
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ringlet-bench-lm-"))
    result = launch("ringlet.bench.lm", layout, rate, cfg, out, args, PROGRESS)
    if len(layout) == 1:  # one host
        result["cpus"] = os.cpu_count()
    report(result, "python -m ringlet.bench algorithms", argv, tables, args.json)
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError:
            print(f"{PROGRESS} --plot skipped: matplotlib is not installed "
                  "(pip install matplotlib)", file=sys.stderr)


if __name__ == "__main__":
    main()
