"""Bagua's data parallelism with algorithms: ``model.with_bagua(optimizers,
algorithm)`` (``with_ringlet`` under ringlet's own name) and the
:class:`BaguaDistributedDataParallel` behind it.

Wrapping reifies the algorithm on the process group, broadcasts the
parameters and optimizer state from the group's first rank, lets the
algorithm pick the tensors to communicate (``init_tensors``), cuts them into
buckets (``tensors_to_buckets``, buckets of ``get_default_bucket_size()``
bytes in registration order), gives each bucket its operations
(``init_operations``) and installs the algorithm's hooks: before each
training forward, on each parameter's gradient, after backward and after
each ``optimizer.step()``. An algorithm whose ``need_reset()`` answers True
at a forward is initialised again (QAdam after its warm-up, asynchronous
averaging after its own).

Example:
  >>> import ringlet.bagua.compat as bagua
  >>> from ringlet.bagua.compat.algorithms import bytegrad
  >>> bagua.init_process_group()
  >>> opt = torch.optim.SGD(model.parameters(), lr=0.01)
  >>> model = model.with_bagua([opt], bytegrad.ByteGradAlgorithm())
  >>> loss_fn(model(x), y).backward()     # gradients averaged in 8 bits
  >>> opt.step()
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterator
from types import MethodType
from typing import Any, Optional

import torch

from ... import errors
from ...core import groups as core_groups
from ...parallel import ddp as _ringlet_ddp
from ...parallel.tensor import get_module
from .. import communication
from ..bucket import BaguaBucket, _default_group, register_ordered_buckets
from ..communication import BaguaProcessGroup
from ..env import get_default_bucket_size

__all__ = ["BaguaDistributedDataParallel", "DistributedDataParallel", "install", "with_ringlet",
           "wrap_for_ddp"]


class _States:
    """What wrapping leaves on the module (hooks to remove on re-wrapping)."""

    def __init__(self) -> None:
        self._bagua_autograd_hooks: list[Any] = []
        self._bagua_framework_hooks: list[Any] = []


def _describe(algorithm: Any) -> str:
    """The algorithm's class and plain settings, compared across ranks."""
    items = []
    for k, v in sorted(vars(algorithm).items()):
        if isinstance(v, (bool, int, float, str, type(None))):
            items.append(f"{k}={v!r}")
        elif isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v):
            items.append(f"{k}={v!r}")
        elif isinstance(v, torch.optim.Optimizer):
            items.append(f"{k}={type(v).__name__}")
    return f"{type(algorithm).__module__}.{type(algorithm).__qualname__}({', '.join(items)})"


def _agree(group: BaguaProcessGroup, text: str, what: str) -> None:
    """Raises :class:`ringlet.CollectiveMismatchError` on every rank of the
    group, naming the ranks, unless every rank passed the same ``text``."""
    c = group.get_global_communicator()
    if c is communication.CommMember.NON_COMM_MEMBER or c.nranks() == 1:
        return
    data = text.encode()
    n = torch.tensor([len(data)], dtype=torch.int64)
    lens = torch.empty(c.nranks(), dtype=torch.int64)
    communication.allgather(n, lens, c)
    width = int(lens.max())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = torch.empty(width * c.nranks(), dtype=torch.uint8)
    communication.allgather(mine, every, c)
    texts = [bytes(every[i * width:i * width + int(lens[i])].tolist()).decode()
             for i in range(c.nranks())]
    if len(set(texts)) == 1:
        return
    by_text: dict[str, list[int]] = collections.defaultdict(list)
    for i, t in enumerate(texts):
        by_text[t].append(group.ranks[i])
    detail = "; ".join(f"ranks {rs}: {t}" for t, rs in by_text.items())
    raise errors.CollectiveMismatchError(
        f"rank {core_groups.get_ordinal()}: the ranks of process group {group.group_name} "
        f"chose different {what}: {detail}"
    )


