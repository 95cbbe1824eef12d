//! `ringlet._core.Progress`: the ordered progress queue of a process group.
//! Jobs are Python callables, or engine calls queued as they are
//! ([`NativeJob`]: all-reduce, broadcast, all-gather, reduce-scatter,
//! all-to-all, barrier; no Python between the queue and the engine). The queue's
//! thread (or a waiter that runs queued jobs itself) takes the GIL only
//! while a Python callable runs, and every callable releases it again around
//! its engine calls; a native job never takes it.

use crate::{run, Communicator};
use core::buf::{Copies, RawBuf};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use ringlet_core as core;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The engine call of a native job (`submit_engine`).
enum Call {
    AllReduce(RawBuf, core::ReduceOp),
    Broadcast(RawBuf, usize),
    Pair(RawBuf, RawBuf, Pair),
    /// A list form (`collective::ListOp`): its inputs and outputs, staged
    /// through the running thread's kept buffers (`buf::through_staging`).
    List(core::collective::ListOp, Vec<RawBuf>, Vec<RawBuf>),
    Barrier,
}

/// The out-of-place calls of `submit_engine`.
enum Pair {
    Gather,
    Scatter(core::ReduceOp),
    AllToAll(Vec<usize>, Vec<usize>),
}

/// What a native job left: None until it ran; the engine's result, or the
/// message of a panic.
type Outcome = Arc<Mutex<Option<Result<core::Result<()>, String>>>>;

/// One engine call queued on a [`Progress`] queue (`submit_engine`): its
/// ticket, and its outcome once the ticket is done.
#[pyclass(module = "ringlet._core", frozen)]
pub struct NativeJob {
    ticket: u64,
    outcome: Outcome,
}

#[pymethods]
impl NativeJob {
    /// The job's ticket on its queue.
    #[getter]
    fn ticket(&self) -> u64 {
        self.ticket
    }

    /// The exception the engine call failed with (an instance, not raised),
    /// or None when it succeeded. Only valid once the ticket is done: raises
    /// RuntimeError before (or when the queue was closed before it ran).
    fn error(&self, py: Python<'_>) -> PyResult<Option<PyObject>> {
        let guard = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        match &*guard {
            None => Err(PyRuntimeError::new_err(
                "the queued operation has not run (or its process group was closed first)",
            )),
            Some(Ok(Ok(()))) => Ok(None),
            Some(Ok(Err(e))) => Ok(Some(
                crate::errors::to_pyerr(e.clone()).into_value(py).into_any(),
            )),
            Some(Err(panic)) => Ok(Some(
                PyRuntimeError::new_err(panic.clone())
                    .into_value(py)
                    .into_any(),
            )),
        }
    }
}

impl Progress {
    /// Queues `f` on `comm` as a job that runs without the GIL; `keep` (the
    /// Python objects owning the buffers `f` uses) lives until the job ended.
    fn submit_native(
        &self,
        py: Python<'_>,
        comm: &Communicator,
        keep: PyObject,
        wake: bool,
        f: impl FnOnce(&mut core::Communicator) -> core::Result<()> + Send + 'static,
    ) -> PyResult<Option<NativeJob>> {
        let queue = self.get().map_err(crate::errors::to_pyerr)?;
        let shared = comm.inner.clone();
        let mut f = Some(f);
        if !wake {
            // The caller waits at once: on an idle queue the call runs here.
            let (q, sh, f) = (Arc::clone(&queue), shared.clone(), &mut f);
            let ran = run(py, move || {
                match q.run_now(|| f.take().map(|f| sh.with(f))) {
                    Some(Some(result)) => result.map(|()| true),
                    _ => Ok(false),
                }
            })?;
            if ran {
                return Ok(None);
            }
        }
        let Some(f) = f else {
            return Ok(None);
        };
        let outcome: Outcome = Arc::new(Mutex::new(None));
        let slot = Arc::clone(&outcome);
        let job: core::progress::Job = Box::new(move || {
            let out = catch_unwind(AssertUnwindSafe(|| shared.with(f)))
                .map_err(|p| core::error::panic_message(&*p));
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(out);
            // Without the GIL, pyo3 defers this reference's release to the
            // next time a thread takes it.
            drop(keep);
        });
        let ticket = run(py, move || queue.submit(job, wake))?;
        Ok(Some(NativeJob { ticket, outcome }))
    }
}

