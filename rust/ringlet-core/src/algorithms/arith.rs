//! The element-wise arithmetic of the algorithms, on byte buffers tagged
//! with a [`DType`], written the way Bagua's kernels and their plain-torch
//! references compute it: float16 and bfloat16 widen to float32, every
//! operation rounds once to the element type (`a + b * f` rounds the product
//! first, then the sum: no fused multiply-add), float64 stays float64.

use crate::dtype::DType;
use crate::error::{Error, Result};
use half::{bf16, f16};

/// The smallest and largest of `xs`, starting from `(mn, mx)`, and whether
/// every one is `finite`: the chunk extremes the codecs quantise between. A
/// NaN never becomes an extreme (`x < mn` and `x > mx` are false for it).
#[inline(always)]
pub(super) fn extremes<T: PartialOrd + Copy>(
    xs: impl IntoIterator<Item = T>,
    (mut mn, mut mx): (T, T),
    finite: impl Fn(T) -> bool,
) -> (T, T, bool) {
    let mut all_finite = true;
    for x in xs {
        all_finite &= finite(x);
        if x < mn {
            mn = x;
        }
        if x > mx {
            mx = x;
        }
    }
    (mn, mx, all_finite)
}

/// An element type the algorithms compute on.
trait Float: bytemuck::Pod {
    /// The type the arithmetic runs in.
    type Wide: Copy
        + std::ops::Add<Output = Self::Wide>
        + std::ops::Sub<Output = Self::Wide>
        + std::ops::Mul<Output = Self::Wide>
        + std::ops::Div<Output = Self::Wide>;
    fn widen(self) -> Self::Wide;
    fn narrow(w: Self::Wide) -> Self;
    fn wide(x: f64) -> Self::Wide;
}

impl Float for f32 {
    type Wide = f32;
    fn widen(self) -> f32 {
        self
    }
    fn narrow(w: f32) -> f32 {
        w
    }
    fn wide(x: f64) -> f32 {
        x as f32
    }
}

impl Float for f64 {
    type Wide = f64;
    fn widen(self) -> f64 {
        self
    }
    fn narrow(w: f64) -> f64 {
        w
    }
    fn wide(x: f64) -> f64 {
        x
    }
}

impl Float for f16 {
    type Wide = f32;
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(w: f32) -> f16 {
        f16::from_f32(w)
    }
    fn wide(x: f64) -> f32 {
        x as f32
    }
}

impl Float for bf16 {
    type Wide = f32;
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(w: f32) -> bf16 {
        bf16::from_f32(w)
    }
    fn wide(x: f64) -> f32 {
        x as f32
    }
}

fn cast<T: bytemuck::Pod>(buf: &[u8]) -> Result<&[T]> {
    if buf.is_empty() {
        return Ok(&[]);
    }
    bytemuck::try_cast_slice(buf)
        .map_err(|e| Error::InvalidArgument(format!("buffer not aligned for its dtype: {e:?}")))
}

fn cast_mut<T: bytemuck::Pod>(buf: &mut [u8]) -> Result<&mut [T]> {
    if buf.is_empty() {
        return Ok(&mut []);
    }
    bytemuck::try_cast_slice_mut(buf)
        .map_err(|e| Error::InvalidArgument(format!("buffer not aligned for its dtype: {e:?}")))
}

/// Checks that `dtype` is a floating-point type the algorithms compute on.
pub(crate) fn require_float(dtype: DType, what: &str) -> Result<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what} needs floating-point tensors (float32, float64, float16 or bfloat16), \
             not {}",
            dtype.name()
        )))
    }
}

fn same_len(a: usize, b: usize, what: &str) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: buffers of {a} and {b} bytes"
        )))
    }
}

/// Runs the generic body `$f::<T>` for the float type of `$dtype`.
macro_rules! by_float {
    ($dtype:expr, $what:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            other => require_float(other, $what),
        }
    };
}

/// `buf[i] = buf[i] / divisor`.
pub(crate) fn div(buf: &mut [u8], dtype: DType, divisor: f64) -> Result<()> {
    fn go<T: Float>(buf: &mut [u8], d: f64) -> Result<()> {
        let d = T::wide(d);
        cast_mut::<T>(buf)?
            .iter_mut()
            .for_each(|x| *x = T::narrow(x.widen() / d));
        Ok(())
    }
    if divisor == 1.0 {
        return require_float(dtype, "averaging");
    }
    by_float!(dtype, "averaging", go(buf, divisor))
}

