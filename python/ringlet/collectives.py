"""``ringlet.collectives``: kept as an import path; the code is :mod:`ringlet.xla.xla_model`.

This module is that one (``ringlet.collectives is ringlet.xla.xla_model``), so its private
names and any attribute set on it are shared.
"""

import sys

from .xla import xla_model as _home
from .xla.xla_model import *  # noqa: F403  (its names, for type checkers)

sys.modules[__name__] = _home
