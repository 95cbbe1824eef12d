"""``ringlet.sharding``: kept as an import path; the code is :mod:`ringlet.xla.sharding`.

This module is that one (``ringlet.sharding is ringlet.xla.sharding``), so its private
names and any attribute set on it are shared.
"""

import sys

from .xla import sharding as _home
from .xla.sharding import *  # noqa: F403  (its names, for type checkers)

sys.modules[__name__] = _home
