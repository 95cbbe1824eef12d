"""``ringlet._native``: kept as an import path; the code is :mod:`ringlet.distributed._native`.

This module is that one (``ringlet._native is ringlet.distributed._native``), so its private
names and any attribute set on it are shared.
"""

import sys

from .distributed import _native as _home

sys.modules[__name__] = _home
