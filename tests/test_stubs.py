"""The native module's type stubs (``ringlet/_core.pyi``) name every public
class, method and function the extension really has, and nothing it lacks."""

from __future__ import annotations

import ast
import pathlib

import ringlet._core as core


def _stub_names() -> dict[str, set[str]]:
    path = pathlib.Path(core.__file__).with_name("_core.pyi")
    if not path.exists():  # an installed wheel keeps the stub beside the package
        path = pathlib.Path(__file__).parents[1] / "python" / "ringlet" / "_core.pyi"
    tree = ast.parse(path.read_text())
    names: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef)
                and not n.name.startswith("_")
            }
            names[""].add(node.name)
        elif isinstance(node, ast.FunctionDef):
            names[""].add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if not node.target.id.startswith("_"):
                names[""].add(node.target.id)
    return names


def test_stub_matches_the_native_module() -> None:
    stub = _stub_names()
    real = {n for n in dir(core) if not n.startswith("_")}
    assert stub[""] == real
    for cls in real:
        obj = getattr(core, cls)
        if not isinstance(obj, type):
            continue
        public = {n for n in dir(obj) if not n.startswith("_")}
        assert stub[cls] == public, f"{cls}: stub {sorted(stub[cls])} vs real {sorted(public)}"
