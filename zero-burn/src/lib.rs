//! zero-burn: ZeRO (the Zero Redundancy Optimizer) for Burn.
//!
//! DeepSpeed's SimpleModel at ZeRO stage 3 on two ranks (threads of this process): `fc1` is a
//! [`ZeroModule`](sharded::ZeroModule), of which each rank keeps half and gathers the whole for
//! its forward; the loop is Burn's own, with the optimizer [`initialize`] returns.
//!
//! ```
//! use burn::backend::{autodiff::checkpoint::strategy::BalancedCheckpointing, Autodiff, Flex};
//! use burn::nn::{loss::CrossEntropyLossConfig, Linear, LinearConfig};
//! use burn::optim::{GradientsParams, Optimizer};
//! use burn::prelude::*;
//! use burn::tensor::{activation::relu, Distribution};
//! use zero_burn::{sharded::ZeroModule, ZeroError};
//! use zero_core::comm::{SharedGroup, ThreadGroup};
//! use zero_core::config::DeepSpeedConfig;
//!
//! // Stage 3 frees each gathered unit after its forward, and gathers it again in backward.
//! type B = Autodiff<Flex, BalancedCheckpointing>;
//!
//! #[derive(Module, Debug)]
//! struct SimpleModel<B: Backend> {
//!     fc1: ZeroModule<B, Linear<B>>,
//!     fc2: Linear<B>,
//! }
//!
//! impl SimpleModel<B> {
//!     fn forward(&self, x: Tensor<B, 2>) -> Result<Tensor<B, 2>, ZeroError> {
//!         let h = relu(self.fc1.unshard(&x)?.forward(x));
//!         Ok(self.fc2.forward(h))
//!     }
//! }
//!
//! // Each rank runs this with its own group handle and its own half of the batch.
//! fn train(config: &DeepSpeedConfig, rank: usize, group: SharedGroup) -> Result<Vec<f32>, ZeroError> {
//!     let device = Default::default();
//!     let model = SimpleModel {
//!         fc1: ZeroModule::new(LinearConfig::new(784, 128).init(&device)),
//!         fc2: LinearConfig::new(128, 10).init(&device),
//!     };
//!     let (mut model, mut optim) = zero_burn::initialize(config, model, group)?;
//!     // A fixed batch of this rank's: an input of class y is noise with its y-th element lifted.
//!     B::seed(&device, rank as u64);
//!     let y = Tensor::<B, 1, Int>::random([8], Distribution::Uniform(0.0, 10.0), &device);
//!     let noise = Tensor::<B, 2>::random([8, 784], Distribution::Normal(0.0, 1.0), &device);
//!     let x = noise + y.clone().one_hot(784).float() * 5;
//!     let cross_entropy = CrossEntropyLossConfig::new().init(&device);
//!     let mut losses = Vec::new();
//!     for _ in 0..5 {
//!         let loss = cross_entropy.forward(model.forward(x.clone())?, y.clone());
//!         losses.push(loss.clone().into_scalar());
//!         let grads = GradientsParams::from_grads(loss.backward(), &model);
//!         model = optim.step(0.01, model, grads);
//!     }
//!     Ok(losses)
//! }
//!
//! let config = DeepSpeedConfig::from_str(
//!     r#"{"train_batch_size": 16, "zero_optimization": {"stage": 3},
//!         "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}"#,
//!     "ds_config.json",
//! )
//! .expect("a valid config")
//! .config;
//! let ranks: Vec<_> = ThreadGroup::new_group(2)
//!     .expect("two rank threads")
//!     .into_iter()
//!     .enumerate()
//!     .map(|(rank, group)| {
//!         let config = config.clone();
//!         std::thread::spawn(move || train(&config, rank, group))
//!     })
//!     .collect();
//! for rank in ranks {
//!     let losses = rank.join().unwrap().unwrap();
//!     assert!(losses[4] < losses[0], "the loss falls: {losses:?}");
//! }
//! ```
//!
//! A model written for Burn gets ZeRO by wrapping fields in [`sharded::ZeroModule`] and calling
//! [`initialize`], which returns the model (its units cut over the ranks at stage 3) and a
//! [`ZeroOptimizer`] for Burn's own loop: data-parallel training with optimizer state (stage 1),
//! gradients (stage 2) and parameters (stage 3) partitioned across ranks.
//!
//! - [`ZeroOptimizer`]: a `burn::optim::Optimizer` (stages 0-2 for any Burn module, stage 3
//!   through `ZeroModule`s). Its `step` owns what happens between `backward` and the new
//!   weights: gradient averaging, bucketed reductions, clipping by the global norm, the
//!   optimizer on each rank's fp32 shard, and the gathers that give the model its weights back;
//!   accumulation is the loop's (Burn's `GradientsAccumulator`). Without optimizer offload its
//!   fp32 masters and Adam state are tensors on the model's device (module [`device`]), reduced
//!   by a [`DeviceCollective`] ([`HostStaged`] over any process group; `NcclDevice` on Burn's
//!   CUDA buffers with the `cuda` feature).
//!
//! Pipeline parallelism has its own engine, which owns the loop (`engine.train_batch`):
//! [`PipelineEngine`] trains one pipeline stage of a model cut into layers ([`PipelineModule`])
//! on the 1F1B schedule, with ZeRO stage 0/1 over its data-parallel group.
//!
//! A model that says how it chains its blocks ([`ChainModel`]; a list of layers declares it with
//! [`Sequential`]) gets activation checkpointing in any loop through [`checkpointed_grads`].
//!
//! # Stage-3 helpers
//!
//! - [`sharded::ZeroModule::modify`] (DeepSpeed's `GatheredParameters` with a modifier rank):
//!   a unit's whole module changed on one rank, the change written into every rank's shard and
//!   taken by `ZeroOptimizer` as its masters; [`sharded::ZeroModule::gathered`] reads it whole.
//! - [`TiledLinear`] (DeepSpeed's `TiledLinear`): a linear layer cut into tiles, each its own
//!   parameter; with each tile a `ZeroModule` ([`TiledLinear::into_sharded`]) stage 3 gathers
//!   one tile at a time.
//!
//! # Mixed precision
//!
//! With `"bf16": {"enabled": true}` or `"fp16": {"enabled": true}` the model's parameters and
//! gradients are 16-bit while each rank keeps fp32 master weights and optimizer state for its
//! shard ([`PrecisionSettings`]). Stage 3 keeps the 16-bit copy of its shard and gathers that
//! (half the bytes of fp32); gradients are reduced in `communication_data_type` (default: the
//! compute dtype). The model follows its parameters' dtype: float inputs must be cast by the
//! caller to the compute dtype (`settings.precision.dtype.burn()`); integer inputs (token ids) need
//! nothing. The loss may be 16-bit: it is cast to fp32 before it is scaled for backward
//! ([`ZeroOptimizer::scale_loss`] under fp16).
//!
//! fp16 scales the loss with DeepSpeed's dynamic loss scaler (`zero_core::loss_scaler`); a step
//! whose gradients overflow on any rank is skipped on every rank ([`StepReport::skipped`]).
//! bf16 and fp32 have no scaler: a non-finite loss or gradient fails the step with
//! [`ZeroError::NonFinite`], or skips it with [`NonFinitePolicy::Skip`]
//! (`InitOptions::non_finite`, or `settings.precision.non_finite`).
//!
//! It is not a communication library (that is `zero_core::comm`) nor a model zoo (`zero-models`).

