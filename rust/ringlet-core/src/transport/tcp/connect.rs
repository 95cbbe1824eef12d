//! Connection set-up: the listening socket, dialling the lower ranks and
//! accepting the higher ones, in full at creation or on demand.

use super::*;

/// What a mesh needs to open streams on demand.
pub(super) struct Lazy {
    /// This rank's listening socket (a duplicate of the one whose address
    /// the peers have, which other groups of the process may share): the
    /// higher ranks dial it.
    pub(super) listener: TcpListener,
    /// Its address, which with the token names this mesh in the lobby.
    pub(super) at: SocketAddr,
    pub(super) addrs: Vec<String>,
    pub(super) token: u64,
}

/// A group registered in the lobby while it connects in full.
pub(super) struct Connecting(SocketAddr, u64);

impl Drop for Connecting {
    fn drop(&mut self) {
        lobby::unregister(self.0, self.1);
    }
}

pub(super) fn local_addr(listener: &TcpListener) -> Result<SocketAddr> {
    listener
        .local_addr()
        .map_err(|e| Error::io("the listening socket's address", e))
}

/// Binds a listening socket on `addr` (port 0 picks a free port).
pub fn listen(addr: &str) -> Result<TcpListener> {
    let l = TcpListener::bind(addr).map_err(|e| Error::io(format!("bind {addr}"), e))?;
    l.set_nonblocking(true)
        .map_err(|e| Error::io("listener set_nonblocking", e))?;
    Ok(l)
}

pub(super) fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::io(format!("resolve {addr}"), e))?
        .next()
        .ok_or_else(|| Error::InvalidArgument(format!("address '{addr}' resolves to nothing")))
}

pub(super) fn dial(rank: usize, peer: usize, addr: &str, deadline: Instant) -> Result<TcpStream> {
    let sa = resolve(addr)?;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::timeout(rank, peer, "init (connect)", Duration::ZERO));
        }
        match TcpStream::connect_timeout(&sa, left.min(Duration::from_secs(5))) {
            Ok(s) => return Ok(s),
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::TimedOut) => {
                let mut none: [libc::pollfd; 0] = [];
                sys::poll(&mut none, Duration::from_millis(20))?;
            }
            Err(e) => {
                return Err(Error::io(
                    format!("rank {rank}: connect to rank {peer} at {addr}"),
                    e,
                ))
            }
        }
    }
}

/// Sets a new stream up for transfers: no Nagle delay, non-blocking, and
/// unacknowledged data fails it after `timeout`.
pub(super) fn ready(s: &TcpStream, timeout: Duration) -> Result<()> {
    s.set_nodelay(true)
        .map_err(|e| Error::io("set_nodelay", e))?;
    s.set_read_timeout(None)
        .map_err(|e| Error::io("set_read_timeout", e))?;
    s.set_nonblocking(true)
        .map_err(|e| Error::io("set_nonblocking", e))?;
    sys::set_tcp_user_timeout(s.as_raw_fd(), timeout);
    Ok(())
}

impl TcpMesh {
    /// Connects rank `rank` to every other rank: it dials the lower ranks and
    /// accepts the higher ones on `listener`. `addrs[r]` is rank r's listening
    /// `host:port`; `token` (shared by the job) rejects stray connections.
    pub fn connect(
        rank: usize,
        addrs: &[String],
        listener: &TcpListener,
        token: u64,
        timeout: Duration,
    ) -> Result<TcpMesh> {
        let size = addrs.len();
        let deadline = Instant::now() + timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        for (peer, addr) in addrs.iter().enumerate().take(rank) {
            let s = dial(rank, peer, addr, deadline)?;
            say_hello(&s, token, rank).map_err(|e| peer_lost(rank, peer, "connect", e))?;
            streams[peer] = Some(s);
        }
        // Accept the higher ranks. Hellos are read from every connection at
        // once, without blocking (in the lobby of the listener, which other
        // groups of this process may share): a stray or hostile connection
        // (silent, truncated, garbage, wrong token, impossible rank) is
        // dropped after at most HELLO_PATIENCE and never delays the real
        // peers.
        let at = local_addr(listener)?;
        lobby::register(at, token);
        let _registered = Connecting(at, token);
        let mut missing = size - rank - 1;
        while missing > 0 {
            for (peer, s) in lobby::take(listener, at, token)? {
                if peer > rank && peer < size && streams[peer].is_none() {
                    streams[peer] = Some(s);
                    missing -= 1;
                }
            }
            if missing == 0 {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                let peer = (rank + 1..size)
                    .find(|p| streams[*p].is_none())
                    .unwrap_or(rank);
                return Err(Error::timeout(rank, peer, "init (connect)", timeout));
            }
            let mut fds = lobby::pollfds(listener, at);
            sys::poll(&mut fds, (deadline - now).min(POLL_SLICE))?;
        }
        for s in streams.iter().flatten() {
            ready(s, timeout)?;
        }
        let wire = Tripwire::new();
        wire.add_streams(streams.iter().flatten().map(|s| s.as_raw_fd()));
        Ok(TcpMesh {
            rank,
            tails: (0..size).map(|_| Cell::new([0; NOTICE_BYTES])).collect(),
            stalled: Cell::new(false),
            last_turn: Cell::new(None),
            streams: streams
                .into_iter()
                .map(|s| s.map_or_else(OnceCell::new, OnceCell::from))
                .collect(),
            lazy: None,
            wire,
            members: Vec::new(),
            agree_sent: Cell::new(0),
        })
    }

    /// Meshes of more ranks than this may open their streams on demand
    /// (`connect_lazily`); smaller ones connect in full (two ranks' peeks at
    /// a pending message read the peer's stream, which must exist).
    pub const LAZY_ABOVE: usize = FULL_EXCHANGE_UP_TO;

