//! Registry, buckets, ready-marking and the worker, with fake resolvers and
//! operations; all-reduce over an in-process group of ranks.

use super::*;
use crate::dtype::DType;
use crate::error::Error;
use crate::group::Config;
use crate::testing::local_group;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// One buffer and the ranges of it that named tensors occupy.
type Flat = (Vec<f32>, HashMap<String, std::ops::Range<usize>>);

/// Resolves names to float32 vectors it owns (host memory), or to fake
/// device memory for names in `device`.
#[derive(Default)]
struct Host {
    bufs: Mutex<HashMap<String, Vec<f32>>>,
    device: Mutex<HashMap<String, Arc<Mutex<Vec<f32>>>>>,
    /// A flattened bucket: names mapped to ranges of one buffer.
    flat: Mutex<Flat>,
    /// Host mirrors of device tensors: names mapped to ranges of one buffer.
    mirrors: Mutex<Flat>,
}

impl Host {
    fn put(&self, name: &str, v: Vec<f32>) {
        self.bufs.lock().unwrap().insert(name.into(), v);
    }
    fn get(&self, name: &str) -> Vec<f32> {
        if let Some(d) = self.device.lock().unwrap().get(name) {
            return d.lock().unwrap().clone();
        }
        let flat = self.flat.lock().unwrap();
        if let Some(r) = flat.1.get(name) {
            return flat.0[r.clone()].to_vec();
        }
        self.bufs.lock().unwrap()[name].clone()
    }
}

struct FakeDevice(Arc<Mutex<Vec<f32>>>);

impl DeviceMemory for FakeDevice {
    fn download(&self, dst: &mut [u8]) -> Result<()> {
        dst.copy_from_slice(bytemuck::cast_slice(&self.0.lock().unwrap()));
        Ok(())
    }
    fn upload(&self, src: &[u8]) -> Result<()> {
        self.0
            .lock()
            .unwrap()
            .copy_from_slice(bytemuck::cast_slice(src));
        Ok(())
    }
}

impl Resolver for Host {
    fn resolve(&self, meta: &TensorMeta) -> Result<Effective> {
        if let Some(d) = self.device.lock().unwrap().get(&meta.name) {
            let n = d.lock().unwrap().len();
            let mem = Box::new(FakeDevice(Arc::clone(d)));
            let mut mirrors = self.mirrors.lock().unwrap();
            if let Some(r) = mirrors.1.get(&meta.name).cloned() {
                assert_eq!(r.len(), n);
                let addr = mirrors.0[r].as_mut_ptr() as usize;
                // SAFETY: `n` floats of the mirror buffer, which `self` owns
                // and never resizes while the test runs.
                return Ok(unsafe {
                    Effective::device_mirrored(mem, addr, n, DType::F32, "cuda:0", None)
                });
            }
            return Ok(Effective::device(mem, n, DType::F32, "cuda:0"));
        }
        let mut flat = self.flat.lock().unwrap();
        if let Some(r) = flat.1.get(&meta.name).cloned() {
            let addr = flat.0[r.start..].as_mut_ptr() as usize;
            // SAFETY: the vector outlives the operation and is not resized.
            return Ok(unsafe { Effective::host(addr, r.len(), DType::F32, "cpu", None) });
        }
        let mut bufs = self.bufs.lock().unwrap();
        let v = bufs
            .get_mut(&meta.name)
            .ok_or_else(|| Error::InvalidArgument(format!("no buffer for {}", meta.name)))?;
        // SAFETY: the vector outlives the operation and is not resized.
        Ok(unsafe { Effective::host(v.as_mut_ptr() as usize, v.len(), DType::F32, "cpu", None) })
    }
}

fn meta(name: &str, count: usize) -> TensorMeta {
    TensorMeta {
        name: name.into(),
        count,
        dtype: DType::F32,
        device: "cpu".into(),
    }
}

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Records the order of buckets run; fails on bucket `fail`.
struct Record {
    seen: Arc<Mutex<Vec<usize>>>,
    fail: Option<usize>,
}

