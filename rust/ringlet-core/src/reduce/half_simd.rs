//! float16/bfloat16 reduction and conversions at memory speed.
//!
//! Every conversion gives bit for bit the results of the `half` crate's scalar
//! `to_f32`/`from_f32` (the exhaustive tests below check it): widening is
//! exact and quiets signalling NaNs, narrowing rounds to nearest even,
//! overflows to infinity and keeps a NaN's sign and top payload bits, setting
//! its quiet bit.
//!
//! The reduction works on groups of 8 elements: each group of the destination
//! and of every source is widened to float32 in registers, folded with the
//! same lane operation (and in the same source order) as the float32 kernel,
//! and rounded once back into the destination, so each byte is read and
//! written once and nothing goes through a scratch buffer.
//!
//! The portable lane conversions are branch-free `u32` code that the compiler
//! vectorises. On x86_64 the float16 conversions use F16C
//! (`vcvtph2ps`/`vcvtps2ph`) and the bfloat16 ones the portable code, both in
//! functions compiled for AVX2 and chosen at run time; the only `unsafe` in
//! the module is calling those after the feature check.

use half::{bf16, f16};

/// Elements per group: one AVX register of float32.
pub(crate) const LANES: usize = 8;

type Wide = [f32; LANES];
type Narrow = [u16; LANES];

/// `dst = dst ⊕ srcs[0] ⊕ srcs[1] ⊕ ...` over float16, in float32, with `op`
/// one of the float lane operations (`a + b`, `a * b`, min, max). Every
/// source must be at least as long as `dst`.
#[inline(always)]
pub(crate) fn reduce_f16(dst: &mut [f16], srcs: &[&[f16]], op: impl Fn(f32, f32) -> f32 + Copy) {
    #[cfg(target_arch = "x86_64")]
    if x86::has_f16c() {
        // SAFETY: `has_f16c` checked that this CPU has AVX2 and F16C, the
        // features `x86::reduce_f16` is compiled for.
        return unsafe { x86::reduce_f16(dst, srcs, op) };
    }
    fold(dst, srcs, op, portable::widen8_f16, portable::narrow8_f16)
}

/// As [`reduce_f16`], over bfloat16.
#[inline(always)]
pub(crate) fn reduce_bf16(dst: &mut [bf16], srcs: &[&[bf16]], op: impl Fn(f32, f32) -> f32 + Copy) {
    #[cfg(target_arch = "x86_64")]
    if x86::has_avx2() {
        // SAFETY: `has_avx2` checked that this CPU has AVX2, the feature
        // `x86::reduce_bf16` is compiled for.
        return unsafe { x86::reduce_bf16(dst, srcs, op) };
    }
    fold(
        dst,
        srcs,
        op,
        portable::widen8_bf16_for_fold,
        portable::narrow8_bf16,
    )
}

/// float16 -> float32 of `min(src.len(), dst.len())` elements.
pub(crate) fn widen_f16(src: &[f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if x86::has_f16c() {
        // SAFETY: `has_f16c` checked that this CPU has AVX2 and F16C, the
        // features `x86::widen_f16` is compiled for.
        return unsafe { x86::widen_f16(src, dst) };
    }
    widen(src, dst, portable::widen8_f16)
}

/// float32 -> float16 of `min(src.len(), dst.len())` elements, round to
/// nearest even.
pub(crate) fn narrow_f16(src: &[f32], dst: &mut [f16]) {
    #[cfg(target_arch = "x86_64")]
    if x86::has_f16c() {
        // SAFETY: `has_f16c` checked that this CPU has AVX2 and F16C, the
        // features `x86::narrow_f16` is compiled for.
        return unsafe { x86::narrow_f16(src, dst) };
    }
    narrow(src, dst, portable::narrow8_f16)
}

/// bfloat16 -> float32 of `min(src.len(), dst.len())` elements.
pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if x86::has_avx2() {
        // SAFETY: `has_avx2` checked that this CPU has AVX2, the feature
        // `x86::widen_bf16` is compiled for.
        return unsafe { x86::widen_bf16(src, dst) };
    }
    widen(src, dst, portable::widen8_bf16)
}

