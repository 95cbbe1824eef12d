//! The agreement check (every rank runs the same collective with the same
//! arguments): a full exchange of descriptors on small meshes, else the
//! digest bounds through a recursive-doubling all-reduce.

use super::*;

/// Largest mesh whose agreement check is a full exchange of descriptors:
/// there it sends no more messages than the digest all-reduce (p - 1 <=
/// ⌈log2 p⌉), and on two ranks a peer's next descriptor is the first thing
/// in its stream (`peek_desc` reads a pending message's from there).
pub(super) const FULL_EXCHANGE_UP_TO: usize = 3;

/// One step of a recursive-doubling all-reduce, as this rank sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Send this rank's value to the peer and receive the peer's.
    Swap(usize),
    /// Only send (a rank folded into its partner, or the result handed back).
    Give(usize),
    /// Only receive.
    Take(usize),
}

/// The steps of rank `me` in a recursive-doubling all-reduce over `p`
/// ranks, the same pairing as the small TCP all-reduce's: with `q` the
/// largest power of two not above `p`, the first `2(p - q)` ranks pair up
/// (even with odd) and the even one folds its value into the odd one
/// (`Give`, then `Take` of the result at the end); the `q` remaining
/// participants swap with the participant whose index differs in bit k, for
/// each k. The peers are rank xor 2^k when p is a power of two: ⌈log2 p⌉ or
/// so distinct streams, whatever the collective that needs them.
pub(crate) fn doubling_peers(p: usize, me: usize) -> Vec<Step> {
    if p < 2 {
        return Vec::new();
    }
    let q = 1usize << (usize::BITS - 1 - p.leading_zeros());
    let extra = p - q;
    let holder = |i: usize| if i < extra { 2 * i + 1 } else { i + extra };
    let mut steps = Vec::new();
    if me < 2 * extra {
        if me.is_multiple_of(2) {
            return vec![Step::Give(me + 1), Step::Take(me + 1)];
        }
        steps.push(Step::Take(me - 1));
    }
    let i = if me < 2 * extra { me / 2 } else { me - extra };
    let mut mask = 1;
    while mask < q {
        steps.push(Step::Swap(holder(i ^ mask)));
        mask <<= 1;
    }
    if me < 2 * extra {
        steps.push(Step::Give(me - 1));
    }
    steps
}

impl Step {
    pub(crate) fn peer(&self) -> usize {
        match *self {
            Step::Swap(p) | Step::Give(p) | Step::Take(p) => p,
        }
    }
}

pub(super) fn encode_bounds((lo, hi): (u64, u64)) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&lo.to_le_bytes());
    b[8..].copy_from_slice(&hi.to_le_bytes());
    b
}

pub(super) fn decode_bounds(b: &[u8; 16]) -> (u64, u64) {
    let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
    (word(0), word(8))
}

