//! `LRRangeTest`: a rate that grows linearly (or in stairs) from `lr_range_test_min_lr`, to find
//! the largest rate that still trains.

use serde::{Deserialize, Serialize};

use super::{positive_steps, LrSchedule, ScheduleError};

/// `LRRangeTest` params, with DeepSpeed's defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LrRangeTestParams {
    /// Start rate. Default 0.001.
    pub lr_range_test_min_lr: f64,
    /// Steps per unit of growth. Default 2000.
    pub lr_range_test_step_size: u64,
    /// Growth per unit. Default 1.0.
    pub lr_range_test_step_rate: f64,
    /// Grow in whole units (stairs) instead of continuously. Default false.
    pub lr_range_test_staircase: bool,
}

impl Default for LrRangeTestParams {
    fn default() -> Self {
        LrRangeTestParams {
            lr_range_test_min_lr: 1e-3,
            lr_range_test_step_size: 2000,
            lr_range_test_step_rate: 1.0,
            lr_range_test_staircase: false,
        }
    }
}

/// `LRRangeTest`: `min_lr · (1 + rate · x)` with `x = (i + 1) / step_size`, floored in
/// staircase mode.
#[derive(Clone, Debug, PartialEq)]
pub struct LrRangeTest {
    params: LrRangeTestParams,
}

impl LrRangeTest {
    /// The schedule.
    pub fn new(params: &LrRangeTestParams) -> Result<Self, ScheduleError> {
        positive_steps("LRRangeTest", "lr_range_test_step_size", params.lr_range_test_step_size)?;
        Ok(LrRangeTest { params: params.clone() })
    }
}

impl LrSchedule for LrRangeTest {
    fn lr_at(&self, iteration: u64) -> f64 {
        let p = &self.params;
        let x = (iteration + 1) as f64 / p.lr_range_test_step_size as f64;
        let x = if p.lr_range_test_staircase { x.floor() } else { x };
        p.lr_range_test_min_lr * (1.0 + p.lr_range_test_step_rate * x)
    }

    fn initial_lr(&self) -> f64 {
        self.params.lr_range_test_min_lr
    }
}