/// float32 -> bfloat16 of `min(src.len(), dst.len())` elements, round to
/// nearest even.
pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    #[cfg(target_arch = "x86_64")]
    if x86::has_avx2() {
        // SAFETY: `has_avx2` checked that this CPU has AVX2, the feature
        // `x86::narrow_bf16` is compiled for.
        return unsafe { x86::narrow_bf16(src, dst) };
    }
    narrow(src, dst, portable::narrow8_bf16)
}

/// Copies up to 8 elements into a zero-padded group.
#[inline(always)]
fn pad<T: Copy + Default>(tail: &[T]) -> [T; LANES] {
    let mut group = [T::default(); LANES];
    group[..tail.len()].copy_from_slice(tail);
    group
}

/// The reduction over groups of 8, given the group conversions. Inlined into
/// each caller, so it is compiled for that caller's target features.
///
/// Up to three sources are folded in registers (one read of every input, one
/// write of the destination); more go through a 4 KiB float32 accumulator in
/// L1, one source at a time. Either way each element sees the same operations
/// in the same order: `((d op s0) op s1) op ...`, then one rounding.
#[inline(always)]
pub(crate) fn fold<H: bytemuck::Pod>(
    dst: &mut [H],
    srcs: &[&[H]],
    op: impl Fn(f32, f32) -> f32 + Copy,
    widen8: impl Fn(Narrow) -> Wide + Copy,
    narrow8: impl Fn(Wide) -> Narrow + Copy,
) {
    let dst: &mut [u16] = bytemuck::cast_slice_mut(dst);
    let srcs: Vec<&[u16]> = srcs
        .iter()
        .map(|s| &bytemuck::cast_slice(s)[..dst.len()])
        .collect();
    let whole = dst.len() / LANES * LANES;
    let (body, tail) = dst.split_at_mut(whole);
    let body: &mut [Narrow] = bytemuck::cast_slice_mut(body);
    match srcs.as_slice() {
        [] => fold_fused(body, [], op, widen8, narrow8),
        [a] => fold_fused(body, [groups(a, whole)], op, widen8, narrow8),
        [a, b] => fold_fused(
            body,
            [groups(a, whole), groups(b, whole)],
            op,
            widen8,
            narrow8,
        ),
        [a, b, c] => fold_fused(
            body,
            [groups(a, whole), groups(b, whole), groups(c, whole)],
            op,
            widen8,
            narrow8,
        ),
        many => {
            let groups: Vec<&[Narrow]> = many.iter().map(|s| groups(s, whole)).collect();
            fold_blocked(body, &groups, op, widen8, narrow8)
        }
    }
    if !tail.is_empty() {
        let mut acc = widen8(pad(tail));
        for s in &srcs {
            apply(&mut acc, widen8(pad(&s[whole..])), op);
        }
        let n = tail.len();
        tail.copy_from_slice(&narrow8(acc)[..n]);
    }
}

/// The first `whole` (a multiple of 8) elements as groups.
#[inline(always)]
fn groups(s: &[u16], whole: usize) -> &[Narrow] {
    bytemuck::cast_slice(&s[..whole])
}

#[inline(always)]
fn apply(acc: &mut Wide, b: Wide, op: impl Fn(f32, f32) -> f32) {
    for (a, b) in acc.iter_mut().zip(b) {
        *a = op(*a, b);
    }
}

#[inline(always)]
fn fold_fused<const K: usize>(
    body: &mut [Narrow],
    srcs: [&[Narrow]; K],
    op: impl Fn(f32, f32) -> f32 + Copy,
    widen8: impl Fn(Narrow) -> Wide,
    narrow8: impl Fn(Wide) -> Narrow,
) {
    // Same lengths as `body`, so the indexing below needs no bounds checks.
    let srcs = srcs.map(|s| &s[..body.len()]);
    for (i, d) in body.iter_mut().enumerate() {
        let mut acc = widen8(*d);
        for s in &srcs {
            apply(&mut acc, widen8(s[i]), op);
        }
        *d = narrow8(acc);
    }
}

