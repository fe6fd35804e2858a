//! Ranks as processes with one GPU each, collectives through NCCL (behind the `cuda` feature).
//!
//! The NCCL library is loaded at run time (cudarc's dynamic loading), so this compiles on a
//! machine without CUDA; creating a group there fails with a [`CommError::Setup`].
//!
//! Rendezvous goes through a control group of the same ranks (a TCP group for processes, a
//! thread group for ranks as threads of one process, one GPU each): it carries rank 0's NCCL
//! unique id (128 bytes) to every rank, and afterwards every collective's header (op, sequence
//! number, dtype, length), so that a rank calling a different collective than its peers is
//! reported on every rank, as on the other backends, instead of deadlocking inside NCCL. A peer
//! that dies is seen by the control group at the next header exchange; a collective that NCCL
//! does not finish within the timeout aborts the communicator and fails the group. At set-up, a
//! rank that cannot open its GPU or stream is named by every other rank before any enters
//! `ncclCommInitRank` ([`all_ready`](super::all_ready)), and a set-up that has not returned
//! within the timeout ends the process with an error naming the rank.
//!
//! Two kinds of entry points:
//! - [`ProcessGroup`] on host [`FlatBuffer`]s, staged through device buffers on the group's own
//!   stream; 16-bit buffers are widened to f32 on the host first, so that they are reduced in f32
//!   and rounded once, as on every backend.
//! - `*_device` methods on device buffers ([`CudaSlice`]), enqueued on the group's stream without
//!   any host copy or wait. Their stream-ordering contract: the caller passes an event recorded
//!   on its compute stream after the kernels that write the input (`ready`); the group's stream
//!   waits on it before the collective. The method returns an event recorded on the group's
//!   stream after the collective; the caller makes its compute stream wait on it
//!   (`stream.wait(&event)`) before it reads the result or writes the buffers again, or waits
//!   on the host with [`NcclGroup::wait_device`], which has the group's timeout. 16-bit device
//!   buffers are reduced with NCCL's own 16-bit arithmetic.

mod host;

use super::env::{timeout_from_env, DistEnv};
use super::op::{OpDesc, OpKind, DESC_BYTES};
use super::reduce::Element;
use super::worker::Worker;
use super::{CommError, DType, FlatBuffer, ReduceOp, SharedGroup, Subject, TcpGroup, TcpOptions};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits};
use cudarc::nccl::{Comm, Id, NcclType};
use host::NcclRank;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One rank of an NCCL group: one GPU, and a process or a thread of its own.
pub struct NcclGroup {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
    worker: Worker<NcclRank>,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclGroup(rank {} of {})", self.rank, self.world)
    }
}

/// What the handle and its worker thread share.
struct Shared {
    rank: usize,
    world: usize,
    /// The control group: rendezvous, headers, liveness. Used by nothing else, so that its
    /// collectives come in the same order on every rank.
    ctrl: SharedGroup,
    timeout: Duration,
    state: Mutex<NcclState>,
}

/// The communicator, its stream, and the group's sequence number; one collective at a time.
struct NcclState {
    /// `None` once aborted.
    comm: Option<Comm>,
    stream: Arc<CudaStream>,
    seq: u64,
    /// Set once NCCL failed or timed out: the communicator is aborted, nothing more may run.
    broken: Option<CommError>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; the mutex around this state guarantees that.
unsafe impl Send for NcclState {}

impl NcclState {
    /// The communicator, unless the group broke.
    fn comm(&self) -> Result<&Comm, CommError> {
        match (&self.comm, &self.broken) {
            (Some(c), _) => Ok(c),
            (None, Some(cause)) => Err(cause.clone()),
            (None, None) => Err(CommError::Shutdown { op: "nccl".into() }),
        }
    }
}

/// A collective enqueued on the group's stream by a `*_device` method: the event recorded after
/// it (what [`DeviceWork::event`] and `Deref` give, for `stream.wait(&work)`), and which
/// collective it is, for [`NcclGroup::wait_device`]'s errors.
#[derive(Debug)]
pub struct DeviceWork {
    event: CudaEvent,
    kind: OpKind,
    seq: u64,
}

impl DeviceWork {
    /// The event that marks the collective's end on the group's stream.
    pub fn event(&self) -> &CudaEvent {
        &self.event
    }

