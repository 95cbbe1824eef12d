//! All-reduce: every rank ends with the element-wise reduction of every
//! rank's buffer, bit-identical on all ranks. The entry points check the
//! arguments, then run the two-level all-reduce (`hierarchy::all_reduce`) on
//! a communicator with levels, else the flat one (`flat::all_reduce`, which
//! describes the algorithms per transport and size).

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::flat::all_reduce::AllReduce;
use crate::group::Communicator;

const OP: &str = "all_reduce";

impl Communicator {
    /// Reduces `buf` (elements of `dtype`) across all ranks, in place.
    pub fn all_reduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        self.reduce_all(AllReduce {
            input: None,
            buf,
            dtype,
            op,
        })
    }

    /// Reduces `input` across all ranks into `out` (the same length),
    /// leaving `input` untouched: the out-of-place form. A one-phase
    /// shared-memory call copies `input` straight into this rank's slot and
    /// reduces the slots into `out` (no extra copy); any other copies
    /// `input` into `out` and reduces there in place.
    pub fn all_reduce_into(
        &mut self,
        input: &[u8],
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if input.len() != out.len() {
            return Err(Error::InvalidArgument(format!(
                "{OP}: the input has {} bytes and the output {}",
                input.len(),
                out.len()
            )));
        }
        self.reduce_all(AllReduce {
            input: Some(input),
            buf: out,
            dtype,
            op,
        })
    }

    /// Checks the arguments of either entry point and runs the all-reduce.
    fn reduce_all(&mut self, args: AllReduce<'_>) -> Result<()> {
        args.op.check(args.dtype)?;
        super::elements(args.buf.len(), args.dtype, OP)?;
        if self.levels.is_some() {
            return self.all_reduce_levels(args);
        }
        self.all_reduce_flat(args)
    }
}
