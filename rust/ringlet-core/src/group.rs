//! A communicator: this rank's place in a group of ranks, the transport that
//! connects them, the operation sequence number, and the failure state.

use crate::dtype::{DType, ReduceOp};
use crate::error::{Cause, Error, Result};
use crate::fault::{self, Tripwire};
use crate::plan::Plan;
use crate::transport::shm::ShmGroup;
use crate::transport::tcp::TcpMesh;
use crate::transport::{OpDesc, OpKind, WaitPolicy};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tunables of a communicator (the Python side fills them from `RINGLET_*`
/// environment variables).
#[derive(Clone, Debug)]
pub struct Config {
    /// Longest wait for a peer without progress before failing.
    pub timeout: Duration,
    /// Use TCP even between ranks of one host.
    pub force_tcp: bool,
    /// Bytes of shared memory per rank (two halves for pipelining). Large
    /// messages go through in pieces of half a slot, so a slot small enough
    /// for both ranks' pieces to stay in cache is the fastest (see
    /// `DEFAULT_SLOT_BYTES`).
    pub slot_bytes: usize,
    /// Allow cross-memory attach (single-copy) for large messages.
    pub cma: bool,
    /// Messages of at least this many bytes use cross-memory attach (default:
    /// never, see `DEFAULT_CMA_THRESHOLD`).
    pub cma_threshold: usize,
    /// All-reduces up to this many bytes use the latency-optimised path.
    pub small_bytes: usize,
    /// Spin iterations before a waiting rank reads the clock.
    pub spins: u32,
    /// How long a waiting rank spins, on contended cores, for a peer that
    /// may not have entered the operation yet (see [`WaitPolicy`]).
    pub spin_for: Duration,
    /// How long it spins for a peer inside the operation, or at the first
    /// phase while no other task wants a CPU (see [`WaitPolicy`]).
    pub long_spin_for: Duration,
    /// After spinning, how long a waiting rank yields its CPU before it
    /// parks (zero by default: a yield hands a busy neighbour the core for
    /// its whole scheduler slice).
    pub yield_for: Duration,
    /// Global rank of each group rank, for error messages and abort notices
    /// (empty: group ranks are global ranks).
    pub members: Vec<usize>,
    /// The communicator's name in error messages ("the world (4 ranks)").
    pub name: String,
    /// Communicators of one rank with the same non-zero domain fail
    /// together (see `fault`).
    pub domain: u64,
}

/// 1 MiB per rank: pieces of 512 KiB, so the pieces of every rank in flight
/// stay in the caches and a collective touches main memory only for the
/// caller's buffers. Measured against 8 MiB (4 MiB pieces, which spill to
/// memory): 2 ranks, 256 MiB all_reduce 8.3 -> 14 GB/s; 4 ranks on 2 cores,
/// 16 MiB all_reduce 6.5 -> 3.6 ms.
pub const DEFAULT_SLOT_BYTES: usize = 1 << 20;

/// Collectives stage through shared memory at every size unless a threshold
/// is set: the kernel's cross-process copy (`process_vm_readv`/`writev`)
/// runs at 7-10 GB/s per core here, while the staged pipeline above copies at
/// cache speed, and it lost at every size measured (64 KiB to 1 GiB; 1 GiB
/// all_reduce on 2 ranks 7.7 vs 13.7 GB/s, broadcast 10.1 vs 21.5 GB/s).
pub const DEFAULT_CMA_THRESHOLD: usize = usize::MAX;

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(300),
            force_tcp: false,
            slot_bytes: DEFAULT_SLOT_BYTES,
            cma: true,
            cma_threshold: DEFAULT_CMA_THRESHOLD,
            small_bytes: 4 << 10,
            spins: 2000,
            spin_for: crate::transport::DEFAULT_SPIN_FOR,
            long_spin_for: crate::transport::DEFAULT_LONG_SPIN_FOR,
            yield_for: Duration::ZERO,
            members: Vec::new(),
            name: String::new(),
            domain: 0,
        }
    }
}

