//! Bagua's decentralized synchronous operation (gossip SGD): each rank
//! averages its weights with some peers into a *peer weight*, which the
//! algorithm copies back into the model after backward. The bucket itself
//! (the model's weights) is only read.
//!
//! * `all`: the peer weight is the mean over every rank (an exact
//!   all-reduce and a division).
//! * `shift_one`: the ranks pair up, a different pair every communication
//!   step: with `n` (even) ranks and step `s`, rank `r < n/2` pairs with
//!   `(s + r) mod n/2 + n/2`, and each pair swaps weights; the peer weight
//!   is `(peer's + own) / 2`. Every rank talks to one peer per step, so the
//!   cost per step does not grow with the job.
//! * Hierarchical: the host's ranks average exactly first; the hosts'
//!   leaders run the exchange; [`DecentralizedOp::share_peer_weight`] then
//!   copies the leader's peer weight to its host (Bagua's
//!   `copy_back_peer_weight` broadcast). `shift_one` then pairs hosts, so
//!   it needs an even number of hosts (Bagua's own rule).

use super::arith;
use super::compressed::grow;
use super::levels::{broadcast, reduce, Comms, HostTensor};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::SharedCommunicator;
use crate::registry::{BucketOp, BucketTensors};

/// How a decentralized step picks peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerMode {
    /// Average with every rank.
    All,
    /// Average with one peer, a different one each step.
    ShiftOne,
}

impl PeerMode {
    /// Parses Bagua's `peer_selection_mode`.
    pub fn from_name(name: &str) -> Result<PeerMode> {
        match name {
            "all" => Ok(PeerMode::All),
            "shift_one" => Ok(PeerMode::ShiftOne),
            other => Err(Error::InvalidArgument(format!(
                "unknown peer_selection_mode {other:?}: expected \"all\" or \"shift_one\""
            ))),
        }
    }
}

/// `shift_one`'s peer of `rank` among `n` (even) ranks at communication
/// step `step` (Bagua's formula; the pairing is symmetric).
pub fn shift_one_peer(rank: usize, n: usize, step: u64) -> usize {
    let (r, h, s) = (rank as i128, (n / 2) as i128, step as i128);
    let peer = if rank < n / 2 {
        (s + r).rem_euclid((n as i128 + 1) / 2) + h
    } else {
        (r - h - s).rem_euclid(h)
    };
    peer as usize
}

fn check_even(n: usize, hierarchical: bool) -> Result<()> {
    if n.is_multiple_of(2) {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "peer_selection_mode \"shift_one\" pairs ranks up and needs an even number of them, \
         got {n}{}",
        if hierarchical {
            " hosts (hierarchical=True pairs hosts, not ranks: pass hierarchical=False to \
             pair ranks)"
        } else {
            " ranks"
        }
    )))
}

/// Gossip averaging of a bucket into a peer weight (see the module docs).
pub struct DecentralizedOp {
    comms: Comms,
    mode: PeerMode,
    step: u64,
    peer: HostTensor,
    send: Vec<u64>,
    staging: Vec<u64>,
}

impl DecentralizedOp {
    /// An operation writing into `peer_weight` (the bucket's size and dtype).
    pub fn new(comms: Comms, mode: PeerMode, peer_weight: HostTensor) -> Result<DecentralizedOp> {
        if mode == PeerMode::ShiftOne {
            check_even(
                comms.exchange_size(),
                matches!(comms, Comms::Hierarchical { .. }),
            )?;
        }
        Ok(DecentralizedOp {
            comms,
            mode,
            step: 0,
            peer: peer_weight,
            send: Vec::new(),
            staging: Vec::new(),
        })
    }

    /// Communication steps run so far (`shift_one`'s schedule position).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The peer weight's bytes.
    pub fn peer_weight(&self) -> &[u8] {
        self.peer.bytes()
    }

