//! The transfer loop: any mix of sends and receives driven to completion
//! with one `poll` loop, and the errors of a peer lost on the way.

use super::*;
/// Longest a blocked transfer sleeps before checking the tripwire again.
pub(super) const POLL_SLICE: Duration = Duration::from_millis(20);
pub(super) const HANGUP: libc::c_short = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
/// How long a rank waits on a peer that has not connected yet before it
/// checks that the peer still listens (and then again as often).
pub(super) const PROBE_AFTER: Duration = Duration::from_secs(1);

/// One pending data movement with a peer.
pub enum Xfer<'a> {
    Send {
        peer: usize,
        buf: &'a [u8],
        done: usize,
    },
    Recv {
        peer: usize,
        buf: &'a mut [u8],
        done: usize,
    },
}

impl<'a> Xfer<'a> {
    /// A send of `buf` to `peer`.
    pub fn send(peer: usize, buf: &'a [u8]) -> Self {
        Xfer::Send { peer, buf, done: 0 }
    }

    /// A receive from `peer` that fills `buf`.
    pub fn recv(peer: usize, buf: &'a mut [u8]) -> Self {
        Xfer::Recv { peer, buf, done: 0 }
    }

    /// A send of `buf` to `peer` whose first `done` bytes went out already
    /// (an earlier transfer stopped before it finished).
    pub fn send_from(peer: usize, buf: &'a [u8], done: usize) -> Self {
        Xfer::Send {
            peer,
            buf,
            done: done.min(buf.len()),
        }
    }

    /// Bytes to move in all.
    pub fn len(&self) -> usize {
        match self {
            Xfer::Send { buf, .. } => buf.len(),
            Xfer::Recv { buf, .. } => buf.len(),
        }
    }

    /// True for a transfer of nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes moved so far.
    pub fn done(&self) -> usize {
        match self {
            Xfer::Send { done, .. } | Xfer::Recv { done, .. } => *done,
        }
    }

    /// Same peer and same direction: the two share a byte stream, so the
    /// later one must wait until the earlier one finished.
    pub(super) fn same_stream(&self, other: &Xfer<'_>) -> bool {
        self.peer() == other.peer()
            && matches!(
                (self, other),
                (Xfer::Send { .. }, Xfer::Send { .. }) | (Xfer::Recv { .. }, Xfer::Recv { .. })
            )
    }

    pub(super) fn peer(&self) -> usize {
        match self {
            Xfer::Send { peer, .. } | Xfer::Recv { peer, .. } => *peer,
        }
    }

    /// The bytes a receive has filled so far (empty for a send).
    pub fn received(&self) -> &[u8] {
        match self {
            Xfer::Recv { buf, done, .. } => &buf[..*done],
            Xfer::Send { .. } => &[],
        }
    }

    pub(super) fn finished(&self) -> bool {
        match self {
            Xfer::Send { buf, done, .. } => *done == buf.len(),
            Xfer::Recv { buf, done, .. } => *done == buf.len(),
        }
    }
}

impl TcpMesh {
    /// The peers with a stream, and a pollfd watching each for a hang-up
    /// (same order).
    pub(super) fn hangup_pollfds(&self) -> (Vec<usize>, Vec<libc::pollfd>) {
        (0..self.size())
            .filter(|&p| p != self.rank)
            .filter_map(|p| {
                self.fd(p).map(|fd| {
                    let watch = libc::pollfd {
                        fd,
                        events: libc::POLLRDHUP,
                        revents: 0,
                    };
                    (p, watch)
                })
            })
            .unzip()
    }

    /// Raw fd of the stream to `peer` (for liveness checks).
    pub fn fd(&self, peer: usize) -> Option<RawFd> {
        self.streams.get(peer)?.get().map(|s| s.as_raw_fd())
    }

    pub(super) fn stream(&self, peer: usize) -> Result<&TcpStream> {
        self.streams.get(peer).and_then(|s| s.get()).ok_or_else(|| {
            Error::InvalidArgument(format!("rank {}: no stream to rank {peer}", self.rank))
        })
    }

