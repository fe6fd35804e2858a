//! The communication layer: collectives over flat typed buffers that never hang.
//!
//! [`ProcessGroup`] is what the engine speaks. Every backend numbers its collectives (a sequence
//! number per group) and names them, so that a rank which calls a different collective than its
//! peers, or a peer that dies or stops answering, becomes a [`CommError`] on every surviving rank
//! that names the rank, the op and the sequence number.
//!
//! Backends live in their own files: threads in one process ([`ThreadGroup`]), processes over TCP
//! ([`TcpGroup`]), processes with one GPU each over NCCL (`NcclGroup`, behind the `cuda`
//! feature, which also takes device buffers).
//! Each runs its collectives on one worker thread per rank, in issue order.
//!
//! Reductions of 16-bit buffers (f16, bf16) accumulate in f32 on every backend and round to the
//! buffer's dtype once, after the last rank's contribution (and after the division of
//! [`ReduceOp::Avg`]).
//!
//! Every wait has a deadline: ZERO_COMM_TIMEOUT_SECS (default 300 s), counted from the last
//! progress. After a failure the group is poisoned: every later collective fails at once with the
//! original cause.

mod buffer;
mod bytes;
pub mod env;
mod error;
#[cfg(feature = "cuda")]
mod nccl;
mod op;
mod ready;
mod reduce;
mod subject;
mod tcp;
mod threads;
mod work;
mod worker;

pub use buffer::{BufferMut, BufferRef, DType, FlatBuffer};
pub use bytes::all_gather_bytes;
pub use env::{DistEnv, EnvError, Launcher};
pub use error::CommError;
#[cfg(feature = "cuda")]
pub use nccl::{DeviceElement, DeviceWork, NcclGroup};
pub use ready::{all_ready, gather_failures, Failure};
pub use subject::Subject;
pub use tcp::{TcpGroup, TcpOptions, Transport};
pub use threads::ThreadGroup;
pub use work::Work;

use std::sync::Arc;

/// How the elements of the ranks' buffers are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks (sum, then divide by the world size).
    Avg,
    /// Element-wise maximum.
    Max,
}

/// A group of ranks that run collectives together.
///
/// Every rank must issue the same collectives in the same order, with buffers of the same length
/// and dtype. A violation is detected and reported, never waited on forever.
///
/// Asynchronous variants take ownership of the buffer and return a [`Work`] handle; ops issued
/// asynchronously still execute in issue order on every rank, so they can be mixed freely with
/// blocking ones. The blocking methods have default implementations on top of the asynchronous
/// ones.
pub trait ProcessGroup: Send + Sync + std::fmt::Debug {
    /// This rank's index in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Reduces `buffer` element-wise over all ranks; every rank receives the result.
    fn all_reduce_async(&self, buffer: FlatBuffer, op: ReduceOp) -> Work<FlatBuffer>;

    /// `input` holds `world_size` equal, contiguous chunks; rank `r` receives the element-wise
    /// reduction of every rank's chunk `r`. The input length must be a multiple of the world size.
    fn reduce_scatter_async(&self, input: FlatBuffer, op: ReduceOp) -> Work<FlatBuffer>;

    /// As [`ProcessGroup::reduce_scatter_async`], writing this rank's reduced chunk into `out`
    /// (the input's length divided by the world size, same dtype). The result is `(out, input)`:
    /// both allocations come back, so a caller that reuses them pays no allocation, page fault
    /// or page freeing per call. The input's values afterwards are unspecified (a backend may
    /// use it as workspace). Backends without a native implementation copy the shard of
    /// [`ProcessGroup::reduce_scatter_async`] into `out` and hand back an empty input.
    fn reduce_scatter_into_async(
        &self,
        input: FlatBuffer,
        out: FlatBuffer,
        op: ReduceOp,
    ) -> Work<(FlatBuffer, FlatBuffer)> {
        let dtype = input.dtype();
        self.reduce_scatter_async(input, op).map(move |shard| {
            let mut out = out;
            if !out.copy_from(&shard) {
                out = shard;
            }
            (out, FlatBuffer::zeros(dtype, 0))
        })
    }

