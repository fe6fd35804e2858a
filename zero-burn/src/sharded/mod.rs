//! ZeRO stage 3 inside Burn's autodiff graph: a module's parameters live as each rank's shard of
//! one flat vector ([`ZeroModule`], itself a Burn module), gathered for a forward by a
//! differentiable op whose backward reduce-scatters the gradient (`gather`). A model holding
//! `ZeroModule`s trains in the ordinary Burn loop with `ZeroOptimizer` (each rank steps its
//! shards; the other parameters are reduced at the optimizer's stage 0, 1 or 2), or with Burn's
//! own element-wise optimizers when every parameter sits in a `ZeroModule`.

mod backend;
mod cut;
mod gather;
mod held;
mod ledger;
mod module;
mod offload;
mod prefetch;
mod skeleton;
mod unit_param;

pub use backend::{ShardBackend, ShardComm};
pub(crate) use cut::after_step;
pub use cut::{shard_units, shard_units_with, UnitPlan};
pub use gather::UnitComm;
pub(crate) use held::check_units;
pub use held::{contains_zero_module, held_params, HeldParam};
pub(crate) use ledger::take_error as take_backward_error;
pub(crate) use module::take_modified;
pub use module::{shard_len, UnitLayout, ZeroModule, UNIT_ALIGNMENT};
pub use offload::ParamPlace;
pub(crate) use offload::{store_of, stored_values, stores_in_place};
