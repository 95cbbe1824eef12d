//! Element types and reduce operations understood by the engine.

use crate::error::{Error, Result};

coded_enum! {
    /// Element type of a communicated buffer (names follow `torch.dtype`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum DType: u32 {
        F32 = 0 => "float32", 4;
        F64 = 1 => "float64", 8;
        F16 = 2 => "float16", 2;
        BF16 = 3 => "bfloat16", 2;
        I8 = 4 => "int8", 1;
        U8 = 5 => "uint8", 1;
        I16 = 6 => "int16", 2;
        I32 = 7 => "int32", 4;
        I64 = 8 => "int64", 8;
        Bool = 9 => "bool", 1;
    }
    /// The torch name of the dtype (`"float32"`, `"bfloat16"`, ...).
    fn name;
    /// Bytes per element.
    fn size -> usize;
}

/// Every dtype, in code order.
pub const ALL_DTYPES: [DType; 10] = DType::ALL;

impl DType {
    /// Parses a torch dtype name.
    pub fn from_name(name: &str) -> Result<Self> {
        ALL_DTYPES
            .iter()
            .copied()
            .find(|d| d.name() == name)
            .ok_or_else(|| Error::InvalidArgument(format!("unsupported dtype '{name}'")))
    }

    /// True for float32/64, float16 and bfloat16.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

coded_enum! {
    /// A reduction applied element-wise across ranks (names follow xla_model's
    /// `REDUCE_*` constants).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum ReduceOp: u32 {
        Sum = 0 => "sum",
        Mul = 1 => "mul",
        Min = 2 => "min",
        Max = 3 => "max",
        And = 4 => "and",
        Or = 5 => "or",
        Xor = 6 => "xor",
    }
    /// The xla_model name (`"sum"`, `"mul"`, `"min"`, `"max"`, `"and"`, `"or"`),
    /// plus `"xor"` (torch.distributed's `BXOR`).
    fn name;
}

/// Every reduce op, in code order.
pub const ALL_OPS: [ReduceOp; 7] = ReduceOp::ALL;

impl ReduceOp {
    /// Parses an xla_model reduce-type name.
    pub fn from_name(name: &str) -> Result<Self> {
        ALL_OPS
            .iter()
            .copied()
            .find(|o| o.name() == name)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown reduce type '{name}' (expected one of sum, mul, min, max, and, or, xor)"
                ))
            })
    }

    /// Checks that this op is defined for `dtype`: `and`/`or`/`xor` need bool or
    /// integer elements.
    pub fn check(self, dtype: DType) -> Result<()> {
        if matches!(self, ReduceOp::And | ReduceOp::Or | ReduceOp::Xor) && dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "reduce type '{}' is not defined for {} tensors (use a bool or integer dtype)",
                self.name(),
                dtype.name()
            )));
        }
        Ok(())
    }
}
