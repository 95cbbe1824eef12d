//! Two-level collectives on simulated hosts (ranks are threads; each host's
//! ranks share memory, hosts talk TCP): even, uneven, interleaved and
//! three-host layouts, every dtype and reduce op, sizes from empty to
//! several pipeline pieces, checked bit for bit against a reference.

mod common;

use common::{aligned, view};
use ringlet_core::testing::{host_groups, run_ranks};
use ringlet_core::{Config, DType, Error, ReduceOp, ALL_DTYPES, ALL_OPS};
use std::time::Duration;

fn cfg() -> Config {
    Config {
        timeout: Duration::from_secs(30),
        slot_bytes: 64 << 10,
        ..Config::default()
    }
}

fn layouts() -> Vec<Vec<Vec<usize>>> {
    vec![
        vec![vec![0, 1], vec![2, 3]],
        vec![vec![0], vec![1, 2, 3]],
        vec![vec![0, 2], vec![1, 3]],
        vec![vec![0, 1], vec![2, 3], vec![4, 5]],
        vec![vec![0, 1, 2], vec![3, 4]],
        vec![vec![0], vec![1], vec![2, 3]],
        // Nine hosts: small runs take recursive doubling across hosts.
        vec![
            vec![0, 1],
            vec![2],
            vec![3],
            vec![4],
            vec![5],
            vec![6],
            vec![7],
            vec![8],
            vec![9],
        ],
    ]
}

#[test]
fn all_reduce_every_layout_dtype_op_and_size() {
    for layout in layouts() {
        let mut comms = host_groups(&layout, &cfg()).unwrap();
        for dtype in ALL_DTYPES {
            for op in ALL_OPS {
                if op.check(dtype).is_err() {
                    continue;
                }
                let counts: &[usize] = if matches!(dtype, DType::F32) && op == ReduceOp::Sum {
                    &[0, 1, 7, 1001, 70_001, 1_000_003]
                } else {
                    &[0, 5, 70_001]
                };
                for &count in counts {
                    let what = format!("{layout:?}");
                    common::check_all_reduce(&mut comms, dtype, op, count, 0, &what);
                }
            }
        }
    }
}

#[test]
fn all_gather_reduce_scatter_broadcast_every_layout() {
    for layout in layouts() {
        let size: usize = layout.iter().map(Vec::len).sum();
        let mut comms = host_groups(&layout, &cfg()).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::I64, DType::Bool, DType::U8] {
            for count in [0, 1, 7, 1001, 70_001, 400_003] {
                if count > 70_001 && dtype != DType::F32 {
                    continue;
                }
                let what = format!("{layout:?}");
                common::check_all_gather(&mut comms, dtype, count, &what);
                for op in [ReduceOp::Sum, ReduceOp::Max] {
                    if dtype == DType::Bool && op == ReduceOp::Sum {
                        continue;
                    }
                    common::check_reduce_scatter(&mut comms, dtype, op, count, &what);
                }
                for root in [0, size - 1, size / 2] {
                    common::check_broadcast(&mut comms, dtype, count, 3 + root, root, false, &what);
                }
            }
        }
    }
}

#[test]
fn ranks_that_disagree_fail_together_and_stay_usable() {
    let mut comms = host_groups(&[vec![0, 1], vec![2, 3]], &cfg()).unwrap();
    let got = run_ranks(&mut comms, |r, c| {
        let mut b = vec![0u64; 8];
        let len = if r == 3 { 32 } else { 64 };
        c.all_reduce(view(&mut b, len), DType::F32, ReduceOp::Sum)
    });
    for (r, g) in got.iter().enumerate() {
        assert!(
            matches!(g, Err(Error::Mismatch { rank, .. }) if *rank == r),
            "rank {r}: {g:?}"
        );
    }
    let got = run_ranks(&mut comms, |_, c| {
        let mut b = aligned(&2.0f32.to_le_bytes());
        c.all_reduce(view(&mut b, 4), DType::F32, ReduceOp::Sum)
            .unwrap();
        f32::from_le_bytes(view(&mut b, 4).try_into().unwrap())
    });
    assert_eq!(got, vec![8.0; 4]);
}

#[test]
fn a_rank_that_stops_mid_pipeline_is_named_on_every_rank() {
    let cfg = Config {
        timeout: Duration::from_millis(800),
        ..cfg()
    };
    let mut comms = host_groups(&[vec![0, 1], vec![2, 3]], &cfg).unwrap();
    let count = 1 << 20; // several pipeline pieces
    let got = run_ranks(&mut comms, |r, c| {
        let mut b = vec![0u64; count / 2];
        if r == 2 {
            return Ok(());
        }
        c.all_reduce(view(&mut b, count * 4), DType::F32, ReduceOp::Sum)
    });
    for (r, g) in got.iter().enumerate().filter(|(r, _)| *r != 2) {
        let culprit = match g {
            Err(Error::Timeout { peer, .. }) | Err(Error::PeerLost { peer, .. }) => *peer,
            Err(Error::Aborted {
                origin: Some((p, _)),
                ..
            }) => *p,
            other => panic!("rank {r}: {other:?}"),
        };
        assert_eq!(culprit, 2, "rank {r}: {g:?} all: {got:?}");
    }
}

#[test]
fn all_to_all_every_layout_with_uneven_blocks() {
    for layout in layouts() {
        let p: usize = layout.iter().map(Vec::len).sum();
        let mut comms = host_groups(&layout, &cfg()).unwrap();
        for scale in [0usize, 1, 3, 20_000] {
            // Rank i sends (i + 2j) * scale + j elements to rank j.
            let m = |i: usize, j: usize| (i + 2 * j) * scale + j;
            let dtype = DType::I32;
            let block = |i: usize, j: usize| -> Vec<u8> {
                (0..m(i, j))
                    .flat_map(|k| ((i * 1000 + j * 10 + k) as i32).to_le_bytes())
                    .collect()
            };
            let got = run_ranks(&mut comms, |r, c| {
                let send: Vec<u8> = (0..p).flat_map(|j| block(r, j)).collect();
                let sc: Vec<usize> = (0..p).map(|j| m(r, j)).collect();
                let rc: Vec<usize> = (0..p).map(|i| m(i, r)).collect();
                let mut recv = vec![0u8; rc.iter().sum::<usize>() * 4];
                c.all_to_all_v(&send, &sc, &mut recv, &rc, dtype).unwrap();
                recv
            });
            for (r, g) in got.iter().enumerate() {
                let want: Vec<u8> = (0..p).flat_map(|i| block(i, r)).collect();
                assert!(*g == want, "{layout:?} scale={scale} rank={r}");
            }
        }
    }
}
