//! The message layer for RPC, beside the collectives: framed requests and
//! responses between named workers, with tensors carried as raw bytes beside
//! an opaque payload (single-copy between processes on one host). The
//! embedder (the Python front end) gives payloads their meaning; distributed
//! autograd fits on the same frames as one more kind of payload.

mod agent;
pub mod frame;

pub use agent::{Agent, AgentConfig, Handler, Incoming, KeepAlive, ReplyTo};

/// Outcome codes of a response.
pub mod status {
    /// The function ran; the payload is its result.
    pub const OK: u8 = 0;
    /// The function raised; the payload describes the exception.
    pub const ERROR: u8 = 1;
    /// No response before the call's deadline (made locally).
    pub const TIMEOUT: u8 = 2;
    /// The connection to the callee broke (made locally; payload: why).
    pub const PEER_LOST: u8 = 3;
    /// This agent shut down first (made locally).
    pub const SHUTDOWN: u8 = 4;
}
