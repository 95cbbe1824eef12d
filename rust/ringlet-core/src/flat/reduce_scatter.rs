//! Reduce-scatter on one level: `input` holds `size` equal blocks; rank r
//! receives the element-wise reduction of block r over all ranks.
//!
//! Shared memory: staged pieces (each rank copies the same piece of every
//! block into its slot; after one phase rank r reduces piece r of all slots in
//! rank order), or, for large inputs with cross-memory attach, rank r reads
//! block r of each peer's input in cache-sized pieces and reduces them.
//!
//! TCP: ring reduce-scatter that reads the input in place and builds partial
//! sums in two block-sized accumulators, arranged so that rank r finishes
//! owning block r; float16/bfloat16 travel as float32.

use super::all_reduce::Ring;
use super::{pieces, Reused, RingOrder, CMA_PIECE};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::group::{Communicator, Config, Link};
use crate::reduce;
use crate::transport::shm::ShmGroup;
use crate::transport::tcp::TcpMesh;
use crate::transport::{OpDesc, OpKind};

const OP: &str = "reduce_scatter";

/// A reduce-scatter's arguments, checked by [`Communicator::reduce_scatter`]
/// and handed on, as one value, to the flat or the two-level algorithm (the
/// two-level one also runs the flat one on buffers it sized itself).
pub(crate) struct ReduceScatter<'a> {
    pub(crate) input: &'a [u8],
    pub(crate) output: &'a mut [u8],
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
}

impl Communicator {
    /// Reduces block r of every rank's `input` into this rank's `output`
    /// (`input.len() == size * output.len()`), on one level.
    pub(crate) fn reduce_scatter_flat(&mut self, args: ReduceScatter<'_>) -> Result<()> {
        let count = args.output.len() / args.dtype.size();
        self.guarded(|c| {
            let desc = c.next_desc(OpKind::ReduceScatter, args.dtype, Some(args.op), count, 0);
            match &mut c.link {
                Link::Local => {
                    args.output.copy_from_slice(args.input);
                    Ok(())
                }
                Link::Shm { shm, .. } => shm_reduce_scatter(
                    shm,
                    &c.cfg,
                    desc,
                    args.input,
                    args.output,
                    args.dtype,
                    args.op,
                ),
                Link::Tcp(mesh) => {
                    mesh.agree(&desc, c.cfg.timeout)?;
                    tcp_reduce_scatter(mesh, &c.cfg, args.input, args.output, args.dtype, args.op)
                }
            }
        })
    }
}

fn shm_reduce_scatter(
    shm: &mut ShmGroup,
    cfg: &Config,
    mut desc: OpDesc,
    input: &[u8],
    output: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (m, p, r, esz) = (output.len(), shm.size(), shm.rank(), dtype.size());
    if shm.cma() && input.len() >= cfg.cma_threshold {
        desc.addr = input.as_ptr() as u64;
        shm.next_half();
        shm.arrive(&desc)?;
        let addrs: Vec<u64> = (0..p)
            .map(|j| shm.peer_desc(j).map(|d| d.addr))
            .collect::<Result<_>>()?;
        let piece = (CMA_PIECE / esz) * esz;
        let mut tmp = Reused::new((p - 1) * piece);
        let tmp = tmp.bytes();
        for range in pieces(m, piece, esz) {
            let at = r * m + range.start;
            let len = range.len();
            let mut slots: Vec<&mut [u8]> = tmp.chunks_mut(piece).map(|c| &mut c[..len]).collect();
            for (slot, j) in slots.iter_mut().zip((0..p).filter(|&j| j != r)) {
                shm.read_peer(j, addrs[j] + at as u64, slot, OP)?;
            }
            let mut srcs: Vec<&[u8]> = vec![&input[at..at + len]];
            srcs.extend(slots.iter().map(|s| &**s));
            reduce::reduce_into(dtype, op, &mut output[range], &srcs)?;
        }
        return shm.sync(OP);
    }
    // Each piece covers the same sub-range of every block: p * piece <= half.
    // Blocks that all fit in a half at whole cache lines go in one piece.
    let fit = m.div_ceil(64).max(1) * 64;
    let per_block = if fit * p <= shm.half_bytes() {
        fit
    } else {
        (shm.half_bytes() / p / esz).max(1) * esz
    };
    let parts = pieces(m, per_block, esz);
    for (k, range) in parts.iter().cloned().enumerate() {
        shm.next_piece(desc.seq, parts.len(), p * per_block);
        for j in 0..p {
            shm.put(
                j * per_block,
                &input[j * m + range.start..j * m + range.end],
            );
        }
        if k == 0 {
            shm.arrive(&desc)?;
        } else {
            shm.sync(OP)?;
        }
        shm.reduce_all_slots(dtype, op, r * per_block, &mut output[range])?;
    }
    Ok(())
}

/// Ring reduce-scatter that leaves `input` untouched; rank r ends with block
/// r reduced in `output` (below, r is a ring position, see the body). At step s rank r sends block r-s-1 to the next rank
/// (its own input block at step 0, afterwards the partial sum it built in the
/// step before) and builds the partial sum of block r-s-2 from its input
/// block and what the previous rank sent. The last step's partial sum is
/// block r, complete, written straight into `output`. Two block-sized
/// accumulators take turns, so the input is never copied as a whole. Steps
/// move in chunks through a cache-resident scratch, reducing what has arrived
/// while the rest is in flight.
///
/// float16 and bfloat16 travel and accumulate as float32 (rounded once at
/// the end).
fn tcp_reduce_scatter(
    mesh: &TcpMesh,
    cfg: &Config,
    input: &[u8],
    output: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    if output.is_empty() {
        return Ok(());
    }
    if matches!(dtype, DType::F16 | DType::BF16) {
        let mut wide_in = vec![0f32; input.len() / dtype.size()];
        reduce::widen_half(dtype, input, &mut wide_in)?;
        let mut wide_out = vec![0f32; output.len() / dtype.size()];
        tcp_reduce_scatter(
            mesh,
            cfg,
            bytemuck::cast_slice(&wide_in),
            bytemuck::cast_slice_mut(&mut wide_out),
            DType::F32,
            op,
        )?;
        return reduce::narrow_half(dtype, &wide_out, output);
    }
    // Around the ring of `RingOrder`: positions stand in for ranks, and the
    // block of position j is that of rank_at(j), so position r (this rank)
    // ends with its own block.
    let order = RingOrder::new(mesh.size(), mesh.rank());
    let (p, r, m) = (mesh.size(), order.pos, output.len());
    let block = |j: usize| {
        let j = order.rank_at(j);
        &input[j * m..(j + 1) * m]
    };
    let mut ring = Ring::new(mesh, OP, dtype, op);
    let mut accs = Reused::new(if p > 2 { 2 * m } else { 0 });
    let (mut built, mut building) = accs.bytes().split_at_mut(if p > 2 { m } else { 0 });
    for s in 0..p - 1 {
        let src: &[u8] = if s == 0 {
            block((r + 2 * p - 1) % p)
        } else {
            built
        };
        let mine = block((r + 2 * p - s - 2) % p);
        let dst: &mut [u8] = if s == p - 2 {
            &mut *output
        } else {
            &mut *building
        };
        ring.step(mesh, cfg, src, dst, Some(mine))?;
        std::mem::swap(&mut built, &mut building);
    }
    Ok(())
}
