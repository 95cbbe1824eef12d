//! Point-to-point send and receive on a two-rank communicator (ringlet gives
//! every communicating pair its own). Messages are matched in order: the
//! n-th send from a rank meets the n-th receive posted for it, and both sides
//! must agree on the size, dtype and tag, else both get a mismatch error.
//!
//! Data moves as a one-to-all copy from the sender, so it takes the same
//! paths as broadcast (staged slots or a single-copy read on shared memory,
//! one stream on TCP). A send returns once the receiver holds the data.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::flat::broadcast::{shm_broadcast, tcp_broadcast, Side};
use crate::group::{Communicator, Link};
use crate::transport::OpKind;

const OP: &str = "send/recv";

impl Communicator {
    /// Sends `buf` to `peer` (the other rank of this two-rank communicator).
    pub fn send(&mut self, buf: &[u8], dtype: DType, peer: usize, tag: u32) -> Result<()> {
        self.check_peer(peer, "send to")?;
        let me = self.rank();
        // The sender only reads; `Side::Root` never writes through the view.
        self.p2p(dtype, me, tag, Side::Root(buf))
    }

    /// Receives into `buf` what `peer` sends with the matching `tag`.
    pub fn recv(&mut self, buf: &mut [u8], dtype: DType, peer: usize, tag: u32) -> Result<()> {
        self.check_peer(peer, "receive from")?;
        self.p2p(dtype, peer, tag, Side::Leaf(buf))
    }

    fn check_peer(&self, peer: usize, what: &str) -> Result<()> {
        if self.size() != 2 || peer >= 2 || peer == self.rank() {
            return Err(Error::InvalidArgument(format!(
                "rank {}: cannot {what} rank {peer}: point-to-point messages run on a \
                 two-rank communicator, between its two ranks",
                self.rank()
            )));
        }
        Ok(())
    }

    fn p2p(&mut self, dtype: DType, sender: usize, tag: u32, side: Side) -> Result<()> {
        let count = super::elements(side.len(), dtype, OP)?;
        self.guarded(|c| {
            let packed = ((tag as usize) << 1) | sender;
            let desc = c.next_desc(OpKind::SendRecv, dtype, None, count, packed);
            match &mut c.link {
                Link::Local => Err(Error::InvalidArgument(format!(
                    "rank {}: a one-rank communicator has no peer",
                    c.rank()
                ))),
                Link::Shm { shm, .. } => shm_broadcast(shm, &c.cfg, desc, side, dtype, sender),
                Link::Tcp(mesh) => {
                    mesh.agree(&desc, c.cfg.timeout)?;
                    tcp_broadcast(mesh, &c.cfg, side, sender, OP)
                }
            }
        })
    }
}
