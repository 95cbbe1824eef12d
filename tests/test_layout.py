"""The package is laid out by front door, its imports only point down, and the
modules' earlier import paths still work through one legacy table (each is the same
module object, and warns once that it is deprecated)."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys
from typing import Any

import pytest

import ringlet

ROOT = pathlib.Path(ringlet.__file__).parent

# Earlier import path -> the module's home since the door sub-packages.
OLD_PATHS = {
    "ringlet.collectives": "ringlet.xla.xla_model",
    "ringlet.sharding": "ringlet.xla.sharding",
    "ringlet.sharded_tensor": "ringlet.xla.sharded_tensor",
    "ringlet.c10d": "ringlet.distributed.c10d",
    "ringlet._native": "ringlet.distributed._native",
    "ringlet.runtime": "ringlet.core.groups",
    "ringlet._engine": "ringlet.core.engine",
    "ringlet.tensor": "ringlet.parallel.tensor",
    "ringlet.ddp": "ringlet.parallel.ddp",
    "ringlet.comm_hooks": "ringlet.parallel.comm_hooks",
    "ringlet.bagua.tensor": "ringlet.parallel.tensor",
    "ringlet.bagua.ddp": "ringlet.parallel.ddp",
    "ringlet.bagua.comm_hooks": "ringlet.parallel.comm_hooks",
    "ringlet.compat.bagua": "ringlet.bagua.compat",
    "ringlet.soak": "ringlet.bench.soak",
    "ringlet.torchft": "ringlet.distributed.torchft",
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("ringlet", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    for stub in ROOT.glob("*.pyi"):  # the native module
        out[f"ringlet.{stub.stem}"] = stub
    return out


def _imports_of(tree: ast.AST, package: str, mods: dict[str, pathlib.Path]) -> set[str]:
    """The ringlet modules a module imports, at module level or inside a function
    (imports under ``if TYPE_CHECKING:`` are left out)."""
    edges: set[str] = set()
    todo = [tree]
    while todo:
        for child in ast.iter_child_nodes(todo.pop()):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    base_name = ".".join(base + ([child.module] if child.module else []))
                else:
                    base_name = child.module or ""
                for alias in child.names:
                    sub = f"{base_name}.{alias.name}"
                    edges.add(sub if sub in mods else base_name)
            elif isinstance(child, ast.Import):
                edges.update(a.name for a in child.names)
            todo.append(child)
    return {e for e in edges if e in mods}


def _import_graph() -> dict[str, set[str]]:
    """Module -> the ringlet modules it imports."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        if path.suffix == ".pyi":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = _imports_of(ast.parse(path.read_text()), package, mods) - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def test_no_import_cycles() -> None:
    graph = _import_graph()
    assert "ringlet.xla.sharded_tensor" in graph["ringlet.xla.sharding"]  # the graph is real
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_lower_layers_do_not_import_doors() -> None:
    graph = _import_graph()
    engine_layer = {m for m in graph if m == "ringlet.core" or m.startswith("ringlet.core.")}
    assert {"ringlet.core.engine", "ringlet.core.groups", "ringlet.core.connection",
            "ringlet.core.store", "ringlet.core.members"} <= engine_layer
    core = engine_layer | {"ringlet.errors", "ringlet.checkpoint.mapping",
                           "ringlet.checkpoint.integration", "ringlet.xla.mesh"}
    doors = ("ringlet.xla.sharded_tensor", "ringlet.xla.sharding", "ringlet.distributed",
             "ringlet.bagua", "ringlet.rpc", "ringlet.ops")
    # ringlet.parallel (ringlet's own tensor API, DDP and DDP hooks) is a layer of its own
    # between the two: over the core, under the doors (Bagua's look-alike is built on it).
    parallel = {m for m in graph if m == "ringlet.parallel" or m.startswith("ringlet.parallel.")}
    assert {"ringlet.parallel.tensor", "ringlet.parallel.ddp",
            "ringlet.parallel.comm_hooks"} <= parallel
    layers = [(core, (*doors, "ringlet.parallel")), (parallel, doors)]
    for low_layer, above in layers:
        for low in low_layer:
            bad = sorted(m for m in graph[low] if m.startswith(above))
            assert not bad, f"{low} imports {bad}"
    assert "ringlet.parallel.tensor" in graph["ringlet.bagua.bucket"]  # the door uses it


