//! The host-buffer collectives of [`super::NcclGroup`], run on its worker thread: staged
//! through device buffers on the group's stream, 16-bit values widened to f32 first.

use super::{driver, nccl, nccl_op, DeviceElement, NcclState, Shared};
use crate::comm::op::{validate, OpKind};
use crate::comm::reduce::widen;
use crate::comm::threads::into_flat;
use crate::comm::worker::BackendState;
use crate::comm::{CommError, DType, FlatBuffer, ReduceOp, Subject};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use std::sync::Arc;

/// The worker-side state: runs the host-buffer collectives.
pub(super) struct NcclRank {
    pub(super) shared: Arc<Shared>,
}

impl BackendState for NcclRank {
    fn on_error(&mut self, _error: &CommError) {
        // The control group tells the peers: their next header exchange fails.
    }

    fn on_exit(&mut self, _reason: &str) {}

    fn run(
        &mut self,
        kind: OpKind,
        subject: Subject,
        buffer: FlatBuffer,
        reduce: Option<ReduceOp>,
        root: usize,
        out: Option<FlatBuffer>,
    ) -> Result<(FlatBuffer, Option<FlatBuffer>), CommError> {
        let shared = self.shared.clone();
        let world = shared.world;
        let mut st = shared.lock(kind.name())?;
        if let Err(e) = validate(kind, &buffer, world, root, out.as_ref()) {
            // Still take part in the header exchange, with a length no peer has: the peers then
            // fail at once naming this rank, instead of waiting in NCCL for the timeout.
            shared.begin(&mut st, kind, subject, buffer.dtype(), usize::MAX, reduce, root)?;
            return Err(e);
        }
        let seq = shared.begin(&mut st, kind, subject, buffer.dtype(), buffer.len(), reduce, root)?;
        let dtype = buffer.dtype();
        let op = reduce.unwrap_or(ReduceOp::Sum);
        match kind {
            OpKind::Barrier => {
                st.stream.synchronize().map_err(|e| driver(kind, seq, e))?;
                Ok((buffer, None))
            }
            OpKind::AllReduce => {
                // Reductions run in f32 whatever the dtype (see the module documentation).
                let mut values = to_f32(buffer);
                if !values.is_empty() {
                    let mut dev = st.stream.clone_htod(&values).map_err(|e| driver(kind, seq, e))?;
                    st.comm()?
                        .all_reduce_in_place(&mut dev, &nccl_op(op))
                        .map_err(|e| nccl(kind, seq, e))?;
                    // Wait (with the deadline) before the copy: a copy to pageable memory blocks until
                    // the stream gets there, with no deadline of its own.
                    shared.finish(&mut st, kind, seq)?;
                    st.stream
                        .memcpy_dtoh(&dev, &mut values)
                        .map_err(|e| driver(kind, seq, e))?;
                }
                Ok((from_f32_vec(values, dtype), None))
            }
            OpKind::ReduceScatter => {
                let input = to_f32(buffer);
                let chunk = input.len() / world;
                let mut shard = vec![0f32; chunk];
                if chunk > 0 {
                    let dev_in = st.stream.clone_htod(&input).map_err(|e| driver(kind, seq, e))?;
                    let mut dev_out = alloc::<f32>(&st.stream, chunk, kind, seq)?;
                    st.comm()?
                        .reduce_scatter(&dev_in, &mut dev_out, &nccl_op(op))
                        .map_err(|e| nccl(kind, seq, e))?;
                    // Wait (with the deadline) before the copy: a copy to pageable memory blocks until
                    // the stream gets there, with no deadline of its own.
                    shared.finish(&mut st, kind, seq)?;
                    st.stream
                        .memcpy_dtoh(&dev_out, &mut shard)
                        .map_err(|e| driver(kind, seq, e))?;
                }
                let shard = FlatBuffer::from_f32(&shard, dtype);
                match out {
                    Some(mut o) => {
                        o.copy_from(&shard);
                        Ok((o, Some(from_f32_vec(input, dtype))))
                    }
                    None => Ok((shard, None)),
                }
            }
            OpKind::AllGather => {
                let len = buffer.len();
                let gathered = match buffer {
                    FlatBuffer::F32(v) => gather::<f32>(&shared, &mut st, &v, world, seq)?,
                    FlatBuffer::F16(v) => gather(&shared, &mut st, &v, world, seq)?,
                    FlatBuffer::BF16(v) => gather(&shared, &mut st, &v, world, seq)?,
                };
                debug_assert_eq!(gathered.len(), len * world);
                match out {
                    Some(mut o) => {
                        o.copy_from(&gathered);
                        Ok((o, None))
                    }
                    None => Ok((gathered, None)),
                }
            }
            OpKind::Broadcast => {
                let result = match buffer {
                    FlatBuffer::F32(v) => bcast::<f32>(&shared, &mut st, v, root, seq)?,
                    FlatBuffer::F16(v) => bcast(&shared, &mut st, v, root, seq)?,
                    FlatBuffer::BF16(v) => bcast(&shared, &mut st, v, root, seq)?,
                };
                Ok((result, None))
            }
        }
    }
}

