//! Binding of the tensor registry (`ringlet_core::registry`): one
//! `TensorModule` per model, whose proxies are resolved, staged, waited on and
//! custom-reduced through Python callables that `ringlet.bagua.tensor` supplies.
//!
//! The worker thread takes the GIL only to call those callables. A Python
//! exception raised inside one is kept and re-raised, unchanged, by
//! `wait_pending` on the caller.

use crate::errors::to_pyerr;
use crate::{dtype, run, Communicator};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use ringlet_core as core;
use ringlet_core::registry::{
    AllReduceOp, BucketOp, BucketOps, BucketTensors, DeviceMemory, Effective, ReadyEvent, Resolver,
    TensorMeta,
};
use std::sync::{Arc, Mutex};

/// Context of engine errors that stand for a Python exception kept aside.
const PY_CALLBACK: &str = "ringlet python callback";

/// The first Python exception raised by a callback on the worker thread.
type Stash = Arc<Mutex<Option<PyErr>>>;

fn stash(slot: &Stash, what: &str, err: PyErr) -> core::Error {
    let message = format!("{what}: {err}");
    if let Ok(mut s) = slot.lock() {
        s.get_or_insert(err);
    }
    core::Error::Io {
        context: PY_CALLBACK.into(),
        message,
    }
}

/// Calls `resolver(name) -> (ptr, numel, dtype_name, device, tensor,
/// mirror_ptr, mirror)` (`mirror`: a page-locked host tensor of a device
/// tensor's size to stage it through, or None with `mirror_ptr` 0).
struct PyResolver {
    resolver: Py<PyAny>,
    stager: Arc<Py<PyAny>>,
    errors: Stash,
}

impl Resolver for PyResolver {
    fn resolve(&self, meta: &TensorMeta) -> core::Result<Effective> {
        Python::with_gil(|py| {
            let fail = |e: PyErr| stash(&self.errors, &format!("resolving '{}'", meta.name), e);
            let out = self
                .resolver
                .call1(py, (meta.name.as_str(),))
                .map_err(fail)?;
            #[allow(clippy::type_complexity)]
            let (ptr, numel, dtype_name, device, tensor, mirror_ptr, mirror): (
                usize,
                usize,
                String,
                String,
                PyObject,
                usize,
                PyObject,
            ) = out.extract(py).map_err(fail)?;
            let d = core::DType::from_name(&dtype_name)?;
            if device == "cpu" {
                if ptr == 0 && numel != 0 {
                    return Err(core::Error::InvalidArgument(format!(
                        "the effective tensor of '{}' has a null data pointer",
                        meta.name
                    )));
                }
                // SAFETY: `ringlet.bagua.tensor` returns the data pointer and element
                // count of a contiguous CPU tensor of this dtype, and `tensor`
                // (kept as the owner) keeps its storage alive. The tensor is
                // not used by Python while its bucket is in flight (the caller
                // waits with `wait_pending` before touching it).
                Ok(unsafe { Effective::host(ptr, numel, d, device, Some(Box::new(tensor))) })
            } else {
                let mem = PyDevice {
                    tensor,
                    stager: Arc::clone(&self.stager),
                    errors: Arc::clone(&self.errors),
                };
                if mirror_ptr == 0 {
                    return Ok(Effective::device(Box::new(mem), numel, d, device));
                }
                // SAFETY: `ringlet.bagua.tensor` returns the address of a contiguous
                // page-locked host tensor of exactly this tensor's size
                // (`mirror`, kept as the owner, keeps it alive), reserved for
                // staging this tensor and used by nothing else meanwhile.
                Ok(unsafe {
                    Effective::device_mirrored(
                        Box::new(mem),
                        mirror_ptr,
                        numel,
                        d,
                        device,
                        Some(Box::new(mirror)),
                    )
                })
            }
        })
    }
}

/// A device tensor copied through host memory by
/// `stager(tensor, host_ptr, nbytes, to_host)`.
struct PyDevice {
    tensor: PyObject,
    stager: Arc<Py<PyAny>>,
    errors: Stash,
}

impl PyDevice {
    fn stage(&self, ptr: usize, nbytes: usize, to_host: bool) -> core::Result<()> {
        Python::with_gil(|py| {
            self.stager
                .call1(py, (self.tensor.clone_ref(py), ptr, nbytes, to_host))
                .map(drop)
                .map_err(|e| stash(&self.errors, "staging a device tensor", e))
        })
    }
}

impl DeviceMemory for PyDevice {
    fn download(&self, dst: &mut [u8]) -> core::Result<()> {
        self.stage(dst.as_mut_ptr() as usize, dst.len(), true)
    }

