"""The ``torch.backends`` entry point: torch calls :func:`register` at the end
of ``import torch`` (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), so that
``init_process_group("ringlet")`` works without ``import ringlet``.

It registers a creator that imports ringlet only when a ringlet process
group is made, and never raises: a problem here must not break ``import
torch``.
"""

from __future__ import annotations

from typing import Any


def _create(opts: Any, pg_options: Any = None) -> Any:
    from .distributed import c10d

    c10d.register()
    return c10d._create(opts, pg_options)


def register() -> None:
    """Registers the ``"ringlet"`` process-group backend with torch.distributed."""
    try:
        import torch.distributed as dist

        if dist.is_available() and "RINGLET" not in dist.Backend._plugins:
            dist.Backend.register_backend("ringlet", _create, extended_api=True, devices=["cpu"])
    except Exception:  # torch without distributed, or an older API: import ringlet works
        pass