/// The f32 values as a buffer of `dtype` (a move for f32).
fn from_f32_vec(values: Vec<f32>, dtype: DType) -> FlatBuffer {
    match dtype {
        DType::F32 => FlatBuffer::F32(values),
        _ => FlatBuffer::from_f32(&values, dtype),
    }
}

/// The values as f32 (a move for f32 buffers).
fn to_f32(buffer: FlatBuffer) -> Vec<f32> {
    match buffer {
        FlatBuffer::F32(v) => v,
        FlatBuffer::F16(v) => widen(&v),
        FlatBuffer::BF16(v) => widen(&v),
    }
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
    kind: OpKind,
    seq: u64,
) -> Result<CudaSlice<T>, CommError> {
    stream.alloc_zeros::<T>(len).map_err(|e| driver(kind, seq, e))
}

/// All-gather of host values (bytes are moved as they are: no arithmetic, any dtype).
fn gather<T: DeviceElement>(
    shared: &Shared,
    st: &mut NcclState,
    shard: &[T],
    world: usize,
    seq: u64,
) -> Result<FlatBuffer, CommError> {
    let kind = OpKind::AllGather;
    let mut host = vec![T::zeroed(); shard.len() * world];
    if !shard.is_empty() {
        let dev_in = st.stream.clone_htod(shard).map_err(|e| driver(kind, seq, e))?;
        let mut dev_out = alloc::<T>(&st.stream, host.len(), kind, seq)?;
        st.comm()?
            .all_gather(&dev_in, &mut dev_out)
            .map_err(|e| nccl(kind, seq, e))?;
        // Wait (with the deadline) before the copy: a copy to pageable memory blocks until
        // the stream gets there, with no deadline of its own.
        shared.finish(st, kind, seq)?;
        st.stream
            .memcpy_dtoh(&dev_out, &mut host)
            .map_err(|e| driver(kind, seq, e))?;
    }
    Ok(into_flat(host))
}

/// Broadcast of host values from `root`.
fn bcast<T: DeviceElement>(
    shared: &Shared,
    st: &mut NcclState,
    mut values: Vec<T>,
    root: usize,
    seq: u64,
) -> Result<FlatBuffer, CommError> {
    let kind = OpKind::Broadcast;
    if !values.is_empty() {
        let mut dev = st.stream.clone_htod(&values).map_err(|e| driver(kind, seq, e))?;
        st.comm()?
            .broadcast_in_place(&mut dev, root as i32)
            .map_err(|e| nccl(kind, seq, e))?;
        // Wait (with the deadline) before the copy: a copy to pageable memory blocks until
        // the stream gets there, with no deadline of its own.
        shared.finish(st, kind, seq)?;
        st.stream
            .memcpy_dtoh(&dev, &mut values)
            .map_err(|e| driver(kind, seq, e))?;
    }
    Ok(into_flat(values))
}