    fn upload(&self, src: &[u8]) -> core::Result<()> {
        self.stage(src.as_ptr() as usize, src.len(), false)
    }
}

/// A `torch.cuda.Event` (anything with `synchronize()`).
struct PyEvent {
    event: PyObject,
    errors: Stash,
}

impl ReadyEvent for PyEvent {
    fn wait(&self) -> core::Result<()> {
        Python::with_gil(|py| {
            self.event
                .call_method0(py, "synchronize")
                .map(drop)
                .map_err(|e| stash(&self.errors, "waiting on a ready event", e))
        })
    }
}

/// A Python callable run on each bucket as `op(bucket_index, names)`.
struct PyOp {
    func: PyObject,
    errors: Stash,
}

impl BucketOp for PyOp {
    fn run(&mut self, bucket: &BucketTensors<'_>) -> core::Result<()> {
        Python::with_gil(|py| {
            let names: Vec<&str> = bucket.tensors.iter().map(|t| t.name.as_str()).collect();
            self.func
                .call1(py, (bucket.index, names))
                .map(drop)
                .map_err(|e| stash(&self.errors, &format!("bucket {}", bucket.index), e))
        })
    }
}

/// The registered tensors of one model, their buckets, and the worker thread
/// that communicates them in bucket order.
#[pyclass(module = "ringlet._core", frozen)]
pub(crate) struct TensorModule {
    inner: Mutex<Option<Arc<core::registry::Module>>>,
    name: String,
    errors: Stash,
}

impl TensorModule {
    fn module(&self) -> PyResult<Arc<core::registry::Module>> {
        self.inner
            .lock()
            .ok()
            .and_then(|g| g.clone())
            .ok_or_else(|| {
                PyRuntimeError::new_err(format!("tensor module '{}' is closed", self.name))
            })
    }

    /// Runs `f` on the module without the GIL; a Python exception kept from a
    /// callback replaces the engine error that stands for it.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&core::registry::Module) -> core::Result<T> + Send,
    ) -> PyResult<T> {
        let m = self.module()?;
        match run(py, || Ok(f(&m)))? {
            Ok(v) => Ok(v),
            Err(e) => {
                let from_callback =
                    matches!(&e, core::Error::Io { context, .. } if context == PY_CALLBACK);
                let kept = if from_callback {
                    self.errors.lock().ok().and_then(|mut s| s.take())
                } else {
                    None
                };
                Err(kept.unwrap_or_else(|| to_pyerr(e)))
            }
        }
    }
}