#[inline(always)]
fn fold_blocked(
    body: &mut [Narrow],
    srcs: &[&[Narrow]],
    op: impl Fn(f32, f32) -> f32 + Copy,
    widen8: impl Fn(Narrow) -> Wide + Copy,
    narrow8: impl Fn(Wide) -> Narrow,
) {
    const BLOCK: usize = 128; // groups: 1024 elements, 4 KiB of float32
    let mut acc = [[0f32; LANES]; BLOCK];
    for (b, d) in body.chunks_mut(BLOCK).enumerate() {
        let start = b * BLOCK;
        let acc = &mut acc[..d.len()];
        for (a, d) in acc.iter_mut().zip(d.iter()) {
            *a = widen8(*d);
        }
        for s in srcs {
            for (a, s) in acc.iter_mut().zip(&s[start..start + d.len()]) {
                apply(a, widen8(*s), op);
            }
        }
        for (d, a) in d.iter_mut().zip(acc.iter()) {
            *d = narrow8(*a);
        }
    }
}

#[inline(always)]
fn widen<H: bytemuck::Pod>(src: &[H], dst: &mut [f32], widen8: impl Fn(Narrow) -> Wide) {
    let n = src.len().min(dst.len());
    let whole = n / LANES * LANES;
    let src: &[u16] = bytemuck::cast_slice(&src[..n]);
    let (body, tail) = dst[..n].split_at_mut(whole);
    let groups: &[Narrow] = bytemuck::cast_slice(&src[..whole]);
    for (d, s) in bytemuck::cast_slice_mut::<f32, Wide>(body)
        .iter_mut()
        .zip(groups)
    {
        *d = widen8(*s);
    }
    let k = tail.len();
    tail.copy_from_slice(&widen8(pad(&src[whole..]))[..k]);
}

#[inline(always)]
fn narrow<H: bytemuck::Pod>(src: &[f32], dst: &mut [H], narrow8: impl Fn(Wide) -> Narrow) {
    let n = src.len().min(dst.len());
    let whole = n / LANES * LANES;
    let dst: &mut [u16] = bytemuck::cast_slice_mut(&mut dst[..n]);
    let (body, tail) = dst.split_at_mut(whole);
    let groups: &[Wide] = bytemuck::cast_slice(&src[..whole]);
    for (d, s) in bytemuck::cast_slice_mut::<u16, Narrow>(body)
        .iter_mut()
        .zip(groups)
    {
        *d = narrow8(*s);
    }
    let k = tail.len();
    tail.copy_from_slice(&narrow8(pad(&src[whole..n]))[..k]);
}

/// Portable lane functions and the group conversions over them.
pub(crate) mod portable {
    use super::{Narrow, Wide};

    /// float16 bits -> float32 bits.
    #[inline(always)]
    pub(crate) fn f16_to_f32_bits(h: u16) -> u32 {
        let h = u32::from(h);
        let sign = (h & 0x8000) << 16;
        let em = (h & 0x7fff) as i32; // exponent and mantissa
                                      // Normal: rebias the exponent from 15 to 127.
        let normal = ((em << 13) + (112 << 23)) as u32;
        // Infinity or NaN: all exponent bits set; a NaN gets its quiet bit.
        let quiet = if em > 0x7c00 { 0x0040_0000 } else { 0 };
        let special = (em << 13) as u32 | 0x7f80_0000 | quiet;
        // Zero or subnormal: mantissa x 2^-24, exact in float32.
        let sub = (em as f32 * (1.0 / 16_777_216.0)).to_bits();
        let mag = if em >= 0x7c00 {
            special
        } else if em < 0x0400 {
            sub
        } else {
            normal
        };
        mag | sign
    }