impl BucketOp for Record {
    fn run(&mut self, bucket: &BucketTensors<'_>) -> Result<()> {
        self.seen.lock().unwrap().push(bucket.index);
        if Some(bucket.index) == self.fail {
            return Err(Error::InvalidArgument(format!("boom in {}", bucket.index)));
        }
        Ok(())
    }
}

fn module_with(n: usize, fail: Option<usize>) -> (Module, Arc<Mutex<Vec<usize>>>) {
    let m = Module::new("m", Arc::new(Host::default())).unwrap();
    for i in 0..n {
        m.register(meta(&format!("t{i}"), 1)).unwrap();
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    m.set_op(Box::new(Record {
        seen: Arc::clone(&seen),
        fail,
    }))
    .unwrap();
    (m, seen)
}

#[test]
fn registration_errors() {
    let m = Module::new("mod", Arc::new(Host::default())).unwrap();
    m.register(meta("a", 2)).unwrap();
    let e = m.register(meta("a", 3)).unwrap_err();
    assert!(
        e.to_string().contains("already registered in module 'mod'"),
        "{e}"
    );
    assert!(m.register(meta("", 3)).is_err());
    let e = m.tensor("nope").unwrap_err();
    assert!(e.to_string().contains("no tensor named 'nope'"), "{e}");
    assert_eq!(m.tensor("a").unwrap().count, 2);
    m.register(TensorMeta {
        dtype: DType::F64,
        ..meta("b", 1)
    })
    .unwrap();
    m.register(meta("c", 1)).unwrap();
    let e = m.set_buckets(&[names(&["a", "b"])]).unwrap_err();
    assert!(e.to_string().contains("one dtype on one device"), "{e}");
    let e = m
        .set_buckets(&[names(&["a"]), names(&["c", "a"])])
        .unwrap_err();
    assert!(e.to_string().contains("in bucket 0 and bucket 1"), "{e}");
    assert!(m.set_buckets(&[names(&["zzz"])]).is_err());
    assert!(m.plan(&names(&["zzz"]), 8).is_err());
    assert_eq!(
        m.plan(&names(&["c", "a", "b"]), 1 << 20).unwrap(),
        vec![names(&["c", "a"]), names(&["b"])]
    );
    // marking ready: unknown, no bucket, no op, twice
    assert!(m.mark_ready("zzz", None).is_err());
    let e = m.mark_ready("a", None).unwrap_err();
    assert!(e.to_string().contains("in no bucket"), "{e}");
    m.set_buckets(&[names(&["a", "c"]), names(&["b"])]).unwrap();
    let e = m.mark_ready("a", None).unwrap_err();
    assert!(e.to_string().contains("no bucket operation"), "{e}");
    let seen = Arc::new(Mutex::new(Vec::new()));
    m.set_op(Box::new(Record { seen, fail: None })).unwrap();
    m.mark_ready("a", None).unwrap();
    assert!(m.is_ready("a").unwrap());
    let e = m.mark_ready("a", None).unwrap_err();
    assert!(e.to_string().contains("already marked ready"), "{e}");
    assert!(m.set_buckets(&[names(&["a"])]).is_err(), "busy round");
    assert_eq!(m.bucket_layout(0, 4).unwrap().offsets, vec![0, 2]);
    assert!(m.bucket_layout(7, 1).is_err());
}

#[test]
fn buckets_run_in_order_when_marked_out_of_order() {
    let (m, seen) = module_with(5, None);
    m.set_buckets(&[names(&["t0", "t1"]), names(&["t2"]), names(&["t3", "t4"])])
        .unwrap();
    for round in 0..3 {
        m.mark_ready("t4", None).unwrap();
        m.mark_ready("t3", None).unwrap();
        m.mark_ready("t2", None).unwrap();
        m.mark_ready("t1", None).unwrap();
        // buckets 1 and 2 are complete but wait behind bucket 0
        assert_eq!(m.pending().unwrap(), 0);
        m.wait_pending().unwrap();
        assert_eq!(seen.lock().unwrap().len(), round * 3);
        m.mark_ready("t0", None).unwrap();
        m.wait_pending().unwrap();
        assert_eq!(m.pending().unwrap(), 0);
        assert!(!m.is_ready("t0").unwrap(), "a new round starts");
    }
    assert_eq!(*seen.lock().unwrap(), [0, 1, 2].repeat(3));
}

/// An event that blocks the worker until the test opens it.
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<(bool, bool)>, Condvar)>);

