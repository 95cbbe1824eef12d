//! 16 lanes of float32 in a zmm register (AVX-512F; float16 also F16C).

use std::arch::x86_64::{
    __m512, __m512i, _mm512_add_epi32, _mm512_add_ps, _mm512_and_si512, _mm512_castps_si512,
    _mm512_castsi512_ps, _mm512_cmp_ps_mask, _mm512_cvtepi32_epi16, _mm512_cvtepi32_ps,
    _mm512_cvtepu16_epi32, _mm512_cvtepu8_epi32, _mm512_cvtph_ps, _mm512_cvtps_ph,
    _mm512_cvttps_epi32, _mm512_cvtusepi32_epi8, _mm512_div_ps, _mm512_mask_or_epi32,
    _mm512_max_epi32, _mm512_max_ps, _mm512_min_ps, _mm512_mul_ps, _mm512_or_si512,
    _mm512_roundscale_ps, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps,
    _mm512_setzero_si512, _mm512_slli_epi32, _mm512_srli_epi32, _mm512_sub_ps, _CMP_UNORD_Q,
    _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT,
};

/// The vector of float32 lanes.
pub(crate) type V = __m512;
/// Lanes per vector.
pub(crate) const L: usize = 16;

#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn splat(x: f32) -> V {
    _mm512_set1_ps(x)
}

#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn zero() -> V {
    _mm512_setzero_ps()
}

#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn add(a: V, b: V) -> V {
    _mm512_add_ps(a, b)
}

#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn sub(a: V, b: V) -> V {
    _mm512_sub_ps(a, b)
}

#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn mul(a: V, b: V) -> V {
    _mm512_mul_ps(a, b)
}

#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn div(a: V, b: V) -> V {
    _mm512_div_ps(a, b)
}

#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn min(a: V, b: V) -> V {
    _mm512_min_ps(a, b)
}

#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn max(a: V, b: V) -> V {
    _mm512_max_ps(a, b)
}

/// Round to nearest even, no exceptions (`rint`).
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn rint(v: V) -> V {
    _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)
}

/// `as u8` of each lane in integer operations: truncation to i32 (NaN,
/// -inf and large negatives become i32::MIN), then negatives go to 0 and
/// values above 255 saturate.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn to_bytes(v: V) -> [u8; L] {
    let i = _mm512_cvttps_epi32(v);
    bytemuck::cast(_mm512_cvtusepi32_epi8(_mm512_max_epi32(
        i,
        _mm512_setzero_si512(),
    )))
}

/// Unsigned bytes to float32 lanes.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn from_bytes(b: &[u8; L]) -> V {
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytemuck::cast(*b)))
}

/// The lanes as an array.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn lanes(v: V) -> [f32; L] {
    bytemuck::cast(v)
}

#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn load_f32(b: &[u8; 4 * L]) -> V {
    bytemuck::cast(*b)
}

#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn store_f32(v: V, b: &mut [u8; 4 * L]) {
    *b = bytemuck::cast(v);
}

/// `vcvtph2ps`: exact, and sets a NaN's quiet bit like `half`.
#[target_feature(enable = "avx512f,avx2,f16c")]
#[inline]
pub(crate) fn load_f16(b: &[u8; 2 * L]) -> V {
    _mm512_cvtph_ps(bytemuck::cast(*b))
}

/// `vcvtps2ph`, rounding to nearest even (not the MXCSR mode).
#[target_feature(enable = "avx512f,avx2,f16c")]
#[inline]
pub(crate) fn store_f16(v: V, b: &mut [u8; 2 * L]) {
    *b = bytemuck::cast(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
}

/// `v` rounded to float16 and back.
#[target_feature(enable = "avx512f,avx2,f16c")]
#[inline]
pub(crate) fn round_f16(v: V) -> V {
    _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
}

/// A plain shift: exact (a signalling NaN stays signalling, which only
/// matters where no float operation follows to quiet it).
#[target_feature(enable = "avx512f,avx2")]
#[inline]
pub(crate) fn load_bf16(b: &[u8; 2 * L]) -> V {
    let x = _mm512_cvtepu16_epi32(bytemuck::cast(*b));
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(x))
}

/// float32 -> bfloat16 rounding to nearest even (`half`'s
/// `bf16::from_f32`): add `0x7fff + lsb` unless NaN, whose quiet bit is set
/// instead; the result is the high half of each lane (the low half is junk).
#[target_feature(enable = "avx512f,avx2")]
#[inline]
pub(crate) fn round_bf16_high(v: V) -> __m512i {
    let x = _mm512_castps_si512(v);
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
    let rounded = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    _mm512_mask_or_epi32(rounded, nan, x, _mm512_set1_epi32(0x0040_0000))
}

#[target_feature(enable = "avx512f,avx2")]
#[inline]
pub(crate) fn store_bf16(v: V, b: &mut [u8; 2 * L]) {
    let top = _mm512_srli_epi32::<16>(round_bf16_high(v));
    *b = bytemuck::cast(_mm512_cvtepi32_epi16(top));
}

/// `v` rounded to bfloat16 and back.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
pub(crate) fn round_bf16(v: V) -> V {
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    _mm512_castsi512_ps(_mm512_and_si512(round_bf16_high(v), high))
}

/// bfloat16 -> float32 as plain shifts (as [`load_bf16`]), 32 elements from
/// one 64-byte load: the even-indexed elements are the low halves of the
/// 32-bit lanes (shifted up), the odd ones the high halves (masked). The
/// lane order does not matter to an element-wise operation as long as
/// [`store_bf16_pairs`] undoes it.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
pub(crate) fn load_bf16_pairs(b: &[u8; 4 * L]) -> [V; 2] {
    let x: __m512i = bytemuck::cast(*b);
    let even = _mm512_slli_epi32::<16>(x);
    let odd = _mm512_and_si512(x, _mm512_set1_epi32(0xffff_0000_u32 as i32));
    bytemuck::cast([even, odd])
}

/// Inverse of [`load_bf16_pairs`], rounding as [`store_bf16`].
#[target_feature(enable = "avx512f,avx2")]
#[inline]
pub(crate) fn store_bf16_pairs(v: [V; 2], b: &mut [u8; 4 * L]) {
    let [even, odd] = v;
    let even = _mm512_srli_epi32::<16>(round_bf16_high(even));
    let odd = _mm512_and_si512(
        round_bf16_high(odd),
        _mm512_set1_epi32(0xffff_0000_u32 as i32),
    );
    *b = bytemuck::cast(_mm512_or_si512(even, odd));
}