def _sub_package(name: str) -> str:
    """``ringlet.<x>``'s part of the package: its sub-package, or the module
    itself for a module at the package top (``ringlet`` for the package)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "ringlet"


def _private_names_across_sub_packages() -> dict[str, set[str]]:
    """Private names (``_x``, not dunders) that a module uses from a module of
    another sub-package (``from ringlet.a import _x``, ``from ringlet.a import
    _mod``, ``alias._x`` on an imported module): name -> the modules using it.
    The native module ``ringlet._core`` is the engine itself and not counted."""
    mods = _modules()
    found: dict[str, set[str]] = {}

    def private(n: str) -> bool:
        return n.startswith("_") and not n.startswith("__")

    for name, path in mods.items():
        if path.suffix == ".pyi":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                if not base_name.startswith("ringlet"):
                    continue
                for a in node.names:
                    full = f"{base_name}.{a.name}"
                    if full in mods:
                        aliases[a.asname or a.name] = full
                        if (private(a.name) and a.name != "_core"
                                and _sub_package(full) != _sub_package(name)):
                            found.setdefault(full, set()).add(name)
                    elif private(a.name) and _sub_package(base_name) != _sub_package(name):
                        found.setdefault(full, set()).add(name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("ringlet") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                target = aliases[node.value.id]
                if private(node.attr) and _sub_package(target) != _sub_package(name):
                    found.setdefault(f"{target}.{node.attr}", set()).add(name)
    return found


def test_doors_use_the_engine_layer_by_public_names() -> None:
    # The doors reach ringlet.core (and each other) through public names: at
    # most 5 private names are used across sub-packages (the legacy table,
    # the c10d backend's native glue and its creator, a torch_xla helper).
    found = _private_names_across_sub_packages()
    listing = "\n".join(f"{k} <- {sorted(v)}" for k, v in sorted(found.items()))
    assert len(found) <= 5, f"private names used across sub-packages:\n{listing}"
    assert not [k for k in found if k.startswith("ringlet.core")], listing


def test_private_name_scan_finds_private_names() -> None:
    # The scan above is real: it sees the ones that remain.
    assert "ringlet._legacy" in _private_names_across_sub_packages()


def test_raw_pointers_stay_in_the_engine_layer() -> None:
    # The doors hand the engine tensors; the raw ``.data_ptr()`` calls live in
    # ringlet.core.engine and the native RPC glue only.
    holders = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                     if ".data_ptr()" in p.read_text())
    assert "core/engine.py" in holders
    assert len(holders) <= 2, holders


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("old,new", sorted(OLD_PATHS.items()))
def test_old_import_paths_are_the_new_modules(old: str, new: str) -> None:
    # Through ringlet._legacy's table: the old path is the home module itself, bound on
    # its parent package, and warns (once) with the new path, at the importing line.
    if not _importable(new):
        pytest.skip(f"{new} needs an optional dependency")
    from ringlet import _legacy

    sys.modules.pop(old, None)
    _legacy._warned.pop(old, None)
    with pytest.warns(DeprecationWarning) as record:
        module = importlib.import_module(old)
        assert importlib.import_module(old) is module  # the second import does not warn
    assert module is importlib.import_module(new) is sys.modules[old]
    assert [str(w.message) for w in record] == [
        f"{old} is deprecated: import {new} (the old path goes away in ringlet 0.3)"]
    assert record[0].filename == __file__
    parent, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is module


def test_legacy_table_is_complete() -> None:
    # "No alias modules at the package top": every old path is in the one table, and no
    # module of the package stands in for another by rebinding sys.modules.
    from ringlet import _legacy

    assert _legacy.LEGACY_PATHS == OLD_PATHS
    for old in OLD_PATHS:
        rel = pathlib.Path(*old.split(".")[1:])
        assert not ROOT.joinpath(rel.with_suffix(".py")).exists(), rel
        assert not ROOT.joinpath(rel, "__init__.py").exists(), rel
    aliasing = sorted(str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
                      if "sys.modules[__name__]" in p.read_text())
    assert not aliasing, f"alias modules: {aliasing}"


def _warnings_of(tmp_path: pathlib.Path, body: list[str]) -> list[str]:
    """Runs ``body`` (after ``import sys, warnings``; it records warnings in
    ``caught``) as a script in a new interpreter; returns one line per warning
    caught: category, whether the script's own line raised it, the line, the
    message."""
    script = tmp_path / "script.py"
    script.write_text("\n".join([
        "import sys, warnings", *body,
        "for w in caught:",
        "    print(w.category.__name__, w.filename == __file__, w.lineno, w.message)",
    ]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_old_paths_in_a_fresh_process(tmp_path: pathlib.Path) -> None:
    # Each old path imported first thing in a new interpreter (no import ringlet before it),
    # with the names users import from it, twice: one DeprecationWarning per old path,
    # naming the new one, pointing at the importing line.
    lines = _warnings_of(tmp_path, [
        "warnings.simplefilter('always')",
        "with warnings.catch_warnings(record=True) as caught:",
        "    warnings.simplefilter('always')",
        "    from ringlet.sharding import Mesh, ShardingSpec, mark_sharding, XLAShardedTensor",
        "    from ringlet.c10d import ProcessGroupRinglet, backend_kind",
        "    from ringlet.collectives import all_reduce, REDUCE_SUM",
        "    from ringlet.tensor import get_module",
        "    import ringlet.compat.bagua, ringlet.sharded_tensor, ringlet.soak",
        "    from ringlet.compat.bagua.algorithms.q_adam import QAdamOptimizer",
        "    from ringlet.checkpoint import sharded_state_dict, save",
        "    import ringlet",
        "    ringlet.ddp, ringlet._native, ringlet.comm_hooks",
        "    import ringlet.c10d, ringlet.sharding, ringlet.compat.bagua, ringlet.tensor",
        "    ringlet.ddp, ringlet._native, ringlet.comm_hooks",
        "assert ringlet.c10d is ringlet.distributed.c10d is sys.modules['ringlet.c10d']",
        "assert ringlet.collectives.all_reduce is ringlet.all_reduce is ringlet.xla.all_reduce",
        "assert ringlet.sharding.mark_sharding is ringlet.xla.sharded_tensor.mark_sharding",
        "assert ringlet.ddp.DistributedDataParallel is ringlet.DistributedDataParallel",
        "assert QAdamOptimizer is ringlet.bagua.compat.algorithms.q_adam.QAdamOptimizer",
        "assert ringlet.c10d.__spec__.name == 'ringlet.distributed.c10d'",
    ])
    olds = ["ringlet.sharding", "ringlet.c10d", "ringlet.collectives", "ringlet.tensor",
            "ringlet.compat.bagua", "ringlet.sharded_tensor", "ringlet.soak",
            "ringlet.compat.bagua.algorithms", "ringlet.ddp", "ringlet._native",
            "ringlet.comm_hooks"]
    line_of = [5, 6, 7, 8, 9, 9, 9, 10, 13, 13, 13]
    assert lines == [
        f"DeprecationWarning True {line} {old} is deprecated: import "
        f"{OLD_PATHS.get(old) or old.replace('compat.bagua', 'bagua.compat')} "
        "(the old path goes away in ringlet 0.3)"
        for old, line in zip(olds, line_of)
    ]


def test_old_bagua_paths_in_a_fresh_process(tmp_path: pathlib.Path) -> None:
    # ringlet's own tensor API, DDP and hooks left ringlet.bagua for ringlet.parallel: the
    # old paths, imported every way first thing in a new interpreter, are the new modules
    # and warn once each at the importing line; ringlet.bagua.DistributedDataParallel too.
    lines = _warnings_of(tmp_path, [
        "with warnings.catch_warnings(record=True) as caught:",
        "    warnings.simplefilter('always')",
        "    from ringlet.bagua.tensor import get_module, TensorModule",
        "    import ringlet.bagua.ddp",
        "    from ringlet.bagua import comm_hooks",
        "    import ringlet.bagua, ringlet.bagua.tensor, ringlet.bagua.ddp",
        "    ringlet.bagua.DistributedDataParallel, ringlet.bagua.tensor, ringlet.bagua.comm_hooks",
        "    from ringlet.bagua import DistributedDataParallel, tensor, ddp",
        "    from ringlet.bagua.comm_hooks import allreduce_hook",
        "    import ringlet.bagua.compat",
        "import ringlet.parallel as new",
        "assert get_module is new.tensor.get_module and TensorModule is new.tensor.TensorModule",
        "assert ringlet.bagua.ddp is new.ddp is ddp is sys.modules['ringlet.bagua.ddp']",
        "assert comm_hooks is new.comm_hooks is ringlet.bagua.comm_hooks",
        "assert tensor is new.tensor is ringlet.bagua.tensor",
        "assert tensor is sys.modules['ringlet.bagua.tensor']",
        "assert DistributedDataParallel is new.DistributedDataParallel",
        "assert DistributedDataParallel is ringlet.DistributedDataParallel",
        "assert allreduce_hook is new.comm_hooks.allreduce_hook",
    ])
    olds = [("ringlet.bagua.tensor", 4), ("ringlet.bagua.ddp", 5),
            ("ringlet.bagua.comm_hooks", 6), ("ringlet.bagua.DistributedDataParallel", 8)]
    assert lines == [
        f"DeprecationWarning True {line} {old} is deprecated: import "
        f"{old.replace('bagua', 'parallel')} (the old path goes away in ringlet 0.3)"
        for old, line in olds
    ]


def test_old_bagua_name_warns_once_in_process() -> None:
    # The one old name that is not a module, through ringlet._legacy's LEGACY_NAMES.
    import ringlet.bagua
    from ringlet import _legacy

    assert _legacy.LEGACY_NAMES == {
        "ringlet.bagua.DistributedDataParallel": "ringlet.parallel.DistributedDataParallel"}
    _legacy._warned.pop("ringlet.bagua.DistributedDataParallel", None)
    with pytest.warns(DeprecationWarning) as record:
        assert ringlet.bagua.DistributedDataParallel is ringlet.parallel.DistributedDataParallel
        assert ringlet.bagua.DistributedDataParallel is ringlet.DistributedDataParallel
    assert [str(w.message) for w in record] == [
        "ringlet.bagua.DistributedDataParallel is deprecated: import "
        "ringlet.parallel.DistributedDataParallel (the old path goes away in ringlet 0.3)"]
    assert record[0].filename == __file__
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        ringlet.bagua.no_such_name  # noqa: B018


def test_bagua_look_alike_imports_without_warnings() -> None:
    # Users of Bagua's look-alike see no deprecation warning: ringlet.bagua and
    # ringlet.bagua.compat import cleanly (warnings as errors) in a new interpreter, and
    # install the torch.Tensor methods (ringlet_ names; bagua_ names with compat).
    for module, method in [("ringlet.bagua", "ringlet_ensure_grad"),
                           ("ringlet.bagua.compat", "bagua_ensure_grad")]:
        code = (f"import torch, {module} as m\n"
                f"assert callable(torch.Tensor.{method})\n"
                "assert torch.zeros(1).ensure_ringlet_tensor('t').is_ringlet_tensor()\n"
                "m.algorithms, m.communication, m.data_parallel, m.env, m.utils\n")
        out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, (module, out.stderr)


def test_sharding_keeps_every_name_it_had() -> None:
    # ringlet.sharding was one module before the split into xla.mesh and
    # xla.sharded_tensor: its names, torch_xla's private helpers included, still resolve,
    # and module state is read live (not a copy taken at import).
    import ringlet.xla.sharding as xs
    from ringlet.xla import mesh

    for name in ["Mesh", "HybridMesh", "ShardingSpec", "mark_sharding", "XLAShardedTensor",
                 "get_1d_mesh", "set_global_mesh", "shard_indices", "XLAPatchedLinear",
                 "_get_group_assignment", "_get_tile_assignment", "_get_sharding_type",
                 "_translate_named_partition_spec", "_read_back_sharding_type",
                 "_compute_op_sharding", "_validate_host_layout", "_normalize_entry"]:
        assert getattr(xs, name) is not None, name
    m = xs.Mesh(range(1), (1,))
    xs.set_global_mesh(m)
    try:
        assert xs._GLOBAL_MESH is mesh._GLOBAL_MESH is m
    finally:
        xs.set_global_mesh(None)
    with pytest.raises(AttributeError):
        xs._no_such_name  # noqa: B018


def test_python_m_ringlet_bench_soak_runs_and_the_old_name_warns() -> None:
    out = subprocess.run([sys.executable, "-m", "ringlet.bench.soak", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "python -m ringlet.bench.soak" in out.stdout
    old = subprocess.run([sys.executable, "-m", "ringlet.soak", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert old.returncode == 0, old.stderr
    assert old.stdout == out.stdout
    assert ("DeprecationWarning: python -m ringlet.soak is deprecated: run python -m "
            "ringlet.bench.soak (the old path goes away in ringlet 0.3)") in old.stderr


def test_sharded_parameters_give_their_own_checkpoint_mapping() -> None:
    # The checkpoint layer knows sharded tensors only through LAYOUT_ATTR and
    # sharded_checkpoint_tensor(key); plain tensors are replicated (rank 0 writes them).
    from ringlet.checkpoint import ShardedTensor, integration

    class Layout:
        def sharded_checkpoint_tensor(self, key: str) -> str:
            return f"mapping of {key}"

    t = torch_tensor()
    setattr(t, integration.LAYOUT_ATTR, Layout())
    assert integration.sharded_tensor_mapping("w", t) == "mapping of w"
    assert integration.sharded_tensor_mapping("l", Layout()) == "mapping of l"
    plain = integration.sharded_tensor_mapping("b", torch_tensor())
    assert isinstance(plain, ShardedTensor) and plain.replica_id == 0
    with pytest.raises(TypeError, match="expected a tensor"):
        integration.sharded_tensor_mapping("x", 3)


def torch_tensor() -> Any:
    import torch

    return torch.arange(4.0)


def test_rust_core_modules_have_no_cycle() -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).parent / "scripts"))
    try:
        import rust_module_graph as rmg
    finally:
        sys.path.pop(0)
    src = pathlib.Path(__file__).resolve().parents[1] / "rust" / "ringlet-core" / "src"
    if not src.is_dir():
        pytest.skip("no Rust sources beside the tests (an installed wheel)")
    g = rmg.graph(src)
    assert "transport" not in g["fault"] and "fault" in g["transport"]  # the graph is real
    assert "hierarchy" not in g["group"] and "flat" in g["hierarchy"]
    assert rmg.cycles(g) == []


# The package's programs: they sit above every door (nothing imports them) and
# their workers import the door a run chose, in the process that runs it.
_PROGRAMS = ("ringlet.bench",)


def _function_level_package_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, statement)`` of every absolute import of the package
    (``import ringlet``, ``import ringlet.x``, ``from ringlet[.x] import ...``)
    inside a function's body."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            if any(n == "ringlet" or n.startswith("ringlet.") for n in names):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_function_level_package_imports_are_caught() -> None:
    src = (
        "import ringlet\n"
        "def f():\n    import ringlet\n"
        "def g():\n    from ringlet.xla import mesh\n"
        "class C:\n    def h(self):\n        import ringlet.core.groups as r\n"
        "def ok():\n    from . import groups\n    import ringletx\n"
    )
    got = [line for line, _ in _function_level_package_imports(ast.parse(src))]
    assert got == [3, 5, 8]


def test_no_function_level_import_of_the_package_below_the_top() -> None:
    """A module inside the package imports what it needs at module level (or
    relatively), never ``ringlet`` from inside a function: a lower layer that
    reaches the package's top at call time hides an upward dependency."""
    bad = []
    for name, path in sorted(_modules().items()):
        if path.suffix == ".pyi" or name == "ringlet" or name.startswith(_PROGRAMS):
            continue
        for line, stmt in _function_level_package_imports(ast.parse(path.read_text())):
            bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {stmt}")
    assert not bad, "function-level imports of the package:\n" + "\n".join(bad)


def test_old_bagua_sub_paths_keep_the_not_provided_errors() -> None:
    # A Bagua part ringlet does not provide, asked for under the deprecated path, still
    # says so (naming the module by its new path).
    import warnings

    importlib.import_module("ringlet.bagua.compat")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ImportError, match=r"No module named 'ringlet\.bagua\.compat\.moe': "
                                              "ringlet does not provide Bagua's"):
            importlib.import_module("ringlet.compat.bagua.moe")
