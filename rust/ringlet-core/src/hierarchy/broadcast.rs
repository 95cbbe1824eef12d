//! Two-level broadcast. Per piece: the root's host broadcasts it within the
//! host (shared memory); each rank there sends the channels it owns to
//! their owners on every other host (all of the host's ranks stream at
//! once); each other host all-gathers its ranks' channels within the host.

use super::{bytes, chunks, give, pipeline, round_up, take, LocalSide, Net, Plan};
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
                    cross(plan, net, piece, next, esz, home)
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
            local.broadcast(p.full(esz), self.dtype, self.from)?;
        }
        Ok(p)
    }

    fn post(&mut self, local: &mut Communicator, _k: usize, mut p: Piece<'a>) -> Result<()> {
        let esz = self.esz;
        if !self.home {
            let part = p.n / self.width * esz;
            let mut tmp = std::mem::take(&mut p.tmp);
            local.all_gather(bytes(&mut tmp, part), p.full(esz), self.dtype)?;
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

/// On the root's host: sends this rank's channels to their owners on every
/// other host (the `next` piece's queued behind). Elsewhere: receives them
/// from their owners on the root's host.
fn cross(
    plan: &Plan,
    net: &Net<'_>,
    p: &mut Piece<'_>,
    next: Option<&mut Piece<'_>>,
    esz: usize,
    home: usize,
) -> Result<()> {
    if plan.host == home {
        let ahead = next
            .as_deref()
            .map_or_else(Vec::new, |n| sends(plan, n, esz, home));
        let got = net.exchange(sends(plan, p, esz, home), &p.sent, Vec::new(), ahead)?;
        if let Some(n) = next {
            n.sent = got;
        }
        return Ok(());
    }
    let chan = p.n / plan.channels * esz;
    let part = p.n / plan.local_size() * esz;
    let mut recvs = Vec::new();
    let mut rest = bytes(&mut p.tmp, part);
    for (r, peer) in plan.byte_runs(home, plan.mine(), chan) {
        let (head, tail) = rest.split_at_mut(r.len());
        rest = tail;
        recvs.push((peer, head));
    }
    net.exchange(Vec::new(), &[], recvs, Vec::new()).map(drop)
}

/// A piece's sends from the root's host: this rank's channels to their
/// owners on every other host.
fn sends<'p>(plan: &Plan, p: &'p Piece<'_>, esz: usize, home: usize) -> Vec<(usize, &'p [u8])> {
    let chan = p.n / plan.channels * esz;
    let part = p.n / plan.local_size() * esz;
    let mine = plan.mine();
    let first = mine.start * chan;
    let full: &[u8] = match &p.stage {
        Some(s) => &bytemuck::cast_slice(s)[..p.n * esz],
        None => p.data,
    };
    let own = &full[first..first + part];
    (0..plan.hosts())
        .filter(|&g| g != home)
        .flat_map(|g| plan.byte_runs(g, mine.clone(), chan))
        .map(|(r, peer)| (peer, &own[r]))
        .collect()
}
