//! Reduce-scatter: `input` holds `size` equal blocks; rank r receives the
//! element-wise reduction of block r over all ranks. The entry point checks
//! the arguments, then runs the two-level reduce-scatter
//! (`hierarchy::reduce_scatter`) on a communicator with levels, else the
//! flat one (`flat::reduce_scatter`).

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::flat::reduce_scatter::ReduceScatter;
use crate::group::Communicator;

const OP: &str = "reduce_scatter";

impl Communicator {
    /// Reduces block r of every rank's `input` into this rank's `output`
    /// (`input.len() == size * output.len()`).
    pub fn reduce_scatter(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        op.check(dtype)?;
        super::elements(output.len(), dtype, OP)?;
        if input.len() != output.len() * self.size() {
            return Err(Error::InvalidArgument(format!(
                "rank {}: reduce_scatter input holds {} bytes, expected {} ({} ranks x {} bytes)",
                self.rank(),
                input.len(),
                output.len() * self.size(),
                self.size(),
                output.len()
            )));
        }
        let args = ReduceScatter {
            input,
            output,
            dtype,
            op,
        };
        if self.levels.is_some() {
            return self.reduce_scatter_levels(args);
        }
        self.reduce_scatter_flat(args)
    }
}
