//! All-to-all with per-peer counts and point-to-point send/recv over every
//! transport mode: block sizes of zero, one, odd and several slot windows,
//! checked byte for byte; disagreeing sizes and tags fail on both sides.

mod common;

use common::modes;
use ringlet_core::testing::{local_group, run_ranks};
use ringlet_core::{Config, DType, Error};

/// Elements rank i sends to rank j (zero for some pairs, large for others).
fn count(i: usize, j: usize, scale: usize) -> usize {
    match (i * 3 + j * 5) % 4 {
        0 => 0,
        1 => 1,
        2 => 7 * scale,
        _ => 1000 * scale + i,
    }
}

/// The value of element k of the block from rank i to rank j.
fn value(i: usize, j: usize, k: usize) -> i32 {
    (i * 1_000_000 + j * 10_000 + k) as i32
}

#[test]
fn all_to_all_v_every_mode_and_size() {
    for (name, cfg) in modes(4 << 10) {
        for p in 1..=4 {
            let mut comms = local_group(p, &cfg).unwrap();
            for scale in [1, 3] {
                let got = run_ranks(&mut comms, |r, c| {
                    let sc: Vec<usize> = (0..p).map(|j| count(r, j, scale)).collect();
                    let rc: Vec<usize> = (0..p).map(|i| count(i, r, scale)).collect();
                    let send: Vec<i32> = (0..p)
                        .flat_map(|j| (0..sc[j]).map(move |k| value(r, j, k)))
                        .collect();
                    let mut recv = vec![-1i32; rc.iter().sum()];
                    c.all_to_all_v(
                        bytemuck::cast_slice(&send),
                        &sc,
                        bytemuck::cast_slice_mut(&mut recv),
                        &rc,
                        DType::I32,
                    )
                    .map(|()| recv)
                });
                for (r, g) in got.into_iter().enumerate() {
                    let want: Vec<i32> = (0..p)
                        .flat_map(|i| (0..count(i, r, scale)).map(move |k| value(i, r, k)))
                        .collect();
                    assert_eq!(g.unwrap(), want, "{name} p={p} scale={scale} rank {r}");
                }
            }
        }
    }
}

#[test]
fn all_to_all_v_disagreeing_sizes_fail_everywhere_and_recover() {
    for (name, cfg) in modes(4 << 10) {
        let mut comms = local_group(3, &cfg).unwrap();
        let got = run_ranks(&mut comms, |r, c| {
            // Rank 2 expects 2 elements from rank 0, which sends 1.
            let sc = [1usize, 1, 1];
            let rc = if r == 2 { [2usize, 1, 1] } else { [1, 1, 1] };
            let send = [0u8; 3];
            let mut recv = vec![0u8; rc.iter().sum()];
            c.all_to_all_v(&send, &sc, &mut recv, &rc, DType::U8)
        });
        for (r, g) in got.iter().enumerate() {
            match g {
                Err(Error::Mismatch { rank, detail }) => {
                    assert_eq!(*rank, r);
                    assert!(
                        detail.contains("rank 0 sends 1 elements to rank 2, which expects 2"),
                        "{name}: {detail}"
                    );
                }
                other => panic!("{name}: rank {r} got {other:?}"),
            }
        }
        let got = run_ranks(&mut comms, |r, c| {
            let send = [r as u8; 3];
            let mut recv = [9u8; 3];
            c.all_to_all_v(&send, &[1, 1, 1], &mut recv, &[1, 1, 1], DType::U8)
                .map(|()| recv)
        });
        for g in got {
            assert_eq!(g.unwrap(), [0, 1, 2], "{name}");
        }
    }
}

#[test]
fn all_to_all_v_checks_its_arguments() {
    let mut comms = local_group(1, &Config::default()).unwrap();
    let c = &mut comms[0];
    let mut out = [0u8; 4];
    for (sc, rc) in [(vec![1usize, 1], vec![4usize]), (vec![3], vec![4])] {
        let e = c
            .all_to_all_v(&[0u8; 4], &sc, &mut out, &rc, DType::U8)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    }
}

