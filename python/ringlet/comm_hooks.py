"""``ringlet.comm_hooks``: kept as an import path; the code is :mod:`ringlet.bagua.comm_hooks`.

This module is that one (``ringlet.comm_hooks is ringlet.bagua.comm_hooks``), so its private
names and any attribute set on it are shared.
"""

import sys

from .bagua import comm_hooks as _home
from .bagua.comm_hooks import *  # noqa: F403  (its names, for type checkers)

sys.modules[__name__] = _home
