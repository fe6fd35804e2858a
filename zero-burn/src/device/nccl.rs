//! NCCL on the buffers Burn's CUDA backend already holds (feature `cuda`).
//!
//! A CUDA tensor of Burn 0.21 (`CubeBackend<CudaRuntime, ..>`) is a `CubeTensor`: a cubecl
//! compute client and a memory handle. Under fusion (`Fusion<CubeBackend<..>>`, what
//! `burn::backend::Cuda` is with Burn's default features) a tensor is an entry of the fusion
//! server's graph: [`CudaBuffers`] resolves it to its `CubeTensor` (running the operations still
//! queued for it) and registers a collective's output back as a fusion tensor. The client's `get_resource(handle)` gives the
//! storage resource of the handle's bytes, whose `ptr` is the raw `CUdeviceptr` (with the
//! handle's offset applied), and keeps the allocation reserved while the resource lives. That
//! pointer is wrapped as a cudarc `CudaSlice` on the NCCL group's stream with
//! `CudaStream::upgrade_device_ptr`, handed to `NcclGroup`'s `*_device` methods, and released
//! with `CudaSlice::leak`, so cudarc never frees memory that cubecl owns. Both libraries use
//! the device's primary context (cubecl retains it, as cudarc's `CudaContext::new` does), so
//! the pointer is valid on NCCL's stream.
//!
//! # Ordering and what is synchronous
//!
//! Burn's kernels run on cubecl's stream for the calling thread; NCCL runs on the group's own
//! stream. Each collective here is synchronous with respect to the host:
//! 1. The output buffer is allocated (a fresh cubecl allocation; an all-reduce works in place on
//!    its input only when the caller gave up the tensor's last handle, otherwise on a copy).
//! 2. The resources are taken (cubecl orders a buffer last written on another thread's stream
//!    before this thread's stream), then Burn's device is synchronised: every kernel that
//!    writes the input, or last read the output's memory, has finished.
//! 3. The collective is enqueued on the group's stream with no ready event (nothing is pending)
//!    and the host waits for the event it returns, at most the group's timeout
//!    (`NcclGroup::wait_device`, which aborts the group when it expires).
//! 4. The slices are leaked (not freed) and the resources dropped; the output tensor owns its
//!    buffer, and Burn may reuse the input's. If the wait failed, the resources are leaked too:
//!    NCCL may still touch that memory, which cubecl must not hand to another tensor.
//!
//! So one collective costs a device synchronisation and a host wait: the gradients do not go
//! through host memory, but a blocking collective does not overlap compute. An all-gather
//! started with `all_gather_start` (a prefetch) returns after step 3's enqueue and waits for
//! its event when its result is asked for, or when it is dropped unasked (its buffers are only
//! released once NCCL is done with them), so the kernels Burn issues meanwhile run beside it;
//! making Burn's own stream wait on NCCL's event instead of the host would need cubecl's stream
//! handle, which cubecl 0.10 does not expose.
//!
//! Scalars (norm partial sums, overflow flags) go through the group's host entry point.

use super::collective::{DeviceCollective, Started};
use crate::error::ZeroError;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorMetadata, TensorPrimitive};
use burn_cubecl::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use burn_fusion::stream::OperationStreams;
use burn_fusion::{Fusion, FusionTensor, NoOp};
use burn_ir::{BackendIr, InitOperationIr, OperationIr, OperationOutput};
use cudarc::driver::{CudaSlice, CudaStream};
use half::{bf16, f16};
use std::sync::Arc;
use zero_core::comm::{CommError, DeviceElement, DeviceWork, FlatBuffer, NcclGroup, ProcessGroup, ReduceOp, Subject};

