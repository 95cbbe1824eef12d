//! Wire format of RPC messages. A frame is a fixed 48-byte header, the
//! caller's opaque payload (the pickled call structure), one 24-byte
//! descriptor per tensor, then the bytes of every *inline* tensor back to
//! back. A tensor whose bytes stay in the sender's memory (same host, large)
//! is described by `(pid, address, length)` and fetched by the receiver with
//! one cross-memory copy; the receiver acknowledges it (an `Ack` frame) so the
//! sender can release the memory.
//!
//! Every header carries a check word, and every length is bounded and
//! cross-checked before anything is allocated: a malformed or truncated frame
//! is an error on that connection, never a crash or a huge allocation.

use crate::error::{Error, Result};

/// Size of the fixed header.
pub const HEADER_BYTES: usize = 48;
/// Size of one tensor descriptor.
pub const DESC_BYTES: usize = 24;
const MAGIC: u32 = 0x5250_4331; // "RPC1"
/// Largest payload (pickled structure) accepted: 16 GiB.
pub const MAX_PAYLOAD: u64 = 1 << 34;
/// Most tensors in one message.
pub const MAX_TENSORS: u32 = 1 << 16;
/// Largest total of inline tensor bytes in one message: 1 TiB.
pub const MAX_INLINE: u64 = 1 << 40;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A call: run something and answer with the same id.
    Request = 1,
    /// The answer to the request with the same id.
    Response = 2,
    /// The receiver of a message with same-host tensors has copied them.
    Ack = 3,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        match v {
            1 => Some(Kind::Request),
            2 => Some(Kind::Response),
            3 => Some(Kind::Ack),
            _ => None,
        }
    }
}

/// The fixed part of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    /// Response: outcome code (see `rpc::status`); Ack: the kind of the
    /// acknowledged message.
    pub status: u8,
    pub id: u64,
    pub payload_len: u64,
    pub ntensors: u32,
    pub inline_total: u64,
}

fn check_word(h: &Header) -> u64 {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for w in [
        h.kind as u64,
        h.status as u64,
        h.id,
        h.payload_len,
        h.ntensors as u64,
        h.inline_total,
    ] {
        x = (x ^ w).wrapping_mul(0x100_0000_01b3).rotate_left(29);
    }
    x
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

impl Header {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.status;
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.payload_len.to_le_bytes());
        b[24..28].copy_from_slice(&self.ntensors.to_le_bytes());
        b[32..40].copy_from_slice(&self.inline_total.to_le_bytes());
        b[40..48].copy_from_slice(&check_word(self).to_le_bytes());
        b
    }

    /// Parses and validates a header.
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Header> {
        let bad = |what: &str| Error::Rpc(format!("malformed RPC message: {what}"));
        if u32_at(b, 0) != MAGIC {
            return Err(bad("bad magic number"));
        }
        let kind = Kind::from_u8(b[4]).ok_or_else(|| bad("unknown message kind"))?;
        let h = Header {
            kind,
            status: b[5],
            id: u64_at(b, 8),
            payload_len: u64_at(b, 16),
            ntensors: u32_at(b, 24),
            inline_total: u64_at(b, 32),
        };
        if b[6] != 0 || b[7] != 0 || u32_at(b, 28) != 0 || u64_at(b, 40) != check_word(&h) {
            return Err(bad("header check failed"));
        }
        if h.payload_len > MAX_PAYLOAD {
            return Err(bad("payload too large"));
        }
        if h.ntensors > MAX_TENSORS {
            return Err(bad("too many tensors"));
        }
        if h.inline_total > MAX_INLINE {
            return Err(bad("tensor data too large"));
        }
        if kind == Kind::Ack && (h.payload_len != 0 || h.ntensors != 0) {
            return Err(bad("acknowledgement with a body"));
        }
        Ok(h)
    }
}

/// Where a tensor's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// In the frame, after the descriptors.
    Inline,
    /// In the sender's memory at `addr` (process `pid`, same host).
    Remote { pid: u32, addr: u64 },
}

/// One tensor's descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    pub len: u64,
    pub place: Place,
}

impl Desc {
    /// The descriptor's bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (mode, pid, addr) = match self.place {
            Place::Inline => (0u8, 0u32, 0u64),
            Place::Remote { pid, addr } => (1u8, pid, addr),
        };
        out.push(mode);
        out.extend_from_slice(&[0, 0, 0]);
        out.extend_from_slice(&pid.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&addr.to_le_bytes());
    }

    /// Parses every descriptor of a frame and checks that the inline lengths
    /// add up to the header's total.
    pub fn decode_all(b: &[u8], h: &Header) -> Result<Vec<Desc>> {
        let bad = |what: &str| Error::Rpc(format!("malformed RPC message: {what}"));
        if b.len() != h.ntensors as usize * DESC_BYTES {
            return Err(bad("descriptor block has the wrong size"));
        }
        let mut out = Vec::with_capacity(h.ntensors as usize);
        let mut inline = 0u64;
        for d in b.chunks_exact(DESC_BYTES) {
            if d[1..4] != [0, 0, 0] {
                return Err(bad("descriptor padding"));
            }
            let len = u64_at(d, 8);
            let place = match d[0] {
                0 => {
                    inline = inline
                        .checked_add(len)
                        .ok_or_else(|| bad("tensor sizes overflow"))?;
                    Place::Inline
                }
                1 => Place::Remote {
                    pid: u32_at(d, 4),
                    addr: u64_at(d, 16),
                },
                _ => return Err(bad("unknown tensor placement")),
            };
            out.push(Desc { len, place });
        }
        if inline != h.inline_total {
            return Err(bad("inline tensor sizes do not add up"));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            kind: Kind::Request,
            status: 0,
            id: 42,
            payload_len: 10,
            ntensors: 2,
            inline_total: 8,
        }
    }

    #[test]
    fn round_trip() {
        let h = header();
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let mut b = Vec::new();
        Desc {
            len: 8,
            place: Place::Inline,
        }
        .encode(&mut b);
        Desc {
            len: 1 << 20,
            place: Place::Remote { pid: 7, addr: 4096 },
        }
        .encode(&mut b);
        let d = Desc::decode_all(&b, &h).map_err(|e| e.to_string());
        assert_eq!(d.map(|v| v.len()), Ok(2));
    }

    #[test]
    fn every_flipped_byte_is_rejected() {
        let good = header().encode();
        for i in 0..HEADER_BYTES {
            let mut b = good;
            b[i] ^= 0x5a;
            assert!(Header::decode(&b).is_err(), "byte {i} flip accepted");
        }
    }

    #[test]
    fn inline_total_must_match() {
        let h = header();
        let mut b = Vec::new();
        Desc {
            len: 3,
            place: Place::Inline,
        }
        .encode(&mut b);
        Desc {
            len: 3,
            place: Place::Inline,
        }
        .encode(&mut b);
        assert!(Desc::decode_all(&b, &h).is_err());
        assert!(Desc::decode_all(&b[..DESC_BYTES], &h).is_err());
    }
}