/// `dst[i] = dst[i] + src[i] * factor` (the product rounded, then the sum):
/// the reference `ring_mix` is checked against.
#[cfg(test)]
fn add_scaled(dst: &mut [u8], src: &[u8], dtype: DType, factor: f64) -> Result<()> {
    fn go<T: Float>(dst: &mut [u8], src: &[u8], f: f64) -> Result<()> {
        let f = T::wide(f);
        let src = cast::<T>(src)?;
        for (x, &y) in cast_mut::<T>(dst)?.iter_mut().zip(src) {
            let prod = T::narrow(y.widen() * f);
            *x = T::narrow(x.widen() + prod.widen());
        }
        Ok(())
    }
    same_len(dst.len(), src.len(), "add_scaled")?;
    by_float!(
        dtype,
        "the low-precision decentralized update",
        go(dst, src, factor)
    )
}

/// Low-precision decentralized SGD's difference, in one pass:
/// `t[i] = t[i] + l[i] * a + r[i] * a + w[i] * b`, rounded exactly as three
/// `add_scaled` calls in that order (each product, then each sum).
pub(crate) fn ring_mix(
    t: &mut [u8],
    l: &[u8],
    r: &[u8],
    w: &[u8],
    dtype: DType,
    a: f64,
    b: f64,
) -> Result<()> {
    fn go<T: Float>(t: &mut [u8], l: &[u8], r: &[u8], w: &[u8], a: f64, b: f64) -> Result<()> {
        let (a, b) = (T::wide(a), T::wide(b));
        let (l, r, w) = (cast::<T>(l)?, cast::<T>(r)?, cast::<T>(w)?);
        for (((x, &l), &r), &w) in cast_mut::<T>(t)?.iter_mut().zip(l).zip(r).zip(w) {
            let mut acc = x.widen();
            acc = T::narrow(acc + T::narrow(l.widen() * a).widen()).widen();
            acc = T::narrow(acc + T::narrow(r.widen() * a).widen()).widen();
            *x = T::narrow(acc + T::narrow(w.widen() * b).widen());
        }
        Ok(())
    }
    for (what, len) in [("left", l.len()), ("right", r.len()), ("weight", w.len())] {
        same_len(t.len(), len, what)?;
    }
    by_float!(
        dtype,
        "the low-precision decentralized update",
        go(t, l, r, w, a, b)
    )
}

/// `dst[i] = (dst[i] + other[i]) / 2` (Bagua's `average_inplace`).
pub(crate) fn average_with(dst: &mut [u8], other: &[u8], dtype: DType) -> Result<()> {
    fn go<T: Float>(dst: &mut [u8], other: &[u8]) -> Result<()> {
        let two = T::wide(2.0);
        let other = cast::<T>(other)?;
        for (x, &y) in cast_mut::<T>(dst)?.iter_mut().zip(other) {
            let sum = T::narrow(x.widen() + y.widen());
            *x = T::narrow(sum.widen() / two);
        }
        Ok(())
    }
    same_len(dst.len(), other.len(), "average")?;
    by_float!(dtype, "peer averaging", go(dst, other))
}

/// `dst[i] = dst[i] + src[i]`.
pub(crate) fn add(dst: &mut [u8], src: &[u8], dtype: DType) -> Result<()> {
    fn go<T: Float>(dst: &mut [u8], src: &[u8]) -> Result<()> {
        let src = cast::<T>(src)?;
        for (x, &y) in cast_mut::<T>(dst)?.iter_mut().zip(src) {
            *x = T::narrow(x.widen() + y.widen());
        }
        Ok(())
    }
    same_len(dst.len(), src.len(), "add")?;
    by_float!(dtype, "error feedback", go(dst, src))
}

/// `out[i] = a[i] - b[i]`.
pub(crate) fn sub_into(out: &mut [u8], a: &[u8], b: &[u8], dtype: DType) -> Result<()> {
    fn go<T: Float>(out: &mut [u8], a: &[u8], b: &[u8]) -> Result<()> {
        let (a, b) = (cast::<T>(a)?, cast::<T>(b)?);
        for ((o, &x), &y) in cast_mut::<T>(out)?.iter_mut().zip(a).zip(b) {
            *o = T::narrow(x.widen() - y.widen());
        }
        Ok(())
    }
    same_len(out.len(), a.len(), "sub")?;
    same_len(out.len(), b.len(), "sub")?;
    by_float!(dtype, "error feedback", go(out, a, b))
}

