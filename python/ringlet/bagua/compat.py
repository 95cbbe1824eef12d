"""Bagua's tensor API names on top of ringlet.

Importing this module adds to :class:`torch.Tensor` the exact method names of
``bagua.torch_api.tensor.BaguaTensor`` (``ensure_bagua_tensor``,
``to_bagua_tensor``, ``is_bagua_tensor``, ``bagua_getter_closure``,
``bagua_setter_closure``, ``bagua_backend_tensor``, ``bagua_ensure_grad``,
``bagua_mark_communication_ready``,
``bagua_mark_communication_ready_without_synchronization``,
``bagua_set_storage``), each the same function as its ``ringlet_`` twin; the
attributes Bagua sets on a tensor (``bagua_tensor_name``, ``""`` when no name
was given, ``bagua_module_name`` and ``bagua_backend``, the tensor's
:class:`ringlet.parallel.tensor.TensorModule` or ``None``), readable on every ringlet
tensor and absent on others; and ``bagua_module_name`` to
:class:`torch.nn.Module` (an alias of ``ringlet_module_name``, assignable), so
code written for Bagua's tensor API runs unchanged.

It also stands for ``bagua.torch_api`` itself, so Bagua code runs after
replacing ``import bagua.torch_api as bagua`` with ``import
ringlet.bagua.compat as bagua``: ``init_process_group``, ``get_rank``,
``get_world_size``, ``get_local_rank``, ``get_local_size``, the collectives
and ``ReduceOp``, and the submodules ``algorithms`` (with ``base``,
``gradient_allreduce``, ``bytegrad``, ``decentralized``, ``q_adam``,
``async_model_average``), ``communication``, ``bucket``, ``env``,
``utils``, ``tensor``, ``distributed`` (``BaguaModule``), ``data_parallel``
(with ``distributed`` and ``bagua_distributed``) and ``contrib``
(``fuse_optimizer``, the load-balancing samplers, ``CacheLoader`` and
``CachedDataset``), importable under this name (``from
ringlet.bagua.compat.algorithms.q_adam import QAdamOptimizer``); the classes
``BaguaTensor`` and ``BaguaModule`` (the methods Bagua patches onto
``torch.Tensor`` and ``torch.nn.Module``); ``with_bagua`` with
``bagua_algorithm``, ``bagua_buckets`` and ``bagua_optimizers`` on
:class:`torch.nn.Module`; and ``bagua_patch()``, ``bagua_pg`` and
``bagua_get_*_communicator()`` on ``torch.distributed.ProcessGroup``.

Bagua's parts ringlet does not provide (``moe`` / ``model_parallel``,
``checkpoint``, ``contrib.sync_batchnorm``, ``data_parallel.functional``)
raise ``ModuleNotFoundError`` (an ``ImportError``) when imported under this
name, saying so and what to use instead.

Example:
  >>> import torch, ringlet.bagua.compat
  >>> t = torch.zeros(3).ensure_bagua_tensor("t")
  >>> t.is_bagua_tensor(), t.is_ringlet_tensor()
  (True, True)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable, Optional

import torch

from ..parallel import tensor
from ..parallel.tensor import (
    Getter,
    Setter,
    ensure_ringlet_tensor,
    install,
    is_ringlet_tensor,
    reensure_ringlet_tensor,
    registered_module,
)
from . import (
    algorithms,
    bucket,
    communication,
    contrib,
    data_parallel,
    distributed,
    env,
    utils,
)
from .communication import (
    ReduceOp,
    allgather,
    allgather_inplace,
    allreduce,
    allreduce_inplace,
    alltoall,
    alltoall_inplace,
    alltoall_v,
    alltoall_v_inplace,
    barrier,
    broadcast,
    gather,
    gather_inplace,
    get_backend,
    init_process_group,
    recv,
    reduce,
    reduce_inplace,
    reduce_scatter,
    reduce_scatter_inplace,
    scatter,
    scatter_inplace,
    send,
)
from .data_parallel import bagua_distributed as _bagua_distributed  # noqa: F401
from .data_parallel import distributed as _distributed  # noqa: F401
from .distributed import BaguaModule
from .env import get_local_rank, get_local_size, get_rank, get_world_size

__all__ = [
    "BaguaModule",
    "BaguaTensor",
    "ReduceOp",
    "algorithms",
    "allgather",
    "allgather_inplace",
    "allreduce",
    "allreduce_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "barrier",
    "broadcast",
    "bucket",
    "communication",
    "contrib",
    "data_parallel",
    "distributed",
    "env",
    "gather",
    "gather_inplace",
    "get_backend",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "recv",
    "reduce",
    "reduce_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "scatter",
    "scatter_inplace",
    "send",
    "tensor",
    "utils",
]


class _TensorAttribute:
    """A read-only view of a ringlet tensor's state, as the attribute Bagua
    sets on the tensor. Absent (``AttributeError``) on other tensors; an
    assignment stores a plain attribute that hides it, as in Bagua."""

    def __init__(self, read: Callable[[torch.Tensor], Any]) -> None:
        self._read = read
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Optional[torch.Tensor], owner: Optional[type] = None) -> Any:
        if obj is None:
            return self
        if not is_ringlet_tensor(obj):
            raise AttributeError(
                f"'{type(obj).__name__}' object has no attribute '{self._name}' "
                "(not a ringlet tensor: call ensure_bagua_tensor() first)"
            )
        return self._read(obj)


_ATTRIBUTES = {
    "bagua_tensor_name": _TensorAttribute(lambda t: t._ringlet_given_name),
    "bagua_module_name": _TensorAttribute(lambda t: t._ringlet_module_name),
    "bagua_backend": _TensorAttribute(registered_module),
}


def _get_module_name(self: torch.nn.Module) -> Optional[str]:
    """The module's name for the tensor API (``ringlet_module_name``)."""
    return self.__dict__.get("ringlet_module_name")


