"""Bagua's communication algorithms (``bagua.torch_api.algorithms``) on
ringlet: pass one to ``model.with_bagua(optimizers, algorithm)`` (or
``with_ringlet``).

* :mod:`.gradient_allreduce`: exact gradient averaging.
* :mod:`.bytegrad`: gradients averaged through 8-bit compression.
* :mod:`.decentralized`: gossip SGD (``all``, ``shift_one``) and its
  low-precision ring variant.
* :mod:`.q_adam`: Adam with 8-bit compressed momentum after a warm-up.
* :mod:`.async_model_average`: weights averaged by a background thread.
* :mod:`.diloco`: DiLoCo / Streaming DiLoCo (ringlet's addition), through
  :class:`ringlet.algorithms.DiLoCo`.
* :mod:`.base`: :class:`Algorithm` and :class:`AlgorithmImpl`, to write new
  ones; :data:`GlobalAlgorithmRegistry` maps names to algorithms
  (:meth:`Algorithm.init`).

Example:
  >>> from ringlet.bagua.algorithms import Algorithm
  >>> model.with_ringlet([opt], Algorithm.init("bytegrad", hierarchical=False))
"""

from . import async_model_average, bytegrad, decentralized, diloco, gradient_allreduce, q_adam
from .base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry

__all__ = [
    "Algorithm",
    "AlgorithmImpl",
    "GlobalAlgorithmRegistry",
    "async_model_average",
    "bytegrad",
    "decentralized",
    "diloco",
    "gradient_allreduce",
    "q_adam",
]

GlobalAlgorithmRegistry.register(
    "gradient_allreduce", gradient_allreduce.GradientAllReduceAlgorithm,
    description="Gradient AllReduce Algorithm",
)
GlobalAlgorithmRegistry.register(
    "bytegrad", bytegrad.ByteGradAlgorithm, description="ByteGrad Algorithm"
)
GlobalAlgorithmRegistry.register(
    "decentralized", decentralized.DecentralizedAlgorithm,
    description="Decentralized SGD Algorithm",
)
GlobalAlgorithmRegistry.register(
    "low_precision_decentralized", decentralized.LowPrecisionDecentralizedAlgorithm,
    description="Low Precision Decentralized SGD Algorithm",
)
GlobalAlgorithmRegistry.register("qadam", q_adam.QAdamAlgorithm, description="QAdam Algorithm")
GlobalAlgorithmRegistry.register(
    "async", async_model_average.AsyncModelAverageAlgorithm,
    description="Asynchronous Model Average Algorithm",
)
GlobalAlgorithmRegistry.register(
    "diloco", diloco.DiLoCoAlgorithm, description="DiLoCo Algorithm (ringlet)"
)