mod activation_checkpointing;
mod agreement;
mod chain;
mod checkpoint;
mod core;
pub mod device;
mod error;
mod flat_state;
mod half_buffer;
mod initialize;
mod layout;
mod memory;
mod optimizer;
mod optimizer_bridge;
pub mod params;
pub mod pipeline;
pub mod sequential;
mod settings;
pub mod sharded;
mod tiled_linear;

pub use activation_checkpointing::{checkpointed_grads, segments, ActivationCheckpointing};
pub use chain::{ChainModel, Hidden};
pub use core::StepReport;
#[cfg(feature = "cuda")]
pub use device::{CudaBuffers, NcclDevice};
pub use device::{DeviceAdam, DeviceCollective, HostStaged};
pub use error::ZeroError;
pub use initialize::{
    activation_checkpointing, engine_settings, initialize, initialize_on, initialize_settings, initialize_with,
    resolve, InitOptions,
};
pub use memory::{Bytes, LocationSplit, Locations, MemoryReport};
pub use optimizer::{ZeroLr, ZeroOptimizer, ZeroOptimizerRecord};
pub use pipeline::{LayerSpec, PartitionMethod, PipeLayer, PipelineEngine, PipelineModule};
pub use sequential::{Layer, Sequential};
pub use settings::{
    BetasFn, ComputeDtype, EngineSettings, LrFn, NonFinitePolicy, OptimizerOffload, ParamOffload, PrecisionSettings,
    Stage,
};
pub use tiled_linear::{LinearTile, ShardedTiledLinear, TiledLinear, TiledLinearConfig};
/// How a parameter is cut over tensor-parallel ranks ([`ZeroOptimizer::with_tensor_parallel`]).
pub use zero_core::checkpoint::TensorSplit;
/// What a save does with the other tags of its directory, and what it removed
/// ([`ZeroOptimizer::save_checkpoint_with`]).
pub use zero_core::checkpoint::{SaveOptions, Saved};
