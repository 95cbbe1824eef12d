//! Element-wise reduction kernels: one type-erased entry point per shape of
//! call, dispatching on (dtype, op) to tight loops the compiler vectorises.
//!
//! * `reduce_inplace(dst, srcs)`: `dst = dst ⊕ srcs[0] ⊕ srcs[1] ⊕ ...`
//! * `reduce_into(dst, srcs)`:   `dst = srcs[0] ⊕ srcs[1] ⊕ ...`
//!
//! float16 and bfloat16 accumulate in float32 and round once at the end, so a
//! reduction over many ranks loses no more precision than a single rounding.
//! Integer sums and products wrap like torch's. Float min/max propagate NaN.
//! bool is stored as one byte 0/1: sum and max are "or", mul and min are "and".

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use bytemuck::Pod;
use half::{bf16, f16};

/// Elements processed per block when widening half floats to float32.
const HALF_BLOCK: usize = 1024;

fn cast<T: Pod>(bytes: &[u8]) -> Result<&[T]> {
    if bytes.is_empty() {
        return Ok(&[]);
    }
    bytemuck::try_cast_slice(bytes)
        .map_err(|e| Error::InvalidArgument(format!("buffer not aligned for its dtype: {e:?}")))
}

fn cast_mut<T: Pod>(bytes: &mut [u8]) -> Result<&mut [T]> {
    if bytes.is_empty() {
        return Ok(&mut []);
    }
    bytemuck::try_cast_slice_mut(bytes)
        .map_err(|e| Error::InvalidArgument(format!("buffer not aligned for its dtype: {e:?}")))
}

fn check_lengths(dst: usize, srcs: &[&[u8]]) -> Result<()> {
    if let Some(bad) = srcs.iter().find(|s| s.len() != dst) {
        return Err(Error::InvalidArgument(format!(
            "reduce: source of {} bytes does not match destination of {dst} bytes",
            bad.len()
        )));
    }
    Ok(())
}

/// `dst = dst ⊕ srcs[0] ⊕ srcs[1] ⊕ ...` element-wise.
pub fn reduce_inplace(dtype: DType, op: ReduceOp, dst: &mut [u8], srcs: &[&[u8]]) -> Result<()> {
    op.check(dtype)?;
    check_lengths(dst.len(), srcs)?;
    match dtype {
        DType::F32 => float_inplace::<f32>(op, dst, srcs),
        DType::F64 => float_inplace::<f64>(op, dst, srcs),
        DType::F16 => half_inplace::<f16>(op, dst, srcs),
        DType::BF16 => half_inplace::<bf16>(op, dst, srcs),
        DType::I8 => int_inplace::<i8>(op, dst, srcs),
        DType::U8 => int_inplace::<u8>(op, dst, srcs),
        DType::I16 => int_inplace::<i16>(op, dst, srcs),
        DType::I32 => int_inplace::<i32>(op, dst, srcs),
        DType::I64 => int_inplace::<i64>(op, dst, srcs),
        DType::Bool => bool_inplace(op, dst, srcs),
    }
}

/// `dst = srcs[0] ⊕ srcs[1] ⊕ ...` element-wise; `dst` must not alias a source.
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], srcs: &[&[u8]]) -> Result<()> {
    let (first, rest) = srcs
        .split_first()
        .ok_or_else(|| Error::InvalidArgument("reduce_into needs at least one source".into()))?;
    check_lengths(dst.len(), srcs)?;
    dst.copy_from_slice(first);
    reduce_inplace(dtype, op, dst, rest)
}

fn zip_apply<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f(*d, *s);
    }
}

trait Float: Pod + PartialOrd + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> {
    fn nan(self) -> bool;
}
impl Float for f32 {
    fn nan(self) -> bool {
        self.is_nan()
    }
}
impl Float for f64 {
    fn nan(self) -> bool {
        self.is_nan()
    }
}

#[inline(always)]
fn fmin<T: Float>(a: T, b: T) -> T {
    if a < b || a.nan() {
        a
    } else {
        b
    }
}

#[inline(always)]
fn fmax<T: Float>(a: T, b: T) -> T {
    if a > b || a.nan() {
        a
    } else {
        b
    }
}

fn float_slices<T: Float>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    match op {
        ReduceOp::Sum => zip_apply(dst, src, |a, b| a + b),
        ReduceOp::Mul => zip_apply(dst, src, |a, b| a * b),
        ReduceOp::Min => zip_apply(dst, src, fmin),
        ReduceOp::Max => zip_apply(dst, src, fmax),
        // Rejected by ReduceOp::check before dispatch.
        ReduceOp::And | ReduceOp::Or | ReduceOp::Xor => {}
    }
}

