//! Binding of Bagua's algorithms (`ringlet_core::algorithms`): the
//! communicators an algorithm runs on, its bucket operations (handed to a
//! `TensorModule` with `set_bucket_ops`, and kept by Python for their extra
//! methods), the asynchronous averager, and the MinMaxUInt8 codec on raw
//! buffers (for tests and benchmarks).

use crate::{dtype, raw_buf, run, run_in_out, Communicator, Plan};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use ringlet_core as core;
use ringlet_core::algorithms::{self as alg, HostTensor};
use ringlet_core::registry::{BucketOp, SharedOp};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The communicators of one algorithm instance: the group's (flat), or
/// Bagua's two levels.
#[pyclass(module = "ringlet._core", frozen)]
pub(crate) struct Comms {
    inner: alg::Comms,
}

#[pymethods]
impl Comms {
    /// Every rank of the group on `comm`.
    #[staticmethod]
    fn flat(comm: &Communicator) -> Self {
        Comms {
            inner: alg::Comms::Flat(comm.inner.clone()),
        }
    }

    /// The host's ranks on `intra` (its rank 0 is the host's leader), the
    /// hosts' leaders on `inter` (None on other ranks), laid out by `plan`.
    /// `channel`: where the plan has channels, the ranks at this rank's
    /// position on every host.
    #[staticmethod]
    #[pyo3(signature = (intra, inter, plan, channel=None))]
    fn hierarchical(
        intra: &Communicator,
        inter: Option<&Communicator>,
        plan: &Plan,
        channel: Option<&Communicator>,
    ) -> PyResult<Self> {
        let inner = alg::Comms::hierarchical(
            &plan.inner,
            intra.inner.clone(),
            inter.map(|c| c.inner.clone()),
            channel.map(|c| c.inner.clone()),
        )
        .map_err(crate::errors::to_pyerr)?;
        Ok(Comms { inner })
    }
}

/// Host memory of a CPU tensor for algorithm state.
fn host_tensor(
    ptr: usize,
    nbytes: usize,
    dtype_name: &str,
    owner: PyObject,
) -> PyResult<HostTensor> {
    let d = dtype(dtype_name)?;
    // SAFETY: the Python wrapper passes the data pointer and byte size of a
    // contiguous CPU tensor (`owner`, kept alive by the returned value), and
    // the algorithm's Python code does not write it while an operation of
    // the algorithm runs (it waits for the worker first).
    unsafe { HostTensor::new(ptr, nbytes, d, Some(Box::new(owner))) }
        .map_err(crate::errors::to_pyerr)
}

fn locked<T>(op: &SharedOp<T>) -> PyResult<std::sync::MutexGuard<'_, T>> {
    op.0.lock().map_err(|_| {
        pyo3::exceptions::PyRuntimeError::new_err(
            "ringlet internal error: algorithm state poisoned by an earlier panic",
        )
    })
}

/// Runs `f` on the operation, with the GIL released (see [`run`]); `what`
/// names it in the error when an earlier panic poisoned its state.
fn run_locked<T: Send, R: Send>(
    py: Python<'_>,
    op: &SharedOp<T>,
    what: &'static str,
    f: impl FnOnce(&mut T) -> core::Result<R> + Send,
) -> PyResult<R> {
    let op = SharedOp::clone(op);
    run(py, move || {
        let mut op = op.0.lock().map_err(|_| core::Error::Io {
            context: what.into(),
            message: "state poisoned by an earlier panic".into(),
        })?;
        f(&mut op)
    })
}

/// Sum or mean of a bucket over the group, exact or compressed
/// (`compression="MinMaxUInt8"`), with optional error feedback.
#[pyclass(module = "ringlet._core", frozen)]
pub(crate) struct CentralizedOp {
    op: SharedOp<alg::CentralizedOp>,
}

#[pymethods]
impl CentralizedOp {
    #[new]
    #[pyo3(signature = (comms, average, compression=None, error_feedback=false))]
    fn new(
        comms: &Comms,
        average: bool,
        compression: Option<&str>,
        error_feedback: bool,
    ) -> PyResult<Self> {
        let compress = compression.map(codec).transpose()?;
        let op = alg::CentralizedOp::new(comms.inner.clone(), average, compress, error_feedback)
            .map_err(crate::errors::to_pyerr)?;
        Ok(CentralizedOp {
            op: SharedOp(Arc::new(Mutex::new(op))),
        })
    }

