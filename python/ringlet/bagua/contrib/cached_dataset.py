"""Bagua's cached dataset (``bagua.torch_api.contrib.CachedDataset``): a
dataset whose samples are cached by index through a
:class:`~.cache_loader.CacheLoader` (``backend="local"``, in-process, by
default here; ``"redis"`` needs the ``redis`` package and running servers).

Example:
  >>> cached = CachedDataset(dataset, dataset_name="train")
  >>> loader = torch.utils.data.DataLoader(cached, batch_size=32)
"""

from __future__ import annotations

from typing import Any

from torch.utils.data.dataset import Dataset

from .cache_loader import CacheLoader

__all__ = ["CachedDataset"]


class CachedDataset(Dataset):
    """Wraps ``dataset``; ``cached[i]`` is ``dataset[i]``, computed once per
    cache (Bagua's ``CachedDataset``).

    Args:
      dataset (torch.utils.data.Dataset): The dataset (with ``__len__``).
      backend (str): ``"local"`` (default) or ``"redis"``, as :class:`CacheLoader`.
      dataset_name (str): Key prefix. Default: ``""``.
      writer_buffer_size (int): Samples gathered before one write. Default: 20.
      **kwargs: The Redis store's arguments.

    Example:
      >>> cached = CachedDataset(torch.utils.data.TensorDataset(x, y))
      >>> cached[3] == (x[3], y[3])
    """

    def __init__(
        self,
        dataset: Any,
        backend: str = "local",
        dataset_name: str = "",
        writer_buffer_size: int = 20,
        **kwargs: Any,
    ) -> None:
        self.dataset = dataset
        self.cache_loader = CacheLoader(backend, dataset_name, writer_buffer_size, **kwargs)

    def __getitem__(self, item: Any) -> Any:
        return self.cache_loader.get(item, lambda x: self.dataset[x])

    def __len__(self) -> int:
        return len(self.dataset)
