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

mod half_simd;
pub use half_simd::selected_kernels;
use half_simd::Half;

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
        DType::F16 => half_reduce::<f16>(op, dst, None, srcs),
        DType::BF16 => half_reduce::<bf16>(op, dst, None, srcs),
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
    op.check(dtype)?;
    // float16/bfloat16: every source in one pass, the float32 accumulator
    // starting from `s0` widened, which is what copying `s0` and folding the
    // rest in place computes (the same bits widened, the same operations in
    // the same order, one rounding), without writing `dst` and reading it
    // back. (A lone source, too: the in-place fold of no sources rounded the
    // copy again, quieting signalling NaNs, as this does.)
    match dtype {
        DType::F16 => return half_reduce::<f16>(op, dst, Some(first), rest),
        DType::BF16 => return half_reduce::<bf16>(op, dst, Some(first), rest),
        _ => {}
    }
    // The first two sources in one pass (`dst = s0 ⊕ s1`: read each once, write
    // `dst` once, instead of copying `s0` and reading it back), the rest in place.
    if let Some((second, more)) = rest.split_first() {
        let fused = match dtype {
            DType::F32 => float_pair::<f32>(op, dst, first, second)?,
            DType::F64 => float_pair::<f64>(op, dst, first, second)?,
            DType::I8 => int_pair::<i8>(op, dst, first, second)?,
            DType::U8 => int_pair::<u8>(op, dst, first, second)?,
            DType::I16 => int_pair::<i16>(op, dst, first, second)?,
            DType::I32 => int_pair::<i32>(op, dst, first, second)?,
            DType::I64 => int_pair::<i64>(op, dst, first, second)?,
            // (float16/bfloat16 took the whole-reduction path above.)
            DType::F16 | DType::BF16 | DType::Bool => false,
        };
        if fused {
            return reduce_inplace(dtype, op, dst, more);
        }
    }
    dst.copy_from_slice(first);
    reduce_inplace(dtype, op, dst, rest)
}

fn zip_apply<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f(*d, *s);
    }
}

fn zip2_apply<T: Copy>(dst: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
        *d = f(*x, *y);
    }
}

/// `dst = a ⊕ b` for a float type; true when done.
fn float_pair<T: Float>(op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) -> Result<bool> {
    let (d, a, b) = (cast_mut::<T>(dst)?, cast::<T>(a)?, cast::<T>(b)?);
    match op {
        ReduceOp::Sum => zip2_apply(d, a, b, |x, y| x + y),
        ReduceOp::Mul => zip2_apply(d, a, b, |x, y| x * y),
        ReduceOp::Min => zip2_apply(d, a, b, fmin),
        ReduceOp::Max => zip2_apply(d, a, b, fmax),
        ReduceOp::And | ReduceOp::Or | ReduceOp::Xor => return Ok(false),
    }
    Ok(true)
}

