//! All-reduce on one level: every rank ends with the element-wise
//! reduction of every rank's buffer, bit-identical on all ranks.
//!
//! Shared memory, three paths by size:
//! * small (<= `small_bytes`, 4 KiB by default): each rank copies its buffer
//!   into its slot, one phase, then every rank reduces all slots in rank
//!   order into its buffer. One synchronisation per call.
//! * staged (above `small_bytes`, below `cma_threshold`): pieces of half a slot. Per
//!   piece, rank r owns part r. Each rank stages only the parts its peers own
//!   (its own part never leaves its buffer: (p-1)/p of the copy-in); after the
//!   phase, r reduces part r of its buffer and of every peer's slot, in rank
//!   order, into its own slot, then every rank copies each owner's part out
//!   (phase). Staging only peers' parts took 2 ranks from 76-118 to 60-64 µs at
//!   1 MiB, 36-40 to 31-36 µs at 256 KiB and 273-286 to 239-296 µs at 4 MiB.
//!   A message of one piece is staged in a window that moves through the
//!   half ([`ShmGroup::next_window`]); with that, this path beats the small
//!   one from 4 KiB on 2 ranks (fp32, µs: 4 KiB 2.3 vs 2.5, 16 KiB 3.5 vs
//!   4.1, 64 KiB 7.5 vs 10.4), which is why `small_bytes` fell from 64 KiB
//!   to 2 KiB. Measured again in this VM's slow placement (2026-12-02,
//!   `bench c10d --what doors`, 2 ranks, three alternating runs each), the
//!   one-phase path wins at 4 KiB (engine call 1.36-1.40 vs 1.63-1.70 µs,
//!   float32; bfloat16 1.59-1.67 vs 1.76-1.83), ties at 8 KiB and loses at
//!   16 KiB (3.4 vs 3.0), while in the fast placement the two were within
//!   0.05 µs at 4 KiB: `small_bytes` is 4 KiB.
//! * single-copy (from `cma_threshold`, off by default: the staged path is
//!   faster on the machines measured, see `group::DEFAULT_CMA_THRESHOLD`):
//!   rank r owns part r. In pieces
//!   of 128 KiB it reads its piece from each peer's buffer into a
//!   cache-resident scratch, reduces it into its own buffer and writes the
//!   result, still in cache, into every peer's buffer. Parts are disjoint, so
//!   the only phases are the first (addresses) and the last (all written).
//!
//! TCP: small messages are exchanged with every peer and reduced locally in
//! rank order (up to 7 ranks) or combined by recursive doubling (8 ranks and
//! up: log2 p steps, see [`doubling`]); larger ones use a ring reduce-scatter then a ring all-gather
//! (2(p-1)/p of the buffer crosses each link). float16/bfloat16 travel and
//! accumulate as float32.

use super::{
    part_bytes, pieces, scratch, split_ref_mut, via_f32, Reused, RingOrder, CMA_PIECE, TCP_SMALL,
};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::group::{Communicator, Config, Link};
use crate::reduce;
use crate::transport::shm::ShmGroup;
use crate::transport::tcp::{TcpMesh, Xfer};
use crate::transport::{OpDesc, OpKind};

const OP: &str = "all_reduce";

/// Received bytes reduced at a time while a TCP ring step is in flight.
const OVERLAP_BATCH: usize = 128 << 10;

/// Bytes a TCP ring step moves per chunk (the receive scratch's size).
const TCP_CHUNK: usize = 1 << 20;

/// An all-reduce's arguments, checked by the entry points and handed on, as
/// one value, to the flat or the two-level algorithm: the reduction of
/// `input` when given (out of place), else of `buf`, into `buf`.
pub(crate) struct AllReduce<'a> {
    pub(crate) input: Option<&'a [u8]>,
    pub(crate) buf: &'a mut [u8],
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
}

