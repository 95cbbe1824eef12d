//! Transports move bytes between ranks. Two exist, each in its own folder:
//!
//! * `tcp/`: one stream per peer pair (full mesh), non-blocking, driven by a
//!   `poll` loop that progresses any number of sends and receives at once.
//! * `shm/`: one shared segment per host group. Ranks publish data in their own
//!   slot (or just its address, for cross-memory attach) and read peers' data
//!   directly; synchronisation is a per-rank phase counter (spin, then futex).
//!
//! Both share the operation descriptor that lets ranks detect disagreement
//! about a collective before any data moves.

pub mod shm;
pub mod tcp;

use crate::dtype::{DType, ReduceOp};
use crate::error::{Cause, Error};
use std::time::{Duration, Instant};

coded_enum! {
    /// Which collective an operation is; part of the cross-rank agreement check.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum OpKind: u64 {
        AllReduce = 1 => "all_reduce",
        AllGather = 2 => "all_gather",
        ReduceScatter = 3 => "reduce_scatter",
        Broadcast = 4 => "broadcast",
        Barrier = 5 => "barrier",
        AllToAll = 6 => "all_to_all",
        SendRecv = 7 => "send/recv",
    }
    /// Name used in error messages.
    fn name;
}

/// What a rank is about to do. Every rank publishes its descriptor; all must
/// agree on every field but `addr` (the buffer address, used by cross-memory
/// attach).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpDesc {
    pub seq: u64,
    pub kind: OpKind,
    pub dtype: DType,
    pub op: Option<ReduceOp>,
    pub count: u64,
    pub root: u64,
    pub addr: u64,
}

/// Number of u64 words in an encoded descriptor.
pub const DESC_WORDS: usize = 7;

impl OpDesc {
    /// Encodes into fixed-size words (for shared memory and the wire).
    pub fn encode(&self) -> [u64; DESC_WORDS] {
        [
            self.seq,
            self.kind as u64,
            self.dtype as u64,
            self.op.map_or(u64::MAX, |o| o as u64),
            self.count,
            self.root,
            self.addr,
        ]
    }

    /// Decodes words written by `encode`; `None` for garbage.
    pub fn decode(w: &[u64; DESC_WORDS]) -> Option<OpDesc> {
        Some(OpDesc {
            seq: w[0],
            kind: OpKind::from_code(w[1])?,
            dtype: DType::from_code(u32::try_from(w[2]).ok()?)?,
            op: if w[3] == u64::MAX {
                None
            } else {
                Some(ReduceOp::from_code(u32::try_from(w[3]).ok()?)?)
            },
            count: w[4],
            root: w[5],
            addr: w[6],
        })
    }

    /// Human-readable form for mismatch errors.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{}(#{}, count={}, dtype={}",
            self.kind.name(),
            self.seq,
            self.count,
            self.dtype.name()
        );
        if let Some(op) = self.op {
            s += &format!(", op={}", op.name());
        }
        if self.kind == OpKind::Broadcast {
            s += &format!(", root={}", self.root);
        }
        if self.kind == OpKind::SendRecv {
            // `root` packs the sender's rank (low bit) and the tag.
            s += &format!(", from rank {}, tag={}", self.root & 1, self.root >> 1);
        }
        s + ")"
    }

    /// True when `other` describes the same collective call.
    pub fn agrees_with(&self, other: &OpDesc) -> bool {
        OpDesc { addr: 0, ..*self } == OpDesc { addr: 0, ..*other }
    }

    /// A 64-bit digest of what [`agrees_with`](Self::agrees_with) compares
    /// (every field but `addr`): equal descriptors have equal digests, and
    /// different ones collide with probability about 2^-64.
    pub fn digest(&self) -> u64 {
        let w = OpDesc { addr: 0, ..*self }.encode();
        w.iter().fold(0x243f_6a88_85a3_08d3u64, |h, &x| {
            let v = (h ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            v ^ (v >> 29)
        })
    }
}

/// Compares every rank's descriptor with ours; the message names each rank
/// that disagrees. All ranks see the same descriptors, so all raise together.
pub fn check_agreement(rank: usize, all: &[OpDesc]) -> crate::Result<()> {
    let reference = &all[0];
    let odd: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, d)| !d.agrees_with(reference))
        .map(|(r, d)| format!("rank {r} called {}", d.describe()))
        .collect();
    if odd.is_empty() {
        return Ok(());
    }
    Err(crate::Error::Mismatch {
        rank,
        detail: format!(
            "rank 0 called {} but {}",
            reference.describe(),
            odd.join(", ")
        ),
    })
}

