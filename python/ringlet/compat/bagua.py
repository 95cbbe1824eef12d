"""``ringlet.compat.bagua``: kept as an import path; the code is :mod:`ringlet.bagua.compat`.

Importing either installs Bagua's tensor API names on ``torch.Tensor``. This
module is that one (``ringlet.compat.bagua is ringlet.bagua.compat``).
"""

import sys

from ..bagua import compat as _home
from ..bagua.compat import *  # noqa: F403  (its names, for type checkers)

sys.modules[__name__] = _home
