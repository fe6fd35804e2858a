//! From a DeepSpeed config to ZeRO: `initialize` (a Burn model and its `ZeroOptimizer`).
//!
//! The config is parsed and validated once, at the edge (`zero_core::config`); here it is
//! resolved for the process group's world size and turned into [`EngineSettings`], plain values
//! the hot path reads.

use crate::device::HostStaged;
use crate::error::ZeroError;
use crate::optimizer::ZeroOptimizer;
use crate::settings::{
    BetasFn, ComputeDtype, EngineSettings, LrFn, NonFinitePolicy, OptimizerOffload, ParamOffload, PrecisionSettings,
    Stage,
};
use crate::sharded::{contains_zero_module, shard_units_with, ParamPlace, ShardBackend, UnitComm, UnitPlan};
use crate::ActivationCheckpointing;
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use std::sync::Arc;
use zero_core::comm::ProcessGroup;
use zero_core::config::{
    CommDataType, DeepSpeedConfig, OffloadDevice, Overrides, Precision, ResolveContext, ResolvedConfig, Unsupported,
};
use zero_core::lr_schedule::LrSchedule;
use zero_core::optim::OptimizerSpec;

/// What the config may leave to be known at initialize.
#[derive(Clone, Debug, Default)]
pub struct InitOptions {
    /// The model's hidden size, for bucket sizes written "auto".
    pub hidden_size: Option<usize>,
    /// Values for keys written "auto" that only the caller can give (optimizer lr, ...).
    pub overrides: Overrides,
    /// What a step does with an infinite or NaN loss or gradient under fp32 or bf16: `None`
    /// keeps the default, an error naming the step and the rank (nothing checked under bf16
    /// with `"check_grad_overflow": false`); `Some(NonFinitePolicy::Skip)` skips such steps on
    /// every rank and goes on. fp16 always leaves it to its loss scaler.
    pub non_finite: Option<NonFinitePolicy>,
    /// The model, recorded in the engine's checkpoints ([`EngineSettings::model`]).
    pub model: Option<zero_core::checkpoint::ModelRecord>,
    /// The optimizer, for a config that names none (as a training script hands its own to
    /// DeepSpeed's `initialize`, HuggingFace's Trainer among them). A config that names one as
    /// well is an error: which of the two was meant is not for the engine to guess.
    pub optimizer: Option<OptimizerSpec>,
}

/// Resolves `config` for `world_size` ranks.
pub fn resolve(
    config: &DeepSpeedConfig,
    world_size: usize,
    options: &InitOptions,
) -> Result<ResolvedConfig, ZeroError> {
    config
        .resolve(&ResolveContext {
            world_size,
            hidden_size: options.hidden_size,
            overrides: options.overrides.clone(),
        })
        .map_err(|e| ZeroError::Config(e.to_string()))
}

/// The engine's settings from a resolved config. Parts of the config this engine does not do
/// are errors that say so ([`ResolvedConfig::unsupported`], every one of them), never silently
/// ignored. The config must name the optimizer; [`InitOptions::optimizer`] gives one to a
/// config that does not.
pub fn engine_settings(config: &ResolvedConfig) -> Result<EngineSettings, ZeroError> {
    settings_for(config, None)
}

