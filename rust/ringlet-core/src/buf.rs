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

    fn overlaps(self, other: RawBuf) -> bool {
        self.len > 0
            && other.len > 0
            && self.ptr < other.ptr + other.len
            && other.ptr < self.ptr + self.len
    }
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
