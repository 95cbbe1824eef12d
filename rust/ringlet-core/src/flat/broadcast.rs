//! Broadcast on one level: every rank's buffer becomes a copy of the root's.
//!
//! Shared memory: staged pieces through the root's slot (one phase per piece),
//! or, for large buffers with cross-memory attach, every rank copies straight
//! out of the root's buffer (a second phase releases it).
//!
//! TCP: a binomial tree rooted at the root, the buffer forwarded in pieces
//! so that a rank passes piece k on to its children while piece k + 1
//! arrives. For a power-of-two size the tree's edges join ranks that differ
//! in one bit (see [`tree`]), the recursive-doubling partners whose streams
//! the agreement check opens anyway: a broadcast opens no stream of its own,
//! and the root sends ⌈log2 p⌉ copies instead of p - 1.

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

/// Bytes a rank of the TCP tree forwards at a time: the first piece reaches
/// a leaf after ⌈log2 p⌉ hops of one piece, not of the whole buffer.
const TREE_PIECE: usize = 256 << 10;

/// The TCP tree of `rank` for a broadcast from `root` over `p` ranks: its
/// parent (None at the root) and its children. Ranks are numbered relative
/// to the root (`v = rank ^ root` for a power-of-two size, else
/// `rank - root` mod p); relative rank v > 0 hangs under v minus its
/// highest bit, and has children v + 2^k for every 2^k above v's highest
/// bit (below p). With xor numbering these edges join ranks one bit apart.
pub(crate) fn tree(p: usize, rank: usize, root: usize) -> (Option<usize>, Vec<usize>) {
    let xor = p.is_power_of_two();
    let rel = |r: usize| if xor { r ^ root } else { (r + p - root) % p };
    let abs = |v: usize| if xor { v ^ root } else { (v + root) % p };
    let v = rel(rank);
    let top = if v == 0 {
        0
    } else {
        1usize << (usize::BITS - 1 - v.leading_zeros())
    };
    let parent = (v != 0).then(|| abs(v - top));
    let mut children = Vec::new();
    let mut bit = if v == 0 { 1 } else { top << 1 };
    while v + bit < p {
        children.push(abs(v + bit));
        bit <<= 1;
    }
    (parent, children)
}

/// Copies the root's buffer into every other rank's (TCP), down the tree of
/// [`tree`]: each rank receives its piece k + 1 from its parent while it
/// sends piece k to all its children.
pub(crate) fn tcp_broadcast(
    mesh: &TcpMesh,
    cfg: &Config,
    side: Side<'_>,
    root: usize,
    op: &'static str,
) -> Result<()> {
    let (parent, children) = tree(mesh.size(), mesh.rank(), root);
    match side {
        Side::Root(b) if !b.is_empty() => {
            let mut x: Vec<Xfer> = children.iter().map(|&c| Xfer::send(c, b)).collect();
            mesh.transfer(&mut x, op, cfg.timeout)
        }
        Side::Leaf(b) if !b.is_empty() => {
            let Some(parent) = parent else {
                return Ok(());
            };
            if children.is_empty() {
                return mesh.transfer(&mut [Xfer::recv(parent, b)], op, cfg.timeout);
            }
            let n = b.len();
            let pieces = n.div_ceil(TREE_PIECE);
            for k in 0..=pieces {
                // piece k arrives while piece k - 1 goes on
                let at = |i: usize| (i * TREE_PIECE).min(n);
                let (done, rest) = b.split_at_mut(at(k));
                let mut x: Vec<Xfer> = Vec::with_capacity(children.len() + 1);
                if k < pieces {
                    x.push(Xfer::recv(parent, &mut rest[..at(k + 1) - at(k)]));
                }
                if k > 0 {
                    let out = &done[at(k - 1)..];
                    x.extend(children.iter().map(|&c| Xfer::send(c, out)));
                }
                mesh.transfer(&mut x, op, cfg.timeout)?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::tree;

    #[test]
    fn the_tree_reaches_every_rank_once_over_one_bit_edges() {
        for p in 1..=40usize {
            for root in 0..p {
                let mut reached = vec![0usize; p];
                reached[root] += 1;
                for r in 0..p {
                    let (parent, children) = tree(p, r, root);
                    assert_eq!(parent.is_none(), r == root, "p={p} root {root} rank {r}");
                    for c in children {
                        reached[c] += 1;
                        assert_eq!(tree(p, c, root).0, Some(r), "p={p} root {root}");
                        if p.is_power_of_two() {
                            assert_eq!((c ^ r).count_ones(), 1, "p={p} root {root}");
                        }
                    }
                }
                assert!(
                    reached.iter().all(|&n| n == 1),
                    "p={p} root {root}: {reached:?}"
                );
                let (_, at_root) = tree(p, root, root);
                let depth = usize::BITS - (p.max(1) - 1).leading_zeros();
                assert_eq!(at_root.len() as u32, depth, "p={p} root {root}");
            }
        }
    }
}
