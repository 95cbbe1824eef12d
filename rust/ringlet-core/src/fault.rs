//! Failure propagation: the tripwire of a communicator and abort notices.
//!
//! When a rank gives up on a communicator (a lost or late peer, an internal
//! error, `ringlet.abort()`), it *trips* the communicator's [`Tripwire`]:
//! the failure is recorded, and an abort notice naming the rank the failure
//! started from (the culprit) and what happened to it ([`Cause`]) is
//! published to every peer before the connections close: in its control
//! block for shared memory, as the last 32 bytes before the end of each TCP
//! stream. A peer that then fails reads the notice and names the culprit,
//! so the cause spreads instead of the symptom (the neighbour that gave up).
//!
//! Communicators of one rank that belong to the same job share a *domain*:
//! a failure in one trips all of them (two-level collectives, replica groups,
//! send/recv pairs and the bucket worker all learn the culprit), and
//! `abort_domain` (`ringlet.abort()`) trips them from any thread. A thread
//! blocked in a collective on a tripped communicator sees the flag within a
//! few milliseconds and raises.

use crate::error::{Cause, Error};
use crate::sys;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Bytes of an abort notice on a TCP stream.
pub(crate) const NOTICE_BYTES: usize = 32;
const NOTICE_HEAD: u64 = 0x5452_4241_474e_4952; // "RINGABRT"
const NOTICE_TAIL: u64 = !NOTICE_HEAD;