/// How long a waiting rank spins by default, on contended cores, for a peer
/// that may not have entered the operation yet (see [`WaitPolicy::spin_for`]).
pub const DEFAULT_SPIN_FOR: Duration = Duration::from_micros(50);

/// How long a waiting rank spins by default for a peer inside the operation
/// (see [`WaitPolicy::long_spin_for`]).
pub const DEFAULT_LONG_SPIN_FOR: Duration = Duration::from_millis(2);

/// How a waiting rank behaves: spin while the peer is likely to answer
/// within a few microseconds, then park on a futex that the writer wakes,
/// with a deadline. `timeout` is the longest wait without progress before
/// failing.
///
/// A waiting rank never calls `sched_yield` unless `yield_for` asks for it:
/// on a core that another process wants (a neighbour's job, data-loader
/// workers, the caller's own compute threads), a yield hands that process
/// the core for the rest of its scheduler slice (milliseconds under CFS and
/// EEVDF alike), while a spinning rank keeps its core until the peer answers
/// and a parked one frees it for whoever the scheduler picks and is woken by
/// the writer the moment the data is there.
#[derive(Clone, Copy, Debug)]
pub struct WaitPolicy {
    pub timeout: Duration,
    /// Spin iterations before the clock is read (the answer of a peer
    /// running on another core arrives within them).
    pub spins: u32,
    /// A wait for a peer that may still be outside the operation (its first
    /// phase) spins this long in all when other tasks want the CPUs: the
    /// peer may be computing for a long time, and a spinning rank keeps a
    /// core from them.
    pub spin_for: Duration,
    /// Every other wait spins up to this long: a peer inside the operation
    /// answers as soon as it has a CPU, and a rank that parks on a contended
    /// core may wait a whole scheduler slice to run again once woken.
    /// The first phase spins as long while no other task wants a CPU.
    pub long_spin_for: Duration,
    /// After spinning, yield the CPU for up to this long before parking
    /// (zero by default; see the type's documentation).
    pub yield_for: Duration,
    pub park_slice: Duration,
}

impl WaitPolicy {
    /// A policy with the given timeout and default spin/yield budgets.
    pub fn with_timeout(timeout: Duration) -> Self {
        WaitPolicy {
            timeout,
            spins: 2000,
            spin_for: DEFAULT_SPIN_FOR,
            long_spin_for: DEFAULT_LONG_SPIN_FOR,
            yield_for: Duration::ZERO,
            park_slice: Duration::from_millis(5),
        }
    }

    /// Deadline for a wait that starts now.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }
}

/// Whether the machine has more runnable tasks than this process has CPUs
/// (busy neighbours, data-loader workers, more ranks than cores): a peer
/// that is off its CPU then waits for one, and a rank spinning for it
/// keeps a core the peer could have. Read at most once a millisecond per
/// thread (a read of `/proc/loadavg` costs a few microseconds).
pub(crate) fn cores_contended() -> bool {
    use std::cell::Cell;
    thread_local! {
        static LAST: Cell<Option<(Instant, bool)>> = const { Cell::new(None) };
    }
    LAST.with(|last| {
        let now = Instant::now();
        if let Some((at, contended)) = last.get() {
            if now.duration_since(at) < Duration::from_millis(1) {
                return contended;
            }
        }
        let contended = crate::sys::runnable_tasks().is_some_and(|n| n > crate::sys::cpus());
        last.set(Some((now, contended)));
        contended
    })
}

// -- Whom to blame for a timeout ----------------------------------------------
//
// A rank that waits for a peer longer than the timeout blames it, but the
// peer may itself be waiting for a third rank: the rank that stopped is at
// the end of a chain of waits, and only the ranks next to it see it
// directly. Three rules make every rank name the end of the chain:
// 1. a rank that times out first waits a grace for a notice (a peer that
//    gives up meanwhile names the culprit it found);
// 2. a rank blamed by a peer's notice while it has itself been waiting,
//    running, for at least the grace, answers at once with its own verdict
//    (`answer_blame`); a rank that was stopped meanwhile takes the blame
//    for a timeout whoever the notice names;
// 3. a rank that blamed a peer then waits up to a grace for that peer's
//    notice and adopts the rank it names, along the chain (`follow_blame`),
//    except a notice naming this rank when this rank timed out itself,
//    running, and one pointing back into the chain: both relay a verdict
//    that a rank stopped unawares read from another's notice.

