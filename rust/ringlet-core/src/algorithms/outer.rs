//! DiLoCo's outer synchronisation (and LocalSGD's average) on flat buckets:
//! the pseudo-gradient `global - local` of a fragment's parameters, its
//! average over the replicas on a thread of its own while the next inner
//! steps compute (Streaming DiLoCo's overlap), and the copies between the
//! parameters and the flat global copy.
//!
//! * [`pseudo_gradient`]: `out = global - concat(params)`, one pass.
//! * [`OuterSync::start`]: copies the pseudo-gradient into the working
//!   buffer and averages it there on a thread, exact or quantized
//!   ([`Codec`]: 8-bit per chunk, 4-bit per block), with error feedback as
//!   an option, flat or two-level ([`Comms`]: exact within a host,
//!   quantized across hosts). The pseudo-gradient itself stays as it was,
//!   so a sync interrupted by a lost replica can be averaged again among
//!   the survivors.
//! * [`OuterSync::wait`]: joins the thread; its error (a lost peer, a
//!   timeout) is raised here.
//! * [`scatter`] / [`gather`]: the flat copy into the parameters (the
//!   restore) and the parameters into the flat copy (the save).

use super::arith;
use super::centralized::CentralizedOp;
use super::compressed::Codec;
use super::levels::{Comms, HostTensor};
use crate::dtype::DType;
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

struct Work {
    op: CentralizedOp,
    pseudo: HostTensor,
    avg: HostTensor,
}

/// The average of one flat bucket's pseudo-gradient over the replicas, run
/// on a thread (see the module documentation).
pub struct OuterSync {
    work: Arc<Mutex<Work>>,
    dtype: DType,
    running: Option<JoinHandle<Result<()>>>,
}

fn sizes(what: &str, flat: usize, parts: usize) -> Result<()> {
    if flat != parts {
        return Err(Error::InvalidArgument(format!(
            "{what}: a flat buffer of {flat} bytes against parameters of {parts} bytes in all"
        )));
    }
    Ok(())
}

/// `out = global - concat(locals)` (elements of `dtype`, rounded once to
/// it; float16 and bfloat16 computed in float32).
pub fn pseudo_gradient(
    global: &[u8],
    locals: &[&[u8]],
    out: &mut [u8],
    dtype: DType,
) -> Result<()> {
    arith::require_float(dtype, "a pseudo-gradient")?;
    sizes(
        "pseudo-gradient",
        global.len(),
        locals.iter().map(|l| l.len()).sum(),
    )?;
    sizes("pseudo-gradient", out.len(), global.len())?;
    let mut at = 0;
    for l in locals {
        let r = at..at + l.len();
        arith::sub_into(&mut out[r.clone()], &global[r], l, dtype)?;
        at += l.len();
    }
    Ok(())
}

/// Copies consecutive pieces of `flat` into `dsts` (the restore).
pub fn scatter(flat: &[u8], dsts: &mut [&mut [u8]]) -> Result<()> {
    sizes("restore", flat.len(), dsts.iter().map(|d| d.len()).sum())?;
    let mut at = 0;
    for d in dsts.iter_mut() {
        d.copy_from_slice(&flat[at..at + d.len()]);
        at += d.len();
    }
    Ok(())
}

/// Copies `srcs` one after the other into `flat` (the save).
pub fn gather(srcs: &[&[u8]], flat: &mut [u8]) -> Result<()> {
    sizes("save", flat.len(), srcs.iter().map(|s| s.len()).sum())?;
    let mut at = 0;
    for s in srcs {
        flat[at..at + s.len()].copy_from_slice(s);
        at += s.len();
    }
    Ok(())
}

fn poisoned() -> Error {
    Error::Io {
        context: "an outer synchronisation".into(),
        message: "state poisoned by an earlier panic".into(),
    }
}

impl OuterSync {
    /// The mean over `comms` of the pseudo-gradient in `pseudo`, computed
    /// in `avg` (same size and dtype); `codec` None averages exactly;
    /// `error_feedback` (needs a codec) keeps each quantization's residual
    /// for the next sync.
    pub fn new(
        comms: Comms,
        codec: Option<Codec>,
        error_feedback: bool,
        pseudo: HostTensor,
        avg: HostTensor,
    ) -> Result<OuterSync> {
        let dtype = pseudo.dtype();
        arith::require_float(dtype, "DiLoCo's outer average")?;
        avg.check_fits("the outer average's buffer", pseudo.nbytes(), dtype)?;
        let op = CentralizedOp::new(comms, true, codec, error_feedback)?;
        Ok(OuterSync {
            work: Arc::new(Mutex::new(Work { op, pseudo, avg })),
            dtype,
            running: None,
        })
    }

    /// Starts averaging: the pseudo-gradient is copied into the working
    /// buffer and averaged there by a thread. The caller must not touch
    /// either buffer until [`OuterSync::wait`] returns.
    pub fn start(&mut self) -> Result<()> {
        if self.running.is_some() {
            return Err(Error::InvalidArgument(
                "an outer average is already running: wait for it before starting another".into(),
            ));
        }
        let work = Arc::clone(&self.work);
        let dtype = self.dtype;
        let handle = std::thread::Builder::new()
            .name("ringlet-outer".into())
            .spawn(move || {
                let mut w = work.lock().map_err(|_| poisoned())?;
                let Work { op, pseudo, avg } = &mut *w;
                avg.bytes_mut().copy_from_slice(pseudo.bytes());
                op.apply(avg.bytes_mut(), dtype, 0)
            })
            .map_err(|e| Error::Io {
                context: "starting the outer average's thread".into(),
                message: e.to_string(),
            })?;
        self.running = Some(handle);
        Ok(())
    }

    /// Whether an average was started and not yet waited for.
    pub fn running(&self) -> bool {
        self.running.is_some()
    }

    /// Waits for the average started last; returns at once when none runs.
    pub fn wait(&mut self) -> Result<()> {
        match self.running.take() {
            None => Ok(()),
            Some(h) => h.join().map_err(|_| Error::Io {
                context: "the outer average's thread".into(),
                message: "it panicked".into(),
            })?,
        }
    }
}

impl Drop for OuterSync {
    fn drop(&mut self) {
        // A running average reads and writes the buffers: finish it first.
        let _ = self.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    #[test]
    fn pseudo_gradient_scatter_gather() {
        let global = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        let (a, b) = (f32s(&[0.5, 1.0]), f32s(&[1.0, 1.0, 1.0]));
        let mut out = vec![0u8; 20];
        pseudo_gradient(&global, &[&a, &b], &mut out, DType::F32).unwrap();
        assert_eq!(out, f32s(&[0.5, 1.0, 2.0, 3.0, 4.0]));
        assert!(pseudo_gradient(&global, &[&a], &mut out, DType::F32).is_err());
        assert!(pseudo_gradient(&global, &[&a, &b], &mut out, DType::I32).is_err());
        let (mut x, mut y) = (vec![0u8; 8], vec![0u8; 12]);
        scatter(&global, &mut [&mut x, &mut y]).unwrap();
        assert_eq!(x, f32s(&[1.0, 2.0]));
        assert_eq!(y, f32s(&[3.0, 4.0, 5.0]));
        let mut back = vec![0u8; 20];
        gather(&[&x, &y], &mut back).unwrap();
        assert_eq!(back, global);
        assert!(gather(&[&x], &mut back).is_err());
    }
}
