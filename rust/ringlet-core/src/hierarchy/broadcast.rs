//! Two-level broadcast. Per piece: the root's host broadcasts it within the
//! host (shared memory); each rank there sends the channels it owns to
//! their owners on the other hosts (all of the host's ranks stream at once);
//! each other host all-gathers its ranks' channels within the host.
//!
//! Across two hosts, or a message of one piece, the root's host sends to
//! every other host itself. Across three or more hosts a longer message
//! goes down a chain instead (the root's host, then the hosts after it in
//! order, wrapping around): each host's ranks receive their channels of a
//! piece from the host before and pass them on to the host after, so every
//! host link carries the message once each way at most, where sending to
//! every host from the root's would put it H - 1 times through one link.

use super::{bytes, chunks, give, pipeline, recv_runs, round_up, take, LocalSide, Net, Plan};
use crate::dtype::DType;
use crate::error::Result;
use crate::group::Communicator;
use crate::transport::OpKind;

impl Communicator {
    /// `broadcast` on a communicator with levels.
    pub(crate) fn broadcast_levels(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        let esz = dtype.size();
        let count = buf.len() / esz;
        self.two_level(
            OpKind::Broadcast,
            dtype,
            None,
            count,
            root,
            |lv, net, stop| {
                if count == 0 {
                    return Ok(());
                }
                let plan = &lv.plan;
                let home = plan
                    .layout
                    .iter()
                    .position(|g| g.contains(&root))
                    .unwrap_or(0);
                let from = plan.layout[home]
                    .iter()
                    .position(|&r| r == root)
                    .unwrap_or(0);
                let pe = plan.piece_elems(count, esz);
                let pieces = count.div_ceil(pe);
                let chain = plan.hosts() >= 3 && pieces >= 2;
                let mut side = Side {
                    chunks: chunks(buf, pe * esz),
                    pool: &mut lv.pool,
                    esz,
                    dtype,
                    unit: plan.channels,
                    width: plan.local_size(),
                    home: plan.host == home,
                    from,
                };
                pipeline(&mut lv.local, &mut side, pieces, stop, |_, piece, next| {
                    cross(plan, net, piece, next, esz, home, chain)
                })
            },
        )
    }
}

/// Piece `k` of the buffer, padded to `n` elements (whole channels) in
/// `stage` when short; `tmp` receives this rank's channels off the root's
/// host.
struct Piece<'a> {
    data: &'a mut [u8],
    n: usize,
    stage: Option<Vec<u64>>,
    tmp: Vec<u64>,
    /// How far each send got ahead of time (see `Net::exchange`).
    sent: Vec<usize>,
}

impl Piece<'_> {
    /// The piece as the network sees it (padded).
    fn full(&mut self, esz: usize) -> &mut [u8] {
        match &mut self.stage {
            Some(s) => bytes(s, self.n * esz),
            None => self.data,
        }
    }
}

struct Side<'a, 'p> {
    chunks: Vec<Option<&'a mut [u8]>>,
    pool: &'p mut Vec<Vec<u64>>,
    esz: usize,
    dtype: DType,
    unit: usize,
    width: usize,
    /// Whether this host holds the root, and the root's local rank.
    home: bool,
    from: usize,
}

