//! MinMaxUInt4: MinMaxUInt8's formulas ([`super::codec`]) with 15 levels
//! and two elements per byte, on blocks of [`BLOCK`] elements, each with a
//! minimum and maximum of its own.
//!
//! Sixteen levels over a whole chunk would let one outlier flatten every
//! other value of the chunk to one level; a block of 512 elements keeps the
//! damage local for 8 header bytes per 256 bytes of levels (a float32
//! buffer shrinks 7.75x).
//!
//! ```text
//! per block:  eps = 1e-7, Q = 15
//! mn = min(x), mx = max(x), scale = Q / (mx - mn + eps)
//! upper = rint(mx * scale), lower = upper - Q
//! level = min(rint(x * scale), upper) - lower, saturated to 0..=15
//! y     = (level + lower) / scale
//! ```
//!
//! **Format.** A chunk of `n` elements is `max(1, ceil(n / 512))` blocks;
//! a block is its header ([`super::codec::header_bytes`]: `mn`, `mx` as
//! little-endian float32, float64 for float64 chunks) then its levels, two
//! per byte, the even element in the low nibble (an odd block's last high
//! nibble is 0). A zero-length chunk is one header holding zeros.
//! Non-finite values, signed zeros and rounding to the element type follow
//! [`super::codec`]: a block holding NaN or ±infinity stores NaN as `mn`
//! and `mx` and decompresses to NaN. Plain scalar loops (the 4-bit codec
//! runs once per DiLoCo sync, not every step).

use super::codec::header_bytes;
use crate::dtype::DType;
use crate::error::{Error, Result};
use half::{bf16, f16};

/// Elements per block (one header each).
pub const BLOCK: usize = 512;

/// The arithmetic type of a block: float32, or float64 for float64 chunks.
trait Wide:
    Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    const EPS: Self;
    const Q: Self;
    const ZERO: Self;
    const BYTES: usize;
    fn rint(self) -> Self;
    fn finite(self) -> bool;
    fn nan() -> Self;
    fn level(l: u8) -> Self;
    /// `self` as a level (its integer value, saturated to `0..=15`).
    fn to_level(self) -> u8;
    fn put(self, b: &mut [u8]);
    fn get(b: &[u8]) -> Self;
}

impl Wide for f32 {
    const EPS: f32 = 1e-7;
    const Q: f32 = 15.0;
    const ZERO: f32 = 0.0;
    const BYTES: usize = 4;
    fn rint(self) -> f32 {
        self.round_ties_even()
    }
    fn finite(self) -> bool {
        self.is_finite()
    }
    fn nan() -> f32 {
        f32::NAN
    }
    fn level(l: u8) -> f32 {
        f32::from(l)
    }
    fn to_level(self) -> u8 {
        (self.clamp(0.0, 15.0)) as u8
    }
    fn put(self, b: &mut [u8]) {
        b[..4].copy_from_slice(&self.to_le_bytes());
    }
    fn get(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Wide for f64 {
    const EPS: f64 = 1e-7;
    const Q: f64 = 15.0;
    const ZERO: f64 = 0.0;
    const BYTES: usize = 8;
    fn rint(self) -> f64 {
        self.round_ties_even()
    }
    fn finite(self) -> bool {
        self.is_finite()
    }
    fn nan() -> f64 {
        f64::NAN
    }
    fn level(l: u8) -> f64 {
        f64::from(l)
    }
    fn to_level(self) -> u8 {
        (self.clamp(0.0, 15.0)) as u8
    }
    fn put(self, b: &mut [u8]) {
        b[..8].copy_from_slice(&self.to_le_bytes());
    }
    fn get(b: &[u8]) -> f64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[..8]);
        f64::from_le_bytes(a)
    }
}

/// An element type: its size, and its value widened to (or rounded from)
/// its arithmetic type, in native byte order.
trait Elem {
    type W: Wide;
    const SIZE: usize;
    fn load(b: &[u8]) -> Self::W;
    fn store(w: Self::W, b: &mut [u8]);
    /// `w` rounded to the element type, widened again.
    fn round(w: Self::W) -> Self::W;
}

