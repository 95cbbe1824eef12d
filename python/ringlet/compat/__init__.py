"""Deprecated: ``ringlet.compat.bagua`` is :mod:`ringlet.bagua.compat`.

The old path still imports (through :mod:`ringlet._legacy`, with a
``DeprecationWarning``) until ringlet 0.3; this package holds nothing else.
"""

from typing import Any

from .. import _legacy


def __getattr__(name: str) -> Any:
    """``ringlet.compat.bagua`` as an attribute (deprecated)."""
    return _legacy.attribute(__name__, name)
