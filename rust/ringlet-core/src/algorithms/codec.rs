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

/// `v.round_ties_even()`. On x86 without SSE4.1 (the baseline target) that
/// is a library call per element; there the portable kernel instead adds and
/// subtracts 2^23 to the magnitude below 2^23 (the float unit rounds to
/// nearest even), the same result for every input, signed zeros included.
#[inline(always)]
fn rint(v: f32) -> f32 {
    if cfg!(any(target_arch = "x86", target_arch = "x86_64")) && !cfg!(target_feature = "sse4.1") {
        const BIG: f32 = 8_388_608.0; // 2^23: from here on, floats are integers
        if v.abs() < BIG {
            ((v.abs() + BIG) - BIG).copysign(v)
        } else {
            v
        }
    } else {
        v.round_ties_even()
    }
}

/// [`rint`] in float64 (2^52).
#[inline(always)]
fn rint64(v: f64) -> f64 {
    if cfg!(any(target_arch = "x86", target_arch = "x86_64")) && !cfg!(target_feature = "sse4.1") {
        const BIG: f64 = 4_503_599_627_370_496.0; // 2^52
        if v.abs() < BIG {
            ((v.abs() + BIG) - BIG).copysign(v)
        } else {
            v
        }
    } else {
        v.round_ties_even()
    }
}

/// The quantisation constants of a chunk with (finite) extremes `mn`, `mx`.
#[derive(Clone, Copy, Debug)]
struct Params {
    scale: f32,
    upper: f32,
    lower: f32,
}

impl Params {
    fn new(mn: f32, mx: f32) -> Self {
        let scale = Q / (mx - mn + EPS);
        let upper = (mx * scale).round_ties_even();
        Params {
            scale,
            upper,
            lower: upper - Q,
        }
    }

    /// The byte of `x`. `min` is written as `minps` computes it; `as u8`
    /// saturates (NaN -> 0).
    ///
    /// The vector kernels saturate in integers after truncating to i32,
    /// which agrees with `as u8` because `level - lower` never exceeds
    /// 2^31: `level <= upper`, and `upper - lower` is 255 while `upper` is
    /// below 2^24 and at most 255 + ulp(upper) / 2 <= 383 up to 2^32, beyond
    /// which `lower == upper`; an infinite `upper` makes `level - lower` NaN
    /// or -inf (`scale` is finite and `mx` finite, so `upper` is never NaN).
    #[inline(always)]
    fn byte(self, x: f32) -> u8 {
        let level = rint(x * self.scale);
        let level = if level < self.upper {
            level
        } else {
            self.upper
        };
        (level - self.lower) as u8
    }

    /// The decompressed value of `byte`, before rounding to the element type.
    #[inline(always)]
    fn value(self, byte: u8) -> f32 {
        (f32::from(byte) + self.lower) / self.scale
    }
}

/// [`Params`] of a float64 chunk.
#[derive(Clone, Copy, Debug)]
struct Params64 {
    scale: f64,
    upper: f64,
    lower: f64,
}

impl Params64 {
    fn new(mn: f64, mx: f64) -> Self {
        let scale = Q_F64 / (mx - mn + EPS_F64);
        let upper = (mx * scale).round_ties_even();
        Params64 {
            scale,
            upper,
            lower: upper - Q_F64,
        }
    }

    #[inline(always)]
    fn byte(self, x: f64) -> u8 {
        let level = rint64(x * self.scale);
        let level = if level < self.upper {
            level
        } else {
            self.upper
        };
        (level - self.lower) as u8
    }

    #[inline(always)]
    fn value(self, byte: u8) -> f64 {
        (f64::from(byte) + self.lower) / self.scale
    }
}

/// The extremes of a chunk as a kernel found them: exact when `finite`.
#[derive(Clone, Copy, Debug)]
struct Range {
    mn: f32,
    mx: f32,
    finite: bool,
}

impl Range {
    /// Folds the lanes of vector accumulators: `mn`/`mx` lane-wise extremes,
    /// `chk` lane-wise sums of `x - x` or `x * 0` (0 unless a NaN or an
    /// infinity was seen).
    fn from_lanes(mn: &[f32], mx: &[f32], chk: &[f32]) -> Range {
        let mut r = Range {
            mn: f32::INFINITY,
            mx: f32::NEG_INFINITY,
            finite: chk.iter().all(|c| *c == 0.0),
        };
        for (a, b) in mn.iter().zip(mx) {
            if *a < r.mn {
                r.mn = *a;
            }
            if *b > r.mx {
                r.mx = *b;
            }
        }
        r
    }
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

/// The operation a kernel applies per decompressed value (the accumulators
/// are float32 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Store,
    Add,
    AccFirst,
    Acc,
}

/// Which kernels run. The x86 variants hold a token only made after the
/// features were detected, so holding one proves the CPU has them.
#[derive(Clone, Copy, Debug)]
enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2(x86::Avx2),
    #[cfg(target_arch = "x86_64")]
    Avx512(x86::Avx512),
}

