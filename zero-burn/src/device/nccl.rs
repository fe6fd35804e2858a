//! NCCL on the buffers Burn's CUDA backend already holds (feature `cuda`).
//!
//! A CUDA tensor of Burn 0.21 (`CubeBackend<CudaRuntime, ..>`, no fusion) is a `CubeTensor`: a
//! cubecl compute client and a memory handle. The client's `get_resource(handle)` gives the
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
//!    and the host waits for the event it returns.
//! 4. The slices are leaked (not freed) and the resources dropped; the output tensor owns its
//!    buffer, and Burn may reuse the input's.
//!
//! So one collective costs a device synchronisation and a host wait: the gradients do not go
//! through host memory, but a blocking collective does not overlap compute. An all-gather
//! started with `all_gather_start` (a prefetch) returns after step 3's enqueue and waits for
//! its event when its result is asked for, so the kernels Burn issues meanwhile run beside it;
//! making Burn's own stream wait on NCCL's event instead of the host would need cubecl's stream
//! handle, which cubecl 0.10 does not expose.
//!
//! Scalars (norm partial sums, overflow flags) go through the group's host entry point.

use super::collective::{DeviceCollective, Started};
use crate::error::ZeroError;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_cubecl::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use half::{bf16, f16};
use std::sync::Arc;
use zero_core::comm::{CommError, DeviceElement, FlatBuffer, NcclGroup, ProcessGroup, ReduceOp};

/// Burn's CUDA backend without fusion: what `burn::backend::Cuda` is with this workspace's
/// features.
type CudaBackend<F, I, BT> = CubeBackend<CudaRuntime, F, I, BT>;

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

/// The CUDA primitive of a float tensor, contiguous.
fn primitive<F: FloatElement, I: IntElement, BT: BoolElement>(
    tensor: Tensor<CudaBackend<F, I, BT>, 1>,
    op: &str,
) -> Result<CubeTensor<CudaRuntime>, ZeroError> {
    match tensor.into_primitive() {
        TensorPrimitive::Float(t) if t.is_contiguous() => Ok(t),
        TensorPrimitive::Float(t) => Ok(burn_cubecl::kernel::into_contiguous(t)),
        TensorPrimitive::QFloat(_) => Err(ZeroError::Comm(CommError::InvalidArgument {
            op: op.to_string(),
            message: "quantized tensors cannot be reduced; dequantize first".into(),
        })),
    }
}

/// Waits on the host for the collective's end event.
fn wait(event: CudaEvent, op: &str) -> Result<(), ZeroError> {
    event.synchronize().map_err(|e| lend_error(op, e))
}

/// Dispatches on the tensor's dtype to the element type NCCL reduces.
macro_rules! by_dtype {
    ($self:ident, $t:ident, $name:expr, $call:ident ( $($arg:expr),* )) => {
        match $t.dtype {
            DType::F32 => $self.$call::<f32, F, I, BT>($t $(, $arg)*),
            DType::F16 => $self.$call::<f16, F, I, BT>($t $(, $arg)*),
            DType::BF16 => $self.$call::<bf16, F, I, BT>($t $(, $arg)*),
            other => Err(ZeroError::Comm(CommError::InvalidArgument {
                op: $name.into(),
                message: format!("tensors of dtype {other:?} cannot be reduced by NCCL here (f32, f16 or bf16 only)"),
            })),
        }
    };
}

impl NcclDevice {
    /// Makes every kernel issued on `device` so far complete (step 2 of the module's ordering).
    fn sync<F: FloatElement, I: IntElement, BT: BoolElement>(device: &CudaDevice, op: &str) -> Result<(), ZeroError> {
        CudaBackend::<F, I, BT>::sync(device).map_err(|e| lend_error(op, e))
    }

    fn all_reduce_typed<T: DeviceElement, F: FloatElement, I: IntElement, BT: BoolElement>(
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
        Self::sync::<F, I, BT>(&out.device, name)?;
        let event = self.group.all_reduce_device(lent.slice_mut(), op, None)?;
        wait(event, name)?;
        drop(lent);
        Ok(out)
    }

