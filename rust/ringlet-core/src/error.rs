//! The one error type of the engine. The Python binding maps each variant to a
//! Python exception in exactly one place (`ringlet-py/src/errors.rs`).
//!
//! Failures name the rank they *started* from (the culprit), not the
//! neighbour that gave up in reaction: a rank that gives up publishes an
//! abort notice (culprit and [`Cause`]) to its peers before it closes, and a
//! rank that learns of a failure through a notice reports the culprit with
//! `via` set to the rank that told it.

use std::fmt;
use std::time::Duration;

coded_enum! {
    /// What happened to the rank a failure started from.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Cause: u64 {
        /// Its process exited or was killed (its connections closed without notice).
        Exited = 1 => "exited", "exited or was killed";
        /// The network between us and it stopped delivering (retransmissions
        /// unanswered, host unreachable).
        Unreachable = 2 => "unreachable", "is unreachable over the network";
        /// It did not take its part within the timeout (hung, stopped, or slow).
        TimedOut = 3 => "timeout", "did not arrive within the timeout";
        /// Its process called `ringlet.abort()`.
        Aborted = 4 => "aborted", "called ringlet.abort()";
        /// It gave up after an internal error (a failed system call).
        Failed = 5 => "failed", "failed with an internal error";
        /// It shut its communicator down while peers still needed it.
        Left = 6 => "left", "shut its communicator down (left the job) while peers needed it";
    }
    /// Short name exposed to Python (`err.cause`).
    fn name;
    /// What happened, as the end of "rank k ...".
    fn describe -> &'static str;
}

impl Cause {
    /// The code carried in abort notices.
    pub fn code(self) -> u64 {
        self as u64
    }
}

/// Everything that can go wrong inside the engine.
///
/// Rank fields are global ranks once an error leaves a `Communicator` (it maps
/// its group ranks through its member table); inside a transport they are
/// group ranks, except `peer` of an error with `via` set, which came from a
/// notice and is global already.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The caller passed something the engine cannot work with (bad dtype/op
    /// pair, wrong buffer sizes, out-of-range root, ...). Maps to `ValueError`.
    InvalidArgument(String),
    /// Ranks called the same collective with different arguments (operation,
    /// element count, dtype, reduce op, root). Detected before any data moves.
    Mismatch { rank: usize, detail: String },
    /// `peer` did not take its part before the deadline.
    Timeout {
        rank: usize,
        peer: usize,
        op: &'static str,
        waited: Duration,
        /// The communicator's name ("the world", "replica group [0, 2]", ...).
        group: String,
        /// Set when the rank learned of the timeout from this rank's notice.
        via: Option<usize>,
    },
    /// `peer` is gone for this communicator (`cause` says how).
    PeerLost {
        rank: usize,
        peer: usize,
        op: &'static str,
        cause: Cause,
        detail: String,
        group: String,
        via: Option<usize>,
    },
    /// An earlier failure (or `abort`) left the communicator unusable;
    /// `origin` is the rank that failure started from and its cause.
    Aborted {
        rank: usize,
        reason: String,
        origin: Option<(usize, Cause)>,
    },
    /// A system call failed while setting up or using a transport.
    Io { context: String, message: String },
    /// An operation queued behind earlier operations of its process group
    /// did not start within the timeout (it was withdrawn and never ran;
    /// the earlier operations report their own failure). Maps to
    /// `CollectiveTimeoutError`.
    Stalled {
        rank: usize,
        op: &'static str,
        waited: Duration,
    },
    /// An RPC failed in the message layer (malformed frame, lost connection,
    /// agent shut down). Maps to `RuntimeError`, as torch.distributed.rpc.
    Rpc(String),
}

/// Result alias used throughout the engine.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wraps an `io::Error` with a short description of what was being done.
    pub fn io(context: impl Into<String>, err: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            message: err.to_string(),
        }
    }

    /// A lost peer (group ranks), not learned from a notice.
    pub fn lost(
        rank: usize,
        peer: usize,
        op: &'static str,
        cause: Cause,
        detail: impl Into<String>,
    ) -> Self {
        Error::PeerLost {
            rank,
            peer,
            op,
            cause,
            detail: detail.into(),
            group: String::new(),
            via: None,
        }
    }

    /// A late peer (group ranks), not learned from a notice.
    pub fn timeout(rank: usize, peer: usize, op: &'static str, waited: Duration) -> Self {
        Error::Timeout {
            rank,
            peer,
            op,
            waited,
            group: String::new(),
            via: None,
        }
    }

    /// The error a rank raises on learning from `via`'s notice (group rank)
    /// that the failure started at global rank `culprit` with `cause`.
    pub fn from_notice(
        rank: usize,
        via: usize,
        op: &'static str,
        culprit: usize,
        cause: Cause,
    ) -> Self {
        match cause {
            Cause::TimedOut => Error::Timeout {
                rank,
                peer: culprit,
                op,
                waited: Duration::ZERO,
                group: String::new(),
                via: Some(via),
            },
            cause => Error::PeerLost {
                rank,
                peer: culprit,
                op,
                cause,
                detail: String::new(),
                group: String::new(),
                via: Some(via),
            },
        }
    }

    /// True for failures after which the communicator's peers may be out of
    /// step (timeouts, lost peers): such a communicator must not be reused.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. }
                | Error::PeerLost { .. }
                | Error::Io { .. }
                | Error::Aborted { .. }
                | Error::Rpc(_)
        )
    }

    /// The rank a fatal failure started from and what happened to it, given
    /// the rank that observed it (global ranks). `None` for non-fatal errors.
    pub fn origin(&self, me: usize) -> Option<(usize, Cause)> {
        match self {
            Error::Timeout { peer, .. } => Some((*peer, Cause::TimedOut)),
            Error::PeerLost { peer, cause, .. } => Some((*peer, *cause)),
            Error::Aborted { origin, .. } => Some(origin.unwrap_or((me, Cause::Aborted))),
            Error::Io { .. } => Some((me, Cause::Failed)),
            _ => None,
        }
    }

    /// Rewrites group ranks into global ranks (`members[group rank]`), names
    /// the communicator and the collective the caller ran (`call`; a phase
    /// inside it may have named itself); applied once as the error leaves
    /// the communicator.
    pub fn globalize(self, members: &[usize], name: &str, call: &'static str) -> Self {
        let g = |r: usize| members.get(r).copied().unwrap_or(r);
        match self {
            Error::Mismatch { rank, detail } => Error::Mismatch {
                rank: g(rank),
                detail,
            },
            Error::Timeout {
                rank,
                peer,
                waited,
                group,
                via,
                ..
            } => Error::Timeout {
                rank: g(rank),
                peer: if via.is_some() { peer } else { g(peer) },
                op: call,
                waited,
                group: if group.is_empty() { name.into() } else { group },
                via: via.map(g),
            },
            Error::PeerLost {
                rank,
                peer,
                cause,
                detail,
                group,
                via,
                ..
            } => Error::PeerLost {
                rank: g(rank),
                peer: if via.is_some() { peer } else { g(peer) },
                op: call,
                cause,
                detail,
                group: if group.is_empty() { name.into() } else { group },
                via: via.map(g),
            },
            Error::Aborted {
                rank,
                reason,
                origin,
            } => Error::Aborted {
                rank: g(rank),
                reason,
                origin,
            },
            other => other,
        }
    }
}

