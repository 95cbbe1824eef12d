//! TCP transport: one stream per peer pair, set up from a table of listening
//! addresses, then used non-blocking. `transfer` drives any mix of sends and
//! receives to completion with one `poll` loop, so a ring step ("send to next
//! while receiving from previous") and an all-to-all exchange are the same call
//! and neither can deadlock on full socket buffers.
//!
//! A mesh is either connected in full at creation (`TcpMesh::connect`) or
//! on demand (`TcpMesh::connect_lazily`): a stream opens the first time a
//! transfer names its peer. Either way the higher rank of a pair dials and
//! the lower accepts; the dial never waits for the peer (the listener's
//! backlog takes it), and the accepting side keeps driving its other
//! transfers until the hello arrives, so on-demand streams add no wait that
//! a full mesh would not have.

use crate::error::{Cause, Error, Result};
use crate::fault::{decode_notice, Tripwire, NOTICE_BYTES};
use crate::sys;
use crate::transport::{check_agreement, grace, OpDesc, Waiting, DESC_WORDS};
use std::cell::{Cell, OnceCell};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod lobby;

const HELLO_MAGIC: u64 = 0x5249_4e47_4c45_5401; // "RINGLET\x01"
/// Longest a blocked transfer sleeps before checking the tripwire again.
const POLL_SLICE: Duration = Duration::from_millis(20);
const HANGUP: libc::c_short = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;

/// Longest an incoming connection may take to send its hello.
const HELLO_PATIENCE: Duration = Duration::from_secs(2);
/// How long a rank waits on a peer that has not connected yet before it
/// checks that the peer still listens (and then again as often).
const PROBE_AFTER: Duration = Duration::from_secs(1);
const HELLO_BYTES: usize = 24;

/// Largest mesh whose agreement check is a full exchange of descriptors:
/// there it sends no more messages than the digest all-reduce (p - 1 <=
/// ⌈log2 p⌉), and on two ranks a peer's next descriptor is the first thing
/// in its stream (`peek_desc` reads a pending message's from there).
const FULL_EXCHANGE_UP_TO: usize = 3;

/// An accepted connection whose hello (magic, job token, rank) is being read.
struct Hello {
    stream: TcpStream,
    buf: [u8; HELLO_BYTES],
    got: usize,
    since: Instant,
}

enum HelloState {
    Waiting,
    Rejected,
    /// A whole hello: the group's token and the dialer's rank in it.
    Done {
        token: u64,
        peer: usize,
    },
}

impl Hello {
    fn new(stream: TcpStream) -> Self {
        Hello {
            stream,
            buf: [0; HELLO_BYTES],
            got: 0,
            since: Instant::now(),
        }
    }

    /// Reads what arrived; decides once the hello is complete. Garbage, a
    /// short hello followed by the end of the stream and silence past
    /// `HELLO_PATIENCE` are rejected (the connection is then closed); a whole
    /// hello names the group (its token) and the dialer's rank, which the
    /// group's mesh checks when it takes the stream (a wrong token never
    /// reaches a mesh; an impossible or duplicate rank is closed there). What
    /// follows a good hello is the peer's first message: the group's token
    /// is what authenticates a peer.
    fn progress(&mut self) -> HelloState {
        while self.got < HELLO_BYTES {
            match (&self.stream).read(&mut self.buf[self.got..]) {
                Ok(0) => return HelloState::Rejected,
                Ok(n) => self.got += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    return if self.since.elapsed() > HELLO_PATIENCE {
                        HelloState::Rejected
                    } else {
                        HelloState::Waiting
                    };
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return HelloState::Rejected,
            }
        }
        let word =
            |i: usize| u64::from_le_bytes(self.buf[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
        let (magic, tok) = (word(0), word(1));
        let Ok(peer) = usize::try_from(word(2)) else {
            return HelloState::Rejected;
        };
        if magic != HELLO_MAGIC {
            return HelloState::Rejected;
        }
        HelloState::Done { token: tok, peer }
    }
}

/// One pending data movement with a peer.
pub enum Xfer<'a> {
    Send {
        peer: usize,
        buf: &'a [u8],
        done: usize,
    },
    Recv {
        peer: usize,
        buf: &'a mut [u8],
        done: usize,
    },
}

impl<'a> Xfer<'a> {
    /// A send of `buf` to `peer`.
    pub fn send(peer: usize, buf: &'a [u8]) -> Self {
        Xfer::Send { peer, buf, done: 0 }
    }

    /// A receive from `peer` that fills `buf`.
    pub fn recv(peer: usize, buf: &'a mut [u8]) -> Self {
        Xfer::Recv { peer, buf, done: 0 }
    }

    /// A send of `buf` to `peer` whose first `done` bytes went out already
    /// (an earlier transfer stopped before it finished).
    pub fn send_from(peer: usize, buf: &'a [u8], done: usize) -> Self {
        Xfer::Send {
            peer,
            buf,
            done: done.min(buf.len()),
        }
    }

    /// Bytes to move in all.
    pub fn len(&self) -> usize {
        match self {
            Xfer::Send { buf, .. } => buf.len(),
            Xfer::Recv { buf, .. } => buf.len(),
        }
    }

    /// True for a transfer of nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes moved so far.
    pub fn done(&self) -> usize {
        match self {
            Xfer::Send { done, .. } | Xfer::Recv { done, .. } => *done,
        }
    }

    /// Same peer and same direction: the two share a byte stream, so the
    /// later one must wait until the earlier one finished.
    fn same_stream(&self, other: &Xfer<'_>) -> bool {
        self.peer() == other.peer()
            && matches!(
                (self, other),
                (Xfer::Send { .. }, Xfer::Send { .. }) | (Xfer::Recv { .. }, Xfer::Recv { .. })
            )
    }

    fn peer(&self) -> usize {
        match self {
            Xfer::Send { peer, .. } | Xfer::Recv { peer, .. } => *peer,
        }
    }

    /// The bytes a receive has filled so far (empty for a send).
    pub fn received(&self) -> &[u8] {
        match self {
            Xfer::Recv { buf, done, .. } => &buf[..*done],
            Xfer::Send { .. } => &[],
        }
    }

