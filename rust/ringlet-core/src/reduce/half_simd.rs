//! float16/bfloat16 reduction and conversions at memory speed.
//!
//! Every conversion gives bit for bit the results of the `half` crate's scalar
//! `to_f32`/`from_f32` (the exhaustive tests below check it): widening is
//! exact and quiets signalling NaNs, narrowing rounds to nearest even,
//! overflows to infinity and keeps a NaN's sign and top payload bits, setting
//! its quiet bit.
//!
//! The reduction ([`fold`]) works on groups of one vector register of
//! float32: each group of the destination and of every source is widened in
//! registers, folded with the float32 kernel's lane operation in source
//! order, and rounded once back into the destination, so each byte is read
//! and written once and nothing goes through a scratch buffer (beyond three
//! sources, through a 4 KiB accumulator in L1).
//!
//! The same fold also computes `dst = first ⊕ srcs[0] ⊕ ...` (`reduce_into`):
//! each accumulator then starts from `first`'s group widened instead of the
//! destination's, and the destination is only written. That is exactly what
//! copying `first` into the destination and folding in place computes (the
//! same widening of the same bits, then the same operations in the same
//! order), without writing the destination and reading it back: three
//! passes over memory instead of five for two sources (the float32 and
//! integer kernels have the same fused first pair).
//!
//! Variants, chosen at run time (`is_x86_feature_detected!`), same results:
//! * AVX-512F: float16 with `vcvtph2ps`/`vcvtps2ph` on 16 lanes; bfloat16 as
//!   integer shifts and the rounding bias, 32 elements per 64-byte load.
//! * AVX2 + F16C: the same on 8 lanes.
//! * portable, for other CPUs: branch-free `u32` lane functions in plain
//!   loops over blocks of 1024 elements (destination and one source widened
//!   into 4 KiB float32 buffers), which the compiler vectorises for the
//!   target (SSE2 on baseline x86-64: about 3x the old float16 kernel, the
//!   same speed as the old bfloat16 one).
//!
//! The x86 code is safe functions with `#[target_feature]` over the group
//! conversions of the SIMD layer (`crate::simd`, shared with the codec;
//! intrinsics and `bytemuck` casts, no raw pointers); the only `unsafe` is
//! calling them after the feature check.

use half::{bf16, f16};

/// Elements per group in the AVX2 code (and the slice conversions over it).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const LANES: usize = 8;

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
type Wide = [f32; LANES];
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
type Narrow = [u16; LANES];

/// The float16 and bfloat16 kernels behind one interface: each function
/// runs the fastest variant this CPU has (AVX-512, AVX2, portable; see
/// [`half!`] below).
pub(crate) trait Half: bytemuck::Pod {
    /// `dst = start ⊕ srcs[0] ⊕ srcs[1] ⊕ ...` in float32, with `op` one of
    /// the float lane operations (`a + b`, `a * b`, min, max) and `start`
    /// the destination itself (`first` = `None`, in place) or `first` (the
    /// destination is then only written). Every source, `first` included,
    /// must be at least as long as `dst`.
    fn reduce(
        dst: &mut [Self],
        first: Option<&[Self]>,
        srcs: &[&[Self]],
        op: impl Fn(f32, f32) -> f32 + Copy,
    );

    /// Widens `min(src.len(), dst.len())` elements to float32.
    fn widen(src: &[Self], dst: &mut [f32]);

    /// Narrows `min(src.len(), dst.len())` float32 elements, round to
    /// nearest even.
    fn narrow(src: &[f32], dst: &mut [Self]);

    /// Every reduction kernel this CPU can run.
    #[cfg(test)]
    fn kernels() -> Vec<Kernel<Self>>;

    /// Every slice conversion this CPU can run, the dispatched ones first.
    #[cfg(test)]
    fn conversions() -> (Vec<WidenFn<Self>>, Vec<NarrowFn<Self>>);
}

