"""Bagua-style tensor API: proxy tensors registered by name, buckets and
ready-marking, installed as methods of :class:`torch.Tensor` when ringlet is
imported.

A *ringlet tensor* is a proxy: when the engine communicates it, it calls the
proxy's getter closure to find the *effective tensor* that is actually worked
on. Registering a model parameter with ``getter_closure=lambda p: p.grad``
makes its gradient the effective tensor, so a gradient recreated between steps
is still found. The methods below follow Bagua's ``BaguaTensor`` with
``bagua_`` renamed ``ringlet_`` (``import ringlet.bagua.compat`` installs the
original names too).

Tensors registered with a ``module_name`` belong to a :class:`TensorModule`
(see :func:`get_module`), which groups them into buckets, runs one worker
thread that communicates each bucket, in bucket order, once all of its tensors
are marked ready, and waits for that work in
:meth:`TensorModule.wait_pending_comm_ops`.

Example:
  >>> import torch, ringlet
  >>> ringlet.init()
  >>> p = torch.nn.Parameter(torch.ones(4))
  >>> p.ensure_ringlet_tensor("w", "model", getter_closure=lambda t: t.grad)
  >>> m = ringlet.parallel.tensor.get_module("model")
  >>> m.set_buckets([[p]]); m.set_all_reduce(average=True)
  >>> p.ringlet_ensure_grad().ringlet_mark_communication_ready()
  >>> m.wait_pending_comm_ops()      # p.grad is now averaged over the ranks
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from .. import _core
from ..core import connection, engine
from ..core import groups as core_groups
from ..core.engine import DTYPE_NAMES
from ..errors import TensorRegistrationError, TensorStateError

__all__ = [
    "BackendTensor",
    "TensorModule",
    "close_modules",
    "effective_tensor",
    "get_module",
    "install",
    "new_communicator",
    "reensure_ringlet_tensor",
    "registered_module",
]

Getter = Callable[[torch.Tensor], Optional[torch.Tensor]]
Setter = Callable[[torch.Tensor, torch.Tensor], None]
BucketOp = Callable[[int, list[torch.Tensor]], None]

_modules: dict[str, TensorModule] = {}
_modules_lock = threading.Lock()
_auto_names = itertools.count()
_comm_generation: dict[str, int] = {}


_ELEMENT_BYTES = {name: torch.empty(0, dtype=d).element_size() for d, name in DTYPE_NAMES.items()}


def _dtype_name(t: torch.Tensor, what: str) -> str:
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"{what}: dtype {t.dtype} is not supported by ringlet")
    return name


def _stage(tensor: torch.Tensor, ptr: int, nbytes: int, to_host: bool) -> None:
    """Copies a (device) tensor to or from ``nbytes`` of host memory at ``ptr``."""
    if nbytes == 0:
        return
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    host = torch.frombuffer(raw, dtype=torch.uint8)
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    if flat.numel() != nbytes:
        raise ValueError(f"staging {nbytes} bytes for a tensor of {flat.numel()} bytes")
    if to_host:
        host.copy_(flat)
    else:
        flat.copy_(host)


@dataclass(frozen=True)
class BackendTensor:
    """What the engine holds for a ringlet tensor (returned by
    ``ringlet_backend_tensor()``).

    Attributes:
      name (str): The tensor's unique name.
      module_name (str, optional): Its module, or ``None``.
    """

    name: str
    module_name: Optional[str]
    proxy: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    def data_ptr(self) -> int:
        """Returns the data pointer of the effective tensor now (Bagua's
        pointer of ``bagua_backend_tensor()``).

        Returns:
          int: The address, 0 when the getter returns ``None``.
        """
        proxy = self.proxy
        if proxy is None:
            proxy = _module_of(self.module_name, self.name)._proxies[self.name]
        eff = effective_tensor(proxy)
        return 0 if eff is None else engine.ptr(eff)

    def registration(self) -> tuple[int, str, str]:
        """Returns ``(numel, dtype_name, device)`` recorded by the engine.

        Raises:
          TensorStateError: The tensor belongs to no module (a ``RuntimeError``
        and an ``AssertionError``, as Bagua's ``assert``).
        """
        return _module_of(self.module_name, self.name)._core.tensor(self.name)

    def is_ready(self) -> bool:
        """Returns whether the tensor is marked ready in its module's current round."""
        return _module_of(self.module_name, self.name)._core.is_ready(self.name)


class TensorModule:
    """The ringlet tensors of one model: buckets, bucket operation, worker.

    Get one with :func:`get_module`; tensors join it through
    ``ensure_ringlet_tensor(..., module_name=...)``.

    Example:
      >>> m = ringlet.parallel.tensor.get_module("model")
      >>> m.set_buckets(m.plan_buckets(m.tensors(), bucket_cap_bytes=1 << 20))
      >>> m.set_all_reduce()
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._proxies: dict[str, torch.Tensor] = {}
        self._flat: list[torch.Tensor] = []
        self._padding: list[torch.Tensor] = []
        self._mirrors: dict[str, torch.Tensor] = {}
        self._core = _core.TensorModule(name, self._resolve, _stage)

    # -- engine callbacks (run on the worker thread, with the GIL) ----------

    def _effective(self, name: str) -> torch.Tensor:
        proxy = self._proxies.get(name)
        if proxy is None:
            raise KeyError(f"no tensor named '{name}' in module '{self.name}'")
        eff = effective_tensor(proxy)
        if eff is None:
            raise RuntimeError(
                f"the getter closure of tensor '{name}' (module '{self.name}') returned "
                "None: create the effective tensor first (e.g. ringlet_ensure_grad())"
            )
        return eff

    def _resolve(
        self, name: str
    ) -> tuple[int, int, str, str, torch.Tensor, int, Optional[torch.Tensor]]:
        eff = self._effective(name)
        if not eff.is_contiguous():
            raise ValueError(
                f"the effective tensor of '{name}' (module '{self.name}') is not contiguous"
            )
        mirror = self._mirrors.get(name)
        if mirror is None or not eff.is_cuda or mirror.numel() != eff.nbytes:
            return (engine.ptr(eff), eff.numel(), _dtype_name(eff, name), str(eff.device), eff,
                    0, None)
        return (engine.ptr(eff), eff.numel(), _dtype_name(eff, name), str(eff.device), eff,
                engine.ptr(mirror), mirror)

    def _make_mirrors(self) -> dict[str, torch.Tensor]:
        """One page-locked host buffer per bucket of CUDA tensors, a slice of it
        per tensor: the worker stages the bucket through them (device copies
        at full speed, the reduction in place there) instead of through
        pageable memory of its own."""
        mirrors: dict[str, torch.Tensor] = {}
        if not torch.cuda.is_available():
            return mirrors
        for group in self._core.buckets():
            regs = [self._core.tensor(n) for n in group]
            if not regs or not regs[0][2].startswith("cuda"):
                continue
            sizes = [count * _ELEMENT_BYTES[dtype] for count, dtype, _ in regs]
            try:
                buf = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # no page-locked memory: pageable staging still works
                return {}
            at = 0
            for n, size in zip(group, sizes):
                mirrors[n] = buf[at:at + size]
                at += size
        return mirrors

    def _register(self, name: str, proxy: torch.Tensor, eff: torch.Tensor) -> None:
        self._core.register(name, eff.numel(), _dtype_name(eff, name), str(eff.device))
        self._proxies[name] = proxy

    def _names(self, tensors: list[Union[torch.Tensor, str]]) -> list[str]:
        out = []
        for t in tensors:
            if isinstance(t, str):
                out.append(t)
                continue
            if not is_ringlet_tensor(t) or t._ringlet_module_name != self.name:
                raise ValueError(
                    f"a tensor in the list is not a ringlet tensor of module '{self.name}'"
                )
            out.append(t._ringlet_name)
        return out

    # -- public API ----------------------------------------------------------

    def tensors(self) -> list[torch.Tensor]:
        """Returns the module's proxy tensors in registration order.

        Returns:
          list[torch.Tensor]: The proxies.
        """
        return [self._proxies[n] for n in self._core.names()]

    def plan_buckets(
        self, tensors: list[Union[torch.Tensor, str]], bucket_cap_bytes: int
    ) -> list[list[torch.Tensor]]:
        """Groups tensors, in the given order, into buckets of at most
        ``bucket_cap_bytes`` bytes of one dtype and device each.

        Args:
          tensors (list): Ringlet tensors of this module (or their names), in
            communication order.
          bucket_cap_bytes (int): Byte cap of a bucket (a larger tensor gets a
            bucket of its own).

        Returns:
          list[list[torch.Tensor]]: The buckets, to pass to :meth:`set_buckets`.

        Example:
          >>> m.set_buckets(m.plan_buckets(list(reversed(m.tensors())), 25 << 20))
        """
        groups = self._core.plan(self._names(tensors), int(bucket_cap_bytes))
        return [[self._proxies[n] for n in g] for g in groups]

    def set_buckets(self, buckets: list[list[Union[torch.Tensor, str]]]) -> None:
        """Sets the buckets, in communication order.

        Args:
          buckets (list[list]): Lists of ringlet tensors of this module (or
            names); each tensor at most once, one dtype and device per bucket.

        Raises:
          ValueError: Unknown or repeated tensor, mixed dtype or device, or a
            round in progress.
        """
        self._core.set_buckets([self._names(b) for b in buckets])
        self._flat, self._padding = [], []
        self._mirrors = self._make_mirrors()

    def register_ordered_buckets(self, buckets: list[Any]) -> None:
        """Makes Bagua buckets this module's buckets, in communication order,
        with their operations (Bagua's backend method, called as
        ``get_backend(name).register_ordered_buckets([b.backend_bucket for b
        in buckets])``). Calling it again replaces the buckets.

        Args:
          buckets (list[BaguaBucket]): The buckets, or their ``backend_bucket``.

        Raises:
          TypeError: An entry that is not a :class:`ringlet.bagua.bucket.BaguaBucket`.
          ValueError: A bucket's tensor that is not in this module.

        Example:
          >>> bagua.get_backend("m").register_ordered_buckets([bucket.backend_bucket])
        """
        items = list(buckets)
        for i, b in enumerate(items):
            # a BaguaBucket (whose backend_bucket is itself), told by its parts:
            # the bucket module imports this one
            if not (hasattr(b, "_all_tensors") and hasattr(b, "_ops")):
                raise TypeError(
                    f"register_ordered_buckets: entry {i} is a {type(b).__name__}, not a "
                    "BaguaBucket (or its backend_bucket)"
                )
        self.wait_pending_comm_ops()
        self.set_buckets([[t._ringlet_name for t in b._all_tensors] for b in items])
        self.__dict__["_bagua_buckets"] = items
        self._core.set_bucket_ops([list(b._ops) for b in items])

    def buckets(self) -> list[list[torch.Tensor]]:
        """Returns the buckets as lists of proxy tensors."""
        return [[self._proxies[n] for n in g] for g in self._core.buckets()]

    def flatten_buckets(self, alignment: int = 1) -> list[torch.Tensor]:
        """Makes each bucket's effective tensors views of one contiguous buffer.

        Values are copied into the buffer, then every effective tensor is
        re-pointed at its slice with ``ringlet_set_storage`` (through the setter
        closure when there is one). A flattened bucket is all-reduced in place
        with no staging copy.

        Args:
          alignment (int): Pad each buffer with zeros to a multiple of this
            many elements. Default: 1 (no padding).

        Returns:
          list[torch.Tensor]: One flat buffer per bucket (padding included).
          The padding of bucket ``i`` is :meth:`bucket_padding` ``(i)``.

        Example:
          >>> flat = m.flatten_buckets(alignment=ringlet.world_size())
          >>> from ringlet.core.engine import ptr
          >>> ptr(p.grad) == ptr(flat[0])
          True
        """
        if alignment < 1:
            raise ValueError(f"alignment must be at least 1, got {alignment}")
        flats, pads = [], []
        for i, group in enumerate(self._core.buckets()):
            offsets, data, padding = self._core.bucket_layout(i, alignment)
            effs = [self._effective(n) for n in group]
            flat = torch.zeros(data + padding, dtype=effs[0].dtype, device=effs[0].device)
            with torch.no_grad():
                for eff, off in zip(effs, offsets):
                    flat[off : off + eff.numel()].copy_(eff.reshape(-1))
            for name, off in zip(group, offsets):
                set_storage(self._proxies[name], flat.untyped_storage(), off)
            flats.append(flat)
            pads.append(flat[data:])
        self._flat, self._padding = flats, pads
        return flats

    def bucket_padding(self, index: int) -> torch.Tensor:
        """Returns the zero padding tensor of flattened bucket ``index``.

        Args:
          index (int): Bucket position.

        Returns:
          torch.Tensor: A (possibly empty) view of the buffer's tail.
        """
        if not 0 <= index < len(self._padding):
            raise IndexError(f"bucket {index} of module '{self.name}' is not flattened")
        return self._padding[index]

    def set_all_reduce(
        self, average: bool = True, comm: Optional[_core.Communicator] = None
    ) -> None:
        """Makes the bucket operation an all-reduce over all ranks.

        The module gets a communicator of its own (connected collectively, so
        every rank must call this for the module, in the same order), so the
        worker never interleaves with collectives on the world communicator.

        Args:
          average (bool): Divide the sum by the number of ranks. Default: True.
          comm (_core.Communicator, optional): A dedicated communicator to take
            over instead of connecting a new one (see :func:`new_communicator`).

        Example:
          >>> m.set_all_reduce(average=False)   # sum
        """
        if comm is None:
            comm = new_communicator(self.name)
        self._core.set_all_reduce(comm, average)

    def set_bucket_op(self, op: BucketOp) -> None:
        """Makes the bucket operation a Python callable.

        ``op(bucket_index, effective_tensors)`` runs on the worker thread (with
        the GIL), once per bucket, in bucket order, after the bucket's ready
        events fired. An exception it raises is re-raised by
        :meth:`wait_pending_comm_ops`, and the rest of the round is skipped.

        Args:
          op (Callable[[int, list[torch.Tensor]], None]): The operation.

        Example:
          >>> m.set_bucket_op(lambda i, ts: [t.mul_(2) for t in ts])
        """

        def run(index: int, names: list[str]) -> None:
            op(index, [self._effective(n) for n in names])

        self._core.set_op(run)

    def wait_pending_comm_ops(self) -> None:
        """Blocks until every enqueued bucket operation has finished.

        The GIL is released while waiting. Raises, on the caller, the first
        error of the worker since the previous call (a Python exception from a
        custom operation is re-raised as is); the round then starts over.
        """
        self._core.wait_pending()

    def pending(self) -> int:
        """Returns how many enqueued bucket operations have not finished."""
        return self._core.pending()

    def close(self) -> None:
        """Stops the worker and forgets the module (its tensors stay ringlet
        tensors but can no longer be marked ready)."""
        with _modules_lock:
            if _modules.get(self.name) is self:
                del _modules[self.name]
        self._core.close()


def new_communicator(tag: str) -> _core.Communicator:
    """Connects a new communicator over all ranks, for one module's worker.

    Collective: every rank must call it with the same ``tag``, in the same order.

    Args:
      tag (str): Identifies the communicator in the key-value store.

    Returns:
      _core.Communicator: A communicator no one else uses.
    """
    state = core_groups.require_state()
    if state.world_size == 1:
        return _core.Communicator.single(state.domain)
    with _modules_lock:
        gen = _comm_generation.get(tag, 0)
        _comm_generation[tag] = gen + 1
    comm, _ = connection.connect(
        state.store,
        f"{state.prefix}/tensor_module/{tag}/{gen}",
        state.rank,
        state.world_size,
        state.addr,
        state.timeout,
        name=f"the bucket worker's communicator {tag!r}",
        domain=state.domain,
    )
    return comm


def get_module(module_name: str) -> TensorModule:
    """Returns the :class:`TensorModule` named ``module_name``, creating it.

    Args:
      module_name (str): The module's name (``model.ringlet_module_name`` for
        a model wrapped by :class:`ringlet.DistributedDataParallel`).

    Returns:
      TensorModule: The module.

    Example:
      >>> ringlet.parallel.tensor.get_module("model").tensors()
      []
    """
    if not isinstance(module_name, str) or not module_name:
        raise ValueError(f"module_name must be a non-empty string, got {module_name!r}")
    with _modules_lock:
        m = _modules.get(module_name)
        if m is None:
            m = _modules[module_name] = TensorModule(module_name)
        return m


def close_modules() -> None:
    """Stops every module's worker (also run at interpreter exit)."""
    for m in list(_modules.values()):
        m.close()


