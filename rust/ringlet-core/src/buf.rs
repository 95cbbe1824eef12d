//! Byte ranges of memory a caller outside Rust owns (a tensor's storage, as
//! an address and a length), handed to the engine for one call: the Python
//! binding and the C ABI both take their buffers this way.

use crate::error::{Error, Result};

/// A byte range the caller keeps alive, and does not touch, for the call.
#[derive(Clone, Copy, Debug)]
pub struct RawBuf {
    ptr: usize,
    len: usize,
}

impl RawBuf {
    /// The range of `len` bytes at address `ptr` (null only when empty).
    pub fn new(ptr: usize, len: usize) -> Result<RawBuf> {
        if ptr == 0 && len != 0 {
            return Err(Error::InvalidArgument(
                "null data pointer with a non-zero length".into(),
            ));
        }
        Ok(RawBuf { ptr, len })
    }

    /// # Safety
    /// `ptr..ptr+len` must be readable memory that stays alive and unwritten
    /// by anyone else for the lifetime `'a`.
    pub unsafe fn slice<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: non-null (checked in `new`) and valid per the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// # Safety
    /// As `slice`, and nothing else may read or write the range during `'a`.
    pub unsafe fn slice_mut<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: non-null (checked in `new`) and exclusively ours per the
        // caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }

    /// Its length in bytes.
    pub fn len(self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(self) -> bool {
        self.len == 0
    }

    fn overlaps(self, other: RawBuf) -> bool {
        self.len > 0
            && other.len > 0
            && self.ptr < other.ptr + other.len
            && other.ptr < self.ptr + self.len
    }
}

/// Byte copies between caller-owned ranges, run around one queued engine
/// call: staging a list of tensors into one flat buffer before it, or the
/// flat result out into a list after it.
#[derive(Clone, Debug, Default)]
pub struct Copies(Vec<(RawBuf, RawBuf)>);

impl Copies {
    /// One copy of `nbytes` bytes from address `from` to address `to` per
    /// `(from, to, nbytes)`.
    pub fn new(list: &[(usize, usize, usize)]) -> Result<Copies> {
        list.iter()
            .map(|&(from, to, n)| Ok((RawBuf::new(from, n)?, RawBuf::new(to, n)?)))
            .collect::<Result<Vec<_>>>()
            .map(Copies)
    }

    /// Whether there is nothing to copy.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Runs the copies in order (overlapping ranges are copied as by memmove).
    ///
    /// # Safety
    /// Every range must be valid memory that stays alive for the call, and no
    /// one else may read or write the destinations (or write the sources)
    /// meanwhile.
    pub unsafe fn run(&self) {
        for &(from, to) in &self.0 {
            if from.len > 0 {
                // SAFETY: both ranges are non-null (checked in `RawBuf::new`),
                // `from.len` bytes long and valid per the caller's contract;
                // `copy` allows them to overlap.
                unsafe { std::ptr::copy(from.ptr as *const u8, to.ptr as *mut u8, from.len) }
            }
        }
    }
}

/// Copies the ranges `bufs` back to back into `dst` (cleared first): a list
/// of inputs staged into one flat buffer.
///
/// # Safety
/// Every range must be readable memory that stays alive, and that no one
/// writes, for the call.
pub unsafe fn stage(bufs: &[RawBuf], dst: &mut Vec<u8>) {
    dst.clear();
    dst.reserve(bufs.iter().map(|b| b.len).sum());
    for b in bufs {
        // SAFETY: readable and unwritten for the call per the contract.
        dst.extend_from_slice(unsafe { b.slice() });
    }
}

/// Copies `src` out into the ranges `bufs`, in order (`src` holds at least
/// their total length): a flat result copied into a list of outputs.
///
/// # Safety
/// Every range must be writable memory that stays alive, and that no one
/// else reads or writes, for the call; the ranges may overlap each other
/// (the later copy wins), not `src`.
pub unsafe fn unstage(src: &[u8], bufs: &[RawBuf]) {
    let mut at = 0;
    for b in bufs {
        let piece = &src[at..at + b.len];
        if b.len > 0 {
            // SAFETY: `piece` is `b.len` bytes of `src`, which no range
            // overlaps; the destination is writable per the contract.
            unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), b.ptr as *mut u8, b.len) }
        }
        at += b.len;
    }
}

