//! What an algorithm runs on: the group's communicator, or Bagua's two
//! levels; and the host memory algorithm state lives in.

use super::arith;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::group::SharedCommunicator;
use crate::plan::Plan;
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
    /// The hosts and their ranks are the group's [`Plan`], the one the
    /// core's own two-level collectives take.
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
    /// Bagua's two levels, checked against the group's `plan`: `intra` holds
    /// this rank's host, in its place; the leader (the host's first rank)
    /// and only it has `inter`, of one rank per host; `channel`, of one rank
    /// per host, only where the plan has channels.
    pub fn hierarchical(
        plan: &Plan,
        intra: SharedCommunicator,
        inter: Option<SharedCommunicator>,
        channel: Option<SharedCommunicator>,
    ) -> Result<Comms> {
        let (hosts, size) = (plan.hosts(), plan.size());
        if intra.size() != plan.local_size() || intra.rank() != plan.index() {
            return Err(Error::InvalidArgument(format!(
                "the host communicator is rank {} of {} but the plan puts this rank at {} of \
                 its host's {} ranks",
                intra.rank(),
                intra.size(),
                plan.index(),
                plan.local_size()
            )));
        }
        if let Some(c) = &channel {
            if c.size() != hosts || !plan.has_channels() {
                return Err(Error::InvalidArgument(format!(
                    "a channel communicator of {} ranks for {hosts} hosts of {} ranks \
                     (group of {size})",
                    c.size(),
                    intra.size()
                )));
            }
        }
        let leader = plan.index() == 0;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::{Communicator, Config};

    fn one() -> SharedCommunicator {
        SharedCommunicator::new(Communicator::single(Config::default()))
    }

    fn refused(plan: &Plan, inter: bool, channel: bool) -> String {
        let got = Comms::hierarchical(plan, one(), inter.then(one), channel.then(one));
        match got {
            Err(e) => e.to_string(),
            Ok(_) => panic!("accepted {plan:?}"),
        }
    }

    #[test]
    fn bagua_levels_are_checked_against_the_plan() {
        let plan = Plan::of_hosts(&["a"], 0).unwrap();
        let comms = Comms::hierarchical(&plan, one(), Some(one()), None).unwrap();
        assert_eq!(comms.exchange_size(), 1);
        // A channel only where every host holds as many ranks, more than one.
        assert!(refused(&plan, true, true).contains("a channel communicator of 1 ranks"));
        // The host communicator must hold this rank's host, in its place.
        let two = Plan::of_hosts(&["a", "a"], 1).unwrap();
        let e = refused(&two, false, false);
        assert!(
            e.contains("plan puts this rank at 1 of its host's 2 ranks"),
            "{e}"
        );
        // The leader's inter-host communicator holds one rank per host.
        let hosts = Plan::of_hosts(&["a", "b"], 0).unwrap();
        let e = refused(&hosts, true, false);
        assert!(e.contains("has 1 ranks for 2 hosts"), "{e}");
        assert!(refused(&hosts, false, false).contains("needs the inter-host"));
    }
}
