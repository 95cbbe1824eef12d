"""ringlet's engine layer, as the doors use it (one module so far; the
engine adapter and the bootstrap join it):

* :mod:`.members`: the communicators of one algorithm instance over some of
  the job's ranks, flat or in Bagua's two levels (exact within a host, the
  expensive part across hosts), shared by the ByteGrad DDP hook, Bagua's
  algorithms and DiLoCo.
"""

from .members import MemberComms, connect_members, local_address

__all__ = ["MemberComms", "connect_members", "local_address"]
