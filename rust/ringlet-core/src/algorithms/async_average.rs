//! Bagua's asynchronous model averaging: a thread of its own averages the
//! model's weights with every rank every `interval`, while the training
//! loop goes on without waiting for the network.
//!
//! A round: agree with every rank whether to stop (an all-reduce of this
//! rank's abort flag with `min`: the thread stops only once *every* rank
//! has asked to, so all stop after the same round), copy the weights, sum
//! the copies over the ranks (the slow part, while training goes on), then
//! apply `w += sum / n - copy`: the mean replaces the weights as they were
//! when the round started, and whatever the optimizer did meanwhile is
//! kept. The copy and the update hold the *weight lock*, which the training
//! loop holds while it uses the weights ([`AsyncAverager::lock_weight`]).
//!
//! A failure (a peer lost, a timeout) ends the thread; the error is raised
//! once, by the next `lock_weight` or by `abort`, whichever comes first.

use super::arith;
use super::levels::HostTensor;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::group::SharedCommunicator;
use crate::registry::{BucketOp, BucketTensors};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// What the averaging thread is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncStatus {
    /// Never started, or stopped by `abort` (it may start again).
    Stopped,
    /// Averaging every interval.
    Running,
    /// Ended by an error (raised once by `lock_weight` or `abort`).
    Failed,
}

struct Inner {
    comm: SharedCommunicator,
    weights: Mutex<HostTensor>,
    dtype: DType,
    /// The weight lock: held by the training loop or by a round's copy or
    /// update.
    held: Mutex<bool>,
    released: Condvar,
    /// This rank asked to stop.
    abort: AtomicBool,
    /// Wakes the thread from its sleep between rounds.
    sleep: Mutex<()>,
    wake: Condvar,
    running: AtomicBool,
    rounds: AtomicU64,
    error: Mutex<Option<Error>>,
    scratch: Mutex<(Vec<u64>, Vec<u64>)>,
}

fn poisoned(what: &str) -> Error {
    Error::Io {
        context: format!("asynchronous averaging ({what})"),
        message: "state poisoned by an earlier panic".into(),
    }
}

fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>> {
    m.lock().map_err(|_| poisoned(what))
}

impl Inner {
    fn acquire(&self) -> Result<()> {
        let mut held = lock(&self.held, "weight lock")?;
        while *held {
            held = self
                .released
                .wait(held)
                .map_err(|_| poisoned("weight lock"))?;
        }
        *held = true;
        Ok(())
    }

    fn release(&self) {
        if let Ok(mut held) = self.held.lock() {
            *held = false;
        }
        self.released.notify_all();
    }

    /// Runs `f` holding the weight lock.
    fn locked<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.acquire()?;
        let out = f();
        self.release();
        out
    }

    /// Whether every rank asked to stop (collective).
    fn all_stopping(&self) -> Result<bool> {
        let mut flag = [u8::from(self.abort.load(Ordering::Acquire))];
        self.comm
            .with(|c| c.all_reduce(&mut flag, DType::U8, ReduceOp::Min))?;
        Ok(flag[0] == 1)
    }

    /// One averaging round on `w` (the weights, in host memory).
    fn round(&self, w: &mut [u8]) -> Result<()> {
        let mut scratch = lock(&self.scratch, "scratch")?;
        let (copy, reduced) = &mut *scratch;
        let copy = super::compressed::grow(copy, w.len());
        let reduced = super::compressed::grow(reduced, w.len());
        self.locked(|| {
            copy.copy_from_slice(w);
            Ok(())
        })?;
        reduced.copy_from_slice(copy);
        let n = self.comm.size();
        self.comm
            .with(|c| c.all_reduce(reduced, self.dtype, ReduceOp::Sum))?;
        self.locked(|| arith::async_update(w, reduced, copy, self.dtype, n as f64))?;
        self.rounds.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn run(&self, interval: Duration) -> Result<()> {
        loop {
            if self.all_stopping()? {
                return Ok(());
            }
            {
                let mut w = lock(&self.weights, "weights")?;
                self.round(w.bytes_mut())?;
            }
            let guard = lock(&self.sleep, "sleep")?;
            let _ = self
                .wake
                .wait_timeout_while(guard, interval, |_| !self.abort.load(Ordering::Acquire))
                .map_err(|_| poisoned("sleep"))?;
        }
    }
}