/// Bagua's asynchronous model average: `w[i] = w[i] + (reduced[i] / n -
/// copy[i])`, where `copy` is the weights when the round started and
/// `reduced` their sum over the ranks, so progress made meanwhile is kept.
pub(crate) fn async_update(
    w: &mut [u8],
    reduced: &[u8],
    copy: &[u8],
    dtype: DType,
    n: f64,
) -> Result<()> {
    fn go<T: Float>(w: &mut [u8], reduced: &[u8], copy: &[u8], n: f64) -> Result<()> {
        let n = T::wide(n);
        let (r, c) = (cast::<T>(reduced)?, cast::<T>(copy)?);
        for ((x, &r), &c) in cast_mut::<T>(w)?.iter_mut().zip(r).zip(c) {
            let mean = T::narrow(r.widen() / n);
            let delta = T::narrow(mean.widen() - c.widen());
            *x = T::narrow(x.widen() + delta.widen());
        }
        Ok(())
    }
    same_len(w.len(), reduced.len(), "async average")?;
    same_len(w.len(), copy.len(), "async average")?;
    by_float!(
        dtype,
        "asynchronous model averaging",
        go(w, reduced, copy, n)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(v: &[f32]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    fn floats(b: &[u8]) -> Vec<f32> {
        bytemuck::cast_slice(b).to_vec()
    }

    #[test]
    fn float32_formulas() {
        let mut a = bytes(&[1.0, 2.0, 3.0]);
        div(&mut a, DType::F32, 3.0).unwrap();
        assert_eq!(floats(&a), vec![1.0 / 3.0, 2.0 / 3.0, 1.0]);
        let mut a = bytes(&[1.0, 2.0]);
        add_scaled(&mut a, &bytes(&[3.0, 6.0]), DType::F32, 1.0 / 3.0).unwrap();
        let third = (1.0f64 / 3.0) as f32;
        assert_eq!(floats(&a), vec![1.0 + 3.0 * third, 2.0 + 6.0 * third]);
        let mut a = bytes(&[1.0, -3.0]);
        average_with(&mut a, &bytes(&[2.0, 5.0]), DType::F32).unwrap();
        assert_eq!(floats(&a), vec![1.5, 1.0]);
        let mut out = vec![0u8; 8];
        sub_into(
            &mut out,
            &bytes(&[1.0, 2.0]),
            &bytes(&[0.5, 4.0]),
            DType::F32,
        )
        .unwrap();
        assert_eq!(floats(&out), vec![0.5, -2.0]);
        let mut t = bytes(&[1.0, 2.0]);
        let (l, r, w) = (bytes(&[3.0, 6.0]), bytes(&[0.3, 0.7]), bytes(&[1.1, -2.0]));
        let mut t2 = t.clone();
        for (x, f) in [(&l, 1.0 / 3.0), (&r, 1.0 / 3.0), (&w, -5.0 / 3.0)] {
            add_scaled(&mut t2, x, DType::F32, f).unwrap();
        }
        ring_mix(&mut t, &l, &r, &w, DType::F32, 1.0 / 3.0, -5.0 / 3.0).unwrap();
        assert_eq!(t, t2);
        let mut w = bytes(&[10.0]);
        async_update(&mut w, &bytes(&[6.0]), &bytes(&[1.0]), DType::F32, 3.0).unwrap();
        assert_eq!(floats(&w), vec![10.0 + (2.0 - 1.0)]);
    }

    #[test]
    fn half_rounds_once_per_operation() {
        let h = |x: f32| f16::from_f32(x);
        let mut a: Vec<u8> = bytemuck::cast_slice(&[h(1.0), h(2049.0)]).to_vec();
        add(&mut a, bytemuck::cast_slice(&[h(1.0), h(1.0)]), DType::F16).unwrap();
        let got: &[f16] = bytemuck::cast_slice(&a);
        assert_eq!(got[0].to_f32(), 2.0);
        assert_eq!(got[1], h(h(2049.0).to_f32() + 1.0));
    }

    #[test]
    fn refuses_integers_and_bad_lengths() {
        let mut a = vec![0u8; 8];
        assert!(div(&mut a, DType::I32, 2.0).is_err());
        assert!(add(&mut a, &[0u8; 4], DType::F32).is_err());
        assert!(average_with(&mut a, &[0u8; 8], DType::I64).is_err());
    }
}
