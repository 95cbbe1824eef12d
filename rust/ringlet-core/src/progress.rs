//! An ordered progress queue: one thread that runs submitted jobs strictly in
//! submission order, so asynchronous operations issued on a process group
//! complete in issue order while the caller goes on computing.
//!
//! Every job gets a ticket (its position in the queue). [`Progress::wait`]
//! blocks until a ticket's job has run. A waiter whose job has not started yet
//! runs the queued jobs itself, in order, instead of waking the thread and
//! sleeping: a synchronous call (submit, then wait at once) then costs no
//! thread switch. Whoever runs a job, the next one starts only after it ends.
//!
//! Jobs report their own outcome (the binding stores it beside the ticket);
//! the queue only tracks which have run. A panicking job counts as run.

use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

/// A unit of work run on the progress thread (or by a waiter).
pub type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// Tickets handed out so far (the next ticket).
    issued: u64,
    /// Jobs that have finished: tickets `< finished` are done.
    finished: u64,
    /// A job is running (on the thread or in a waiter).
    running: bool,
    /// The thread running it.
    runner: Option<ThreadId>,
    /// Threads blocked on `done` (its wake-up is skipped when none is).
    waiters: u32,
    stop: bool,
}

impl State {
    /// Marks the running job finished and wakes whoever needs it.
    fn finish(&mut self, shared: &Shared) {
        self.running = false;
        self.runner = None;
        self.finished += 1;
        if self.waiters > 0 {
            shared.done.notify_all();
        }
        if !self.queue.is_empty() {
            shared.work.notify_one();
        }
    }
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is queued or the queue stops.
    work: Condvar,
    /// Signalled when a job finishes.
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A job never runs under the lock, so a poisoned lock still holds
        // consistent counters.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs the job at the head of the queue with the lock released; returns
    /// the lock re-taken after the job finished.
    fn run_head<'a>(&'a self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        let Some(job) = st.queue.pop_front() else {
            return st;
        };
        st.running = true;
        st.runner = Some(std::thread::current().id());
        drop(st);
        let _ = catch_unwind(AssertUnwindSafe(job));
        let mut st = self.lock();
        st.finish(self);
        st
    }
}

