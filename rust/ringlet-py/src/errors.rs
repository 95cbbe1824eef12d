//! The one place where engine errors become Python exceptions.
//!
//! The exception classes live in `ringlet/errors.py` so that each can inherit
//! both from `ringlet.RingletError` and from the matching built-in
//! (`TimeoutError`, `ConnectionError`, `ValueError`).

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use ringlet_core::Error;

fn ringlet_exception(py: Python<'_>, class: &str, msg: String) -> PyErr {
    match py.import("ringlet.errors").and_then(|m| m.getattr(class)) {
        Ok(cls) => PyErr::from_value(match cls.call1((msg.clone(),)) {
            Ok(v) => v,
            Err(e) => return e,
        }),
        Err(_) => PyRuntimeError::new_err(msg),
    }
}

/// Converts an engine error into the Python exception users see.
pub fn to_pyerr(err: Error) -> PyErr {
    Python::with_gil(|py| {
        let msg = err.to_string();
        match err {
            Error::InvalidArgument(_) => PyValueError::new_err(msg),
            Error::Mismatch { .. } => ringlet_exception(py, "CollectiveMismatchError", msg),
            Error::Timeout { .. } => ringlet_exception(py, "CollectiveTimeoutError", msg),
            Error::PeerLost { .. } => ringlet_exception(py, "PeerLostError", msg),
            Error::Aborted { .. } => ringlet_exception(py, "CommunicatorAbortedError", msg),
            Error::Io { .. } => ringlet_exception(py, "RingletError", msg),
            Error::Rpc(_) => PyRuntimeError::new_err(msg),
        }
    })
}
