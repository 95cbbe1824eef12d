"""``ringlet.sharded_tensor``: kept as an import path; the code is
:mod:`ringlet.xla.sharded_tensor`.

This module is that one (``ringlet.sharded_tensor is ringlet.xla.sharded_tensor``), so its private
names and any attribute set on it are shared.
"""

import sys

from .xla import sharded_tensor as _home
from .xla.sharded_tensor import *  # noqa: F403  (its names, for type checkers)

sys.modules[__name__] = _home