class BaguaDistributedDataParallel:
    """A model trained data-parallel with a Bagua algorithm (made by
    ``with_bagua``). Its attributes are Bagua's, which algorithms read:
    ``module``, ``bagua_module_name``, ``bagua_optimizers``,
    ``bagua_algorithm`` (the algorithm implementation), ``process_group``,
    ``bagua_train_step_counter`` (training forwards so far),
    ``bagua_buckets`` and ``_bagua_backend`` (the model's tensor module,
    with ``wait_pending_comm_ops()``).

    Args:
      module (torch.nn.Module): The model.
      optimizers (list[torch.optim.Optimizer]): Its optimizers.
      algorithm (Algorithm): The algorithm.
      process_group (BaguaProcessGroup): The group to train on.
      bagua_module_name (str, optional): The model's name for the tensor API.
      gradient_as_bucket_view (bool): Flatten buckets. Default: True.
      find_unused_parameters (bool): Kept for Bagua; a parameter without a
        gradient never hangs the job either way. Default: False.
      bucket_bytes (int, optional): Bucket size suggested to the algorithm.
        Default: ``get_default_bucket_size()`` (10 MiB, as Bagua).

    Example:
      >>> ddp = BaguaDistributedDataParallel(model, [opt], GradientAllReduceAlgorithm(),
      ...                                    bagua.communication.new_group())
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        algorithm: Any,
        process_group: BaguaProcessGroup,
        bagua_module_name: Optional[str] = None,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        bucket_bytes: Optional[int] = None,
    ) -> None:
        from ..algorithms.base import Algorithm

        if isinstance(algorithm, str):
            algorithm = Algorithm.init(algorithm)
        if not isinstance(algorithm, Algorithm):
            raise TypeError(
                f"algorithm must be a ringlet.bagua.algorithms.Algorithm (or a registered "
                f"algorithm's name), got {type(algorithm).__name__}"
            )
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        process_group._require_member("with_bagua")
        _agree(process_group, f"{_describe(algorithm)} do_flatten={gradient_as_bucket_view}",
               "algorithms for with_bagua")
        self.module = module
        self.bagua_module_name = bagua_module_name or _fresh_name(type(module).__name__, module)
        self.bagua_optimizers = list(optimizers)
        self.process_group = process_group
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.bucket_bytes = bucket_bytes or get_default_bucket_size()
        self.parameters_to_ignore: list[str] = []
        for attr in ("_bagua_params_and_buffers_to_ignore", "_ddp_params_and_buffers_to_ignore"):
            self.parameters_to_ignore.extend(getattr(module, attr, []))
        previous = module.__dict__.get("bagua_ddp")
        if previous is not None:
            previous._release()
        if hasattr(module, "_bagua_states"):
            self._reset_algorithm_state()
        self.bagua_algorithm = algorithm.reify(process_group)
        self.bagua_train_step_counter = 0
        self.bagua_buckets: list[BaguaBucket] = []
        module._bagua_states = _States()
        self._bagua_backend = get_module(self.bagua_module_name)
        self.require_backward_grad_sync = True
        self.autograd_graph_params: dict[str, torch.nn.Parameter] = {}
        self._is_post_backward_callback_queued = False
        self._released = False

        ddp = self

        def step_counter(mod: torch.nn.Module, _input: Any) -> None:
            if mod.training:
                ddp.bagua_train_step_counter += 1

        def reset(mod: torch.nn.Module, _input: Any) -> None:
            if ddp.bagua_algorithm.need_reset() and mod.training:
                ddp._bagua_init_algorithm()

        def forward_pre(mod: torch.nn.Module, inputs: Any) -> None:
            if mod.training:
                ddp.bagua_algorithm.init_forward_pre_hook(ddp)(inputs)

        def clear(mod: torch.nn.Module, _input: Any) -> None:
            ddp.autograd_graph_params.clear()
            ddp._is_post_backward_callback_queued = False

        states = module._bagua_states
        states._bagua_framework_hooks.extend(
            module.register_forward_pre_hook(h) for h in (clear, step_counter, reset, forward_pre)
        )
        self._bagua_init_algorithm()

    # -- Bagua's DDP methods -----------------------------------------------------

    def bagua_build_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Returns ``(name, parameter)`` of every trainable parameter not
        ignored, in module order, each once.

        Returns:
          list[tuple[str, torch.nn.Parameter]]: The parameters.
        """
        seen: set[int] = set()
        out = []
        for mod_name, mod in self.module.named_modules():
            for p_name, p in mod.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}"
                if not p.requires_grad or full in self.parameters_to_ignore or id(p) in seen:
                    continue
                if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and mod.sparse:
                    raise NotImplementedError("sparse gradient not supported yet")
                seen.add(id(p))
                out.append((full, p))
        return out

    def _group_comm(self) -> Any:
        return self.process_group.get_global_communicator()

    def _bagua_broadcast_parameters(self) -> None:
        """Copies the parameters and optimizer state of the group's first
        rank to its other ranks."""
        c = self._group_comm()
        with torch.no_grad():
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = collections.defaultdict(list)
            for _, p in self.bagua_build_params():
                by_dtype[p.dtype].append(p.data)
            for tensors in by_dtype.values():
                communication.broadcast_coalesced(tensors, 0, c)
        for opt in self.bagua_optimizers:
            self._bagua_broadcast_optimizer_state(opt, c)

    def _bagua_broadcast_optimizer_state(self, optimizer: torch.optim.Optimizer, c: Any) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("cannot broadcast torch.optim.LBFGS state")
        state = optimizer.state_dict()
        if len(state["state"]) == 0:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.requires_grad and p.grad is None:
                        p.ringlet_ensure_grad()
            state = optimizer.state_dict()
        if len(state["state"]) == 0:
            return
        tensors: list[torch.Tensor] = []
        scalars: dict[str, Any] = {}
        for index, pg in enumerate(state["param_groups"]):
            for key, value in sorted(pg.items(), key=lambda kv: kv[0]):
                if key != "params":
                    scalars[f"group/{index}/{key}"] = value
            for pid in sorted(pg["params"]):
                for name, inner in sorted(state["state"].get(pid, {}).items(),
                                          key=lambda kv: kv[0]):
                    if isinstance(inner, torch.Tensor):
                        tensors.append(inner)
                    else:
                        scalars[f"state/{pid}/{name}"] = inner
        with torch.no_grad():
            for t in tensors:
                if t.numel():
                    communication.broadcast(t, 0, c)
        scalars = communication.broadcast_object(scalars, 0, c)  # type: ignore[assignment]
        for key, value in scalars.items():
            kind, a, name = key.split("/", 2)
            if kind == "group":
                optimizer.param_groups[int(a)][name] = value
            else:
                pid = int(a)
                params = [p for g in optimizer.param_groups for p in g["params"]]
                if pid < len(params) and params[pid] in optimizer.state:
                    optimizer.state[params[pid]][name] = value

    def _bagua_init_algorithm(self) -> None:
        self._bagua_backend.wait_pending_comm_ops()
        self._bagua_broadcast_parameters()
        self._bagua_tensors = self.bagua_algorithm.init_tensors(self)
        self._bagua_tensor_map = {t._ringlet_name: t for t in self._bagua_tensors}
        self._reset_buckets()
        self._register_autograd_hooks()
        self._register_optimizer_hooks()

    def _suggested_buckets(self) -> list[list[torch.Tensor]]:
        """Tensors in registration order, cut into buckets of the default
        size (one dtype and device each): Bagua's first suggestion."""
        if not self._bagua_tensors:
            return []
        names = [t._ringlet_name for t in self._bagua_tensors]
        groups = self._bagua_backend._core.plan(names, self.bucket_bytes)
        return [[self._bagua_tensor_map[n] for n in g] for g in groups]

    def _reset_buckets(self) -> None:
        raw = self._suggested_buckets()
        self.bagua_buckets = self.bagua_algorithm.tensors_to_buckets(
            raw, self.gradient_as_bucket_view
        )
        for bucket in self.bagua_buckets:
            self.bagua_algorithm.init_operations(self, bucket)
        register_ordered_buckets(self._bagua_backend, self.bagua_buckets)
        self.params_in_use = {name for name, _ in self.bagua_build_params()}
        self._publish()

    def _publish(self) -> None:
        """Puts Bagua's attributes on the module itself (``bagua_algorithm``,
        ``bagua_buckets``, ``bagua_optimizers``, ``bagua_ddp`` and their
        ``ringlet_`` twins), as Bagua's patched ``torch.nn.Module`` shows them."""
        d = self.module.__dict__
        d["bagua_ddp"] = self
        for prefix in ("bagua", "ringlet"):
            d[f"{prefix}_algorithm"] = self.bagua_algorithm
            d[f"{prefix}_buckets"] = self.bagua_buckets
            d[f"{prefix}_optimizers"] = self.bagua_optimizers

    def _cleanup_autograd_hooks(self) -> None:
        states = self.module._bagua_states
        for h in states._bagua_autograd_hooks:
            h.remove()
        states._bagua_autograd_hooks.clear()

    def _register_autograd_hooks(self) -> None:
        self._cleanup_autograd_hooks()
        hook = self.bagua_algorithm.init_backward_hook(self)
        post = self.bagua_algorithm.init_post_backward_hook(self)

        def make(name: str, param: torch.nn.Parameter) -> Any:
            def on_grad(_p: torch.Tensor) -> None:
                if not self.require_backward_grad_sync or self._released:
                    return
                if self.find_unused_parameters:
                    self.autograd_graph_params[name] = param
                bucket = param.__dict__.get("_bagua_bucket")
                if bucket is not None and bucket.flatten:
                    bucket._rebind(param)
                hook(name, param)
                if not self._is_post_backward_callback_queued:
                    self._is_post_backward_callback_queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(post)

            return on_grad

        states = self.module._bagua_states
        for name, param in self.module.named_parameters():
            if param.requires_grad:
                states._bagua_autograd_hooks.append(
                    param.register_post_accumulate_grad_hook(make(name, param))
                )

    def _register_optimizer_hooks(self) -> None:
        hook = self.bagua_algorithm.init_post_optimizer_step_hook(self)
        ddp = self
        for optimizer in self.bagua_optimizers:
            if not hasattr(optimizer, "_bagua_original_step"):
                optimizer._bagua_original_step = optimizer.step  # type: ignore[attr-defined]

            def post_step(opt: torch.optim.Optimizer) -> None:
                if not ddp._released:
                    hook(opt)

            def new_step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
                result = opt._bagua_original_step(*args, **kwargs)  # type: ignore[attr-defined]
                opt.__dict__["_bagua_post_step_hook"](opt)
                return result

            # kept apart so contrib.fuse_optimizer's fuse_step runs it after a fused update
            optimizer.__dict__["_bagua_post_step_hook"] = post_step
            optimizer.step = MethodType(new_step, optimizer)  # type: ignore[method-assign]

    def _reset_algorithm_state(self) -> None:
        states = self.module._bagua_states
        for h in getattr(states, "_bagua_framework_hooks", []):
            h.remove()
        for h in getattr(states, "_bagua_autograd_hooks", []):
            h.remove()

    def _release(self) -> None:
        """Stops this wrapping before the module is wrapped again."""
        impl = self.bagua_algorithm
        running = getattr(impl, "_is_running", None)
        if running is not None and running():
            raise RuntimeError(
                f"model {self.bagua_module_name!r} is already wrapped with an asynchronous "
                "algorithm that is still averaging: call model.bagua_algorithm.abort(model) "
                "before wrapping it again with with_bagua"
            )
        self._bagua_backend.wait_pending_comm_ops()
        self._released = True

    # ringlet's own names
    @property
    def ringlet_module_name(self) -> str:
        """The model's name (``bagua_module_name``)."""
        return self.bagua_module_name

    @property
    def ringlet_buckets(self) -> list[BaguaBucket]:
        """The model's buckets (``bagua_buckets``)."""
        return self.bagua_buckets

    @property
    def ringlet_algorithm(self) -> Any:
        """The algorithm implementation (``bagua_algorithm``)."""
        return self.bagua_algorithm


