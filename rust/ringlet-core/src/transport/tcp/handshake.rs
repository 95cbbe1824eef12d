//! The hello that opens every connection: the magic of the protocol, the
//! job's token and the dialer's rank (the RPC agent's adds its pid), as
//! little-endian words. Both the collective mesh and the RPC agent
//! (`crate::rpc`) write and check hellos with these functions; each keeps
//! its own magic, so a connection to the wrong kind of listener is refused.

use super::*;

pub(super) const HELLO_MAGIC: u64 = 0x5249_4e47_4c45_5401; // "RINGLET\x01"

/// Longest an incoming connection may take to send its hello.
pub(super) const HELLO_PATIENCE: Duration = Duration::from_secs(2);
pub(super) const HELLO_BYTES: usize = 24;

/// An accepted connection whose hello (magic, job token, rank) is being read.
pub(super) struct Hello {
    pub(super) stream: TcpStream,
    pub(super) buf: [u8; HELLO_BYTES],
    pub(super) got: usize,
    pub(super) since: Instant,
}

pub(super) enum HelloState {
    Waiting,
    Rejected,
    /// A whole hello: the group's token and the dialer's rank in it.
    Done {
        token: u64,
        peer: usize,
    },
}

impl Hello {
    pub(super) fn new(stream: TcpStream) -> Self {
        Hello {
            stream,
            buf: [0; HELLO_BYTES],
            got: 0,
            since: Instant::now(),
        }
    }

    /// Reads what arrived; decides once the hello is complete. Garbage, a
    /// short hello followed by the end of the stream and silence past
    /// `HELLO_PATIENCE` are rejected (the connection is then closed); a whole
    /// hello names the group (its token) and the dialer's rank, which the
    /// group's mesh checks when it takes the stream (a wrong token never
    /// reaches a mesh; an impossible or duplicate rank is closed there). What
    /// follows a good hello is the peer's first message: the group's token
    /// is what authenticates a peer.
    pub(super) fn progress(&mut self) -> HelloState {
        while self.got < HELLO_BYTES {
            match (&self.stream).read(&mut self.buf[self.got..]) {
                Ok(0) => return HelloState::Rejected,
                Ok(n) => self.got += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    return if self.since.elapsed() > HELLO_PATIENCE {
                        HelloState::Rejected
                    } else {
                        HelloState::Waiting
                    };
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return HelloState::Rejected,
            }
        }
        let word =
            |i: usize| u64::from_le_bytes(self.buf[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
        let (magic, tok) = (word(0), word(1));
        let Ok(peer) = usize::try_from(word(2)) else {
            return HelloState::Rejected;
        };
        if magic != HELLO_MAGIC {
            return HelloState::Rejected;
        }
        HelloState::Done { token: tok, peer }
    }
}

/// Sends the hello that identifies this rank on a new connection.
pub(super) fn say_hello(s: &TcpStream, token: u64, rank: usize) -> std::io::Result<()> {
    let mut hello = Vec::with_capacity(HELLO_BYTES);
    for w in [HELLO_MAGIC, token, rank as u64] {
        hello.extend_from_slice(&w.to_le_bytes());
    }
    let mut s = s;
    s.write_all(&hello)
}
