//! A C ABI over one process group's communicator and progress queue: what the
//! C++ `torch.distributed` Backend (`python/ringlet/distributed/csrc/backend.cpp`) calls
//! for its hot collectives, with no Python in between.
//!
//! The C++ side never links against this library. Python hands it the
//! address of [`TABLE`] (a versioned struct of function pointers, from
//! `ringlet._core.capi_table()`) and, per process group, the address of a
//! [`NativeGroup`] (from `ringlet._core.native_group(queue, comm)`) that the
//! C++ side owns and frees with `group_free`. C++ converts arguments and
//! nothing else: buffers are the data pointers and byte sizes of dense
//! contiguous CPU tensors, dtypes and reduce ops are the codes of
//! [`DType`] and [`ReduceOp`].
//!
//! Every function catches panics. A call returns [`RINGLET_OK`], or
//! [`RINGLET_ERROR`] with an owned [`CError`] written to `err`; the caller
//! hands that to `ringlet._core.native_error` (the binding maps engine errors
//! to Python exceptions in one place) or frees it with `error_free`.
//!
//! Ordering: a call runs on the calling thread at once when the group's
//! queue is idle ([`Progress::run_now`]); otherwise it is queued behind the
//! operations issued before it (Python jobs of the same group) and the
//! caller waits for it, running queued jobs itself when none is running
//! ([`Progress::wait`]). Either way a group's operations run in issue order,
//! whichever door (C++ or Python) they came in by. The caller must not hold
//! the GIL: a queued Python job it runs takes it.

use crate::buf::{self, RawBuf};
use crate::collective::ListOp;
use crate::dtype::{DType, ReduceOp};
use crate::error::{panic_message, Error, Result};
use crate::group::{Communicator, SharedCommunicator};
use crate::progress::Progress;
use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The call finished.
pub const RINGLET_OK: i32 = 0;
/// The call failed; `*err` holds the error.
pub const RINGLET_ERROR: i32 = 1;

/// Bumped when [`RingletCApi`] changes incompatibly.
pub const RINGLET_CAPI_VERSION: u32 = 2;

/// One process group as the C++ Backend sees it: the group's progress queue
/// (shared with its Python jobs) and its communicator (shared with the
/// Python binding's object, so closing either closes both).
pub struct NativeGroup {
    queue: Arc<Progress>,
    comm: SharedCommunicator,
}

impl NativeGroup {
    /// A group handle over `queue` and `comm`.
    pub fn new(queue: Arc<Progress>, comm: SharedCommunicator) -> Self {
        NativeGroup { queue, comm }
    }

    /// Moves the handle to the heap for the C side (freed by `group_free`).
    pub fn into_raw(self) -> *mut NativeGroup {
        Box::into_raw(Box::new(self))
    }

    /// Runs `f` on the communicator in queue order: at once on this thread
    /// when the queue is idle, else queued and waited for. `limit` bounds
    /// the wait for earlier operations; a call still queued when it passes is
    /// withdrawn (it never runs) and fails with a timeout, while a call that
    /// has started is waited for to its end (the engine's own timeout bounds
    /// it), so `f`'s buffers are never used after this returns.
    fn run(
        &self,
        limit: Duration,
        op: &'static str,
        f: impl FnOnce(&mut Communicator) -> Result<()> + Send + 'static,
    ) -> Result<()> {
        let comm = self.comm.clone();
        let mut f = Some(f);
        let now = self.queue.run_now(|| match f.take() {
            Some(f) => comm.with(f),
            None => Ok(()),
        });
        if let Some(result) = now {
            return result;
        }
        let Some(f) = f.take() else {
            return Ok(());
        };
        // Queued: 0 waiting, 1 started, 2 withdrawn by a caller that gave up.
        let state = Arc::new(AtomicU8::new(0));
        let slot: Arc<Mutex<Option<Result<()>>>> = Arc::new(Mutex::new(None));
        let (job_state, job_slot, comm) =
            (Arc::clone(&state), Arc::clone(&slot), self.comm.clone());
        let ticket = self.queue.submit(
            Box::new(move || {
                if job_state
                    .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    let out = comm.with(f);
                    *job_slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(out);
                }
            }),
            false,
        )?;
        if !self.queue.wait(ticket, Some(limit))? {
            let withdrawn = state
                .compare_exchange(0, 2, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            if withdrawn {
                return Err(Error::Stalled {
                    rank: self.comm.global_rank(),
                    op,
                    waited: limit,
                });
            }
            self.queue.wait(ticket, None)?;
        }
        let out = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        out.unwrap_or_else(|| {
            Err(Error::InvalidArgument(format!(
                "{op}: the queued operation did not run (the process group was closed)"
            )))
        })
    }
}

