//! The RPC agent of one worker: a listener that admits connections carrying
//! the job's token, one reader per connection, at most `request_threads`
//! requests running at once, a small pool that completes the caller's
//! asynchronous calls (so a request that blocks on a nested call never starves
//! the completion of that call), and the table of pending calls with their
//! deadlines.
//!
//! Leader/follower: the thread that reads a request runs it itself, after
//! handing the reading of its connection to another thread, so a request
//! starts without a thread switch. Responses arrive only on connections this
//! worker dialled and requests only on the ones it accepted, so a request
//! blocked on a nested call never holds up the response it waits for.
//!
//! The agent moves opaque payloads and raw tensor bytes; what a payload
//! means (function, arguments, RRef protocol) is the embedder's business,
//! through the [`Handler`] it installs. Connections are made on first use and
//! are bidirectional: a request goes out on the connection this worker dialled
//! and its response comes back on the same one.
//!
//! Failures: a connection that breaks fails every pending call to that peer at
//! once (with the peer's rank); a call past its deadline is failed by the timer
//! thread; a malformed frame closes the connection it came on, which fails the
//! calls that were waiting on it. Nothing here panics on bad input.

use super::frame::{Desc, Header, Kind, Place, DESC_BYTES, HEADER_BYTES};
use super::status;
use crate::error::{Error, Result};
use crate::sys;
use crate::transport::tcp::{hello_bytes, read_hello, RPC_MAGIC};
use std::any::Any;
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread;
use std::time::{Duration, Instant};

/// Longest sleep of the deadline thread.
const TIMER_IDLE: Duration = Duration::from_millis(200);
/// Destinations at least this large are backed by huge pages before a fetch.
const HUGE_PAGE_MIN: usize = 4 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Receives everything that arrives for this worker. Called on the agent's
/// pool threads.
pub trait Handler: Send + Sync {
    /// A request to run; answer it with [`Agent::respond`] (now or later).
    fn request(&self, msg: Incoming);
    /// The outcome of one of this worker's calls: a response, or a failure the
    /// agent detected (status `TIMEOUT`, `PEER_LOST`, `SHUTDOWN`).
    fn response(&self, msg: Incoming);
}

/// Something that must stay alive until a peer has copied tensor memory out
/// of it (the embedder passes its tensors).
pub type KeepAlive = Box<dyn Any + Send>;

struct Conn {
    peer: usize,
    pid: u32,
    outgoing: bool,
    stream: TcpStream,
    writer: Mutex<TcpStream>,
}

impl Conn {
    fn write_frame(&self, parts: &[&[u8]]) -> std::io::Result<()> {
        let mut w = lock(&self.writer);
        for p in parts {
            w.write_all(p)?;
        }
        Ok(())
    }
}

/// Where to send the answer to a request.
#[derive(Clone)]
pub struct ReplyTo {
    conn: Arc<Conn>,
    id: u64,
}

impl ReplyTo {
    /// The rank that made the request.
    pub fn peer(&self) -> usize {
        self.conn.peer
    }
}

/// A received request or response (or a locally made failure of a call).
pub struct Incoming {
    /// Call id (the caller's).
    pub id: u64,
    /// The rank it came from (for a local failure: the call's destination).
    pub from: usize,
    /// `status::OK` for requests and successful responses.
    pub status: u8,
    /// The opaque payload (for local failures: a UTF-8 message).
    pub payload: Vec<u8>,
    descs: Vec<Desc>,
    offsets: Vec<usize>,
    data: Vec<u8>,
    reply: Option<ReplyTo>,
    kind: Kind,
    pool: Option<Arc<BufPool>>,
}

impl Incoming {
    fn local_failure(id: u64, to: usize, status: u8, msg: String) -> Incoming {
        Incoming {
            id,
            from: to,
            status,
            payload: msg.into_bytes(),
            descs: Vec::new(),
            offsets: Vec::new(),
            data: Vec::new(),
            reply: None,
            kind: Kind::Response,
            pool: None,
        }
    }

    /// Byte length of each tensor in the message.
    pub fn tensor_lens(&self) -> Vec<usize> {
        self.descs.iter().map(|d| d.len as usize).collect()
    }