    fn finished(&self) -> bool {
        match self {
            Xfer::Send { buf, done, .. } => *done == buf.len(),
            Xfer::Recv { buf, done, .. } => *done == buf.len(),
        }
    }
}

/// The streams of one communicator: a full mesh, or opened on demand.
pub struct TcpMesh {
    rank: usize,
    streams: Vec<OnceCell<TcpStream>>,
    /// Set for a mesh whose streams open on demand.
    lazy: Option<Lazy>,
    /// The last bytes received from each peer: when a stream ends, they hold
    /// the peer's abort notice if it sent one.
    tails: Vec<Cell<[u8; NOTICE_BYTES]>>,
    /// This process was stopped during a wait since the last `check_peers`
    /// (see [`Waiting`]).
    stalled: Cell<bool>,
    /// The last turn of a wait in the current operation, with the grace:
    /// a stop between two waits of one operation, or after its last wait,
    /// shows as a gap from it.
    last_turn: Cell<Option<(Instant, Duration)>>,
    wire: Arc<Tripwire>,
    /// Global rank of each group rank (empty: the same numbers). Notices
    /// name global ranks.
    members: Vec<usize>,
    /// Messages sent by `agree` so far.
    agree_sent: Cell<u64>,
}

/// What a mesh needs to open streams on demand.
struct Lazy {
    /// This rank's listening socket (a duplicate of the one whose address
    /// the peers have, which other groups of the process may share): the
    /// higher ranks dial it.
    listener: TcpListener,
    /// Its address, which with the token names this mesh in the lobby.
    at: SocketAddr,
    addrs: Vec<String>,
    token: u64,
}

impl Drop for TcpMesh {
    fn drop(&mut self) {
        if let Some(lazy) = &self.lazy {
            lobby::unregister(lazy.at, lazy.token);
        }
    }
}

/// A group registered in the lobby while it connects in full.
struct Connecting(SocketAddr, u64);

impl Drop for Connecting {
    fn drop(&mut self) {
        lobby::unregister(self.0, self.1);
    }
}

fn local_addr(listener: &TcpListener) -> Result<SocketAddr> {
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

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::io(format!("resolve {addr}"), e))?
        .next()
        .ok_or_else(|| Error::InvalidArgument(format!("address '{addr}' resolves to nothing")))
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

    fn connected(&self, peer: usize) -> bool {
        self.streams.get(peer).is_some_and(|s| s.get().is_some())
    }

