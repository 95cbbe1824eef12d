//! Two-level all-to-all. Large: every block goes straight to its rank over
//! TCP, every rank's streams at once; each block crosses the network once.
//! (This host's blocks through its shared memory on a helper thread beside
//! the network measured slower across namespace hosts sharing 2 cores: a
//! shared-memory phase needs both ranks on a CPU at once, the network does
//! not; 1 MiB per rank over 2 Gbit, 7.0 ms against 4.5 ms all over TCP.)
//!
//! Small (every rank sends at most `AGGREGATE_MAX` bytes to other hosts):
//! the blocks for other hosts are gathered first, in the same shared-memory
//! all-to-all as the host's own blocks, at the rank of this host that
//! handles their destination (destination `(g, j)`, host g's local rank j,
//! is handled by this host's local rank `j mod L`), which sends all of them
//! as one message: one message per destination and host instead of one per
//! block (with 8 ranks per host, 8 instead of 64 between two hosts).

use super::{Net, Plan, Stop};
use crate::dtype::DType;
use crate::error::Result;
use crate::flat::all_to_all::Traffic;
use crate::group::Communicator;
use crate::transport::tcp::Xfer;
use crate::transport::OpKind;

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
                // Large: every block goes straight to its rank over TCP, this
                // host's too (see the module comment for why).
                let me = plan.layout[plan.host][plan.index];
                let mut theirs: Vec<(usize, &mut [u8])> = Vec::with_capacity(t.m.len());
                let mut rest = recv;
                for i in 0..t.m.len() {
                    let (b, tail) = rest.split_at_mut(t.m[i][me] * t.esz);
                    rest = tail;
                    if i == me {
                        b.copy_from_slice(&send[t.send_range(me, me)]);
                    } else {
                        theirs.push((i, b));
                    }
                }
                remote(net, t, me, &[me], send, theirs).inspect_err(|e| stop.now(e))
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
        local.all_to_all_v_flat(&packed, &sends, &mut got, &recvs, dtype)?;
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

/// Sends this rank's blocks to every rank not in `host` and receives theirs,
/// all at once.
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
