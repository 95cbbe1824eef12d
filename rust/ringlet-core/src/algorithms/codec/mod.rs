//! Bagua's MinMaxUInt8 gradient compression, bit for bit.
//!
//! A *chunk* of `n` float elements compresses to a header holding the
//! chunk's minimum and maximum followed by one byte per element (Bagua's
//! `compress_float_to_uint8` / `decompress_uint8_to_float` kernels):
//!
//! ```text
//! eps = 1e-7, Q = 255
//! mn = min(x), mx = max(x)
//! scale = Q / (mx - mn + eps)
//! upper = rint(mx * scale), lower = upper - Q
//! byte  = u8(min(rint(x * scale), upper) - lower)      (saturating)
//! y     = (f32(byte) + lower) / scale                  (a true division)
//! ```
//!
//! `rint` rounds half to even and every operation rounds to float32 (one
//! rounding per operation, no fused multiply-add). float16 and bfloat16
//! elements are widened to float32 exactly, go through the same float32
//! formulas, and a decompressed value is rounded to the element type (to
//! nearest even). float64 uses the same formulas in float64.
//!
//! **Format.** The header is [`header_bytes`] long: `mn` then `mx` as
//! little-endian float32 (8 bytes) for float32/float16/bfloat16, as
//! little-endian float64 (16 bytes) for float64; then one byte per element.
//! A chunk is [`compressed_len`] bytes. Elements themselves are read and
//! written in native byte order (they are tensor memory). A zero-length chunk
//! is its header alone, holding `mn = mx = 0`.
//!
//! **Signed zeros.** The stored `mn` and `mx` are the true minimum and
//! maximum with `-0.0` replaced by `+0.0` (`v + 0.0`): which zero a min/max
//! picks among `-0.0` and `+0.0` depends on the order of comparisons, and the
//! normalisation keeps the header deterministic. It changes no byte and no
//! decompressed value (`lower` is `-255` either way).
//!
//! **Non-finite values (ringlet's definition; Bagua leaves them undefined).**
//! If any element of a chunk is NaN or ±infinity, the header holds NaN as both
//! `mn` and `mx` and every element byte is 0. Decompressing a chunk whose
//! header holds a non-finite `mn` or `mx` yields NaN for every element:
//! [`decompress`] writes NaN, [`decompress_add`] makes every destination
//! element NaN, [`decompress_accumulate`] every accumulator element. A
//! non-finite gradient therefore propagates as NaN, as an exact all-reduce
//! would make it non-finite, and overflow checks (GradScaler) still see it.
//!
//! **Limits of the formula** (Bagua's, kept as they are): the levels are
//! `rint(x * scale)` in float32, so when `max(|mn|, |mx|) * scale` exceeds
//! about 2^24 (values with a large common offset and a tiny spread, e.g.
//! `1e6 + 1e-3 * noise`) the levels lose resolution and bytes saturate at 0 or
//! 255; and `|x| * scale` overflows to infinity for constant chunks beyond
//! about 1.3e29 in magnitude (decompressing to ±infinity or NaN). Otherwise a
//! decompressed value is within `(mx - mn + eps) / 255` of the original
//! (about half a level, plus the rounding to the element type).
//!
//! **Buffers** are byte slices that may have any alignment (network buffers,
//! byte offsets): the kernels read and write through unaligned vector loads
//! and stores, so nothing is copied whatever the alignment. A length that is
//! not a whole number of elements, a length that does not match the other
//! buffer, or a non-float dtype is [`Error::InvalidArgument`].
//!
//! **Kernels**, chosen at run time (`is_x86_feature_detected!`), same results
//! bit for bit (the tests check every variant against a scalar reference):
//! * AVX-512F (with AVX2, F16C): 16 lanes of float32; float16 through
//!   `vcvtph2ps`/`vcvtps2ph`, bfloat16 through shifts and the rounding bias.
//! * AVX2 + F16C: the same on 8 lanes.
//! * portable: plain scalar loops, for other CPUs and architectures.
//!
//! Compression reads the chunk twice (min/max with a non-finite check, then
//! the levels); decompression reads the bytes once and writes the elements
//! once. The x86 code is safe `#[target_feature]` functions (intrinsics and
//! `bytemuck` casts, no raw pointers); the only `unsafe` is calling them
//! after the feature check.

use crate::dtype::DType;
use crate::error::{Error, Result};

mod kernels;
#[cfg(test)]
mod tests;

use kernels::{Isa, Mode, Params, Params64};