impl<'a> LocalSide for Side<'a, '_> {
    type Piece = Piece<'a>;

    fn pre(&mut self, local: &mut Communicator, k: usize) -> Result<Piece<'a>> {
        let esz = self.esz;
        let data = self.chunks[k].take().unwrap_or_default();
        let n = round_up(data.len() / esz, self.unit);
        let stage = (n * esz != data.len()).then(|| {
            let mut v = take(self.pool, n * esz);
            let b = bytes(&mut v, n * esz);
            b[..data.len()].copy_from_slice(data);
            b[data.len()..].fill(0);
            v
        });
        let tmp = take(self.pool, n / self.width * esz);
        let mut p = Piece {
            data,
            n,
            stage,
            tmp,
            sent: Vec::new(),
        };
        if self.home {
            local.broadcast_flat(p.full(esz), self.dtype, self.from)?;
        }
        Ok(p)
    }

    fn post(&mut self, local: &mut Communicator, _k: usize, mut p: Piece<'a>) -> Result<()> {
        let esz = self.esz;
        if !self.home {
            let part = p.n / self.width * esz;
            let mut tmp = std::mem::take(&mut p.tmp);
            local.all_gather_flat(bytes(&mut tmp, part), p.full(esz), self.dtype)?;
            p.tmp = tmp;
        }
        if let Some(s) = &p.stage {
            let len = p.data.len();
            p.data.copy_from_slice(&bytemuck::cast_slice(s)[..len]);
        }
        give(self.pool, [p.tmp]);
        give(self.pool, p.stage);
        Ok(())
    }
}

/// The hosts this host sends a piece to: every other host from the root's
/// host, or along the chain the next host unless it is the root's; and the
/// host it receives from (None on the root's host).
fn route(plan: &Plan, home: usize, chain: bool) -> (Vec<usize>, Option<usize>) {
    let (h, n) = (plan.host, plan.hosts());
    let after = (h + 1) % n;
    let to = match (chain, h == home) {
        (false, true) => (0..n).filter(|&g| g != home).collect(),
        (false, false) => Vec::new(),
        (true, _) if after == home => Vec::new(),
        (true, _) => vec![after],
    };
    let from = match (chain, h == home) {
        (_, true) => None,
        (false, false) => Some(home),
        (true, false) => Some((h + n - 1) % n),
    };
    (to, from)
}

/// On the root's host: sends this rank's channels to their owners on the
/// hosts it serves (the `next` piece's queued behind). Elsewhere: receives
/// them from their owners on the host before, then (along a chain) passes
/// them on to their owners on the host after.
fn cross(
    plan: &Plan,
    net: &Net<'_>,
    p: &mut Piece<'_>,
    next: Option<&mut Piece<'_>>,
    esz: usize,
    home: usize,
    chain: bool,
) -> Result<()> {
    let (to, from) = route(plan, home, chain);
    let chan = p.n / plan.channels * esz;
    let part = p.n / plan.local_size() * esz;
    let Some(from) = from else {
        let mine = sends(plan, own(plan, p, esz), chan, &to);
        return net.exchange_ahead(
            mine,
            &p.sent,
            Vec::new(),
            next,
            |n| sends(plan, own(plan, n, esz), n.n / plan.channels * esz, &to),
            |n| &mut n.sent,
        );
    };
    let recvs = recv_runs(
        bytes(&mut p.tmp, part),
        plan.byte_runs(from, plan.mine(), chan),
    );
    net.exchange(Vec::new(), &[], recvs, Vec::new())?;
    if to.is_empty() {
        return Ok(());
    }
    let tmp = super::view(&p.tmp, part);
    net.exchange(sends(plan, tmp, chan, &to), &[], Vec::new(), Vec::new())
        .map(drop)
}

/// This rank's channels of a piece on the root's host.
fn own<'p>(plan: &Plan, p: &'p Piece<'_>, esz: usize) -> &'p [u8] {
    let chan = p.n / plan.channels * esz;
    let part = p.n / plan.local_size() * esz;
    let first = plan.mine().start * chan;
    let full: &[u8] = match &p.stage {
        Some(s) => &bytemuck::cast_slice(s)[..p.n * esz],
        None => p.data,
    };
    &full[first..first + part]
}

/// A piece's sends: this rank's channels (`own`) to their owners on the
/// hosts `to`.
fn sends<'p>(plan: &Plan, own: &'p [u8], chan: usize, to: &[usize]) -> Vec<(usize, &'p [u8])> {
    let mine = plan.mine();
    to.iter()
        .flat_map(|&g| plan.byte_runs(g, mine.clone(), chan))
        .map(|(r, peer)| (peer, &own[r]))
        .collect()
}
