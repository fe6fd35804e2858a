//! Pipeline parallelism: the model's layers cut into stages, one stage per rank of the pipeline
//! group, micro-batches flowing through them on a 1F1B schedule.
//!
//! - [`PipeLayer`]: one layer of a pipelined model (every layer has the same type, usually an
//!   enum): the first turns a micro-batch into hidden states, the middle ones map hidden states
//!   to hidden states, the last gives the loss. [`LayerSpec`] builds one layer.
//! - [`PipelineModule`]: the layers of one stage, cut uniformly or balanced by parameter count
//!   ([`PartitionMethod`]); a stage builds only its own layers.
//! - [`PipelineEngine`]: trains one stage. Each optimizer step runs
//!   `gradient_accumulation_steps` micro-batches on the 1F1B schedule ([`one_f_one_b`]),
//!   activations and their gradients crossing stages over [`Channel`]s; the stage's parameters
//!   are one ZeRO stage-0/1/2 flat state over the data-parallel group (stage 2 reduce-scatters
//!   each micro-batch's gradients as they come); weights tied between the first and last stage
//!   (GPT-2's `wte`) have their gradients summed before the optimizer; clipping uses the global
//!   norm over every stage. `save_checkpoint`/`load_checkpoint` write and read one checkpoint of
//!   the whole model; `eval_batch` runs forwards only (validation). With activation
//!   checkpointing in the settings (the config's `activation_checkpointing` section), each
//!   stage's middle layers keep only their segments' inputs between a micro-batch's forward and
//!   its backward, and rerun in backward.

mod build;
mod channel;
mod checkpoint;
mod engine;
mod eval;
mod layer;
mod module;
mod partition;
mod recompute;
mod schedule;

pub use channel::Channel;
pub use engine::{OpSpan, PipelineEngine, PipelineStep};
pub use layer::{LayerSpec, PipeHidden, PipeLayer, TiedWeight};
pub use module::PipelineModule;
pub use partition::{partition_layers, PartitionMethod};
pub use schedule::{one_f_one_b, PipeOp};