impl Config {
    pub(crate) fn wait_policy(&self) -> WaitPolicy {
        WaitPolicy {
            spins: self.spins,
            spin_for: self.spin_for,
            long_spin_for: self.long_spin_for,
            yield_for: self.yield_for,
            ..WaitPolicy::with_timeout(self.timeout)
        }
    }
}

/// How the ranks of a communicator are connected.
pub(crate) enum Link {
    /// World of one: nothing to connect.
    Local,
    /// Every rank on one host: shared memory (TCP kept for liveness only).
    Shm { shm: Box<ShmGroup>, _tcp: TcpMesh },
    /// TCP streams between every pair.
    Tcp(TcpMesh),
}

/// The host level of a communicator that spans hosts (attached with
/// `attach_levels`; the two-level collectives in `hierarchy` run on it).
pub(crate) struct Levels {
    /// This host's ranks (shared memory; a world of one on a one-rank host).
    pub(crate) local: Communicator,
    /// Where every rank sits and which channels it carries.
    pub(crate) plan: Plan,
    /// Scratch buffers kept between calls (no page faults on hot paths).
    pub(crate) pool: Vec<Vec<u64>>,
}

/// One rank's endpoint in a group of ranks.
pub struct Communicator {
    rank: usize,
    size: usize,
    seq: u64,
    pub(crate) cfg: Config,
    pub(crate) link: Link,
    failure: Option<Error>,
    wire: Arc<Tripwire>,
    /// Name of the operation running (or last run), for errors.
    op: &'static str,
    /// The host level, on communicators that span hosts (see `hierarchy`).
    pub(crate) levels: Option<Box<Levels>>,
}

impl Communicator {
    /// A world of one rank.
    pub fn single(cfg: Config) -> Communicator {
        let wire = Tripwire::new();
        fault::register(cfg.domain, &wire);
        Communicator {
            rank: 0,
            size: 1,
            seq: 0,
            cfg,
            link: Link::Local,
            failure: None,
            wire,
            op: "init",
            levels: None,
        }
    }

    /// Connects rank `rank` to the ranks listening at `addrs` (one per rank,
    /// `host:port`); `hosts[r]` identifies rank r's machine. All ranks on one
    /// host (and `force_tcp` off) gives shared memory, otherwise TCP.
    pub fn connect(
        rank: usize,
        addrs: &[String],
        hosts: &[String],
        listener: &TcpListener,
        token: u64,
        cfg: Config,
    ) -> Result<Communicator> {
        let size = addrs.len();
        if size == 0 || rank >= size || hosts.len() != size {
            return Err(Error::InvalidArgument(format!(
                "bad peer table: rank {rank}, {size} addresses, {} hosts",
                hosts.len()
            )));
        }
        if !cfg.members.is_empty() && cfg.members.len() != size {
            return Err(Error::InvalidArgument(format!(
                "bad member table: {} members for {size} ranks",
                cfg.members.len()
            )));
        }
        if size == 1 {
            return Ok(Communicator::single(cfg));
        }
        let one_host = hosts.iter().all(|h| *h == hosts[0]);
        // Over TCP, streams open as the algorithms first use them (the
        // doubling partners, which the Gray-ordered rings and the broadcast
        // tree share for a power of two, and the hosts' channel owners;
        // every peer only for all_to_all and the like). A group on one host
        // connects in full: shared memory is set up over the streams, which
        // then carry its failure notices.
        let shm = one_host && !cfg.force_tcp;
        let mut mesh = if !shm && size > TcpMesh::LAZY_ABOVE {
            TcpMesh::connect_lazily(rank, addrs, listener, token)?
        } else {
            TcpMesh::connect(rank, addrs, listener, token, cfg.timeout)?
        };
        mesh.set_members(&cfg.members);
        let link = if shm {
            match ShmGroup::establish(
                rank,
                size,
                &mesh,
                cfg.slot_bytes,
                cfg.cma,
                cfg.wait_policy(),
            )? {
                Some(shm) => Link::Shm {
                    shm: Box::new(shm),
                    _tcp: mesh,
                },
                None => Link::Tcp(mesh),
            }
        } else {
            Link::Tcp(mesh)
        };
        let wire = match &link {
            Link::Shm { _tcp: m, .. } | Link::Tcp(m) => m.wire().clone(),
            Link::Local => Tripwire::new(),
        };
        fault::register(cfg.domain, &wire);
        Ok(Communicator {
            rank,
            size,
            seq: 0,
            cfg,
            link,
            failure: None,
            wire,
            op: "init",
            levels: None,
        })
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// TCP streams to peers open now: every peer's for a group on one host
    /// (and up to `TcpMesh::LAZY_ABOVE` ranks), else those the collectives
    /// so far have used (they open on demand).
    pub fn open_streams(&self) -> usize {
        match &self.link {
            Link::Local => 0,
            Link::Shm { _tcp: m, .. } | Link::Tcp(m) => m.open_streams(),
        }
    }

    /// Which transport is in use: `"local"`, `"shm+cma"`, `"shm"` or `"tcp"`.
    pub fn transport(&self) -> &'static str {
        match &self.link {
            Link::Local => "local",
            Link::Shm { shm, .. } if shm.cma() => "shm+cma",
            Link::Shm { .. } => "shm",
            Link::Tcp(_) => "tcp",
        }
    }

