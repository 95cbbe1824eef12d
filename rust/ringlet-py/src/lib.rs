//! `ringlet._core`: the PyO3 binding of ringlet-core. It converts arguments,
//! releases the GIL around every call into the engine, turns panics into
//! exceptions and maps errors (in `errors.rs`). Nothing else.

mod algorithms;
mod errors;
mod progress;
mod registry;
mod rpc;

use core::buf::RawBuf;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use ringlet_core as core;
use std::cell::RefCell;
use std::net::TcpListener;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use std::thread::ThreadId;
use std::time::Duration;

static MAIN_THREAD: OnceLock<ThreadId> = OnceLock::new();

thread_local! {
    /// The exception a signal handler raised while this thread was blocked
    /// in the engine (re-raised by `run` instead of the engine's error).
    static PENDING: RefCell<Option<PyErr>> = const { RefCell::new(None) };
}

/// The engine's interrupt hook: on the main thread, runs pending Python
/// signal handlers (a handler may call `ringlet.abort()`); true when one
/// raised (Ctrl-C), which stops the blocked collective.
fn run_signal_handlers() -> bool {
    if MAIN_THREAD.get() != Some(&std::thread::current().id()) {
        return false;
    }
    Python::with_gil(|py| match py.check_signals() {
        Ok(()) => false,
        Err(e) => {
            PENDING.with(|p| *p.borrow_mut() = Some(e));
            true
        }
    })
}

/// Runs `f` without the GIL, converting panics and engine errors to Python
/// exceptions. Every call into the engine goes through here.
pub(crate) fn run<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> core::Result<T> + Send,
) -> PyResult<T> {
    match py.allow_threads(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => match PENDING.with(|p| p.borrow_mut().take()) {
            Some(raised) => Err(raised),
            None => Err(errors::to_pyerr(e)),
        },
        Err(panic) => Err(PyRuntimeError::new_err(core::error::panic_message(&*panic))),
    }
}

/// A byte range of memory owned by a Python object (a tensor or an array)
/// that the caller keeps alive and does not touch during the call.
pub(crate) fn raw_buf(ptr: usize, len: usize) -> PyResult<RawBuf> {
    RawBuf::new(ptr, len).map_err(errors::to_pyerr)
}

/// The input and output buffers of an out-of-place collective, checked not
/// to overlap.
fn in_out(
    in_ptr: usize,
    in_len: usize,
    out_ptr: usize,
    out_len: usize,
) -> PyResult<(RawBuf, RawBuf)> {
    core::buf::in_out(in_ptr, in_len, out_ptr, out_len).map_err(errors::to_pyerr)
}

/// Runs `f` with the GIL released (see [`run`]) on the input and output
/// buffers of an out-of-place call, each a (data pointer, byte size) pair,
/// checked not to overlap.
pub(crate) fn run_in_out<T: Send>(
    py: Python<'_>,
    input: (usize, usize),
    output: (usize, usize),
    f: impl FnOnce(&[u8], &mut [u8]) -> core::Result<T> + Send,
) -> PyResult<T> {
    let (i, o) = in_out(input.0, input.1, output.0, output.1)?;
    // SAFETY: two distinct (checked) contiguous CPU tensors that the Python
    // wrapper keeps referenced, and leaves alone, for the whole call.
    run(py, move || {
        f(unsafe { i.slice() }, unsafe { o.slice_mut() })
    })
}

/// Where a group's ranks sit across hosts: the one plan of the core's two
/// levels and Bagua's (ringlet-core's `plan`), its facts read once.
#[pyclass(module = "ringlet._core", frozen)]
pub(crate) struct Plan {
    pub(crate) inner: core::plan::Plan,
    /// The group ranks of each host, hosts in order of their lowest rank.
    #[pyo3(get)]
    layout: Vec<Vec<usize>>,
    /// This rank's host (its place in `layout`).
    #[pyo3(get)]
    host: usize,
    /// This rank's index among its host's ranks.
    #[pyo3(get)]
    index: usize,
    /// The group ranks on this rank's host.
    #[pyo3(get)]
    local: Vec<usize>,
    /// Each host's first rank, hosts in order.
    #[pyo3(get)]
    leaders: Vec<usize>,
    /// Whether every host holds the same number of ranks.
    #[pyo3(get)]
    even: bool,
    /// Whether Bagua's levels have channel communicators.
    #[pyo3(get)]
    has_channels: bool,
    /// Channels per cross-host buffer (the lcm of the hosts' rank counts).
    #[pyo3(get)]
    channels: usize,
    /// Whether the group's collectives stay on one level.
    #[pyo3(get)]
    flat: bool,
}

