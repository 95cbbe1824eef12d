//! Criterion microbenchmark of the MinMaxUInt8 codec
//! (`ringlet_core::algorithms::codec`): compress, decompress and both in a
//! row of one chunk, float32 at 64 KiB, 1 MiB, 16 MiB and 64 MiB and
//! float16/bfloat16 at 16 MiB, with a `memcpy` of the same buffer for scale.
//! Throughput is the size of the uncompressed input per call, so the
//! `compress+decompress` line is input bytes / (compress time + decompress
//! time).
//!
//! `cargo bench -p ringlet-core --bench codec` (add
//! `-- --warm-up-time 1 --measurement-time 3` for a quicker run, or a filter
//! such as `-- float32/compress`).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::{bf16, f16};
use ringlet_core::algorithms::codec::{compress, compressed_len, decompress};
use ringlet_core::DType;
use std::hint::black_box;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn label(bytes: usize) -> String {
    if bytes >= MIB {
        format!("{}MiB", bytes / MIB)
    } else {
        format!("{}KiB", bytes / KIB)
    }
}

/// `bytes` of gradient-like values of `dtype`: small, mixed-sign, with a few
/// larger outliers (xorshift, reproducible).
fn gradient(dtype: DType, bytes: usize) -> Vec<u8> {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let n = bytes / dtype.size();
    let mut out = Vec::with_capacity(bytes);
    for i in 0..n {
        let v = if i % 1009 == 0 { 0.5 } else { 1e-3 } * next();
        match dtype {
            DType::F32 => out.extend(v.to_ne_bytes()),
            DType::F16 => out.extend(f16::from_f32(v).to_ne_bytes()),
            DType::BF16 => out.extend(bf16::from_f32(v).to_ne_bytes()),
            _ => unreachable!("float dtypes only"),
        }
    }
    out
}

fn bench(c: &mut Criterion) {
    let cases: [(DType, &[usize]); 3] = [
        (DType::F32, &[64 * KIB, MIB, 16 * MIB, 64 * MIB]),
        (DType::F16, &[16 * MIB]),
        (DType::BF16, &[16 * MIB]),
    ];
    for (dtype, sizes) in cases {
        let mut group = c.benchmark_group(format!("codec_{}", dtype.name()));
        group.sample_size(10);
        for &bytes in sizes {
            let id = label(bytes);
            let src = gradient(dtype, bytes);
            let mut comp = vec![0u8; compressed_len(dtype, bytes / dtype.size())];
            let mut out = vec![0u8; bytes];
            compress(dtype, &src, &mut comp).expect("compress");
            decompress(dtype, &comp, &mut out).expect("decompress");
            group.throughput(Throughput::Bytes(bytes as u64));
            if dtype == DType::F32 {
                group.bench_function(BenchmarkId::new("memcpy", &id), |b| {
                    b.iter(|| out.copy_from_slice(black_box(&src)))
                });
            }
            group.bench_function(BenchmarkId::new("compress", &id), |b| {
                b.iter(|| compress(dtype, black_box(&src), &mut comp).expect("compress"))
            });
            group.bench_function(BenchmarkId::new("decompress", &id), |b| {
                b.iter(|| decompress(dtype, black_box(&comp), &mut out).expect("decompress"))
            });
            group.bench_function(BenchmarkId::new("compress+decompress", &id), |b| {
                b.iter(|| {
                    compress(dtype, black_box(&src), &mut comp).expect("compress");
                    decompress(dtype, &comp, &mut out).expect("decompress");
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
