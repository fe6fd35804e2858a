//! Mixed precision: `fp16` (with DeepSpeed's loss-scaler settings), `bf16` (also spelled
//! `bfloat16`) and `amp`.

use super::error::ConfigError;
use super::reader::{Cx, Section, UnknownKeys};
use serde::Serialize;
use serde_json::Value;

/// The dtype training computes in, with its settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "dtype", rename_all = "lowercase")]
pub enum Precision {
    /// Full precision (neither fp16 nor bf16 enabled).
    Fp32,
    /// fp16 compute with fp32 master weights and a loss scaler.
    Fp16(LossScaleConfig),
    /// bf16 compute with fp32 master weights.
    Bf16(Bf16Options),
}

/// The `fp16` section: DeepSpeed's loss scaler.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LossScaleConfig {
    /// Cast the model's inputs and operations automatically (default false).
    pub auto_cast: bool,
    /// A static loss scale; 0 means dynamic (default 0).
    pub loss_scale: f64,
    /// The dynamic scale starts at 2^initial_scale_power (default 16).
    pub initial_scale_power: u32,
    /// Steps without overflow before the scale doubles (default 1000).
    pub loss_scale_window: u64,
    /// Overflows tolerated before the scale halves (default 2).
    pub hysteresis: u64,
    /// Whether hysteresis is refilled only by consecutive good steps (default false).
    pub consecutive_hysteresis: bool,
    /// The scale never drops below this (default 1).
    pub min_loss_scale: f64,
    /// fp16 master weights and gradients (stages 1-3; default false).
    pub fp16_master_weights_and_grads: bool,
}

impl LossScaleConfig {
    /// The loss scaler these keys describe (a hysteresis beyond u32 saturates; the support
    /// checks refuse it first).
    pub fn scaler(&self) -> crate::loss_scaler::LossScalerConfig {
        crate::loss_scaler::LossScalerConfig {
            loss_scale: self.loss_scale,
            initial_scale_power: self.initial_scale_power,
            loss_scale_window: self.loss_scale_window,
            hysteresis: u32::try_from(self.hysteresis).unwrap_or(u32::MAX),
            consecutive_hysteresis: self.consecutive_hysteresis,
            min_loss_scale: self.min_loss_scale,
        }
    }

    /// Whether the scale adapts to overflows (`loss_scale` 0).
    pub fn is_dynamic(&self) -> bool {
        self.loss_scale == 0.0
    }

    /// The scale of the first step.
    pub fn initial_scale(&self) -> f64 {
        if self.is_dynamic() {
            2f64.powi(self.initial_scale_power as i32)
        } else {
            self.loss_scale
        }
    }
}

/// The `bf16` section's settings besides `enabled`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bf16Options {
    /// Apply each gradient to its parameter as soon as it is reduced (default false).
    pub immediate_grad_update: bool,
    /// Check gradients for overflow (default true).
    pub check_grad_overflow: bool,
    /// bf16 master weights and gradients (stages 1-3; default false).
    pub bf16_master_weights_and_grads: bool,
    /// bf16 optimizer states (needs bf16 master weights; default false).
    pub bf16_optimizer_states: bool,
}

/// The `amp` section (NVIDIA Apex mixed precision): `enabled`, `opt_level` and Apex's other
/// settings, kept as written.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AmpConfig {
    /// Whether Apex AMP is on (default false).
    pub enabled: bool,
    /// Apex's optimisation level ("O0" to "O3"), if given.
    pub opt_level: Option<String>,
    /// The other keys, passed to Apex as written.
    pub params: serde_json::Map<String, Value>,
}