    /// A mesh of rank `rank` whose streams open on demand: the first
    /// transfer that names a peer dials it (a higher rank dials a lower
    /// one) or accepts it on `listener` (kept, duplicated, for the mesh's
    /// life). Nothing is sent at creation. Arguments as for `connect`.
    pub fn connect_lazily(
        rank: usize,
        addrs: &[String],
        listener: &TcpListener,
        token: u64,
    ) -> Result<TcpMesh> {
        let size = addrs.len();
        let listener = listener
            .try_clone()
            .map_err(|e| Error::io("duplicating the listening socket", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("listener set_nonblocking", e))?;
        let at = local_addr(&listener)?;
        lobby::register(at, token);
        Ok(TcpMesh {
            rank,
            tails: (0..size).map(|_| Cell::new([0; NOTICE_BYTES])).collect(),
            stalled: Cell::new(false),
            last_turn: Cell::new(None),
            streams: (0..size).map(|_| OnceCell::new()).collect(),
            lazy: Some(Lazy {
                listener,
                at,
                addrs: addrs.to_vec(),
                token,
            }),
            wire: Tripwire::new(),
            members: Vec::new(),
            agree_sent: Cell::new(0),
        })
    }

    /// Streams open now (peers this rank has exchanged bytes with, or all
    /// of them for a full mesh).
    pub fn open_streams(&self) -> usize {
        self.streams.iter().filter(|s| s.get().is_some()).count()
    }

    pub(super) fn connected(&self, peer: usize) -> bool {
        self.streams.get(peer).is_some_and(|s| s.get().is_some())
    }

    /// Installs a new stream to `peer`.
    pub(super) fn adopt(&self, peer: usize, s: TcpStream, timeout: Duration) -> Result<()> {
        ready(&s, timeout)?;
        let fd = s.as_raw_fd();
        if self.streams[peer].set(s).is_ok() {
            self.wire.add_streams([fd]);
        }
        Ok(())
    }

    /// Dials the lower-ranked peers of `xfers` that have no stream yet. The
    /// connection completes in the peer's listen backlog, without waiting
    /// for the peer to accept; a refusal means the peer no longer listens.
    pub(super) fn dial_lower(
        &self,
        xfers: &[Xfer<'_>],
        op: &'static str,
        timeout: Duration,
    ) -> Result<()> {
        self.dial_peers(xfers.iter().map(Xfer::peer), op, timeout)
    }

    /// Dials those of `peers` that are lower than this rank and have no
    /// stream yet (see `dial_lower`).
    pub(super) fn dial_peers(
        &self,
        peers: impl IntoIterator<Item = usize>,
        op: &'static str,
        timeout: Duration,
    ) -> Result<()> {
        let Some(lazy) = &self.lazy else {
            return Ok(());
        };
        for peer in peers {
            if peer >= self.rank || self.connected(peer) {
                continue;
            }
            let sa = resolve(&lazy.addrs[peer])?;
            let s = TcpStream::connect_timeout(
                &sa,
                timeout.clamp(Duration::from_millis(1), Duration::from_secs(5)),
            )
            .map_err(|e| self.unreachable(peer, op, e))?;
            say_hello(&s, lazy.token, self.rank).map_err(|e| peer_lost(self.rank, peer, op, e))?;
            self.adopt(peer, s, timeout)?;
        }
        Ok(())
    }

    /// The error for a failed dial of `peer`.
    pub(super) fn unreachable(&self, peer: usize, op: &'static str, e: std::io::Error) -> Error {
        let (cause, why) = match e.kind() {
            ErrorKind::ConnectionRefused => (
                Cause::Exited,
                "it no longer accepts connections (connection refused)".to_string(),
            ),
            // the peer closed its listener while this connection sat in its
            // queue: it went away as we dialled, as a refusal says a moment later
            ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => (
                Cause::Exited,
                format!("it closed its listener as this rank connected ({e})"),
            ),
            _ => (Cause::Unreachable, format!("connecting to it failed: {e}")),
        };
        Error::lost(self.rank, peer, op, cause, why)
    }

    /// Accepts the connections waiting on the listener and reads their
    /// hellos, without blocking, and adopts the streams of this group's
    /// higher ranks (from the lobby, which may hold some that another group
    /// of this process accepted); true when a stream was added.
    pub(super) fn accept_higher(&self, timeout: Duration) -> Result<bool> {
        let Some(lazy) = &self.lazy else {
            return Ok(false);
        };
        let mut added = false;
        for (peer, s) in lobby::take(&lazy.listener, lazy.at, lazy.token)? {
            if peer > self.rank && peer < self.size() && !self.connected(peer) {
                self.adopt(peer, s, timeout)?;
                added = true;
            }
        }
        Ok(added)
    }

    /// The listener and the connections whose hello is awaited, to poll
    /// while a transfer waits for a peer that has not connected yet.
    pub(super) fn accept_pollfds(&self) -> Vec<libc::pollfd> {
        let Some(lazy) = &self.lazy else {
            return Vec::new();
        };
        lobby::pollfds(&lazy.listener, lazy.at)
    }

    /// Whether `peer` (which has not connected) still listens: an error
    /// naming it when its listener refuses a connection.
    pub(super) fn probe(&self, peer: usize, op: &'static str) -> Result<()> {
        let Some(lazy) = &self.lazy else {
            return Ok(());
        };
        let sa = resolve(&lazy.addrs[peer])?;
        match TcpStream::connect_timeout(&sa, Duration::from_millis(100)) {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                Err(self.unreachable(peer, op, e))
            }
            _ => Ok(()),
        }
    }
}
