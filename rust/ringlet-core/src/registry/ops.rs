//! Bucket operations: what the worker runs on a bucket once all of its
//! tensors are ready. All-reduce is built in; the binding supplies others
//! (a Python callable).

use super::{Effective, Memory, Resolver, TensorMeta};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::group::Communicator;
use half::{bf16, f16};

/// The bucket handed to a [`BucketOp`]: its position in the module's bucket
/// order and its tensors, resolvable to their effective tensors.
pub struct BucketTensors<'a> {
    /// Position of the bucket in the module's order.
    pub index: usize,
    /// The bucket's tensors, in order.
    pub tensors: &'a [TensorMeta],
    pub(crate) resolver: &'a dyn Resolver,
}

impl BucketTensors<'_> {
    /// Resolves every tensor of the bucket to its effective tensor, checking
    /// that each still has the element count, dtype and device it was
    /// registered with.
    pub fn resolve_all(&self) -> Result<Vec<Effective>> {
        self.tensors
            .iter()
            .map(|m| {
                let e = self.resolver.resolve(m)?;
                if e.count != m.count || e.dtype != m.dtype || e.device != m.device {
                    return Err(Error::InvalidArgument(format!(
                        "the effective tensor of '{}' is now {} {} elements on {}, \
                         but it was registered as {} {} elements on {}",
                        m.name,
                        e.count,
                        e.dtype.name(),
                        e.device,
                        m.count,
                        m.dtype.name(),
                        m.device
                    )));
                }
                Ok(e)
            })
            .collect()
    }
}

/// An operation the worker runs on each bucket, in bucket order.
pub trait BucketOp: Send {
    /// Runs on one bucket whose tensors are all ready.
    fn run(&mut self, bucket: &BucketTensors<'_>) -> Result<()>;
}

/// Built-in all-reduce of every bucket (sum, or average over the ranks) over a
/// communicator owned by the operation, so the worker never interleaves with
/// collectives the user runs on other communicators.
pub struct AllReduceOp {
    comm: Communicator,
    average: bool,
    /// Host memory that scattered or device tensors are staged through,
    /// kept from bucket to bucket (its pages are touched once, not faulted
    /// in afresh for every bucket of every step).
    staging: Vec<u64>,
}

impl AllReduceOp {
    /// Sums (or averages, when `average`) every bucket across `comm`'s ranks.
    pub fn new(comm: Communicator, average: bool) -> AllReduceOp {
        AllReduceOp {
            comm,
            average,
            staging: Vec::new(),
        }
    }

    fn reduce(&mut self, buf: &mut [u8], dtype: DType) -> Result<()> {
        self.comm.all_reduce(buf, dtype, ReduceOp::Sum)?;
        if self.average && self.comm.size() > 1 {
            scale(buf, dtype, 1.0 / self.comm.size() as f64)?;
        }
        Ok(())
    }
}

impl BucketOp for AllReduceOp {
    fn run(&mut self, bucket: &BucketTensors<'_>) -> Result<()> {
        let Some(dtype) = bucket.tensors.first().map(|t| t.dtype) else {
            return Ok(());
        };
        if self.average && !dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "bucket {}: averaging needs floating-point tensors, not {}",
                bucket.index,
                dtype.name()
            )));
        }
        let mut staging = std::mem::take(&mut self.staging);
        let out = bucket.with_host(&mut staging, |buf| self.reduce(buf, dtype));
        self.staging = staging;
        out
    }
}