/// How long a rank that timed out waits for a notice before it blames the
/// peer it waited for, and then for the blamed rank's answer.
pub(crate) fn grace(timeout: Duration) -> Duration {
    (timeout / 2).min(Duration::from_secs(2))
}

/// How long a blocked wait has gone without progress, and whether this
/// process was stopped meanwhile (two turns of the wait further apart than
/// the grace: SIGSTOP, a debugger, a suspended machine).
pub(crate) struct Waiting {
    pub(crate) since: Instant,
    last_turn: Instant,
    stalled: bool,
    grace: Duration,
}

impl Waiting {
    pub(crate) fn new(timeout: Duration) -> Waiting {
        let now = Instant::now();
        Waiting {
            since: now,
            last_turn: now,
            stalled: false,
            grace: grace(timeout),
        }
    }

    /// One turn of the wait.
    pub(crate) fn tick(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_turn) >= self.grace {
            self.stalled = true;
        }
        self.last_turn = now;
    }

    /// Progress: the wait starts again.
    pub(crate) fn progressed(&mut self) {
        self.since = Instant::now();
        self.stalled = false;
    }
}

/// Rule 2: `e` came from a peer's notice. When it blames this rank (group
/// rank `rank`, global `me`) for a timeout while this rank has been waiting
/// for `late`, running all along, for at least the grace, the peer waited
/// for this rank while this rank waited for `late`: the answer is this
/// rank's own verdict. A rank that was stopped meanwhile, or that arrives
/// late, keeps the blame; and a rank that was stopped meanwhile takes it
/// when the first notice it reads names another rank for a timeout: that
/// rank timed out waiting, directly or through others, on this one (the
/// notice that named this rank may sit on a stream this rank reads later).
pub(crate) fn answer_blame(
    e: Error,
    rank: usize,
    me: usize,
    late: usize,
    op: &'static str,
    w: &Waiting,
) -> Error {
    let (blamed_me, via) = match e {
        Error::Timeout {
            peer, via: Some(v), ..
        } => (peer == me, Some(v)),
        _ => (false, None),
    };
    let waited = w.since.elapsed();
    match via {
        Some(v) if w.stalled && !blamed_me => Error::from_notice(rank, v, op, me, Cause::TimedOut),
        Some(_) if blamed_me && !w.stalled && waited >= w.grace && late != rank => {
            Error::timeout(rank, late, op, waited)
        }
        _ => e,
    }
}

/// [`answer_blame`] after an operation that completed: `e` came from a
/// peer's notice read once the operation was done, and `stalled` tells
/// whether this process was stopped during it. A stopped rank takes the
/// blame for a timeout the notice puts on another rank: its peers timed
/// out waiting, directly or through others, on it.
pub(crate) fn answer_blame_after(
    e: Error,
    rank: usize,
    me: usize,
    op: &'static str,
    stalled: bool,
) -> Error {
    match e {
        Error::Timeout {
            peer, via: Some(v), ..
        } if stalled && peer != me => Error::from_notice(rank, v, op, me, Cause::TimedOut),
        e => e,
    }
}