    /// Runs the operation on `nbytes` of host memory at `ptr` (a contiguous
    /// CPU tensor the caller keeps alive and does not touch meanwhile);
    /// `key` picks the error-feedback residuals.
    fn apply(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        dtype_name: &str,
        key: u64,
    ) -> PyResult<()> {
        let (d, buf) = (dtype(dtype_name)?, raw_buf(ptr, nbytes)?);
        run_locked(py, &self.op, "a centralized operation", move |op| {
            // SAFETY: per this method's contract, `nbytes` of host memory at
            // `ptr` that nothing else touches during the call.
            op.apply(unsafe { buf.slice_mut() }, d, key)
        })
    }

    /// The error-feedback residuals of bucket `key` as (the sender's, the
    /// chunk owner's) raw bytes of the bucket's dtype; None before any.
    fn residuals<'py>(
        &self,
        py: Python<'py>,
        key: u64,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)>> {
        let got = locked(&self.op)?.residuals(key);
        Ok(got.map(|(w, s)| (PyBytes::new(py, &w), PyBytes::new(py, &s))))
    }
}

/// Gossip averaging of a bucket into a peer weight.
#[pyclass(module = "ringlet._core", frozen)]
pub(crate) struct DecentralizedOp {
    op: SharedOp<alg::DecentralizedOp>,
}

#[pymethods]
impl DecentralizedOp {
    /// `peer_*`: the peer weight (a contiguous CPU tensor of the bucket's
    /// size and dtype, `peer_owner`, kept alive by the operation).
    #[new]
    fn new(
        comms: &Comms,
        peer_selection_mode: &str,
        peer_ptr: usize,
        peer_nbytes: usize,
        dtype_name: &str,
        peer_owner: PyObject,
    ) -> PyResult<Self> {
        let mode =
            alg::PeerMode::from_name(peer_selection_mode).map_err(crate::errors::to_pyerr)?;
        let peer = host_tensor(peer_ptr, peer_nbytes, dtype_name, peer_owner)?;
        let op = alg::DecentralizedOp::new(comms.inner.clone(), mode, peer)
            .map_err(crate::errors::to_pyerr)?;
        Ok(DecentralizedOp {
            op: SharedOp(Arc::new(Mutex::new(op))),
        })
    }

    /// Hierarchical: copies the host leader's peer weight to the host's
    /// ranks (collective over the host); flat: nothing.
    fn share_peer_weight(&self, py: Python<'_>) -> PyResult<()> {
        run_locked(py, &self.op, "a decentralized operation", |op| {
            op.share_peer_weight()
        })
    }

    /// Communication steps run so far.
    #[getter]
    fn step(&self) -> PyResult<u64> {
        Ok(locked(&self.op)?.step())
    }
}

/// Low-precision decentralized SGD's ring exchange.
#[pyclass(module = "ringlet._core", frozen)]
pub(crate) struct LowPrecisionOp {
    op: SharedOp<alg::LowPrecisionOp>,
}

#[pymethods]
impl LowPrecisionOp {
    /// `weight`, `left`, `right`: the replicas as `(data_ptr, nbytes,
    /// tensor)` of contiguous CPU tensors of the bucket's size and dtype.
    #[new]
    fn new(
        comms: &Comms,
        weight: (usize, usize, PyObject),
        left: (usize, usize, PyObject),
        right: (usize, usize, PyObject),
        dtype_name: &str,
    ) -> PyResult<Self> {
        let w = host_tensor(weight.0, weight.1, dtype_name, weight.2)?;
        let l = host_tensor(left.0, left.1, dtype_name, left.2)?;
        let r = host_tensor(right.0, right.1, dtype_name, right.2)?;
        Ok(LowPrecisionOp {
            op: SharedOp(Arc::new(Mutex::new(alg::LowPrecisionOp::new(
                comms.inner.clone(),
                w,
                l,
                r,
            )))),
        })
    }
}