    /// The collective's sequence number in the group (the `#` of its errors).
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

impl std::ops::Deref for DeviceWork {
    type Target = CudaEvent;

    fn deref(&self) -> &CudaEvent {
        &self.event
    }
}

/// An element type of the device entry points.
pub trait DeviceElement: NcclType + DeviceRepr + ValidAsZeroBits + sealed::Sealed {}
impl DeviceElement for f32 {}
impl DeviceElement for half::f16 {}
impl DeviceElement for half::bf16 {}

mod sealed {
    /// Only the communication dtypes are device elements.
    // The bound lets the crate's generic code use its own element functions; the trait cannot be
    // named outside the crate, so nothing private leaks.
    #[allow(private_bounds)]
    pub trait Sealed: super::Element {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A CUDA driver failure during `op`.
fn driver(op: OpKind, seq: u64, e: DriverError) -> CommError {
    CommError::Backend {
        op: op.name().to_string(),
        seq,
        message: format!("CUDA: {e:?}"),
    }
}

/// An NCCL failure during `op`.
fn nccl(op: OpKind, seq: u64, e: cudarc::nccl::result::NcclError) -> CommError {
    CommError::Backend {
        op: op.name().to_string(),
        seq,
        message: format!("NCCL: {:?}", e.0),
    }
}

fn nccl_op(op: ReduceOp) -> cudarc::nccl::ReduceOp {
    match op {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Avg => cudarc::nccl::ReduceOp::Avg,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
    }
}

/// Runs `f` (NCCL's communicator set-up, which waits for every rank with no deadline of its own);
/// if it has not returned within `timeout` (a peer died inside it, or cannot be reached), the
/// process ends with status 1 and a message naming this rank, rather than wait forever.
fn exit_unless_done_within<T>(timeout: Duration, rank: usize, f: impl FnOnce() -> T) -> T {
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(timeout) {
            eprintln!(
                "error: NCCL rank {rank}: ncclCommInitRank has not returned after {} s: a peer rank \
                 failed inside it or cannot be reached (the limit is ZERO_COMM_TIMEOUT_SECS); exiting",
                timeout.as_secs()
            );
            std::process::exit(1);
        }
    });
    let out = f();
    drop(done);
    let _ = watchdog.join();
    out
}

impl NcclGroup {
    /// Joins the group the environment describes ([`DistEnv::detect`]) on GPU `LOCAL_RANK`.
    /// `timeout` overrides ZERO_COMM_TIMEOUT_SECS (default 300 s).
    pub fn from_env(timeout: Option<Duration>) -> Result<Self, CommError> {
        let env = DistEnv::detect().map_err(|e| CommError::Setup(e.to_string()))?;
        let timeout = match timeout {
            Some(t) => t,
            None => timeout_from_env().map_err(|e| CommError::Setup(e.to_string()))?,
        };
        let options = TcpOptions {
            timeout,
            ..TcpOptions::default()
        };
        let ctrl = TcpGroup::connect(env.rank, env.world_size, &env.master_addr, env.master_port, options)?;
        Self::over(Arc::new(ctrl), env.local_rank, timeout)
    }

