//! Ranks as threads of one process, collectives through shared memory.
//!
//! Each rank publishes a pointer to its buffer; a reduction is computed by every rank on its own
//! 1/world slice, reading the peers' buffers directly (no central copy). In an all-reduce the
//! rank then writes its reduced slice into every rank's buffer, so every element is read once
//! and written once per rank: the minimum memory traffic.
//!
//! The ranks meet at phase counters under one mutex. Every wait has a deadline and watches for a
//! rank that is gone (its handle dropped, its thread panicked) and for a group-wide abort, so a
//! failure on one rank becomes an error on all of them.

use super::env::{timeout_from_env, DEFAULT_TIMEOUT};
use super::op::{validate, OpDesc, OpKind};
use super::reduce::{reduce_raw, Element};
use super::worker::{BackendState, Worker};
use super::{CommError, DType, FlatBuffer, ReduceOp, Subject};
use half::{bf16, f16};
use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One rank of a group whose ranks are threads of this process.
///
/// Create all ranks at once with [`ThreadGroup::new_group`] and move each handle to its thread.
/// Dropping a handle (or panicking while holding it) makes the peers' collectives fail with an
/// error naming this rank.
///
/// ```
/// use std::thread;
/// use zero_core::comm::{FlatBuffer, ProcessGroup, ReduceOp, ThreadGroup};
///
/// let ranks = ThreadGroup::new_group(2).unwrap();
/// let results: Vec<Vec<f32>> = thread::scope(|s| {
///     let handles: Vec<_> = ranks
///         .iter()
///         .map(|g| {
///             s.spawn(move || {
///                 let mut buf = FlatBuffer::F32(vec![g.rank() as f32 + 1.0; 3]);
///                 g.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
///                 buf.into_f32()
///             })
///         })
///         .collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect()
/// });
/// assert_eq!(results, vec![vec![3.0; 3]; 2]);
/// ```
pub struct ThreadGroup {
    rank: usize,
    world: usize,
    worker: Worker<ThreadRank>,
}

impl std::fmt::Debug for ThreadGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadGroup(rank {} of {})", self.rank, self.world)
    }
}

impl ThreadGroup {
    /// The `world` ranks of a new group, with the timeout of ZERO_COMM_TIMEOUT_SECS (default
    /// 300 s); index `r` is rank `r`.
    pub fn new_group(world: usize) -> Result<Vec<Arc<ThreadGroup>>, CommError> {
        let timeout = timeout_from_env().map_err(|e| CommError::Setup(e.to_string()))?;
        Self::with_timeout(world, timeout)
    }

    /// As [`ThreadGroup::new_group`], with an explicit timeout for every wait.
    pub fn with_timeout(world: usize, timeout: Duration) -> Result<Vec<Arc<ThreadGroup>>, CommError> {
        if world == 0 {
            return Err(CommError::Setup("a group needs at least one rank".into()));
        }
        let shared = Arc::new(Shared {
            world,
            timeout: if timeout.is_zero() { DEFAULT_TIMEOUT } else { timeout },
            state: Mutex::new(SharedState {
                phase: vec![0; world],
                desc: vec![None; world],
                bufs: (0..world).map(|_| None).collect(),
                gone: vec![None; world],
                abort: None,
            }),
            cv: Condvar::new(),
        });
        (0..world)
            .map(|rank| {
                let state = ThreadRank {
                    rank,
                    shared: shared.clone(),
                    seq: 0,
                };
                let worker = Worker::spawn(format!("zero-comm-thread-rank{rank}"), state)?;
                Ok(Arc::new(ThreadGroup { rank, world, worker }))
            })
            .collect()
    }
}

super::worker::process_group_on_worker!(ThreadGroup);

/// What all ranks of a group share.
struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<SharedState>,
    cv: Condvar,
}

struct SharedState {
    /// Per rank: 3·seq + 1 once it has posted collective `seq`, 3·seq + 3 once it is done with
    /// the peers' buffers.
    phase: Vec<u64>,
    desc: Vec<Option<OpDesc>>,
    bufs: Vec<Option<Arc<SharedBuf>>>,
    /// Ranks whose handle is gone, and why.
    gone: Vec<Option<String>>,
    /// The first failure in the group; every wait returns it.
    abort: Option<CommError>,
}

/// A rank's buffer while a collective runs, readable by the peers through `ptr`.
struct SharedBuf {
    buf: UnsafeCell<FlatBuffer>,
    ptr: *mut u8,
}

// SAFETY: the heap memory behind `ptr` is accessed only under the phase protocol of
// `ThreadRank::run`: in every phase each element has either one writer (its owner) or readers.
unsafe impl Send for SharedBuf {}
unsafe impl Sync for SharedBuf {}

impl SharedBuf {
    fn new(mut buf: FlatBuffer) -> Self {
        let ptr = match &mut buf {
            FlatBuffer::F32(v) => v.as_mut_ptr() as *mut u8,
            FlatBuffer::F16(v) => v.as_mut_ptr() as *mut u8,
            FlatBuffer::BF16(v) => v.as_mut_ptr() as *mut u8,
        };
        SharedBuf {
            buf: UnsafeCell::new(buf),
            ptr,
        }
    }

