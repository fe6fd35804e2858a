//! Megatron-style tensor parallelism: layers whose weights are split across a tensor-parallel
//! [`ProcessGroup`](zero_core::comm::ProcessGroup), and GPT-2 built from them.
//!
//! - [`ColumnParallelLinear`] splits a linear layer's output features, [`RowParallelLinear`] its
//!   input features; a column-parallel layer followed by a row-parallel one (attention's
//!   `c_attn`/`c_proj` with the heads split, the MLP's `c_fc`/`c_proj`) communicates once
//!   forward and once backward.
//! - [`VocabParallelEmbedding`] splits the vocabulary; tied to the LM head, it gives each rank
//!   the logits of its own tokens, which [`vocab_parallel_cross_entropy`] consumes without
//!   gathering the vocabulary.
//! - The communication is Megatron's pair of conjugate collectives, [`copy_to_tp`] (`f`) and
//!   [`reduce_from_tp`] (`g`), custom autodiff operations ([`TpBackend`]).
//! - [`TpGpt2`] is GPT-2 from these layers, sliced from a full [`Gpt2`](crate::Gpt2), and a
//!   [`ChainModel`](zero_burn::ChainModel): ZeRO over the data-parallel group then shards
//!   each rank's slice, which is Megatron combined with ZeRO.
//!
//! The process groups come from [`zero_core::parallel::ParallelLayout`].

mod block;
mod collectives;
mod cross_entropy;
mod embedding;
mod group;
mod linear;
mod model;
mod pipeline;
mod sharded;

pub use block::{TpAttention, TpBlock, TpMlp};
pub use collectives::{all_reduce_primitive, copy_to_tp, reduce_from_tp, TpBackend};
pub use cross_entropy::vocab_parallel_cross_entropy;
pub use embedding::VocabParallelEmbedding;
pub use group::{TpError, TpGroup};
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use model::TpGpt2;
pub use pipeline::{TpEmbed, TpGpt2Layer, TpHead};
pub use sharded::ShardedTpGpt2;

use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;

/// A full model cannot be split over the tensor-parallel group.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TpLoadError {
    /// A dimension that must split evenly does not.
    #[error("{what} ({dim}) does not split evenly over {size} tensor-parallel ranks")]
    Indivisible {
        /// Which dimension.
        what: String,
        /// Its size.
        dim: usize,
        /// The tensor-parallel group's size.
        size: usize,
    },
}

/// Gives every parameter of `module` a new id and a leaf tensor of its own, cut from any graph:
/// replicated parts copied from a full model then share nothing with it (nor with the copies
/// other ranks take from the same model).
pub(crate) fn fresh<B: Backend, M: Module<B>>(module: M) -> M {
    struct Fresh;
    impl<B: Backend> ModuleMapper<B> for Fresh {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            Param::from_tensor(param.val().detach())
        }
    }
    module.map(&mut Fresh)
}
