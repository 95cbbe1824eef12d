//! Layout of the shared segment and the only pointer arithmetic into it.
//!
//! ```text
//! [0, 4096)                 header: magic, rank count, slot size
//! [4096, 4096 + p*256)      one control block per rank (counter, sleepers, pid,
//!                           state, probe address, abort notice, parked flag,
//!                           operation descriptor)
//! [slots, slots + p*slot)   one data slot per rank, split in two halves that
//!                           alternate between pipeline pieces
//! ```
//! Every control word is an atomic. Slots are plain bytes whose ownership is
//! handed between processes by the phase protocol in `shm/mod.rs`: a rank
//! writes only its own slot, and only in a half that no peer can be reading.

use crate::error::{Error, Result};
use crate::sys::{self, Mapping};
use crate::transport::DESC_WORDS;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64};

const MAGIC: u64 = 0x5249_4e47_5348_4d31; // "RINGSHM1"
const PAGE: usize = 4096;
const CTL_BYTES: usize = 256;

/// Per-rank control block; exactly `CTL_BYTES` long, cache-line aligned.
#[repr(C, align(64))]
pub struct RankCtl {
    /// Phase counter: bumped once per phase, waited on by peers (futex word).
    pub counter: AtomicU32,
    /// Number of peers parked on `counter` (the signaller skips the wake
    /// syscall when nobody sleeps).
    pub sleepers: AtomicU32,
    /// Process id, for cross-memory attach.
    pub pid: AtomicU32,
    /// 0 while healthy; 1 once this rank gave up on the communicator (its
    /// notice is then set); 2 once it shut the communicator down.
    pub state: AtomicU32,
    /// Address of a known word in this process (cross-memory-attach probe).
    pub probe_addr: AtomicU64,
    /// Abort notice: global rank the failure started from, and its cause
    /// code (written before `state`).
    pub notice_culprit: AtomicU64,
    pub notice_cause: AtomicU64,
    /// A digest of each published descriptor (indexed like `desc`), in the
    /// same cache line as `counter`: a peer that sees the phase also has
    /// the digest, and reads `desc` only when the digests differ.
    pub digest: [AtomicU64; 2],
    /// 1 while this rank is parked on a futex, waiting for a peer itself: a
    /// rank that waits for it cannot hear from it before it is woken, so on
    /// contended cores it parks too instead of spinning (`shm::wait_peer_at`).
    pub parked: AtomicU32,
    /// The CPU this rank last started an operation or a wait on
    /// (`u32::MAX`: unknown): a rank waiting for it on the same CPU would
    /// spin on the core the peer needs, so it yields to it instead.
    pub cpu: AtomicU32,
    /// The operation descriptors this rank published, indexed by sequence
    /// parity: a rank can run at most one operation ahead of its slowest peer,
    /// so two buffers keep the one a peer may still be reading intact.
    pub desc: [[AtomicU64; 8]; 2],
    _pad1: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<RankCtl>() == CTL_BYTES);
const _: () = assert!(DESC_WORDS <= 8);

#[repr(C)]
struct Header {
    magic: AtomicU64,
    nranks: AtomicU64,
    slot_bytes: AtomicU64,
}

/// A mapped segment shared by the ranks of one host group.
pub struct Segment {
    map: Mapping,
    nranks: usize,
    slot_bytes: usize,
    slots_off: usize,
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

fn layout(nranks: usize, slot_bytes: usize) -> (usize, usize) {
    let slots_off = PAGE + round_up(nranks * CTL_BYTES, PAGE);
    (slots_off, slots_off + nranks * slot_bytes)
}

impl Segment {
    /// Creates the segment (leader side). Returns it with the memfd that peers
    /// open through /proc.
    pub fn create(nranks: usize, slot_bytes: usize) -> Result<(Segment, OwnedFd)> {
        let slot_bytes = round_up(slot_bytes.max(2 * PAGE), 2 * PAGE);
        let fd = sys::memfd(layout(nranks, slot_bytes).1)?;
        let seg = Segment::map(&fd, nranks, slot_bytes)?;
        let h = seg.header();
        h.nranks
            .store(nranks as u64, std::sync::atomic::Ordering::SeqCst);
        h.slot_bytes
            .store(slot_bytes as u64, std::sync::atomic::Ordering::SeqCst);
        h.magic.store(MAGIC, std::sync::atomic::Ordering::SeqCst);
        Ok((seg, fd))
    }

    /// Maps the leader's segment (peer side) and checks its header.
    pub fn open(pid: u32, fd: i32, nranks: usize, slot_bytes: usize) -> Result<Segment> {
        let seg = Segment::map(&sys::open_peer_fd(pid, fd)?, nranks, slot_bytes)?;
        let h = seg.header();
        let ord = std::sync::atomic::Ordering::SeqCst;
        if h.magic.load(ord) != MAGIC
            || h.nranks.load(ord) != nranks as u64
            || h.slot_bytes.load(ord) != slot_bytes as u64
        {
            return Err(Error::InvalidArgument(
                "shared-memory segment header does not match".into(),
            ));
        }
        Ok(seg)
    }

    /// Maps the segment behind `fd`, every page faulted in: every rank
    /// maps every page before the first operation (no rank writes slot data
    /// until all ranks have finished setting up).
    fn map(fd: &OwnedFd, nranks: usize, slot_bytes: usize) -> Result<Segment> {
        let (slots_off, total) = layout(nranks, slot_bytes);
        let map = Mapping::new(fd, total)?;
        map.prefault();
        Ok(Segment {
            map,
            nranks,
            slot_bytes,
            slots_off,
        })
    }

