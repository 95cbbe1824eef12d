//! ringlet-core: the collective-communication engine behind ringlet.
//!
//! Pure Rust, no Python: a [`Communicator`] connects the ranks of a job (shared
//! memory within a host, TCP between hosts) and runs collectives on raw byte
//! buffers tagged with a [`DType`]. The Python binding (`ringlet-py`) is a thin
//! layer over this crate.

#[macro_use]
mod coded;

pub mod algorithms;
pub mod buf;
pub mod capi;
pub mod collective;
pub mod dtype;
pub mod error;
pub mod fault;
mod flat;
pub mod group;
mod hierarchy;
pub mod plan;
pub mod progress;
pub mod reduce;
pub mod registry;
pub mod rpc;
mod simd;
mod sys;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod transport;

pub use dtype::{DType, ReduceOp, ALL_DTYPES, ALL_OPS};
pub use error::{Cause, Error, Result};
pub use group::{Communicator, Config, SharedCommunicator};

/// Version of the engine.
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// A string identifying this machine (hostname and boot id), compared across
/// ranks to decide which peers can share memory. `RINGLET_HOST_ID` overrides
/// it (the Python side reads it).
pub fn host_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", host.trim(), boot.trim())
}
