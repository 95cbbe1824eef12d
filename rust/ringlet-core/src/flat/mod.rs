//! The single-level ("flat") collectives, one file each: every collective
//! is a `pub(crate)` method on [`Communicator`] named `<collective>_flat`,
//! with one algorithm per transport:
//!
//! * shared memory: staged through slots in pipeline pieces, or single-copy
//!   through cross-memory attach for large messages;
//! * TCP: rings (reduce-scatter, all-gather) and direct exchanges.
//!
//! Every collective starts with an agreement phase in which all ranks compare
//! their operation descriptors, so ranks that disagree get an error, never
//! corrupted data.
//!
//! The arguments come checked: by the public entry points in `collective`
//! (which run a communicator with levels through `hierarchy` instead), or by
//! the two-level collectives, which call these on their host level with
//! buffers they sized themselves. This module knows neither of them.
//!
//! [`Communicator`]: crate::group::Communicator

mod all_gather;
pub(crate) mod all_reduce;
pub(crate) mod all_to_all;
pub(crate) mod broadcast;
pub(crate) mod reduce_scatter;

use crate::dtype::DType;
use crate::error::Result;
use std::ops::Range;

/// Bytes per piece when reading a peer's memory directly: small enough that
/// the pieces stay in cache while they are reduced.
pub(crate) const CMA_PIECE: usize = 128 << 10;

/// Messages up to this many bytes take the TCP direct-exchange path.
pub(crate) const TCP_SMALL: usize = 64 << 10;

/// The order of the ranks around a TCP ring. For a power-of-two size it is
/// the reflected Gray code: position i holds rank `i ^ (i >> 1)`, so
/// neighbours on the ring (the last and the first included) differ in one
/// bit and are among each rank's recursive-doubling partners (rank xor
/// 2^k), whose streams the agreement check and the small all-reduce open
/// anyway: a group's collectives then hold ⌈log2 p⌉ streams per rank, not
/// ⌈log2 p⌉ + 1. Other sizes keep the ranks in order.
pub(crate) struct RingOrder {
    p: usize,
    gray: bool,
    /// This rank's position.
    pub(crate) pos: usize,
}

impl RingOrder {
    pub(crate) fn new(p: usize, rank: usize) -> Self {
        let gray = p.is_power_of_two();
        let pos = if gray {
            // the inverse of the Gray code: the prefix xor of the bits
            let mut b = rank;
            let mut shift = 1;
            while rank >> shift != 0 {
                b ^= rank >> shift;
                shift += 1;
            }
            b
        } else {
            rank
        };
        RingOrder { p, gray, pos }
    }

    /// The rank at position `i` (mod p).
    pub(crate) fn rank_at(&self, i: usize) -> usize {
        let i = i % self.p;
        if self.gray {
            i ^ (i >> 1)
        } else {
            i
        }
    }

    /// The rank this one sends to.
    pub(crate) fn next(&self) -> usize {
        self.rank_at(self.pos + 1)
    }

    /// The rank this one receives from.
    pub(crate) fn prev(&self) -> usize {
        self.rank_at(self.pos + self.p - 1)
    }
}

