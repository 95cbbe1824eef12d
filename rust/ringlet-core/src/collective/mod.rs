//! The collectives' public entry points, one file each: every collective is
//! an `impl Communicator` block that checks its arguments, then runs the
//! two-level algorithm (`hierarchy`) on a communicator with levels, else the
//! single-level one (`flat`), which describes the algorithms per transport.
//! Barrier and point-to-point messages have one level only and run here.
//!
//! Every collective starts with an agreement phase in which all ranks compare
//! their operation descriptors, so ranks that disagree get an error, never
//! corrupted data.

mod all_gather;
mod all_reduce;
mod all_to_all;
mod barrier;
mod broadcast;
mod lists;
mod reduce_scatter;
mod send_recv;

pub use lists::ListOp;

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Checks that a byte length holds whole elements.
pub(crate) fn elements(len: usize, dtype: DType, what: &str) -> Result<usize> {
    if !len.is_multiple_of(dtype.size()) {
        return Err(Error::InvalidArgument(format!(
            "{what}: {len} bytes is not a whole number of {} elements",
            dtype.name()
        )));
    }
    Ok(len / dtype.size())
}
