//! Shared-memory transport for the ranks of one host.
//!
//! One segment (an anonymous memfd, so it never appears in /dev/shm) holds a
//! control block and a data slot per rank. Ranks move through *phases*: each
//! phase a rank bumps its own counter (`signal`) and waits until every peer's
//! counter has reached the same value (`wait_all`). A waiting rank spins
//! (see `WaitPolicy`), then parks on the peer's counter with a futex; while
//! parked it checks, every few milliseconds, whether the peer's process is
//! gone (its TCP stream closed) or gave up, and whether the deadline passed.
//!
//! Two ways to move data:
//! * staged: a rank copies its data into its slot and peers read it from there.
//!   Each slot has two halves used alternately by successive pieces, so a rank
//!   may refill one half while peers still read the other. The half index
//!   flips once per piece on every rank alike (also when an operation fails
//!   its agreement check), which keeps it identical across ranks.
//! * cross-memory attach (`process_vm_readv`): a rank publishes its buffer's
//!   address and peers copy straight out of its memory, one copy in all.
//!   Probed at set-up; unavailable when the kernel forbids it (Yama ptrace
//!   scope, seccomp), and then everything is staged.

mod segment;

use crate::dtype::{DType, ReduceOp};
use crate::error::{Cause, Error, Result};
use crate::fault::{NoticeBoard, Tripwire};
use crate::reduce;
use crate::sys;
use crate::transport::tcp::{TcpMesh, Xfer};
use crate::transport::{check_agreement, grace, OpDesc, WaitPolicy, Waiting, DESC_WORDS};
use segment::Segment;
use std::cell::Cell;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const PROBE_MAGIC: u64 = 0x7072_6f62_6521_2121;
const STATE_ABORTED: u32 = 1;
const STATE_LEFT: u32 = 2;

/// Writes this rank's abort notice or departure into its control block (held
/// by the communicator's tripwire, usable from any thread).
pub struct Notifier {
    seg: Arc<Segment>,
    rank: usize,
    /// Global rank of each group rank.
    members: Vec<usize>,
}

impl NoticeBoard for Notifier {
    /// Publishes that the failure started at global rank `culprit` with
    /// `cause`, then marks this rank as given up and wakes parked peers.
    fn publish(&self, culprit: usize, cause: Cause) {
        let c = self.seg.ctl(self.rank);
        c.notice_culprit.store(culprit as u64, Ordering::SeqCst);
        c.notice_cause.store(cause.code(), Ordering::SeqCst);
        c.state.store(STATE_ABORTED, Ordering::SeqCst);
        sys::futex_wake_all(&c.counter);
    }

    /// Marks this rank as having shut the communicator down.
    fn leave(&self, _me: usize) {
        let c = self.seg.ctl(self.rank);
        let _ = c
            .state
            .compare_exchange(0, STATE_LEFT, Ordering::SeqCst, Ordering::SeqCst);
        sys::futex_wake_all(&c.counter);
    }

    fn notice_of(&self, rank: usize) -> Option<Option<(usize, Cause)>> {
        let peer = self.members.iter().position(|&g| g == rank)?;
        let c = self.seg.ctl(peer);
        if c.state.load(Ordering::Acquire) != STATE_ABORTED {
            return Some(None);
        }
        let culprit = c.notice_culprit.load(Ordering::SeqCst) as usize;
        let cause =
            Cause::from_code(c.notice_cause.load(Ordering::SeqCst)).unwrap_or(Cause::Failed);
        Some(Some((culprit, cause)))
    }
}

/// The start of operation `seq`'s window of `bytes` in a half of
/// `half_bytes`: windows are whole pages, and the two halves alternate, so
/// consecutive uses of one half (seq, seq + 2, ...) step through its windows.
fn window_base(half_bytes: usize, seq: u64, bytes: usize) -> usize {
    let step = bytes.div_ceil(4096).max(1) * 4096;
    let windows = (half_bytes / step).max(1) as u64;
    ((seq / 2) % windows) as usize * step
}