def _set_module_name(self: torch.nn.Module, value: Optional[str]) -> None:
    self.ringlet_module_name = value


def _del_module_name(self: torch.nn.Module) -> None:
    self.__dict__.pop("ringlet_module_name", None)


def ensure_bagua_tensor(
    self: torch.Tensor,
    name: Optional[str] = None,
    module_name: Optional[str] = None,
    getter_closure: Optional[Getter] = None,
    setter_closure: Optional[Setter] = None,
) -> torch.Tensor:
    """Bagua's ``ensure_bagua_tensor``: :func:`ringlet.parallel.tensor.ensure_ringlet_tensor`
    with Bagua's rule for a tensor that already is one: the closures are set
    to the ones given, ``None`` being the identity getter and no setter
    (``ensure_ringlet_tensor`` keeps a closure passed as ``None``).

    Args:
      name (str, optional): The tensor's unique name; must not change.
      module_name (str, optional): Its module; must not change.
      getter_closure (Callable, optional): Proxy -> effective tensor. Default:
        ``None``, the identity.
      setter_closure (Callable, optional): ``(proxy, new_tensor) -> None``.
        Default: ``None``, none.

    Returns:
      torch.Tensor: ``self``.

    Example:
      >>> p.ensure_bagua_tensor("w", getter_closure=lambda t: t.grad) is p
      True
      >>> p.ensure_bagua_tensor("w").bagua_getter_closure() is p   # the identity again
      True
    """
    if is_ringlet_tensor(self):
        reensure_ringlet_tensor(self, name, module_name, getter_closure, setter_closure, keep=False)
        return self
    return ensure_ringlet_tensor(self, name, module_name, getter_closure, setter_closure)


class BaguaTensor:
    """The methods Bagua patches onto :class:`torch.Tensor` (Bagua's
    ``bagua.torch_api.tensor.BaguaTensor``): importing this module installs
    them on every tensor; the class holds the same functions, for code that
    names it (``BaguaTensor.ensure_bagua_tensor(t, "w")``, type hints). A
    tensor is never an instance of it, in Bagua either.

    Example:
      >>> BaguaTensor.is_bagua_tensor(torch.zeros(1).ensure_bagua_tensor("z"))
      True
    """


install("bagua")
torch.Tensor.ensure_bagua_tensor = ensure_bagua_tensor  # type: ignore[attr-defined]
for _name, _attr in _ATTRIBUTES.items():
    _attr.__set_name__(torch.Tensor, _name)
    setattr(torch.Tensor, _name, _attr)
torch.nn.Module.bagua_module_name = property(  # type: ignore[attr-defined]
    _get_module_name, _set_module_name, _del_module_name, _get_module_name.__doc__
)
data_parallel.install("bagua")

