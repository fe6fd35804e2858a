//! Learning-rate schedules with DeepSpeed's exact formulas and defaults.
//!
//! A schedule is a pure function of the scheduler's `last_batch_iteration`, which DeepSpeed
//! advances once after every optimizer step that was not skipped for overflow. Before the first
//! advance the iteration is -1 and each schedule has its own starting value
//! ([`LrSchedule::initial_lr`]); afterwards the rate is [`LrSchedule::lr_at`] of the iteration.
//! [`LrScheduler`] holds the iteration (the only state a checkpoint needs).
//!
//! The config's `scheduler` section deserialises directly into [`LrScheduleSpec`]:
//!
//! ```
//! use zero_core::lr_schedule::{LrScheduleSpec, LrScheduler};
//!
//! let section = r#"{"type": "WarmupLR",
//!                   "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 100,
//!                              "warmup_type": "linear"}}"#;
//! let spec: LrScheduleSpec = serde_json::from_str(section).unwrap();
//! let mut sched = LrScheduler::new(spec.build(1e-3).unwrap());
//! assert_eq!(sched.lr(), 0.0); // the first step runs at warmup_min_lr
//! sched.step();
//! sched.step();
//! assert!((sched.lr() - 0.01 * 1.0 / 100.0).abs() < 1e-15);
//! ```

mod lr_range_test;
mod one_cycle;
mod warmup;
mod warmup_cosine;
mod warmup_decay;

use serde::{Deserialize, Serialize};

pub use lr_range_test::{LrRangeTest, LrRangeTestParams};
pub use one_cycle::{OneCycle, OneCycleParams};
pub use warmup::{WarmupLr, WarmupLrParams, WarmupType};
pub use warmup_cosine::{WarmupCosineLr, WarmupCosineLrParams};
pub use warmup_decay::{WarmupDecayLr, WarmupDecayLrParams};

/// β2 while a schedule cycles the momentum: DeepSpeed's OneCycle sets an optimizer's betas to
/// (momentum, 0.99) at construction and at every step, whatever `betas` the optimizer was
/// given.
pub const CYCLED_BETA2: f64 = 0.99;

/// A learning-rate (and optionally momentum) schedule.
pub trait LrSchedule: Send + Sync + std::fmt::Debug {
    /// The learning rate at `last_batch_iteration = iteration` (0 after the first step).
    fn lr_at(&self, iteration: u64) -> f64;

    /// The learning rate before the scheduler has advanced (`last_batch_iteration = -1`): the
    /// rate of the very first optimizer step.
    fn initial_lr(&self) -> f64;

    /// The momentum (β1) at `iteration`, for schedules that cycle it.
    fn momentum_at(&self, iteration: u64) -> Option<f64> {
        let _ = iteration;
        None
    }

    /// The momentum before the scheduler has advanced.
    fn initial_momentum(&self) -> Option<f64> {
        None
    }
}

/// A schedule that was configured wrongly.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    /// A required parameter is absent.
    #[error("scheduler {schedule} needs `{param}` in its params")]
    Missing {
        /// The schedule type (`WarmupDecayLR`, ...).
        schedule: &'static str,
        /// The parameter's config key.
        param: &'static str,
    },
    /// A parameter is out of range.
    #[error("scheduler {schedule}: `{param}` = {value} is invalid: {reason}")]
    Invalid {
        /// The schedule type.
        schedule: &'static str,
        /// The parameter's config key.
        param: &'static str,
        /// The value given.
        value: f64,
        /// The valid range.
        reason: &'static str,
    },
}

/// The config's `scheduler` section: `{"type": ..., "params": {...}}`, with DeepSpeed's names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "params")]
pub enum LrScheduleSpec {
    /// `WarmupLR`.
    #[serde(rename = "WarmupLR")]
    WarmupLr(WarmupLrParams),
    /// `WarmupDecayLR`.
    #[serde(rename = "WarmupDecayLR")]
    WarmupDecayLr(WarmupDecayLrParams),
    /// `WarmupCosineLR`.
    #[serde(rename = "WarmupCosineLR")]
    WarmupCosineLr(WarmupCosineLrParams),
    /// `OneCycle`.
    OneCycle(OneCycleParams),
    /// `LRRangeTest`.
    #[serde(rename = "LRRangeTest")]
    LrRangeTest(LrRangeTestParams),
}

impl LrScheduleSpec {
    /// The schedule, given the optimizer's configured learning rate (`WarmupLR` without
    /// `warmup_max_lr` warms up to it; `WarmupCosineLR` scales it).
    pub fn build(&self, optimizer_lr: f64) -> Result<Box<dyn LrSchedule>, ScheduleError> {
        Ok(match self {
            LrScheduleSpec::WarmupLr(p) => Box::new(WarmupLr::new(p, optimizer_lr)?),
            LrScheduleSpec::WarmupDecayLr(p) => Box::new(WarmupDecayLr::new(p)?),
            LrScheduleSpec::WarmupCosineLr(p) => Box::new(WarmupCosineLr::new(p, optimizer_lr)?),
            LrScheduleSpec::OneCycle(p) => Box::new(OneCycle::new(p)?),
            LrScheduleSpec::LrRangeTest(p) => Box::new(LrRangeTest::new(p)?),
        })
    }
}

/// What a checkpoint stores of a scheduler (DeepSpeed's `state_dict()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerState {
    /// -1 before the first advance.
    pub last_batch_iteration: i64,
}

/// A schedule and the iteration it has reached.
#[derive(Debug)]
pub struct LrScheduler {
    schedule: Box<dyn LrSchedule>,
    last_batch_iteration: i64,
}

impl LrScheduler {
    /// A scheduler at its start (`last_batch_iteration = -1`).
    pub fn new(schedule: Box<dyn LrSchedule>) -> Self {
        LrScheduler {
            schedule,
            last_batch_iteration: -1,
        }
    }

    /// The learning rate for the next optimizer step.
    pub fn lr(&self) -> f64 {
        match u64::try_from(self.last_batch_iteration) {
            Ok(i) => self.schedule.lr_at(i),
            Err(_) => self.schedule.initial_lr(),
        }
    }

    /// The momentum for the next optimizer step, if the schedule cycles it.
    pub fn momentum(&self) -> Option<f64> {
        match u64::try_from(self.last_batch_iteration) {
            Ok(i) => self.schedule.momentum_at(i),
            Err(_) => self.schedule.initial_momentum(),
        }
    }

    /// Advances after an optimizer step that was applied (not after a skipped one).
    pub fn step(&mut self) {
        self.last_batch_iteration += 1;
    }

    /// The state to checkpoint.
    pub fn state(&self) -> SchedulerState {
        SchedulerState {
            last_batch_iteration: self.last_batch_iteration,
        }
    }

    /// Restores a checkpointed state.
    pub fn load_state(&mut self, state: SchedulerState) {
        self.last_batch_iteration = state.last_batch_iteration.max(-1);
    }
}

pub(crate) fn positive_steps(schedule: &'static str, param: &'static str, value: u64) -> Result<u64, ScheduleError> {
    if value == 0 {
        Err(ScheduleError::Invalid {
            schedule,
            param,
            value: 0.0,
            reason: "must be a positive number of steps",
        })
    } else {
        Ok(value)
    }
}
