"""ringlet's engine layer, as the doors use it (the engine adapter and the
rest of the bootstrap, today's ``ringlet._engine`` and ``ringlet.runtime``,
are to join it):

* :mod:`.store`: the job's rendezvous on its key-value store (opening it
  without hanging on a taken port, waiting for keys, the address exchange).
* :mod:`.members`: the communicators of one algorithm instance over some of
  the job's ranks, flat or in Bagua's two levels (exact within a host, the
  expensive part across hosts), shared by the ByteGrad DDP hook, Bagua's
  algorithms and DiLoCo.
"""

from .members import MemberComms, connect_members, group_timeout, local_address

__all__ = ["MemberComms", "connect_members", "group_timeout", "local_address"]