    /// Averages `bucket` (its weights, one host buffer of `dtype`) with the
    /// peers into the peer weight.
    pub fn apply(&mut self, bucket: &[u8], dtype: DType) -> Result<()> {
        arith::require_float(dtype, "decentralized averaging")?;
        self.peer
            .check_fits("the peer weight", bucket.len(), dtype)?;
        let DecentralizedOp {
            comms,
            mode,
            step,
            peer,
            send,
            ..
        } = self;
        let peer = peer.bytes_mut();
        peer.copy_from_slice(bucket);
        match comms {
            Comms::Flat(c) => exchange(c, *mode, *step, peer, dtype, send)?,
            Comms::Hierarchical {
                intra, inter, size, ..
            } => {
                match (mode, inter) {
                    (PeerMode::All, Some(inter)) => {
                        reduce(intra, peer, dtype, None)?;
                        reduce(inter, peer, dtype, Some(*size))?;
                    }
                    (PeerMode::ShiftOne, Some(inter)) => {
                        reduce(intra, peer, dtype, Some(intra.size()))?;
                        exchange(inter, PeerMode::ShiftOne, *step, peer, dtype, send)?;
                    }
                    // Not the leader: the host mean, until share_peer_weight
                    // brings the leader's result.
                    (_, None) => reduce(intra, peer, dtype, Some(intra.size()))?,
                }
            }
        }
        *step += 1;
        Ok(())
    }

    /// Hierarchical: copies the leader's peer weight to the host's other
    /// ranks (collective over the host); flat: nothing to do.
    pub fn share_peer_weight(&mut self) -> Result<()> {
        if let Comms::Hierarchical { intra, .. } = &self.comms {
            let dtype = self.peer.dtype();
            broadcast(intra, self.peer.bytes_mut(), dtype)?;
        }
        Ok(())
    }
}

/// One exchange step on `comm` (the group, or the hosts' leaders): `peer`
/// holds this rank's weights and ends with the peer weight.
fn exchange(
    comm: &SharedCommunicator,
    mode: PeerMode,
    step: u64,
    peer: &mut [u8],
    dtype: DType,
    send: &mut Vec<u64>,
) -> Result<()> {
    let n = comm.size();
    match mode {
        PeerMode::All => reduce(comm, peer, dtype, Some(n)),
        PeerMode::ShiftOne => {
            check_even(n, false)?;
            if n == 0 {
                return Ok(());
            }
            let other = shift_one_peer(comm.rank(), n, step);
            let mine = grow(send, peer.len());
            mine.copy_from_slice(peer);
            let elems = peer.len() / dtype.size();
            let mut counts = vec![0usize; n];
            counts[other] = elems;
            comm.with(|c| c.all_to_all_v(mine, &counts, peer, &counts, dtype))?;
            arith::average_with(peer, mine, dtype)
        }
    }
}

impl BucketOp for DecentralizedOp {
    fn run(&mut self, bucket: &BucketTensors<'_>) -> Result<()> {
        let mut staging = std::mem::take(&mut self.staging);
        let out = bucket.on_host(&mut staging, |buf, dtype| self.apply(buf, dtype));
        self.staging = staging;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shift_one_pairs_symmetrically_and_visits_the_other_half() {
        for n in [2usize, 4, 6, 8] {
            for step in 0..(2 * n as u64) {
                for r in 0..n {
                    let p = shift_one_peer(r, n, step);
                    assert!(p < n && p != r);
                    assert_eq!(shift_one_peer(p, n, step), r, "n={n} step={step} r={r}");
                    assert_ne!(r < n / 2, p < n / 2);
                }
            }
            // rank 0 meets every rank of the other half in n/2 steps
            let met: std::collections::BTreeSet<usize> = (0..(n / 2) as u64)
                .map(|s| shift_one_peer(0, n, s))
                .collect();
            assert_eq!(met.len(), n / 2);
        }
        // Bagua's own numbers for 4 ranks, step 0 and 1
        assert_eq!(
            (0..4).map(|r| shift_one_peer(r, 4, 0)).collect::<Vec<_>>(),
            vec![2, 3, 0, 1]
        );
        assert_eq!(
            (0..4).map(|r| shift_one_peer(r, 4, 1)).collect::<Vec<_>>(),
            vec![3, 2, 1, 0]
        );
    }
}
