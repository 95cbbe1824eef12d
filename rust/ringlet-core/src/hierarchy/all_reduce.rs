//! Two-level all-reduce. Per piece: reduce-scatter within the host (shared
//! memory) leaves each rank the host's partial sums of its channels; the
//! owners of each channel on the different hosts all-reduce it over TCP;
//! an all-gather within the host hands every rank the whole piece.
//!
//! Across hosts, for each run of channels with one owner per host: two
//! hosts swap their partial sums and both reduce them in host order (one
//! message each way); three or more reduce-scatter the run among its
//! owners (part g to host g), reduce, and all-gather the parts back. Either
//! way 2(H-1)/H of the buffer leaves each host, the least an all-reduce can
//! send, spread over all of the host's ranks.

use super::{bytes, chunks, give, pipeline, recv_runs, round_up, take, view, LocalSide, Net, Plan};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::flat::all_reduce::doubling;
use crate::flat::all_reduce::AllReduce;
use crate::flat::part_bytes;
use crate::flat::reduce_scatter::ReduceScatter;
use crate::group::Communicator;
use crate::reduce;
use crate::transport::tcp::Xfer;
use crate::transport::OpKind;

impl Communicator {
    /// `all_reduce` / `all_reduce_into` on a communicator with levels.
    pub(crate) fn all_reduce_levels(&mut self, args: AllReduce<'_>) -> Result<()> {
        let esz = args.dtype.size();
        let count = args.buf.len() / esz;
        self.two_level(
            OpKind::AllReduce,
            args.dtype,
            Some(args.op),
            count,
            0,
            |lv, net, stop| {
                if let Some(src) = args.input {
                    args.buf.copy_from_slice(src);
                }
                if count == 0 {
                    return Ok(());
                }
                let plan = &lv.plan;
                let pe = plan.piece_elems(count, esz);
                let pieces = count.div_ceil(pe);
                let mut side = Side {
                    chunks: chunks(args.buf, pe * esz),
                    pool: &mut lv.pool,
                    dtype: args.dtype,
                    op: args.op,
                    unit: plan.channels,
                    width: plan.local_size(),
                    hosts: plan.hosts(),
                };
                pipeline(&mut lv.local, &mut side, pieces, stop, |_, p, next| {
                    cross(plan, net, p, next, args.dtype, args.op)
                })
            },
        )
    }
}

/// One piece on its way: `data` is the piece of the caller's buffer; the
/// reduce-scatter leaves this rank's channels in `shard` (of `n` padded
/// elements in all), `tmp` receives the peers' partial sums.
struct Piece<'a> {
    data: &'a mut [u8],
    n: usize,
    shard: Vec<u64>,
    tmp: Vec<u64>,
    stage: Option<Vec<u64>>,
    /// Bytes of each run already sent ahead (two hosts: while the previous
    /// piece's data arrived).
    sent: Vec<usize>,
}

struct Side<'a, 'p> {
    chunks: Vec<Option<&'a mut [u8]>>,
    pool: &'p mut Vec<Vec<u64>>,
    dtype: DType,
    op: ReduceOp,
    unit: usize,
    width: usize,
    hosts: usize,
}

impl<'a> LocalSide for Side<'a, '_> {
    type Piece = Piece<'a>;

    fn pre(&mut self, local: &mut Communicator, k: usize) -> Result<Piece<'a>> {
        let esz = self.dtype.size();
        let data = self.chunks[k].take().unwrap_or_default();
        let real = data.len() / esz;
        // A short last piece is padded to whole channels in a staging copy
        // (the padding is reduced along and dropped).
        let n = round_up(real, self.unit);
        let sb = n / self.width * esz;
        let tmp_bytes = if self.hosts == 2 {
            sb
        } else {
            self.hosts * (n / self.width).div_ceil(self.hosts) * esz
        };
        let mut shard = take(self.pool, sb);
        let tmp = take(self.pool, tmp_bytes);
        let stage = if n == real {
            local.reduce_scatter_flat(ReduceScatter {
                input: data,
                output: bytes(&mut shard, sb),
                dtype: self.dtype,
                op: self.op,
            })?;
            None
        } else {
            let mut st = take(self.pool, n * esz);
            let s = bytes(&mut st, n * esz);
            s[..data.len()].copy_from_slice(data);
            s[data.len()..].fill(0);
            local.reduce_scatter_flat(ReduceScatter {
                input: s,
                output: bytes(&mut shard, sb),
                dtype: self.dtype,
                op: self.op,
            })?;
            Some(st)
        };
        Ok(Piece {
            data,
            n,
            shard,
            tmp,
            stage,
            sent: Vec::new(),
        })
    }

    fn post(&mut self, local: &mut Communicator, _k: usize, p: Piece<'a>) -> Result<()> {
        let esz = self.dtype.size();
        let Piece {
            data,
            n,
            mut shard,
            tmp,
            stage,
            ..
        } = p;
        let sb = n / self.width * esz;
        match stage {
            None => local.all_gather_flat(bytes(&mut shard, sb), data, self.dtype)?,
            Some(mut st) => {
                let s = bytes(&mut st, n * esz);
                local.all_gather_flat(bytes(&mut shard, sb), s, self.dtype)?;
                data.copy_from_slice(&s[..data.len()]);
                give(self.pool, [st]);
            }
        }
        give(self.pool, [shard, tmp]);
        Ok(())
    }
}

