//! The x86 SIMD layer: one module per instruction set, each holding the
//! vector of float32 lanes (`V`, `L` lanes) and the same set of safe
//! `#[target_feature]` functions over it (arithmetic, rounding, and the
//! loads, stores and round trips of float32, float16 and bfloat16 groups).
//! The reductions of float16/bfloat16 (`reduce::half_simd`) and the
//! MinMaxUInt8 codec (`algorithms::codec`) are written over these names, so
//! each conversion exists once per instruction set; the codec's kernels are
//! generated for both sets from one description (`codec::kernels`).
//!
//! Every function names the features it needs and no more (the bfloat16
//! ones need no F16C), so it can be called without `unsafe` and is inlined
//! from any function compiled with at least those features. Callers check
//! the features with [`has_avx2`], [`has_f16c`] or [`has_avx512`] before
//! their one `unsafe` call into such a function.
//!
//! Conversions give bit for bit the results of the `half` crate's scalar
//! `to_f32` / `from_f32` (round to nearest even; a NaN keeps its sign and
//! top payload bits and gets its quiet bit), except where a function says
//! it is a plain shift (exact, a signalling NaN stays signalling).

#![cfg(target_arch = "x86_64")]

pub(crate) mod avx2;
pub(crate) mod avx512;

/// Whether this CPU has AVX2.
pub(crate) fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
}

/// Whether this CPU has AVX2 and F16C.
pub(crate) fn has_f16c() -> bool {
    has_avx2() && is_x86_feature_detected!("f16c")
}

/// Whether this CPU has AVX-512F, AVX2 and F16C.
pub(crate) fn has_avx512() -> bool {
    is_x86_feature_detected!("avx512f") && has_f16c()
}
