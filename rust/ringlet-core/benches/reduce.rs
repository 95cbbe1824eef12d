//! Criterion microbenchmark of the element-wise reduce kernels
//! (`ringlet_core::reduce::reduce_inplace`): every dtype x op on 4 MiB buffers,
//! folding 1 and 3 sources into the destination, against a `memcpy`
//! (`copy_from_slice`) of the same size. Throughput is the size of one buffer
//! per call, so "GB/s" compares directly with the memcpy line.
//!
//! `float16_scalar_before/...` and `bfloat16_scalar_before/...` are the kernel
//! as it was before
//! the vectorised conversions (one `half` scalar conversion per element), kept
//! here so before/after run side by side in one process.
//!
//! `cargo bench -p ringlet-core --bench reduce` (about 3 minutes); add a filter
//! such as `-- bfloat16` for a subset.
//!
//! On a shared, noisy machine, timings drift between criterion's cases, which
//! run one after another. `RINGLET_REDUCE_TABLE=15 cargo bench -p ringlet-core
//! --bench reduce` instead runs every case round-robin (the value is the
//! number of rounds; each case's sample is the best of 3 calls,
//! its figure the median over rounds) and prints the Markdown tables of
//! docs/benchmarks/kernels.md;
//! `RINGLET_REDUCE_MIB=64` sets another buffer size.

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use half::{bf16, f16};
use ringlet_core::reduce::reduce_inplace;
use ringlet_core::{DType, ReduceOp, ALL_DTYPES, ALL_OPS};
use std::hint::black_box;
use std::time::{Duration, Instant};

const BYTES: usize = 4 << 20;
const SOURCES: [usize; 2] = [1, 3];

/// A buffer of `bytes` aligned for every dtype.
fn buffer(bytes: usize) -> Vec<u64> {
    vec![0u64; bytes / 8]
}

fn bytes_mut(v: &mut [u64]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}

/// Fills `buf` with values for which repeated reduction stays cheap and
/// meaningful: small mixed-sign floats (±1 for mul, so products neither
/// overflow nor go subnormal), varied integers, 0/1 bools.
fn fill(dtype: DType, op: ReduceOp, buf: &mut [u8], seed: usize) {
    let float = |i: usize| -> f32 {
        if op == ReduceOp::Mul {
            if (i + seed) & 1 == 0 {
                1.0
            } else {
                -1.0
            }
        } else {
            ((i * 7 + seed) % 13) as f32 * 0.25 - 1.5
        }
    };
    match dtype {
        DType::F32 => {
            for (i, v) in bytemuck::cast_slice_mut::<u8, f32>(buf)
                .iter_mut()
                .enumerate()
            {
                *v = float(i);
            }
        }
        DType::F64 => {
            for (i, v) in bytemuck::cast_slice_mut::<u8, f64>(buf)
                .iter_mut()
                .enumerate()
            {
                *v = f64::from(float(i));
            }
        }
        DType::F16 => {
            for (i, v) in bytemuck::cast_slice_mut::<u8, f16>(buf)
                .iter_mut()
                .enumerate()
            {
                *v = f16::from_f32(float(i));
            }
        }
        DType::BF16 => {
            for (i, v) in bytemuck::cast_slice_mut::<u8, bf16>(buf)
                .iter_mut()
                .enumerate()
            {
                *v = bf16::from_f32(float(i));
            }
        }
        DType::Bool => {
            for (i, v) in buf.iter_mut().enumerate() {
                *v = (((i + seed) >> 1) & 1) as u8;
            }
        }
        _ => {
            for (i, v) in buf.iter_mut().enumerate() {
                *v = (i.wrapping_mul(2_654_435_761) >> 7) as u8 ^ seed as u8;
            }
        }
    }
}

/// The float16/bfloat16 kernel before the block conversions, verbatim apart
/// from taking typed slices.
mod before {
    use super::*;

    pub trait Half: Copy {
        fn widen(self) -> f32;
        fn narrow(v: f32) -> Self;
    }
    impl Half for f16 {
        fn widen(self) -> f32 {
            self.to_f32()
        }
        fn narrow(v: f32) -> Self {
            f16::from_f32(v)
        }
    }
    impl Half for bf16 {
        fn widen(self) -> f32 {
            self.to_f32()
        }
        fn narrow(v: f32) -> Self {
            bf16::from_f32(v)
        }
    }

