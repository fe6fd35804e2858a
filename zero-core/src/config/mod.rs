//! The DeepSpeed JSON configuration: parsed once, at the edge, into plain typed structs.
//!
//! [`DeepSpeedConfig::from_file`] reads a `ds_config.json` as DeepSpeed does (its keys, legacy
//! spellings and defaults; integers written `5e8`), checks every section, and returns the
//! config with the warnings worth showing. [`DeepSpeedConfig::resolve`] then fills in what the
//! file left open (the batch triad from the world size, "auto" values from the model or the
//! caller) and gives a [`ResolvedConfig`] of plain numbers, which is all the engine reads.
//!
//! Choices where DeepSpeed's behaviour is not the friendliest:
//! - Text: DeepSpeed reads configs with hjson, so comments (`//`, `#`, `/* */`) and trailing
//!   commas are accepted, with a warning (other readers of the file, such as HuggingFace's
//!   Trainer, use strict JSON). Unquoted words are not: in capitals where a value goes they are
//!   unsubstituted template placeholders (`"stage": ZERO_STAGE`), reported by name and line;
//!   anywhere else, a JSON error with its line and column.
//! - Unknown keys: an error inside `zero_optimization` (and its offload sections) and in an
//!   optimizer's or scheduler's `params`, as in DeepSpeed; a warning elsewhere.
//! - Read, not acted on: a feature DeepSpeed has and this project does not (ZeRO++ quantization,
//!   MiCS, Apex AMP, progressive layer drop, ...), set in the file, is a warning that says what
//!   happens instead; DeepSpeed's own tuning knobs that change no result are named together in one.
//! - "auto": the batch triad is derived; `reduce_bucket_size`, `stage3_prefetch_bucket_size`
//!   and `stage3_param_persistence_threshold` follow from the hidden size; the values
//!   HuggingFace's Trainer fills (optimizer and scheduler params, `gradient_clipping`,
//!   `fp16.enabled`, `bf16.enabled`, `amp`) must come from [`ResolveContext::overrides`]; any
//!   other "auto" means DeepSpeed's default, as DeepSpeed's own config models treat it.
//!
//! ```
//! use zero_core::config::{DeepSpeedConfig, ResolveContext, ZeroStage};
//! let text = r#"{
//!     "train_micro_batch_size_per_gpu": 4,
//!     "gradient_accumulation_steps": 2,
//!     "zero_optimization": { "stage": 3, "reduce_bucket_size": "auto" },
//!     "bf16": { "enabled": true }
//! }"#;
//! let parsed = DeepSpeedConfig::from_str(text, "ds_config.json")?;
//! let ctx = ResolveContext { world_size: 8, hidden_size: Some(1024), ..Default::default() };
//! let config = parsed.config.resolve(&ctx)?;
//! assert_eq!(config.train_batch_size, 64);
//! assert_eq!(config.zero.stage, ZeroStage::Parameters);
//! assert_eq!(config.zero.reduce_bucket_size, 1024 * 1024);
//! assert!(config.zero.overlap_comm); // DeepSpeed's default at stage 3
//! # Ok::<(), zero_core::config::ConfigError>(())
//! ```

mod auto;
mod batch;
mod error;
mod offload;
mod optimizer;
mod precision;
mod reader;
mod resolved;
mod scalar;
mod scheduler;
mod sections;
mod support;
mod text;
mod unacted;
mod zero;

pub use auto::{Auto, Overrides};
pub use batch::{BatchSizes, BatchSpec};
pub use error::{ConfigError, ConfigWarning};
pub use optimizer::{AdagradParams, AdamParams, LambParams, LionParams, OptimizerConfig, SgdParams};
pub use precision::{AmpConfig, Bf16Options, LossScaleConfig, Precision};
pub use reader::Deferred;
pub use resolved::{AllreduceOp, PartialResolution, ResolveContext, ResolvedConfig};
pub use scheduler::{
    LrRangeTestParams, OneCycleParams, SchedulerConfig, WarmupCosineParams, WarmupDecayParams, WarmupParams, WarmupType,
};
pub use sections::{
    ActivationCheckpointingConfig, AioConfig, CheckpointConfig, CommDataType, CommsLoggerConfig, FileMonitorConfig,
    FlopsProfilerConfig, MonitorConfig, PipelineConfig, TagValidation, TensorParallelConfig, WandbConfig,
};
pub use support::Unsupported;
pub use zero::{OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig, ZeroStage};

use reader::Cx;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;

/// The keys that set the ranks' layout (pipeline and tensor-parallel degrees): read from the
/// file itself, before any supplied value, as the world is cut from them.
pub const LAYOUT_KEYS: [&str; 2] = ["pipeline.stages", "tensor_parallel.autotp_size"];

/// The most bytes read from a config file: far more than any real config (DeepSpeed's largest
/// are a few KiB), and little enough that a wrong path (`/dev/zero`, a dataset) fails at once
/// instead of filling memory.
pub const MAX_CONFIG_BYTES: u64 = crate::files::SMALL;