/// The queue and its thread. Dropping it runs what is queued, then joins.
pub struct Progress {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Progress {
    /// Starts the progress thread, named `name`.
    pub fn new(name: &str) -> Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            done: Condvar::new(),
        });
        let worker = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let mut st = worker.lock();
                loop {
                    if !st.running && !st.queue.is_empty() {
                        st = worker.run_head(st);
                        continue;
                    }
                    if st.stop && st.queue.is_empty() {
                        return;
                    }
                    st = worker.work.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            })
            .map_err(|e| Error::io("starting the progress thread", e))?;
        Ok(Progress {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues `job`; returns its ticket. With `wake` false the thread is not
    /// woken for it: the caller is about to wait for the ticket and will run
    /// the job itself unless the thread is already busy with earlier ones (a
    /// synchronous call then costs no wake-up and no thread switch).
    pub fn submit(&self, job: Job, wake: bool) -> Result<u64> {
        let mut st = self.shared.lock();
        if st.stop {
            return Err(Error::InvalidArgument(
                "the progress queue is closed (the process group was destroyed)".into(),
            ));
        }
        st.queue.push_back(job);
        let ticket = st.issued;
        st.issued += 1;
        if wake {
            self.shared.work.notify_one();
        }
        Ok(ticket)
    }

    /// Runs `f` on the calling thread at once, in queue order, when the
    /// queue is idle (nothing queued or running); returns None, without
    /// running it, otherwise. Jobs submitted meanwhile wait behind it.
    pub fn run_now<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        {
            let mut st = self.shared.lock();
            if st.running || !st.queue.is_empty() || st.stop {
                return None;
            }
            st.running = true;
            st.runner = Some(std::thread::current().id());
            st.issued += 1;
        }
        let out = catch_unwind(AssertUnwindSafe(f));
        self.shared.lock().finish(&self.shared);
        match out {
            Ok(v) => Some(v),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// Whether the job of `ticket` has run.
    pub fn is_done(&self, ticket: u64) -> bool {
        self.shared.lock().finished > ticket
    }

    /// Blocks until the job of `ticket` has run, running queued jobs (in
    /// order) on the calling thread when none is running. Returns false when
    /// `timeout` passed first, and an error at once when the caller is
    /// itself inside a job of this queue (a completion callback) and would
    /// wait for a later job: that can never finish before this one.
    pub fn wait(&self, ticket: u64, timeout: Option<Duration>) -> Result<bool> {
        self.wait_for(ticket, timeout, true)
    }

    /// As [`Progress::wait`], but with `run_queued` false the caller never
    /// runs a job itself: it only waits for the thread (or another waiter) to
    /// run them, so a job blocked on its peers cannot hold it past `timeout`.
    pub fn wait_for(
        &self,
        ticket: u64,
        timeout: Option<Duration>,
        run_queued: bool,
    ) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = self.shared.lock();
        loop {
            if st.finished > ticket {
                return Ok(true);
            }
            if st.runner == Some(std::thread::current().id()) {
                return Err(Error::InvalidArgument(
                    "waiting, inside an operation's completion callback, for a later \
                     operation of the same process group would deadlock: operations \
                     complete in issue order"
                        .into(),
                ));
            }
            if !st.running && !st.queue.is_empty() {
                if run_queued {
                    st = self.shared.run_head(st);
                    continue;
                }
                self.shared.work.notify_one();
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(false);
            }
            st.waiters += 1;
            st = match deadline {
                None => self.shared.done.wait(st).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    self.shared
                        .done
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
            st.waiters -= 1;
        }
    }

    /// Number of jobs queued or running.
    pub fn pending(&self) -> u64 {
        let st = self.shared.lock();
        st.issued - st.finished
    }

    /// Refuses new jobs, lets the queued ones run, and joins the thread
    /// (unless called from a job on that thread, which cannot join itself).
    pub fn close(&self) {
        {
            let mut st = self.shared.lock();
            st.stop = true;
            self.shared.work.notify_all();
        }
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = handle {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn jobs_run_in_order_whoever_runs_them() {
        let p = Progress::new("test-progress").unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut tickets = Vec::new();
        for i in 0..200 {
            let log = Arc::clone(&log);
            tickets.push(
                p.submit(Box::new(move || log.lock().unwrap().push(i)), i % 3 != 0)
                    .unwrap(),
            );
            if i % 7 == 0 {
                assert!(p.wait(tickets[i], None).unwrap());
            }
        }
        assert!(p
            .wait(*tickets.last().unwrap(), Some(Duration::from_secs(10)))
            .unwrap());
        assert_eq!(*log.lock().unwrap(), (0..200).collect::<Vec<_>>());
        assert_eq!(p.pending(), 0);
    }

    #[test]
    fn wait_times_out_behind_a_slow_job_and_close_drains() {
        let p = Progress::new("test-progress").unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let count = Arc::new(AtomicUsize::new(0));
        let c1 = Arc::clone(&count);
        let first = p
            .submit(
                Box::new(move || {
                    let _ = rx.recv();
                    c1.fetch_add(1, Ordering::SeqCst);
                }),
                true,
            )
            .unwrap();
        // Make sure the thread (not this waiter) holds the first job.
        while p.shared.lock().queue.len() == 1 && !p.shared.lock().running {
            std::thread::yield_now();
        }
        let c2 = Arc::clone(&count);
        let second = p
            .submit(
                Box::new(move || {
                    c2.fetch_add(1, Ordering::SeqCst);
                }),
                true,
            )
            .unwrap();
        assert!(!p.wait(second, Some(Duration::from_millis(20))).unwrap());
        assert!(!p.is_done(first));
        tx.send(()).unwrap();
        p.close();
        assert_eq!(count.load(Ordering::SeqCst), 2);
        assert!(p.submit(Box::new(|| {}), true).is_err());
    }

    #[test]
    fn run_now_only_when_idle() {
        let p = Progress::new("test-progress").unwrap();
        assert_eq!(p.run_now(|| 5), Some(5));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = p
            .submit(
                Box::new(move || {
                    let _ = rx.recv();
                }),
                true,
            )
            .unwrap();
        assert_eq!(p.run_now(|| 6), None);
        tx.send(()).unwrap();
        assert!(p.wait(t, Some(Duration::from_secs(5))).unwrap());
        assert_eq!(p.run_now(|| 7), Some(7));
        assert_eq!(p.pending(), 0);
    }

    #[test]
    fn waiting_for_a_later_job_from_inside_a_job_is_an_error() {
        let p = Arc::new(Progress::new("test-progress").unwrap());
        let q = Arc::clone(&p);
        let (tx, rx) = std::sync::mpsc::channel();
        let first = p
            .submit(
                Box::new(move || {
                    let later = q.submit(Box::new(|| {}), true).unwrap();
                    tx.send(q.wait(later, None)).unwrap();
                }),
                true,
            )
            .unwrap();
        assert!(p.wait(first, Some(Duration::from_secs(5))).unwrap());
        assert!(rx.recv().unwrap().is_err());
    }

    #[test]
    fn a_waiter_that_does_not_run_jobs_wakes_the_thread_for_them() {
        let p = Progress::new("test-progress").unwrap();
        let me = std::thread::current().id();
        let ran_on = Arc::new(Mutex::new(None));
        let r = Arc::clone(&ran_on);
        // Not woken at submission: only the waiter's nudge starts the thread.
        let t = p
            .submit(
                Box::new(move || *r.lock().unwrap() = Some(std::thread::current().id())),
                false,
            )
            .unwrap();
        assert!(p.wait_for(t, Some(Duration::from_secs(5)), false).unwrap());
        let ran = ran_on.lock().unwrap().expect("the job ran");
        assert_ne!(ran, me);
        // A slow job run by the thread: the waiter gives up at its timeout.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let slow = p
            .submit(
                Box::new(move || {
                    let _ = rx.recv();
                }),
                false,
            )
            .unwrap();
        assert!(!p
            .wait_for(slow, Some(Duration::from_millis(20)), false)
            .unwrap());
        tx.send(()).unwrap();
        assert!(p.wait(slow, Some(Duration::from_secs(5))).unwrap());
    }

    #[test]
    fn a_panicking_job_counts_as_run() {
        let p = Progress::new("test-progress").unwrap();
        let t = p.submit(Box::new(|| panic!("boom")), true).unwrap();
        assert!(p.wait(t, Some(Duration::from_secs(5))).unwrap());
        let t2 = p.submit(Box::new(|| {}), false).unwrap();
        assert!(p.wait(t2, Some(Duration::from_secs(5))).unwrap());
    }
}
