//! Helpers to run a communicator per thread inside one process (Rust tests and
//! benchmarks): ranks are threads, the peer table is built in memory.

use crate::error::Result;
use crate::group::{Communicator, Config};
use crate::transport::tcp::listen;

/// Connects `size` communicators on loopback (shared memory unless
/// `cfg.force_tcp`) and returns them in rank order.
pub fn local_group(size: usize, cfg: &Config) -> Result<Vec<Communicator>> {
    let listeners = (0..size)
        .map(|_| listen("127.0.0.1:0"))
        .collect::<Result<Vec<_>>>()?;
    let addrs: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.to_string()).unwrap_or_default())
        .collect();
    let hosts = vec!["test-host".to_string(); size];
    let token = 0x5eed_u64 ^ std::process::id() as u64;
    std::thread::scope(|s| {
        let handles: Vec<_> = listeners
            .iter()
            .enumerate()
            .map(|(rank, l)| {
                let (addrs, hosts, cfg) = (&addrs, &hosts, cfg.clone());
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
