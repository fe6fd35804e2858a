//! What the engine does not do of what a valid DeepSpeed config can ask for. The parser accepts
//! what DeepSpeed accepts; these settings are refused when the engine is built from a config
//! (`zero_burn::engine_settings`), and `zero check-config` says them before a run. Each is an
//! [`Unsupported`] that names the key, why, and what to write instead.

use super::optimizer::OptimizerConfig;
use super::precision::Precision;
use super::resolved::{AllreduceOp, ResolvedConfig};
use super::scheduler::SchedulerConfig;
use crate::lr_schedule::{LrSchedule, LrScheduleSpec, ScheduleError};
use crate::optim::OptimizerSpec;

/// A setting of a valid DeepSpeed config that the engine refuses.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{key}`: {message}")]
pub struct Unsupported {
    /// The dotted config key.
    pub key: String,
    /// Why, and what to write instead.
    pub message: String,
}

impl Unsupported {
    fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Unsupported {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl ResolvedConfig {
    /// The optimizer the engine steps: the `optimizer` section's; `None` where the config names
    /// none (the program gives it, as a client optimizer is given to DeepSpeed's `initialize`).
    pub fn shard_optimizer(&self) -> Result<Option<OptimizerSpec>, Unsupported> {
        let Some(optimizer) = &self.optimizer else {
            return Ok(None);
        };
        // The parser already checked the settings against the optimizer's own rules.
        let spec = optimizer.shard_spec().ok_or_else(|| {
            Unsupported::new(
                "optimizer.type",
                format!(
                    "\"{}\" is not available here; choose Adam, AdamW, SGD, Lamb or Lion",
                    optimizer.name()
                ),
            )
        })?;
        Ok(Some(spec))
    }

    /// The schedule the `scheduler` section names (`None` without one), for an optimizer of
    /// learning rate `optimizer_lr` (WarmupLR without `warmup_max_lr` warms up to it;
    /// WarmupCosineLR scales it).
    pub fn lr_schedule(&self, optimizer_lr: f64) -> Result<Option<Box<dyn LrSchedule>>, Unsupported> {
        let Some(scheduler) = &self.scheduler else {
            return Ok(None);
        };
        if let SchedulerConfig::Other { name, .. } = scheduler {
            return Err(Unsupported::new(
                "scheduler.type",
                format!(
                    "\"{name}\" is not available here; choose WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or \
                     LRRangeTest"
                ),
            ));
        }
        // Both sides speak DeepSpeed's key names: the resolved section is the schedule's spec.
        let spec = serde_json::to_value(scheduler)
            .and_then(serde_json::from_value::<LrScheduleSpec>)
            .map_err(|e| Unsupported::new("scheduler", e.to_string()))?;
        let schedule = spec.build(optimizer_lr).map_err(|e| {
            let param = match &e {
                ScheduleError::Missing { param, .. } | ScheduleError::Invalid { param, .. } => param,
            };
            Unsupported::new(format!("scheduler.params.{param}"), e.to_string())
        })?;
        Ok(Some(schedule))
    }

    /// Every setting of this config the engine refuses, in the config's section order; empty
    /// when it runs the config as written (a config that names no optimizer needs one from the
    /// program, which is not a refusal of the config).
    pub fn unsupported(&self) -> Vec<Unsupported> {
        self.unsupported_except(&[])
    }

    /// [`ResolvedConfig::unsupported`], leaving out what depends on the keys `deferred` (values
    /// a partial resolution could not settle yet, held by stand-ins: `zero check-config`).
    pub fn unsupported_except(&self, deferred: &[&str]) -> Vec<Unsupported> {
        let open = |prefix: &str| deferred.iter().any(|k| k.starts_with(prefix));
        let mut out = Vec::new();
        if let Err(e) = self.shard_optimizer() {
            out.push(e);
        }
        let settled = !open("scheduler.") && !open("optimizer.params.lr");
        let optimizer_lr = self.optimizer.as_ref().and_then(OptimizerConfig::lr).unwrap_or(1e-3);
        match self.lr_schedule(optimizer_lr) {
            Err(e) if settled || e.key == "scheduler.type" => out.push(e),
            _ => {}
        }
        if self.gradient_allreduce_op == AllreduceOp::Sum {
            out.push(Unsupported::new(
                "gradient_allreduce_op",
                "\"sum\": gradients are averaged over the data-parallel ranks here (\"mean\", DeepSpeed's default), \
                 never summed; remove the key or set it to \"mean\"",
            ));
        }
        out.extend(self.unsupported_precision());
        if let Some(o) = &self.zero.offload_optimizer {
            if o.ratio < 1.0 {
                out.push(Unsupported::new(
                    "zero_optimization.offload_optimizer.ratio",
                    format!(
                        "{} asks for partial offload, which is not available: every rank's optimizer state is offloaded whole \
                         (remove the key or set it to 1)",
                        o.ratio
                    ),
                ));
            }
        }
        out
    }

    fn unsupported_precision(&self) -> Vec<Unsupported> {
        let mut out = Vec::new();
        let always_fp32 = "the master weights and optimizer state are always fp32 here; remove the key or set it to \
                           false";
        match &self.precision {
            Precision::Fp32 => {}
            Precision::Fp16(fp16) => {
                if fp16.fp16_master_weights_and_grads {
                    out.push(Unsupported::new("fp16.fp16_master_weights_and_grads", always_fp32));
                }
                if u32::try_from(fp16.hysteresis).is_err() {
                    out.push(Unsupported::new(
                        "fp16.hysteresis",
                        format!("{} is too large (at most {})", fp16.hysteresis, u32::MAX),
                    ));
                } else if let Err(crate::loss_scaler::LossScaleError::InvalidSetting { name, value, reason }) =
                    crate::loss_scaler::LossScaler::new(fp16.scaler())
                {
                    // The scaler's own checks, so that a config passes here only if training
                    // can build its scaler.
                    out.push(Unsupported::new(format!("fp16.{name}"), format!("{value}: {reason}")));
                }
            }
            Precision::Bf16(bf16) => {
                if bf16.bf16_master_weights_and_grads {
                    out.push(Unsupported::new("bf16.bf16_master_weights_and_grads", always_fp32));
                }
                if bf16.bf16_optimizer_states {
                    out.push(Unsupported::new("bf16.bf16_optimizer_states", always_fp32));
                }
                if bf16.immediate_grad_update {
                    out.push(Unsupported::new(
                        "bf16.immediate_grad_update",
                        "gradients are applied at the step here; remove the key or set it to false",
                    ));
                }
            }
        }
        out
    }
}
