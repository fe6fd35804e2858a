//! Collectives on flat device tensors, and their implementation through any process group.

use crate::error::ZeroError;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use half::{bf16, f16};
use std::sync::Arc;
use zero_core::comm::{CommError, FlatBuffer, ProcessGroup, ReduceOp, Subject};

/// Collectives over the ranks of a data-parallel group, on flat 1-D tensors of the backend `B`.
///
/// Every rank calls the same collectives in the same order with tensors of the same length and
/// dtype (f32, f16 or bf16). Results are new tensors on the input's device, in the input's
/// dtype, that own their memory: Burn may reuse the inputs' buffers freely afterwards. 16-bit
/// reductions accumulate in f32 and round once (the process groups' rule), or use NCCL's own
/// 16-bit arithmetic for `NcclDevice`.
pub trait DeviceCollective<B: Backend>: Send + Sync + std::fmt::Debug {
    /// This rank's index in the group.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn world_size(&self) -> usize;

    /// The element-wise reduction (`op`; the engine uses [`ReduceOp::Avg`]) of every rank's
    /// `tensor`.
    fn all_reduce(&self, tensor: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, ZeroError>;

    /// The reduction of every rank's `tensor` (a multiple of the world size long), cut in
    /// world-size equal contiguous shards: this rank's shard. `subject` names what it reduces
    /// (a unit, a bucket): every rank must name the same, and a collective that can check it
    /// (every one here: the header the ranks exchange carries it) fails naming both otherwise.
    fn reduce_scatter_of(
        &self,
        tensor: Tensor<B, 1>,
        op: ReduceOp,
        subject: Subject,
    ) -> Result<Tensor<B, 1>, ZeroError>;

    /// [`DeviceCollective::reduce_scatter_of`] of something unnamed.
    fn reduce_scatter(&self, tensor: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, ZeroError> {
        self.reduce_scatter_of(tensor, op, Subject::Unnamed)
    }

    /// Every rank's `shard` (all equally long) of `subject`, concatenated in rank order (see
    /// [`DeviceCollective::reduce_scatter_of`] for the subject).
    fn all_gather_of(&self, shard: Tensor<B, 1>, subject: Subject) -> Result<Tensor<B, 1>, ZeroError> {
        self.all_gather_start_of(shard, subject).wait()
    }

    /// [`DeviceCollective::all_gather_of`] of something unnamed.
    fn all_gather(&self, shard: Tensor<B, 1>) -> Result<Tensor<B, 1>, ZeroError> {
        self.all_gather_of(shard, Subject::Unnamed)
    }

    /// [`DeviceCollective::all_gather_of`], started now and finished by [`Started::wait`]: the
    /// collective runs while the caller goes on (a prefetch). It takes its place in the rank's
    /// order of collectives when it is started, so collectives called after it run after it.
    fn all_gather_start_of(&self, shard: Tensor<B, 1>, subject: Subject) -> Started<B>;

    /// [`DeviceCollective::all_gather_start_of`] of something unnamed.
    fn all_gather_start(&self, shard: Tensor<B, 1>) -> Started<B> {
        self.all_gather_start_of(shard, Subject::Unnamed)
    }

    /// Rank `root`'s `tensor`, on every rank. The default sums `tensor` on the root with zeros
    /// elsewhere, which is exact (x + 0 = x).
    fn broadcast(&self, tensor: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, ZeroError> {
        let contribution = if self.rank() == root {
            tensor
        } else {
            tensor.zeros_like()
        };
        self.all_reduce(contribution, ReduceOp::Sum)
    }

    /// The element-wise reduction of a few host scalars (norms' partial sums, overflow flags),
    /// in f32, in place.
    fn all_reduce_scalars(&self, values: &mut [f32], op: ReduceOp) -> Result<(), ZeroError>;

    /// The same ranks as a host [`ProcessGroup`], for what moves host data between them
    /// (checkpoints); `None` (the default) when there is none, and checkpoints are refused.
    fn host_group(&self) -> Option<Arc<dyn ProcessGroup>> {
        None
    }

    /// Whether the ranks may be threads of one process, whose autodiff graphs burn 0.21 locks
    /// together (then a stage-2 forward that gathers nothing still calls one scalar
    /// all-reduce per unit, keeping the ranks in step). The default, `true`, is the safe
    /// answer; a collective whose ranks are separate processes says `false`.
    fn ranks_may_share_a_process(&self) -> bool {
        true
    }
}

/// A collective in flight ([`DeviceCollective::all_gather_start`]). Dropping it without waiting
/// does not cancel it: the ranks still run it, and its result is freed once it is done (the drop
/// may block until then).
#[must_use = "a started collective's result is only seen through wait()"]
pub struct Started<B: Backend>(Box<dyn FnOnce() -> Result<Tensor<B, 1>, ZeroError> + Send>);

impl<B: Backend> Started<B> {
    /// A collective that has already finished with `result`.
    pub fn ready(result: Result<Tensor<B, 1>, ZeroError>) -> Self {
        Started(Box::new(move || result))
    }

    /// A collective whose result `finish` waits for.
    pub fn pending(finish: impl FnOnce() -> Result<Tensor<B, 1>, ZeroError> + Send + 'static) -> Self {
        Started(Box::new(finish))
    }

    /// Blocks until every rank has taken part, and returns the result.
    pub fn wait(self) -> Result<Tensor<B, 1>, ZeroError> {
        (self.0)()
    }
}

impl<B: Backend> std::fmt::Debug for Started<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Started")
    }
}

/// [`DeviceCollective`] for any backend over a host [`ProcessGroup`]: each tensor is read to the
/// host, reduced by the group, and written back to the tensor's device in its dtype.
///
/// This is the CPU path (for Flex "reading to the host" is a copy in memory), and the path for
/// several ranks on one GPU ([`zero_core::comm::ThreadGroup`]), where NCCL cannot run. On a GPU
/// with one process per device, `NcclDevice` (feature `cuda`) avoids the copies. At world size 1
/// every collective returns its input as it is: nothing leaves the device.
#[derive(Debug, Clone)]
pub struct HostStaged {
    group: Arc<dyn ProcessGroup>,
}

impl HostStaged {
    /// Collectives through `group`.
    pub fn new(group: Arc<dyn ProcessGroup>) -> Self {
        HostStaged { group }
    }

