//! All-gather: rank r's input lands in block r of every rank's output
//! (`output.len() == size * input.len()`). The entry point checks the
//! arguments, then runs the two-level all-gather (`hierarchy::all_gather`)
//! on a communicator with levels, else the flat one (`flat::all_gather`).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::Communicator;

const OP: &str = "all_gather";

impl Communicator {
    /// Gathers every rank's `input` into `output`, block r from rank r.
    pub fn all_gather(&mut self, input: &[u8], output: &mut [u8], dtype: DType) -> Result<()> {
        super::elements(input.len(), dtype, OP)?;
        if output.len() != input.len() * self.size() {
            return Err(Error::InvalidArgument(format!(
                "rank {}: all_gather output holds {} bytes, expected {} ({} ranks x {} bytes)",
                self.rank(),
                output.len(),
                input.len() * self.size(),
                self.size(),
                input.len()
            )));
        }
        if self.levels.is_some() {
            return self.all_gather_levels(input, output, dtype);
        }
        self.all_gather_flat(input, output, dtype)
    }
}