    /// Builds the NCCL communicator over an established control group, on GPU `device`: rank 0
    /// creates the unique id and broadcasts it through `ctrl`, which then carries the headers.
    /// `ctrl` must serve this group alone (a TCP group of its own, or one split off another;
    /// for ranks as threads, a thread group of their own): another user's collectives on it
    /// would interleave with the headers in an order the ranks need not share.
    ///
    /// A machine without the CUDA driver or the NCCL library gives a [`CommError::Setup`] that
    /// says which library is missing.
    pub fn over(ctrl: SharedGroup, device: usize, timeout: Duration) -> Result<Self, CommError> {
        let rank = ctrl.rank();
        // SAFETY: only probes whether the library can be loaded.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(CommError::Setup(format!(
                "NCCL rank {rank}: the NCCL library is not found. It is loaded by the name \
                 libnccl.so (or libnccl.so.<CUDA major>) from LD_LIBRARY_PATH; NVIDIA's wheels \
                 (nvidia-nccl-cu12, nvidia-nccl-cu13) ship only libnccl.so.2, so link \
                 libnccl.so to that file in a directory on LD_LIBRARY_PATH"
            )));
        }
        // cudarc panics when it cannot load a library; that is a setup error here.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Self::build(ctrl, device, timeout))).unwrap_or_else(
            |panic| {
                let what = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("unknown cause");
                Err(CommError::Setup(format!(
                    "NCCL rank {rank}: CUDA or NCCL is unusable: {what}"
                )))
            },
        )
    }

    fn build(ctrl: SharedGroup, device: usize, timeout: Duration) -> Result<Self, CommError> {
        let (rank, world) = (ctrl.rank(), ctrl.world_size());
        let setup = |what: &str, e: &dyn std::fmt::Debug| CommError::Setup(format!("NCCL rank {rank}: {what}: {e:?}"));
        // Each rank's GPU and stream, and rank 0's unique id, are ready on every rank before any
        // enters ncclCommInitRank, which waits for all of them with no deadline: a rank that
        // failed here says so, and the others stop with an error naming it.
        let prepared = (|| {
            let ctx = CudaContext::new(device).map_err(|e| setup(&format!("cannot open GPU {device}"), &e))?;
            let stream = ctx.new_stream().map_err(|e| setup("cannot create a stream", &e))?;
            let id = match rank {
                0 => Some(Id::new().map_err(|e| setup("cannot create the unique id", &e.0))?),
                _ => None,
            };
            Ok((stream, id))
        })();
        let (stream, id) = super::all_ready(&*ctrl, "NCCL set-up", prepared)?;
        // The id travels as f32 bit patterns: the broadcast copies bytes, it computes nothing.
        let mut words = vec![0f32; 128 / 4];
        if let Some(id) = id {
            for (w, b) in words.iter_mut().zip(id.internal().chunks_exact(4)) {
                *w = f32::from_bits(u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8]));
            }
        }
        let mut buf = FlatBuffer::F32(words);
        ctrl.broadcast(&mut buf, 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, w) in internal.chunks_exact_mut(4).zip(buf.into_f32()) {
            for (d, b) in c.iter_mut().zip(w.to_bits().to_le_bytes()) {
                *d = b as std::ffi::c_char;
            }
        }
        let comm = exit_unless_done_within(timeout, rank, || {
            Comm::from_rank(stream.clone(), rank, world, Id::uninit(internal))
        })
        .map_err(|e| setup("ncclCommInitRank failed", &e.0));
        // A rank whose set-up returned an error tells the others, whose own may have succeeded.
        let comm = super::all_ready(&*ctrl, "ncclCommInitRank", comm)?;
        let shared = Arc::new(Shared {
            rank,
            world,
            ctrl,
            timeout,
            state: Mutex::new(NcclState {
                comm: Some(comm),
                stream,
                seq: 0,
                broken: None,
            }),
        });
        let worker = Worker::spawn(
            format!("zero-comm-nccl-rank{rank}"),
            NcclRank { shared: shared.clone() },
        )?;
        Ok(NcclGroup {
            rank,
            world,
            shared,
            worker,
        })
    }

    /// The stream the group's collectives run on.
    pub fn stream(&self) -> Result<Arc<CudaStream>, CommError> {
        Ok(self.shared.lock("stream")?.stream.clone())
    }

    /// Waits until every collective issued before is done (issue order is the order of the
    /// calls on this handle, host and device entry points alike), then runs `f` on the state.
    fn device_op<R>(
        &self,
        kind: OpKind,
        subject: Subject,
        dtype: DType,
        len: usize,
        reduce: Option<ReduceOp>,
        root: usize,
        f: impl FnOnce(&mut NcclState, u64) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        // A fence through the worker queue: the host collectives issued earlier go first, and a
        // poisoned group fails here with its original cause.
        self.worker.submit(kind.name(), |_| Ok(())).wait()?;
        let mut st = self.shared.lock(kind.name())?;
        let seq = self.shared.begin(&mut st, kind, subject, dtype, len, reduce, root)?;
        // A symbol missing from an old NCCL makes cudarc panic: an error of this collective.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut st, seq))).unwrap_or_else(|_| {
            Err(CommError::Backend {
                op: kind.name().to_string(),
                seq,
                message: "the CUDA or NCCL library failed (see the message above)".into(),
            })
        })
    }

    /// Enqueues an all-reduce of `buf` in place on the group's stream, after `ready` (see the
    /// module's stream-ordering contract); returns its end ([`DeviceWork`]).
    pub fn all_reduce_device<T: DeviceElement>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        ready: Option<&CudaEvent>,
    ) -> Result<DeviceWork, CommError> {
        let kind = OpKind::AllReduce;
        self.device_op(kind, Subject::Unnamed, T::DTYPE, buf.len(), Some(op), 0, |st, seq| {
            wait_ready(st, kind, seq, ready)?;
            if !buf.is_empty() {
                st.comm()?
                    .all_reduce_in_place(buf, &nccl_op(op))
                    .map_err(|e| nccl(kind, seq, e))?;
            }
            record_work(st, kind, seq)
        })
    }

    /// Enqueues a reduce-scatter of `input` (world size × `out.len()` elements) into `out`, after
    /// `ready`; returns its end ([`DeviceWork`]). Every rank names the same `subject`, checked
    /// in the header exchange.
    pub fn reduce_scatter_device<T: DeviceElement>(
        &self,
        input: &CudaSlice<T>,
        out: &mut CudaSlice<T>,
        op: ReduceOp,
        subject: Subject,
        ready: Option<&CudaEvent>,
    ) -> Result<DeviceWork, CommError> {
        let kind = OpKind::ReduceScatter;
        if input.len() != out.len() * self.world {
            return Err(CommError::InvalidArgument {
                op: kind.name().to_string(),
                message: format!(
                    "the input holds {} elements; {} ranks with outputs of {} need {}",
                    input.len(),
                    self.world,
                    out.len(),
                    out.len() * self.world
                ),
            });
        }
        self.device_op(kind, subject, T::DTYPE, input.len(), Some(op), 0, |st, seq| {
            wait_ready(st, kind, seq, ready)?;
            if !out.is_empty() {
                st.comm()?
                    .reduce_scatter(input, out, &nccl_op(op))
                    .map_err(|e| nccl(kind, seq, e))?;
            }
            record_work(st, kind, seq)
        })
    }

    /// Enqueues an all-gather of every rank's `shard` into `out` (world size × `shard.len()`
    /// elements, in rank order), after `ready`; returns its end ([`DeviceWork`]). Every rank
    /// names the same `subject`, checked in the header exchange.
    pub fn all_gather_device<T: DeviceElement>(
        &self,
        shard: &CudaSlice<T>,
        out: &mut CudaSlice<T>,
        subject: Subject,
        ready: Option<&CudaEvent>,
    ) -> Result<DeviceWork, CommError> {
        let kind = OpKind::AllGather;
        if out.len() != shard.len() * self.world {
            return Err(CommError::InvalidArgument {
                op: kind.name().to_string(),
                message: format!(
                    "the output holds {} elements; gathering {} elements from {} ranks needs {}",
                    out.len(),
                    shard.len(),
                    self.world,
                    shard.len() * self.world
                ),
            });
        }
        self.device_op(kind, subject, T::DTYPE, shard.len(), None, 0, |st, seq| {
            wait_ready(st, kind, seq, ready)?;
            if !shard.is_empty() {
                st.comm()?.all_gather(shard, out).map_err(|e| nccl(kind, seq, e))?;
            }
            record_work(st, kind, seq)
        })
    }

    /// Waits on the host until `work` (a `*_device` collective of this group) is done, at most
    /// the group's timeout. On a timeout, or a driver error, the communicator is aborted, as for
    /// a host collective (NCCL cannot say which peer it waits for), and the group fails from
    /// then on; the error names the collective and this rank.
    pub fn wait_device(&self, work: &DeviceWork) -> Result<(), CommError> {
        let failed = match wait_until(&work.event, self.shared.timeout) {
            Ok(true) => return Ok(()),
            Ok(false) => CommError::Timeout {
                seq: work.seq,
                op: work.kind.name().to_string(),
                // NCCL does not tell which peer is missing: the error names this rank.
                peer: self.rank,
                seconds: self.shared.timeout.as_secs_f64(),
            },
            Err(e) => driver(work.kind, work.seq, e),
        };
        let mut st = self.shared.lock(work.kind.name())?;
        Err(self.shared.break_comm(&mut st, failed))
    }
}

