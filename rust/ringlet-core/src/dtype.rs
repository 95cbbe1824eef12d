//! Element types and reduce operations understood by the engine.

use crate::error::{Error, Result};

/// Element type of a communicated buffer (names follow `torch.dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DType {
    F32 = 0,
    F64 = 1,
    F16 = 2,
    BF16 = 3,
    I8 = 4,
    U8 = 5,
    I16 = 6,
    I32 = 7,
    I64 = 8,
    Bool = 9,
}

/// Every dtype, in code order.
pub const ALL_DTYPES: [DType; 10] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I8,
    DType::U8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::Bool,
];

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The torch name of the dtype (`"float32"`, `"bfloat16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::Bool => "bool",
        }
    }

    /// Parses a torch dtype name.
    pub fn from_name(name: &str) -> Result<Self> {
        ALL_DTYPES
            .iter()
            .copied()
            .find(|d| d.name() == name)
            .ok_or_else(|| Error::InvalidArgument(format!("unsupported dtype '{name}'")))
    }

    /// Inverse of `self as u32`.
    pub fn from_code(code: u32) -> Option<Self> {
        ALL_DTYPES.get(code as usize).copied()
    }

    /// True for float32/64, float16 and bfloat16.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

/// A reduction applied element-wise across ranks (names follow xla_model's
/// `REDUCE_*` constants).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ReduceOp {
    Sum = 0,
    Mul = 1,
    Min = 2,
    Max = 3,
    And = 4,
    Or = 5,
    Xor = 6,
}

/// Every reduce op, in code order.
pub const ALL_OPS: [ReduceOp; 7] = [
    ReduceOp::Sum,
    ReduceOp::Mul,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::And,
    ReduceOp::Or,
    ReduceOp::Xor,
];

impl ReduceOp {
    /// The xla_model name (`"sum"`, `"mul"`, `"min"`, `"max"`, `"and"`, `"or"`),
    /// plus `"xor"` (torch.distributed's `BXOR`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mul => "mul",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::And => "and",
            ReduceOp::Or => "or",
            ReduceOp::Xor => "xor",
        }
    }

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

    /// Inverse of `self as u32`.
    pub fn from_code(code: u32) -> Option<Self> {
        ALL_OPS.get(code as usize).copied()
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
