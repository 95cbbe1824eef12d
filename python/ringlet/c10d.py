"""``ringlet.c10d``: kept as an import path; the code is :mod:`ringlet.distributed.c10d`.

This module is that one (``ringlet.c10d is ringlet.distributed.c10d``), so its private
names and any attribute set on it are shared.
"""

import sys

from .distributed import c10d as _home
from .distributed.c10d import *  # noqa: F403  (its names, for type checkers)

sys.modules[__name__] = _home