impl Gate {
    fn open(&self) {
        self.0 .0.lock().unwrap().1 = true;
        self.0 .1.notify_all();
    }
    fn wait_until_waiting(&self) {
        let g = self.0 .0.lock().unwrap();
        let (_g, t) = self
            .0
             .1
            .wait_timeout_while(g, Duration::from_secs(20), |s| !s.0)
            .unwrap();
        assert!(!t.timed_out(), "worker never waited on the event");
    }
}

impl ReadyEvent for Gate {
    fn wait(&self) -> Result<()> {
        let mut g = self.0 .0.lock().unwrap();
        g.0 = true;
        self.0 .1.notify_all();
        let (g, t) = self
            .0
             .1
            .wait_timeout_while(g, Duration::from_secs(20), |s| !s.1)
            .unwrap();
        drop(g);
        if t.timed_out() {
            return Err(Error::InvalidArgument("gate never opened".into()));
        }
        Ok(())
    }
}

#[test]
fn worker_waits_on_ready_events_before_running() {
    let (m, seen) = module_with(2, None);
    m.set_buckets(&[names(&["t0", "t1"])]).unwrap();
    let gate = Gate::default();
    m.mark_ready("t0", Some(Box::new(gate.clone()))).unwrap();
    assert_eq!(m.pending().unwrap(), 0, "bucket incomplete");
    m.mark_ready("t1", None).unwrap();
    assert_eq!(m.pending().unwrap(), 1);
    gate.wait_until_waiting();
    assert!(
        seen.lock().unwrap().is_empty(),
        "ran before its event fired"
    );
    gate.open();
    m.wait_pending().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![0]);
}

#[test]
fn worker_error_reaches_the_waiter_and_skips_the_rest() {
    let (m, seen) = module_with(3, Some(1));
    m.set_buckets(&[names(&["t0"]), names(&["t1"]), names(&["t2"])])
        .unwrap();
    for t in ["t0", "t1", "t2"] {
        m.mark_ready(t, None).unwrap();
    }
    let e = m.wait_pending().unwrap_err();
    assert!(e.to_string().contains("boom in 1"), "{e}");
    assert_eq!(*seen.lock().unwrap(), vec![0, 1]);
    m.wait_pending().unwrap(); // the error was handed over once
    m.mark_ready("t0", None).unwrap();
    m.wait_pending().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![0, 1, 0]);
}

struct Panics;
impl BucketOp for Panics {
    fn run(&mut self, _: &BucketTensors<'_>) -> Result<()> {
        panic!("kaboom")
    }
}

#[test]
fn a_panic_in_an_operation_becomes_an_error() {
    let m = Module::new("p", Arc::new(Host::default())).unwrap();
    m.register(meta("a", 1)).unwrap();
    m.set_buckets(&[names(&["a"])]).unwrap();
    m.set_op(Box::new(Panics)).unwrap();
    m.mark_ready("a", None).unwrap();
    let e = m.wait_pending().unwrap_err();
    assert!(e.to_string().contains("kaboom"), "{e}");
}

#[test]
fn effective_tensor_must_match_its_registration() {
    let host = Arc::new(Host::default());
    host.put("a", vec![1.0; 3]);
    let m = Module::new("x", host.clone()).unwrap();
    m.register(meta("a", 4)).unwrap();
    m.set_buckets(&[names(&["a"])]).unwrap();
    m.set_op(Box::new(AllReduceOp::new(
        crate::Communicator::single(Config::default()),
        true,
    )))
    .unwrap();
    m.mark_ready("a", None).unwrap();
    let e = m.wait_pending().unwrap_err();
    assert!(e.to_string().contains("registered as 4 float32"), "{e}");
}

