"""Bagua's load-balancing samplers (``bagua.torch_api.contrib``):
:class:`LoadBalancingDistributedSampler` gives each rank samples of about the
same computational complexity at each position, and
:class:`LoadBalancingDistributedBatchSampler` cuts each rank's share into
variable-sized batches with the same number of batches on every rank.

The partition is Bagua's, index for index: samples are ordered by
complexity (ties by index), with ``shuffle`` each complexity first gets a
random integer below ``int((max - min) * random_level + 1)`` added (drawn
from a ``torch.Generator`` seeded ``seed + epoch``); the ordered indices are
cut into chunks of ``num_replicas`` consecutive ones (wrapping round to fill
``num_samples`` chunks), the chunks are permuted with the same generator, and
rank ``r`` takes the ``r``-th index of each chunk.

Example:
  >>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda s: len(s[0]))
  >>> loader = torch.utils.data.DataLoader(dataset, sampler=sampler)
  >>> for epoch in range(epochs):
  ...     sampler.set_epoch(epoch)
  ...     train(loader)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch.utils.data.sampler import Sampler

__all__ = ["LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler"]


def _job() -> tuple[int, int]:
    """(world size, rank): torch.distributed's when initialised (as Bagua
    reads them), else the Bagua door's (``WORLD_SIZE`` / ``RANK`` or the
    ringlet job)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    from .. import env

    return env.get_world_size(), env.get_rank()


