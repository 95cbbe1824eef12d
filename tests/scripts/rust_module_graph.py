"""The top-level module graph of ringlet-core (non-test code), and its cycles.

An edge A -> B is a ``crate::B`` / ``super::`` path in A, or a call in A of a method
that only an ``impl Communicator`` block in B defines (how a collective reaches the
two-level code). Run: ``python tests/scripts/rust_module_graph.py`` (exit status 1
when there is a cycle); tests/test_layout.py checks it.
"""

from __future__ import annotations

import pathlib
import re
import sys
from collections import defaultdict

SRC = pathlib.Path(__file__).resolve().parents[2] / "rust" / "ringlet-core" / "src"
# lib.rs re-exports -> the module that defines them.
ROOT_NAMES = {
    "DType": "dtype", "ReduceOp": "dtype", "ALL_DTYPES": "dtype", "ALL_OPS": "dtype",
    "Cause": "error", "Error": "error", "Result": "error",
    "Communicator": "group", "Config": "group", "SharedCommunicator": "group",
    "version": "lib", "host_identity": "lib",
}
_TOKENS = re.compile(
    r"//[^\n]*|/\*.*?\*/|r(#*)\".*?\"\1|b?\"(?:\\.|[^\"\\])*\"|b?'(?:\\.|[^'\\])'", re.S)


def _close(text: str, start: int) -> int:
    """Index of the brace closing the one at ``start``."""
    depth = 0
    for p in range(start, len(text)):
        if text[p] == "{":
            depth += 1
        elif text[p] == "}":
            depth -= 1
            if depth == 0:
                return p
    return len(text)


def _strip(text: str) -> str:
    """Comments and literals blanked, ``#[cfg(test)]`` items dropped."""
    text = _TOKENS.sub(lambda m: "" if m.group(0).startswith(("/", "'")) else '""', text)
    out, i = [], 0
    while (m := re.search(r"#\[cfg\(test\)\]", text[i:])) is not None:
        s = i + m.start()
        out.append(text[i:s])
        brace, semi = text.find("{", s), text.find(";", s)
        i = semi + 1 if semi != -1 and (brace == -1 or semi < brace) else _close(text, brace) + 1
    out.append(text[i:])
    return "".join(out)


def _names_after(text: str, pos: int) -> list[str]:
    if pos < len(text) and text[pos] == "{":
        inner, parts, depth, cur = text[pos + 1:_close(text, pos)], [], 0, ""
        for ch in inner:
            depth += (ch == "{") - (ch == "}")
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        parts.append(cur)
        return [m.group(1) for x in parts if (m := re.match(r"\s*(\w+)", x))]
    m = re.match(r"(\w+)", text[pos:])
    return [m.group(1)] if m else []


def graph(src: pathlib.Path = SRC) -> dict[str, set[str]]:
    files: dict[str, tuple[str, list[str], str]] = {}
    for path in sorted(src.rglob("*.rs")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "mod":
            parts = parts[:-1]
        if parts == ["lib"]:
            parts = []
        if "tests" in parts:
            continue
        files[str(path)] = (parts[0] if parts else "lib", parts, _strip(path.read_text()))
    edges: dict[str, set[str]] = defaultdict(set)
    for top, parts, text in files.values():
        edges[top]
        for m in re.finditer(r"\bcrate::", text):
            edges[top].update(ROOT_NAMES.get(n, n) for n in _names_after(text, m.end()))
        for m in re.finditer(r"\b((?:super::)+)", text):
            up = m.group(1).count("super")
            parent = parts[:-up] if up <= len(parts) else []
            if parent:
                edges[top].add(parent[0])
            else:
                edges[top].update(ROOT_NAMES.get(n, n) for n in _names_after(text, m.end()))
    owner: dict[str, set[str]] = defaultdict(set)
    elsewhere: set[str] = set()
    for top, _, text in files.values():
        spans = [(m.start(), _close(text, text.find("{", m.end() - 1)))
                 for m in re.finditer(r"impl(?:<[^>]*>)?\s+Communicator\s*\{", text)]
        for m in re.finditer(r"\bfn\s+(\w+)", text):
            if any(a <= m.start() <= b for a, b in spans):
                owner[m.group(1)].add(top)
            else:
                elsewhere.add(m.group(1))
    for top, _, text in files.values():
        for m in re.finditer(r"\.(\w+)\s*(?:::<[^>]*>)?\(", text):
            homes = owner.get(m.group(1), set())
            if len(homes) == 1 and m.group(1) not in elsewhere:
                edges[top].update(homes)
    tops = set(edges)
    return {a: {b for b in bs if b in tops and b not in (a, "self")} for a, bs in edges.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


if __name__ == "__main__":
    g = graph()
    for a in sorted(g):
        print(f"{a:12s} -> {', '.join(sorted(g[a])) or '(nothing)'}")
    bad = cycles(g)
    print("cycles:", bad or "none")
    sys.exit(1 if bad else 0)
