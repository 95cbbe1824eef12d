"""``ringlet.torchft``: kept as an import path; the code is :mod:`ringlet.distributed.torchft`.

This module is that one (``ringlet.torchft is ringlet.distributed.torchft``), so its private
names and any attribute set on it are shared.
"""

import sys

from .distributed import torchft as _home
from .distributed.torchft import *  # noqa: F403  (its names, for type checkers)

sys.modules[__name__] = _home
