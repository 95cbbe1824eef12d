//! Block conversions between float16/bfloat16 and float32 at memory speed.
//!
//! Every function gives bit for bit the results of the `half` crate's scalar
//! `to_f32`/`from_f32` (which the exhaustive tests below check): widening is
//! exact and quiets signalling NaNs, narrowing rounds to nearest even,
//! overflows to infinity and keeps a NaN's sign and top payload bits, setting
//! its quiet bit.
//!
//! The portable versions are branch-free lane functions over `u32` that the
//! compiler vectorises. On x86_64 the float16 conversions use F16C
//! (`vcvtph2ps`/`vcvtps2ph`, 8 lanes) and the bfloat16 ones the portable code
//! compiled for AVX2, both chosen at run time; the only `unsafe` in the module
//! is those run-time dispatches.
//!
//! Each function converts `min(src.len(), dst.len())` elements.

use half::{bf16, f16};

/// float16 -> float32.
pub(crate) fn widen_f16(src: &[f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if x86::has_f16c() {
        // SAFETY: `has_f16c` checked that this CPU has AVX2 and F16C, the only
        // requirement of `x86::widen_f16`.
        return unsafe { x86::widen_f16(src, dst) };
    }
    portable::widen_f16(src, dst)
}

/// float32 -> float16, round to nearest even.
pub(crate) fn narrow_f16(src: &[f32], dst: &mut [f16]) {
    #[cfg(target_arch = "x86_64")]
    if x86::has_f16c() {
        // SAFETY: `has_f16c` checked that this CPU has AVX2 and F16C, the only
        // requirement of `x86::narrow_f16`.
        return unsafe { x86::narrow_f16(src, dst) };
    }
    portable::narrow_f16(src, dst)
}

/// bfloat16 -> float32.
pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if x86::has_avx2() {
        // SAFETY: `has_avx2` checked that this CPU has AVX2, the only
        // requirement of `x86::widen_bf16`.
        return unsafe { x86::widen_bf16(src, dst) };
    }
    portable::widen_bf16(src, dst)
}

/// float32 -> bfloat16, round to nearest even.
pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    #[cfg(target_arch = "x86_64")]
    if x86::has_avx2() {
        // SAFETY: `has_avx2` checked that this CPU has AVX2, the only
        // requirement of `x86::narrow_bf16`.
        return unsafe { x86::narrow_bf16(src, dst) };
    }
    portable::narrow_bf16(src, dst)
}

/// Portable lane functions and the slice loops over them.
pub(crate) mod portable {
    use half::{bf16, f16};

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
        (if x & 0x7fff_ffff > 0x7f80_0000 {
            nan
        } else {
            rounded
        }) as u16
    }

    #[inline(always)]
    pub(crate) fn widen_f16(src: &[f16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(f16_to_f32_bits(s.to_bits()));
        }
    }

    #[inline(always)]
    pub(crate) fn narrow_f16(src: &[f32], dst: &mut [f16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f16::from_bits(f32_to_f16_bits(s.to_bits()));
        }
    }

    #[inline(always)]
    pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(bf16_to_f32_bits(s.to_bits()));
        }
    }

    #[inline(always)]
    pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(f32_to_bf16_bits(s.to_bits()));
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use half::{bf16, f16};
    use std::arch::x86_64::{
        __m128i, __m256, _mm256_cvtph_ps, _mm256_cvtps_ph, _MM_FROUND_TO_NEAREST_INT,
    };

    /// Lanes per F16C conversion.
    const LANES: usize = 8;

    pub(crate) fn has_f16c() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
    }

    pub(crate) fn has_avx2() -> bool {
        is_x86_feature_detected!("avx2")
    }

    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) unsafe fn widen_f16(src: &[f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let whole = n / LANES * LANES;
        let (src, src_tail) = src[..n].split_at(whole);
        let (dst, dst_tail) = dst[..n].split_at_mut(whole);
        let src: &[[u16; LANES]] = bytemuck::cast_slice(src);
        let dst: &mut [[f32; LANES]] = bytemuck::cast_slice_mut(dst);
        for (d, s) in dst.iter_mut().zip(src) {
            let v: __m256 = _mm256_cvtph_ps(bytemuck::cast::<_, __m128i>(*s));
            *d = bytemuck::cast(v);
        }
        // The last few: vcvtph2ps sets a NaN's quiet bit, as the portable code does.
        super::portable::widen_f16(src_tail, dst_tail);
    }

    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) unsafe fn narrow_f16(src: &[f32], dst: &mut [f16]) {
        let n = src.len().min(dst.len());
        let whole = n / LANES * LANES;
        let (src, src_tail) = src[..n].split_at(whole);
        let (dst, dst_tail) = dst[..n].split_at_mut(whole);
        let src: &[[f32; LANES]] = bytemuck::cast_slice(src);
        let dst: &mut [[u16; LANES]] = bytemuck::cast_slice_mut(dst);
        for (d, s) in dst.iter_mut().zip(src) {
            let v: __m128i =
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(bytemuck::cast::<_, __m256>(*s));
            *d = bytemuck::cast(v);
        }
        super::portable::narrow_f16(src_tail, dst_tail);
    }

    /// The portable loop compiled for AVX2 (8 lanes).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
        super::portable::widen_bf16(src, dst)
    }

    /// The portable loop compiled for AVX2 (8 lanes).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
        super::portable::narrow_bf16(src, dst)
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
            ("portable", |s, d| portable::widen_f16(s, d)),
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
            ("portable", |s, d| portable::narrow_f16(s, d)),
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
            ("portable", |s, d| portable::widen_bf16(s, d)),
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
            ("portable", |s, d| portable::narrow_bf16(s, d)),
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
