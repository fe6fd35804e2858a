//! One rank of a run without a pipeline: the model's blocks `ZeroModule`s, whole on every rank
//! or each rank's tensor slice of them, in Burn's own loop with `ZeroOptimizer`.

use super::super::data::DataSource;
use super::super::metrics::{MetricsWriter, Progress};
use super::super::model::ModelSource;
use super::super::monitor::Monitors;
use super::super::timers::{StepTimers, TimedGroup};
use super::super::TrainError;
use super::shared::{
    backward, caught, checkpoint_due, finish_run, mean_over_ranks, memory_of_all_ranks, nothing_to_train, resume_step,
    resume_tag, run_info, save_checkpoint, timed, token_tensor, Part, Resumed,
};
use super::{rank_start, LayersCut, RankStart, StepRecord, TrainArgs, TrainSummary};
use burn::module::AutodiffModule;
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ElementConversion;
use burn::tensor::{Int, Tensor};
use std::sync::Arc;
use std::time::Instant;
use zero_burn::sharded::{ShardBackend, UnitComm};
use zero_burn::{ChainModel, EngineSettings, HostStaged, TensorSplit, ZeroError};
use zero_core::comm::{ProcessGroup, SharedGroup};
use zero_core::config::ResolvedConfig;
use zero_core::parallel::RankGroups;
use zero_models::gpt2::{Gpt2Batch, ShardedGpt2};
use zero_models::tp::{ShardedTpGpt2, TpBackend};
use zero_models::Gpt2;

/// Where a rank of a run without a pipeline stands: its groups, and its index among the
/// data-parallel ranks (which share of each global batch it trains).
pub(super) struct RankPlace {
    /// The rank's index in the world: rank 0 alone prints, writes the metrics and draws.
    pub(super) world_rank: usize,
    /// Every rank: the memory reports.
    pub(super) world: SharedGroup,
    /// The ranks that hold the same weights and train other data: ZeRO runs over them, and the
    /// loss is their mean.
    pub(super) data: SharedGroup,
    /// The ranks that split each block with this one, with tensor parallelism.
    pub(super) tensor: Option<SharedGroup>,
}

impl RankPlace {
    /// Rank `rank` of `group`, every rank a data-parallel one.
    pub(super) fn data_only(rank: usize, group: SharedGroup) -> Self {
        RankPlace {
            world_rank: rank,
            world: group.clone(),
            data: group,
            tensor: None,
        }
    }

    /// A rank of a data × tensor layout.
    pub(super) fn of(groups: &RankGroups) -> Self {
        RankPlace {
            world_rank: groups.world.rank(),
            world: groups.world.clone(),
            data: groups.data.clone(),
            tensor: Some(groups.tensor.clone()),
        }
    }
}

/// Where a rank computes, and how its units' tensors travel between the data ranks.
pub(super) struct RankDevice<B: ShardBackend> {
    /// The rank's device.
    pub(super) device: B::Device,
    /// The data ranks' device collective (NCCL), or `None` for the host path over the data
    /// group.
    pub(super) units: Option<UnitComm<B::Collective>>,
}

/// How each parameter, by name, is split over the tensor ranks.
type SplitRule = Box<dyn Fn(&str) -> Option<TensorSplit> + Send + Sync>;