    /// Copies tensor `i` into `dst` (which must have its exact length): from
    /// the frame, or straight out of the sender's memory (one copy).
    pub fn fetch(&self, i: usize, dst: &mut [u8]) -> Result<()> {
        let d = self
            .descs
            .get(i)
            .ok_or_else(|| Error::InvalidArgument(format!("no tensor {i} in the message")))?;
        if d.len as usize != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor {i} has {} bytes, destination {}",
                d.len,
                dst.len()
            )));
        }
        if dst.len() >= HUGE_PAGE_MIN {
            sys::advise_huge_pages(dst);
        }
        match d.place {
            Place::Inline => {
                let at = self.offsets[i];
                dst.copy_from_slice(&self.data[at..at + dst.len()]);
                Ok(())
            }
            Place::Remote { pid, addr } => sys::read_peer_memory(pid, addr, dst).map_err(|e| {
                Error::Rpc(format!(
                    "could not copy a tensor from worker rank {} (pid {pid}): {e}",
                    self.from
                ))
            }),
        }
    }

    /// Where to answer (requests only).
    pub fn reply_to(&self) -> Option<ReplyTo> {
        self.reply.clone()
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            pool.give(std::mem::take(&mut self.data));
        }
        // Tensors fetched (or abandoned): let the sender release their memory.
        if self.descs.iter().any(|d| d.place != Place::Inline) {
            if let Some(r) = &self.reply {
                let h = Header {
                    kind: Kind::Ack,
                    status: self.kind as u8,
                    id: self.id,
                    payload_len: 0,
                    ntensors: 0,
                    inline_total: 0,
                };
                let _ = r.conn.write_frame(&[&h.encode()]);
            }
        }
    }
}

/// Receive buffers for inline tensor bytes, kept for reuse: fresh memory
/// costs a page fault per 4 KiB on first touch, which for large messages
/// costs more than the copy itself.
#[derive(Default)]
struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
}

const POOL_MIN: usize = 64 << 10;
const POOL_MAX_BUFS: usize = 8;
const POOL_MAX_BYTES: usize = 256 << 20;

impl BufPool {
    /// A buffer of at least `n` bytes (its length may exceed `n`).
    fn take(&self, n: usize) -> Option<Vec<u8>> {
        if n < POOL_MIN {
            return None;
        }
        let mut free = lock(&self.free);
        let i = free.iter().position(|b| b.len() >= n && b.len() <= 2 * n)?;
        Some(free.swap_remove(i))
    }

    fn give(&self, buf: Vec<u8>) {
        if buf.len() < POOL_MIN || buf.len() > POOL_MAX_BYTES / 2 {
            return;
        }
        let mut free = lock(&self.free);
        let held: usize = free.iter().map(|b| b.len()).sum();
        if free.len() < POOL_MAX_BUFS && held + buf.len() <= POOL_MAX_BYTES {
            free.push(buf);
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// A fixed number of threads taking jobs from one queue.
struct Pool {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
}

impl Pool {
    fn new(name: &str, threads: usize) -> Result<Pool> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || loop {
                    let job = match lock(&rx).recv() {
                        Ok(j) => j,
                        Err(_) => return,
                    };
                    job();
                })
                .map_err(|e| Error::io("spawn an RPC thread", e))?;
        }
        Ok(Pool {
            tx: Mutex::new(Some(tx)),
        })
    }

    fn submit(&self, job: Job) {
        if let Some(tx) = lock(&self.tx).as_ref() {
            let _ = tx.send(job);
        }
    }

    fn close(&self) {
        lock(&self.tx).take();
    }
}

/// Where a call's outcome goes.
enum Waiter {
    /// To [`Handler::response`] on a completion thread.
    Handler,
    /// To a thread blocked in [`Agent::call_wait`].
    Slot(Arc<Slot>),
}

#[derive(Default)]
struct Slot {
    msg: Mutex<Option<Incoming>>,
    ready: Condvar,
}

/// Threads for connection readers (and the requests they run): every job
/// gets a thread at once (an idle one or a new one), so a connection is never
/// left unread while its reader's thread runs a request.
struct IoPool {
    state: Mutex<IoState>,
    wake: Condvar,
}

#[derive(Default)]
struct IoState {
    jobs: std::collections::VecDeque<Job>,
    idle: usize,
    closed: bool,
}

impl IoPool {
    fn submit(self: &Arc<Self>, job: Job) -> std::result::Result<(), Job> {
        let mut st = lock(&self.state);
        if st.idle > st.jobs.len() {
            st.jobs.push_back(job);
            self.wake.notify_one();
            return Ok(());
        }
        drop(st);
        let me = self.clone();
        let slot = Arc::new(Mutex::new(Some(job)));
        let taken = slot.clone();
        let spawned = thread::Builder::new()
            .name("ringlet-rpc-io".into())
            .spawn(move || {
                if let Some(j) = lock(&taken).take() {
                    j();
                }
                me.work();
            });
        match spawned {
            Ok(_) => Ok(()),
            Err(_) => lock(&slot).take().map_or(Ok(()), Err),
        }
    }

