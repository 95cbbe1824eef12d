"""DiLoCo and Streaming DiLoCo with torchft's names and semantics, over any
process group, the outer average run by ringlet's engine."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn, optim
from torch.utils.hooks import RemovableHandle

from ..core import engine
from ._flat import FlatBucket
from ._sync import (
    QUANTIZATIONS,
    HookedAlgorithm,
    OuterAverage,
    buckets_of,
    covered,
    logger,
    unique_params,
)

__all__ = ["DiLoCo"]


class _Fragment:
    """One fragment: its parameters' flat buckets and its outer optimizer."""

    def __init__(self, index: int, module: nn.Module, outer: optim.Optimizer,
                 backup_device: Any, what: str) -> None:
        self.index = index
        self.module = module
        self.outer = outer
        self.params = unique_params(module)
        names = {id(p): n for n, p in module.named_parameters()}
        self.names = [names[id(p)] for p in self.params]
        self.name_of = names
        self.buckets: list[FlatBucket] = buckets_of(self.params, backup_device, what)
        self.pending = False  # an average started and not yet applied
        self.ready = False  # its result loaded from a checkpoint

    def save(self) -> None:
        for b in self.buckets:
            b.save()

    @property
    def original_parameters(self) -> dict[str, torch.Tensor]:
        """The global copy of each parameter, by name (torchft's attribute;
        views of the flat copy)."""
        return {self.name_of[id(p)]: b.view(b.glob, i)
                for b in self.buckets for i, p in enumerate(b.params)}


