"""``ringlet.tensor``: kept as an import path; the code is :mod:`ringlet.bagua.tensor`.

This module is that one (``ringlet.tensor is ringlet.bagua.tensor``), so its private
names and any attribute set on it are shared.
"""

import sys

from .bagua import tensor as _home
from .bagua.tensor import *  # noqa: F403  (its names, for type checkers)

sys.modules[__name__] = _home