/// An error handed to the C side: the engine's error and its message.
pub struct CError {
    /// The error, for the binding to convert.
    pub error: Error,
    message: CString,
}

impl CError {
    fn boxed(error: Error) -> *mut CError {
        let text = error.to_string().replace('\0', " ");
        let message = CString::new(text).unwrap_or_default();
        Box::into_raw(Box::new(CError { error, message }))
    }

    /// Takes back an error the C side received.
    ///
    /// # Safety
    /// `ptr` must come from a call of this module and must not have been
    /// freed or taken already.
    pub unsafe fn take(ptr: *mut CError) -> Option<Error> {
        if ptr.is_null() {
            return None;
        }
        // SAFETY: per the contract, `ptr` is a live Box made by `boxed`.
        Some(unsafe { Box::from_raw(ptr) }.error)
    }
}

/// Input and output buffers of an out-of-place collective, checked not to
/// overlap.
fn in_out(
    inp: *const c_void,
    in_len: usize,
    out: *mut c_void,
    out_len: usize,
) -> Result<(RawBuf, RawBuf)> {
    buf::in_out(inp as usize, in_len, out as usize, out_len)
}

fn dtype(code: u32) -> Result<DType> {
    DType::from_code(code)
        .ok_or_else(|| Error::InvalidArgument(format!("unknown dtype code {code}")))
}

fn reduce_op(code: u32) -> Result<ReduceOp> {
    ReduceOp::from_code(code)
        .ok_or_else(|| Error::InvalidArgument(format!("unknown reduce op code {code}")))
}

/// Runs `f` with panics caught, writing its error to `err`.
///
/// # Safety
/// `err` must be null or point to writable storage for one pointer.
unsafe fn guard(err: *mut *mut CError, f: impl FnOnce() -> Result<()>) -> i32 {
    let out = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => Err(Error::InvalidArgument(panic_message(&*panic))),
    };
    match out {
        Ok(()) => RINGLET_OK,
        Err(e) => {
            if !err.is_null() {
                // SAFETY: non-null and writable per the contract.
                unsafe { *err = CError::boxed(e) };
            }
            RINGLET_ERROR
        }
    }
}

/// The group behind a handle.
///
/// # Safety
/// `g` must be null or a live handle from [`NativeGroup::into_raw`].
unsafe fn group<'a>(g: *const NativeGroup) -> Result<&'a NativeGroup> {
    if g.is_null() {
        return Err(Error::InvalidArgument("null process group handle".into()));
    }
    // SAFETY: non-null and live per the contract.
    Ok(unsafe { &*g })
}

fn limit(timeout_ms: u64) -> Duration {
    Duration::from_millis(timeout_ms.max(1))
}

