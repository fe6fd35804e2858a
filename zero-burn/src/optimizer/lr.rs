//! The config's learning-rate schedule as a Burn `LrScheduler` ([`ZeroLr`]).

use super::ZeroOptimizer;
use crate::settings::LrFn;
use burn::tensor::backend::Backend;

/// A DeepSpeed config's learning-rate schedule as a Burn `LrScheduler`
/// ([`ZeroOptimizer::lr_scheduler`]): `step()` gives the rate of the optimizer's next applied
/// step. Its record is that position, for reading; loading one changes nothing (the position is
/// the optimizer's, restored with its checkpoint).
#[derive(Clone)]
pub struct ZeroLr {
    pub(super) schedule: LrFn,
    pub(super) optimizer: ZeroOptimizer,
}

impl ZeroLr {
    /// Applied optimizer steps so far (those of a loaded record that the next step applies).
    fn position(&self) -> u64 {
        if let Some(step) = self.optimizer.pending_step() {
            return step;
        }
        let state = self.optimizer.state.lock().unwrap_or_else(|e| e.into_inner());
        state.as_ref().map_or(0, |s| s.global_step() - s.skipped_steps())
    }
}

impl burn::optim::lr_scheduler::LrScheduler for ZeroLr {
    type Record<B: Backend> = u64;

    fn step(&mut self) -> f64 {
        (self.schedule)(self.position())
    }

    fn to_record<B: Backend>(&self) -> u64 {
        self.position()
    }

    fn load_record<B: Backend>(self, _position: u64) -> Self {
        self
    }
}
