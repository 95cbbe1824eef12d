"""Bagua's Redis store (``bagua.torch_api.contrib.utils.redis_store``),
over Redis servers that already run.

It needs the ``redis`` package (``pip install redis``); constructing a
:class:`RedisStore` without it raises ``ImportError`` saying so. Bagua
starts a ``redis-server`` on each node when ``hosts`` is None; ringlet
does not start servers: pass ``hosts``, or use the cache loader's
``backend="local"`` (an in-process store).

Example:
  >>> store = RedisStore(hosts=[{"host": "10.0.0.1", "port": "7000"}])
  >>> store.set("k", b"v")
"""

from __future__ import annotations

from typing import Any, Optional

from .store import ClusterStore, Store, Value

__all__ = ["RedisStore"]


def _redis() -> Any:
    try:
        import redis
    except ImportError as e:
        raise ImportError(
            "the 'redis' cache backend needs the redis package (pip install redis) and running "
            "Redis servers; without them use backend='local' (ringlet's in-process store)"
        ) from e
    return redis


class _RedisStore(Store):
    """One Redis server."""

    def __init__(self, host: str, port: Any) -> None:
        self.host, self.port = host, int(port)
        self.client = _redis().Redis(host=host, port=self.port)
        try:
            ok = self.client.ping()
        except Exception as e:
            raise ConnectionError(
                f"could not connect to the Redis server {host}:{port}: {e}"
            ) from e
        if not ok:
            raise ConnectionError(f"the Redis server {host}:{port} did not answer PING")

    def set(self, key: str, value: Value) -> None:
        self.client.set(key, value)

    def get(self, key: str) -> Optional[Value]:
        return self.client.get(key)

    def num_keys(self) -> int:
        return int(self.client.dbsize())

    def clear(self) -> None:
        self.client.flushdb()

    def mset(self, dictionary: dict[str, Value]) -> None:
        self.client.mset(dictionary)

    def mget(self, keys: list[str]) -> list[Optional[Value]]:
        return list(self.client.mget(keys))

    def status(self) -> bool:
        return bool(self.client.ping())

    def shutdown(self) -> None:
        """Servers ringlet did not start are left running."""


class RedisStore(ClusterStore):
    """Entries kept on Redis servers (Bagua's ``RedisStore``).

    Args:
      hosts (list[dict]): The servers, ``[{"host": ..., "port": ...}, ...]``.
        Required here (Bagua spawns servers when None; ringlet does not).
      cluster_mode (bool): Shard entries over every server (else the node
        with index ``n`` uses server ``n % len(hosts)``). Default: True.
      capacity_per_node (int): Bagua's memory limit for servers it spawns;
        accepted, unused.

    Raises:
      ImportError: The ``redis`` package is not installed.
      ValueError: ``hosts`` is None or empty.
      ConnectionError: A server does not answer.

    Example:
      >>> RedisStore(hosts=[{"host": "127.0.0.1", "port": "6379"}], cluster_mode=False)
    """

    def __init__(
        self,
        hosts: Optional[list[dict[str, Any]]] = None,
        cluster_mode: bool = True,
        capacity_per_node: int = 107_374_182_400,
    ) -> None:
        _redis()
        if not hosts:
            raise ValueError(
                "RedisStore: ringlet does not start Redis servers (Bagua does when hosts=None): "
                "pass hosts=[{'host': ..., 'port': ...}] of running servers, or use the cache "
                "loader's backend='local'"
            )
        if cluster_mode:
            chosen = list(hosts)
        else:
            from ...env import get_node_rank

            chosen = [hosts[get_node_rank() % len(hosts)]]
        super().__init__([_RedisStore(h["host"], h["port"]) for h in chosen])
