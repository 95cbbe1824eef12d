//! Bagua's communication algorithms on ringlet's communicators: what a
//! bucket's ordered worker runs once the bucket is ready (Bagua's "comm
//! ops"), plus the asynchronous averaging thread.
//!
//! * [`codec`]: MinMaxUInt8, Bagua's 8-bit compression (per-chunk min and
//!   max, one byte per element), vectorised.
//! * [`CentralizedOp`] (`compressed`, `centralized`): every rank ends with the
//!   sum or mean of the bucket; exact, or compressed (ByteGrad, QAdam), with
//!   optional error feedback.
//! * [`DecentralizedOp`]: gossip SGD's peer averaging into a peer weight
//!   (`all`, or `shift_one`'s changing pairs).
//! * [`LowPrecisionOp`]: low-precision decentralized SGD's ring exchange of
//!   compressed weight differences with both neighbours.
//! * [`outer`]: DiLoCo's and LocalSGD's outer synchronisation: the
//!   pseudo-gradient of a flat bucket, its exact, 8-bit or 4-bit average on
//!   a thread while training goes on, and the restore and save copies.
//! * [`AsyncAverager`]: asynchronous model averaging on a thread of its own,
//!   locked against the training loop.
//!
//! Every operation runs on [`Comms`]: one communicator over the group, or
//! Bagua's two levels (the ranks of this host over shared memory, and one
//! rank per host across hosts), where the expensive part (compression, peer
//! exchange) happens across hosts only and the host level stays exact.
//! Algorithm state (peer weights, replicas, residuals) lives in host memory.

pub mod codec;
pub mod codec4;

mod arith;
mod async_average;
mod centralized;
mod compressed;
mod decentralized;
mod levels;
mod low_precision;
pub mod outer;

pub use async_average::{AsyncAverager, AsyncStatus};
pub use centralized::CentralizedOp;
pub use compressed::{Codec, Feedback, Scratch};
pub use decentralized::{shift_one_peer, DecentralizedOp, PeerMode};
pub use levels::{Comms, HostTensor};
pub use low_precision::LowPrecisionOp;
