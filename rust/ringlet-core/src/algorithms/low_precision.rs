//! Bagua's low-precision decentralized synchronous operation: on a ring,
//! every rank keeps replicas of its own weights (`weight`) and of its two
//! neighbours' (`left`, `right`), and sends only the 8-bit compressed
//! *difference* between where its weights are and where the ring's mixing
//! says they should go. With `t` the bucket (the weights after the
//! optimizer step), `w`, `l`, `r` the replicas and `Q` the MinMaxUInt8
//! round trip of the whole bucket (one chunk):
//!
//! ```text
//! d = t + l/3 + r/3 - 5w/3          (= (l + w + r)/3 + (t - w) - w)
//! send C(d) to both neighbours, receive theirs
//! l += Q(left's d);  r += Q(right's d)
//! t = w + Q(d);      w = t
//! ```
//!
//! so every replica moves by exactly what its owner applied, and the
//! replicas stay equal to the weights they mirror, bit for bit. Each step
//! sends two compressed copies of the bucket per rank, whatever the job's
//! size. Hierarchical: the host's ranks average exactly, the hosts'
//! leaders run the ring, and the result is broadcast within each host.

use super::arith;
use super::codec;
use super::compressed::grow;
use super::levels::{broadcast, reduce, Comms, HostTensor};
use crate::dtype::DType;
use crate::error::Result;
use crate::group::SharedCommunicator;
use crate::registry::{BucketOp, BucketTensors};

/// The ring exchange of compressed weight differences (see the module docs).
pub struct LowPrecisionOp {
    comms: Comms,
    weight: HostTensor,
    left: HostTensor,
    right: HostTensor,
    send: Vec<u64>,
    recv: Vec<u64>,
    staging: Vec<u64>,
}

impl LowPrecisionOp {
    /// An operation with the replicas `weight`, `left` and `right` (each the
    /// bucket's size and dtype, initialised by the caller to the weights,
    /// which are equal on every rank when training starts).
    pub fn new(
        comms: Comms,
        weight: HostTensor,
        left: HostTensor,
        right: HostTensor,
    ) -> LowPrecisionOp {
        LowPrecisionOp {
            comms,
            weight,
            left,
            right,
            send: Vec::new(),
            recv: Vec::new(),
            staging: Vec::new(),
        }
    }

    /// One step on the bucket `t` (the weights, one host buffer of `dtype`),
    /// updated in place.
    pub fn apply(&mut self, t: &mut [u8], dtype: DType) -> Result<()> {
        arith::require_float(dtype, "low-precision decentralized SGD")?;
        for (what, x) in [
            ("the weight replica", &self.weight),
            ("the left peer's replica", &self.left),
            ("the right peer's replica", &self.right),
        ] {
            x.check_fits(what, t.len(), dtype)?;
        }
        match &self.comms {
            Comms::Flat(c) => {
                let c = c.clone();
                self.ring_step(&c, t, dtype)
            }
            Comms::Hierarchical { intra, inter, .. } => {
                let (intra, inter) = (intra.clone(), inter.clone());
                reduce(&intra, t, dtype, Some(intra.size()))?;
                if let Some(inter) = inter {
                    self.ring_step(&inter, t, dtype)?;
                }
                broadcast(&intra, t, dtype)
            }
        }
    }

    fn ring_step(&mut self, comm: &SharedCommunicator, t: &mut [u8], dtype: DType) -> Result<()> {
        let LowPrecisionOp {
            weight,
            left,
            right,
            send,
            recv,
            ..
        } = self;
        arith::ring_mix(
            t,
            left.bytes(),
            right.bytes(),
            weight.bytes(),
            dtype,
            1.0 / 3.0,
            -5.0 / 3.0,
        )?;
        let clen = codec::compressed_len(dtype, t.len() / dtype.size());
        let (n, me) = (comm.size(), comm.rank());
        let (lrank, rrank) = ((me + n - 1) % n, (me + 1) % n);
        // One block per distinct neighbour, in rank order (none alone: a
        // rank on its own ring is its own neighbour both ways).
        let blocks = if n <= 2 { 1 } else { 2 };
        let out = grow(send, clen * blocks);
        codec::compress(dtype, t, &mut out[..clen])?;
        let (own, received): (&[u8], &[u8]) = if n == 1 {
            (&out[..clen], &out[..clen])
        } else {
            if blocks == 2 {
                let (a, b) = out.split_at_mut(clen);
                b.copy_from_slice(a);
            }
            let mut counts = vec![0usize; n];
            counts[lrank] = clen;
            counts[rrank] = clen;
            let inbox = grow(recv, clen * blocks);
            comm.with(|c| c.all_to_all_v(out, &counts, inbox, &counts, DType::U8))?;
            (&out[..clen], inbox)
        };
        let at = |r: usize| {
            if blocks == 1 || r == lrank.min(rrank) {
                0
            } else {
                clen
            }
        };
        codec::decompress_add(
            dtype,
            &received[at(lrank)..at(lrank) + clen],
            left.bytes_mut(),
        )?;
        codec::decompress_add(
            dtype,
            &received[at(rrank)..at(rrank) + clen],
            right.bytes_mut(),
        )?;
        // w = w + Q(d); t = w
        codec::decompress_add(dtype, own, weight.bytes_mut())?;
        t.copy_from_slice(weight.bytes());
        Ok(())
    }

    /// The replicas' bytes: (weight, left peer's, right peer's).
    pub fn replicas(&self) -> (&[u8], &[u8], &[u8]) {
        (self.weight.bytes(), self.left.bytes(), self.right.bytes())
    }
}

impl BucketOp for LowPrecisionOp {
    fn run(&mut self, bucket: &BucketTensors<'_>) -> Result<()> {
        let mut staging = std::mem::take(&mut self.staging);
        let out = bucket.on_host(&mut staging, |buf, dtype| self.apply(buf, dtype));
        self.staging = staging;
        out
    }
}
