//! Two-level collectives for a communicator whose ranks span several hosts.
//!
//! Such a communicator keeps its TCP mesh (a stream between every pair of
//! ranks) and, attached with [`Communicator::attach_levels`], a
//! shared-memory communicator of the ranks on its own host (`local`). Its
//! collectives then move every byte across a host's link as few times as the
//! collective allows, every rank of a host carries its share over its own
//! streams, and the host-local work overlaps the network. On the host level
//! they call the single-level collectives (`flat`) directly; the public
//! entry points (`collective`) call them here. Where each rank sits and
//! which channels it carries is the [`Plan`] (in `plan`), kept with `local`
//! in the communicator's `Levels` (in `group`).
//!
//! **Channels.** A buffer that crosses hosts is cut into `C` equal channels,
//! `C` the least common multiple of the hosts' rank counts. On host `h`
//! (`L_h` ranks) local rank `i` owns channels `[i·C/L_h, (i+1)·C/L_h)`: an
//! equal, contiguous share, so the host's shared-memory reduce-scatter
//! produces (and its all-gather consumes) exactly the channels that rank
//! carries across hosts. For each channel the owners on different hosts talk
//! directly over their stream. When every host holds the same number of
//! ranks, channel `i` is local rank `i` everywhere (the classic "same local
//! index" cross groups); with uneven hosts (1 + 3 ranks) the rank of the
//! small host owns three channels and talks to three peers at once.
//!
//! **Pipeline.** Large collectives run in pieces ([`pipeline`]): a helper
//! thread does the shared-memory steps (reduce-scatter of piece k+1,
//! all-gather of piece k-1) while the calling thread moves piece k over TCP,
//! so the link does not wait for memory work, nor memory work for the link.
//!
//! **Errors.** Cross-host steps name global ranks; the local communicator's
//! errors already do. Any failure inside a collective trips this rank's
//! communicators at once, so the peers on both levels learn the culprit
//! instead of waiting out their timeout.

mod all_gather;
mod all_reduce;
mod all_to_all;
mod broadcast;
mod reduce_scatter;

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::fault::{self, Tripwire};
use crate::group::{Communicator, Levels, Link};
use crate::plan::Plan;
use crate::transport::tcp::{TcpMesh, Xfer};
use crate::transport::{OpDesc, OpKind};
use std::sync::{mpsc, Arc};
use std::time::Duration;

fn take(pool: &mut Vec<Vec<u64>>, bytes: usize) -> Vec<u64> {
    let words = bytes.div_ceil(8);
    match pool.iter().position(|v| v.len() >= words) {
        Some(i) => pool.swap_remove(i),
        None => vec![0u64; words],
    }
}

/// Returns scratch buffers to the pool (at most a few are kept).
fn give(pool: &mut Vec<Vec<u64>>, bufs: impl IntoIterator<Item = Vec<u64>>) {
    for b in bufs {
        if pool.len() < 16 && !b.is_empty() {
            pool.push(b);
        }
    }
}

/// `buf` cut, front to back, into one receive per run of `runs` (`(byte
/// range, peer)`, as [`Plan::byte_runs`] gives them): `(peer, bytes)`.
fn recv_runs(
    buf: &mut [u8],
    runs: impl IntoIterator<Item = (std::ops::Range<usize>, usize)>,
) -> Vec<(usize, &mut [u8])> {
    let mut out = Vec::new();
    let mut rest = buf;
    for (r, peer) in runs {
        let (head, tail) = rest.split_at_mut(r.len());
        rest = tail;
        out.push((peer, head));
    }
    out
}

/// The first `len` bytes of a scratch buffer (read only).
fn view(v: &[u64], len: usize) -> &[u8] {
    &bytemuck::cast_slice(v)[..len]
}

/// The first `len` bytes of a scratch buffer.
fn bytes(v: &mut [u64], len: usize) -> &mut [u8] {
    &mut bytemuck::cast_slice_mut(v)[..len]
}

/// `n` rounded up to a multiple of `m`.
fn round_up(n: usize, m: usize) -> usize {
    n.div_ceil(m) * m
}

