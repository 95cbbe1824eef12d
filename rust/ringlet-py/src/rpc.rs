//! Binding of the RPC message layer (`ringlet-core/src/rpc`). The agent's pool
//! threads call the two Python callbacks given at construction; each takes
//! the GIL only for the duration of that call. Every blocking call (connect,
//! send, cross-memory fetch) runs with the GIL released through `run`.

use crate::{raw_buf, run};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use ringlet_core::buf::RawBuf;
use ringlet_core::rpc::{self, Agent, AgentConfig, Handler, Incoming, ReplyTo};
use std::sync::{Arc, Mutex};
use std::time::Duration;

struct PyHandler {
    on_request: Py<PyAny>,
    on_response: Py<PyAny>,
}

thread_local! {
    static PY_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Gives this agent thread a Python thread state that outlives each call,
/// so `with_gil` does not create and destroy one per message.
fn keep_thread_state() {
    PY_THREAD.with(|done| {
        if done.get() {
            return;
        }
        done.set(true);
        // SAFETY: called on an agent thread that does not hold the GIL.
        // `PyGILState_Ensure` creates this thread's state and takes the GIL;
        // `PyEval_SaveThread` releases the GIL and keeps the state, whose
        // ensure-count of one is never released, so later `with_gil` calls
        // reuse it. The state lives as long as the thread.
        unsafe {
            pyo3::ffi::PyGILState_Ensure();
            pyo3::ffi::PyEval_SaveThread();
        }
    });
}

fn deliver(cb: &Py<PyAny>, msg: Incoming) {
    keep_thread_state();
    Python::with_gil(|py| {
        let m = RpcMessage::new(msg);
        match Py::new(py, m).and_then(|obj| cb.call1(py, (obj,))) {
            Ok(_) => {}
            Err(e) => e.print(py),
        }
    })
}

impl Handler for PyHandler {
    fn request(&self, msg: Incoming) {
        deliver(&self.on_request, msg)
    }

    fn response(&self, msg: Incoming) {
        deliver(&self.on_response, msg)
    }
}

/// Tensors given as `(data_ptr, nbytes)` pairs, checked non-null.
fn bufs(tensors: &[(usize, usize)]) -> PyResult<Vec<RawBuf>> {
    tensors.iter().map(|&(p, n)| raw_buf(p, n)).collect()
}

/// Runs `f` over the bytes of `tensors` (`(address, length)` pairs) with
/// the GIL released. The caller keeps every tensor alive and unmodified
/// until the peer has copied it (a `keep` object handed on with them holds
/// them past this call).
fn with_slices<T: Send>(
    py: Python<'_>,
    tensors: &[(usize, usize)],
    f: impl FnOnce(&[&[u8]]) -> ringlet_core::Result<T> + Send,
) -> PyResult<T> {
    let bufs = bufs(tensors)?;
    run(py, move || {
        // SAFETY: the caller keeps every tensor alive and unmodified (see
        // above).
        let slices: Vec<&[u8]> = bufs.iter().map(|b| unsafe { b.slice() }).collect();
        f(&slices)
    })
}

/// A call's deadline: `timeout_s <= 0` means none.
fn deadline(timeout_s: f64) -> Option<Duration> {
    (timeout_s > 0.0).then(|| Duration::from_secs_f64(timeout_s))
}

/// One worker's RPC agent.
#[pyclass(module = "ringlet._core", frozen)]
pub struct RpcAgent {
    inner: Agent,
}

#[pymethods]
impl RpcAgent {
    #[new]
    #[pyo3(signature = (rank, token, bind_addr, on_request, on_response, request_threads=16, completion_threads=4, single_copy_min=65536))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rank: usize,
        token: u64,
        bind_addr: &str,
        on_request: Py<PyAny>,
        on_response: Py<PyAny>,
        request_threads: usize,
        completion_threads: usize,
        single_copy_min: usize,
    ) -> PyResult<Self> {
        let handler = Arc::new(PyHandler {
            on_request,
            on_response,
        });
        let cfg = AgentConfig {
            rank,
            token,
            request_threads,
            completion_threads,
            single_copy_min,
        };
        let addr = bind_addr.to_string();
        let inner = run(py, move || Agent::start(cfg, &addr, handler))?;
        Ok(RpcAgent { inner })
    }

    /// The port the agent listens on.
    #[getter]
    fn port(&self) -> u16 {
        self.inner.port()
    }

    /// Every worker's `host:port` and whether it shares this host.
    fn set_peers(&self, addrs: Vec<String>, same_host: Vec<bool>) -> PyResult<()> {
        self.inner
            .set_peers(addrs, same_host)
            .map_err(crate::errors::to_pyerr)
    }

    /// Sends a request; returns its call id. `timeout_s <= 0`: no deadline.
    /// `keep` stays referenced until the callee has copied the tensors.
    #[pyo3(signature = (to, payload, tensors, timeout_s, keep))]
    fn call(
        &self,
        py: Python<'_>,
        to: usize,
        payload: &[u8],
        tensors: Vec<(usize, usize)>,
        timeout_s: f64,
        keep: Py<PyAny>,
    ) -> PyResult<u64> {
        let timeout = deadline(timeout_s);
        with_slices(py, &tensors, move |slices| {
            self.inner
                .call(to, payload, slices, timeout, Box::new(keep))
        })
    }

    /// Sends a request and waits (GIL released) for its outcome.
    #[pyo3(signature = (to, payload, tensors, timeout_s, keep))]
    fn call_wait(
        &self,
        py: Python<'_>,
        to: usize,
        payload: &[u8],
        tensors: Vec<(usize, usize)>,
        timeout_s: f64,
        keep: Py<PyAny>,
    ) -> PyResult<RpcMessage> {
        let timeout = deadline(timeout_s);
        let msg = with_slices(py, &tensors, move |slices| {
            self.inner
                .call_wait(to, payload, slices, timeout, Box::new(keep))
        })?;
        Ok(RpcMessage::new(msg))
    }

    /// Answers a request (`status`: 0 result, 1 exception).
    #[pyo3(signature = (reply, status, payload, tensors, keep))]
    fn respond(
        &self,
        py: Python<'_>,
        reply: &RpcReply,
        status: u8,
        payload: &[u8],
        tensors: Vec<(usize, usize)>,
        keep: Py<PyAny>,
    ) -> PyResult<()> {
        let to = reply.inner.clone();
        with_slices(py, &tensors, move |slices| {
            self.inner
                .respond(&to, status, payload, slices, Box::new(keep))
        })
    }

    /// Calls still waiting for their outcome.
    fn pending(&self) -> usize {
        self.inner.pending()
    }

    /// Connections refused so far (wrong token or garbage greeting).
    fn refused(&self) -> u64 {
        self.inner.refused()
    }

    /// Closes every connection and fails the calls still pending.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        run(py, || {
            self.inner.shutdown();
            Ok(())
        })
    }
}