impl TcpMesh {
    /// The descriptor `peer` has sent for an operation this rank has not
    /// joined yet, read without consuming it: `Ok(None)` while fewer bytes
    /// than a descriptor wait; an error when the stream is closed or the
    /// bytes are not a descriptor. Never blocks.
    pub fn peek_desc(&self, peer: usize, op: &'static str) -> Result<Option<OpDesc>> {
        let fd = self.stream(peer)?.as_raw_fd();
        let mut b = [0u8; DESC_WORDS * 8];
        let n = match crate::sys::peek_now(fd, &mut b) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(Error::io("peeking at a peer's message", e)),
        };
        if n == 0 {
            return Err(Error::lost(
                self.rank,
                peer,
                op,
                crate::error::Cause::Exited,
                "",
            ));
        }
        if n < b.len() {
            return Ok(None);
        }
        self.decode_desc(peer, &b).map(Some)
    }

    /// The descriptor `peer` sent as `bytes` (`DESC_WORDS` little-endian words).
    pub(super) fn decode_desc(&self, peer: usize, bytes: &[u8]) -> Result<OpDesc> {
        let mut w = [0u64; DESC_WORDS];
        for (x, c) in w.iter_mut().zip(bytes.chunks_exact(8)) {
            *x = u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
        }
        OpDesc::decode(&w).ok_or_else(|| Error::Mismatch {
            rank: self.rank,
            detail: format!("rank {peer} sent an unreadable operation descriptor"),
        })
    }

    /// Waits (up to `timeout` without a byte) until `peer` has sent the
    /// descriptor of an operation this rank has not joined yet, and returns
    /// it without consuming it.
    pub fn wait_desc(&self, peer: usize, op: &'static str, timeout: Duration) -> Result<OpDesc> {
        let fd = self.stream(peer)?.as_raw_fd();
        let start = Instant::now();
        loop {
            if let Some(d) = self.peek_desc(peer, op)? {
                return Ok(d);
            }
            if self.wire.tripped() {
                return Err(self.wire.fault());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::timeout(self.rank, peer, op, waited));
            }
            let mut p = [libc::pollfd {
                fd,
                events: libc::POLLIN | libc::POLLRDHUP,
                revents: 0,
            }];
            // A slice at a time, so an abort of this rank is seen promptly;
            // part of a descriptor already waiting makes poll return at once.
            crate::sys::poll(&mut p, (timeout - waited).min(Duration::from_millis(5)))?;
            if p[0].revents & libc::POLLIN != 0 && self.peek_desc(peer, op)?.is_none() {
                std::thread::yield_now(); // the rest of the descriptor is on its way
            }
        }
    }

    /// Agreement check: every rank learns whether all ranks called the same
    /// collective, and all fail together, with the same message, when they
    /// did not. It is also a barrier: no rank returns before every rank has
    /// entered it.
    ///
    /// Up to `FULL_EXCHANGE_UP_TO` ranks, every rank sends its descriptor to
    /// every other rank. Above that, the ranks first all-reduce the (min,
    /// max) of their descriptors' digests by recursive doubling (see
    /// [`doubling_peers`]): log2 p rounds of one 16-byte message each when p
    /// is a power of two, at most ⌈log2 p⌉ + 1 otherwise, exchanged with the
    /// same ⌈log2 p⌉ or so peers as the small all-reduce's, so an agreeing
    /// collective opens no stream its data would not. Equal bounds: all
    /// agree. Otherwise every rank knows it, and all exchange their full
    /// descriptors as above, to name the ranks that disagree.
    pub fn agree(&self, desc: &OpDesc, timeout: Duration) -> Result<()> {
        if self.size() > FULL_EXCHANGE_UP_TO {
            let (lo, hi) = self.digest_bounds(desc, timeout)?;
            if lo == hi {
                return Ok(());
            }
        }
        self.exchange_descs(desc, timeout)
    }

    /// The least and greatest digest of every rank's descriptor, the same
    /// on every rank: a recursive-doubling all-reduce of the pair (min and
    /// max are exact and commutative, so every rank ends with the same
    /// bounds whatever the order).
    pub(super) fn digest_bounds(&self, desc: &OpDesc, timeout: Duration) -> Result<(u64, u64)> {
        let what = desc.kind.name();
        let mut bounds = (desc.digest(), desc.digest());
        let steps = doubling_peers(self.size(), self.rank);
        // Every lower partner is dialed before the first step (a dial never
        // waits): a rank stuck in an early step, waiting for a rank that
        // does not come, still has streams to its later partners, so they
        // read its notice when it fails and follow the blame to that rank
        // instead of naming it.
        self.dial_peers(steps.iter().map(|s| s.peer()), what, timeout)?;
        for (i, step) in steps.into_iter().enumerate() {
            let mine = encode_bounds(bounds);
            let mut theirs = [0u8; 16];
            let done = match step {
                Step::Swap(peer) => self.transfer(
                    &mut [Xfer::send(peer, &mine), Xfer::recv(peer, &mut theirs)],
                    what,
                    timeout,
                ),
                Step::Give(peer) => self.transfer(&mut [Xfer::send(peer, &mine)], what, timeout),
                Step::Take(peer) => {
                    self.transfer(&mut [Xfer::recv(peer, &mut theirs)], what, timeout)
                }
            };
            if let Err(e) = done {
                return Err(self.chained(e, i, step.peer(), what, timeout));
            }
            let got = !matches!(step, Step::Give(_));
            if !matches!(step, Step::Take(_)) {
                self.agree_sent.set(self.agree_sent.get() + 1);
            }
            if got {
                let (lo, hi) = decode_bounds(&theirs);
                bounds = (bounds.0.min(lo), bounds.1.max(hi));
            }
        }
        Ok(bounds)
    }

    /// The error of an agreement step that failed. Past the first step, a
    /// partner that never sent may be waiting itself, in an earlier step,
    /// for a rank that does not come (its own partners then time out a
    /// little before this rank does): this rank's own timeout waits up to
    /// one more grace for the partner's notice and, when it names another
    /// rank, reports that one, as the partner's peers do, so that the
    /// verdict this rank tells its own peers is the end of the chain.
    /// Meanwhile ranks that waited on this one (past the agreement, for its
    /// data) may give up and blame it: such a notice is answered at once
    /// with this rank's own verdict (rule 2), so that they learn of it
    /// within their own wait for this rank's answer; a notice naming
    /// another rank is taken as it is.
    pub(super) fn chained(
        &self,
        e: Error,
        step: usize,
        peer: usize,
        what: &'static str,
        timeout: Duration,
    ) -> Error {
        let first_hand = matches!(&e, Error::Timeout { via: None, .. });
        if step == 0 || !first_hand || self.wire.tripped() || !self.connected(peer) {
            return e;
        }
        let me = self.global(self.rank);
        let deadline = Instant::now() + grace(timeout);
        let mut w = Waiting::new(timeout);
        // it waited `timeout` already (an Instant that early may not exist
        // on a machine up for less than that: then it counts from now)
        w.since = Instant::now().checked_sub(timeout).unwrap_or(w.since);
        w.stalled = self.stalled.get();
        loop {
            let slice = (Instant::now() + Duration::from_millis(5)).min(deadline);
            match self.read_to_end(peer, slice) {
                Ok(false) => {}
                Ok(true) | Err(_) => {
                    return match decode_notice(&self.tails[peer].get()) {
                        Some((culprit, cause)) if culprit != me => {
                            Error::from_notice(self.rank, peer, what, culprit, cause)
                        }
                        _ => e,
                    };
                }
            }
            let (peers, mut fds) = self.hangup_pollfds();
            if sys::poll(&mut fds, Duration::ZERO).is_ok() {
                let gave_up = fds
                    .iter()
                    .zip(&peers)
                    .find(|(p, &q)| q != peer && p.revents & HANGUP != 0);
                if let Some((_, &q)) = gave_up {
                    let theirs = self.drain_error(q, what);
                    return self.answer_blame(theirs, peer, what, &w);
                }
            }
            if Instant::now() >= deadline {
                return e;
            }
        }
    }

    /// Every rank sends its descriptor to every other rank, so all ranks see
    /// all descriptors and fail together on a mismatch.
    pub(super) fn exchange_descs(&self, desc: &OpDesc, timeout: Duration) -> Result<()> {
        let mine: Vec<u8> = desc.encode().iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut theirs = vec![vec![0u8; DESC_WORDS * 8]; self.size()];
        {
            let mut x: Vec<Xfer> = Vec::with_capacity(2 * self.size());
            for (peer, buf) in theirs
                .iter_mut()
                .enumerate()
                .filter(|(p, _)| *p != self.rank)
            {
                x.push(Xfer::send(peer, &mine));
                x.push(Xfer::recv(peer, buf));
            }
            self.transfer(&mut x, desc.kind.name(), timeout)?;
        }
        let sent = self.size().saturating_sub(1) as u64;
        self.agree_sent.set(self.agree_sent.get() + sent);
        let mut all = Vec::with_capacity(self.size());
        for (peer, buf) in theirs.iter().enumerate() {
            if peer == self.rank {
                all.push(*desc);
                continue;
            }
            all.push(self.decode_desc(peer, buf)?);
        }
        check_agreement(self.rank, &all)
    }

    /// Messages this rank has sent in agreement checks so far (a count for
    /// tests and benchmarks).
    pub fn agree_messages(&self) -> u64 {
        self.agree_sent.get()
    }
}