fn float_inplace<T: Float>(op: ReduceOp, dst: &mut [u8], srcs: &[&[u8]]) -> Result<()> {
    let d = cast_mut::<T>(dst)?;
    for s in srcs {
        float_slices(op, d, cast::<T>(s)?);
    }
    Ok(())
}

trait Half: Pod {
    fn widen(self) -> f32;
    fn narrow(v: f32) -> Self;
}
impl Half for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(v: f32) -> Self {
        f16::from_f32(v)
    }
}
impl Half for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

fn half_inplace<H: Half>(op: ReduceOp, dst: &mut [u8], srcs: &[&[u8]]) -> Result<()> {
    let d = cast_mut::<H>(dst)?;
    let s: Vec<&[H]> = srcs.iter().map(|s| cast::<H>(s)).collect::<Result<_>>()?;
    let mut acc = [0f32; HALF_BLOCK];
    let mut wide = [0f32; HALF_BLOCK];
    let mut start = 0;
    while start < d.len() {
        let n = HALF_BLOCK.min(d.len() - start);
        let block = &mut d[start..start + n];
        for (a, h) in acc.iter_mut().zip(block.iter()) {
            *a = h.widen();
        }
        for src in &s {
            for (w, h) in wide.iter_mut().zip(&src[start..start + n]) {
                *w = h.widen();
            }
            float_slices(op, &mut acc[..n], &wide[..n]);
        }
        for (h, a) in block.iter_mut().zip(acc.iter()) {
            *h = H::narrow(*a);
        }
        start += n;
    }
    Ok(())
}

trait Int: Pod + Ord {
    fn wrapping_add(self, o: Self) -> Self;
    fn wrapping_mul(self, o: Self) -> Self;
    fn bitand(self, o: Self) -> Self;
    fn bitor(self, o: Self) -> Self;
    fn bitxor(self, o: Self) -> Self;
}
macro_rules! int_impl {
    ($($t:ty),*) => {$(
        impl Int for $t {
            #[inline(always)] fn wrapping_add(self, o: Self) -> Self { <$t>::wrapping_add(self, o) }
            #[inline(always)] fn wrapping_mul(self, o: Self) -> Self { <$t>::wrapping_mul(self, o) }
            #[inline(always)] fn bitand(self, o: Self) -> Self { self & o }
            #[inline(always)] fn bitor(self, o: Self) -> Self { self | o }
            #[inline(always)] fn bitxor(self, o: Self) -> Self { self ^ o }
        }
    )*};
}
int_impl!(i8, u8, i16, i32, i64);

fn int_inplace<T: Int>(op: ReduceOp, dst: &mut [u8], srcs: &[&[u8]]) -> Result<()> {
    let d = cast_mut::<T>(dst)?;
    for s in srcs {
        let s = cast::<T>(s)?;
        match op {
            ReduceOp::Sum => zip_apply(d, s, T::wrapping_add),
            ReduceOp::Mul => zip_apply(d, s, T::wrapping_mul),
            ReduceOp::Min => zip_apply(d, s, Ord::min),
            ReduceOp::Max => zip_apply(d, s, Ord::max),
            ReduceOp::And => zip_apply(d, s, T::bitand),
            ReduceOp::Or => zip_apply(d, s, T::bitor),
            ReduceOp::Xor => zip_apply(d, s, T::bitxor),
        }
    }
    Ok(())
}

fn bool_inplace(op: ReduceOp, dst: &mut [u8], srcs: &[&[u8]]) -> Result<()> {
    for s in srcs {
        match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::Or => zip_apply(dst, s, |a, b| a | b),
            ReduceOp::Mul | ReduceOp::Min | ReduceOp::And => zip_apply(dst, s, |a, b| a & b),
            ReduceOp::Xor => zip_apply(dst, s, |a, b| a ^ b),
        }
    }
    Ok(())
}

/// Widens a float16/bfloat16 buffer to float32 (used by transports that
/// carry partial sums between ranks, so they accumulate in float32).
pub fn widen_half(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    match dtype {
        DType::F16 => widen::<f16>(src, dst),
        DType::BF16 => widen::<bf16>(src, dst),
        other => Err(Error::InvalidArgument(format!(
            "widen_half: {} is not a half type",
            other.name()
        ))),
    }
}