    fn reduce_scatter_typed<T: DeviceElement, F: FloatElement, I: IntElement, BT: BoolElement>(
        &self,
        input: CubeTensor<CudaRuntime>,
        op: ReduceOp,
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
        let out = empty::<F, I, BT>(n / world, input.dtype, &input.device);
        let stream = self.group.stream()?;
        let lent_in = lend::<T>(&input, n, &stream, name)?;
        let mut lent_out = lend::<T>(&out, n / world, &stream, name)?;
        Self::sync::<F, I, BT>(&input.device, name)?;
        let event = self
            .group
            .reduce_scatter_device(lent_in.slice(), lent_out.slice_mut(), op, None)?;
        wait(event, name)?;
        drop((lent_in, lent_out));
        Ok(out)
    }

    /// Enqueues the all-gather of `shard` on NCCL's stream after Burn's device has finished
    /// what writes it; the host waits for it in [`Started::wait`], so Burn's stream runs on in
    /// the meantime (a prefetch). The buffers stay lent, and the output unread, until then.
    fn all_gather_start_typed<T: DeviceElement, F: FloatElement, I: IntElement, BT: BoolElement>(
        &self,
        shard: CubeTensor<CudaRuntime>,
    ) -> Result<Started<CudaBackend<F, I, BT>>, ZeroError> {
        let name = "all_gather";
        let n = shard.meta.shape().num_elements();
        let world = self.group.world_size();
        let out = empty::<F, I, BT>(n * world, shard.dtype, &shard.device);
        let stream = self.group.stream()?;
        let lent_in = lend::<T>(&shard, n, &stream, name)?;
        let mut lent_out = lend::<T>(&out, n * world, &stream, name)?;
        Self::sync::<F, I, BT>(&shard.device, name)?;
        let event = self
            .group
            .all_gather_device(lent_in.slice(), lent_out.slice_mut(), None)?;
        Ok(Started::pending(move || {
            wait(event, name)?;
            drop((lent_in, lent_out));
            Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
        }))
    }

    fn all_gather_start_any<F: FloatElement, I: IntElement, BT: BoolElement>(
        &self,
        shard: Tensor<CudaBackend<F, I, BT>, 1>,
    ) -> Result<Started<CudaBackend<F, I, BT>>, ZeroError> {
        let t = primitive(shard, "all_gather")?;
        by_dtype!(self, t, "all_gather", all_gather_start_typed())
    }
}

/// A fresh, uninitialised 1-D buffer of `len` elements of `dtype` on `device`.
fn empty<F: FloatElement, I: IntElement, BT: BoolElement>(
    len: usize,
    dtype: DType,
    device: &CudaDevice,
) -> CubeTensor<CudaRuntime> {
    match Tensor::<CudaBackend<F, I, BT>, 1>::empty([len], (device, dtype)).into_primitive() {
        TensorPrimitive::Float(t) => t,
        TensorPrimitive::QFloat(_) => unreachable!("a float creation gives a float primitive"),
    }
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> DeviceCollective<CudaBackend<F, I, BT>> for NcclDevice {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn world_size(&self) -> usize {
        self.group.world_size()
    }

    fn all_reduce(
        &self,
        tensor: Tensor<CudaBackend<F, I, BT>, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, 1>, ZeroError> {
        let t = primitive(tensor, "all_reduce")?;
        let out = by_dtype!(self, t, "all_reduce", all_reduce_typed(op))?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
    }

    fn reduce_scatter(
        &self,
        tensor: Tensor<CudaBackend<F, I, BT>, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, 1>, ZeroError> {
        let t = primitive(tensor, "reduce_scatter")?;
        let out = by_dtype!(self, t, "reduce_scatter", reduce_scatter_typed(op))?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
    }

    fn all_gather(
        &self,
        shard: Tensor<CudaBackend<F, I, BT>, 1>,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, 1>, ZeroError> {
        self.all_gather_start_any(shard)?.wait()
    }

    fn all_gather_start(&self, shard: Tensor<CudaBackend<F, I, BT>, 1>) -> Started<CudaBackend<F, I, BT>> {
        self.all_gather_start_any(shard)
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