/// Reads `fp16`, `bf16`/`bfloat16` and `amp`.
pub(crate) fn read_precision(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<(Precision, AmpConfig), ConfigError> {
    let mut fp16 = top.child("fp16", cx)?;
    let fp16_enabled: bool = cx.get(&mut fp16, &["enabled"], false)?;
    let loss = LossScaleConfig {
        auto_cast: cx.get(&mut fp16, &["auto_cast"], false)?,
        loss_scale: non_negative(cx, &mut fp16, "loss_scale", 0.0)?,
        initial_scale_power: cx.get(&mut fp16, &["initial_scale_power"], 16)?,
        loss_scale_window: cx.get(&mut fp16, &["loss_scale_window"], 1000)?,
        hysteresis: cx.get(&mut fp16, &["hysteresis"], 2)?,
        consecutive_hysteresis: cx.get(&mut fp16, &["consecutive_hysteresis"], false)?,
        min_loss_scale: non_negative(cx, &mut fp16, "min_loss_scale", 1.0)?,
        fp16_master_weights_and_grads: cx.get(&mut fp16, &["fp16_master_weights_and_grads"], false)?,
    };
    if fp16_enabled && loss.is_dynamic() {
        for (name, bad) in [
            ("loss_scale_window", loss.loss_scale_window == 0),
            ("min_loss_scale", loss.min_loss_scale <= 0.0),
        ] {
            if bad {
                return Err(cx.invalid(
                    &format!("fp16.{name}"),
                    &Value::from(0),
                    "it must be > 0 with dynamic loss scaling (loss_scale 0)",
                ));
            }
        }
    }
    if loss.initial_scale_power > 63 {
        return Err(cx.invalid(
            "fp16.initial_scale_power",
            &Value::from(loss.initial_scale_power),
            "the initial scale 2^power must fit a float; use at most 63",
        ));
    }
    // Older DeepSpeed read fp16 key by key and ignored the rest; configs written then still train.
    fp16.finish(cx, UnknownKeys::Warn)?;

    let bf16_name = if top.lookup(&["bf16"], cx)?.is_some() {
        if top.lookup(&["bfloat16"], cx)?.is_some() {
            cx.warning(
                "bfloat16",
                "ignored: DeepSpeed reads `bf16` when both spellings are given",
            );
        }
        "bf16"
    } else {
        "bfloat16"
    };
    let mut bf16 = top.child(bf16_name, cx)?;
    let bf16_enabled: bool = cx.get(&mut bf16, &["enabled"], false)?;
    let bf16_options = Bf16Options {
        immediate_grad_update: cx.get(&mut bf16, &["immediate_grad_update"], false)?,
        check_grad_overflow: cx.get(&mut bf16, &["check_grad_overflow"], true)?,
        bf16_master_weights_and_grads: cx.get(&mut bf16, &["bf16_master_weights_and_grads"], false)?,
        bf16_optimizer_states: cx.get(&mut bf16, &["bf16_optimizer_states"], false)?,
    };
    if bf16_options.bf16_optimizer_states && !bf16_options.bf16_master_weights_and_grads {
        return Err(ConfigError::Conflict {
            source_name: cx.source.to_string(),
            key: format!("{bf16_name}.bf16_optimizer_states"),
            other: format!("{bf16_name}.bf16_master_weights_and_grads"),
            reason: "bf16 optimizer states need bf16 master weights and grads".into(),
        });
    }
    bf16.finish(cx, UnknownKeys::Warn)?;

    if fp16_enabled && bf16_enabled {
        return Err(ConfigError::Conflict {
            source_name: cx.source.to_string(),
            key: "fp16.enabled".into(),
            other: format!("{bf16_name}.enabled"),
            reason: "fp16 and bf16 cannot both be enabled".into(),
        });
    }
    let precision = if fp16_enabled {
        Precision::Fp16(loss)
    } else if bf16_enabled {
        Precision::Bf16(bf16_options)
    } else {
        Precision::Fp32
    };

    let mut amp = top.child("amp", cx)?;
    let enabled: bool = cx.get(&mut amp, &["enabled"], false)?;
    let opt_level: Option<String> = cx.get(&mut amp, &["opt_level"], None)?;
    let mut params = serde_json::Map::new();
    if let Some(Value::Object(m)) = top.raw("amp") {
        for (k, v) in m {
            if k != "enabled" && k != "opt_level" {
                params.insert(k.clone(), v.clone());
            }
        }
    }
    if enabled && precision != Precision::Fp32 {
        return Err(ConfigError::Conflict {
            source_name: cx.source.to_string(),
            key: "amp.enabled".into(),
            other: if fp16_enabled {
                "fp16.enabled".into()
            } else {
                format!("{bf16_name}.enabled")
            },
            reason: "Apex AMP and DeepSpeed's own mixed precision exclude each other".into(),
        });
    }
    Ok((
        precision,
        AmpConfig {
            enabled,
            opt_level,
            params,
        },
    ))
}

fn non_negative(cx: &mut Cx<'_>, s: &mut Section<'_>, name: &'static str, default: f64) -> Result<f64, ConfigError> {
    let v: f64 = cx.get(s, &[name], default)?;
    if v < 0.0 {
        return Err(cx.invalid(&s.key(name), &Value::from(v), "it must be >= 0"));
    }
    Ok(v)
}