/// The variant each kernel above runs on this CPU, chosen by the same
/// feature checks as the calls (`python -m ringlet info` reports them):
/// `(kernel, variant)` for the float16 and bfloat16 reductions and
/// conversions, the variant one of `"avx512f+f16c"`, `"avx512f"`,
/// `"avx2+f16c"`, `"avx2"` or `"portable"`.
pub fn selected_kernels() -> [(&'static str, &'static str); 4] {
    #[allow(unused_mut)]
    let (mut f16_reduce, mut bf16_reduce, mut f16_convert, mut bf16_convert) =
        ("portable", "portable", "portable", "portable");
    #[cfg(target_arch = "x86_64")]
    {
        if x86::has_avx512() {
            (f16_reduce, bf16_reduce) = ("avx512f+f16c", "avx512f");
        } else {
            if x86::has_f16c() {
                f16_reduce = "avx2+f16c";
            }
            if x86::has_avx2() {
                bf16_reduce = "avx2";
            }
        }
        if x86::has_f16c() {
            f16_convert = "avx2+f16c";
        }
        if x86::has_avx2() {
            bf16_convert = "avx2";
        }
    }
    [
        ("float16 reduce", f16_reduce),
        ("bfloat16 reduce", bf16_reduce),
        ("float16 convert", f16_convert),
        ("bfloat16 convert", bf16_convert),
    ]
}

/// Copies up to `L` elements into a zero-padded group.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
fn pad<T: Copy + Default, const L: usize>(tail: &[T]) -> [T; L] {
    let mut group = [T::default(); L];
    group[..tail.len()].copy_from_slice(tail);
    group
}

/// The reduction over groups of `L` elements (one vector register of
/// float32), given the group conversions. Inlined into each caller, so it is
/// compiled for that caller's target features.
///
/// Each accumulator starts from the destination's group widened (`first` =
/// `None`, in place) or from `first`'s (`reduce_into`: the destination is
/// then never read). Up to three further sources are folded in registers
/// (one read of every input, one write of the destination); more go through
/// a 4 KiB float32 accumulator in L1, one source at a time. Either way each
/// element sees the same operations in the same order: `((start op s0) op
/// s1) op ...`, then one rounding.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub(crate) fn fold<H: bytemuck::Pod, const L: usize>(
    dst: &mut [H],
    first: Option<&[H]>,
    srcs: &[&[H]],
    op: impl Fn(f32, f32) -> f32 + Copy,
    widen: impl Fn([u16; L]) -> [f32; L] + Copy,
    narrow: impl Fn([f32; L]) -> [u16; L] + Copy,
) where
    [u16; L]: bytemuck::Pod,
    [f32; L]: bytemuck::Pod,
{
    let n = dst.len();
    let dst: &mut [u16] = bytemuck::cast_slice_mut(dst);
    let whole = n / L * L;
    let (body, tail) = dst.split_at_mut(whole);
    let body: &mut [[u16; L]] = bytemuck::cast_slice_mut(body);
    // Two copies of the loops, so the choice of start is made once, here,
    // not per group; within each, the number of sources is chosen once too:
    // up to three are folded in registers, more through the L1 accumulator.
    macro_rules! by_sources {
        ($into:literal, $first:expr) => {
            match srcs {
                [] => fold_fused::<$into, 0, L>(body, $first, [], op, widen, narrow),
                [a] => {
                    let s = [groups(a, whole)];
                    fold_fused::<$into, 1, L>(body, $first, s, op, widen, narrow)
                }
                [a, b] => {
                    let s = [groups(a, whole), groups(b, whole)];
                    fold_fused::<$into, 2, L>(body, $first, s, op, widen, narrow)
                }
                [a, b, c] => {
                    let s = [groups(a, whole), groups(b, whole), groups(c, whole)];
                    fold_fused::<$into, 3, L>(body, $first, s, op, widen, narrow)
                }
                many => {
                    let all: Vec<&[[u16; L]]> = many.iter().map(|s| groups(s, whole)).collect();
                    fold_blocked(body, $into.then_some($first), &all, op, widen, narrow)
                }
            }
        };
    }
    match first {
        None => by_sources!(false, &[]),
        Some(f) => by_sources!(true, groups(f, whole)),
    }
    if !tail.is_empty() {
        let start: &[u16] = match first {
            Some(f) => bytemuck::cast_slice(&f[whole..n]),
            None => tail,
        };
        let mut acc = widen(pad(start));
        for s in srcs {
            let s: &[u16] = bytemuck::cast_slice(&s[whole..n]);
            apply(&mut acc, widen(pad(s)), op);
        }
        tail.copy_from_slice(&narrow(acc)[..n - whole]);
    }
}

