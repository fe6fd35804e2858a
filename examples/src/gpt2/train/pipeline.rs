//! One rank of a pipelined run: its stage of the model's layers (each its tensor slice, with
//! tensor parallelism), trained by `PipelineEngine`.

use super::super::data::DataSource;
use super::super::metrics::{MetricsWriter, Progress};
use super::super::model::{same_weights_as_rank_0, ModelSource};
use super::super::TrainError;
use super::shared::{
    checkpoint_due, finish_run, memory_of_all_ranks, nothing_to_train, resume_step, resume_tag, run_info,
    save_checkpoint, token_tensor, Resumed,
};
use super::{rank_start, LayersCut, RankStart, StepRecord, TrainArgs, TrainSummary};
use burn::tensor::backend::AutodiffBackend;
use std::time::Instant;
use zero_burn::pipeline::{PartitionMethod, PipeLayer, PipelineEngine, PipelineModule};
use zero_core::config::ResolvedConfig;
use zero_core::parallel::{Axis, RankGroups};
use zero_core::plot::RunInfo;
use zero_models::gpt2::{Gpt2Batch, Gpt2Layer};
use zero_models::tp::{TpBackend, TpGpt2, TpGpt2Layer, TpGroup};

/// One rank of a pipelined run: its stage of the model's layers, trained on its data index's
/// share of each global batch.
pub(super) fn pipeline_rank_loop<B: AutodiffBackend + TpBackend>(
    groups: RankGroups,
    device: B::Device,
    args: &TrainArgs,
    resolved: &ResolvedConfig,
    data: &DataSource,
    source: &ModelSource,
) -> Result<TrainSummary, TrainError> {
    let RankStart {
        model,
        model_config,
        settings,
        micro,
        gas,
        global,
    } = rank_start::<B>(&device, args, resolved, source, LayersCut::Pipeline)?;
    let model = model.ok_or_else(|| TrainError::Model("a pipelined run builds its model whole".into()))?;
    let method = match resolved.pipeline.partition.as_str() {
        // DeepSpeed's default; the layers here are balanced by parameters.
        "best" => PartitionMethod::Parameters,
        name => PartitionMethod::from_name(name)?,
    };
    // Every stage cuts the same model: world rank 0's weights, so that a stage's layers do not
    // depend on how the ranks' threads shared the random generator.
    let model = same_weights_as_rank_0(model, groups.world.as_ref(), &device)?;
    let stages = groups.layout.size(Axis::Pipeline);
    let stage = groups.coords.pipeline;
    let layout = [Axis::Data, Axis::Tensor, Axis::Pipeline].map(|a| groups.layout.size(a));
    let run = PipelineRun {
        args,
        data,
        groups: &groups,
        micro,
        gas,
        global,
        zero_stage: resolved.zero.stage as u8,
        parameters: model_config.num_params() as usize,
        layout,
        run: run_info(args, resolved, model_config.num_params() as usize, layout),
        every: resolved.steps_per_print.max(1),
        schedule: resolved.scheduler.as_ref().and_then(|s| s.total_num_steps()),
    };
    if groups.layout.size(Axis::Tensor) > 1 {
        let tp = TpGpt2::from_full(&model, TpGroup::new(groups.tensor.clone()))
            .map_err(|e| TrainError::Model(format!("tensor_parallel.autotp_size: {e}")))?;
        let module = PipelineModule::from_layers::<B>(tp.into_pipeline_layers(), stages, method, stage)?;
        let mut settings = settings;
        // Tensor-parallel collectives run inside backward(): fence the stage's tensor ranks.
        settings.backward_fence = Some(groups.tensor.clone());
        run.steps(
            PipelineEngine::<B, TpGpt2Layer<B>>::new(settings, module, &groups)?,
            &device,
        )
    } else {
        let module = PipelineModule::from_layers::<B>(model.into_pipeline_layers(), stages, method, stage)?;
        run.steps(
            PipelineEngine::<B, Gpt2Layer<B>>::new(settings, module, &groups)?,
            &device,
        )
    }
}

/// What the steps of a pipelined run need besides the engine.
struct PipelineRun<'a> {
    args: &'a TrainArgs,
    data: &'a DataSource,
    groups: &'a RankGroups,
    micro: usize,
    gas: usize,
    global: usize,
    zero_stage: u8,
    parameters: usize,
    /// Data × tensor × pipeline ranks.
    layout: [usize; 3],
    /// The metrics file's header.
    run: RunInfo,
    /// steps_per_print: how often the validation loss is computed.
    every: u64,
    /// The schedule's length, recorded in checkpoints.
    schedule: Option<u64>,
}

