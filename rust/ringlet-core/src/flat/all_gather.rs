//! All-gather on one level: rank r's input lands in block r of every
//! rank's output (`output.len() == size * input.len()`).
//!
//! Shared memory: staged pieces (each rank copies a piece of its input into
//! its slot; after one phase everyone copies every slot's piece into the right
//! block), or, for large inputs with cross-memory attach, every rank copies
//! each peer's input straight out of the peer's memory (one phase to publish
//! addresses, one to release the buffers).
//!
//! TCP: ring; at each of the p-1 steps a rank forwards the block it received
//! in the previous step.

use super::{pieces, split_ref_mut, streams, RingOrder};
use crate::dtype::DType;
use crate::error::Result;
use crate::group::{Communicator, Config, Link};
use crate::transport::shm::ShmGroup;
use crate::transport::tcp::{TcpMesh, Xfer};
use crate::transport::{OpDesc, OpKind};

const OP: &str = "all_gather";

impl Communicator {
    /// Gathers every rank's `input` into `output`, block r from rank r, on
    /// one level.
    pub(crate) fn all_gather_flat(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
    ) -> Result<()> {
        let count = input.len() / dtype.size();
        self.guarded(|c| {
            let desc = c.next_desc(OpKind::AllGather, dtype, None, count, 0);
            match &mut c.link {
                Link::Local => {
                    output.copy_from_slice(input);
                    Ok(())
                }
                Link::Shm { shm, .. } => shm_all_gather(shm, &c.cfg, desc, input, output, dtype),
                Link::Tcp(mesh) => {
                    mesh.agree(&desc, c.cfg.timeout)?;
                    tcp_all_gather(mesh, &c.cfg, input, output)
                }
            }
        })
    }
}

fn shm_all_gather(
    shm: &mut ShmGroup,
    cfg: &Config,
    mut desc: OpDesc,
    input: &[u8],
    output: &mut [u8],
    dtype: DType,
) -> Result<()> {
    let (n, p, r) = (input.len(), shm.size(), shm.rank());
    if shm.cma() && n >= cfg.cma_threshold {
        desc.addr = input.as_ptr() as u64;
        shm.next_half();
        shm.arrive(&desc)?;
        for j in (0..p).filter(|&j| j != r) {
            let addr = shm.peer_desc(j)?.addr;
            shm.read_peer(j, addr, &mut output[j * n..(j + 1) * n], OP)?;
        }
        output[r * n..(r + 1) * n].copy_from_slice(input);
        return shm.sync(OP);
    }
    let stream = streams(output.len());
    let parts = pieces(n, shm.half_bytes(), dtype.size());
    for (k, piece) in parts.iter().cloned().enumerate() {
        shm.next_piece(desc.seq, parts.len(), piece.len());
        shm.put(0, &input[piece.clone()]);
        if k == 0 {
            shm.arrive(&desc)?;
        } else {
            shm.sync(OP)?;
        }
        for j in 0..p {
            let dst = &mut output[j * n + piece.start..j * n + piece.end];
            if j != r {
                shm.get_out(j, 0, dst, stream);
            } else if stream {
                crate::sys::copy_streaming(dst, &input[piece.clone()]);
            } else {
                dst.copy_from_slice(&input[piece.clone()]);
            }
        }
    }
    Ok(())
}

fn tcp_all_gather(mesh: &TcpMesh, cfg: &Config, input: &[u8], output: &mut [u8]) -> Result<()> {
    let (n, p, r) = (input.len(), mesh.size(), mesh.rank());
    output[r * n..(r + 1) * n].copy_from_slice(input);
    if n == 0 {
        return Ok(());
    }
    // Around the ring of `RingOrder`: the rank at position i starts with
    // its own block (that of rank_at(i)) and passes on, at step s, the
    // block it got at step s - 1.
    let order = RingOrder::new(p, r);
    let (next, prev, at) = (order.next(), order.prev(), order.pos);
    for s in 0..p - 1 {
        let send = order.rank_at(at + p - s);
        let recv = order.rank_at(at + 2 * p - s - 1);
        let (out, inc) = split_ref_mut(output, send * n..(send + 1) * n, recv * n..(recv + 1) * n);
        mesh.transfer(
            &mut [Xfer::send(next, out), Xfer::recv(prev, inc)],
            OP,
            cfg.timeout,
        )?;
    }
    Ok(())
}