/// The message of a panic caught where the engine hands control back to
/// foreign code (the C ABI, the Python binding): `ringlet internal error:`
/// and the panic's text.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("ringlet internal error: {what}")
}

fn on(group: &str) -> String {
    if group.is_empty() {
        String::new()
    } else {
        format!(" on {group}")
    }
}

fn reported(via: &Option<usize>, culprit: usize) -> String {
    match via {
        Some(v) if *v != culprit => format!(" (reported by rank {v})"),
        _ => String::new(),
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidArgument(msg) => write!(f, "{msg}"),
            Error::Mismatch { rank, detail } => {
                write!(
                    f,
                    "rank {rank}: ranks disagree about the collective: {detail}"
                )
            }
            Error::Timeout {
                rank,
                peer,
                op,
                waited,
                group,
                via: None,
            } => write!(
                f,
                "rank {rank}: {op}{}: Timed out after {:.1} s waiting for rank {peer}: \
                 rank {peer} {} (set RINGLET_TIMEOUT or init(timeout=...) to change the limit)",
                on(group),
                waited.as_secs_f64(),
                Cause::TimedOut.describe(),
            ),
            Error::Timeout {
                rank,
                peer,
                op,
                group,
                via,
                ..
            } => write!(
                f,
                "rank {rank}: {op}{}: Timed out waiting for rank {peer}: rank {peer} {}{} \
                 (set RINGLET_TIMEOUT or init(timeout=...) to change the limit)",
                on(group),
                Cause::TimedOut.describe(),
                reported(via, *peer),
            ),
            Error::PeerLost {
                rank,
                peer,
                op,
                cause,
                detail,
                group,
                via,
            } => {
                write!(
                    f,
                    "rank {rank}: {op}{} failed: lost rank {peer}: rank {peer} {}{}",
                    on(group),
                    cause.describe(),
                    reported(via, *peer)
                )?;
                if !detail.is_empty() {
                    write!(f, " ({detail})")?;
                }
                Ok(())
            }
            Error::Aborted { rank, reason, .. } => write!(
                f,
                "rank {rank}: communicator is unusable after an earlier failure: {reason}"
            ),
            Error::Io { context, message } => write!(f, "{context}: {message}"),
            Error::Stalled { rank, op, waited } => write!(
                f,
                "rank {rank}: {op}: Timed out after {:.1} s waiting for the operations issued \
                 before it on this process group to finish; it did not start",
                waited.as_secs_f64()
            ),
            Error::Rpc(msg) => write!(f, "{msg}"),
        }
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    /// torch's tests and log scrapers look for " Timed out " in a timeout's
    /// message; ringlet's rank, operation, group and culprit stay in it.
    #[test]
    fn timeout_messages_say_timed_out_and_name_the_culprit() {
        let direct = Error::Timeout {
            rank: 0,
            peer: 3,
            op: "all_reduce",
            waited: Duration::from_millis(1500),
            group: "the world (4 ranks)".into(),
            via: None,
        };
        assert_eq!(
            direct.to_string(),
            "rank 0: all_reduce on the world (4 ranks): Timed out after 1.5 s waiting for \
             rank 3: rank 3 did not arrive within the timeout (set RINGLET_TIMEOUT or \
             init(timeout=...) to change the limit)"
        );
        let reported = Error::Timeout {
            rank: 0,
            peer: 3,
            op: "barrier",
            waited: Duration::ZERO,
            group: String::new(),
            via: Some(1),
        };
        let text = reported.to_string();
        assert!(
            text.starts_with(
                "rank 0: barrier: Timed out waiting for rank 3: rank 3 did not arrive"
            ),
            "{text}"
        );
        assert!(text.contains("(reported by rank 1)"), "{text}");
    }
}
