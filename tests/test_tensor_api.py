"""The Bagua-style tensor API (``ringlet.parallel.tensor``): proxies and closures,
storage aliasing, buckets, ready-marking order, the worker's errors, bucket
all-reduce across real processes, the ``ringlet.bagua.compat`` names, and the
CUDA path (event sync, staging through host memory) where CUDA exists."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import torch

import ringlet
from ringlet.parallel.tensor import TensorModule, _stage, get_module

from conftest import launch

_ids = itertools.count()


def fresh(prefix: str) -> str:
    """A module name no other test in this process uses."""
    return f"{prefix}_{next(_ids)}"


def grad_param(values: list[float], name: str, module: str) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.tensor(values))
    return p.ensure_ringlet_tensor(
        name, module, lambda t: t.grad, lambda t, g: setattr(t, "grad", g)
    )


def test_proxies_closures_and_identity() -> None:
    mod = fresh("closures")
    x = torch.arange(4.0)
    assert not x.is_ringlet_tensor()
    assert x.ensure_ringlet_tensor("x", mod) is x  # in place, returns self
    assert x.is_ringlet_tensor() and x.ringlet_getter_closure() is x  # identity getter
    assert x.ensure_ringlet_tensor() is x and x.ensure_ringlet_tensor("x", mod) is x
    backend = x.ringlet_backend_tensor()
    assert (backend.name, backend.module_name) == ("x", mod)
    assert backend.registration() == (4, "float32", "cpu")
    assert not backend.is_ready()

    # getter / setter closures: the effective tensor is the gradient
    p = grad_param([1.0, 2.0], "p", mod)
    assert p.ringlet_getter_closure() is None  # no grad yet
    assert p.ringlet_ensure_grad() is p and torch.equal(p.grad, torch.zeros(2))
    g0 = p.grad
    assert p.ringlet_ensure_grad().grad is g0  # kept when it exists
    new = torch.tensor([5.0, 6.0])
    p.ringlet_setter_closure(new)
    assert p.grad is new and p.ringlet_getter_closure() is new

    # auto names are unique; no module is allowed until marking ready
    a, b = torch.zeros(1).ensure_ringlet_tensor(), torch.zeros(1).ensure_ringlet_tensor()
    assert a.ringlet_tensor_name != b.ringlet_tensor_name
    assert a.ringlet_backend_tensor().module_name is None

    # to_ vs ensure_: a new tensor sharing storage; the original untouched
    y = torch.arange(3.0)
    t = y.to_ringlet_tensor("t", mod)
    assert t is not y and t.is_ringlet_tensor() and not y.is_ringlet_tensor()
    assert t.data_ptr() == y.data_ptr()
    t[0] = 42.0
    assert y[0].item() == 42.0
    w = torch.nn.Parameter(torch.ones(2))
    tw = w.to_ringlet_tensor("tw", mod)
    assert tw.requires_grad and tw.is_leaf and not w.is_ringlet_tensor()
    y.set_(torch.zeros(3).untyped_storage(), 0, (3,))  # the seed's caveat
    assert t[0].item() == 42.0 and y[0].item() == 0.0

    m = get_module(mod)
    assert [v.ringlet_tensor_name for v in m.tensors()] == ["x", "p", "t", "tw"]
    assert m.tensors()[1] is p


def test_set_storage_aliases_without_copy() -> None:
    mod = fresh("storage")
    # no setter: the effective tensor itself is re-pointed
    x = torch.arange(3.0).ensure_ringlet_tensor("x", mod)
    buf = torch.arange(10.0, 20.0)
    x.ringlet_set_storage(buf.untyped_storage(), 4)
    assert x.data_ptr() == buf.data_ptr() + 4 * 4
    assert x.tolist() == [14.0, 15.0, 16.0]
    buf[5] = -1.0
    assert x[1].item() == -1.0  # aliased, not copied
    # with a setter: a new tensor on the storage goes through the setter
    p = grad_param([0.0, 0.0], "p", mod)
    p.ringlet_ensure_grad()
    old_grad = p.grad
    p.ringlet_set_storage(buf.untyped_storage())
    assert p.grad is not old_grad and p.grad.data_ptr() == buf.data_ptr()
    assert p.grad.tolist() == [10.0, 11.0]
    # getter only: the gradient tensor object is re-pointed in place
    q = torch.nn.Parameter(torch.zeros(2)).ensure_ringlet_tensor("q", mod, lambda t: t.grad)
    q.ringlet_ensure_grad()
    g = q.grad
    q.ringlet_set_storage(buf.untyped_storage(), 8)
    assert q.grad is g and g.tolist() == [18.0, 19.0]


def test_misuse_raises_clear_errors() -> None:
    mod = fresh("errors")
    with pytest.raises(ValueError, match="setter_closure needs a getter_closure"):
        torch.zeros(1).ensure_ringlet_tensor("s", mod, setter_closure=lambda t, g: None)
    x = torch.zeros(2).ensure_ringlet_tensor("x", mod)
    with pytest.raises(ValueError, match="cannot be renamed to 'y'"):
        x.ensure_ringlet_tensor("y")
    with pytest.raises(ValueError, match="cannot move to 'other'"):
        x.ensure_ringlet_tensor(module_name="other")
    with pytest.raises(ValueError, match="setter_closure needs a getter_closure"):
        x.ensure_ringlet_tensor(setter_closure=lambda t, g: None)  # x has no getter
    with pytest.raises(ValueError, match="already registered in module"):
        torch.zeros(2).ensure_ringlet_tensor("x", mod)
    dup = torch.zeros(2)
    with pytest.raises(ValueError):
        dup.ensure_ringlet_tensor("x", mod)
    assert not dup.is_ringlet_tensor()  # a failed registration leaves no trace
    loose = torch.zeros(1).ensure_ringlet_tensor("loose")
    with pytest.raises(RuntimeError, match="belongs to no module"):
        loose.ringlet_mark_communication_ready()
    with pytest.raises(RuntimeError, match="belongs to no module"):
        loose.ringlet_mark_communication_ready_without_synchronization()
    with pytest.raises(RuntimeError, match="has no setter_closure"):
        x.ringlet_setter_closure(torch.zeros(2))
    plain = torch.zeros(1)
    for method in ("ringlet_getter_closure", "ringlet_backend_tensor",
                   "ringlet_mark_communication_ready"):
        with pytest.raises(RuntimeError, match="not a ringlet tensor"):
            getattr(plain, method)()
    m = get_module(mod)
    with pytest.raises(ValueError, match="in no bucket"):
        x.ringlet_mark_communication_ready()
    d = torch.zeros(2, dtype=torch.float64).ensure_ringlet_tensor("d", mod)
    with pytest.raises(ValueError, match="one dtype on one device"):
        m.set_buckets([[x, d]])
    with pytest.raises(ValueError, match="no tensor named 'ghost'"):
        m.set_buckets([["ghost"]])
    with pytest.raises(ValueError, match="not a ringlet tensor of module"):
        m.set_buckets([[torch.zeros(1)]])
    with pytest.raises(ValueError, match="in bucket 0 and bucket 1"):
        m.set_buckets([[x], [x]])
    m.set_buckets([[x], [d]])
    with pytest.raises(ValueError, match="no bucket operation"):
        x.ringlet_mark_communication_ready()
    m.set_bucket_op(lambda i, ts: None)
    x.ringlet_mark_communication_ready()
    with pytest.raises(ValueError, match="already marked ready"):
        x.ringlet_mark_communication_ready()
    with pytest.raises(ValueError, match="operations are pending"):
        m.set_buckets([[x]])
    d.ringlet_mark_communication_ready_without_synchronization()
    m.wait_pending_comm_ops()
    with pytest.raises(ValueError, match="module_name must be"):
        get_module("")
    # an effective tensor that changed shape since registration
    holder: dict[str, Any] = {"v": torch.zeros(2)}
    p = torch.zeros(2).ensure_ringlet_tensor("p", mod, lambda t: holder["v"])
    m.set_buckets([[p]])
    m.set_all_reduce(comm=ringlet._core.Communicator.single())
    holder["v"] = torch.zeros(3)
    p.ringlet_mark_communication_ready()
    with pytest.raises(ValueError, match="registered as 2 float32"):
        m.wait_pending_comm_ops()
    holder["v"] = None
    p.ringlet_mark_communication_ready()
    with pytest.raises(RuntimeError, match="returned None"):
        m.wait_pending_comm_ops()
    holder["v"] = torch.zeros(4)[::2]
    p.ringlet_mark_communication_ready()
    with pytest.raises(ValueError, match="not contiguous"):
        m.wait_pending_comm_ops()
    m.close()
    with pytest.raises(RuntimeError, match="was closed"):
        p.ringlet_mark_communication_ready()


def test_reensure_replaces_closures_used_by_the_worker() -> None:
    mod = fresh("reensure")
    p = grad_param([0.0, 0.0], "p", mod)
    p.grad = torch.tensor([1.0, 2.0])
    m = get_module(mod)
    m.set_buckets([[p]])
    seen: list[torch.Tensor] = []

    def op(index: int, tensors: list[torch.Tensor]) -> None:
        seen.append(tensors[0])
        tensors[0].mul_(10.0)

    m.set_bucket_op(op)
    p.ringlet_mark_communication_ready()
    m.wait_pending_comm_ops()
    assert seen[-1] is p.grad and p.grad.tolist() == [10.0, 20.0]

    # a new getter (the setter is kept: None keeps a closure)
    holder = {"main": torch.tensor([7.0, 8.0])}
    old_setter = p._ringlet_setter
    assert p.ensure_ringlet_tensor(getter_closure=lambda t: holder["main"]) is p
    assert p._ringlet_setter is old_setter
    assert p.ringlet_getter_closure() is holder["main"]
    p.ringlet_mark_communication_ready()
    m.wait_pending_comm_ops()
    assert seen[-1] is holder["main"] and holder["main"].tolist() == [70.0, 80.0]
    assert p.grad.tolist() == [10.0, 20.0]  # the old effective tensor is untouched

    # a new setter, with name and module repeated: set_storage goes through it
    def set_main(t: torch.Tensor, v: torch.Tensor) -> None:
        holder["main"] = v

    assert p.ensure_ringlet_tensor("p", mod, setter_closure=set_main) is p
    buf = torch.arange(4.0)
    p.ringlet_set_storage(buf.untyped_storage(), 2)
    assert holder["main"].data_ptr() == buf.data_ptr() + 2 * 4
    assert p.ringlet_getter_closure().tolist() == [2.0, 3.0]
    p.ringlet_mark_communication_ready()
    m.wait_pending_comm_ops()
    assert buf.tolist() == [0.0, 1.0, 20.0, 30.0]  # the worker used the new tensor
    p.ringlet_setter_closure(torch.tensor([5.0, 5.0]))
    assert holder["main"].tolist() == [5.0, 5.0] and p.grad.tolist() == [10.0, 20.0]

    # the registration is fixed: a getter returning another shape is refused
    # up front, and the closures stay as they were
    before = p._ringlet_getter
    with pytest.raises(ValueError, match=r"returns 3 float32 elements.*as 2 float32"):
        p.ensure_ringlet_tensor(getter_closure=lambda t: torch.zeros(3))
    assert p._ringlet_getter is before and p.ringlet_getter_closure() is holder["main"]

    # an identity tensor gains a getter and a setter in one call
    x = torch.zeros(2).ensure_ringlet_tensor("x", mod)
    side = {"v": torch.ones(2)}
    x.ensure_ringlet_tensor(
        getter_closure=lambda t: side["v"], setter_closure=lambda t, v: side.update(v=v)
    )
    assert x.ringlet_getter_closure() is side["v"]
    x.ringlet_setter_closure(torch.full((2,), 3.0))
    assert side["v"].tolist() == [3.0, 3.0] and x.tolist() == [0.0, 0.0]
    m.close()


def test_registration_errors_are_value_and_assertion_errors() -> None:
    from ringlet.errors import TensorRegistrationError

    assert issubclass(TensorRegistrationError, ValueError)
    assert issubclass(TensorRegistrationError, AssertionError)
    mod = fresh("regerr")
    x = torch.zeros(2).ensure_ringlet_tensor("x", mod)
    cases = [
        (lambda: x.ensure_ringlet_tensor("y"), "cannot be renamed to 'y'"),
        (lambda: x.ensure_ringlet_tensor(module_name="other"), "cannot move to 'other'"),
        (lambda: x.ensure_ringlet_tensor(setter_closure=lambda t, g: None),
         "setter_closure needs a getter_closure"),
        (lambda: torch.zeros(1).ensure_ringlet_tensor(setter_closure=lambda t, g: None),
         "setter_closure needs a getter_closure"),
    ]
    for call, message in cases:
        for cls in (ValueError, AssertionError, TensorRegistrationError):
            with pytest.raises(cls, match=message) as info:
                call()
            assert type(info.value) is TensorRegistrationError
    # nothing changed
    assert x.ringlet_tensor_name == "x" and x.ringlet_module_name == mod
    assert x._ringlet_getter is None and x._ringlet_setter is None
    assert [t.ringlet_tensor_name for t in get_module(mod).tensors()] == ["x"]
    get_module(mod).close()


def test_ensure_grad_needs_a_parameter() -> None:
    plain = torch.zeros(2, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"only a torch\.nn\.Parameter"):
        plain.ringlet_ensure_grad()
    assert plain.grad is None
    with pytest.raises(NotImplementedError):
        torch.zeros(2).ensure_ringlet_tensor().ringlet_ensure_grad()
    g = torch.ones(2)
    plain.grad = g
    assert plain.ringlet_ensure_grad() is plain and plain.grad is g  # has one: kept
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))  # not a ringlet tensor
    assert p.ringlet_ensure_grad() is p
    assert p.grad.dtype == torch.float64 and p.grad.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_set_storage_checks_the_dtype_of_a_typed_storage() -> None:
    mod = fresh("typed")
    x = torch.arange(2.0).ensure_ringlet_tensor("x", mod)
    ptr = x.data_ptr()
    wrong = torch.arange(4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"holds torch\.float64 .* .x. is torch\.float32"):
        x.ringlet_set_storage(wrong.storage())
    assert x.data_ptr() == ptr and x.tolist() == [0.0, 1.0]
    p = grad_param([0.0, 0.0], "p", mod)
    p.ringlet_ensure_grad()
    g = p.grad
    with pytest.raises(RuntimeError, match=r"holds torch\.float64"):
        p.ringlet_set_storage(wrong.storage(), 1)
    assert p.grad is g and p.grad.tolist() == [0.0, 0.0]
    right = torch.arange(10.0, 14.0)  # a typed storage of the same dtype works
    x.ringlet_set_storage(right.storage(), 1)
    assert x.data_ptr() == right.data_ptr() + 4 and x.tolist() == [11.0, 12.0]
    p.ringlet_set_storage(right.storage(), 2)
    assert p.grad.data_ptr() == right.data_ptr() + 8 and p.grad.tolist() == [12.0, 13.0]
    get_module(mod).close()


def test_flatten_keeps_values_and_makes_views() -> None:
    mod = fresh("flat")
    params = [grad_param([0.0] * n, f"p{n}", mod) for n in (3, 5, 2, 4)]
    for i, p in enumerate(params):
        p.grad = torch.arange(p.numel(), dtype=torch.float32) + 10 * i
    want = [p.grad.clone() for p in params]
    m = get_module(mod)
    buckets = m.plan_buckets(params, bucket_cap_bytes=8 * 4)
    assert [[t.numel() for t in b] for b in buckets] == [[3, 5], [2, 4]]
    m.set_buckets(buckets)
    flats = m.flatten_buckets(alignment=4)
    assert [f.numel() for f in flats] == [8, 8]
    assert m.bucket_padding(0).numel() == 0 and m.bucket_padding(1).tolist() == [0.0, 0.0]
    for p, w in zip(params, want):
        assert torch.equal(p.grad, w)  # values kept
    for flat, bucket in zip(flats, buckets):
        at = flat.data_ptr()
        for p in bucket:
            assert p.grad.data_ptr() == at  # back to back
            at += p.grad.nbytes
    flats[1][0] = 99.0
    assert params[2].grad[0].item() == 99.0  # views, not copies
    assert torch.equal(flats[0], torch.cat([want[0], want[1]]))
    with pytest.raises(ValueError, match="alignment"):
        m.flatten_buckets(alignment=0)
    with pytest.raises(IndexError):
        m.bucket_padding(5)
    m.close()


def test_buckets_run_in_order_only_when_complete() -> None:
    mod = fresh("order")
    ts = [torch.full((2,), float(i)).ensure_ringlet_tensor(f"t{i}", mod) for i in range(6)]
    m = get_module(mod)
    m.set_buckets([[ts[0], ts[1]], [ts[2]], [ts[3], ts[4], ts[5]]])
    marked: list[str] = []
    calls: list[tuple[int, list[float], bool]] = []
    worker_threads: set[int] = set()

    def op(index: int, tensors: list[torch.Tensor]) -> None:
        names = [t.ringlet_tensor_name for t in tensors]
        calls.append((index, [t[0].item() for t in tensors], set(names) <= set(marked)))
        worker_threads.add(threading.get_ident())
        for t in tensors:
            t.add_(100.0)

    m.set_bucket_op(op)
    for step in range(2):
        for i in (5, 3, 2, 4, 1):  # everything but t0: nothing may start
            marked.append(f"t{i}")
            ts[i].ringlet_mark_communication_ready()
        assert m.pending() == 0
        m.wait_pending_comm_ops()
        assert len(calls) == 3 * step
        marked.append("t0")
        ts[0].ringlet_mark_communication_ready()
        m.wait_pending_comm_ops()
        marked.clear()
    assert [c[0] for c in calls] == [0, 1, 2, 0, 1, 2]
    assert all(c[2] for c in calls), calls  # never before all were marked
    assert calls[3][1] == [100.0, 101.0]  # the second round saw the first's result
    assert threading.get_ident() not in worker_threads and len(worker_threads) == 1
    assert all(t[0].item() == i + 200.0 for i, t in enumerate(ts))
    m.close()


def test_worker_error_reaches_the_waiting_caller() -> None:
    mod = fresh("fail")
    ts = [torch.zeros(1).ensure_ringlet_tensor(f"t{i}", mod) for i in range(3)]
    m = get_module(mod)
    m.set_buckets([[t] for t in ts])
    ran: list[int] = []

    class Boom(ValueError):
        pass

    def op(index: int, tensors: list[torch.Tensor]) -> None:
        ran.append(index)
        if index == 1 and len(ran) < 3:
            raise Boom(f"bucket {index} failed")

    m.set_bucket_op(op)
    for t in ts:
        t.ringlet_mark_communication_ready()
    with pytest.raises(Boom, match="bucket 1 failed"):
        m.wait_pending_comm_ops()
    assert ran == [0, 1]  # the rest of the round is skipped
    m.wait_pending_comm_ops()  # handed over once
    for t in ts:
        t.ringlet_mark_communication_ready()
    m.wait_pending_comm_ops()
    assert ran == [0, 1, 0, 1, 2]
    m.close()


def test_staging_helper_copies_both_ways() -> None:
    src = torch.arange(6, dtype=torch.float64)
    host = torch.zeros(6, dtype=torch.float64)
    _stage(src, host.data_ptr(), host.nbytes, True)
    assert torch.equal(host, src)
    host.mul_(2)
    _stage(src, host.data_ptr(), host.nbytes, False)
    assert src.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    _stage(torch.zeros(0), 0, 0, True)
    with pytest.raises(ValueError, match="staging"):
        _stage(src, host.data_ptr(), 8, True)


def test_compat_bagua_names() -> None:
    import ringlet.bagua.compat  # noqa: F401

    mod = fresh("bagua")
    p = torch.nn.Parameter(torch.ones(3))
    assert p.ensure_bagua_tensor("w", mod, lambda t: t.grad) is p
    assert p.is_bagua_tensor() and p.is_ringlet_tensor()
    assert p.bagua_ensure_grad() is p and p.bagua_getter_closure() is p.grad
    assert p.bagua_backend_tensor().name == "w"
    q = torch.ones(2).to_bagua_tensor("q", mod)
    buf = torch.arange(4.0)
    q.bagua_set_storage(buf.untyped_storage(), 2)
    assert q.tolist() == [2.0, 3.0]
    m = get_module(mod)
    m.set_buckets([[p], [q]])
    seen: list[int] = []
    m.set_bucket_op(lambda i, ts: seen.append(i))
    q.bagua_mark_communication_ready()
    p.bagua_mark_communication_ready_without_synchronization()
    m.wait_pending_comm_ops()
    assert seen == [0, 1]
    with pytest.raises(RuntimeError, match="no setter_closure"):
        q.bagua_setter_closure(torch.zeros(2))
    with pytest.raises(AssertionError, match="no setter_closure"):  # Bagua asserts
        q.bagua_setter_closure(torch.zeros(2))
    loose = torch.zeros(1).ensure_bagua_tensor("loose")
    for mark in (loose.bagua_mark_communication_ready,
                 loose.bagua_mark_communication_ready_without_synchronization):
        with pytest.raises(AssertionError, match="belongs to no module"):
            mark()
    # Bagua's re-call sets the closures given: None is the identity, no setter
    # (ensure_ringlet_tensor keeps a closure passed as None)
    r = torch.nn.Parameter(torch.ones(3))
    r.grad = torch.zeros(3)
    r.ensure_bagua_tensor("r", getter_closure=lambda t: t.grad,
                          setter_closure=lambda t, g: setattr(t, "grad", g))
    assert r.ensure_ringlet_tensor("r").bagua_getter_closure() is r.grad
    assert r.ensure_bagua_tensor("r").bagua_getter_closure() is r
    with pytest.raises(AssertionError, match="no setter_closure"):
        r.bagua_setter_closure(torch.ones(3))
    with pytest.raises(AssertionError, match="cannot be renamed"):
        r.ensure_bagua_tensor("other")
    model = torch.nn.Linear(1, 1)
    model.ringlet_module_name = "lin"
    assert model.bagua_module_name == "lin"
    m.close()


def test_compat_bagua_tensor_attributes() -> None:
    mod = fresh("battr")
    early = torch.zeros(2).ensure_ringlet_tensor("early", mod)  # before the import
    loose = torch.zeros(1).ensure_ringlet_tensor()
    import ringlet.bagua.compat  # noqa: F401

    assert early.bagua_tensor_name == "early" and early.bagua_module_name == mod
    assert early.bagua_backend is get_module(mod)
    assert early.ringlet_tensor_name == "early" and early.ringlet_module_name == mod
    # no name given: Bagua's "" (ringlet's own name is generated)
    assert loose.bagua_tensor_name == "" and loose.ringlet_tensor_name.startswith("ringlet_")
    assert loose.bagua_module_name is None and loose.ringlet_module_name is None
    assert loose.bagua_backend is None
    p = torch.nn.Parameter(torch.ones(2)).ensure_bagua_tensor("w", mod, lambda t: t.grad)
    assert (p.bagua_tensor_name, p.bagua_module_name) == ("w", mod)
    assert p.bagua_backend is early.bagua_backend
    plain = torch.zeros(1)
    for attr in ("bagua_tensor_name", "bagua_module_name", "bagua_backend"):
        assert not hasattr(plain, attr)
        with pytest.raises(AttributeError, match=attr):
            getattr(plain, attr)
    assert not hasattr(plain, "ringlet_module_name")
    get_module(mod).close()
    assert early.bagua_backend is None  # the module was closed
    assert early.bagua_module_name == mod

    model = torch.nn.Linear(1, 1)
    assert model.bagua_module_name is None
    model.bagua_module_name = "lin2"  # assignable, stored as ringlet_module_name
    assert model.ringlet_module_name == "lin2" and model.bagua_module_name == "lin2"
    assert model.__dict__["ringlet_module_name"] == "lin2"
    assert "lin2" not in dict(model.named_parameters())
    del model.bagua_module_name
    assert model.bagua_module_name is None and not hasattr(model, "ringlet_module_name")


# -- across processes ---------------------------------------------------------


def all_reduce_ranks(rank: int, world: int) -> dict[str, Any]:
    mod = "ar"
    params = [
        torch.nn.Parameter(torch.zeros(n)).ensure_ringlet_tensor(
            f"p{n}", mod, lambda t: t.grad, lambda t, g: setattr(t, "grad", g)
        )
        for n in (5, 3, 1000, 7)
    ]
    half = torch.zeros(4, dtype=torch.bfloat16).ensure_ringlet_tensor("h", mod)
    m = get_module(mod)
    m.set_buckets(m.plan_buckets([*params, half], bucket_cap_bytes=64))
    assert [len(b) for b in m.buckets()] == [2, 1, 1, 1]
    m.set_all_reduce(average=True)
    out: dict[str, Any] = {}
    for step, flatten in enumerate((False, True, True)):
        for i, p in enumerate(params):
            g = torch.arange(p.numel(), dtype=torch.float32) * (rank + 1) + i + step
            if step == 2:
                p.grad.copy_(g)  # still views of the flattened buckets
            else:
                p.grad = g
        half.fill_(rank + 1)
        if flatten and step == 1:
            flats = m.flatten_buckets(alignment=world)
            assert all(f.numel() % world == 0 for f in flats)
        for t in reversed([*params, half]):  # out of order
            t.ringlet_mark_communication_ready()
        # the user's own collectives meanwhile use the world communicator
        assert ringlet.all_reduce("sum", torch.ones(3)).tolist() == [world] * 3
        m.wait_pending_comm_ops()
        mean = sum(r + 1 for r in range(world)) / world
        for i, p in enumerate(params):
            want = torch.arange(p.numel(), dtype=torch.float32) * mean + i + step
            torch.testing.assert_close(p.grad, want)
        torch.testing.assert_close(half, torch.full((4,), mean, dtype=torch.bfloat16))
        out[f"step{step}"] = params[0].grad.tolist()
    summed = get_module("ar_sum")
    s = torch.ones(3).ensure_ringlet_tensor("s", "ar_sum")
    summed.set_buckets([[s]])
    summed.set_all_reduce(average=False)
    s.ringlet_mark_communication_ready()
    summed.wait_pending_comm_ops()
    assert s.tolist() == [world] * 3
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bucket_all_reduce_across_ranks(world: int) -> None:
    out = launch(world, all_reduce_ranks, timeout=90)
    assert all(out[r] == out[0] for r in range(world))


# -- CUDA ---------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is unavailable")


def cuda_ranks(rank: int, world: int) -> list[float]:
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    p = torch.nn.Parameter(torch.zeros(1 << 16, device=dev)).ensure_ringlet_tensor(
        "p", "cu", lambda t: t.grad
    )
    q = torch.nn.Parameter(torch.zeros(5, device=dev)).ensure_ringlet_tensor(
        "q", "cu", lambda t: t.grad
    )
    m = get_module("cu")
    m.set_buckets([[p, q]])
    m.set_all_reduce(average=False)
    # long GPU work on a side stream produces the gradient: the worker must
    # wait on the event recorded when it is marked ready
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        a = torch.randn(2048, 2048, device=dev)
        for _ in range(20):
            a = a @ a / 2048
        p.grad = torch.full((1 << 16,), float(rank + 1), device=dev) + 0 * a.sum()
        q.grad = torch.full((5,), float(rank), device=dev)
        p.ringlet_mark_communication_ready()
        q.ringlet_mark_communication_ready()
    m.wait_pending_comm_ops()
    total = sum(r + 1 for r in range(world))
    assert torch.all(p.grad == total).item(), p.grad[:4]
    assert q.grad.tolist() == [float(sum(range(world)))] * 5
    return p.grad[:2].tolist()


@pytest.mark.cuda
@needs_cuda
def test_cuda_event_sync_and_host_staging() -> None:
    """CUDA only: events recorded on the producing stream, staging via host."""
    launch(2, cuda_ranks, timeout=120)


def test_module_objects_are_per_name() -> None:
    name = fresh("same")
    assert get_module(name) is get_module(name)
    assert isinstance(get_module(name), TensorModule)
    get_module(name).close()
    assert not ringlet.parallel.tensor.get_module(name).tensors()