/// The asynchronous averaging thread of one model.
#[pyclass(module = "ringlet._core", frozen)]
pub(crate) struct AsyncAverager {
    inner: Arc<alg::AsyncAverager>,
}

#[pymethods]
impl AsyncAverager {
    /// Averages `nbytes` of `dtype_name` at `ptr` (the flattened weights, a
    /// CPU tensor `owner` kept alive by the averager) over `comm`, a
    /// communicator of its own.
    #[new]
    fn new(
        comm: &Communicator,
        ptr: usize,
        nbytes: usize,
        dtype_name: &str,
        owner: PyObject,
    ) -> PyResult<Self> {
        let w = host_tensor(ptr, nbytes, dtype_name, owner)?;
        let inner =
            alg::AsyncAverager::new(comm.inner.clone(), w).map_err(crate::errors::to_pyerr)?;
        Ok(AsyncAverager {
            inner: Arc::new(inner),
        })
    }

    /// Starts averaging every `interval_ms` milliseconds.
    fn start(&self, py: Python<'_>, interval_ms: f64) -> PyResult<()> {
        if !(interval_ms.is_finite() && interval_ms >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "sync_interval_ms must be a non-negative number, got {interval_ms}"
            )));
        }
        let a = Arc::clone(&self.inner);
        run(py, move || {
            a.start(Duration::from_secs_f64(interval_ms / 1000.0))
        })
    }

    /// Stops once every rank asked to (collective); raises the thread's
    /// error if nothing raised it yet.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        let a = Arc::clone(&self.inner);
        run(py, move || a.abort())
    }

    /// Clears the abort flag.
    fn reset(&self) {
        self.inner.reset();
    }

    /// Takes the weight lock (GIL released while waiting); raises the
    /// thread's error once.
    fn lock_weight(&self, py: Python<'_>) -> PyResult<()> {
        let a = Arc::clone(&self.inner);
        run(py, move || a.lock_weight())
    }

    /// Releases the weight lock.
    fn unlock_weight(&self) {
        self.inner.unlock_weight();
    }

    /// "running", "stopped" or "failed".
    fn status(&self) -> &'static str {
        match self.inner.status() {
            alg::AsyncStatus::Running => "running",
            alg::AsyncStatus::Stopped => "stopped",
            alg::AsyncStatus::Failed => "failed",
        }
    }

    /// Averaging rounds completed.
    #[getter]
    fn rounds(&self) -> u64 {
        self.inner.rounds()
    }
}

/// The bucket operation a Python object stands for, or None when it is
/// none of the algorithm operations.
pub(crate) fn bucket_op(obj: &Bound<'_, PyAny>) -> Option<Box<dyn BucketOp>> {
    if let Ok(op) = obj.downcast::<CentralizedOp>() {
        return Some(Box::new(op.get().op.clone()));
    }
    if let Ok(op) = obj.downcast::<DecentralizedOp>() {
        return Some(Box::new(op.get().op.clone()));
    }
    if let Ok(op) = obj.downcast::<LowPrecisionOp>() {
        return Some(Box::new(op.get().op.clone()));
    }
    if let Ok(op) = obj.downcast::<AsyncAverager>() {
        return Some(op.get().inner.bucket_op());
    }
    None
}

/// MinMaxUInt8: compresses `nbytes` of `dtype_name` at `in_ptr` (one chunk)
/// into `out_nbytes` at `out_ptr` (`minmax_uint8_compressed_len` bytes).
#[pyfunction]
pub(crate) fn minmax_uint8_compress(
    py: Python<'_>,
    in_ptr: usize,
    nbytes: usize,
    dtype_name: &str,
    out_ptr: usize,
    out_nbytes: usize,
) -> PyResult<()> {
    codec_compress(
        py,
        "MinMaxUInt8",
        in_ptr,
        nbytes,
        dtype_name,
        out_ptr,
        out_nbytes,
    )
}