    /// The error that made this communicator unusable, if any.
    pub fn failure(&self) -> Option<&Error> {
        self.failure.as_ref()
    }

    /// Builds the descriptor of the next operation (advancing the sequence).
    pub(crate) fn next_desc(
        &mut self,
        kind: OpKind,
        dtype: DType,
        op: Option<ReduceOp>,
        count: usize,
        root: usize,
    ) -> OpDesc {
        self.seq += 1;
        self.op = kind.name();
        OpDesc {
            seq: self.seq,
            kind,
            dtype,
            op,
            count: count as u64,
            root: root as u64,
            addr: 0,
        }
    }

    /// Global rank of group rank `r`.
    fn global(&self, r: usize) -> usize {
        self.cfg.members.get(r).copied().unwrap_or(r)
    }

    /// This rank's global rank.
    pub(crate) fn global_rank(&self) -> usize {
        self.global(self.rank)
    }

    /// `guarded` for work whose errors name global ranks already (the
    /// two-level collectives convert each level's errors where they arise).
    pub(crate) fn guarded_global<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<T> {
        self.guarded_as(true, f)
    }

    /// Runs one collective: refuses to start on a failed communicator; after
    /// it, fails if a peer gave up meanwhile; on a fatal error marks the
    /// communicator failed and trips it (and its domain), so peers learn the
    /// culprit. Errors leave with global ranks and the communicator's name.
    pub(crate) fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.guarded_as(false, f)
    }

    fn guarded_as<T>(&mut self, global: bool, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.failure.is_none() && self.wire.tripped() {
            self.failure = Some(self.wire.fault());
        }
        if let Some(e) = &self.failure {
            let me = self.global(self.rank);
            return Err(Error::Aborted {
                rank: me,
                reason: e.to_string(),
                origin: e.origin(me),
            });
        }
        let out = f(self).and_then(|v| {
            match &self.link {
                Link::Local => Ok(()),
                Link::Shm { shm, .. } => shm.check_peers(self.op),
                Link::Tcp(mesh) => mesh.check_peers(self.op),
            }
            .map_err(|e| {
                if global {
                    e.globalize(&self.cfg.members, &self.cfg.name, self.op)
                } else {
                    e
                }
            })?;
            Ok(v)
        });
        out.map_err(|e| {
            let e = if self.wire.tripped() {
                self.wire.fault()
            } else if global {
                e
            } else {
                e.globalize(&self.cfg.members, &self.cfg.name, self.op)
            };
            if e.is_fatal() {
                self.abort(e.clone());
                return self.follow_blame(e);
            }
            e
        })
    }

    /// After blaming a peer for a timeout (and telling every peer): the
    /// blamed rank may answer that it was itself waiting for another;
    /// the failure recorded (here and in the domain) becomes the rank the
    /// chain of waits ends at.
    fn follow_blame(&mut self, e: Error) -> Error {
        if self.wire.followed() {
            // another communicator of this rank traced it already
            let f = self.wire.fault();
            self.failure = Some(f.clone());
            return f;
        }
        // a reporter's notice on a shared-memory board (this communicator's
        // or, in a two-level collective, the host level's) may be revised
        let (wire, domain) = (self.wire.clone(), self.cfg.domain);
        let revised = |v: usize, said: (usize, Cause), until: Instant| loop {
            match fault::board_notice(&wire, domain, v) {
                None => return None,
                Some(Some(now)) if now != said => return Some(now),
                Some(_) => {}
            }
            if Instant::now() >= until {
                return None;
            }
            let _ = crate::sys::poll(&mut [], Duration::from_millis(5));
        };
        let end = match &self.link {
            Link::Local => return e,
            Link::Tcp(mesh) => mesh.follow_blame(
                e.clone(),
                self.cfg.timeout,
                &self.cfg.name,
                self.op,
                revised,
            ),
            Link::Shm { shm, .. } => shm.follow_blame(e.clone(), &self.cfg.name, self.op, revised),
        };
        let me = self.global(self.rank);
        let (culprit, cause) = end.origin(me).unwrap_or((me, Cause::Failed));
        self.wire.settle(&e, &end, culprit, cause);
        fault::settle_domain(self.cfg.domain, &e, &end, culprit, cause);
        if end != e {
            self.failure = Some(end.clone());
        }
        end
    }

    /// The message `peer` has started sending on this two-rank communicator
    /// that this rank has not received yet, as `(tag, element count,
    /// dtype)`, or `None` when there is none; never blocks on the peer. Over
    /// shared memory the sender's phase runs ahead and its descriptor is
    /// readable; over TCP the descriptor waits in the stream (read without
    /// consuming it). A peer that is gone, or an operation that is not a
    /// message, is an error naming it (the error a receive would raise).
    pub fn pending_message(&self, peer: usize) -> Result<Option<(u64, u64, DType)>> {
        if self.size() != 2 || peer >= 2 || peer == self.rank {
            return Err(Error::InvalidArgument(format!(
                "rank {}: pending_message: {peer} is not the other rank of a two-rank group",
                self.rank
            )));
        }
        let desc = match &self.link {
            Link::Local => Ok(None),
            Link::Shm { shm, .. } => shm.peer_next(peer, "recv"),
            Link::Tcp(mesh) => mesh.peek_desc(peer, "recv"),
        }
        .map_err(|e| e.globalize(&self.cfg.members, &self.cfg.name, "recv"))?;
        desc.map(|d| self.message_of(peer, d)).transpose()
    }

    /// Waits until `peer` starts sending a message on this two-rank
    /// communicator (or the timeout passes, or the peer is lost), and
    /// returns it as `(tag, element count, dtype)` without receiving it, so
    /// the caller can pick a buffer for it: a message with another tag than
    /// the one wanted can be received aside and kept for its own receive.
    pub fn wait_message(&mut self, peer: usize) -> Result<(u64, u64, DType)> {
        self.pending_message(peer)?; // argument checks; a peer already gone
        let timeout = self.cfg.timeout;
        let d = self.guarded(|c| match &c.link {
            Link::Local => Err(Error::InvalidArgument(format!(
                "rank {}: a one-rank communicator has no peer",
                c.rank
            ))),
            Link::Shm { shm, .. } => shm.wait_next(peer, "recv"),
            Link::Tcp(mesh) => mesh.wait_desc(peer, "recv", timeout),
        })?;
        self.message_of(peer, d)
    }

    /// `(tag, element count, dtype)` of the message `peer` started, as its
    /// descriptor `d` tells; an error when it started something else.
    fn message_of(&self, peer: usize, d: OpDesc) -> Result<(u64, u64, DType)> {
        if d.kind != OpKind::SendRecv || (d.root & 1) as usize != peer {
            return Err(Error::Mismatch {
                rank: self.global(self.rank),
                detail: format!(
                    "rank {} started {} where this rank waits for a message",
                    self.global(peer),
                    d.kind.name()
                ),
            });
        }
        Ok((d.root >> 1, d.count, d.dtype))
    }

    /// True once a fatal error (a lost or late peer) has made the
    /// communicator unusable.
    pub fn failed(&self) -> bool {
        self.failure.is_some() || self.wire.tripped()
    }

    /// Gives up on the communicator after `reason` (global ranks): peers
    /// blocked on this rank fail fast and learn the rank the failure started
    /// from; so do the other communicators of this rank's domain.
    pub fn abort(&mut self, reason: Error) {
        let me = self.global(self.rank);
        let (culprit, cause) = reason
            .origin(me)
            .unwrap_or((me, crate::error::Cause::Failed));
        self.wire.trip(reason.clone(), culprit, cause);
        fault::trip_domain(self.cfg.domain, &reason, culprit, cause);
        if self.failure.is_none() {
            self.failure = Some(reason);
        }
    }

    /// The communicator's failure flag, to abort it from another thread.
    pub fn tripwire(&self) -> Arc<Tripwire> {
        self.wire.clone()
    }

    /// The longest wait for a peer without progress.
    pub fn timeout(&self) -> Duration {
        self.cfg.timeout
    }

    /// Changes the longest wait for a peer without progress, for the
    /// operations that start from now on (on every level of a communicator
    /// spanning hosts).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.cfg.timeout = timeout;
        if let Link::Shm { shm, .. } = &mut self.link {
            shm.set_timeout(timeout);
        }
        if let Some(levels) = self.levels.as_deref_mut() {
            levels.local.set_timeout(timeout);
        }
    }
}

