//! What the integration tests share: the transport modes, deterministic
//! inputs in aligned storage, the reference reduction, and each collective
//! run on every rank with the bytes each rank ends with.
#![allow(dead_code)] // each test crate uses its own part of this module

use ringlet_core::reduce::reduce_into;
use ringlet_core::testing::run_ranks;
use ringlet_core::{Communicator, Config, DType, ReduceOp};
use std::time::Duration;

/// Shared memory with and without cross-memory attach, and TCP, over
/// staging slots of `slot_bytes` (small: many pipeline pieces / windows).
pub fn modes(slot_bytes: usize) -> Vec<(&'static str, Config)> {
    let base = Config {
        timeout: Duration::from_secs(20),
        slot_bytes,
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
pub fn data(dtype: DType, rank: usize, count: usize, salt: usize) -> Vec<u8> {
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
pub fn aligned(bytes: &[u8]) -> Vec<u64> {
    let mut v = vec![0u64; bytes.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..bytes.len()].copy_from_slice(bytes);
    v
}

pub fn view(v: &mut [u64], len: usize) -> &mut [u8] {
    &mut bytemuck::cast_slice_mut::<u64, u8>(v)[..len]
}

/// The element-wise reduction of `inputs`, computed here with the kernels.
pub fn reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
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

/// The inputs of a check: `data(dtype, r, count, salt)` for every rank r.
pub fn inputs(size: usize, dtype: DType, count: usize, salt: usize) -> Vec<Vec<u8>> {
    (0..size).map(|r| data(dtype, r, count, salt)).collect()
}

/// All-reduces `count` elements of [`inputs`] in place on every rank and
/// checks each rank's result against the reference (failures name `what`);
/// returns the inputs and the expected result.
pub fn check_all_reduce(
    comms: &mut [Communicator],
    dtype: DType,
    op: ReduceOp,
    count: usize,
    salt: usize,
    what: &str,
) -> (Vec<Vec<u8>>, Vec<u8>) {
    let inputs = inputs(comms.len(), dtype, count, salt);
    let want = reference(dtype, op, &inputs);
    let got = run_ranks(comms, |r, c| {
        let mut b = aligned(&inputs[r]);
        c.all_reduce(view(&mut b, inputs[r].len()), dtype, op)
            .unwrap();
        view(&mut b, inputs[r].len()).to_vec()
    });
    let what = format!("{what} {dtype:?} {op:?} count={count}");
    assert_ranks(&got, |_| &want[..], &what);
    (inputs, want)
}

/// All-gathers `count` elements of [`inputs`] from every rank and checks
/// that every rank ends with them all in rank order.
pub fn check_all_gather(comms: &mut [Communicator], dtype: DType, count: usize, what: &str) {
    let (size, n) = (comms.len(), count * dtype.size());
    let inputs = inputs(size, dtype, count, 1);
    let got = run_ranks(comms, |r, c| {
        let input = aligned(&inputs[r]);
        let mut out = vec![0u64; (n * size).div_ceil(8)];
        let inp = &bytemuck::cast_slice::<u64, u8>(&input)[..n];
        c.all_gather(inp, view(&mut out, n * size), dtype).unwrap();
        view(&mut out, n * size).to_vec()
    });
    let want = inputs.concat();
    let what = format!("all_gather {what} {dtype:?} count={count}");
    assert_ranks(&got, |_| &want[..], &what);
}

/// Reduce-scatters `count` elements per rank of [`inputs`] and checks that
/// rank r ends with block r of the reference.
pub fn check_reduce_scatter(
    comms: &mut [Communicator],
    dtype: DType,
    op: ReduceOp,
    count: usize,
    what: &str,
) {
    let (size, n) = (comms.len(), count * dtype.size());
    let inputs = inputs(size, dtype, count * size, 2);
    let full = reference(dtype, op, &inputs);
    let got = run_ranks(comms, |r, c| {
        let input = aligned(&inputs[r]);
        let mut out = vec![0u64; n.div_ceil(8)];
        let inp = &bytemuck::cast_slice::<u64, u8>(&input)[..n * size];
        c.reduce_scatter(inp, view(&mut out, n), dtype, op).unwrap();
        view(&mut out, n).to_vec()
    });
    let what = format!("reduce_scatter {what} {dtype:?} {op:?} count={count}");
    assert_ranks(&got, |r| &full[r * n..(r + 1) * n], &what);
}

/// Broadcasts `count` elements of [`inputs`] from `root` (then, with
/// `barrier`, waits at a barrier on every rank) and checks that every rank
/// ends with the root's.
pub fn check_broadcast(
    comms: &mut [Communicator],
    dtype: DType,
    count: usize,
    salt: usize,
    root: usize,
    barrier: bool,
    what: &str,
) {
    let n = count * dtype.size();
    let inputs = inputs(comms.len(), dtype, count, salt);
    let got = run_ranks(comms, |r, c| {
        let mut b = aligned(&inputs[r]);
        c.broadcast(view(&mut b, n), dtype, root).unwrap();
        if barrier {
            c.barrier().unwrap();
        }
        view(&mut b, n).to_vec()
    });
    let what = format!("broadcast {what} {dtype:?} count={count} root={root}");
    assert_ranks(&got, |_| &inputs[root][..], &what);
}

/// Asserts that rank r ended with `want(r)`, naming `what` and the rank.
pub fn assert_ranks<'a>(got: &[Vec<u8>], want: impl Fn(usize) -> &'a [u8], what: &str) {
    for (r, g) in got.iter().enumerate() {
        assert!(g[..] == *want(r), "{what} rank={r}");
    }
}