    /// Size of each rank's slot in bytes.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is page aligned and at least one page long; the
        // header is three atomics, valid for any bit pattern (zeroed memfd).
        unsafe { &*(self.map.as_ptr() as *const Header) }
    }

    /// Control block of `rank`.
    pub fn ctl(&self, rank: usize) -> &RankCtl {
        assert!(rank < self.nranks, "control block index out of range");
        // SAFETY: rank < nranks, so the block lies inside the mapping; the
        // address is 64-byte aligned (page + rank*256); RankCtl is made of
        // atomics and padding, valid for any bit pattern, and shared access
        // through atomics is sound across threads and processes.
        unsafe { &*(self.map.as_ptr().add(PAGE + rank * CTL_BYTES) as *const RankCtl) }
    }

    fn slot_range_ptr(&self, rank: usize, off: usize, len: usize) -> *mut u8 {
        assert!(
            rank < self.nranks
                && off
                    .checked_add(len)
                    .is_some_and(|end| end <= self.slot_bytes),
            "slot access out of range"
        );
        // SAFETY: bounds checked just above: the range lies inside rank's slot,
        // which lies inside the mapping.
        unsafe {
            self.map
                .as_ptr()
                .add(self.slots_off + rank * self.slot_bytes + off)
        }
    }

    /// Brings `rank`'s slot into this core's caches: writes it (zeros, as the
    /// fresh segment holds) when `own`, else reads a word of every line.
    /// Pages fresh from the kernel are zeroed with stores that bypass the
    /// caches, so without this every window's first use fetched its lines
    /// from memory: a communicator's first pass ran at up to 1.8x the
    /// steady cost even with the pages mapped.
    ///
    /// Protocol requirement (upheld by `ShmGroup::establish`): runs before
    /// the first operation; only the owner writes its slot, and peers read
    /// a slot only after its owner has finished (an agreement in between).
    pub fn warm(&self, rank: usize, own: bool) {
        let p = self.slot_range_ptr(rank, 0, self.slot_bytes);
        if own {
            // SAFETY: the range is rank's whole slot inside the mapping
            // (checked above); this process owns it and nobody reads it yet.
            unsafe { std::ptr::write_bytes(p, 0, self.slot_bytes) };
            return;
        }
        for off in (0..self.slot_bytes).step_by(64) {
            // SAFETY: off < slot_bytes, so the byte lies in rank's slot; its
            // owner finished writing before this read (see above); the
            // value is discarded.
            unsafe { std::ptr::read_volatile(p.add(off)) };
        }
    }

    /// Copies `src` into `rank`'s slot at `off`.
    ///
    /// Protocol requirement (upheld by `ShmGroup`): only the slot's owner
    /// writes it, and no peer reads that range until the owner's next signal.
    pub fn write(&self, rank: usize, off: usize, src: &[u8]) {
        let dst = self.slot_range_ptr(rank, off, src.len());
        // SAFETY: `dst..dst+len` is inside the mapping (checked) and cannot
        // overlap `src`, a Rust slice outside the slot region's owner protocol
        // (callers never pass slot memory as `src`).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
    }

    /// Copies from `rank`'s slot at `off` into `dst`.
    pub fn read(&self, rank: usize, off: usize, dst: &mut [u8]) {
        let src = self.slot_range_ptr(rank, off, dst.len());
        // SAFETY: in bounds (checked); `dst` is a private Rust buffer; the
        // protocol guarantees the owner does not write this range meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
    }

    /// Copies from `rank`'s slot at `off` into `dst` with non-temporal
    /// stores (see [`crate::sys::copy_streaming`]).
    pub fn read_streaming(&self, rank: usize, off: usize, dst: &mut [u8]) {
        self.with_slots(&[rank], off, dst.len(), |views| {
            crate::sys::copy_streaming(dst, views[0])
        })
    }

    /// Runs `f` with read-only views of the same range in the given ranks'
    /// slots (in the given order).
    pub fn with_slots<R>(
        &self,
        ranks: &[usize],
        off: usize,
        len: usize,
        f: impl FnOnce(&[&[u8]]) -> R,
    ) -> R {
        let views: Vec<&[u8]> = ranks
            .iter()
            .map(|&r| {
                let p = self.slot_range_ptr(r, off, len);
                // SAFETY: in bounds (checked); while `f` runs, the protocol
                // guarantees nobody writes these ranges (their owners have
                // signalled and wait for our next signal before reuse).
                unsafe { std::slice::from_raw_parts(p as *const u8, len) }
            })
            .collect();
        f(&views)
    }

    /// Runs `f` with a mutable view of `rank`'s own slot range and read-only
    /// views of the same range in `others`' slots.
    pub fn with_own_and_slots<R>(
        &self,
        rank: usize,
        others: &[usize],
        off: usize,
        len: usize,
        f: impl FnOnce(&mut [u8], &[&[u8]]) -> R,
    ) -> R {
        assert!(!others.contains(&rank), "own slot listed as a source");
        let own = self.slot_range_ptr(rank, off, len);
        // SAFETY: in bounds (checked); distinct ranks' slots never overlap, so
        // the mutable view aliases none of the shared views; only `rank` writes
        // its slot and no peer reads this range until our next signal.
        let own = unsafe { std::slice::from_raw_parts_mut(own, len) };
        self.with_slots(others, off, len, |views| f(own, views))
    }
}