/// Burn's CUDA backends, whose float tensors [`NcclDevice`] lends to NCCL: `CubeBackend` over
/// CUDA, and `Fusion` over it (`burn::backend::Cuda` with Burn's default features).
pub trait CudaBuffers: Backend<Device = CudaDevice> {
    /// The unfused backend underneath, which allocates the collectives' outputs.
    type Cube: Backend<Device = CudaDevice, FloatTensorPrimitive = CubeTensor<CudaRuntime>>;

    /// The CUDA buffer of `tensor`, once every operation that writes it has been issued.
    fn to_cube(tensor: Self::FloatTensorPrimitive) -> CubeTensor<CudaRuntime>;

    /// A buffer a collective wrote, as a float tensor of this backend.
    fn from_cube(tensor: CubeTensor<CudaRuntime>) -> Self::FloatTensorPrimitive;
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> CudaBuffers for CubeBackend<CudaRuntime, F, I, BT> {
    type Cube = Self;

    fn to_cube(tensor: CubeTensor<CudaRuntime>) -> CubeTensor<CudaRuntime> {
        tensor
    }

    fn from_cube(tensor: CubeTensor<CudaRuntime>) -> CubeTensor<CudaRuntime> {
        tensor
    }
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> CudaBuffers for Fusion<CubeBackend<CudaRuntime, F, I, BT>> {
    type Cube = CubeBackend<CudaRuntime, F, I, BT>;

    /// Runs the fused operations queued on the tensor's stream and takes its buffer.
    fn to_cube(tensor: FusionTensor<FusionCubeRuntime<CudaRuntime>>) -> CubeTensor<CudaRuntime> {
        tensor.client.clone().resolve_tensor_float::<Self::Cube>(tensor)
    }

    /// Registers the buffer with the device's fusion server, as Burn does for a tensor made from
    /// data.
    fn from_cube(tensor: CubeTensor<CudaRuntime>) -> FusionTensor<FusionCubeRuntime<CudaRuntime>> {
        let client = burn_fusion::get_client::<Self::Cube>(&tensor.device);
        let (shape, dtype) = (tensor.shape(), tensor.dtype);
        let handle = <Self::Cube as BackendIr>::float_tensor_handle(tensor);
        let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
        client
            .register(
                OperationStreams::default(),
                OperationIr::Init(init),
                NoOp::<Self::Cube>::new(),
            )
            .output()
    }
}

/// [`DeviceCollective`] for Burn's CUDA tensors over an [`NcclGroup`]: no host copy of the
/// tensors (see the module documentation for the ordering, which makes every call synchronous).
#[derive(Debug, Clone)]
pub struct NcclDevice {
    group: Arc<NcclGroup>,
    /// Whether the ranks are threads of one process (one GPU each).
    threads: bool,
}

impl NcclDevice {
    /// Collectives through `group`, for tensors on `device`, which must be the group's GPU.
    pub fn new(group: Arc<NcclGroup>, device: &CudaDevice) -> Result<Self, ZeroError> {
        let ordinal = group.stream()?.context().ordinal();
        if ordinal != device.index {
            return Err(ZeroError::Config(format!(
                "NCCL rank {} runs on GPU {ordinal} but the model is on GPU {}: build the model on \
                 CudaDevice::new(LOCAL_RANK)",
                group.rank(),
                device.index
            )));
        }
        Ok(NcclDevice { group, threads: false })
    }

    /// The same, for ranks that are threads of one process, each on its own GPU: their
    /// autodiff graphs share burn 0.21's lock, which the units then keep in step around (see
    /// [`DeviceCollective::ranks_may_share_a_process`]).
    pub fn thread_ranks(self) -> Self {
        NcclDevice { threads: true, ..self }
    }

    /// The NCCL group underneath.
    pub fn group(&self) -> &Arc<NcclGroup> {
        &self.group
    }
}

/// An error of the CUDA driver or of cubecl while lending a buffer to `op`.
fn lend_error(op: &str, what: impl std::fmt::Debug) -> ZeroError {
    ZeroError::Comm(CommError::Backend {
        op: op.to_string(),
        // Raised before the collective is numbered by the group.
        seq: 0,
        message: format!("lending a Burn CUDA buffer to NCCL: {what:?}"),
    })
}

/// A cubecl buffer lent to cudarc: the view is leaked on drop, never freed; `_keep` holds the
/// cubecl resource, which keeps the allocation reserved.
struct Lent<T, K> {
    slice: Option<CudaSlice<T>>,
    _keep: K,
}

impl<T, K> Drop for Lent<T, K> {
    fn drop(&mut self) {
        if let Some(slice) = self.slice.take() {
            // The memory is cubecl's: forget the view without freeing it.
            let _ = slice.leak();
        }
    }
}

impl<T, K> Lent<T, K> {
    fn slice(&self) -> &CudaSlice<T> {
        self.slice
            .as_ref()
            .unwrap_or_else(|| unreachable!("taken only on drop"))
    }

    fn slice_mut(&mut self) -> &mut CudaSlice<T> {
        self.slice
            .as_mut()
            .unwrap_or_else(|| unreachable!("taken only on drop"))
    }
}

/// Lends `tensor`'s memory (`len` elements of `T`) as a slice on `stream`.
fn lend<T: DeviceElement>(
    tensor: &CubeTensor<CudaRuntime>,
    len: usize,
    stream: &Arc<CudaStream>,
    op: &str,
) -> Result<Lent<T, impl Sized>, ZeroError> {
    let resource = tensor
        .client
        .get_resource(tensor.handle.clone())
        .map_err(|e| lend_error(op, e))?;
    let ptr = resource.resource().ptr;
    let bytes = resource.resource().size as usize;
    if bytes < len * std::mem::size_of::<T>() {
        return Err(lend_error(
            op,
            format!("the buffer holds {bytes} bytes, {len} elements need more"),
        ));
    }
    // SAFETY: `ptr` is a live allocation of at least `len` elements of `T` in the primary
    // context of this device, reserved while `resource` (kept in the `Lent`) lives; the view
    // is leaked, never freed, when the `Lent` drops.
    let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, len) };
    Ok(Lent {
        slice: Some(slice),
        _keep: resource,
    })
}

