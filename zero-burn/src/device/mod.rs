//! The model's state on the model's device: what [`crate::ZeroOptimizer`] keeps there when the
//! optimizer is not offloaded.
//!
//! The gradients stay Burn tensors: flattened on the device, reduced by a [`DeviceCollective`],
//! clipped and fed to [`DeviceAdam`] on fp32 master shards held as device tensors; the updated
//! shards are gathered and become the model's parameters without leaving the device. Only
//! scalars reach the host (the norm's partial sums, the overflow flag); whether a collective
//! copies through the host is the collective's business: [`HostStaged`] does, `NcclDevice`
//! does not.
//!
//! - [`DeviceCollective`]: collectives on flat 1-D tensors. [`HostStaged`] runs them through any
//!   process group (the CPU backend, or several ranks sharing one GPU); `NcclDevice` (feature
//!   `cuda`) hands Burn's CUDA buffers to NCCL directly.
//! - [`DeviceAdam`], SGD, Lion and LAMB with Burn tensor ops, the host kernels' arithmetic, or on
//!   the CPU backend (Adam, SGD, Lion) the host kernels themselves; LAMB sums each parameter's
//!   norms over the ranks through the device collective.
//! - The state's checkpoints are the host state's format: either loads the other's, at any
//!   world size.

mod adam;
mod checkpoint;
mod collective;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda_adam;
pub(crate) mod flat;
mod lamb;
#[cfg(feature = "cuda")]
mod nccl;
mod optim;
pub(crate) mod state;

pub use adam::DeviceAdam;
pub use collective::{DeviceCollective, HostStaged, Started};
pub(crate) use cpu::{cast, own_buffer};
#[cfg(feature = "cuda")]
pub use nccl::{CudaBuffers, NcclDevice};

/// The GPUs the CUDA driver sees, or why there are none (no driver library, a driver error, or
/// no device visible), so that a program can refuse `--backend cuda` with a sentence before
/// Burn's CUDA runtime, which panics on a machine without a GPU, is first touched.
#[cfg(feature = "cuda")]
pub fn cuda_devices() -> Result<usize, String> {
    // SAFETY: only probes whether the driver library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda) is not installed on this machine".into());
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err("the CUDA driver sees no GPU (is CUDA_VISIBLE_DEVICES empty?)".into()),
        Err(e) => Err(format!("the CUDA driver failed to start: {e}")),
    }
}