/// Reads a config file's text: at most [`MAX_CONFIG_BYTES`], UTF-8. Every tool reads configs
/// through this one function, so that each refuses the same inputs with the same message.
pub fn read_config_text(path: &Path) -> Result<String, ConfigError> {
    let bytes = crate::files::read(path, MAX_CONFIG_BYTES).map_err(|source| match source.kind() {
        std::io::ErrorKind::FileTooLarge => ConfigError::TooLarge {
            path: path.to_path_buf(),
            limit: MAX_CONFIG_BYTES,
        },
        _ => ConfigError::Io {
            path: path.to_path_buf(),
            source,
        },
    })?;
    String::from_utf8(bytes).map_err(|e| {
        let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        // The prefix is valid UTF-8 by construction.
        let prefix = std::str::from_utf8(valid).unwrap_or_default();
        let line_start = prefix.rfind('\n').map_or(0, |at| at + 1);
        ConfigError::Syntax {
            source_name: path.display().to_string(),
            line: prefix.matches('\n').count() + 1,
            column: prefix[line_start..].chars().count() + 1,
            message: format!(
                "not UTF-8 text (byte 0x{:02x}); a config is JSON, which is UTF-8",
                e.as_bytes()[valid.len()]
            ),
        }
    })
}

/// A parsed DeepSpeed configuration: checked, not yet resolved against a world size or a model.
#[derive(Debug, Clone)]
pub struct DeepSpeedConfig {
    source_name: String,
    raw: Value,
    batch: BatchSpec,
    zero_stage: ZeroStage,
    auto_keys: Vec<Deferred>,
    written_auto: BTreeSet<String>,
}

/// The result of parsing: the config and what is worth telling the user about it.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The configuration.
    pub config: DeepSpeedConfig,
    /// Unknown top-level keys, legacy spellings, non-strict JSON, "auto" read as a default.
    pub warnings: Vec<ConfigWarning>,
}