    /// The process group underneath.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }
}

/// A 1-D tensor's elements as a flat buffer of its own dtype.
fn to_buffer<B: Backend>(tensor: Tensor<B, 1>, op: &str) -> Result<FlatBuffer, ZeroError> {
    let dtype = tensor.dtype();
    let data = tensor.into_data();
    let unsupported = || {
        ZeroError::Comm(CommError::InvalidArgument {
            op: op.to_string(),
            message: format!("tensors of dtype {dtype:?} cannot be reduced (f32, f16 or bf16 only)"),
        })
    };
    let read = |e| {
        ZeroError::Comm(CommError::InvalidArgument {
            op: op.to_string(),
            message: format!("the tensor's data could not be read as {dtype:?}: {e:?}"),
        })
    };
    Ok(match dtype {
        DType::F32 => FlatBuffer::F32(data.into_vec::<f32>().map_err(read)?),
        DType::F16 => FlatBuffer::F16(data.into_vec::<f16>().map_err(read)?),
        DType::BF16 => FlatBuffer::BF16(data.into_vec::<bf16>().map_err(read)?),
        _ => return Err(unsupported()),
    })
}

/// A flat buffer as a 1-D tensor on `device`, in the buffer's dtype.
fn from_buffer<B: Backend>(buffer: FlatBuffer, device: &B::Device) -> Tensor<B, 1> {
    let n = buffer.len();
    let (data, dtype) = match buffer {
        FlatBuffer::F32(v) => (TensorData::new(v, [n]), DType::F32),
        FlatBuffer::F16(v) => (TensorData::new(v, [n]), DType::F16),
        FlatBuffer::BF16(v) => (TensorData::new(v, [n]), DType::BF16),
    };
    Tensor::from_data(data, (device, dtype))
}

impl<B: Backend> DeviceCollective<B> for HostStaged {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn world_size(&self) -> usize {
        self.group.world_size()
    }