/// Polls `event` until it completes (`true`) or `timeout` has passed (`false`). The first
/// milliseconds yield between polls, as CUDA's own wait spins, so that a short collective is
/// not waited for much longer than it runs; then short sleeps.
fn wait_until(event: &CudaEvent, timeout: Duration) -> Result<bool, DriverError> {
    let start = Instant::now();
    let spin = Duration::from_millis(5);
    loop {
        if event.try_is_complete()? {
            return Ok(true);
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Ok(false);
        }
        if waited < spin {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Makes the group's stream wait for the caller's event.
fn wait_ready(st: &NcclState, kind: OpKind, seq: u64, ready: Option<&CudaEvent>) -> Result<(), CommError> {
    match ready {
        Some(event) => st.stream.wait(event).map_err(|e| driver(kind, seq, e)),
        None => Ok(()),
    }
}

/// An event at the current end of the group's stream.
fn record(st: &NcclState, kind: OpKind, seq: u64) -> Result<CudaEvent, CommError> {
    st.stream.record_event(None).map_err(|e| driver(kind, seq, e))
}

/// The end of the device collective `kind` #`seq`, just enqueued.
fn record_work(st: &NcclState, kind: OpKind, seq: u64) -> Result<DeviceWork, CommError> {
    Ok(DeviceWork {
        event: record(st, kind, seq)?,
        kind,
        seq,
    })
}

impl Shared {
    fn lock(&self, op: &str) -> Result<MutexGuard<'_, NcclState>, CommError> {
        self.state
            .lock()
            .map_err(|_| CommError::Shutdown { op: op.to_string() })
    }

    /// Numbers the collective and checks, through the control group, that every rank agrees on it.
    fn begin(
        &self,
        st: &mut NcclState,
        kind: OpKind,
        subject: Subject,
        dtype: DType,
        len: usize,
        reduce: Option<ReduceOp>,
        root: usize,
    ) -> Result<u64, CommError> {
        if let Some(cause) = &st.broken {
            return Err(cause.clone());
        }
        let desc = OpDesc {
            kind,
            seq: st.seq,
            dtype,
            len: len as u64,
            reduce,
            root: root as u64,
            subject,
        };
        st.seq += 1;
        if self.world > 1 {
            // The header as f32 bit patterns (a gather copies bytes, it computes nothing).
            let words: Vec<f32> = desc
                .encode()
                .chunks_exact(4)
                .map(|b| f32::from_bits(u32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect();
            let all = self.ctrl.all_gather(FlatBuffer::F32(words))?.into_f32();
            let per = DESC_BYTES / 4;
            for peer in (0..self.world).filter(|&p| p != self.rank) {
                let mut raw = [0u8; DESC_BYTES];
                for (c, w) in raw.chunks_exact_mut(4).zip(&all[peer * per..(peer + 1) * per]) {
                    c.copy_from_slice(&w.to_bits().to_le_bytes());
                }
                let theirs = OpDesc::decode(&raw).ok_or_else(|| CommError::PeerLost {
                    seq: desc.seq,
                    op: kind.name().to_string(),
                    peer,
                    reason: "it sent an unreadable header".into(),
                })?;
                desc.check(self.rank, peer, &theirs)?;
            }
        }
        Ok(desc.seq)
    }

    /// Waits for everything enqueued on the stream, at most the timeout; on a timeout the
    /// communicator is aborted, since NCCL cannot say which peer it waits for.
    fn finish(&self, st: &mut NcclState, kind: OpKind, seq: u64) -> Result<(), CommError> {
        let event = record(st, kind, seq)?;
        match wait_until(&event, self.timeout) {
            Ok(true) => Ok(()),
            Ok(false) => {
                let e = CommError::Timeout {
                    seq,
                    op: kind.name().to_string(),
                    // NCCL does not tell which peer is missing: the error names this rank.
                    peer: self.rank,
                    seconds: self.timeout.as_secs_f64(),
                };
                Err(self.break_comm(st, e))
            }
            Err(e) => Err(self.break_comm(st, driver(kind, seq, e))),
        }
    }

    /// Records `e` as the group's end and aborts the communicator, which unblocks its kernels.
    fn break_comm(&self, st: &mut NcclState, e: CommError) -> CommError {
        st.broken = Some(e.clone());
        // Dropping the communicator calls ncclCommAbort.
        st.comm = None;
        e
    }
}

crate::comm::worker::process_group_on_worker!(NcclGroup);