atexit.register(close_modules)
core_groups.on_shutdown(close_modules)


def _module_of(module_name: Optional[str], name: str) -> TensorModule:
    if module_name is None:
        raise TensorStateError(
            f"ringlet tensor '{name}' belongs to no module: pass module_name= to "
            "ensure_ringlet_tensor to communicate it"
        )
    m = _modules.get(module_name)
    if m is None:
        raise TensorStateError(f"module '{module_name}' of tensor '{name}' was closed")
    return m


def _require_ringlet(t: torch.Tensor, method: str) -> None:
    if not is_ringlet_tensor(t):
        raise RuntimeError(
            f"{method}: not a ringlet tensor (call ensure_ringlet_tensor() first)"
        )


def effective_tensor(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor the engine works on for ``t``: its getter closure applied to
    it, or ``t`` itself (also for a tensor that is not a ringlet tensor).
    :meth:`torch.Tensor.ringlet_getter_closure` without the ringlet-tensor check.

    Args:
      t (torch.Tensor): A ringlet tensor (or any tensor).

    Returns:
      Optional[torch.Tensor]: The effective tensor (``None`` when the getter
      returns none, e.g. a gradient not created yet).

    Example:
      >>> p = torch.nn.Parameter(torch.ones(2))
      >>> p.ensure_ringlet_tensor("w", getter_closure=lambda t: t.grad)
      >>> effective_tensor(p) is None
      True
    """
    getter = t.__dict__.get("_ringlet_getter")
    return t if getter is None else getter(t)


# -- the methods installed on torch.Tensor -----------------------------------


def ensure_ringlet_tensor(
    self: torch.Tensor,
    name: Optional[str] = None,
    module_name: Optional[str] = None,
    getter_closure: Optional[Getter] = None,
    setter_closure: Optional[Setter] = None,
) -> torch.Tensor:
    """Converts a PyTorch tensor or parameter to a ringlet tensor in place and
    returns it.

    Registers ``self`` as a proxy tensor. ``getter_closure(proxy)`` returns the
    effective tensor used for communication (e.g. ``lambda p: p.grad``);
    ``setter_closure(proxy, tensor)`` replaces it (e.g.
    ``lambda p, g: setattr(p, "grad", g)``). Calling it again on a ringlet
    tensor returns it with the closures that are given replacing the current
    ones (``None`` keeps a closure; the worker uses the new getter from its
    next operation); a different name or module is an error.

    Sets ``ringlet_tensor_name`` and ``ringlet_module_name`` on the tensor
    (with ``ringlet.bagua.compat``: ``bagua_tensor_name``, ``""`` for a
    generated name, ``bagua_module_name`` and ``bagua_backend``, the
    :class:`TensorModule` or ``None``).

    Args:
      name (str, optional): The tensor's unique name (within its module).
        Default: a generated one.
      module_name (str, optional): The model the tensor belongs to
        (``model.ringlet_module_name``); required to mark it ready.
      getter_closure (Callable, optional): Proxy -> effective tensor. Default:
        ``None``, the identity.
      setter_closure (Callable, optional): ``(proxy, new_tensor) -> None``.
        Default: ``None``, a no-op; needs a getter.

    Returns:
      torch.Tensor: ``self``, with ringlet tensor attributes initialised.

    Raises:
      TensorRegistrationError: A setter without a getter, or a new name or
        module for a ringlet tensor (both a ``ValueError`` and an
        ``AssertionError``, as Bagua's ``assert``).
      ValueError: The name is taken in the module, or a new getter returns a
        tensor other than the registered element count, dtype and device.

    Example:
      >>> p.ensure_ringlet_tensor("fc.weight", "model", lambda t: t.grad) is p
      True
      >>> p.ensure_ringlet_tensor(getter_closure=lambda t: t.main_grad) is p
      True
    """
    if is_ringlet_tensor(self):
        reensure_ringlet_tensor(self, name, module_name, getter_closure, setter_closure)
        return self
    if getter_closure is None and setter_closure is not None:
        raise TensorRegistrationError(_SETTER_NEEDS_GETTER)
    given = name
    if name is None:
        name = f"ringlet_tensor_{next(_auto_names)}"
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if module_name is not None:
        eff = self if getter_closure is None else getter_closure(self)
        # e.g. lambda p: p.grad before the first backward: the proxy's shape.
        get_module(module_name)._register(name, self, self if eff is None else eff)
    self._ringlet_name = name
    self._ringlet_given_name = "" if given is None else name
    self._ringlet_module_name = module_name
    self._ringlet_getter = getter_closure
    self._ringlet_setter = setter_closure
    self.ringlet_tensor_name = name
    self.ringlet_module_name = module_name
    return self


_SETTER_NEEDS_GETTER = (
    "a setter_closure needs a getter_closure: without one the effective "
    "tensor is the proxy itself and cannot be replaced"
)


def reensure_ringlet_tensor(
    t: torch.Tensor,
    name: Optional[str],
    module_name: Optional[str],
    getter: Optional[Getter],
    setter: Optional[Setter],
    keep: bool = True,
) -> None:
    """``ensure_ringlet_tensor`` on a ringlet tensor: checks the name and
    module, then replaces the closures that are given (``None`` keeps one;
    with ``keep=False``, Bagua's rule, ``None`` is the identity getter or no
    setter).

    Args:
      t (torch.Tensor): A ringlet tensor.
      name (str, optional): Its name again (``None``: not checked).
      module_name (str, optional): Its module again (``None``: not checked).
      getter (Getter, optional): The new getter closure.
      setter (Setter, optional): The new setter closure.
      keep (bool): ``None`` keeps a closure (``True``) or clears it. Default: True.

    Raises:
      TensorRegistrationError: Another name or module, or a setter without a getter.
      ValueError: The new getter's tensor does not match the registered one.

    Example:
      >>> t = torch.zeros(3).ensure_ringlet_tensor("t")
      >>> reensure_ringlet_tensor(t, "t", None, lambda x: x, None)
    """
    if name is not None and name != t._ringlet_name:
        raise TensorRegistrationError(
            f"ringlet tensor '{t._ringlet_name}' cannot be renamed to '{name}'"
        )
    if module_name is not None and module_name != t._ringlet_module_name:
        raise TensorRegistrationError(
            f"ringlet tensor '{t._ringlet_name}' belongs to module "
            f"{t._ringlet_module_name!r}; it cannot move to {module_name!r}"
        )
    if keep:
        getter = t._ringlet_getter if getter is None else getter
        setter = t._ringlet_setter if setter is None else setter
    if getter is t._ringlet_getter and setter is t._ringlet_setter:
        return
    if getter is None and setter is not None:
        raise TensorRegistrationError(_SETTER_NEEDS_GETTER)
    m = registered_module(t)
    if m is not None and getter is not t._ringlet_getter:
        eff = t if getter is None else getter(t)
        if eff is not None:
            got = (eff.numel(), _dtype_name(eff, t._ringlet_name), str(eff.device))
            want = tuple(m._core.tensor(t._ringlet_name))
            if got != want:
                raise ValueError(
                    f"the new getter_closure of ringlet tensor '{t._ringlet_name}' "
                    f"returns {got[0]} {got[1]} elements on {got[2]}, but it is "
                    f"registered in module '{m.name}' as {want[0]} {want[1]} "
                    f"elements on {want[2]}"
                )
    # The worker resolves the effective tensor through effective_tensor() at
    # every operation, so the new getter takes effect from the next bucket run.
    t._ringlet_getter = getter
    t._ringlet_setter = setter


def registered_module(t: torch.Tensor) -> Optional[TensorModule]:
    """The open module ``t`` is registered in, or ``None``.

    Args:
      t (torch.Tensor): A ringlet tensor.

    Returns:
      Optional[TensorModule]: Its module, while open and ``t`` is registered there.

    Example:
      >>> registered_module(torch.zeros(1).ensure_ringlet_tensor("x")) is None
      True
    """
    name = t.__dict__.get("_ringlet_module_name")
    m = None if name is None else _modules.get(name)
    if m is None or m._proxies.get(t._ringlet_name) is not t:
        return None
    return m


def to_ringlet_tensor(
    self: torch.Tensor,
    name: Optional[str] = None,
    module_name: Optional[str] = None,
    getter_closure: Optional[Getter] = None,
    setter_closure: Optional[Setter] = None,
) -> torch.Tensor:
    """Creates a new ringlet tensor sharing ``self``'s storage and returns it;
    ``self`` is not converted.

    The new tensor is a leaf with ``self``'s ``requires_grad``. Caveat: if
    ``self`` later changes storage (``torch.Tensor.set_``), the new tensor keeps
    the old one.

    Args:
      name (str, optional): See ``ensure_ringlet_tensor``.
      module_name (str, optional): See ``ensure_ringlet_tensor``.
      getter_closure (Callable, optional): See ``ensure_ringlet_tensor``.
      setter_closure (Callable, optional): See ``ensure_ringlet_tensor``.

    Returns:
      torch.Tensor: The new ringlet tensor.

    Example:
      >>> from ringlet.core.engine import ptr
      >>> t = x.to_ringlet_tensor("x"); ptr(t) == ptr(x), x.is_ringlet_tensor()
      (True, False)
    """
    new = self.detach()
    new.requires_grad_(self.requires_grad)
    return ensure_ringlet_tensor(new, name, module_name, getter_closure, setter_closure)


def is_ringlet_tensor(self: torch.Tensor) -> bool:
    """Checks whether this is a ringlet tensor.

    Returns:
      bool: ``True`` after ``ensure_ringlet_tensor`` / ``to_ringlet_tensor``.
    """
    return "_ringlet_name" in self.__dict__


def ringlet_getter_closure(self: torch.Tensor) -> Optional[torch.Tensor]:
    """Returns the effective tensor: the getter closure applied to ``self``, or
    ``self`` when there is none.

    Returns:
      torch.Tensor: The tensor used at runtime.
    """
    _require_ringlet(self, "ringlet_getter_closure")
    return effective_tensor(self)


def ringlet_setter_closure(self: torch.Tensor, tensor: torch.Tensor) -> None:
    """Replaces the effective tensor with ``tensor`` through the setter closure.

    Args:
      tensor (torch.Tensor): The new effective tensor.

    Raises:
      TensorStateError: The tensor has no setter closure (a ``RuntimeError``
        and an ``AssertionError``, as Bagua's ``assert``).
    """
    _require_ringlet(self, "ringlet_setter_closure")
    setter = self._ringlet_setter
    if setter is None:
        raise TensorStateError(f"ringlet tensor '{self._ringlet_name}' has no setter_closure")
    setter(self, tensor)


def ringlet_backend_tensor(self: torch.Tensor) -> BackendTensor:
    """Returns the raw backend tensor.

    Returns:
      BackendTensor: The engine's record of the tensor (name, module).
    """
    _require_ringlet(self, "ringlet_backend_tensor")
    return BackendTensor(self._ringlet_name, self._ringlet_module_name, self)


def ringlet_ensure_grad(self: torch.Tensor) -> torch.Tensor:
    """Creates a zero gradient for this parameter if it has none.

    Returns:
      torch.Tensor: ``self``.

    Raises:
      NotImplementedError: ``self`` has no gradient and is not a
        :class:`torch.nn.Parameter` (as in Bagua).
    """
    if self.grad is not None:
        return self
    if not isinstance(self, torch.nn.Parameter):
        raise NotImplementedError(
            "ringlet_ensure_grad: only a torch.nn.Parameter gets a zero gradient "
            "created; this tensor is not one and has no .grad"
        )
    with torch.no_grad():
        self.grad = torch.zeros_like(self.data)
    return self


def _mark(self: torch.Tensor, sync: bool, method: str) -> None:
    _require_ringlet(self, method)
    m = _module_of(self._ringlet_module_name, self._ringlet_name)
    event = None
    if sync:
        eff = effective_tensor(self)
        if eff is not None and eff.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(eff.device))
    m._core.mark_ready(self._ringlet_name, event)


def ringlet_mark_communication_ready(self: torch.Tensor) -> None:
    """Marks the tensor ready for its module's scheduled operations.

    For a CUDA effective tensor, records an event on the current stream; the
    worker waits on it before touching the data. A no-op wait for CPU tensors.

    Raises:
      TensorStateError: The tensor belongs to no module (a ``RuntimeError``
        and an ``AssertionError``, as Bagua's ``assert``).
      ValueError: It is in no bucket, or already marked in this round.
    """
    _mark(self, True, "ringlet_mark_communication_ready")


def ringlet_mark_communication_ready_without_synchronization(self: torch.Tensor) -> None:
    """Marks the tensor ready immediately, without CUDA event synchronization.

    Raises:
      TensorStateError: The tensor belongs to no module (a ``RuntimeError``
        and an ``AssertionError``, as Bagua's ``assert``).
    """
    _mark(self, False, "ringlet_mark_communication_ready_without_synchronization")


def set_storage(self: torch.Tensor, storage: Any, storage_offset: int = 0) -> None:
    """Points the effective tensor at ``storage`` (no copy).

    Without a setter closure the effective tensor itself is re-pointed
    (``set_``); with one, a new tensor of the same shape on ``storage`` is
    handed to the setter.

    Args:
      storage (torch.UntypedStorage or torch.TypedStorage): The storage to
        use; a typed one must have the effective tensor's dtype.
      storage_offset (int): The offset in the storage, in elements.

    Raises:
      RuntimeError: The getter returned ``None``, or ``storage`` is typed with
        another dtype (as ``torch.Tensor.set_``).
    """
    _require_ringlet(self, "ringlet_set_storage")
    eff = effective_tensor(self)
    if eff is None:
        raise RuntimeError(
            f"ringlet_set_storage: the getter of '{self._ringlet_name}' returned None"
        )
    if isinstance(storage, torch.TypedStorage):
        if storage.dtype != eff.dtype:
            raise RuntimeError(
                f"ringlet_set_storage: the storage holds {storage.dtype} but the "
                f"effective tensor of '{self._ringlet_name}' is {eff.dtype}"
            )
        storage = storage.untyped()
    with torch.no_grad():
        if self._ringlet_setter is None:
            eff.set_(storage, storage_offset, eff.shape)
            return
        t = torch.empty(0, dtype=eff.dtype, device=eff.device)
        t.set_(storage, storage_offset, eff.shape)
        self._ringlet_setter(self, t)


ringlet_set_storage = set_storage

_METHODS: dict[str, Callable[..., Any]] = {
    "ensure_{}_tensor": ensure_ringlet_tensor,
    "to_{}_tensor": to_ringlet_tensor,
    "is_{}_tensor": is_ringlet_tensor,
    "{}_getter_closure": ringlet_getter_closure,
    "{}_setter_closure": ringlet_setter_closure,
    "{}_backend_tensor": ringlet_backend_tensor,
    "{}_ensure_grad": ringlet_ensure_grad,
    "{}_mark_communication_ready": ringlet_mark_communication_ready,
    "{}_mark_communication_ready_without_synchronization": (
        ringlet_mark_communication_ready_without_synchronization
    ),
    "{}_set_storage": set_storage,
}


def install(prefix: str = "ringlet") -> None:
    """Adds the tensor API to :class:`torch.Tensor` under ``prefix``.

    Args:
      prefix (str): ``"ringlet"`` (done on import) or ``"bagua"`` (done by
        ``import ringlet.bagua.compat``).

    Example:
      >>> ringlet.parallel.tensor.install("bagua"); torch.ones(1).is_bagua_tensor()
      False
    """
    for pattern, fn in _METHODS.items():
        setattr(torch.Tensor, pattern.format(prefix), fn)


install()