/// The element range of part `i` when `count` elements are split into `parts`
/// contiguous parts as evenly as possible (the first `count % parts` parts get
/// one element more).
pub(crate) fn part(count: usize, parts: usize, i: usize) -> Range<usize> {
    let base = count / parts;
    let extra = count % parts;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// `part` in bytes.
pub(crate) fn part_bytes(count: usize, parts: usize, i: usize, esz: usize) -> Range<usize> {
    let r = part(count, parts, i);
    r.start * esz..r.end * esz
}

/// Whether a collective that copies `out_bytes` into the caller's buffer
/// writes them with non-temporal stores (see [`crate::sys::copy_streaming`]):
/// from 16 MiB, half the last-level cache here, the output would not stay
/// cached anyway. Measured with all_gather and broadcast on 2 ranks (16-256
/// MiB: 5-20% faster; below 16 MiB slower, as the output is still cached
/// when the caller reads it). Not used where the engine reads the buffer
/// just before writing it (the staged all_reduce): its lines are already
/// cached, and streaming them out made a 256 MiB all_reduce 1.5x slower.
pub(crate) fn streams(out_bytes: usize) -> bool {
    out_bytes >= 16 << 20
}

/// Consecutive pieces of at most `max` bytes (a multiple of `esz`) covering
/// `0..len`; one empty piece when `len == 0`, so every operation runs at least
/// its agreement phase.
pub(crate) fn pieces(len: usize, max: usize, esz: usize) -> Vec<Range<usize>> {
    let max = (max / esz).max(1) * esz;
    if len == 0 {
        return std::iter::once(0..0).collect();
    }
    (0..len)
        .step_by(max)
        .map(|s| s..(s + max).min(len))
        .collect()
}

/// A shared view of `a` and a mutable view of `b` in one buffer (`a` and `b`
/// must not overlap).
pub(crate) fn split_ref_mut(
    buf: &mut [u8],
    a: Range<usize>,
    b: Range<usize>,
) -> (&[u8], &mut [u8]) {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// A zeroed scratch buffer aligned for any element type.
pub(crate) fn scratch(bytes: usize) -> Vec<u64> {
    vec![0u64; bytes.div_ceil(8)]
}

thread_local! {
    /// Buffers handed back by `Reused` on this thread, for the next call.
    static POOL: std::cell::RefCell<Vec<Vec<u64>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A scratch buffer of at least `bytes` bytes, aligned for any element type,
/// taken from a per-thread pool and returned to it on drop, so hot paths do
/// not pay for fresh (page-faulting) memory on every call. Its contents are
/// unspecified: callers overwrite what they read.
pub(crate) struct Reused {
    words: Vec<u64>,
    bytes: usize,
}

impl Reused {
    pub(crate) fn new(bytes: usize) -> Self {
        let need = bytes.div_ceil(8);
        let mut words = POOL
            .with(|p| {
                let mut p = p.borrow_mut();
                let i = p.iter().position(|v| v.len() >= need)?;
                Some(p.swap_remove(i))
            })
            .unwrap_or_default();
        if words.len() < need {
            words = vec![0u64; need];
        }
        Reused { words, bytes }
    }

    pub(crate) fn bytes(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.bytes]
    }
}

impl Drop for Reused {
    fn drop(&mut self) {
        let words = std::mem::take(&mut self.words);
        POOL.with(|p| {
            let mut p = p.borrow_mut();
            if p.len() < 4 {
                p.push(words);
            }
        });
    }
}

/// Runs `f` on a float32 copy of a half-precision buffer and writes the result
/// back rounded, so partial results travel and accumulate in float32.
pub(crate) fn via_f32(
    dtype: DType,
    buf: &mut [u8],
    f: impl FnOnce(&mut [u8]) -> Result<()>,
) -> Result<()> {
    let mut wide = vec![0f32; buf.len() / dtype.size()];
    crate::reduce::widen_half(dtype, buf, &mut wide)?;
    f(bytemuck::cast_slice_mut(&mut wide))?;
    crate::reduce::narrow_half(dtype, &wide, buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gray_ring_visits_every_rank_and_its_neighbours_differ_in_one_bit() {
        for p in 2..=64usize {
            let seen: std::collections::BTreeSet<usize> =
                (0..p).map(|i| RingOrder::new(p, 0).rank_at(i)).collect();
            assert_eq!(seen.len(), p, "p={p}");
            for r in 0..p {
                let o = RingOrder::new(p, r);
                assert_eq!(o.rank_at(o.pos), r, "p={p} rank {r}");
                assert_eq!(RingOrder::new(p, o.next()).prev(), r, "p={p} rank {r}");
                if p.is_power_of_two() {
                    assert_eq!((o.next() ^ r).count_ones(), 1, "p={p} rank {r}");
                } else {
                    assert_eq!(o.next(), (r + 1) % p, "p={p} rank {r}");
                }
            }
        }
    }

    #[test]
    fn parts_cover_evenly() {
        let r: Vec<_> = (0..3).map(|i| part(7, 3, i)).collect();
        assert_eq!(r, vec![0..3, 3..5, 5..7]);
        let r: Vec<_> = (0..4).map(|i| part(2, 4, i)).collect();
        assert_eq!(r, vec![0..1, 1..2, 2..2, 2..2]);
    }

    #[test]
    fn pieces_cover() {
        assert_eq!(pieces(0, 8, 4), vec![0..0]);
        assert_eq!(pieces(20, 8, 4), vec![0..8, 8..16, 16..20]);
        assert_eq!(pieces(6, 5, 2), vec![0..4, 4..6]);
    }

    #[test]
    fn split_views() {
        let mut b = [0u8, 1, 2, 3, 4, 5];
        let (a, m) = split_ref_mut(&mut b, 4..6, 0..2);
        assert_eq!(a, &[4, 5]);
        m[0] = 9;
        assert_eq!(b[0], 9);
    }
}