    fn all_reduce(&self, tensor: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, ZeroError> {
        if self.group.world_size() == 1 {
            return Ok(tensor);
        }
        let device = tensor.device();
        let mut buffer = to_buffer(tensor, "all_reduce")?;
        self.group.all_reduce(&mut buffer, op)?;
        Ok(from_buffer(buffer, &device))
    }

    fn reduce_scatter_of(
        &self,
        tensor: Tensor<B, 1>,
        op: ReduceOp,
        subject: Subject,
    ) -> Result<Tensor<B, 1>, ZeroError> {
        if self.group.world_size() == 1 {
            return Ok(tensor);
        }
        let device = tensor.device();
        let buffer = to_buffer(tensor, "reduce_scatter")?;
        let shard = self.group.reduce_scatter_of_async(buffer, op, subject).wait()?;
        Ok(from_buffer(shard, &device))
    }

    fn all_gather_start_of(&self, shard: Tensor<B, 1>, subject: Subject) -> Started<B> {
        if self.group.world_size() == 1 {
            return Started::ready(Ok(shard));
        }
        let device = shard.device();
        let buffer = match to_buffer(shard, "all_gather") {
            Ok(buffer) => buffer,
            Err(e) => return Started::ready(Err(e)),
        };
        // The group's own worker runs it, in this rank's order of collectives.
        let work = self.group.all_gather_of_async(buffer, subject);
        Started::pending(move || Ok(from_buffer(work.wait()?, &device)))
    }

    fn broadcast(&self, tensor: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, ZeroError> {
        if self.group.world_size() == 1 {
            return Ok(tensor);
        }
        let device = tensor.device();
        let mut buffer = to_buffer(tensor, "broadcast")?;
        self.group.broadcast(&mut buffer, root)?;
        Ok(from_buffer(buffer, &device))
    }

    fn all_reduce_scalars(&self, values: &mut [f32], op: ReduceOp) -> Result<(), ZeroError> {
        let mut buffer = FlatBuffer::F32(values.to_vec());
        self.group.all_reduce(&mut buffer, op)?;
        values.copy_from_slice(&buffer.into_f32());
        Ok(())
    }

    fn host_group(&self) -> Option<Arc<dyn ProcessGroup>> {
        Some(self.group.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use zero_core::comm::ThreadGroup;

    type F = Flex;

    /// Runs `f(rank, collective)` on `world` threads.
    fn on_ranks<T: Send + 'static>(world: usize, f: impl Fn(usize, HostStaged) -> T + Send + Sync + 'static) -> Vec<T> {
        let f = Arc::new(f);
        let groups = ThreadGroup::new_group(world).expect("thread group");
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                let f = f.clone();
                std::thread::spawn(move || f(rank, HostStaged::new(g)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    }

    fn values(t: Tensor<F, 1>) -> Vec<f32> {
        crate::params::tensor_to_vec(t)
    }

    #[test]
    fn collectives_match_the_f64_reference() {
        // Reference: each rank's input is (rank + 1) · (i + 1) · 0.25; sums and means computed
        // here in f64 (every value is exact in f32 and bf16).
        let world = 3;
        let n = 6;
        let input = move |rank: usize, dtype: DType| {
            let v: Vec<f32> = (0..n).map(|i| (rank + 1) as f32 * (i + 1) as f32 * 0.25).collect();
            Tensor::<F, 1>::from_data(TensorData::new(v, [n]), &Default::default()).cast(dtype)
        };
        let out = on_ranks(world, move |rank, c| {
            let avg =
                DeviceCollective::<F>::all_reduce(&c, input(rank, DType::F32), ReduceOp::Avg).expect("all_reduce");
            let rs = DeviceCollective::<F>::reduce_scatter(&c, input(rank, DType::BF16), ReduceOp::Sum).expect("rs");
            assert_eq!(rs.dtype(), DType::BF16, "the result keeps the input's dtype");
            let shard = Tensor::<F, 1>::from_data(TensorData::new(vec![rank as f32; 2], [2]), &Default::default());
            let gathered = DeviceCollective::<F>::all_gather(&c, shard).expect("all_gather");
            let b = DeviceCollective::<F>::broadcast(&c, input(rank, DType::F32), 2).expect("broadcast");
            let mut scalars = [rank as f32, 1.0];
            DeviceCollective::<F>::all_reduce_scalars(&c, &mut scalars, ReduceOp::Max).expect("scalars");
            (values(avg), values(rs), values(gathered), values(b), scalars)
        });
        let total: f64 = (1..=world).map(|r| r as f64).sum();
        for (rank, (avg, rs, gathered, b, scalars)) in out.into_iter().enumerate() {
            for (i, v) in avg.iter().enumerate() {
                let want = total * (i + 1) as f64 * 0.25 / world as f64;
                assert!(
                    (*v as f64 - want).abs() < 1e-6,
                    "rank {rank} avg[{i}] = {v}, want {want}"
                );
            }
            for (j, v) in rs.iter().enumerate() {
                let i = rank * 2 + j;
                assert_eq!(*v as f64, total * (i + 1) as f64 * 0.25, "rank {rank} shard[{j}]");
            }
            assert_eq!(gathered, vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
            let root: Vec<f32> = (0..n).map(|i| 3.0 * (i + 1) as f32 * 0.25).collect();
            assert_eq!(b, root, "rank {rank} holds the root's tensor");
            assert_eq!(scalars, [2.0, 1.0]);
        }
    }

    #[test]
    fn default_broadcast_is_exact() {
        // The trait's default (a sum with zeros) against the group's own broadcast: identical
        // bits, including values that are not exact in binary.
        #[derive(Debug)]
        struct SumOnly(HostStaged);
        impl DeviceCollective<F> for SumOnly {
            fn rank(&self) -> usize {
                DeviceCollective::<F>::rank(&self.0)
            }
            fn world_size(&self) -> usize {
                DeviceCollective::<F>::world_size(&self.0)
            }
            fn all_reduce(&self, t: Tensor<F, 1>, op: ReduceOp) -> Result<Tensor<F, 1>, ZeroError> {
                self.0.all_reduce(t, op)
            }
            fn reduce_scatter_of(&self, t: Tensor<F, 1>, op: ReduceOp, s: Subject) -> Result<Tensor<F, 1>, ZeroError> {
                self.0.reduce_scatter_of(t, op, s)
            }
            fn all_gather_start_of(&self, t: Tensor<F, 1>, s: Subject) -> Started<F> {
                self.0.all_gather_start_of(t, s)
            }
            fn all_reduce_scalars(&self, v: &mut [f32], op: ReduceOp) -> Result<(), ZeroError> {
                DeviceCollective::<F>::all_reduce_scalars(&self.0, v, op)
            }
        }
        let out = on_ranks(4, |rank, c| {
            let v: Vec<f32> = (0..5).map(|i| ((rank * 7 + i) as f32 * 0.1).sin()).collect();
            let t = Tensor::<F, 1>::from_data(TensorData::new(v, [5]), &Default::default());
            values(SumOnly(c).broadcast(t, 1).expect("broadcast"))
        });
        let want: Vec<f32> = (0..5).map(|i| ((7 + i) as f32 * 0.1).sin()).collect();
        for got in out {
            assert_eq!(got, want);
        }
    }
}
