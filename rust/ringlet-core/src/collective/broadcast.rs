//! Broadcast: every rank's buffer becomes a copy of the root's. The entry
//! point checks the arguments, then runs the two-level broadcast
//! (`hierarchy::broadcast`) on a communicator with levels, else the flat one
//! (`flat::broadcast`).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::Communicator;

const OP: &str = "broadcast";

impl Communicator {
    /// Copies `root`'s `buf` into every rank's `buf`.
    pub fn broadcast(&mut self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()> {
        super::elements(buf.len(), dtype, OP)?;
        if root >= self.size() {
            return Err(Error::InvalidArgument(format!(
                "rank {}: broadcast root {root} is out of range for {} ranks",
                self.rank(),
                self.size()
            )));
        }
        if self.levels.is_some() {
            return self.broadcast_levels(buf, dtype, root);
        }
        self.broadcast_flat(buf, dtype, root)
    }
}
