//! Two-level reduce-scatter, the mirror of the two-level all-gather. The
//! input's blocks of each host's ranks, in local-rank order, form that
//! host's region; channel c of a region belongs to the rank of that host
//! that owns c, whose own block it is part of. Per piece (the same element
//! range of every block):
//! * pre: for every host, this host's ranks reduce-scatter that host's
//!   region of the piece within the host (shared memory): each rank holds
//!   this host's partial sums of the channels it owns;
//! * cross: each rank sends the partial sums of other hosts' regions to
//!   their owners there and receives the other hosts' partial sums of its
//!   own block, then reduces all hosts' sums in host order into its output.
//!   Each host sends (H-1)/H of the input, the least possible.

use super::{bytes, chunks, give, pipeline, take, LocalSide, Net, Plan};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::group::Communicator;
use crate::reduce;
use crate::transport::tcp::Xfer;
use crate::transport::OpKind;

impl Communicator {
    /// `reduce_scatter` on a communicator with levels.
    pub(crate) fn reduce_scatter_levels(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let esz = dtype.size();
        let count = output.len() / esz;
        let p = self.size();
        self.two_level(
            OpKind::ReduceScatter,
            dtype,
            Some(op),
            count,
            0,
            |lv, net, stop| {
                if count == 0 {
                    return Ok(());
                }
                let plan = &lv.plan;
                let q = plan.block_piece(count, p, esz);
                let pieces = count.div_ceil(q);
                let mut side = Side {
                    plan,
                    input,
                    outputs: chunks(output, q * esz),
                    pool: &mut lv.pool,
                    dtype,
                    op,
                    q,
                    count,
                };
                pipeline(&mut lv.local, &mut side, pieces, stop, |_, piece, _| {
                    cross(plan, net, piece, dtype, op, q)
                })
            },
        )
    }
}

/// Piece `k`: this rank's output piece (`out`), its channels' partial sums
/// of every host's region (`parts`, hosts in order, `L_g·q/L_h` elements
/// each) and room for the other hosts' sums of its own block (`recv`).
struct Piece<'a> {
    out: &'a mut [u8],
    parts: Vec<u64>,
    recv: Vec<u64>,
}

struct Side<'a, 'p> {
    plan: &'p Plan,
    input: &'a [u8],
    outputs: Vec<Option<&'a mut [u8]>>,
    pool: &'p mut Vec<Vec<u64>>,
    dtype: DType,
    op: ReduceOp,
    q: usize,
    count: usize,
}

impl<'a> LocalSide for Side<'a, '_> {
    type Piece = Piece<'a>;

    fn pre(&mut self, local: &mut Communicator, k: usize) -> Result<Piece<'a>> {
        let (esz, q, plan) = (self.dtype.size(), self.q, self.plan);
        let (start, l) = (k * q, plan.local_size());
        let real = q.min(self.count - start);
        let total: usize = (0..plan.hosts()).map(|g| plan.width(g) * q / l).sum();
        let mut parts = take(self.pool, total * esz);
        let widest = plan.layout.iter().map(Vec::len).max().unwrap_or(1);
        let mut stage = take(self.pool, widest * q * esz);
        let mut at = 0;
        for g in 0..plan.hosts() {
            let w = plan.width(g);
            let region = bytes(&mut stage, w * q * esz);
            for (j, &r) in plan.layout[g].iter().enumerate() {
                let from = (r * self.count + start) * esz;
                let dst = &mut region[j * q * esz..(j + 1) * q * esz];
                dst[..real * esz].copy_from_slice(&self.input[from..from + real * esz]);
                dst[real * esz..].fill(0);
            }
            let mine = w * q / l * esz;
            let out = &mut bytemuck::cast_slice_mut(&mut parts)[at..at + mine];
            local.reduce_scatter(region, out, self.dtype, self.op)?;
            at += mine;
        }
        give(self.pool, [stage]);
        let recv = take(self.pool, (plan.hosts() - 1) * q * esz);
        Ok(Piece {
            out: self.outputs[k].take().unwrap_or_default(),
            parts,
            recv,
        })
    }

    fn post(&mut self, _local: &mut Communicator, _k: usize, p: Piece<'a>) -> Result<()> {
        give(self.pool, [p.parts, p.recv]);
        Ok(())
    }
}

/// Sends the partial sums of other hosts' regions to their owners, receives
/// the other hosts' sums of this rank's block and reduces them in host order.
fn cross(
    plan: &Plan,
    net: &Net<'_>,
    p: &mut Piece<'_>,
    dtype: DType,
    op: ReduceOp,
    q: usize,
) -> Result<()> {
    let esz = dtype.size();
    let (h, l, c) = (plan.host, plan.local_size(), plan.channels);
    let parts: &[u8] = bytemuck::cast_slice(&p.parts);
    let recv = bytes(&mut p.recv, (plan.hosts() - 1) * q * esz);
    let mut own = &parts[..0];
    {
        let mut x = Vec::new();
        let (mut at, mut rest) = (0, &mut recv[..]);
        for g in 0..plan.hosts() {
            let w = plan.width(g);
            let region = &parts[at..at + w * q / l * esz];
            at += region.len();
            if g == h {
                own = region;
                continue;
            }
            // Channels of host g's region are w*q/c elements, of ours l*q/c.
            for (r, peer) in plan.byte_runs(g, plan.mine(), w * q / c * esz) {
                x.push(Xfer::send(peer, &region[r]));
            }
            let (mut slot, tail) = rest.split_at_mut(q * esz);
            rest = tail;
            for (r, peer) in plan.byte_runs(g, plan.mine(), l * q / c * esz) {
                let (head, tail) = slot.split_at_mut(r.len());
                slot = tail;
                x.push(Xfer::recv(peer, head));
            }
        }
        net.transfer(&mut x)?;
    }
    let n = p.out.len();
    let mut theirs = recv.chunks(q * esz);
    let srcs: Vec<&[u8]> = (0..plan.hosts())
        .map(|g| {
            if g == h {
                &own[..n]
            } else {
                theirs.next().map_or(&[][..], |t| &t[..n])
            }
        })
        .collect();
    reduce::reduce_into(dtype, op, p.out, &srcs)
}
