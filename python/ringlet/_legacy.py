"""The package's earlier import paths, kept working for one more release.

Before the door sub-packages, ringlet's modules lived at the package top
(``ringlet.c10d``, ``ringlet.sharding``, ``ringlet.tensor``, ...), and ringlet's
own tensor API, DDP and DDP hooks in the Bagua door (``ringlet.bagua.tensor``,
``ringlet.bagua.ddp``, ``ringlet.bagua.comm_hooks``; now :mod:`ringlet.parallel`).
Those paths are not files any more: :data:`LEGACY_PATHS` maps each to its home, and a
``sys.meta_path`` finder (installed by ``import ringlet``) answers an import of
an old path with the home module itself (``import ringlet.c10d`` binds
:mod:`ringlet.distributed.c10d`; ``ringlet.c10d is ringlet.distributed.c10d``,
so private names and attributes set on it are shared), a sub-module of an old
package path with the home's sub-module (``ringlet.compat.bagua.algorithms`` is
``ringlet.bagua.compat.algorithms``), and warns once per old path with a
``DeprecationWarning`` that names the new path, attributed to the importing
line. ``python -m ringlet.soak`` runs ``python -m ringlet.bench.soak`` the same
way. The old paths go away in ringlet :data:`REMOVED_IN`.

Example:
  >>> import ringlet.c10d          # DeprecationWarning: ringlet.c10d is deprecated: ...
  >>> import ringlet.distributed.c10d
  >>> ringlet.c10d is ringlet.distributed.c10d
  True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any, Optional

# Old import path -> the module's home since the door sub-packages.
LEGACY_PATHS: dict[str, str] = {
    "ringlet._engine": "ringlet.core.engine",
    "ringlet._native": "ringlet.distributed._native",
    "ringlet.c10d": "ringlet.distributed.c10d",
    "ringlet.bagua.comm_hooks": "ringlet.parallel.comm_hooks",
    "ringlet.bagua.ddp": "ringlet.parallel.ddp",
    "ringlet.bagua.tensor": "ringlet.parallel.tensor",
    "ringlet.collectives": "ringlet.xla.xla_model",
    "ringlet.comm_hooks": "ringlet.parallel.comm_hooks",
    "ringlet.compat.bagua": "ringlet.bagua.compat",
    "ringlet.ddp": "ringlet.parallel.ddp",
    "ringlet.runtime": "ringlet.core.groups",
    "ringlet.sharded_tensor": "ringlet.xla.sharded_tensor",
    "ringlet.sharding": "ringlet.xla.sharding",
    "ringlet.soak": "ringlet.bench.soak",
    "ringlet.tensor": "ringlet.parallel.tensor",
    "ringlet.torchft": "ringlet.distributed.torchft",
}

# Old place of a name that is not a module -> its home (``package.name``), for the
# packages' module ``__getattr__`` (see :func:`attribute`).
LEGACY_NAMES: dict[str, str] = {
    "ringlet.bagua.DistributedDataParallel": "ringlet.parallel.DistributedDataParallel",
}

#: The release in which the old paths go away.
REMOVED_IN = "0.3"

# Old paths already warned about, with the (file, line) that imported them.
_warned: dict[str, tuple[str, int]] = {}

# Old path -> its home module's own __spec__, between create_module and exec_module.
_home_specs: dict[str, Any] = {}

# Frames between the importing line and the warning: the import machinery,
# importlib.import_module, this module and the package's module __getattr__.
_SKIPPED_FILES = frozenset(
    os.path.normcase(os.path.abspath(f))
    for f in (__file__, os.path.join(os.path.dirname(__file__), "__init__.py"),
              os.path.join(os.path.dirname(__file__), "compat", "__init__.py"),
              os.path.join(os.path.dirname(__file__), "bagua", "__init__.py"),
              importlib.__file__ or "")
)


def new_path(old: str) -> Optional[str]:
    """The home of an old import path, or ``None`` when ``old`` is not one.

    Args:
      old (str): A dotted module path (``"ringlet.c10d"``, or a sub-module of an
        old package path, ``"ringlet.compat.bagua.algorithms"``).

    Returns:
      Optional[str]: The module's path today (``"ringlet.distributed.c10d"``,
      ``"ringlet.bagua.compat.algorithms"``), or ``None``.

    Example:
      >>> new_path("ringlet.compat.bagua.algorithms.q_adam")
      'ringlet.bagua.compat.algorithms.q_adam'
      >>> new_path("ringlet.xla") is None
      True
    """
    if old in LEGACY_PATHS:
        return LEGACY_PATHS[old]
    for prefix, home in LEGACY_PATHS.items():
        if old.startswith(prefix + "."):
            return home + old[len(prefix):]
    return None


def message(old: str) -> str:
    """The deprecation message for an old import path.

    Args:
      old (str): An old path (a key of :data:`LEGACY_PATHS` or a sub-module of one,
        or a key of :data:`LEGACY_NAMES`).

    Returns:
      str: ``"<old> is deprecated: import <new> (the old path goes away in ringlet 0.3)"``.

    Example:
      >>> message("ringlet.tensor")
      'ringlet.tensor is deprecated: import ringlet.parallel.tensor (the old path goes away in ringlet 0.3)'
    """  # noqa: E501
    return (f"{old} is deprecated: import {new_path(old) or LEGACY_NAMES.get(old)} "
            f"(the old path goes away in ringlet {REMOVED_IN})")


def _is_bootstrap(filename: str) -> bool:
    # The frames the warnings module itself steps over without counting them.
    return "importlib" in filename and "_bootstrap" in filename


def _importer() -> tuple[int, str, int]:
    """``(stacklevel, file, line)`` of the first frame outside the import
    machinery, for a ``warnings.warn`` called by this function's caller."""
    frame = sys._getframe(2)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not _is_bootstrap(name):
            level += 1
            if os.path.normcase(os.path.abspath(name)) not in _SKIPPED_FILES:
                return level, name, frame.f_lineno
        frame = frame.f_back
    return level, "", 0


