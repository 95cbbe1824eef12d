//! The one error type of the engine. The Python binding maps each variant to a
//! Python exception in exactly one place (`ringlet-py/src/errors.rs`).

use std::fmt;
use std::time::Duration;

/// Everything that can go wrong inside the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The caller passed something the engine cannot work with (bad dtype/op
    /// pair, wrong buffer sizes, out-of-range root, ...). Maps to `ValueError`.
    InvalidArgument(String),
    /// Ranks called the same collective with different arguments (operation,
    /// element count, dtype, reduce op, root). Detected before any data moves.
    Mismatch { rank: usize, detail: String },
    /// A peer did not reach the collective before the deadline.
    Timeout {
        rank: usize,
        peer: usize,
        op: &'static str,
        waited: Duration,
    },
    /// A peer's process exited or its connection broke during a collective.
    PeerLost {
        rank: usize,
        peer: usize,
        op: &'static str,
        detail: String,
    },
    /// An earlier failure left the communicator unusable.
    Aborted { rank: usize, reason: String },
    /// A system call failed while setting up or using a transport.
    Io { context: String, message: String },
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
            } => write!(
                f,
                "rank {rank}: {op} timed out after {:.1} s waiting for rank {peer} \
                 (set RINGLET_TIMEOUT or init(timeout=...) to change the limit)",
                waited.as_secs_f64()
            ),
            Error::PeerLost {
                rank,
                peer,
                op,
                detail,
            } => write!(f, "rank {rank}: {op} failed: lost rank {peer} ({detail})"),
            Error::Aborted { rank, reason } => write!(
                f,
                "rank {rank}: communicator is unusable after an earlier failure: {reason}"
            ),
            Error::Io { context, message } => write!(f, "{context}: {message}"),
            Error::Rpc(msg) => write!(f, "{msg}"),
        }
    }
}

impl std::error::Error for Error {}
