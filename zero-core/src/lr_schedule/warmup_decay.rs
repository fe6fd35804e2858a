//! `WarmupDecayLR`: `WarmupLR`, then a linear decay to 0 at `total_num_steps`.

use serde::{Deserialize, Serialize};

use super::warmup::{WarmupLr, WarmupLrParams, WarmupType};
use super::{LrSchedule, ScheduleError};

/// `WarmupDecayLR` params, with DeepSpeed's defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WarmupDecayLrParams {
    /// The step at which the rate reaches 0. Required.
    pub total_num_steps: Option<u64>,
    /// Start rate. Default 0.
    pub warmup_min_lr: f64,
    /// Peak rate. Default 0.001.
    pub warmup_max_lr: f64,
    /// Warm-up length in steps. Default 1000.
    pub warmup_num_steps: u64,
    /// Shape of the rise. Default log.
    pub warmup_type: WarmupType,
}

impl Default for WarmupDecayLrParams {
    fn default() -> Self {
        WarmupDecayLrParams {
            total_num_steps: None,
            warmup_min_lr: 0.0,
            warmup_max_lr: 0.001,
            warmup_num_steps: 1000,
            warmup_type: WarmupType::Log,
        }
    }
}

/// `WarmupDecayLR`: after warm-up, `γ = max(0, (total - i) / max(1, total - warmup))`.
#[derive(Clone, Debug, PartialEq)]
pub struct WarmupDecayLr {
    warmup: WarmupLr,
    total_num_steps: u64,
}

impl WarmupDecayLr {
    /// The schedule.
    pub fn new(params: &WarmupDecayLrParams) -> Result<Self, ScheduleError> {
        let total_num_steps = params.total_num_steps.ok_or(ScheduleError::Missing {
            schedule: "WarmupDecayLR",
            param: "total_num_steps",
        })?;
        let warmup = WarmupLr::new(
            &WarmupLrParams {
                warmup_min_lr: params.warmup_min_lr,
                warmup_max_lr: Some(params.warmup_max_lr),
                warmup_num_steps: params.warmup_num_steps,
                warmup_type: params.warmup_type,
            },
            params.warmup_max_lr,
        )
        .map_err(|e| match e {
            ScheduleError::Invalid {
                param, value, reason, ..
            } => ScheduleError::Invalid {
                schedule: "WarmupDecayLR",
                param,
                value,
                reason,
            },
            other => other,
        })?;
        Ok(WarmupDecayLr {
            warmup,
            total_num_steps,
        })
    }
}

impl LrSchedule for WarmupDecayLr {
    fn lr_at(&self, iteration: u64) -> f64 {
        let gamma = self.warmup.warmup.gamma(iteration).unwrap_or_else(|| {
            let total = self.total_num_steps as f64;
            let span = (total - self.warmup.warmup.num_steps as f64).max(1.0);
            ((total - iteration as f64) / span).max(0.0)
        });
        self.warmup.lr_with_gamma(gamma)
    }

    fn initial_lr(&self) -> f64 {
        self.warmup.initial_lr()
    }
}
