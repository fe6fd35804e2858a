//! The `scheduler` section: DeepSpeed's learning-rate schedules and their defaults.
//!
//! DeepSpeed's own names (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) are
//! typed; names of torch's schedulers, which DeepSpeed also accepts, are kept with their params.

use super::error::ConfigError;
use super::reader::{nearest, Cx, Section, UnknownKeys};
use super::scalar::Scalar;
use crate::optim::{check_learning_rate, OptimError};
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};

/// A configured learning-rate schedule.
#[derive(Debug, Clone, PartialEq)]
pub enum SchedulerConfig {
    /// Warm up from `warmup_min_lr` to `warmup_max_lr`, then hold.
    WarmupLR(WarmupParams),
    /// Warm up, then decay linearly to 0 at `total_num_steps`.
    WarmupDecayLR(WarmupDecayParams),
    /// Warm up as a ratio of the optimizer's lr, then cosine-decay to `cos_min_ratio`.
    WarmupCosineLR(WarmupCosineParams),
    /// The 1Cycle policy (lr and momentum).
    OneCycle(OneCycleParams),
    /// The LR range test.
    LRRangeTest(LrRangeTestParams),
    /// A torch scheduler, with its params as written.
    Other {
        /// The scheduler's name.
        name: String,
        /// Its params ("auto" values resolved).
        params: Map<String, Value>,
    },
}

impl SchedulerConfig {
    /// The schedule's length, for the schedules that have one (WarmupDecayLR, WarmupCosineLR).
    pub fn total_num_steps(&self) -> Option<u64> {
        match self {
            SchedulerConfig::WarmupDecayLR(p) => Some(p.total_num_steps),
            SchedulerConfig::WarmupCosineLR(p) => Some(p.total_num_steps),
            _ => None,
        }
    }
}

impl SchedulerConfig {
    /// The schedule's name, in DeepSpeed's spelling.
    pub fn name(&self) -> &str {
        match self {
            Self::WarmupLR(_) => "WarmupLR",
            Self::WarmupDecayLR(_) => "WarmupDecayLR",
            Self::WarmupCosineLR(_) => "WarmupCosineLR",
            Self::OneCycle(_) => "OneCycle",
            Self::LRRangeTest(_) => "LRRangeTest",
            Self::Other { name, .. } => name,
        }
    }
}

impl Serialize for SchedulerConfig {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let params = match self {
            Self::WarmupLR(p) => serde_json::to_value(p),
            Self::WarmupDecayLR(p) => serde_json::to_value(p),
            Self::WarmupCosineLR(p) => serde_json::to_value(p),
            Self::OneCycle(p) => serde_json::to_value(p),
            Self::LRRangeTest(p) => serde_json::to_value(p),
            Self::Other { params, .. } => Ok(Value::Object(params.clone())),
        }
        .map_err(serde::ser::Error::custom)?;
        let mut out = Map::new();
        out.insert("type".into(), Value::String(self.name().to_string()));
        out.insert("params".into(), params);
        out.serialize(serializer)
    }
}

/// How the warm-up phase rises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmupType {
    /// Logarithmically (DeepSpeed's default).
    Log,
    /// Linearly.
    Linear,
}

/// WarmupLR.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WarmupParams {
    /// Learning rate at step 0 (default 0).
    pub warmup_min_lr: f64,
    /// Learning rate at the end of warm-up (default: the optimizer's lr).
    pub warmup_max_lr: Option<f64>,
    /// Warm-up steps (default 1000, > 0).
    pub warmup_num_steps: u64,
    /// Shape of the rise (default log).
    pub warmup_type: WarmupType,
    /// Step the schedule resumes after (default -1, a fresh start).
    pub last_batch_iteration: i64,
}

/// WarmupDecayLR.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WarmupDecayParams {
    /// Steps of the whole schedule (required).
    pub total_num_steps: u64,
    /// The warm-up (its `warmup_max_lr` defaults to 0.001 here).
    #[serde(flatten)]
    pub warmup: WarmupParams,
}

