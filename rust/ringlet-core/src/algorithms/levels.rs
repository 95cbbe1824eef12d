//! What an algorithm runs on: the group's communicator, or Bagua's two
//! levels; and the host memory algorithm state lives in.

use super::arith;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::group::SharedCommunicator;
use std::any::Any;

/// The communicators of one algorithm instance (dedicated to it: nothing
/// else may use them while its operations run).
#[derive(Clone)]
pub enum Comms {
    /// Every rank of the group on one communicator (Bagua's
    /// `hierarchical=False`).
    Flat(SharedCommunicator),
    /// Bagua's `hierarchical=True`: `intra` holds the group's ranks on this
    /// host (its rank 0 is the host's *leader*), `inter` the leaders of the
    /// `hosts` hosts (`None` on other ranks); `size` is the group's size.
    /// When every host holds the same number of the group's ranks, `channel`
    /// holds the ranks at this rank's position on every host (the leaders'
    /// channel is `inter`): a centralized operation then splits the bucket
    /// among the host's ranks and each carries its share across hosts.
    Hierarchical {
        intra: SharedCommunicator,
        inter: Option<SharedCommunicator>,
        channel: Option<SharedCommunicator>,
        hosts: usize,
        size: usize,
    },
}

impl Comms {
    /// Bagua's two levels, checked: the leader (rank 0 of `intra`) and only
    /// it has `inter`, of `hosts` ranks.
    pub fn hierarchical(
        intra: SharedCommunicator,
        inter: Option<SharedCommunicator>,
        channel: Option<SharedCommunicator>,
        hosts: usize,
        size: usize,
    ) -> Result<Comms> {
        if let Some(c) = &channel {
            if c.size() != hosts || size != hosts * intra.size() {
                return Err(Error::InvalidArgument(format!(
                    "a channel communicator of {} ranks for {hosts} hosts of {} ranks \
                     (group of {size})",
                    c.size(),
                    intra.size()
                )));
            }
        }
        let leader = intra.rank() == 0;
        match &inter {
            Some(c) if !leader => {
                return Err(Error::InvalidArgument(format!(
                    "rank {} of its host is not the host's first rank but got an \
                     inter-host communicator of {} ranks",
                    intra.rank(),
                    c.size()
                )))
            }
            Some(c) if c.size() != hosts => {
                return Err(Error::InvalidArgument(format!(
                    "the inter-host communicator has {} ranks for {hosts} hosts",
                    c.size()
                )))
            }
            None if leader => {
                return Err(Error::InvalidArgument(
                    "the first rank of a host needs the inter-host communicator".into(),
                ))
            }
            _ => {}
        }
        if hosts == 0 || size < intra.size() {
            return Err(Error::InvalidArgument(format!(
                "a group of {size} ranks on {hosts} hosts cannot have {} ranks on this host",
                intra.size()
            )));
        }
        Ok(Comms::Hierarchical {
            intra,
            inter,
            channel,
            hosts,
            size,
        })
    }

    /// The number of ranks that take part in the exchange step: the group
    /// (flat), or the hosts (hierarchical).
    pub fn exchange_size(&self) -> usize {
        match self {
            Comms::Flat(c) => c.size(),
            Comms::Hierarchical { hosts, .. } => *hosts,
        }
    }
}

/// Sums `buf` over `comm` (exact).
pub(crate) fn sum(comm: &SharedCommunicator, buf: &mut [u8], dtype: DType) -> Result<()> {
    comm.with(|c| c.all_reduce(buf, dtype, ReduceOp::Sum))
}

/// Sums `buf` over `comm` and divides by `divisor` when averaging.
pub(crate) fn reduce(
    comm: &SharedCommunicator,
    buf: &mut [u8],
    dtype: DType,
    divisor: Option<usize>,
) -> Result<()> {
    sum(comm, buf, dtype)?;
    match divisor {
        Some(d) if d > 1 => arith::div(buf, dtype, d as f64),
        _ => Ok(()),
    }
}

/// Copies `buf` of `comm`'s rank 0 to its other ranks.
pub(crate) fn broadcast(comm: &SharedCommunicator, buf: &mut [u8], dtype: DType) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    comm.with(|c| c.broadcast(buf, dtype, 0))
}

/// Host memory an algorithm keeps state in (a peer weight, a replica),
/// owned by the binding (a CPU tensor) and kept alive by `owner`.
pub struct HostTensor {
    addr: usize,
    len: usize,
    dtype: DType,
    _owner: Option<Box<dyn Any + Send>>,
}

impl HostTensor {
    /// `nbytes` bytes of `dtype` elements at `addr`.
    ///
    /// # Safety
    /// `addr..addr + nbytes` must be valid, readable and writable memory,
    /// aligned for `dtype`, for as long as the returned value lives (keeping
    /// `owner` alive must guarantee that), and nothing may write it while an
    /// operation of the algorithm runs.
    pub unsafe fn new(
        addr: usize,
        nbytes: usize,
        dtype: DType,
        owner: Option<Box<dyn Any + Send>>,
    ) -> Result<HostTensor> {
        if addr == 0 && nbytes != 0 {
            return Err(Error::InvalidArgument(
                "an algorithm state tensor has a null data pointer".into(),
            ));
        }
        if !nbytes.is_multiple_of(dtype.size()) || !addr.is_multiple_of(dtype.size()) {
            return Err(Error::InvalidArgument(format!(
                "an algorithm state tensor of {nbytes} bytes at {addr:#x} is not an \
                 aligned run of {} elements",
                dtype.name()
            )));
        }
        Ok(HostTensor {
            addr,
            len: nbytes,
            dtype,
            _owner: owner,
        })
    }

    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its size in bytes.
    pub fn nbytes(&self) -> usize {
        self.len
    }

    /// Its bytes.
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: valid, live memory of `len` bytes per `new`'s contract.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// Its bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: valid, live memory of `len` bytes per `new`'s contract,
        // and `&mut self` makes this the only view handed out.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }

    /// Checks that it can hold a bucket of `nbytes` bytes of `dtype`.
    pub(crate) fn check_fits(&self, what: &str, nbytes: usize, dtype: DType) -> Result<()> {
        if self.len != nbytes || self.dtype != dtype {
            return Err(Error::InvalidArgument(format!(
                "{what} holds {} bytes of {} but the bucket holds {nbytes} bytes of {}",
                self.len,
                self.dtype.name(),
                dtype.name()
            )));
        }
        Ok(())
    }
}