impl BucketTensors<'_> {
    /// [`BucketTensors::with_host`] with the bucket's dtype handed to `f`
    /// (nothing to do for an empty bucket): how every algorithm operation
    /// runs.
    pub fn on_host(
        &self,
        staging: &mut Vec<u64>,
        f: impl FnOnce(&mut [u8], DType) -> Result<()>,
    ) -> Result<()> {
        let Some(dtype) = self.tensors.first().map(|t| t.dtype) else {
            return Ok(());
        };
        self.with_host(staging, |buf| f(buf, dtype))
    }

    /// Runs `f` on the bucket's data as one contiguous host buffer (its
    /// tensors back to back, in bucket order): the tensors' own memory when
    /// they are a flattened bucket in host memory, their back-to-back host
    /// mirrors for device tensors that have them, else `staging` (kept by
    /// the caller from bucket to bucket), filled from the tensors before
    /// and copied back into them after `f`. The dtype is the bucket's.
    pub fn with_host(
        &self,
        staging: &mut Vec<u64>,
        f: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let effs = self.resolve_all()?;
        if let Some((addr, len)) = contiguous_host(&effs) {
            // A flattened bucket: work on its memory in place, no copy.
            if len == 0 {
                return f(&mut []);
            }
            // SAFETY: every tensor of the run is host memory the resolver
            // vouched for (see `Effective::host`), kept alive by `effs`, and
            // the tensors are back to back, so the union is one valid range.
            let buf = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            return f(buf);
        }
        if let Some((addr, len)) = contiguous_mirrors(&effs) {
            // Device tensors with back-to-back host mirrors: stage through them.
            // SAFETY: each mirror is host memory of its tensor's size vouched
            // for by the binding (see `Effective::device_mirrored`) and kept
            // alive by `effs`; they are back to back, so the union is one
            // valid range, used by nothing else while the bucket runs.
            let buf = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            return through(&effs, buf, f);
        }
        // Scattered or device tensors: stage through one host buffer.
        let total: usize = effs.iter().map(Effective::nbytes).sum();
        if staging.len() < total.div_ceil(8) {
            *staging = vec![0u64; total.div_ceil(8)];
        }
        let stage = &mut bytemuck::cast_slice_mut::<u64, u8>(staging)[..total];
        through(&effs, stage, f)
    }
}

/// Copies the bucket's tensors, in order, into `stage` (their total size),
/// runs `f` on it, and copies the result back.
fn through(
    effs: &[Effective],
    stage: &mut [u8],
    f: impl FnOnce(&mut [u8]) -> Result<()>,
) -> Result<()> {
    copy_all(effs, stage, true)?;
    f(stage)?;
    copy_all(effs, stage, false)
}

/// Copies each tensor of `effs` into its place in `stage` (`down`), or
/// back from it.
fn copy_all(effs: &[Effective], stage: &mut [u8], down: bool) -> Result<()> {
    let mut at = 0;
    for e in effs {
        let n = e.nbytes();
        let part = &mut stage[at..at + n];
        match &e.memory {
            Memory::Host(_) if n == 0 => {}
            // SAFETY: host memory of `n` bytes vouched for by the resolver
            // and kept alive by `effs`; the worker is the only user of the
            // tensor while the bucket operation runs.
            Memory::Host(a) if down => {
                part.copy_from_slice(unsafe { std::slice::from_raw_parts(*a as *const u8, n) })
            }
            // SAFETY: as above.
            Memory::Host(a) => {
                unsafe { std::slice::from_raw_parts_mut(*a as *mut u8, n) }.copy_from_slice(part)
            }
            Memory::Device(d) if down => d.download(part)?,
            Memory::Device(d) => d.upload(part)?,
        }
        at += n;
    }
    Ok(())
}

/// One operation shared between the worker (in a [`BucketOps`] list) and
/// whoever else drives it (the binding's handle, for an operation's extra
/// methods such as copying a peer weight back).
pub struct SharedOp<T>(pub std::sync::Arc<std::sync::Mutex<T>>);

impl<T> Clone for SharedOp<T> {
    fn clone(&self) -> Self {
        SharedOp(std::sync::Arc::clone(&self.0))
    }
}

impl<T: BucketOp> BucketOp for SharedOp<T> {
    fn run(&mut self, bucket: &BucketTensors<'_>) -> Result<()> {
        let mut op = self.0.lock().map_err(|_| Error::Io {
            context: format!("bucket {}", bucket.index),
            message: "operation state poisoned by an earlier panic".into(),
        })?;
        op.run(bucket)
    }
}