/// Bagua's `eps`, as float32.
const EPS: f32 = 1e-7;
/// The number of levels above the lowest (`2^8 - 1`).
const Q: f32 = 255.0;
/// `eps` for float64 chunks.
const EPS_F64: f64 = 1e-7;
/// `Q` for float64 chunks.
const Q_F64: f64 = 255.0;

/// The kernel variant compression and decompression run on this CPU (the
/// run-time choice described above): `"avx512f+f16c"`, `"avx2+f16c"` or
/// `"portable"`.
pub fn selected_kernel() -> &'static str {
    Isa::best().name()
}

/// Bytes of a compressed chunk's header: 8 (`mn`, `mx` as float32) for
/// float32, float16 and bfloat16, 16 (float64) for float64. Other dtypes
/// cannot be compressed (the functions below reject them); they get 8.
pub fn header_bytes(dtype: DType) -> usize {
    match dtype {
        DType::F64 => 16,
        _ => 8,
    }
}

/// Bytes of a compressed chunk of `elements` elements: the header plus one
/// byte per element.
pub fn compressed_len(dtype: DType, elements: usize) -> usize {
    header_bytes(dtype).saturating_add(elements)
}

/// Compresses `src` (elements of `dtype`, one chunk) into `dst`, which must be
/// exactly [`compressed_len`]`(dtype, elements)` bytes.
pub fn compress(dtype: DType, src: &[u8], dst: &mut [u8]) -> Result<()> {
    compress_with(Isa::best(), dtype, src, dst)
}

/// `dst` (elements of `dtype`) = the decompressed chunk `src`.
pub fn decompress(dtype: DType, src: &[u8], dst: &mut [u8]) -> Result<()> {
    decode_with(Isa::best(), dtype, src, Target::Store(dst))
}

/// `dst[i] = dst[i] + decompressed[i]`: the decompressed value is rounded to
/// the element type first (as [`decompress`] would store it), then the sum is
/// computed in float32 (float64 for float64) and rounded once to the element
/// type.
pub fn decompress_add(dtype: DType, src: &[u8], dst: &mut [u8]) -> Result<()> {
    decode_with(Isa::best(), dtype, src, Target::Add(dst))
}

/// Accumulates a decompressed chunk for a sum or mean of several:
/// `acc[i] = (if first { 0.0 } else { acc[i] }) + f32(T(decompressed[i]))`,
/// where `T(..)` rounds to the element type (float32, float16 or bfloat16).
/// `acc` has one float32 per element. For float64 see
/// [`decompress_accumulate_f64`].
pub fn decompress_accumulate(dtype: DType, src: &[u8], acc: &mut [f32], first: bool) -> Result<()> {
    decode_with(Isa::best(), dtype, src, Target::Acc(acc, first))
}

/// [`decompress_accumulate`] of a float64 chunk into float64 accumulators.
pub fn decompress_accumulate_f64(src: &[u8], acc: &mut [f64], first: bool) -> Result<()> {
    decode_with(Isa::best(), DType::F64, src, Target::Acc64(acc, first))
}

/// `dst[i] = T(acc[i] / divisor)` (`divisor` 1 for a sum): a float32 division,
/// then rounding to the element type (float32, float16 or bfloat16).
pub fn store_scaled(dtype: DType, acc: &[f32], divisor: f32, dst: &mut [u8]) -> Result<()> {
    store_scaled_with(Isa::best(), dtype, acc, divisor, dst)
}

/// `dst[i] = acc[i] / divisor` into float64 elements.
pub fn store_scaled_f64(acc: &[f64], divisor: f64, dst: &mut [u8]) -> Result<()> {
    if dst.len() / 8 != acc.len() || !dst.len().is_multiple_of(8) {
        return Err(invalid(format!(
            "codec: {} float64 accumulators do not match a destination of {} bytes",
            acc.len(),
            dst.len()
        )));
    }
    for (a, d) in acc.iter().zip(dst.chunks_exact_mut(8)) {
        d.copy_from_slice(&(a / divisor).to_ne_bytes());
    }
    Ok(())
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// The element types computed in float32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    F32,
    F16,
    BF16,
}

impl Kind {
    fn size(self) -> usize {
        match self {
            Kind::F32 => 4,
            Kind::F16 | Kind::BF16 => 2,
        }
    }

