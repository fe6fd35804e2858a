//! What the two rank loops share: the step's timers, backward and a caught panic, when to
//! save and where a resumed run starts, the end of a run, and the values agreed over the ranks.

use super::super::data::DataSource;
use super::super::metrics::{MetricsWriter, Progress};
use super::super::timers::StepTimers;
use super::super::TrainError;
use super::{StepRecord, TrainArgs, TrainSummary};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use std::path::{Path, PathBuf};
use std::time::Instant;
use zero_burn::MemoryReport;
use zero_core::comm::{FlatBuffer, ProcessGroup, ReduceOp};
use zero_core::config::{Precision, ResolvedConfig};
use zero_core::plot::RunInfo;

/// The parts of a step the timers of `wall_clock_breakdown` tell apart.
#[derive(Clone, Copy)]
pub(super) enum Part {
    Forward,
    Backward,
    Step,
}

/// `f()`, its time added to `part` of the step timers when there are timers.
pub(super) fn timed<T>(timers: &mut Option<StepTimers>, part: Part, f: impl FnOnce() -> T) -> T {
    match (timers.as_mut(), part) {
        (Some(t), Part::Forward) => t.forward(f),
        (Some(t), Part::Backward) => t.backward(f),
        (Some(t), Part::Step) => t.step(f),
        (None, _) => f(),
    }
}

/// The gradients of `loss`. A collective that fails inside backward (a unit's reduce-scatter
/// or gather: a dead or diverging peer) ends Burn's backward with its error as a panic: it
/// comes back here as the error it is.
pub(super) fn backward<B: AutodiffBackend>(loss: Tensor<B, 1>) -> Result<B::Gradients, TrainError> {
    caught("backward", || loss.backward())
}

/// `f()`, or the panic it ended with (a collective failing inside Burn's backward) as an error
/// naming `op`.
pub(super) fn caught<T>(op: &str, f: impl FnOnce() -> T) -> Result<T, TrainError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        TrainError::Engine(zero_burn::ZeroError::Comm(
            zero_core::comm::CommError::InvalidArgument {
                op: op.into(),
                message: crate::ranks::panic_message(&*payload).to_string(),
            },
        ))
    })
}

/// The tag `--load` resumes from: the one it names, else the one `latest` names (tensor rank
/// 0's, for a `tensor_parallel` run), resolved once so that what is loaded is what is said.
/// `None` where there is none: the load then says why.
pub(super) fn resume_tag(dir: &Path, tag: Option<String>, tensor_parallel: bool) -> Option<String> {
    use zero_core::checkpoint::{resolve_tag, tensor_rank_dir};
    let latest_in = if tensor_parallel {
        tensor_rank_dir(dir, 0)
    } else {
        dir.to_path_buf()
    };
    tag.or_else(|| resolve_tag(&latest_in, None).ok())
}

/// Where a resumed run starts: the checkpoint directory and tag it loaded, the step, and the
/// client state saved with it.
pub(super) struct Resumed {
    pub(super) dir: PathBuf,
    pub(super) tag: Option<String>,
    pub(super) step: u64,
    pub(super) client: serde_json::Value,
}

impl Resumed {
    /// The line a resumed run prints (rank 0): what it resumed from (tag, step, directory),
    /// what it trains, and where the data goes on.
    pub(super) fn line(&self, args: &TrainArgs, data: &DataSource) -> String {
        let from = match &self.tag {
            Some(tag) => format!("{tag} in {}", self.dir.display()),
            None => self.dir.display().to_string(),
        };
        let data = match data {
            DataSource::Fixed(_) => "every step trains on the whole token file".to_string(),
            DataSource::Text { .. } => {
                let saved = self.client.get("seed").and_then(serde_json::Value::as_u64);
                let differs = match saved {
                    Some(saved) if saved != args.seed() => {
                        format!(" (the saved run's was {saved}: the batches from here are not its)")
                    }
                    _ => String::new(),
                };
                format!(
                    "the data sampler goes on at step {}, seed {}{differs}",
                    self.step + 1,
                    args.seed()
                )
            }
        };
        format!(
            "resumed from {from} at step {}: training steps {} to {}; {data}",
            self.step,
            self.step + 1,
            args.steps
        )
    }
}