def _warn(old: str) -> None:
    """Warns (once per old path) that ``old`` is deprecated, at the importing line.

    A sub-module imported by the same statement as its old package
    (``import ringlet.compat.bagua.algorithms``) adds no second warning.
    """
    if old in _warned:
        return
    level, filename, line = _importer()
    parent = old.rpartition(".")[0]
    while parent:
        if _warned.get(parent) == (filename, line):
            _warned[old] = (filename, line)
            return
        parent = parent.rpartition(".")[0]
    warnings.warn(message(old), DeprecationWarning, stacklevel=level)
    _warned[old] = (filename, line)


class _LegacyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old import path and loads it as its home module (the same
    object, under both names in ``sys.modules``), warning once."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None,
        target: Optional[types.ModuleType] = None,
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if new_path(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(new_path(spec.name) or "")
        _warn(spec.name)
        # The import system sets __spec__ on the module it is given: keep the home's.
        _home_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The home module is already executed: only its own __spec__ is put back.
        module.__spec__ = _home_specs.pop(module.__spec__.name)

    def get_code(self, fullname: str) -> types.CodeType:
        """The code ``python -m <old path>`` runs: ``python -m <new path>``, warning."""
        source = ("from ringlet import _legacy\n"
                  f"_legacy._run_as_main({fullname!r})\n")
        return compile(source, f"<python -m {fullname}>", "exec")


def _run_as_main(old: str) -> None:
    """``python -m <old>``: warns, then runs ``python -m <new>``."""
    import runpy

    new = new_path(old)
    warnings.warn(f"python -m {old} is deprecated: run python -m {new} (the old path goes "
                  f"away in ringlet {REMOVED_IN})", DeprecationWarning, stacklevel=2)
    _warned[old] = ("", 0)
    runpy.run_module(new or "", run_name="__main__", alter_sys=True)


def attribute(package: str, name: str) -> Any:
    """A package's module ``__getattr__`` for its old sub-module names:
    ``ringlet.c10d`` without ``import ringlet.c10d`` imports the old path (warning);
    and for the names it held before (:data:`LEGACY_NAMES`,
    ``ringlet.bagua.DistributedDataParallel``): their home, warning once.

    Args:
      package (str): The package (``"ringlet"``, ``"ringlet.compat"``, ``"ringlet.bagua"``).
      name (str): The attribute asked for.

    Returns:
      Any: The home module of ``package.name``, or the name's home object.

    Raises:
      AttributeError: ``package.name`` is not an old path (or its home cannot be
        imported, e.g. ``ringlet.torchft`` without torchft installed).

    Example:
      >>> attribute("ringlet", "c10d") is importlib.import_module("ringlet.distributed.c10d")
      True
    """
    old = f"{package}.{name}"
    if old in LEGACY_NAMES:
        home, _, attr = LEGACY_NAMES[old].rpartition(".")
        value = getattr(importlib.import_module(home), attr)
        _warn(old)
        return value
    if old not in LEGACY_PATHS:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    try:
        return importlib.import_module(old)
    except ImportError as e:
        raise AttributeError(f"module {package!r} has no attribute {name!r} ({e})") from e


def install() -> None:
    """Puts the old paths' finder on ``sys.meta_path`` (once; ``import ringlet`` does).

    Example:
      >>> install()   # again: nothing changes
    """
    if not any(isinstance(f, _LegacyFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LegacyFinder())