/// `dst = a ⊕ b` for an integer type; true when done.
fn int_pair<T: Int>(op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) -> Result<bool> {
    let (d, a, b) = (cast_mut::<T>(dst)?, cast::<T>(a)?, cast::<T>(b)?);
    match op {
        ReduceOp::Sum => zip2_apply(d, a, b, T::wrapping_add),
        ReduceOp::Mul => zip2_apply(d, a, b, T::wrapping_mul),
        ReduceOp::Min => zip2_apply(d, a, b, Ord::min),
        ReduceOp::Max => zip2_apply(d, a, b, Ord::max),
        ReduceOp::And => zip2_apply(d, a, b, T::bitand),
        ReduceOp::Or => zip2_apply(d, a, b, T::bitor),
        ReduceOp::Xor => zip2_apply(d, a, b, T::bitxor),
    }
    Ok(true)
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

/// Widens each group of 8 elements of the start (the destination, or `first`
/// for `reduce_into`) and of every source to float32 in registers, folds them
/// with the float32 kernel's lane operations in source order and rounds once
/// (see `half_simd`).
fn half_reduce<H: Half>(
    op: ReduceOp,
    dst: &mut [u8],
    first: Option<&[u8]>,
    srcs: &[&[u8]],
) -> Result<()> {
    let d = cast_mut::<H>(dst)?;
    let f = first.map(cast::<H>).transpose()?;
    let s: Vec<&[H]> = srcs.iter().map(|s| cast::<H>(s)).collect::<Result<_>>()?;
    match op {
        ReduceOp::Sum => H::reduce(d, f, &s, |a, b| a + b),
        ReduceOp::Mul => H::reduce(d, f, &s, |a, b| a * b),
        ReduceOp::Min => H::reduce(d, f, &s, fmin::<f32>),
        ReduceOp::Max => H::reduce(d, f, &s, fmax::<f32>),
        // Rejected by ReduceOp::check before dispatch.
        ReduceOp::And | ReduceOp::Or | ReduceOp::Xor => {}
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

/// Divides every element of `buf` by `n` as torch's ReduceOp.AVG finishes a
/// sum: floating point by true division (float16 and bfloat16 in float32,
/// rounded once), integers truncating toward zero. bool has no average.
pub fn divide(dtype: DType, buf: &mut [u8], n: usize) -> Result<()> {
    fn ints<T: Pod + TryFrom<usize> + std::ops::Div<Output = T>>(
        buf: &mut [u8],
        n: usize,
    ) -> Result<()> {
        let d = T::try_from(n)
            .map_err(|_| Error::InvalidArgument(format!("divide: {n} overflows the dtype")))?;
        cast_mut::<T>(buf)?.iter_mut().for_each(|x| *x = *x / d);
        Ok(())
    }
    if n == 0 {
        return Err(Error::InvalidArgument("divide: by zero ranks".into()));
    }
    match dtype {
        DType::F32 => {
            let d = n as f32;
            cast_mut::<f32>(buf)?.iter_mut().for_each(|x| *x /= d);
        }
        DType::F64 => {
            let d = n as f64;
            cast_mut::<f64>(buf)?.iter_mut().for_each(|x| *x /= d);
        }
        DType::F16 => {
            let d = n as f32;
            cast_mut::<f16>(buf)?
                .iter_mut()
                .for_each(|x| *x = f16::from_f32(x.to_f32() / d));
        }
        DType::BF16 => {
            let d = n as f32;
            cast_mut::<bf16>(buf)?
                .iter_mut()
                .for_each(|x| *x = bf16::from_f32(x.to_f32() / d));
        }
        DType::I8 => ints::<i8>(buf, n)?,
        DType::U8 => ints::<u8>(buf, n)?,
        DType::I16 => ints::<i16>(buf, n)?,
        DType::I32 => ints::<i32>(buf, n)?,
        DType::I64 => ints::<i64>(buf, n)?,
        DType::Bool => {
            return Err(Error::InvalidArgument(
                "divide: bool tensors have no average".into(),
            ))
        }
    }
    Ok(())
}

fn widen<H: Half>(src: &[u8], dst: &mut [f32]) -> Result<()> {
    H::widen(cast::<H>(src)?, dst);
    Ok(())
}

fn narrow<H: Half>(src: &[f32], dst: &mut [u8]) -> Result<()> {
    H::narrow(src, cast_mut::<H>(dst)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn divide_as_torch_averages() {
        let mut f = bytes(&[3.0f32, -7.0, 1.0]);
        divide(DType::F32, &mut f, 3).unwrap();
        assert_eq!(
            bytemuck::cast_slice::<u8, f32>(&f),
            &[1.0, -7.0 / 3.0, 1.0 / 3.0]
        );
        let mut i = bytes(&[7i32, -7, 2]);
        divide(DType::I32, &mut i, 2).unwrap();
        assert_eq!(bytemuck::cast_slice::<u8, i32>(&i), &[3, -3, 1]);
        let mut h = bytes(&[bf16::from_f32(1.0), bf16::from_f32(10.0)]);
        divide(DType::BF16, &mut h, 3).unwrap();
        let want = [bf16::from_f32(1.0 / 3.0), bf16::from_f32(10.0 / 3.0)];
        assert_eq!(bytemuck::cast_slice::<u8, bf16>(&h), &want);
        assert!(divide(DType::Bool, &mut [1u8], 2).is_err());
        assert!(divide(DType::I8, &mut [1u8], 300).is_err());
        assert!(divide(DType::F32, &mut [], 0).is_err());
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
    fn reduce_into_matches_copy_then_inplace_bit_for_bit() {
        // The fused first pair (dst = s0 ⊕ s1) must give exactly what copying s0
        // and folding the rest in place gives, in source order: signed zeros,
        // NaNs and wrap-around included, for 2 and 3 sources.
        let f = [
            0.0f32,
            -0.0,
            1.5,
            f32::NAN,
            -f32::INFINITY,
            3.0e38,
            -7.25,
            1e-45,
        ];
        let g = [-0.0f32, 0.0, f32::NAN, 2.0, 5.0, 3.0e38, -7.25, -1e-45];
        let h = [1.0f32, -0.0, 0.0, -1.0, f32::NAN, -3.0e38, 0.5, 0.0];
        let d: Vec<f64> = f.iter().map(|&x| x as f64).collect();
        let e: Vec<f64> = g.iter().map(|&x| x as f64).collect();
        let i32s = [i32::MAX, -1, 0, 7, i32::MIN, 3, -5, 1 << 30];
        let i32t = [1i32, i32::MIN, -9, 7, -1, 1 << 30, 5, 4];
        type Case = (DType, Vec<u8>, Vec<u8>, Vec<u8>);
        let cases: Vec<Case> = vec![
            (DType::F32, bytes(&f), bytes(&g), bytes(&h)),
            (DType::F64, bytes(&d), bytes(&e), bytes(&d)),
            (DType::I32, bytes(&i32s), bytes(&i32t), bytes(&i32s)),
            (
                DType::I64,
                bytes(&[i64::MAX, -3]),
                bytes(&[2i64, i64::MIN]),
                bytes(&[5i64, 6]),
            ),
            (
                DType::I8,
                bytes(&[i8::MAX, -128, 3]),
                bytes(&[1i8, -1, 9]),
                bytes(&[2i8, 2, 2]),
            ),
            (DType::U8, vec![255, 0, 7], vec![1, 3, 9], vec![4, 4, 4]),
            (
                DType::I16,
                bytes(&[i16::MIN, 2]),
                bytes(&[-1i16, 3]),
                bytes(&[9i16, 9]),
            ),
        ];
        for (dtype, a, b, c) in cases {
            for op in crate::dtype::ALL_OPS {
                if op.check(dtype).is_err() {
                    continue;
                }
                for srcs in [vec![&a[..], &b[..]], vec![&a[..], &b[..], &c[..]]] {
                    let mut want = srcs[0].to_vec();
                    reduce_inplace(dtype, op, &mut want, &srcs[1..]).unwrap();
                    let mut got = vec![0u8; a.len()];
                    reduce_into(dtype, op, &mut got, &srcs).unwrap();
                    assert_eq!(got, want, "{dtype:?} {op:?} {} sources", srcs.len());
                }
            }
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

    /// The half-precision reduction one element at a time: `half`'s scalar
    /// conversions, the float32 lane operations in source order, one rounding.
    fn scalar_half_reference<H: Pod>(
        op: ReduceOp,
        dst: &mut [H],
        srcs: &[&[H]],
        widen: fn(H) -> f32,
        narrow: fn(f32) -> H,
    ) {
        for (i, d) in dst.iter_mut().enumerate() {
            let mut acc = widen(*d);
            for s in srcs {
                let b = widen(s[i]);
                acc = match op {
                    ReduceOp::Sum => acc + b,
                    ReduceOp::Mul => acc * b,
                    ReduceOp::Min => fmin(acc, b),
                    ReduceOp::Max => fmax(acc, b),
                    ReduceOp::And | ReduceOp::Or | ReduceOp::Xor => unreachable!(),
                };
            }
            *d = narrow(acc);
        }
    }

    /// Half-precision inputs mixing ordinary values with zeros, subnormals,
    /// infinities, NaNs and values whose sums overflow or need rounding.
    fn half_inputs(n: usize, seed: u64) -> Vec<u16> {
        let mut state = seed | 1;
        (0..n)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let r = state as u16;
                match i % 11 {
                    0 => [
                        0x0000, 0x8000, 0x0001, 0x7c00, 0xfc00, 0x7e01, 0x7f80, 0x7fc1,
                    ][r as usize % 8],
                    1 => 0x7bff ^ (r & 0x8003), // large float16 / bfloat16 near the top
                    2 => r & 0x83ff,            // float16 subnormals, tiny bfloat16
                    _ => r,
                }
            })
            .collect()
    }

    /// One half-precision format, as the tests see it.
    struct Format<H> {
        dtype: DType,
        from_bits: fn(u16) -> H,
        widen: fn(H) -> f32,
        narrow: fn(f32) -> H,
        /// Every kernel variant this CPU can run (portable, AVX2, AVX-512).
        kernels: Vec<half_simd::Kernel<H>>,
    }

    impl<H: Pod> Format<H> {
        fn bits(&self, h: H) -> u16 {
            bytemuck::cast(h)
        }

        fn is_nan(&self, h: H) -> bool {
            (self.widen)(h).is_nan()
        }

        /// Whether a kernel result matches the reference at one element.
        /// Bits must be equal, except where two or more NaNs meet in `a + b`
        /// or `a * b` (NaN inputs, or a NaN made by `inf - inf` or `0 * inf`):
        /// Rust leaves open which payload comes out, and the compiler may
        /// swap the operands (the kernel before this one already differed
        /// there between its vector body and its scalar tail), so any of
        /// those NaNs, quieted, is accepted.
        fn same(&self, op: ReduceOp, got: H, want: H, inputs: &[H]) -> bool {
            if self.bits(got) == self.bits(want) {
                return true;
            }
            if matches!(op, ReduceOp::Min | ReduceOp::Max)
                || !self.is_nan(got)
                || !self.is_nan(want)
            {
                return false;
            }
            let mut nans: Vec<u16> = inputs
                .iter()
                .filter(|h| self.is_nan(**h))
                .map(|h| self.bits((self.narrow)((self.widen)(*h))))
                .collect();
            if !nans.contains(&self.bits(want)) {
                nans.push(self.bits(want)); // a NaN the operations made
            }
            // `inf - inf` or `0 * inf` (also of an overflowed or underflowed
            // partial result) makes the default NaN, either sign, which then
            // meets the inputs' NaNs in whichever order the code runs
            if self.bits(got) == self.bits((self.narrow)(f32::NAN))
                || self.bits(got) == self.bits((self.narrow)(-f32::NAN))
            {
                return true;
            }
            nans.len() >= 2 && nans.contains(&self.bits(got))
        }
    }

    fn check_half_against_scalar<H: Pod>(f: Format<H>) {
        let dtype = f.dtype;
        for n in [0, 1, 7, 8, 9, 15, 16, 17, 2047, 2048, 6161] {
            for nsrc in 0..=4 {
                let make = |seed| -> Vec<H> {
                    half_inputs(n, seed).into_iter().map(f.from_bits).collect()
                };
                let dst0 = make(99);
                let srcs: Vec<Vec<H>> = (0..nsrc).map(|k| make(7 + k as u64)).collect();
                let src_refs: Vec<&[H]> = srcs.iter().map(|s| s.as_slice()).collect();
                let src_bytes: Vec<&[u8]> = srcs.iter().map(|s| bytemuck::cast_slice(s)).collect();
                for op in [ReduceOp::Sum, ReduceOp::Mul, ReduceOp::Min, ReduceOp::Max] {
                    let mut want = dst0.clone();
                    scalar_half_reference(op, &mut want, &src_refs, f.widen, f.narrow);
                    let mut got = dst0.clone();
                    reduce_inplace(dtype, op, bytemuck::cast_slice_mut(&mut got), &src_bytes)
                        .unwrap();
                    for (name, kernel) in &f.kernels {
                        let mut variant = dst0.clone();
                        kernel(op, &mut variant, None, &src_refs);
                        for i in 0..n {
                            let mut inputs = vec![dst0[i]];
                            inputs.extend(srcs.iter().map(|s| s[i]));
                            assert!(
                                f.same(op, variant[i], want[i], &inputs),
                                "{name} {dtype:?} {op:?} n={n} sources={nsrc} at {i}"
                            );
                        }
                    }
                    for i in 0..n {
                        let mut inputs = vec![dst0[i]];
                        inputs.extend(srcs.iter().map(|s| s[i]));
                        assert!(
                            f.same(op, got[i], want[i], &inputs),
                            "{dtype:?} {op:?} n={n} sources={nsrc} at {i}: inputs {:x?} got {:#06x} want {:#06x}",
                            inputs.iter().map(|h| f.bits(*h)).collect::<Vec<_>>(),
                            f.bits(got[i]),
                            f.bits(want[i]),
                        );
                    }
                    if let Some(first) = src_refs.first() {
                        let mut got = vec![(f.from_bits)(0); n];
                        reduce_into(dtype, op, bytemuck::cast_slice_mut(&mut got), &src_bytes)
                            .unwrap();
                        let mut want = first.to_vec();
                        scalar_half_reference(op, &mut want, &src_refs[1..], f.widen, f.narrow);
                        for i in 0..n {
                            let inputs: Vec<H> = srcs.iter().map(|s| s[i]).collect();
                            assert!(
                                f.same(op, got[i], want[i], &inputs),
                                "into {dtype:?} {op:?} n={n} at {i}"
                            );
                        }
                    }
                }
            }
        }
        // widen_half / narrow_half use the same conversions.
        let hs: Vec<H> = half_inputs(5000, 3).into_iter().map(f.from_bits).collect();
        let mut wide = vec![0f32; hs.len()];
        widen_half(dtype, bytemuck::cast_slice(&hs), &mut wide).unwrap();
        assert!(wide
            .iter()
            .zip(&hs)
            .all(|(w, h)| w.to_bits() == (f.widen)(*h).to_bits()));
        let mut back = vec![0u8; hs.len() * 2];
        narrow_half(dtype, &wide, &mut back).unwrap();
        let want: Vec<H> = wide.iter().map(|w| (f.narrow)(*w)).collect();
        assert_eq!(back, bytemuck::cast_slice::<H, u8>(&want));
    }

    #[test]
    fn half_kernels_match_scalar_reference() {
        check_half_against_scalar(Format {
            dtype: DType::F16,
            from_bits: f16::from_bits,
            widen: f16::to_f32,
            narrow: f16::from_f32,
            kernels: f16::kernels(),
        });
        check_half_against_scalar(Format {
            dtype: DType::BF16,
            from_bits: bf16::from_bits,
            widen: bf16::to_f32,
            narrow: bf16::from_f32,
            kernels: bf16::kernels(),
        });
    }

    /// `reduce_into`'s float16/bfloat16 path (every source in one pass, the
    /// accumulator starting from the first source) against what it replaced:
    /// copy the first source into the destination, fold the rest in place.
    /// Bits must be equal everywhere, NaN payloads included, for every kernel
    /// variant this CPU runs and through the dispatch; lengths cover the
    /// vector bodies, their 4-group unrolling, the 1024-element blocks and
    /// odd tails, at offsets that misalign the groups; 1-6 sources cover the
    /// lone source (whose copy was rounded again in place), the register
    /// folds (1-3 further sources) and the blocked one (4+).
    fn check_half_into_matches_copy_then_inplace<H: Pod>(f: Format<H>) {
        let dtype = f.dtype;
        let ops = [ReduceOp::Sum, ReduceOp::Mul, ReduceOp::Min, ReduceOp::Max];
        let sources: Vec<Vec<H>> = (0..6)
            .map(|k| {
                half_inputs(4200, 31 + k)
                    .into_iter()
                    .map(f.from_bits)
                    .collect()
            })
            .collect();
        // A destination full of NaNs: the fused path must never read it.
        let garbage = (f.from_bits)(0x7e55);
        let lens = [
            0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 159, 1023, 1024,
            1025, 2049, 4099,
        ];
        for nsrc in 1..=6 {
            for &n in &lens {
                for off in [0, 1, 3] {
                    let srcs: Vec<&[H]> =
                        sources[..nsrc].iter().map(|s| &s[off..off + n]).collect();
                    let src_bytes: Vec<&[u8]> =
                        srcs.iter().map(|s| bytemuck::cast_slice(s)).collect();
                    for op in ops {
                        let what = format!("{dtype:?} {op:?} n={n} off={off} sources={nsrc}");
                        let mut want = srcs[0].to_vec();
                        reduce_inplace(
                            dtype,
                            op,
                            bytemuck::cast_slice_mut(&mut want),
                            &src_bytes[1..],
                        )
                        .unwrap();
                        let mut got = vec![garbage; n];
                        reduce_into(dtype, op, bytemuck::cast_slice_mut(&mut got), &src_bytes)
                            .unwrap();
                        let bits = |v: &[H]| v.iter().map(|h| f.bits(*h)).collect::<Vec<u16>>();
                        assert_eq!(bits(&got), bits(&want), "dispatched {what}");
                        for (name, kernel) in &f.kernels {
                            let mut want = srcs[0].to_vec();
                            kernel(op, &mut want, None, &srcs[1..]);
                            let mut got = vec![garbage; n];
                            kernel(op, &mut got, Some(srcs[0]), &srcs[1..]);
                            assert_eq!(bits(&got), bits(&want), "{name} {what}");
                        }
                    }
                }
            }
        }
        // Special values meeting each other in every order, with the first
        // source among them: NaNs (quiet and signalling, both signs, payloads),
        // infinities, signed zeros, subnormals, the largest finite values.
        let special: Vec<H> = [
            0x0000u16, 0x8000, 0x0001, 0x8001, 0x03ff, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7c01,
            0x7e00, 0xfe01, 0x7f80, 0xff80, 0x7f81, 0x7fc1, 0x3c00, 0xbc00,
        ]
        .into_iter()
        .map(f.from_bits)
        .collect();
        let k = special.len();
        // Every ordered triple, laid out as three sources of k^3 elements.
        let cols: Vec<Vec<H>> = (0..3)
            .map(|c| (0..k * k * k).map(|i| special[i / k.pow(c) % k]).collect())
            .collect();
        // (One source: the copy was rounded again in place, which quiets a
        // signalling NaN; the fused path does the same.)
        for nsrc in [1, 2, 3] {
            let srcs: Vec<&[u8]> = cols[..nsrc]
                .iter()
                .map(|c| bytemuck::cast_slice(c))
                .collect();
            for op in ops {
                let mut want = srcs[0].to_vec();
                reduce_inplace(dtype, op, &mut want, &srcs[1..]).unwrap();
                let mut got = vec![0xffu8; want.len()];
                reduce_into(dtype, op, &mut got, &srcs).unwrap();
                let bad = got.chunks(2).zip(want.chunks(2)).position(|(g, w)| g != w);
                assert_eq!(bad, None, "special values {dtype:?} {op:?} sources={nsrc}");
            }
        }
    }

    #[test]
    fn half_reduce_into_matches_copy_then_inplace_bit_for_bit() {
        check_half_into_matches_copy_then_inplace(Format {
            dtype: DType::F16,
            from_bits: f16::from_bits,
            widen: f16::to_f32,
            narrow: f16::from_f32,
            kernels: f16::kernels(),
        });
        check_half_into_matches_copy_then_inplace(Format {
            dtype: DType::BF16,
            from_bits: bf16::from_bits,
            widen: bf16::to_f32,
            narrow: bf16::from_f32,
            kernels: bf16::kernels(),
        });
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
