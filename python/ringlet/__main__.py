"""``python -m ringlet <command>``: ``info`` reports what ringlet finds on this
machine and what it will do here (see :mod:`ringlet.info`).

Example:
  python -m ringlet info
  python -m ringlet info --json
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Optional

_USAGE = """usage: python -m ringlet <command> [options]

commands:
  info [--json]   versions, the process group init_process_group("ringlet") will use and
                  why, transports, SIMD kernels and the configuration variables set
                  (the benchmarks are python -m ringlet.bench)
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command named first in ``argv``.

    Args:
      argv (list of str, optional): The arguments; default ``sys.argv[1:]``.

    Returns:
      int: The exit status: 0, or 2 for an unknown command.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_USAGE, end="")
        return 0
    if args[0] == "info":
        from .info import main as info

        return info(args[1:])
    print(f"python -m ringlet: unknown command {args[0]!r}\n\n{_USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
