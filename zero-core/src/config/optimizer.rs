//! The `optimizer` section: `{type, params}` with DeepSpeed's names and defaults.
//!
//! Names are matched case-insensitively, as DeepSpeed lower-cases its own. DeepSpeed's "Adam"
//! is decoupled weight decay (AdamW) unless `params.adam_w_mode` is false; "AdamW" is always
//! decoupled. Names DeepSpeed accepts that this crate does not type (1-bit optimizers, mup,
//! Muon, the rest of `torch.optim`) are kept with their params as written.

use super::error::ConfigError;
use super::reader::{nearest, Cx, Section, UnknownKeys};
use crate::optim::{AdamSpec, LambSpec, LambVariant, LionSpec, OptimError, OptimizerSpec, SgdSpec};
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};

/// A configured optimizer and its parameters, DeepSpeed's defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimizerConfig {
    /// "Adam": AdamW unless `adam_w_mode` is false.
    Adam(AdamParams),
    /// "AdamW": always decoupled weight decay.
    AdamW(AdamParams),
    /// "SGD" (torch.optim).
    Sgd(SgdParams),
    /// "Lamb" (DeepSpeed's fused LAMB).
    Lamb(LambParams),
    /// "Lion".
    Lion(LionParams),
    /// "Adagrad".
    Adagrad(AdagradParams),
    /// Another name DeepSpeed accepts, with its params as written.
    Other {
        /// The canonical spelling of the name (e.g. "OneBitAdam").
        name: String,
        /// The params, as written ("auto" values resolved).
        params: Map<String, Value>,
    },
}

impl OptimizerConfig {
    /// The optimizer's name, in DeepSpeed's spelling.
    pub fn name(&self) -> &str {
        match self {
            Self::Adam(_) => "Adam",
            Self::AdamW(_) => "AdamW",
            Self::Sgd(_) => "SGD",
            Self::Lamb(_) => "Lamb",
            Self::Lion(_) => "Lion",
            Self::Adagrad(_) => "Adagrad",
            Self::Other { name, .. } => name,
        }
    }

    /// The learning rate, where the optimizer has a typed one.
    pub fn lr(&self) -> Option<f64> {
        Some(match self {
            Self::Adam(p) | Self::AdamW(p) => p.lr,
            Self::Sgd(p) => p.lr,
            Self::Lamb(p) => p.lr,
            Self::Lion(p) => p.lr,
            Self::Adagrad(p) => p.lr,
            Self::Other { params, .. } => return params.get("lr").and_then(Value::as_f64),
        })
    }
}

impl OptimizerConfig {
    /// The settings of this crate's shard optimizer for this section (Adam, AdamW, SGD, Lamb,
    /// Lion); `None` for the optimizers DeepSpeed knows that this crate does not implement.
    /// Parsing has already checked them ([`OptimizerSpec::validate`]).
    pub fn shard_spec(&self) -> Option<OptimizerSpec> {
        Some(match self {
            Self::Adam(p) | Self::AdamW(p) => OptimizerSpec::Adam(AdamSpec {
                lr: p.lr,
                betas: (p.betas[0], p.betas[1]),
                eps: p.eps,
                weight_decay: p.weight_decay,
                // The parser already applied DeepSpeed's rule: "Adam" is AdamW unless
                // adam_w_mode is false.
                decoupled_weight_decay: p.adam_w_mode,
                bias_correction: p.bias_correction,
                amsgrad: p.amsgrad,
            }),
            Self::Sgd(p) => OptimizerSpec::Sgd(SgdSpec {
                lr: p.lr,
                momentum: p.momentum,
                dampening: p.dampening,
                weight_decay: p.weight_decay,
                nesterov: p.nesterov,
            }),
            Self::Lamb(p) => OptimizerSpec::Lamb(LambSpec {
                lr: p.lr,
                betas: (p.betas[0], p.betas[1]),
                eps: p.eps,
                weight_decay: p.weight_decay,
                bias_correction: p.bias_correction,
                max_coeff: p.max_coeff,
                min_coeff: p.min_coeff,
                // A DeepSpeed config means DeepSpeed's FusedLamb update (raw moments in the ratio).
                variant: LambVariant::DeepSpeed,
            }),
            Self::Lion(p) => OptimizerSpec::Lion(LionSpec {
                lr: p.lr,
                betas: (p.betas[0], p.betas[1]),
                weight_decay: p.weight_decay,
            }),
            Self::Adagrad(_) | Self::Other { .. } => return None,
        })
    }
}

