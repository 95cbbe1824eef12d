//! The hello that opens every connection: the magic of the protocol, the
//! job's token and the dialer's rank (the RPC agent's adds its pid), as
//! little-endian words. Both the collective mesh and the RPC agent
//! (`crate::rpc`) write and check hellos with these functions; each keeps
//! its own magic, so a connection to the wrong kind of listener is refused.

use super::*;

/// The collective mesh's magic: "RINGLET\x01".
pub(super) const HELLO_MAGIC: u64 = 0x5249_4e47_4c45_5401;
/// The RPC agent's magic: "RINGRPC\x01" (its hello adds the pid).
pub(crate) const RPC_MAGIC: u64 = 0x5249_4e47_5250_4301;

/// Longest an incoming connection may take to send its hello.
pub(super) const HELLO_PATIENCE: Duration = Duration::from_secs(2);
/// A mesh hello: magic, token, rank.
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
        match parse_hello(&self.buf, HELLO_MAGIC) {
            Some((token, peer)) => HelloState::Done { token, peer },
            None => HelloState::Rejected,
        }
    }
}

/// Little-endian word `i` of a hello (0 past its end).
fn word(buf: &[u8], i: usize) -> u64 {
    buf.get(i * 8..i * 8 + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

/// The token and the sender's rank of a whole hello (its first three words),
/// or `None` when it does not start with `magic` or the rank is impossible.
pub(crate) fn parse_hello(buf: &[u8], magic: u64) -> Option<(u64, usize)> {
    if buf.len() < HELLO_BYTES || word(buf, 0) != magic {
        return None;
    }
    Some((word(buf, 1), usize::try_from(word(buf, 2)).ok()?))
}

/// The bytes of a hello: `magic`, `token`, `rank`, then `extra`, as
/// little-endian words.
pub(crate) fn hello_bytes(magic: u64, token: u64, rank: usize, extra: &[u64]) -> Vec<u8> {
    let mut hello = Vec::with_capacity(HELLO_BYTES + 8 * extra.len());
    for w in [magic, token, rank as u64].iter().chain(extra) {
        hello.extend_from_slice(&w.to_le_bytes());
    }
    hello
}

/// Sends the hello that identifies this rank on a new mesh connection.
pub(super) fn say_hello(s: &TcpStream, token: u64, rank: usize) -> std::io::Result<()> {
    let mut s = s;
    s.write_all(&hello_bytes(HELLO_MAGIC, token, rank, &[]))
}

/// Reads a whole hello of three words and `E` more from a blocking stream:
/// the token, the rank and the extra words, or `None` when the stream ends
/// or fails first or the hello is not `magic`'s.
pub(crate) fn read_hello<const E: usize>(
    s: &mut TcpStream,
    magic: u64,
) -> Option<(u64, usize, [u64; E])> {
    let mut buf = vec![0u8; HELLO_BYTES + 8 * E];
    s.read_exact(&mut buf).ok()?;
    let (token, rank) = parse_hello(&buf, magic)?;
    Some((token, rank, std::array::from_fn(|i| word(&buf, 3 + i))))
}
