"""Bagua's ``bagua.torch_api.contrib.utils``: key-value stores behind the
cache loader (:mod:`.store`: ``Store``, ``ClusterStore`` and ringlet's
in-process ``LocalStore``; :mod:`.redis_store`: ``RedisStore``, which needs
the ``redis`` package)."""

from . import redis_store, store

__all__ = ["redis_store", "store"]
