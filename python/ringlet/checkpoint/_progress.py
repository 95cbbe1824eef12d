"""A progress bar (tqdm, in bytes) for long saves and loads, shown only on a terminal."""

from __future__ import annotations

import sys

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._bar = None
        if not enabled or total <= 0:
            return
        try:
            if not sys.stderr.isatty():
                return
        except (AttributeError, ValueError):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(
            total=total,
            desc=desc,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            delay=1.0,
            leave=False,
        )

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
