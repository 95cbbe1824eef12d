"""``python -m ringlet.bench <what> [options]``: see :mod:`ringlet.bench`."""

from __future__ import annotations

import importlib
import sys

from . import WHAT


def main() -> None:
    """Runs the benchmark named by the first argument (``collectives`` when
    the first argument is an option), passing it the remaining arguments."""
    what = "collectives"
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        what = sys.argv.pop(1)
    if what not in WHAT:
        raise SystemExit(f"unknown benchmark {what!r}: one of {', '.join(WHAT)}")
    sys.argv[0] = f"ringlet.bench {what}"
    importlib.import_module(f"ringlet.bench.{what}").main()


if __name__ == "__main__":
    main()
