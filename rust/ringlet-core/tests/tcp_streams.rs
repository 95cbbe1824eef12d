//! The TCP mesh's transfers: several sends to one peer in one transfer keep
//! their order on the stream (each waits for the one before it), and a
//! transfer that stops early (`transfer_until`) leaves the rest resumable
//! from where they got (`Xfer::send_from`).

use ringlet_core::transport::tcp::{listen, TcpMesh, Xfer};
use std::time::Duration;

fn pair() -> Vec<TcpMesh> {
    let ls = [
        listen("127.0.0.1:0").unwrap(),
        listen("127.0.0.1:0").unwrap(),
    ];
    let addrs: Vec<String> = ls
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    std::thread::scope(|s| {
        let h: Vec<_> = ls
            .iter()
            .enumerate()
            .map(|(r, l)| {
                let addrs = &addrs;
                s.spawn(move || TcpMesh::connect(r, addrs, l, 77, Duration::from_secs(20)))
            })
            .collect();
        h.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    })
}

fn pattern(tag: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| tag ^ (i % 251) as u8).collect()
}

#[test]
fn sends_to_one_peer_keep_their_order_and_resume() {
    let mut meshes = pair().into_iter();
    let (m0, m1) = (meshes.next().unwrap(), meshes.next().unwrap());
    let t = Duration::from_secs(20);
    // `a` is more than the socket buffers hold; `b` is far more than loopback's
    // buffers (send and receive, autotuned to a few MiB) hold, and the receiver
    // reads none of it until the sender has stopped: stopping when `a` is out
    // always leaves part of `b` to resume.
    let len = 6 << 20;
    let blen = 8 * len;
    let (a, b, c) = (pattern(1, len), pattern(2, blen), pattern(3, len / 3));
    let (stopped, wait_stop) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let (a, b, c) = (&a, &b, &c);
        s.spawn(move || {
            // One transfer with three sends to the same peer.
            m0.transfer(
                &mut [Xfer::send(1, a), Xfer::send(1, b), Xfer::send(1, c)],
                "test",
                t,
            )
            .unwrap();
            // Stop as soon as `a` is out; `b` goes on later from where it got.
            let mut x = [Xfer::send(1, a), Xfer::send(1, b)];
            m0.transfer_until(&mut x, "test", t, |x| x[0].done() == x[0].len())
                .unwrap();
            let got = x[1].done();
            stopped.send(()).unwrap();
            assert!(got < b.len());
            m0.transfer(&mut [Xfer::send_from(1, b, got)], "test", t)
                .unwrap();
        });
        let mut got = [vec![0u8; len], vec![0u8; blen], vec![0u8; len / 3]];
        {
            let [x, y, z] = &mut got[..] else {
                unreachable!()
            };
            m1.transfer(
                &mut [Xfer::recv(0, x), Xfer::recv(0, y), Xfer::recv(0, z)],
                "test",
                t,
            )
            .unwrap();
        }
        assert!(got[0] == *a && got[1] == *b && got[2] == *c);
        let mut again = [vec![0u8; len], vec![0u8; blen]];
        {
            let [x, y] = &mut again[..] else {
                unreachable!()
            };
            m1.transfer(&mut [Xfer::recv(0, x)], "test", t).unwrap();
            wait_stop.recv().unwrap();
            m1.transfer(&mut [Xfer::recv(0, y)], "test", t).unwrap();
        }
        assert!(again[0] == *a && again[1] == *b);
    });
}