/// The averaging thread of one model (see the module documentation).
pub struct AsyncAverager {
    inner: Arc<Inner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl AsyncAverager {
    /// An averager of `weights` (the model's flattened weights, in host
    /// memory) over `comm`, a communicator of its own. Not started.
    pub fn new(comm: SharedCommunicator, weights: HostTensor) -> Result<AsyncAverager> {
        let dtype = weights.dtype();
        arith::require_float(dtype, "asynchronous model averaging")?;
        Ok(AsyncAverager {
            inner: Arc::new(Inner {
                comm,
                weights: Mutex::new(weights),
                dtype,
                held: Mutex::new(false),
                released: Condvar::new(),
                abort: AtomicBool::new(false),
                sleep: Mutex::new(()),
                wake: Condvar::new(),
                running: AtomicBool::new(false),
                rounds: AtomicU64::new(0),
                error: Mutex::new(None),
                scratch: Mutex::new((Vec::new(), Vec::new())),
            }),
            thread: Mutex::new(None),
        })
    }

    /// Starts the thread, a round every `interval` (Bagua's
    /// `sync_interval_ms`). An error if it is running.
    pub fn start(&self, interval: Duration) -> Result<()> {
        let mut slot = lock(&self.thread, "thread")?;
        if let Some(t) = slot.as_ref() {
            if !t.is_finished() {
                return Err(Error::InvalidArgument(
                    "asynchronous averaging is already running: abort() it first".into(),
                ));
            }
        }
        if let Some(t) = slot.take() {
            let _ = t.join();
        }
        self.inner.abort.store(false, Ordering::Release);
        self.inner.running.store(true, Ordering::Release);
        let inner = Arc::clone(&self.inner);
        let t = std::thread::Builder::new()
            .name("ringlet-async-avg".into())
            .spawn(move || {
                let out = inner.run(interval);
                if let Err(e) = out {
                    if let Ok(mut slot) = inner.error.lock() {
                        slot.get_or_insert(e);
                    }
                }
                inner.running.store(false, Ordering::Release);
                // A training loop blocked on the weight lock learns of it.
                inner.released.notify_all();
            })
            .map_err(|e| Error::io("starting the asynchronous averaging thread", e))?;
        *slot = Some(t);
        Ok(())
    }

    /// Asks to stop and waits until every rank has asked too (the thread
    /// ends after the round in which all agree), or the thread fails.
    /// Returns the thread's error if nothing raised it yet. Does nothing
    /// when not running.
    pub fn abort(&self) -> Result<()> {
        self.inner.abort.store(true, Ordering::Release);
        {
            let _g = self.inner.sleep.lock();
            self.inner.wake.notify_all();
        }
        let t = lock(&self.thread, "thread")?.take();
        if let Some(t) = t {
            let _ = t.join();
        }
        self.take_error()
    }

    /// Clears the abort flag (Bagua's `reset`), for the next `start`.
    pub fn reset(&self) {
        self.inner.abort.store(false, Ordering::Release);
    }

    fn take_error(&self) -> Result<()> {
        match lock(&self.inner.error, "error")?.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Takes the weight lock for the training loop (blocks while a round
    /// copies or updates the weights); raises the thread's error if it
    /// failed since the last report.
    pub fn lock_weight(&self) -> Result<()> {
        self.take_error()?;
        self.inner.acquire()
    }

    /// Releases the weight lock.
    pub fn unlock_weight(&self) {
        self.inner.release();
    }

    /// What the thread is doing.
    pub fn status(&self) -> AsyncStatus {
        if self.inner.running.load(Ordering::Acquire) {
            return AsyncStatus::Running;
        }
        match self.inner.error.lock() {
            Ok(e) if e.is_some() => AsyncStatus::Failed,
            _ => AsyncStatus::Stopped,
        }
    }

    /// Rounds completed since the averager was made.
    pub fn rounds(&self) -> u64 {
        self.inner.rounds.load(Ordering::Relaxed)
    }

    /// A bucket operation running one round on the bucket each time it is
    /// ready (Bagua's op, driven by marking the bucket's tensors ready from
    /// a loop of the caller's), after agreeing whether to stop.
    pub fn bucket_op(self: &Arc<Self>) -> Box<dyn BucketOp> {
        Box::new(Round {
            avg: Arc::clone(self),
            staging: Vec::new(),
        })
    }
}

impl Drop for AsyncAverager {
    fn drop(&mut self) {
        // Never leave a thread averaging memory that is about to go away.
        self.inner.abort.store(true, Ordering::Release);
        self.inner.wake.notify_all();
        if let Ok(mut slot) = self.thread.lock() {
            if let Some(t) = slot.take() {
                // Peers that keep training hold the agreement up: a closed
                // communicator ends it instead.
                if let Ok(Some(c)) = self.inner.comm.take() {
                    drop(c);
                }
                let _ = t.join();
            }
        }
    }
}

struct Round {
    avg: Arc<AsyncAverager>,
    staging: Vec<u64>,
}

impl BucketOp for Round {
    fn run(&mut self, bucket: &BucketTensors<'_>) -> Result<()> {
        let inner = &self.avg.inner;
        if inner.all_stopping()? {
            inner.running.store(false, Ordering::Release);
            return Ok(());
        }
        let mut staging = std::mem::take(&mut self.staging);
        let out = bucket.with_host(&mut staging, |buf| inner.round(buf));
        self.staging = staging;
        out
    }
}