/// MinMaxUInt8: decompresses `in_nbytes` at `in_ptr` into `nbytes` of
/// `dtype_name` at `out_ptr`.
#[pyfunction]
pub(crate) fn minmax_uint8_decompress(
    py: Python<'_>,
    in_ptr: usize,
    in_nbytes: usize,
    out_ptr: usize,
    nbytes: usize,
    dtype_name: &str,
) -> PyResult<()> {
    codec_decompress(
        py,
        "MinMaxUInt8",
        in_ptr,
        in_nbytes,
        out_ptr,
        nbytes,
        dtype_name,
    )
}

/// Bytes a chunk of `elements` elements of `dtype_name` compresses to.
#[pyfunction]
pub(crate) fn minmax_uint8_compressed_len(dtype_name: &str, elements: usize) -> PyResult<usize> {
    codec_compressed_len("MinMaxUInt8", dtype_name, elements)
}

/// `shift_one`'s peer of `rank` among `n` ranks at communication step `step`.
#[pyfunction]
pub(crate) fn shift_one_peer(rank: usize, n: usize, step: u64) -> PyResult<usize> {
    if n == 0 || !n.is_multiple_of(2) || rank >= n {
        return Err(PyValueError::new_err(format!(
            "shift_one needs an even number of ranks and a rank among them, got rank {rank} of {n}"
        )));
    }
    Ok(alg::shift_one_peer(rank, n, step))
}

/// DiLoCo's outer average of one flat bucket (`ringlet_core::algorithms::outer`):
/// the pseudo-gradient in `pseudo` averaged into `avg` on a thread.
#[pyclass(module = "ringlet._core")]
pub(crate) struct OuterSync {
    inner: alg::outer::OuterSync,
}

#[pymethods]
impl OuterSync {
    /// `pseudo` and `avg`: (data pointer, bytes, owner) of two contiguous
    /// CPU tensors of `dtype_name` of the same size, kept alive by this
    /// object; `compression` None (exact), "MinMaxUInt8" or "MinMaxUInt4".
    #[new]
    #[pyo3(signature = (comms, dtype_name, pseudo, avg, compression=None, error_feedback=false))]
    fn new(
        comms: &Comms,
        dtype_name: &str,
        pseudo: (usize, usize, PyObject),
        avg: (usize, usize, PyObject),
        compression: Option<&str>,
        error_feedback: bool,
    ) -> PyResult<Self> {
        let codec = compression.map(codec).transpose()?;
        let p = host_tensor(pseudo.0, pseudo.1, dtype_name, pseudo.2)?;
        let a = host_tensor(avg.0, avg.1, dtype_name, avg.2)?;
        let inner = alg::outer::OuterSync::new(comms.inner.clone(), codec, error_feedback, p, a)
            .map_err(crate::errors::to_pyerr)?;
        Ok(OuterSync { inner })
    }

    /// Starts the average (the caller leaves both buffers alone until `wait`).
    fn start(&mut self) -> PyResult<()> {
        self.inner.start().map_err(crate::errors::to_pyerr)
    }

    /// Waits for the average started last (raises its error).
    fn wait(&mut self, py: Python<'_>) -> PyResult<()> {
        let inner = &mut self.inner;
        run(py, move || inner.wait())
    }

    /// Whether an average was started and not yet waited for.
    fn running(&self) -> bool {
        self.inner.running()
    }
}

/// The checked byte ranges of a list of (data pointer, bytes) tensors.
fn raw_list(parts: &[(usize, usize)]) -> PyResult<Vec<core::buf::RawBuf>> {
    parts.iter().map(|&(p, n)| raw_buf(p, n)).collect()
}

/// `out = flat - concat(params)`: the pseudo-gradient of a flat global copy
/// against the parameters (each a (data pointer, bytes) of a contiguous CPU
/// tensor of `dtype_name`).
#[pyfunction]
pub(crate) fn pseudo_gradient(
    py: Python<'_>,
    flat: (usize, usize),
    params: Vec<(usize, usize)>,
    out: (usize, usize),
    dtype_name: &str,
) -> PyResult<()> {
    let d = dtype(dtype_name)?;
    let (g, o) = crate::in_out(flat.0, flat.1, out.0, out.1)?;
    let ps = raw_list(&params)?;
    run(py, move || {
        // SAFETY: contiguous CPU tensors the caller keeps alive and leaves
        // alone during the call; `out` is checked not to overlap `flat`, and
        // the Python caller passes parameters distinct from both.
        let locals: Vec<&[u8]> = ps.into_iter().map(|b| unsafe { b.slice() }).collect();
        alg::outer::pseudo_gradient(unsafe { g.slice() }, &locals, unsafe { o.slice_mut() }, d)
    })
}