    /// Installs a new stream to `peer`.
    fn adopt(&self, peer: usize, s: TcpStream, timeout: Duration) -> Result<()> {
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
    fn dial_lower(&self, xfers: &[Xfer<'_>], op: &'static str, timeout: Duration) -> Result<()> {
        self.dial_peers(xfers.iter().map(Xfer::peer), op, timeout)
    }

    /// Dials those of `peers` that are lower than this rank and have no
    /// stream yet (see `dial_lower`).
    fn dial_peers(
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
    fn unreachable(&self, peer: usize, op: &'static str, e: std::io::Error) -> Error {
        let (cause, why) = match e.kind() {
            ErrorKind::ConnectionRefused => (
                Cause::Exited,
                "it no longer accepts connections (connection refused)".to_string(),
            ),
            _ => (Cause::Unreachable, format!("connecting to it failed: {e}")),
        };
        Error::lost(self.rank, peer, op, cause, why)
    }

    /// Accepts the connections waiting on the listener and reads their
    /// hellos, without blocking, and adopts the streams of this group's
    /// higher ranks (from the lobby, which may hold some that another group
    /// of this process accepted); true when a stream was added.
    fn accept_higher(&self, timeout: Duration) -> Result<bool> {
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
    fn accept_pollfds(&self) -> Vec<libc::pollfd> {
        let Some(lazy) = &self.lazy else {
            return Vec::new();
        };
        lobby::pollfds(&lazy.listener, lazy.at)
    }

    /// Whether `peer` (which has not connected) still listens: an error
    /// naming it when its listener refuses a connection.
    fn probe(&self, peer: usize, op: &'static str) -> Result<()> {
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

    /// Sets the global rank of each group rank (notices name global ranks).
    pub(crate) fn set_members(&mut self, members: &[usize]) {
        self.members = members.to_vec();
    }

    fn global(&self, r: usize) -> usize {
        self.members.get(r).copied().unwrap_or(r)
    }

    /// The global rank of every group rank.
    pub(crate) fn members(&self) -> Vec<usize> {
        (0..self.size()).map(|r| self.global(r)).collect()
    }

    /// [`super::answer_blame`] for this rank.
    fn answer_blame(&self, e: Error, late: usize, op: &'static str, w: &Waiting) -> Error {
        super::answer_blame(e, self.rank, self.global(self.rank), late, op, w)
    }

    /// [`super::follow_blame`] over this mesh's streams.
    pub(crate) fn follow_blame(
        &self,
        e: Error,
        timeout: Duration,
        name: &str,
        call: &'static str,
    ) -> Error {
        super::follow_blame(
            e,
            self.rank,
            &self.members(),
            timeout,
            name,
            call,
            |x, until| self.await_notice(x, until),
        )
    }

    /// Reads `peer`'s stream (this rank is failing: the bytes are discarded)
    /// until it ends or `deadline` passes; the notice it ended with.
    fn await_notice(&self, peer: usize, deadline: Instant) -> Option<(usize, Cause)> {
        match self.read_to_end(peer, deadline) {
            Ok(false) => None,
            Ok(true) | Err(_) => decode_notice(&self.tails[peer].get()),
        }
    }

    /// Reads and discards `peer`'s stream, remembering its last bytes, until
    /// it ends (true) or `deadline` passes (false).
    fn read_to_end(&self, peer: usize, deadline: Instant) -> std::io::Result<bool> {
        let Some(fd) = self.fd(peer) else {
            return Ok(true);
        };
        let mut scratch = vec![0u8; 64 << 10];
        loop {
            match sys::recv_now(fd, &mut scratch) {
                Ok(0) => return Ok(true),
                Ok(n) => self.note_tail(peer, &scratch[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(false);
                    }
                    let mut p = [libc::pollfd {
                        fd,
                        events: libc::POLLIN | libc::POLLRDHUP,
                        revents: 0,
                    }];
                    let _ = sys::poll(&mut p, left.min(Duration::from_millis(5)));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The failure flag of the communicator this mesh belongs to.
    pub fn wire(&self) -> &Arc<Tripwire> {
        &self.wire
    }

    /// The descriptor `peer` has sent for an operation this rank has not
    /// joined yet, read without consuming it: `Ok(None)` while fewer bytes
    /// than a descriptor wait; an error when the stream is closed or the
    /// bytes are not a descriptor. Never blocks.
    pub fn peek_desc(&self, peer: usize, op: &'static str) -> Result<Option<OpDesc>> {
        let fd = self.stream(peer)?.as_raw_fd();
        let mut b = [0u8; DESC_WORDS * 8];
        let n = match crate::sys::peek_now(fd, &mut b) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(Error::io("peeking at a peer's message", e)),
        };
        if n == 0 {
            return Err(Error::lost(
                self.rank,
                peer,
                op,
                crate::error::Cause::Exited,
                "",
            ));
        }
        if n < b.len() {
            return Ok(None);
        }
        self.decode_desc(peer, &b).map(Some)
    }

    /// The descriptor `peer` sent as `bytes` (`DESC_WORDS` little-endian words).
    fn decode_desc(&self, peer: usize, bytes: &[u8]) -> Result<OpDesc> {
        let mut w = [0u64; DESC_WORDS];
        for (x, c) in w.iter_mut().zip(bytes.chunks_exact(8)) {
            *x = u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
        }
        OpDesc::decode(&w).ok_or_else(|| Error::Mismatch {
            rank: self.rank,
            detail: format!("rank {peer} sent an unreadable operation descriptor"),
        })
    }

    /// Waits (up to `timeout` without a byte) until `peer` has sent the
    /// descriptor of an operation this rank has not joined yet, and returns
    /// it without consuming it.
    pub fn wait_desc(&self, peer: usize, op: &'static str, timeout: Duration) -> Result<OpDesc> {
        let fd = self.stream(peer)?.as_raw_fd();
        let start = Instant::now();
        loop {
            if let Some(d) = self.peek_desc(peer, op)? {
                return Ok(d);
            }
            if self.wire.tripped() {
                return Err(self.wire.fault());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::timeout(self.rank, peer, op, waited));
            }
            let mut p = [libc::pollfd {
                fd,
                events: libc::POLLIN | libc::POLLRDHUP,
                revents: 0,
            }];
            // A slice at a time, so an abort of this rank is seen promptly;
            // part of a descriptor already waiting makes poll return at once.
            crate::sys::poll(&mut p, (timeout - waited).min(Duration::from_millis(5)))?;
            if p[0].revents & libc::POLLIN != 0 && self.peek_desc(peer, op)?.is_none() {
                std::thread::yield_now(); // the rest of the descriptor is on its way
            }
        }
    }

    /// The peers with a stream, and a pollfd watching each for a hang-up
    /// (same order).
    fn hangup_pollfds(&self) -> (Vec<usize>, Vec<libc::pollfd>) {
        (0..self.size())
            .filter(|&p| p != self.rank)
            .filter_map(|p| {
                self.fd(p).map(|fd| {
                    let watch = libc::pollfd {
                        fd,
                        events: libc::POLLRDHUP,
                        revents: 0,
                    };
                    (p, watch)
                })
            })
            .unzip()
    }

    /// Raw fd of the stream to `peer` (for liveness checks).
    pub fn fd(&self, peer: usize) -> Option<RawFd> {
        self.streams.get(peer)?.get().map(|s| s.as_raw_fd())
    }

    fn stream(&self, peer: usize) -> Result<&TcpStream> {
        self.streams.get(peer).and_then(|s| s.get()).ok_or_else(|| {
            Error::InvalidArgument(format!("rank {}: no stream to rank {peer}", self.rank))
        })
    }

    /// Runs every transfer to completion. Fails with `Timeout` when no byte
    /// moves for `timeout`, and with `PeerLost` when a peer closes its stream.
    pub fn transfer(
        &self,
        xfers: &mut [Xfer<'_>],
        op: &'static str,
        timeout: Duration,
    ) -> Result<()> {
        self.transfer_with(xfers, op, timeout, |_| Ok(()))
    }

    /// `transfer`, calling `after(xfers)` whenever bytes moved (and once at
    /// the end), so the caller can work on data as it arrives (a ring step
    /// reduces the received prefix while the rest is still in flight).
    pub fn transfer_with(
        &self,
        xfers: &mut [Xfer<'_>],
        op: &'static str,
        timeout: Duration,
        after: impl FnMut(&[Xfer<'_>]) -> Result<()>,
    ) -> Result<()> {
        self.drive(xfers, op, timeout, after, |x| x.iter().all(Xfer::finished))
    }

    /// Moves the transfers until `until(xfers)` holds; the others keep what
    /// they moved (`Xfer::done`), so a later call can go on with them. Used
    /// to let the next piece's send start while this piece's data arrives.
    pub fn transfer_until(
        &self,
        xfers: &mut [Xfer<'_>],
        op: &'static str,
        timeout: Duration,
        until: impl Fn(&[Xfer<'_>]) -> bool,
    ) -> Result<()> {
        self.drive(xfers, op, timeout, |_| Ok(()), until)
    }

    /// The loop behind `transfer_with` and `transfer_until`. Transfers on
    /// the same stream (peer and direction) go in list order.
    fn drive(
        &self,
        xfers: &mut [Xfer<'_>],
        op: &'static str,
        timeout: Duration,
        mut after: impl FnMut(&[Xfer<'_>]) -> Result<()>,
        until: impl Fn(&[Xfer<'_>]) -> bool,
    ) -> Result<()> {
        self.dial_lower(xfers, op, timeout)?;
        let eligible = |xfers: &[Xfer<'_>], i: usize| {
            !xfers[i].finished()
                && self.connected(xfers[i].peer())
                && !xfers[..i]
                    .iter()
                    .any(|y| !y.finished() && y.same_stream(&xfers[i]))
        };
        // a peer that has not connected yet (it is higher: it dials)
        let unconnected = |xfers: &[Xfer<'_>]| {
            xfers
                .iter()
                .find(|x| !x.finished() && !self.connected(x.peer()))
                .map(Xfer::peer)
        };
        let mut last_probe = Instant::now();
        let mut w = Waiting::new(timeout);
        w.stalled = self.stopped_since_last_turn();
        let late = |xfers: &[Xfer<'_>]| {
            xfers
                .iter()
                .find(|x| !x.finished())
                .map_or(self.rank, Xfer::peer)
        };
        loop {
            if self.wire.tripped() {
                return Err(self.wire.fault());
            }
            w.tick();
            self.last_turn.set(Some((Instant::now(), w.grace)));
            if w.stalled {
                self.stalled.set(true);
            }
            let mut progressed = false;
            if self.lazy.is_some() && unconnected(xfers).is_some() {
                progressed |= self.accept_higher(timeout)?;
            }
            for i in 0..xfers.len() {
                if !eligible(xfers, i) {
                    continue;
                }
                match self.progress(&mut xfers[i], op) {
                    Ok(moved) => progressed |= moved,
                    Err(e) => return Err(self.answer_blame(e, late(xfers), op, &w)),
                }
            }
            if progressed {
                after(xfers)?;
            }
            if until(xfers) {
                return Ok(());
            }
            if progressed {
                w.progressed();
            } else if w.since.elapsed() >= timeout {
                return Err(self.settle(late(xfers), op, timeout, w));
            }
            if !progressed {
                let waiting_for = unconnected(xfers);
                if let Some(peer) = waiting_for {
                    // one that died before it connected refuses the probe
                    if w.since.elapsed() >= PROBE_AFTER && last_probe.elapsed() >= PROBE_AFTER {
                        last_probe = Instant::now();
                        self.probe(peer, op)?;
                    }
                }
                let pending: Vec<&Xfer> = (0..xfers.len())
                    .filter(|&i| eligible(xfers, i))
                    .map(|i| &xfers[i])
                    .collect();
                let mut fds: Vec<libc::pollfd> = Vec::with_capacity(pending.len() + 1);
                for x in &pending {
                    let events = match x {
                        Xfer::Send { .. } => libc::POLLOUT,
                        Xfer::Recv { .. } => libc::POLLIN,
                    };
                    fds.push(libc::pollfd {
                        fd: self.stream(x.peer())?.as_raw_fd(),
                        events: events | libc::POLLRDHUP,
                        revents: 0,
                    });
                }
                let watched = fds.len();
                if waiting_for.is_some() {
                    fds.extend(self.accept_pollfds());
                }
                let left = timeout.saturating_sub(w.since.elapsed());
                sys::poll(&mut fds, left.min(POLL_SLICE))?;
                if fds.iter().all(|p| p.revents == 0) {
                    crate::fault::check_interrupt(self.rank)?;
                }
                fds.truncate(watched);
                // A peer we only send to hung up: it gave up or died. (A
                // pending receive finds out by reading to the end.)
                for (x, p) in pending.iter().zip(&fds) {
                    let peer = x.peer();
                    let receiving = pending
                        .iter()
                        .any(|y| matches!(y, Xfer::Recv { .. }) && y.peer() == peer);
                    if p.revents & HANGUP != 0 && !receiving {
                        let e = self.drain_error(peer, op);
                        return Err(self.answer_blame(e, late(xfers), op, &w));
                    }
                }
            }
        }
    }

    /// Remembers the last bytes received from `peer`.
    fn note_tail(&self, peer: usize, got: &[u8]) {
        let mut t = self.tails[peer].get();
        if got.len() >= NOTICE_BYTES {
            t.copy_from_slice(&got[got.len() - NOTICE_BYTES..]);
        } else {
            t.copy_within(got.len().., 0);
            t[NOTICE_BYTES - got.len()..].copy_from_slice(got);
        }
        self.tails[peer].set(t);
    }

    /// The error for `peer`'s stream having ended: its notice names the
    /// culprit; without one, its process is gone.
    fn closed_error(&self, peer: usize, op: &'static str) -> Error {
        if self.wire.tripped() {
            // This rank's own failure comes first: the peer may only be
            // reacting to it.
            return self.wire.fault();
        }
        match decode_notice(&self.tails[peer].get()) {
            Some((culprit, cause)) => Error::from_notice(self.rank, peer, op, culprit, cause),
            None => Error::lost(
                self.rank,
                peer,
                op,
                Cause::Exited,
                "its connection closed without notice",
            ),
        }
    }

    /// Reads what is left of `peer`'s stream (we are failing anyway) up to
    /// its end, then explains the end.
    fn drain_error(&self, peer: usize, op: &'static str) -> Error {
        if self.fd(peer).is_none() {
            return Error::lost(self.rank, peer, op, Cause::Exited, "");
        }
        match self.read_to_end(peer, Instant::now() + Duration::from_millis(500)) {
            Ok(_) => self.closed_error(peer, op),
            Err(e) => self.io_lost(peer, op, e),
        }
    }

    /// The error for a failed write to `peer`: the network, or the peer
    /// closed (what it sent last, still queued for us, may explain why).
    fn send_failed(&self, peer: usize, op: &'static str, e: std::io::Error) -> Error {
        match self.io_lost(peer, op, e) {
            e @ Error::PeerLost {
                cause: Cause::Unreachable,
                ..
            } => e,
            _ => self.drain_error(peer, op),
        }
    }

    /// The error for a failed read or write on `peer`'s stream.
    fn io_lost(&self, peer: usize, op: &'static str, e: std::io::Error) -> Error {
        let unreachable = matches!(
            e.raw_os_error(),
            Some(libc::ETIMEDOUT | libc::EHOSTUNREACH | libc::ENETUNREACH | libc::ENETDOWN)
        );
        if unreachable {
            return Error::lost(self.rank, peer, op, Cause::Unreachable, e.to_string());
        }
        if decode_notice(&self.tails[peer].get()).is_some() {
            return self.closed_error(peer, op);
        }
        Error::lost(self.rank, peer, op, Cause::Exited, e.to_string())
    }

    /// Decides whom to blame after `late` moved no byte within the timeout:
    /// a peer that gives up meanwhile (the rank `late` itself waits for may
    /// time out a moment later and send the real culprit), else `late`,
    /// unreachable when data sent to it goes unacknowledged.
    fn settle(&self, late: usize, op: &'static str, waited: Duration, mut w: Waiting) -> Error {
        let deadline = Instant::now() + grace(waited);
        loop {
            if self.wire.tripped() {
                return self.wire.fault();
            }
            w.tick();
            let (peers, mut fds) = self.hangup_pollfds();
            let left = deadline.saturating_duration_since(Instant::now());
            if sys::poll(&mut fds, left.min(POLL_SLICE)).is_err() {
                break;
            }
            if let Some(i) = fds.iter().position(|p| p.revents & HANGUP != 0) {
                let e = self.drain_error(peers[i], op);
                return self.answer_blame(e, late, op, &w);
            }
            if left.is_zero() {
                break;
            }
        }
        match self.fd(late) {
            Some(fd) if sys::tcp_retransmitting(fd) => Error::lost(
                self.rank,
                late,
                op,
                Cause::Unreachable,
                format!(
                    "data sent to it was not acknowledged for {:.1} s",
                    waited.as_secs_f64()
                ),
            ),
            _ => Error::timeout(self.rank, late, op, waited),
        }
    }

    /// After an operation: fails if a peer gave up meanwhile, so that a rank
    /// resumed after being stopped never returns data its peers abandoned. A
    /// peer that finished and shut down normally (or died after doing its
    /// part) is no failure of this operation.
    pub fn check_peers(&self, op: &'static str) -> Result<()> {
        self.stopped_since_last_turn();
        let stalled = self.stalled.replace(false);
        self.last_turn.set(None);
        let (peers, mut fds) = self.hangup_pollfds();
        sys::poll(&mut fds, Duration::ZERO)?;
        for (i, p) in fds.iter().enumerate() {
            if p.revents & HANGUP != 0 {
                match self.drain_error(peers[i], op) {
                    // Only an abort notice fails a finished operation: a peer
                    // that left (or whose end came without a notice) did its
                    // part; the next operation with it will find out.
                    e @ (Error::Timeout { via: Some(_), .. }
                    | Error::PeerLost { via: Some(_), .. })
                        if !matches!(
                            e,
                            Error::PeerLost {
                                cause: Cause::Left,
                                ..
                            }
                        ) =>
                    {
                        let me = self.global(self.rank);
                        return Err(super::answer_blame_after(e, self.rank, me, op, stalled));
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// True (and remembered until `check_peers`) when more than the grace
    /// went by since the current operation's last turn of a wait: this
    /// process was stopped between its waits.
    fn stopped_since_last_turn(&self) -> bool {
        let gap = self
            .last_turn
            .get()
            .is_some_and(|(t, grace)| t.elapsed() >= grace);
        if gap {
            self.stalled.set(true);
        }
        gap
    }

    /// Moves as many bytes as the socket takes now; true if any moved.
    fn progress(&self, x: &mut Xfer<'_>, op: &'static str) -> Result<bool> {
        let mut moved = false;
        match x {
            Xfer::Send { peer, buf, done } => {
                let mut s = self.stream(*peer)?;
                while *done < buf.len() {
                    match s.write(&buf[*done..]) {
                        Ok(0) => return Err(self.io_lost(*peer, op, ErrorKind::WriteZero.into())),
                        Ok(n) => {
                            *done += n;
                            moved = true;
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) => return Err(self.send_failed(*peer, op, e)),
                    }
                }
            }
            Xfer::Recv { peer, buf, done } => {
                let mut s = self.stream(*peer)?;
                while *done < buf.len() {
                    match s.read(&mut buf[*done..]) {
                        Ok(0) => return Err(self.closed_error(*peer, op)),
                        Ok(n) => {
                            self.note_tail(*peer, &buf[*done..*done + n]);
                            *done += n;
                            moved = true;
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) => return Err(self.io_lost(*peer, op, e)),
                    }
                }
            }
        }
        Ok(moved)
    }

    /// Number of ranks in the mesh.
    pub fn size(&self) -> usize {
        self.streams.len()
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Agreement check: every rank learns whether all ranks called the same
    /// collective, and all fail together, with the same message, when they
    /// did not. It is also a barrier: no rank returns before every rank has
    /// entered it.
    ///
    /// Up to `FULL_EXCHANGE_UP_TO` ranks, every rank sends its descriptor to
    /// every other rank. Above that, the ranks first all-reduce the (min,
    /// max) of their descriptors' digests by recursive doubling (see
    /// [`doubling_peers`]): log2 p rounds of one 16-byte message each when p
    /// is a power of two, at most ⌈log2 p⌉ + 1 otherwise, exchanged with the
    /// same ⌈log2 p⌉ or so peers as the small all-reduce's, so an agreeing
    /// collective opens no stream its data would not. Equal bounds: all
    /// agree. Otherwise every rank knows it, and all exchange their full
    /// descriptors as above, to name the ranks that disagree.
    pub fn agree(&self, desc: &OpDesc, timeout: Duration) -> Result<()> {
        if self.size() > FULL_EXCHANGE_UP_TO {
            let (lo, hi) = self.digest_bounds(desc, timeout)?;
            if lo == hi {
                return Ok(());
            }
        }
        self.exchange_descs(desc, timeout)
    }

    /// The least and greatest digest of every rank's descriptor, the same
    /// on every rank: a recursive-doubling all-reduce of the pair (min and
    /// max are exact and commutative, so every rank ends with the same
    /// bounds whatever the order).
    fn digest_bounds(&self, desc: &OpDesc, timeout: Duration) -> Result<(u64, u64)> {
        let what = desc.kind.name();
        let mut bounds = (desc.digest(), desc.digest());
        let steps = doubling_peers(self.size(), self.rank);
        // Every lower partner is dialed before the first step (a dial never
        // waits): a rank stuck in an early step, waiting for a rank that
        // does not come, still has streams to its later partners, so they
        // read its notice when it fails and follow the blame to that rank
        // instead of naming it.
        self.dial_peers(steps.iter().map(|s| s.peer()), what, timeout)?;
        for (i, step) in steps.into_iter().enumerate() {
            let mine = encode_bounds(bounds);
            let mut theirs = [0u8; 16];
            let done = match step {
                Step::Swap(peer) => self.transfer(
                    &mut [Xfer::send(peer, &mine), Xfer::recv(peer, &mut theirs)],
                    what,
                    timeout,
                ),
                Step::Give(peer) => self.transfer(&mut [Xfer::send(peer, &mine)], what, timeout),
                Step::Take(peer) => {
                    self.transfer(&mut [Xfer::recv(peer, &mut theirs)], what, timeout)
                }
            };
            if let Err(e) = done {
                return Err(self.chained(e, i, step.peer(), what, timeout));
            }
            let got = !matches!(step, Step::Give(_));
            if !matches!(step, Step::Take(_)) {
                self.agree_sent.set(self.agree_sent.get() + 1);
            }
            if got {
                let (lo, hi) = decode_bounds(&theirs);
                bounds = (bounds.0.min(lo), bounds.1.max(hi));
            }
        }
        Ok(bounds)
    }

    /// The error of an agreement step that failed. Past the first step, a
    /// partner that never sent may be waiting itself, in an earlier step,
    /// for a rank that does not come (its own partners then time out a
    /// little before this rank does): this rank's own timeout waits up to
    /// one more grace for the partner's notice and, when it names another
    /// rank, reports that one, as the partner's peers do, so that the
    /// verdict this rank tells its own peers is the end of the chain.
    fn chained(
        &self,
        e: Error,
        step: usize,
        peer: usize,
        what: &'static str,
        timeout: Duration,
    ) -> Error {
        let first_hand = matches!(&e, Error::Timeout { via: None, .. });
        if step == 0 || !first_hand || self.wire.tripped() || !self.connected(peer) {
            return e;
        }
        let me = self.global(self.rank);
        match self.await_notice(peer, Instant::now() + grace(timeout)) {
            Some((culprit, cause)) if culprit != me => {
                Error::from_notice(self.rank, peer, what, culprit, cause)
            }
            _ => e,
        }
    }

    /// Every rank sends its descriptor to every other rank, so all ranks see
    /// all descriptors and fail together on a mismatch.
    fn exchange_descs(&self, desc: &OpDesc, timeout: Duration) -> Result<()> {
        let mine: Vec<u8> = desc.encode().iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut theirs = vec![vec![0u8; DESC_WORDS * 8]; self.size()];
        {
            let mut x: Vec<Xfer> = Vec::with_capacity(2 * self.size());
            for (peer, buf) in theirs
                .iter_mut()
                .enumerate()
                .filter(|(p, _)| *p != self.rank)
            {
                x.push(Xfer::send(peer, &mine));
                x.push(Xfer::recv(peer, buf));
            }
            self.transfer(&mut x, desc.kind.name(), timeout)?;
        }
        let sent = self.size().saturating_sub(1) as u64;
        self.agree_sent.set(self.agree_sent.get() + sent);
        let mut all = Vec::with_capacity(self.size());
        for (peer, buf) in theirs.iter().enumerate() {
            if peer == self.rank {
                all.push(*desc);
                continue;
            }
            all.push(self.decode_desc(peer, buf)?);
        }
        check_agreement(self.rank, &all)
    }

    /// Messages this rank has sent in agreement checks so far (a count for
    /// tests and benchmarks).
    pub fn agree_messages(&self) -> u64 {
        self.agree_sent.get()
    }

    /// Shuts every stream down so that peers blocked on us fail fast.
    pub fn shutdown(&self) {
        for s in self.streams.iter().filter_map(OnceCell::get) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// One step of a recursive-doubling all-reduce, as this rank sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Send this rank's value to the peer and receive the peer's.
    Swap(usize),
    /// Only send (a rank folded into its partner, or the result handed back).
    Give(usize),
    /// Only receive.
    Take(usize),
}

/// The steps of rank `me` in a recursive-doubling all-reduce over `p`
/// ranks, the same pairing as the small TCP all-reduce's: with `q` the
/// largest power of two not above `p`, the first `2(p - q)` ranks pair up
/// (even with odd) and the even one folds its value into the odd one
/// (`Give`, then `Take` of the result at the end); the `q` remaining
/// participants swap with the participant whose index differs in bit k, for
/// each k. The peers are rank xor 2^k when p is a power of two: ⌈log2 p⌉ or
/// so distinct streams, whatever the collective that needs them.
pub(crate) fn doubling_peers(p: usize, me: usize) -> Vec<Step> {
    if p < 2 {
        return Vec::new();
    }
    let q = 1usize << (usize::BITS - 1 - p.leading_zeros());
    let extra = p - q;
    let holder = |i: usize| if i < extra { 2 * i + 1 } else { i + extra };
    let mut steps = Vec::new();
    if me < 2 * extra {
        if me.is_multiple_of(2) {
            return vec![Step::Give(me + 1), Step::Take(me + 1)];
        }
        steps.push(Step::Take(me - 1));
    }
    let i = if me < 2 * extra { me / 2 } else { me - extra };
    let mut mask = 1;
    while mask < q {
        steps.push(Step::Swap(holder(i ^ mask)));
        mask <<= 1;
    }
    if me < 2 * extra {
        steps.push(Step::Give(me - 1));
    }
    steps
}

impl Step {
    pub(crate) fn peer(&self) -> usize {
        match *self {
            Step::Swap(p) | Step::Give(p) | Step::Take(p) => p,
        }
    }
}

fn encode_bounds((lo, hi): (u64, u64)) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&lo.to_le_bytes());
    b[8..].copy_from_slice(&hi.to_le_bytes());
    b
}

fn decode_bounds(b: &[u8; 16]) -> (u64, u64) {
    let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
    (word(0), word(8))
}

fn dial(rank: usize, peer: usize, addr: &str, deadline: Instant) -> Result<TcpStream> {
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

/// Sends the hello that identifies this rank on a new connection.
fn say_hello(s: &TcpStream, token: u64, rank: usize) -> std::io::Result<()> {
    let mut hello = Vec::with_capacity(HELLO_BYTES);
    for w in [HELLO_MAGIC, token, rank as u64] {
        hello.extend_from_slice(&w.to_le_bytes());
    }
    let mut s = s;
    s.write_all(&hello)
}

/// Sets a new stream up for transfers: no Nagle delay, non-blocking, and
/// unacknowledged data fails it after `timeout`.
fn ready(s: &TcpStream, timeout: Duration) -> Result<()> {
    s.set_nodelay(true)
        .map_err(|e| Error::io("set_nodelay", e))?;
    s.set_read_timeout(None)
        .map_err(|e| Error::io("set_read_timeout", e))?;
    s.set_nonblocking(true)
        .map_err(|e| Error::io("set_nonblocking", e))?;
    sys::set_tcp_user_timeout(s.as_raw_fd(), timeout);
    Ok(())
}

fn peer_lost(rank: usize, peer: usize, op: &'static str, e: std::io::Error) -> Error {
    Error::lost(rank, peer, op, Cause::Exited, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{DType, ReduceOp};
    use crate::transport::OpKind;

    /// A mesh of `p` ranks on loopback, one per thread, each running
    /// `f(rank, mesh)`: the full mesh (`lazy` false) or streams on demand;
    /// the results in rank order.
    fn meshes_of<T: Send>(p: usize, lazy: bool, f: impl Fn(usize, &TcpMesh) -> T + Sync) -> Vec<T> {
        let listeners: Vec<TcpListener> = (0..p)
            .map(|_| listen("127.0.0.1:0").expect("listen"))
            .collect();
        let addrs: Vec<String> = listeners
            .iter()
            .map(|l| l.local_addr().expect("local_addr").to_string())
            .collect();
        let token = 0xa9ee_u64 ^ std::process::id() as u64;
        let f = &f;
        std::thread::scope(|s| {
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(rank, l)| {
                    let addrs = &addrs;
                    s.spawn(move || {
                        let mesh = if lazy {
                            TcpMesh::connect_lazily(rank, addrs, &l, token)
                        } else {
                            TcpMesh::connect(rank, addrs, &l, token, Duration::from_secs(20))
                        }
                        .expect("connect");
                        drop(l); // the mesh keeps what it needs
                        f(rank, &mesh)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
                .collect()
        })
    }

    fn call(seq: u64) -> OpDesc {
        OpDesc {
            seq,
            kind: OpKind::AllReduce,
            dtype: DType::F32,
            op: Some(ReduceOp::Sum),
            count: 1024,
            root: 0,
            addr: 0,
        }
    }

    /// The distinct peers of `rank`'s recursive-doubling steps.
    fn doubling_partners(p: usize, rank: usize) -> Vec<usize> {
        let mut v: Vec<usize> = doubling_peers(p, rank)
            .into_iter()
            .map(|s| match s {
                Step::Swap(x) | Step::Give(x) | Step::Take(x) => x,
            })
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    #[test]
    fn doubling_steps_pair_up_and_reach_every_rank() {
        for p in 2..=33 {
            // every send has its receive on the peer, in the same order
            let steps: Vec<Vec<Step>> = (0..p).map(|r| doubling_peers(p, r)).collect();
            for (r, mine) in steps.iter().enumerate() {
                for (k, s) in mine.iter().enumerate() {
                    let (peer, want) = match *s {
                        Step::Swap(x) => (x, Step::Swap(r)),
                        Step::Give(x) => (x, Step::Take(r)),
                        Step::Take(x) => (x, Step::Give(r)),
                    };
                    let theirs: Vec<&Step> = steps[peer].iter().filter(|t| **t == want).collect();
                    assert_eq!(theirs.len(), 1, "p={p} rank {r} step {k}");
                }
            }
            // a simulation: the ranks whose value each rank holds
            let mut held: Vec<std::collections::BTreeSet<usize>> =
                (0..p).map(|r| std::iter::once(r).collect()).collect();
            let mut pos = vec![0usize; p];
            loop {
                let mut moved = false;
                for r in 0..p {
                    let Some(&s) = steps[r].get(pos[r]) else {
                        continue;
                    };
                    let peer = match s {
                        Step::Swap(x) | Step::Give(x) | Step::Take(x) => x,
                    };
                    let Some(&t) = steps[peer].get(pos[peer]) else {
                        continue;
                    };
                    let back = match t {
                        Step::Swap(x) | Step::Give(x) | Step::Take(x) => x,
                    };
                    if back != r || peer < r && matches!(s, Step::Swap(_)) {
                        continue;
                    }
                    match (s, t) {
                        (Step::Swap(_), Step::Swap(_)) => {
                            let u: std::collections::BTreeSet<usize> =
                                held[r].union(&held[peer]).copied().collect();
                            held[r] = u.clone();
                            held[peer] = u;
                        }
                        (Step::Give(_), Step::Take(_)) => {
                            let u = held[r].clone();
                            held[peer].extend(u);
                        }
                        (Step::Take(_), Step::Give(_)) => continue,
                        _ => panic!("p={p}: rank {r} {s:?} meets rank {peer} {t:?}"),
                    }
                    pos[r] += 1;
                    pos[peer] += 1;
                    moved = true;
                }
                if !moved {
                    break;
                }
            }
            for r in 0..p {
                assert_eq!(pos[r], steps[r].len(), "p={p}: rank {r} stuck");
                assert_eq!(held[r].len(), p, "p={p}: rank {r} holds {:?}", held[r]);
                let sends = steps[r]
                    .iter()
                    .filter(|s| !matches!(s, Step::Take(_)))
                    .count() as u64;
                assert!(sends <= log2_ceil(p) + 1, "p={p} rank {r}: {sends} sends");
            }
        }
    }

    fn log2_ceil(p: usize) -> u64 {
        u64::from(usize::BITS - (p - 1).leading_zeros())
    }

    #[test]
    fn agreement_takes_log_p_messages_and_names_who_disagrees() {
        agreement_in_log_p(false);
    }

    #[test]
    fn agreement_on_streams_opened_on_demand() {
        agreement_in_log_p(true);
    }

    fn agreement_in_log_p(lazy: bool) {
        let timeout = Duration::from_secs(20);
        for p in (2..=9).chain([16]) {
            // the descriptors of three calls: all agree; rank p-1 disagrees;
            // ranks 1 and p-1 disagree (in two ways); then all agree again
            let calls = |rank: usize| -> Vec<OpDesc> {
                let odd = |d: OpDesc, who: &[usize], how: OpDesc| {
                    if who.contains(&rank) {
                        how
                    } else {
                        d
                    }
                };
                vec![
                    // only the address (each rank's own) differs
                    OpDesc {
                        addr: 0x1000 * rank as u64,
                        ..call(1)
                    },
                    odd(
                        call(2),
                        &[p - 1],
                        OpDesc {
                            count: 7,
                            ..call(2)
                        },
                    ),
                    odd(
                        odd(
                            call(3),
                            &[1],
                            OpDesc {
                                dtype: DType::BF16,
                                ..call(3)
                            },
                        ),
                        &[p - 1],
                        OpDesc {
                            kind: OpKind::Broadcast,
                            op: None,
                            ..call(3)
                        },
                    ),
                    call(4),
                ]
            };
            let out = meshes_of(p, lazy, |rank, mesh| {
                let mut results = Vec::new();
                let mut sent = Vec::new();
                let mut streams = vec![mesh.open_streams()];
                for d in calls(rank) {
                    let before = mesh.agree_messages();
                    results.push(mesh.agree(&d, timeout));
                    sent.push(mesh.agree_messages() - before);
                    streams.push(mesh.open_streams());
                }
                (results, sent, streams)
            });
            for (rank, (results, sent, streams)) in out.iter().enumerate() {
                if lazy {
                    // none at creation; the doubling partners (rank xor 2^k
                    // for a power of two, else also the folding partner)
                    // after an agreeing call; every peer once a mismatch
                    // needed the full exchange
                    assert_eq!(streams[0], 0, "p={p}");
                    let partners: std::collections::BTreeSet<usize> = if p > FULL_EXCHANGE_UP_TO {
                        doubling_partners(p, rank).into_iter().collect()
                    } else {
                        (0..p).filter(|&q| q != rank).collect()
                    };
                    assert_eq!(streams[1], partners.len(), "p={p} rank {rank}");
                    assert!(partners.len() as u64 <= log2_ceil(p), "p={p} rank {rank}");
                    if p.is_power_of_two() {
                        let xor: std::collections::BTreeSet<usize> =
                            (0..log2_ceil(p)).map(|k| rank ^ (1 << k)).collect();
                        assert_eq!(partners, xor, "p={p} rank {rank}");
                    }
                    assert_eq!(streams[2], p - 1, "p={p}");
                }
                for (i, r) in results.iter().enumerate() {
                    // what the full exchange of descriptors raises
                    let all: Vec<OpDesc> = (0..p).map(|q| calls(q)[i]).collect();
                    let want = check_agreement(rank, &all);
                    assert_eq!(*r, want, "p={p} rank {rank} call {i}");
                }
                assert!(results[0].is_ok() && results[3].is_ok(), "p={p}");
                for (i, r) in results.iter().enumerate().skip(1).take(2) {
                    let Err(Error::Mismatch { detail, .. }) = r else {
                        panic!("p={p} rank {rank} call {i}: {r:?}");
                    };
                    assert!(
                        detail.contains(&format!("rank {} called", p - 1)),
                        "{detail}"
                    );
                }
                // agreeing calls: at most ⌈log2 p⌉ + 1 messages each
                for i in [0, 3] {
                    assert!(
                        sent[i] <= log2_ceil(p) + 1,
                        "p={p} rank {rank}: {} messages",
                        sent[i]
                    );
                }
                if p > FULL_EXCHANGE_UP_TO && p.is_power_of_two() {
                    assert_eq!(sent[0], log2_ceil(p), "p={p}");
                    // a mismatch then takes the full exchange, to name the ranks
                    assert_eq!(sent[1], log2_ceil(p) + p as u64 - 1, "p={p}");
                }
            }
        }
    }

    #[test]
    fn streams_open_on_demand_and_a_peer_gone_before_it_connected_is_named() {
        let t = Duration::from_secs(20);
        // an exchange in which every rank sends to every other, in the order
        // that makes each wait on peers that have not connected yet
        let out = meshes_of(6, true, |rank, mesh| {
            let mine: Vec<Vec<u8>> = (0..6)
                .map(|q| vec![(rank * 6 + q) as u8; 1 << 20])
                .collect();
            let mut theirs = vec![vec![0u8; 1 << 20]; 6];
            let mut x: Vec<Xfer> = Vec::new();
            for (q, b) in theirs
                .iter_mut()
                .enumerate()
                .rev()
                .filter(|(q, _)| *q != rank)
            {
                x.push(Xfer::recv(q, b));
            }
            for (q, b) in mine.iter().enumerate().filter(|(q, _)| *q != rank) {
                x.push(Xfer::send(q, b));
            }
            mesh.transfer(&mut x, "all_to_all", t).expect("all_to_all");
            drop(x);
            let ok = theirs
                .iter()
                .enumerate()
                .all(|(q, b)| q == rank || b.iter().all(|&v| v == (q * 6 + rank) as u8));
            (ok, mesh.open_streams())
        });
        assert!(out.iter().all(|&(ok, n)| ok && n == 5), "{out:?}");

        // rank 2 closes its mesh without ever connecting: ranks 0 and 1
        // (which wait for it to dial) learn it from the refused probe, rank 3
        // (which dials it) at once; none waits for the timeout
        let out = meshes_of(4, true, |rank, mesh| {
            let start = Instant::now();
            if rank == 2 {
                return (None, start.elapsed());
            }
            let mut b = [0u8; 8];
            let r = mesh.transfer(&mut [Xfer::recv(2, &mut b)], "broadcast", t);
            (Some(r), start.elapsed())
        });
        for (rank, (r, took)) in out.iter().enumerate() {
            let Some(r) = r else { continue };
            assert!(
                matches!(
                    r,
                    Err(Error::PeerLost {
                        peer: 2,
                        cause: Cause::Exited,
                        ..
                    })
                ),
                "rank {rank}: {r:?}"
            );
            assert!(*took < Duration::from_secs(5), "rank {rank}: {took:?}");
        }
    }

    #[test]
    fn many_peers_dialing_one_rank_at_once_all_get_through() {
        // 79 ranks dial rank 0 together, more than the hellos it keeps
        // waiting at once (MAX_PENDING_HELLOS): each hello is read as its
        // connection is accepted, so none is dropped for a later one
        let p = 80;
        let t = Duration::from_secs(30);
        let out = meshes_of(p, true, |rank, mesh| {
            if rank == 0 {
                let mut got = vec![[0u8; 8]; p];
                let mut x: Vec<Xfer> = got
                    .iter_mut()
                    .enumerate()
                    .skip(1)
                    .map(|(q, b)| Xfer::recv(q, b))
                    .collect();
                mesh.transfer(&mut x, "gather", t).expect("gather");
                drop(x);
                got.iter()
                    .enumerate()
                    .skip(1)
                    .all(|(q, b)| *b == (q as u64).to_le_bytes())
            } else {
                let mine = (rank as u64).to_le_bytes();
                mesh.transfer(&mut [Xfer::send(0, &mine)], "gather", t)
                    .is_ok()
            }
        });
        assert!(out.iter().all(|ok| *ok), "{out:?}");
    }
}
