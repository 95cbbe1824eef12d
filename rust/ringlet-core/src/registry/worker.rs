//! A module: its registered tensors, its buckets, the ready state of the
//! current round, and the one worker thread that runs bucket operations in
//! bucket order.
//!
//! A *round* starts with no tensor ready. Marking a tensor ready decrements
//! its bucket's count of unready tensors; whenever the next bucket in order
//! (the cursor) has none left, it is enqueued and the cursor moves on, so a
//! ready bucket behind an unready one waits. When the last bucket is enqueued
//! the round is over and the ready flags are cleared for the next one. The
//! worker pops jobs in order, waits on each tensor's ready event, and runs the
//! operation; after a failure it skips the rest of the queue until
//! [`Module::wait_pending`] has handed the error to a caller.

use super::bucket::{plan_buckets, Bucket, BucketLayout};
use super::ops::{BucketOp, BucketTensors};
use super::{ReadyEvent, Resolver, TensorMeta};
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

type SharedOp = Arc<Mutex<Box<dyn BucketOp>>>;

struct Job {
    index: usize,
    tensors: Vec<TensorMeta>,
    events: Vec<Box<dyn ReadyEvent>>,
    op: SharedOp,
}

#[derive(Default)]
struct State {
    tensors: Vec<TensorMeta>,
    by_name: HashMap<String, usize>,
    buckets: Vec<Bucket>,
    bucket_of: Vec<Option<usize>>,
    ready: Vec<bool>,
    /// Tensors that count as ready in every round without being marked
    /// (Bagua's bucket padding).
    always: Vec<bool>,
    events: Vec<Option<Box<dyn ReadyEvent>>>,
    unready: Vec<usize>,
    cursor: usize,
    queue: VecDeque<Job>,
    enqueued: u64,
    finished: u64,
    error: Option<Error>,
    op: Option<SharedOp>,
    stop: bool,
}

impl State {
    fn id(&self, module: &str, name: &str) -> Result<usize> {
        self.by_name.get(name).copied().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "no tensor named '{name}' is registered in module '{module}'"
            ))
        })
    }

    fn busy(&self) -> bool {
        self.finished < self.enqueued
            || self
                .ready
                .iter()
                .zip(&self.always)
                .any(|(&r, &always)| r && !always)
    }

    fn reset_round(&mut self) {
        self.ready.clone_from(&self.always);
        self.events.iter_mut().for_each(|e| *e = None);
        self.unready = self
            .buckets
            .iter()
            .map(|b| b.tensors.iter().filter(|&&i| !self.always[i]).count())
            .collect();
        self.cursor = 0;
    }
}

struct Shared {
    name: String,
    state: Mutex<State>,
    /// Signalled when a job is queued or the module stops.
    work: Condvar,
    /// Signalled when a job finishes.
    done: Condvar,
    resolver: Arc<dyn Resolver>,
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| poisoned(&self.name))
    }
}