/// Copies the flat buffer into the parameters, one after the other.
#[pyfunction]
pub(crate) fn flat_scatter(
    py: Python<'_>,
    flat: (usize, usize),
    params: Vec<(usize, usize)>,
) -> PyResult<()> {
    let f = raw_buf(flat.0, flat.1)?;
    let ps = raw_list(&params)?;
    run(py, move || {
        // SAFETY: as in `pseudo_gradient`: distinct live CPU tensors nothing
        // else touches during the call.
        let mut dsts: Vec<&mut [u8]> = ps.into_iter().map(|b| unsafe { b.slice_mut() }).collect();
        alg::outer::scatter(unsafe { f.slice() }, &mut dsts)
    })
}

/// Copies the parameters, one after the other, into the flat buffer.
#[pyfunction]
pub(crate) fn flat_gather(
    py: Python<'_>,
    params: Vec<(usize, usize)>,
    flat: (usize, usize),
) -> PyResult<()> {
    let f = raw_buf(flat.0, flat.1)?;
    let ps = raw_list(&params)?;
    run(py, move || {
        // SAFETY: as in `pseudo_gradient`.
        let srcs: Vec<&[u8]> = ps.into_iter().map(|b| unsafe { b.slice() }).collect();
        alg::outer::gather(&srcs, unsafe { f.slice_mut() })
    })
}

/// A codec (`"MinMaxUInt8"` or `"MinMaxUInt4"`) on raw buffers: compresses
/// `nbytes` of `dtype_name` at `in_ptr` into `out_nbytes` at `out_ptr`.
#[pyfunction]
pub(crate) fn codec_compress(
    py: Python<'_>,
    codec: &str,
    in_ptr: usize,
    nbytes: usize,
    dtype_name: &str,
    out_ptr: usize,
    out_nbytes: usize,
) -> PyResult<()> {
    with_codec(
        py,
        codec,
        dtype_name,
        (in_ptr, nbytes),
        (out_ptr, out_nbytes),
        |c, d, i, o| c.compress(d, i, o),
    )
}

/// The codec's decompression of `in_nbytes` at `in_ptr` into `nbytes` of
/// `dtype_name` at `out_ptr`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(crate) fn codec_decompress(
    py: Python<'_>,
    codec: &str,
    in_ptr: usize,
    in_nbytes: usize,
    out_ptr: usize,
    nbytes: usize,
    dtype_name: &str,
) -> PyResult<()> {
    with_codec(
        py,
        codec,
        dtype_name,
        (in_ptr, in_nbytes),
        (out_ptr, nbytes),
        |c, d, i, o| c.decompress(d, i, o),
    )
}

/// The codec named `name` (`"MinMaxUInt8"` or `"MinMaxUInt4"`).
fn codec(name: &str) -> PyResult<alg::Codec> {
    alg::Codec::by_name(name).map_err(crate::errors::to_pyerr)
}

/// Runs `f` with the codec named `codec`, the dtype named `dtype_name` and
/// the input and output buffers (see [`run_in_out`]).
fn with_codec(
    py: Python<'_>,
    codec: &str,
    dtype_name: &str,
    input: (usize, usize),
    output: (usize, usize),
    f: impl FnOnce(alg::Codec, core::DType, &[u8], &mut [u8]) -> core::Result<()> + Send,
) -> PyResult<()> {
    let (c, d) = (self::codec(codec)?, dtype(dtype_name)?);
    run_in_out(py, input, output, move |i, o| f(c, d, i, o))
}

/// Bytes a chunk of `elements` elements of `dtype_name` compresses to.
#[pyfunction]
pub(crate) fn codec_compressed_len(
    codec: &str,
    dtype_name: &str,
    elements: usize,
) -> PyResult<usize> {
    let c = self::codec(codec)?;
    Ok(c.compressed_len(dtype(dtype_name)?, elements))
}
