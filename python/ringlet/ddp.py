"""``ringlet.ddp``: kept as an import path; the code is :mod:`ringlet.bagua.ddp`.

This module is that one (``ringlet.ddp is ringlet.bagua.ddp``), so its private
names and any attribute set on it are shared.
"""

import sys

from .bagua import ddp as _home
from .bagua.ddp import *  # noqa: F403  (its names, for type checkers)

sys.modules[__name__] = _home
