//! Reduce-scatter: `input` holds `size` equal blocks; rank r receives the
//! element-wise reduction of block r over all ranks.
//!
//! Shared memory: staged pieces (each rank copies the same piece of every
//! block into its slot; after one phase rank r reduces piece r of all slots in
//! rank order), or, for large inputs with cross-memory attach, rank r reads
//! block r of each peer's input in cache-sized pieces and reduces them.
//!
//! TCP: ring reduce-scatter on a copy of the input, arranged so that rank r
//! finishes owning block r; float16/bfloat16 travel as float32.

use super::{pieces, scratch, via_f32, Reused, CMA_PIECE};
use crate::collective::all_reduce::ring_reduce_scatter;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::group::{Communicator, Config, Link};
use crate::reduce;
use crate::transport::shm::ShmGroup;
use crate::transport::tcp::TcpMesh;
use crate::transport::{OpDesc, OpKind};

const OP: &str = "reduce_scatter";

impl Communicator {
    /// Reduces block r of every rank's `input` into this rank's `output`
    /// (`input.len() == size * output.len()`).
    pub fn reduce_scatter(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        op.check(dtype)?;
        let count = super::elements(output.len(), dtype, OP)?;
        if input.len() != output.len() * self.size() {
            return Err(Error::InvalidArgument(format!(
                "rank {}: reduce_scatter input holds {} bytes, expected {} ({} ranks x {} bytes)",
                self.rank(),
                input.len(),
                output.len() * self.size(),
                self.size(),
                output.len()
            )));
        }
        self.guarded(|c| {
            let desc = c.next_desc(OpKind::ReduceScatter, dtype, Some(op), count, 0);
            match &mut c.link {
                Link::Local => {
                    output.copy_from_slice(input);
                    Ok(())
                }
                Link::Shm { shm, .. } => {
                    shm_reduce_scatter(shm, &c.cfg, desc, input, output, dtype, op)
                }
                Link::Tcp(mesh) => {
                    mesh.agree(&desc, c.cfg.timeout)?;
                    tcp_reduce_scatter(mesh, &c.cfg, input, output, dtype, op)
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
    let per_block = (shm.half_bytes() / p / esz).max(1) * esz;
    for (k, range) in pieces(m, per_block, esz).into_iter().enumerate() {
        shm.next_half();
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

fn tcp_reduce_scatter(
    mesh: &TcpMesh,
    cfg: &Config,
    input: &[u8],
    output: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (m, p, r) = (output.len(), mesh.size(), mesh.rank());
    if m == 0 {
        return Ok(());
    }
    let mut work = scratch(input.len());
    let work: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut work)[..input.len()];
    work.copy_from_slice(input);
    if matches!(dtype, DType::F16 | DType::BF16) {
        let wm = m / dtype.size() * 4;
        let mut mine = vec![0u8; 0];
        via_f32(dtype, work, |wide| {
            ring_reduce_scatter(mesh, cfg, wide, DType::F32, op, p - 1)?;
            mine = wide[r * wm..(r + 1) * wm].to_vec();
            Ok(())
        })?;
        let f: Vec<f32> = mine
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        return reduce::narrow_half(dtype, &f, output);
    }
    ring_reduce_scatter(mesh, cfg, work, dtype, op, p - 1)?;
    output.copy_from_slice(&work[r * m..(r + 1) * m]);
    Ok(())
}