    fn zip_apply(dst: &mut [f32], src: &[f32], f: impl Fn(f32, f32) -> f32) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f(*d, *s);
        }
    }

    fn float_slices(op: ReduceOp, dst: &mut [f32], src: &[f32]) {
        match op {
            ReduceOp::Sum => zip_apply(dst, src, |a, b| a + b),
            ReduceOp::Mul => zip_apply(dst, src, |a, b| a * b),
            ReduceOp::Min => zip_apply(dst, src, |a, b| if a < b || a.is_nan() { a } else { b }),
            ReduceOp::Max => zip_apply(dst, src, |a, b| if a > b || a.is_nan() { a } else { b }),
            ReduceOp::And | ReduceOp::Or | ReduceOp::Xor => {}
        }
    }

    pub fn half_inplace<H: Half>(op: ReduceOp, d: &mut [H], s: &[&[H]]) {
        const HALF_BLOCK: usize = 1024;
        let mut acc = [0f32; HALF_BLOCK];
        let mut wide = [0f32; HALF_BLOCK];
        let mut start = 0;
        while start < d.len() {
            let n = HALF_BLOCK.min(d.len() - start);
            let block = &mut d[start..start + n];
            for (a, h) in acc.iter_mut().zip(block.iter()) {
                *a = h.widen();
            }
            for src in s {
                for (w, h) in wide.iter_mut().zip(&src[start..start + n]) {
                    *w = h.widen();
                }
                float_slices(op, &mut acc[..n], &wide[..n]);
            }
            for (h, a) in block.iter_mut().zip(acc.iter()) {
                *h = H::narrow(*a);
            }
            start += n;
        }
    }

    pub fn run(dtype: DType, op: ReduceOp, dst: &mut [u8], srcs: &[&[u8]]) {
        match dtype {
            DType::F16 => {
                let s: Vec<&[f16]> = srcs.iter().map(|s| bytemuck::cast_slice(s)).collect();
                half_inplace(op, bytemuck::cast_slice_mut(dst), &s)
            }
            DType::BF16 => {
                let s: Vec<&[bf16]> = srcs.iter().map(|s| bytemuck::cast_slice(s)).collect();
                half_inplace(op, bytemuck::cast_slice_mut(dst), &s)
            }
            _ => unreachable!("only the half kernels have a before"),
        }
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("reduce_4MiB");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1))
        .throughput(Throughput::Bytes(BYTES as u64));

    let mut dst = buffer(BYTES);
    let mut src_bufs: Vec<Vec<u64>> = (0..3).map(|_| buffer(BYTES)).collect();

    fill(DType::U8, ReduceOp::Sum, bytes_mut(&mut src_bufs[0]), 1);
    group.bench_function("memcpy", |b| {
        b.iter(|| bytes_mut(&mut dst).copy_from_slice(bytemuck::cast_slice(&src_bufs[0])))
    });

    for dtype in ALL_DTYPES {
        for op in ALL_OPS {
            if op.check(dtype).is_err() {
                continue;
            }
            fill(dtype, op, bytes_mut(&mut dst), 0);
            for (k, s) in src_bufs.iter_mut().enumerate() {
                fill(dtype, op, bytes_mut(s), k + 1);
            }
            for nsrc in SOURCES {
                let srcs: Vec<&[u8]> = src_bufs[..nsrc]
                    .iter()
                    .map(|s| bytemuck::cast_slice(s))
                    .collect();
                let id = format!("{}/{}", dtype.name(), op.name());
                group.bench_with_input(
                    BenchmarkId::new(id, format!("{nsrc}src")),
                    &nsrc,
                    |b, _| {
                        b.iter(|| {
                            reduce_inplace(dtype, op, bytes_mut(&mut dst), black_box(&srcs))
                                .expect("reduce")
                        })
                    },
                );
                if matches!(dtype, DType::F16 | DType::BF16) {
                    let id = format!("{}_scalar_before/{}", dtype.name(), op.name());
                    group.bench_with_input(
                        BenchmarkId::new(id, format!("{nsrc}src")),
                        &nsrc,
                        |b, _| {
                            b.iter(|| before::run(dtype, op, bytes_mut(&mut dst), black_box(&srcs)))
                        },
                    );
                }
            }
        }
    }
    group.finish();
}

/// One timed case of the round-robin table.
struct Case {
    name: String,
    dtype: DType,
    op: ReduceOp,
    nsrc: usize,
    /// `None`: memcpy; `Some(false)`: the kernel; `Some(true)`: the scalar
    /// half kernel from before.
    before: Option<bool>,
    secs: Vec<f64>,
}

/// Calls per case and round; the round's sample is the fastest.
const CALLS: usize = 3;