/// Bagua's per-bucket operation lists: bucket `i` runs `lists[i]` in order
/// (a bucket without a list, or with an empty one, runs nothing).
#[derive(Default)]
pub struct BucketOps {
    lists: Vec<Vec<Box<dyn BucketOp>>>,
}

impl BucketOps {
    /// The lists, by bucket position.
    pub fn new(lists: Vec<Vec<Box<dyn BucketOp>>>) -> Self {
        BucketOps { lists }
    }
}

impl BucketOp for BucketOps {
    fn run(&mut self, bucket: &BucketTensors<'_>) -> Result<()> {
        if let Some(list) = self.lists.get_mut(bucket.index) {
            for op in list {
                op.run(bucket)?;
            }
        }
        Ok(())
    }
}

/// The address and length of the memory `addr_of` gives for each tensor,
/// when every tensor has some and they lie back to back in order.
fn back_to_back(
    effs: &[Effective],
    addr_of: impl Fn(&Effective) -> Option<usize>,
) -> Option<(usize, usize)> {
    let start = addr_of(effs.first()?)?;
    let mut end = start;
    for e in effs {
        if addr_of(e)? != end {
            return None;
        }
        end += e.nbytes();
    }
    Some((start, end - start))
}

/// The tensors' memory when all are in host memory, back to back (a
/// flattened bucket).
fn contiguous_host(effs: &[Effective]) -> Option<(usize, usize)> {
    back_to_back(effs, Effective::host_addr)
}

/// The tensors' host mirrors when all are device tensors with one, back to
/// back.
fn contiguous_mirrors(effs: &[Effective]) -> Option<(usize, usize)> {
    back_to_back(effs, |e| match e.memory {
        Memory::Device(_) => e.mirror,
        Memory::Host(_) => None,
    })
}

/// Multiplies every element of a floating-point buffer by `factor`.
pub(crate) fn scale(buf: &mut [u8], dtype: DType, factor: f64) -> Result<()> {
    fn cast<T: bytemuck::Pod>(buf: &mut [u8]) -> Result<&mut [T]> {
        if buf.is_empty() {
            return Ok(&mut []);
        }
        bytemuck::try_cast_slice_mut(buf)
            .map_err(|e| Error::InvalidArgument(format!("buffer not aligned for its dtype: {e:?}")))
    }
    match dtype {
        DType::F32 => cast::<f32>(buf)?
            .iter_mut()
            .for_each(|x| *x = (*x as f64 * factor) as f32),
        DType::F64 => cast::<f64>(buf)?.iter_mut().for_each(|x| *x *= factor),
        DType::F16 => cast::<f16>(buf)?
            .iter_mut()
            .for_each(|x| *x = f16::from_f32(x.to_f32() * factor as f32)),
        DType::BF16 => cast::<bf16>(buf)?
            .iter_mut()
            .for_each(|x| *x = bf16::from_f32(x.to_f32() * factor as f32)),
        other => {
            return Err(Error::InvalidArgument(format!(
                "cannot scale {} elements",
                other.name()
            )))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_every_float_type() {
        let mut a = [2.0f32, -4.0];
        scale(bytemuck::cast_slice_mut(&mut a), DType::F32, 0.5).unwrap();
        assert_eq!(a, [1.0, -2.0]);
        let mut b = [3.0f64];
        scale(bytemuck::cast_slice_mut(&mut b), DType::F64, 1.0 / 3.0).unwrap();
        assert!((b[0] - 1.0).abs() < 1e-15);
        let mut h = [f16::from_f32(6.0)];
        scale(bytemuck::cast_slice_mut(&mut h), DType::F16, 0.5).unwrap();
        assert_eq!(h[0].to_f32(), 3.0);
        let mut g = [bf16::from_f32(6.0)];
        scale(bytemuck::cast_slice_mut(&mut g), DType::BF16, 0.5).unwrap();
        assert_eq!(g[0].to_f32(), 3.0);
        assert!(scale(&mut [0u8; 4], DType::I32, 0.5).is_err());
    }
}
