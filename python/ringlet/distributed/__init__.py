"""The torch.distributed door: the ``"ringlet"`` backend of ``init_process_group``.

* :mod:`ringlet.distributed.c10d`: the Python ``ProcessGroup``
  (:class:`ProcessGroupRinglet`), its ``Work``, the backend's registration,
  and which door a group takes (:func:`backend_kind`).
* ``ringlet.distributed._native``: builds and loads the native C++
  ``c10d::Backend`` (``csrc/``) that wraps the Python group on the hot path.
* :mod:`ringlet.distributed.hooks`: torch DDP communication hooks that
  send fewer bytes (ByteGrad's 8-bit compressed all-reduce with error
  feedback).
* :mod:`ringlet.distributed.torchft`: torchft's fault-tolerant training on
  ringlet (needs the optional ``torchft``).

Example:
    >>> import torch.distributed as dist
    >>> dist.init_process_group("ringlet")      # under torchrun; no import ringlet needed
    >>> import ringlet.distributed
    >>> ringlet.distributed.backend_kind()
    'native'
"""

from . import c10d, hooks
from .c10d import BACKEND_NAME, ProcessGroupRinglet, Work, backend_kind, python_group, register

__all__ = ["BACKEND_NAME", "ProcessGroupRinglet", "Work", "backend_kind", "c10d", "hooks",
           "python_group", "register"]