/// The CUDA buffer of a float tensor, contiguous.
fn primitive<B: CudaBuffers>(tensor: Tensor<B, 1>, op: &str) -> Result<CubeTensor<CudaRuntime>, ZeroError> {
    match tensor.into_primitive() {
        TensorPrimitive::Float(t) => {
            let t = B::to_cube(t);
            Ok(if t.is_contiguous() {
                t
            } else {
                burn_cubecl::kernel::into_contiguous(t)
            })
        }
        TensorPrimitive::QFloat(_) => Err(ZeroError::Comm(CommError::InvalidArgument {
            op: op.to_string(),
            message: "quantized tensors cannot be reduced; dequantize first".into(),
        })),
    }
}

/// Waits on the host for `work`'s end (at most the group's timeout, which aborts the group), and
/// gives back `lent`, the buffers it uses. If the wait failed, NCCL may still touch them: they
/// are leaked, never handed back to cubecl for the next tensor; the group is broken by then.
fn wait<L>(group: &NcclGroup, work: &DeviceWork, lent: L) -> Result<L, ZeroError> {
    match group.wait_device(work) {
        Ok(()) => Ok(lent),
        Err(e) => {
            std::mem::forget(lent);
            Err(e.into())
        }
    }
}

/// An all-gather in flight: its buffers stay lent, and its output unread, until its end has
/// been waited for: by [`Started::wait`], or on drop when the prefetch is dropped unwaited
/// (freeing the buffers earlier would let cubecl give memory NCCL still writes to a new tensor).
struct Gathering<L> {
    group: Arc<NcclGroup>,
    work: DeviceWork,
    /// The lent buffers and the output; `None` once waited for.
    pending: Option<(L, CubeTensor<CudaRuntime>)>,
}

