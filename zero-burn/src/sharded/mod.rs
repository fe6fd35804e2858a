//! ZeRO stage 3 inside Burn's autodiff graph: a module's parameters live as each rank's shard of
//! one flat vector ([`ZeroModule`], itself a Burn module), gathered for a forward by a
//! differentiable op whose backward reduce-scatters the gradient ([`gather`]). Not yet wired to
//! `ZeroOptimizer` or the config: a model whose parameters all sit in `ZeroModule`s trains with
//! Burn's own element-wise optimizers (each rank steps its shards); parameters outside them are
//! not reduced.

mod gather;
mod module;

pub use gather::{gather, UnitComm};
pub(crate) use module::refuse_zero_modules;
pub use module::{contains_zero_module, ShardBackend, ShardComm, UnitLayout, ZeroModule};
