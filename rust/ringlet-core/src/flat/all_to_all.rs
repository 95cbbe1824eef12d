//! All-to-all with per-peer counts (MPI's `alltoallv`) on one level: rank
//! r's `send` holds consecutive blocks, block j (`send_counts[j]` elements)
//! for rank j; its `recv` receives consecutive blocks, block i
//! (`recv_counts[i]` elements) from rank i. Equal-split all-to-all and
//! collective permute are special cases.
//!
//! The operation first all-gathers every rank's count vectors
//! (`exchange_counts`, with the caller's all-gather: the flat one here, the
//! communicator's own in the entry point, two-level when it has levels), so
//! each rank knows the whole traffic matrix (`Traffic`, which the two-level
//! all-to-all uses too) and every rank reports the same error when a sender
//! and a receiver disagree about a block's size.
//!
//! Shared memory: every rank copies its own block straight into its receive
//! buffer and streams the rest of its send buffer (the blocks for its
//! peers, back to back: its *outgoing* stream) through its slot in windows
//! of half a slot; after each phase each rank copies the parts of each
//! peer's window that are addressed to it. With cross-memory attach and
//! large blocks, every rank reads its blocks straight out of the peers' send
//! buffers instead (one phase to publish addresses, one to release them).
//!
//! TCP: every block goes directly to its destination; one `transfer` moves
//! all sends and receives together, so no ordering can deadlock.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::{Communicator, Config, Link};
use crate::transport::shm::ShmGroup;
use crate::transport::tcp::{TcpMesh, Xfer};
use crate::transport::{OpDesc, OpKind};
use std::ops::Range;

const OP: &str = "all_to_all";

/// Who sends how many elements to whom: `m[i][j]` elements from rank i to j.
pub(crate) struct Traffic {
    pub(crate) m: Vec<Vec<usize>>,
    pub(crate) esz: usize,
}

impl Traffic {
    /// The bytes of rank `i`'s send buffer addressed to rank `j`.
    pub(crate) fn send_range(&self, i: usize, j: usize) -> Range<usize> {
        let start: usize = self.m[i][..j].iter().sum::<usize>() * self.esz;
        start..start + self.m[i][j] * self.esz
    }

    /// The bytes of rank `j`'s receive buffer that come from rank `i`.
    pub(crate) fn recv_range(&self, i: usize, j: usize) -> Range<usize> {
        let start: usize = (0..i).map(|k| self.m[k][j]).sum::<usize>() * self.esz;
        start..start + self.m[i][j] * self.esz
    }

    /// Where rank `i`'s block for rank `j` (`j != i`) lies in `i`'s outgoing
    /// stream: its send buffer without its own block.
    fn out_range(&self, i: usize, j: usize) -> Range<usize> {
        let start: usize = (0..j)
            .filter(|&k| k != i)
            .map(|k| self.m[i][k])
            .sum::<usize>();
        start * self.esz..(start + self.m[i][j]) * self.esz
    }

    /// The length of rank `i`'s outgoing stream.
    fn out_total(&self, i: usize) -> usize {
        (self.m[i].iter().sum::<usize>() - self.m[i][i]) * self.esz
    }

    fn largest_block(&self) -> usize {
        self.m.iter().flatten().copied().max().unwrap_or(0) * self.esz
    }

    pub(crate) fn elements(&self) -> usize {
        self.m.iter().flatten().sum()
    }
}

impl Communicator {
    /// `all_to_all_v` on one level, for the host level of a two-level
    /// all-to-all (the counts, sized by the caller, go round by the flat
    /// all-gather).
    pub(crate) fn all_to_all_v_flat(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let traffic =
            self.exchange_counts(send_counts, recv_counts, dtype.size(), |c, mine, all| {
                c.all_gather_flat(mine, all, DType::I64)
            })?;
        self.all_to_all_flat(send, recv, &traffic, dtype)
    }

    /// `all_to_all_v` on one level, after the counts were exchanged and
    /// checked (`traffic`).
    pub(crate) fn all_to_all_flat(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        traffic: &Traffic,
        dtype: DType,
    ) -> Result<()> {
        let me = self.rank();
        self.guarded(|c| {
            let desc = c.next_desc(OpKind::AllToAll, dtype, None, traffic.elements(), 0);
            let own = traffic.send_range(me, me);
            recv[traffic.recv_range(me, me)].copy_from_slice(&send[own]);
            match &mut c.link {
                Link::Local => Ok(()),
                Link::Shm { shm, .. } => shm_all_to_all(shm, &c.cfg, desc, traffic, send, recv),
                Link::Tcp(mesh) => {
                    mesh.agree(&desc, c.cfg.timeout)?;
                    tcp_all_to_all(mesh, &c.cfg, traffic, send, recv)
                }
            }
        })
    }