/// Checks the settings the shard optimizer will run with, by the optimizer's own rules, so that
/// a config the trainer would refuse is refused when it is read, naming the key.
fn validate(config: &OptimizerConfig, cx: &Cx<'_>) -> Result<(), ConfigError> {
    let Some(spec) = config.shard_spec() else {
        return Ok(());
    };
    match spec.validate() {
        Ok(()) => Ok(()),
        Err(OptimError::InvalidSetting { name, value, reason }) => {
            // `betas[0]` is an element of the key `betas`: show the pair as written.
            let (key, shown) = match name.split_once('[') {
                Some((key, _)) => {
                    let pair = match &spec {
                        OptimizerSpec::Adam(s) => s.betas,
                        OptimizerSpec::Lamb(s) => s.betas,
                        OptimizerSpec::Lion(s) => s.betas,
                        OptimizerSpec::Sgd(_) => (value, value),
                    };
                    (key, Value::from(vec![pair.0, pair.1]))
                }
                None => (name, Value::from(value)),
            };
            Err(cx.invalid(&format!("optimizer.params.{key}"), &shown, format!("{name} {reason}")))
        }
        Err(other) => Err(cx.invalid("optimizer.params", &Value::Null, other.to_string())),
    }
}

impl Serialize for OptimizerConfig {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let params = match self {
            Self::Adam(p) | Self::AdamW(p) => serde_json::to_value(p),
            Self::Sgd(p) => serde_json::to_value(p),
            Self::Lamb(p) => serde_json::to_value(p),
            Self::Lion(p) => serde_json::to_value(p),
            Self::Adagrad(p) => serde_json::to_value(p),
            Self::Other { params, .. } => Ok(Value::Object(params.clone())),
        }
        .map_err(serde::ser::Error::custom)?;
        let mut out = Map::new();
        out.insert("type".into(), Value::String(self.name().to_string()));
        out.insert("params".into(), params);
        out.serialize(serializer)
    }
}

/// Adam and AdamW (DeepSpeed's fused or CPU Adam).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdamParams {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Moment decay rates (default [0.9, 0.999]).
    pub betas: [f64; 2],
    /// Denominator term (default 1e-8).
    pub eps: f64,
    /// Weight decay (default 0).
    pub weight_decay: f64,
    /// Bias correction of the moments (default true).
    pub bias_correction: bool,
    /// AMSGrad variant (default false).
    pub amsgrad: bool,
    /// Decoupled weight decay, as it will apply (AdamW: always true).
    pub adam_w_mode: bool,
    /// Use torch's Adam/AdamW rather than DeepSpeed's (default false).
    pub torch_adam: bool,
    /// fp32 optimizer states for the CPU optimizer (default: DeepSpeed decides, true).
    pub fp32_optimizer_states: Option<bool>,
}

/// SGD (torch.optim.SGD).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SgdParams {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Momentum factor (default 0).
    pub momentum: f64,
    /// Dampening of the momentum (default 0).
    pub dampening: f64,
    /// Weight decay, as L2 (default 0).
    pub weight_decay: f64,
    /// Nesterov momentum (default false).
    pub nesterov: bool,
    /// Maximise instead of minimise (default false).
    pub maximize: bool,
}

/// LAMB (DeepSpeed's fused LAMB).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LambParams {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Bias correction (default true).
    pub bias_correction: bool,
    /// Moment decay rates (default [0.9, 0.999]).
    pub betas: [f64; 2],
    /// Denominator term (default 1e-8).
    pub eps: f64,
    /// eps inside the square root (default false).
    pub eps_inside_sqrt: bool,
    /// Weight decay (default 0).
    pub weight_decay: f64,
    /// Gradient norm clip inside LAMB (default 0 = off).
    pub max_grad_norm: f64,
    /// Upper bound of the trust ratio (default 10).
    pub max_coeff: f64,
    /// Lower bound of the trust ratio (default 0.01).
    pub min_coeff: f64,
    /// AMSGrad variant (default false; DeepSpeed's LAMB rejects true).
    pub amsgrad: bool,
}

/// Lion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LionParams {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Interpolation and decay rates (default [0.9, 0.999]).
    pub betas: [f64; 2],
    /// Weight decay (default 0).
    pub weight_decay: f64,
}

/// Adagrad.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdagradParams {
    /// Learning rate (default 1e-2).
    pub lr: f64,
    /// Denominator term (default 1e-10).
    pub eps: f64,
    /// Weight decay (default 0).
    pub weight_decay: f64,
}

