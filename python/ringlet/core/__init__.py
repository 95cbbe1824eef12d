"""ringlet's engine layer, as the doors use it (public names only):

* :mod:`.engine`: the engine on torch tensors, the one adapter every door
  calls (tensor checks, dtype and reduce-type names, the native module's
  operations called with tensors, the world's fast paths).
* :mod:`.groups`: the job's world (:func:`~.groups.init`, rank queries, the
  world, replica-group and pair communicators, shutdown with the hooks the
  doors register through :func:`~.groups.on_shutdown`, abort).
* :mod:`.connection`: how communicators connect (the address exchange, this
  process's listening socket, the host level of a group spanning hosts).
* :mod:`.store`: the job's rendezvous on its key-value store (opening it
  without hanging on a taken port, waiting for keys, the address exchange).
* :mod:`.members`: the communicators of one algorithm instance over some of
  the job's ranks, flat or in Bagua's two levels (exact within a host, the
  expensive part across hosts), shared by the ByteGrad DDP hook, Bagua's
  algorithms and DiLoCo.
* :mod:`.hook_worker`: the thread and futures behind torch DDP
  communication hooks, shared by ringlet's all-reduce hook
  (``ringlet.parallel.comm_hooks``) and the ByteGrad hook
  (``ringlet.distributed.hooks``).

The old paths ``ringlet.runtime`` and ``ringlet._engine`` are
:mod:`.groups` and :mod:`.engine`, deprecated.
"""

from . import connection, engine, groups, store
from .groups import on_shutdown
from .members import MemberComms, connect_members, group_timeout, local_address

__all__ = ["MemberComms", "connect_members", "connection", "engine", "group_timeout", "groups",
           "local_address", "on_shutdown", "store"]
