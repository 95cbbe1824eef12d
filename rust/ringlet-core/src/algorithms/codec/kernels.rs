//! The codec's kernels: the quantisation constants and rounding of one
//! chunk, and the min/max, quantise, dequantise and scale loops over it,
//! portable and x86 (generated for each instruction set of the SIMD layer,
//! `crate::simd`), with the run-time choice among them ([`Isa`]).

use super::{Kind, EPS, EPS_F64, Q, Q_F64};

/// `rint` (round half to even) and the quantisation constants of a chunk
/// (`Params`) for one float type, written once for float32 and float64.
macro_rules! quantisation {
    (
        $(#[$rint_doc:meta])* fn $rint:ident($F:ty), big $big:literal;
        $(#[$params_doc:meta])* struct $Params:ident, q $q:expr, eps $eps:expr;
    ) => {
        $(#[$rint_doc])*
        #[inline(always)]
        pub(super) fn $rint(v: $F) -> $F {
            if cfg!(any(target_arch = "x86", target_arch = "x86_64"))
                && !cfg!(target_feature = "sse4.1")
            {
                const BIG: $F = $big; // from here on, floats are integers
                if v.abs() < BIG {
                    ((v.abs() + BIG) - BIG).copysign(v)
                } else {
                    v
                }
            } else {
                v.round_ties_even()
            }
        }

        $(#[$params_doc])*
        #[derive(Clone, Copy, Debug)]
        pub(super) struct $Params {
            pub(super) scale: $F,
            pub(super) upper: $F,
            pub(super) lower: $F,
        }

        impl $Params {
            pub(super) fn new(mn: $F, mx: $F) -> Self {
                let scale = $q / (mx - mn + $eps);
                let upper = (mx * scale).round_ties_even();
                $Params {
                    scale,
                    upper,
                    lower: upper - $q,
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
            pub(super) fn byte(self, x: $F) -> u8 {
                let level = $rint(x * self.scale);
                let level = if level < self.upper {
                    level
                } else {
                    self.upper
                };
                (level - self.lower) as u8
            }

            /// The decompressed value of `byte`, before rounding to the element type.
            #[inline(always)]
            pub(super) fn value(self, byte: u8) -> $F {
                (<$F>::from(byte) + self.lower) / self.scale
            }
        }
    };
}

quantisation! {
    /// `v.round_ties_even()`. On x86 without SSE4.1 (the baseline target) that
    /// is a library call per element; there the portable kernel instead adds and
    /// subtracts 2^23 to the magnitude below 2^23 (the float unit rounds to
    /// nearest even), the same result for every input, signed zeros included.
    fn rint(f32), big 8_388_608.0;
    /// The quantisation constants of a chunk with (finite) extremes `mn`, `mx`.
    struct Params, q Q, eps EPS;
}

quantisation! {
    /// [`rint`] in float64 (2^52).
    fn rint64(f64), big 4_503_599_627_370_496.0;
    /// [`Params`] of a float64 chunk.
    struct Params64, q Q_F64, eps EPS_F64;
}

/// The extremes of a chunk as a kernel found them: exact when `finite`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Range {
    pub(super) mn: f32,
    pub(super) mx: f32,
    pub(super) finite: bool,
}

impl Range {
    /// Folds the lanes of vector accumulators: `mn`/`mx` lane-wise extremes,
    /// `chk` lane-wise sums of `x - x` or `x * 0` (0 unless a NaN or an
    /// infinity was seen).
    pub(super) fn from_lanes(mn: &[f32], mx: &[f32], chk: &[f32]) -> Range {
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

/// The operation a kernel applies per decompressed value (the accumulators
/// are float32 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Store,
    Add,
    AccFirst,
    Acc,
}

/// Which kernels run. The x86 variants hold a token only made after the
/// features were detected, so holding one proves the CPU has them.
#[derive(Clone, Copy, Debug)]
pub(super) enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2(x86::Avx2),
    #[cfg(target_arch = "x86_64")]
    Avx512(x86::Avx512),
}

impl Isa {
    /// The fastest kernels this CPU runs.
    pub(super) fn best() -> Isa {
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
    pub(super) fn name(self) -> &'static str {
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
    pub(super) fn available() -> Vec<Isa> {
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
}

/// The kernel functions of [`Isa`], each running the variant it names: the
/// x86 ones after the check its token stands for.
macro_rules! isa_kernels {
    ($(fn $f:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?;)*) => {
        impl Isa {
            $(
                pub(super) fn $f(self, $($arg: $ty),*) $(-> $ret)? {
                    match self {
                        Isa::Portable => portable::$f($($arg),*),
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: the token proves AVX2 and F16C were detected,
                        // the features `x86::avx2` is compiled for.
                        Isa::Avx2(_) => unsafe { x86::avx2::$f($($arg),*) },
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: the token proves AVX-512F, AVX2 and F16C were
                        // detected, the features `x86::avx512` is compiled for.
                        Isa::Avx512(_) => unsafe { x86::avx512::$f($($arg),*) },
                    }
                }
            )*
        }
    };
}

isa_kernels! {
    fn minmax(kind: Kind, src: &[u8]) -> Range;
    fn quantize(kind: Kind, src: &[u8], p: Params, dst: &mut [u8]);
    fn dequantize(kind: Kind, mode: Mode, src: &[u8], p: Params, dst: &mut [u8]);
    fn scaled(kind: Kind, acc: &[u8], divisor: f32, dst: &mut [u8]);
}

/// Folds `step` over the `B`-byte groups of `src` in four interleaved
/// states (independent dependency chains) and merges them. The last, partial
/// group (whole elements of `esize` bytes) is padded with copies of its first
/// element, which leaves minima, maxima and finiteness unchanged.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub(super) fn fold_groups<const B: usize, S: Copy>(
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
pub(super) fn zip_groups<const A: usize, const B: usize>(
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

    /// A half-precision [`Lane`] through the `half` crate's conversions.
    macro_rules! half_lane {
        ($($Lane:ident: $H:ty),*) => {$(
            impl Lane for $Lane {
                const SIZE: usize = 2;
                #[inline(always)]
                fn widen(b: &[u8]) -> f32 {
                    <$H>::from_ne_bytes([b[0], b[1]]).to_f32()
                }
                #[inline(always)]
                fn narrow(v: f32, b: &mut [u8]) {
                    b.copy_from_slice(&<$H>::from_f32(v).to_ne_bytes());
                }
                #[inline(always)]
                fn round(v: f32) -> f32 {
                    <$H>::from_f32(v).to_f32()
                }
            }
        )*};
    }

    half_lane!(F16: f16, BF16: bf16);

    /// Runs the generic `run::<L>(args)` for the [`Lane`] of `kind`.
    macro_rules! by_kind {
        ($kind:expr, $run:ident($($arg:expr),*)) => {
            match $kind {
                Kind::F32 => $run::<F32>($($arg),*),
                Kind::F16 => $run::<F16>($($arg),*),
                Kind::BF16 => $run::<BF16>($($arg),*),
            }
        };
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
        by_kind!(kind, run(src))
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
        by_kind!(kind, run(src, p, dst))
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
        by_kind!(kind, run(mode, src, p, dst))
    }

    pub(super) fn scaled(kind: Kind, acc: &[u8], divisor: f32, dst: &mut [u8]) {
        fn run<L: Lane>(acc: &[u8], divisor: f32, dst: &mut [u8]) {
            for (a, d) in acc.chunks_exact(4).zip(dst.chunks_exact_mut(L::SIZE)) {
                L::narrow(F32::widen(a) / divisor, d);
            }
        }
        by_kind!(kind, run(acc, divisor, dst))
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
    pub(in crate::algorithms::codec) struct Avx2(());

    impl Avx2 {
        pub(super) fn detect() -> Option<Self> {
            crate::simd::has_f16c().then_some(Avx2(()))
        }
    }

    /// Proof that this CPU has AVX-512F, AVX2 and F16C.
    #[derive(Clone, Copy, Debug)]
    pub(in crate::algorithms::codec) struct Avx512(());

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
                    match kind {
                        Kind::F32 => scaled_of::<{ 4 * L }>(acc, d, dst, |v, o| store_f32(v, o)),
                        Kind::F16 => scaled_of::<{ 2 * L }>(acc, d, dst, |v, o| store_f16(v, o)),
                        Kind::BF16 => scaled_of::<{ 2 * L }>(acc, d, dst, |v, o| store_bf16(v, o)),
                    }
                }

                #[target_feature(enable = $features)]
                #[inline]
                fn scaled_of<const B: usize>(
                    acc: &[u8],
                    divisor: V,
                    dst: &mut [u8],
                    store: impl Fn(V, &mut [u8; B]),
                ) {
                    zip_groups::<{ 4 * L }, B>(acc, dst, |a, o| store(div(load_f32(a), divisor), o));
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
