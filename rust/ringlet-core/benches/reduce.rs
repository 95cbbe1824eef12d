//! Criterion microbenchmark of the element-wise reduce kernels
//! (`ringlet_core::reduce::reduce_inplace`): every dtype x op on 4 MiB buffers,
//! folding 1 and 3 sources into the destination, against a `memcpy`
//! (`copy_from_slice`) of the same size. Throughput is the size of one buffer
//! per call, so "GB/s" compares directly with the memcpy line.
//!
//! `half_scalar_before/...` is the float16/bfloat16 kernel as it was before
//! the block conversions (one `half` scalar conversion per element), kept
//! here so before/after run side by side in one process.
//!
//! `cargo bench -p ringlet-core --bench reduce` (about 3 minutes); add a filter
//! such as `-- bfloat16` for a subset.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::{bf16, f16};
use ringlet_core::reduce::reduce_inplace;
use ringlet_core::{DType, ReduceOp, ALL_DTYPES, ALL_OPS};
use std::hint::black_box;
use std::time::Duration;

const BYTES: usize = 4 << 20;
const SOURCES: [usize; 2] = [1, 3];

/// A 4 MiB buffer aligned for every dtype.
fn buffer() -> Vec<u64> {
    vec![0u64; BYTES / 8]
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

    let mut dst = buffer();
    let mut src_bufs: Vec<Vec<u64>> = (0..3).map(|_| buffer()).collect();

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

criterion_group!(benches, bench);
criterion_main!(benches);