    /// The element pointer; the caller has checked that the dtype is `T`'s.
    fn typed<T: Element>(&self) -> *mut T {
        self.ptr as *mut T
    }
}

/// The worker-side state of one rank.
struct ThreadRank {
    rank: usize,
    shared: Arc<Shared>,
    seq: u64,
}

impl BackendState for ThreadRank {
    fn run(
        &mut self,
        kind: OpKind,
        subject: Subject,
        buffer: FlatBuffer,
        reduce: Option<ReduceOp>,
        root: usize,
        out: Option<FlatBuffer>,
    ) -> Result<(FlatBuffer, Option<FlatBuffer>), CommError> {
        self.run_collective(kind, subject, buffer, reduce, root, out)
    }

    fn on_error(&mut self, error: &CommError) {
        if let Ok(mut st) = self.shared.state.lock() {
            st.abort.get_or_insert_with(|| error.clone());
        }
        self.shared.cv.notify_all();
    }

    fn on_exit(&mut self, reason: &str) {
        if let Ok(mut st) = self.shared.state.lock() {
            st.gone[self.rank] = Some(reason.to_string());
        }
        self.shared.cv.notify_all();
    }
}

/// Even split of `len` elements into `world` contiguous ranges (the first ones one longer).
pub(crate) fn split(len: usize, world: usize) -> Vec<Range<usize>> {
    let (q, rem) = (len / world, len % world);
    let mut start = 0;
    (0..world)
        .map(|i| {
            let n = q + usize::from(i < rem);
            start += n;
            start - n..start
        })
        .collect()
}