#[pymethods]
impl Plan {
    /// The plan of a group whose rank r runs on host `hosts[r]`, seen from
    /// `rank`.
    #[new]
    fn new(hosts: Vec<String>, rank: usize) -> PyResult<Self> {
        let p = core::plan::Plan::of_hosts(&hosts, rank).map_err(errors::to_pyerr)?;
        Ok(Plan {
            layout: p.layout().to_vec(),
            host: p.host(),
            index: p.index(),
            local: p.local().to_vec(),
            leaders: p.leaders(),
            even: p.even(),
            has_channels: p.has_channels(),
            channels: p.channels(),
            flat: p.flat(),
            inner: p,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan(layout={:?}, host={}, index={})",
            self.layout, self.host, self.index
        )
    }
}

/// A listening TCP socket; its port is published before connecting.
#[pyclass(module = "ringlet._core")]
struct Listener {
    inner: TcpListener,
}

#[pymethods]
impl Listener {
    #[new]
    fn new(addr: &str) -> PyResult<Self> {
        Ok(Listener {
            inner: core::transport::tcp::listen(addr).map_err(errors::to_pyerr)?,
        })
    }

    /// The port the socket listens on.
    #[getter]
    fn port(&self) -> PyResult<u16> {
        self.inner
            .local_addr()
            .map(|a| a.port())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }
}

/// One rank's endpoint in a group; all collectives are methods.
#[pyclass(module = "ringlet._core", frozen)]
pub(crate) struct Communicator {
    pub(crate) inner: core::SharedCommunicator,
}

impl Communicator {
    fn wrap(c: core::Communicator) -> Self {
        Communicator {
            inner: core::SharedCommunicator::new(c),
        }
    }

    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut core::Communicator) -> core::Result<T> + Send,
    ) -> PyResult<T> {
        run(py, || self.inner.with(f))
    }

    /// [`Communicator::with`] for an out-of-place collective: `f` gets the
    /// input and output buffers (see [`run_in_out`]).
    fn with_in_out(
        &self,
        py: Python<'_>,
        input: (usize, usize),
        output: (usize, usize),
        f: impl FnOnce(&mut core::Communicator, &[u8], &mut [u8]) -> core::Result<()> + Send,
    ) -> PyResult<()> {
        run_in_out(py, input, output, |i, o| self.inner.with(|c| f(c, i, o)))
    }
}

fn dtype(name: &str) -> PyResult<core::DType> {
    core::DType::from_name(name).map_err(errors::to_pyerr)
}

fn op(name: &str) -> PyResult<core::ReduceOp> {
    core::ReduceOp::from_name(name).map_err(errors::to_pyerr)
}

#[pymethods]
impl Communicator {
    /// A world of one rank (no network), failing with `domain`.
    #[staticmethod]
    #[pyo3(signature = (domain=0))]
    fn single(domain: u64) -> Self {
        Communicator::wrap(core::Communicator::single(core::Config {
            domain,
            ..core::Config::default()
        }))
    }