fn table(rounds: usize, bytes: usize) {
    let mut cases = vec![Case {
        name: "memcpy".into(),
        dtype: DType::U8,
        op: ReduceOp::Sum,
        nsrc: 1,
        before: None,
        secs: vec![],
    }];
    for dtype in ALL_DTYPES {
        for op in ALL_OPS.into_iter().filter(|op| op.check(dtype).is_ok()) {
            for nsrc in SOURCES {
                let mut add = |before: bool, tag: &str| {
                    cases.push(Case {
                        name: format!("{}{tag}/{}/{nsrc}src", dtype.name(), op.name()),
                        dtype,
                        op,
                        nsrc,
                        before: Some(before),
                        secs: vec![],
                    })
                };
                add(false, "");
                if matches!(dtype, DType::F16 | DType::BF16) {
                    add(true, "_scalar_before");
                }
            }
        }
    }
    let mut dst = buffer(bytes);
    let mut src_bufs: Vec<Vec<u64>> = (0..3).map(|_| buffer(bytes)).collect();
    // Each round visits the cases in a different order (a fixed shuffle), so
    // that no case always follows the same neighbour.
    let mut order: Vec<usize> = (0..cases.len()).collect();
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    for _ in 0..rounds {
        for i in (1..order.len()).rev() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            order.swap(i, (state % (i as u64 + 1)) as usize);
        }
        for &c in &order {
            let case = &mut cases[c];
            fill(case.dtype, case.op, bytes_mut(&mut dst), 0);
            for (k, s) in src_bufs.iter_mut().enumerate() {
                fill(case.dtype, case.op, bytes_mut(s), k + 1);
            }
            let srcs: Vec<&[u8]> = src_bufs[..case.nsrc]
                .iter()
                .map(|s| bytemuck::cast_slice(s))
                .collect();
            let best = (0..CALLS)
                .map(|_| {
                    let t0 = Instant::now();
                    match case.before {
                        None => bytes_mut(&mut dst).copy_from_slice(srcs[0]),
                        Some(false) => {
                            reduce_inplace(case.dtype, case.op, bytes_mut(&mut dst), &srcs)
                                .expect("reduce")
                        }
                        Some(true) => before::run(case.dtype, case.op, bytes_mut(&mut dst), &srcs),
                    }
                    t0.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            case.secs.push(best);
        }
    }
    let gbs = |name: &str| -> Option<f64> {
        let case = cases.iter().find(|c| c.name == name)?;
        let mut secs = case.secs.clone();
        secs.sort_by(f64::total_cmp);
        Some(bytes as f64 / secs[secs.len() / 2] / 1e9)
    };
    let memcpy = gbs("memcpy").unwrap_or(f64::NAN);
    println!(
        "{} MiB buffers, median of {rounds} round-robin rounds; memcpy {memcpy:.1} GB/s\n",
        bytes >> 20
    );
    for nsrc in SOURCES {
        println!("{nsrc} source(s): GB/s (% of memcpy)\n");
        println!("| dtype | {} |", ALL_OPS.map(|o| o.name()).join(" | "));
        println!("|---|{}", "---:|".repeat(ALL_OPS.len()));
        for dtype in ALL_DTYPES {
            let cells: Vec<String> = ALL_OPS
                .iter()
                .map(
                    |op| match gbs(&format!("{}/{}/{nsrc}src", dtype.name(), op.name())) {
                        Some(g) => format!("{g:.1} ({:.0}%)", g / memcpy * 100.0),
                        None => "–".into(),
                    },
                )
                .collect();
            println!("| {} | {} |", dtype.name(), cells.join(" | "));
        }
        println!();
    }
    println!("| dtype | op | sources | before GB/s | after GB/s | speed-up | after / float32 |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for dtype in [DType::F16, DType::BF16] {
        for op in [ReduceOp::Sum, ReduceOp::Mul, ReduceOp::Min, ReduceOp::Max] {
            for nsrc in SOURCES {
                let name = |d: &str, tag: &str| format!("{d}{tag}/{}/{nsrc}src", op.name());
                let (Some(b), Some(a), Some(f)) = (
                    gbs(&name(dtype.name(), "_scalar_before")),
                    gbs(&name(dtype.name(), "")),
                    gbs(&name("float32", "")),
                ) else {
                    continue;
                };
                println!(
                    "| {} | {} | {nsrc} | {b:.2} | {a:.1} | {:.0}x | {:.2} |",
                    dtype.name(),
                    op.name(),
                    a / b,
                    a / f
                );
            }
        }
    }
}

criterion_group!(benches, bench);

fn main() {
    match std::env::var("RINGLET_REDUCE_TABLE") {
        Ok(v) => {
            let mib: usize = std::env::var("RINGLET_REDUCE_MIB")
                .ok()
                .and_then(|m| m.parse().ok())
                .unwrap_or(BYTES >> 20);
            table(v.parse().unwrap_or(15).max(1), mib.max(1) << 20)
        }
        Err(_) => {
            benches();
            Criterion::default().configure_from_args().final_summary();
        }
    }
}