for _name in (
    "is_bagua_tensor",
    "ensure_bagua_tensor",
    "to_bagua_tensor",
    "bagua_getter_closure",
    "bagua_setter_closure",
    "bagua_backend_tensor",
    "bagua_ensure_grad",
    "bagua_mark_communication_ready",
    "bagua_mark_communication_ready_without_synchronization",
    "bagua_set_storage",
):
    setattr(BaguaTensor, _name, getattr(torch.Tensor, _name))
# Bagua's ``tensor`` module holds the class too.
tensor.BaguaTensor = BaguaTensor  # type: ignore[attr-defined]


# -- torch ProcessGroup: Bagua's patch ---------------------------------------------


def _bagua_patch(self: Any, stream: Any = None) -> Any:
    """Makes (once, collectively) the Bagua process group of this torch
    group (Bagua's ``ProcessGroup.bagua_patch``).

    Args:
      stream: Unused (CUDA streams are not used by ringlet's groups).

    Returns:
      torch.distributed.ProcessGroup: The group itself.

    Example:
      >>> pg = torch.distributed.new_group([0, 1]).bagua_patch()
      >>> pg.bagua_pg.ranks
      [0, 1]
    """
    if self not in communication._torch_to_bagua_pg_map:
        communication._torch_to_bagua_pg_map[self] = communication.from_torch_group(self, stream)
    return self


def _bagua_pg(self: Any) -> Any:
    """The Bagua process group made by :func:`_bagua_patch`."""
    pg = communication._torch_to_bagua_pg_map.get(self)
    if pg is None:
        raise RuntimeError(
            "cannot find the Bagua process group of this torch process group: call "
            "bagua_patch() on it first (on every rank)"
        )
    return pg


def _communicator(level: str) -> Callable[[Any], Any]:
    def get(self: Any) -> Any:
        return communication.get_communicator(_bagua_pg(self).group_name, level)

    get.__doc__ = f"The {level} communicator of the group's Bagua process group."
    return get


def _install_process_group_patch() -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    cls = dist.ProcessGroup
    cls.bagua_patch = _bagua_patch  # type: ignore[attr-defined]
    cls.bagua_pg = property(_bagua_pg, doc=_bagua_pg.__doc__)  # type: ignore[attr-defined]
    cls.bagua_get_global_communicator = _communicator("global")  # type: ignore[attr-defined]
    cls.bagua_get_inter_node_communicator = _communicator("inter")  # type: ignore[attr-defined]
    cls.bagua_get_intra_node_communicator = _communicator("intra")  # type: ignore[attr-defined]


_install_process_group_patch()

# Bagua's submodules under this module's name (``bagua.torch_api``'s layout), so
# ``from ringlet.bagua.compat.algorithms.q_adam import QAdamOptimizer``
# finds ringlet's modules (the old ``ringlet.compat.bagua.<sub>`` paths reach
# them through ringlet._legacy).
_SUBMODULES = {
    "algorithms": algorithms,
    "algorithms.base": algorithms.base,
    "algorithms.gradient_allreduce": algorithms.gradient_allreduce,
    "algorithms.bytegrad": algorithms.bytegrad,
    "algorithms.decentralized": algorithms.decentralized,
    "algorithms.q_adam": algorithms.q_adam,
    "algorithms.async_model_average": algorithms.async_model_average,
    "bucket": bucket,
    "communication": communication,
    "contrib": contrib,
    "contrib.cache_loader": contrib.cache_loader,
    "contrib.cached_dataset": contrib.cached_dataset,
    "contrib.fuse": contrib.fuse,
    "contrib.fuse.optimizer": contrib.fuse.optimizer,
    "contrib.load_balancing_data_loader": contrib.load_balancing_data_loader,
    "contrib.utils": contrib.utils,
    "contrib.utils.store": contrib.utils.store,
    "contrib.utils.redis_store": contrib.utils.redis_store,
    "data_parallel": data_parallel,
    "data_parallel.bagua_distributed": data_parallel.bagua_distributed,
    "data_parallel.distributed": data_parallel.distributed,
    "distributed": distributed,
    "env": env,
    "tensor": tensor,
    "utils": utils,
}
_PUBLIC = "ringlet.bagua.compat"
for _rel, _mod in _SUBMODULES.items():
    sys.modules.setdefault(f"{_PUBLIC}.{_rel}", _mod)
