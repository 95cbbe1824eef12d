//! The one place where engine errors become Python exceptions.
//!
//! The exception classes live in `ringlet/errors.py` so that each can inherit
//! both from `ringlet.RingletError` and from the matching built-in
//! (`TimeoutError`, `ConnectionError`, `ValueError`).

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use ringlet_core::{Cause, Error};

/// What a failure exception carries besides its message (`err.rank`,
/// `err.culprit`, `err.cause`, `err.op`, `err.group`, `err.reported_by`).
#[derive(Default)]
struct Fields {
    rank: Option<usize>,
    culprit: Option<usize>,
    cause: Option<&'static str>,
    op: Option<&'static str>,
    group: Option<String>,
    via: Option<usize>,
}

fn ringlet_exception(py: Python<'_>, class: &str, msg: String, f: Fields) -> PyErr {
    match py.import("ringlet.errors").and_then(|m| m.getattr(class)) {
        Ok(cls) => PyErr::from_value(match cls.call1((msg.clone(),)) {
            Ok(v) => {
                let _ = v.setattr("rank", f.rank);
                let _ = v.setattr("culprit", f.culprit);
                let _ = v.setattr("cause", f.cause);
                let _ = v.setattr("op", f.op);
                let _ = v.setattr("group", f.group);
                let _ = v.setattr("reported_by", f.via);
                v
            }
            Err(e) => return e,
        }),
        Err(_) => PyRuntimeError::new_err(msg),
    }
}

/// Converts an engine error into the Python exception users see.
pub fn to_pyerr(err: Error) -> PyErr {
    Python::with_gil(|py| {
        let msg = err.to_string();
        // A timeout or a lost peer: the culprit and what happened to it.
        let origin = err.origin(usize::MAX);
        let class = match err {
            Error::Timeout { .. } => "CollectiveTimeoutError",
            _ => "PeerLostError",
        };
        match err {
            Error::InvalidArgument(_) => PyValueError::new_err(msg),
            Error::Mismatch { rank, .. } => ringlet_exception(
                py,
                "CollectiveMismatchError",
                msg,
                Fields {
                    rank: Some(rank),
                    ..Fields::default()
                },
            ),
            Error::Timeout {
                rank,
                op,
                group,
                via,
                ..
            }
            | Error::PeerLost {
                rank,
                op,
                group,
                via,
                ..
            } => ringlet_exception(
                py,
                class,
                msg,
                Fields {
                    rank: Some(rank),
                    culprit: origin.map(|o| o.0),
                    cause: origin.map(|o| o.1.name()),
                    op: Some(op),
                    group: Some(group),
                    via,
                },
            ),
            Error::Aborted { rank, origin, .. } => ringlet_exception(
                py,
                "CommunicatorAbortedError",
                msg,
                Fields {
                    rank: Some(rank),
                    culprit: origin.map(|o| o.0),
                    cause: origin.map(|o| o.1.name()),
                    ..Fields::default()
                },
            ),
            Error::Stalled { rank, op, .. } => ringlet_exception(
                py,
                "CollectiveTimeoutError",
                msg,
                Fields {
                    rank: Some(rank),
                    cause: Some(Cause::TimedOut.name()),
                    op: Some(op),
                    ..Fields::default()
                },
            ),
            Error::Io { .. } => ringlet_exception(py, "RingletError", msg, Fields::default()),
            Error::Rpc(_) => PyRuntimeError::new_err(msg),
        }
    })
}