/// Smallest pipeline piece: below it the per-piece steps cost more than the
/// overlap saves.
pub(super) const PIECE_MIN: usize = 256 << 10;
/// Largest pipeline piece: pieces of every rank in flight stay cache-sized.
/// Measured across two namespace hosts (2 x 2 ranks, all_reduce): with 2 MiB
/// pieces 4 / 16 MiB reached 84 / 87% of a 2 Gbit link and took 34.8 ms for
/// 16 MiB on the raw veth; with 256 KiB pieces 89 / 88% and 24.5 ms (one
/// piece for the whole message: 77 / 68%).
pub(super) const PIECE_MAX: usize = 256 << 10;
/// Smallest message a piece should give each cross-host exchange: with many
/// hosts, pieces grow so that per-message costs stay small beside the bytes.
const MESSAGE_MIN: usize = 16 << 10;

impl Plan {
    /// Bytes per piece of a pipelined collective moving `total` bytes:
    /// about a quarter of the whole within `PIECE_MIN..PIECE_MAX` (today one
    /// size: 256 KiB), so a large collective has many pieces to overlap and a
    /// small one runs in one; at least `MESSAGE_MIN` per channel and host.
    fn piece_bytes(&self, total: usize) -> usize {
        let floor = PIECE_MIN.max(MESSAGE_MIN * self.channels * self.hosts());
        (total / 4).clamp(floor, PIECE_MAX.max(floor))
    }

    /// Elements per piece of a buffer of `total` elements of `esz` bytes, a
    /// multiple of the channel count.
    fn piece_elems(&self, total: usize, esz: usize) -> usize {
        round_up((self.piece_bytes(total * esz) / esz).max(1), self.channels)
    }

    /// Elements of each rank's block per piece when `p` blocks of `count`
    /// elements move together, a multiple of the channel count: a share of
    /// a piece of the whole, or, for blocks of 1 MiB and more, a quarter of
    /// the block up to `PIECE_MAX`. Measured across 2 x 2 namespace hosts at
    /// 2 Gbit (all_gather / reduce_scatter at 4 and 16 MiB): with a share of
    /// a 256 KiB piece (64 KiB per block) 65-79% and 79-88% of the link
    /// limit, with 256 KiB per block 77-81% and 90-91% (fewer shared-memory
    /// steps per byte on the link, where each host sends only half of S).
    fn block_piece(&self, count: usize, p: usize, esz: usize) -> usize {
        let share = self.piece_bytes(count * p * esz) / p;
        let block = (count * esz / 4).min(PIECE_MAX);
        round_up((share.max(block) / esz).max(1), self.channels)
    }
}

/// Pieces the shared-memory side may run ahead of the network.
const DEPTH: usize = 2;

/// The cross-host side of a collective: the world's TCP mesh, with errors
/// turned into global ranks as they leave it.
pub(crate) struct Net<'a> {
    mesh: &'a TcpMesh,
    timeout: Duration,
    members: &'a [usize],
    name: &'a str,
    op: &'static str,
}

impl Net<'_> {
    /// Moves every transfer to completion.
    fn transfer(&self, x: &mut [Xfer<'_>]) -> Result<()> {
        self.mesh
            .transfer(x, self.op, self.timeout)
            .map_err(|e| self.global(e))
    }

    /// One piece's transfers: `sends` (each resumed from `sent`, how far an
    /// earlier call got with it) and `recvs`, with `ahead` (the next piece's
    /// sends) queued behind them on the same streams. Returns when this
    /// piece's transfers are done and tells how far each of `ahead` got, so
    /// the link keeps busy while this piece is finished and handed back.
    fn exchange(
        &self,
        sends: Vec<(usize, &[u8])>,
        sent: &[usize],
        recvs: Vec<(usize, &mut [u8])>,
        ahead: Vec<(usize, &[u8])>,
    ) -> Result<Vec<usize>> {
        let mut x: Vec<Xfer<'_>> = Vec::with_capacity(sends.len() + recvs.len() + ahead.len());
        for (i, (peer, b)) in sends.into_iter().enumerate() {
            x.push(Xfer::send_from(peer, b, sent.get(i).copied().unwrap_or(0)));
        }
        x.extend(recvs.into_iter().map(|(peer, b)| Xfer::recv(peer, b)));
        let needed = x.len();
        x.extend(ahead.into_iter().map(|(peer, b)| Xfer::send(peer, b)));
        self.mesh
            .transfer_until(&mut x, self.op, self.timeout, |x| {
                x[..needed].iter().all(|t| t.done() == t.len())
            })
            .map_err(|e| self.global(e))?;
        Ok(x[needed..].iter().map(Xfer::done).collect())
    }

    /// [`Net::exchange`] of one pipeline piece, with the `next` piece's
    /// sends (`ahead(next)`), when it is ready, queued behind; how far they
    /// got is left in the next piece's `sent_of(next)`.
    fn exchange_ahead<P>(
        &self,
        sends: Vec<(usize, &[u8])>,
        sent: &[usize],
        recvs: Vec<(usize, &mut [u8])>,
        next: Option<&mut P>,
        ahead: impl for<'n> FnOnce(&'n P) -> Vec<(usize, &'n [u8])>,
        sent_of: impl for<'n> FnOnce(&'n mut P) -> &'n mut Vec<usize>,
    ) -> Result<()> {
        let queued = next.as_deref().map_or_else(Vec::new, ahead);
        let got = self.exchange(sends, sent, recvs, queued)?;
        if let Some(n) = next {
            *sent_of(n) = got;
        }
        Ok(())
    }

    /// Every rank checks that every rank called the same collective (the
    /// mesh's agreement: ⌈log2 p⌉ messages, descriptors only on a mismatch).
    fn agree(&self, desc: &OpDesc) -> Result<()> {
        self.mesh
            .agree(desc, self.timeout)
            .map_err(|e| self.global(e))
    }

    fn global(&self, e: Error) -> Error {
        if self.mesh.wire().tripped() {
            return self.mesh.wire().fault();
        }
        e.globalize(self.members, self.name, self.op)
    }
}