    /// float32 bits -> float16 bits, round to nearest even.
    #[inline(always)]
    pub(crate) fn f32_to_f16_bits(x: u32) -> u16 {
        let sign = (x >> 16) & 0x8000;
        let a = (x & 0x7fff_ffff) as i32; // magnitude
                                          // NaN: keep the top 10 payload bits and set the quiet bit.
        let nan = 0x7e00 | ((a >> 13) as u32 & 0x03ff);
        // Normal: rebias the exponent, round to nearest even with the bias trick
        // (a carry out of the mantissa bumps the exponent, up to infinity).
        let lsb = (a >> 13) & 1;
        let normal = ((a - (112 << 23) + 0x0fff + lsb) >> 13) as u32;
        // Subnormal or zero: adding 0.5 (whose ulp is 2^-24, the float16
        // subnormal step) rounds to nearest even in the float unit; the
        // mantissa of the sum is the float16 encoding (0x400 = smallest normal).
        let sub = (f32::from_bits(a as u32) + 0.5).to_bits() - 0x3f00_0000;
        let mag = if a > 0x7f80_0000 {
            nan
        } else if a >= 0x4780_0000 {
            0x7c00 // >= 2^16: infinity
        } else if a >= 0x3880_0000 {
            normal // >= 2^-14
        } else {
            sub
        };
        (mag | sign) as u16
    }

    /// bfloat16 bits -> float32 bits.
    #[inline(always)]
    pub(crate) fn bf16_to_f32_bits(h: u16) -> u32 {
        let h = u32::from(h);
        let quiet = if h & 0x7fff > 0x7f80 { 0x0040 } else { 0 };
        (h | quiet) << 16
    }

    /// float32 bits -> bfloat16 bits, round to nearest even.
    #[inline(always)]
    pub(crate) fn f32_to_bf16_bits(x: u32) -> u16 {
        let nan = (x >> 16) | 0x0040;
        let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
        (if f32::from_bits(x).is_nan() {
            nan
        } else {
            rounded
        }) as u16
    }

    #[inline(always)]
    fn map_widen(h: Narrow, f: impl Fn(u16) -> u32) -> Wide {
        let mut out = [0f32; super::LANES];
        for (o, h) in out.iter_mut().zip(h) {
            *o = f32::from_bits(f(h));
        }
        out
    }

    #[inline(always)]
    fn map_narrow(x: Wide, f: impl Fn(u32) -> u16) -> Narrow {
        let mut out = [0u16; super::LANES];
        for (o, x) in out.iter_mut().zip(x) {
            *o = f(x.to_bits());
        }
        out
    }

    #[inline(always)]
    pub(crate) fn widen8_f16(h: Narrow) -> Wide {
        map_widen(h, f16_to_f32_bits)
    }

    #[inline(always)]
    pub(crate) fn narrow8_f16(x: Wide) -> Narrow {
        map_narrow(x, f32_to_f16_bits)
    }

    #[inline(always)]
    pub(crate) fn widen8_bf16(h: Narrow) -> Wide {
        map_widen(h, bf16_to_f32_bits)
    }

    /// bfloat16 -> float32 for the reduction only: a plain shift, which
    /// leaves a signalling NaN signalling. The result is the same as with
    /// [`widen8_bf16`]: float arithmetic returns a NaN operand quieted, min
    /// and max pass it through unchanged, and [`narrow8_bf16`] sets the quiet
    /// bit of any NaN, so the bits that reach memory do not change.
    #[inline(always)]
    pub(crate) fn widen8_bf16_for_fold(h: Narrow) -> Wide {
        map_widen(h, |h| u32::from(h) << 16)
    }

    #[inline(always)]
    pub(crate) fn narrow8_bf16(x: Wide) -> Narrow {
        map_narrow(x, f32_to_bf16_bits)
    }

    /// The portable slice conversions (for tests and other targets).
    #[cfg(test)]
    pub(crate) mod slices {
        use half::{bf16, f16};

        pub(crate) fn widen_f16(src: &[f16], dst: &mut [f32]) {
            super::super::widen(src, dst, super::widen8_f16)
        }
        pub(crate) fn narrow_f16(src: &[f32], dst: &mut [f16]) {
            super::super::narrow(src, dst, super::narrow8_f16)
        }
        pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
            super::super::widen(src, dst, super::widen8_bf16)
        }
        pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
            super::super::narrow(src, dst, super::narrow8_bf16)
        }
    }
}

