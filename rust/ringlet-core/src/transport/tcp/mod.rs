//! TCP transport: one stream per peer pair, set up from a table of listening
//! addresses, then used non-blocking. `transfer` drives any mix of sends and
//! receives to completion with one `poll` loop, so a ring step ("send to next
//! while receiving from previous") and an all-to-all exchange are the same call
//! and neither can deadlock on full socket buffers.

use crate::error::{Error, Result};
use crate::sys;
use crate::transport::{check_agreement, OpDesc, DESC_WORDS};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

const HELLO_MAGIC: u64 = 0x5249_4e47_4c45_5401; // "RINGLET\x01"
const POLL_SLICE: Duration = Duration::from_millis(100);

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

/// Full mesh of streams for one communicator.
pub struct TcpMesh {
    rank: usize,
    streams: Vec<Option<TcpStream>>,
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
            let mut hello = Vec::with_capacity(24);
            for w in [HELLO_MAGIC, token, rank as u64] {
                hello.extend_from_slice(&w.to_le_bytes());
            }
            (&s).write_all(&hello)
                .map_err(|e| peer_lost(rank, peer, "connect", e))?;
            streams[peer] = Some(s);
        }
        let mut missing = size - rank - 1;
        while missing > 0 {
            let (s, _) = match listener.accept() {
                Ok(pair) => pair,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let now = Instant::now();
                    if now >= deadline {
                        let peer = (rank + 1..size)
                            .find(|p| streams[*p].is_none())
                            .unwrap_or(rank);
                        return Err(Error::Timeout {
                            rank,
                            peer,
                            op: "init (connect)",
                            waited: timeout,
                        });
                    }
                    let mut p = [libc::pollfd {
                        fd: listener.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    }];
                    sys::poll(&mut p, (deadline - now).min(POLL_SLICE))?;
                    continue;
                }
                Err(e) => return Err(Error::io("accept", e)),
            };
            s.set_nonblocking(false)
                .map_err(|e| Error::io("set_nonblocking", e))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))
                .map_err(|e| Error::io("set_read_timeout", e))?;
            let mut hello = [0u8; 24];
            if (&s).read_exact(&mut hello).is_err() {
                continue; // not one of ours
            }
            let word =
                |i: usize| u64::from_le_bytes(hello[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            let (magic, tok, peer) = (word(0), word(1), word(2) as usize);
            if magic != HELLO_MAGIC
                || tok != token
                || peer <= rank
                || peer >= size
                || streams[peer].is_some()
            {
                continue;
            }
            streams[peer] = Some(s);
            missing -= 1;
        }
        for s in streams.iter().flatten() {
            s.set_nodelay(true)
                .map_err(|e| Error::io("set_nodelay", e))?;
            s.set_read_timeout(None)
                .map_err(|e| Error::io("set_read_timeout", e))?;
            s.set_nonblocking(true)
                .map_err(|e| Error::io("set_nonblocking", e))?;
        }
        Ok(TcpMesh { rank, streams })
    }

    /// Raw fd of the stream to `peer` (for liveness checks).
    pub fn fd(&self, peer: usize) -> Option<RawFd> {
        self.streams.get(peer)?.as_ref().map(|s| s.as_raw_fd())
    }

    fn stream(&self, peer: usize) -> Result<&TcpStream> {
        self.streams
            .get(peer)
            .and_then(|s| s.as_ref())
            .ok_or_else(|| {
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
        mut after: impl FnMut(&[Xfer<'_>]) -> Result<()>,
    ) -> Result<()> {
        let mut last_progress = Instant::now();
        loop {
            let mut progressed = false;
            for x in xfers.iter_mut() {
                progressed |= self.progress(x, op)?;
            }
            if progressed {
                after(xfers)?;
            }
            if xfers.iter().all(Xfer::finished) {
                return Ok(());
            }
            let now = Instant::now();
            if progressed {
                last_progress = now;
            } else if now.duration_since(last_progress) >= timeout {
                let peer = xfers
                    .iter()
                    .find(|x| !x.finished())
                    .map_or(self.rank, Xfer::peer);
                return Err(Error::Timeout {
                    rank: self.rank,
                    peer,
                    op,
                    waited: timeout,
                });
            }
            if !progressed {
                let mut fds: Vec<libc::pollfd> = Vec::with_capacity(xfers.len());
                for x in xfers.iter().filter(|x| !x.finished()) {
                    let events = match x {
                        Xfer::Send { .. } => libc::POLLOUT,
                        Xfer::Recv { .. } => libc::POLLIN,
                    };
                    fds.push(libc::pollfd {
                        fd: self.stream(x.peer())?.as_raw_fd(),
                        events,
                        revents: 0,
                    });
                }
                let left = timeout.saturating_sub(now.duration_since(last_progress));
                sys::poll(&mut fds, left.min(POLL_SLICE))?;
            }
        }
    }

    /// Moves as many bytes as the socket takes now; true if any moved.
    fn progress(&self, x: &mut Xfer<'_>, op: &'static str) -> Result<bool> {
        let rank = self.rank;
        let mut moved = false;
        match x {
            Xfer::Send { peer, buf, done } => {
                let mut s = self.stream(*peer)?;
                while *done < buf.len() {
                    match s.write(&buf[*done..]) {
                        Ok(0) => {
                            return Err(peer_lost(rank, *peer, op, ErrorKind::WriteZero.into()))
                        }
                        Ok(n) => {
                            *done += n;
                            moved = true;
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) => return Err(peer_lost(rank, *peer, op, e)),
                    }
                }
            }
            Xfer::Recv { peer, buf, done } => {
                let mut s = self.stream(*peer)?;
                while *done < buf.len() {
                    match s.read(&mut buf[*done..]) {
                        Ok(0) => {
                            return Err(Error::PeerLost {
                                rank,
                                peer: *peer,
                                op,
                                detail: "connection closed by the peer (process exited?)".into(),
                            })
                        }
                        Ok(n) => {
                            *done += n;
                            moved = true;
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) => return Err(peer_lost(rank, *peer, op, e)),
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

    /// Agreement check: every rank sends its descriptor to every other rank,
    /// so all ranks see all descriptors and fail together on a mismatch.
    pub fn agree(&self, desc: &OpDesc, timeout: Duration) -> Result<()> {
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
        let mut all = Vec::with_capacity(self.size());
        for (peer, buf) in theirs.iter().enumerate() {
            if peer == self.rank {
                all.push(*desc);
                continue;
            }
            let mut w = [0u64; DESC_WORDS];
            for (x, c) in w.iter_mut().zip(buf.chunks_exact(8)) {
                *x = u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
            }
            all.push(OpDesc::decode(&w).ok_or_else(|| Error::Mismatch {
                rank: self.rank,
                detail: format!("rank {peer} sent an unreadable operation descriptor"),
            })?);
        }
        check_agreement(self.rank, &all)
    }

    /// Shuts every stream down so that peers blocked on us fail fast.
    pub fn shutdown(&self) {
        for s in self.streams.iter().flatten() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn dial(rank: usize, peer: usize, addr: &str, deadline: Instant) -> Result<TcpStream> {
    let sa = resolve(addr)?;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout {
                rank,
                peer,
                op: "init (connect)",
                waited: Duration::ZERO,
            });
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

fn peer_lost(rank: usize, peer: usize, op: &'static str, e: std::io::Error) -> Error {
    Error::PeerLost {
        rank,
        peer,
        op,
        detail: e.to_string(),
    }
}