impl DeepSpeedConfig {
    /// Reads and checks a config file (read with [`read_config_text`]).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Parsed, ConfigError> {
        let path = path.as_ref();
        let text = read_config_text(path)?;
        Self::from_str(&text, &path.display().to_string())
    }

    /// Reads and checks config text; `source_name` names it in errors and warnings.
    pub fn from_str(text: &str, source_name: &str) -> Result<Parsed, ConfigError> {
        let (raw, mut warnings) = text::parse_relaxed(text, source_name)?;
        let mut parsed = Self::check(raw, source_name, Some(text))?;
        warnings.append(&mut parsed.warnings);
        parsed.warnings = warnings;
        Ok(parsed)
    }

    /// Checks an already-parsed JSON value (a config built in code).
    pub fn from_value(raw: Value, source_name: &str) -> Result<Parsed, ConfigError> {
        Self::check(raw, source_name, None)
    }

    fn check(raw: Value, source_name: &str, text: Option<&str>) -> Result<Parsed, ConfigError> {
        let overrides = Overrides::new();
        let mut cx = Cx::new(source_name, &overrides);
        cx.text = text;
        cx.warn = true;
        let (draft, batch) = resolved::build(&raw, &mut cx, None)?;
        cx.warnings.extend(unacted::notices(&draft));
        let auto_keys = cx.deferred.into_iter().filter(|d| d.key != "world_size").collect();
        Ok(Parsed {
            config: DeepSpeedConfig {
                source_name: source_name.to_string(),
                raw,
                batch,
                zero_stage: draft.zero.stage,
                auto_keys,
                written_auto: cx.written_auto,
            },
            warnings: cx.warnings,
        })
    }

    /// Resolves the config for a run: every value a plain one. Fails, naming the key, where an
    /// "auto" value has nothing to resolve it.
    pub fn resolve(&self, ctx: &ResolveContext) -> Result<ResolvedConfig, ConfigError> {
        let (config, _) = self.resolve_with(Some(ctx.world_size), ctx.hidden_size, &ctx.overrides, false)?;
        Ok(config)
    }

    /// Resolves what can be resolved with what is known, and lists the rest instead of
    /// failing (the world size and the hidden size may be unknown).
    pub fn resolve_partial(
        &self,
        world_size: Option<usize>,
        hidden_size: Option<usize>,
        overrides: &Overrides,
    ) -> Result<PartialResolution, ConfigError> {
        let (config, deferred) = self.resolve_with(world_size, hidden_size, overrides, true)?;
        // Only parsing tolerates a config with no batch size at all; any run needs one.
        if deferred.iter().any(|d| d.resolved_by.starts_with("nothing")) {
            return Err(ConfigError::Batch {
                source_name: self.source_name.clone(),
                message: "the file gives neither train_batch_size nor \
                          train_micro_batch_size_per_gpu; DeepSpeed needs at least one of them: add one \
                          to the file (a value given on the command line only fills one the file writes \
                          \"auto\")"
                    .into(),
            });
        }
        Ok(PartialResolution { config, deferred })
    }

    fn resolve_with(
        &self,
        world: Option<usize>,
        hidden: Option<usize>,
        overrides: &Overrides,
        defer: bool,
    ) -> Result<(ResolvedConfig, Vec<Deferred>), ConfigError> {
        let mut cx = Cx::new(&self.source_name, overrides);
        cx.defer = defer;
        if let Some(h) = hidden {
            match resolved::derived_from_hidden(h) {
                Some(derived) => cx.derived.extend(derived),
                None => {
                    // Only a key that would take the derived value makes the size an error.
                    if let Some(key) = resolved::FROM_HIDDEN.iter().find(|k| self.written_auto.contains(**k)) {
                        return Err(ConfigError::InvalidValue {
                            source_name: self.source_name.clone(),
                            key: key.to_string(),
                            value: "\"auto\"".into(),
                            valid: format!(
                                "it follows from the model's hidden size, and {h} is too large for it \
                                 (its square must fit 64 bits)"
                            ),
                        });
                    }
                }
            }
        }
        let (config, _) = resolved::build(&self.raw, &mut cx, world)?;
        Ok((config, cx.deferred))
    }

    /// The name of the file (or text) the config came from.
    pub fn source_name(&self) -> &str {
        &self.source_name
    }

    /// The JSON as written (comments and trailing commas removed).
    pub fn raw(&self) -> &Value {
        &self.raw
    }

    /// The pipeline degree (`pipeline.stages`; "auto" or absent: 1) and the tensor-parallel
    /// degree (`tensor_parallel.autotp_size`; 0, "auto" or absent: 1) the config asks for: the ranks are
    /// laid out data × pipeline × tensor, so the data-parallel world size (which the batch sizes
    /// are over) is the world's divided by their product.
    pub fn model_parallel_degrees(&self) -> Result<(usize, usize), String> {
        let stages = match self.raw.pointer("/pipeline/stages") {
            None | Some(Value::Null) => 1,
            Some(Value::String(s)) if s == "auto" => 1,
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("pipeline.stages: {v} is not \"auto\" nor a positive integer"))?
                as usize,
        };
        let tensor = match self.raw.pointer("/tensor_parallel/autotp_size") {
            None | Some(Value::Null) => 1,
            // DeepSpeed's default (0: no tensor parallelism), as the parser reads it.
            Some(Value::String(s)) if s == "auto" => 1,
            Some(v) => v
                .as_u64()
                .ok_or_else(|| format!("tensor_parallel.autotp_size: {v} is not an integer"))?
                .max(1) as usize,
        };
        Ok((stages, tensor))
    }

    /// The data-parallel world size of `world` ranks under [`DeepSpeedConfig::model_parallel_degrees`];
    /// an error naming both keys where the ranks cannot be cut so.
    pub fn data_parallel_size(&self, world: usize) -> Result<usize, String> {
        let (stages, tensor) = self.model_parallel_degrees()?;
        if world == 0 || !world.is_multiple_of(stages * tensor) {
            return Err(format!(
                "{world} ranks cannot be cut into pipeline.stages {stages} × tensor_parallel.autotp_size {tensor}: the \
                 world size must be a positive multiple of {}",
                stages * tensor
            ));
        }
        Ok(world / (stages * tensor))
    }

    /// The batch keys as written.
    pub fn batch(&self) -> &BatchSpec {
        &self.batch
    }

    /// The ZeRO stage (known at parse time: it cannot be "auto").
    pub fn zero_stage(&self) -> ZeroStage {
        self.zero_stage
    }

    /// Checks that every key of `overrides` names a value the file writes "auto", for callers
    /// whose overrides come from a user who means each one (`zero check-config --set`): a value
    /// for a key the file writes otherwise, or does not write at all, would be silently
    /// ignored. (A training script that supplies the same values for every config, as
    /// HuggingFace's Trainer does, skips this check.)
    ///
    /// The ranks' layout ([`LAYOUT_KEYS`]) is read from the file before any value is supplied
    /// ([`DeepSpeedConfig::model_parallel_degrees`]), so a value supplied for it is refused
    /// even where the file writes "auto".
    pub fn check_overrides(&self, overrides: &Overrides) -> Result<(), ConfigError> {
        for key in overrides.keys() {
            let layout = LAYOUT_KEYS.contains(&key);
            if self.written_auto.contains(key) && !layout {
                continue;
            }
            let written = key
                .split('.')
                .try_fold(&self.raw, |v, part| v.get(part))
                .map(Value::to_string);
            return Err(ConfigError::NotAuto {
                source_name: self.source_name.clone(),
                key: key.to_string(),
                written,
                layout,
            });
        }
        Ok(())
    }

    /// Keys written "auto" that need the model, the world size or the caller to resolve, with
    /// what resolves each.
    pub fn auto_keys(&self) -> &[Deferred] {
        &self.auto_keys
    }
}
