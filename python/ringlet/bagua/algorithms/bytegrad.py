"""ByteGrad: gradients averaged through 8-bit compression (Bagua's
``ByteGradAlgorithm``): each bucket is cut into one chunk per rank, every
chunk quantized to one byte per element between its min and max
(MinMaxUInt8), scattered to its owner, averaged there, quantized again and
gathered: a quarter of float32's bytes on the wire. ``hierarchical=True``
(the default) sums exactly within each host over shared memory and
compresses only between hosts, where bytes cost; on one host it is an exact
all-reduce. ``error_feedback=True`` (ringlet's addition) keeps what each
quantization lost and adds it back at the next step.

Example:
  >>> model = model.with_bagua([opt], ByteGradAlgorithm(error_feedback=True))
"""

from __future__ import annotations

from typing import Any

from ..bucket import BaguaBucket
from ..communication import BaguaProcessGroup
from .base import Algorithm, AlgorithmImpl, aligned_buckets

__all__ = ["ByteGradAlgorithm", "ByteGradAlgorithmImpl"]


class ByteGradAlgorithmImpl(AlgorithmImpl):
    """The implementation of :class:`ByteGradAlgorithm`.

    Args:
      process_group (BaguaProcessGroup): The group to work on.
      hierarchical (bool): Exact within hosts, compressed between them.
        Default: True.
      average (bool): Average (True) or sum. Default: True.
      error_feedback (bool): Carry quantization residuals to the next step.
        Default: False.
    """

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = True,
                 average: bool = True, error_feedback: bool = False) -> None:
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.average = average
        self.error_feedback = error_feedback

    def tensors_to_buckets(self, tensors: list[list[Any]], do_flatten: bool) -> list[BaguaBucket]:
        return aligned_buckets(tensors, do_flatten, len(self.process_group.ranks))

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical,
            average=self.average,
            scattergather=True,
            compression="MinMaxUInt8",
            group=self.process_group,
            error_feedback=self.error_feedback,
        )


class ByteGradAlgorithm(Algorithm):
    """Averages gradients through 8-bit MinMaxUInt8 compression.

    Args:
      hierarchical (bool): Exact within each host, compressed between hosts.
        Default: True.
      average (bool): Average (True) or sum the gradients. Default: True.
      error_feedback (bool): Add each quantization's residual to the next
        step's gradient (ringlet's addition; Bagua has none). Default: False.

    Example:
      >>> model.with_bagua([opt], ByteGradAlgorithm(hierarchical=False))
    """

    def __init__(self, hierarchical: bool = True, average: bool = True,
                 error_feedback: bool = False) -> None:
        self.hierarchical = hierarchical
        self.average = average
        self.error_feedback = error_feedback

    def reify(self, process_group: BaguaProcessGroup) -> ByteGradAlgorithmImpl:
        return ByteGradAlgorithmImpl(process_group, hierarchical=self.hierarchical,
                                     average=self.average, error_feedback=self.error_feedback)
