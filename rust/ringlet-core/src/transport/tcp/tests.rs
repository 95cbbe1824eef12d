//! The TCP transport's tests: meshes of threads on loopback.

use super::*;
use crate::dtype::{DType, ReduceOp};
use crate::transport::OpKind;

/// A mesh of `p` ranks on loopback, one per thread, each running
/// `f(rank, mesh)`: the full mesh (`lazy` false) or streams on demand;
/// the results in rank order.
fn meshes_of<T: Send>(p: usize, lazy: bool, f: impl Fn(usize, &TcpMesh) -> T + Sync) -> Vec<T> {
    let listeners: Vec<TcpListener> = (0..p)
        .map(|_| listen("127.0.0.1:0").expect("listen"))
        .collect();
    let addrs: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr().expect("local_addr").to_string())
        .collect();
    let token = 0xa9ee_u64 ^ std::process::id() as u64;
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let addrs = &addrs;
                s.spawn(move || {
                    let mesh = if lazy {
                        TcpMesh::connect_lazily(rank, addrs, &l, token)
                    } else {
                        TcpMesh::connect(rank, addrs, &l, token, Duration::from_secs(20))
                    }
                    .expect("connect");
                    drop(l); // the mesh keeps what it needs
                    f(rank, &mesh)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

fn call(seq: u64) -> OpDesc {
    OpDesc {
        seq,
        kind: OpKind::AllReduce,
        dtype: DType::F32,
        op: Some(ReduceOp::Sum),
        count: 1024,
        root: 0,
        addr: 0,
    }
}

/// The distinct peers of `rank`'s recursive-doubling steps.
fn doubling_partners(p: usize, rank: usize) -> Vec<usize> {
    let mut v: Vec<usize> = doubling_peers(p, rank)
        .into_iter()
        .map(|s| match s {
            Step::Swap(x) | Step::Give(x) | Step::Take(x) => x,
        })
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

#[test]
fn doubling_steps_pair_up_and_reach_every_rank() {
    for p in 2..=33 {
        // every send has its receive on the peer, in the same order
        let steps: Vec<Vec<Step>> = (0..p).map(|r| doubling_peers(p, r)).collect();
        for (r, mine) in steps.iter().enumerate() {
            for (k, s) in mine.iter().enumerate() {
                let (peer, want) = match *s {
                    Step::Swap(x) => (x, Step::Swap(r)),
                    Step::Give(x) => (x, Step::Take(r)),
                    Step::Take(x) => (x, Step::Give(r)),
                };
                let theirs: Vec<&Step> = steps[peer].iter().filter(|t| **t == want).collect();
                assert_eq!(theirs.len(), 1, "p={p} rank {r} step {k}");
            }
        }
        // a simulation: the ranks whose value each rank holds
        let mut held: Vec<std::collections::BTreeSet<usize>> =
            (0..p).map(|r| std::iter::once(r).collect()).collect();
        let mut pos = vec![0usize; p];
        loop {
            let mut moved = false;
            for r in 0..p {
                let Some(&s) = steps[r].get(pos[r]) else {
                    continue;
                };
                let peer = match s {
                    Step::Swap(x) | Step::Give(x) | Step::Take(x) => x,
                };
                let Some(&t) = steps[peer].get(pos[peer]) else {
                    continue;
                };
                let back = match t {
                    Step::Swap(x) | Step::Give(x) | Step::Take(x) => x,
                };
                if back != r || peer < r && matches!(s, Step::Swap(_)) {
                    continue;
                }
                match (s, t) {
                    (Step::Swap(_), Step::Swap(_)) => {
                        let u: std::collections::BTreeSet<usize> =
                            held[r].union(&held[peer]).copied().collect();
                        held[r] = u.clone();
                        held[peer] = u;
                    }
                    (Step::Give(_), Step::Take(_)) => {
                        let u = held[r].clone();
                        held[peer].extend(u);
                    }
                    (Step::Take(_), Step::Give(_)) => continue,
                    _ => panic!("p={p}: rank {r} {s:?} meets rank {peer} {t:?}"),
                }
                pos[r] += 1;
                pos[peer] += 1;
                moved = true;
            }
            if !moved {
                break;
            }
        }
        for r in 0..p {
            assert_eq!(pos[r], steps[r].len(), "p={p}: rank {r} stuck");
            assert_eq!(held[r].len(), p, "p={p}: rank {r} holds {:?}", held[r]);
            let sends = steps[r]
                .iter()
                .filter(|s| !matches!(s, Step::Take(_)))
                .count() as u64;
            assert!(sends <= log2_ceil(p) + 1, "p={p} rank {r}: {sends} sends");
        }
    }
}

fn log2_ceil(p: usize) -> u64 {
    u64::from(usize::BITS - (p - 1).leading_zeros())
}

#[test]
fn agreement_takes_log_p_messages_and_names_who_disagrees() {
    agreement_in_log_p(false);
}

#[test]
fn agreement_on_streams_opened_on_demand() {
    agreement_in_log_p(true);
}

fn agreement_in_log_p(lazy: bool) {
    let timeout = Duration::from_secs(20);
    for p in (2..=9).chain([16]) {
        // the descriptors of three calls: all agree; rank p-1 disagrees;
        // ranks 1 and p-1 disagree (in two ways); then all agree again
        let calls = |rank: usize| -> Vec<OpDesc> {
            let odd = |d: OpDesc, who: &[usize], how: OpDesc| {
                if who.contains(&rank) {
                    how
                } else {
                    d
                }
            };
            vec![
                // only the address (each rank's own) differs
                OpDesc {
                    addr: 0x1000 * rank as u64,
                    ..call(1)
                },
                odd(
                    call(2),
                    &[p - 1],
                    OpDesc {
                        count: 7,
                        ..call(2)
                    },
                ),
                odd(
                    odd(
                        call(3),
                        &[1],
                        OpDesc {
                            dtype: DType::BF16,
                            ..call(3)
                        },
                    ),
                    &[p - 1],
                    OpDesc {
                        kind: OpKind::Broadcast,
                        op: None,
                        ..call(3)
                    },
                ),
                call(4),
            ]
        };
        let out = meshes_of(p, lazy, |rank, mesh| {
            let mut results = Vec::new();
            let mut sent = Vec::new();
            let mut streams = vec![mesh.open_streams()];
            for d in calls(rank) {
                let before = mesh.agree_messages();
                results.push(mesh.agree(&d, timeout));
                sent.push(mesh.agree_messages() - before);
                streams.push(mesh.open_streams());
            }
            (results, sent, streams)
        });
        for (rank, (results, sent, streams)) in out.iter().enumerate() {
            if lazy {
                // none at creation; the doubling partners (rank xor 2^k
                // for a power of two, else also the folding partner)
                // after an agreeing call; every peer once a mismatch
                // needed the full exchange
                assert_eq!(streams[0], 0, "p={p}");
                let partners: std::collections::BTreeSet<usize> = if p > FULL_EXCHANGE_UP_TO {
                    doubling_partners(p, rank).into_iter().collect()
                } else {
                    (0..p).filter(|&q| q != rank).collect()
                };
                assert_eq!(streams[1], partners.len(), "p={p} rank {rank}");
                assert!(partners.len() as u64 <= log2_ceil(p), "p={p} rank {rank}");
                if p.is_power_of_two() {
                    let xor: std::collections::BTreeSet<usize> =
                        (0..log2_ceil(p)).map(|k| rank ^ (1 << k)).collect();
                    assert_eq!(partners, xor, "p={p} rank {rank}");
                }
                assert_eq!(streams[2], p - 1, "p={p}");
            }
            for (i, r) in results.iter().enumerate() {
                // what the full exchange of descriptors raises
                let all: Vec<OpDesc> = (0..p).map(|q| calls(q)[i]).collect();
                let want = check_agreement(rank, &all);
                assert_eq!(*r, want, "p={p} rank {rank} call {i}");
            }
            assert!(results[0].is_ok() && results[3].is_ok(), "p={p}");
            for (i, r) in results.iter().enumerate().skip(1).take(2) {
                let Err(Error::Mismatch { detail, .. }) = r else {
                    panic!("p={p} rank {rank} call {i}: {r:?}");
                };
                assert!(
                    detail.contains(&format!("rank {} called", p - 1)),
                    "{detail}"
                );
            }
            // agreeing calls: at most ⌈log2 p⌉ + 1 messages each
            for i in [0, 3] {
                assert!(
                    sent[i] <= log2_ceil(p) + 1,
                    "p={p} rank {rank}: {} messages",
                    sent[i]
                );
            }
            if p > FULL_EXCHANGE_UP_TO && p.is_power_of_two() {
                assert_eq!(sent[0], log2_ceil(p), "p={p}");
                // a mismatch then takes the full exchange, to name the ranks
                assert_eq!(sent[1], log2_ceil(p) + p as u64 - 1, "p={p}");
            }
        }
    }
}

#[test]
fn streams_open_on_demand_and_a_peer_gone_before_it_connected_is_named() {
    let t = Duration::from_secs(20);
    // an exchange in which every rank sends to every other, in the order
    // that makes each wait on peers that have not connected yet
    let out = meshes_of(6, true, |rank, mesh| {
        let mine: Vec<Vec<u8>> = (0..6)
            .map(|q| vec![(rank * 6 + q) as u8; 1 << 20])
            .collect();
        let mut theirs = vec![vec![0u8; 1 << 20]; 6];
        let mut x: Vec<Xfer> = Vec::new();
        for (q, b) in theirs
            .iter_mut()
            .enumerate()
            .rev()
            .filter(|(q, _)| *q != rank)
        {
            x.push(Xfer::recv(q, b));
        }
        for (q, b) in mine.iter().enumerate().filter(|(q, _)| *q != rank) {
            x.push(Xfer::send(q, b));
        }
        mesh.transfer(&mut x, "all_to_all", t).expect("all_to_all");
        drop(x);
        let ok = theirs
            .iter()
            .enumerate()
            .all(|(q, b)| q == rank || b.iter().all(|&v| v == (q * 6 + rank) as u8));
        (ok, mesh.open_streams())
    });
    assert!(out.iter().all(|&(ok, n)| ok && n == 5), "{out:?}");

    // rank 2 closes its mesh without ever connecting: ranks 0 and 1
    // (which wait for it to dial) learn it from the refused probe, rank 3
    // (which dials it) at once; none waits for the timeout
    let out = meshes_of(4, true, |rank, mesh| {
        let start = Instant::now();
        if rank == 2 {
            return (None, start.elapsed());
        }
        let mut b = [0u8; 8];
        let r = mesh.transfer(&mut [Xfer::recv(2, &mut b)], "broadcast", t);
        (Some(r), start.elapsed())
    });
    for (rank, (r, took)) in out.iter().enumerate() {
        let Some(r) = r else { continue };
        assert!(
            matches!(
                r,
                Err(Error::PeerLost {
                    peer: 2,
                    cause: Cause::Exited,
                    ..
                })
            ),
            "rank {rank}: {r:?}"
        );
        assert!(*took < Duration::from_secs(5), "rank {rank}: {took:?}");
    }
}

#[test]
fn many_peers_dialing_one_rank_at_once_all_get_through() {
    // 79 ranks dial rank 0 together, more than the hellos it keeps
    // waiting at once (MAX_PENDING_HELLOS): each hello is read as its
    // connection is accepted, so none is dropped for a later one
    let p = 80;
    let t = Duration::from_secs(30);
    let out = meshes_of(p, true, |rank, mesh| {
        if rank == 0 {
            let mut got = vec![[0u8; 8]; p];
            let mut x: Vec<Xfer> = got
                .iter_mut()
                .enumerate()
                .skip(1)
                .map(|(q, b)| Xfer::recv(q, b))
                .collect();
            mesh.transfer(&mut x, "gather", t).expect("gather");
            drop(x);
            got.iter()
                .enumerate()
                .skip(1)
                .all(|(q, b)| *b == (q as u64).to_le_bytes())
        } else {
            let mine = (rank as u64).to_le_bytes();
            mesh.transfer(&mut [Xfer::send(0, &mine)], "gather", t)
                .is_ok()
        }
    });
    assert!(out.iter().all(|ok| *ok), "{out:?}");
}
