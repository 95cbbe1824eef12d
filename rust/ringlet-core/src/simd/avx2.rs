//! 8 lanes of float32 in a ymm register (AVX2; float16 also F16C).

use std::arch::x86_64::{
    __m256, __m256i, _mm256_add_epi32, _mm256_add_ps, _mm256_and_si256, _mm256_andnot_si256,
    _mm256_castps_si256, _mm256_castsi256_ps, _mm256_castsi256_si128, _mm256_cmp_ps,
    _mm256_cmpgt_epi32, _mm256_cvtepi32_ps, _mm256_cvtepu16_epi32, _mm256_cvtepu8_epi32,
    _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_cvttps_epi32, _mm256_div_ps, _mm256_extracti128_si256,
    _mm256_max_ps, _mm256_min_ps, _mm256_mul_ps, _mm256_or_si256, _mm256_packs_epi32,
    _mm256_packus_epi16, _mm256_round_ps, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setzero_ps,
    _mm256_setzero_si256, _mm256_slli_epi32, _mm256_srli_epi32, _mm256_sub_ps, _mm_cvtsi128_si64,
    _mm_cvtsi64_si128, _mm_packus_epi32, _mm_unpacklo_epi32, _CMP_UNORD_Q, _MM_FROUND_NO_EXC,
    _MM_FROUND_TO_NEAREST_INT,
};

/// The vector of float32 lanes.
pub(crate) type V = __m256;
/// Lanes per vector.
pub(crate) const L: usize = 8;

#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn splat(x: f32) -> V {
    _mm256_set1_ps(x)
}

#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn zero() -> V {
    _mm256_setzero_ps()
}

#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn add(a: V, b: V) -> V {
    _mm256_add_ps(a, b)
}

#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn sub(a: V, b: V) -> V {
    _mm256_sub_ps(a, b)
}

#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn mul(a: V, b: V) -> V {
    _mm256_mul_ps(a, b)
}

#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn div(a: V, b: V) -> V {
    _mm256_div_ps(a, b)
}

#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn min(a: V, b: V) -> V {
    _mm256_min_ps(a, b)
}

#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn max(a: V, b: V) -> V {
    _mm256_max_ps(a, b)
}

/// Round to nearest even, no exceptions (`rint`).
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn rint(v: V) -> V {
    _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)
}

/// `as u8` of each lane in integer operations: truncation to i32 (NaN,
/// -inf and large negatives become i32::MIN), and the saturating packs take
/// negatives to 0 and values above 255 to 255. They work within 128-bit
/// halves, leaving the eight bytes in bytes 0-3 of each half.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn to_bytes(v: V) -> [u8; L] {
    let i = _mm256_cvttps_epi32(v);
    let b = _mm256_packus_epi16(_mm256_packs_epi32(i, i), _mm256_setzero_si256());
    let b = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
    (_mm_cvtsi128_si64(b) as u64).to_le_bytes()
}

/// Unsigned bytes to float32 lanes.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn from_bytes(b: &[u8; L]) -> V {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(
        *b,
    ))))
}

/// The lanes as an array.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn lanes(v: V) -> [f32; L] {
    bytemuck::cast(v)
}

#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn load_f32(b: &[u8; 4 * L]) -> V {
    bytemuck::cast(*b)
}

#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn store_f32(v: V, b: &mut [u8; 4 * L]) {
    *b = bytemuck::cast(v);
}

/// `vcvtph2ps`: exact, and sets a NaN's quiet bit like `half`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(crate) fn load_f16(b: &[u8; 2 * L]) -> V {
    _mm256_cvtph_ps(bytemuck::cast(*b))
}

/// `vcvtps2ph`, rounding to nearest even (not the MXCSR mode).
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(crate) fn store_f16(v: V, b: &mut [u8; 2 * L]) {
    *b = bytemuck::cast(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
}

/// `v` rounded to float16 and back.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(crate) fn round_f16(v: V) -> V {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
}

/// A plain shift: exact (a signalling NaN stays signalling, which only
/// matters where no float operation follows to quiet it).
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn load_bf16(b: &[u8; 2 * L]) -> V {
    let x = _mm256_cvtepu16_epi32(bytemuck::cast(*b));
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(x))
}

/// bfloat16 -> float32 quieting NaNs, as `half`'s `bf16::to_f32`.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn load_bf16_quiet(b: &[u8; 2 * L]) -> V {
    let x = _mm256_cvtepu16_epi32(bytemuck::cast(*b));
    let abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7fff));
    let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80));
    let quiet = _mm256_or_si256(x, _mm256_and_si256(nan, _mm256_set1_epi32(0x0040)));
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(quiet))
}

/// float32 -> bfloat16 rounding to nearest even (`half`'s
/// `bf16::from_f32`): add the bias `0x7fff + lsb` except for NaNs, which get
/// their quiet bit instead; the result is the high half of each lane (the
/// low half is junk).
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn round_bf16_high(v: V) -> __m256i {
    let x = _mm256_castps_si256(v);
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
    let bias = _mm256_andnot_si256(nan, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    let quiet = _mm256_or_si256(x, _mm256_and_si256(nan, _mm256_set1_epi32(0x0040_0000)));
    _mm256_add_epi32(quiet, bias)
}

#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn store_bf16(v: V, b: &mut [u8; 2 * L]) {
    let top = _mm256_srli_epi32::<16>(round_bf16_high(v));
    *b = bytemuck::cast(_mm_packus_epi32(
        _mm256_castsi256_si128(top),
        _mm256_extracti128_si256::<1>(top),
    ));
}

/// `v` rounded to bfloat16 and back.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn round_bf16(v: V) -> V {
    let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    _mm256_castsi256_ps(_mm256_and_si256(round_bf16_high(v), high))
}