/// x86_64 versions: the same loops compiled for AVX2, with the group
/// conversions written with intrinsics (F16C for float16) so that the
/// compiler keeps one group per vector register.
/// These are safe functions with target features; callers must check the
/// features first (the `unsafe` at each call).
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{Narrow, Wide};
    use half::{bf16, f16};
    use std::arch::x86_64::{
        __m128i, __m256, __m256i, _mm256_add_epi32, _mm256_and_si256, _mm256_andnot_si256,
        _mm256_castps_si256, _mm256_castsi256_si128, _mm256_cmp_ps, _mm256_cmpgt_epi32,
        _mm256_cvtepu16_epi32, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_extracti128_si256,
        _mm256_or_si256, _mm256_set1_epi32, _mm256_slli_epi32, _mm256_srli_epi32, _mm_packus_epi32,
        _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT,
    };

    pub(crate) fn has_f16c() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
    }

    pub(crate) fn has_avx2() -> bool {
        is_x86_feature_detected!("avx2")
    }

    /// `vcvtph2ps`: exact, and sets a NaN's quiet bit like `half`.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn widen8_f16(h: Narrow) -> Wide {
        bytemuck::cast(_mm256_cvtph_ps(bytemuck::cast::<Narrow, __m128i>(h)))
    }

    /// `vcvtps2ph` rounding to nearest even (not the MXCSR mode).
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn narrow8_f16(x: Wide) -> Narrow {
        bytemuck::cast(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(
            bytemuck::cast::<Wide, __m256>(x),
        ))
    }

    /// bfloat16 -> float32, quieting NaNs (as `portable::bf16_to_f32_bits`).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn widen8_bf16(h: Narrow) -> Wide {
        let x = _mm256_cvtepu16_epi32(bytemuck::cast::<Narrow, __m128i>(h));
        let abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7fff));
        let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80));
        let quiet = _mm256_or_si256(x, _mm256_and_si256(nan, _mm256_set1_epi32(0x0040)));
        bytemuck::cast(_mm256_slli_epi32::<16>(quiet))
    }

    /// bfloat16 -> float32 for the reduction: a plain shift (see
    /// `portable::widen8_bf16_for_fold`).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn widen8_bf16_for_fold(h: Narrow) -> Wide {
        let x = _mm256_cvtepu16_epi32(bytemuck::cast::<Narrow, __m128i>(h));
        bytemuck::cast(_mm256_slli_epi32::<16>(x))
    }

    /// float32 -> bfloat16 as `portable::f32_to_bf16_bits`: add the rounding
    /// bias `0x7fff + lsb` (round to nearest even) except for NaNs, which get
    /// their quiet bit instead, then keep the top half.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn narrow8_bf16(x: Wide) -> Narrow {
        let v: __m256 = bytemuck::cast(x);
        let x: __m256i = _mm256_castps_si256(v);
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
        let bias = _mm256_andnot_si256(nan, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
        let quiet = _mm256_or_si256(x, _mm256_and_si256(nan, _mm256_set1_epi32(0x0040_0000)));
        let top = _mm256_srli_epi32::<16>(_mm256_add_epi32(quiet, bias));
        bytemuck::cast(_mm_packus_epi32(
            _mm256_castsi256_si128(top),
            _mm256_extracti128_si256::<1>(top),
        ))
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(crate) fn reduce_f16(
        dst: &mut [f16],
        srcs: &[&[f16]],
        op: impl Fn(f32, f32) -> f32 + Copy,
    ) {
        super::fold(dst, srcs, op, |h| widen8_f16(h), |x| narrow8_f16(x))
    }

    #[target_feature(enable = "avx2")]
    pub(crate) fn reduce_bf16(
        dst: &mut [bf16],
        srcs: &[&[bf16]],
        op: impl Fn(f32, f32) -> f32 + Copy,
    ) {
        super::fold(
            dst,
            srcs,
            op,
            |h| widen8_bf16_for_fold(h),
            |x| narrow8_bf16(x),
        )
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(crate) fn widen_f16(src: &[f16], dst: &mut [f32]) {
        super::widen(src, dst, |h| widen8_f16(h))
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(crate) fn narrow_f16(src: &[f32], dst: &mut [f16]) {
        super::narrow(src, dst, |x| narrow8_f16(x))
    }

    #[target_feature(enable = "avx2")]
    pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
        super::widen(src, dst, |h| widen8_bf16(h))
    }

    #[target_feature(enable = "avx2")]
    pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
        super::narrow(src, dst, |x| narrow8_bf16(x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slice conversion under test, by name.
    type Widen<H> = (&'static str, fn(&[H], &mut [f32]));
    type Narrow<H> = (&'static str, fn(&[f32], &mut [H]));

    fn f16_widens() -> Vec<Widen<f16>> {
        #[allow(unused_mut)]
        let mut v: Vec<Widen<f16>> = vec![
            ("dispatched", widen_f16),
            ("portable", portable::slices::widen_f16),
        ];
        #[cfg(target_arch = "x86_64")]
        if x86::has_f16c() {
            // SAFETY: AVX2 and F16C were just detected.
            v.push(("f16c", |s, d| unsafe { x86::widen_f16(s, d) }));
        }
        v
    }

    fn f16_narrows() -> Vec<Narrow<f16>> {
        #[allow(unused_mut)]
        let mut v: Vec<Narrow<f16>> = vec![
            ("dispatched", narrow_f16),
            ("portable", portable::slices::narrow_f16),
        ];
        #[cfg(target_arch = "x86_64")]
        if x86::has_f16c() {
            // SAFETY: AVX2 and F16C were just detected.
            v.push(("f16c", |s, d| unsafe { x86::narrow_f16(s, d) }));
        }
        v
    }

    fn bf16_widens() -> Vec<Widen<bf16>> {
        #[allow(unused_mut)]
        let mut v: Vec<Widen<bf16>> = vec![
            ("dispatched", widen_bf16),
            ("portable", portable::slices::widen_bf16),
        ];
        #[cfg(target_arch = "x86_64")]
        if x86::has_avx2() {
            // SAFETY: AVX2 was just detected.
            v.push(("avx2", |s, d| unsafe { x86::widen_bf16(s, d) }));
        }
        v
    }

    fn bf16_narrows() -> Vec<Narrow<bf16>> {
        #[allow(unused_mut)]
        let mut v: Vec<Narrow<bf16>> = vec![
            ("dispatched", narrow_bf16),
            ("portable", portable::slices::narrow_bf16),
        ];
        #[cfg(target_arch = "x86_64")]
        if x86::has_avx2() {
            // SAFETY: AVX2 was just detected.
            v.push(("avx2", |s, d| unsafe { x86::narrow_bf16(s, d) }));
        }
        v
    }

    /// xorshift64*: reproducible bit patterns without a dependency.
    fn random_bits(n: usize, mut state: u64) -> Vec<u32> {
        (0..n)
            .map(|_| {
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32
            })
            .collect()
    }

    /// float32 values that probe every narrowing path of both formats.
    fn narrowing_inputs() -> Vec<f32> {
        let mut bits = random_bits(1 << 20, 0x9e37_79b9_7f4a_7c15);
        // Around every float16 value (widened), the midpoints to its
        // neighbours (ties to even) and one float32 ulp either side of them;
        // this covers float16 subnormals, the largest finite values and the
        // overflow to infinity at 65520.
        for h in 0..=u16::MAX {
            let x = f16::from_bits(h).to_f32_const().to_bits();
            let next = f16::from_bits(h.wrapping_add(1)).to_f32_const().to_bits();
            let mid = x.wrapping_add(next.wrapping_sub(x) / 2);
            bits.extend([x, x ^ 1, mid.wrapping_sub(1), mid, mid.wrapping_add(1)]);
        }
        // bfloat16: every upper half with the lower half at each rounding case.
        for h in (0..=u16::MAX).step_by(7) {
            let x = u32::from(h) << 16;
            bits.extend([x, x | 1, x | 0x7fff, x | 0x8000, x | 0x8001, x | 0xffff]);
        }
        // float32 subnormals, zeros, infinities, NaNs (quiet and signalling,
        // with payloads in the low and high bits), extremes.
        for sign in [0, 0x8000_0000u32] {
            bits.extend(
                [
                    0,
                    1,
                    2,
                    0x0000_1000,
                    0x007f_ffff,
                    0x0080_0000,
                    0x3380_0000, // 2^-24: smallest float16 subnormal
                    0x3300_0000, // 2^-25: ties to zero
                    0x3300_0001,
                    0x387f_ffff,
                    0x3880_0000, // 2^-14: smallest float16 normal
                    0x477f_e000, // 65504: largest float16
                    0x477f_efff,
                    0x477f_f000, // 65520: rounds to infinity
                    0x4780_0000,
                    0x7f7f_ffff, // largest float32: bfloat16 rounds to infinity
                    0x7f7f_7fff,
                    0x7f80_0000,
                    0x7f80_0001,
                    0x7f80_1000,
                    0x7f80_2000,
                    0x7fa0_0000,
                    0x7fbf_ffff,
                    0x7fc0_0000,
                    0x7fc0_0001,
                    0x7fff_ffff,
                ]
                .map(|b| b | sign),
            );
        }
        bits.into_iter().map(f32::from_bits).collect()
    }

    #[test]
    fn widening_matches_half_for_every_pattern() {
        let f16s: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let bf16s: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        for (i, h) in f16s.iter().enumerate() {
            assert_eq!(
                h.to_f32().to_bits(),
                h.to_f32_const().to_bits(),
                "half's own paths differ at {i:#x}"
            );
        }
        // Odd lengths and offsets exercise the tails of the 8-lane loops.
        for (off, len) in [(0, 65536), (3, 65533), (0, 13)] {
            for (name, widen) in f16_widens() {
                let mut got = vec![0f32; len];
                widen(&f16s[off..off + len], &mut got);
                for (h, g) in f16s[off..].iter().zip(&got) {
                    assert_eq!(
                        g.to_bits(),
                        h.to_f32().to_bits(),
                        "f16 {name} {:#x}",
                        h.to_bits()
                    );
                }
            }
            for (name, widen) in bf16_widens() {
                let mut got = vec![0f32; len];
                widen(&bf16s[off..off + len], &mut got);
                for (h, g) in bf16s[off..].iter().zip(&got) {
                    assert_eq!(
                        g.to_bits(),
                        h.to_f32().to_bits(),
                        "bf16 {name} {:#x}",
                        h.to_bits()
                    );
                }
            }
        }
    }

    #[test]
    fn narrowing_matches_half() {
        let xs = narrowing_inputs();
        let want16: Vec<u16> = xs.iter().map(|x| f16::from_f32(*x).to_bits()).collect();
        let want_bf: Vec<u16> = xs.iter().map(|x| bf16::from_f32(*x).to_bits()).collect();
        for (x, w) in xs.iter().zip(&want16) {
            assert_eq!(
                f16::from_f32_const(*x).to_bits(),
                *w,
                "half's own paths differ"
            );
        }
        for off in [0, 5] {
            let xs = &xs[off..];
            for (name, narrow) in f16_narrows() {
                let mut got = vec![f16::ZERO; xs.len()];
                narrow(xs, &mut got);
                for ((x, g), w) in xs.iter().zip(&got).zip(&want16[off..]) {
                    assert_eq!(g.to_bits(), *w, "f16 {name} {:#010x}", x.to_bits());
                }
            }
            for (name, narrow) in bf16_narrows() {
                let mut got = vec![bf16::ZERO; xs.len()];
                narrow(xs, &mut got);
                for ((x, g), w) in xs.iter().zip(&got).zip(&want_bf[off..]) {
                    assert_eq!(g.to_bits(), *w, "bf16 {name} {:#010x}", x.to_bits());
                }
            }
        }
    }

    #[test]
    fn converts_the_shorter_length() {
        let src = [f16::ONE; 20];
        let mut dst = [0f32; 11];
        widen_f16(&src, &mut dst);
        assert!(dst.iter().all(|v| *v == 1.0));
        let mut out = [f16::ZERO; 20];
        narrow_f16(&dst, &mut out);
        assert!(
            out[..11].iter().all(|v| *v == f16::ONE) && out[11..].iter().all(|v| *v == f16::ZERO)
        );
        let mut out = [bf16::ZERO; 5];
        narrow_bf16(&dst, &mut out);
        assert!(out.iter().all(|v| *v == bf16::ONE));
    }
}
