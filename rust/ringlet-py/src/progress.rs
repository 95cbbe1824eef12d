//! `ringlet._core.Progress`: the ordered progress queue of a process group.
//! Jobs are Python callables; the queue's thread (or a waiter that runs
//! queued jobs itself) takes the GIL only while a callable runs, and every
//! callable releases it again around its engine calls.

use crate::{run, Communicator};
use pyo3::prelude::*;
use ringlet_core as core;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

    /// Whether the job of `ticket` has run.
    fn is_done(&self, ticket: u64) -> PyResult<bool> {
        let queue = self.get().map_err(crate::errors::to_pyerr)?;
        Ok(queue.is_done(ticket))
    }

    /// Waits (GIL released) until the job of `ticket` has run; False when
    /// `timeout_s` passed first. Runs queued jobs itself when none is running.
    #[pyo3(signature = (ticket, timeout_s=None))]
    fn wait(&self, py: Python<'_>, ticket: u64, timeout_s: Option<f64>) -> PyResult<bool> {
        let timeout = timeout_s.map(|s| Duration::from_secs_f64(s.max(0.0)));
        let queue = self.get().map_err(crate::errors::to_pyerr)?;
        run(py, move || queue.wait(ticket, timeout))
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
