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
//!
//! Files by job: `handshake` (the hello, shared with the RPC agent),
//! `connect` (listening, dialling, accepting), `lobby` (connections accepted
//! on a listener shared by several groups), `transfer` (the poll loop and
//! its errors), `agree` (the agreement check), `tests`.

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

mod agree;
mod connect;
mod handshake;
mod lobby;
#[cfg(test)]
mod tests;
mod transfer;

use agree::*;
use connect::*;
use handshake::*;
use transfer::*;

pub use connect::listen;
pub(crate) use handshake::{hello_bytes, read_hello, RPC_MAGIC};
pub use transfer::Xfer;

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

impl Drop for TcpMesh {
    fn drop(&mut self) {
        if let Some(lazy) = &self.lazy {
            lobby::unregister(lazy.at, lazy.token);
        }
    }
}

fn peer_lost(rank: usize, peer: usize, op: &'static str, e: std::io::Error) -> Error {
    Error::lost(rank, peer, op, Cause::Exited, e.to_string())
}

impl TcpMesh {
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

    /// [`super::follow_blame`] over this mesh's streams (`revised` watches
    /// the boards a notice may be revised on: a stream's notice is final).
    pub(crate) fn follow_blame(
        &self,
        e: Error,
        timeout: Duration,
        name: &str,
        call: &'static str,
        revised: impl FnMut(usize, (usize, Cause), Instant) -> Option<(usize, Cause)>,
    ) -> Error {
        super::follow_blame(
            e,
            self.rank,
            &self.members(),
            timeout,
            name,
            call,
            |x, until| self.await_notice(x, until),
            revised,
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

    /// Number of ranks in the mesh.
    pub fn size(&self) -> usize {
        self.streams.len()
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Shuts every stream down so that peers blocked on us fail fast.
    pub fn shutdown(&self) {
        for s in self.streams.iter().filter_map(OnceCell::get) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}