/// Optimizer names DeepSpeed accepts: its own (matched case-insensitively) and torch.optim's.
const KNOWN: &[&str] = &[
    "Adam",
    "AdamW",
    "SGD",
    "Lamb",
    "Lion",
    "Adagrad",
    "OneBitAdam",
    "ZeroOneAdam",
    "OneBitLamb",
    "MuAdam",
    "MuAdamW",
    "MuSGD",
    "Muon",
    "Adadelta",
    "Adafactor",
    "Adamax",
    "ASGD",
    "LBFGS",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SparseAdam",
];

/// Reads `optimizer`; `None` when absent (the caller brings its own optimizer).
pub(crate) fn read_optimizer(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<Option<OptimizerConfig>, ConfigError> {
    let mut s = top.child("optimizer", cx)?;
    if !s.present() {
        return Ok(None);
    }
    let name: Option<String> = cx.get(&mut s, &["type"], None)?;
    let _legacy_fusion: bool = cx.get(&mut s, &["legacy_fusion"], false)?;
    let mut p = s.child("params", cx)?;
    s.finish(cx, UnknownKeys::Warn)?;
    let Some(name) = name else {
        if p.present() {
            cx.warning("optimizer", "params without a type are ignored; set optimizer.type");
        }
        return Ok(None);
    };
    let Some(canonical) = KNOWN.iter().find(|k| k.eq_ignore_ascii_case(&name)) else {
        let lower = name.to_ascii_lowercase();
        let lowered: Vec<String> = KNOWN.iter().map(|k| k.to_ascii_lowercase()).collect();
        let lowered: Vec<&str> = lowered.iter().map(String::as_str).collect();
        let suggestion = nearest(&lower, &lowered)
            .and_then(|n| KNOWN.iter().find(|k| k.eq_ignore_ascii_case(&n)).map(|k| k.to_string()))
            .or_else(|| lower.contains("adamw").then(|| "AdamW".to_string()))
            .or_else(|| lower.contains("adam").then(|| "Adam".to_string()));
        let hint = suggestion
            .map(|s| format!(" (did you mean \"{s}\"?)"))
            .unwrap_or_default();
        return Err(cx.invalid(
            "optimizer.type",
            &Value::String(name),
            format!("valid optimizers are {}{hint}", KNOWN.join(", ")),
        ));
    };
    let config = match *canonical {
        "Adam" | "AdamW" => {
            let is_adamw = *canonical == "AdamW";
            let params = adam(&mut p, cx, is_adamw)?;
            if is_adamw {
                OptimizerConfig::AdamW(params)
            } else {
                OptimizerConfig::Adam(params)
            }
        }
        "SGD" => OptimizerConfig::Sgd(SgdParams {
            lr: cx.get(&mut p, &["lr"], 1e-3)?,
            momentum: cx.get(&mut p, &["momentum"], 0.0)?,
            dampening: cx.get(&mut p, &["dampening"], 0.0)?,
            weight_decay: cx.get(&mut p, &["weight_decay"], 0.0)?,
            nesterov: cx.get(&mut p, &["nesterov"], false)?,
            maximize: cx.get(&mut p, &["maximize"], false)?,
        }),
        "Lamb" => OptimizerConfig::Lamb(LambParams {
            lr: cx.get(&mut p, &["lr"], 1e-3)?,
            bias_correction: cx.get(&mut p, &["bias_correction"], true)?,
            betas: cx.get(&mut p, &["betas"], [0.9, 0.999])?,
            eps: cx.get(&mut p, &["eps"], 1e-8)?,
            eps_inside_sqrt: cx.get(&mut p, &["eps_inside_sqrt"], false)?,
            weight_decay: cx.get(&mut p, &["weight_decay"], 0.0)?,
            max_grad_norm: cx.get(&mut p, &["max_grad_norm"], 0.0)?,
            max_coeff: cx.get(&mut p, &["max_coeff"], 10.0)?,
            min_coeff: cx.get(&mut p, &["min_coeff"], 0.01)?,
            amsgrad: cx.get(&mut p, &["amsgrad"], false)?,
        }),
        "Lion" => {
            let params = LionParams {
                lr: cx.get(&mut p, &["lr"], 1e-3)?,
                betas: cx.get(&mut p, &["betas"], [0.9, 0.999])?,
                weight_decay: cx.get(&mut p, &["weight_decay"], 0.0)?,
            };
            let _: Option<bool> = cx.get(&mut p, &["fp32_optimizer_states"], None)?;
            let _: Option<bool> = cx.get(&mut p, &["set_grad_none"], None)?;
            OptimizerConfig::Lion(params)
        }
        "Adagrad" => {
            let params = AdagradParams {
                lr: cx.get(&mut p, &["lr"], 1e-2)?,
                eps: cx.get(&mut p, &["eps"], 1e-10)?,
                weight_decay: cx.get(&mut p, &["weight_decay"], 0.0)?,
            };
            for extra in ["amsgrad", "fp32_optimizer_states"] {
                let _: Option<bool> = cx.get(&mut p, &[extra], None)?;
            }
            for extra in ["lr_decay", "initial_accumulator_value"] {
                let _: Option<f64> = cx.get(&mut p, &[extra], None)?;
            }
            OptimizerConfig::Adagrad(params)
        }
        other => {
            let params = untyped_params(top, cx)?;
            return Ok(Some(OptimizerConfig::Other {
                name: other.to_string(),
                params,
            }));
        }
    };
    // DeepSpeed passes params to the optimizer's constructor, which rejects unknown ones.
    p.finish(cx, UnknownKeys::Error)?;
    validate(&config, cx)?;
    Ok(Some(config))
}

fn adam(p: &mut Section<'_>, cx: &mut Cx<'_>, is_adamw: bool) -> Result<AdamParams, ConfigError> {
    let written_mode: Option<bool> = cx.get(p, &["adam_w_mode"], None)?;
    if is_adamw && written_mode == Some(false) {
        cx.warning(
            "optimizer.params.adam_w_mode",
            "false has no effect with \"AdamW\" (DeepSpeed keeps decoupled weight decay); use \"Adam\" for L2",
        );
    }
    let max_grad_norm: Option<f64> = cx.get(p, &["max_grad_norm"], None)?;
    if max_grad_norm.is_some() {
        cx.warning(
            "optimizer.params.max_grad_norm",
            "not an Adam parameter (current DeepSpeed rejects it); ignored, use gradient_clipping",
        );
    }
    // torch.optim.Adam(W) arguments, accepted with torch_adam and otherwise without effect.
    for extra in [
        "set_grad_none",
        "foreach",
        "maximize",
        "capturable",
        "differentiable",
        "fused",
    ] {
        let _: Option<Value> = cx.get(p, &[extra], None)?;
    }
    let torch_adam = match cx.get::<Option<Value>>(p, &["torch_adam"], None)? {
        None => false,
        Some(Value::Bool(b)) => b,
        // DeepSpeed tests `if torch_adam:`, so any non-empty string switches it on; configs
        // in the wild write "torch_impl".
        Some(Value::String(s)) if !s.is_empty() => {
            cx.warning(
                "optimizer.params.torch_adam",
                format!("\"{s}\" read as true, as DeepSpeed does; write true"),
            );
            true
        }
        Some(other) => {
            return Err(ConfigError::InvalidType {
                source_name: cx.source.to_string(),
                key: "optimizer.params.torch_adam".into(),
                expected: "a boolean (true or false)".into(),
                found: other.to_string(),
            })
        }
    };
    Ok(AdamParams {
        lr: cx.get(p, &["lr"], 1e-3)?,
        betas: cx.get(p, &["betas"], [0.9, 0.999])?,
        eps: cx.get(p, &["eps"], 1e-8)?,
        weight_decay: cx.get(p, &["weight_decay"], 0.0)?,
        bias_correction: cx.get(p, &["bias_correction"], true)?,
        amsgrad: cx.get(p, &["amsgrad"], false)?,
        adam_w_mode: is_adamw || written_mode.unwrap_or(true),
        torch_adam,
        fp32_optimizer_states: cx.get(p, &["fp32_optimizer_states"], None)?,
    })
}

/// Params of an optimizer this crate does not type: kept as written, "auto" resolved.
fn untyped_params(top: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<Map<String, Value>, ConfigError> {
    let mut out = Map::new();
    let params = top
        .raw("optimizer")
        .and_then(|o| o.get("params"))
        .and_then(Value::as_object);
    for (k, v) in params.into_iter().flatten() {
        let key = format!("optimizer.params.{k}");
        let value = if v.as_str() == Some("auto") {
            cx.written_auto.insert(key.clone());
            cx.resolve_auto(&key, &key, Value::Null)?
        } else {
            v.clone()
        };
        out.insert(k.clone(), value);
    }
    Ok(out)
}