    /// A NaN of this type, in native byte order (the first `size` bytes).
    fn nan_bytes(self) -> [u8; 4] {
        let mut b = [0u8; 4];
        match self {
            Kind::F32 => b.copy_from_slice(&f32::NAN.to_ne_bytes()),
            Kind::F16 => b[..2].copy_from_slice(&half::f16::NAN.to_ne_bytes()),
            Kind::BF16 => b[..2].copy_from_slice(&half::bf16::NAN.to_ne_bytes()),
        }
        b
    }
}

/// `None`: float64.
fn kind(dtype: DType, what: &str) -> Result<Option<Kind>> {
    match dtype {
        DType::F32 => Ok(Some(Kind::F32)),
        DType::F16 => Ok(Some(Kind::F16)),
        DType::BF16 => Ok(Some(Kind::BF16)),
        DType::F64 => Ok(None),
        _ => Err(invalid(format!(
            "codec: {what} needs a float dtype, not {}",
            dtype.name()
        ))),
    }
}

/// Elements in `bytes`, which must be whole elements of `size` bytes.
fn elements(bytes: usize, size: usize, dtype: DType, what: &str) -> Result<usize> {
    if !bytes.is_multiple_of(size) {
        return Err(invalid(format!(
            "codec: {what} of {bytes} bytes is not a whole number of {} elements",
            dtype.name()
        )));
    }
    Ok(bytes / size)
}