/// Rounds float32 values back to float16/bfloat16.
pub fn narrow_half(dtype: DType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    match dtype {
        DType::F16 => narrow::<f16>(src, dst),
        DType::BF16 => narrow::<bf16>(src, dst),
        other => Err(Error::InvalidArgument(format!(
            "narrow_half: {} is not a half type",
            other.name()
        ))),
    }
}

fn widen<H: Half>(src: &[u8], dst: &mut [f32]) -> Result<()> {
    for (d, h) in dst.iter_mut().zip(cast::<H>(src)?) {
        *d = h.widen();
    }
    Ok(())
}

fn narrow<H: Half>(src: &[f32], dst: &mut [u8]) -> Result<()> {
    for (h, s) in cast_mut::<H>(dst)?.iter_mut().zip(src) {
        *h = H::narrow(*s);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn f32_ops() {
        let a = bytes(&[1.0f32, -2.0, f32::NAN, 4.0]);
        let b = bytes(&[3.0f32, 5.0, 1.0, f32::NAN]);
        let mut d = a.clone();
        reduce_inplace(DType::F32, ReduceOp::Sum, &mut d, &[&b]).unwrap();
        let r: &[f32] = bytemuck::cast_slice(&d);
        assert_eq!(&r[..2], &[4.0, 3.0]);
        assert!(r[2].is_nan() && r[3].is_nan());
        for op in [ReduceOp::Min, ReduceOp::Max] {
            let mut d = a.clone();
            reduce_inplace(DType::F32, op, &mut d, &[&b]).unwrap();
            let r: &[f32] = bytemuck::cast_slice(&d);
            assert!(r[2].is_nan() && r[3].is_nan(), "{op:?} must propagate NaN");
        }
        let mut d = a.clone();
        assert!(reduce_inplace(DType::F32, ReduceOp::And, &mut d, &[&b]).is_err());
    }

    #[test]
    fn int_ops_wrap_and_bitwise() {
        let a = bytes(&[i8::MAX, 6, -3]);
        let b = bytes(&[1i8, 3, 5]);
        let cases = [
            (ReduceOp::Sum, [i8::MIN, 9, 2]),
            (ReduceOp::Mul, [i8::MAX, 18, -15]),
            (ReduceOp::Min, [1, 3, -3]),
            (ReduceOp::Max, [i8::MAX, 6, 5]),
            (ReduceOp::And, [1, 2, 5]),
            (ReduceOp::Or, [i8::MAX, 7, -3]),
            (ReduceOp::Xor, [126, 5, -8]),
        ];
        for (op, want) in cases {
            let mut d = vec![0u8; 3];
            reduce_into(DType::I8, op, &mut d, &[&a, &b]).unwrap();
            assert_eq!(d, bytes(&want), "{op:?}");
        }
    }

    #[test]
    fn bool_ops() {
        let a = vec![0u8, 0, 1, 1];
        let b = vec![0u8, 1, 0, 1];
        for (op, want) in [
            (ReduceOp::Sum, [0u8, 1, 1, 1]),
            (ReduceOp::Mul, [0, 0, 0, 1]),
            (ReduceOp::And, [0, 0, 0, 1]),
            (ReduceOp::Or, [0, 1, 1, 1]),
            (ReduceOp::Xor, [0, 1, 1, 0]),
        ] {
            let mut d = vec![0u8; 4];
            reduce_into(DType::Bool, op, &mut d, &[&a, &b]).unwrap();
            assert_eq!(d, want, "{op:?}");
        }
    }

    #[test]
    fn half_accumulates_in_f32() {
        // 2048 + 1 + 1 in float16 step by step stays 2048; in float32 it is 2050.
        let vals = [2048.0f32, 1.0, 1.0].map(f16::from_f32);
        let srcs: Vec<Vec<u8>> = vals.iter().map(|v| bytes(&vec![*v; 3000])).collect();
        let refs: Vec<&[u8]> = srcs.iter().map(|s| s.as_slice()).collect();
        let mut d = vec![0u8; 6000];
        reduce_into(DType::F16, ReduceOp::Sum, &mut d, &refs).unwrap();
        let r: &[f16] = bytemuck::cast_slice(&d);
        assert!(r.iter().all(|v| v.to_f32() == 2050.0));
    }

    #[test]
    fn empty_buffers_need_no_alignment() {
        let mut d: [u8; 0] = [];
        reduce_inplace(DType::F64, ReduceOp::Sum, &mut d, &[&[]]).unwrap();
    }

    #[test]
    fn length_mismatch_is_an_error() {
        let mut d = vec![0u8; 8];
        assert!(reduce_inplace(DType::F32, ReduceOp::Sum, &mut d, &[&[0u8; 4]]).is_err());
    }
}