_module_ids = itertools.count()


def _fresh_name(kind: str, module: torch.nn.Module) -> str:
    """A model's name for the tensor API, unique in this process: Bagua's
    ``<class>_<id>`` and a counter, since a model collected while its
    registration lives on (its wrapper not yet released) leaves its id to
    the next object, whose registration would then meet the old one's
    tensors."""
    return f"{kind}_{id(module)}_{next(_module_ids)}"


def with_ringlet(
    self: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    algorithm: Any,
    process_group: Optional[BaguaProcessGroup] = None,
    do_flatten: bool = True,
) -> torch.nn.Module:
    """Trains the module data-parallel with a Bagua algorithm (Bagua's
    ``with_bagua``). Collective: every rank of the group wraps the same
    model, in the same order, with the same algorithm and settings (a
    difference raises :class:`ringlet.CollectiveMismatchError` on every
    rank, naming the ranks). Wrapping again switches the algorithm.

    Args:
      optimizers (list[torch.optim.Optimizer]): The module's optimizers.
      algorithm (Algorithm or str): The algorithm, e.g.
        ``ByteGradAlgorithm()``, or a registered name (``"bytegrad"``).
      process_group (BaguaProcessGroup, optional): Default: the default group.
      do_flatten (bool): Make each bucket's tensors views of one buffer.
        Default: True.

    Returns:
      torch.nn.Module: The module itself, with ``bagua_ddp``,
      ``bagua_algorithm``, ``bagua_buckets``, ``bagua_optimizers`` and
      ``bagua_module_name`` (``ringlet_*`` too).

    Raises:
      KeyError: An unknown algorithm name (the registered ones listed).
      ValueError: This rank is not in ``process_group``.
      CollectiveMismatchError: Ranks chose different algorithms or settings.
      RuntimeError: The module runs an asynchronous algorithm not aborted yet.

    Example:
      >>> model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    """
    if process_group is None:
        process_group = _default_group()
    name = self.__dict__.get("ringlet_module_name")
    if name is None:
        name = _fresh_name(type(self).__name__, self)
        self.ringlet_module_name = name
    self.bagua_ddp = BaguaDistributedDataParallel(
        self, optimizers=optimizers, algorithm=algorithm, process_group=process_group,
        bagua_module_name=name, gradient_as_bucket_view=do_flatten,
    )
    return self