/// Trips this rank's communicators (both levels and the domain) with `e` the
/// moment a collective fails, so every peer stops waiting for this rank and
/// learns the culprit.
pub(crate) struct Stop {
    wires: Vec<Arc<Tripwire>>,
    domain: u64,
    me: usize,
}

impl Stop {
    fn now(&self, e: &Error) {
        if *e == stopped() {
            return;
        }
        let (culprit, cause) = e.origin(self.me).unwrap_or((self.me, crate::Cause::Failed));
        for w in &self.wires {
            w.trip(e.clone(), culprit, cause);
        }
        fault::trip_domain(self.domain, e, culprit, cause);
    }
}

/// The shared-memory half of a pipelined collective: `pre` makes piece `k`
/// ready for the network (e.g. reduces it within the host), `post` finishes
/// it after the network (e.g. all-gathers it within the host). Both run on
/// one thread, in an order every rank of the host follows.
pub(crate) trait LocalSide: Send {
    type Piece: Send;
    fn pre(&mut self, local: &mut Communicator, k: usize) -> Result<Self::Piece>;
    fn post(&mut self, local: &mut Communicator, k: usize, piece: Self::Piece) -> Result<()>;
}

/// Why a pipeline half stopped early: the other half failed (its error is
/// the one reported).
fn stopped() -> Error {
    Error::Aborted {
        rank: 0,
        reason: "the other half of a two-level collective stopped".into(),
        origin: None,
    }
}

/// Runs `pieces` pieces through `side.pre`, `cross` and `side.post`. One
/// piece runs on the calling thread; more run the shared-memory side on a
/// helper thread up to `DEPTH` pieces ahead of `cross`, which runs here (the
/// TCP mesh stays on the thread that owns it). The shared-memory steps run
/// in the same order on every rank of a host: pre 0..=DEPTH, then post k and
/// pre k+DEPTH+1 alternately, then the remaining posts.
fn pipeline<S: LocalSide>(
    local: &mut Communicator,
    side: &mut S,
    pieces: usize,
    stop: &Stop,
    mut cross: impl FnMut(usize, &mut S::Piece, Option<&mut S::Piece>) -> Result<()>,
) -> Result<()> {
    if pieces <= 1 {
        let mut run = || -> Result<()> {
            for k in 0..pieces {
                let mut p = side.pre(local, k)?;
                cross(k, &mut p, None)?;
                side.post(local, k, p)?;
            }
            Ok(())
        };
        return run().inspect_err(|e| stop.now(e));
    }
    let (to_net, from_local) = mpsc::channel::<(usize, S::Piece)>();
    let (to_local, from_net) = mpsc::channel::<(usize, S::Piece)>();
    std::thread::scope(|s| {
        let worker = s.spawn(move || -> Result<()> {
            let mut run = || -> Result<()> {
                let mut inflight = 0;
                let mut next = 0;
                while next < pieces || inflight > 0 {
                    if next < pieces && inflight <= DEPTH {
                        let p = side.pre(local, next)?;
                        to_net.send((next, p)).map_err(|_| stopped())?;
                        next += 1;
                        inflight += 1;
                    } else {
                        let (k, p) = from_net.recv().map_err(|_| stopped())?;
                        side.post(local, k, p)?;
                        inflight -= 1;
                    }
                }
                Ok(())
            };
            run().inspect_err(|e| stop.now(e))
        });
        let mut net = || -> Result<()> {
            // The next piece, when the shared-memory side has it ready, so
            // its sends can start while this piece's data arrives.
            let mut next: Option<(usize, S::Piece)> = None;
            for _ in 0..pieces {
                let (k, mut p) = match next.take() {
                    Some(n) => n,
                    None => from_local.recv().map_err(|_| stopped())?,
                };
                next = from_local.try_recv().ok();
                cross(k, &mut p, next.as_mut().map(|(_, n)| n))?;
                to_local.send((k, p)).map_err(|_| stopped())?;
            }
            Ok(())
        };
        let net = net();
        if let Err(e) = &net {
            stop.now(e);
        }
        drop(from_local);
        drop(to_local);
        let here = worker.join().unwrap_or_else(|_| {
            let e = Error::Io {
                context: "two-level collective".into(),
                message: "the shared-memory helper thread panicked".into(),
            };
            stop.now(&e);
            Err(e)
        });
        match (net, here) {
            (Err(e), Err(l)) if e == stopped() => Err(l),
            (Err(e), _) | (Ok(()), Err(e)) => Err(e),
            (Ok(()), Ok(())) => Ok(()),
        }
    })
}