macro_rules! elem {
    ($t:ty, $w:ty, $size:expr, $to:expr, $from:expr) => {
        impl Elem for $t {
            type W = $w;
            const SIZE: usize = $size;
            fn load(b: &[u8]) -> $w {
                let mut a = [0u8; $size];
                a.copy_from_slice(&b[..$size]);
                $to(<$t>::from_ne_bytes(a))
            }
            fn store(w: $w, b: &mut [u8]) {
                let v: $t = $from(w);
                b[..$size].copy_from_slice(&v.to_ne_bytes());
            }
            fn round(w: $w) -> $w {
                $to($from(w))
            }
        }
    };
}

elem!(f32, f32, 4, |v: f32| v, |w: f32| w);
elem!(f64, f64, 8, |v: f64| v, |w: f64| w);
elem!(f16, f32, 2, |v: f16| v.to_f32(), f16::from_f32);
elem!(bf16, f32, 2, |v: bf16| v.to_f32(), bf16::from_f32);

fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK).max(1)
}

/// Bytes of a compressed chunk of `elements` elements of `dtype`.
pub fn compressed_len(dtype: DType, elements: usize) -> usize {
    let full = elements / BLOCK;
    let rest = elements % BLOCK;
    let mut len = full * (header_bytes(dtype) + BLOCK / 2);
    if rest > 0 || elements == 0 {
        len += header_bytes(dtype) + rest.div_ceil(2);
    }
    len
}

fn invalid(what: String) -> Error {
    Error::InvalidArgument(what)
}

fn check(dtype: DType, elements: usize, compressed: usize, what: &str) -> Result<()> {
    if compressed != compressed_len(dtype, elements) {
        return Err(invalid(format!(
            "MinMaxUInt4 {what}: {compressed} bytes do not hold {elements} {} elements \
             ({} expected)",
            dtype.name(),
            compressed_len(dtype, elements)
        )));
    }
    Ok(())
}

fn elements(dtype: DType, bytes: usize) -> Result<usize> {
    if !dtype.is_float() {
        return Err(invalid(format!(
            "MinMaxUInt4 compression needs floating-point tensors (float32, float64, float16 \
             or bfloat16), not {}",
            dtype.name()
        )));
    }
    if !bytes.is_multiple_of(dtype.size()) {
        return Err(invalid(format!(
            "MinMaxUInt4: {bytes} bytes is not a whole number of {} elements",
            dtype.name()
        )));
    }
    Ok(bytes / dtype.size())
}

/// Runs `$f::<T>` for the element type of `$dtype` (a float, checked).
macro_rules! by_elem {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            _ => $f::<bf16>($($arg),*),
        }
    };
}

/// Compresses `src` (elements of `dtype`) into `dst`, exactly
/// [`compressed_len`]`(dtype, elements)` bytes.
pub fn compress(dtype: DType, src: &[u8], dst: &mut [u8]) -> Result<()> {
    fn go<T: Elem>(src: &[u8], dst: &mut [u8]) {
        let h = 2 * T::W::BYTES;
        let mut out = 0;
        let n = src.len() / T::SIZE;
        for b in 0..blocks(n) {
            let (lo, hi) = (b * BLOCK, ((b + 1) * BLOCK).min(n));
            let x = |i: usize| T::load(&src[i * T::SIZE..]);
            let (mn, mx, finite) = if lo < hi {
                super::arith::extremes((lo..hi).map(x), (x(lo), x(lo)), |v: T::W| v.finite())
            } else {
                (T::W::ZERO, T::W::ZERO, true)
            };
            let len = (hi - lo).div_ceil(2);
            let (head, levels) = dst[out..out + h + len].split_at_mut(h);
            if !finite {
                T::W::nan().put(&mut head[..]);
                T::W::nan().put(&mut head[T::W::BYTES..]);
                levels.fill(0);
            } else {
                // `+ 0` turns -0.0 into +0.0 (a deterministic header).
                let (mn, mx) = (mn + T::W::ZERO, mx + T::W::ZERO);
                mn.put(&mut head[..]);
                mx.put(&mut head[T::W::BYTES..]);
                let scale = T::W::Q / (mx - mn + T::W::EPS);
                let upper = (mx * scale).rint();
                let lower = upper - T::W::Q;
                let q = |i: usize| {
                    let r = (x(i) * scale).rint();
                    let r = if r > upper { upper } else { r };
                    (r - lower).to_level()
                };
                for (k, byte) in levels.iter_mut().enumerate() {
                    let i = lo + 2 * k;
                    let high = if i + 1 < hi { q(i + 1) } else { 0 };
                    *byte = q(i) | (high << 4);
                }
            }
            out += h + len;
        }
    }
    let n = elements(dtype, src.len())?;
    check(dtype, n, dst.len(), "compress")?;
    by_elem!(dtype, go(src, dst));
    Ok(())
}