    /// Connects to every rank in the peer table (blocks without the GIL).
    #[staticmethod]
    #[pyo3(signature = (listener, rank, addrs, hosts, token, timeout_s, force_tcp=false, slot_bytes=core::group::DEFAULT_SLOT_BYTES, cma=true, cma_threshold=core::group::DEFAULT_CMA_THRESHOLD, small_bytes=64<<10, spins=2000, spin_us=50, long_spin_us=2000, yield_us=0, members=Vec::new(), name=String::new(), domain=0))]
    #[allow(clippy::too_many_arguments)]
    fn connect(
        py: Python<'_>,
        listener: &Listener,
        rank: usize,
        addrs: Vec<String>,
        hosts: Vec<String>,
        token: u64,
        timeout_s: f64,
        force_tcp: bool,
        slot_bytes: usize,
        cma: bool,
        cma_threshold: usize,
        small_bytes: usize,
        spins: u32,
        spin_us: u64,
        long_spin_us: u64,
        yield_us: u64,
        members: Vec<usize>,
        name: String,
        domain: u64,
    ) -> PyResult<Self> {
        if !(timeout_s.is_finite() && timeout_s > 0.0) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "timeout must be a positive number of seconds, got {timeout_s}"
            )));
        }
        let cfg = core::Config {
            timeout: Duration::from_secs_f64(timeout_s),
            force_tcp,
            slot_bytes,
            cma,
            cma_threshold,
            small_bytes,
            spins,
            spin_for: Duration::from_micros(spin_us),
            long_spin_for: Duration::from_micros(long_spin_us),
            yield_for: Duration::from_micros(yield_us),
            members,
            name,
            domain,
        };
        let l = &listener.inner;
        let c = run(py, || {
            core::Communicator::connect(rank, &addrs, &hosts, l, token, cfg)
        })?;
        Ok(Communicator::wrap(c))
    }

    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    /// `"local"`, `"shm+cma"`, `"shm"` or `"tcp"`.
    #[getter]
    fn transport(&self) -> &'static str {
        self.inner.transport()
    }

    /// TCP streams to peers open now (they open on demand in groups of more
    /// than 3 ranks that span hosts).
    fn open_streams(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |c| Ok(c.open_streams()))
    }

    /// The longest wait for a peer without progress, in seconds.
    fn timeout(&self, py: Python<'_>) -> PyResult<f64> {
        self.with(py, |c| Ok(c.timeout().as_secs_f64()))
    }

    /// Changes the longest wait for a peer without progress (seconds) for
    /// the operations that start from now on; waits for a running one.
    fn set_timeout(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        if !(timeout_s.is_finite() && timeout_s > 0.0) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "timeout must be a positive number of seconds, got {timeout_s}"
            )));
        }
        self.with(py, move |c| {
            c.set_timeout(Duration::from_secs_f64(timeout_s));
            Ok(())
        })
    }

    pub(crate) fn all_reduce(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        dtype_name: &str,
        op_name: &str,
    ) -> PyResult<()> {
        let (d, o, buf) = (dtype(dtype_name)?, op(op_name)?, raw_buf(ptr, nbytes)?);
        // SAFETY: the Python wrapper passes the data pointer and byte size of a
        // contiguous CPU tensor it keeps referenced for the whole call.
        self.with(py, move |c| c.all_reduce(unsafe { buf.slice_mut() }, d, o))
    }

    fn all_reduce_into(
        &self,
        py: Python<'_>,
        in_ptr: usize,
        out_ptr: usize,
        nbytes: usize,
        dtype_name: &str,
        op_name: &str,
    ) -> PyResult<()> {
        let (d, o) = (dtype(dtype_name)?, op(op_name)?);
        self.with_in_out(py, (in_ptr, nbytes), (out_ptr, nbytes), move |c, i, out| {
            c.all_reduce_into(i, out, d, o)
        })
    }

    fn all_gather(
        &self,
        py: Python<'_>,
        in_ptr: usize,
        in_nbytes: usize,
        out_ptr: usize,
        out_nbytes: usize,
        dtype_name: &str,
    ) -> PyResult<()> {
        let d = dtype(dtype_name)?;
        self.with_in_out(
            py,
            (in_ptr, in_nbytes),
            (out_ptr, out_nbytes),
            move |c, i, o| c.all_gather(i, o, d),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        in_ptr: usize,
        in_nbytes: usize,
        out_ptr: usize,
        out_nbytes: usize,
        dtype_name: &str,
        op_name: &str,
    ) -> PyResult<()> {
        let (d, op) = (dtype(dtype_name)?, op(op_name)?);
        self.with_in_out(
            py,
            (in_ptr, in_nbytes),
            (out_ptr, out_nbytes),
            move |c, i, o| c.reduce_scatter(i, o, d, op),
        )
    }

    fn broadcast(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        dtype_name: &str,
        root: usize,
    ) -> PyResult<()> {
        let (d, buf) = (dtype(dtype_name)?, raw_buf(ptr, nbytes)?);
        // SAFETY: as in all_reduce.
        self.with(py, move |c| {
            c.broadcast(unsafe { buf.slice_mut() }, d, root)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn all_to_all_v(
        &self,
        py: Python<'_>,
        in_ptr: usize,
        in_nbytes: usize,
        send_counts: Vec<usize>,
        out_ptr: usize,
        out_nbytes: usize,
        recv_counts: Vec<usize>,
        dtype_name: &str,
    ) -> PyResult<()> {
        let d = dtype(dtype_name)?;
        self.with_in_out(
            py,
            (in_ptr, in_nbytes),
            (out_ptr, out_nbytes),
            move |c, i, o| c.all_to_all_v(i, &send_counts, o, &recv_counts, d),
        )
    }

    fn send(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        dtype_name: &str,
        peer: usize,
        tag: u32,
    ) -> PyResult<()> {
        let (d, buf) = (dtype(dtype_name)?, raw_buf(ptr, nbytes)?);
        // SAFETY: a contiguous CPU tensor kept alive by the Python wrapper for
        // the whole call; only read.
        self.with(py, move |c| c.send(unsafe { buf.slice() }, d, peer, tag))
    }

    fn recv(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        dtype_name: &str,
        peer: usize,
        tag: u32,
    ) -> PyResult<()> {
        let (d, buf) = (dtype(dtype_name)?, raw_buf(ptr, nbytes)?);
        // SAFETY: as in all_reduce.
        self.with(py, move |c| {
            c.recv(unsafe { buf.slice_mut() }, d, peer, tag)
        })
    }

    /// Runs this communicator's collectives in two levels: `local` (this
    /// host's ranks, shared memory; taken over, it cannot be used on its
    /// own afterwards) and TCP across hosts; `layout` lists each host's
    /// ranks (group ranks, in `local`'s rank order).
    fn attach_levels(
        &self,
        py: Python<'_>,
        local: &Communicator,
        layout: Vec<Vec<usize>>,
    ) -> PyResult<()> {
        let level = run(py, || {
            local.inner.take()?.ok_or_else(|| {
                core::Error::InvalidArgument("the local communicator is closed or attached".into())
            })
        })?;
        self.with(py, move |c| c.attach_levels(level, layout))
    }

    /// Each host's ranks when the collectives run in two levels, else None.
    fn host_layout(&self, py: Python<'_>) -> PyResult<Option<Vec<Vec<usize>>>> {
        self.with(py, |c| Ok(c.host_layout().map(<[Vec<usize>]>::to_vec)))
    }

    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |c| c.barrier())
    }

    /// The message `peer` has started sending on this two-rank communicator
    /// and this rank has not received: `(tag, element count, dtype name)`,
    /// or None; raises what a receive would raise when the peer is gone.
    /// Never blocks on the peer.
    fn pending_message(
        &self,
        py: Python<'_>,
        peer: usize,
    ) -> PyResult<Option<(u64, u64, &'static str)>> {
        let got = self.with(py, move |c| c.pending_message(peer))?;
        Ok(got.map(|(tag, count, d)| (tag, count, d.name())))
    }

    /// Waits (GIL released) until `peer` starts sending a message and
    /// returns it as `(tag, element count, dtype name)` without receiving it.
    fn wait_message(&self, py: Python<'_>, peer: usize) -> PyResult<(u64, u64, &'static str)> {
        let (tag, count, d) = self.with(py, move |c| c.wait_message(peer))?;
        Ok((tag, count, d.name()))
    }

    /// True when a fatal error made the communicator unusable, or it was
    /// closed.
    fn failed(&self, py: Python<'_>) -> bool {
        py.allow_threads(|| self.inner.failed())
    }

    /// Closes the connections; later calls raise.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        run(py, || {
            drop(self.inner.take());
            Ok(())
        })
    }
}