#[pyclass(module = "ringlet._core", frozen)]
pub struct Progress {
    inner: Mutex<Option<Arc<core::progress::Progress>>>,
}

impl Progress {
    /// The queue, for a C ABI handle that shares it.
    pub(crate) fn shared(&self) -> core::Result<Arc<core::progress::Progress>> {
        self.get()
    }

    /// The queue, shared so that a waiter never holds the lock others need.
    fn get(&self) -> core::Result<Arc<core::progress::Progress>> {
        let guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        guard.clone().ok_or_else(|| {
            core::Error::InvalidArgument(
                "the progress queue is closed (the process group was destroyed)".into(),
            )
        })
    }
}

#[pymethods]
impl Progress {
    #[new]
    fn new(name: &str) -> PyResult<Self> {
        let p = core::progress::Progress::new(name).map_err(crate::errors::to_pyerr)?;
        Ok(Progress {
            inner: Mutex::new(Some(Arc::new(p))),
        })
    }

    /// Queues `job` (a callable taking no arguments; its exceptions are
    /// printed and otherwise ignored: jobs report their own outcome). With
    /// `wake=False` the caller promises to wait for it at once (and will
    /// usually run it itself).
    #[pyo3(signature = (job, wake=true))]
    fn submit(&self, py: Python<'_>, job: PyObject, wake: bool) -> PyResult<u64> {
        let boxed: core::progress::Job = Box::new(move || {
            Python::with_gil(|py| {
                if let Err(e) = job.call0(py) {
                    e.print(py);
                }
                drop(job);
            })
        });
        let queue = self.get().map_err(crate::errors::to_pyerr)?;
        run(py, move || queue.submit(boxed, wake))
    }

    /// Calls `job` on this thread at once (GIL held; the job releases it
    /// around engine calls) when the queue is idle, keeping queue order:
    /// returns True, or raises what `job` raised. Returns False without
    /// calling it when earlier jobs are queued or running.
    fn run_now(&self, py: Python<'_>, job: PyObject) -> PyResult<bool> {
        let queue = self.get().map_err(crate::errors::to_pyerr)?;
        match queue.run_now(|| job.call0(py)) {
            None => Ok(false),
            Some(Ok(_)) => Ok(true),
            Some(Err(e)) => Err(e),
        }
    }

    /// `comm.all_reduce(ptr, nbytes, dtype_name, op_name)` on this thread at
    /// once (GIL released) when the queue is idle, as `run_now` with that
    /// call as the job but without a Python callable in between (the
    /// blocking one-tensor all-reduce of the torch.distributed backend).
    /// Returns False, having done nothing, when earlier jobs are queued or
    /// running.
    fn all_reduce_now(
        &self,
        py: Python<'_>,
        comm: &Communicator,
        ptr: usize,
        nbytes: usize,
        dtype_name: &str,
        op_name: &str,
    ) -> PyResult<bool> {
        let queue = self.get().map_err(crate::errors::to_pyerr)?;
        match queue.run_now(|| comm.all_reduce(py, ptr, nbytes, dtype_name, op_name)) {
            None => Ok(false),
            Some(r) => r.map(|()| true),
        }
    }

