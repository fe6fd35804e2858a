//! ZeRO stage 3 inside Burn's autodiff graph: a unit's parameters live as each rank's shard of
//! one flat vector, gathered by a differentiable op whose backward reduce-scatters the gradient.
//! This is the mechanism `ZeroModule` is to be built on; it is exercised by tests here and is not
//! yet wired to an optimizer or to the config.

mod gather;
mod unit;

pub use gather::{gather, UnitComm};
pub use unit::ShardedUnit;