/// The shared-memory group of one communicator (all its ranks on one host).
pub struct ShmGroup {
    rank: usize,
    size: usize,
    seg: Arc<Segment>,
    /// The communicator's failure flag (checked while waiting).
    wire: Arc<Tripwire>,
    /// Streams to each peer, only used to notice that a peer's process died.
    liveness: Vec<Option<RawFd>>,
    pids: Vec<u32>,
    /// Global rank of each group rank (notices name global ranks).
    members: Vec<usize>,
    cma: bool,
    /// Value of our own counter (we are its only writer).
    counter: u32,
    /// Which half of the slots the current piece uses.
    half: usize,
    /// Where in the current half this piece's bytes start (see
    /// [`next_window`](Self::next_window)); 0 after [`next_half`](Self::next_half).
    base: usize,
    /// Sequence number of the current operation.
    seq: u64,
    policy: WaitPolicy,
    /// Kept alive for the cross-memory-attach probe.
    _probe: Box<u64>,
    /// When this rank's last wait ended: a first phase that starts soon
    /// after (back-to-back operations) meets peers that are between calls
    /// too, and spins as long as a wait inside an operation.
    last_wait: Cell<Instant>,
}

fn words_to_bytes(w: &[u64]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_to_words(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect()
}

impl ShmGroup {
    /// Changes the longest wait without progress for later operations.
    pub(crate) fn set_timeout(&mut self, timeout: Duration) {
        self.policy.timeout = timeout;
    }

    /// Sets up the segment among all ranks of `mesh` (which must share a
    /// host), using the TCP streams for the hand-shake. Returns `None` when any
    /// rank cannot map the segment; every rank then gets `None` together.
    pub fn establish(
        rank: usize,
        size: usize,
        mesh: &TcpMesh,
        slot_bytes: usize,
        try_cma: bool,
        policy: WaitPolicy,
    ) -> Result<Option<ShmGroup>> {
        let t = policy.timeout;
        let op = "init (shared memory)";
        let probe = Box::new(PROBE_MAGIC ^ rank as u64);
        // Step 1: the leader creates the segment and tells everyone where it is.
        let mut leader_fd = None;
        let seg = if rank == 0 {
            let (seg, fd) = Segment::create(size, slot_bytes)?;
            let msg = words_to_bytes(&[
                sys::pid() as u64,
                fd.as_raw_fd() as u64,
                seg.slot_bytes() as u64,
            ]);
            let mut x: Vec<Xfer> = (1..size).map(|p| Xfer::send(p, &msg)).collect();
            mesh.transfer(&mut x, op, t)?;
            leader_fd = Some(fd);
            Some(seg)
        } else {
            let mut msg = [0u8; 24];
            mesh.transfer(&mut [Xfer::recv(0, &mut msg)], op, t)?;
            let w = bytes_to_words(&msg);
            Segment::open(w[0] as u32, w[1] as i32, size, w[2] as usize).ok()
        };
        if let Some(seg) = &seg {
            let c = seg.ctl(rank);
            c.pid.store(sys::pid(), Ordering::SeqCst);
            c.cpu.store(u32::MAX, Ordering::SeqCst);
            c.probe_addr
                .store(&*probe as *const u64 as u64, Ordering::SeqCst);
        }
        if let Some(seg) = &seg {
            seg.warm(rank, true); // this rank's slot into its caches
        }
        // Step 2: everyone reports whether mapping worked; the leader decides.
        let ok = agree_all(rank, size, mesh, seg.is_some(), op, t)?;
        drop(leader_fd); // peers have opened it (or given up): the file can go
        let seg = match (ok, seg) {
            (true, Some(seg)) => seg,
            _ => return Ok(None),
        };
        // Every owner has written its slot (they did before the agreement):
        // the peers' slots into this core's caches too.
        for peer in (0..size).filter(|&p| p != rank) {
            seg.warm(peer, false);
        }
        // Step 3: probe cross-memory attach against every peer.
        let pids: Vec<u32> = (0..size)
            .map(|r| seg.ctl(r).pid.load(Ordering::SeqCst))
            .collect();
        let mut cma_ok = try_cma;
        if cma_ok {
            for peer in (0..size).filter(|&p| p != rank) {
                let addr = seg.ctl(peer).probe_addr.load(Ordering::SeqCst);
                let mut got = [0u8; 8];
                let read = sys::read_peer_memory(pids[peer], addr, &mut got);
                cma_ok &= read.is_ok() && u64::from_le_bytes(got) == PROBE_MAGIC ^ peer as u64;
            }
        }
        let cma = agree_all(rank, size, mesh, cma_ok, op, t)?;
        let counter = seg.ctl(rank).counter.load(Ordering::SeqCst);
        let seg = Arc::new(seg);
        let wire = mesh.wire().clone();
        wire.set_shm(Notifier {
            seg: seg.clone(),
            rank,
            members: mesh.members(),
        });
        Ok(Some(ShmGroup {
            rank,
            size,
            seg,
            wire,
            liveness: (0..size)
                .map(|p| if p == rank { None } else { mesh.fd(p) })
                .collect(),
            pids,
            members: mesh.members(),
            cma,
            counter,
            half: 0,
            base: 0,
            seq: 0,
            policy,
            _probe: probe,
            last_wait: Cell::new(Instant::now()),
        }))
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// True when peers can read each other's memory directly.
    pub fn cma(&self) -> bool {
        self.cma
    }

    /// Bytes available to one piece in a rank's slot (half the slot).
    pub fn half_bytes(&self) -> usize {
        self.seg.slot_bytes() / 2
    }

    fn half_off(&self, off: usize) -> usize {
        self.half * self.half_bytes() + self.base + off
    }

    /// Bumps our phase counter, waking peers parked on it.
    pub fn signal(&mut self) {
        let c = self.seg.ctl(self.rank);
        self.counter = self.counter.wrapping_add(1);
        c.counter.store(self.counter, Ordering::SeqCst);
        if c.sleepers.load(Ordering::SeqCst) > 0 {
            sys::futex_wake_all(&c.counter);
        }
    }

    /// The descriptor of the operation `peer` has started beyond ours (its
    /// phase is ahead): `Ok(None)` when it has not; an error when it will
    /// never take part again or published garbage. Never blocks.
    pub fn peer_next(&self, peer: usize, op: &'static str) -> Result<Option<OpDesc>> {
        if let Some(e) = self.peer_gone(peer, op) {
            return Err(e);
        }
        let c = self.seg.ctl(peer);
        let v = c.counter.load(Ordering::Acquire);
        if (v.wrapping_sub(self.counter) as i32) <= 0 {
            return Ok(None);
        }
        // The peer wrote its descriptor for our next sequence number before
        // the phase we just saw.
        self.desc_of(peer, self.seq.wrapping_add(1)).map(Some)
    }

    /// Waits until every peer has reached our current phase.
    pub fn wait_all(&self, op: &'static str) -> Result<()> {
        self.wait_each(op, false)
    }

    /// Waits for every peer to reach our current phase; `arrival`: the first
    /// phase of an operation, where a peer may still be computing outside
    /// the library (a shorter spin on contended cores, see [`WaitPolicy`]).
    fn wait_each(&self, op: &'static str, arrival: bool) -> Result<()> {
        for peer in (0..self.size).filter(|&p| p != self.rank) {
            self.wait_peer_at(peer, self.counter, op, arrival)?;
        }
        Ok(())
    }

    /// One full phase: signal, then wait for everyone.
    pub fn sync(&mut self, op: &'static str) -> Result<()> {
        self.signal();
        self.wait_all(op)
    }

    /// Waits until `peer` has reached our current phase.
    pub fn wait_peer(&self, peer: usize, op: &'static str) -> Result<()> {
        self.wait_peer_at(peer, self.counter, op, false)
    }

    /// Waits until `peer` has started an operation beyond ours (its phase
    /// runs ahead), then returns that operation's descriptor.
    pub fn wait_next(&self, peer: usize, op: &'static str) -> Result<OpDesc> {
        self.wait_peer_at(peer, self.counter.wrapping_add(1), op, true)?;
        self.peer_next(peer, op)?.ok_or_else(|| Error::Mismatch {
            rank: self.rank,
            detail: format!("rank {peer} moved ahead without publishing an operation"),
        })
    }

    /// Waits until `peer`'s phase counter reaches `target`; `arrival`: the
    /// peer may not have entered the operation yet.
    fn wait_peer_at(
        &self,
        peer: usize,
        target: u32,
        op: &'static str,
        arrival: bool,
    ) -> Result<()> {
        let out = self.wait_phase(peer, target, op, arrival);
        self.last_wait.set(Instant::now());
        out
    }

    fn wait_phase(&self, peer: usize, target: u32, op: &'static str, arrival: bool) -> Result<()> {
        let c = self.seg.ctl(peer);
        let me = self.seg.ctl(self.rank);
        let reached = |v: u32| (v.wrapping_sub(target) as i32) >= 0;
        for _ in 0..self.policy.spins {
            if reached(c.counter.load(Ordering::Acquire)) {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let start = Instant::now();
        let mut cpu = sys::current_cpu();
        me.cpu.store(cpu, Ordering::Relaxed);
        // Keep the core while the peer is likely to answer (no system call,
        // the clock read every 64 turns): up to `long_spin_for` for a peer
        // inside the operation (it answers as soon as it has a CPU, and a
        // parked rank on a contended core may wait a whole slice to be run
        // again); for one that may still be outside, only `spin_for` when
        // other tasks want the CPUs. A peer last seen on this rank's CPU is
        // handed the core by a yield (spinning would hold the core it
        // needs). Stop early for a peer that is parked itself on contended
        // cores: it answers only once woken and given a CPU, which this
        // rank's core may be. Then, only if asked, yield.
        let p = &self.policy;
        // A first phase right after this rank's last wait (back-to-back
        // operations) is waited for as a phase inside an operation.
        let arrival = arrival && start.duration_since(self.last_wait.get()) > p.long_spin_for;
        let spun = loop {
            for _ in 0..64 {
                if reached(c.counter.load(Ordering::Acquire)) {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            let waited = start.elapsed();
            if waited >= p.spin_for.max(p.long_spin_for) {
                break waited;
            }
            if cpu != u32::MAX && c.cpu.load(Ordering::Relaxed) == cpu {
                // The peer shares this CPU: hand it the core at once (a
                // yield to a task on this CPU's run queue runs it now; a
                // futex park would cost two wake-ups and invite the
                // scheduler to keep both ranks on this CPU).
                sys::yield_now();
                cpu = sys::current_cpu();
                me.cpu.store(cpu, Ordering::Relaxed);
                continue;
            }
            let past_short = arrival && waited >= p.spin_for;
            let peer_parked = c.parked.load(Ordering::Relaxed) != 0;
            if (past_short || peer_parked) && crate::transport::cores_contended() {
                break waited;
            }
        };
        while start.elapsed() < spun + p.yield_for {
            if reached(c.counter.load(Ordering::Acquire)) {
                return Ok(());
            }
            sys::yield_now();
        }
        let mut w = Waiting::new(self.policy.timeout);
        w.since = start;
        loop {
            w.tick();
            c.sleepers.fetch_add(1, Ordering::SeqCst);
            let seen = c.counter.load(Ordering::SeqCst);
            if !reached(seen) {
                me.parked.store(1, Ordering::Relaxed);
                sys::futex_wait(&c.counter, seen, self.policy.park_slice);
                me.parked.store(0, Ordering::Relaxed);
            }
            c.sleepers.fetch_sub(1, Ordering::SeqCst);
            if reached(c.counter.load(Ordering::Acquire)) {
                return Ok(());
            }
            crate::fault::check_interrupt(self.rank)?;
            if self.wire.tripped() {
                return Err(self.wire.fault());
            }
            if let Some(e) = self.peer_gone(peer, op) {
                // This rank's own failure (armed before any peer heard of
                // it) comes first, even when a peer's reaction is seen first.
                return Err(if self.wire.tripped() {
                    self.wire.fault()
                } else {
                    self.answer_blame(e, peer, op, &w)
                });
            }
            let waited = start.elapsed();
            if waited >= self.policy.timeout {
                return Err(self.settle(peer, op, waited, w));
            }
        }
    }

    /// Why `peer` will not take part any more, if it will not: it gave up
    /// (its notice names the culprit), shut down, or its process is gone.
    fn peer_gone(&self, peer: usize, op: &'static str) -> Option<Error> {
        let c = self.seg.ctl(peer);
        let state = c.state.load(Ordering::Acquire);
        if state == STATE_ABORTED {
            return Some(self.notice_of(peer, op));
        }
        if state == STATE_LEFT {
            return Some(Error::lost(self.rank, peer, op, Cause::Left, ""));
        }
        if self.liveness[peer].is_some_and(sys::stream_closed) {
            // A rank publishes its notice before it closes its streams.
            if c.state.load(Ordering::Acquire) == STATE_ABORTED {
                return Some(self.notice_of(peer, op));
            }
            return Some(Error::lost(self.rank, peer, op, Cause::Exited, ""));
        }
        None
    }

    /// The error that `peer`'s abort notice describes.
    fn notice_of(&self, peer: usize, op: &'static str) -> Error {
        let (culprit, cause) = self.notice(peer);
        Error::from_notice(self.rank, peer, op, culprit, cause)
    }

    /// The culprit and cause `peer`'s abort notice names.
    fn notice(&self, peer: usize) -> (usize, Cause) {
        let c = self.seg.ctl(peer);
        let culprit = c.notice_culprit.load(Ordering::SeqCst) as usize;
        let cause =
            Cause::from_code(c.notice_cause.load(Ordering::SeqCst)).unwrap_or(Cause::Failed);
        (culprit, cause)
    }

    /// Decides whom to blame after `late` did not arrive in time: a peer
    /// that gives up meanwhile (the rank `late` itself waits for may time out
    /// a moment later and publish the real culprit) or is gone, else `late`.
    fn settle(&self, late: usize, op: &'static str, waited: Duration, mut w: Waiting) -> Error {
        let deadline = Instant::now() + grace(self.policy.timeout);
        loop {
            if self.wire.tripped() {
                return self.wire.fault();
            }
            w.tick();
            if let Some(e) = (0..self.size)
                .filter(|&p| p != self.rank)
                .find_map(|p| self.peer_gone(p, op))
            {
                return self.answer_blame(e, late, op, &w);
            }
            if Instant::now() >= deadline {
                return Error::timeout(self.rank, late, op, waited);
            }
            let _ = sys::poll(&mut [], Duration::from_millis(5));
        }
    }

    /// [`super::answer_blame`] for this rank.
    fn answer_blame(&self, e: Error, late: usize, op: &'static str, w: &Waiting) -> Error {
        super::answer_blame(e, self.rank, self.members[self.rank], late, op, w)
    }

    /// [`super::follow_blame`] over the control blocks.
    pub(crate) fn follow_blame(
        &self,
        e: Error,
        name: &str,
        call: &'static str,
        revised: impl FnMut(usize, (usize, Cause), Instant) -> Option<(usize, Cause)>,
    ) -> Error {
        let timeout = self.policy.timeout;
        super::follow_blame(
            e,
            self.rank,
            &self.members,
            timeout,
            name,
            call,
            |x, until| loop {
                if self.peer_gone(x, call).is_some() {
                    // gone with a notice (it gave up), or without one
                    let aborted = self.seg.ctl(x).state.load(Ordering::Acquire) == STATE_ABORTED;
                    return aborted.then(|| self.notice(x));
                }
                if Instant::now() >= until {
                    return None;
                }
                let _ = sys::poll(&mut [], Duration::from_millis(5));
            },
            revised,
        )
    }

    /// Explains a failed cross-memory transfer with `peer`: it gave up (and
    /// freed the buffer), or it died (its memory went first, its streams a
    /// moment later). Waits briefly for the evidence.
    fn cma_error(&self, peer: usize, op: &'static str, what: &str, e: std::io::Error) -> Error {
        let patience = self.policy.timeout.min(Duration::from_secs(2));
        let deadline = Instant::now() + patience;
        loop {
            if self.wire.tripped() {
                return self.wire.fault();
            }
            if let Some(e) = self.peer_gone(peer, op) {
                return e;
            }
            if e.raw_os_error() == Some(libc::ESRCH) {
                return Error::lost(self.rank, peer, op, Cause::Exited, "");
            }
            if Instant::now() >= deadline {
                return Error::lost(
                    self.rank,
                    peer,
                    op,
                    Cause::Failed,
                    format!("cross-memory {what} failed: {e}"),
                );
            }
            let _ = sys::poll(&mut [], Duration::from_millis(2));
        }
    }

    /// After an operation: fails if a peer gave up meanwhile, so that a rank
    /// resumed after being stopped never returns data its peers abandoned.
    pub fn check_peers(&self, op: &'static str) -> Result<()> {
        for peer in (0..self.size).filter(|&p| p != self.rank) {
            if self.seg.ctl(peer).state.load(Ordering::Acquire) == STATE_ABORTED {
                return Err(self.notice_of(peer, op));
            }
        }
        Ok(())
    }

    /// First phase of every operation: publish our descriptor, move to the
    /// next slot half, signal, wait for everyone, and check that all ranks run
    /// the same operation. Staged operations write their first piece (with
    /// `put`) *before* calling this, into the half that `next_half` returns.
    pub fn arrive(&mut self, desc: &OpDesc) -> Result<()> {
        let c = self.seg.ctl(self.rank);
        let parity = (desc.seq % 2) as usize;
        for (slot, w) in c.desc[parity].iter().zip(desc.encode()) {
            slot.store(w, Ordering::Relaxed);
        }
        let digest = desc.digest();
        c.digest[parity].store(digest, Ordering::Relaxed);
        c.cpu.store(sys::current_cpu(), Ordering::Relaxed);
        self.signal();
        self.wait_each(desc.kind.name(), true)?;
        self.seq = desc.seq;
        // The digests came with the counters (one cache line): the
        // descriptors themselves are read only to name who disagrees. This
        // saves a cache-line transfer per peer per operation (about 0.1 µs
        // of a 4-byte all-reduce's 1.8 on 2 ranks).
        let agreed = (0..self.size)
            .all(|r| self.seg.ctl(r).digest[parity].load(Ordering::Acquire) == digest);
        if agreed {
            return Ok(());
        }
        let all: Vec<OpDesc> = (0..self.size)
            .map(|r| self.peer_desc(r))
            .collect::<Result<_>>()?;
        check_agreement(self.rank, &all)
    }

    /// The descriptor `rank` published for the current operation.
    pub fn peer_desc(&self, rank: usize) -> Result<OpDesc> {
        self.desc_of(rank, self.seq)
    }

    /// The descriptor `rank` published for the operation numbered `seq`.
    fn desc_of(&self, rank: usize, seq: u64) -> Result<OpDesc> {
        let c = self.seg.ctl(rank);
        let mut w = [0u64; DESC_WORDS];
        for (x, slot) in w.iter_mut().zip(&c.desc[(seq % 2) as usize]) {
            *x = slot.load(Ordering::Acquire);
        }
        OpDesc::decode(&w).ok_or_else(|| Error::Mismatch {
            rank: self.rank,
            detail: format!("rank {rank} published an unreadable operation descriptor"),
        })
    }

    /// Moves to the other slot half; call before writing each new piece.
    pub fn next_half(&mut self) {
        self.half ^= 1;
        self.base = 0;
    }

    /// As [`next_half`](Self::next_half) for an operation `seq` that stages
    /// `bytes` (at most a half) in one piece: the piece goes to a window of
    /// the half that moves on with every use of that half, so the lines
    /// written now were last written, and read by the peers, a whole half
    /// of traffic ago. Rewriting the lines peers have just read is what a
    /// small shared-memory collective spends most on (each store must take
    /// the line back from the peers' caches, over half the time of a 64 KiB
    /// all-reduce by `perf`); with windows, 2 ranks took 12.7-12.9 -> 10.2-10.4
    /// µs at 64 KiB and 4.6-4.7 -> 4.0-4.1 µs at 16 KiB on the one-phase
    /// path. Every rank derives the window from the agreed `seq` and
    /// `bytes`, so no state can drift between ranks.
    pub fn next_window(&mut self, seq: u64, bytes: usize) {
        self.next_half();
        self.base = window_base(self.half_bytes(), seq, bytes);
    }

    /// The move before staging a piece of operation `seq`, which moves
    /// `count` pieces of at most `bytes`: a moving window when the whole
    /// operation is one piece, else the next half.
    pub fn next_piece(&mut self, seq: u64, count: usize, bytes: usize) {
        if count == 1 {
            self.next_window(seq, bytes);
        } else {
            self.next_half();
        }
    }

    /// Copies `src` into our slot (current half) at `off`.
    pub fn put(&self, off: usize, src: &[u8]) {
        self.seg.write(self.rank, self.half_off(off), src);
    }

    /// Copies from `peer`'s slot (current half) at `off` into `dst`.
    pub fn get(&self, peer: usize, off: usize, dst: &mut [u8]) {
        self.seg.read(peer, self.half_off(off), dst);
    }

    /// As [`get`](Self::get), with non-temporal stores when `stream` (the
    /// destination is a large buffer that will not be read back soon).
    pub fn get_out(&self, peer: usize, off: usize, dst: &mut [u8], stream: bool) {
        if stream {
            self.seg.read_streaming(peer, self.half_off(off), dst);
        } else {
            self.seg.read(peer, self.half_off(off), dst);
        }
    }

    /// `dst = slot_0 ⊕ slot_1 ⊕ ... ⊕ slot_{p-1}` over the range at `off`, in
    /// rank order (so every rank computing it gets identical bits).
    pub fn reduce_all_slots(
        &self,
        dtype: DType,
        op: ReduceOp,
        off: usize,
        dst: &mut [u8],
    ) -> Result<()> {
        let ranks: Vec<usize> = (0..self.size).collect();
        self.seg
            .with_slots(&ranks, self.half_off(off), dst.len(), |srcs| {
                reduce::reduce_into(dtype, op, dst, srcs)
            })
    }

    /// Our slot range at `off` = the reduction, in rank order, of every peer's
    /// same range and `local` (this rank's own contribution, which it never
    /// staged: nobody else reads it).
    pub fn reduce_own_part(
        &self,
        dtype: DType,
        op: ReduceOp,
        off: usize,
        local: &[u8],
    ) -> Result<()> {
        let peers: Vec<usize> = (0..self.size).filter(|&p| p != self.rank).collect();
        self.seg.with_own_and_slots(
            self.rank,
            &peers,
            self.half_off(off),
            local.len(),
            |own, views| {
                let mut srcs: Vec<&[u8]> = Vec::with_capacity(self.size);
                srcs.extend_from_slice(&views[..self.rank]);
                srcs.push(local);
                srcs.extend_from_slice(&views[self.rank..]);
                reduce::reduce_into(dtype, op, own, &srcs)
            },
        )
    }

    /// Copies `dst.len()` bytes at address `addr` in `peer`'s process into
    /// `dst` (cross-memory attach).
    pub fn read_peer(
        &self,
        peer: usize,
        addr: u64,
        dst: &mut [u8],
        op: &'static str,
    ) -> Result<()> {
        sys::read_peer_memory(self.pids[peer], addr, dst)
            .map_err(|e| self.cma_error(peer, op, "read", e))
    }

    /// Copies `src` to address `addr` in `peer`'s process (cross-memory
    /// attach).
    pub fn write_peer(&self, peer: usize, addr: u64, src: &[u8], op: &'static str) -> Result<()> {
        sys::write_peer_memory(self.pids[peer], addr, src)
            .map_err(|e| self.cma_error(peer, op, "write", e))
    }
}

/// Every rank contributes a flag; all learn whether all flags were true.
fn agree_all(
    rank: usize,
    size: usize,
    mesh: &TcpMesh,
    mine: bool,
    op: &'static str,
    t: std::time::Duration,
) -> Result<bool> {
    if rank == 0 {
        let mut votes = vec![[0u8; 1]; size];
        {
            let mut x: Vec<Xfer> = votes
                .iter_mut()
                .enumerate()
                .skip(1)
                .map(|(p, v)| Xfer::recv(p, v))
                .collect();
            mesh.transfer(&mut x, op, t)?;
        }
        let all = mine && votes.iter().skip(1).all(|v| v[0] == 1);
        let out = [all as u8];
        let mut x: Vec<Xfer> = (1..size).map(|p| Xfer::send(p, &out)).collect();
        mesh.transfer(&mut x, op, t)?;
        Ok(all)
    } else {
        let vote = [mine as u8];
        mesh.transfer(&mut [Xfer::send(0, &vote)], op, t)?;
        let mut out = [0u8; 1];
        mesh.transfer(&mut [Xfer::recv(0, &mut out)], op, t)?;
        Ok(out[0] == 1)
    }
}

#[cfg(test)]
mod window_tests {
    use super::window_base;

    #[test]
    fn windows_are_whole_pages_inside_the_half_and_move_on() {
        for half in [4096usize, 32 << 10, 512 << 10] {
            for bytes in [0, 1, 4095, 4096, 4097, 16 << 10, 64 << 10, 300 << 10, half] {
                if bytes > half {
                    continue;
                }
                let step = bytes.div_ceil(4096).max(1) * 4096;
                let windows = (half / step).max(1);
                let mut seen = std::collections::BTreeSet::new();
                for seq in 0..(4 * windows as u64 + 3) {
                    let base = window_base(half, seq, bytes);
                    assert_eq!(base % 4096, 0, "half={half} bytes={bytes} seq={seq}");
                    assert!(base + bytes <= half, "half={half} bytes={bytes} seq={seq}");
                    if seq % 2 == 0 {
                        seen.insert(base);
                    }
                    if windows > 1 {
                        // the same half's next use takes another window
                        assert_ne!(base, window_base(half, seq + 2, bytes));
                    }
                }
                assert_eq!(seen.len(), windows, "half={half} bytes={bytes}");
            }
        }
    }
}