/// Aborts every communicator of `domain` (`ringlet.abort()`): a thread
/// blocked in one raises within milliseconds; peers learn that global rank
/// `rank` aborted. Takes no lock a blocked collective holds.
#[pyfunction]
fn abort_domain(py: Python<'_>, domain: u64, rank: usize) {
    py.allow_threads(|| core::fault::abort_domain(domain, rank));
}

/// The address of the engine's C ABI table (`ringlet_core::capi::TABLE`),
/// for the C++ torch.distributed Backend: it calls the engine through it
/// without linking against this module.
#[pyfunction]
fn capi_table() -> usize {
    std::ptr::addr_of!(core::capi::TABLE) as usize
}

/// A C ABI handle (an address) over a process group's progress queue and
/// communicator, owned from now on by the caller, who frees it with the
/// table's `group_free` (the C++ Backend does).
#[pyfunction]
fn native_group(queue: &progress::Progress, comm: &Communicator) -> PyResult<usize> {
    let q = queue.shared().map_err(errors::to_pyerr)?;
    Ok(core::capi::NativeGroup::new(q, comm.inner.clone()).into_raw() as usize)
}

/// The Python exception for an error the C ABI returned (an address the
/// C++ Backend hands over; taken here and freed). A signal handler's
/// exception raised while that call blocked on this thread (Ctrl-C) wins,
/// as in every engine call.
///
/// Only for the C++ Backend: `err` must be an error address from the C ABI,
/// passed once.
#[pyfunction]
fn native_error(err: usize) -> PyErr {
    if let Some(raised) = PENDING.with(|p| p.borrow_mut().take()) {
        // SAFETY: per this function's contract, a live error address.
        drop(unsafe { core::capi::CError::take(err as *mut core::capi::CError) });
        return raised;
    }
    // SAFETY: per this function's contract, a live error address, taken once.
    match unsafe { core::capi::CError::take(err as *mut core::capi::CError) } {
        Some(e) => errors::to_pyerr(e),
        None => PyRuntimeError::new_err("ringlet internal error: a null error address"),
    }
}

