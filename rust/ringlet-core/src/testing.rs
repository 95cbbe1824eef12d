//! Helpers to run a communicator per thread inside one process (Rust tests and
//! benchmarks): ranks are threads, the peer table is built in memory. Behind
//! the `testing` cargo feature (or `cfg(test)`); the crate's integration
//! tests and benchmarks turn it on through a dev-dependency on the crate itself.

use crate::error::Result;
use crate::group::{Communicator, Config};
use crate::transport::tcp::listen;

/// Connects `size` communicators on loopback (shared memory unless
/// `cfg.force_tcp`) and returns them in rank order.
pub fn local_group(size: usize, cfg: &Config) -> Result<Vec<Communicator>> {
    let hosts = vec!["test-host".to_string(); size];
    let token = 0x5eed_u64 ^ std::process::id() as u64;
    connect_all(&hosts, token, |_| cfg.clone())
}

/// Connects one communicator per rank on loopback listeners, rank r on host
/// `hosts[r]` with `cfg(r)`, one thread per rank; returns them in rank order.
fn connect_all(
    hosts: &[String],
    token: u64,
    cfg: impl Fn(usize) -> Config,
) -> Result<Vec<Communicator>> {
    let listeners = hosts
        .iter()
        .map(|_| listen("127.0.0.1:0"))
        .collect::<Result<Vec<_>>>()?;
    let addrs: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.to_string()).unwrap_or_default())
        .collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = listeners
            .iter()
            .enumerate()
            .map(|(rank, l)| {
                let (addrs, cfg) = (&addrs, cfg(rank));
                s.spawn(move || Communicator::connect(rank, addrs, hosts, l, token, cfg))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(crate::Error::InvalidArgument("rank thread panicked".into()))
                })
            })
            .collect()
    })
}

/// Runs `f(rank, communicator)` on one thread per rank and collects the
/// results in rank order.
pub fn run_ranks<T: Send>(
    comms: &mut [Communicator],
    f: impl Fn(usize, &mut Communicator) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms
            .iter_mut()
            .enumerate()
            .map(|(rank, c)| s.spawn(move || f(rank, c)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// Connects one communicator per rank of a job that spans simulated hosts
/// (`layout[h]`: the ranks of host h): TCP between every pair of ranks, and
/// on each host a shared-memory communicator attached as its level, as the
/// Python runtime builds them. Each rank gets a failure domain of its own.
pub fn host_groups(layout: &[Vec<usize>], cfg: &Config) -> Result<Vec<Communicator>> {
    let size: usize = layout.iter().map(Vec::len).sum();
    let host_of = |r: usize| layout.iter().position(|g| g.contains(&r)).unwrap_or(0);
    let hosts: Vec<String> = (0..size).map(|r| format!("host{}", host_of(r))).collect();
    let token = 0x4e57_u64 ^ std::process::id() as u64;
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let domain =
        move |r: usize| (call << 32) | ((std::process::id() as u64) << 12) | r as u64 | 1 << 63;
    let mut world = connect_all(&hosts, token, |rank| Config {
        domain: domain(rank),
        ..cfg.clone()
    })?;
    let mut locals: Vec<Option<Communicator>> = (0..size).map(|_| None).collect();
    for (h, ranks) in layout.iter().enumerate() {
        let cfg = Config {
            members: ranks.clone(),
            name: format!("host {h}"),
            ..cfg.clone()
        };
        let same = vec![format!("host{h}"); ranks.len()];
        let comms = connect_all(&same, token ^ 1, |i| Config {
            domain: domain(ranks[i]),
            ..cfg.clone()
        })?;
        for (c, &r) in comms.into_iter().zip(ranks) {
            locals[r] = Some(c);
        }
    }
    for (r, c) in world.iter_mut().enumerate() {
        let local = locals[r]
            .take()
            .ok_or_else(|| crate::Error::InvalidArgument(format!("rank {r} is on no host")))?;
        c.attach_levels(local, layout.to_vec())?;
    }
    Ok(world)
}