class DiLoCo(HookedAlgorithm):
    """DiLoCo (Douillard et al., 2023) and Streaming DiLoCo (2025): each
    replica takes ``sync_every`` inner steps on its own, then the replicas
    average the pseudo-gradient (global weights minus local weights) and an
    outer optimizer steps the global copy with it. With several fragments
    one fragment syncs every ``sync_every / len(model_fragments)`` inner
    steps, in turn; with ``fragment_sync_delay`` its average starts that
    many steps early and runs in ringlet's engine while training goes on.

    torchft's ``DiLoCo`` with a process group in place of its Manager: the
    same arguments, checks, schedule and numerics (fragment ``k`` syncs
    after every ``sync_every // F`` inner steps when ``k == syncs % F``;
    the local weights kept at the sync are merged into the new global ones
    by ``lerp(fragment_update_alpha)``). The average of a fragment is one
    engine operation per dtype on a flat bucket, exact, or quantized to 8
    or 4 bits per value across hosts (exact within a host with
    ``hierarchical=True``). A replica lost during a sync is named, the
    survivors finish the sync among themselves and go on.

    It is a context manager: entering hooks ``inner_optimizer.step``,
    leaving removes the hook. Creating it is collective over the group:
    the replicas agree on the arguments, and every replica starts from the
    group's first rank's parameters (the global copy).

    Args:
      model_fragments (list[torch.nn.Module]): The fragments (one for
        DiLoCo), holding disjoint contiguous CPU floating-point parameters.
      inner_optimizer (torch.optim.Optimizer): Steps every parameter of
        every fragment every inner step.
      outer_optimizer (torch.optim.Optimizer or list): One for all
        fragments, or one per fragment; DiLoCo's is
        ``SGD(lr=0.7, momentum=0.9, nesterov=True)``.
      sync_every (int): Inner steps between two syncs of a fragment, times
        the number of fragments (torchft's meaning).
      group (torch.distributed.ProcessGroup, optional): The replicas (any
        backend). Default: the default group.
      backup_device (torch.device, optional): Where the global copy lives:
        None or ``"cpu"``.
      pin_memory (bool): torchft's; accepted, without effect (the global
        copy is in host memory).
      use_bucketization (bool): torchft's; accepted, without effect (ringlet
        always averages one flat buffer per fragment and dtype).
      bucket_cap_mb (int, optional): torchft's; accepted, without effect.
      should_quantize (bool): Average 8-bit values (torchft's switch; same
        as ``quantization="int8"``). Default: False.
      fragment_sync_delay (int): Inner steps between the start of a
        fragment's average and its use (Streaming DiLoCo's tau); less than
        ``sync_every // len(model_fragments)``. Default: 0.
      fragment_update_alpha (float): In [0, 1]: how much of the local
        weights to keep at a sync (0: the new global weights). Default: 0.
      quantization (str, optional): ``"int8"`` (per-chunk minimum and
        maximum, a byte per value), ``"int4"`` (per block of 512 values, half
        a byte per value) or None. Default: None (exact unless
        ``should_quantize``).
      error_feedback (bool): Carry each quantization's error into the next
        sync of the fragment (needs quantization). Default: False.
      hierarchical (bool): Exact within a host, quantized across hosts.
        Default: True.

    Example:
      >>> outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
      >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
      >>> with DiLoCo([model], inner, outer, sync_every=20, should_quantize=True):
      ...     for x, y in data:
      ...         loss_fn(model(x), y).backward()
      ...         inner.step()
      ...         inner.zero_grad()
    """

    def __init__(
        self,
        model_fragments: list[nn.Module],
        inner_optimizer: optim.Optimizer,
        outer_optimizer: Union[optim.Optimizer, list[optim.Optimizer]],
        sync_every: int,
        *,
        group: Any = None,
        backup_device: Optional[torch.device] = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: Optional[int] = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        quantization: Optional[str] = None,
        error_feedback: bool = False,
        hierarchical: bool = True,
    ) -> None:
        if isinstance(model_fragments, nn.Module):
            model_fragments = [model_fragments]
        model_fragments = list(model_fragments)
        n = len(model_fragments)
        if n == 0:
            raise ValueError("DiLoCo needs at least one model fragment")
        if isinstance(outer_optimizer, (list, tuple)) and len(outer_optimizer) != n:
            raise ValueError(f"The number of outer optimizers ({len(outer_optimizer)}) must "
                             f"match the number of model fragments ({n})")
        if sync_every < n:
            raise ValueError(f"Only 1 fragment can be synchronized at a time: sync_every "
                             f"({sync_every}) is less than the number of fragments ({n})")
        if sync_every % n != 0:
            raise ValueError(f"sync_every ({sync_every}) must be divisible by the number of "
                             f"fragments ({n})")
        self._sync_every = sync_every // n
        if fragment_sync_delay < 0 or fragment_sync_delay >= self._sync_every:
            raise ValueError(f"Fragment must be synced before it is reduced another time: "
                             f"fragment_sync_delay ({fragment_sync_delay}) must be in "
                             f"[0, sync_every // fragments = {self._sync_every})")
        if fragment_update_alpha < 0 or fragment_update_alpha > 1:
            raise ValueError(f"fragment_update_alpha must be between 0 and 1, got "
                             f"{fragment_update_alpha}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {quantization!r}: ringlet averages exactly (None), "
                             "in 8 bits ('int8') or in 4 bits ('int4')")
        if should_quantize and quantization is None:
            quantization = "int8"
        if error_feedback and quantization is None:
            raise ValueError("error_feedback needs quantization: an exact average leaves no "
                             "error to carry")
        outers = (list(outer_optimizer) if isinstance(outer_optimizer, (list, tuple))
                  else [outer_optimizer] * n)
        what = "DiLoCo"
        self._fragments = [_Fragment(i, m, outers[i], backup_device, what)
                           for i, m in enumerate(model_fragments)]
        self._check_params(inner_optimizer)
        self._local_optimizer = inner_optimizer
        self._fragment_sync_delay = fragment_sync_delay
        self._fragment_update_alpha = float(fragment_update_alpha)
        self.quantization = quantization
        self._local_step = 0
        self._syncs = 0
        self._loaded = False  # load_state_dict ran (this replica has a state to share)
        self._healed = False  # the first step's state sharing ran
        self._hooks: list[RemovableHandle] = []
        self._outer = OuterAverage(group, what, hierarchical, quantization, error_feedback,
                                   [b for f in self._fragments for b in f.buckets])
        self._outer.replicas.agree("DiLoCo's arguments", {
            "sync_every": sync_every, "fragments": n, "fragment_sync_delay": fragment_sync_delay,
            "fragment_update_alpha": self._fragment_update_alpha, "quantization": quantization,
            "error_feedback": error_feedback, "hierarchical": hierarchical,
            "fragment sizes": [[[b.name, b.numel] for b in f.buckets] for f in self._fragments],
        })
        # Every replica starts from the same global copy: the first rank's.
        for f in self._fragments:
            f.save()
        self._outer.broadcast()
        for f in self._fragments:
            for b in f.buckets:
                b.restore()

    def _check_params(self, inner: optim.Optimizer) -> None:
        owner: dict[int, int] = {}
        spans: list[tuple[int, int, int]] = []
        for f in self._fragments:
            for p in f.params:
                if id(p) in owner:
                    raise ValueError(f"DiLoCo: a parameter of shape {tuple(p.shape)} is in "
                                     f"fragment {owner[id(p)]} and in fragment {f.index}: "
                                     "fragments must hold disjoint parameters")
                owner[id(p)] = f.index
                if p.numel():
                    start, size = engine.span(p)
                    spans.append((start, start + size, f.index))
        spans.sort()
        for (_s0, e0, f0), (s1, _, f1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ValueError(f"DiLoCo: parameters of fragments {f0} and {f1} share memory: "
                                 "fragments must hold disjoint parameters")
        inner_ids = covered(inner)
        for f in self._fragments:
            outer_ids = covered(f.outer)
            for name, p in zip(f.names, f.params):
                if id(p) not in inner_ids:
                    raise ValueError(f"DiLoCo: the inner optimizer does not step parameter "
                                     f"{name!r} of fragment {f.index}")
                if id(p) not in outer_ids:
                    raise ValueError(f"DiLoCo: the outer optimizer of fragment {f.index} does "
                                     f"not step its parameter {name!r}")

    def __enter__(self) -> DiLoCo:
        self._hooks.append(self._local_optimizer.register_step_pre_hook(self._step_pre_hook))
        self._hooks.append(self._local_optimizer.register_step_post_hook(self._step_post_hook))
        return self

    def _step_pre_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if not self._healed:
            self._heal()

    @torch.no_grad()
    def _heal(self) -> None:
        """Before the first inner step: where some replicas resumed from a
        checkpoint (``load_state_dict``) and others did not (replicas that
        joined), the joiners receive the first resumed replica's global
        copies, outer optimizer states and schedule, and start their inner
        steps from the global copy. Collective (once per replica)."""
        self._healed = True
        reps = self._outer.replicas
        if reps.size == 1:
            return
        flags = torch.zeros(reps.size, dtype=torch.int32)
        flags[reps.index] = int(self._loaded)
        engine.all_reduce(reps.flat, flags)
        have = [i for i, f in enumerate(flags.tolist()) if f]
        if not have or len(have) == reps.size:
            return
        src = have[0]
        state = self._outer.broadcast_object(
            {"local_step": self._local_step, "syncs": self._syncs,
             "outer": [f.outer.state_dict() for f in self._fragments],
             "pending": [f.pending for f in self._fragments]}, src)
        self._outer.broadcast(src, avg=True)
        if self._loaded:
            return
        logger.info("DiLoCo: rank %d joins from rank %d's state (%d syncs so far)", reps.me,
                    reps.members[src], state["syncs"])
        self._local_step, self._syncs = state["local_step"], state["syncs"]
        for f, outer_state, pending in zip(self._fragments, state["outer"], state["pending"]):
            f.outer.load_state_dict(outer_state)
            f.pending = f.ready = pending
            for b in f.buckets:
                b.restore()

    def _current_fragment(self) -> int:
        return self._syncs % len(self._fragments)

    def _step_post_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._local_step += 1
        if self._local_step == self._sync_every - self._fragment_sync_delay:
            self._prepare_sync(self._fragments[self._current_fragment()])
        if self._local_step < self._sync_every:
            return
        self._perform_sync(self._fragments[self._current_fragment()])
        self._local_step = 0

    @torch.no_grad()
    def _prepare_sync(self, f: _Fragment) -> None:
        logger.debug("DiLoCo: preparing fragment %d at inner step %d", f.index, self._local_step)
        for b in f.buckets:
            b.pseudo_gradient()
        self._outer.start(f.buckets)
        f.pending = True

    @torch.no_grad()
    def _perform_sync(self, f: _Fragment) -> None:
        if not f.ready:
            self._outer.finish(f.buckets)
        f.pending = f.ready = False
        alpha = self._fragment_update_alpha
        for b in f.buckets:
            if alpha > 0:
                b.keep_local()
            b.restore()
            for i, p in enumerate(b.params):
                p.grad = b.view(b.avg, i)
        f.outer.step()
        for b in f.buckets:
            b.save()
            if alpha > 0:
                assert b.local is not None
                for i, p in enumerate(b.params):
                    p.lerp_(b.view(b.local, i), alpha)
        f.outer.zero_grad()
        self._syncs += 1

    def sync(self) -> None:
        """Syncs the current fragment now (its average started if it was not),
        as if ``sync_every // fragments`` inner steps had passed."""
        f = self._fragments[self._current_fragment()]
        if not f.pending:
            self._prepare_sync(f)
        self._perform_sync(f)
        self._local_step = 0

    def state_dict(self) -> dict[str, Any]:
        """The global copies, the outer optimizers' states and the schedule
        (an average in flight is waited for and its result kept), for
        ``torch.save`` or torch.distributed.checkpoint.

        Returns:
          dict: ``{"local_step", "syncs", "fragments": [{"original_parameters",
          "outer_optimizer", "pending_average"}, ...]}``.

        Example:
          >>> torch.save({"model": model.state_dict(), "diloco": diloco.state_dict()}, path)
        """
        frags = []
        for f in self._fragments:
            if f.pending and not f.ready:
                self._outer.finish(f.buckets)
                f.ready = True
            original = {k: v.clone() for k, v in f.original_parameters.items()}
            entry: dict[str, Any] = {
                "original_parameters": original,
                "outer_optimizer": f.outer.state_dict(),
            }
            if f.pending:
                entry["pending_average"] = [b.avg.clone() for b in f.buckets]
            frags.append(entry)
        return {"local_step": self._local_step, "syncs": self._syncs, "fragments": frags}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned (the model's own
        parameters are the model's ``load_state_dict``'s business).

        Args:
          state (dict): From :meth:`state_dict`.

        Example:
          >>> diloco.load_state_dict(torch.load(path)["diloco"])
        """
        frags = state["fragments"]
        if len(frags) != len(self._fragments):
            raise ValueError(f"DiLoCo.load_state_dict: {len(frags)} fragments in the state, "
                             f"{len(self._fragments)} here")
        for f, entry in zip(self._fragments, frags):
            for b in f.buckets:
                for i, p in enumerate(b.params):
                    name = f.name_of[id(p)]
                    if name not in entry["original_parameters"]:
                        raise KeyError(f"DiLoCo.load_state_dict: fragment {f.index} has no "
                                       f"global copy of {name!r}")
                    b.view(b.glob, i).copy_(entry["original_parameters"][name])
            f.outer.load_state_dict(entry["outer_optimizer"])
            pending = entry.get("pending_average")
            f.pending = f.ready = pending is not None
            if pending is not None:
                for b, t in zip(f.buckets, pending):
                    b.avg.copy_(t)
        self._local_step = int(state["local_step"])
        self._syncs = int(state["syncs"])
        self._loaded = True

