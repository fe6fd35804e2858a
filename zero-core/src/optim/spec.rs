//! Plain typed optimizer settings, with PyTorch's (and DeepSpeed's) defaults.

use serde::{Deserialize, Serialize};

use super::OptimError;

/// Which optimizer, with its settings. Built from the config's `optimizer` section by the engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum OptimizerSpec {
    /// Adam or AdamW (see [`AdamSpec::decoupled_weight_decay`]).
    Adam(AdamSpec),
    /// SGD with momentum, dampening and Nesterov.
    Sgd(SgdSpec),
    /// LAMB (layer-wise adaptive moments).
    Lamb(LambSpec),
    /// Lion (evolved sign momentum).
    Lion(LionSpec),
}

impl OptimizerSpec {
    /// `torch.optim.Adam` with its defaults.
    pub fn adam() -> Self {
        OptimizerSpec::Adam(AdamSpec::adam())
    }

    /// `torch.optim.AdamW` with its defaults.
    pub fn adamw() -> Self {
        OptimizerSpec::Adam(AdamSpec::adamw())
    }

    /// Checks every setting against its valid range: the one check of optimizer settings, made
    /// when a config is parsed (naming the config key) and when a shard optimizer is built from
    /// settings written in code.
    pub fn validate(&self) -> Result<(), OptimError> {
        match self {
            OptimizerSpec::Adam(s) => s.validate(),
            OptimizerSpec::Sgd(s) => s.validate(),
            OptimizerSpec::Lamb(s) => s.validate(),
            OptimizerSpec::Lion(s) => s.validate(),
        }
    }

    /// The `betas` (Adam, AdamW, LAMB, Lion); `None` for SGD, which has none.
    pub fn betas(&self) -> Option<(f64, f64)> {
        match self {
            OptimizerSpec::Adam(s) => Some(s.betas),
            OptimizerSpec::Sgd(_) => None,
            OptimizerSpec::Lamb(s) => Some(s.betas),
            OptimizerSpec::Lion(s) => Some(s.betas),
        }
    }

    /// Sets the `betas` for the steps to come (a schedule that cycles the momentum); false,
    /// changing nothing, for SGD, which has none.
    pub fn set_betas(&mut self, betas: (f64, f64)) -> bool {
        match self {
            OptimizerSpec::Adam(s) => s.betas = betas,
            OptimizerSpec::Sgd(_) => return false,
            OptimizerSpec::Lamb(s) => s.betas = betas,
            OptimizerSpec::Lion(s) => s.betas = betas,
        }
        true
    }

    /// The base learning rate (what a schedule scales, and the rate when there is none).
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerSpec::Adam(s) => s.lr,
            OptimizerSpec::Sgd(s) => s.lr,
            OptimizerSpec::Lamb(s) => s.lr,
            OptimizerSpec::Lion(s) => s.lr,
        }
    }
}

/// Adam / AdamW settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdamSpec {
    /// Base learning rate. Default 1e-3.
    pub lr: f64,
    /// (β1, β2). Default (0.9, 0.999).
    pub betas: (f64, f64),
    /// Added to the denominator after the square root. Default 1e-8.
    pub eps: f64,
    /// Weight decay. Default 0 for Adam, 0.01 for AdamW.
    pub weight_decay: f64,
    /// AdamW's decoupled decay (`p -= lr·wd·p`) instead of Adam's L2 term in the gradient.
    pub decoupled_weight_decay: bool,
    /// Divide the moments by 1 - β^t. Default true (PyTorch always does).
    pub bias_correction: bool,
    /// Keep the maximum of the second moment (AMSGrad). Default false.
    pub amsgrad: bool,
}

impl AdamSpec {
    /// `torch.optim.Adam` defaults.
    pub fn adam() -> Self {
        AdamSpec {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled_weight_decay: false,
            bias_correction: true,
            amsgrad: false,
        }
    }

    /// `torch.optim.AdamW` defaults.
    pub fn adamw() -> Self {
        AdamSpec {
            weight_decay: 1e-2,
            decoupled_weight_decay: true,
            ..Self::adam()
        }
    }

    pub(crate) fn validate(&self) -> Result<(), OptimError> {
        check_lr(self.lr)?;
        check_beta("betas[0]", self.betas.0)?;
        check_beta("betas[1]", self.betas.1)?;
        check_non_negative("eps", self.eps)?;
        check_non_negative("weight_decay", self.weight_decay)
    }
}

impl Default for AdamSpec {
    fn default() -> Self {
        Self::adamw()
    }
}

/// SGD settings (`torch.optim.SGD`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SgdSpec {
    /// Base learning rate. Default 1e-3.
    pub lr: f64,
    /// Momentum factor; 0 disables the momentum buffer. Default 0.
    pub momentum: f64,
    /// Dampening of the gradient's contribution to momentum. Default 0.
    pub dampening: f64,
    /// L2 weight decay added to the gradient. Default 0.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0). Default false.
    pub nesterov: bool,
}

