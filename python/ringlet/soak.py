"""``ringlet.soak``: kept as an import path and as ``python -m ringlet.soak``; the
code is :mod:`ringlet.bench.soak` (``python -m ringlet.bench.soak``).
"""

import sys

from .bench import soak as _home
from .bench.soak import *  # noqa: F403  (its names, for type checkers)

if __name__ == "__main__":
    sys.exit(_home.main())
sys.modules[__name__] = _home