impl Communicator {
    /// The all-reduce into `buf`, of `input` when given (else of `buf`), on
    /// one level.
    pub(crate) fn all_reduce_flat(&mut self, args: AllReduce<'_>) -> Result<()> {
        let count = args.buf.len() / args.dtype.size();
        self.guarded(|c| {
            let desc = c.next_desc(OpKind::AllReduce, args.dtype, Some(args.op), count, 0);
            if let (Some(src), Link::Shm { shm, .. }) = (args.input, &mut c.link) {
                if one_phase(shm, &c.cfg, args.buf.len()) {
                    stage(shm, &desc, src)?;
                    return shm.reduce_all_slots(args.dtype, args.op, 0, args.buf);
                }
            }
            if let Some(src) = args.input {
                args.buf.copy_from_slice(src);
            }
            match &mut c.link {
                Link::Local => Ok(()),
                Link::Shm { shm, .. } => {
                    shm_all_reduce(shm, &c.cfg, desc, args.buf, args.dtype, args.op)
                }
                Link::Tcp(mesh) => {
                    mesh.agree(&desc, c.cfg.timeout)?;
                    tcp_all_reduce(mesh, &c.cfg, args.buf, args.dtype, args.op)
                }
            }
        })
    }
}

/// Whether an all-reduce of `n` bytes takes the one-phase path: every rank
/// stages its buffer in its slot and reduces all slots.
fn one_phase(shm: &ShmGroup, cfg: &Config, n: usize) -> bool {
    n <= cfg.small_bytes.min(shm.half_bytes())
}

/// The one-phase path's staging: `input` into this rank's slot, then the
/// phase that makes every slot readable.
fn stage(shm: &mut ShmGroup, desc: &OpDesc, input: &[u8]) -> Result<()> {
    shm.next_window(desc.seq, input.len());
    shm.put(0, input);
    shm.arrive(desc)
}

fn shm_all_reduce(
    shm: &mut ShmGroup,
    cfg: &Config,
    mut desc: OpDesc,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (n, esz) = (buf.len(), dtype.size());
    let (p, r) = (shm.size(), shm.rank());
    if one_phase(shm, cfg, n) {
        stage(shm, &desc, buf)?;
        return shm.reduce_all_slots(dtype, op, 0, buf);
    }
    let count = n / esz;
    if shm.cma() && n >= cfg.cma_threshold {
        desc.addr = buf.as_ptr() as u64;
        shm.next_half();
        shm.arrive(&desc)?;
        let addrs: Vec<u64> = (0..p)
            .map(|j| shm.peer_desc(j).map(|d| d.addr))
            .collect::<Result<_>>()?;
        // Rank r owns part r. Piece by piece (cache-sized), it reads that
        // piece from every peer's buffer, reduces it into its own buffer and
        // writes the result straight into every peer's buffer. Nobody else
        // reads or writes part r of any buffer meanwhile, so no phase is
        // needed until the last one, which tells everyone all writes landed.
        let own = part_bytes(count, p, r, esz);
        let piece = (CMA_PIECE / esz) * esz;
        let mut tmp = Reused::new((p - 1) * piece);
        let tmp = tmp.bytes();
        for start in (own.start..own.end).step_by(piece) {
            let range = start..(start + piece).min(own.end);
            let len = range.len();
            let mut slots: Vec<&mut [u8]> = tmp.chunks_mut(piece).map(|c| &mut c[..len]).collect();
            for (slot, j) in slots.iter_mut().zip((0..p).filter(|&j| j != r)) {
                shm.read_peer(j, addrs[j] + start as u64, slot, OP)?;
            }
            let srcs: Vec<&[u8]> = slots.iter().map(|s| &**s).collect();
            reduce::reduce_inplace(dtype, op, &mut buf[range.clone()], &srcs)?;
            for j in (0..p).filter(|&j| j != r) {
                shm.write_peer(j, addrs[j] + start as u64, &buf[range.clone()], OP)?;
            }
        }
        return shm.sync(OP);
    }
    let parts = pieces(n, shm.half_bytes(), esz);
    for (k, piece) in parts.iter().cloned().enumerate() {
        shm.next_piece(desc.seq, parts.len(), piece.len());
        let pcount = piece.len() / esz;
        let mine = part_bytes(pcount, p, r, esz);
        // Only the parts peers reduce are staged; our own part stays in `buf`.
        for j in (0..p).filter(|&j| j != r) {
            let theirs = part_bytes(pcount, p, j, esz);
            shm.put(
                theirs.start,
                &buf[piece.start + theirs.start..piece.start + theirs.end],
            );
        }
        if k == 0 {
            shm.arrive(&desc)?;
        } else {
            shm.sync(OP)?;
        }
        shm.reduce_own_part(
            dtype,
            op,
            mine.start,
            &buf[piece.start + mine.start..piece.start + mine.end],
        )?;
        shm.get(
            r,
            mine.start,
            &mut buf[piece.start + mine.start..piece.start + mine.end],
        );
        shm.sync(OP)?;
        for j in (0..p).filter(|&j| j != r) {
            let theirs = part_bytes(pcount, p, j, esz);
            shm.get(
                j,
                theirs.start,
                &mut buf[piece.start + theirs.start..piece.start + theirs.end],
            );
        }
    }
    Ok(())
}

