//! zero-core: everything of ZeRO that does not need a tensor library.
//!
//! The DeepSpeed configuration, the partition layout of flat buffers, the communication layer
//! (process groups that never hang), optimizer kernels on flat host buffers, the loss scaler and
//! learning-rate schedules, the checkpoint format, parallel passes over flat vectors (`passes`) and
//! the `zero` command-line tool.
//!
//! It is not a training engine: the Burn integration (modules, gradients, the step) is in
//! `zero-burn`, which drives what this crate provides.

pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod estimate;
pub mod files;
pub mod launch;
pub mod loss_scaler;
pub mod lr_schedule;
pub mod offload;
pub mod optim;
pub mod parallel;
pub mod partition;
pub mod passes;
pub mod plot;