/// What a decompression does with each value.
enum Target<'a> {
    /// Store it (elements of the dtype).
    Store(&'a mut [u8]),
    /// Add it to the element.
    Add(&'a mut [u8]),
    /// Add it to float32 accumulators (`true`: the first, start from 0).
    Acc(&'a mut [f32], bool),
    /// Add it to float64 accumulators.
    Acc64(&'a mut [f64], bool),
}

fn compress_with(isa: Isa, dtype: DType, src: &[u8], dst: &mut [u8]) -> Result<()> {
    let kind = kind(dtype, "compress")?;
    let n = elements(src.len(), dtype.size(), dtype, "compress source")?;
    let header = header_bytes(dtype);
    if dst.len() != compressed_len(dtype, n) {
        return Err(invalid(format!(
            "codec: compressing {n} {} elements needs {} bytes, not {}",
            dtype.name(),
            compressed_len(dtype, n),
            dst.len()
        )));
    }
    let (head, body) = dst.split_at_mut(header);
    let Some(kind) = kind else {
        return compress_f64(src, head, body);
    };
    if n == 0 {
        head.fill(0);
        return Ok(());
    }
    let r = isa.minmax(kind, src);
    if !r.finite {
        head[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        head[4..].copy_from_slice(&f32::NAN.to_le_bytes());
        body.fill(0);
        return Ok(());
    }
    let (mn, mx) = (r.mn + 0.0, r.mx + 0.0);
    head[..4].copy_from_slice(&mn.to_le_bytes());
    head[4..].copy_from_slice(&mx.to_le_bytes());
    isa.quantize(kind, src, Params::new(mn, mx), body);
    Ok(())
}

fn compress_f64(src: &[u8], head: &mut [u8], body: &mut [u8]) -> Result<()> {
    if src.is_empty() {
        head.fill(0);
        return Ok(());
    }
    let load = |c: &[u8]| {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        f64::from_ne_bytes(b)
    };
    let (mn, mx, finite) = super::arith::extremes(
        src.chunks_exact(8).map(load),
        (f64::INFINITY, f64::NEG_INFINITY),
        f64::is_finite,
    );
    if !finite {
        head[..8].copy_from_slice(&f64::NAN.to_le_bytes());
        head[8..].copy_from_slice(&f64::NAN.to_le_bytes());
        body.fill(0);
        return Ok(());
    }
    let (mn, mx) = (mn + 0.0, mx + 0.0);
    head[..8].copy_from_slice(&mn.to_le_bytes());
    head[8..].copy_from_slice(&mx.to_le_bytes());
    let p = Params64::new(mn, mx);
    for (c, d) in src.chunks_exact(8).zip(body.iter_mut()) {
        *d = p.byte(load(c));
    }
    Ok(())
}

fn decode_with(isa: Isa, dtype: DType, src: &[u8], target: Target) -> Result<()> {
    let what = match target {
        Target::Store(_) => "decompress",
        Target::Add(_) => "decompress_add",
        Target::Acc(..) | Target::Acc64(..) => "decompress_accumulate",
    };
    let kind = kind(dtype, what)?;
    let header = header_bytes(dtype);
    if src.len() < header {
        return Err(invalid(format!(
            "codec: a compressed {} chunk has at least {header} bytes, not {}",
            dtype.name(),
            src.len()
        )));
    }
    let (head, body) = src.split_at(header);
    let n = body.len();
    let size = dtype.size();
    let mismatch = |len: usize, unit: &str| {
        invalid(format!(
            "codec: {what} of a {n}-element chunk into {len} {unit} (elements of {})",
            dtype.name()
        ))
    };
    // The destination as bytes, checked against `n`.
    let (dst, mode): (&mut [u8], Mode) = match target {
        Target::Store(d) | Target::Add(d)
            if d.len() / size != n || !d.len().is_multiple_of(size) =>
        {
            return Err(mismatch(d.len(), "bytes"));
        }
        Target::Store(d) => (d, Mode::Store),
        Target::Add(d) => (d, Mode::Add),
        Target::Acc(a, first) => {
            if kind.is_none() {
                return Err(invalid(
                    "codec: float64 chunks accumulate into float64 (decompress_accumulate_f64)"
                        .into(),
                ));
            }
            if a.len() != n {
                return Err(mismatch(a.len(), "accumulators"));
            }
            let mode = if first { Mode::AccFirst } else { Mode::Acc };
            (bytemuck::cast_slice_mut(a), mode)
        }
        Target::Acc64(a, first) => {
            if a.len() != n {
                return Err(mismatch(a.len(), "accumulators"));
            }
            return decode_f64(head, body, Dst64::Acc(a, first));
        }
    };
    let Some(kind) = kind else {
        return decode_f64(
            head,
            body,
            match mode {
                Mode::Store => Dst64::Store(dst),
                _ => Dst64::Add(dst),
            },
        );
    };
    let word = |i: usize| {
        let mut b = [0u8; 4];
        b.copy_from_slice(&head[i..i + 4]);
        f32::from_le_bytes(b)
    };
    let (mn, mx) = (word(0), word(4));
    if !(mn.is_finite() && mx.is_finite()) {
        match mode {
            Mode::Store | Mode::Add => {
                let nan = kind.nan_bytes();
                for d in dst.chunks_exact_mut(size) {
                    d.copy_from_slice(&nan[..size]);
                }
            }
            Mode::AccFirst | Mode::Acc => {
                for d in dst.chunks_exact_mut(4) {
                    d.copy_from_slice(&f32::NAN.to_ne_bytes());
                }
            }
        }
        return Ok(());
    }
    if n > 0 {
        isa.dequantize(kind, mode, body, Params::new(mn, mx), dst);
    }
    Ok(())
}

/// A float64 decompression's destination.
enum Dst64<'a> {
    Store(&'a mut [u8]),
    Add(&'a mut [u8]),
    Acc(&'a mut [f64], bool),
}

fn decode_f64(head: &[u8], body: &[u8], dst: Dst64) -> Result<()> {
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&head[i..i + 8]);
        f64::from_le_bytes(b)
    };
    let load = |c: &[u8]| {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        f64::from_ne_bytes(b)
    };
    let (mn, mx) = (word(0), word(8));
    let nan = !(mn.is_finite() && mx.is_finite());
    let p = Params64::new(mn, mx);
    let value = |b: u8| if nan { f64::NAN } else { p.value(b) };
    match dst {
        Dst64::Store(d) => {
            for (b, d) in body.iter().zip(d.chunks_exact_mut(8)) {
                d.copy_from_slice(&value(*b).to_ne_bytes());
            }
        }
        Dst64::Add(d) => {
            for (b, d) in body.iter().zip(d.chunks_exact_mut(8)) {
                let sum = load(d) + value(*b);
                d.copy_from_slice(&sum.to_ne_bytes());
            }
        }
        Dst64::Acc(acc, first) => {
            for (b, a) in body.iter().zip(acc.iter_mut()) {
                *a = if first { 0.0 } else { *a } + value(*b);
            }
        }
    }
    Ok(())
}

fn store_scaled_with(
    isa: Isa,
    dtype: DType,
    acc: &[f32],
    divisor: f32,
    dst: &mut [u8],
) -> Result<()> {
    let Some(kind) = kind(dtype, "store_scaled")? else {
        return Err(invalid(
            "codec: float64 results come from float64 accumulators (store_scaled_f64)".into(),
        ));
    };
    let n = elements(dst.len(), kind.size(), dtype, "store_scaled destination")?;
    if n != acc.len() {
        return Err(invalid(format!(
            "codec: {} accumulators do not match {n} {} elements",
            acc.len(),
            dtype.name()
        )));
    }
    if n > 0 {
        isa.scaled(kind, bytemuck::cast_slice(acc), divisor, dst);
    }
    Ok(())
}