impl<L> Gathering<L> {
    /// Waits for the gather and returns its output.
    fn finish(mut self) -> Result<CubeTensor<CudaRuntime>, ZeroError> {
        let pending = self
            .pending
            .take()
            .unwrap_or_else(|| unreachable!("taken only here and on drop"));
        let (lent, out) = wait(&self.group, &self.work, pending)?;
        drop(lent);
        Ok(out)
    }
}

impl<L> Drop for Gathering<L> {
    fn drop(&mut self) {
        if let Some(pending) = self.pending.take() {
            // Unwaited: the error, if any, is the group's from now on, and reported by its next
            // collective.
            let _ = wait(&self.group, &self.work, pending);
        }
    }
}

/// Dispatches on the tensor's dtype to the element type NCCL reduces.
macro_rules! by_dtype {
    ($self:ident, $t:ident, $name:expr, $call:ident ( $($arg:expr),* )) => {
        match $t.dtype {
            DType::F32 => $self.$call::<f32, B>($t $(, $arg)*),
            DType::F16 => $self.$call::<f16, B>($t $(, $arg)*),
            DType::BF16 => $self.$call::<bf16, B>($t $(, $arg)*),
            other => Err(ZeroError::Comm(CommError::InvalidArgument {
                op: $name.into(),
                message: format!("tensors of dtype {other:?} cannot be reduced by NCCL here (f32, f16 or bf16 only)"),
            })),
        }
    };
}

impl NcclDevice {
    /// Makes every kernel issued on `device` so far complete (step 2 of the module's ordering).
    fn sync<B: CudaBuffers>(device: &CudaDevice, op: &str) -> Result<(), ZeroError> {
        B::sync(device).map_err(|e| lend_error(op, e))
    }

    fn all_reduce_typed<T: DeviceElement, B: CudaBuffers>(
        &self,
        input: CubeTensor<CudaRuntime>,
        op: ReduceOp,
    ) -> Result<CubeTensor<CudaRuntime>, ZeroError> {
        let name = "all_reduce";
        let n = input.meta.shape().num_elements();
        // In place only on a buffer nobody else holds; otherwise on a fresh copy.
        let out = if input.can_mut() { input } else { input.copy() };
        let stream = self.group.stream()?;
        let mut lent = lend::<T>(&out, n, &stream, name)?;
        Self::sync::<B>(&out.device, name)?;
        let work = self.group.all_reduce_device(lent.slice_mut(), op, None)?;
        drop(wait(&self.group, &work, lent)?);
        Ok(out)
    }

    fn reduce_scatter_typed<T: DeviceElement, B: CudaBuffers>(
        &self,
        input: CubeTensor<CudaRuntime>,
        op: ReduceOp,
        subject: Subject,
    ) -> Result<CubeTensor<CudaRuntime>, ZeroError> {
        let name = "reduce_scatter";
        let n = input.meta.shape().num_elements();
        let world = self.group.world_size();
        if !n.is_multiple_of(world) {
            return Err(ZeroError::Comm(CommError::InvalidArgument {
                op: name.into(),
                message: format!("{n} elements cannot be cut in {world} equal shards"),
            }));
        }
        let out = empty::<B::Cube>(n / world, input.dtype, &input.device);
        let stream = self.group.stream()?;
        let lent_in = lend::<T>(&input, n, &stream, name)?;
        let mut lent_out = lend::<T>(&out, n / world, &stream, name)?;
        Self::sync::<B>(&input.device, name)?;
        let work = self
            .group
            .reduce_scatter_device(lent_in.slice(), lent_out.slice_mut(), op, subject, None)?;
        drop(wait(&self.group, &work, (lent_in, lent_out))?);
        Ok(out)
    }

