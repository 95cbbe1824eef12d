//! Broadcast: every rank's buffer becomes a copy of the root's.
//!
//! Shared memory: staged pieces through the root's slot (one phase per piece),
//! or, for large buffers with cross-memory attach, every rank copies straight
//! out of the root's buffer (a second phase releases it).
//!
//! TCP: the root sends the buffer to every peer at once; `transfer` keeps all
//! streams busy together.

use super::pieces;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::{Communicator, Config, Link};
use crate::transport::shm::ShmGroup;
use crate::transport::tcp::{TcpMesh, Xfer};
use crate::transport::{OpDesc, OpKind};

const OP: &str = "broadcast";

impl Communicator {
    /// Copies `root`'s `buf` into every rank's `buf`.
    pub fn broadcast(&mut self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()> {
        let count = super::elements(buf.len(), dtype, OP)?;
        if root >= self.size() {
            return Err(Error::InvalidArgument(format!(
                "rank {}: broadcast root {root} is out of range for {} ranks",
                self.rank(),
                self.size()
            )));
        }
        self.guarded(|c| {
            let desc = c.next_desc(OpKind::Broadcast, dtype, None, count, root);
            match &mut c.link {
                Link::Local => Ok(()),
                Link::Shm { shm, .. } => shm_broadcast(shm, &c.cfg, desc, buf, dtype, root),
                Link::Tcp(mesh) => {
                    mesh.agree(&desc, c.cfg.timeout)?;
                    tcp_broadcast(mesh, &c.cfg, buf, root)
                }
            }
        })
    }
}

fn shm_broadcast(
    shm: &mut ShmGroup,
    cfg: &Config,
    mut desc: OpDesc,
    buf: &mut [u8],
    dtype: DType,
    root: usize,
) -> Result<()> {
    let me = shm.rank();
    if shm.cma() && buf.len() >= cfg.cma_threshold {
        desc.addr = buf.as_ptr() as u64;
        shm.next_half();
        shm.arrive(&desc)?;
        if me != root {
            let addr = shm.peer_desc(root)?.addr;
            shm.read_peer(root, addr, buf, OP)?;
        }
        return shm.sync(OP);
    }
    for (k, piece) in pieces(buf.len(), shm.half_bytes(), dtype.size())
        .into_iter()
        .enumerate()
    {
        shm.next_half();
        if me == root {
            shm.put(0, &buf[piece.clone()]);
        }
        if k == 0 {
            shm.arrive(&desc)?;
        } else {
            shm.sync(OP)?;
        }
        if me != root {
            shm.get(root, 0, &mut buf[piece]);
        }
    }
    Ok(())
}

fn tcp_broadcast(mesh: &TcpMesh, cfg: &Config, buf: &mut [u8], root: usize) -> Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    if mesh.rank() == root {
        let mut x: Vec<Xfer> = (0..mesh.size())
            .filter(|&j| j != root)
            .map(|j| Xfer::send(j, buf))
            .collect();
        mesh.transfer(&mut x, OP, cfg.timeout)
    } else {
        mesh.transfer(&mut [Xfer::recv(root, buf)], OP, cfg.timeout)
    }
}