/// Encodes a TCP abort notice.
pub(crate) fn encode_notice(culprit: usize, cause: Cause) -> [u8; NOTICE_BYTES] {
    let mut out = [0u8; NOTICE_BYTES];
    for (i, w) in [NOTICE_HEAD, culprit as u64, cause.code(), NOTICE_TAIL]
        .into_iter()
        .enumerate()
    {
        out[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// Decodes the notice that ends a stream (`tail`: its last bytes).
pub(crate) fn decode_notice(tail: &[u8; NOTICE_BYTES]) -> Option<(usize, Cause)> {
    let w = |i: usize| u64::from_le_bytes(tail[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    if w(0) != NOTICE_HEAD || w(3) != NOTICE_TAIL {
        return None;
    }
    Some((usize::try_from(w(1)).ok()?, Cause::from_code(w(2))?))
}

/// A place besides the TCP streams where a [`Tripwire`] posts its notices:
/// the shared-memory control block (`transport::shm::Notifier`). Defined
/// here so that this module depends on no transport; called only on failure
/// and at shutdown.
pub(crate) trait NoticeBoard: Send + Sync {
    /// Publishes that the failure started at global rank `culprit` with
    /// `cause` (this rank has given up).
    fn publish(&self, culprit: usize, cause: Cause);

    /// Publishes that this rank (global `me`) shut the communicator down.
    fn leave(&self, me: usize);

    /// The notice global rank `rank` published here (`Some(None)`: it is on
    /// this board and has published none), or `None` when it is not on this
    /// board.
    fn notice_of(&self, rank: usize) -> Option<Option<(usize, Cause)>>;
}

#[derive(Default)]
struct Targets {
    /// Streams to every peer (owned by the transport, which closes them only
    /// after `close` has emptied this list).
    fds: Vec<RawFd>,
    shm: Option<Box<dyn NoticeBoard>>,
    closed: bool,
}

/// A communicator's failure flag, shared with other threads (`abort`) and
/// with the other communicators of its domain.
#[derive(Default)]
pub struct Tripwire {
    tripped: AtomicBool,
    followed: AtomicBool,
    fault: Mutex<Option<Error>>,
    targets: Mutex<Targets>,
}

impl Tripwire {
    /// A fresh, untripped wire with nothing to notify.
    pub fn new() -> Arc<Tripwire> {
        Arc::new(Tripwire::default())
    }

    /// Registers the TCP streams that carry abort notices to peers.
    pub(crate) fn add_streams(&self, fds: impl IntoIterator<Item = RawFd>) {
        if let Ok(mut t) = self.targets.lock() {
            t.fds.extend(fds);
        }
    }

    /// Registers the shared-memory control block that carries notices.
    pub(crate) fn set_shm(&self, board: impl NoticeBoard + 'static) {
        if let Ok(mut t) = self.targets.lock() {
            t.shm = Some(Box::new(board));
        }
    }

    /// True once tripped (by this communicator, its domain or `abort`).
    pub fn tripped(&self) -> bool {
        self.tripped.load(Ordering::Acquire)
    }

    /// The failure the wire was tripped with.
    pub fn fault(&self) -> Error {
        self.fault
            .lock()
            .ok()
            .and_then(|f| f.clone())
            .unwrap_or(Error::Aborted {
                rank: 0,
                reason: "the communicator was aborted".into(),
                origin: None,
            })
    }

    /// Records `fault` and tells every peer that the failure started at
    /// global rank `culprit` with `cause`. Only the first trip counts.
    pub fn trip(&self, fault: Error, culprit: usize, cause: Cause) {
        if self.arm(fault) {
            self.announce(culprit, cause);
        }
    }

    /// Settles the recorded failure after `Communicator::follow_blame`
    /// traced `old` back to `new` (global rank `culprit` with `cause`):
    /// `old` is replaced by `new` (another recorded failure is kept), and a
    /// wire holding `new` is marked followed, so that the other communicators
    /// of the rank raise it without tracing it again. The shared-memory
    /// notice is revised too: a peer that adopted the first verdict while its
    /// culprit lay beyond its own communicator (a rank on another host of a
    /// two-level collective) watches it for this.
    pub(crate) fn settle(&self, old: &Error, new: &Error, culprit: usize, cause: Cause) {
        let (revised, followed) = match self.fault.lock() {
            Ok(mut f) if f.as_ref() == Some(old) && old != new => {
                *f = Some(new.clone());
                (true, true)
            }
            Ok(f) => (false, f.as_ref() == Some(new)),
            Err(_) => (false, false),
        };
        if followed {
            self.followed.store(true, Ordering::Release);
        }
        if revised {
            if let Ok(t) = self.targets.lock() {
                if let (false, Some(shm)) = (t.closed, &t.shm) {
                    shm.publish(culprit, cause);
                }
            }
        }
    }

    /// True once the recorded failure was traced to the end of its chain of
    /// waits (here or by another communicator of the domain).
    pub(crate) fn followed(&self) -> bool {
        self.followed.load(Ordering::Acquire)
    }

    /// Records `fault` (the first one counts) and marks the wire tripped,
    /// telling no one yet; true when this was the first trip.
    fn arm(&self, fault: Error) -> bool {
        if let Ok(mut f) = self.fault.lock() {
            if f.is_some() {
                return false;
            }
            *f = Some(fault);
        }
        self.tripped.store(true, Ordering::Release);
        true
    }

    /// Tells every peer that the failure started at global rank `culprit`.
    fn announce(&self, culprit: usize, cause: Cause) {
        let Ok(t) = self.targets.lock() else { return };
        if t.closed {
            return;
        }
        if let Some(shm) = &t.shm {
            shm.publish(culprit, cause);
        }
        let notice = encode_notice(culprit, cause);
        for &fd in &t.fds {
            write_notice(fd, &notice, Duration::from_millis(200));
            sys::shutdown_write(fd);
        }
    }

    /// Normal shutdown: tells peers still waiting that this rank (global
    /// `me`) left, then forgets the streams (their owner closes them next).
    pub(crate) fn close(&self, me: usize) {
        let Ok(mut t) = self.targets.lock() else {
            return;
        };
        if !t.closed && !self.tripped() {
            if let Some(shm) = &t.shm {
                shm.leave(me);
            }
            let notice = encode_notice(me, Cause::Left);
            for &fd in &t.fds {
                write_notice(fd, &notice, Duration::from_millis(20));
            }
        }
        t.closed = true;
        t.fds.clear();
        t.shm = None;
    }
}

/// Writes `notice` to a stream whose peer may not be reading: drains (and
/// discards) what the peer sends meanwhile, so that a peer blocked sending
/// to us can move on and read. Gives up after `patience`.
fn write_notice(fd: RawFd, notice: &[u8], patience: Duration) {
    let deadline = Instant::now() + patience;
    let mut done = 0;
    let mut scratch = [0u8; 16 << 10];
    while done < notice.len() {
        match sys::send_now(fd, &notice[done..]) {
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return;
                }
                while matches!(sys::recv_now(fd, &mut scratch), Ok(n) if n > 0) {}
                let mut p = [libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                }];
                let _ = sys::poll(&mut p, Duration::from_millis(2));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

impl Tripwire {
    /// What global rank `rank` published on this wire's notice board (see
    /// [`NoticeBoard::notice_of`]).
    fn board_notice(&self, rank: usize) -> Option<Option<(usize, Cause)>> {
        let t = self.targets.lock().ok()?;
        t.shm.as_ref()?.notice_of(rank)
    }
}

/// The notice global rank `rank` published on a shared-memory board this
/// rank can read: `wire`'s own or that of another communicator of `domain`
/// (the host level of a two-level collective). `None` when no board here
/// holds `rank` (a notice on a stream cannot change; there is nothing to
/// watch).
pub(crate) fn board_notice(
    wire: &Tripwire,
    domain: u64,
    rank: usize,
) -> Option<Option<(usize, Cause)>> {
    if let Some(n) = wire.board_notice(rank) {
        return Some(n);
    }
    domain_wires(domain)
        .iter()
        .find_map(|w| w.board_notice(rank))
}

type Domains = Vec<(u64, Weak<Tripwire>)>;
static DOMAINS: Mutex<Domains> = Mutex::new(Vec::new());

/// The live communicators' wires of `domain` (none for 0, no domain).
fn domain_wires(domain: u64) -> Vec<Arc<Tripwire>> {
    if domain == 0 {
        return Vec::new();
    }
    match DOMAINS.lock() {
        Ok(d) => d
            .iter()
            .filter(|(id, _)| *id == domain)
            .filter_map(|(_, w)| w.upgrade())
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Adds a communicator's wire to `domain` (0: none).
pub(crate) fn register(domain: u64, wire: &Arc<Tripwire>) {
    if domain == 0 {
        return;
    }
    if let Ok(mut d) = DOMAINS.lock() {
        d.retain(|(_, w)| w.strong_count() > 0);
        d.push((domain, Arc::downgrade(wire)));
    }
}

/// Trips every live communicator of `domain` with `fault` (a no-op for the
/// ones already tripped).
pub fn trip_domain(domain: u64, fault: &Error, culprit: usize, cause: Cause) {
    let wires = domain_wires(domain);
    // Every wire of the domain is tripped before any peer hears of it: a
    // peer's reaction must never reach one of this rank's waits first (it
    // would report the peer instead of this rank's own failure).
    let armed: Vec<&Arc<Tripwire>> = wires.iter().filter(|w| w.arm(fault.clone())).collect();
    for w in armed {
        w.announce(culprit, cause);
    }
}

/// `Tripwire::settle` for every live communicator of `domain`.
pub(crate) fn settle_domain(domain: u64, old: &Error, new: &Error, culprit: usize, cause: Cause) {
    for w in domain_wires(domain) {
        w.settle(old, new, culprit, cause);
    }
}

/// `ncclCommAbort` for a whole rank: every communicator of `domain` fails,
/// a thread blocked in one of them raises within milliseconds, and peers
/// learn that global rank `rank` aborted. Safe from any thread.
pub fn abort_domain(domain: u64, rank: usize) {
    let fault = Error::Aborted {
        rank,
        reason: format!("rank {rank} called ringlet.abort()"),
        origin: Some((rank, Cause::Aborted)),
    };
    trip_domain(domain, &fault, rank, Cause::Aborted);
}

static INTERRUPT: OnceLock<fn() -> bool> = OnceLock::new();

/// Installs the check a blocked wait runs every few milliseconds: it returns
/// true when the wait must stop (the Python binding runs pending signal
/// handlers there, so Ctrl-C or a handler calling `ringlet.abort()` reaches a
/// rank blocked in a collective). Only the first call counts.
pub fn set_interrupt_hook(f: fn() -> bool) {
    let _ = INTERRUPT.set(f);
}

/// Runs the interrupt hook: `Err` when the wait must stop.
pub(crate) fn check_interrupt(rank: usize) -> crate::Result<()> {
    match INTERRUPT.get() {
        Some(f) if f() => Err(Error::Aborted {
            rank,
            reason: "interrupted by a signal while blocked in a collective".into(),
            origin: Some((rank, Cause::Aborted)),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// xorshift64*: a deterministic stream of fuzz words (also the transport's
    /// descriptor fuzzing).
    pub(crate) fn words(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed;
        move || {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    #[test]
    fn notices_round_trip_and_garbage_is_no_notice() {
        for cause in [Cause::Exited, Cause::TimedOut, Cause::Aborted, Cause::Left] {
            assert_eq!(decode_notice(&encode_notice(7, cause)), Some((7, cause)));
        }
        let mut next = words(0x9e37_79b9_7f4a_7c15);
        for _ in 0..100_000 {
            let mut tail = [0u8; NOTICE_BYTES];
            for c in tail.chunks_exact_mut(8) {
                c.copy_from_slice(&next().to_le_bytes());
            }
            assert_eq!(decode_notice(&tail), None);
            // a notice with a corrupted cause code is refused too
            let mut bad = encode_notice(3, Cause::Exited);
            bad[16..24].copy_from_slice(&(next() | 64).to_le_bytes());
            assert_eq!(decode_notice(&bad), None);
        }
    }
}