/// Rule 3: after this rank blamed a rank for a timeout (`e`, global ranks)
/// and told its peers, waits up to the grace for the blamed rank's own
/// notice (`await_notice(group rank, deadline)`) and, when it names another
/// rank that timed out, follows on to that one. When the blamed rank does
/// not answer here (no stream to it: a rank on another host of a two-level
/// collective, reached through the host level) and its name came from a
/// peer's notice, that peer may trace it further back and revise its notice
/// on a board this rank reads (`revised(global rank of the reporter, what it
/// said, deadline)`, `None` at once where nothing can change): until a
/// little over a grace from the start (the reporter's own follow-up began
/// before this rank read its notice and takes a grace at most) this rank
/// adopts the revision.
#[allow(clippy::too_many_arguments)]
pub(crate) fn follow_blame(
    mut e: Error,
    rank: usize,
    members: &[usize],
    timeout: Duration,
    name: &str,
    call: &'static str,
    mut await_notice: impl FnMut(usize, Instant) -> Option<(usize, Cause)>,
    mut revised: impl FnMut(usize, (usize, Cause), Instant) -> Option<(usize, Cause)>,
) -> Error {
    let me = members.get(rank).copied().unwrap_or(rank);
    // this rank timed out waiting itself, running all along (a rank that
    // was stopped meanwhile reads its peers' notices first): the chain
    // cannot end here, whatever a notice relayed by another says
    let first_hand = matches!(e, Error::Timeout { via: None, .. });
    let start = Instant::now();
    let deadline = start + grace(timeout);
    let until = deadline + grace(timeout) / 4;
    let mut seen = vec![me];
    while let Some((culprit, Cause::TimedOut)) = e.origin(me) {
        if seen.contains(&culprit) {
            break;
        }
        seen.push(culprit);
        let answer = members
            .iter()
            .position(|&g| g == culprit)
            .and_then(|x| Some((x, await_notice(x, deadline)?)))
            .or_else(|| {
                let Error::Timeout { via: Some(v), .. } = e else {
                    return None;
                };
                let x = members.iter().position(|&g| g == v)?;
                Some((x, revised(v, (culprit, Cause::TimedOut), until)?))
            });
        match answer {
            // a notice that points back into the chain (not at this rank)
            // relays a verdict already on it: the rank that sent it only
            // read a notice meanwhile, as a rank that was stopped does,
            // and the chain ends at the rank reached last
            Some((_, (next, _))) if next != me && seen.contains(&next) => break,
            Some((_, (next, _))) if next == me && first_hand => break,
            Some((x, (next, cause))) if next != culprit => {
                // the chain may end at this rank: it was stopped before
                // its collective began, and reads first the notice of a
                // rank that waited on the one that waited on it
                e = Error::from_notice(rank, x, call, next, cause).globalize(members, name, call);
            }
            _ => break,
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::tests::words;

    /// The rank a timeout names and the rank whose notice said so.
    fn blamed(e: Error) -> (usize, Option<usize>) {
        match e {
            Error::Timeout { peer, via, .. } => (peer, via),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_chain_of_blame_may_end_at_this_rank() {
        // global rank 2 of [0, 1, 2, 3] read rank 0's notice naming rank 3;
        // rank 3's notice names rank 2, whose wait rank 3 timed out on
        let members = [0, 1, 2, 3];
        let timeout = Duration::from_secs(2);
        let e = Error::from_notice(2, 0, "all_reduce", 3, Cause::TimedOut);
        let mut asked = vec![];
        let end = follow_blame(
            e,
            2,
            &members,
            timeout,
            "the world",
            "all_reduce",
            |x, _| {
                asked.push(x);
                Some((2, Cause::TimedOut))
            },
            |_, _, _| None,
        );
        assert_eq!(asked, [3]);
        assert_eq!(blamed(end), (2, Some(3)));
        // a chain through other ranks is followed to its end
        let e = Error::timeout(0, 1, "all_reduce", timeout).globalize(&members, "w", "all_reduce");
        let end = follow_blame(
            e,
            0,
            &members,
            timeout,
            "w",
            "all_reduce",
            |x, _| (x == 1).then_some((2, Cause::TimedOut)),
            |_, _, _| None,
        );
        assert_eq!(blamed(end), (2, Some(1)));
    }

    #[test]
    fn a_stopped_rank_takes_the_blame_for_a_timeout() {
        // group rank 2 (global 2) reads rank 0's notice naming rank 3
        let notice = || Error::from_notice(2, 0, "all_reduce", 3, Cause::TimedOut);
        let mut w = Waiting::new(Duration::from_secs(2));
        // running all along: the notice stands
        assert_eq!(
            blamed(answer_blame(notice(), 2, 2, 1, "all_reduce", &w)),
            (3, Some(0))
        );
        // stopped meanwhile (a turn of the wait further apart than the grace)
        w.last_turn -= Duration::from_secs(3);
        w.tick();
        assert_eq!(
            blamed(answer_blame(notice(), 2, 2, 1, "all_reduce", &w)),
            (2, Some(0))
        );
        // a rank that exited is still named as such
        let lost = Error::from_notice(2, 0, "all_reduce", 3, Cause::Exited);
        assert!(matches!(
            answer_blame(lost, 2, 2, 1, "all_reduce", &w),
            Error::PeerLost { peer: 3, .. }
        ));
    }

    #[test]
    fn a_rank_stopped_during_a_finished_operation_takes_the_blame() {
        let notice = || Error::from_notice(2, 0, "all_reduce", 3, Cause::TimedOut);
        assert_eq!(
            blamed(answer_blame_after(notice(), 2, 2, "all_reduce", false)),
            (3, Some(0))
        );
        assert_eq!(
            blamed(answer_blame_after(notice(), 2, 2, "all_reduce", true)),
            (2, Some(0))
        );
        let lost = Error::from_notice(2, 0, "all_reduce", 3, Cause::Exited);
        assert!(matches!(
            answer_blame_after(lost, 2, 2, "all_reduce", true),
            Error::PeerLost { peer: 3, .. }
        ));
    }

    #[test]
    fn a_rank_that_timed_out_itself_is_not_the_end_of_the_chain() {
        // global rank 3 waited on rank 2, running, and blamed it; rank 2,
        // stopped unawares, relayed a notice naming 3: rank 3 keeps 2
        let members = [0, 1, 2, 3];
        let e = Error::timeout(3, 2, "all_reduce", Duration::from_secs(2));
        let end = follow_blame(
            e,
            3,
            &members,
            Duration::from_secs(2),
            "w",
            "all_reduce",
            |_, _| Some((3, Cause::TimedOut)),
            |_, _, _| None,
        );
        assert_eq!(blamed(end), (2, None));
    }

    #[test]
    fn a_notice_pointing_back_into_the_chain_ends_it() {
        // global rank 1 blamed rank 3 (it waited on 3); rank 3's notice
        // names rank 2 (3 waited on 2); rank 2, stopped, relayed a notice
        // naming 3 once it resumed: the chain ends at 2, not back at 3
        let members = [0, 1, 2, 3];
        let e = Error::timeout(1, 3, "all_reduce", Duration::from_secs(2));
        let mut asked = vec![];
        let end = follow_blame(
            e,
            1,
            &members,
            Duration::from_secs(2),
            "w",
            "all_reduce",
            |x, _| {
                asked.push(x);
                Some((if x == 3 { 2 } else { 3 }, Cause::TimedOut))
            },
            |_, _, _| None,
        );
        assert_eq!(asked, [3, 2]);
        assert_eq!(blamed(end), (2, Some(3)));
    }

    #[test]
    fn a_culprit_beyond_this_communicator_is_traced_through_the_reporter() {
        // two hosts {0, 1} and {2, 3}: global rank 0 (local group [0, 1])
        // read local rank 1's notice naming rank 3, on the other host; rank 1
        // then traced it to rank 2 and revised its notice: rank 0 follows
        let members = [0, 1];
        let timeout = Duration::from_secs(2);
        let e = Error::from_notice(0, 1, "all_reduce", 3, Cause::TimedOut).globalize(
            &members,
            "host",
            "all_reduce",
        );
        let mut asked = vec![];
        let end = follow_blame(
            e.clone(),
            0,
            &members,
            timeout,
            "host",
            "all_reduce",
            |_, _| None,
            |v, said, _| {
                asked.push((v, said.0));
                (said.0 == 3).then_some((2, Cause::TimedOut))
            },
        );
        assert_eq!(asked, [(1, 3), (1, 2)]);
        assert_eq!(blamed(end), (2, Some(1)));
        // no revision within the wait: the reported culprit stands
        let end = follow_blame(
            e,
            0,
            &members,
            timeout,
            "host",
            "all_reduce",
            |_, _| None,
            |_, _, _| None,
        );
        assert_eq!(blamed(end), (3, Some(1)));
    }

    #[test]
    fn random_descriptors_decode_or_are_refused_never_panic() {
        let mut next = words(14);
        let mut decoded = 0;
        for i in 0..200_000u64 {
            let mut w = [0u64; DESC_WORDS];
            for x in w.iter_mut() {
                // mix small values in so that some descriptors are valid
                *x = if i % 3 == 0 { next() % 16 } else { next() };
            }
            if let Some(d) = OpDesc::decode(&w) {
                decoded += 1;
                let _ = d.describe();
                assert_eq!(OpDesc::decode(&d.encode()), Some(d));
            }
        }
        assert!(decoded > 0);
    }

    #[test]
    fn digests_follow_agreement() {
        let base = OpDesc {
            seq: 9,
            kind: OpKind::AllReduce,
            dtype: DType::F32,
            op: Some(ReduceOp::Sum),
            count: 1024,
            root: 0,
            addr: 0x1000,
        };
        // the address is each rank's own: it never makes a disagreement
        assert_eq!(
            base.digest(),
            OpDesc {
                addr: 0x2000,
                ..base
            }
            .digest()
        );
        let others = [
            OpDesc { seq: 10, ..base },
            OpDesc {
                kind: OpKind::Broadcast,
                ..base
            },
            OpDesc {
                dtype: DType::BF16,
                ..base
            },
            OpDesc {
                op: Some(ReduceOp::Max),
                ..base
            },
            OpDesc { op: None, ..base },
            OpDesc {
                count: 1025,
                ..base
            },
            OpDesc { root: 1, ..base },
        ];
        for d in others {
            assert!(!d.agrees_with(&base));
            assert_ne!(d.digest(), base.digest(), "{d:?}");
        }
    }
}