/// [`engine_settings`] with the program's optimizer (`client`) for a config that names none.
fn settings_for(config: &ResolvedConfig, client: Option<&OptimizerSpec>) -> Result<EngineSettings, ZeroError> {
    let refused = config.unsupported();
    if !refused.is_empty() {
        let each: Vec<String> = refused.iter().map(ToString::to_string).collect();
        return Err(ZeroError::Config(each.join("; ")));
    }
    let unsupported = |e: Unsupported| ZeroError::Config(e.to_string());
    let stage = Stage::from_number(config.zero.stage as u8)
        .ok_or_else(|| ZeroError::Config(format!("zero_optimization.stage {:?} is not 0-3", config.zero.stage)))?;
    let optimizer = match (config.shard_optimizer().map_err(unsupported)?, client) {
        (Some(named), None) => named,
        (None, Some(given)) => given.clone(),
        (Some(_), Some(_)) => {
            return Err(ZeroError::Config(
                "optimizer: the config names an optimizer and InitOptions::optimizer gives another; keep one".into(),
            ))
        }
        (None, None) => return Err(ZeroError::Config(
            "optimizer: the config names no optimizer; add e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}, \
                 or give one to initialize_with (InitOptions::optimizer)"
                .into(),
        )),
    };
    let schedule = config.lr_schedule(optimizer.lr()).map_err(unsupported)?;
    let (lr_schedule, betas_schedule) = match schedule {
        None => (None, None),
        Some(schedule) => {
            let schedule: Arc<dyn LrSchedule> = Arc::from(schedule);
            (Some(lr_by_step(schedule.clone())), betas_by_step(schedule, &optimizer))
        }
    };
    let mut settings = EngineSettings::new(stage, optimizer);
    settings.gradient_accumulation_steps = config.gradient_accumulation_steps as usize;
    settings.reduce_bucket_size = config.zero.reduce_bucket_size as usize;
    settings.overlap_comm = config.zero.overlap_comm;
    settings.prefetch_bucket_size = config.zero.stage3_prefetch_bucket_size as usize;
    settings.param_persistence_threshold = config.zero.stage3_param_persistence_threshold as usize;
    settings.gradient_clipping = config.gradient_clipping;
    settings.lr_schedule = lr_schedule;
    settings.betas_schedule = betas_schedule;
    settings.precision = precision_settings(config);
    settings.offload_optimizer = optimizer_offload(config)?;
    settings.delayed_update = delayed_update(config, &settings.optimizer)?;
    settings.offload_param = param_offload(config, stage)?;
    settings.activation_checkpointing = activation_checkpointing(config);
    settings.max_live_parameters = config.zero.stage3_max_live_parameters as usize;
    Ok(settings)
}

/// Activation checkpointing from the config's `activation_checkpointing` section: on when the
/// section is written. `partition_activations` needs the tensor-parallel group, which only the
/// caller knows: set [`ActivationCheckpointing::partition_group`] on the result (without it,
/// one rank's activation is its whole activation and there is nothing to split); and for
/// [`crate::checkpointed_grads`], [`ActivationCheckpointing::boundary_group`].
pub fn activation_checkpointing(config: &ResolvedConfig) -> Option<ActivationCheckpointing> {
    let c = &config.activation_checkpointing;
    c.present.then(|| ActivationCheckpointing {
        number_checkpoints: c.number_checkpoints.map(|n| n as usize),
        cpu_checkpointing: c.cpu_checkpointing,
        partition_group: None,
        synchronize_checkpoint_boundary: c.synchronize_checkpoint_boundary,
        boundary_group: None,
    })
}

/// The optimizer's placement from `zero_optimization.offload_optimizer` (and `sub_group_size`,
/// the elements of one chunk streamed from NVMe); partial offload was refused before.
fn optimizer_offload(config: &ResolvedConfig) -> Result<OptimizerOffload, ZeroError> {
    let Some(o) = config.zero.offload_optimizer.as_ref() else {
        return Ok(OptimizerOffload::None);
    };
    Ok(match o.device {
        OffloadDevice::Cpu => OptimizerOffload::Cpu { threads: 0 },
        OffloadDevice::Nvme => {
            let path = o.nvme_path.as_ref().ok_or_else(|| {
                ZeroError::Config("zero_optimization.offload_optimizer.nvme_path: required with device \"nvme\"".into())
            })?;
            let buffer_count = usize::try_from(o.buffer_count).unwrap_or(usize::MAX).max(1);
            OptimizerOffload::Nvme {
                path: path.into(),
                buffer_count,
                chunk_elements: zero_core::offload::chunk_elements(config.zero.sub_group_size),
                threads: 0,
            }
        }
    })
}

/// `zero_optimization.offload_optimizer.delayed_update`; refused for LAMB, whose step sums
/// norms over the ranks and so cannot run beside the next step's collectives.
fn delayed_update(config: &ResolvedConfig, optimizer: &OptimizerSpec) -> Result<bool, ZeroError> {
    let delayed = config.zero.offload_optimizer.as_ref().is_some_and(|o| o.delayed_update);
    if delayed && matches!(optimizer, OptimizerSpec::Lamb(_)) {
        return Err(crate::settings::delayed_update_communicates());
    }
    Ok(delayed)
}

