//! `OneCycle`: one triangular cycle of the rate between `cycle_min_lr` and `cycle_max_lr` (and,
//! inversely, of the momentum), then an optional hyperbolic decay (Smith 2018, "A disciplined
//! approach to neural network hyper-parameters").

use serde::{Deserialize, Serialize};

use super::{LrSchedule, ScheduleError};

/// `OneCycle` params, with DeepSpeed's defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OneCycleParams {
    /// Lower rate of the cycle, and the rate after it (without decay). Required.
    pub cycle_min_lr: Option<f64>,
    /// Peak rate, reached at the end of the first half. Required.
    pub cycle_max_lr: Option<f64>,
    /// Post-cycle decay rate of the learning rate. Default 0 (no decay).
    pub decay_lr_rate: f64,
    /// Steps of the rising half. Default 2000.
    pub cycle_first_step_size: u64,
    /// Steps of the falling half. Default: as the first.
    pub cycle_second_step_size: Option<u64>,
    /// Stairs in the rising half (0: continuous). Default 0.
    pub cycle_first_stair_count: i64,
    /// Stairs in the falling half. Default: as the first.
    pub cycle_second_stair_count: Option<i64>,
    /// Steps per unit of post-cycle decay (0: no decay). Default 0.
    pub decay_step_size: u64,
    /// Cycle the momentum (β1) inversely to the rate. Default true.
    pub cycle_momentum: bool,
    /// Momentum at the peak rate. Default 0.8.
    pub cycle_min_mom: f64,
    /// Momentum at the lowest rate. Default 0.9.
    pub cycle_max_mom: f64,
    /// Post-cycle growth rate of the momentum. Default 0.
    pub decay_mom_rate: f64,
}

impl Default for OneCycleParams {
    fn default() -> Self {
        OneCycleParams {
            cycle_min_lr: None,
            cycle_max_lr: None,
            decay_lr_rate: 0.0,
            cycle_first_step_size: 2000,
            cycle_second_step_size: None,
            cycle_first_stair_count: 0,
            cycle_second_stair_count: None,
            decay_step_size: 0,
            cycle_momentum: true,
            cycle_min_mom: 0.8,
            cycle_max_mom: 0.9,
            decay_mom_rate: 0.0,
        }
    }
}

/// `OneCycle`.
#[derive(Clone, Debug, PartialEq)]
pub struct OneCycle {
    min_lr: f64,
    max_lr: f64,
    decay_lr_rate: f64,
    first_step_size: f64,
    second_step_size: f64,
    total_size: f64,
    step_ratio: f64,
    first_stair_count: i64,
    second_stair_count: i64,
    decay_step_size: f64,
    skip_lr_decay: bool,
    skip_mom_decay: bool,
    cycle_momentum: bool,
    min_mom: f64,
    max_mom: f64,
    decay_mom_rate: f64,
}

impl OneCycle {
    /// The schedule.
    pub fn new(p: &OneCycleParams) -> Result<Self, ScheduleError> {
        let missing = |param| ScheduleError::Missing {
            schedule: "OneCycle",
            param,
        };
        let min_lr = p.cycle_min_lr.ok_or_else(|| missing("cycle_min_lr"))?;
        let max_lr = p.cycle_max_lr.ok_or_else(|| missing("cycle_max_lr"))?;
        if p.cycle_first_step_size == 0 {
            return Err(ScheduleError::Invalid {
                schedule: "OneCycle",
                param: "cycle_first_step_size",
                value: 0.0,
                reason: "must be positive",
            });
        }
        let first = p.cycle_first_step_size as f64;
        let second = p.cycle_second_step_size.map_or(first, |s| s as f64);
        let total = first + second;
        let no_decay_steps = p.decay_step_size == 0;
        Ok(OneCycle {
            min_lr,
            max_lr,
            decay_lr_rate: p.decay_lr_rate,
            first_step_size: first,
            second_step_size: second,
            total_size: total,
            step_ratio: first / total,
            first_stair_count: p.cycle_first_stair_count,
            second_stair_count: p.cycle_second_stair_count.unwrap_or(p.cycle_first_stair_count),
            decay_step_size: p.decay_step_size as f64,
            skip_lr_decay: no_decay_steps || p.decay_lr_rate == 0.0,
            skip_mom_decay: no_decay_steps || p.decay_mom_rate == 0.0,
            cycle_momentum: p.cycle_momentum,
            min_mom: p.cycle_min_mom,
            max_mom: p.cycle_max_mom,
            decay_mom_rate: p.decay_mom_rate,
        })
    }

    /// Position in the cycle: 0 at the low end, 1 at the peak.
    fn scale_factor(&self, iteration: u64) -> f64 {
        let batch = (iteration + 1) as f64;
        let cycle = (1.0 + batch / self.total_size).floor();
        let x = 1.0 + batch / self.total_size - cycle;
        let (mut scale, stairs) = if x <= self.step_ratio {
            (x / self.step_ratio, self.first_stair_count)
        } else {
            ((x - 1.0) / (self.step_ratio - 1.0), self.second_stair_count)
        };
        if stairs > 0 {
            // Stairs are counted from the integer offset in the cycle: the float scale at a
            // half-cycle boundary can fall a hair under a whole stair.
            let in_cycle = batch % self.total_size;
            let position = if in_cycle <= self.first_step_size {
                in_cycle * stairs as f64 / self.first_step_size
            } else {
                (self.total_size - in_cycle) * stairs as f64 / self.second_step_size
            };
            scale = position.floor() / stairs as f64;
        }
        scale
    }

    /// Steps since the cycle ended (1 at the first step after it), if it has.
    fn decay_iteration(&self, iteration: u64) -> Option<f64> {
        let i = iteration as f64;
        (i >= self.total_size).then_some(i - self.total_size + 1.0)
    }
}

impl LrSchedule for OneCycle {
    fn lr_at(&self, iteration: u64) -> f64 {
        match self.decay_iteration(iteration) {
            None => self.min_lr + (self.max_lr - self.min_lr) * self.scale_factor(iteration),
            Some(_) if self.skip_lr_decay => self.min_lr,
            Some(d) => self.min_lr / (1.0 + self.decay_lr_rate * (d / self.decay_step_size)),
        }
    }

    fn initial_lr(&self) -> f64 {
        self.min_lr
    }

    fn momentum_at(&self, iteration: u64) -> Option<f64> {
        if !self.cycle_momentum {
            return None;
        }
        Some(match self.decay_iteration(iteration) {
            None => self.max_mom - (self.max_mom - self.min_mom) * self.scale_factor(iteration),
            Some(_) if self.skip_mom_decay => self.max_mom,
            Some(d) => self.max_mom * (1.0 + self.decay_mom_rate * (d / self.decay_step_size)),
        })
    }

    /// DeepSpeed sets β1 to `cycle_min_mom` at construction, though the cycle's formula would
    /// give `cycle_max_mom` there.
    fn initial_momentum(&self) -> Option<f64> {
        self.cycle_momentum.then_some(self.min_mom)
    }
}
