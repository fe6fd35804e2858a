//! `WarmupLR`: from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then constant.

use serde::{Deserialize, Serialize};

use super::{positive_steps, LrSchedule, ScheduleError};

/// How the rate rises during warm-up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmupType {
    /// `ln(i + 1) / ln(warmup_num_steps)` (DeepSpeed's default).
    #[default]
    Log,
    /// `i / warmup_num_steps`.
    Linear,
}

/// The warm-up fraction (0 → 1) shared by the warm-up schedules.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Warmup {
    pub(crate) kind: WarmupType,
    /// DeepSpeed raises the configured count to at least 2 (a log warm-up over 1 step would
    /// divide by ln 1 = 0).
    pub(crate) num_steps: u64,
    inverse_log: f64,
}

impl Warmup {
    pub(crate) fn new(schedule: &'static str, kind: WarmupType, num_steps: u64) -> Result<Self, ScheduleError> {
        let num_steps = positive_steps(schedule, "warmup_num_steps", num_steps)?.max(2);
        Ok(Warmup {
            kind,
            num_steps,
            inverse_log: 1.0 / (num_steps as f64).ln(),
        })
    }

    /// The fraction at `iteration`, or None once warm-up is over.
    pub(crate) fn gamma(&self, iteration: u64) -> Option<f64> {
        if iteration >= self.num_steps {
            return None;
        }
        Some(match self.kind {
            WarmupType::Log => self.inverse_log * ((iteration + 1) as f64).ln(),
            WarmupType::Linear => iteration as f64 / self.num_steps as f64,
        })
    }
}

/// `WarmupLR` params, with DeepSpeed's defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WarmupLrParams {
    /// Start rate. Default 0.
    pub warmup_min_lr: f64,
    /// Rate after warm-up. Default: the optimizer's lr.
    pub warmup_max_lr: Option<f64>,
    /// Warm-up length in steps. Default 1000.
    pub warmup_num_steps: u64,
    /// Shape of the rise. Default log.
    pub warmup_type: WarmupType,
}

impl Default for WarmupLrParams {
    fn default() -> Self {
        WarmupLrParams {
            warmup_min_lr: 0.0,
            warmup_max_lr: None,
            warmup_num_steps: 1000,
            warmup_type: WarmupType::Log,
        }
    }
}

/// `WarmupLR`: `min + (max - min)·γ(i)` during warm-up, `max` afterwards.
#[derive(Clone, Debug, PartialEq)]
pub struct WarmupLr {
    pub(crate) min_lr: f64,
    pub(crate) delta_lr: f64,
    pub(crate) warmup: Warmup,
}

impl WarmupLr {
    /// The schedule; `optimizer_lr` is the peak when `warmup_max_lr` is not given.
    pub fn new(params: &WarmupLrParams, optimizer_lr: f64) -> Result<Self, ScheduleError> {
        let max_lr = params.warmup_max_lr.unwrap_or(optimizer_lr);
        Ok(WarmupLr {
            min_lr: params.warmup_min_lr,
            delta_lr: max_lr - params.warmup_min_lr,
            warmup: Warmup::new("WarmupLR", params.warmup_type, params.warmup_num_steps)?,
        })
    }

    pub(crate) fn lr_with_gamma(&self, gamma: f64) -> f64 {
        self.min_lr + self.delta_lr * gamma
    }
}

impl LrSchedule for WarmupLr {
    fn lr_at(&self, iteration: u64) -> f64 {
        self.lr_with_gamma(self.warmup.gamma(iteration).unwrap_or(1.0))
    }

    fn initial_lr(&self) -> f64 {
        self.min_lr
    }
}