/// Saves a checkpoint into `dir` as `--discard-later-tags` and `--save-total-limit` ask, with
/// `save` (the engine's `save_checkpoint_with`); returns the line that says which tags of
/// another trajectory were removed, if any (rank 0 learns them). `since` is the step the run
/// resumed at.
pub(super) fn save_checkpoint(
    args: &TrainArgs,
    dir: &Path,
    since: u64,
    save: impl FnOnce(zero_burn::SaveOptions) -> Result<zero_burn::Saved, zero_burn::ZeroError>,
) -> Result<Option<String>, TrainError> {
    let saved = save(args.save_options())?;
    Ok((!saved.discarded.is_empty()).then(|| {
        format!(
            "removed {} from {}: saved after step {since} by the run that went on from the tag this one resumed \
             (--discard-later-tags)",
            zero_core::checkpoint::describe_tags(&saved.discarded),
            dir.display()
        )
    }))
}

/// The step to resume after, from a loaded checkpoint's client state; it must be the engine's
/// optimizer step (a checkpoint whose data position and optimizer disagree is refused).
///
/// A schedule whose length (`total_num_steps`, `schedule`) is not the saved run's goes on with
/// the new length, which the uninterrupted run would not have: rank 0 (`lead`) says so.
pub(super) fn resume_step(
    dir: &std::path::Path,
    client: &serde_json::Value,
    global_step: u64,
    schedule: Option<u64>,
    lead: bool,
) -> Result<u64, TrainError> {
    let step = client.get("step").and_then(|v| v.as_u64()).unwrap_or(global_step);
    if step != global_step {
        return Err(TrainError::Config(format!(
            "{}: the checkpoint's data position (step {step}) and optimizer step ({global_step}) disagree",
            dir.display(),
        )));
    }
    let saved = client.get("total_num_steps").and_then(|v| v.as_u64());
    if let (Some(saved), Some(now), true) = (saved, schedule, lead) {
        if saved != now {
            eprintln!(
                "warning: {}: the saved run's schedule was {saved} steps long (scheduler.params.total_num_steps, \
                 --steps when the config writes \"auto\"), this one is {now}: the learning rate from step {} on \
                 follows the new length, not the saved run's",
                dir.display(),
                step + 1
            );
        }
    }
    Ok(step)
}

/// When a resumed run's checkpoint is already at (or past) `--steps`, the total: says so (rank
/// 0) and gives the empty summary, instead of a silent exit.
pub(super) fn nothing_to_train(
    args: &TrainArgs,
    first_step: u64,
    lead: bool,
    world: usize,
    parameters: usize,
) -> Option<TrainSummary> {
    let (Some(dir), true) = (&args.load, first_step >= args.steps) else {
        return None;
    };
    if lead {
        super::super::metrics::say(format_args!(
            "nothing to train: the checkpoint in {} is at step {first_step}, --steps is {} (the total, not the \
             steps to add)",
            dir.display(),
            args.steps
        ));
    }
    Some(TrainSummary {
        steps: Vec::new(),
        seconds: 0.0,
        world_size: world,
        parameters,
    })
}

/// Where and with what client state to save after `step` (0-based), when `--save` (with
/// `--save-every`, or at the last step) asks for a checkpoint then.
/// The client state records the schedule's length (`schedule`), which a resumed run compares
/// with its own.
pub(super) fn checkpoint_due(
    args: &TrainArgs,
    step: u64,
    schedule: Option<u64>,
) -> Option<(&PathBuf, serde_json::Value)> {
    let dir = args.save.as_ref()?;
    let periodic = args.save_every.is_some_and(|k| k > 0 && (step + 1).is_multiple_of(k));
    (periodic || step + 1 == args.steps).then(|| {
        let mut client = serde_json::json!({ "step": step + 1, "seed": args.seed() });
        if let Some(total) = schedule {
            client["total_num_steps"] = total.into();
        }
        (dir, client)
    })
}

