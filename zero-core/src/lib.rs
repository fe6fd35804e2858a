//! zero-core: everything of ZeRO that does not need a tensor library.
//!
//! DeepSpeed's SimpleModel (784 → 128 → 10, 101,770 parameters) as zero-core sees it: its
//! config resolved for two ranks, what ZeRO stage 3 holds per device, and the two ranks (threads
//! of this process) averaging a gradient. `zero-burn` builds the training engine on these.
//!
//! ```
//! use zero_core::comm::{FlatBuffer, ProcessGroup, ReduceOp, ThreadGroup};
//! use zero_core::config::{DeepSpeedConfig, ResolveContext};
//! use zero_core::estimate::{estimate, Dtype, EstimateInput};
//!
//! let parsed = DeepSpeedConfig::from_str(
//!     r#"{"train_batch_size": 16, "zero_optimization": {"stage": 3}, "bf16": {"enabled": true}}"#,
//!     "ds_config.json",
//! )
//! .expect("a valid config");
//! let context = ResolveContext { world_size: 2, hidden_size: None, overrides: Default::default() };
//! let resolved = parsed.config.resolve(&context).expect("resolves at two ranks");
//! assert_eq!(resolved.micro_batch_size, 8);
//!
//! // bf16 weights and gradients, fp32 masters and Adam moments: 16 bytes a parameter, each
//! // device holding half of it (and the largest unit, gathered, while it runs).
//! let per_device = estimate(&EstimateInput::new(101_770, 3, 2, Dtype::Bf16)).expect("fits").per_device;
//! assert_eq!(per_device.optimizer_state, 12 * 101_770 / 2);
//!
//! let ranks: Vec<_> = ThreadGroup::new_group(2)
//!     .expect("two rank threads")
//!     .into_iter()
//!     .map(|group| {
//!         std::thread::spawn(move || {
//!             let mut grad = FlatBuffer::F32(vec![group.rank() as f32 + 1.0; 4]);
//!             group.all_reduce(&mut grad, ReduceOp::Avg).expect("both ranks take part");
//!             grad
//!         })
//!     })
//!     .collect();
//! for rank in ranks {
//!     assert_eq!(rank.join().unwrap(), FlatBuffer::F32(vec![1.5; 4]));
//! }
//! ```
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