impl Isa {
    /// The fastest kernels this CPU runs.
    fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(t) = x86::Avx512::detect() {
                return Isa::Avx512(t);
            }
            if let Some(t) = x86::Avx2::detect() {
                return Isa::Avx2(t);
            }
        }
        Isa::Portable
    }

    /// The variant's name, as `python -m ringlet info` shows it.
    fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2(_) => "avx2+f16c",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(_) => "avx512f+f16c",
        }
    }

    /// Every variant this CPU runs.
    #[cfg(test)]
    fn available() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(t) = x86::Avx2::detect() {
                v.push(Isa::Avx2(t));
            }
            if let Some(t) = x86::Avx512::detect() {
                v.push(Isa::Avx512(t));
            }
        }
        v
    }

    fn minmax(self, kind: Kind, src: &[u8]) -> Range {
        match self {
            Isa::Portable => portable::minmax(kind, src),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX2 and F16C were detected, the
            // features `x86::avx2` is compiled for.
            Isa::Avx2(_) => unsafe { x86::avx2::minmax(kind, src) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX-512F, AVX2 and F16C were
            // detected, the features `x86::avx512` is compiled for.
            Isa::Avx512(_) => unsafe { x86::avx512::minmax(kind, src) },
        }
    }

    fn quantize(self, kind: Kind, src: &[u8], p: Params, dst: &mut [u8]) {
        match self {
            Isa::Portable => portable::quantize(kind, src, p, dst),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX2 and F16C were detected.
            Isa::Avx2(_) => unsafe { x86::avx2::quantize(kind, src, p, dst) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX-512F, AVX2 and F16C were detected.
            Isa::Avx512(_) => unsafe { x86::avx512::quantize(kind, src, p, dst) },
        }
    }

    fn dequantize(self, kind: Kind, mode: Mode, src: &[u8], p: Params, dst: &mut [u8]) {
        match self {
            Isa::Portable => portable::dequantize(kind, mode, src, p, dst),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX2 and F16C were detected.
            Isa::Avx2(_) => unsafe { x86::avx2::dequantize(kind, mode, src, p, dst) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX-512F, AVX2 and F16C were detected.
            Isa::Avx512(_) => unsafe { x86::avx512::dequantize(kind, mode, src, p, dst) },
        }
    }

    fn scaled(self, kind: Kind, acc: &[u8], divisor: f32, dst: &mut [u8]) {
        match self {
            Isa::Portable => portable::scaled(kind, acc, divisor, dst),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX2 and F16C were detected.
            Isa::Avx2(_) => unsafe { x86::avx2::scaled(kind, acc, divisor, dst) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves AVX-512F, AVX2 and F16C were detected.
            Isa::Avx512(_) => unsafe { x86::avx512::scaled(kind, acc, divisor, dst) },
        }
    }
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
    let (mut mn, mut mx, mut finite) = (f64::INFINITY, f64::NEG_INFINITY, true);
    for c in src.chunks_exact(8) {
        let x = load(c);
        finite &= x.is_finite();
        if x < mn {
            mn = x;
        }
        if x > mx {
            mx = x;
        }
    }
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

/// Folds `step` over the `B`-byte groups of `src` in four interleaved
/// states (independent dependency chains) and merges them. The last, partial
/// group (whole elements of `esize` bytes) is padded with copies of its first
/// element, which leaves minima, maxima and finiteness unchanged.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
fn fold_groups<const B: usize, S: Copy>(
    src: &[u8],
    esize: usize,
    init: S,
    step: impl Fn(S, &[u8; B]) -> S,
    merge: impl Fn(S, S) -> S,
) -> S {
    let (groups, tail) = src.as_chunks::<B>();
    let mut s = [init; 4];
    let mut quads = groups.chunks_exact(4);
    for q in &mut quads {
        if let [a, b, c, d] = q {
            s = [step(s[0], a), step(s[1], b), step(s[2], c), step(s[3], d)];
        }
    }
    for g in quads.remainder() {
        s[0] = step(s[0], g);
    }
    if tail.len() >= esize {
        let mut pad = [0u8; B];
        for c in pad.chunks_exact_mut(esize) {
            c.copy_from_slice(&tail[..esize]);
        }
        pad[..tail.len()].copy_from_slice(tail);
        s[1] = step(s[1], &pad);
    }
    merge(merge(s[0], s[1]), merge(s[2], s[3]))
}

/// Calls `f` on corresponding groups of `src` (`A` bytes) and `dst` (`B`
/// bytes), which hold the same number of elements; the last, partial groups
/// go through zero-padded copies (`dst`'s holding its current bytes).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
fn zip_groups<const A: usize, const B: usize>(
    src: &[u8],
    dst: &mut [u8],
    mut f: impl FnMut(&[u8; A], &mut [u8; B]),
) {
    let (sg, st) = src.as_chunks::<A>();
    let (dg, dt) = dst.as_chunks_mut::<B>();
    for (s, d) in sg.iter().zip(dg.iter_mut()) {
        f(s, d);
    }
    if !st.is_empty() || !dt.is_empty() {
        let mut s = [0u8; A];
        s[..st.len()].copy_from_slice(st);
        let mut d = [0u8; B];
        d[..dt.len()].copy_from_slice(dt);
        f(&s, &mut d);
        let k = dt.len();
        dt.copy_from_slice(&d[..k]);
    }
}

/// Scalar kernels, one element at a time: for CPUs without the vector
/// variants, and the variant the others are tested against.
mod portable {
    use super::{Kind, Mode, Params, Range};
    use half::{bf16, f16};

    /// An element type computed in float32.
    trait Lane {
        const SIZE: usize;
        /// The element in `b` (`SIZE` bytes, native order), widened exactly.
        fn widen(b: &[u8]) -> f32;
        /// Rounds `v` to the element type into `b`.
        fn narrow(v: f32, b: &mut [u8]);
        /// `v` rounded to the element type and widened back.
        fn round(v: f32) -> f32;
    }

    struct F32;
    struct F16;
    struct BF16;

    impl Lane for F32 {
        const SIZE: usize = 4;
        #[inline(always)]
        fn widen(b: &[u8]) -> f32 {
            f32::from_ne_bytes([b[0], b[1], b[2], b[3]])
        }
        #[inline(always)]
        fn narrow(v: f32, b: &mut [u8]) {
            b.copy_from_slice(&v.to_ne_bytes());
        }
        #[inline(always)]
        fn round(v: f32) -> f32 {
            v
        }
    }

    impl Lane for F16 {
        const SIZE: usize = 2;
        #[inline(always)]
        fn widen(b: &[u8]) -> f32 {
            f16::from_ne_bytes([b[0], b[1]]).to_f32()
        }
        #[inline(always)]
        fn narrow(v: f32, b: &mut [u8]) {
            b.copy_from_slice(&f16::from_f32(v).to_ne_bytes());
        }
        #[inline(always)]
        fn round(v: f32) -> f32 {
            f16::from_f32(v).to_f32()
        }
    }

    impl Lane for BF16 {
        const SIZE: usize = 2;
        #[inline(always)]
        fn widen(b: &[u8]) -> f32 {
            bf16::from_ne_bytes([b[0], b[1]]).to_f32()
        }
        #[inline(always)]
        fn narrow(v: f32, b: &mut [u8]) {
            b.copy_from_slice(&bf16::from_f32(v).to_ne_bytes());
        }
        #[inline(always)]
        fn round(v: f32) -> f32 {
            bf16::from_f32(v).to_f32()
        }
    }

    /// Elements per step of the loops below: blocks of `W` independent
    /// lanes, which the compiler can keep in vector registers.
    const W: usize = 8;

    /// The `W` elements in `b` (`W * L::SIZE` bytes), widened.
    #[inline(always)]
    fn widen_block<L: Lane>(b: &[u8]) -> [f32; W] {
        let mut x = [0f32; W];
        for (x, c) in x.iter_mut().zip(b.chunks_exact(L::SIZE)) {
            *x = L::widen(c);
        }
        x
    }

    pub(super) fn minmax(kind: Kind, src: &[u8]) -> Range {
        fn run<L: Lane>(src: &[u8]) -> Range {
            let mut mn = [f32::INFINITY; W];
            let mut mx = [f32::NEG_INFINITY; W];
            // Sums of `x * 0`: 0 unless a NaN or an infinity went in.
            let mut chk = [0f32; W];
            let mut step = |x: [f32; W]| {
                for k in 0..W {
                    mn[k] = if x[k] < mn[k] { x[k] } else { mn[k] };
                    mx[k] = if x[k] > mx[k] { x[k] } else { mx[k] };
                    chk[k] += x[k] * 0.0;
                }
            };
            let blocks = src.chunks_exact(W * L::SIZE);
            let rest = blocks.remainder();
            for b in blocks {
                step(widen_block::<L>(b));
            }
            for c in rest.chunks_exact(L::SIZE) {
                // Pad with copies of the element: extremes unchanged.
                step([L::widen(c); W]);
            }
            Range::from_lanes(&mn, &mx, &chk)
        }
        match kind {
            Kind::F32 => run::<F32>(src),
            Kind::F16 => run::<F16>(src),
            Kind::BF16 => run::<BF16>(src),
        }
    }

    pub(super) fn quantize(kind: Kind, src: &[u8], p: Params, dst: &mut [u8]) {
        fn run<L: Lane>(src: &[u8], p: Params, dst: &mut [u8]) {
            let blocks = src.chunks_exact(W * L::SIZE);
            let rest = blocks.remainder();
            let mut out = dst.chunks_exact_mut(W);
            for (b, o) in blocks.zip(&mut out) {
                for (o, x) in o.iter_mut().zip(widen_block::<L>(b)) {
                    *o = p.byte(x);
                }
            }
            let tail = out.into_remainder();
            for (c, d) in rest.chunks_exact(L::SIZE).zip(tail.iter_mut()) {
                *d = p.byte(L::widen(c));
            }
        }
        match kind {
            Kind::F32 => run::<F32>(src, p, dst),
            Kind::F16 => run::<F16>(src, p, dst),
            Kind::BF16 => run::<BF16>(src, p, dst),
        }
    }

    pub(super) fn dequantize(kind: Kind, mode: Mode, src: &[u8], p: Params, dst: &mut [u8]) {
        fn run<L: Lane>(mode: Mode, src: &[u8], p: Params, dst: &mut [u8]) {
            match mode {
                Mode::Store => {
                    for (b, d) in src.iter().zip(dst.chunks_exact_mut(L::SIZE)) {
                        L::narrow(p.value(*b), d);
                    }
                }
                Mode::Add => {
                    for (b, d) in src.iter().zip(dst.chunks_exact_mut(L::SIZE)) {
                        L::narrow(L::widen(d) + L::round(p.value(*b)), d);
                    }
                }
                Mode::AccFirst | Mode::Acc => {
                    let first = mode == Mode::AccFirst;
                    for (b, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
                        let a = if first { 0.0 } else { F32::widen(d) };
                        F32::narrow(a + L::round(p.value(*b)), d);
                    }
                }
            }
        }
        match kind {
            Kind::F32 => run::<F32>(mode, src, p, dst),
            Kind::F16 => run::<F16>(mode, src, p, dst),
            Kind::BF16 => run::<BF16>(mode, src, p, dst),
        }
    }

    pub(super) fn scaled(kind: Kind, acc: &[u8], divisor: f32, dst: &mut [u8]) {
        fn run<L: Lane>(acc: &[u8], divisor: f32, dst: &mut [u8]) {
            for (a, d) in acc.chunks_exact(4).zip(dst.chunks_exact_mut(L::SIZE)) {
                L::narrow(F32::widen(a) / divisor, d);
            }
        }
        match kind {
            Kind::F32 => run::<F32>(acc, divisor, dst),
            Kind::F16 => run::<F16>(acc, divisor, dst),
            Kind::BF16 => run::<BF16>(acc, divisor, dst),
        }
    }
}

/// x86_64 kernels: safe functions with target features, generated for each
/// instruction set of the SIMD layer (`crate::simd`) from one description
/// over its float32 lanes; the element type enters through the layer's load
/// (widen), store (narrow) and round-trip functions.
#[cfg(target_arch = "x86_64")]
mod x86 {
    /// Proof that this CPU has AVX2 and F16C (only `detect` makes one).
    #[derive(Clone, Copy, Debug)]
    pub(super) struct Avx2(());

    impl Avx2 {
        pub(super) fn detect() -> Option<Self> {
            crate::simd::has_f16c().then_some(Avx2(()))
        }
    }

    /// Proof that this CPU has AVX-512F, AVX2 and F16C.
    #[derive(Clone, Copy, Debug)]
    pub(super) struct Avx512(());

    impl Avx512 {
        pub(super) fn detect() -> Option<Self> {
            crate::simd::has_avx512().then_some(Avx512(()))
        }
    }

    /// The kernels over `crate::simd::$isa`, compiled for `$features`.
    macro_rules! kernels {
        ($(#[$doc:meta])* $isa:ident, $features:literal) => {
            $(#[$doc])*
            pub(super) mod $isa {
                use super::super::{fold_groups, zip_groups, Kind, Mode, Params, Range};
                use crate::simd::$isa::{
                    add, div, from_bytes, lanes, load_bf16, load_f16, load_f32, max, min, mul,
                    rint, round_bf16, round_f16, splat, store_bf16, store_f16, store_f32, sub,
                    to_bytes, zero, L, V,
                };

                #[target_feature(enable = $features)]
                #[inline]
                fn minmax_of<const B: usize>(
                    src: &[u8],
                    esize: usize,
                    load: impl Fn(&[u8; B]) -> V,
                ) -> Range {
                    let init = (splat(f32::INFINITY), splat(f32::NEG_INFINITY), zero());
                    // `chk` sums `x - x`: 0 unless a NaN or an infinity went in.
                    let step = |(mn, mx, chk): (V, V, V), g: &[u8; B]| {
                        let x = load(g);
                        (min(mn, x), max(mx, x), add(chk, sub(x, x)))
                    };
                    let merge = |a: (V, V, V), b: (V, V, V)| {
                        (min(a.0, b.0), max(a.1, b.1), add(a.2, b.2))
                    };
                    let (mn, mx, chk) = fold_groups::<B, (V, V, V)>(src, esize, init, step, merge);
                    Range::from_lanes(&lanes(mn), &lanes(mx), &lanes(chk))
                }

                #[target_feature(enable = $features)]
                pub(in super::super) fn minmax(kind: Kind, src: &[u8]) -> Range {
                    match kind {
                        Kind::F32 => minmax_of::<{ 4 * L }>(src, 4, |b| load_f32(b)),
                        Kind::F16 => minmax_of::<{ 2 * L }>(src, 2, |b| load_f16(b)),
                        Kind::BF16 => minmax_of::<{ 2 * L }>(src, 2, |b| load_bf16(b)),
                    }
                }

                #[target_feature(enable = $features)]
                #[inline]
                fn quantize_of<const B: usize>(
                    src: &[u8],
                    p: Params,
                    dst: &mut [u8],
                    load: impl Fn(&[u8; B]) -> V,
                ) {
                    let scale = splat(p.scale);
                    let upper = splat(p.upper);
                    let lower = splat(p.lower);
                    zip_groups::<B, L>(src, dst, |s, d| {
                        let level = min(rint(mul(load(s), scale)), upper);
                        // `as u8` in integer operations (see `Params::byte`).
                        *d = to_bytes(sub(level, lower));
                    });
                }

                #[target_feature(enable = $features)]
                pub(in super::super) fn quantize(
                    kind: Kind,
                    src: &[u8],
                    p: Params,
                    dst: &mut [u8],
                ) {
                    match kind {
                        Kind::F32 => quantize_of::<{ 4 * L }>(src, p, dst, |b| load_f32(b)),
                        Kind::F16 => quantize_of::<{ 2 * L }>(src, p, dst, |b| load_f16(b)),
                        Kind::BF16 => quantize_of::<{ 2 * L }>(src, p, dst, |b| load_bf16(b)),
                    }
                }

                #[target_feature(enable = $features)]
                #[inline]
                fn dequantize_of<const B: usize>(
                    mode: Mode,
                    src: &[u8],
                    p: Params,
                    dst: &mut [u8],
                    load: impl Fn(&[u8; B]) -> V,
                    store: impl Fn(V, &mut [u8; B]),
                    round: impl Fn(V) -> V,
                ) {
                    let scale = splat(p.scale);
                    let lower = splat(p.lower);
                    let value = |s: &[u8; L]| div(add(from_bytes(s), lower), scale);
                    match mode {
                        Mode::Store => zip_groups::<L, B>(src, dst, |s, d| store(value(s), d)),
                        Mode::Add => zip_groups::<L, B>(src, dst, |s, d| {
                            store(add(load(d), round(value(s))), d)
                        }),
                        Mode::AccFirst => zip_groups::<L, { 4 * L }>(src, dst, |s, d| {
                            store_f32(add(zero(), round(value(s))), d)
                        }),
                        Mode::Acc => zip_groups::<L, { 4 * L }>(src, dst, |s, d| {
                            store_f32(add(load_f32(d), round(value(s))), d)
                        }),
                    }
                }

                #[target_feature(enable = $features)]
                pub(in super::super) fn dequantize(
                    kind: Kind,
                    mode: Mode,
                    src: &[u8],
                    p: Params,
                    dst: &mut [u8],
                ) {
                    match kind {
                        Kind::F32 => dequantize_of::<{ 4 * L }>(
                            mode,
                            src,
                            p,
                            dst,
                            |b| load_f32(b),
                            |v, b| store_f32(v, b),
                            |v| v,
                        ),
                        Kind::F16 => dequantize_of::<{ 2 * L }>(
                            mode,
                            src,
                            p,
                            dst,
                            |b| load_f16(b),
                            |v, b| store_f16(v, b),
                            |v| round_f16(v),
                        ),
                        Kind::BF16 => dequantize_of::<{ 2 * L }>(
                            mode,
                            src,
                            p,
                            dst,
                            |b| load_bf16(b),
                            |v, b| store_bf16(v, b),
                            |v| round_bf16(v),
                        ),
                    }
                }

                #[target_feature(enable = $features)]
                pub(in super::super) fn scaled(
                    kind: Kind,
                    acc: &[u8],
                    divisor: f32,
                    dst: &mut [u8],
                ) {
                    let d = splat(divisor);
                    let q = |a: &[u8; 4 * L]| div(load_f32(a), d);
                    match kind {
                        Kind::F32 => zip_groups::<{ 4 * L }, { 4 * L }>(acc, dst, |a, o| {
                            store_f32(q(a), o)
                        }),
                        Kind::F16 => zip_groups::<{ 4 * L }, { 2 * L }>(acc, dst, |a, o| {
                            store_f16(q(a), o)
                        }),
                        Kind::BF16 => zip_groups::<{ 4 * L }, { 2 * L }>(acc, dst, |a, o| {
                            store_bf16(q(a), o)
                        }),
                    }
                }
            }
        };
    }

    kernels!(
        /// 16 lanes of float32 in a zmm register.
        avx512,
        "avx512f,avx2,f16c"
    );
    kernels!(
        /// 8 lanes of float32 in a ymm register.
        avx2,
        "avx2,f16c"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    const NARROW: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
    const SIZES: [usize; 14] = [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1000, 4097];

    /// xorshift64*: reproducible values without a dependency.
    struct Rng(u64);

    impl Rng {
        fn bits(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        /// Uniform in [-1, 1).
        fn sym(&mut self) -> f64 {
            (self.bits() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        }
    }

    fn same32(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    fn same64(a: f64, b: f64) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// `v` rounded to `dtype` (float32, float16 or bfloat16), as float32.
    fn round_to(dtype: DType, v: f32) -> f32 {
        match dtype {
            DType::F32 => v,
            DType::F16 => f16::from_f32(v).to_f32(),
            DType::BF16 => bf16::from_f32(v).to_f32(),
            _ => unreachable!(),
        }
    }

    fn to_bytes(dtype: DType, xs: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        for x in xs {
            match dtype {
                DType::F32 => out.extend(x.to_ne_bytes()),
                DType::F16 => out.extend(f16::from_f32(*x).to_ne_bytes()),
                DType::BF16 => out.extend(bf16::from_f32(*x).to_ne_bytes()),
                _ => unreachable!(),
            }
        }
        out
    }

    fn from_bytes(dtype: DType, b: &[u8]) -> Vec<f32> {
        b.chunks_exact(dtype.size())
            .map(|c| match dtype {
                DType::F32 => f32::from_ne_bytes([c[0], c[1], c[2], c[3]]),
                DType::F16 => f16::from_ne_bytes([c[0], c[1]]).to_f32(),
                DType::BF16 => bf16::from_ne_bytes([c[0], c[1]]).to_f32(),
                _ => unreachable!(),
            })
            .collect()
    }

    /// A copy of `b` starting `offset` bytes into a fresh allocation (so at
    /// an odd address for offset 1), returned with the offset.
    fn placed(b: &[u8], offset: usize) -> (Vec<u8>, usize) {
        let mut v = vec![0xa5u8; b.len() + offset];
        v[offset..].copy_from_slice(b);
        (v, offset)
    }

    /// Bagua's compression written straight from the formulas, in float32:
    /// `(mn, mx, bytes)`.
    fn ref_compress(xs: &[f32]) -> (f32, f32, Vec<u8>) {
        if xs.is_empty() {
            return (0.0, 0.0, vec![]);
        }
        if xs.iter().any(|x| !x.is_finite()) {
            return (f32::NAN, f32::NAN, vec![0; xs.len()]);
        }
        let mn = xs.iter().fold(f32::INFINITY, |a, x| a.min(*x)) + 0.0;
        let mx = xs.iter().fold(f32::NEG_INFINITY, |a, x| a.max(*x)) + 0.0;
        let scale = 255.0f32 / (mx - mn + 1e-7f32);
        let upper = (mx * scale).round_ties_even();
        let lower = upper - 255.0;
        let bytes = xs
            .iter()
            .map(|x| {
                let level = (x * scale).round_ties_even().min(upper);
                (level - lower) as u8
            })
            .collect();
        (mn, mx, bytes)
    }

    /// The decompressed values before rounding to the element type.
    fn ref_values(mn: f32, mx: f32, bytes: &[u8]) -> Vec<f32> {
        let scale = 255.0f32 / (mx - mn + 1e-7f32);
        let upper = (mx * scale).round_ties_even();
        let lower = upper - 255.0;
        bytes
            .iter()
            .map(|b| {
                if mn.is_finite() && mx.is_finite() {
                    (*b as f32 + lower) / scale
                } else {
                    f32::NAN
                }
            })
            .collect()
    }

    /// The float64 reference.
    fn ref_compress64(xs: &[f64]) -> (f64, f64, Vec<u8>) {
        if xs.is_empty() {
            return (0.0, 0.0, vec![]);
        }
        if xs.iter().any(|x| !x.is_finite()) {
            return (f64::NAN, f64::NAN, vec![0; xs.len()]);
        }
        let mn = xs.iter().fold(f64::INFINITY, |a, x| a.min(*x)) + 0.0;
        let mx = xs.iter().fold(f64::NEG_INFINITY, |a, x| a.max(*x)) + 0.0;
        let scale = 255.0f64 / (mx - mn + 1e-7f64);
        let upper = (mx * scale).round_ties_even();
        let lower = upper - 255.0;
        let bytes = xs
            .iter()
            .map(|x| ((x * scale).round_ties_even().min(upper) - lower) as u8)
            .collect();
        (mn, mx, bytes)
    }

    fn ref_values64(mn: f64, mx: f64, bytes: &[u8]) -> Vec<f64> {
        let scale = 255.0f64 / (mx - mn + 1e-7f64);
        let lower = (mx * scale).round_ties_even() - 255.0;
        bytes
            .iter()
            .map(|b| {
                if mn.is_finite() && mx.is_finite() {
                    (*b as f64 + lower) / scale
                } else {
                    f64::NAN
                }
            })
            .collect()
    }

    /// Value patterns of chunks of `n` elements, in float64 (callers round
    /// them to the element type). `big` is the largest magnitude to use.
    fn patterns(n: usize, big: f64, tiny: f64, rng: &mut Rng) -> Vec<Vec<f64>> {
        let mut gen = |f: &mut dyn FnMut(&mut Rng, usize) -> f64| -> Vec<f64> {
            (0..n).map(|i| f(rng, i)).collect()
        };
        vec![
            gen(&mut |r, _| r.sym()),
            gen(&mut |r, _| 1.0 + 1e-6 * r.sym()),
            gen(&mut |r, _| 3e-4 * r.sym()),
            gen(&mut |r, _| big * r.sym()),
            gen(&mut |r, _| big * 1e-3 * r.sym()),
            gen(&mut |_, _| 0.7),
            gen(&mut |_, _| -12.5),
            gen(&mut |_, _| 0.0),
            gen(&mut |r, _| -(1.0 + r.sym().abs()) * 10.0),
            gen(&mut |r, _| (big * 1e-6).min(1e6) + 1e-2 * r.sym()),
            gen(&mut |r, _| 1e3 + 0.5 * r.sym()),
            gen(&mut |r, _| tiny * r.sym()),
            gen(&mut |r, i| match i % 3 {
                0 => 0.0,
                1 => -0.0,
                _ => 1e-3 * r.sym(),
            }),
            // Gradient-like: small values with rare outliers.
            gen(&mut |r, i| {
                if i % 97 == 13 {
                    5.0 * r.sym()
                } else {
                    1e-3 * r.sym()
                }
            }),
            // Exact levels and ties: multiples of 1/2 of a level.
            gen(&mut |r, _| ((r.bits() % 511) as f64) / 2.0 * (1.0 / 255.0)),
        ]
    }

    /// Runs compress, decompress, decompress_add, accumulate and
    /// store_scaled of `xs` (values of `dtype`) on `isa` at byte offset
    /// `off` and checks every result against the reference.
    fn check_chunk(isa: Isa, dtype: DType, xs: &[f32], off: usize, rng: &mut Rng) {
        let n = xs.len();
        let ctx = format!("{isa:?} {} n={n} off={off}", dtype.name());
        let (src, o) = placed(&to_bytes(dtype, xs), off);
        let (mut comp, _) = placed(&vec![0u8; compressed_len(dtype, n)], off);
        compress_with(isa, dtype, &src[o..], &mut comp[o..]).unwrap();
        let comp = &comp[o..];

        let (mn, mx, bytes) = ref_compress(xs);
        let word = |i: usize| f32::from_le_bytes(comp[i..i + 4].try_into().unwrap());
        assert!(same32(word(0), mn), "{ctx}: mn {} vs {mn}", word(0));
        assert!(same32(word(4), mx), "{ctx}: mx {} vs {mx}", word(4));
        assert!(
            mn.is_nan() || mn.to_bits() == word(0).to_bits() && mx.to_bits() == word(4).to_bits(),
            "{ctx}: header bits"
        );
        assert_eq!(&comp[8..], &bytes[..], "{ctx}: bytes");

        let values: Vec<f32> = ref_values(mn, mx, &bytes)
            .into_iter()
            .map(|v| round_to(dtype, v))
            .collect();

        // decompress
        let (mut out, o) = placed(&vec![0u8; n * dtype.size()], off);
        decode_with(isa, dtype, comp, Target::Store(&mut out[o..])).unwrap();
        for (i, (g, w)) in from_bytes(dtype, &out[o..]).iter().zip(&values).enumerate() {
            assert!(same32(*g, *w), "{ctx}: decompress [{i}] {g} vs {w}");
        }

        // decompress_add onto values of the type
        let base: Vec<f32> = (0..n)
            .map(|_| round_to(dtype, (rng.sym() * 3.0) as f32))
            .collect();
        let (mut out, o) = placed(&to_bytes(dtype, &base), off);
        decode_with(isa, dtype, comp, Target::Add(&mut out[o..])).unwrap();
        for (i, ((g, w), b)) in from_bytes(dtype, &out[o..])
            .iter()
            .zip(&values)
            .zip(&base)
            .enumerate()
        {
            let want = round_to(dtype, b + w);
            assert!(same32(*g, want), "{ctx}: add [{i}] {g} vs {want}");
        }

        // accumulate twice (first, then not), then the mean
        let mut acc = vec![f32::NAN; n];
        decode_with(isa, dtype, comp, Target::Acc(&mut acc, true)).unwrap();
        for (i, (g, w)) in acc.iter().zip(&values).enumerate() {
            assert!(same32(*g, 0.0 + w), "{ctx}: acc first [{i}] {g} vs {w}");
        }
        decode_with(isa, dtype, comp, Target::Acc(&mut acc, false)).unwrap();
        for (i, (g, w)) in acc.iter().zip(&values).enumerate() {
            let want = (0.0 + w) + w;
            assert!(same32(*g, want), "{ctx}: acc [{i}] {g} vs {want}");
        }
        for divisor in [1.0f32, 2.0, 3.0] {
            let (mut out, o) = placed(&vec![0u8; n * dtype.size()], off);
            store_scaled_with(isa, dtype, &acc, divisor, &mut out[o..]).unwrap();
            for (i, (g, a)) in from_bytes(dtype, &out[o..]).iter().zip(&acc).enumerate() {
                let want = round_to(dtype, a / divisor);
                assert!(
                    same32(*g, want),
                    "{ctx}: scaled /{divisor} [{i}] {g} vs {want}"
                );
            }
        }
    }

    fn finite_cases(dtype: DType, rng: &mut Rng) -> Vec<Vec<f32>> {
        let (big, tiny) = match dtype {
            DType::F16 => (6e4, 1e-6),
            _ => (1e30, 1e-40),
        };
        let mut cases = vec![];
        for n in SIZES {
            for p in patterns(n, big, tiny, rng) {
                cases.push(p.iter().map(|v| round_to(dtype, *v as f32)).collect());
            }
        }
        // Corner cases of the formula: a spread that overflows (scale 0),
        // a constant beyond 255 / eps (x * scale overflows), the extremes.
        if dtype != DType::F16 {
            cases.push(vec![3e38, -3e38, 1.0, 0.0, -2.5e38]);
            cases.push(vec![1e30; 20]);
            cases.push(vec![-1e30; 20]);
        }
        cases.push(vec![f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 0.0]);
        cases
            .into_iter()
            .map(|c| c.into_iter().map(|v| round_to(dtype, v)).collect())
            .collect()
    }

    #[test]
    fn every_variant_matches_the_reference() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for isa in Isa::available() {
            for dtype in NARROW {
                for xs in finite_cases(dtype, &mut rng) {
                    for off in [0, 1, 2, 3] {
                        check_chunk(isa, dtype, &xs, off, &mut rng);
                    }
                }
            }
        }
    }

    #[test]
    fn public_functions_match_the_reference() {
        let mut rng = Rng(7);
        for dtype in NARROW {
            for xs in finite_cases(dtype, &mut rng).into_iter().step_by(5) {
                let n = xs.len();
                let src = to_bytes(dtype, &xs);
                let mut comp = vec![0u8; compressed_len(dtype, n)];
                compress(dtype, &src, &mut comp).unwrap();
                let (mn, mx, bytes) = ref_compress(&xs);
                assert_eq!(comp[..4], mn.to_le_bytes());
                assert_eq!(comp[4..8], mx.to_le_bytes());
                assert_eq!(comp[8..], bytes[..]);
                let values = ref_values(mn, mx, &bytes);
                let mut out = vec![0u8; src.len()];
                decompress(dtype, &comp, &mut out).unwrap();
                for (g, w) in from_bytes(dtype, &out).iter().zip(&values) {
                    assert!(same32(*g, round_to(dtype, *w)));
                }
                decompress_add(dtype, &comp, &mut out).unwrap();
                for (g, w) in from_bytes(dtype, &out).iter().zip(&values) {
                    let w = round_to(dtype, *w);
                    assert!(same32(*g, round_to(dtype, w + w)));
                }
                let mut acc = vec![0f32; n];
                decompress_accumulate(dtype, &comp, &mut acc, true).unwrap();
                decompress_accumulate(dtype, &comp, &mut acc, false).unwrap();
                store_scaled(dtype, &acc, 2.0, &mut out).unwrap();
                for (g, w) in from_bytes(dtype, &out).iter().zip(&values) {
                    let w = round_to(dtype, *w);
                    assert!(same32(*g, round_to(dtype, (0.0 + w + w) / 2.0)));
                }
            }
        }
    }

    #[test]
    fn float64_matches_the_reference() {
        let mut rng = Rng(0x1234_5678);
        let mut cases = vec![];
        for n in SIZES {
            cases.extend(patterns(n, 1e300, 1e-310, &mut rng));
        }
        cases.push(vec![1.7e308, -1.7e308, 0.0]);
        cases.push(vec![1e200; 9]);
        for xs in cases {
            for off in [0, 1, 5] {
                let n = xs.len();
                let ctx = format!("f64 n={n} off={off}");
                let raw: Vec<u8> = xs.iter().flat_map(|x| x.to_ne_bytes()).collect();
                let (src, o) = placed(&raw, off);
                let (mut comp, _) = placed(&vec![0u8; compressed_len(DType::F64, n)], off);
                compress(DType::F64, &src[o..], &mut comp[o..]).unwrap();
                let comp = &comp[o..];
                let (mn, mx, bytes) = ref_compress64(&xs);
                assert_eq!(comp[..8], mn.to_le_bytes(), "{ctx}");
                assert_eq!(comp[8..16], mx.to_le_bytes(), "{ctx}");
                assert_eq!(comp[16..], bytes[..], "{ctx}");
                let values = ref_values64(mn, mx, &bytes);
                let read = |b: &[u8]| -> Vec<f64> {
                    b.chunks_exact(8)
                        .map(|c| f64::from_ne_bytes(c.try_into().unwrap()))
                        .collect()
                };

                let (mut out, o) = placed(&vec![0u8; n * 8], off);
                decompress(DType::F64, comp, &mut out[o..]).unwrap();
                for (g, w) in read(&out[o..]).iter().zip(&values) {
                    assert!(same64(*g, *w), "{ctx}: decompress {g} vs {w}");
                }
                let base: Vec<f64> = (0..n).map(|_| rng.sym()).collect();
                let raw: Vec<u8> = base.iter().flat_map(|x| x.to_ne_bytes()).collect();
                let (mut out, o) = placed(&raw, off);
                decompress_add(DType::F64, comp, &mut out[o..]).unwrap();
                for ((g, w), b) in read(&out[o..]).iter().zip(&values).zip(&base) {
                    assert!(same64(*g, b + w), "{ctx}: add");
                }
                let mut acc = vec![f64::NAN; n];
                decompress_accumulate_f64(comp, &mut acc, true).unwrap();
                decompress_accumulate_f64(comp, &mut acc, false).unwrap();
                for (g, w) in acc.iter().zip(&values) {
                    assert!(same64(*g, (0.0 + w) + w), "{ctx}: acc");
                }
                let (mut out, o) = placed(&vec![0u8; n * 8], off);
                store_scaled_f64(&acc, 2.0, &mut out[o..]).unwrap();
                for (g, a) in read(&out[o..]).iter().zip(&acc) {
                    assert!(same64(*g, a / 2.0), "{ctx}: scaled");
                }
            }
        }
    }

    #[test]
    fn reconstruction_error_is_within_a_level() {
        let mut rng = Rng(99);
        for isa in Isa::available() {
            for dtype in NARROW {
                // Relative rounding of the element type (half an ulp, doubled).
                let rel = match dtype {
                    DType::F32 => 1.2e-7,
                    DType::F16 => 1e-3,
                    _ => 8e-3,
                };
                for xs in finite_cases(dtype, &mut rng) {
                    let n = xs.len();
                    let (mn, mx, _) = ref_compress(&xs);
                    let scale = 255.0 / (mx - mn + 1e-7);
                    // Bagua's levels only resolve while |x| * scale stays
                    // well inside float32's integers (see the module doc).
                    let top = mn.abs().max(mx.abs()) * scale;
                    if n == 0 || scale == 0.0 || top.is_nan() || top >= 4e6 {
                        continue;
                    }
                    let src = to_bytes(dtype, &xs);
                    let mut comp = vec![0u8; compressed_len(dtype, n)];
                    compress_with(isa, dtype, &src, &mut comp).unwrap();
                    let mut out = vec![0u8; src.len()];
                    decode_with(isa, dtype, &comp, Target::Store(&mut out)).unwrap();
                    let bound = (mx - mn + 1e-7) / 255.0;
                    for (x, y) in xs.iter().zip(from_bytes(dtype, &out)) {
                        let err = (y - x).abs();
                        assert!(
                            err <= bound * 1.0001 + x.abs() * rel,
                            "{isa:?} {} n={n}: {x} -> {y}, error {err} > {bound}",
                            dtype.name()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn non_finite_chunks_decompress_to_nan() {
        for isa in Isa::available() {
            for dtype in NARROW {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
                    for n in [1, 5, 16, 37, 100] {
                        for pos in [0, n / 2, n - 1] {
                            let mut xs: Vec<f32> =
                                (0..n).map(|i| round_to(dtype, i as f32 * 0.1)).collect();
                            xs[pos] = bad;
                            let ctx = format!("{isa:?} {} {bad} n={n} at {pos}", dtype.name());
                            let src = to_bytes(dtype, &xs);
                            let mut comp = vec![0xffu8; compressed_len(dtype, n)];
                            compress_with(isa, dtype, &src, &mut comp).unwrap();
                            assert!(f32::from_le_bytes(comp[..4].try_into().unwrap()).is_nan());
                            assert!(f32::from_le_bytes(comp[4..8].try_into().unwrap()).is_nan());
                            assert!(comp[8..].iter().all(|b| *b == 0), "{ctx}");
                            let mut out = src.clone();
                            decode_with(isa, dtype, &comp, Target::Store(&mut out)).unwrap();
                            assert!(from_bytes(dtype, &out).iter().all(|v| v.is_nan()), "{ctx}");
                            let mut out = to_bytes(dtype, &vec![1.0; n]);
                            decode_with(isa, dtype, &comp, Target::Add(&mut out)).unwrap();
                            assert!(from_bytes(dtype, &out).iter().all(|v| v.is_nan()), "{ctx}");
                            for first in [true, false] {
                                let mut acc = vec![1.0f32; n];
                                decode_with(isa, dtype, &comp, Target::Acc(&mut acc, first))
                                    .unwrap();
                                assert!(acc.iter().all(|v| v.is_nan()), "{ctx}");
                            }
                        }
                    }
                }
            }
        }
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let xs = [1.0f64, bad, -2.0];
            let src: Vec<u8> = xs.iter().flat_map(|x| x.to_ne_bytes()).collect();
            let mut comp = vec![0u8; compressed_len(DType::F64, 3)];
            compress(DType::F64, &src, &mut comp).unwrap();
            assert!(f64::from_le_bytes(comp[..8].try_into().unwrap()).is_nan());
            assert!(f64::from_le_bytes(comp[8..16].try_into().unwrap()).is_nan());
            let mut out = vec![0u8; 24];
            decompress(DType::F64, &comp, &mut out).unwrap();
            assert!(out
                .chunks_exact(8)
                .all(|c| f64::from_ne_bytes(c.try_into().unwrap()).is_nan()));
            let mut acc = vec![0f64; 3];
            decompress_accumulate_f64(&comp, &mut acc, false).unwrap();
            assert!(acc.iter().all(|v| v.is_nan()));
        }
    }

    #[test]
    fn empty_chunks() {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let mut comp = vec![0xffu8; compressed_len(dtype, 0)];
            assert_eq!(comp.len(), header_bytes(dtype));
            compress(dtype, &[], &mut comp).unwrap();
            assert!(comp.iter().all(|b| *b == 0));
            decompress(dtype, &comp, &mut []).unwrap();
            decompress_add(dtype, &comp, &mut []).unwrap();
        }
        decompress_accumulate(DType::F16, &[0; 8], &mut [], true).unwrap();
        decompress_accumulate_f64(&[0; 16], &mut [], true).unwrap();
        store_scaled(DType::BF16, &[], 1.0, &mut []).unwrap();
        store_scaled_f64(&[], 1.0, &mut []).unwrap();
    }

    #[test]
    fn bad_arguments_are_errors() {
        let bad = |r: Result<()>| assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        for dtype in [DType::I8, DType::U8, DType::I32, DType::I64, DType::Bool] {
            bad(compress(dtype, &[0; 8], &mut [0; 16]));
            bad(decompress(dtype, &[0; 16], &mut [0; 8]));
            bad(decompress_add(dtype, &[0; 16], &mut [0; 8]));
            bad(decompress_accumulate(dtype, &[0; 16], &mut [0.0; 8], true));
            bad(store_scaled(dtype, &[0.0; 2], 1.0, &mut [0; 8]));
        }
        for dtype in NARROW {
            let s = dtype.size();
            // Not whole elements (float16: odd byte counts).
            bad(compress(dtype, &[0; 5], &mut [0; 10]));
            // Destination of the wrong length.
            bad(compress(dtype, &vec![0; 4 * s], &mut [0; 11]));
            bad(compress(dtype, &vec![0; 4 * s], &mut [0; 13]));
            // Shorter than a header.
            bad(decompress(dtype, &[0; 7], &mut []));
            bad(decompress(dtype, &[0; 12], &mut vec![0; 3 * s]));
            bad(decompress(dtype, &[0; 12], &mut vec![0; 5 * s]));
            bad(decompress(dtype, &[0; 12], &mut vec![0; 4 * s + 1]));
            bad(decompress_add(dtype, &[0; 12], &mut vec![0; 3 * s]));
            bad(decompress_accumulate(dtype, &[0; 12], &mut [0.0; 3], true));
            bad(store_scaled(dtype, &[0.0; 3], 1.0, &mut vec![0; 4 * s]));
            bad(store_scaled(dtype, &[0.0; 3], 1.0, &mut vec![0; 3 * s + 1]));
        }
        bad(compress(DType::F64, &[0; 12], &mut [0; 17]));
        bad(compress(DType::F64, &[0; 16], &mut [0; 17]));
        bad(decompress(DType::F64, &[0; 15], &mut []));
        bad(decompress(DType::F64, &[0; 18], &mut [0; 8]));
        bad(decompress_accumulate(
            DType::F64,
            &[0; 18],
            &mut [0.0; 2],
            true,
        ));
        bad(decompress_accumulate_f64(&[0; 18], &mut [0.0; 3], true));
        bad(decompress_accumulate_f64(&[0; 8], &mut [], true));
        bad(store_scaled(DType::F64, &[0.0; 2], 1.0, &mut [0; 16]));
        bad(store_scaled_f64(&[0.0; 2], 1.0, &mut [0; 15]));
        bad(store_scaled_f64(&[0.0; 2], 1.0, &mut [0; 24]));
    }

    /// The vector kernels against the portable one on long chunks of mixed
    /// and adversarial values (random bit patterns, saturating levels), every
    /// output compared byte for byte.
    #[test]
    fn vector_kernels_agree_with_the_scalar_fallback() {
        let mut rng = Rng(0xdead_beef);
        let isas = Isa::available();
        for dtype in NARROW {
            let mut chunks: Vec<Vec<u8>> = vec![];
            for round in 0..40usize {
                let n = 1000 + round * 37;
                let center = (rng.sym() * 10f64.powi((round % 9) as i32 - 3)) as f32;
                let spread = 10f32.powi((round % 13) as i32 - 8);
                let xs: Vec<f32> = (0..n).map(|_| center + spread * rng.sym() as f32).collect();
                chunks.push(to_bytes(dtype, &xs));
            }
            for round in 0..10 {
                // Random bit patterns, with the non-finite ones replaced
                // every other round (the rest compress to NaN chunks).
                let raw: Vec<u8> = (0..(4099 * dtype.size()))
                    .map(|_| rng.bits() as u8)
                    .collect();
                let mut xs = from_bytes(dtype, &raw);
                if round % 2 == 0 {
                    xs.iter_mut()
                        .filter(|v| !v.is_finite())
                        .for_each(|v| *v = 1.0);
                }
                chunks.push(to_bytes(dtype, &xs));
            }
            for src in &chunks {
                let n = src.len() / dtype.size();
                let run = |isa: Isa| {
                    let mut comp = vec![0u8; compressed_len(dtype, n)];
                    compress_with(isa, dtype, src, &mut comp).unwrap();
                    let mut out = vec![0u8; src.len()];
                    decode_with(isa, dtype, &comp, Target::Store(&mut out)).unwrap();
                    let mut sum = src.clone();
                    decode_with(isa, dtype, &comp, Target::Add(&mut sum)).unwrap();
                    let mut acc = vec![0f32; n];
                    decode_with(isa, dtype, &comp, Target::Acc(&mut acc, true)).unwrap();
                    decode_with(isa, dtype, &comp, Target::Acc(&mut acc, false)).unwrap();
                    let mut mean = vec![0u8; src.len()];
                    store_scaled_with(isa, dtype, &acc, 3.0, &mut mean).unwrap();
                    let acc: Vec<u8> = bytemuck::cast_slice(&acc).to_vec();
                    [comp, out, sum, acc, mean]
                };
                let want = run(Isa::Portable);
                for isa in &isas[1..] {
                    let got = run(*isa);
                    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(g == w, "{isa:?} {} output {k} differs", dtype.name());
                    }
                }
            }
        }
    }

    #[test]
    fn rint_is_round_half_even() {
        let mut rng = Rng(3);
        let mut xs: Vec<f32> = vec![
            0.5,
            1.5,
            2.5,
            -0.5,
            -1.5,
            -2.5,
            0.0,
            -0.0,
            0.49999997,
            8388607.5,
            8388608.0,
            -8388607.5,
            4194303.5,
            16777215.0,
            1e30,
            -1e-30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
            f32::MAX,
        ];
        xs.extend((0..100_000).map(|_| f32::from_bits(rng.bits() as u32)));
        xs.extend((0..100_000).map(|_| (rng.sym() * 1e7) as f32));
        for x in xs {
            let (got, want) = (rint(x), x.round_ties_even());
            assert!(same32(got, want), "{x}: {got} vs {want}");
            let x = f64::from(x) * 3.0e8;
            let (got, want) = (rint64(x), x.round_ties_even());
            assert!(same64(got, want), "{x}: {got} vs {want}");
        }
        for x in [4503599627370495.5f64, 2.5, -0.5, 1e300, f64::from_bits(1)] {
            assert!(same64(rint64(x), x.round_ties_even()), "{x}");
        }
    }

    #[test]
    fn header_sizes() {
        assert_eq!(header_bytes(DType::F32), 8);
        assert_eq!(header_bytes(DType::F16), 8);
        assert_eq!(header_bytes(DType::BF16), 8);
        assert_eq!(header_bytes(DType::F64), 16);
        assert_eq!(compressed_len(DType::F32, 1000), 1008);
        assert_eq!(compressed_len(DType::F64, 3), 19);
    }
}
