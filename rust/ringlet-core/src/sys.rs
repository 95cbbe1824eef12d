//! Thin safe wrappers over the Linux system calls the transports need, and
//! the streaming (non-temporal) copy. All of the engine's FFI lives here, so
//! every `unsafe` call site is in this module, in `transport/shm/segment.rs`
//! (pointer access into mapped memory) or in the SIMD reduce kernels.

use crate::error::{Error, Result};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

fn last_err(context: &str) -> Error {
    Error::io(context, io::Error::last_os_error())
}

/// An anonymous memory file (`memfd_create`) of `len` bytes. It has no name in
/// any file system, so nothing is left behind when the processes exit, however
/// they exit.
pub fn memfd(len: usize) -> Result<OwnedFd> {
    let name = CString::new("ringlet-shm").map_err(|e| Error::InvalidArgument(e.to_string()))?;
    // SAFETY: `name` is a valid NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(last_err("memfd_create"));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscall on a valid fd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(last_err("ftruncate of the shared-memory file"));
    }
    // Owner-only permissions: other users cannot open it through /proc.
    // SAFETY: plain syscall on a valid fd.
    unsafe { libc::fchmod(fd.as_raw_fd(), 0o600) };
    Ok(fd)
}

/// Opens another process's memfd through `/proc/<pid>/fd/<fd>` (needs the same
/// user; the kernel checks ptrace-read permission).
pub fn open_peer_fd(pid: u32, fd: i32) -> Result<OwnedFd> {
    let path = CString::new(format!("/proc/{pid}/fd/{fd}"))
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    // SAFETY: `path` is a valid NUL-terminated string.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(last_err(&format!("open /proc/{pid}/fd/{fd}")));
    }
    // SAFETY: `raw` is a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// A shared read-write mapping of a whole file; unmapped on drop.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all cross-thread access goes
// through atomics or through the collectives' phase protocol.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` shared and read-write.
    pub fn new(fd: &OwnedFd, len: usize) -> Result<Mapping> {
        // SAFETY: a fresh mapping chosen by the kernel (addr = NULL) cannot
        // overlap any Rust object; the fd is valid for the call.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(last_err("mmap of the shared-memory file"));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| last_err("mmap returned null"))?;
        Ok(Mapping { ptr, len })
    }

    /// Start of the mapping (page aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Faults every page of the mapping in now, so that the first operations
    /// do not each pay page faults (allocation and zeroing of a shared page,
    /// then one page-table entry per process): without it a communicator's
    /// first pass through its staging windows ran at 2.5x the steady cost.
    ///
    /// `MADV_POPULATE_WRITE` (Linux 5.14) allocates the pages and maps them
    /// writable without changing a byte; older kernels get one read per page,
    /// which allocates a shared-memory page and maps it as well. Must run
    /// before any rank writes data into the segment (the reads would race).
    pub fn prefault(&self) {
        // SAFETY: `ptr`/`len` describe exactly this mapping; POPULATE_WRITE
        // changes no contents (it only simulates write faults).
        let rc = unsafe {
            libc::madvise(
                self.ptr.as_ptr().cast(),
                self.len,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if rc == 0 {
            return;
        }
        for off in (0..self.len).step_by(4096) {
            // SAFETY: off < len, so the byte lies inside the mapping; the
            // caller guarantees nobody writes the segment yet, and the value
            // read is discarded.
            unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(off)) };
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe exactly the mapping created in `new`;
        // no references into it outlive `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Sleeps while `*word == expected`, for at most `timeout` (futex, shared
/// between processes). Spurious returns are fine: callers re-check.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call; the
    // kernel only reads it and the timespec.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

/// Wakes every process sleeping in `futex_wait` on `word`.
pub fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE does not dereference
    // any other pointer.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

/// Copies `dst.len()` bytes from address `remote` in process `pid` into `dst`
/// (cross-memory attach, one copy, no kernel buffer).
pub fn read_peer_memory(pid: u32, remote: u64, dst: &mut [u8]) -> io::Result<()> {
    cross_memory(remote, dst.len(), "process_vm_readv", |done, remote_iov| {
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr().cast(),
            iov_len: remote_iov.iov_len,
        };
        // SAFETY: the local iovec covers exactly the writable rest of `dst`;
        // the remote iovec is only interpreted in the other process's address
        // space by the kernel, which validates it.
        unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, remote_iov, 1, 0) }
    })
}