/// Where to send the answer to a request.
#[pyclass(module = "ringlet._core", frozen)]
pub struct RpcReply {
    inner: ReplyTo,
}

#[pymethods]
impl RpcReply {
    /// The rank that made the request.
    #[getter]
    fn peer(&self) -> usize {
        self.inner.peer()
    }
}

/// A received request or response.
#[pyclass(module = "ringlet._core", frozen)]
pub struct RpcMessage {
    msg: Mutex<Option<Incoming>>,
    id: u64,
    sender: usize,
    status: u8,
    lens: Vec<usize>,
    reply: Option<ReplyTo>,
}

impl RpcMessage {
    fn new(msg: Incoming) -> Self {
        RpcMessage {
            id: msg.id,
            sender: msg.from,
            status: msg.status,
            lens: msg.tensor_lens(),
            reply: msg.reply_to(),
            msg: Mutex::new(Some(msg)),
        }
    }
}

#[pymethods]
impl RpcMessage {
    /// The call id.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }

    /// The rank it came from (or, for a local failure, the callee).
    #[getter]
    fn sender(&self) -> usize {
        self.sender
    }

    /// Outcome code (0 ok, 1 remote exception, 2 timeout, 3 peer lost, 4 shut down).
    #[getter]
    fn status(&self) -> u8 {
        self.status
    }

    /// Byte length of every tensor carried.
    #[getter]
    fn tensor_lens(&self) -> Vec<usize> {
        self.lens.clone()
    }

    /// The payload bytes.
    fn payload<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let g = self.msg.lock().unwrap_or_else(|p| p.into_inner());
        let m = g
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("message already released"))?;
        Ok(PyBytes::new(py, &m.payload))
    }

    /// Copies tensor `i` into the memory at `ptr` (`nbytes` long).
    fn fetch(&self, py: Python<'_>, i: usize, ptr: usize, nbytes: usize) -> PyResult<()> {
        let dst = raw_buf(ptr, nbytes)?;
        run(py, move || {
            let g = self.msg.lock().unwrap_or_else(|p| p.into_inner());
            let m = g.as_ref().ok_or_else(|| {
                ringlet_core::Error::InvalidArgument("message already released".into())
            })?;
            // SAFETY: the caller passes a fresh tensor's memory that nothing
            // else touches during the call.
            m.fetch(i, unsafe { dst.slice_mut() })
        })
    }

    /// Frees the message (acknowledges same-host tensors to the sender).
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        run(py, || {
            self.msg.lock().unwrap_or_else(|p| p.into_inner()).take();
            Ok(())
        })
    }

    /// Where to answer (requests only).
    fn reply_to(&self) -> Option<RpcReply> {
        self.reply.clone().map(|inner| RpcReply { inner })
    }
}

/// Status codes as Python ints, for the front end.
pub fn status_codes() -> [(&'static str, u8); 5] {
    [
        ("RPC_OK", rpc::status::OK),
        ("RPC_ERROR", rpc::status::ERROR),
        ("RPC_TIMEOUT", rpc::status::TIMEOUT),
        ("RPC_PEER_LOST", rpc::status::PEER_LOST),
        ("RPC_SHUTDOWN", rpc::status::SHUTDOWN),
    ]
}
