//! Named tensors, proxies, buckets and the bucket worker: the machinery under
//! the Bagua-style tensor API (`ringlet.bagua.tensor`) and `ringlet.DistributedDataParallel`.
//!
//! * A [`Module`] holds tensors registered by unique name. Each is a *proxy*:
//!   the engine never keeps its address. When a bucket is communicated, the
//!   module asks its [`Resolver`] (supplied by the binding) for the *effective*
//!   tensor behind each name (address, element count, dtype, device), so an
//!   effective tensor that was recreated between steps (a new `.grad`) is found.
//! * Registered tensors are grouped into [`Bucket`]s, in a given order, one
//!   dtype and device per bucket ([`plan_buckets`] cuts by a byte cap);
//!   [`Bucket::layout`] gives the offsets of a flattened bucket.
//! * Marking a tensor ready (optionally with a [`ReadyEvent`] the worker waits
//!   on) enqueues the next bucket in order once all of its tensors are ready.
//!   One worker thread per module runs the bucket operation ([`BucketOp`]:
//!   [`AllReduceOp`] built in, or one supplied by the binding) strictly in
//!   bucket order; [`Module::wait_pending`] blocks until everything enqueued
//!   has finished and returns the worker's first error.

mod bucket;
mod ops;
mod worker;

pub use bucket::{plan_buckets, Bucket, BucketLayout};
pub use ops::{AllReduceOp, BucketOp, BucketOps, BucketTensors, SharedOp};
pub use worker::Module;

use crate::dtype::DType;
use crate::error::Result;
use std::any::Any;

/// What the engine knows about a registered tensor: its name and the shape of
/// its effective tensor at registration (checked again at communication).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    /// Unique name within the module.
    pub name: String,
    /// Number of elements.
    pub count: usize,
    /// Element type.
    pub dtype: DType,
    /// Device string in torch's spelling (`"cpu"`, `"cuda:0"`).
    pub device: String,
}

impl TensorMeta {
    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        self.count * self.dtype.size()
    }
}

/// Memory the engine cannot address directly (a GPU tensor): it is staged
/// through host memory by copying it out and back in.
pub trait DeviceMemory: Send {
    /// Copies the tensor's bytes into `dst` (exactly its size).
    fn download(&self, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` (exactly its size) into the tensor.
    fn upload(&self, src: &[u8]) -> Result<()>;
}

/// Where an effective tensor's data lives.
pub enum Memory {
    /// Host memory at this address, readable and writable by the worker.
    Host(usize),
    /// Device memory, staged through the host.
    Device(Box<dyn DeviceMemory>),
}

/// The tensor a proxy resolves to at communication time.
pub struct Effective {
    pub(crate) memory: Memory,
    /// Number of elements.
    pub count: usize,
    /// Element type.
    pub dtype: DType,
    /// Device string (`"cpu"`, `"cuda:0"`).
    pub device: String,
    /// Page-locked host memory of the tensor's size to stage a device tensor
    /// through (see [`Effective::device_mirrored`]).
    pub(crate) mirror: Option<usize>,
    /// Keeps the owner of the memory (a Python tensor) alive while in use.
    _owner: Option<Box<dyn Any + Send>>,
}

impl Effective {
    fn new(memory: Memory, count: usize, dtype: DType, device: String) -> Effective {
        Effective {
            memory,
            count,
            dtype,
            device,
            mirror: None,
            _owner: None,
        }
    }

    /// An effective tensor in host memory.
    ///
    /// # Safety
    /// `addr..addr + count * dtype.size()` must be valid, suitably aligned for
    /// `dtype`, readable and writable memory for as long as the returned value
    /// lives (keeping `owner` alive must guarantee that), and nothing else may
    /// access it while a bucket operation uses it.
    pub unsafe fn host(
        addr: usize,
        count: usize,
        dtype: DType,
        device: impl Into<String>,
        owner: Option<Box<dyn Any + Send>>,
    ) -> Effective {
        let host = Effective::new(Memory::Host(addr), count, dtype, device.into());
        Effective {
            _owner: owner,
            ..host
        }
    }

    /// An effective tensor in device memory (staged through the host).
    pub fn device(
        mem: Box<dyn DeviceMemory>,
        count: usize,
        dtype: DType,
        device: impl Into<String>,
    ) -> Effective {
        Effective::new(Memory::Device(mem), count, dtype, device.into())
    }

    /// An effective tensor in device memory with a host *mirror*: memory of
    /// its size (page-locked, so device copies run at full speed) that the
    /// binding reserved for it. When the mirrors of a bucket's tensors lie
    /// back to back, the bucket is staged through them and reduced in place
    /// there, instead of through the worker's own buffer.
    ///
    /// # Safety
    /// As for [`Effective::host`], for `mirror..mirror + count *
    /// dtype.size()`, kept alive by `owner`.
    pub unsafe fn device_mirrored(
        mem: Box<dyn DeviceMemory>,
        mirror: usize,
        count: usize,
        dtype: DType,
        device: impl Into<String>,
        owner: Option<Box<dyn Any + Send>>,
    ) -> Effective {
        Effective {
            mirror: Some(mirror),
            _owner: owner,
            ..Effective::device(mem, count, dtype, device)
        }
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    /// The host address, if the data is in host memory.
    pub fn host_addr(&self) -> Option<usize> {
        match self.memory {
            Memory::Host(a) => Some(a),
            Memory::Device(_) => None,
        }
    }
}

/// Finds the effective tensor behind a registered proxy (the binding calls the
/// proxy's getter closure).
pub trait Resolver: Send + Sync {
    /// The effective tensor of `meta.name` right now.
    fn resolve(&self, meta: &TensorMeta) -> Result<Effective>;
}

/// Something the worker waits for before touching a tensor's data (a CUDA
/// event recorded on the producing stream). CPU tensors carry none.
pub trait ReadyEvent: Send {
    /// Blocks until the tensor's producer has finished writing it.
    fn wait(&self) -> Result<()>;
}

#[cfg(test)]
mod tests;