/// Splits `buf` into consecutive chunks of `size` bytes (the last shorter).
fn chunks(buf: &mut [u8], size: usize) -> Vec<Option<&mut [u8]>> {
    buf.chunks_mut(size.max(1)).map(Some).collect()
}

impl Communicator {
    /// Makes this communicator (TCP between every pair of ranks) run its
    /// collectives in two levels: `local` connects the ranks of this rank's
    /// host (shared memory), `layout` lists each host's ranks (group ranks,
    /// in `local`'s rank order). Every rank of the communicator must attach
    /// the same layout before its next collective. `local` should report
    /// global ranks in its errors (its member table) and share this
    /// communicator's failure domain.
    pub fn attach_levels(&mut self, local: Communicator, layout: Vec<Vec<usize>>) -> Result<()> {
        if !matches!(self.link, Link::Tcp(_)) {
            return Err(Error::InvalidArgument(format!(
                "attach_levels: the communicator must connect its ranks over TCP (it uses {})",
                self.transport()
            )));
        }
        if self.levels.is_some() {
            return Err(Error::InvalidArgument(
                "attach_levels: levels are attached already".into(),
            ));
        }
        let plan = Plan::new(self.rank(), self.size(), local.rank(), local.size(), layout)?;
        self.levels = Some(Box::new(Levels {
            local,
            plan,
            pool: Vec::new(),
        }));
        Ok(())
    }

    /// The ranks of each host when levels are attached.
    pub fn host_layout(&self) -> Option<&[Vec<usize>]> {
        self.levels.as_deref().map(|l| l.plan.layout.as_slice())
    }

    /// Runs a two-level collective described by `kind`, `dtype`, `op`,
    /// `count` and `root`: every rank checks every rank's descriptor first,
    /// then `f` gets the levels, the cross-host side and the tripwires to
    /// pull on failure. Errors leave with global ranks.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn two_level<T>(
        &mut self,
        kind: OpKind,
        dtype: DType,
        reduce: Option<ReduceOp>,
        count: usize,
        root: usize,
        f: impl FnOnce(&mut Levels, &Net<'_>, &Stop) -> Result<T>,
    ) -> Result<T> {
        let op = kind.name();
        self.guarded_global(|c| {
            let desc = c.next_desc(kind, dtype, reduce, count, root);
            let me = c.global_rank();
            let domain = c.cfg.domain;
            let Communicator {
                link, levels, cfg, ..
            } = c;
            let (Link::Tcp(mesh), Some(levels)) = (&*link, levels.as_deref_mut()) else {
                return Err(Error::InvalidArgument(format!("{op}: no levels attached")));
            };
            let stop = Stop {
                wires: vec![mesh.wire().clone(), levels.local.tripwire()],
                domain,
                me,
            };
            let net = Net {
                mesh,
                timeout: cfg.timeout,
                members: &cfg.members,
                name: &cfg.name,
                op,
            };
            net.agree(&desc)?;
            f(levels, &net, &stop)
        })
    }
}