    /// As [`ProcessGroup::reduce_scatter_async`], for `subject` (a unit of the model, a bucket
    /// of its layout): backends that exchange a header per collective check that every rank
    /// names the same subject, and fail naming both otherwise. The default ignores the name.
    fn reduce_scatter_of_async(&self, input: FlatBuffer, op: ReduceOp, subject: Subject) -> Work<FlatBuffer> {
        let _ = subject;
        self.reduce_scatter_async(input, op)
    }

    /// Concatenates every rank's equally sized `shard`, in rank order.
    fn all_gather_async(&self, shard: FlatBuffer) -> Work<FlatBuffer>;

    /// As [`ProcessGroup::all_gather_async`], for `subject` (see
    /// [`ProcessGroup::reduce_scatter_of_async`]).
    fn all_gather_of_async(&self, shard: FlatBuffer, subject: Subject) -> Work<FlatBuffer> {
        let _ = subject;
        self.all_gather_async(shard)
    }

    /// As [`ProcessGroup::all_gather_async`], writing into `out` (`world_size` times the shard's
    /// length, same dtype), which comes back as the result. Reusing one output buffer saves the
    /// allocation and page faults of a fresh one per call; backends that cannot use it return a
    /// new buffer instead.
    fn all_gather_into_async(&self, shard: FlatBuffer, out: FlatBuffer) -> Work<FlatBuffer> {
        drop(out);
        self.all_gather_async(shard)
    }

    /// Every rank receives `root`'s buffer (the other ranks' buffers give only length and dtype).
    fn broadcast_async(&self, buffer: FlatBuffer, root: usize) -> Work<FlatBuffer>;

    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<(), CommError>;

    /// Blocking [`ProcessGroup::all_reduce_async`], in place.
    fn all_reduce(&self, buffer: &mut FlatBuffer, op: ReduceOp) -> Result<(), CommError> {
        let taken = std::mem::replace(buffer, FlatBuffer::F32(Vec::new()));
        *buffer = self.all_reduce_async(taken, op).wait()?;
        Ok(())
    }

    /// Blocking [`ProcessGroup::reduce_scatter_async`].
    fn reduce_scatter(&self, input: FlatBuffer, op: ReduceOp) -> Result<FlatBuffer, CommError> {
        self.reduce_scatter_async(input, op).wait()
    }

    /// Blocking [`ProcessGroup::reduce_scatter_into_async`]: this rank's reduced chunk lands in
    /// `out`; `input` keeps its allocation, with unspecified values.
    fn reduce_scatter_into(&self, input: &mut FlatBuffer, out: &mut FlatBuffer, op: ReduceOp) -> Result<(), CommError> {
        let dtype = input.dtype();
        let taken_in = std::mem::replace(input, FlatBuffer::zeros(dtype, 0));
        let taken_out = std::mem::replace(out, FlatBuffer::zeros(dtype, 0));
        let (shard, spare) = self.reduce_scatter_into_async(taken_in, taken_out, op).wait()?;
        *out = shard;
        *input = spare;
        Ok(())
    }

    /// Blocking [`ProcessGroup::all_gather_async`].
    fn all_gather(&self, shard: FlatBuffer) -> Result<FlatBuffer, CommError> {
        self.all_gather_async(shard).wait()
    }

    /// Blocking [`ProcessGroup::all_gather_into_async`], in place in `out`.
    fn all_gather_into(&self, shard: FlatBuffer, out: &mut FlatBuffer) -> Result<(), CommError> {
        let taken = std::mem::replace(out, FlatBuffer::F32(Vec::new()));
        *out = self.all_gather_into_async(shard, taken).wait()?;
        Ok(())
    }

    /// Blocking [`ProcessGroup::broadcast_async`], in place.
    fn broadcast(&self, buffer: &mut FlatBuffer, root: usize) -> Result<(), CommError> {
        let taken = std::mem::replace(buffer, FlatBuffer::F32(Vec::new()));
        *buffer = self.broadcast_async(taken, root).wait()?;
        Ok(())
    }
}

/// Shared handle to a process group, as the engine holds it.
pub type SharedGroup = Arc<dyn ProcessGroup>;