/// The models [`rank_loop`] trains: GPT-2 with its blocks `ZeroModule`s, whole on every rank
/// ([`ShardedGpt2`]) or each rank's tensor slice of them ([`ShardedTpGpt2`]).
pub(super) trait TrainedGpt2<B: AutodiffBackend>:
    AutodiffModule<B> + ChainModel<B, Batch = Gpt2Batch<B>, Ends = Self, Hidden = Tensor<B, 3>>
{
    /// Mean next-token cross-entropy.
    fn loss(&self, tokens: Tensor<B, 2, Int>, labels: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>, ZeroError>;

    /// The loss of `tokens` predicting themselves, on the model's copy without autodiff.
    fn held_out_loss(&self, tokens: Tensor<B::InnerBackend, 2, Int>) -> Result<f64, ZeroError>;

    /// How each parameter, by name, is split over the tensor ranks (`None`: held whole).
    fn tensor_splits(&self) -> SplitRule;
}

impl<B: AutodiffBackend + ShardBackend> TrainedGpt2<B> for ShardedGpt2<B>
where
    B::InnerBackend: ShardBackend,
{
    fn loss(&self, tokens: Tensor<B, 2, Int>, labels: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>, ZeroError> {
        ShardedGpt2::loss(self, tokens, labels)
    }

    fn held_out_loss(&self, tokens: Tensor<B::InnerBackend, 2, Int>) -> Result<f64, ZeroError> {
        Ok(self.valid().loss(tokens.clone(), tokens)?.into_scalar().elem::<f64>())
    }

    fn tensor_splits(&self) -> SplitRule {
        Box::new(|_| None)
    }
}

impl<B: AutodiffBackend + ShardBackend + TpBackend> TrainedGpt2<B> for ShardedTpGpt2<B>
where
    B::InnerBackend: ShardBackend + TpBackend,
{
    fn loss(&self, tokens: Tensor<B, 2, Int>, labels: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>, ZeroError> {
        ShardedTpGpt2::loss(self, tokens, labels)
    }

    fn held_out_loss(&self, tokens: Tensor<B::InnerBackend, 2, Int>) -> Result<f64, ZeroError> {
        Ok(self.valid().loss(tokens.clone(), tokens)?.into_scalar().elem::<f64>())
    }

    fn tensor_splits(&self) -> SplitRule {
        Box::new(ShardedTpGpt2::tensor_splits(self))
    }
}

/// One rank's training loop: the model `build` makes (every block a `ZeroModule`, cut over the
/// data-parallel ranks at stage 3) in Burn's own loop with `ZeroOptimizer`, over the data
/// ranks and, with tensor parallelism, the tensor ranks too. `build` takes the model when
/// `rank_start` built it whole, the rank's device, the engine settings and the collective the
/// units are cut over.
pub(super) fn rank_loop<B, M>(
    place: &RankPlace,
    RankDevice { device, units }: RankDevice<B>,
    args: &TrainArgs,
    resolved: &ResolvedConfig,
    data: &DataSource,
    source: &ModelSource,
    build: impl FnOnce(Option<Gpt2<B>>, &B::Device, &EngineSettings, UnitComm<B::Collective>) -> Result<M, TrainError>,
) -> Result<TrainSummary, TrainError>
where
    B: AutodiffBackend + ShardBackend,
    M: TrainedGpt2<B> + 'static,
    M::Block: AutodiffModule<B>,
{
    let world = place.world.world_size();
    let (rank, data_ranks) = (place.data.rank(), place.data.world_size());
    let RankStart {
        model,
        model_config,
        settings,
        micro,
        gas,
        global,
    } = rank_start::<B>(
        &device,
        args,
        resolved,
        source,
        if place.tensor.is_some() {
            LayersCut::Tensor
        } else {
            LayersCut::No
        },
    )?;
    let parameters = model_config.num_params() as usize;
    let lead = place.world_rank == 0;
    // wall_clock_breakdown: the collectives pass through a timing wrapper (rank 0 only prints,
    // so only rank 0 pays for it).
    let (engine_group, comm_clock) = if resolved.wall_clock_breakdown && lead {
        let (timed, clock) = TimedGroup::new(place.data.clone());
        (timed as SharedGroup, Some(clock))
    } else {
        (place.data.clone(), None)
    };
    // A device collective given is NCCL; otherwise the host path over the data group.
    let through_nccl = units.is_some();
    let units: UnitComm<B::Collective> = units.unwrap_or_else(|| Arc::new(HostStaged::new(engine_group.clone())));
    let model = build(model, &device, &settings, units.clone())?;
    // The config's `activation_checkpointing`: each micro-batch through `checkpointed_grads`,
    // the ranks waiting for each other at its boundaries when asked; with
    // `partition_activations`, each tensor rank keeps its part of every checkpoint (they hold
    // the same activations between blocks).
    let checkpointing = settings.activation_checkpointing.clone().map(|mut ac| {
        ac.boundary_group = Some(place.world.clone());
        if resolved.activation_checkpointing.partition_activations {
            ac.partition_group = place.tensor.clone();
        }
        ac
    });
    let (mut model, mut optim) = zero_burn::initialize_settings(settings, model, engine_group, units)?;
    if let Some(tensor) = &place.tensor {
        // The gradient norm (and so clipping) over the whole model; checkpoints per tensor rank.
        optim = optim.with_tensor_parallel(tensor.clone(), model.tensor_splits());
    }
    let schedule_len = resolved.scheduler.as_ref().and_then(|s| s.total_num_steps());
    let resumed = match args.load_target() {
        Some((dir, tag)) => {
            let tag = resume_tag(&dir, tag, place.tensor.as_ref().is_some_and(|t| t.world_size() > 1));
            let (loaded, client) = optim.load_checkpoint(&dir, tag.as_deref(), model)?;
            model = loaded;
            let step = resume_step(&dir, &client, optim.global_step(), schedule_len, lead)?;
            Some(Resumed { dir, tag, step, client })
        }
        None => None,
    };
    let first_step = resumed.as_ref().map_or(0, |r| r.step);
    if let Some(done) = nothing_to_train(args, first_step, lead, world, parameters) {
        return Ok(done);
    }
    if let (Some(resumed), true) = (&resumed, lead) {
        crate::gpt2::metrics::say(resumed.line(args, data));
    }

    // Data × tensor × pipeline ranks.
    let layout = [data_ranks, place.tensor.as_ref().map_or(1, |t| t.world_size()), 1];
    let mut progress = Progress::new(
        lead,
        !args.quiet,
        &args.backend,
        args.steps,
        parameters,
        layout,
        resolved.zero.stage as u8,
        through_nccl.then_some("NCCL"),
    );
    let mut metrics = match (&args.metrics, lead) {
        (Some(path), true) => Some(MetricsWriter::create(
            path,
            &run_info(args, resolved, parameters, layout),
            first_step,
        )?),
        _ => None,
    };
    let seq = data.seq_len();
    let validation = data.validation(global.max(data_ranks));
    let every = resolved.steps_per_print.max(1);
    let mut monitors = Monitors::open(&resolved.monitors, lead, global as u64)?;
    let mut timers = (resolved.wall_clock_breakdown && lead).then(|| StepTimers::new(comm_clock));
    let mut schedule = optim.lr_scheduler();
    let mut last_printed = first_step;
    let started = Instant::now();
    let mut records = Vec::new();
    for step in first_step..args.steps {
        let t0 = Instant::now();
        let batch = data.global_batch(step, global, args.seed())?;
        let mine = &batch[rank * micro * gas..(rank + 1) * micro * gas];
        let mut loss_sum = 0.0f64;
        let mut accumulator = GradientsAccumulator::new();
        for chunk in mine.chunks(micro) {
            let tokens = token_tensor(chunk, &device);
            if let Some(ac) = &checkpointing {
                // Forward and backward are one call (the blocks run again in backward): its
                // time is the backward's.
                let scale = (optim.scale_for_backward() / gas as f64) as f32;
                let batch = (tokens.clone(), tokens);
                let (value, grads) = timed(&mut timers, Part::Backward, || {
                    caught("checkpointed backward", || {
                        zero_burn::checkpointed_grads(&model, &batch, ac, scale)
                    })?
                    .map_err(TrainError::from)
                })?;
                optim.note_loss(value as f64);
                accumulator.accumulate(&model, grads);
                loss_sum += value as f64;
                continue;
            }
            let loss = timed(&mut timers, Part::Forward, || model.loss(tokens.clone(), tokens))?;
            loss_sum += timed(&mut timers, Part::Backward, || {
                let value = loss.clone().into_scalar().elem::<f64>();
                optim.note_loss(value);
                let scaled = optim.scale_loss(loss.div_scalar(gas as f64));
                let grads = backward(scaled)?;
                accumulator.accumulate(&model, GradientsParams::from_grads(grads, &model));
                Ok::<f64, TrainError>(value)
            })?;
        }
        let lr = schedule.step();
        model = timed(&mut timers, Part::Step, || {
            optim.try_step(lr, model, accumulator.grads())
        })?;
        if let Some(t) = timers.as_mut() {
            t.end_step();
        }
        let report = optim
            .last_step()
            .ok_or_else(|| TrainError::Config("the optimizer reported no step".into()))?;
        let loss = mean_over_ranks(place.data.as_ref(), loss_sum / gas as f64)?;
        let valid_loss = if !validation.is_empty() && ((step + 1) % every == 0 || step + 1 == args.steps) {
            Some(validate(&model, place.data.as_ref(), &validation, micro, &device)?)
        } else {
            None
        };
        let memory = memory_of_all_ranks(place.world.as_ref(), optim.memory())?;
        let record = StepRecord {
            step: step + 1,
            loss,
            lr: report.lr,
            loss_scale: report.loss_scale,
            grad_norm: report.grad_norm,
            tokens_per_s: (global * seq) as f64 / t0.elapsed().as_secs_f64(),
            skipped: report.skipped,
            valid_loss,
            memory,
        };
        progress.step(&record);
        if let Some(m) = metrics.as_mut() {
            m.write(&record)?;
        }
        monitors.step(&record)?;
        if let Some(t) = timers.as_mut() {
            if (step + 1) % every == 0 || step + 1 == args.steps {
                progress.println(&t.take().line(last_printed + 1, step + 1));
                last_printed = step + 1;
            }
        }
        records.push(record);
        if let Some((dir, client)) = checkpoint_due(args, step, schedule_len) {
            let said = save_checkpoint(args, dir, first_step, |options| {
                optim.save_checkpoint_with(dir, None, &client, options)
            })?;
            if let Some(line) = said {
                progress.println(&line);
            }
        }
    }
    finish_run(args, progress, metrics, records, started, world, parameters)
}

/// Held-out loss: each data-parallel rank (of `group`) scores its share of the validation
/// sequences, without autodiff, `micro` sequences at a time (the share is the rank's whole
/// batch, `gradient_accumulation_steps` micro-batches: at once it would need that many
/// micro-batches' logits).
fn validate<B: AutodiffBackend, M: TrainedGpt2<B>>(
    model: &M,
    group: &dyn ProcessGroup,
    validation: &[Vec<u32>],
    micro: usize,
    device: &burn::tensor::Device<B>,
) -> Result<f64, TrainError> {
    let rows = crate::gpt2::data::validation_share(validation, group.world_size(), group.rank());
    let mut sum = 0.0;
    for chunk in rows.chunks(micro.max(1)) {
        sum += model.held_out_loss(token_tensor::<B>(chunk, device).inner())? * chunk.len() as f64;
    }
    mean_over_ranks(group, sum / rows.len() as f64)
}
