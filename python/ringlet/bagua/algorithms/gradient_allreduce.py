"""Gradient all-reduce: every rank averages (or sums) the gradients, in
buckets, while backward runs (Bagua's ``GradientAllReduceAlgorithm``).

Example:
  >>> model = model.with_bagua([opt], GradientAllReduceAlgorithm())
"""

from __future__ import annotations

from typing import Any

from ..bucket import BaguaBucket
from ..communication import BaguaProcessGroup
from .base import Algorithm, AlgorithmImpl

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]


class GradientAllReduceAlgorithmImpl(AlgorithmImpl):
    """The implementation of :class:`GradientAllReduceAlgorithm`.

    Args:
      process_group (BaguaProcessGroup): The group to work on.
      hierarchical (bool): Sum within each host first (shared memory), then
        between hosts. Default: False.
      average (bool): Average (True) or sum. Default: True.
    """

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = False,
                 average: bool = True) -> None:
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.average = average

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=self.average, group=self.process_group
        )


class GradientAllReduceAlgorithm(Algorithm):
    """Averages gradients over the ranks, exactly.

    Args:
      hierarchical (bool): Sum within each host first, then between hosts.
        Default: False.
      average (bool): Average (True) or sum the gradients. Default: True.

    Example:
      >>> model.with_bagua([opt], GradientAllReduceAlgorithm(hierarchical=True))
    """

    def __init__(self, hierarchical: bool = False, average: bool = True) -> None:
        self.hierarchical = hierarchical
        self.average = average

    def reify(self, process_group: BaguaProcessGroup) -> GradientAllReduceAlgorithmImpl:
        return GradientAllReduceAlgorithmImpl(process_group, hierarchical=self.hierarchical,
                                              average=self.average)