/// WarmupCosineLR.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WarmupCosineParams {
    /// Steps of the whole schedule (required).
    pub total_num_steps: u64,
    /// Warm-up start as a ratio of the optimizer's lr (default 0).
    pub warmup_min_ratio: f64,
    /// Warm-up steps (default 1000).
    pub warmup_num_steps: u64,
    /// Final lr as a ratio of the optimizer's lr (default 0.0001).
    pub cos_min_ratio: f64,
    /// Shape of the rise (default log).
    pub warmup_type: WarmupType,
    /// Step the schedule resumes after (default -1).
    pub last_batch_iteration: i64,
}

/// OneCycle.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OneCycleParams {
    /// Lowest lr of the cycle (required).
    pub cycle_min_lr: f64,
    /// Highest lr of the cycle (required).
    pub cycle_max_lr: f64,
    /// Decay rate after the cycle (default 0).
    pub decay_lr_rate: f64,
    /// Steps of the rising half (default 2000).
    pub cycle_first_step_size: u64,
    /// Steps of the falling half (default: the rising half's).
    pub cycle_second_step_size: Option<u64>,
    /// Stairs in the rising half (default 0 = smooth).
    pub cycle_first_stair_count: u64,
    /// Stairs in the falling half (default: the rising half's).
    pub cycle_second_stair_count: Option<u64>,
    /// Steps between post-cycle decays (default 0).
    pub decay_step_size: u64,
    /// Cycle the momentum inversely (default true).
    pub cycle_momentum: bool,
    /// Lowest momentum (default 0.8).
    pub cycle_min_mom: f64,
    /// Highest momentum (default 0.9).
    pub cycle_max_mom: f64,
    /// Momentum decay rate after the cycle (default 0).
    pub decay_mom_rate: f64,
    /// Step the schedule resumes after (default -1).
    pub last_batch_iteration: i64,
}

/// LRRangeTest.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LrRangeTestParams {
    /// Starting lr (default 1e-3).
    pub lr_range_test_min_lr: f64,
    /// Steps per increase (default 2000).
    pub lr_range_test_step_size: u64,
    /// Increase rate (default 1.0).
    pub lr_range_test_step_rate: f64,
    /// Increase in stairs rather than continuously (default false).
    pub lr_range_test_staircase: bool,
    /// Step the schedule resumes after (default -1).
    pub last_batch_iteration: i64,
}

const DEEPSPEED: &[&str] = &["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"];
const TORCH: &[&str] = &[
    "LambdaLR",
    "MultiplicativeLR",
    "StepLR",
    "MultiStepLR",
    "ConstantLR",
    "LinearLR",
    "ExponentialLR",
    "PolynomialLR",
    "CosineAnnealingLR",
    "ChainedScheduler",
    "SequentialLR",
    "ReduceLROnPlateau",
    "CyclicLR",
    "OneCycleLR",
    "CosineAnnealingWarmRestarts",
];