impl PipelineRun<'_> {
    /// The training steps: each data index trains on its share of every global batch.
    fn steps<B: AutodiffBackend, L: PipeLayer<B, Batch = Gpt2Batch<B>>>(
        &self,
        mut engine: PipelineEngine<B, L>,
        device: &B::Device,
    ) -> Result<TrainSummary, TrainError> {
        let (args, data, groups) = (self.args, self.data, self.groups);
        let (micro, gas, global) = (self.micro, self.gas, self.global);
        let world = groups.layout.world_size();
        let lead = groups.world.rank() == 0;
        let resumed = match args.load_target() {
            Some((dir, tag)) => {
                let tag = resume_tag(&dir, tag, groups.layout.size(Axis::Tensor) > 1);
                let client = engine.load_checkpoint(&dir, tag.as_deref())?;
                let step = resume_step(&dir, &client, engine.global_step(), self.schedule, lead)?;
                Some(Resumed { dir, tag, step, client })
            }
            None => None,
        };
        let first_step = resumed.as_ref().map_or(0, |r| r.step);
        if let Some(done) = nothing_to_train(args, first_step, lead, world, self.parameters) {
            return Ok(done);
        }
        if let (Some(resumed), true) = (&resumed, lead) {
            crate::gpt2::metrics::say(resumed.line(args, data));
        }
        let mut progress = Progress::new(
            lead,
            !args.quiet,
            &args.backend,
            args.steps,
            self.parameters,
            self.layout,
            self.zero_stage,
            None,
        );
        let mut metrics = match (&args.metrics, lead) {
            (Some(path), true) => Some(MetricsWriter::create(path, &self.run, first_step)?),
            _ => None,
        };
        let d = groups.coords.data;
        // Validation as without a pipeline: each data index evaluates its share of the held-out
        // rows, forward only through the stages, in micro-batches of the training's size.
        let dp = groups.layout.size(Axis::Data);
        let validation = data.validation(global.max(dp));
        let valid_rows = crate::gpt2::data::validation_share(&validation, dp, d);
        let started = Instant::now();
        let mut records = Vec::new();
        for step in first_step..args.steps {
            let t0 = Instant::now();
            let batch = data.global_batch(step, global, args.seed())?;
            let mine = &batch[d * micro * gas..(d + 1) * micro * gas];
            let out = engine.train_batch(&micro_batches(mine, micro, device))?;
            let valid_loss = if !valid_rows.is_empty() && ((step + 1) % self.every == 0 || step + 1 == args.steps) {
                Some(held_out(&mut engine, valid_rows, micro, device)?)
            } else {
                None
            };
            let memory = memory_of_all_ranks(groups.world.as_ref(), engine.memory())?;
            let record = StepRecord {
                step: step + 1,
                loss: out.loss as f64,
                lr: out.report.lr,
                loss_scale: out.report.loss_scale,
                grad_norm: out.report.grad_norm,
                tokens_per_s: (global * data.seq_len()) as f64 / t0.elapsed().as_secs_f64(),
                skipped: out.report.skipped,
                valid_loss,
                memory,
            };
            progress.step(&record);
            if let Some(m) = metrics.as_mut() {
                m.write(&record)?;
            }
            records.push(record);
            if let Some((dir, client)) = checkpoint_due(args, step, self.schedule) {
                let said = save_checkpoint(args, dir, first_step, |options| {
                    engine.save_checkpoint_with(dir, None, &client, options)
                })?;
                if let Some(line) = said {
                    progress.println(&line);
                }
            }
        }
        finish_run(args, progress, metrics, records, started, world, self.parameters)
    }
}

/// The mean loss over `rows` of the held-out sequences, forward only through the stages:
/// the whole micro-batches of `micro` sequences in one pipelined pass, the remainder in another
/// (each pass's loss is the mean over its micro-batches, which are then all the same size).
fn held_out<B: AutodiffBackend, L: PipeLayer<B, Batch = Gpt2Batch<B>>>(
    engine: &mut PipelineEngine<B, L>,
    rows: &[Vec<u32>],
    micro: usize,
    device: &B::Device,
) -> Result<f64, TrainError> {
    let micro = micro.max(1);
    let whole = rows.len() / micro * micro;
    let mut sum = 0.0;
    for (part, size) in [(&rows[..whole], micro), (&rows[whole..], rows.len() - whole)] {
        if part.is_empty() {
            continue;
        }
        sum += engine.eval_batch(&micro_batches(part, size, device))? as f64 * part.len() as f64;
    }
    Ok(sum / rows.len() as f64)
}

/// `rows` as micro-batches of `size` sequences, each predicting itself.
fn micro_batches<B: AutodiffBackend>(rows: &[Vec<u32>], size: usize, device: &B::Device) -> Vec<Gpt2Batch<B>> {
    rows.chunks(size)
        .map(|chunk| {
            let tokens = token_tensor(chunk, device);
            (tokens.clone(), tokens)
        })
        .collect()
}