    fn work(&self) {
        loop {
            let job = {
                let mut st = lock(&self.state);
                st.idle += 1;
                while st.jobs.is_empty() && !st.closed {
                    st = match self.wake.wait(st) {
                        Ok(g) => g,
                        Err(p) => p.into_inner(),
                    };
                }
                st.idle -= 1;
                match st.jobs.pop_front() {
                    Some(j) => j,
                    None => return,
                }
            };
            job();
        }
    }

    fn close(&self) {
        lock(&self.state).closed = true;
        self.wake.notify_all();
    }
}

/// Requests running, and those waiting for a free slot.
#[derive(Default)]
struct RequestQueue {
    running: usize,
    waiting: std::collections::VecDeque<Incoming>,
}

struct Pending {
    to: usize,
    deadline: Option<Instant>,
    waiter: Waiter,
}

struct Peer {
    addr: String,
    same_host: bool,
}

struct Inner {
    rank: usize,
    token: u64,
    handler: Arc<dyn Handler>,
    peers: RwLock<Vec<Peer>>,
    out: Mutex<HashMap<usize, Arc<Conn>>>,
    all: Mutex<Vec<Arc<Conn>>>,
    pending: Mutex<HashMap<u64, Pending>>,
    /// Earliest deadline among the pending calls (may be stale-early).
    next_due: Mutex<Option<Instant>>,
    timer: Condvar,
    pins: Mutex<HashMap<(usize, u8, u64), KeepAlive>>,
    next_id: AtomicU64,
    closing: AtomicBool,
    refused: AtomicU64,
    io: Arc<IoPool>,
    bufs: Arc<BufPool>,
    queue: Mutex<RequestQueue>,
    max_running: usize,
    completions: Pool,
    single_copy_min: usize,
}

/// Options of an [`Agent`].
pub struct AgentConfig {
    /// This worker's rank.
    pub rank: usize,
    /// The job's secret: connections without it are refused.
    pub token: u64,
    /// Threads that run incoming requests.
    pub request_threads: usize,
    /// Threads that complete this worker's calls.
    pub completion_threads: usize,
    /// Tensors at least this large go single-copy between processes on one
    /// host (`usize::MAX`: never).
    pub single_copy_min: usize,
}

/// One worker's RPC endpoint.
pub struct Agent {
    inner: Arc<Inner>,
    port: u16,
}

fn lost(peer: usize, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Rpc(format!(
        "lost the connection to worker rank {peer} ({what}: {e})"
    ))
}

impl Agent {
    /// Starts the agent: binds `bind_addr` (port 0: any free port) and starts
    /// the listener, timer and pool threads.
    pub fn start(cfg: AgentConfig, bind_addr: &str, handler: Arc<dyn Handler>) -> Result<Agent> {
        let listener = crate::transport::tcp::listen(bind_addr)?;
        let port = listener
            .local_addr()
            .map_err(|e| Error::io("listener address", e))?
            .port();
        let inner = Arc::new(Inner {
            rank: cfg.rank,
            token: cfg.token,
            handler,
            peers: RwLock::new(Vec::new()),
            out: Mutex::new(HashMap::new()),
            all: Mutex::new(Vec::new()),
            pending: Mutex::new(HashMap::new()),
            next_due: Mutex::new(None),
            timer: Condvar::new(),
            pins: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            closing: AtomicBool::new(false),
            refused: AtomicU64::new(0),
            io: Arc::new(IoPool {
                state: Mutex::new(IoState::default()),
                wake: Condvar::new(),
            }),
            bufs: Arc::new(BufPool::default()),
            queue: Mutex::new(RequestQueue::default()),
            max_running: cfg.request_threads.max(1),
            completions: Pool::new("ringlet-rpc-done", cfg.completion_threads)?,
            single_copy_min: cfg.single_copy_min,
        });
        let i = inner.clone();
        thread::Builder::new()
            .name("ringlet-rpc-listen".into())
            .spawn(move || i.listen(listener))
            .map_err(|e| Error::io("spawn the RPC listener", e))?;
        let i = inner.clone();
        thread::Builder::new()
            .name("ringlet-rpc-timer".into())
            .spawn(move || i.expire_loop())
            .map_err(|e| Error::io("spawn the RPC timer", e))?;
        Ok(Agent { inner, port })
    }