/// Calls `each(i, y)` for every element of the compressed chunk `src`
/// (`n` elements), `y` in the arithmetic type, rounded to the element type.
fn decode<T: Elem>(src: &[u8], n: usize, mut each: impl FnMut(usize, T::W)) {
    let h = 2 * T::W::BYTES;
    let mut at = 0;
    for b in 0..blocks(n) {
        let (lo, hi) = (b * BLOCK, ((b + 1) * BLOCK).min(n));
        let (mn, mx) = (T::W::get(&src[at..]), T::W::get(&src[at + T::W::BYTES..]));
        let levels = &src[at + h..at + h + (hi - lo).div_ceil(2)];
        if !(mn.finite() && mx.finite()) {
            for i in lo..hi {
                each(i, T::W::nan());
            }
        } else {
            let scale = T::W::Q / (mx - mn + T::W::EPS);
            let lower = (mx * scale).rint() - T::W::Q;
            for i in lo..hi {
                let byte = levels[(i - lo) / 2];
                let l = if (i - lo) % 2 == 0 {
                    byte & 15
                } else {
                    byte >> 4
                };
                each(i, T::round((T::W::level(l) + lower) / scale));
            }
        }
        at += h + levels.len();
    }
}

/// `dst` (elements of `dtype`) = the decompressed chunk `src`.
pub fn decompress(dtype: DType, src: &[u8], dst: &mut [u8]) -> Result<()> {
    fn go<T: Elem>(src: &[u8], dst: &mut [u8]) {
        let n = dst.len() / T::SIZE;
        decode::<T>(src, n, |i, y| T::store(y, &mut dst[i * T::SIZE..]));
    }
    let n = elements(dtype, dst.len())?;
    check(dtype, n, src.len(), "decompress")?;
    by_elem!(dtype, go(src, dst));
    Ok(())
}

/// `acc[i] = (if first { 0 } else { acc[i] }) + decompressed[i]` (rounded
/// to the element type first), for float32, float16 and bfloat16 chunks.
pub fn decompress_accumulate(dtype: DType, src: &[u8], acc: &mut [f32], first: bool) -> Result<()> {
    fn go<T: Elem<W = f32>>(src: &[u8], acc: &mut [f32], first: bool) {
        let n = acc.len();
        decode::<T>(src, n, |i, y| acc[i] = if first { y } else { acc[i] + y });
    }
    if dtype == DType::F64 {
        return Err(invalid(
            "MinMaxUInt4: float64 chunks accumulate in float64".into(),
        ));
    }
    elements(dtype, 0)?;
    check(dtype, acc.len(), src.len(), "accumulate")?;
    match dtype {
        DType::F32 => go::<f32>(src, acc, first),
        DType::F16 => go::<f16>(src, acc, first),
        _ => go::<bf16>(src, acc, first),
    }
    Ok(())
}