fn poisoned(module: &str) -> Error {
    Error::Io {
        context: format!("module '{module}'"),
        message: "internal state poisoned by an earlier panic".into(),
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Registered tensors of one model (module), their buckets and the worker that
/// communicates them.
pub struct Module {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl Module {
    /// A module named `name` whose proxies are resolved by `resolver`; starts
    /// its worker thread.
    pub fn new(name: impl Into<String>, resolver: Arc<dyn Resolver>) -> Result<Module> {
        let name = name.into();
        let shared = Arc::new(Shared {
            name: name.clone(),
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            done: Condvar::new(),
            resolver,
        });
        let s = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name(format!("ringlet-bucket-{name}"))
            .spawn(move || worker_loop(&s))
            .map_err(|e| Error::io(format!("starting the worker of module '{name}'"), e))?;
        Ok(Module {
            shared,
            worker: Some(worker),
        })
    }

    /// The module's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Registers a tensor; names are unique within the module.
    pub fn register(&self, meta: TensorMeta) -> Result<usize> {
        let mut st = self.shared.lock()?;
        if meta.name.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "module '{}': a registered tensor needs a non-empty name",
                self.name()
            )));
        }
        if st.by_name.contains_key(&meta.name) {
            return Err(Error::InvalidArgument(format!(
                "a tensor named '{}' is already registered in module '{}'",
                meta.name,
                self.name()
            )));
        }
        let id = st.tensors.len();
        st.by_name.insert(meta.name.clone(), id);
        st.tensors.push(meta);
        st.bucket_of.push(None);
        st.ready.push(false);
        st.always.push(false);
        st.events.push(None);
        Ok(id)
    }

    /// The registration of `name`.
    pub fn tensor(&self, name: &str) -> Result<TensorMeta> {
        let st = self.shared.lock()?;
        let id = st.id(self.name(), name)?;
        Ok(st.tensors[id].clone())
    }

    /// Names of every registered tensor, in registration order.
    pub fn names(&self) -> Result<Vec<String>> {
        Ok(self
            .shared
            .lock()?
            .tensors
            .iter()
            .map(|t| t.name.clone())
            .collect())
    }

    /// Groups the named tensors, in this order, into buckets of at most
    /// `cap_bytes` bytes of one dtype and device each (see [`plan_buckets`]);
    /// returns the groups of names, to pass to [`Module::set_buckets`].
    pub fn plan(&self, names: &[String], cap_bytes: usize) -> Result<Vec<Vec<String>>> {
        let st = self.shared.lock()?;
        let metas = names
            .iter()
            .map(|n| st.id(self.name(), n).map(|i| &st.tensors[i]))
            .collect::<Result<Vec<_>>>()?;
        Ok(plan_buckets(&metas, cap_bytes)
            .into_iter()
            .map(|g| g.into_iter().map(|i| names[i].clone()).collect())
            .collect())
    }

    /// Replaces the buckets (communication order = order of `groups`). Every
    /// name must be registered, appear at most once, and each bucket must hold
    /// one dtype on one device. Refused while a round is in progress.
    pub fn set_buckets(&self, groups: &[Vec<String>]) -> Result<()> {
        let mut st = self.shared.lock()?;
        if st.busy() {
            return Err(Error::InvalidArgument(format!(
                "module '{}': cannot change buckets while tensors are marked ready \
                 or operations are pending (call wait_pending_comm_ops first)",
                self.name()
            )));
        }
        let mut buckets = Vec::with_capacity(groups.len());
        let mut bucket_of = vec![None; st.tensors.len()];
        for (b, group) in groups.iter().enumerate() {
            let ids = group
                .iter()
                .map(|n| st.id(self.name(), n))
                .collect::<Result<Vec<_>>>()?;
            for &id in &ids {
                if let Some(other) = bucket_of[id].replace(b) {
                    return Err(Error::InvalidArgument(format!(
                        "module '{}': tensor '{}' is in bucket {other} and bucket {b}",
                        self.name(),
                        st.tensors[id].name
                    )));
                }
            }
            let metas: Vec<&TensorMeta> = ids.iter().map(|&i| &st.tensors[i]).collect();
            buckets.push(Bucket::new(&metas, ids.clone()).map_err(|e| match e {
                Error::InvalidArgument(m) => {
                    Error::InvalidArgument(format!("module '{}', bucket {b}: {m}", self.name()))
                }
                other => other,
            })?);
        }
        st.buckets = buckets;
        st.bucket_of = bucket_of;
        st.reset_round();
        Ok(())
    }

    /// The buckets as lists of names.
    pub fn buckets(&self) -> Result<Vec<Vec<String>>> {
        let st = self.shared.lock()?;
        Ok(st
            .buckets
            .iter()
            .map(|b| {
                b.tensors
                    .iter()
                    .map(|&i| st.tensors[i].name.clone())
                    .collect()
            })
            .collect())
    }

    /// Offsets of bucket `index`'s tensors when flattened into one buffer
    /// padded to a multiple of `alignment` elements.
    pub fn bucket_layout(&self, index: usize, alignment: usize) -> Result<BucketLayout> {
        let st = self.shared.lock()?;
        let b = st.buckets.get(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "module '{}' has {} buckets, no bucket {index}",
                self.name(),
                st.buckets.len()
            ))
        })?;
        let counts: Vec<usize> = b.tensors.iter().map(|&i| st.tensors[i].count).collect();
        Ok(b.layout(&counts, alignment))
    }

    /// Sets the operation run on every bucket. Refused while a round is in
    /// progress.
    pub fn set_op(&self, op: Box<dyn BucketOp>) -> Result<()> {
        let mut st = self.shared.lock()?;
        if st.busy() {
            return Err(Error::InvalidArgument(format!(
                "module '{}': cannot change the bucket operation while a round is in progress",
                self.name()
            )));
        }
        st.op = Some(Arc::new(Mutex::new(op)));
        Ok(())
    }

    /// Makes `name` count as ready in every round without being marked (a
    /// bucket's padding). Refused while a round is in progress.
    pub fn set_always_ready(&self, name: &str) -> Result<()> {
        let mut st = self.shared.lock()?;
        if st.busy() {
            return Err(Error::InvalidArgument(format!(
                "module '{}': cannot change tensors while a round is in progress",
                self.name()
            )));
        }
        let id = st.id(self.name(), name)?;
        st.always[id] = true;
        st.reset_round();
        Ok(())
    }

    /// Marks `name` ready for this round; `event` (if any) is waited on by the
    /// worker before it touches the data. Enqueues every bucket that became
    /// next in order with all of its tensors ready.
    pub fn mark_ready(&self, name: &str, event: Option<Box<dyn ReadyEvent>>) -> Result<()> {
        let mut st = self.shared.lock()?;
        let module = self.name();
        let id = st.id(module, name)?;
        let Some(b) = st.bucket_of[id] else {
            return Err(Error::InvalidArgument(format!(
                "tensor '{name}' of module '{module}' is in no bucket: \
                 set the module's buckets before marking tensors ready"
            )));
        };
        let Some(op) = st.op.clone() else {
            return Err(Error::InvalidArgument(format!(
                "module '{module}' has no bucket operation: set one before marking tensors ready"
            )));
        };
        if st.always[id] {
            return Ok(()); // padding: ready in every round anyway
        }
        if st.ready[id] {
            return Err(Error::InvalidArgument(format!(
                "tensor '{name}' of module '{module}' was already marked ready in this round"
            )));
        }
        st.ready[id] = true;
        st.events[id] = event;
        st.unready[b] -= 1;
        let mut queued = false;
        while st.cursor < st.buckets.len() && st.unready[st.cursor] == 0 {
            let index = st.cursor;
            let ids = st.buckets[index].tensors.clone();
            let job = Job {
                index,
                tensors: ids.iter().map(|&i| st.tensors[i].clone()).collect(),
                events: ids.iter().filter_map(|&i| st.events[i].take()).collect(),
                op: Arc::clone(&op),
            };
            st.queue.push_back(job);
            st.enqueued += 1;
            st.cursor += 1;
            queued = true;
        }
        if st.cursor == st.buckets.len() {
            st.reset_round();
        }
        drop(st);
        if queued {
            self.shared.work.notify_all();
        }
        Ok(())
    }

    /// Whether `name` is marked ready in the current round.
    pub fn is_ready(&self, name: &str) -> Result<bool> {
        let st = self.shared.lock()?;
        let id = st.id(self.name(), name)?;
        Ok(st.ready[id])
    }

    /// Number of enqueued bucket operations that have not finished.
    pub fn pending(&self) -> Result<u64> {
        let st = self.shared.lock()?;
        Ok(st.enqueued - st.finished)
    }

    /// Blocks until every enqueued bucket operation has finished; returns the
    /// worker's first error since the last call (then the round starts over).
    pub fn wait_pending(&self) -> Result<()> {
        let mut st = self.shared.lock()?;
        while st.finished < st.enqueued {
            st = self
                .shared
                .done
                .wait(st)
                .map_err(|_| poisoned(&self.shared.name))?;
        }
        match st.error.take() {
            Some(e) => {
                st.reset_round();
                Err(e)
            }
            None => Ok(()),
        }
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if let Ok(mut st) = self.shared.state.lock() {
            st.stop = true;
            st.finished += st.queue.len() as u64;
            st.queue.clear();
        }
        self.shared.work.notify_all();
        self.shared.done.notify_all();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

fn worker_loop(shared: &Shared) {
    loop {
        let (job, skip) = {
            let Ok(mut st) = shared.state.lock() else {
                return;
            };
            loop {
                if st.stop {
                    return;
                }
                if let Some(job) = st.queue.pop_front() {
                    break (job, st.error.is_some());
                }
                st = match shared.work.wait(st) {
                    Ok(g) => g,
                    Err(_) => return,
                };
            }
        };
        let result = if skip { Ok(()) } else { run_job(shared, &job) };
        drop(job);
        let Ok(mut st) = shared.state.lock() else {
            return;
        };
        st.finished += 1;
        if let Err(e) = result {
            st.error.get_or_insert(e);
        }
        drop(st);
        shared.done.notify_all();
    }
}

fn run_job(shared: &Shared, job: &Job) -> Result<()> {
    let run = || -> Result<()> {
        for ev in &job.events {
            ev.wait()?;
        }
        let mut op = job.op.lock().map_err(|_| poisoned(&shared.name))?;
        op.run(&BucketTensors {
            index: job.index,
            tensors: &job.tensors,
            resolver: &*shared.resolver,
        })
    };
    catch_unwind(AssertUnwindSafe(run)).unwrap_or_else(|p| {
        Err(Error::Io {
            context: format!(
                "bucket {} of module '{}': internal error",
                job.index, shared.name
            ),
            message: format!("panic: {}", panic_message(&*p)),
        })
    })
}