    /// The port the agent listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Sets every worker's listening address (`host:port`) and whether it
    /// shares this host (then large tensors go single-copy).
    pub fn set_peers(&self, addrs: Vec<String>, same_host: Vec<bool>) -> Result<()> {
        if addrs.len() != same_host.len() || self.inner.rank >= addrs.len() {
            return Err(Error::InvalidArgument(
                "addresses and host flags must cover every worker".into(),
            ));
        }
        let peers = addrs
            .into_iter()
            .zip(same_host)
            .map(|(addr, same_host)| Peer { addr, same_host })
            .collect();
        *self.inner.peers.write().unwrap_or_else(|p| p.into_inner()) = peers;
        Ok(())
    }

    /// Sends a request to `to` and returns its call id at once; the outcome
    /// reaches [`Handler::response`] with that id. `timeout` of `None`: no
    /// deadline. `keep` is held until `to` has copied any tensor it reads
    /// from this process's memory.
    pub fn call(
        &self,
        to: usize,
        payload: &[u8],
        tensors: &[&[u8]],
        timeout: Option<Duration>,
        keep: KeepAlive,
    ) -> Result<u64> {
        self.start_call(to, payload, tensors, timeout, keep, Waiter::Handler)
    }

    /// As [`Agent::call`], but blocks the calling thread until the outcome
    /// arrives and returns it (no completion thread involved: the reader
    /// thread hands the response straight over).
    pub fn call_wait(
        &self,
        to: usize,
        payload: &[u8],
        tensors: &[&[u8]],
        timeout: Option<Duration>,
        keep: KeepAlive,
    ) -> Result<Incoming> {
        let slot = Arc::new(Slot::default());
        self.start_call(
            to,
            payload,
            tensors,
            timeout,
            keep,
            Waiter::Slot(slot.clone()),
        )?;
        let mut g = lock(&slot.msg);
        loop {
            if let Some(m) = g.take() {
                return Ok(m);
            }
            g = match slot.ready.wait(g) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
    }

    fn start_call(
        &self,
        to: usize,
        payload: &[u8],
        tensors: &[&[u8]],
        timeout: Option<Duration>,
        keep: KeepAlive,
        waiter: Waiter,
    ) -> Result<u64> {
        let inner = &self.inner;
        if inner.closing.load(Ordering::Acquire) {
            return Err(Error::Rpc("the RPC agent has shut down".into()));
        }
        let conn = inner.connection(to)?;
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let deadline = timeout.map(|t| Instant::now() + t);
        {
            // Under the table's lock, so the deadline thread either sees the
            // new deadline or is already asleep and gets the notification.
            let mut table = lock(&inner.pending);
            table.insert(
                id,
                Pending {
                    to,
                    deadline,
                    waiter,
                },
            );
            if let Some(d) = deadline {
                let mut due = lock(&inner.next_due);
                if due.is_none_or(|cur| d < cur) {
                    *due = Some(d);
                    inner.timer.notify_all();
                }
            }
        }
        if let Err(e) = inner.send(&conn, Kind::Request, status::OK, id, payload, tensors, keep) {
            lock(&inner.pending).remove(&id);
            return Err(e);
        }
        Ok(id)
    }

    /// Answers a request.
    pub fn respond(
        &self,
        to: &ReplyTo,
        status: u8,
        payload: &[u8],
        tensors: &[&[u8]],
        keep: KeepAlive,
    ) -> Result<()> {
        self.inner.send(
            &to.conn,
            Kind::Response,
            status,
            to.id,
            payload,
            tensors,
            keep,
        )
    }

    /// Number of calls waiting for their outcome.
    pub fn pending(&self) -> usize {
        lock(&self.inner.pending).len()
    }

    /// Connections refused so far (wrong token or garbage greeting).
    pub fn refused(&self) -> u64 {
        self.inner.refused.load(Ordering::Relaxed)
    }

    /// Stops accepting, closes every connection and fails the calls still
    /// pending with status `SHUTDOWN`. Threads running requests finish theirs.
    pub fn shutdown(&self) {
        let inner = &self.inner;
        if inner.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        for c in lock(&inner.all).drain(..) {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        lock(&inner.out).clear();
        let pend: Vec<(u64, Pending)> = lock(&inner.pending).drain().collect();
        for (id, p) in pend {
            let msg = Incoming::local_failure(
                id,
                p.to,
                status::SHUTDOWN,
                "the RPC agent shut down before the call completed".into(),
            );
            inner.complete(p.waiter, msg);
        }
        lock(&inner.pins).clear();
        inner.timer.notify_all();
        inner.io.close();
        inner.completions.close();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Reads exactly `n` bytes into a new vector that grows as the bytes arrive,
/// so a header announcing a huge length costs nothing until the data exists.
fn read_vec(s: &mut TcpStream, n: usize) -> std::io::Result<Vec<u8>> {
    let mut v = Vec::with_capacity(n.min(READ_CHUNK));
    Read::by_ref(s).take(n as u64).read_to_end(&mut v)?;
    if v.len() != n {
        return Err(std::io::Error::new(
            ErrorKind::UnexpectedEof,
            format!("{} of {n} bytes", v.len()),
        ));
    }
    Ok(v)
}

/// Largest allocation made before the bytes it is for have arrived.
const READ_CHUNK: usize = 64 << 20;

/// This worker's hello (the transport's handshake, with the RPC magic and
/// the pid as the extra word).
fn hello(token: u64, rank: usize) -> Vec<u8> {
    hello_bytes(RPC_MAGIC, token, rank, &[u64::from(sys::pid())])
}

/// A peer's hello: its token, rank and pid.
fn read_greeting(s: &mut TcpStream) -> Option<(u64, usize, u32)> {
    let (token, rank, [pid]) = read_hello::<1>(s, RPC_MAGIC)?;
    Some((token, rank, pid as u32))
}

impl Inner {
    fn world(&self) -> usize {
        self.peers.read().map(|p| p.len()).unwrap_or(0)
    }

    fn listen(self: Arc<Self>, listener: TcpListener) {
        while !self.closing.load(Ordering::Acquire) {
            match listener.accept() {
                Ok((s, _)) => {
                    let me = self.clone();
                    // Greet on a thread of its own: a silent client must not
                    // hold up the others.
                    let _ = thread::Builder::new()
                        .name("ringlet-rpc-greet".into())
                        .spawn(move || me.admit(s));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let mut p = [libc::pollfd {
                        fd: listener.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    }];
                    let _ = sys::poll(&mut p, Duration::from_millis(100));
                }
                Err(_) => thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    fn admit(self: Arc<Self>, mut s: TcpStream) {
        let ok = s.set_nonblocking(false).is_ok()
            && s.set_read_timeout(Some(Duration::from_secs(10))).is_ok();
        let greeting = if ok { read_greeting(&mut s) } else { None };
        match greeting {
            Some((token, rank, pid))
                if token == self.token
                    && (self.world() == 0 || rank < self.world())
                    && s.set_read_timeout(None).is_ok() =>
            {
                let _ = self.register(s, rank, pid, false);
            }
            _ => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    fn register(
        self: &Arc<Self>,
        s: TcpStream,
        peer: usize,
        pid: u32,
        outgoing: bool,
    ) -> Result<Arc<Conn>> {
        let _ = s.set_nodelay(true);
        let writer = s.try_clone().map_err(|e| Error::io("clone a stream", e))?;
        let reader = s.try_clone().map_err(|e| Error::io("clone a stream", e))?;
        let conn = Arc::new(Conn {
            peer,
            pid,
            outgoing,
            stream: s,
            writer: Mutex::new(writer),
        });
        lock(&self.all).push(conn.clone());
        if self.closing.load(Ordering::Acquire) {
            let _ = conn.stream.shutdown(Shutdown::Both);
        }
        let me = self.clone();
        let c = conn.clone();
        thread::Builder::new()
            .name(format!("ringlet-rpc-read-{peer}"))
            .spawn(move || me.read_loop(c, reader, false))
            .map_err(|e| Error::io("spawn an RPC reader", e))?;
        Ok(conn)
    }

    fn connection(self: &Arc<Self>, to: usize) -> Result<Arc<Conn>> {
        let mut out = lock(&self.out);
        if let Some(c) = out.get(&to) {
            return Ok(c.clone());
        }
        let addr = {
            let peers = self.peers.read().unwrap_or_else(|p| p.into_inner());
            peers
                .get(to)
                .map(|p| p.addr.clone())
                .ok_or_else(|| Error::InvalidArgument(format!("unknown worker rank {to}")))?
        };
        let target = addr
            .to_socket_addrs()
            .map_err(|e| Error::io(format!("resolve {addr}"), e))?
            .next()
            .ok_or_else(|| Error::Rpc(format!("address {addr} resolves to nothing")))?;
        let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(30))
            .map_err(|e| lost(to, "connect", e))?;
        s.write_all(&hello(self.token, self.rank))
            .map_err(|e| lost(to, "greet", e))?;
        // The peer's pid comes back as its own greeting.
        let pid = match read_greeting(&mut s) {
            Some((token, rank, pid)) if token == self.token && rank == to => pid,
            _ => return Err(lost(to, "greet", "the peer refused the connection")),
        };
        let conn = self.register(s, to, pid, true)?;
        out.insert(to, conn.clone());
        Ok(conn)
    }

    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        conn: &Arc<Conn>,
        kind: Kind,
        status: u8,
        id: u64,
        payload: &[u8],
        tensors: &[&[u8]],
        keep: KeepAlive,
    ) -> Result<()> {
        let same_host = self
            .peers
            .read()
            .ok()
            .and_then(|p| p.get(conn.peer).map(|p| p.same_host))
            .unwrap_or(false);
        let mut descs = Vec::with_capacity(tensors.len() * DESC_BYTES);
        let mut inline_total = 0u64;
        let mut remote = false;
        let mut inline: Vec<&[u8]> = Vec::new();
        for t in tensors {
            let place = if same_host && t.len() >= self.single_copy_min {
                remote = true;
                Place::Remote {
                    pid: sys::pid(),
                    addr: t.as_ptr() as u64,
                }
            } else {
                inline_total += t.len() as u64;
                inline.push(t);
                Place::Inline
            };
            Desc {
                len: t.len() as u64,
                place,
            }
            .encode(&mut descs);
        }
        let header = Header {
            kind,
            status,
            id,
            payload_len: payload.len() as u64,
            ntensors: tensors.len() as u32,
            inline_total,
        }
        .encode();
        let key = (conn.peer, kind as u8, id);
        if remote {
            lock(&self.pins).insert(key, keep);
        }
        let mut parts: Vec<&[u8]> = vec![&header, payload, &descs];
        parts.extend(inline);
        conn.write_frame(&parts).map_err(|e| {
            lock(&self.pins).remove(&key);
            lost(conn.peer, "send", e)
        })
    }

    fn read_loop(self: Arc<Self>, conn: Arc<Conn>, mut s: TcpStream, greeted: bool) {
        let outgoing = conn.outgoing;
        if !greeted && !outgoing {
            // Answer the greeting with ours (carries our pid).
            if conn.write_frame(&[&hello(self.token, self.rank)]).is_err() {
                return;
            }
        }
        let why = loop {
            match self.read_one(&conn, &mut s) {
                Ok(None) => {}
                Ok(Some(req)) => {
                    // Another thread goes on reading; this one runs the request.
                    let me = self.clone();
                    let c = conn.clone();
                    let next: Job = Box::new(move || me.read_loop(c, s, true));
                    match self.io.submit(next) {
                        Ok(()) => {
                            self.run_request(req);
                            return;
                        }
                        Err(job) => {
                            // No thread to be had: queue the request, read on here.
                            lock(&self.queue).waiting.push_back(req);
                            return job();
                        }
                    }
                }
                Err(e) => break e,
            }
        };
        let _ = conn.stream.shutdown(Shutdown::Both);
        lock(&self.all).retain(|c| !Arc::ptr_eq(c, &conn));
        {
            let mut out = lock(&self.out);
            if out.get(&conn.peer).is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                out.remove(&conn.peer);
            }
        }
        if self.closing.load(Ordering::Acquire) {
            return;
        }
        lock(&self.pins).retain(|k, _| k.0 != conn.peer);
        if outgoing {
            self.fail_peer(conn.peer, &why.to_string());
        }
    }

    /// Runs `msg`, then any requests that queued meanwhile, keeping at most
    /// `max_running` requests running at once.
    fn run_request(&self, msg: Incoming) {
        {
            let mut q = lock(&self.queue);
            if q.running >= self.max_running {
                q.waiting.push_back(msg);
                return;
            }
            q.running += 1;
        }
        let mut next = Some(msg);
        while let Some(m) = next {
            self.handler.request(m);
            let mut q = lock(&self.queue);
            next = q.waiting.pop_front();
            if next.is_none() {
                q.running -= 1;
            }
        }
    }

    /// Delivers a call's outcome to whoever waits for it.
    fn complete(&self, waiter: Waiter, msg: Incoming) {
        match waiter {
            Waiter::Handler => {
                let h = self.handler.clone();
                self.completions.submit(Box::new(move || h.response(msg)));
            }
            Waiter::Slot(slot) => {
                *lock(&slot.msg) = Some(msg);
                slot.ready.notify_all();
            }
        }
    }

    /// Fails every pending call to `peer`.
    fn fail_peer(&self, peer: usize, why: &str) {
        let failed: Vec<(u64, Pending)> = {
            let mut p = lock(&self.pending);
            let ids: Vec<u64> = p
                .iter()
                .filter(|(_, v)| v.to == peer)
                .map(|(k, _)| *k)
                .collect();
            ids.into_iter()
                .filter_map(|id| p.remove(&id).map(|v| (id, v)))
                .collect()
        };
        for (id, p) in failed {
            let msg = Incoming::local_failure(id, peer, status::PEER_LOST, why.to_string());
            self.complete(p.waiter, msg);
        }
    }

    /// Reads one frame: a request is returned to be run, anything else is
    /// delivered here.
    fn read_one(&self, conn: &Arc<Conn>, s: &mut TcpStream) -> Result<Option<Incoming>> {
        let peer = conn.peer;
        let mut hb = [0u8; HEADER_BYTES];
        s.read_exact(&mut hb).map_err(|e| lost(peer, "read", e))?;
        let h = Header::decode(&hb)?;
        if h.kind == Kind::Ack {
            lock(&self.pins).remove(&(peer, h.status, h.id));
            return Ok(None);
        }
        let truncated = |e| lost(peer, "read (truncated message)", e);
        let payload = read_vec(s, h.payload_len as usize).map_err(truncated)?;
        let db = read_vec(s, h.ntensors as usize * DESC_BYTES).map_err(truncated)?;
        let descs = Desc::decode_all(&db, &h)?;
        let mut offsets = Vec::with_capacity(descs.len());
        let mut at = 0usize;
        for d in &descs {
            offsets.push(at);
            match d.place {
                Place::Inline => at += d.len as usize,
                Place::Remote { pid, .. } if pid == conn.pid => {}
                Place::Remote { .. } => {
                    return Err(Error::Rpc(
                        "malformed RPC message: tensor memory outside the sender".into(),
                    ))
                }
            }
        }
        let n = h.inline_total as usize;
        let data = match self.bufs.take(n) {
            Some(mut buf) => {
                s.read_exact(&mut buf[..n]).map_err(truncated)?;
                buf
            }
            None => read_vec(s, n).map_err(truncated)?,
        };
        let msg = Incoming {
            id: h.id,
            from: peer,
            status: h.status,
            payload,
            descs,
            offsets,
            data,
            reply: Some(ReplyTo {
                conn: conn.clone(),
                id: h.id,
            }),
            kind: h.kind,
            pool: Some(self.bufs.clone()),
        };
        if h.kind == Kind::Request {
            return Ok(Some(msg));
        }
        // A response nobody waits for any more (timed out) is dropped, which
        // still acknowledges its tensors.
        let waiting = lock(&self.pending).remove(&h.id);
        if let Some(p) = waiting {
            self.complete(p.waiter, msg);
        }
        Ok(None)
    }

    /// Fails calls past their deadline. The table is scanned only when the
    /// earliest deadline has passed; in between the thread sleeps until then
    /// (or until a call with an earlier deadline starts).
    fn expire_loop(self: Arc<Self>) {
        let mut pending = lock(&self.pending);
        while !self.closing.load(Ordering::Acquire) {
            let now = Instant::now();
            let due = *lock(&self.next_due);
            if due.is_some_and(|d| d <= now) {
                let expired: Vec<u64> = pending
                    .iter()
                    .filter(|(_, p)| p.deadline.is_some_and(|d| d <= now))
                    .map(|(k, _)| *k)
                    .collect();
                for id in expired {
                    if let Some(p) = pending.remove(&id) {
                        let msg = Incoming::local_failure(id, p.to, status::TIMEOUT, String::new());
                        self.complete(p.waiter, msg);
                    }
                }
                *lock(&self.next_due) = pending.values().filter_map(|p| p.deadline).min();
            }
            let wait = lock(&self.next_due)
                .map(|d| d.saturating_duration_since(Instant::now()))
                .unwrap_or(TIMER_IDLE)
                .clamp(Duration::from_micros(100), TIMER_IDLE);
            pending = match self.timer.wait_timeout(pending, wait) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{channel, Receiver, Sender};

    type Outcome = (u64, u8, Vec<u8>);

    /// Echoes every request (after `delay_ms` from the payload's first byte)
    /// and forwards every response to a channel.
    struct Echo {
        agent: Mutex<Option<Arc<Agent>>>,
        done: Mutex<Sender<Outcome>>,
    }

    impl Handler for Echo {
        fn request(&self, msg: Incoming) {
            let delay = msg.payload.first().copied().unwrap_or(0);
            thread::sleep(Duration::from_millis(delay as u64 * 10));
            let mut bufs: Vec<Vec<u8>> = msg.tensor_lens().iter().map(|n| vec![0; *n]).collect();
            for (i, b) in bufs.iter_mut().enumerate() {
                assert!(msg.fetch(i, b).is_ok());
            }
            // The keep-alive owns the buffers: a same-host peer reads them
            // after this function has returned.
            let bufs = Arc::new(bufs);
            let slices: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
            let reply = msg.reply_to();
            let agent = lock(&self.agent).clone();
            if let (Some(a), Some(r)) = (agent, reply) {
                let keep = Box::new(bufs.clone());
                let _ = a.respond(&r, status::OK, &msg.payload, &slices, keep);
            }
        }

        fn response(&self, msg: Incoming) {
            let _ = lock(&self.done).send((msg.id, msg.status, msg.payload.clone()));
        }
    }

    fn pair(same_host: bool) -> (Arc<Agent>, Arc<Agent>, Receiver<Outcome>) {
        let (tx, rx) = channel();
        let mut agents = Vec::new();
        for rank in 0..2 {
            let h = Arc::new(Echo {
                agent: Mutex::new(None),
                done: Mutex::new(tx.clone()),
            });
            let cfg = AgentConfig {
                rank,
                token: 42,
                request_threads: 4,
                completion_threads: 1,
                single_copy_min: 1024,
            };
            let a = Arc::new(Agent::start(cfg, "127.0.0.1:0", h.clone()).expect("start"));
            *lock(&h.agent) = Some(a.clone());
            agents.push(a);
        }
        let addrs: Vec<String> = agents
            .iter()
            .map(|a| format!("127.0.0.1:{}", a.port()))
            .collect();
        for a in &agents {
            a.set_peers(addrs.clone(), vec![same_host; 2])
                .expect("peers");
        }
        let b = agents.pop().expect("two");
        let a = agents.pop().expect("two");
        (a, b, rx)
    }

    #[test]
    fn echo_inline_and_single_copy() {
        for same_host in [false, true] {
            let (a, _b, _rx) = pair(same_host);
            let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
            let small = vec![7u8; 10];
            let got = a
                .call_wait(1, &[0, 1, 2], &[&big, &small, &[]], None, Box::new(()))
                .expect("call");
            assert_eq!(got.status, status::OK);
            assert_eq!(got.payload, vec![0, 1, 2]);
            assert_eq!(got.tensor_lens(), vec![big.len(), 10, 0]);
            let mut back = vec![0u8; big.len()];
            got.fetch(0, &mut back).expect("fetch");
            assert_eq!(back, big);
            a.shutdown();
        }
    }

    #[test]
    fn timeout_and_shutdown_fail_pending_calls() {
        let (a, b, rx) = pair(false);
        let id = a
            .call(1, &[50], &[], Some(Duration::from_millis(50)), Box::new(()))
            .expect("call");
        let (got, st, _) = rx.recv_timeout(Duration::from_secs(5)).expect("timeout");
        assert_eq!((got, st), (id, status::TIMEOUT));
        // The callee goes away while a call waits: the call fails at once.
        let id = a.call(1, &[100], &[], None, Box::new(())).expect("call");
        b.shutdown();
        let (got, st, _) = rx.recv_timeout(Duration::from_secs(5)).expect("lost");
        assert_eq!((got, st), (id, status::PEER_LOST));
        assert!(a.call(1, &[0], &[], None, Box::new(())).is_err());
    }

    #[test]
    fn wrong_token_is_refused() {
        let (a, _b, _rx) = pair(false);
        let mut s = TcpStream::connect(("127.0.0.1", a.port())).expect("connect");
        s.write_all(&hello(41, 1)).expect("write");
        let mut buf = [0u8; 8];
        assert_eq!(s.read(&mut buf).unwrap_or(0), 0);
        assert_eq!(a.refused(), 1);
        assert!(a.call_wait(1, &[0], &[], None, Box::new(())).is_ok());
    }
}