/// The first `whole` (a multiple of `L`) elements as groups.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
fn groups<H: bytemuck::Pod, const L: usize>(s: &[H], whole: usize) -> &[[u16; L]]
where
    [u16; L]: bytemuck::Pod,
{
    bytemuck::cast_slice(&s[..whole])
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
fn apply<const L: usize>(acc: &mut [f32; L], b: [f32; L], op: impl Fn(f32, f32) -> f32) {
    for (a, b) in acc.iter_mut().zip(b) {
        *a = op(*a, b);
    }
}

/// `K` sources folded in registers, each accumulator starting from `first`'s
/// group when `INTO` (a constant, so each copy of the loop has one start and
/// no branch), else from the destination's (and `first` is unused).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
fn fold_fused<const INTO: bool, const K: usize, const L: usize>(
    body: &mut [[u16; L]],
    first: &[[u16; L]],
    srcs: [&[[u16; L]]; K],
    op: impl Fn(f32, f32) -> f32 + Copy,
    widen: impl Fn([u16; L]) -> [f32; L],
    narrow: impl Fn([f32; L]) -> [u16; L],
) {
    // Same lengths as `body`, so the indexing below needs no bounds checks.
    let srcs = srcs.map(|s| &s[..body.len()]);
    let first = if INTO { &first[..body.len()] } else { first };
    // Four groups per step: independent conversion chains in flight (the
    // conversions, not memory, bound this loop on cached data).
    const U: usize = 4;
    let pairs = body.len() / U;
    let (head, tail) = body.split_at_mut(pairs * U);
    for (j, d) in head.chunks_exact_mut(U).enumerate() {
        let i = U * j;
        let mut acc: [[f32; L]; U] =
            std::array::from_fn(|u| widen(if INTO { first[i + u] } else { d[u] }));
        for s in &srcs {
            for (u, a) in acc.iter_mut().enumerate() {
                apply(a, widen(s[i + u]), op);
            }
        }
        for (u, a) in acc.into_iter().enumerate() {
            d[u] = narrow(a);
        }
    }
    for (k, d) in tail.iter_mut().enumerate() {
        let i = pairs * U + k;
        let mut acc = widen(if INTO { first[i] } else { *d });
        for s in &srcs {
            apply(&mut acc, widen(s[i]), op);
        }
        *d = narrow(acc);
    }
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
fn fold_blocked<const L: usize>(
    body: &mut [[u16; L]],
    first: Option<&[[u16; L]]>,
    srcs: &[&[[u16; L]]],
    op: impl Fn(f32, f32) -> f32 + Copy,
    widen: impl Fn([u16; L]) -> [f32; L] + Copy,
    narrow: impl Fn([f32; L]) -> [u16; L],
) where
    [f32; L]: bytemuck::Pod,
{
    const BLOCK: usize = 1024; // elements: 4 KiB of float32
    let mut acc = [0f32; BLOCK];
    let acc: &mut [[f32; L]] = bytemuck::cast_slice_mut(&mut acc);
    let per_block = acc.len();
    for (b, d) in body.chunks_mut(per_block).enumerate() {
        let start = b * per_block;
        let acc = &mut acc[..d.len()];
        let init: &[[u16; L]] = match first {
            Some(f) => &f[start..start + d.len()],
            None => d,
        };
        for (a, h) in acc.iter_mut().zip(init) {
            *a = widen(*h);
        }
        for s in srcs {
            for (a, s) in acc.iter_mut().zip(&s[start..start + d.len()]) {
                apply(a, widen(*s), op);
            }
        }
        for (d, a) in d.iter_mut().zip(acc.iter()) {
            *d = narrow(*a);
        }
    }
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
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

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
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

/// Portable lane functions and the slice loops over them.
pub(crate) mod portable {

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

    /// The reduction one element at a time through the lane functions, in
    /// blocks of 1024 (the accumulator's start, the destination's or
    /// `first`'s, and one source widened into 4 KiB float32 buffers in L1):
    /// plain loops over slices, which the compiler vectorises for whatever
    /// the target has.
    #[inline(always)]
    pub(crate) fn fold<H: bytemuck::Pod>(
        dst: &mut [H],
        first: Option<&[H]>,
        srcs: &[&[H]],
        op: impl Fn(f32, f32) -> f32 + Copy,
        widen: impl Fn(u16) -> u32 + Copy,
        narrow: impl Fn(u32) -> u16 + Copy,
    ) {
        const BLOCK: usize = 1024;
        let mut acc = [0f32; BLOCK];
        let mut wide = [0f32; BLOCK];
        let dst: &mut [u16] = bytemuck::cast_slice_mut(dst);
        for (b, block) in dst.chunks_mut(BLOCK).enumerate() {
            let (start, n) = (b * BLOCK, block.len());
            let acc = &mut acc[..n];
            let init: &[u16] = match first {
                Some(f) => bytemuck::cast_slice(&f[start..start + n]),
                None => block,
            };
            for (a, h) in acc.iter_mut().zip(init) {
                *a = f32::from_bits(widen(*h));
            }
            for s in srcs {
                let s: &[u16] = bytemuck::cast_slice(&s[start..start + n]);
                for (w, h) in wide.iter_mut().zip(s) {
                    *w = f32::from_bits(widen(*h));
                }
                for (a, w) in acc.iter_mut().zip(wide.iter()) {
                    *a = op(*a, *w);
                }
            }
            for (h, a) in block.iter_mut().zip(acc.iter()) {
                *h = narrow(a.to_bits());
            }
        }
    }

    /// Widens `min(src.len(), dst.len())` elements.
    #[inline(always)]
    pub(crate) fn widen<H: bytemuck::Pod>(src: &[H], dst: &mut [f32], f: impl Fn(u16) -> u32) {
        for (d, s) in dst.iter_mut().zip(bytemuck::cast_slice::<H, u16>(src)) {
            *d = f32::from_bits(f(*s));
        }
    }

    /// Narrows `min(src.len(), dst.len())` elements.
    #[inline(always)]
    pub(crate) fn narrow<H: bytemuck::Pod>(src: &[f32], dst: &mut [H], f: impl Fn(u32) -> u16) {
        for (d, s) in bytemuck::cast_slice_mut::<H, u16>(dst).iter_mut().zip(src) {
            *d = f(s.to_bits());
        }
    }
}

/// x86_64 versions: the same loops compiled for AVX2 or AVX-512, with the
/// group conversions of the SIMD layer (`crate::simd`; F16C for float16) so
/// that the compiler keeps one group per vector register.
/// These are safe functions with target features; callers must check the
/// features first (the `unsafe` at each call).
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use crate::simd::{avx2, avx512};
    pub(crate) use crate::simd::{has_avx2, has_avx512, has_f16c};
    use half::{bf16, f16};

    /// One format's kernels on one instruction set (`$features`), over
    /// groups of `$lanes` float32 lanes converted by the SIMD layer's group
    /// load and store: the reduction `$reduce` and, where named, the slice
    /// conversions (widening with `$load_exact`, which quiets NaNs like
    /// `half`; the reduction may use a plain load, see `avx2::load_bf16`).
    macro_rules! kernels {
        (
            $features:literal, $H:ty, $lanes:literal, $load:path, $store:path => $reduce:ident
            $(; $load_exact:path => $widen:ident, $narrow:ident)?
        ) => {
            #[target_feature(enable = $features)]
            pub(crate) fn $reduce(
                dst: &mut [$H],
                first: Option<&[$H]>,
                srcs: &[&[$H]],
                op: impl Fn(f32, f32) -> f32 + Copy,
            ) {
                super::fold::<$H, $lanes>(
                    dst,
                    first,
                    srcs,
                    op,
                    |h| bytemuck::cast($load(&bytemuck::cast(h))),
                    |x| {
                        let mut b = [0u8; 2 * $lanes];
                        $store(bytemuck::cast(x), &mut b);
                        bytemuck::cast(b)
                    },
                )
            }

            $(
                #[target_feature(enable = $features)]
                pub(crate) fn $widen(src: &[$H], dst: &mut [f32]) {
                    super::widen(src, dst, |h| bytemuck::cast($load_exact(&bytemuck::cast(h))))
                }

                #[target_feature(enable = $features)]
                pub(crate) fn $narrow(src: &[f32], dst: &mut [$H]) {
                    super::narrow(src, dst, |x| {
                        let mut b = [0u8; 2 * $lanes];
                        $store(bytemuck::cast(x), &mut b);
                        bytemuck::cast(b)
                    })
                }
            )?
        };
    }

    // float16: `vcvtph2ps` / `vcvtps2ph` (F16C), exact and rounding to
    // nearest even, quieting NaNs like `half`.
    kernels!("avx512f,avx2,f16c", f16, 16, avx512::load_f16, avx512::store_f16 => reduce_f16_avx512);
    kernels!("avx2,f16c", f16, 8, avx2::load_f16, avx2::store_f16 => reduce_f16;
        avx2::load_f16 => widen_f16, narrow_f16);
    // bfloat16: integer shifts and the rounding bias. The reduction widens
    // with a plain shift, which leaves a signalling NaN signalling; what
    // reaches memory is the same as with the quieting load: float arithmetic
    // returns a NaN operand quieted, min and max pass it through unchanged,
    // and the store sets the quiet bit of any NaN. With AVX-512, 32 elements
    // from one 64-byte load, in the lane order of `avx512::load_bf16_pairs`
    // (which `avx512::store_bf16_pairs` undoes; an element-wise fold does
    // not see it).
    kernels!("avx512f,avx2", bf16, 32, avx512::load_bf16_pairs, avx512::store_bf16_pairs => reduce_bf16_avx512);
    kernels!("avx2", bf16, 8, avx2::load_bf16, avx2::store_bf16 => reduce_bf16;
        avx2::load_bf16_quiet => widen_bf16, narrow_bf16);
}

/// A reduction kernel under test: `(name, run(op, dst, first, srcs))`.
#[cfg(test)]
pub(crate) type Kernel<H> = (
    &'static str,
    fn(crate::dtype::ReduceOp, &mut [H], Option<&[H]>, &[&[H]]),
);

/// Runs `$body` with `$f` bound to the lane operation of `$op`.
#[cfg(test)]
macro_rules! with_op {
    ($op:expr, $f:ident => $body:expr) => {{
        use crate::dtype::ReduceOp;
        match $op {
            ReduceOp::Sum => {
                let $f = |a: f32, b: f32| a + b;
                $body
            }
            ReduceOp::Mul => {
                let $f = |a: f32, b: f32| a * b;
                $body
            }
            ReduceOp::Min => {
                let $f = super::fmin::<f32>;
                $body
            }
            ReduceOp::Max => {
                let $f = super::fmax::<f32>;
                $body
            }
            ReduceOp::And | ReduceOp::Or | ReduceOp::Xor => unreachable!(),
        }
    }};
}

/// A slice conversion under test, by name.
#[cfg(test)]
pub(crate) type WidenFn<H> = (&'static str, fn(&[H], &mut [f32]));
#[cfg(test)]
pub(crate) type NarrowFn<H> = (&'static str, fn(&[f32], &mut [H]));

/// Implements [`Half`] for `$H`: the reduction tries each x86 variant in
/// turn (`x86::$has()` detects the features it is compiled for; `$name`
/// names it in tests), the slice conversions the one variant after
/// `convert`, and both fall back to the portable lane functions.
macro_rules! half {
    (
        $H:ty, portable $to:path, $from:path;
        reduce $($name:literal if $has:ident => $reduce:ident),+;
        convert $cname:literal if $chas:ident => $widen:ident, $narrow:ident
    ) => {
        impl Half for $H {
            #[inline(always)]
            fn reduce(
                dst: &mut [Self],
                first: Option<&[Self]>,
                srcs: &[&[Self]],
                op: impl Fn(f32, f32) -> f32 + Copy,
            ) {
                $(
                    #[cfg(target_arch = "x86_64")]
                    if x86::$has() {
                        // SAFETY: `x86::$has` checked that this CPU has the
                        // features `x86::$reduce` is compiled for.
                        return unsafe { x86::$reduce(dst, first, srcs, op) };
                    }
                )+
                portable::fold(dst, first, srcs, op, $to, $from)
            }

            fn widen(src: &[Self], dst: &mut [f32]) {
                #[cfg(target_arch = "x86_64")]
                if x86::$chas() {
                    // SAFETY: `x86::$chas` checked that this CPU has the
                    // features `x86::$widen` is compiled for.
                    return unsafe { x86::$widen(src, dst) };
                }
                portable::widen(src, dst, $to)
            }

            fn narrow(src: &[f32], dst: &mut [Self]) {
                #[cfg(target_arch = "x86_64")]
                if x86::$chas() {
                    // SAFETY: as in `widen`, for `x86::$narrow`.
                    return unsafe { x86::$narrow(src, dst) };
                }
                portable::narrow(src, dst, $from)
            }

            #[cfg(test)]
            fn kernels() -> Vec<Kernel<Self>> {
                #[allow(unused_mut)]
                let mut v: Vec<Kernel<Self>> = vec![(
                    "portable",
                    |op, d, first, s| with_op!(op, f => portable::fold(d, first, s, f, $to, $from)),
                )];
                $(
                    #[cfg(target_arch = "x86_64")]
                    if x86::$has() {
                        // SAFETY: the features were just detected.
                        v.push((
                            $name,
                            |op, d, first, s| with_op!(op, f => unsafe { x86::$reduce(d, first, s, f) }),
                        ));
                    }
                )+
                v
            }

            #[cfg(test)]
            fn conversions() -> (Vec<WidenFn<Self>>, Vec<NarrowFn<Self>>) {
                #[allow(unused_mut)]
                let mut w: Vec<WidenFn<Self>> = vec![
                    ("dispatched", Self::widen),
                    ("portable", |s, d| portable::widen(s, d, $to)),
                ];
                #[allow(unused_mut)]
                let mut n: Vec<NarrowFn<Self>> = vec![
                    ("dispatched", Self::narrow),
                    ("portable", |s, d| portable::narrow(s, d, $from)),
                ];
                #[cfg(target_arch = "x86_64")]
                if x86::$chas() {
                    // SAFETY: the features were just detected.
                    w.push(($cname, |s, d| unsafe { x86::$widen(s, d) }));
                    // SAFETY: as above.
                    n.push(($cname, |s, d| unsafe { x86::$narrow(s, d) }));
                }
                (w, n)
            }
        }
    };
}

half!(f16, portable portable::f16_to_f32_bits, portable::f32_to_f16_bits;
    reduce "avx512" if has_avx512 => reduce_f16_avx512, "avx2" if has_f16c => reduce_f16;
    convert "f16c" if has_f16c => widen_f16, narrow_f16);
half!(bf16, portable portable::bf16_to_f32_bits, portable::f32_to_bf16_bits;
    reduce "avx512" if has_avx512 => reduce_bf16_avx512, "avx2" if has_avx2 => reduce_bf16;
    convert "avx2" if has_avx2 => widen_bf16, narrow_bf16);

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Every widening of `H` against `want` for every bit pattern `hs`;
    /// odd lengths and offsets exercise the tails of the 8-lane loops.
    fn check_widens<H: Half>(format: &str, hs: &[H], want: impl Fn(&H) -> f32) {
        let bits = |h: &H| bytemuck::cast::<H, u16>(*h);
        for (off, len) in [(0, 65536), (3, 65533), (0, 13)] {
            for (name, widen) in H::conversions().0 {
                let mut got = vec![0f32; len];
                widen(&hs[off..off + len], &mut got);
                for (h, g) in hs[off..].iter().zip(&got) {
                    let w = want(h).to_bits();
                    assert_eq!(g.to_bits(), w, "{format} {name} {:#x}", bits(h));
                }
            }
        }
    }

    /// Every narrowing of `H` of `xs` against `want` (the bits `half` gives).
    fn check_narrows<H: Half>(format: &str, xs: &[f32], want: &[u16]) {
        for off in [0, 5] {
            let xs = &xs[off..];
            for (name, narrow) in H::conversions().1 {
                let mut got = vec![H::zeroed(); xs.len()];
                narrow(xs, &mut got);
                for ((x, g), w) in xs.iter().zip(&got).zip(&want[off..]) {
                    let g = bytemuck::cast::<H, u16>(*g);
                    assert_eq!(g, *w, "{format} {name} {:#010x}", x.to_bits());
                }
            }
        }
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
        check_widens("f16", &f16s, |h| h.to_f32());
        check_widens("bf16", &bf16s, |h| h.to_f32());
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
        check_narrows::<f16>("f16", &xs, &want16);
        check_narrows::<bf16>("bf16", &xs, &want_bf);
    }

    #[test]
    fn converts_the_shorter_length() {
        let src = [f16::ONE; 20];
        let mut dst = [0f32; 11];
        Half::widen(&src, &mut dst);
        assert!(dst.iter().all(|v| *v == 1.0));
        let mut out = [f16::ZERO; 20];
        Half::narrow(&dst, &mut out);
        assert!(
            out[..11].iter().all(|v| *v == f16::ONE) && out[11..].iter().all(|v| *v == f16::ZERO)
        );
        let mut out = [bf16::ZERO; 5];
        Half::narrow(&dst, &mut out);
        assert!(out.iter().all(|v| *v == bf16::ONE));
    }
}
