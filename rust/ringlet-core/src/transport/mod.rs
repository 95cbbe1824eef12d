//! Transports move bytes between ranks. Two exist, each in its own folder:
//!
//! * `tcp/`: one stream per peer pair (full mesh), non-blocking, driven by a
//!   `poll` loop that progresses any number of sends and receives at once.
//! * `shm/`: one shared segment per host group. Ranks publish data in their own
//!   slot (or just its address, for cross-memory attach) and read peers' data
//!   directly; synchronisation is a per-rank phase counter (spin, then futex).
//!
//! Both share the operation descriptor that lets ranks detect disagreement
//! about a collective before any data moves.

pub mod shm;
pub mod tcp;

use crate::dtype::{DType, ReduceOp};
use std::time::{Duration, Instant};

/// Which collective an operation is; part of the cross-rank agreement check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum OpKind {
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    Broadcast = 4,
    Barrier = 5,
    AllToAll = 6,
    SendRecv = 7,
}

impl OpKind {
    /// Name used in error messages.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
            OpKind::AllToAll => "all_to_all",
            OpKind::SendRecv => "send/recv",
        }
    }

    fn from_code(code: u64) -> Option<Self> {
        [
            OpKind::AllReduce,
            OpKind::AllGather,
            OpKind::ReduceScatter,
            OpKind::Broadcast,
            OpKind::Barrier,
            OpKind::AllToAll,
            OpKind::SendRecv,
        ]
        .into_iter()
        .find(|k| *k as u64 == code)
    }
}

/// What a rank is about to do. Every rank publishes its descriptor; all must
/// agree on every field but `addr` (the buffer address, used by cross-memory
/// attach).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpDesc {
    pub seq: u64,
    pub kind: OpKind,
    pub dtype: DType,
    pub op: Option<ReduceOp>,
    pub count: u64,
    pub root: u64,
    pub addr: u64,
}

/// Number of u64 words in an encoded descriptor.
pub const DESC_WORDS: usize = 7;

impl OpDesc {
    /// Encodes into fixed-size words (for shared memory and the wire).
    pub fn encode(&self) -> [u64; DESC_WORDS] {
        [
            self.seq,
            self.kind as u64,
            self.dtype as u64,
            self.op.map_or(u64::MAX, |o| o as u64),
            self.count,
            self.root,
            self.addr,
        ]
    }

    /// Decodes words written by `encode`; `None` for garbage.
    pub fn decode(w: &[u64; DESC_WORDS]) -> Option<OpDesc> {
        Some(OpDesc {
            seq: w[0],
            kind: OpKind::from_code(w[1])?,
            dtype: DType::from_code(u32::try_from(w[2]).ok()?)?,
            op: if w[3] == u64::MAX {
                None
            } else {
                Some(ReduceOp::from_code(u32::try_from(w[3]).ok()?)?)
            },
            count: w[4],
            root: w[5],
            addr: w[6],
        })
    }

    /// Human-readable form for mismatch errors.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{}(#{}, count={}, dtype={}",
            self.kind.name(),
            self.seq,
            self.count,
            self.dtype.name()
        );
        if let Some(op) = self.op {
            s += &format!(", op={}", op.name());
        }
        if self.kind == OpKind::Broadcast {
            s += &format!(", root={}", self.root);
        }
        if self.kind == OpKind::SendRecv {
            // `root` packs the sender's rank (low bit) and the tag.
            s += &format!(", from rank {}, tag={}", self.root & 1, self.root >> 1);
        }
        s + ")"
    }

    /// True when `other` describes the same collective call.
    pub fn agrees_with(&self, other: &OpDesc) -> bool {
        OpDesc { addr: 0, ..*self } == OpDesc { addr: 0, ..*other }
    }
}

/// Compares every rank's descriptor with ours; the message names each rank
/// that disagrees. All ranks see the same descriptors, so all raise together.
pub fn check_agreement(rank: usize, all: &[OpDesc]) -> crate::Result<()> {
    let reference = &all[0];
    let odd: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, d)| !d.agrees_with(reference))
        .map(|(r, d)| format!("rank {r} called {}", d.describe()))
        .collect();
    if odd.is_empty() {
        return Ok(());
    }
    Err(crate::Error::Mismatch {
        rank,
        detail: format!(
            "rank 0 called {} but {}",
            reference.describe(),
            odd.join(", ")
        ),
    })
}

/// How a waiting rank behaves: spin briefly, yield a little, then park with a
/// deadline. `timeout` is the longest wait without progress before failing.
#[derive(Clone, Copy, Debug)]
pub struct WaitPolicy {
    pub timeout: Duration,
    pub spins: u32,
    /// After spinning, yield the CPU (letting other ranks on the same core
    /// run) for up to this long before parking on a futex.
    pub yield_for: Duration,
    pub park_slice: Duration,
}

impl WaitPolicy {
    /// A policy with the given timeout and default spin/yield budgets.
    pub fn with_timeout(timeout: Duration) -> Self {
        WaitPolicy {
            timeout,
            spins: 2000,
            yield_for: Duration::from_millis(2),
            park_slice: Duration::from_millis(5),
        }
    }

    /// Deadline for a wait that starts now.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }
}