/// The collective entry points and the table that holds them, from one
/// description each: its arguments after the group handle, then the job it
/// runs on the group's communicator, built from them (any argument error is
/// returned before the job is queued). Each becomes an `extern "C"`
/// function taking the group handle first and `timeout_ms` and the error
/// slot last, that checks the handle, runs the job through the group's queue
/// under the operation's name with panics caught, and writes its error to
/// the slot; and a field of [`RingletCApi`] of that function's type, in the
/// order given (after `version` and `size`, before the error and free
/// functions).
macro_rules! c_api {
    ($(
        $(#[$doc:meta])*
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $job:block
    )*) => {
        $(
            $(#[$doc])*
            #[allow(clippy::too_many_arguments)]
            unsafe extern "C" fn $name(
                g: *const NativeGroup,
                $($arg: $ty,)*
                timeout_ms: u64,
                err: *mut *mut CError,
            ) -> i32 {
                let call = || -> Result<()> {
                    // SAFETY: `g` is a live handle per the contract.
                    let g = unsafe { group(g) }?;
                    let job = $job;
                    g.run(limit(timeout_ms), stringify!($name), job)
                };
                // SAFETY: `err` is null or writable per this function's contract.
                unsafe { guard(err, call) }
            }
        )*

        /// The functions the C++ Backend calls, in this order (mirrored by the
        /// `RingletCApi` struct in `python/ringlet/distributed/csrc/ringlet_capi.h`).
        #[repr(C)]
        pub struct RingletCApi {
            /// [`RINGLET_CAPI_VERSION`].
            pub version: u32,
            /// `size_of::<RingletCApi>()`, so a reader can check it knows them all.
            pub size: u32,
            $(pub $name: unsafe extern "C" fn(
                *const NativeGroup,
                $($ty,)*
                u64,
                *mut *mut CError,
            ) -> i32,)*
            pub error_message: unsafe extern "C" fn(*const CError) -> *const c_char,
            pub error_free: unsafe extern "C" fn(*mut CError),
            pub group_free: unsafe extern "C" fn(*mut NativeGroup),
        }

        /// The table whose address Python hands the C++ Backend.
        pub static TABLE: RingletCApi = RingletCApi {
            version: RINGLET_CAPI_VERSION,
            size: std::mem::size_of::<RingletCApi>() as u32,
            $($name,)*
            error_message,
            error_free,
            group_free,
        };
    };
}

c_api! {
    /// All-reduces `nbytes` at `buf` in place.
    ///
    /// # Safety
    /// `g` is a live handle; `buf` holds `nbytes` bytes the caller keeps alive
    /// and untouched during the call; `err` is null or writable.
    fn all_reduce(buf: *mut c_void, nbytes: usize, dtype_code: u32, op_code: u32) {
        let (d, o) = (dtype(dtype_code)?, reduce_op(op_code)?);
        let b = RawBuf::new(buf as usize, nbytes)?;
        move |c: &mut Communicator| {
            // SAFETY: the caller keeps the buffer alive and untouched during
            // the call, and `run` returns only after this job ran or was
            // withdrawn.
            c.all_reduce(unsafe { b.slice_mut() }, d, o)
        }
    }

    /// All-gathers `in_len` bytes at `inp` into `out` (`out_len` bytes, rank
    /// blocks in rank order).
    ///
    /// # Safety
    /// As [`all_reduce`], for both buffers.
    fn all_gather(inp: *const c_void, in_len: usize, out: *mut c_void, out_len: usize, dtype_code: u32) {
        let d = dtype(dtype_code)?;
        let (i, o) = in_out(inp, in_len, out, out_len)?;
        // SAFETY: as in all_reduce; the buffers do not overlap (checked).
        move |c: &mut Communicator| c.all_gather(unsafe { i.slice() }, unsafe { o.slice_mut() }, d)
    }

    /// Reduce-scatters `inp` (one block per rank) into `out`.
    ///
    /// # Safety
    /// As [`all_gather`].
    fn reduce_scatter(
        inp: *const c_void, in_len: usize, out: *mut c_void, out_len: usize,
        dtype_code: u32, op_code: u32,
    ) {
        let (d, op) = (dtype(dtype_code)?, reduce_op(op_code)?);
        let (i, o) = in_out(inp, in_len, out, out_len)?;
        // SAFETY: as in all_gather.
        move |c: &mut Communicator| {
            c.reduce_scatter(unsafe { i.slice() }, unsafe { o.slice_mut() }, d, op)
        }
    }

    /// Broadcasts `nbytes` at `buf` from group rank `root`.
    ///
    /// # Safety
    /// As [`all_reduce`].
    fn broadcast(buf: *mut c_void, nbytes: usize, dtype_code: u32, root: usize) {
        let (d, b) = (dtype(dtype_code)?, RawBuf::new(buf as usize, nbytes)?);
        // SAFETY: as in all_reduce.
        move |c: &mut Communicator| c.broadcast(unsafe { b.slice_mut() }, d, root)
    }

    /// Waits until every rank of the group has called it.
    ///
    /// # Safety
    /// `g` is a live handle; `err` is null or writable.
    fn barrier() {
        |c: &mut Communicator| c.barrier()
    }

    /// All-to-all: `send_counts[r]` elements of `inp` (in rank order) go to
    /// rank r, `recv_counts[r]` elements of `out` come from it; `ncounts` is
    /// the group size.
    ///
    /// # Safety
    /// As [`all_gather`]; `send_counts` and `recv_counts` hold `ncounts`
    /// numbers each, read during the call only.
    fn all_to_all(
        inp: *const c_void, in_len: usize, send_counts: *const usize,
        out: *mut c_void, out_len: usize, recv_counts: *const usize,
        ncounts: usize, dtype_code: u32,
    ) {
        let d = dtype(dtype_code)?;
        let (i, o) = in_out(inp, in_len, out, out_len)?;
        if ncounts > 0 && (send_counts.is_null() || recv_counts.is_null()) {
            return Err(Error::InvalidArgument("null split counts".into()));
        }
        let (sends, recvs) = if ncounts == 0 {
            (Vec::new(), Vec::new())
        } else {
            // SAFETY: non-null, `ncounts` readable numbers each per the
            // contract; copied before the call returns.
            unsafe {
                (
                    std::slice::from_raw_parts(send_counts, ncounts).to_vec(),
                    std::slice::from_raw_parts(recv_counts, ncounts).to_vec(),
                )
            }
        };
        // SAFETY: as in all_gather.
        move |c: &mut Communicator| {
            c.all_to_all_v(unsafe { i.slice() }, &sends, unsafe { o.slice_mut() }, &recvs, d)
        }
    }

    /// A list form of torch.distributed's collectives
    /// ([`crate::collective::ListOp`]): `kind` 0 all_gather, 1 gather, 2
    /// scatter (`root`), 3 all_to_all, 4 reduce_scatter (`op_code`); `ins`
    /// and `outs` hold `nin` and `nout` buffers, which may alias each other
    /// (they are staged through flat buffers of the engine's own).
    ///
    /// # Safety
    /// `g` is a live handle; `ins` and `outs` point to `nin` and `nout`
    /// [`RingletBuf`]s (read during the call only), each a range the caller
    /// keeps alive, and leaves alone, during the call; `err` is null or
    /// writable.
    fn list_collective(
        kind: u32, ins: *const RingletBuf, nin: usize, outs: *const RingletBuf, nout: usize,
        dtype_code: u32, op_code: u32, root: usize,
    ) {
        let d = dtype(dtype_code)?;
        let op = match kind {
            0 => ListOp::AllGather,
            1 => ListOp::Gather { root },
            2 => ListOp::Scatter { root },
            3 => ListOp::AllToAll,
            4 => ListOp::ReduceScatter(reduce_op(op_code)?),
            other => {
                return Err(Error::InvalidArgument(format!("unknown list collective {other}")))
            }
        };
        // SAFETY: `nin` / `nout` readable entries per the contract.
        let (ins, outs) = unsafe { (ring_bufs(ins, nin)?, ring_bufs(outs, nout)?) };
        move |c: &mut Communicator| {
            // SAFETY: the caller keeps every range alive and untouched during
            // the call, and `run` returns only after this job ran or was
            // withdrawn.
            unsafe {
                buf::through_staging(&ins, &outs, |send, in_lens, recv, out_lens| {
                    c.list_collective(op, send, in_lens, recv, out_lens, d)
                })
            }
        }
    }
}

/// A buffer of a list handed over the C ABI: its address and byte length.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RingletBuf {
    /// The first byte (null only when `nbytes` is 0).
    pub ptr: *mut c_void,
    /// Its length.
    pub nbytes: usize,
}

/// The `n` buffers at `bufs`, copied out.
///
/// # Safety
/// `bufs` points to `n` readable [`RingletBuf`]s (or `n` is 0).
unsafe fn ring_bufs(bufs: *const RingletBuf, n: usize) -> Result<Vec<RawBuf>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if bufs.is_null() {
        return Err(Error::InvalidArgument("null buffer list".into()));
    }
    // SAFETY: non-null, `n` readable entries per the contract.
    let list = unsafe { std::slice::from_raw_parts(bufs, n) };
    list.iter()
        .map(|b| RawBuf::new(b.ptr as usize, b.nbytes))
        .collect()
}