impl Default for SgdSpec {
    fn default() -> Self {
        SgdSpec {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl SgdSpec {
    pub(crate) fn validate(&self) -> Result<(), OptimError> {
        check_lr(self.lr)?;
        check_non_negative("momentum", self.momentum)?;
        check_non_negative("weight_decay", self.weight_decay)?;
        // The setting that breaks Nesterov's rule is the one named.
        if self.nesterov && self.momentum <= 0.0 {
            return Err(OptimError::InvalidSetting {
                name: "momentum",
                value: self.momentum,
                reason: "must be > 0 with nesterov",
            });
        }
        if self.nesterov && self.dampening != 0.0 {
            return Err(OptimError::InvalidSetting {
                name: "dampening",
                value: self.dampening,
                reason: "must be 0 with nesterov",
            });
        }
        Ok(())
    }
}

/// Where LAMB applies bias correction. The two published forms differ, and DeepSpeed's kernel
/// is not the paper's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LambVariant {
    /// The LAMB paper: `u = m̂ / (sqrt(v̂) + eps) + wd·p` with bias-corrected moments,
    /// `p -= lr · ratio · u`.
    #[default]
    Paper,
    /// DeepSpeed's FusedLamb kernel: `u = m / (sqrt(v) + eps) + wd·p` on the raw moments (so the
    /// trust ratio sees the uncorrected update), `p -= lr · sqrt(bc2)/bc1 · ratio · u`.
    DeepSpeed,
}

/// LAMB settings (DeepSpeed's FusedLamb defaults).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LambSpec {
    /// Base learning rate. Default 1e-3.
    pub lr: f64,
    /// (β1, β2). Default (0.9, 0.999).
    pub betas: (f64, f64),
    /// Added to sqrt(v̂). Default 1e-8.
    pub eps: f64,
    /// Decay added to the update (`u += wd·p`). Default 0.
    pub weight_decay: f64,
    /// Divide the moments by 1 - β^t. Default true.
    pub bias_correction: bool,
    /// Upper clamp of the trust ratio. Default 10.
    pub max_coeff: f64,
    /// Lower clamp of the trust ratio. Default 0.01.
    pub min_coeff: f64,
    /// Which form of the update. Default: the paper's.
    pub variant: LambVariant,
}

impl Default for LambSpec {
    fn default() -> Self {
        LambSpec {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            bias_correction: true,
            max_coeff: 10.0,
            min_coeff: 0.01,
            variant: LambVariant::Paper,
        }
    }
}

impl LambSpec {
    pub(crate) fn validate(&self) -> Result<(), OptimError> {
        check_lr(self.lr)?;
        check_beta("betas[0]", self.betas.0)?;
        check_beta("betas[1]", self.betas.1)?;
        check_non_negative("eps", self.eps)?;
        check_non_negative("weight_decay", self.weight_decay)?;
        check_non_negative("min_coeff", self.min_coeff)?;
        if self.max_coeff < self.min_coeff {
            return Err(OptimError::InvalidSetting {
                name: "max_coeff",
                value: self.max_coeff,
                reason: "must not be below min_coeff",
            });
        }
        Ok(())
    }
}

/// Lion settings (DeepSpeed's FusedLion defaults).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LionSpec {
    /// Base learning rate. Default 1e-3.
    pub lr: f64,
    /// (β1 for the update's interpolation, β2 for the momentum). Default (0.9, 0.999).
    pub betas: (f64, f64),
    /// Decoupled weight decay (`p -= lr·wd·p`). Default 0.
    pub weight_decay: f64,
}

impl Default for LionSpec {
    fn default() -> Self {
        LionSpec {
            lr: 1e-3,
            betas: (0.9, 0.999),
            weight_decay: 0.0,
        }
    }
}

impl LionSpec {
    pub(crate) fn validate(&self) -> Result<(), OptimError> {
        check_lr(self.lr)?;
        check_beta("betas[0]", self.betas.0)?;
        check_beta("betas[1]", self.betas.1)?;
        check_non_negative("weight_decay", self.weight_decay)
    }
}

fn check_lr(lr: f64) -> Result<(), OptimError> {
    check_learning_rate("lr", lr)
}

/// The rule every learning rate a config gives is held to (the optimizer's `lr`, a schedule's
/// rates): finite and not negative, for a step against a negative rate climbs the loss.
pub(crate) fn check_learning_rate(name: &'static str, lr: f64) -> Result<(), OptimError> {
    check_non_negative(name, lr)
}

fn check_non_negative(name: &'static str, value: f64) -> Result<(), OptimError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(OptimError::InvalidSetting {
            name,
            value,
            reason: "must be finite and >= 0",
        })
    }
}

fn check_beta(name: &'static str, value: f64) -> Result<(), OptimError> {
    if (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(OptimError::InvalidSetting {
            name,
            value,
            reason: "must be in [0, 1)",
        })
    }
}
