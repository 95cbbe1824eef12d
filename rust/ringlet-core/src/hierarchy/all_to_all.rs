//! Two-level all-to-all: blocks between ranks of one host go through the
//! host's shared memory (packed in local-rank order, one shared-memory
//! all-to-all) on a helper thread, while the blocks for other hosts go
//! straight to their ranks over TCP on the calling thread, every rank's
//! streams at once. Each block crosses the network once, and only the
//! blocks that leave the host touch the network stack.

use super::{side_by_side, Net};
use crate::collective::all_to_all::Traffic;
use crate::dtype::DType;
use crate::error::Result;
use crate::group::Communicator;
use crate::transport::tcp::Xfer;
use crate::transport::OpKind;

/// Below this many bytes through shared memory the two halves run one
/// after the other on the calling thread (a thread costs more than they do).
const INLINE_BYTES: usize = 256 << 10;

impl Communicator {
    /// `all_to_all_v` on a communicator with levels, after the counts were
    /// exchanged and checked (`t`).
    pub(crate) fn all_to_all_levels(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        t: &Traffic,
        dtype: DType,
    ) -> Result<()> {
        self.two_level(
            OpKind::AllToAll,
            dtype,
            None,
            t.elements(),
            0,
            |lv, net, stop| {
                let plan = &lv.plan;
                let host = &plan.layout[plan.host];
                let me = host[plan.index];
                let p = t.m.len();
                // The receive buffer by source rank; this host's sources go to
                // the shared-memory side, the others to the network side.
                let mut blocks: Vec<Option<&mut [u8]>> = Vec::with_capacity(p);
                let mut rest = recv;
                for i in 0..p {
                    let (b, tail) = rest.split_at_mut(t.m[i][me] * t.esz);
                    rest = tail;
                    blocks.push(Some(b));
                }
                let mut ours: Vec<&mut [u8]> = host
                    .iter()
                    .map(|&i| blocks[i].take().unwrap_or_default())
                    .collect();
                let theirs: Vec<(usize, &mut [u8])> = blocks
                    .into_iter()
                    .enumerate()
                    .filter_map(|(i, b)| b.map(|b| (i, b)))
                    .collect();
                let sends: Vec<usize> = host.iter().map(|&j| t.m[me][j]).collect();
                let recvs: Vec<usize> = host.iter().map(|&i| t.m[i][me]).collect();
                let local_bytes =
                    (sends.iter().sum::<usize>() + recvs.iter().sum::<usize>()) * t.esz;
                let here = move |local: &mut Communicator| -> Result<()> {
                    let packed: Vec<u8> = host
                        .iter()
                        .flat_map(|&j| send[t.send_range(me, j)].iter().copied())
                        .collect();
                    let mut got = vec![0u8; recvs.iter().sum::<usize>() * t.esz];
                    local.all_to_all_v(&packed, &sends, &mut got, &recvs, dtype)?;
                    let mut at = 0;
                    for b in ours.iter_mut() {
                        b.copy_from_slice(&got[at..at + b.len()]);
                        at += b.len();
                    }
                    Ok(())
                };
                let there = || remote(net, t, me, host, send, theirs);
                side_by_side(&mut lv.local, stop, local_bytes < INLINE_BYTES, here, there)
            },
        )
    }
}

/// Sends this rank's blocks for other hosts and receives theirs, all at once.
fn remote(
    net: &Net<'_>,
    t: &Traffic,
    me: usize,
    host: &[usize],
    send: &[u8],
    theirs: Vec<(usize, &mut [u8])>,
) -> Result<()> {
    let mut x: Vec<Xfer> = Vec::with_capacity(2 * t.m.len());
    for (i, b) in theirs {
        if !b.is_empty() {
            x.push(Xfer::recv(i, b));
        }
    }
    for j in (0..t.m.len()).filter(|j| !host.contains(j) && t.m[me][*j] > 0) {
        x.push(Xfer::send(j, &send[t.send_range(me, j)]));
    }
    if x.is_empty() {
        return Ok(());
    }
    net.transfer(&mut x)
}
