"""Training across slow links: torchft's DiLoCo (and Streaming DiLoCo) and
LocalSGD on any process group, their outer averages run by ringlet's engine
on flat buckets, exact or in 8 or 4 bits, hidden behind the next inner steps,
and finished among the survivors when a replica is lost.

Example:
  >>> from ringlet.algorithms import DiLoCo
  >>> with DiLoCo([model], inner, outer, sync_every=20, should_quantize=True):
  ...     train(model, inner)
"""

from .diloco import DiLoCo
from .local_sgd import LocalSGD

__all__ = ["DiLoCo", "LocalSGD"]