    /// Enqueues the all-gather of `shard` on NCCL's stream after Burn's device has finished
    /// what writes it; the host waits for it in [`Started::wait`], so Burn's stream runs on in
    /// the meantime (a prefetch). The buffers stay lent, and the output unread, until then.
    fn all_gather_start_typed<T: DeviceElement, B: CudaBuffers>(
        &self,
        shard: CubeTensor<CudaRuntime>,
        subject: Subject,
    ) -> Result<Started<B>, ZeroError> {
        let name = "all_gather";
        let n = shard.meta.shape().num_elements();
        let world = self.group.world_size();
        let out = empty::<B::Cube>(n * world, shard.dtype, &shard.device);
        let stream = self.group.stream()?;
        let lent_in = lend::<T>(&shard, n, &stream, name)?;
        let mut lent_out = lend::<T>(&out, n * world, &stream, name)?;
        Self::sync::<B>(&shard.device, name)?;
        let work = self
            .group
            .all_gather_device(lent_in.slice(), lent_out.slice_mut(), subject, None)?;
        let gathering = Gathering {
            group: self.group.clone(),
            work,
            pending: Some(((lent_in, lent_out), out)),
        };
        Ok(Started::pending(move || {
            let out = gathering.finish()?;
            Ok(Tensor::from_primitive(TensorPrimitive::Float(B::from_cube(out))))
        }))
    }

    fn all_gather_start_any<B: CudaBuffers>(
        &self,
        shard: Tensor<B, 1>,
        subject: Subject,
    ) -> Result<Started<B>, ZeroError> {
        let t = primitive(shard, "all_gather")?;
        by_dtype!(self, t, "all_gather", all_gather_start_typed(subject))
    }
}

/// A fresh, uninitialised 1-D buffer of `len` elements of `dtype` on `device`.
fn empty<C: Backend<Device = CudaDevice, FloatTensorPrimitive = CubeTensor<CudaRuntime>>>(
    len: usize,
    dtype: DType,
    device: &CudaDevice,
) -> CubeTensor<CudaRuntime> {
    match Tensor::<C, 1>::empty([len], (device, dtype)).into_primitive() {
        TensorPrimitive::Float(t) => t,
        TensorPrimitive::QFloat(_) => unreachable!("a float creation gives a float primitive"),
    }
}

impl<B: CudaBuffers> DeviceCollective<B> for NcclDevice {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn world_size(&self) -> usize {
        self.group.world_size()
    }

    fn all_reduce(&self, tensor: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, ZeroError> {
        let t = primitive(tensor, "all_reduce")?;
        let out = by_dtype!(self, t, "all_reduce", all_reduce_typed(op))?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(B::from_cube(out))))
    }

    fn reduce_scatter_of(
        &self,
        tensor: Tensor<B, 1>,
        op: ReduceOp,
        subject: Subject,
    ) -> Result<Tensor<B, 1>, ZeroError> {
        let t = primitive(tensor, "reduce_scatter")?;
        let out = by_dtype!(self, t, "reduce_scatter", reduce_scatter_typed(op, subject))?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(B::from_cube(out))))
    }

    fn all_gather_start_of(&self, shard: Tensor<B, 1>, subject: Subject) -> Started<B> {
        self.all_gather_start_any(shard, subject)
            .unwrap_or_else(|e| Started::ready(Err(e)))
    }

    fn all_reduce_scalars(&self, values: &mut [f32], op: ReduceOp) -> Result<(), ZeroError> {
        let mut buffer = FlatBuffer::F32(values.to_vec());
        self.group.all_reduce(&mut buffer, op)?;
        values.copy_from_slice(&buffer.into_f32());
        Ok(())
    }

    /// Ranks are processes, as the launcher starts them, unless built with
    /// [`NcclDevice::thread_ranks`].
    fn ranks_may_share_a_process(&self) -> bool {
        self.threads
    }

    fn host_group(&self) -> Option<Arc<dyn ProcessGroup>> {
        Some(self.group.clone())
    }
}