class LoadBalancingDistributedSampler(Sampler[int]):
    """A distributed sampler whose ranks get samples of balanced complexity
    (Bagua's ``LoadBalancingDistributedSampler``). The dataset is assumed
    not to change size.

    Args:
      dataset (torch.utils.data.Dataset): The dataset (with ``__len__``).
      complexity_fn (Callable): ``sample -> int``, the sample's complexity.
      num_replicas (int, optional): Ranks sharing the dataset. Default: the job's size.
      rank (int, optional): This rank among them. Default: the job's rank.
      shuffle (bool): Shuffle (deterministically, by ``seed`` and the
        epoch). Default: True.
      seed (int): The same on every rank. Default: 0.
      drop_last (bool): Drop the tail so the data divides evenly (else
        wrap round). Default: False.
      random_level (float): 0 (best balance) to 1 (most random). Default: 0.

    Raises:
      ValueError: ``rank`` outside ``[0, num_replicas - 1]``, ``random_level``
        outside ``[0, 1]``, or an empty dataset.

    Example:
      >>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda s: s[1],
      ...                                           num_replicas=2, rank=0)
      >>> list(sampler)
    """

    def __init__(
        self,
        dataset: Any,
        complexity_fn: Callable[..., int],
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0,
    ) -> None:
        if num_replicas is None or rank is None:
            world, me = _job()
            num_replicas = world if num_replicas is None else num_replicas
            rank = me if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"Invalid num_replicas {num_replicas}, should be at least 1")
        if rank >= num_replicas or rank < 0:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        if random_level < 0.0 or random_level > 1.0:
            raise ValueError(
                f"Invalid random level {random_level}, should be in the range [0.0, 1.0]"
            )
        length = len(dataset)
        if length == 0:
            raise ValueError("LoadBalancingDistributedSampler: the dataset is empty")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        if drop_last and length % num_replicas != 0:
            self.num_samples = math.ceil((length - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(length / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.shuffle = shuffle
        self.seed = seed
        self.item_complexity_map = {i: complexity_fn(dataset[i]) for i in range(length)}
        self.ordered_item_complexity_map = dict(
            sorted(self.item_complexity_map.items(), key=lambda kv: kv[1])
        )
        values = self.item_complexity_map.values()
        self.random_number = int((max(values) - min(values)) * random_level + 1)

    def _chunks(self, ordered: list[int]) -> list[list[int]]:
        """``max(1, num_samples)`` chunks of ``num_replicas`` indices taken in
        order from ``ordered``, wrapping round."""
        n = self.num_replicas
        count = max(1, self.num_samples)
        return [[ordered[(c * n + j) % len(ordered)] for j in range(n)] for c in range(count)]

    def shuffle_chunks(self) -> tuple[list[list[int]], list[int]]:
        """Returns the epoch's chunks and the order to take them in (Bagua's method).

        Returns:
          tuple[list[list[int]], list[int]]: ``(index_chunks, chunk_indices)``.
        """
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            noise = torch.randint(
                self.random_number, (len(self.item_complexity_map),), generator=g
            ).tolist()
            noisy = {k: v + r for (k, v), r in zip(self.item_complexity_map.items(), noise)}
            ordered = [k for k, _ in sorted(noisy.items(), key=lambda kv: kv[1])]
            index_chunks = self._chunks(ordered)
            chunk_indices = torch.randperm(len(index_chunks), generator=g).tolist()
        else:
            index_chunks = self._chunks(list(self.ordered_item_complexity_map))
            chunk_indices = list(range(len(index_chunks)))
        # len(chunk_indices) is max(1, num_samples): nothing to pad, at most one to drop
        chunk_indices = chunk_indices[: self.num_samples]
        return index_chunks, chunk_indices

    def __iter__(self) -> Iterator[int]:
        index_chunks, chunk_indices = self.shuffle_chunks()
        return iter([index_chunks[i][self.rank] for i in chunk_indices])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch (call it before each epoch's iterator, on every rank).

        Args:
          epoch (int): The epoch.
        """
        self.epoch = epoch


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
    """Variable-sized batches of a :class:`LoadBalancingDistributedSampler`'s
    samples, the same number on every rank (Bagua's
    ``LoadBalancingDistributedBatchSampler``).

    Each rank's samples (in the sampler's order) go through
    ``batch_fn(indices) -> list of batches``. Without ``drop_last`` every rank
    yields as many batches as the rank with the most, a rank with fewer
    repeating its own from its first; with ``drop_last`` every rank yields as
    many as the rank with the fewest. (Bagua's own code yields more batches
    than its ``len()`` with ``drop_last``, and fewer when a rank would repeat
    more than all of its batches; here a rank yields exactly ``len()``.)

    Args:
      sampler (LoadBalancingDistributedSampler): Its ``drop_last`` must be False.
      batch_fn (Callable): ``list[int] -> list[list[int]]``.
      drop_last (bool): See above. Default: False.

    Raises:
      ValueError: Another sampler, or one with ``drop_last=True``.

    Example:
      >>> batches = LoadBalancingDistributedBatchSampler(
      ...     sampler, batch_fn=lambda idx: [idx[i:i + 4] for i in range(0, len(idx), 4)])
      >>> loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches)
    """

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: Callable[[list[int]], list[list[int]]],
        drop_last: bool = False,
    ) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise ValueError(
                f"sampler should be of LoadBalancingDistributedSampler type, got "
                f"{type(sampler).__name__}"
            )
        if sampler.drop_last:
            raise ValueError("drop_last of sampler should be False")
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last
        self.num_replicas = sampler.num_replicas
        self.rank = sampler.rank
        self.generate_batches()

    def generate_batches(self) -> None:
        """Computes every rank's batches for the sampler's epoch (Bagua's method)."""
        index_chunks, chunk_indices = self.sampler.shuffle_chunks()
        batches = [
            list(self.batch_fn([index_chunks[i][r] for i in chunk_indices]))
            for r in range(self.num_replicas)
        ]
        counts = [len(b) for b in batches]
        self.total_batch = min(counts) if self.drop_last else max(counts)
        self.padded_batches = [
            [b[i % len(b)] for i in range(self.total_batch)] if b else [] for b in batches
        ]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.padded_batches[self.rank])

    def __len__(self) -> int:
        return self.total_batch

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch and recomputes the batches (call it before each epoch).

        Args:
          epoch (int): The epoch.
        """
        self.sampler.set_epoch(epoch)
        self.generate_batches()
