//! Every collective over every transport mode, world sizes 1..4, every dtype
//! and reduce op, element counts 0, 1, odd and uneven, checked against a
//! reference computed rank by rank with the reduction kernels.

use ringlet_core::reduce::reduce_into;
use ringlet_core::testing::{local_group, run_ranks};
use ringlet_core::{Config, DType, Error, ReduceOp, ALL_DTYPES, ALL_OPS};
use std::time::Duration;

fn modes() -> Vec<(&'static str, Config)> {
    let base = Config {
        timeout: Duration::from_secs(20),
        slot_bytes: 64 << 10, // small slots: many pipeline pieces
        small_bytes: 1 << 10,
        cma_threshold: 8 << 10,
        ..Config::default()
    };
    vec![
        ("shm+cma", base.clone()),
        (
            "shm",
            Config {
                cma: false,
                ..base.clone()
            },
        ),
        (
            "tcp",
            Config {
                force_tcp: true,
                ..base
            },
        ),
    ]
}

/// Deterministic small values (exact in every dtype, products stay small).
fn data(dtype: DType, rank: usize, count: usize, salt: usize) -> Vec<u8> {
    let v = |i: usize| ((rank * 31 + i * 17 + salt) % 7) as i64 - 3;
    let mut out = Vec::with_capacity(count * dtype.size());
    for i in 0..count {
        let x = v(i);
        match dtype {
            DType::F32 => out.extend((x as f32).to_le_bytes()),
            DType::F64 => out.extend((x as f64).to_le_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(x as f64).to_le_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(x as f64).to_le_bytes()),
            DType::I8 => out.push(x as i8 as u8),
            DType::U8 => out.push((x + 3) as u8),
            DType::I16 => out.extend((x as i16).to_le_bytes()),
            DType::I32 => out.extend((x as i32).to_le_bytes()),
            DType::I64 => out.extend(x.to_le_bytes()),
            DType::Bool => out.push((x & 1) as u8),
        }
    }
    out
}

/// Byte buffers in Vec<u64> storage so they are aligned for every dtype.
fn aligned(bytes: &[u8]) -> Vec<u64> {
    let mut v = vec![0u64; bytes.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..bytes.len()].copy_from_slice(bytes);
    v
}

fn view(v: &mut [u64], len: usize) -> &mut [u8] {
    &mut bytemuck::cast_slice_mut::<u64, u8>(v)[..len]
}

fn reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let srcs: Vec<Vec<u64>> = inputs.iter().map(|b| aligned(b)).collect();
    let len = inputs[0].len();
    let views: Vec<&[u8]> = srcs
        .iter()
        .map(|s| &bytemuck::cast_slice::<u64, u8>(s)[..len])
        .collect();
    let mut out = vec![0u64; len.div_ceil(8)];
    reduce_into(dtype, op, view(&mut out, len), &views).unwrap();
    bytemuck::cast_slice::<u64, u8>(&out)[..len].to_vec()
}

const COUNTS: [usize; 5] = [0, 1, 7, 1001, 70_001];