/// TCP all-reduce after the agreement check (also used by other collectives).
pub(crate) fn tcp_all_reduce(
    mesh: &TcpMesh,
    cfg: &Config,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    if matches!(dtype, DType::F16 | DType::BF16) {
        return via_f32(dtype, buf, |wide| {
            tcp_all_reduce(mesh, cfg, wide, DType::F32, op)
        });
    }
    let (p, r) = (mesh.size(), mesh.rank());
    let esz = dtype.size();
    if buf.len() <= TCP_SMALL && p >= RD_MIN_RANKS {
        let transfer = |x: &mut [Xfer<'_>]| mesh.transfer(x, OP, cfg.timeout);
        return doubling(p, r, |i| i, buf, dtype, op, transfer);
    }
    if buf.len() <= TCP_SMALL {
        let mut theirs = vec![scratch(buf.len()); p];
        {
            let mut x: Vec<Xfer> = Vec::with_capacity(2 * p);
            for (j, t) in theirs.iter_mut().enumerate().filter(|(j, _)| *j != r) {
                x.push(Xfer::send(j, buf));
                x.push(Xfer::recv(j, &mut bytemuck::cast_slice_mut(t)[..buf.len()]));
            }
            mesh.transfer(&mut x, OP, cfg.timeout)?;
        }
        let srcs: Vec<&[u8]> = theirs
            .iter()
            .enumerate()
            .map(|(j, t)| {
                if j == r {
                    &*buf
                } else {
                    &bytemuck::cast_slice(t)[..buf.len()]
                }
            })
            .collect();
        let mut out = scratch(buf.len());
        let out = &mut bytemuck::cast_slice_mut(&mut out)[..buf.len()];
        reduce::reduce_into(dtype, op, out, &srcs)?;
        buf.copy_from_slice(out);
        return Ok(());
    }
    // Ring reduce-scatter over `p` parts of `buf`, in place, around the ring
    // of [`RingOrder`] (parts are numbered by ring position: the result does
    // not depend on which rank reduced which part). At step s the rank at
    // position r sends part `r - s` to the next rank and reduces part
    // `r - s - 1` (mod p) received from the previous one; after p-1 steps it
    // owns the fully reduced part `r + 1`, where the ring all-gather starts.
    let count = buf.len() / esz;
    let pos = RingOrder::new(p, r).pos;
    let mut ring = Ring::new(mesh, OP, dtype, op);
    for s in 0..p - 1 {
        let send = part_bytes(count, p, (pos + p - s) % p, esz);
        let recv = part_bytes(count, p, (pos + 2 * p - s - 1) % p, esz);
        let (out, dst) = split_ref_mut(buf, send, recv);
        ring.step(mesh, cfg, out, dst, None)?;
    }
    ring_all_gather(mesh, cfg, buf, count, esz, 1)
}

/// From this many ranks, small TCP all-reduces use recursive doubling
/// (log2 p exchange steps) instead of one exchange with every peer. One
/// exchange costs a latency plus p - 1 messages per rank, recursive doubling
/// log2 p latencies and messages; on loopback here the two are level at 4
/// and 8 ranks (docs/scaling.md, "Within one host"), and across real links the exchange's
/// p - 1 messages per rank dominate beyond that.
const RD_MIN_RANKS: usize = 8;

/// Recursive doubling for small TCP all-reduces, among `n` participants of
/// which this one is `me`: `rank_of(i)` is participant i's rank in the mesh,
/// and `transfer` runs one step's transfers (the flat TCP all-reduce runs it
/// over every rank, the two-level one over each host's owner of a channel).
/// With `q` the largest power of two not above `n`, the first `2(n - q)`
/// participants pair up (even with odd) and the odd one folds in its
/// partner's buffer, leaving `q`; in step `k` each swaps its whole partial
/// result with the one whose index differs in bit `k` and reduces the two,
/// lower block first, so both partners compute the same value bit for bit;
/// at the end each odd folder hands the result back to its even partner.
/// log2(q) + 2 steps, one message each, instead of n - 1 messages per rank.
pub(crate) fn doubling(
    n: usize,
    me: usize,
    rank_of: impl Fn(usize) -> usize,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    transfer: impl Fn(&mut [Xfer<'_>]) -> Result<()>,
) -> Result<()> {
    let q = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let extra = n - q;
    let len = buf.len();
    let mut theirs = scratch(len);
    let mut out = scratch(len);
    let t = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut theirs)[..len];
    let o = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut out)[..len];
    // Index among the q participants (None: an even folder that sits out),
    // and the participant that holds index `i`.
    let index = if me < 2 * extra {
        (me % 2 == 1).then_some(me / 2)
    } else {
        Some(me - extra)
    };
    let holder = |i: usize| if i < extra { 2 * i + 1 } else { i + extra };
    if me < 2 * extra {
        if me.is_multiple_of(2) {
            transfer(&mut [Xfer::send(rank_of(me + 1), buf)])?;
        } else {
            transfer(&mut [Xfer::recv(rank_of(me - 1), t)])?;
            reduce::reduce_into(dtype, op, o, &[&*t, &*buf])?;
            buf.copy_from_slice(o);
        }
    }
    if let Some(i) = index {
        let mut mask = 1;
        while mask < q {
            let partner = i ^ mask;
            let peer = rank_of(holder(partner));
            transfer(&mut [Xfer::send(peer, buf), Xfer::recv(peer, t)])?;
            if partner < i {
                reduce::reduce_into(dtype, op, o, &[&*t, &*buf])?;
            } else {
                reduce::reduce_into(dtype, op, o, &[&*buf, &*t])?;
            }
            buf.copy_from_slice(o);
            mask <<= 1;
        }
    }
    if me < 2 * extra {
        if me % 2 == 1 {
            transfer(&mut [Xfer::send(rank_of(me - 1), buf)])?;
        } else {
            transfer(&mut [Xfer::recv(rank_of(me + 1), buf)])?;
        }
    }
    Ok(())
}

/// The reduce steps of a TCP ring: each sends a block to the next rank while
/// the previous rank's block arrives, in chunks through a small,
/// cache-resident scratch; within a chunk, what has arrived is reduced while
/// the rest is still in flight.
pub(crate) struct Ring {
    what: &'static str,
    next: usize,
    prev: usize,
    dtype: DType,
    op: ReduceOp,
    chunk: usize,
    tmp: Reused,
}

impl Ring {
    pub(crate) fn new(mesh: &TcpMesh, what: &'static str, dtype: DType, op: ReduceOp) -> Self {
        let order = RingOrder::new(mesh.size(), mesh.rank());
        let chunk = (TCP_CHUNK / dtype.size()).max(1) * dtype.size();
        Ring {
            what,
            next: order.next(),
            prev: order.prev(),
            dtype,
            op,
            chunk,
            tmp: Reused::new(chunk),
        }
    }

    /// One step: sends `out`, receives `dst.len()` bytes and reduces them:
    /// `dst = base ⊕ received` when `base` is given (the input stays
    /// untouched), else `dst ⊕= received`. `out` and `dst` may differ in
    /// length (uneven parts).
    pub(crate) fn step(
        &mut self,
        mesh: &TcpMesh,
        cfg: &Config,
        out: &[u8],
        dst: &mut [u8],
        base: Option<&[u8]>,
    ) -> Result<()> {
        let (dtype, op, chunk) = (self.dtype, self.op, self.chunk);
        let esz = dtype.size();
        let tmp = self.tmp.bytes();
        // Chunk by chunk, each reduced as it arrives.
        for k in 0..out.len().max(dst.len()).div_ceil(chunk) {
            let piece = |len: usize| (k * chunk).min(len)..((k + 1) * chunk).min(len);
            let (sp, rp) = (piece(out.len()), piece(dst.len()));
            let base = base.map(|b| &b[rp.clone()]);
            let (out, dst) = (&out[sp], &mut dst[rp]);
            let len = dst.len();
            let mut reduced = 0;
            mesh.transfer_with(
                &mut [
                    Xfer::send(self.next, out),
                    Xfer::recv(self.prev, &mut tmp[..len]),
                ],
                self.what,
                cfg.timeout,
                |x| {
                    let got = x[1].received();
                    let upto = got.len() - got.len() % esz;
                    if upto - reduced >= OVERLAP_BATCH || upto == len {
                        reduce_chunk(dtype, op, &mut dst[reduced..upto], base, got, reduced)?;
                        reduced = upto;
                    }
                    Ok(())
                },
            )?;
            if reduced < len {
                reduce_chunk(dtype, op, &mut dst[reduced..], base, &tmp[..len], reduced)?;
            }
        }
        Ok(())
    }
}

/// Reduces `got[from..from + dst.len()]` into `dst`, on top of the same range
/// of `base` when given.
fn reduce_chunk(
    dtype: DType,
    op: ReduceOp,
    dst: &mut [u8],
    base: Option<&[u8]>,
    got: &[u8],
    from: usize,
) -> Result<()> {
    let range = from..from + dst.len();
    match base {
        Some(b) => reduce::reduce_into(dtype, op, dst, &[&b[range.clone()], &got[range]]),
        None => reduce::reduce_inplace(dtype, op, dst, &[&got[range]]),
    }
}

/// Ring all-gather over `p` parts of `buf`, in place, around the ring of
/// [`RingOrder`], when the rank at ring position r starts out holding part
/// `(r + shift) % p`.
pub(crate) fn ring_all_gather(
    mesh: &TcpMesh,
    cfg: &Config,
    buf: &mut [u8],
    count: usize,
    esz: usize,
    shift: usize,
) -> Result<()> {
    let order = RingOrder::new(mesh.size(), mesh.rank());
    let (p, r) = (mesh.size(), order.pos);
    let (next, prev) = (order.next(), order.prev());
    for s in 0..p - 1 {
        let send = part_bytes(count, p, (r + shift + p - s) % p, esz);
        let recv = part_bytes(count, p, (r + shift + 2 * p - s - 1) % p, esz);
        let (out, inc) = split_ref_mut(buf, send, recv);
        mesh.transfer(
            &mut [Xfer::send(next, out), Xfer::recv(prev, inc)],
            "all_gather",
            cfg.timeout,
        )?;
    }
    Ok(())
}