    /// All-gathers the count vectors and checks that every block's sender and
    /// receiver agree on its size; every rank sees the same matrix, so every
    /// rank raises the same error. `gather` all-gathers this rank's counts
    /// (`mine`) into `all` (elements of `I64`): the caller's all-gather, on
    /// one level or two.
    pub(crate) fn exchange_counts(
        &mut self,
        send_counts: &[usize],
        recv_counts: &[usize],
        esz: usize,
        gather: impl FnOnce(&mut Self, &[u8], &mut [u8]) -> Result<()>,
    ) -> Result<Traffic> {
        let p = self.size();
        let mine: Vec<u64> = send_counts
            .iter()
            .chain(recv_counts)
            .map(|&c| c as u64)
            .collect();
        let mut all = vec![0u64; 2 * p * p];
        gather(
            self,
            bytemuck::cast_slice(&mine),
            bytemuck::cast_slice_mut(&mut all),
        )?;
        let sends = |i: usize, j: usize| all[i * 2 * p + j] as usize;
        let recvs = |j: usize, i: usize| all[j * 2 * p + p + i] as usize;
        let odd: Vec<String> = (0..p)
            .flat_map(|i| (0..p).map(move |j| (i, j)))
            .filter(|&(i, j)| sends(i, j) != recvs(j, i))
            .map(|(i, j)| {
                format!(
                    "rank {i} sends {} elements to rank {j}, which expects {}",
                    sends(i, j),
                    recvs(j, i)
                )
            })
            .collect();
        if !odd.is_empty() {
            return Err(Error::Mismatch {
                rank: self.rank(),
                detail: format!("all_to_all block sizes disagree: {}", odd.join("; ")),
            });
        }
        Ok(Traffic {
            m: (0..p)
                .map(|i| (0..p).map(|j| sends(i, j)).collect())
                .collect(),
            esz,
        })
    }
}

fn shm_all_to_all(
    shm: &mut ShmGroup,
    cfg: &Config,
    mut desc: OpDesc,
    t: &Traffic,
    send: &[u8],
    recv: &mut [u8],
) -> Result<()> {
    let (p, me) = (shm.size(), shm.rank());
    let peers = || (0..p).filter(move |&j| j != me);
    if shm.cma() && t.largest_block() >= cfg.cma_threshold {
        desc.addr = send.as_ptr() as u64;
        shm.next_half();
        shm.arrive(&desc)?;
        for j in peers() {
            let src = t.send_range(j, me);
            let addr = shm.peer_desc(j)?.addr + src.start as u64;
            shm.read_peer(j, addr, &mut recv[t.recv_range(j, me)], OP)?;
        }
        return shm.sync(OP);
    }
    let window = shm.half_bytes();
    let longest = (0..p).map(|i| t.out_total(i)).max().unwrap_or(0);
    let rounds = longest.div_ceil(window).max(1);
    for k in 0..rounds {
        let win = k * window..(k + 1) * window;
        shm.next_piece(desc.seq, rounds, longest.min(window));
        for j in peers() {
            // the part of my block for j that falls in this window
            let out = t.out_range(me, j);
            let (s, e) = (out.start.max(win.start), out.end.min(win.end));
            if s < e {
                let from = t.send_range(me, j).start + (s - out.start);
                shm.put(s - win.start, &send[from..from + (e - s)]);
            }
        }
        if k == 0 {
            shm.arrive(&desc)?;
        } else {
            shm.sync(OP)?;
        }
        for j in peers() {
            let src = t.out_range(j, me);
            let (s, e) = (src.start.max(win.start), src.end.min(win.end));
            if s < e {
                let dst = t.recv_range(j, me).start + (s - src.start);
                shm.get(j, s - win.start, &mut recv[dst..dst + (e - s)]);
            }
        }
    }
    Ok(())
}

fn tcp_all_to_all(
    mesh: &TcpMesh,
    cfg: &Config,
    t: &Traffic,
    send: &[u8],
    recv: &mut [u8],
) -> Result<()> {
    let me = mesh.rank();
    let mut xfers: Vec<Xfer> = Vec::with_capacity(2 * mesh.size());
    let mut rest = recv;
    for i in 0..mesh.size() {
        let (block, tail) = rest.split_at_mut(t.m[i][me] * t.esz);
        rest = tail;
        if i != me && !block.is_empty() {
            xfers.push(Xfer::recv(i, block));
        }
    }
    for j in (0..mesh.size()).filter(|&j| j != me && t.m[me][j] > 0) {
        xfers.push(Xfer::send(j, &send[t.send_range(me, j)]));
    }
    if xfers.is_empty() {
        return Ok(());
    }
    mesh.transfer(&mut xfers, OP, cfg.timeout)
}