/// The end of a rank's run: the summary, the progress bar's last line, the metrics file closed
/// and the loss curve drawn beside it.
pub(super) fn finish_run(
    args: &TrainArgs,
    mut progress: Progress,
    metrics: Option<MetricsWriter>,
    records: Vec<StepRecord>,
    started: Instant,
    world: usize,
    parameters: usize,
) -> Result<TrainSummary, TrainError> {
    let summary = TrainSummary {
        steps: records,
        seconds: started.elapsed().as_secs_f64(),
        world_size: world,
        parameters,
    };
    progress.finish(&summary);
    if let (Some(m), Some(path)) = (metrics, &args.metrics) {
        m.finish()?;
        super::super::metrics::write_loss_curve(path)?;
    }
    Ok(summary)
}

/// Token ids `[rows, seq]` as an Int tensor.
pub(super) fn token_tensor<B: AutodiffBackend>(
    rows: &[Vec<u32>],
    device: &burn::tensor::Device<B>,
) -> Tensor<B, 2, Int> {
    let seq = rows.first().map(Vec::len).unwrap_or(0);
    let ids: Vec<i64> = rows.iter().flatten().map(|&t| t as i64).collect();
    Tensor::from_data(TensorData::new(ids, [rows.len(), seq]), device)
}

/// The mean of `value` over the ranks.
pub(super) fn mean_over_ranks(group: &dyn ProcessGroup, value: f64) -> Result<f64, TrainError> {
    let mut buf = FlatBuffer::F32(vec![value as f32]);
    group
        .all_reduce(&mut buf, ReduceOp::Avg)
        .map_err(|e| TrainError::Engine(e.into()))?;
    Ok(buf.into_f32()[0] as f64)
}

/// What the metrics file's header says about the run (the loss plot's title and legend), on
/// `layout`'s (data, tensor, pipeline) ranks.
pub(super) fn run_info(args: &TrainArgs, resolved: &ResolvedConfig, parameters: usize, layout: [usize; 3]) -> RunInfo {
    let [data, tensor, pipeline] = layout;
    let model = match (&args.model, &args.preset) {
        (Some(dir), _) => format!(
            "GPT-2 from {}",
            dir.file_name()
                .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned())
        ),
        (None, preset) => format!("GPT-2 {}", preset.as_deref().unwrap_or("tiny")),
    };
    let precision = match resolved.precision {
        Precision::Fp32 => "fp32",
        Precision::Fp16(_) => "fp16",
        Precision::Bf16(_) => "bf16",
    };
    RunInfo {
        model,
        parameters: parameters as u64,
        stage: resolved.zero.stage as u8,
        world_size: data * tensor * pipeline,
        precision: precision.into(),
        layout: zero_core::plot::layout_label(data, tensor, pipeline),
    }
}

/// Every rank's memory report, whole (bytes by kind and by location), on every rank.
pub(super) fn memory_of_all_ranks(
    group: &dyn ProcessGroup,
    mine: MemoryReport,
) -> Result<Vec<MemoryReport>, TrainError> {
    // A report of plain counts always serialises; one that arrives unreadable is a peer's fault.
    let unreadable = |rank: usize, e: serde_json::Error| {
        TrainError::Engine(zero_burn::ZeroError::Comm(
            zero_core::comm::CommError::InvalidArgument {
                op: "memory report".into(),
                message: format!("rank {rank}'s report arrived unreadable: {e}"),
            },
        ))
    };
    let record = serde_json::to_vec(&mine).map_err(|e| unreadable(group.rank(), e))?;
    zero_core::comm::all_gather_bytes(group, &record)
        .map_err(|e| TrainError::Engine(e.into()))?
        .iter()
        .enumerate()
        .map(|(rank, bytes)| serde_json::from_slice(bytes).map_err(|e| unreadable(rank, e)))
        .collect()
}