# The deprecated path (ringlet._legacy's table) names the same modules.
_HOMES = (_PUBLIC, "ringlet.compat.bagua")

# -- Bagua's parts ringlet does not provide ---------------------------------------

_MOE = (
    "mixture-of-experts layers",
    "exchange tokens between experts with torch.distributed.all_to_all_single over "
    'torch.distributed.init_process_group("ringlet"), or use deepspeed.moe',
)
_NOT_PROVIDED: dict[str, tuple[str, str]] = {
    "moe": _MOE,
    "model_parallel": _MOE,
    "checkpoint": (
        "checkpointing (save_checkpoint / load_checkpoint)",
        "use ringlet.checkpoint (save / load of sharded state) or torch.distributed.checkpoint; "
        "a replicated model's model.state_dict() can be saved with torch.save on rank 0",
    ),
    "contrib.sync_batchnorm": (
        "SyncBatchNorm",
        "use torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) with "
        'torch.distributed.init_process_group("ringlet") (torch\'s SyncBatchNorm takes GPU '
        "inputs; on CPU torch.nn.BatchNorm keeps per-rank statistics)",
    ),
    "data_parallel.functional": (
        "differentiable all_reduce",
        "use torch.distributed.nn.functional.all_reduce over a torch.distributed "
        'process group of the "ringlet" backend',
    ),
}
# Where the import system looks for these names when a from-import names a
# submodule of a module (it uses the module's own __name__).
_ALIASES = {
    "ringlet.bagua.contrib": f"{_PUBLIC}.contrib",
    "ringlet.bagua.data_parallel": f"{_PUBLIC}.data_parallel",
}


def _not_provided(fullname: str) -> Optional[str]:
    """The error text for a Bagua module ringlet does not provide, or None."""
    public = None
    for home, alias in (*((h, _PUBLIC) for h in _HOMES), *_ALIASES.items()):
        if fullname.startswith(home + "."):
            public = alias + fullname[len(home) :]
            break
    if public is None:
        return None
    rel = public[len(_PUBLIC) + 1 :]
    for key, (what, instead) in _NOT_PROVIDED.items():
        if rel == key or rel.startswith(key + "."):
            return (
                f"No module named '{public}': ringlet does not provide Bagua's {what} "
                f"(bagua.torch_api.{rel}). Instead, {instead}."
            )
    return None


class NotProvidedError(ModuleNotFoundError):
    """Raised on importing a Bagua module ringlet does not provide; its
    ``name`` is Bagua's own name of the module (``bagua.torch_api...``)."""


NotProvidedError.__module__ = _PUBLIC


class _NotProvidedFinder(importlib.abc.MetaPathFinder):
    """Answers an import of a Bagua module ringlet does not provide with
    ``ModuleNotFoundError`` saying so and what to use instead."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        message = _not_provided(fullname)
        if message is not None:
            # named by Bagua's name: a from-import (``from ringlet.bagua.compat
            # import moe``) would take an error named by the path it asked for
            # as "absent" and say "cannot import name" instead
            bagua_name = message.partition("(bagua.torch_api.")[2].partition(")")[0]
            bagua_name = f"bagua.torch_api.{bagua_name}"
            raise NotProvidedError(message, name=bagua_name)
        return None


if not any(isinstance(f, _NotProvidedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _NotProvidedFinder())
# A package's path (empty: its submodules are the ones registered above), so
# an unknown submodule is "No module named ...", not "... is not a package".
__path__: list[str] = []
data_parallel.__path__ = []  # type: ignore[attr-defined]


def __getattr__(name: str) -> Any:
    """``bagua.moe``, ``bagua.checkpoint``, ...: the attribute Bagua's package
    has, absent here with the reason."""
    if name in _NOT_PROVIDED:
        what, instead = _NOT_PROVIDED[name]
        raise AttributeError(
            f"module '{_PUBLIC}' has no attribute '{name}': ringlet does not provide Bagua's "
            f"{what} (bagua.torch_api.{name}). Instead, {instead}."
        )
    raise AttributeError(f"module '{_PUBLIC}' has no attribute '{name}'")
