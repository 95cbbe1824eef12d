//! Two-level all-gather. The blocks of each host, in local-rank order, form
//! the host's block; cut into channels, channel c of it belongs to the
//! rank of that host that owns c, which is exactly the rank whose input it
//! is. Per piece (the same element range of every rank's input):
//! * pre: all-gather of this host's piece within the host (shared memory);
//! * cross: this rank sends its own piece to the owners of its channels on
//!   every other host and receives, from each other host, the channels of
//!   that host's piece that it owns; each host's block crosses each link
//!   once, carried by all of its ranks;
//! * post: per other host, all-gather of what its ranks received within
//!   the host.
//!
//! Host blocks land in a staging buffer and are copied to their ranks'
//! places in the output (ranks of a host need not be consecutive).

use super::{bytes, give, pipeline, recv_runs, take, LocalSide, Net, Plan};
use crate::dtype::DType;
use crate::error::Result;
use crate::group::Communicator;
use crate::transport::OpKind;

impl Communicator {
    /// `all_gather` on a communicator with levels.
    pub(crate) fn all_gather_levels(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
    ) -> Result<()> {
        let esz = dtype.size();
        let count = input.len() / esz;
        let p = self.size();
        self.two_level(OpKind::AllGather, dtype, None, count, 0, |lv, net, stop| {
            if count == 0 {
                return Ok(());
            }
            let plan = &lv.plan;
            let q = plan.block_piece(count, p, esz);
            let pieces = count.div_ceil(q);
            let mut side = Side {
                plan,
                input,
                output,
                pool: &mut lv.pool,
                dtype,
                q,
                count,
            };
            pipeline(&mut lv.local, &mut side, pieces, stop, |_, piece, next| {
                cross(plan, net, piece, next, input, esz, q)
            })
        })
    }
}

/// Piece `k`: the range of every rank's block it covers (`start`, `real`
/// elements, padded to `q`), this rank's padded input piece when the last
/// piece is short, and what arrived from each other host (`recv`: host g's
/// channels this rank owns, hosts in order).
struct Piece {
    start: usize,
    real: usize,
    pad: Option<Vec<u64>>,
    recv: Vec<u64>,
    /// How far each send got ahead of time (see `Net::exchange`).
    sent: Vec<usize>,
}

struct Side<'a, 'p> {
    plan: &'p Plan,
    input: &'a [u8],
    output: &'a mut [u8],
    pool: &'p mut Vec<Vec<u64>>,
    dtype: DType,
    q: usize,
    count: usize,
}

impl Side<'_, '_> {
    /// Copies host `g`'s piece (`L_g` rank pieces of `q` elements, in
    /// `stage`) to its ranks' blocks in the output.
    fn scatter(&mut self, g: usize, stage: &[u8], start: usize, real: usize) {
        let esz = self.dtype.size();
        let (q, block) = (self.q * esz, self.count * esz);
        for (j, &r) in self.plan.layout[g].iter().enumerate() {
            let at = r * block + start * esz;
            self.output[at..at + real * esz].copy_from_slice(&stage[j * q..j * q + real * esz]);
        }
    }
}

impl LocalSide for Side<'_, '_> {
    type Piece = Piece;

    fn pre(&mut self, local: &mut Communicator, k: usize) -> Result<Piece> {
        let (esz, q, plan) = (self.dtype.size(), self.q, self.plan);
        let start = k * q;
        let real = q.min(self.count - start);
        let input = self.input;
        let mine = &input[start * esz..(start + real) * esz];
        let pad = (real < q).then(|| {
            let mut v = take(self.pool, q * esz);
            let b = bytes(&mut v, q * esz);
            b[..mine.len()].copy_from_slice(mine);
            b[mine.len()..].fill(0);
            v
        });
        let l = plan.local_size();
        let widest = plan.layout.iter().map(Vec::len).max().unwrap_or(1);
        let mut stage = take(self.pool, widest * q * esz);
        let own = match &pad {
            Some(v) => &bytemuck::cast_slice(v)[..q * esz],
            None => mine,
        };
        local.all_gather_flat(own, bytes(&mut stage, l * q * esz), self.dtype)?;
        self.scatter(plan.host, bytemuck::cast_slice(&stage), start, real);
        give(self.pool, [stage]);
        let theirs: usize = (0..plan.hosts())
            .filter(|&g| g != plan.host)
            .map(|g| plan.width(g) * q / l)
            .sum();
        let recv = take(self.pool, theirs * esz);
        Ok(Piece {
            start,
            real,
            pad,
            recv,
            sent: Vec::new(),
        })
    }