#[test]
fn send_recv_in_order_with_tags() {
    for (name, cfg) in modes(4 << 10) {
        let mut comms = local_group(2, &cfg).unwrap();
        for len in [0usize, 1, 13, 3000, 20_000] {
            let got = run_ranks(&mut comms, |r, c| {
                let msg: Vec<i64> = (0..len as i64).map(|k| k * 3 - 7).collect();
                if r == 0 {
                    c.send(bytemuck::cast_slice(&msg), DType::I64, 1, 5)?;
                    let mut back = vec![0i64; len];
                    c.recv(bytemuck::cast_slice_mut(&mut back), DType::I64, 1, 6)?;
                    Ok(back)
                } else {
                    let mut got = vec![0i64; len];
                    c.recv(bytemuck::cast_slice_mut(&mut got), DType::I64, 0, 5)?;
                    let doubled: Vec<i64> = got.iter().map(|x| x * 2).collect();
                    c.send(bytemuck::cast_slice(&doubled), DType::I64, 0, 6)?;
                    Ok::<_, Error>(got)
                }
            });
            let want: Vec<i64> = (0..len as i64).map(|k| k * 3 - 7).collect();
            assert_eq!(got[1].as_ref().unwrap(), &want, "{name} len={len}");
            let doubled: Vec<i64> = want.iter().map(|x| x * 2).collect();
            assert_eq!(got[0].as_ref().unwrap(), &doubled, "{name} len={len}");
        }
        // A tag or size disagreement fails on both sides; the pair recovers.
        let got = run_ranks(&mut comms, |r, c| {
            let mut b = [0u8; 4];
            if r == 0 {
                c.send(&b, DType::U8, 1, 1)
            } else {
                c.recv(&mut b, DType::U8, 0, 2)
            }
        });
        for g in &got {
            match g {
                Err(Error::Mismatch { detail, .. }) => {
                    assert!(
                        detail.contains("tag=1") && detail.contains("tag=2"),
                        "{detail}"
                    )
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        let got = run_ranks(&mut comms, |r, c| {
            let mut b = [r as u8 + 1; 4];
            if r == 0 {
                c.send(&b, DType::U8, 1, 0).map(|()| b)
            } else {
                c.recv(&mut b, DType::U8, 0, 0).map(|()| b)
            }
        });
        assert_eq!(got[1].as_ref().unwrap(), &[1u8; 4], "{name}");
    }
}

#[test]
fn send_recv_needs_a_pair() {
    let mut comms = local_group(3, &Config::default()).unwrap();
    let e = comms[0].send(&[0u8; 4], DType::U8, 1, 0).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    let mut one = local_group(1, &Config::default()).unwrap();
    let e = one[0].send(&[0u8; 4], DType::U8, 0, 0).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
}

#[test]
fn pending_message_shows_the_waiting_message_without_taking_it() {
    for (name, cfg) in modes(4 << 10) {
        let mut comms = local_group(2, &cfg).unwrap();
        run_ranks(&mut comms, |r, c| {
            if r == 0 {
                c.send(bytemuck::cast_slice(&[1.5f32, 2.5, 3.5]), DType::F32, 1, 9)
                    .unwrap();
                c.send(bytemuck::cast_slice(&[7i64]), DType::I64, 1, 4)
                    .unwrap();
                return;
            }
            assert!(c.pending_message(1).is_err(), "{name}: not a peer");
            // Poll (without blocking the sender) until the first message shows.
            let first = loop {
                if let Some(m) = c.pending_message(0).unwrap() {
                    break m;
                }
                std::thread::yield_now();
            };
            assert_eq!(first, (9, 3, DType::F32), "{name}");
            assert_eq!(
                c.pending_message(0).unwrap(),
                Some(first),
                "{name}: not consumed"
            );
            let mut got = [0f32; 3];
            c.recv(bytemuck::cast_slice_mut(&mut got), DType::F32, 0, 9)
                .unwrap();
            assert_eq!(got, [1.5, 2.5, 3.5], "{name}");
            let second = loop {
                if let Some(m) = c.pending_message(0).unwrap() {
                    break m;
                }
                std::thread::yield_now();
            };
            assert_eq!(second, (4, 1, DType::I64), "{name}");
            let mut v = [0i64];
            c.recv(bytemuck::cast_slice_mut(&mut v), DType::I64, 0, 4)
                .unwrap();
            assert_eq!(v, [7], "{name}");
            assert_eq!(c.pending_message(0).unwrap(), None, "{name}: nothing left");
        });
    }
}
