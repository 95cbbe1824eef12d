"""Walking nested state dicts (dicts and lists): leaves, the common part, merging back.

A save splits a state dict into its sharded leaves and the common tree (the rest,
with holes where sharded values were); a load merges the common tree stored by
rank 0 with the tree of values it loaded (``Loaded`` leaves, ``ABSENT`` elsewhere).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import _encoding as enc
from .mapping import LocalNonpersistentObject, ShardedBase, ShardedTensorFactory

__all__ = [
    "ABSENT",
    "Loaded",
    "common_tree",
    "copy_tree",
    "extract_factories",
    "leaves",
    "loaded_tree",
    "merge",
    "path_str",
]


def copy_tree(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: copy_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [copy_tree(v) for v in tree]
    return tree


def leaves(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from leaves(v, (*path, i))
    else:
        yield path, tree


def path_str(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def extract_factories(tree: Any) -> Any:
    """Sub-tree holding only the factories; list positions become int dict keys."""
    if isinstance(tree, ShardedTensorFactory):
        return tree
    if isinstance(tree, (dict, list)):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        out = {}
        for k, v in items:
            sub = extract_factories(v)
            if sub is not None:
                out[k] = sub
        return out or None
    return None


def common_tree(tree: Any) -> Any:
    """The tree without sharded and local-only values (dict entries dropped, list slots as "
    "holes)."""

    def skip(value: Any) -> bool:
        return isinstance(value, (ShardedBase, LocalNonpersistentObject))

    if isinstance(tree, dict):
        return {k: common_tree(v) for k, v in tree.items() if not skip(v)}
    if isinstance(tree, list):
        return [enc.HOLE if skip(v) else common_tree(v) for v in tree]
    return tree


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()


@dataclass
class Loaded:
    value: Any


def merge(common: Any, loaded: Any) -> Any:
    """Combine the stored common tree with the tree of loaded values (``Loaded`` leaves)."""
    if isinstance(loaded, Loaded):
        return loaded.value
    if isinstance(loaded, dict):
        base = common if isinstance(common, dict) else {}
        out = {}
        for k in itertools.chain(loaded, (k for k in base if k not in loaded)):
            value = merge(base.get(k, ABSENT), loaded.get(k, ABSENT))
            if value is not ABSENT:
                out[k] = value
        return out
    if isinstance(loaded, list):
        base = common if isinstance(common, list) else []
        n = max(len(base), len(loaded))
        merged = [
            merge(base[i] if i < len(base) else ABSENT, loaded[i] if i < len(loaded) else ABSENT)
            for i in range(n)
        ]
        return [None if v is ABSENT else v for v in merged]
    # Nothing was loaded here: the stored common value, if any.
    if common is enc.HOLE or common is ABSENT:
        return ABSENT
    if isinstance(common, dict):
        return {
            k: v for k, v in ((k, merge(v, ABSENT)) for k, v in common.items()) if v is not ABSENT
        }
    if isinstance(common, list):
        return [None if v is ABSENT else v for v in (merge(c, ABSENT) for c in common)]
    return common


def loaded_tree(tree: Any, values: dict[int, Any]) -> Any:
    """The request tree with loaded leaves wrapped in ``Loaded``, everything else ``ABSENT``."""
    if isinstance(tree, dict):
        return {k: loaded_tree(v, values) for k, v in tree.items()}
    if isinstance(tree, list):
        return [loaded_tree(v, values) for v in tree]
    if id(tree) in values:
        return Loaded(values[id(tree)])
    return ABSENT