/// A communicator several owners use in turn (the Python binding's object
/// and the C ABI's group handle), one operation at a time; closing it
/// (taking it out) makes later calls fail instead of touching freed state.
#[derive(Clone)]
pub struct SharedCommunicator {
    inner: Arc<Mutex<Option<Communicator>>>,
    rank: usize,
    global: usize,
    size: usize,
    transport: &'static str,
}

impl SharedCommunicator {
    /// Shares `comm`.
    pub fn new(comm: Communicator) -> Self {
        SharedCommunicator {
            rank: comm.rank(),
            global: comm.global_rank(),
            size: comm.size(),
            transport: comm.transport(),
            inner: Arc::new(Mutex::new(Some(comm))),
        }
    }

    /// The communicator's group rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The communicator's rank in the job (its group rank's member entry).
    pub fn global_rank(&self) -> usize {
        self.global
    }

    /// Its number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Its transport (see [`Communicator::transport`]).
    pub fn transport(&self) -> &'static str {
        self.transport
    }

    fn aborted(&self, reason: &str) -> Error {
        Error::Aborted {
            rank: self.rank,
            reason: reason.into(),
            origin: None,
        }
    }

    /// Runs `f` on the communicator (waiting for the operation of another
    /// owner to end). Fails when it was closed; argument errors name this
    /// rank.
    pub fn with<T>(&self, f: impl FnOnce(&mut Communicator) -> Result<T>) -> Result<T> {
        let mut guard = self
            .inner
            .lock()
            .map_err(|_| self.aborted("an earlier call panicked"))?;
        let comm = guard
            .as_mut()
            .ok_or_else(|| self.aborted("the communicator was shut down"))?;
        let rank = self.rank;
        f(comm).map_err(|e| match e {
            Error::InvalidArgument(m) if !m.starts_with("rank ") => {
                Error::InvalidArgument(format!("rank {rank}: {m}"))
            }
            other => other,
        })
    }

    /// Takes the communicator out (closing it for every owner); None when
    /// it was taken already.
    pub fn take(&self) -> Result<Option<Communicator>> {
        let mut guard = self
            .inner
            .lock()
            .map_err(|_| self.aborted("an earlier call panicked"))?;
        Ok(guard.take())
    }

    /// True when a fatal error made the communicator unusable, or it was
    /// closed.
    pub fn failed(&self) -> bool {
        match self.inner.lock() {
            Ok(g) => g.as_ref().is_none_or(|c| c.failed()),
            Err(_) => true,
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.wire.close(self.global(self.rank));
        if let Link::Tcp(mesh) | Link::Shm { _tcp: mesh, .. } = &self.link {
            mesh.shutdown();
        }
    }
}