impl ThreadRank {
    fn lock(&self) -> Result<MutexGuard<'_, SharedState>, CommError> {
        self.shared
            .state
            .lock()
            .map_err(|_| CommError::Setup("the group's shared state is poisoned".into()))
    }

    /// Sets this rank's phase and waits until every rank has reached it.
    fn step(&self, desc: &OpDesc, phase: u64) -> Result<MutexGuard<'_, SharedState>, CommError> {
        let mut st = self.lock()?;
        st.phase[self.rank] = phase;
        self.shared.cv.notify_all();
        let deadline = Instant::now() + self.shared.timeout;
        let op = desc.kind.name().to_string();
        loop {
            // Peers that all arrived come first: a mismatch is then reported by every rank from
            // its own point of view rather than as the first detector's error.
            let behind = (0..self.shared.world).find(|&p| st.phase[p] < phase);
            let Some(late) = behind else { return Ok(st) };
            if let Some(cause) = &st.abort {
                return Err(cause.clone());
            }
            let lost = (0..self.shared.world)
                .find(|&p| st.phase[p] < phase && st.gone[p].is_some())
                .and_then(|p| st.gone[p].clone().map(|reason| (p, reason)));
            let now = Instant::now();
            let error = if let Some((peer, reason)) = lost {
                Some(CommError::PeerLost {
                    seq: desc.seq,
                    op: op.clone(),
                    peer,
                    reason,
                })
            } else if now >= deadline {
                Some(CommError::Timeout {
                    seq: desc.seq,
                    op: op.clone(),
                    peer: late,
                    seconds: self.shared.timeout.as_secs_f64(),
                })
            } else {
                None
            };
            if let Some(e) = error {
                st.abort.get_or_insert_with(|| e.clone());
                self.shared.cv.notify_all();
                return Err(e);
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .map_err(|_| CommError::Setup("the group's shared state is poisoned".into()))?
                .0;
        }
    }

    fn run_collective(
        &mut self,
        kind: OpKind,
        subject: Subject,
        buffer: FlatBuffer,
        reduce: Option<ReduceOp>,
        root: usize,
        out: Option<FlatBuffer>,
    ) -> Result<(FlatBuffer, Option<FlatBuffer>), CommError> {
        let (world, rank) = (self.shared.world, self.rank);
        let desc = OpDesc {
            kind,
            seq: self.seq,
            dtype: buffer.dtype(),
            len: buffer.len() as u64,
            reduce,
            root: root as u64,
            subject,
        };
        self.seq += 1;
        validate(kind, &buffer, world, root, out.as_ref())?;
        let base = 3 * desc.seq;
        let mine = Arc::new(SharedBuf::new(buffer));
        let peers: Vec<Arc<SharedBuf>> = {
            let mut st = self.lock()?;
            st.desc[rank] = Some(desc);
            st.bufs[rank] = Some(mine.clone());
            drop(st);
            let st = self.step(&desc, base + 1)?;
            for p in (0..world).filter(|&p| p != rank) {
                let theirs = st.desc[p].ok_or_else(|| CommError::Shutdown {
                    op: kind.name().to_string(),
                })?;
                desc.check(rank, p, &theirs)?;
            }
            st.bufs
                .iter()
                .map(|b| {
                    b.clone().ok_or_else(|| CommError::Shutdown {
                        op: kind.name().to_string(),
                    })
                })
                .collect::<Result<_, _>>()?
        };
        let output = match desc.dtype {
            DType::F32 => self.compute::<f32>(&desc, &mine, &peers, out)?,
            DType::F16 => self.compute::<f16>(&desc, &mine, &peers, out)?,
            DType::BF16 => self.compute::<bf16>(&desc, &mine, &peers, out)?,
        };
        drop(peers);
        {
            let mut st = self.step(&desc, base + 3)?;
            st.bufs[rank] = None;
        }
        // Every peer dropped its reference before reaching the last phase.
        let mine = Arc::try_unwrap(mine)
            .map_err(|_| CommError::Shutdown {
                op: kind.name().to_string(),
            })?
            .buf
            .into_inner();
        match output {
            // The input (the shard of an all-gather) is not part of the result.
            Some(out) => Ok((out, Some(mine))),
            None if kind == OpKind::ReduceScatter => {
                let chunk = desc.len as usize / world;
                Ok((mine.keep_range(rank * chunk..(rank + 1) * chunk), None))
            }
            None => Ok((mine, None)),
        }
    }

    /// The data movement of one collective; `None` means the result is this rank's own buffer.
    fn compute<T: Element>(
        &self,
        desc: &OpDesc,
        mine: &SharedBuf,
        peers: &[Arc<SharedBuf>],
        out: Option<FlatBuffer>,
    ) -> Result<Option<FlatBuffer>, CommError> {
        let (world, rank) = (self.shared.world, self.rank);
        let len = desc.len as usize;
        let ptrs: Vec<*mut T> = peers.iter().map(|b| b.typed::<T>()).collect();
        let own = mine.typed::<T>();
        // SAFETY (all blocks below): every pointer addresses a live buffer of `len` elements of
        // dtype T (checked through the descriptors); the phases order the accesses so that an
        // element is never written while another rank reads it.
        match desc.kind {
            OpKind::AllReduce => {
                // This rank owns slice `rank`: it reads it from every buffer and writes the result
                // into every buffer, so no gather pass is needed and each byte moves once.
                let mine_r = split(len, world)[rank].clone();
                let inputs: Vec<*const T> = ptrs
                    .iter()
                    .map(|&p| unsafe { p.add(mine_r.start) } as *const T)
                    .collect();
                let outputs: Vec<*mut T> = ptrs.iter().map(|&p| unsafe { p.add(mine_r.start) }).collect();
                let op = desc.reduce.unwrap_or(ReduceOp::Sum);
                unsafe { reduce_raw(&inputs, &outputs, mine_r.len(), op) };
                Ok(None)
            }
            OpKind::ReduceScatter => {
                // One pass: block by block, this rank reads its chunk from every input and
                // writes the combination once. Without an output, slice `rank` of this rank's
                // input, which no peer reads, takes the result, and `run` keeps only it.
                let chunk = len / world;
                let inputs: Vec<*const T> = ptrs
                    .iter()
                    .map(|&p| unsafe { p.add(rank * chunk) } as *const T)
                    .collect();
                let op = desc.reduce.unwrap_or(ReduceOp::Sum);
                match out.and_then(FlatBuffer::into_vec::<T>) {
                    Some(mut out) => {
                        unsafe { reduce_raw(&inputs, &[out.as_mut_ptr()], chunk, op) };
                        Ok(Some(into_flat(out)))
                    }
                    None => {
                        unsafe { reduce_raw(&inputs, &[own.add(rank * chunk)], chunk, op) };
                        Ok(None)
                    }
                }
            }
            OpKind::AllGather => {
                let mut out = match out.and_then(FlatBuffer::into_vec::<T>) {
                    Some(v) => v,
                    None => vec![T::zeroed(); len * world],
                };
                for (p, &src) in ptrs.iter().enumerate() {
                    let dst = &mut out[p * len..(p + 1) * len];
                    unsafe { dst.copy_from_slice(std::slice::from_raw_parts(src, len)) };
                }
                Ok(Some(into_flat(out)))
            }
            OpKind::Broadcast => {
                let root = desc.root as usize;
                if root != rank {
                    unsafe { std::ptr::copy_nonoverlapping(ptrs[root], own, len) };
                }
                Ok(None)
            }
            OpKind::Barrier => Ok(None),
        }
    }
}

/// Wraps a typed vector back into the enum.
pub(crate) fn into_flat<T: Element>(v: Vec<T>) -> FlatBuffer {
    // The casts are identities: T's dtype selects the variant.
    match T::DTYPE {
        DType::F32 => FlatBuffer::F32(bytemuck::allocation::cast_vec(v)),
        DType::F16 => FlatBuffer::F16(bytemuck::allocation::cast_vec(v)),
        DType::BF16 => FlatBuffer::BF16(bytemuck::allocation::cast_vec(v)),
    }
}
