//! `WarmupCosineLR`: a ratio of the optimizer's lr, warmed up from `warmup_min_ratio` to 1, then
//! a half cosine down to `cos_min_ratio` at `total_num_steps`.

use serde::{Deserialize, Serialize};

use super::warmup::{Warmup, WarmupType};
use super::{LrSchedule, ScheduleError};

/// `WarmupCosineLR` params, with DeepSpeed's defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WarmupCosineLrParams {
    /// The step at which the cosine reaches its floor. Required.
    pub total_num_steps: Option<u64>,
    /// Start ratio. Default 0.
    pub warmup_min_ratio: f64,
    /// Warm-up length in steps. Default 1000.
    pub warmup_num_steps: u64,
    /// Final ratio. Default 0.0001.
    pub cos_min_ratio: f64,
    /// Shape of the rise. Default log.
    pub warmup_type: WarmupType,
}

impl Default for WarmupCosineLrParams {
    fn default() -> Self {
        WarmupCosineLrParams {
            total_num_steps: None,
            warmup_min_ratio: 0.0,
            warmup_num_steps: 1000,
            cos_min_ratio: 0.0001,
            warmup_type: WarmupType::Log,
        }
    }
}

/// `WarmupCosineLR`: `lr = optimizer_lr · ratio(i)`.
#[derive(Clone, Debug, PartialEq)]
pub struct WarmupCosineLr {
    base_lr: f64,
    total_num_steps: u64,
    warmup_min_ratio: f64,
    cos_min_ratio: f64,
    warmup: Warmup,
}

impl WarmupCosineLr {
    /// The schedule, scaling `optimizer_lr`.
    pub fn new(params: &WarmupCosineLrParams, optimizer_lr: f64) -> Result<Self, ScheduleError> {
        let total_num_steps = params.total_num_steps.ok_or(ScheduleError::Missing {
            schedule: "WarmupCosineLR",
            param: "total_num_steps",
        })?;
        Ok(WarmupCosineLr {
            base_lr: optimizer_lr,
            total_num_steps,
            warmup_min_ratio: params.warmup_min_ratio,
            cos_min_ratio: params.cos_min_ratio,
            warmup: Warmup::new("WarmupCosineLR", params.warmup_type, params.warmup_num_steps)?,
        })
    }

    /// The ratio of the optimizer's lr at `iteration`.
    pub fn ratio_at(&self, iteration: u64) -> f64 {
        if let Some(gamma) = self.warmup.gamma(iteration) {
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio);
        }
        let done = (iteration - self.warmup.num_steps + 1) as f64;
        let span = (self.total_num_steps as f64 - self.warmup.num_steps as f64).max(1.0);
        // Past the end the ratio stays at the floor instead of rising again.
        let progress = (done / span).min(1.0);
        let cosine = (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0;
        (self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine).max(0.0)
    }
}

impl LrSchedule for WarmupCosineLr {
    fn lr_at(&self, iteration: u64) -> f64 {
        self.base_lr * self.ratio_at(iteration)
    }

    /// DeepSpeed starts this schedule at 0: the first step does not move the weights.
    fn initial_lr(&self) -> f64 {
        0.0
    }
}