    fn post(&mut self, local: &mut Communicator, _k: usize, p: Piece) -> Result<()> {
        let (esz, q, plan) = (self.dtype.size(), self.q, self.plan);
        let l = plan.local_size();
        let widest = plan.layout.iter().map(Vec::len).max().unwrap_or(1);
        let mut stage = take(self.pool, widest * q * esz);
        let recv: &[u8] = bytemuck::cast_slice(&p.recv);
        let mut at = 0;
        for g in (0..plan.hosts()).filter(|&g| g != plan.host) {
            let part = plan.width(g) * q / l * esz;
            let whole = bytes(&mut stage, plan.width(g) * q * esz);
            local.all_gather_flat(&recv[at..at + part], whole, self.dtype)?;
            at += part;
            self.scatter(g, bytemuck::cast_slice(&stage), p.start, p.real);
        }
        give(self.pool, [stage, p.recv]);
        give(self.pool, p.pad);
        Ok(())
    }
}

/// Sends this rank's piece to the owners of its channels on every other
/// host (the `next` piece's sends queued behind); receives the channels it
/// owns of every other host's piece.
fn cross(
    plan: &Plan,
    net: &Net<'_>,
    p: &mut Piece,
    next: Option<&mut Piece>,
    input: &[u8],
    esz: usize,
    q: usize,
) -> Result<()> {
    let (l, c) = (plan.local_size(), plan.channels);
    let mut recv = std::mem::take(&mut p.recv);
    let mut recvs = Vec::new();
    let mut rest: &mut [u8] = bytemuck::cast_slice_mut(&mut recv);
    for g in (0..plan.hosts()).filter(|&g| g != plan.host) {
        // Host g's piece has channels of w*q/c elements.
        let w = plan.width(g);
        let (slot, tail) = rest.split_at_mut(w * q / l * esz);
        rest = tail;
        recvs.extend(recv_runs(
            slot,
            plan.byte_runs(g, plan.mine(), w * q / c * esz),
        ));
    }
    // Not `Net::exchange_ahead`: the sends borrow the caller's input too.
    let ahead = next
        .as_deref()
        .map_or_else(Vec::new, |n| sends(plan, n, input, esz, q));
    let got = net.exchange(sends(plan, p, input, esz, q), &p.sent, recvs, ahead)?;
    if let Some(n) = next {
        n.sent = got;
    }
    p.recv = recv;
    Ok(())
}

/// A piece's sends: this rank's piece (its channels of this host's piece,
/// of l*q/c elements each) to their owners on every other host.
fn sends<'p>(
    plan: &Plan,
    p: &'p Piece,
    input: &'p [u8],
    esz: usize,
    q: usize,
) -> Vec<(usize, &'p [u8])> {
    let (l, c) = (plan.local_size(), plan.channels);
    let own: &[u8] = match &p.pad {
        Some(v) => &bytemuck::cast_slice(v)[..q * esz],
        None => &input[p.start * esz..(p.start + q) * esz],
    };
    (0..plan.hosts())
        .filter(|&g| g != plan.host)
        .flat_map(|g| plan.byte_runs(g, plan.mine(), l * q / c * esz))
        .map(|(r, peer)| (peer, &own[r]))
        .collect()
}
