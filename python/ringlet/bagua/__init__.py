"""The Bagua door: Bagua's look-alike, built on ringlet's own tensor API and
buckets (:mod:`ringlet.parallel`).

* :mod:`ringlet.bagua.algorithms`: Bagua's communication algorithms
  (gradient all-reduce, ByteGrad, decentralized and low-precision
  decentralized SGD, QAdam, asynchronous averaging) and the extension API;
  ``model.with_ringlet(optimizers, algorithm)`` (``with_bagua`` with
  :mod:`ringlet.bagua.compat`) trains with one (:mod:`.data_parallel`, also
  behind ``ringlet.DistributedDataParallel(model, algorithm=...)``), over
  :mod:`.communication`'s process groups and :mod:`.bucket`'s operations.
* :mod:`ringlet.bagua.compat`: Bagua's own names (``bagua_`` tensor
  methods, ``with_bagua``, ``bagua.torch_api``'s functions and submodules);
  installed only when imported.
* :mod:`.env`, :mod:`.utils`: Bagua's ``env`` and ``utils``.

Importing it installs the ``torch.Tensor.ringlet_*`` methods
(:mod:`ringlet.parallel.tensor`). ringlet's own tensor API, DDP and DDP hooks
were here before: ``ringlet.bagua.tensor``, ``ringlet.bagua.ddp``,
``ringlet.bagua.comm_hooks`` and ``ringlet.bagua.DistributedDataParallel`` are
deprecated paths of their :mod:`ringlet.parallel` homes (:mod:`ringlet._legacy`).

Example:
  >>> import torch, ringlet.bagua
  >>> t = torch.zeros(3).ensure_ringlet_tensor("t")
  >>> t.is_ringlet_tensor()
  True
"""

from typing import Any

from .. import _legacy
from . import (
    algorithms,
    bucket,
    communication,
    data_parallel,
    env,
    utils,
)

__all__ = [
    "algorithms",
    "bucket",
    "communication",
    "data_parallel",
    "env",
    "utils",
]


def __getattr__(name: str) -> Any:
    """``ringlet.bagua.tensor``, ``.ddp``, ``.comm_hooks`` and
    ``.DistributedDataParallel``, now in :mod:`ringlet.parallel` (deprecated:
    see :mod:`ringlet._legacy`)."""
    return _legacy.attribute(__name__, name)
