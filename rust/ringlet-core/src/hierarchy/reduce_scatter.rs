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

use super::{bytes, chunks, give, pipeline, recv_runs, take, LocalSide, Net, Plan};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::flat::reduce_scatter::ReduceScatter;
use crate::group::Communicator;
use crate::reduce;
use crate::transport::OpKind;

impl Communicator {
    /// `reduce_scatter` on a communicator with levels.
    pub(crate) fn reduce_scatter_levels(&mut self, args: ReduceScatter<'_>) -> Result<()> {
        let esz = args.dtype.size();
        let count = args.output.len() / esz;
        let p = self.size();
        self.two_level(
            OpKind::ReduceScatter,
            args.dtype,
            Some(args.op),
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
                    input: args.input,
                    outputs: chunks(args.output, q * esz),
                    pool: &mut lv.pool,
                    dtype: args.dtype,
                    op: args.op,
                    q,
                    count,
                };
                pipeline(&mut lv.local, &mut side, pieces, stop, |_, piece, next| {
                    cross(plan, net, piece, next, args.dtype, args.op, q)
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
    /// How far each send got ahead of time (see `Net::exchange`).
    sent: Vec<usize>,
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
            local.reduce_scatter_flat(ReduceScatter {
                input: region,
                output: out,
                dtype: self.dtype,
                op: self.op,
            })?;
            at += mine;
        }
        give(self.pool, [stage]);
        let recv = take(self.pool, (plan.hosts() - 1) * q * esz);
        Ok(Piece {
            out: self.outputs[k].take().unwrap_or_default(),
            parts,
            recv,
            sent: Vec::new(),
        })
    }

    fn post(&mut self, _local: &mut Communicator, _k: usize, p: Piece<'a>) -> Result<()> {
        give(self.pool, [p.parts, p.recv]);
        Ok(())
    }
}

/// Sends the partial sums of other hosts' regions to their owners (the
/// `next` piece's sends queued behind), receives the other hosts' sums of
/// this rank's block and reduces them in host order.
fn cross(
    plan: &Plan,
    net: &Net<'_>,
    p: &mut Piece<'_>,
    next: Option<&mut Piece<'_>>,
    dtype: DType,
    op: ReduceOp,
    q: usize,
) -> Result<()> {
    let esz = dtype.size();
    let (h, l, c) = (plan.host, plan.local_size(), plan.channels);
    let mut recv = std::mem::take(&mut p.recv);
    let recv = bytes(&mut recv, (plan.hosts() - 1) * q * esz);
    {
        // This host's region has channels of l*q/c elements; host g's owners
        // of this rank's channels send their sums of them.
        let mut recvs = Vec::new();
        let others = (0..plan.hosts()).filter(|&g| g != h);
        for (g, slot) in others.zip(recv.chunks_mut(q * esz)) {
            recvs.extend(recv_runs(
                slot,
                plan.byte_runs(g, plan.mine(), l * q / c * esz),
            ));
        }
        let mine = sends(plan, p, esz, q);
        net.exchange_ahead(
            mine,
            &p.sent,
            recvs,
            next,
            |n| sends(plan, n, esz, q),
            |n| &mut n.sent,
        )?;
    }
    let own = region(plan, &p.parts, h, esz, q);
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

/// This rank's channels of host `g`'s region in `parts` (hosts in order,
/// `L_g q / L_h` elements each).
fn region<'a>(plan: &Plan, parts: &'a [u64], g: usize, esz: usize, q: usize) -> &'a [u8] {
    let l = plan.local_size();
    let at: usize = (0..g).map(|j| plan.width(j) * q / l * esz).sum();
    &bytemuck::cast_slice(parts)[at..at + plan.width(g) * q / l * esz]
}

/// A piece's sends: the partial sums of every other host's region to their
/// owners there (host g's region has channels of L_g q / C elements).
fn sends<'p>(plan: &Plan, p: &'p Piece<'_>, esz: usize, q: usize) -> Vec<(usize, &'p [u8])> {
    let c = plan.channels;
    (0..plan.hosts())
        .filter(|&g| g != plan.host)
        .flat_map(|g| {
            let part = region(plan, &p.parts, g, esz, q);
            plan.byte_runs(g, plan.mine(), plan.width(g) * q / c * esz)
                .into_iter()
                .map(move |(r, peer)| (peer, &part[r]))
        })
        .collect()
}