#[test]
fn all_reduce_every_mode_size_dtype_op() {
    for (name, cfg) in modes() {
        for size in 1..=4 {
            let mut comms = local_group(size, &cfg).unwrap();
            let expect_transport = if size == 1 { "local" } else { name };
            assert_eq!(comms[0].transport(), expect_transport);
            for dtype in ALL_DTYPES {
                for op in ALL_OPS {
                    if op.check(dtype).is_err() {
                        continue;
                    }
                    for count in COUNTS {
                        let inputs: Vec<Vec<u8>> =
                            (0..size).map(|r| data(dtype, r, count, 0)).collect();
                        let want = reference(dtype, op, &inputs);
                        let got = run_ranks(&mut comms, |r, c| {
                            let mut b = aligned(&inputs[r]);
                            c.all_reduce(view(&mut b, inputs[r].len()), dtype, op)
                                .unwrap();
                            view(&mut b, inputs[r].len()).to_vec()
                        });
                        for (r, g) in got.iter().enumerate() {
                            assert!(
                                *g == want,
                                "{name} size={size} {dtype:?} {op:?} count={count} rank={r}"
                            );
                        }
                        // the out-of-place form: same result, input untouched
                        let got = run_ranks(&mut comms, |r, c| {
                            let mut b = aligned(&inputs[r]);
                            let mut o = aligned(&vec![0u8; inputs[r].len()]);
                            let n = inputs[r].len();
                            c.all_reduce_into(view(&mut b, n), view(&mut o, n), dtype, op)
                                .unwrap();
                            assert!(*view(&mut b, n) == inputs[r][..], "input changed");
                            view(&mut o, n).to_vec()
                        });
                        for (r, g) in got.iter().enumerate() {
                            assert!(
                                *g == want,
                                "into: {name} size={size} {dtype:?} {op:?} count={count} rank={r}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn all_gather_reduce_scatter_broadcast() {
    for (name, cfg) in modes() {
        for size in 1..=4 {
            let mut comms = local_group(size, &cfg).unwrap();
            for dtype in [DType::F32, DType::BF16, DType::I64, DType::Bool, DType::U8] {
                for count in COUNTS {
                    let n = count * dtype.size();
                    // all_gather
                    let inputs: Vec<Vec<u8>> =
                        (0..size).map(|r| data(dtype, r, count, 1)).collect();
                    let want: Vec<u8> = inputs.concat();
                    let got = run_ranks(&mut comms, |r, c| {
                        let input = aligned(&inputs[r]);
                        let mut out = vec![0u64; (n * size).div_ceil(8)];
                        let inp = &bytemuck::cast_slice::<u64, u8>(&input)[..n];
                        c.all_gather(inp, view(&mut out, n * size), dtype).unwrap();
                        view(&mut out, n * size).to_vec()
                    });
                    for g in &got {
                        assert!(
                            *g == want,
                            "all_gather {name} size={size} {dtype:?} count={count}"
                        );
                    }
                    // reduce_scatter (sum, and max)
                    for op in [ReduceOp::Sum, ReduceOp::Max] {
                        let inputs: Vec<Vec<u8>> =
                            (0..size).map(|r| data(dtype, r, count * size, 2)).collect();
                        let full = reference(dtype, op, &inputs);
                        let got = run_ranks(&mut comms, |r, c| {
                            let input = aligned(&inputs[r]);
                            let mut out = vec![0u64; n.div_ceil(8)];
                            let inp = &bytemuck::cast_slice::<u64, u8>(&input)[..n * size];
                            c.reduce_scatter(inp, view(&mut out, n), dtype, op).unwrap();
                            view(&mut out, n).to_vec()
                        });
                        for (r, g) in got.iter().enumerate() {
                            assert!(*g == full[r * n..(r + 1) * n], "reduce_scatter {name} size={size} {dtype:?} {op:?} count={count} rank={r}");
                        }
                    }
                    // broadcast from the last rank
                    let root = size - 1;
                    let inputs: Vec<Vec<u8>> =
                        (0..size).map(|r| data(dtype, r, count, 3)).collect();
                    let got = run_ranks(&mut comms, |r, c| {
                        let mut b = aligned(&inputs[r]);
                        c.broadcast(view(&mut b, n), dtype, root).unwrap();
                        c.barrier().unwrap();
                        view(&mut b, n).to_vec()
                    });
                    for g in &got {
                        assert!(
                            *g == inputs[root],
                            "broadcast {name} size={size} {dtype:?} count={count}"
                        );
                    }
                }
            }
        }
    }
}

/// Small collectives back to back, so ranks run ahead of each other while
/// the staging windows rotate and wrap (32 KiB slots: a 16 KiB half holds
/// at most 4 windows).
#[test]
fn back_to_back_small_collectives_through_rotating_windows() {
    let cfg = Config {
        timeout: Duration::from_secs(20),
        slot_bytes: 32 << 10,
        cma: false,
        ..Config::default()
    };
    for size in [2, 3] {
        let mut comms = local_group(size, &cfg).unwrap();
        let failures = run_ranks(&mut comms, |r, c| {
            let mut bad = Vec::new();
            for it in 0..300usize {
                let count = [1, 100, 1024, 1500, 3000][it % 5];
                let mine = |rank: usize, i: usize| ((rank * 7 + i * 3 + it) % 11) as f32;
                let mut b: Vec<f32> = (0..count).map(|i| mine(r, i)).collect();
                c.all_reduce(bytemuck::cast_slice_mut(&mut b), DType::F32, ReduceOp::Sum)
                    .unwrap();
                let want: Vec<f32> = (0..count)
                    .map(|i| (0..size).map(|q| mine(q, i)).sum())
                    .collect();
                if b != want {
                    bad.push(format!("all_reduce it={it} count={count}"));
                }
                let part: Vec<f32> = (0..count).map(|i| mine(r, i)).collect();
                let mut all = vec![0f32; count * size];
                c.all_gather(
                    bytemuck::cast_slice(&part),
                    bytemuck::cast_slice_mut(&mut all),
                    DType::F32,
                )
                .unwrap();
                let want: Vec<f32> = (0..size)
                    .flat_map(|q| (0..count).map(move |i| mine(q, i)))
                    .collect();
                if all != want {
                    bad.push(format!("all_gather it={it} count={count}"));
                }
                let mut out = vec![0f32; count / size];
                let m = out.len();
                c.reduce_scatter(
                    bytemuck::cast_slice(&all[..m * size]),
                    bytemuck::cast_slice_mut(&mut out),
                    DType::F32,
                    ReduceOp::Sum,
                )
                .unwrap();
                let want: Vec<f32> = all[r * m..(r + 1) * m]
                    .iter()
                    .map(|x| x * size as f32)
                    .collect();
                if out != want {
                    bad.push(format!("reduce_scatter it={it} count={count}"));
                }
                let root = it % size;
                let mut bc: Vec<f32> = (0..count).map(|i| mine(r, i)).collect();
                c.broadcast(bytemuck::cast_slice_mut(&mut bc), DType::F32, root)
                    .unwrap();
                let want: Vec<f32> = (0..count).map(|i| mine(root, i)).collect();
                if bc != want {
                    bad.push(format!("broadcast it={it} count={count} root={root}"));
                }
            }
            bad
        });
        for (r, bad) in failures.iter().enumerate() {
            assert!(bad.is_empty(), "size={size} rank={r}: {bad:?}");
        }
    }
}

#[test]
fn mismatched_calls_fail_on_every_rank_and_the_group_stays_usable() {
    for (name, cfg) in modes() {
        let mut comms = local_group(3, &cfg).unwrap();
        let got = run_ranks(&mut comms, |r, c| {
            let mut b = vec![0u64; 4];
            let len = if r == 1 { 16 } else { 32 };
            c.all_reduce(view(&mut b, len), DType::F32, ReduceOp::Sum)
        });
        for (r, g) in got.iter().enumerate() {
            match g {
                Err(Error::Mismatch { rank, detail }) => {
                    assert_eq!(*rank, r);
                    assert!(
                        detail.contains("rank 1 called all_reduce(#1, count=4"),
                        "{name}: {detail}"
                    );
                }
                other => panic!("{name}: rank {r} got {other:?}"),
            }
        }
        // Still in step: a correct call works afterwards.
        let got = run_ranks(&mut comms, |_, c| {
            let mut b = aligned(&1.0f32.to_le_bytes());
            c.all_reduce(view(&mut b, 4), DType::F32, ReduceOp::Sum)
                .unwrap();
            f32::from_le_bytes(view(&mut b, 4).try_into().unwrap())
        });
        assert_eq!(got, vec![3.0; 3], "{name}");
    }
}

#[test]
fn a_missing_rank_times_out_naming_it() {
    for (name, mut cfg) in modes() {
        cfg.timeout = Duration::from_millis(500);
        let mut comms = local_group(3, &cfg).unwrap();
        let got = run_ranks(&mut comms, |r, c| if r == 2 { Ok(()) } else { c.barrier() });
        for (r, g) in got.iter().enumerate().take(2) {
            match g {
                Err(Error::Timeout { peer, .. }) => assert_eq!(*peer, 2, "{name} rank {r}"),
                Err(Error::PeerLost { .. }) if name == "tcp" => {}
                other => panic!("{name}: rank {r} got {other:?}"),
            }
        }
        // The communicator is now unusable, with a clear error.
        let mut b = [0u8; 4];
        let e = comms[0]
            .all_reduce(&mut b, DType::U8, ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(e, Error::Aborted { .. }), "{name}: {e:?}");
    }
}

#[test]
fn invalid_arguments() {
    let mut comms = local_group(1, &Config::default()).unwrap();
    let c = &mut comms[0];
    let mut b = [0u8; 6];
    assert!(matches!(
        c.all_reduce(&mut b, DType::F32, ReduceOp::Sum),
        Err(Error::InvalidArgument(_))
    ));
    let mut f = [0u8; 8];
    assert!(matches!(
        c.all_reduce(&mut f, DType::F32, ReduceOp::And),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        c.broadcast(&mut f, DType::U8, 1),
        Err(Error::InvalidArgument(_))
    ));
    let mut out = [0u8; 4];
    assert!(matches!(
        c.all_gather(&f, &mut out, DType::U8),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn small_tcp_all_reduce_up_to_16_ranks() {
    // Recursive doubling from 4 ranks: powers of two and the folds around them.
    let (_, cfg) = modes()
        .into_iter()
        .find(|(name, _)| *name == "tcp")
        .expect("a tcp mode");
    for size in [5, 6, 7, 8, 9, 12, 16] {
        let mut comms = local_group(size, &cfg).unwrap();
        for (dtype, op) in [
            (DType::F32, ReduceOp::Sum),
            (DType::I64, ReduceOp::Mul),
            (DType::BF16, ReduceOp::Max),
            (DType::I32, ReduceOp::Xor),
            (DType::Bool, ReduceOp::Or),
        ] {
            for count in [0, 1, 7, 1001] {
                let inputs: Vec<Vec<u8>> = (0..size).map(|r| data(dtype, r, count, 3)).collect();
                let want = reference(dtype, op, &inputs);
                let got = run_ranks(&mut comms, |r, c| {
                    let mut b = aligned(&inputs[r]);
                    c.all_reduce(view(&mut b, inputs[r].len()), dtype, op)
                        .unwrap();
                    view(&mut b, inputs[r].len()).to_vec()
                });
                for (r, g) in got.iter().enumerate() {
                    assert!(
                        *g == want,
                        "size={size} {dtype:?} {op:?} count={count} rank={r}"
                    );
                }
            }
        }
    }
}