/// Where stage 3 keeps the parameter shards, from `zero_optimization.offload_param`. The
/// parser drops the section below stage 3 (with a warning, as DeepSpeed ignores it there);
/// one set on a `ResolvedConfig` by hand at stages 0-2 is refused.
fn param_offload(config: &ResolvedConfig, stage: Stage) -> Result<ParamOffload, ZeroError> {
    let Some(o) = config.zero.offload_param.as_ref() else {
        return Ok(ParamOffload::None);
    };
    if stage != Stage::Zero3 {
        return Err(ZeroError::Config(format!(
            "zero_optimization.offload_param: parameters are partitioned only at stage 3, not {}; remove the section \
             or use stage 3",
            stage.number()
        )));
    }
    Ok(match o.device {
        OffloadDevice::Cpu => ParamOffload::Cpu,
        OffloadDevice::Nvme => {
            let path = o.nvme_path.as_ref().ok_or_else(|| {
                ZeroError::Config("zero_optimization.offload_param.nvme_path: required with device \"nvme\"".into())
            })?;
            ParamOffload::Nvme {
                path: path.into(),
                max_in_cpu: usize::try_from(o.max_in_cpu).unwrap_or(usize::MAX),
            }
        }
    })
}

/// The compute dtype, loss scaler and communication dtype from the `fp16`/`bf16` sections and
/// `communication_data_type` (settings that would store more in 16 bits were refused before).
fn precision_settings(config: &ResolvedConfig) -> PrecisionSettings {
    let mut precision = match &config.precision {
        Precision::Fp32 => PrecisionSettings::fp32(),
        Precision::Fp16(fp16) => PrecisionSettings::fp16(fp16.scaler()),
        Precision::Bf16(bf16) => {
            let mut p = PrecisionSettings::bf16();
            if !bf16.check_grad_overflow {
                p.non_finite = NonFinitePolicy::Ignore;
            }
            p
        }
    };
    precision.communication_dtype = config.communication_data_type.map(|d| match d {
        CommDataType::Fp32 => ComputeDtype::F32,
        CommDataType::Fp16 => ComputeDtype::F16,
        CommDataType::Bf16 => ComputeDtype::Bf16,
    });
    precision
}

/// [`engine_settings`] with the options that only the caller gives.
fn settings_with(config: &ResolvedConfig, options: &InitOptions) -> Result<EngineSettings, ZeroError> {
    let mut settings = settings_for(config, options.optimizer.as_ref())?;
    if let Some(policy) = options.non_finite {
        if settings.precision.dtype != ComputeDtype::F16 {
            settings.precision.non_finite = policy;
        }
    }
    settings.model = options.model.clone();
    Ok(settings)
}

/// The learning rate by optimizer step: step k (0-based) runs at the rate the scheduler holds
/// after k advances.
fn lr_by_step(schedule: Arc<dyn LrSchedule>) -> LrFn {
    Arc::new(move |step| {
        if step == 0 {
            schedule.initial_lr()
        } else {
            schedule.lr_at(step - 1)
        }
    })
}

/// The optimizer's betas by optimizer step where `schedule` cycles the momentum (OneCycle with
/// `cycle_momentum`): as DeepSpeed's OneCycle sets them, (momentum, 0.99), β2 replaced too.
/// `None` where the schedule does not cycle it, or the optimizer has no betas (SGD: DeepSpeed
/// turns the cycling off for it, and so does this).
fn betas_by_step(schedule: Arc<dyn LrSchedule>, optimizer: &OptimizerSpec) -> Option<BetasFn> {
    let first = schedule.initial_momentum()?;
    optimizer.betas()?;
    let beta2 = zero_core::lr_schedule::CYCLED_BETA2;
    // Step k (0-based) runs with the momentum the scheduler holds after k advances.
    Some(Arc::new(move |step| {
        let momentum = match step {
            0 => Some(first),
            _ => schedule.momentum_at(step - 1),
        };
        (momentum.unwrap_or(first), beta2)
    }))
}