def install(prefix: str = "ringlet") -> None:
    """Adds ``with_<prefix>`` to :class:`torch.nn.Module` (a wrapped module
    then carries ``<prefix>_algorithm``, ``_buckets`` and ``_optimizers``).

    Args:
      prefix (str): ``"ringlet"`` (on import) or ``"bagua"`` (by
        ``import ringlet.bagua.compat``).
    """
    setattr(torch.nn.Module, f"with_{prefix}", with_ringlet)


install()


def wrap_for_ddp(
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    algorithm: Any,
    name: str,
    bucket_bytes: int,
    broadcast_buffers: bool = True,
) -> BaguaDistributedDataParallel:
    """Trains ``module`` with a Bagua algorithm on the default group, for
    :class:`ringlet.parallel.ddp.DistributedDataParallel`'s ``algorithm``
    argument (installed there by importing this package).

    Args:
      module (torch.nn.Module): The model.
      optimizers (list[torch.optim.Optimizer]): Its optimizers.
      algorithm (Algorithm or str): The algorithm.
      name (str): The model's name for the tensor API.
      bucket_bytes (int): The buckets' size.
      broadcast_buffers (bool): Copy the first rank's buffers first. Default: True.

    Returns:
      BaguaDistributedDataParallel: What trains the model.

    Example:
      >>> ringlet.DistributedDataParallel(model, algorithm=ByteGradAlgorithm(),
      ...                                 optimizers=[opt])   # calls this
    """
    group = _default_group()
    if broadcast_buffers:
        for b in module.buffers():
            if b.numel():
                communication.broadcast(b.data, 0, group.get_global_communicator())
    return BaguaDistributedDataParallel(
        module, optimizers, algorithm, group, bagua_module_name=name, bucket_bytes=bucket_bytes,
    )