/// Reads `scheduler`; `None` when absent.
pub(crate) fn read_scheduler(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<Option<SchedulerConfig>, ConfigError> {
    let mut s = top.child("scheduler", cx)?;
    if !s.present() {
        return Ok(None);
    }
    let name: Option<String> = cx.get(&mut s, &["type"], None)?;
    let mut p = s.child("params", cx)?;
    s.finish(cx, UnknownKeys::Warn)?;
    let Some(name) = name else {
        cx.warning("scheduler", "a scheduler without a type is ignored; set scheduler.type");
        return Ok(None);
    };
    let all: Vec<&str> = DEEPSPEED.iter().chain(TORCH).copied().collect();
    let Some(canonical) = all.iter().find(|k| k.eq_ignore_ascii_case(&name)) else {
        let lowered: Vec<String> = all.iter().map(|k| k.to_ascii_lowercase()).collect();
        let lowered: Vec<&str> = lowered.iter().map(String::as_str).collect();
        let hint = nearest(&name.to_ascii_lowercase(), &lowered)
            .and_then(|n| all.iter().find(|k| k.eq_ignore_ascii_case(&n)))
            .map(|s| format!(" (did you mean \"{s}\"?)"))
            .unwrap_or_default();
        return Err(cx.invalid(
            "scheduler.type",
            &Value::String(name),
            format!(
                "valid schedulers are {} and torch's {}{hint}",
                DEEPSPEED.join(", "),
                TORCH.join(", ")
            ),
        ));
    };
    let config = match *canonical {
        "WarmupLR" => SchedulerConfig::WarmupLR(warmup(&mut p, cx, None)?),
        "WarmupDecayLR" => SchedulerConfig::WarmupDecayLR(WarmupDecayParams {
            total_num_steps: required(&mut p, cx, "total_num_steps", 1u64)?,
            warmup: warmup(&mut p, cx, Some(0.001))?,
        }),
        "WarmupCosineLR" => SchedulerConfig::WarmupCosineLR(WarmupCosineParams {
            total_num_steps: required(&mut p, cx, "total_num_steps", 1u64)?,
            warmup_min_ratio: cx.get(&mut p, &["warmup_min_ratio"], 0.0)?,
            warmup_num_steps: positive_steps(&mut p, cx)?,
            cos_min_ratio: cx.get(&mut p, &["cos_min_ratio"], 0.0001)?,
            warmup_type: warmup_type(&mut p, cx)?,
            last_batch_iteration: cx.get(&mut p, &["last_batch_iteration"], -1)?,
        }),
        "OneCycle" => SchedulerConfig::OneCycle(OneCycleParams {
            cycle_min_lr: required(&mut p, cx, "cycle_min_lr", 0.0)?,
            cycle_max_lr: required(&mut p, cx, "cycle_max_lr", 0.0)?,
            decay_lr_rate: cx.get(&mut p, &["decay_lr_rate"], 0.0)?,
            cycle_first_step_size: cx.get(&mut p, &["cycle_first_step_size"], 2000)?,
            cycle_second_step_size: cx.get(&mut p, &["cycle_second_step_size"], None)?,
            cycle_first_stair_count: cx.get(&mut p, &["cycle_first_stair_count"], 0)?,
            cycle_second_stair_count: cx.get(&mut p, &["cycle_second_stair_count"], None)?,
            decay_step_size: cx.get(&mut p, &["decay_step_size"], 0)?,
            cycle_momentum: cx.get(&mut p, &["cycle_momentum"], true)?,
            cycle_min_mom: cx.get(&mut p, &["cycle_min_mom"], 0.8)?,
            cycle_max_mom: cx.get(&mut p, &["cycle_max_mom"], 0.9)?,
            decay_mom_rate: cx.get(&mut p, &["decay_mom_rate"], 0.0)?,
            last_batch_iteration: cx.get(&mut p, &["last_batch_iteration"], -1)?,
        }),
        "LRRangeTest" => SchedulerConfig::LRRangeTest(LrRangeTestParams {
            lr_range_test_min_lr: cx.get(&mut p, &["lr_range_test_min_lr"], 1e-3)?,
            lr_range_test_step_size: cx.get(&mut p, &["lr_range_test_step_size"], 2000)?,
            lr_range_test_step_rate: cx.get(&mut p, &["lr_range_test_step_rate"], 1.0)?,
            lr_range_test_staircase: cx.get(&mut p, &["lr_range_test_staircase"], false)?,
            last_batch_iteration: cx.get(&mut p, &["last_batch_iteration"], -1)?,
        }),
        other => {
            let mut params = Map::new();
            let raw = top
                .raw("scheduler")
                .and_then(|o| o.get("params"))
                .and_then(Value::as_object);
            for (k, v) in raw.into_iter().flatten() {
                let key = format!("scheduler.params.{k}");
                let value = if v.as_str() == Some("auto") {
                    cx.written_auto.insert(key.clone());
                    cx.resolve_auto(&key, &key, Value::Null)?
                } else {
                    v.clone()
                };
                params.insert(k.clone(), value);
            }
            return Ok(Some(SchedulerConfig::Other {
                name: other.to_string(),
                params,
            }));
        }
    };
    // DeepSpeed passes params to the schedule's constructor, which rejects unknown ones.
    p.finish(cx, UnknownKeys::Error)?;
    check_rates(&config, cx)?;
    Ok(Some(config))
}

/// Refuses a learning rate of the schedule that the optimizer's `lr` would not be allowed to
/// be, by the same rule and in the same words: the rates it sets (`warmup_max_lr`,
/// `cycle_min_lr`, ...), those it sets as a ratio of the optimizer's (`cos_min_ratio`), and
/// those that scale them as it goes (`decay_lr_rate`, `lr_range_test_step_rate`), where a
/// negative one would in time make the rate negative.
fn check_rates(config: &SchedulerConfig, cx: &Cx<'_>) -> Result<(), ConfigError> {
    let warmup = |w: &WarmupParams| {
        let mut rates = vec![("warmup_min_lr", w.warmup_min_lr)];
        rates.extend(w.warmup_max_lr.map(|v| ("warmup_max_lr", v)));
        rates
    };
    let rates: Vec<(&'static str, f64)> = match config {
        SchedulerConfig::WarmupLR(w) => warmup(w),
        SchedulerConfig::WarmupDecayLR(p) => warmup(&p.warmup),
        SchedulerConfig::WarmupCosineLR(p) => {
            vec![
                ("warmup_min_ratio", p.warmup_min_ratio),
                ("cos_min_ratio", p.cos_min_ratio),
            ]
        }
        SchedulerConfig::OneCycle(p) => vec![
            ("cycle_min_lr", p.cycle_min_lr),
            ("cycle_max_lr", p.cycle_max_lr),
            ("decay_lr_rate", p.decay_lr_rate),
        ],
        SchedulerConfig::LRRangeTest(p) => vec![
            ("lr_range_test_min_lr", p.lr_range_test_min_lr),
            ("lr_range_test_step_rate", p.lr_range_test_step_rate),
        ],
        // A torch scheduler is refused by `initialize`; its params are kept as written.
        SchedulerConfig::Other { .. } => Vec::new(),
    };
    for (name, value) in rates {
        if let Err(OptimError::InvalidSetting { name, value, reason }) = check_learning_rate(name, value) {
            return Err(cx.invalid(
                &format!("scheduler.params.{name}"),
                &Value::from(value),
                format!("{name} {reason}"),
            ));
        }
    }
    Ok(())
}

fn warmup(p: &mut Section<'_>, cx: &mut Cx<'_>, max_default: Option<f64>) -> Result<WarmupParams, ConfigError> {
    Ok(WarmupParams {
        warmup_min_lr: cx.get(p, &["warmup_min_lr"], 0.0)?,
        warmup_max_lr: cx.get(p, &["warmup_max_lr"], max_default)?,
        warmup_num_steps: positive_steps(p, cx)?,
        warmup_type: warmup_type(p, cx)?,
        last_batch_iteration: cx.get(p, &["last_batch_iteration"], -1)?,
    })
}

fn positive_steps(p: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<u64, ConfigError> {
    let steps: u64 = cx.get(p, &["warmup_num_steps"], 1000)?;
    if steps == 0 {
        return Err(cx.invalid(
            &p.key("warmup_num_steps"),
            &Value::from(0),
            "it must be a positive integer",
        ));
    }
    Ok(steps)
}

fn warmup_type(p: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<WarmupType, ConfigError> {
    let t: String = cx.get(p, &["warmup_type"], "log".to_string())?;
    match t.as_str() {
        "log" => Ok(WarmupType::Log),
        "linear" => Ok(WarmupType::Linear),
        _ => Err(cx.invalid(
            &p.key("warmup_type"),
            &Value::String(t),
            "valid types are \"log\" and \"linear\"",
        )),
    }
}

/// A parameter the schedule cannot do without; `stand_in` is used while it is "auto" and
/// deferred.
fn required<T: Scalar>(
    p: &mut Section<'_>,
    cx: &mut Cx<'_>,
    name: &'static str,
    stand_in: T,
) -> Result<T, ConfigError> {
    if p.lookup(&[name], cx)?.is_none() {
        return Err(ConfigError::InvalidValue {
            source_name: cx.source.to_string(),
            key: p.key(name),
            value: "(missing)".into(),
            valid: "this schedule needs it".into(),
        });
    }
    cx.get(p, &[name], stand_in)
}
