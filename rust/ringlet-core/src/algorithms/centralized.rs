//! Bagua's centralized synchronous operation: every rank ends with the sum
//! or the mean of the bucket over the group (gradient all-reduce, ByteGrad,
//! QAdam's compressed momentum).
//!
//! * Exact: an all-reduce (Bagua's `scattergather=True` without
//!   compression is a reduce-scatter and an all-gather, which ringlet's
//!   all-reduce already is).
//! * Compressed (`MinMaxUInt8`): the scatter-reduce-gather of [`compressed`]
//!   (`super::compressed`), with optional error feedback per bucket.
//! * Hierarchical: an exact sum over the host's ranks (shared memory), the
//!   exchange above between the hosts' leaders (where the bytes cost), a
//!   broadcast within each host. When every host holds the same number of
//!   ranks, all of them carry a share instead: an exact reduce-scatter
//!   within the host, the exchange of each share between the ranks at the
//!   same position on every host (L exchanges in parallel, each rank
//!   compressing 1/L of the bucket), an all-gather within the host. With one host there is nothing to send
//!   across hosts: the host's exact sum is the result (Bagua would still
//!   quantize it twice; ringlet keeps it exact and costs one all-reduce).
//!   The mean gives every rank the same weight also when hosts hold
//!   different numbers of ranks (Bagua's mean of host means would weigh a
//!   lone rank like a whole host); with even hosts it is Bagua's host mean,
//!   then the mean over hosts.

use super::arith;
use super::compressed::{compressed_all_reduce, grow, Codec, Feedback, Scratch};
use super::levels::{broadcast, reduce, sum, Comms};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::group::SharedCommunicator;
use crate::registry::{BucketOp, BucketTensors};
use std::collections::HashMap;

/// Sum or mean of a bucket over the group, exact or through 8-bit
/// compression (see the module documentation).
pub struct CentralizedOp {
    comms: Comms,
    average: bool,
    compress: Option<Codec>,
    error_feedback: bool,
    feedback: HashMap<u64, Feedback>,
    scratch: Scratch,
    shares: Vec<u64>,
    staging: Vec<u64>,
}

impl CentralizedOp {
    /// A sum (or mean, with `average`) over `comms`; `compress` picks the
    /// codec across the exchange level (None: exact); `error_feedback`
    /// (needs `compress`) carries each quantization's residual to the next
    /// call.
    pub fn new(
        comms: Comms,
        average: bool,
        compress: Option<Codec>,
        error_feedback: bool,
    ) -> Result<CentralizedOp> {
        if error_feedback && compress.is_none() {
            return Err(Error::InvalidArgument(
                "error feedback needs compression: an exact all-reduce leaves no residual".into(),
            ));
        }
        Ok(CentralizedOp {
            comms,
            average,
            compress,
            error_feedback,
            feedback: HashMap::new(),
            scratch: Scratch::default(),
            shares: Vec::new(),
            staging: Vec::new(),
        })
    }

    /// The residuals error feedback keeps for `key` (the bucket index):
    /// the sender's (the whole bucket) and the chunk owner's (this rank's
    /// chunk), as bytes of the bucket's dtype; `None` before the first
    /// compressed call for it (or on a host's ranks other than its leader,
    /// in hierarchical mode, where nothing is compressed).
    pub fn residuals(&self, key: u64) -> Option<(Vec<u8>, Vec<u8>)> {
        self.feedback.get(&key).map(|f| {
            let (w, s) = f.residuals();
            (w.to_vec(), s.to_vec())
        })
    }

    /// Runs the operation on `buf` (the bucket as one host buffer of
    /// `dtype`); `key` picks the error-feedback residuals (the bucket's
    /// index; any stable number for other callers).
    pub fn apply(&mut self, buf: &mut [u8], dtype: DType, key: u64) -> Result<()> {
        if self.average || self.compress.is_some() {
            let what = match self.compress {
                Some(c) => format!("{} compression", c.name()),
                None => "averaging".to_string(),
            };
            arith::require_float(dtype, &what)?;
        }
        let CentralizedOp {
            comms,
            average,
            compress,
            error_feedback,
            feedback,
            scratch,
            shares,
            ..
        } = self;
        // The exchange level: sum, or mean over its ranks (divided inside
        // the compressed all-reduce, before the owner's compression, as Bagua).
        let mut exchange = |comm: &SharedCommunicator, buf: &mut [u8], mean: bool| -> Result<()> {
            if let Some(codec) = *compress {
                let fb = error_feedback.then(|| feedback.entry(key).or_default());
                return comm
                    .with(|c| compressed_all_reduce(c, buf, dtype, mean, codec, fb, scratch));
            }
            sum(comm, buf, dtype)?;
            if mean && comm.size() > 1 {
                arith::div(buf, dtype, comm.size() as f64)?;
            }
            Ok(())
        };
        match comms {
            Comms::Flat(c) => exchange(c, buf, *average),
            Comms::Hierarchical {
                intra,
                inter,
                channel,
                hosts,
                size,
            } => {
                if *hosts == 1 {
                    // One host: its exact sum is everything there is.
                    return reduce(intra, buf, dtype, average.then_some(*size));
                }
                let host_mean = *size as f64 / *hosts as f64;
                let l = intra.size();
                if let Some(ch) = channel {
                    if l > 1 && (buf.len() / dtype.size()).is_multiple_of(l) {
                        // Every rank of the host carries a share: an exact
                        // reduce-scatter within the host, the exchange of
                        // each share between the ranks at the same position
                        // on every host, an all-gather within the host.
                        let share = grow(shares, buf.len() / l);
                        intra.with(|c| c.reduce_scatter(buf, share, dtype, ReduceOp::Sum))?;
                        if *average {
                            arith::div(share, dtype, host_mean)?;
                        }
                        exchange(ch, share, *average)?;
                        return intra.with(|c| c.all_gather(share, buf, dtype));
                    }
                }
                sum(intra, buf, dtype)?;
                if let Some(inter) = inter {
                    if *average {
                        // The host's sum over (group size / hosts): the host
                        // mean when hosts are even (Bagua's numerics), and
                        // every rank weighted alike when they are not.
                        arith::div(buf, dtype, host_mean)?;
                    }
                    exchange(inter, buf, *average)?;
                }
                broadcast(intra, buf, dtype)
            }
        }
    }
}

impl BucketOp for CentralizedOp {
    fn run(&mut self, bucket: &BucketTensors<'_>) -> Result<()> {
        let key = bucket.index as u64;
        let mut staging = std::mem::take(&mut self.staging);
        let out = bucket.on_host(&mut staging, |buf, dtype| self.apply(buf, dtype, key));
        self.staging = staging;
        out
    }
}
