"""Bagua's key-value store interface (``bagua.torch_api.contrib.utils.store``)
and ringlet's in-process store.

* :class:`Store`: the interface (``set``, ``get``, ``mset``, ``mget``,
  ``num_keys``, ``clear``, ``status``, ``shutdown``).
* :class:`ClusterStore`: entries sharded over several stores by a hash of
  the key.
* :class:`LocalStore`: ringlet's: a dictionary in this process, behind a
  lock (what ``CacheLoader(backend="local")`` uses). It is not shared with
  other processes: each rank, and each ``DataLoader`` worker process, caches
  what it loads itself.

Example:
  >>> s = LocalStore()
  >>> s.mset({"a": b"1", "b": b"2"})
  >>> s.mget(["a", "c"])
  [b'1', None]
"""

from __future__ import annotations

import hashlib
import threading
from typing import Optional, Union

__all__ = ["ClusterStore", "LocalStore", "Store"]

Value = Union[str, bytes]


class Store:
    """The interface of a key-value store (Bagua's ``Store``); its methods
    do nothing here.

    Example:
      >>> class Mine(Store):
      ...     def get(self, key): ...
    """

    def set(self, key: str, value: Value) -> None:
        """Sets a key-value pair.

        Args:
          key (str): The key.
          value (str or bytes): The value.
        """

    def get(self, key: str) -> Optional[Value]:
        """Returns the value of ``key``, or None where it is not set.

        Args:
          key (str): The key.

        Returns:
          str or bytes or None: The value.
        """
        return None

    def num_keys(self) -> int:
        """Returns the number of keys.

        Returns:
          int: The count.
        """
        return 0

    def clear(self) -> None:
        """Deletes every key."""

    def mset(self, dictionary: dict[str, Value]) -> None:
        """Sets every pair of ``dictionary``.

        Args:
          dictionary (dict): Keys to values.
        """

    def mget(self, keys: list[str]) -> list[Optional[Value]]:
        """Returns the values of ``keys``, in order (None where not set).

        Args:
          keys (list[str]): The keys.

        Returns:
          list: The values.
        """
        return [None for _ in keys]

    def status(self) -> bool:
        """Returns whether the store is alive.

        Returns:
          bool: True if alive.
        """
        return True

    def shutdown(self) -> None:
        """Shuts down the store instances this store started."""


class LocalStore(Store):
    """ringlet's in-process store: a dictionary behind a lock, shared by the
    threads of one process and by nothing else.

    Example:
      >>> s = LocalStore()
      >>> s.set("k", b"v"); s.get("k"), s.num_keys()
      (b'v', 1)
    """

    def __init__(self) -> None:
        self._data: dict[str, Value] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: Value) -> None:
        with self._lock:
            self._data[key] = value

    def get(self, key: str) -> Optional[Value]:
        with self._lock:
            return self._data.get(key)

    def num_keys(self) -> int:
        with self._lock:
            return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def mset(self, dictionary: dict[str, Value]) -> None:
        with self._lock:
            self._data.update(dictionary)

    def mget(self, keys: list[str]) -> list[Optional[Value]]:
        with self._lock:
            return [self._data.get(k) for k in keys]

    def status(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.clear()


def _hash(key: str) -> int:
    """A stable 64-bit hash of the key (xxhash's xxh64, as Bagua, where
    installed; else the first 8 bytes of BLAKE2b)."""
    try:
        import xxhash
    except ImportError:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return int(xxhash.xxh64(key.encode()).intdigest())


class ClusterStore(Store):
    """Entries sharded over ``stores`` by a hash of the key (Bagua's
    ``ClusterStore``).

    Args:
      stores (list[Store]): The stores (at least one).

    Raises:
      ValueError: No store.

    Example:
      >>> s = ClusterStore([LocalStore(), LocalStore()])
      >>> s.mset({str(i): b"x" for i in range(10)}); s.num_keys()
      10
    """

    def __init__(self, stores: list[Store]) -> None:
        if not stores:
            raise ValueError("ClusterStore needs at least one store")
        self.stores = list(stores)
        self.num_stores = len(self.stores)

    def route(self, key: str) -> Store:
        """Returns the store that holds ``key``.

        Args:
          key (str): The key.

        Returns:
          Store: Its store.
        """
        return self.stores[_hash(key) % self.num_stores] if self.num_stores > 1 else self.stores[0]

    def set(self, key: str, value: Value) -> None:
        self.route(key).set(key, value)

    def get(self, key: str) -> Optional[Value]:
        return self.route(key).get(key)

    def num_keys(self) -> int:
        return sum(s.num_keys() for s in self.stores)

    def clear(self) -> None:
        for s in self.stores:
            s.clear()

    def mset(self, dictionary: dict[str, Value]) -> None:
        shards: dict[int, dict[str, Value]] = {}
        for k, v in dictionary.items():
            shards.setdefault(id(self.route(k)), {})[k] = v
        for s in self.stores:
            if id(s) in shards:
                s.mset(shards[id(s)])

    def mget(self, keys: list[str]) -> list[Optional[Value]]:
        found: dict[str, Optional[Value]] = {}
        shards: dict[int, list[str]] = {}
        for k in keys:
            shards.setdefault(id(self.route(k)), []).append(k)
        for s in self.stores:
            ks = shards.get(id(s))
            if ks:
                found.update(zip(ks, s.mget(ks)))
        return [found.get(k) for k in keys]

    def status(self) -> bool:
        return all(s.status() for s in self.stores)

    def shutdown(self) -> None:
        for s in self.stores:
            s.shutdown()
