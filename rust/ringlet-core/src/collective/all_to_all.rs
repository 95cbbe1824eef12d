//! All-to-all with per-peer counts (MPI's `alltoallv`): rank r's `send` holds
//! consecutive blocks, block j (`send_counts[j]` elements) for rank j; its
//! `recv` receives consecutive blocks, block i (`recv_counts[i]` elements)
//! from rank i. The entry point checks the counts against the buffers,
//! exchanges them (with this communicator's all-gather, two-level when it has
//! levels), then runs the two-level all-to-all (`hierarchy::all_to_all`) on
//! a communicator with levels, else the flat one (`flat::all_to_all`).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::Communicator;

impl Communicator {
    /// Sends block j of `send` to rank j and receives block i of `recv` from
    /// rank i; the blocks are `send_counts` / `recv_counts` elements long and
    /// packed in rank order. Rank i's `send_counts[j]` must equal rank j's
    /// `recv_counts[i]`.
    pub fn all_to_all_v(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let (p, me, esz) = (self.size(), self.rank(), dtype.size());
        for (what, counts, buf) in [
            ("send", send_counts, send.len()),
            ("receive", recv_counts, recv.len()),
        ] {
            if counts.len() != p {
                return Err(Error::InvalidArgument(format!(
                    "rank {me}: all_to_all needs {p} {what} counts (one per rank), got {}",
                    counts.len()
                )));
            }
            let total: usize = counts.iter().sum();
            if total * esz != buf {
                return Err(Error::InvalidArgument(format!(
                    "rank {me}: all_to_all {what} counts add up to {total} {} elements \
                     ({} bytes) but the {what} buffer holds {buf} bytes",
                    dtype.name(),
                    total * esz
                )));
            }
        }
        let traffic = self.exchange_counts(send_counts, recv_counts, esz, |c, mine, all| {
            c.all_gather(mine, all, DType::I64)
        })?;
        if self.levels.is_some() {
            return self.all_to_all_levels(send, recv, &traffic, dtype);
        }
        self.all_to_all_flat(send, recv, &traffic, dtype)
    }
}