/// ZeRO for a model written for Burn, from a DeepSpeed config: the model (its `ZeroModule`s cut
/// over the ranks at stage 3) and the [`ZeroOptimizer`] that trains it in Burn's own loop.
///
/// Every rank starts from rank 0's weights (one broadcast, as DeepSpeed does at initialize). At
/// stage 3 each [`ZeroModule`](crate::sharded::ZeroModule) of at least
/// `stage3_param_persistence_threshold` elements keeps only this rank's shard and gathers the
/// rest for its forward; smaller units, and parameters outside any unit, stay whole. At stages
/// 0-2 every unit stays whole. Collectives of the units and of the optimizer's device state run
/// through the group's host path ([`HostStaged`]); [`initialize_on`] takes a device collective
/// (NCCL on CUDA).
///
/// ```ignore
/// let parsed = DeepSpeedConfig::from_file("ds_config.json")?;
/// // What the file asks for that is read differently or not done here, and what happens instead.
/// parsed.warnings.iter().for_each(|w| eprintln!("warning: {w}"));
/// let (mut model, mut optim) = zero_burn::initialize(&parsed.config, model, group)?;
/// let mut lr = optim.lr_scheduler();
/// for batch in batches {
///     let loss = model.forward(batch);
///     let grads = GradientsParams::from_grads(loss.backward(), &model);
///     model = optim.step(lr.step(), model, grads);
/// }
/// ```
pub fn initialize<B: AutodiffBackend + ShardBackend, M: AutodiffModule<B>>(
    config: &DeepSpeedConfig,
    model: M,
    group: Arc<dyn ProcessGroup>,
) -> Result<(M, ZeroOptimizer), ZeroError> {
    initialize_with(config, model, group, &InitOptions::default())
}

/// [`initialize`] with the hidden size and "auto" overrides.
pub fn initialize_with<B: AutodiffBackend + ShardBackend, M: AutodiffModule<B>>(
    config: &DeepSpeedConfig,
    model: M,
    group: Arc<dyn ProcessGroup>,
    options: &InitOptions,
) -> Result<(M, ZeroOptimizer), ZeroError> {
    let collective: UnitComm<B::Collective> = Arc::new(HostStaged::new(group.clone()));
    initialize_on(config, model, group, collective, options)
}

/// [`initialize_with`] with the collective the units gather and reduce-scatter through and the
/// optimizer reduces its device state through (on CUDA, `NcclDevice` on Burn's own buffers);
/// `group` carries checkpoints and the host state's reductions (with `offload_optimizer`).
pub fn initialize_on<B: AutodiffBackend + ShardBackend, M: AutodiffModule<B>>(
    config: &DeepSpeedConfig,
    model: M,
    group: Arc<dyn ProcessGroup>,
    collective: UnitComm<B::Collective>,
    options: &InitOptions,
) -> Result<(M, ZeroOptimizer), ZeroError> {
    let resolved = resolve(config, group.world_size(), options)?;
    initialize_settings(settings_with(&resolved, options)?, model, group, collective)
}

/// [`initialize_on`] from settings already made of a config ([`engine_settings`]), for a
/// caller that resolved the config itself.
pub fn initialize_settings<B: AutodiffBackend + ShardBackend, M: AutodiffModule<B>>(
    settings: EngineSettings,
    model: M,
    group: Arc<dyn ProcessGroup>,
    collective: UnitComm<B::Collective>,
) -> Result<(M, ZeroOptimizer), ZeroError> {
    let stage3 = settings.stage == Stage::Zero3;
    if stage3 && !contains_zero_module::<B, M>(&model) {
        return Err(crate::optimizer::no_units_at_stage_3());
    }
    // A rank's own model (a record it loaded) may be the only one amiss: every rank learns it.
    let checked = crate::sharded::check_units::<B, M>(&model);
    crate::checkpoint::all_ranks_or_none_of(group.as_ref(), "initialize", checked)?;
    let mut settings = settings;
    if settings.offload_param == ParamOffload::Cpu && B::host_resident() {
        // The shards already live in host memory.
        settings.offload_param = ParamOffload::None;
    }
    // With `overlap_comm`, the units that come next are gathered while one computes, up to
    // `stage3_prefetch_bucket_size` elements (stage 3: at stage 2 the step gathers the units).
    let plan = UnitPlan {
        min_numel: settings.param_persistence_threshold,
        keep_gathered: settings.stage == Stage::Zero2,
        prefetch: settings.prefetch_budget(),
        grad_dtype: settings.precision.communication_dtype.map(ComputeDtype::burn),
        offload_param: match &settings.offload_param {
            ParamOffload::None => None,
            ParamOffload::Cpu => Some(ParamPlace::Host),
            ParamOffload::Nvme { path, max_in_cpu } => Some(ParamPlace::Nvme {
                path: path.clone(),
                max_in_cpu: *max_in_cpu,
            }),
        },
    };
    // Stage 2 on one rank would hold each unit twice (the whole and a shard of all of it).
    let cut = stage3 || (settings.stage == Stage::Zero2 && group.world_size() > 1);
    agree_on_settings(&settings, group.as_ref())?;
    let optimizer = ZeroOptimizer::new(settings, group)?.with_collective(collective.clone());
    optimizer.set_keeps_gathered(!B::frees_gathered());
    let mut model = optimizer.synchronize(model)?;
    if stage3 && !B::frees_gathered() {
        warn_keeps_gathered();
    }
    if cut {
        // At stage 2 every unit is cut (no persistence threshold): each unit's gradient is
        // reduce-scattered in backward; its whole vector is gathered once per step and kept.
        let plan = UnitPlan {
            min_numel: if stage3 { plan.min_numel } else { 0 },
            ..plan
        };
        model = shard_units_with(model, collective, &plan)?;
    }
    Ok((model, optimizer))
}

