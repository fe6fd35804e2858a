//! The integration tests of this crate, one module per file, built as one test binary (one
//! link of the crate and its dependencies instead of one per file). Tests that must own
//! their process (a counting global allocator, a process-wide default) stay files of
//! their own beside this directory.

mod common;
mod precision_support;
mod sharded_support;

mod activation_checkpointing;
mod burn_optimizer;
mod checkpoint_resume;
mod data_dependent_chain;
mod data_dependent_units;
mod delayed_update;
mod device_collective_world2;
mod errors;
mod exactness;
mod frozen_parameters;
mod frozen_state;
mod offload_estimate;
mod one_cycle_momentum;
mod optimizer_device_checkpoint;
mod optimizer_device_schedule;
mod optimizer_device_state;
mod optimizer_offload;
mod optimizer_record;
mod pipeline_overflow;
mod pipeline_schedule;
mod precision_loss_scaling;
mod precision_memory;
mod precision_training;
mod sequential;
mod sharded_export;
mod sharded_models;
mod sharded_modify;
mod sharded_offload_param;
mod sharded_optimizer;
mod sharded_precision_memory;
mod sharded_prefetch;
mod sharded_record;
mod sharded_stage2;
mod sharded_units;
mod stage3_tiled_linear;
mod zero_formulas;
