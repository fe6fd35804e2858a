//! ZeRO stage 3 inside Burn's autodiff graph: a module's parameters live as each rank's shard of
//! one flat vector ([`ZeroModule`], itself a Burn module), gathered for a forward by a
//! differentiable op whose backward reduce-scatters the gradient ([`gather`]). A model holding
//! `ZeroModule`s trains in the ordinary Burn loop with `ZeroOptimizer` (each rank steps its
//! shards; the other parameters are reduced at the optimizer's stage 0, 1 or 2), or with Burn's
//! own element-wise optimizers when every parameter sits in a `ZeroModule`. The engines
//! (`ChainEngine`) refuses such a model.

mod backend;
mod gather;
mod module;
mod prefetch;

pub use backend::{ShardBackend, ShardComm};
pub use gather::UnitComm;
pub(crate) use module::{after_step, refuse_zero_modules};
pub use module::{
    contains_zero_module, held_params, shard_len, shard_units, shard_units_with, HeldParam, UnitLayout, UnitPlan,
    ZeroModule, UNIT_ALIGNMENT,
};