/// A piece's sends between two hosts: each run of this rank's channels to
/// its owner on the other host.
fn pair_sends<'p>(plan: &Plan, n: &'p Piece<'_>, esz: usize) -> Vec<(usize, &'p [u8])> {
    let chan = n.n / plan.channels * esz;
    let shard = view(&n.shard, n.n / plan.local_size() * esz);
    plan.byte_runs(1 - plan.host, plan.mine(), chan)
        .into_iter()
        .map(|(r, q)| (q, &shard[r]))
        .collect()
}

/// From this many hosts, runs of at most `DOUBLING_MAX_BYTES` are
/// all-reduced across hosts by recursive doubling: log2 H exchanges of the
/// whole run instead of two steps with H - 1 messages each (the per-message
/// costs win over the bytes for small runs on many hosts).
const DOUBLING_MIN_HOSTS: usize = 8;
const DOUBLING_MAX_BYTES: usize = 64 << 10;

/// All-reduces this rank's channels of one piece with their owners on the
/// other hosts; the result is left in `p.shard`. With two hosts the sends of
/// the `next` piece, when it is ready, go out behind this piece's, so the
/// link does not idle while this piece is reduced and handed back.
fn cross(
    plan: &Plan,
    net: &Net<'_>,
    p: &mut Piece<'_>,
    next: Option<&mut Piece<'_>>,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let esz = dtype.size();
    let chan = p.n / plan.channels * esz;
    let sb = p.n / plan.local_size() * esz;
    let (h, hosts) = (plan.host, plan.hosts());
    if hosts == 2 {
        let runs = plan.byte_runs(1 - h, plan.mine(), chan);
        let shard = bytes(&mut p.shard, sb);
        let tmp = bytes(&mut p.tmp, sb);
        {
            let sends = runs.iter().map(|(r, q)| (*q, &shard[r.clone()])).collect();
            let recvs = recv_runs(tmp, runs.iter().cloned());
            net.exchange_ahead(
                sends,
                &p.sent,
                recvs,
                next,
                |n| pair_sends(plan, n, esz),
                |n| &mut n.sent,
            )?;
        }
        // Host 0's partial first, on both hosts: the same bits everywhere.
        if h == 0 {
            reduce::reduce_inplace(dtype, op, shard, &[tmp])?;
        } else {
            reduce::reduce_inplace(dtype, op, tmp, &[shard])?;
            std::mem::swap(&mut p.shard, &mut p.tmp);
        }
        return Ok(());
    }
    let shard = bytes(&mut p.shard, sb);
    let first = plan.mine().start;
    for (chans, owners) in plan.segments() {
        let seg = &mut shard[(chans.start - first) * chan..(chans.end - first) * chan];
        if hosts >= DOUBLING_MIN_HOSTS && seg.len() <= DOUBLING_MAX_BYTES {
            doubling(
                owners.len(),
                h,
                |i| owners[i],
                seg,
                dtype,
                op,
                |x| net.transfer(x),
            )?;
            continue;
        }
        let e = seg.len() / esz;
        let part = |g: usize| part_bytes(e, hosts, g, esz);
        let mine = part(h);
        // Reduce-scatter: part g of the run to host g's owner; this rank
        // reduces part h of every host's partial sums, in host order.
        let tmp = bytes(&mut p.tmp, hosts * mine.len());
        let (slots, out) = tmp.split_at_mut((hosts - 1) * mine.len());
        {
            let mut x = Vec::with_capacity(2 * hosts);
            let mut rest: &mut [u8] = slots;
            for g in (0..hosts).filter(|&g| g != h) {
                let (head, tail) = rest.split_at_mut(mine.len());
                rest = tail;
                x.push(Xfer::send(owners[g], &seg[part(g)]));
                x.push(Xfer::recv(owners[g], head));
            }
            net.transfer(&mut x)?;
        }
        {
            let mut theirs = slots.chunks(mine.len().max(1));
            let srcs: Vec<&[u8]> = (0..hosts)
                .map(|g| {
                    if g == h {
                        &seg[mine.clone()]
                    } else {
                        theirs.next().unwrap_or(&[])
                    }
                })
                .collect();
            reduce::reduce_into(dtype, op, &mut out[..mine.len()], &srcs)?;
        }
        seg[mine.clone()].copy_from_slice(&out[..mine.len()]);
        // All-gather: this rank's reduced part to every owner, theirs back.
        let mut parts: Vec<&mut [u8]> = Vec::with_capacity(hosts);
        let mut rest: &mut [u8] = seg;
        for g in 0..hosts {
            let (head, tail) = rest.split_at_mut(part(g).len());
            rest = tail;
            parts.push(head);
        }
        let (before, rest) = parts.split_at_mut(h);
        let Some((done, after)) = rest.split_first_mut() else {
            continue;
        };
        let mut x = Vec::with_capacity(2 * hosts);
        for (g, slot) in before.iter_mut().enumerate() {
            x.push(Xfer::send(owners[g], done));
            x.push(Xfer::recv(owners[g], slot));
        }
        for (j, slot) in after.iter_mut().enumerate() {
            let g = h + 1 + j;
            x.push(Xfer::send(owners[g], done));
            x.push(Xfer::recv(owners[g], slot));
        }
        net.transfer(&mut x)?;
    }
    Ok(())
}
