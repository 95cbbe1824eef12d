"""Bagua's cache loader (``bagua.torch_api.contrib.CacheLoader``): values
computed by an expensive function, cached by key.

Bagua keeps the cache in Redis; ringlet adds an in-process backend,
``backend="local"`` (the default here; Bagua's default is ``"redis"``): one
:class:`~.utils.store.LocalStore`, a dictionary, shared by every loader of
the process as a Redis server is shared by Bagua's, with the same API and
semantics within the process (loaders with the same ``dataset_name`` share
entries, ``num_keys()`` counts every loader's keys, ``store.clear()`` empties
it); nothing is shared between processes (each rank, and each
``DataLoader`` worker process, caches what it loads). ``backend="redis"`` uses
:class:`~.utils.redis_store.RedisStore` over running Redis servers
(``hosts=...``) and needs the ``redis`` package; without it the loader
raises ``ImportError`` saying so.

Values are pickled, keyed ``"{dataset_name}_{key}"``, and written to the
store in batches of ``writer_buffer_size`` (a value still waiting in the
batch is found there, so it is not computed again).

Example:
  >>> loader = CacheLoader(backend="local", dataset_name="train")
  >>> loader.get(7, lambda k: expensive(k))      # computed
  >>> loader.get(7, lambda k: expensive(k))      # from the cache
"""

from __future__ import annotations

import pickle
import threading
from typing import Any, Callable

from .utils.store import LocalStore, Store

__all__ = ["CacheLoader"]

_BACKENDS = ("local", "redis")
_local: LocalStore | None = None
_local_lock = threading.Lock()


def _local_store() -> LocalStore:
    """The process's store for ``backend="local"``."""
    global _local
    with _local_lock:
        if _local is None:
            _local = LocalStore()
        return _local


def _make_store(backend: str, kwargs: dict[str, Any]) -> Store:
    if backend == "local":
        if kwargs:
            raise TypeError(
                f"CacheLoader(backend='local') takes no store arguments, got {sorted(kwargs)}"
            )
        return _local_store()
    if backend == "redis":
        from .utils.redis_store import RedisStore

        return RedisStore(**kwargs)
    raise ValueError(f"Invalid backend {backend!r}: ringlet supports {', '.join(_BACKENDS)}")


class CacheLoader:
    """Caches ``load_fn(key)`` by key (Bagua's ``CacheLoader``).

    Args:
      backend (str): ``"local"`` (the process's in-process store, the default) or ``"redis"``
        (needs the ``redis`` package and ``hosts=`` of running servers).
      dataset_name (str): Prefix of the keys; loaders with the same name on
        the same store share entries. Default: ``""``.
      writer_buffer_size (int): Values gathered before one write to the
        store. Default: 1.
      **kwargs: The Redis store's arguments (``hosts``, ``cluster_mode``,
        ``capacity_per_node``).

    Raises:
      ValueError: An unknown backend.
      ImportError: ``"redis"`` without the ``redis`` package.

    Example:
      >>> loader = CacheLoader(dataset_name="tokens")
      >>> loader.get("a", str.upper), loader.num_keys()
      ('A', 1)
    """

    def __init__(
        self,
        backend: str = "local",
        dataset_name: str = "",
        writer_buffer_size: int = 1,
        **kwargs: Any,
    ) -> None:
        self.backend = backend
        self.dataset_name = dataset_name
        self.store = _make_store(backend, kwargs)
        self.fetcher = _BatchFetcher(self.store, writer_buffer_size)

    def get(self, key: Any, load_fn: Callable[[Any], Any]) -> Any:
        """Returns the cached value of ``key``, computing and caching
        ``load_fn(key)`` where there is none.

        Args:
          key: The key (formatted into ``"{dataset_name}_{key}"``).
          load_fn (Callable): ``key -> value``; the value must pickle.

        Returns:
          The value.
        """
        cache_key = f"{self.dataset_name}_{key}"
        value = self.fetcher.read(cache_key)
        if value is None:
            value = load_fn(key)
            self.fetcher.write(cache_key, value)
        return value

    def num_keys(self) -> int:
        """Returns the number of keys in the store (written ones).

        Returns:
          int: The count.
        """
        return self.store.num_keys()


class _BatchFetcher:
    """Reads from the store; buffers writes (Bagua's ``BatchFetcher``)."""

    def __init__(self, store: Store, writer_buffer_size: int) -> None:
        self.store = store
        self.writer_buffer_size = max(1, int(writer_buffer_size))
        self.write_map: dict[str, bytes] = {}
        self.write_cnt = 0
        self.read_cnt = 0

    def read(self, key: str) -> Any:
        self.read_cnt += 1
        raw = self.write_map.get(key)
        if raw is None:
            try:
                raw = self.store.get(key)
            except Exception:
                return None
        if self.read_cnt % 1000 == 0 and self.write_map:
            self.flush()
        return None if raw is None else pickle.loads(raw)

    def write(self, key: str, value: Any) -> None:
        self.write_cnt += 1
        self.write_map[key] = pickle.dumps(value)
        if self.write_cnt % self.writer_buffer_size == 0:
            self.flush()

    def flush(self) -> None:
        try:
            self.store.mset(dict(self.write_map))
        except Exception:
            return  # kept for the next flush, as Bagua
        self.write_map.clear()
