//! ZeRO stages 0-2 with every model state on the model's device.
//!
//! The host engines ([`crate::ZeroEngine`], [`crate::ChainEngine`]) take each gradient out of
//! Burn as a host vector, reduce it through a [`zero_core::comm::ProcessGroup`], step the CPU
//! optimizer on host fp32 masters and write the new weights back as tensor data. On a GPU that
//! is a round trip through the host for every gradient and weight of every step. Here the
//! gradients stay Burn tensors: flattened on the device, reduced by a [`DeviceCollective`],
//! accumulated, clipped and fed to [`DeviceAdam`] on fp32 master shards held as device tensors;
//! the updated shards are gathered and become the model's parameters without leaving the
//! device. The engine itself reads only scalars on the host (the loss, the norm's partial sums,
//! the overflow flag); whether a collective copies through the host is the collective's
//! business: [`HostStaged`] does, `NcclDevice` does not.
//!
//! - [`DeviceCollective`]: collectives on flat 1-D tensors. [`HostStaged`] runs them through any
//!   process group (the CPU backend, or several ranks sharing one GPU); `NcclDevice` (feature
//!   `cuda`) hands Burn's CUDA buffers to NCCL directly.
//! - [`DeviceAdam`]: Adam/AdamW with Burn tensor ops, the host kernel's arithmetic.
//! - [`DeviceEngine`]: the engine, stages 0, 1 and 2, fp32, bf16 and fp16.

mod adam;
mod collective;
mod engine;
mod flat;
#[cfg(feature = "cuda")]
mod nccl;

pub use adam::DeviceAdam;
pub use collective::{DeviceCollective, HostStaged};
pub use engine::DeviceEngine;
#[cfg(feature = "cuda")]
pub use nccl::NcclDevice;