_ringlet_ddp.set_algorithm_wrapper(wrap_for_ddp)


class DistributedDataParallel(torch.nn.Module):
    """Bagua's ``bagua.torch_api.data_parallel.DistributedDataParallel``: a
    module wrapper with torch DDP's interface that trains ``module`` with a
    Bagua algorithm (the wrapper's ``inner`` is the
    :class:`BaguaDistributedDataParallel`).

    Args:
      module (torch.nn.Module): The model.
      device_ids: torch DDP's; accepted, unused (as in Bagua).
      output_device: Accepted, unused.
      dim: Accepted, unused.
      broadcast_buffers: Accepted, unused.
      bucket_cap_mb: Accepted, unused (buckets follow ``BAGUA_DEFAULT_BUCKET_SIZE``).
      check_reduction: Accepted, unused.
      process_group (BaguaProcessGroup or torch ProcessGroup, optional):
        Default: the default group.
      find_unused_parameters (bool): Default: False.
      gradient_as_bucket_view (bool): Flatten buckets. Default: True.
      optimizers (list[torch.optim.Optimizer]): The model's optimizers.
        Default: none.
      algorithm (Algorithm, optional): Default: gradient all-reduce.

    Example:
      >>> net = DistributedDataParallel(model, optimizers=[opt],
      ...                               algorithm=ByteGradAlgorithm())
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: Any = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        optimizers: Optional[list[torch.optim.Optimizer]] = None,
        algorithm: Any = None,
    ) -> None:
        super().__init__()
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("DistributedDataParallel is not needed when a module doesn't have "
                             "any parameter that requires a gradient.")
        if algorithm is None:
            from ..algorithms.gradient_allreduce import GradientAllReduceAlgorithm

            algorithm = GradientAllReduceAlgorithm()
        self.module = module
        name = module.__dict__.get("ringlet_module_name")
        if name is None:
            name = _fresh_name(type(self).__name__, module)
            module.ringlet_module_name = name
        self.inner = BaguaDistributedDataParallel(
            module, list(optimizers or []), algorithm, _to_bagua_group(process_group),
            bagua_module_name=name, gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
        )
        module.__dict__["bagua_ddp"] = self.inner

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module."""
        return self.module(*inputs, **kwargs)

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether backward communicates (False inside :meth:`no_sync`)."""
        return self.inner.require_backward_grad_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager: backward passes inside it communicate nothing
        (gradients accumulate locally).

        Example:
          >>> with net.no_sync():
          ...     net(x1).sum().backward()
          >>> net(x2).sum().backward()      # communicates the accumulated gradients
        """
        before = self.inner.require_backward_grad_sync
        self.inner.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.inner.require_backward_grad_sync = before

    @property
    def bagua_algorithm(self) -> Any:
        """The algorithm implementation."""
        return self.inner.bagua_algorithm

    @property
    def bagua_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers."""
        return self.inner.bagua_optimizers

    @property
    def bagua_buckets(self) -> list[BaguaBucket]:
        """The buckets."""
        return self.inner.bagua_buckets


def _to_bagua_group(group: Any) -> BaguaProcessGroup:
    """A Bagua group for a Bagua group, a torch group, or None (default)."""
    if group is None:
        return _default_group()
    if isinstance(group, BaguaProcessGroup):
        return group
    mapped = communication._torch_to_bagua_pg_map.get(group)
    if mapped is None:
        mapped = communication._torch_to_bagua_pg_map[group] = (
            communication.from_torch_group(group)
        )
    return mapped
