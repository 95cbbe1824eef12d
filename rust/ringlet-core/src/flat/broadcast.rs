//! Broadcast on one level: every rank's buffer becomes a copy of the root's.
//!
//! Shared memory: staged pieces through the root's slot (one phase per piece),
//! or, for large buffers with cross-memory attach, every rank copies straight
//! out of the root's buffer (a second phase releases it).
//!
//! TCP: the root sends the buffer to every peer at once; `transfer` keeps all
//! streams busy together.

use super::{pieces, streams};
use crate::dtype::DType;
use crate::error::Result;
use crate::group::{Communicator, Config, Link};
use crate::transport::shm::ShmGroup;
use crate::transport::tcp::{TcpMesh, Xfer};
use crate::transport::{OpDesc, OpKind};

const OP: &str = "broadcast";

impl Communicator {
    /// Copies `root`'s `buf` into every rank's `buf`, on one level.
    pub(crate) fn broadcast_flat(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        let count = buf.len() / dtype.size();
        self.guarded(|c| {
            let desc = c.next_desc(OpKind::Broadcast, dtype, None, count, root);
            match &mut c.link {
                Link::Local => Ok(()),
                Link::Shm { shm, .. } => {
                    let side = Side::of(shm.rank() == root, buf);
                    shm_broadcast(shm, &c.cfg, desc, side, dtype, root)
                }
                Link::Tcp(mesh) => {
                    mesh.agree(&desc, c.cfg.timeout)?;
                    let side = Side::of(mesh.rank() == root, buf);
                    tcp_broadcast(mesh, &c.cfg, side, root, OP)
                }
            }
        })
    }
}

/// One rank's part in a one-to-all copy: the root only reads its buffer,
/// everyone else only writes theirs.
pub(crate) enum Side<'a> {
    Root(&'a [u8]),
    Leaf(&'a mut [u8]),
}

impl<'a> Side<'a> {
    pub(super) fn of(is_root: bool, buf: &'a mut [u8]) -> Self {
        if is_root {
            Side::Root(buf)
        } else {
            Side::Leaf(buf)
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Side::Root(b) => b.len(),
            Side::Leaf(b) => b.len(),
        }
    }
}

/// Copies the root's buffer into every other rank's (shared memory).
pub(crate) fn shm_broadcast(
    shm: &mut ShmGroup,
    cfg: &Config,
    mut desc: OpDesc,
    mut side: Side<'_>,
    dtype: DType,
    root: usize,
) -> Result<()> {
    let op = desc.kind.name();
    if shm.cma() && side.len() >= cfg.cma_threshold {
        if let Side::Root(b) = &side {
            desc.addr = b.as_ptr() as u64;
        }
        shm.next_half();
        shm.arrive(&desc)?;
        if let Side::Leaf(b) = &mut side {
            let addr = shm.peer_desc(root)?.addr;
            shm.read_peer(root, addr, b, op)?;
        }
        return shm.sync(op);
    }
    let stream = streams(side.len());
    let parts = pieces(side.len(), shm.half_bytes(), dtype.size());
    for (k, piece) in parts.iter().cloned().enumerate() {
        shm.next_piece(desc.seq, parts.len(), piece.len());
        if let Side::Root(b) = &side {
            shm.put(0, &b[piece.clone()]);
        }
        if k == 0 {
            shm.arrive(&desc)?;
        } else {
            shm.sync(op)?;
        }
        if let Side::Leaf(b) = &mut side {
            shm.get_out(root, 0, &mut b[piece], stream);
        }
    }
    Ok(())
}

/// Copies the root's buffer into every other rank's (TCP).
pub(crate) fn tcp_broadcast(
    mesh: &TcpMesh,
    cfg: &Config,
    side: Side<'_>,
    root: usize,
    op: &'static str,
) -> Result<()> {
    match side {
        Side::Root(b) if !b.is_empty() => {
            let mut x: Vec<Xfer> = (0..mesh.size())
                .filter(|&j| j != root)
                .map(|j| Xfer::send(j, b))
                .collect();
            mesh.transfer(&mut x, op, cfg.timeout)
        }
        Side::Leaf(b) if !b.is_empty() => {
            mesh.transfer(&mut [Xfer::recv(root, b)], op, cfg.timeout)
        }
        _ => Ok(()),
    }
}