#[test]
fn all_reduce_buckets_across_ranks() {
    let cfg = Config {
        timeout: Duration::from_secs(20),
        ..Config::default()
    };
    for force_tcp in [false, true] {
        let cfg = Config {
            force_tcp,
            ..cfg.clone()
        };
        let mut comms = local_group(2, &cfg).unwrap();
        let slots: Vec<Mutex<Option<crate::Communicator>>> =
            comms.drain(..).map(|c| Mutex::new(Some(c))).collect();
        let results = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let comm = slots[rank].lock().unwrap().take().unwrap();
                    s.spawn(move || rank_run(rank, comm))
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for r in results {
            r.unwrap();
        }
    }
}

/// One rank: scattered host tensors (staged), a flattened bucket (in place)
/// and a device tensor (downloaded and uploaded), averaged over two ranks.
fn rank_run(rank: usize, comm: crate::Communicator) -> Result<()> {
    let host = Arc::new(Host::default());
    let r = rank as f32;
    host.put("a", vec![1.0 + r, 2.0 + r]);
    host.put("b", vec![10.0 * (r + 1.0); 3]);
    {
        let mut flat = host.flat.lock().unwrap();
        flat.0 = vec![r, r + 1.0, r + 2.0, 0.0];
        flat.1.insert("c".into(), 0..1);
        flat.1.insert("d".into(), 1..3);
    }
    let dev = Arc::new(Mutex::new(vec![4.0 * (r + 1.0); 2]));
    host.device.lock().unwrap().insert("e".into(), dev);
    // device tensors with back-to-back mirrors: staged through the mirrors
    for (n, v) in [("f", vec![r; 2]), ("g", vec![2.0 * r; 3])] {
        host.device
            .lock()
            .unwrap()
            .insert(n.into(), Arc::new(Mutex::new(v)));
    }
    {
        let mut mirrors = host.mirrors.lock().unwrap();
        mirrors.0 = vec![-1.0; 6];
        mirrors.1.insert("f".into(), 0..2);
        mirrors.1.insert("g".into(), 2..5);
    }
    let m = Module::new("ar", host.clone())?;
    for (n, c) in [("a", 2), ("b", 3), ("c", 1), ("d", 2)] {
        m.register(meta(n, c))?;
    }
    for (n, c) in [("e", 2), ("f", 2), ("g", 3)] {
        m.register(TensorMeta {
            device: "cuda:0".into(),
            ..meta(n, c)
        })?;
    }
    let groups = m.plan(&names(&["a", "b", "c", "d", "e"]), 1 << 20)?;
    assert_eq!(groups.len(), 2, "device change cuts a bucket");
    m.set_buckets(&[
        names(&["a", "b"]),
        names(&["c", "d"]),
        names(&["e"]),
        names(&["f", "g"]),
    ])?;
    m.set_op(Box::new(AllReduceOp::new(comm, true)))?;
    for n in ["g", "f", "e", "d", "c", "b", "a"] {
        m.mark_ready(n, None)?;
    }
    m.wait_pending()?;
    assert_eq!(host.get("f"), vec![0.5; 2]);
    assert_eq!(host.get("g"), vec![1.0; 3]);
    assert_eq!(
        host.mirrors.lock().unwrap().0,
        vec![0.5, 0.5, 1.0, 1.0, 1.0, -1.0],
        "reduced in the mirrors, and only there"
    );
    assert_eq!(host.get("a"), vec![1.5, 2.5]);
    assert_eq!(host.get("b"), vec![15.0; 3]);
    assert_eq!(host.get("c"), vec![0.5]);
    assert_eq!(host.get("d"), vec![1.5, 2.5]);
    assert_eq!(host.get("e"), vec![6.0; 2]);
    assert_eq!(host.flat.lock().unwrap().0[3], 0.0, "padding untouched");
    Ok(())
}