    /// Runs every transfer to completion. Fails with `Timeout` when no byte
    /// moves for `timeout`, and with `PeerLost` when a peer closes its stream.
    pub fn transfer(
        &self,
        xfers: &mut [Xfer<'_>],
        op: &'static str,
        timeout: Duration,
    ) -> Result<()> {
        self.transfer_with(xfers, op, timeout, |_| Ok(()))
    }

    /// `transfer`, calling `after(xfers)` whenever bytes moved (and once at
    /// the end), so the caller can work on data as it arrives (a ring step
    /// reduces the received prefix while the rest is still in flight).
    pub fn transfer_with(
        &self,
        xfers: &mut [Xfer<'_>],
        op: &'static str,
        timeout: Duration,
        after: impl FnMut(&[Xfer<'_>]) -> Result<()>,
    ) -> Result<()> {
        self.drive(xfers, op, timeout, after, |x| x.iter().all(Xfer::finished))
    }

    /// Moves the transfers until `until(xfers)` holds; the others keep what
    /// they moved (`Xfer::done`), so a later call can go on with them. Used
    /// to let the next piece's send start while this piece's data arrives.
    pub fn transfer_until(
        &self,
        xfers: &mut [Xfer<'_>],
        op: &'static str,
        timeout: Duration,
        until: impl Fn(&[Xfer<'_>]) -> bool,
    ) -> Result<()> {
        self.drive(xfers, op, timeout, |_| Ok(()), until)
    }

    /// The loop behind `transfer_with` and `transfer_until`. Transfers on
    /// the same stream (peer and direction) go in list order.
    pub(super) fn drive(
        &self,
        xfers: &mut [Xfer<'_>],
        op: &'static str,
        timeout: Duration,
        mut after: impl FnMut(&[Xfer<'_>]) -> Result<()>,
        until: impl Fn(&[Xfer<'_>]) -> bool,
    ) -> Result<()> {
        self.dial_lower(xfers, op, timeout)?;
        let eligible = |xfers: &[Xfer<'_>], i: usize| {
            !xfers[i].finished()
                && self.connected(xfers[i].peer())
                && !xfers[..i]
                    .iter()
                    .any(|y| !y.finished() && y.same_stream(&xfers[i]))
        };
        // a peer that has not connected yet (it is higher: it dials)
        let unconnected = |xfers: &[Xfer<'_>]| {
            xfers
                .iter()
                .find(|x| !x.finished() && !self.connected(x.peer()))
                .map(Xfer::peer)
        };
        let mut last_probe = Instant::now();
        let mut w = Waiting::new(timeout);
        w.stalled = self.stopped_since_last_turn();
        let late = |xfers: &[Xfer<'_>]| {
            xfers
                .iter()
                .find(|x| !x.finished())
                .map_or(self.rank, Xfer::peer)
        };
        loop {
            if self.wire.tripped() {
                return Err(self.wire.fault());
            }
            w.tick();
            self.last_turn.set(Some((Instant::now(), w.grace)));
            if w.stalled {
                self.stalled.set(true);
            }
            let mut progressed = false;
            if self.lazy.is_some() && unconnected(xfers).is_some() {
                progressed |= self.accept_higher(timeout)?;
            }
            for i in 0..xfers.len() {
                if !eligible(xfers, i) {
                    continue;
                }
                match self.progress(&mut xfers[i], op) {
                    Ok(moved) => progressed |= moved,
                    Err(e) => return Err(self.answer_blame(e, late(xfers), op, &w)),
                }
            }
            if progressed {
                after(xfers)?;
            }
            if until(xfers) {
                return Ok(());
            }
            if progressed {
                w.progressed();
            } else if w.since.elapsed() >= timeout {
                return Err(self.settle(late(xfers), op, timeout, w));
            }
            if !progressed {
                let waiting_for = unconnected(xfers);
                if let Some(peer) = waiting_for {
                    // one that died before it connected refuses the probe
                    if w.since.elapsed() >= PROBE_AFTER && last_probe.elapsed() >= PROBE_AFTER {
                        last_probe = Instant::now();
                        self.probe(peer, op)?;
                    }
                }
                let pending: Vec<&Xfer> = (0..xfers.len())
                    .filter(|&i| eligible(xfers, i))
                    .map(|i| &xfers[i])
                    .collect();
                let mut fds: Vec<libc::pollfd> = Vec::with_capacity(pending.len() + 1);
                for x in &pending {
                    let events = match x {
                        Xfer::Send { .. } => libc::POLLOUT,
                        Xfer::Recv { .. } => libc::POLLIN,
                    };
                    fds.push(libc::pollfd {
                        fd: self.stream(x.peer())?.as_raw_fd(),
                        events: events | libc::POLLRDHUP,
                        revents: 0,
                    });
                }
                let watched = fds.len();
                if waiting_for.is_some() {
                    fds.extend(self.accept_pollfds());
                }
                let left = timeout.saturating_sub(w.since.elapsed());
                sys::poll(&mut fds, left.min(POLL_SLICE))?;
                if fds.iter().all(|p| p.revents == 0) {
                    crate::fault::check_interrupt(self.rank)?;
                }
                fds.truncate(watched);
                // A peer we only send to hung up: it gave up or died. (A
                // pending receive finds out by reading to the end.)
                for (x, p) in pending.iter().zip(&fds) {
                    let peer = x.peer();
                    let receiving = pending
                        .iter()
                        .any(|y| matches!(y, Xfer::Recv { .. }) && y.peer() == peer);
                    if p.revents & HANGUP != 0 && !receiving {
                        let e = self.drain_error(peer, op);
                        return Err(self.answer_blame(e, late(xfers), op, &w));
                    }
                }
            }
        }
    }

    /// Remembers the last bytes received from `peer`.
    pub(super) fn note_tail(&self, peer: usize, got: &[u8]) {
        let mut t = self.tails[peer].get();
        if got.len() >= NOTICE_BYTES {
            t.copy_from_slice(&got[got.len() - NOTICE_BYTES..]);
        } else {
            t.copy_within(got.len().., 0);
            t[NOTICE_BYTES - got.len()..].copy_from_slice(got);
        }
        self.tails[peer].set(t);
    }

    /// The error for `peer`'s stream having ended: its notice names the
    /// culprit; without one, its process is gone.
    pub(super) fn closed_error(&self, peer: usize, op: &'static str) -> Error {
        if self.wire.tripped() {
            // This rank's own failure comes first: the peer may only be
            // reacting to it.
            return self.wire.fault();
        }
        match decode_notice(&self.tails[peer].get()) {
            Some((culprit, cause)) => Error::from_notice(self.rank, peer, op, culprit, cause),
            None => Error::lost(
                self.rank,
                peer,
                op,
                Cause::Exited,
                "its connection closed without notice",
            ),
        }
    }

    /// Reads what is left of `peer`'s stream (we are failing anyway) up to
    /// its end, then explains the end.
    pub(super) fn drain_error(&self, peer: usize, op: &'static str) -> Error {
        if self.fd(peer).is_none() {
            return Error::lost(self.rank, peer, op, Cause::Exited, "");
        }
        match self.read_to_end(peer, Instant::now() + Duration::from_millis(500)) {
            Ok(_) => self.closed_error(peer, op),
            Err(e) => self.io_lost(peer, op, e),
        }
    }

    /// The error for a failed write to `peer`: the network, or the peer
    /// closed (what it sent last, still queued for us, may explain why).
    pub(super) fn send_failed(&self, peer: usize, op: &'static str, e: std::io::Error) -> Error {
        match self.io_lost(peer, op, e) {
            e @ Error::PeerLost {
                cause: Cause::Unreachable,
                ..
            } => e,
            _ => self.drain_error(peer, op),
        }
    }

    /// The error for a failed read or write on `peer`'s stream.
    pub(super) fn io_lost(&self, peer: usize, op: &'static str, e: std::io::Error) -> Error {
        let unreachable = matches!(
            e.raw_os_error(),
            Some(libc::ETIMEDOUT | libc::EHOSTUNREACH | libc::ENETUNREACH | libc::ENETDOWN)
        );
        if unreachable {
            return Error::lost(self.rank, peer, op, Cause::Unreachable, e.to_string());
        }
        if decode_notice(&self.tails[peer].get()).is_some() {
            return self.closed_error(peer, op);
        }
        Error::lost(self.rank, peer, op, Cause::Exited, e.to_string())
    }

    /// Decides whom to blame after `late` moved no byte within the timeout:
    /// a peer that gives up meanwhile (the rank `late` itself waits for may
    /// time out a moment later and send the real culprit), else `late`,
    /// unreachable when data sent to it goes unacknowledged.
    pub(super) fn settle(
        &self,
        late: usize,
        op: &'static str,
        waited: Duration,
        mut w: Waiting,
    ) -> Error {
        let deadline = Instant::now() + grace(waited);
        loop {
            if self.wire.tripped() {
                return self.wire.fault();
            }
            w.tick();
            let (peers, mut fds) = self.hangup_pollfds();
            let left = deadline.saturating_duration_since(Instant::now());
            if sys::poll(&mut fds, left.min(POLL_SLICE)).is_err() {
                break;
            }
            if let Some(i) = fds.iter().position(|p| p.revents & HANGUP != 0) {
                let e = self.drain_error(peers[i], op);
                return self.answer_blame(e, late, op, &w);
            }
            if left.is_zero() {
                break;
            }
        }
        match self.fd(late) {
            Some(fd) if sys::tcp_retransmitting(fd) => Error::lost(
                self.rank,
                late,
                op,
                Cause::Unreachable,
                format!(
                    "data sent to it was not acknowledged for {:.1} s",
                    waited.as_secs_f64()
                ),
            ),
            _ => Error::timeout(self.rank, late, op, waited),
        }
    }

    /// Moves as many bytes as the socket takes now; true if any moved.
    pub(super) fn progress(&self, x: &mut Xfer<'_>, op: &'static str) -> Result<bool> {
        let mut moved = false;
        match x {
            Xfer::Send { peer, buf, done } => {
                let mut s = self.stream(*peer)?;
                while *done < buf.len() {
                    match s.write(&buf[*done..]) {
                        Ok(0) => return Err(self.io_lost(*peer, op, ErrorKind::WriteZero.into())),
                        Ok(n) => {
                            *done += n;
                            moved = true;
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) => return Err(self.send_failed(*peer, op, e)),
                    }
                }
            }
            Xfer::Recv { peer, buf, done } => {
                let mut s = self.stream(*peer)?;
                while *done < buf.len() {
                    match s.read(&mut buf[*done..]) {
                        Ok(0) => return Err(self.closed_error(*peer, op)),
                        Ok(n) => {
                            self.note_tail(*peer, &buf[*done..*done + n]);
                            *done += n;
                            moved = true;
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) => return Err(self.io_lost(*peer, op, e)),
                    }
                }
            }
        }
        Ok(moved)
    }
}