/// The message of an error (valid until it is freed or taken).
///
/// # Safety
/// `e` is null or a live error from this module.
unsafe extern "C" fn error_message(e: *const CError) -> *const c_char {
    if e.is_null() {
        return std::ptr::null();
    }
    // SAFETY: non-null and live per the contract.
    unsafe { (*e).message.as_ptr() }
}

/// Frees an error the caller did not hand on.
///
/// # Safety
/// `e` is null or a live error from this module, not used afterwards.
unsafe extern "C" fn error_free(e: *mut CError) {
    let _ = catch_unwind(|| {
        // SAFETY: per the contract (null is accepted).
        drop(unsafe { CError::take(e) });
    });
}

/// Frees a group handle (the queue and communicator live on while their
/// other owners hold them).
///
/// # Safety
/// `g` is null or a live handle, not used afterwards.
unsafe extern "C" fn group_free(g: *mut NativeGroup) {
    if g.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: a live Box from `into_raw`, freed once per the contract.
        drop(unsafe { Box::from_raw(g) });
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::Config;
    use crate::testing::local_group;
    use std::sync::mpsc;

    /// Each rank's queue and group handle (as an address, to cross threads).
    fn groups(size: usize) -> Vec<(Arc<Progress>, usize)> {
        let cfg = Config {
            timeout: Duration::from_secs(20),
            ..Config::default()
        };
        local_group(size, &cfg)
            .unwrap()
            .into_iter()
            .map(|c| {
                let q = Arc::new(Progress::new("capi-test").unwrap());
                let g = NativeGroup::new(Arc::clone(&q), SharedCommunicator::new(c)).into_raw();
                (q, g as usize)
            })
            .collect()
    }

    /// Runs `f(rank, handle)` on one thread per rank.
    fn each<T: Send>(
        gs: &[(Arc<Progress>, usize)],
        f: impl Fn(usize, usize) -> T + Sync,
    ) -> Vec<T> {
        std::thread::scope(|s| {
            let f = &f;
            let hs: Vec<_> = gs
                .iter()
                .enumerate()
                .map(|(r, (_, g))| {
                    let g = *g;
                    s.spawn(move || f(r, g))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn free(gs: Vec<(Arc<Progress>, usize)>) {
        for (_, g) in gs {
            // SAFETY: each handle is live and freed once.
            unsafe { (TABLE.group_free)(g as *mut NativeGroup) };
        }
    }

    #[test]
    fn collectives_through_the_table() {
        let gs = groups(2);
        let out = each(&gs, |r, g| {
            let g = g as *const NativeGroup;
            let mut x = [r as f32 + 1.0; 5];
            let mut err = std::ptr::null_mut();
            // SAFETY: a live handle, a live buffer, a writable err slot.
            let code = unsafe {
                (TABLE.all_reduce)(
                    g,
                    x.as_mut_ptr().cast(),
                    20,
                    DType::F32 as u32,
                    0,
                    5000,
                    &mut err,
                )
            };
            assert_eq!(code, RINGLET_OK);
            let inp = [r as i32; 3];
            let mut all = [0i32; 6];
            // SAFETY: as above; distinct buffers.
            let code = unsafe {
                (TABLE.all_gather)(
                    g,
                    inp.as_ptr().cast(),
                    12,
                    all.as_mut_ptr().cast(),
                    24,
                    DType::I32 as u32,
                    5000,
                    &mut err,
                )
            };
            assert_eq!(code, RINGLET_OK);
            let mut b = [r as u8 * 7; 4];
            // SAFETY: as above.
            let code = unsafe {
                (TABLE.broadcast)(
                    g,
                    b.as_mut_ptr().cast(),
                    4,
                    DType::U8 as u32,
                    1,
                    5000,
                    &mut err,
                )
            };
            assert_eq!(code, RINGLET_OK);
            let rs_in = [1.0f64, 2.0, 3.0, 4.0];
            let mut rs_out = [0.0f64; 2];
            // SAFETY: as above.
            let code = unsafe {
                (TABLE.reduce_scatter)(
                    g,
                    rs_in.as_ptr().cast(),
                    32,
                    rs_out.as_mut_ptr().cast(),
                    16,
                    DType::F64 as u32,
                    3,
                    5000,
                    &mut err,
                )
            };
            assert_eq!(code, RINGLET_OK);
            let send = [r as i64 * 10, r as i64 * 10 + 1];
            let mut recv = [0i64; 2];
            let counts = [1usize, 1];
            // SAFETY: as above; two counts each.
            let code = unsafe {
                (TABLE.all_to_all)(
                    g,
                    send.as_ptr().cast(),
                    16,
                    counts.as_ptr(),
                    recv.as_mut_ptr().cast(),
                    16,
                    counts.as_ptr(),
                    2,
                    DType::I64 as u32,
                    5000,
                    &mut err,
                )
            };
            assert_eq!(code, RINGLET_OK);
            // SAFETY: as above.
            assert_eq!(unsafe { (TABLE.barrier)(g, 5000, &mut err) }, RINGLET_OK);
            (x, all, b, rs_out, recv)
        });
        for (r, (x, all, b, rs_out, recv)) in out.into_iter().enumerate() {
            assert_eq!(x, [3.0; 5]);
            assert_eq!(all, [0, 0, 0, 1, 1, 1]);
            assert_eq!(b, [7; 4]);
            assert_eq!(rs_out, if r == 0 { [1.0, 2.0] } else { [3.0, 4.0] });
            assert_eq!(recv, [r as i64, 10 + r as i64]);
        }
        free(gs);
    }

    #[test]
    fn a_busy_queue_keeps_issue_order() {
        let gs = groups(2);
        let log = Arc::new(Mutex::new(Vec::new()));
        let out = each(&gs, |r, g| {
            let queue = &gs[r].0;
            // An earlier job (as a Python job of the group would be) that
            // holds the queue until released, then records itself.
            let (tx, rx) = mpsc::channel::<()>();
            let l = Arc::clone(&log);
            queue
                .submit(
                    Box::new(move || {
                        let _ = rx.recv();
                        l.lock().unwrap().push((r, "job"));
                    }),
                    true,
                )
                .unwrap();
            let releaser = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                tx.send(()).unwrap();
            });
            let mut x = [1u8 + r as u8; 3];
            let mut err = std::ptr::null_mut();
            // SAFETY: a live handle and buffer, a writable err slot.
            let code = unsafe {
                (TABLE.all_reduce)(
                    g as *const NativeGroup,
                    x.as_mut_ptr().cast(),
                    3,
                    DType::U8 as u32,
                    0,
                    5000,
                    &mut err,
                )
            };
            log.lock().unwrap().push((r, "all_reduce"));
            releaser.join().unwrap();
            (code, x)
        });
        for (code, x) in out {
            assert_eq!(code, RINGLET_OK);
            assert_eq!(x, [3; 3]);
        }
        for r in 0..2 {
            let mine: Vec<_> = log
                .lock()
                .unwrap()
                .iter()
                .filter(|e| e.0 == r)
                .map(|e| e.1)
                .collect();
            assert_eq!(mine, ["job", "all_reduce"]);
        }
        free(gs);
    }

    #[test]
    fn errors_come_back_with_their_message() {
        let gs = groups(1);
        let g = gs[0].1 as *const NativeGroup;
        let mut x = [1.0f32; 2];
        let mut err = std::ptr::null_mut();
        // SAFETY: a live handle and buffer; dtype code 99 is refused.
        let code =
            unsafe { (TABLE.all_reduce)(g, x.as_mut_ptr().cast(), 8, 99, 0, 5000, &mut err) };
        assert_eq!(code, RINGLET_ERROR);
        // SAFETY: `err` was just set by the call.
        let msg = unsafe { std::ffi::CStr::from_ptr((TABLE.error_message)(err)) };
        assert!(
            msg.to_str().unwrap().contains("unknown dtype code 99"),
            "{msg:?}"
        );
        // SAFETY: freed once.
        unsafe { (TABLE.error_free)(err) };
        // A float tensor with a bitwise op: the engine's own check.
        let mut err = std::ptr::null_mut();
        // SAFETY: as above.
        let code = unsafe {
            (TABLE.all_reduce)(
                g,
                x.as_mut_ptr().cast(),
                8,
                0,
                ReduceOp::Xor as u32,
                5000,
                &mut err,
            )
        };
        assert_eq!(code, RINGLET_ERROR);
        // SAFETY: taken once.
        let e = unsafe { CError::take(err) }.unwrap();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.starts_with("rank 0: ")),
            "{e}"
        );
        // Overlapping buffers are refused before any data moves.
        let mut err = std::ptr::null_mut();
        let p = x.as_mut_ptr().cast::<c_void>();
        // SAFETY: as above.
        let code = unsafe { (TABLE.all_gather)(g, p, 4, p, 4, 0, 5000, &mut err) };
        assert_eq!(code, RINGLET_ERROR);
        // SAFETY: freed once.
        unsafe { (TABLE.error_free)(err) };
        // SAFETY: a null handle is an error, not a crash.
        let code = unsafe { (TABLE.barrier)(std::ptr::null(), 5000, &mut err) };
        assert_eq!(code, RINGLET_ERROR);
        // SAFETY: freed once.
        unsafe { (TABLE.error_free)(err) };
        free(gs);
    }

    #[test]
    fn a_call_queued_behind_a_stuck_job_times_out_and_never_runs() {
        let gs = groups(1);
        let (queue, g) = (&gs[0].0, gs[0].1);
        let (tx, rx) = mpsc::channel::<()>();
        let (started_tx, started) = mpsc::channel::<()>();
        // Held by the progress thread (never by this waiter) until released.
        let stuck = queue
            .submit(
                Box::new(move || {
                    started_tx.send(()).unwrap();
                    let _ = rx.recv();
                }),
                true,
            )
            .unwrap();
        started.recv().unwrap();
        let mut x = [5i32; 2];
        let mut err = std::ptr::null_mut();
        // SAFETY: a live handle and buffer.
        let code = unsafe {
            (TABLE.all_reduce)(
                g as *const NativeGroup,
                x.as_mut_ptr().cast(),
                8,
                DType::I32 as u32,
                0,
                30,
                &mut err,
            )
        };
        assert_eq!(code, RINGLET_ERROR);
        // SAFETY: taken once.
        let e = unsafe { CError::take(err) }.unwrap();
        assert!(matches!(e, Error::Stalled { .. }), "{e}");
        assert!(e.to_string().contains("Timed out after"), "{e}");
        tx.send(()).unwrap();
        assert!(queue.wait(stuck + 1, Some(Duration::from_secs(5))).unwrap());
        assert_eq!(x, [5, 5]);
        free(gs);
    }
}
