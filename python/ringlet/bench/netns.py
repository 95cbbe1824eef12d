"""Hosts made of Linux network namespaces, for benchmarks and tests that need
more than one machine: ``with Hosts(2, rate="2gbit") as net: ...``.

H = 2 hosts are joined by one veth pair; H >= 3 hosts each get a veth to a
bridge that lives in a namespace of its own. Every host has ``lo`` up and one
address ``10.<a>.<b>.<h + 1>/24`` (``a`` in 232..239 and ``b`` picked from the
process id). With a ``rate``, each host's link is limited in both directions
by ``tc qdisc add dev X root tbf rate R burst 256kb latency 100ms``: on the
host's end (what it sends) and on the far end (what it receives: the other
host's end of the pair, or the bridge port).

Nothing is made in the caller's namespace: the veth ends are created straight
inside their namespaces, so deleting the namespaces deletes every interface
and qdisc. They are deleted (after every process left inside them is killed)
when the ``with`` block ends, however it ends: an exception, Ctrl-C, SIGTERM
or SIGHUP (handlers turn those into exceptions while the hosts exist, then
the previous handlers come back), or interpreter exit (atexit). A run that
was killed outright (SIGKILL) leaves namespaces named after its process id;
:func:`cleanup_stale` deletes those of processes that no longer exist.

Needs root and iproute2 (``ip``, and ``tc`` for a rate); :func:`why_not`
says why it cannot run here.

Example:
  >>> from ringlet.bench.netns import Hosts
  >>> with Hosts(2, rate="1gbit") as net:
  ...     subprocess.run(net.exec_argv(1) + ["python", "-c", "print('on host 1')"])
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any, Optional

PREFIX = "rlbench"
"""Default first part of every namespace name (then the process id, then
``h<host>``, ``br`` or ``probe``)."""

BURST = "256kb"
LATENCY = "100ms"
_TAG = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,39}$")
_SIGNALS = tuple(
    getattr(signal, s) for s in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, s)
)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and res.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check)


def list_namespaces() -> list[str]:
    """Returns the names of the network namespaces ``ip netns list`` shows.

    Returns:
      Namespace names (without their ``(id: N)`` suffixes); empty when ``ip``
      is missing or fails.

    Example:
      >>> [n for n in list_namespaces() if n.startswith("rlbench")]
      []
    """
    if shutil.which("ip") is None:
        return []
    res = _ip("netns", "list", check=False)
    return [ln.split()[0] for ln in res.stdout.splitlines() if ln.strip()]


def why_not(rate: bool = True) -> Optional[str]:
    """Says why :class:`Hosts` cannot be made here, or ``None`` when it can
    (root, iproute2, and a probe namespace was made and deleted).

    Args:
      rate (bool): Whether a rate limit will be asked for (then ``tc`` is
        needed too). Default: True

    Returns:
      ``None``, or a sentence fit for ``pytest.skip`` or an error message.

    Example:
      >>> why = why_not()
      >>> if why:
      ...     pytest.skip(why)
    """
    if not hasattr(os, "geteuid") or sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run it with sudo)"
    if shutil.which("ip") is None:
        return "the ip tool (iproute2) is not installed"
    if rate and shutil.which("tc") is None:
        return "the tc tool (iproute2) is not installed; rate limits need it"
    probe = f"{PREFIX}{os.getpid()}probe"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"`ip netns add` is not allowed here: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str, wait: float = 5.0) -> None:
    """SIGKILLs every process in namespace ``ns`` and waits (up to ``wait``
    seconds) until none is left."""
    deadline = time.monotonic() + wait
    while True:
        res = _ip("netns", "pids", ns, check=False)
        pids = [int(p) for p in res.stdout.split() if p.isdigit() and int(p) != os.getpid()]
        if not pids or res.returncode != 0 or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)  # killed processes take a moment to leave; bounded by the deadline


def cleanup_stale(prefix: str = PREFIX, include_live: bool = False) -> list[str]:
    """Deletes namespaces left by runs of :class:`Hosts` that died without
    cleaning up (SIGKILL, power loss), killing any process still in them.

    Args:
      prefix (str): The ``tag`` those runs used. Default: ``"rlbench"``
      include_live (bool): Also delete namespaces of processes that still
        run. Default: False (only those whose process is gone)

    Returns:
      The names of the deleted namespaces.

    Example:
      >>> cleanup_stale()        # before a run: leftovers of a crashed one
      ['rlbench4242h0', 'rlbench4242h1']
    """
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)(?:h\d+|br|probe)$")
    gone = []
    for name in list_namespaces():
        m = pattern.match(name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or (not include_live and _alive(pid)):
            continue
        _kill_inside(name)
        if _ip("netns", "del", name, check=False).returncode == 0:
            gone.append(name)
    return gone


def parse_rate(rate: Optional[str]) -> Optional[float]:
    """Reads a ``tc`` rate such as ``"2gbit"``, ``"500mbit"`` or ``"1gbps"``.

    Args:
      rate (str, optional): A number with a unit: ``bit``, ``kbit``, ``mbit``,
        ``gbit``, ``tbit`` (bits/s, powers of 1000) or ``bps``, ``kbps``,
        ``mbps``, ``gbps`` (bytes/s, as tc reads them); a bare number is
        bits/s. ``None`` or ``"none"``: no limit.

    Returns:
      Bytes per second, or ``None`` for no limit.

    Example:
      >>> parse_rate("2gbit")
      250000000.0
    """
    if rate is None or rate.strip().lower() in ("", "none"):
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
    if m is None:
        raise ValueError(f"cannot read the rate {rate!r}: expected e.g. 2gbit, 500mbit, 1gbps")
    value = float(m.group(1)) * 1000 ** "_kmgt".index(m.group(2) or "_")
    if value <= 0:
        raise ValueError(f"the rate {rate!r} is not positive")
    return value if m.group(3) == "bps" else value / 8


class Hosts:
    """``n`` network-namespace hosts joined by veth links (a pair for 2, a
    bridge in its own namespace for 3 or more), each link optionally limited
    to ``rate`` in both directions.

    Args:
      n (int): Number of hosts, at least 2.
      rate (str, optional): A ``tc`` rate (``"2gbit"``, ``"500mbit"``) for
        every host's link, each way; ``None`` or ``"none"`` for the raw veth.
        Default: ``"2gbit"``
      tag (str): First part of the namespace names (letters, digits, ``_``,
        ``-``); the process id follows, so concurrent runs never collide.
        Default: ``"rlbench"``
      burst (str): tbf burst. Default: ``"256kb"``
      latency (str): tbf latency (queue bound). Default: ``"100ms"``

    Attributes:
      names (list[str]): Namespace of host ``h`` at index ``h``.
      addrs (list[str]): IPv4 address of host ``h`` (without the prefix length).
      ifnames (list[str]): The link's interface inside host ``h`` (for
        ``GLOO_SOCKET_IFNAME``).
      bridge (str or None): The bridge's namespace (3 or more hosts).

    Example:
      >>> with Hosts(3, rate="1gbit") as net:
      ...     net.names, net.addrs, net.ifnames
      (['rlbench77h0', 'rlbench77h1', 'rlbench77h2'],
       ['10.232.78.1', '10.232.78.2', '10.232.78.3'], ['rl-h0', 'rl-h1', 'rl-h2'])
    """

    def __init__(self, n: int, rate: Optional[str] = "2gbit", tag: str = PREFIX,
                 burst: str = BURST, latency: str = LATENCY) -> None:
        if not 2 <= n <= 250:
            raise ValueError(f"Hosts needs 2 to 250 hosts, got {n}")
        if not _TAG.match(tag):
            raise ValueError(f"tag {tag!r}: letters, digits, '_' and '-', starting with a letter")
        self.rate = None if parse_rate(rate) is None else str(rate)
        self.burst, self.latency = burst, latency
        pid = os.getpid()
        base = f"{tag}{pid}"
        self.names = [f"{base}h{h}" for h in range(n)]
        self.bridge: Optional[str] = f"{base}br" if n >= 3 else None
        self.ifnames = [f"rl-h{h}" for h in range(n)]
        net = f"10.{232 + (pid // 250) % 8}.{pid % 250 + 1}"
        self.addrs = [f"{net}.{h + 1}" for h in range(n)]
        self._made: list[str] = []
        self._lock = threading.Lock()
        self._old: dict[int, Any] = {}
        self._closed = False

    # --- setting up -----------------------------------------------------------------

    def __enter__(self) -> Hosts:
        self._install_handlers()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _limit(self, ns: str, dev: str) -> None:
        if self.rate is not None:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                  "burst", self.burst, "latency", self.latency])

    def _build(self) -> None:
        for ns in self.names:
            self._add_ns(ns)
        n = len(self.names)
        if self.bridge is None:
            a, b = self.names
            _ip("-n", a, "link", "add", self.ifnames[0], "type", "veth",
                "peer", "name", self.ifnames[1], "netns", b)
        else:
            br = self.bridge
            self._add_ns(br)
            _ip("-n", br, "link", "add", "rl-br", "type", "bridge")
            _ip("-n", br, "link", "set", "rl-br", "up")
            for h in range(n):
                port = f"rl-p{h}"
                _ip("-n", br, "link", "add", port, "type", "veth",
                    "peer", "name", self.ifnames[h], "netns", self.names[h])
                _ip("-n", br, "link", "set", port, "master", "rl-br")
                _ip("-n", br, "link", "set", port, "up")
                self._limit(br, port)  # bridge -> host h: what host h receives
        for h, ns in enumerate(self.names):
            dev = self.ifnames[h]
            _ip("-n", ns, "addr", "add", f"{self.addrs[h]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            self._limit(ns, dev)  # what host h sends (with 2 hosts: what the other receives)

    # --- using ----------------------------------------------------------------------

    def exec_argv(self, h: int) -> list[str]:
        """The command prefix that runs a program on host ``h``.

        Args:
          h (int): The host.

        Returns:
          ``["ip", "netns", "exec", <namespace of h>]``; append the program.

        Example:
          >>> subprocess.run(net.exec_argv(0) + ["ip", "addr"])
        """
        return ["ip", "netns", "exec", self.names[h]]

    def cut(self, h: int) -> None:
        """Takes host ``h``'s link down, as a cable cut would.

        Args:
          h (int): The host whose link goes down.

        Example:
          >>> net.cut(1)     # host 1 is now unreachable from every other host
        """
        _ip("-n", self.names[h], "link", "set", self.ifnames[h], "down")

    def restore(self, h: int) -> None:
        """Brings host ``h``'s link back up after :meth:`cut`.

        Args:
          h (int): The host.

        Example:
          >>> net.restore(1)
        """
        _ip("-n", self.names[h], "link", "set", self.ifnames[h], "up")

    def qdiscs(self, h: int) -> str:
        """``tc qdisc show`` inside host ``h`` (to check the rate limit).

        Args:
          h (int): The host.

        Returns:
          tc's text.

        Example:
          >>> "tbf" in net.qdiscs(0)
          True
        """
        return _run(["tc", "-n", self.names[h], "qdisc", "show"]).stdout

    # --- tearing down ---------------------------------------------------------------

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    def close(self) -> None:
        """Kills every process left in the hosts, deletes their namespaces
        (and with them every interface and qdisc) and restores the signal
        handlers. Safe to call more than once; :meth:`__exit__` and atexit
        call it.

        Example:
          >>> net = Hosts(2).__enter__()
          >>> net.close()
        """
        block = hasattr(signal, "pthread_sigmask") and threading.current_thread() is \
            threading.main_thread()
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS) if block else None
        try:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                errors = []
                for ns in reversed(self._made):
                    _kill_inside(ns)
                    res = _ip("netns", "del", ns, check=False)
                    if res.returncode != 0 and ns in list_namespaces():
                        errors.append(f"{ns}: {res.stderr.strip()}")
                self._made.clear()
                self._restore_handlers()
                try:
                    atexit.unregister(self.close)
                except Exception:
                    pass
                if errors:
                    print(f"ringlet.bench.netns: could not delete {errors}", file=sys.stderr)
        finally:
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)  # unwinds through __exit__, which cleans up

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; atexit still cleans up
        for sig in _SIGNALS:
            old = signal.getsignal(sig)
            # Where a handler already raises (Python's SIGINT) or was set by the
            # program, leave it; replace only the ones that would kill the
            # process without unwinding.
            if old in (signal.SIG_DFL, None):
                self._old[sig] = old
                signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)
        self._old.clear()