#[pymethods]
impl TensorModule {
    /// A module named `name`. `resolver(name)` returns the effective tensor of
    /// a proxy as `(data_ptr, numel, dtype_name, device, tensor)`;
    /// `stager(tensor, host_ptr, nbytes, to_host)` copies a device tensor to or
    /// from host memory.
    #[new]
    fn new(py: Python<'_>, name: String, resolver: PyObject, stager: PyObject) -> PyResult<Self> {
        let errors: Stash = Arc::new(Mutex::new(None));
        let r = PyResolver {
            resolver,
            stager: Arc::new(stager),
            errors: Arc::clone(&errors),
        };
        let n = name.clone();
        let m = run(py, move || core::registry::Module::new(n, Arc::new(r)))?;
        Ok(TensorModule {
            inner: Mutex::new(Some(Arc::new(m))),
            name,
            errors,
        })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Registers a proxy whose effective tensor has `numel` elements of
    /// `dtype_name` on `device`; returns its registration number.
    fn register(
        &self,
        py: Python<'_>,
        name: String,
        numel: usize,
        dtype_name: &str,
        device: String,
    ) -> PyResult<usize> {
        let meta = TensorMeta {
            name,
            count: numel,
            dtype: dtype(dtype_name)?,
            device,
        };
        self.call(py, move |m| m.register(meta))
    }

    /// Names of the registered tensors, in registration order.
    fn names(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.call(py, |m| m.names())
    }

    /// `(numel, dtype_name, device)` of a registered tensor.
    fn tensor(&self, py: Python<'_>, name: String) -> PyResult<(usize, &'static str, String)> {
        self.call(py, move |m| {
            m.tensor(&name).map(|t| (t.count, t.dtype.name(), t.device))
        })
    }

    /// Groups `names`, in order, into buckets of at most `cap_bytes` bytes of
    /// one dtype and device.
    fn plan(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        cap_bytes: usize,
    ) -> PyResult<Vec<Vec<String>>> {
        self.call(py, move |m| m.plan(&names, cap_bytes))
    }

    /// Sets the buckets (lists of names, in communication order).
    fn set_buckets(&self, py: Python<'_>, groups: Vec<Vec<String>>) -> PyResult<()> {
        self.call(py, move |m| m.set_buckets(&groups))
    }

    /// The buckets as lists of names.
    fn buckets(&self, py: Python<'_>) -> PyResult<Vec<Vec<String>>> {
        self.call(py, |m| m.buckets())
    }

    /// `(offsets, data_elems, padding_elems)` of bucket `index` flattened with
    /// its size padded to a multiple of `alignment` elements.
    fn bucket_layout(
        &self,
        py: Python<'_>,
        index: usize,
        alignment: usize,
    ) -> PyResult<(Vec<usize>, usize, usize)> {
        self.call(py, move |m| {
            m.bucket_layout(index, alignment)
                .map(|l| (l.offsets, l.data_elems, l.padding_elems))
        })
    }

    /// Makes every bucket operation an all-reduce (sum, or average when
    /// `average`) over `comm`, which the module takes over (`comm` is closed
    /// for other uses).
    fn set_all_reduce(&self, py: Python<'_>, comm: &Communicator, average: bool) -> PyResult<()> {
        let taken = run(py, || {
            comm.inner.take()?.ok_or_else(|| core::Error::Aborted {
                rank: comm.inner.rank(),
                reason: "the communicator was shut down".into(),
                origin: None,
            })
        })?;
        self.call(py, move |m| {
            m.set_op(Box::new(AllReduceOp::new(taken, average)))
        })
    }

    /// Makes every bucket operation a call `op(bucket_index, names)` on the
    /// worker thread.
    fn set_op(&self, py: Python<'_>, op: PyObject) -> PyResult<()> {
        let op = PyOp {
            func: op,
            errors: Arc::clone(&self.errors),
        };
        self.call(py, move |m| m.set_op(Box::new(op)))
    }

    /// Makes `name` count as ready in every round (a bucket's padding).
    fn set_always_ready(&self, py: Python<'_>, name: String) -> PyResult<()> {
        self.call(py, move |m| m.set_always_ready(&name))
    }

    /// Gives each bucket its own list of operations, run in order (Bagua's
    /// `append_*_op`): `lists[i]` for bucket `i`, each element an algorithm
    /// operation of this module or a callable `op(bucket_index, names)` run
    /// on the worker thread with the GIL.
    fn set_bucket_ops(&self, py: Python<'_>, lists: Vec<Vec<PyObject>>) -> PyResult<()> {
        let mut built: Vec<Vec<Box<dyn BucketOp>>> = Vec::with_capacity(lists.len());
        for list in lists {
            let mut ops: Vec<Box<dyn BucketOp>> = Vec::with_capacity(list.len());
            for obj in list {
                let bound = obj.bind(py);
                if let Some(op) = crate::algorithms::bucket_op(bound) {
                    ops.push(op);
                } else if bound.is_callable() {
                    ops.push(Box::new(PyOp {
                        func: obj,
                        errors: Arc::clone(&self.errors),
                    }));
                } else {
                    return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                        "a bucket operation must be a ringlet algorithm operation or a \
                         callable, not {}",
                        bound.get_type().name()?
                    )));
                }
            }
            built.push(ops);
        }
        self.call(py, move |m| m.set_op(Box::new(BucketOps::new(built))))
    }

    /// Marks `name` ready; the worker waits on `event.synchronize()` first
    /// when `event` is given.
    #[pyo3(signature = (name, event=None))]
    fn mark_ready(&self, py: Python<'_>, name: String, event: Option<PyObject>) -> PyResult<()> {
        let ev = event.map(|event| {
            Box::new(PyEvent {
                event,
                errors: Arc::clone(&self.errors),
            }) as Box<dyn ReadyEvent>
        });
        self.call(py, move |m| m.mark_ready(&name, ev))
    }

    /// Whether `name` is marked ready in the current round.
    fn is_ready(&self, py: Python<'_>, name: String) -> PyResult<bool> {
        self.call(py, move |m| m.is_ready(&name))
    }

    /// Number of enqueued bucket operations not yet finished.
    fn pending(&self, py: Python<'_>) -> PyResult<u64> {
        self.call(py, |m| m.pending())
    }

    /// Blocks (GIL released) until every enqueued operation has finished;
    /// raises the worker's first error.
    fn wait_pending(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |m| m.wait_pending())
    }

    /// Stops the worker (discarding queued operations) and frees the module.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let m = self.inner.lock().ok().and_then(|mut g| g.take());
        run(py, move || {
            drop(m);
            Ok(())
        })
    }
}

impl Drop for TensorModule {
    fn drop(&mut self) {
        // The worker may need the GIL to finish a callback: join it without.
        if let Some(m) = self.inner.get_mut().ok().and_then(|g| g.take()) {
            Python::with_gil(|py| py.allow_threads(move || drop(m)));
        }
    }
}