/// Copies `src` to address `remote` in process `pid` (cross-memory attach,
/// one copy, no kernel buffer).
pub fn write_peer_memory(pid: u32, remote: u64, src: &[u8]) -> io::Result<()> {
    cross_memory(
        remote,
        src.len(),
        "process_vm_writev",
        |done, remote_iov| {
            let local = libc::iovec {
                iov_base: src[done..].as_ptr() as *mut libc::c_void,
                iov_len: remote_iov.iov_len,
            };
            // SAFETY: the local iovec covers exactly the readable rest of `src`,
            // which the kernel only reads; the remote iovec is interpreted (and
            // validated) in the other process's address space.
            unsafe { libc::process_vm_writev(pid as libc::pid_t, &local, 1, remote_iov, 1, 0) }
        },
    )
}

/// Moves `len` bytes at `remote` with `call(done, remote_iov)` until all have
/// moved (the kernel may move fewer per call than asked).
fn cross_memory(
    remote: u64,
    len: usize,
    what: &str,
    mut call: impl FnMut(usize, &libc::iovec) -> isize,
) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let remote_iov = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let n = call(done, &remote_iov);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{what} moved nothing"),
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// True when the peer has closed (or reset) the stream `fd`: used to notice a
/// dead process while waiting on shared memory. Never consumes data.
pub fn stream_closed(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && (p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL)) != 0
}

/// Copies up to `buf.len()` bytes waiting on `fd` without consuming them;
/// never blocks (0: the peer closed the stream; `WouldBlock`: nothing yet).
pub fn peek_now(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a valid writable slice for the call; the kernel
    // validates `fd`.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            libc::MSG_DONTWAIT | libc::MSG_PEEK,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Waits until some of `fds` are ready for the requested events or `timeout`
/// passes. Returns the pollfds with `revents` filled in.
pub fn poll(fds: &mut [libc::pollfd], timeout: Duration) -> Result<()> {
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid mutable slice of pollfd for the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(Error::io("poll", err));
        }
    }
    Ok(())
}

/// This process's id.
pub fn pid() -> u32 {
    std::process::id()
}

/// Tasks runnable on the machine right now (running or waiting for a CPU,
/// this one included), from `/proc/loadavg`'s fourth field; `None` where it
/// cannot be read.
pub fn runnable_tasks() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let field = text.split_whitespace().nth(3)?;
    field.split('/').next()?.parse().ok()
}

/// The CPU the calling thread runs on (`sched_getcpu`, a vDSO call: no
/// system call on x86-64), or `u32::MAX` where it cannot be told.
pub fn current_cpu() -> u32 {
    // SAFETY: sched_getcpu takes no arguments and touches no memory of ours.
    let cpu = unsafe { libc::sched_getcpu() };
    u32::try_from(cpu).unwrap_or(u32::MAX)
}

/// CPUs this process may run on (affinity and cgroup quota included).
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Gives the CPU to another runnable thread.
pub fn yield_now() {
    std::thread::yield_now();
}

/// Asks the kernel to back the 2 MiB-aligned interior of `buf` with huge
/// pages (`MADV_HUGEPAGE`), so that filling fresh memory takes 512x fewer
/// page faults. Advice only: failure changes nothing and is ignored.
pub fn advise_huge_pages(buf: &mut [u8]) {
    const HUGE: usize = 2 << 20;
    let start = buf.as_mut_ptr() as usize;
    let first = start.div_ceil(HUGE) * HUGE;
    let end = (start + buf.len()) / HUGE * HUGE;
    if end > first {
        // SAFETY: [first, end) lies inside `buf`, which we borrow mutably;
        // MADV_HUGEPAGE changes no contents, only how pages are backed.
        unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
    }
}

