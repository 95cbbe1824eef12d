//! Two-level all-to-all. Large: blocks between ranks of one host go through
//! the host's shared memory (packed in local-rank order, one shared-memory
//! all-to-all) on a helper thread, while the blocks for other hosts go
//! straight to their ranks over TCP on the calling thread, every rank's
//! streams at once. Each block crosses the network once, and only the
//! blocks that leave the host touch the network stack.
//!
//! Small (every rank sends at most `AGGREGATE_MAX` bytes to other hosts):
//! the blocks for other hosts are gathered first, in the same shared-memory
//! all-to-all as the host's own blocks, at the rank of this host that
//! handles their destination (destination `(g, j)`, host g's local rank j,
//! is handled by this host's local rank `j mod L`), which sends all of them
//! as one message: one message per destination and host instead of one per
//! block (with 8 ranks per host, 8 instead of 64 between two hosts).

use super::{side_by_side, Net, Plan, Stop};
use crate::collective::all_to_all::Traffic;
use crate::dtype::DType;
use crate::error::Result;
use crate::group::Communicator;
use crate::transport::tcp::Xfer;
use crate::transport::OpKind;

/// Below this many bytes through shared memory the two halves run one
/// after the other on the calling thread (a thread costs more than they do).
const INLINE_BYTES: usize = 256 << 10;

/// When no rank sends more than this many bytes to other hosts, blocks for
/// other hosts are aggregated per destination through the host first.
const AGGREGATE_MAX: usize = 64 << 10;

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
                if aggregates(plan, t) {
                    return aggregated(plan, &mut lv.local, net, stop, t, send, recv, dtype);
                }
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

/// Whether every rank sends at most `AGGREGATE_MAX` bytes to other hosts
/// (every rank decides alike from the same traffic matrix).
fn aggregates(plan: &Plan, t: &Traffic) -> bool {
    let host_of = plan.host_of();
    (0..t.m.len()).all(|i| {
        let out: usize = (0..t.m.len())
            .filter(|&j| host_of[j] != host_of[i])
            .map(|j| t.m[i][j])
            .sum();
        out * t.esz <= AGGREGATE_MAX
    })
}

/// The small all-to-all: one shared-memory all-to-all carries this host's
/// own blocks and gathers the blocks for other hosts at the ranks that
/// handle their destinations; each handler sends one message per
/// destination; each rank receives one message per other host.
#[allow(clippy::too_many_arguments)]
fn aggregated(
    plan: &Plan,
    local: &mut Communicator,
    net: &Net<'_>,
    stop: &Stop,
    t: &Traffic,
    send: &[u8],
    recv: &mut [u8],
    dtype: DType,
) -> Result<()> {
    let mut run = || -> Result<()> {
        let (host_of, index_of) = (plan.host_of(), plan.index_of());
        let p = t.m.len();
        let here = &plan.layout[plan.host];
        let me = here[plan.index];
        let l = here.len();
        // The rank of this host that handles destination d on another host.
        let handler = |d: usize| here[index_of[d] % l];
        let away = |d: usize| host_of[d] != plan.host;
        // What goes to local rank k: its own block, then the blocks for the
        // destinations it handles, in rank order.
        let to = |src: usize, k: usize| -> Vec<usize> {
            std::iter::once(here[k])
                .chain((0..p).filter(|&d| away(d) && handler(d) == here[k]))
                .filter(|&d| t.m[src][d] > 0)
                .collect()
        };
        let mut packed = Vec::with_capacity(send.len());
        let mut sends = Vec::with_capacity(l);
        for k in 0..l {
            let dests = to(me, k);
            sends.push(dests.iter().map(|&d| t.m[me][d]).sum());
            for d in dests {
                packed.extend_from_slice(&send[t.send_range(me, d)]);
            }
        }
        let recvs: Vec<usize> = (0..l)
            .map(|k| {
                to(here[k], plan.index)
                    .iter()
                    .map(|&d| t.m[here[k]][d])
                    .sum()
            })
            .collect();
        let mut got = vec![0u8; recvs.iter().sum::<usize>() * t.esz];
        local.all_to_all_v(&packed, &sends, &mut got, &recvs, dtype)?;
        // This host's blocks for this rank go to their places; the rest is
        // regrouped by destination into one message each.
        let mine: Vec<usize> = (0..p).filter(|&d| away(d) && handler(d) == me).collect();
        let mut outgoing: Vec<Vec<u8>> = vec![Vec::new(); mine.len()];
        let mut at = 0;
        for k in 0..l {
            for d in to(here[k], plan.index) {
                let len = t.m[here[k]][d] * t.esz;
                let block = &got[at..at + len];
                at += len;
                if d == me {
                    recv[t.recv_range(here[k], me)].copy_from_slice(block);
                } else if let Some(i) = mine.iter().position(|&x| x == d) {
                    outgoing[i].extend_from_slice(block);
                }
            }
        }
        // From each other host, one message from the rank handling this one.
        let hosts: Vec<usize> = (0..plan.hosts()).filter(|&g| g != plan.host).collect();
        let mut incoming: Vec<Vec<u8>> = hosts
            .iter()
            .map(|&g| {
                let n: usize = plan.layout[g].iter().map(|&s| t.m[s][me]).sum();
                vec![0u8; n * t.esz]
            })
            .collect();
        {
            let mut x: Vec<Xfer> = Vec::new();
            for (i, &d) in mine.iter().enumerate() {
                if !outgoing[i].is_empty() {
                    x.push(Xfer::send(d, &outgoing[i]));
                }
            }
            for (&g, buf) in hosts.iter().zip(incoming.iter_mut()) {
                let from = plan.layout[g][plan.index % plan.width(g)];
                if !buf.is_empty() {
                    x.push(Xfer::recv(from, buf));
                }
            }
            if !x.is_empty() {
                net.transfer(&mut x)?;
            }
        }
        for (&g, buf) in hosts.iter().zip(&incoming) {
            let mut at = 0;
            for &s in &plan.layout[g] {
                let len = t.m[s][me] * t.esz;
                recv[t.recv_range(s, me)].copy_from_slice(&buf[at..at + len]);
                at += len;
            }
        }
        Ok(())
    };
    run().inspect_err(|e| stop.now(e))
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