/// The SIMD variant of each vector kernel on this CPU: the float16 and
/// bfloat16 reductions and conversions and the MinMaxUInt8 codec, chosen at
/// run time (`"avx512f+f16c"`, `"avx2+f16c"`, `"avx2"`, `"portable"`, ...),
/// and the instruction set the float32, float64 and integer loops were
/// compiled for (the compiler vectorises them; no run-time choice).
#[pyfunction]
fn simd_kernels() -> std::collections::BTreeMap<&'static str, &'static str> {
    let mut kernels: std::collections::BTreeMap<_, _> =
        core::reduce::selected_kernels().into_iter().collect();
    kernels.insert(
        "minmax_uint8 codec",
        core::algorithms::codec::selected_kernel(),
    );
    let compiled = if cfg!(target_feature = "avx512f") {
        "avx512f (compiled in)"
    } else if cfg!(target_feature = "avx2") {
        "avx2 (compiled in)"
    } else if cfg!(target_feature = "sse2") {
        "sse2 (compiled in)"
    } else if cfg!(target_arch = "aarch64") {
        "neon (compiled in)"
    } else {
        "scalar (compiled in)"
    };
    kernels.insert("float32/float64/integer reduce", compiled);
    kernels
}

/// Identity of this machine (hostname and boot id).
#[pyfunction]
fn host_identity() -> String {
    core::host_identity()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", core::version())?;
    // Python runs signal handlers on the thread that imported it first (the
    // main thread), which is where ringlet is imported in practice.
    let _ = MAIN_THREAD.set(std::thread::current().id());
    core::fault::set_interrupt_hook(run_signal_handlers);
    m.add_class::<Listener>()?;
    m.add_class::<Plan>()?;
    m.add_class::<Communicator>()?;
    m.add_class::<registry::TensorModule>()?;
    m.add_class::<algorithms::Comms>()?;
    m.add_class::<algorithms::CentralizedOp>()?;
    m.add_class::<algorithms::DecentralizedOp>()?;
    m.add_class::<algorithms::LowPrecisionOp>()?;
    m.add_class::<algorithms::AsyncAverager>()?;
    m.add_class::<algorithms::OuterSync>()?;
    m.add_function(wrap_pyfunction!(algorithms::pseudo_gradient, m)?)?;
    m.add_function(wrap_pyfunction!(algorithms::flat_scatter, m)?)?;
    m.add_function(wrap_pyfunction!(algorithms::flat_gather, m)?)?;
    m.add_function(wrap_pyfunction!(algorithms::codec_compress, m)?)?;
    m.add_function(wrap_pyfunction!(algorithms::codec_decompress, m)?)?;
    m.add_function(wrap_pyfunction!(algorithms::codec_compressed_len, m)?)?;
    m.add_function(wrap_pyfunction!(algorithms::minmax_uint8_compress, m)?)?;
    m.add_function(wrap_pyfunction!(algorithms::minmax_uint8_decompress, m)?)?;
    m.add_function(wrap_pyfunction!(
        algorithms::minmax_uint8_compressed_len,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(algorithms::shift_one_peer, m)?)?;
    m.add_class::<progress::Progress>()?;
    m.add_class::<progress::NativeJob>()?;
    m.add_class::<rpc::RpcAgent>()?;
    m.add_class::<rpc::RpcMessage>()?;
    m.add_class::<rpc::RpcReply>()?;
    for (name, code) in rpc::status_codes() {
        m.add(name, code)?;
    }
    m.add_function(wrap_pyfunction!(host_identity, m)?)?;
    m.add_function(wrap_pyfunction!(simd_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(abort_domain, m)?)?;
    m.add_function(wrap_pyfunction!(capi_table, m)?)?;
    m.add_function(wrap_pyfunction!(native_group, m)?)?;
    m.add_function(wrap_pyfunction!(native_error, m)?)?;
    Ok(())
}
