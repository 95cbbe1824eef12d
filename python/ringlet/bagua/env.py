"""Bagua's ``bagua.torch_api.env``: who this process is in the job.

After :func:`ringlet.init` (or Bagua's ``init_process_group``) the answers
come from ringlet's own view of the job (hosts told apart by their
identity, or ``RINGLET_HOST_ID``); before it, from the launcher's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``NODE_RANK``), as Bagua reads them.

Example:
  >>> import ringlet.bagua.compat as bagua
  >>> bagua.init_process_group()          # under torchrun
  >>> bagua.get_rank(), bagua.get_world_size(), bagua.get_local_rank()
  (1, 4, 1)
"""

from __future__ import annotations

import os

from ..core import groups

__all__ = [
    "get_default_bucket_size",
    "get_local_rank",
    "get_local_size",
    "get_node_rank",
    "get_rank",
    "get_world_size",
]


def _env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw not in (None, "") else default


def get_world_size() -> int:
    """Returns the number of processes in the job.

    Returns:
      int: ``WORLD_SIZE`` before initialisation, else the job's size.

    Example:
      >>> bagua.get_world_size()
      4
    """
    if groups.is_initialized():
        return groups.world_size()
    return _env("WORLD_SIZE", 1)


def get_rank() -> int:
    """Returns this process's rank in the job.

    Returns:
      int: ``RANK`` before initialisation, else the job rank.

    Example:
      >>> bagua.get_rank()
      1
    """
    if groups.is_initialized():
        return groups.get_ordinal()
    return _env("RANK", 0)


def get_local_rank() -> int:
    """Returns this process's index among the processes of its host.

    Returns:
      int: ``LOCAL_RANK`` before initialisation, else the position among
      the job's ranks on this host.

    Example:
      >>> bagua.get_local_rank()
      1
    """
    if groups.is_initialized():
        return groups.get_local_ordinal()
    return _env("LOCAL_RANK", 0)


def get_local_size() -> int:
    """Returns the number of processes on this host.

    Returns:
      int: ``LOCAL_WORLD_SIZE`` before initialisation, else the job's ranks
      on this host.

    Example:
      >>> bagua.get_local_size()
      2
    """
    if groups.is_initialized():
        return groups.local_world_size()
    return _env("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """Returns the index of this process's host (hosts in order of their
    lowest rank).

    Returns:
      int: ``NODE_RANK`` (or ``RANK // LOCAL_WORLD_SIZE``) before
      initialisation, else this host's position in :func:`ringlet.host_layout`.

    Example:
      >>> bagua.get_node_rank()
      0
    """
    if groups.is_initialized():
        me = groups.get_ordinal()
        return next(i for i, g in enumerate(groups.host_layout()) if me in g)
    if "NODE_RANK" in os.environ:
        return _env("NODE_RANK", 0)
    return get_rank() // max(get_local_size(), 1)


def get_default_bucket_size() -> int:
    """Returns the bucket size in bytes algorithms cut gradients into
    (``BAGUA_DEFAULT_BUCKET_SIZE``, default 10 MiB, as Bagua).

    Returns:
      int: Bytes.

    Example:
      >>> bagua.get_default_bucket_size()
      10485760
    """
    return _env("BAGUA_DEFAULT_BUCKET_SIZE", 10 * 1024**2)