/// Sends what the socket `fd` takes now without blocking (and without
/// SIGPIPE); returns the bytes sent.
pub fn send_now(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a valid readable slice for the call; the kernel
    // validates `fd`.
    let n = unsafe {
        libc::send(
            fd,
            buf.as_ptr() as *const libc::c_void,
            buf.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Receives what is queued on the socket `fd` without blocking; `Ok(0)` at
/// the end of the stream.
pub fn recv_now(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a valid writable slice for the call; the kernel
    // validates `fd`.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Half-closes the socket `fd` for writing: the peer reads the end of the
/// stream after the bytes already queued.
pub fn shutdown_write(fd: RawFd) {
    // SAFETY: plain syscall; an invalid fd only returns an error.
    unsafe { libc::shutdown(fd, libc::SHUT_WR) };
}

/// Makes unacknowledged data on the TCP socket `fd` fail the connection
/// (ETIMEDOUT) after `t` instead of the kernel's ~15 minutes of retries.
pub fn set_tcp_user_timeout(fd: RawFd, t: Duration) {
    let ms = t.as_millis().clamp(1, u32::MAX as u128) as libc::c_uint;
    // SAFETY: a valid pointer to a c_uint of the size passed.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            &ms as *const libc::c_uint as *const libc::c_void,
            std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
        )
    };
}

/// True when the TCP socket `fd` has sent data that the peer's host has not
/// acknowledged despite retransmissions: the network to it is down.
pub fn tcp_retransmitting(fd: RawFd) -> bool {
    // SAFETY: tcp_info is plain old data; all-zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` are valid for writing and `len` holds the
    // buffer's size.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            &mut info as *mut libc::tcp_info as *mut libc::c_void,
            &mut len,
        )
    };
    rc == 0 && info.tcpi_unacked > 0 && (info.tcpi_retransmits > 0 || info.tcpi_backoff > 0)
}

/// Copies `src` into `dst` (same length) with non-temporal stores on x86-64:
/// the destination lines go to memory without first being read into the
/// cache, which saves a third of the memory traffic of a copy into a buffer
/// larger than the cache that nobody reads back soon (the output of a large
/// collective). Ends with a store fence, so the bytes are visible to other
/// cores before any later store (such as the phase signal). Elsewhere, a
/// plain copy.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let len = dst.len();
        let head = dst.as_ptr().align_offset(16).min(len);
        dst[..head].copy_from_slice(&src[..head]);
        let body = (len - head) / 64 * 64;
        let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
        let mut i = 0;
        while i < body {
            // SAFETY: SSE2 is part of the x86-64 baseline. `i + 64 <= body`,
            // and `body` bytes from `head` lie inside both slices; `d + i` is
            // 16-byte aligned (`head` aligned it, and i steps by 64); loads
            // are unaligned. The slices do not overlap (`&mut` and `&`).
            unsafe {
                let a = _mm_loadu_si128(s.add(i) as *const __m128i);
                let b = _mm_loadu_si128(s.add(i + 16) as *const __m128i);
                let c = _mm_loadu_si128(s.add(i + 32) as *const __m128i);
                let e = _mm_loadu_si128(s.add(i + 48) as *const __m128i);
                _mm_stream_si128(d.add(i) as *mut __m128i, a);
                _mm_stream_si128(d.add(i + 16) as *mut __m128i, b);
                _mm_stream_si128(d.add(i + 32) as *mut __m128i, c);
                _mm_stream_si128(d.add(i + 48) as *mut __m128i, e);
            }
            i += 64;
        }
        let done = head + body;
        dst[done..].copy_from_slice(&src[done..]);
        // SAFETY: a store fence has no preconditions (SSE, x86-64 baseline).
        unsafe { _mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod streaming_tests {
    use super::copy_streaming;

    #[test]
    fn streaming_copy_matches_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        for off in 0..17 {
            for len in [0, 1, 15, 16, 63, 64, 65, 200, 1000, 4000 - off] {
                let mut dst = vec![0u8; len + off + 8];
                copy_streaming(&mut dst[off..off + len], &src[5..5 + len]);
                assert_eq!(&dst[off..off + len], &src[5..5 + len]);
                assert!(dst[..off].iter().all(|&b| b == 0));
                assert!(dst[off + len..].iter().all(|&b| b == 0));
            }
        }
    }
}