thread_local! {
    /// The list forms' flat buffers (send, receive), kept between calls on
    /// this thread: memory fresh from the allocator costs a page fault per
    /// page on first touch, which made a 1 MiB all-to-all of lists several
    /// times slower than the same exchange through kept tensors.
    static STAGING: std::cell::RefCell<(Vec<u8>, Vec<u8>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Staging buffers above this size are freed after the call instead of kept.
const KEEP_STAGING: usize = 64 << 20;

/// A collective on lists through this thread's kept staging buffers: the
/// ranges `ins` staged back to back into the send buffer, `f` run on it, the
/// inputs' byte lengths, a receive buffer of the ranges `outs`' total length
/// and the outputs' byte lengths, and (when `f` succeeded) the receive buffer
/// copied out into `outs` in order. A nested call (from inside `f`) stages
/// through fresh buffers.
///
/// # Safety
/// Every range of `ins` must be readable, and every range of `outs`
/// writable, memory that stays alive, and that no one else writes (or, for
/// `outs`, reads), for the call. `outs` may alias `ins` or each other.
pub unsafe fn through_staging(
    ins: &[RawBuf],
    outs: &[RawBuf],
    f: impl FnOnce(&[u8], &[usize], &mut [u8], &[usize]) -> Result<()>,
) -> Result<()> {
    let lens = |bufs: &[RawBuf]| bufs.iter().map(|b| b.len).collect::<Vec<_>>();
    let (in_lens, out_lens) = (lens(ins), lens(outs));
    let total = out_lens.iter().sum();
    let run = |send: &mut Vec<u8>, recv: &mut Vec<u8>| -> Result<()> {
        // SAFETY: the ranges are readable and unwritten per the contract.
        unsafe { stage(ins, send) };
        if recv.len() < total {
            recv.resize(total, 0);
        }
        let recv = &mut recv[..total];
        f(send, &in_lens, recv, &out_lens)?;
        // SAFETY: writable and ours alone per the contract; `recv` is ours.
        unsafe { unstage(recv, outs) };
        Ok(())
    };
    STAGING.with(|cell| match cell.try_borrow_mut() {
        Ok(mut bufs) => {
            let (send, recv) = &mut *bufs;
            let out = run(send, recv);
            for b in [send, recv] {
                if b.capacity() > KEEP_STAGING {
                    *b = Vec::new();
                }
            }
            out
        }
        Err(_) => run(&mut Vec::new(), &mut Vec::new()),
    })
}

/// The input and output buffers of an out-of-place collective, checked not
/// to overlap.
pub fn in_out(
    in_ptr: usize,
    in_len: usize,
    out_ptr: usize,
    out_len: usize,
) -> Result<(RawBuf, RawBuf)> {
    let (i, o) = (RawBuf::new(in_ptr, in_len)?, RawBuf::new(out_ptr, out_len)?);
    if i.overlaps(o) {
        return Err(Error::InvalidArgument(
            "input and output tensors overlap in memory".into(),
        ));
    }
    Ok((i, o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_run_in_order_and_allow_overlap() {
        let src = [1u8, 2, 3, 4];
        let mut flat = [0u8; 6];
        let a = src.as_ptr() as usize;
        let f = flat.as_mut_ptr() as usize;
        // src[2..4] then src[0..2] into flat[0..4], then flat[0..4] onto flat[2..6]
        let copies = Copies::new(&[(a + 2, f, 2), (a, f + 2, 2), (f, f + 2, 4)]).unwrap();
        assert!(!copies.is_empty() && Copies::default().is_empty());
        // SAFETY: the ranges lie in `src` and `flat`, alive and unshared here.
        unsafe { copies.run() };
        assert_eq!(flat, [3, 4, 3, 4, 1, 2]);
        assert!(Copies::new(&[(0, f, 1)]).is_err());
        assert!(Copies::new(&[(0, 0, 0)]).is_ok());
    }

    #[test]
    fn staging_keeps_its_buffers_and_copies_out_only_on_success() {
        let mut a = [1u8, 2, 3];
        let b = [4u8, 5];
        let ra = RawBuf::new(a.as_mut_ptr() as usize, 3).unwrap();
        let rb = RawBuf::new(b.as_ptr() as usize, 2).unwrap();
        let mut out = [0u8; 2];
        let ro = RawBuf::new(out.as_mut_ptr() as usize, 2).unwrap();
        // SAFETY (every call below): the ranges lie in `a`, `b` and `out`,
        // alive and touched by nothing else meanwhile; an output may alias an
        // input (`a` is both).
        let reversed = |send: &[u8], ins: &[usize], recv: &mut [u8], outs: &[usize]| {
            assert_eq!(
                (send, ins, outs),
                (&[1u8, 2, 3, 4, 5][..], &[3usize, 2][..], &[2usize, 3][..])
            );
            for (r, s) in recv.iter_mut().zip(send.iter().rev()) {
                *r = *s;
            }
            Ok::<(), Error>(())
        };
        // SAFETY: as said above.
        unsafe { through_staging(&[ra, rb], &[ro, ra], reversed) }.unwrap();
        assert_eq!((out, a), ([5, 4], [3, 2, 1]));
        let kept = STAGING.with(|c| c.borrow().0.capacity());
        assert!(kept >= 5, "the send buffer is kept for the next call");
        // a failed call copies nothing out; a nested call stages through fresh buffers
        // SAFETY: as said above.
        let failed = unsafe {
            through_staging(&[rb], &[ro], |_, _, recv, _| {
                recv.fill(9);
                // SAFETY: as said above (`a` is no input of the outer call).
                let inner = through_staging(&[rb], &[ra], |send, _, recv, _| {
                    recv[..2].copy_from_slice(send);
                    Ok(())
                });
                assert!(inner.is_ok());
                Err(Error::InvalidArgument("no".into()))
            })
        };
        assert!(failed.is_err());
        assert_eq!((out, a), ([5, 4], [4, 5, 0]));
    }
}