/// Once per process: stage 3 on an autodiff backend without a checkpointing strategy.
/// Every rank must train with the same settings: ranks whose optimizer, schedule, clipping,
/// precision or stage differ would each step its shard its own way (and the gathered model
/// would mix them) or fail later at a collective. Rank 0's fingerprint of each setting, broadcast,
/// finds them at initialize: each differing rank names its settings, and every rank stops.
fn agree_on_settings(settings: &EngineSettings, group: &dyn ProcessGroup) -> Result<(), ZeroError> {
    if group.world_size() < 2 {
        return Ok(());
    }
    let steps = [0u64, 1, 2, 10, 100, 1_000, 10_000, 100_000];
    let offload = |o: &dyn std::fmt::Debug| format!("{o:?}").split([' ', '{', '(']).next().map(str::to_string);
    let described: [(&str, String); 9] = [
        ("zero_optimization.stage", format!("{:?}", settings.stage)),
        ("optimizer", format!("{:?}", settings.optimizer)),
        (
            "scheduler (learning rate)",
            format!("{:?}", steps.map(|s| settings.lr_at(s))),
        ),
        (
            "scheduler (momentum)",
            format!("{:?}", steps.map(|s| settings.betas_at(s))),
        ),
        ("gradient_clipping", format!("{:?}", settings.gradient_clipping)),
        ("fp16 / bf16", format!("{:?}", settings.precision)),
        (
            "zero_optimization.offload_optimizer",
            format!("{:?}", offload(&settings.offload_optimizer)),
        ),
        (
            "zero_optimization.offload_optimizer.delayed_update",
            format!("{:?}", settings.delayed_update),
        ),
        (
            "zero_optimization.offload_param",
            format!("{:?}", offload(&settings.offload_param)),
        ),
    ];
    // 24 bits of each description's hash: exact in an f32.
    let mine: Vec<f32> = described
        .iter()
        .map(|(_, text)| {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            text.hash(&mut h);
            (h.finish() & 0xFF_FFFF) as f32
        })
        .collect();
    // Rank 0's fingerprints to every rank; each names what it was given otherwise.
    let mut zeroth = zero_core::comm::FlatBuffer::F32(mine.clone());
    group.broadcast(&mut zeroth, 0)?;
    let zeroth = zeroth.into_f32();
    let differ: Vec<&str> = described
        .iter()
        .zip(mine.iter().zip(&zeroth))
        .filter(|(_, (a, b))| a != b)
        .map(|((name, _), _)| *name)
        .collect();
    // Every rank learns whether any differs (the highest such rank), so that all stop.
    let mut flag = zero_core::comm::FlatBuffer::F32(vec![if differ.is_empty() { 0.0 } else { group.rank() as f32 }]);
    group.all_reduce(&mut flag, zero_core::comm::ReduceOp::Max)?;
    let highest = flag.into_f32()[0] as usize;
    if !differ.is_empty() {
        return Err(ZeroError::Config(format!(
            "rank {} was given other settings than rank 0: {}; give every rank the same config",
            group.rank(),
            differ.join(", ")
        )));
    }
    if highest > 0 {
        return Err(ZeroError::Config(format!(
            "rank {highest} was given other settings than rank 0 (its error names them); give every rank the same \
             config"
        )));
    }
    Ok(())
}

fn warn_keeps_gathered() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "warning: zero_optimization.stage 3 on an autodiff backend without checkpointing keeps every \
             gathered unit alive from its forward to its backward (stage 2's memory, the same gradients); \
             use Autodiff<B, BalancedCheckpointing> to gather them again in backward instead"
        );
    });
}
