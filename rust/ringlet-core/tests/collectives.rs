//! Every collective over every transport mode, world sizes 1..4, every dtype
//! and reduce op, element counts 0, 1, odd and uneven, checked against a
//! reference computed rank by rank with the reduction kernels.

mod common;

use common::{aligned, modes, view};
use ringlet_core::testing::{local_group, run_ranks};
use ringlet_core::{Config, DType, Error, ReduceOp, ALL_DTYPES, ALL_OPS};
use std::time::Duration;

const COUNTS: [usize; 5] = [0, 1, 7, 1001, 70_001];

#[test]
fn all_reduce_every_mode_size_dtype_op() {
    for (name, cfg) in modes(64 << 10) {
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
                        let what = format!("{name} size={size}");
                        let (inputs, want) =
                            common::check_all_reduce(&mut comms, dtype, op, count, 0, &what);
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
                        common::assert_ranks(
                            &got,
                            |_| &want[..],
                            &format!("into: {name} size={size} {dtype:?} {op:?} count={count}"),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn all_gather_reduce_scatter_broadcast() {
    for (name, cfg) in modes(64 << 10) {
        for size in 1..=4 {
            let mut comms = local_group(size, &cfg).unwrap();
            for dtype in [DType::F32, DType::BF16, DType::I64, DType::Bool, DType::U8] {
                for count in COUNTS {
                    let what = format!("{name} size={size}");
                    common::check_all_gather(&mut comms, dtype, count, &what);
                    // reduce_scatter (sum, and max)
                    for op in [ReduceOp::Sum, ReduceOp::Max] {
                        common::check_reduce_scatter(&mut comms, dtype, op, count, &what);
                    }
                    // broadcast from the last rank
                    common::check_broadcast(&mut comms, dtype, count, 3, size - 1, true, &what);
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
    for (name, cfg) in modes(64 << 10) {
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
    for (name, mut cfg) in modes(64 << 10) {
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
    let (_, cfg) = modes(64 << 10)
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
                let what = format!("size={size}");
                common::check_all_reduce(&mut comms, dtype, op, count, 3, &what);
            }
        }
    }
}

/// Runs list form `op` on every rank: rank r sends the entries `ins(r)`
/// and receives entries of the byte lengths `outs(r)`; each rank's outputs,
/// back to back.
fn run_list(
    comms: &mut [ringlet_core::Communicator],
    op: ringlet_core::collective::ListOp,
    ins: impl Fn(usize) -> Vec<Vec<u8>> + Sync,
    outs: impl Fn(usize) -> Vec<usize> + Sync,
) -> Vec<ringlet_core::Result<Vec<u8>>> {
    run_ranks(comms, |r, c| {
        let entries = ins(r);
        let lens: Vec<usize> = entries.iter().map(Vec::len).collect();
        let out_lens = outs(r);
        let mut recv = vec![0u8; out_lens.iter().sum()];
        c.list_collective(
            op,
            &entries.concat(),
            &lens,
            &mut recv,
            &out_lens,
            DType::U8,
        )
        .map(|()| recv)
    })
}

/// The list forms (`Communicator::list_collective`): every form, even and
/// ragged lists, on shared memory and TCP; a size mismatch names the form.
#[test]
fn list_forms_stage_lists_through_one_collective() {
    use ringlet_core::collective::ListOp;
    // rank r's entry for peer j: `len(r, j)` bytes of `val(r, j, i)`
    let val = |r: usize, j: usize, i: usize| (r * 50 + j * 7 + i) as u8;
    let p = 3;
    for (name, cfg) in modes(64 << 10) {
        let mut comms = local_group(p, &cfg).unwrap();
        for ragged in [false, true] {
            let len = move |r: usize, j: usize| if ragged { 1 + r + 2 * j } else { 4 };
            let entry =
                move |r: usize, j: usize| (0..len(r, j)).map(|i| val(r, j, i)).collect::<Vec<u8>>();
            // every rank's entries for peer j, back to back in rank order
            let from_all = move |j: usize| (0..p).flat_map(|r| entry(r, j)).collect::<Vec<u8>>();
            let what = format!("{name} ragged={ragged}");
            let got = run_list(
                &mut comms,
                ListOp::AllGather,
                |r| vec![entry(r, 0)],
                |_| (0..p).map(|j| len(j, 0)).collect(),
            );
            for g in got {
                assert_eq!(g.unwrap(), from_all(0), "{what}: all_gather");
            }
            let got = run_list(
                &mut comms,
                ListOp::AllToAll,
                |r| (0..p).map(|j| entry(r, j)).collect(),
                |r| (0..p).map(|j| len(j, r)).collect(),
            );
            for (r, g) in got.into_iter().enumerate() {
                assert_eq!(g.unwrap(), from_all(r), "{what}: all_to_all rank {r}");
            }
            let got = run_list(
                &mut comms,
                ListOp::Gather { root: 1 },
                |r| vec![entry(r, 0)],
                |r| {
                    if r == 1 {
                        (0..p).map(|j| len(j, 0)).collect()
                    } else {
                        vec![]
                    }
                },
            );
            assert_eq!(got[1].as_ref().unwrap(), &from_all(0), "{what}: gather");
            let got = run_list(
                &mut comms,
                ListOp::Scatter { root: 2 },
                |r| {
                    if r == 2 {
                        (0..p).map(|j| entry(2, j)).collect()
                    } else {
                        vec![]
                    }
                },
                |r| vec![len(2, r)],
            );
            for (r, g) in got.into_iter().enumerate() {
                assert_eq!(g.unwrap(), entry(2, r), "{what}: scatter");
            }
            // max over ranks: block j of every rank holds len(0, j) bytes
            let got = run_list(
                &mut comms,
                ListOp::ReduceScatter(ReduceOp::Max),
                |r| {
                    (0..p)
                        .map(|j| (0..len(0, j)).map(|i| val(r, j, i)).collect())
                        .collect()
                },
                |r| vec![len(0, r)],
            );
            for (r, g) in got.into_iter().enumerate() {
                let want: Vec<u8> = (0..len(0, r)).map(|i| val(p - 1, r, i)).collect();
                assert_eq!(g.unwrap(), want, "{what}: reduce_scatter rank {r}");
            }
        }
        // rank 0 sends 3 bytes where the root expects 2 from each: every rank
        // fails, naming gather, and the group stays usable
        let got = run_list(
            &mut comms,
            ListOp::Gather { root: 2 },
            |r| vec![vec![1u8; if r == 0 { 3 } else { 2 }]],
            |r| if r == 2 { vec![2; p] } else { vec![] },
        );
        for (r, g) in got.iter().enumerate() {
            let e = g.as_ref().expect_err("a mismatch");
            assert!(
                e.to_string()
                    .contains("gather: the ranks' tensor sizes do not fit"),
                "{name} rank {r}: {e}"
            );
        }
        let got = run_ranks(&mut comms, |_, c| c.barrier());
        assert!(
            got.iter().all(|g| g.is_ok()),
            "{name}: usable after a mismatch"
        );
    }
}
