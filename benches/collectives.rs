//! Criterion benchmarks of the core over threads: all_reduce and all_gather on
//! 2 ranks, shared memory and TCP, at a few sizes. Ranks are threads of this
//! process; each sample times `iters` back-to-back collectives on every rank.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ringlet_core::testing::{local_group, run_ranks};
use ringlet_core::{Config, DType, ReduceOp};
use std::time::{Duration, Instant};

fn bench(c: &mut Criterion) {
    let modes = [
        ("shm", Config::default()),
        (
            "tcp",
            Config {
                force_tcp: true,
                ..Config::default()
            },
        ),
    ];
    let mut group = c.benchmark_group("collectives_2_ranks");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(2));
    for (name, cfg) in modes {
        let mut comms = local_group(2, &cfg).expect("connect");
        for bytes in [4usize << 10, 1 << 20, 16 << 20] {
            group.throughput(Throughput::Bytes(bytes as u64));
            group.bench_with_input(
                BenchmarkId::new(format!("all_reduce/{name}"), bytes),
                &bytes,
                |b, &n| {
                    b.iter_custom(|iters| {
                        let times = run_ranks(&mut comms, |_, c| {
                            let mut buf = vec![1u8; n];
                            let t0 = Instant::now();
                            for _ in 0..iters {
                                c.all_reduce(&mut buf, DType::U8, ReduceOp::Max)
                                    .expect("all_reduce");
                            }
                            t0.elapsed()
                        });
                        times.into_iter().max().unwrap_or_default()
                    })
                },
            );
            group.bench_with_input(
                BenchmarkId::new(format!("all_gather/{name}"), bytes),
                &bytes,
                |b, &n| {
                    b.iter_custom(|iters| {
                        let times = run_ranks(&mut comms, |_, c| {
                            let input = vec![1u8; n / 2];
                            let mut out = vec![0u8; n];
                            let t0 = Instant::now();
                            for _ in 0..iters {
                                c.all_gather(&input, &mut out, DType::U8)
                                    .expect("all_gather");
                            }
                            t0.elapsed()
                        });
                        times.into_iter().max().unwrap_or_default()
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
