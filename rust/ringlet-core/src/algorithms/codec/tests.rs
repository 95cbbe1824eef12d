//! The codec's tests: every kernel variant against scalar references.

use super::kernels::{rint, rint64};
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
                            decode_with(isa, dtype, &comp, Target::Acc(&mut acc, first)).unwrap();
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