    /// Queues one engine call on `comm` as a native job (no Python runs
    /// for it on the queue): `call` is `"all_reduce"` (`arg`: the reduce op
    /// name) or `"broadcast"` (`arg`: the root) in place on `buffers` =
    /// `[(ptr, nbytes)]`, or `"all_gather"` / `"reduce_scatter"` (`arg`: the
    /// reduce op name) or `"all_to_all_v"` (`arg`: `(send_counts,
    /// recv_counts)` in elements) from `buffers[0]` into `buffers[1]` (checked
    /// not to overlap), or `"list"` (`arg`: `(kind, inputs, root, reduce op
    /// name)`, `kind` one of `all_gather`, `gather`, `scatter`, `all_to_all`,
    /// `reduce_scatter`; `buffers`: the list's inputs, then its outputs,
    /// which may alias), or `"barrier"` (no buffers). Around the call the job
    /// runs the byte copies `before` (staging a list into a flat buffer) and,
    /// once it succeeded, divides the result (the all-reduced buffer or the
    /// reduce-scatter's output) by `divide` when non-zero (ReduceOp.AVG), then
    /// runs the copies `after` (a flat result out into a list); each copy is
    /// `(from_ptr, to_ptr, nbytes)`. `keep` must own every buffer (the
    /// tensors, or a list holding them): it is held until the job ended.
    /// Returns the job's handle; with `wake=False` (the caller waits at once)
    /// on an idle queue the job runs on this thread instead (GIL released),
    /// raising its error, and None is returned.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (comm, call, buffers, dtype_name, arg=None, keep=None, wake=true,
                        before=Vec::new(), after=Vec::new(), divide=0))]
    fn submit_engine(
        &self,
        py: Python<'_>,
        comm: &Communicator,
        call: &str,
        buffers: Vec<(usize, usize)>,
        dtype_name: &str,
        arg: Option<Bound<'_, PyAny>>,
        keep: Option<PyObject>,
        wake: bool,
        before: Vec<(usize, usize, usize)>,
        after: Vec<(usize, usize, usize)>,
        divide: usize,
    ) -> PyResult<Option<NativeJob>> {
        let d = crate::dtype(dtype_name)?;
        let keep = keep.unwrap_or_else(|| py.None());
        let to_py = crate::errors::to_pyerr;
        let (before, after) = (
            Copies::new(&before).map_err(to_py)?,
            Copies::new(&after).map_err(to_py)?,
        );
        let red = || match &arg {
            Some(a) => crate::op(&a.extract::<String>()?),
            None => Ok(core::ReduceOp::Sum),
        };
        let bad = || {
            PyValueError::new_err(format!(
                "submit_engine: {call} takes {} buffer(s){}, got {}",
                match call {
                    "all_reduce" | "broadcast" => 1,
                    "barrier" => 0,
                    _ => 2,
                },
                if call == "all_to_all_v" {
                    " and (send_counts, recv_counts)"
                } else {
                    ""
                },
                buffers.len()
            ))
        };
        if divide != 0 && !matches!(call, "all_reduce" | "reduce_scatter") {
            return Err(PyValueError::new_err(format!(
                "submit_engine: divide applies to all_reduce and reduce_scatter, not {call}"
            )));
        }
        let call = match (call, buffers.as_slice()) {
            ("all_reduce", &[(ptr, nbytes)]) => {
                Call::AllReduce(crate::raw_buf(ptr, nbytes)?, red()?)
            }
            ("broadcast", &[(ptr, nbytes)]) => {
                let root = arg.map(|a| a.extract::<usize>()).transpose()?.unwrap_or(0);
                Call::Broadcast(crate::raw_buf(ptr, nbytes)?, root)
            }
            ("all_gather" | "reduce_scatter" | "all_to_all_v", &[input, output]) => {
                let (i, out) = crate::in_out(input.0, input.1, output.0, output.1)?;
                let pair = match call {
                    "all_gather" => Pair::Gather,
                    "reduce_scatter" => Pair::Scatter(red()?),
                    _ => {
                        let (send, recv) = arg.as_ref().ok_or_else(bad)?.extract()?;
                        Pair::AllToAll(send, recv)
                    }
                };
                Call::Pair(i, out, pair)
            }
            ("list", all) => {
                let shape = || {
                    PyValueError::new_err(format!(
                        "submit_engine: list takes arg=(kind, inputs, root, reduce op) with at \
                         most len(buffers) = {} inputs",
                        all.len()
                    ))
                };
                let (kind, inputs, root, red_name): (String, usize, usize, String) =
                    arg.as_ref().ok_or_else(shape)?.extract()?;
                if inputs > all.len() {
                    return Err(shape());
                }
                let red = if kind == "reduce_scatter" {
                    crate::op(&red_name)?
                } else {
                    core::ReduceOp::Sum
                };
                let op = core::collective::ListOp::named(&kind, root, red).ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "submit_engine: unknown list form {kind:?} (all_gather, gather, \
                         scatter, all_to_all, reduce_scatter)"
                    ))
                })?;
                let raw = |b: &[(usize, usize)]| -> PyResult<Vec<RawBuf>> {
                    b.iter().map(|&(ptr, n)| crate::raw_buf(ptr, n)).collect()
                };
                Call::List(op, raw(&all[..inputs])?, raw(&all[inputs..])?)
            }
            ("barrier", &[]) => Call::Barrier,
            (
                "all_reduce" | "broadcast" | "all_gather" | "reduce_scatter" | "all_to_all_v"
                | "barrier",
                _,
            ) => return Err(bad()),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "submit_engine: unknown call {call:?} (all_reduce, broadcast, all_gather, \
                     reduce_scatter, all_to_all_v, list, barrier)"
                )))
            }
        };
        self.submit_native(py, comm, keep, wake, move |c| {
            // SAFETY: `keep` owns every buffer and copy range (contiguous CPU
            // tensors), held until this job ended; the caller leaves them
            // alone meanwhile, and the two buffers of an out-of-place call
            // were checked not to overlap.
            unsafe {
                before.run();
                let result = match &call {
                    Call::AllReduce(buf, o) => {
                        let buf = buf.slice_mut();
                        c.all_reduce(buf, d, *o)?;
                        Some(buf)
                    }
                    Call::Broadcast(buf, root) => {
                        c.broadcast(buf.slice_mut(), d, *root).map(|()| None)?
                    }
                    Call::Pair(i, out, pair) => {
                        let (i, out) = (i.slice(), out.slice_mut());
                        match pair {
                            Pair::Gather => c.all_gather(i, out, d)?,
                            Pair::Scatter(o) => c.reduce_scatter(i, out, d, *o)?,
                            Pair::AllToAll(send, recv) => c.all_to_all_v(i, send, out, recv, d)?,
                        }
                        Some(out)
                    }
                    Call::List(op, ins, outs) => {
                        core::buf::through_staging(ins, outs, |send, in_lens, recv, out_lens| {
                            c.list_collective(*op, send, in_lens, recv, out_lens, d)
                        })?;
                        None
                    }
                    Call::Barrier => c.barrier().map(|()| None)?,
                };
                if let (Some(buf), true) = (result, divide != 0) {
                    core::reduce::divide(d, buf, divide)?;
                }
                after.run();
            }
            Ok(())
        })
    }

    /// Whether the job of `ticket` has run.
    fn is_done(&self, ticket: u64) -> PyResult<bool> {
        let queue = self.get().map_err(crate::errors::to_pyerr)?;
        Ok(queue.is_done(ticket))
    }

    /// Waits (GIL released) until the job of `ticket` has run; False when
    /// `timeout_s` passed first. Runs queued jobs itself when none is running.
    /// With `run_queued=False` it never runs a job itself (the thread does):
    /// a job blocked on its peers then cannot hold the caller past `timeout_s`.
    #[pyo3(signature = (ticket, timeout_s=None, run_queued=true))]
    fn wait(
        &self,
        py: Python<'_>,
        ticket: u64,
        timeout_s: Option<f64>,
        run_queued: bool,
    ) -> PyResult<bool> {
        let timeout = timeout_s.map(|s| Duration::from_secs_f64(s.max(0.0)));
        let queue = self.get().map_err(crate::errors::to_pyerr)?;
        run(py, move || queue.wait_for(ticket, timeout, run_queued))
    }

    /// Jobs queued or running.
    fn pending(&self) -> PyResult<u64> {
        let queue = self.get().map_err(crate::errors::to_pyerr)?;
        Ok(queue.pending())
    }

    /// Runs what is queued, then stops the thread; later submits raise.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(queue) = taken {
            run(py, move || {
                queue.close();
                Ok(())
            })?;
        }
        Ok(())
    }
}
