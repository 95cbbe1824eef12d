//! The lobby of a listening socket that several meshes share.
//!
//! A process listens on one socket for all its groups (Python's runtime
//! hands every group the same listener), so the mesh that accepts a
//! connection is not always the one it is for: each hello names its group by
//! the group's token. Whichever mesh accepts reads the hello (without
//! blocking) and leaves the stream here, under the listening address and the
//! token; each mesh takes its own. A connection for a group this process has
//! not created yet (its peer got the table first) waits here until the group
//! registers, at most `UNKNOWN_PATIENCE`; one for a live group waits for as
//! long as the group lives, as it would have in a listener of its own.
//!
//! The lobby is process-wide and guarded by one mutex, held only while
//! non-blocking accepts and reads run (connections are made once per pair).

use super::{Hello, HelloState};
use crate::error::{Error, Result};
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Longest a connection whose group is not (yet) live here is kept.
const UNKNOWN_PATIENCE: Duration = Duration::from_secs(120);
/// Most connections kept for groups not live here (the oldest goes first).
const MAX_UNKNOWN: usize = 256;
/// Most connections whose hello is awaited at once (the oldest is dropped).
const MAX_PENDING_HELLOS: usize = 256;

/// A stream whose hello has arrived, until its mesh takes it.
struct Parked {
    at: SocketAddr,
    token: u64,
    peer: usize,
    stream: TcpStream,
    since: Instant,
}

struct Lobby {
    /// Accepted connections whose hello is on its way, by listening address.
    hellos: Vec<(SocketAddr, Hello)>,
    parked: Vec<Parked>,
    /// The meshes alive in this process: (listening address, token, count).
    live: Vec<(SocketAddr, u64, usize)>,
}

static LOBBY: Mutex<Lobby> = Mutex::new(Lobby {
    hellos: Vec::new(),
    parked: Vec::new(),
    live: Vec::new(),
});

fn lobby() -> MutexGuard<'static, Lobby> {
    // Nothing panics under the lock; a poisoned one still holds whole lists.
    LOBBY.lock().unwrap_or_else(|p| p.into_inner())
}

/// Marks the group `token` listening at `at` as alive in this process: its
/// connections are kept until it takes them.
pub(super) fn register(at: SocketAddr, token: u64) {
    let mut l = lobby();
    match l.live.iter_mut().find(|e| e.0 == at && e.1 == token) {
        Some(e) => e.2 += 1,
        None => l.live.push((at, token, 1)),
    }
}

/// The group `token` at `at` is gone (one mesh of it): once no mesh of it
/// is left, its connections still waiting here are closed.
pub(super) fn unregister(at: SocketAddr, token: u64) {
    let mut l = lobby();
    if let Some(i) = l.live.iter().position(|e| e.0 == at && e.1 == token) {
        l.live[i].2 -= 1;
        if l.live[i].2 == 0 {
            l.live.swap_remove(i);
            l.parked.retain(|p| !(p.at == at && p.token == token));
        }
    }
}

/// Accepts what waits on `listener` (listening at `at`), reads every hello
/// that has arrived, and returns the streams for group `token` as (the
/// dialer's rank, stream). Streams for other groups stay for them; bad
/// hellos (garbage, truncated, silent past the hello's patience) are closed.
pub(super) fn take(
    listener: &TcpListener,
    at: SocketAddr,
    token: u64,
) -> Result<Vec<(usize, TcpStream)>> {
    let mut l = lobby();
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                if s.set_nonblocking(true).is_err() {
                    continue;
                }
                if l.hellos.len() >= MAX_PENDING_HELLOS {
                    l.hellos.remove(0);
                }
                // A dialer sends its hello with the connection: it is read
                // below at once, so many peers dialing together never fill
                // the list of hellos still on their way.
                l.hellos.push((at, Hello::new(s)));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::ConnectionAborted => {}
            Err(e) => return Err(Error::io("accept", e)),
        }
    }
    let now = Instant::now();
    let mut i = 0;
    while i < l.hellos.len() {
        match l.hellos[i].1.progress() {
            HelloState::Waiting => i += 1,
            HelloState::Rejected => {
                l.hellos.swap_remove(i);
            }
            HelloState::Done { token, peer } => {
                let (at, h) = l.hellos.swap_remove(i);
                l.parked.push(Parked {
                    at,
                    token,
                    peer,
                    stream: h.stream,
                    since: now,
                });
            }
        }
    }
    // Connections for groups not live here expire, the oldest first.
    let Lobby { parked, live, .. } = &mut *l;
    let unknown = |p: &Parked| !live.iter().any(|e| e.0 == p.at && e.1 == p.token);
    parked.retain(|p| !(unknown(p) && now.duration_since(p.since) > UNKNOWN_PATIENCE));
    let mut extra = parked
        .iter()
        .filter(|p| unknown(p))
        .count()
        .saturating_sub(MAX_UNKNOWN);
    parked.retain(|p| {
        let drop = extra > 0 && unknown(p);
        extra -= usize::from(drop);
        !drop
    });
    let mut mine = Vec::new();
    let mut i = 0;
    while i < parked.len() {
        if parked[i].at == at && parked[i].token == token {
            let p = parked.remove(i);
            mine.push((p.peer, p.stream));
        } else {
            i += 1;
        }
    }
    Ok(mine)
}

/// The listener and the connections at `at` whose hello is awaited, to poll
/// while a transfer waits for a peer that has not connected yet.
pub(super) fn pollfds(listener: &TcpListener, at: SocketAddr) -> Vec<libc::pollfd> {
    let l = lobby();
    std::iter::once(listener.as_raw_fd())
        .chain(
            l.hellos
                .iter()
                .filter(|(a, _)| *a == at)
                .map(|(_, h)| h.stream.as_raw_fd()),
        )
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect()
}