/// [`decompress_accumulate`] of a float64 chunk into float64 accumulators.
pub fn decompress_accumulate_f64(src: &[u8], acc: &mut [f64], first: bool) -> Result<()> {
    check(DType::F64, acc.len(), src.len(), "accumulate")?;
    let n = acc.len();
    decode::<f64>(src, n, |i, y| acc[i] = if first { y } else { acc[i] + y });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    fn back(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn round_trip_within_half_a_level_per_block() {
        for n in [0usize, 1, 2, 3, 511, 512, 513, 1500] {
            let x: Vec<f32> = (0..n)
                .map(|i| {
                    ((i * 7919 % 1000) as f32 / 100.0 - 5.0) * if i >= 512 { 10.0 } else { 1.0 }
                })
                .collect();
            let src = f32s(&x);
            let mut c = vec![0u8; compressed_len(DType::F32, n)];
            compress(DType::F32, &src, &mut c).unwrap();
            let mut out = vec![0u8; src.len()];
            decompress(DType::F32, &c, &mut out).unwrap();
            let y = back(&out);
            for b in 0..n.div_ceil(BLOCK) {
                let r = b * BLOCK..((b + 1) * BLOCK).min(n);
                let mn = x[r.clone()].iter().cloned().fold(f32::MAX, f32::min);
                let mx = x[r.clone()].iter().cloned().fold(f32::MIN, f32::max);
                let bound = (mx - mn + 1e-7) / 15.0 * 0.5001 + 1e-6;
                for i in r {
                    assert!(
                        (x[i] - y[i]).abs() <= bound,
                        "n {n} i {i}: {} vs {}",
                        x[i],
                        y[i]
                    );
                }
            }
            let mut acc = vec![1.0f32; n];
            decompress_accumulate(DType::F32, &c, &mut acc, false).unwrap();
            for i in 0..n {
                assert_eq!(acc[i], 1.0 + y[i]);
            }
        }
    }

    #[test]
    fn ratio_and_nan_and_errors() {
        let n = 4096;
        assert!((n * 4) as f64 / compressed_len(DType::F32, n) as f64 > 7.7);
        let mut x = vec![1.0f32; 600];
        x[3] = f32::NAN;
        let src = f32s(&x);
        let mut c = vec![0u8; compressed_len(DType::F32, 600)];
        compress(DType::F32, &src, &mut c).unwrap();
        let mut out = vec![0u8; src.len()];
        decompress(DType::F32, &c, &mut out).unwrap();
        let y = back(&out);
        assert!(y[..512].iter().all(|v| v.is_nan()));
        assert!(y[512..].iter().all(|v| (v - 1.0).abs() < 1e-6));
        assert!(compress(DType::I32, &src, &mut c).is_err());
        assert!(compress(DType::F32, &src, &mut c[1..]).is_err());
    }

    #[test]
    fn half_and_double() {
        let x: Vec<f64> = (0..700).map(|i| (i as f64).sin()).collect();
        let src: Vec<u8> = x.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let mut c = vec![0u8; compressed_len(DType::F64, 700)];
        compress(DType::F64, &src, &mut c).unwrap();
        let mut acc = vec![0f64; 700];
        decompress_accumulate_f64(&c, &mut acc, true).unwrap();
        for i in 0..700 {
            assert!((acc[i] - x[i]).abs() <= 2.0 / 15.0 * 0.5001 + 1e-6);
        }
        let h: Vec<u8> = x
            .iter()
            .flat_map(|v| bf16::from_f64(*v).to_ne_bytes())
            .collect();
        let mut c = vec![0u8; compressed_len(DType::BF16, 700)];
        compress(DType::BF16, &h, &mut c).unwrap();
        let mut out = vec![0u8; h.len()];
        decompress(DType::BF16, &c, &mut out).unwrap();
        for i in 0..700 {
            let y = bf16::from_ne_bytes([out[2 * i], out[2 * i + 1]]).to_f64();
            assert!((y - x[i]).abs() <= 2.0 / 15.0 * 0.5001 + 0.01);
        }
    }
}
