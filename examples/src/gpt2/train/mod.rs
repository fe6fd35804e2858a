//! `gpt2 train`: GPT-2 trained with ZeRO from a DeepSpeed config.
//!
//! Every rank runs [`rank_loop`] (the zoo's `ShardedGpt2`, `zero_burn::initialize_settings`'s
//! `ZeroOptimizer`, Burn's own loop); rank 0 alone prints, writes the metrics file and draws.
//! With `tensor_parallel.autotp_size` above 1 the ranks are laid out data × tensor and
//! [`rank_loop`] trains each one's tensor slice of the blocks (`ShardedTpGpt2`, ZeRO over the
//! data ranks, any stage). With `pipeline.stages` above 1 they are laid out data × tensor ×
//! pipeline and run [`pipeline_rank_loop`] instead: each holds its tensor slice of one stage of
//! the model's layers.

mod checks;
mod collectives;
mod pipeline;
mod ranks;
mod shared;

use super::data::DataSource;
use super::model::{check_data, same_weights_as_rank_0, ModelSource};
use super::TrainError;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use collectives::DeviceUnits;
use pipeline::pipeline_rank_loop;
use ranks::{rank_loop, RankDevice, RankPlace};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use zero_burn::sharded::ShardBackend;
use zero_burn::{EngineSettings, InitOptions, MemoryReport, Stage};
use zero_core::comm::{DistEnv, TcpGroup};
use zero_core::config::{DeepSpeedConfig, ResolvedConfig};
use zero_core::parallel::{ParallelLayout, RankGroups};
use zero_models::tp::{TpBackend, TpGpt2, TpGroup};
use zero_models::{Gpt2, Gpt2Config};

/// The shipped corpus: ten plays of Shakespeare (see data/README.md).
const SHIPPED_CORPUS: &str = include_str!("../../../../data/shakespeare.txt");

/// Arguments of `gpt2 train`.
#[derive(clap::Args, Clone, Debug)]
pub struct TrainArgs {
    /// DeepSpeed JSON config (batch sizes, ZeRO stage, optimizer, scheduler, clipping).
    #[arg(long)]
    pub config: PathBuf,
    /// Start from a HuggingFace GPT-2 directory (config.json + model.safetensors).
    #[arg(long, conflicts_with = "preset")]
    pub model: Option<PathBuf>,
    /// Start from a randomly initialised preset: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl,
    /// gpt2-10b, or a shape such as gpt2-52x1024 (layers x hidden) (default tiny when --model is not given).
    #[arg(long)]
    pub preset: Option<String>,
    /// Train on this text file (GPT-2 BPE; the last 5 % is held out). Default: the shipped corpus.
    #[arg(long, conflicts_with = "tokens")]
    pub data: Option<PathBuf>,
    /// Train on this JSON array of equal-length token sequences: the whole array is the global
    /// batch of every step, split in order across ranks and micro-batches.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// Tokens per sequence when sampling from text (default 64). With --tokens the file's
    /// sequences are as long as they are: a --seq-len given must say the same.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Total optimizer steps.
    #[arg(long, default_value_t = 100)]
    pub steps: u64,
    /// Ranks to run as threads in this process (ignored under a launcher, where each process is
    /// one rank).
    #[arg(long, default_value_t = 2)]
    pub nproc: usize,
    /// Seed of the model's initialisation and of the data sampler (default: the config's
    /// `seed`, else 42).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Write a checkpoint into this directory at the end (and every --save-every steps).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Checkpoint every this many steps (with --save).
    #[arg(long)]
    pub save_every: Option<u64>,
    /// Keep only the newest N checkpoints in --save (its global_step tags), removing the older
    /// ones once each new one is written and verified; `latest` always names a kept one
    /// (HuggingFace Trainer's save_total_limit). Default: keep every checkpoint.
    #[arg(long, value_name = "N")]
    pub save_total_limit: Option<u64>,
    /// Resume from this checkpoint directory's latest tag, or from one tag given by its own
    /// directory (DIR/TAG); --steps stays the total.
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// Resuming from an older tag into the directory that holds the tags saved after it (by
    /// the run that went on from it), remove those tags once this run has saved its first
    /// checkpoint, instead of refusing to start (they would be replaced one by one, and the
    /// rest left beside this run's `latest`).
    #[arg(long)]
    pub discard_later_tags: bool,
    /// Write one JSON line per optimizer step here, and at the end the loss curve beside it
    /// (the same name ending in .png; `zero plot` draws it too).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Compute backend: cpu (Flex) or cuda (a build with the `cuda` feature). On CUDA, rank r
    /// (threads) or the process of LOCAL_RANK r (launcher) uses GPU r modulo the GPUs visible.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// How the data-parallel ranks' collectives run on CUDA: nccl (NCCL on the GPUs' own
    /// buffers; every rank needs a GPU of its own), host (through host memory, which ranks
    /// sharing a GPU need), or auto: nccl when there are several ranks and each has a GPU of its
    /// own, host otherwise. On the CPU backend, and with pipeline or tensor parallelism, host.
    #[arg(long, default_value = "auto")]
    pub collectives: String,
    /// No progress bar (the summary is still printed).
    #[arg(long)]
    pub quiet: bool,
    /// A value for a key the config leaves "auto" (DeepSpeed's convention for what the training
    /// script supplies), as `KEY=JSON` with a dotted key: `--set train_micro_batch_size_per_gpu=4
    /// --set optimizer.params.lr=3e-4`. Repeatable; a key the file does not leave "auto" is
    /// refused.
    #[arg(long = "set", value_name = "KEY=JSON")]
    pub set: Vec<String>,
}

impl TrainArgs {
    /// The checkpoint `--load` names: its directory and tag (`None`: the one `latest` names).
    /// A tag's own directory (holding the checkpoint's metadata) is its parent and its name.
    pub fn load_target(&self) -> Option<(PathBuf, Option<String>)> {
        let dir = self.load.as_ref()?;
        let tag = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        match (
            dir.join(zero_core::checkpoint::format::META_FILE).is_file(),
            dir.parent(),
            tag,
        ) {
            (true, Some(parent), Some(tag)) => {
                let parent = if parent.as_os_str().is_empty() {
                    std::path::Path::new(".")
                } else {
                    parent
                };
                Some((parent.to_path_buf(), Some(tag)))
            }
            _ => Some((dir.clone(), None)),
        }
    }

    /// The run's seed: `--seed`, or 42 (`train` fills in the config's `seed` when the flag is
    /// not given).
    pub fn seed(&self) -> u64 {
        self.seed.unwrap_or(42)
    }

    /// Tokens per sequence sampled from text: `--seq-len`, or 64.
    pub fn seq_len_or_default(&self) -> usize {
        self.seq_len.unwrap_or(64)
    }

    /// What a save does with the --save directory's other tags: `--discard-later-tags`,
    /// `--save-total-limit`.
    pub fn save_options(&self) -> zero_burn::SaveOptions {
        zero_burn::SaveOptions {
            discard_later_tags: self.discard_later_tags,
            keep_last: self
                .save_total_limit
                .and_then(|n| std::num::NonZeroUsize::new(usize::try_from(n).unwrap_or(usize::MAX))),
        }
    }
}

/// One optimizer step, as the metrics file records it.
#[derive(Clone, Debug, Serialize)]
pub struct StepRecord {
    /// 1-based optimizer step.
    pub step: u64,
    /// Mean training loss over the global batch.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Loss scale (1 without fp16).
    pub loss_scale: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens of the global batch per second of this step.
    pub tokens_per_s: f64,
    /// Whether the step was skipped (fp16 overflow).
    pub skipped: bool,
    /// Held-out loss, on the steps where it is measured.
    pub valid_loss: Option<f64>,
    /// Bytes per rank, by kind.
    pub memory: Vec<MemoryReport>,
}

/// What a run did.
#[derive(Clone, Debug, Serialize)]
pub struct TrainSummary {
    /// Every step.
    pub steps: Vec<StepRecord>,
    /// Seconds from the first to the last step.
    pub seconds: f64,
    /// Ranks.
    pub world_size: usize,
    /// Model parameters.
    pub parameters: usize,
}

/// Runs the training on the backend `--backend` names; returns the summary of the first rank
/// this process hosts.
pub fn train(args: &TrainArgs) -> Result<TrainSummary, TrainError> {
    collectives::check(args)?;
    // A launch whose variables are unusable is refused, not run as ranks of threads alone. Read
    // once: every later question about the launch is asked of `launch`.
    let launch = DistEnv::launched().map_err(|e| TrainError::Config(format!("the launcher's environment: {e} (a launched rank needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or its launcher's own set; without a launcher, unset them: --nproc runs the ranks as threads)")))?;
    match args.backend.as_str() {
        "cpu" => {
            if args.collectives == "nccl" {
                return Err(TrainError::Config(
                    "--collectives nccl: NCCL needs --backend cuda; the CPU backend's collectives are host ones".into(),
                ));
            }
            train_on::<Autodiff<Flex, BalancedCheckpointing>, Autodiff<Flex>>(args, launch.as_ref(), 1, None)
        }
        #[cfg(feature = "cuda")]
        "cuda" => {
            let gpus = zero_burn::device::cuda_devices()
                .map_err(|why| TrainError::Config(format!("--backend cuda: {why}")))?;
            let nccl = collectives::nccl_wanted(args, launch.as_ref(), gpus)?.then_some(collectives::nccl_units as _);
            train_on::<Autodiff<burn::backend::Cuda, BalancedCheckpointing>, Autodiff<burn::backend::Cuda>>(
                args,
                launch.as_ref(),
                gpus,
                nccl,
            )
        }
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err(TrainError::Config(
            "--backend cuda: this build has no CUDA backend; build with `--features cuda`".into(),
        )),
        other => Err(TrainError::Config(format!("--backend {other}: expected cpu or cuda"))),
    }
}

/// Runs the training on backend `B`, whose ranks share `devices` devices: this process's one
/// rank under a launcher (`launch`), or `--nproc` rank threads. Every argument is
/// checked against the config, the model's shape and the data before any rank starts.
/// Data-parallel ranks train on `B` (stage 3 gathers a unit again in backward under its
/// checkpointing strategy), pipelined ones on `P`. With `nccl`, the data-parallel ranks'
/// collectives are the device ones it makes; otherwise they go through host memory.
fn train_on<B, P>(
    args: &TrainArgs,
    launch: Option<&DistEnv>,
    devices: usize,
    nccl: Option<DeviceUnits<B>>,
) -> Result<TrainSummary, TrainError>
where
    B: AutodiffBackend + ShardBackend + TpBackend,
    B::InnerBackend: ShardBackend + TpBackend,
    P: AutodiffBackend + TpBackend,
{
    checks::counts(args, launch.is_some())?;
    checks::metrics_spare_inputs(args)?;
    let parsed = DeepSpeedConfig::from_file(&args.config).map_err(|e| TrainError::Config(e.to_string()))?;
    for w in &parsed.warnings {
        eprintln!("warning: {}: {w}", args.config.display());
    }
    let config = parsed.config;
    let source = match (&args.model, &args.preset) {
        (Some(dir), _) => ModelSource::Pretrained(dir.clone()),
        (None, Some(name)) => ModelSource::Preset(name.clone()),
        (None, None) => ModelSource::Preset("tiny".into()),
    };
    let model_config = source.config()?;
    let n_positions = model_config.n_positions;
    let data = match (&args.tokens, &args.data) {
        (Some(path), _) => {
            let data = DataSource::from_tokens_file(path)?;
            if let Some(n) = args.seq_len.filter(|&n| n != data.seq_len()) {
                return Err(TrainError::Config(format!(
                    "--seq-len {n}: the sequences of --tokens {} are {} tokens long; leave --seq-len out",
                    path.display(),
                    data.seq_len()
                )));
            }
            data
        }
        (None, Some(path)) => {
            let text = zero_core::files::read_to_string(path, zero_core::files::data_limit(path))
                .map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))?;
            DataSource::from_text(
                &text,
                &path.display().to_string(),
                args.seq_len_or_default(),
                n_positions,
            )?
        }
        (None, None) => DataSource::from_text(
            SHIPPED_CORPUS,
            "the shipped corpus",
            args.seq_len_or_default(),
            n_positions,
        )?,
    };
    let what = match (&args.tokens, &args.data) {
        (Some(path), _) => format!("--tokens {}", path.display()),
        (None, Some(path)) => format!("--data {}", path.display()),
        (None, None) => "the shipped corpus".to_string(),
    };
    check_data(&data, &what, &model_config)?;
    if let Some(dir) = &args.save {
        checks::writable("--save", dir)?;
    }
    // The world: the launcher's, or the rank threads'; resolved once for every rank, so that a
    // batch size the ranks cannot share is refused before any starts.
    let world = launch.map_or(args.nproc, |env| env.world_size);
    let in_config = |e: String| TrainError::Config(format!("{}: {e}", args.config.display()));
    let (stages, tensor) = config.model_parallel_degrees().map_err(in_config)?;
    config.data_parallel_size(world).map_err(in_config)?;
    if let Some(dir) = &args.save {
        zero_core::checkpoint::check_same_kind(dir, tensor > 1)
            .map_err(|e| TrainError::Config(format!("--save: {e}")))?;
        checks::save_spares_other_runs(args, tensor)?;
    }
    let mut overrides = zero_core::config::Overrides::from_assignments(&args.set).map_err(TrainError::Config)?;
    // The ranks' layout was read from the file above, before any --set: check_overrides
    // refuses a value for it.
    config
        .check_overrides(&overrides)
        .map_err(|e| TrainError::Config(format!("--set: {e}")))?;
    // What the trainer itself knows, as a training script fills "auto": the schedule's length.
    const TOTAL_STEPS: &str = "scheduler.params.total_num_steps";
    if config.auto_keys().iter().any(|d| d.key == TOTAL_STEPS) && overrides.get(TOTAL_STEPS).is_none() {
        overrides.set(TOTAL_STEPS, args.steps);
    }
    let options = InitOptions {
        hidden_size: Some(model_config.n_embd),
        overrides,
        ..Default::default()
    };
    let resolved = Arc::new(zero_burn::resolve(&config, world / (stages * tensor), &options)?);
    // A fixed batch is every step's global batch: its size is the config's, said before any
    // rank starts, naming the file.
    if let DataSource::Fixed(batch) = &data {
        if batch.len() as u64 != resolved.train_batch_size {
            return Err(TrainError::Data(format!(
                "{what}: {} sequences, but each step's global batch is {} (train_batch_size in {}); every step \
                 trains on the whole file: give a file of {} sequences or change the batch sizes",
                batch.len(),
                resolved.train_batch_size,
                args.config.display(),
                resolved.train_batch_size
            )));
        }
    }
    // What initialize would refuse, said once, before any rank starts.
    let refused = resolved.unsupported();
    if !refused.is_empty() {
        let each: Vec<String> = refused.iter().map(|u| format!("\n  {u}")).collect();
        return Err(TrainError::Config(format!(
            "{}: initialize refuses:{}",
            args.config.display(),
            each.concat()
        )));
    }
    if resolved.optimizer.is_none() {
        return Err(TrainError::Config(format!(
            "{}: the config names no optimizer, and gpt2 train brings none of its own; add a section, e.g. \
             \"optimizer\": {{\"type\": \"AdamW\", \"params\": {{\"lr\": 3e-4}}}}",
            args.config.display()
        )));
    }
    // The config's `seed` when the command line gives none.
    let seeded = TrainArgs {
        seed: args.seed.or(resolved.seed),
        ..args.clone()
    };
    let args = &seeded;
    // Rank 0 writes the monitors' logs: a launched rank 0, or this process of rank threads.
    let lead = launch.is_none_or(|env| env.rank == 0);
    checks::output_paths_writable(&resolved, lead)?;
    if args.backend == "cpu" {
        // Ranks as threads share this machine's memory; launched processes each count once.
        let local = if launch.is_some() { 1 } else { args.nproc };
        checks::model_states_fit(
            &model_config,
            &resolved,
            world / (stages * tensor),
            stages * tensor,
            local,
        )?;
        checks::activations_fit(&model_config, resolved.micro_batch_size, data.seq_len(), local)?;
    }
    let data = Arc::new(data);
    if (stages > 1 || tensor > 1) && nccl.is_some() && args.collectives == "nccl" {
        return Err(TrainError::Config(format!(
            "--collectives nccl with pipeline.stages {stages} × tensor_parallel.autotp_size {tensor}: NCCL runs \
             the collectives of data-parallel runs only; leave --collectives out (auto) or give host"
        )));
    }
    if stages > 1 {
        let layout = ParallelLayout::with_pipeline(world / (stages * tensor), tensor, stages)
            .map_err(|e| TrainError::Config(e.to_string()))?;
        return run_layout::<P>(layout, launch, devices, |groups, device| {
            pipeline_rank_loop::<P>(groups, device, args, &resolved, &data, &source)
        });
    }
    if tensor > 1 {
        // Megatron's split of every block over the tensor ranks, ZeRO over the data ranks.
        let layout =
            ParallelLayout::with_pipeline(world / tensor, tensor, 1).map_err(|e| TrainError::Config(e.to_string()))?;
        return run_layout::<B>(layout, launch, devices, |groups, device| {
            let place = RankPlace::of(&groups);
            rank_loop::<B, _>(
                &place,
                RankDevice { device, units: None },
                args,
                &resolved,
                &data,
                &source,
                |model, device, _, _| {
                    let model = model
                        .ok_or_else(|| TrainError::Model("a tensor-parallel run builds its model whole".into()))?;
                    let model = same_weights_as_rank_0(model, place.world.as_ref(), device)?;
                    let split = TpGpt2::from_full(&model, TpGroup::new(groups.tensor.clone()))
                        .map_err(|e| TrainError::Model(format!("tensor_parallel.autotp_size: {e}")))?;
                    Ok(split.into_sharded())
                },
            )
        });
    }
    let args = Arc::new(args.clone());
    let threads = launch.is_none();
    let local_rank = launch.map(|env| env.local_rank);
    let results = crate::ranks::run_ranks_with(launch, args.nproc, nccl.is_some(), move |rank, group, ctrl| {
        let place = RankPlace::data_only(rank, group);
        let device = rank_device::<B>(local_rank.unwrap_or(rank), devices);
        let units = match (nccl, ctrl) {
            (Some(make), Some(ctrl)) => Some(make(ctrl, &device, threads)?),
            _ => None,
        };
        rank_loop::<B, _>(
            &place,
            RankDevice { device, units },
            &args,
            &resolved,
            &data,
            &source,
            |model, device, settings, units| match model {
                Some(model) => Ok(model.into_sharded()),
                None => Ok(source.build_sharded_seeded::<B>(
                    device,
                    args.seed(),
                    units,
                    settings.param_persistence_threshold,
                )?),
            },
        )
    })
    .map_err(|e| TrainError::Engine(e.into()))?;
    // Every rank's summary holds the same step records (losses are averaged over the ranks);
    // return the first this process hosts: rank 0's with threads, the process's own rank under
    // a launcher.
    first_summary(results)
}

/// The device of the rank of index `local` on this node (LOCAL_RANK under a launcher, the rank
/// itself when ranks are threads): the one of that index modulo `devices`.
fn rank_device<B: AutodiffBackend>(local: usize, devices: usize) -> B::Device {
    use burn::tensor::backend::{Device, DeviceId};
    let type_id = B::Device::default().to_id().type_id;
    B::Device::from_id(DeviceId::new(type_id, (local % devices.max(1)) as u16))
}

/// Every rank's summary holds the same step records (losses are averaged over the ranks): the
/// first this process hosts, after checking that no rank failed.
///
/// When ranks failed, the error returned is the first that is not only a consequence of
/// another's (a peer gone, a wait timed out, a group shut down): the rank that failed first
/// says why, where the others only say that it left.
fn first_summary(results: Vec<Result<TrainSummary, TrainError>>) -> Result<TrainSummary, TrainError> {
    let (oks, errors): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
    let mut errors: Vec<TrainError> = errors.into_iter().filter_map(Result::err).collect();
    if let Some(cause) = errors.iter().position(|e| !peer_consequence(e)) {
        return Err(errors.swap_remove(cause));
    }
    if let Some(e) = errors.into_iter().next() {
        return Err(e);
    }
    oks.into_iter()
        .find_map(Result::ok)
        .ok_or_else(|| TrainError::Config("this process hosts no rank".into()))
}

/// Whether `e` only reports that another rank left or stopped answering.
fn peer_consequence(e: &TrainError) -> bool {
    use zero_core::comm::CommError;
    matches!(
        e,
        TrainError::Engine(zero_burn::ZeroError::Comm(
            CommError::PeerLost { .. } | CommError::Timeout { .. } | CommError::Shutdown { .. }
        ))
    )
}

/// What a rank starts from: its model (seeded; `None` where it is read partitioned),
/// the engine settings, and the micro-batch size, accumulation steps and global batch.
struct RankStart<B: AutodiffBackend> {
    model: Option<Gpt2<B>>,
    model_config: Gpt2Config,
    settings: EngineSettings,
    micro: usize,
    gas: usize,
    global: usize,
}

/// How a run cuts the model's layers over its ranks, beside ZeRO's partitioning.
#[derive(Clone, Copy, PartialEq)]
enum LayersCut {
    /// Every rank runs every layer.
    No,
    /// Each block split over the tensor ranks.
    Tensor,
    /// Pipeline stages (each split over the tensor ranks, with tensor parallelism).
    Pipeline,
}

/// Builds the model on `device` and the engine settings of the config resolved for the
/// data-parallel ranks. A model whose layers are cut is built whole on every rank, to be cut;
/// the checkpoints of a pipeline keep its layers' names, the others name the HuggingFace model
/// they export to.
fn rank_start<B: AutodiffBackend>(
    device: &B::Device,
    args: &TrainArgs,
    resolved: &ResolvedConfig,
    source: &ModelSource,
    cut: LayersCut,
) -> Result<RankStart<B>, TrainError> {
    let mut settings = zero_burn::engine_settings(resolved)?;
    // Stage 3: every rank reads (or draws) the model unit by unit and keeps its shard of each,
    // so no rank ever holds the model whole (DeepSpeed's zero.Init).
    let partitioned = settings.stage == Stage::Zero3 && cut == LayersCut::No;
    let (model, model_config) = if partitioned {
        (None, source.config()?)
    } else {
        let (model, config) = source.build_seeded::<B>(device, args.seed())?;
        (Some(model), config)
    };
    // Checkpoints say which model they hold, so `zero to-fp32` writes a HuggingFace directory
    // (merging the tensor ranks' slices; a pipeline's layers carry the single model's names).
    settings.model = Some(
        model_config
            .model_record()
            .map_err(|e| TrainError::Config(e.to_string()))?,
    );
    Ok(RankStart {
        micro: resolved.micro_batch_size as usize,
        gas: resolved.gradient_accumulation_steps as usize,
        global: resolved.train_batch_size as usize,
        model,
        model_config,
        settings,
    })
}

/// Runs `body` on the ranks of `layout` this process hosts, each with its groups and device:
/// this process's one rank under a launcher, every rank as a thread otherwise.
fn run_layout<B: AutodiffBackend>(
    layout: ParallelLayout,
    launch: Option<&DistEnv>,
    devices: usize,
    body: impl Fn(RankGroups, B::Device) -> Result<TrainSummary, TrainError> + Sync,
) -> Result<TrainSummary, TrainError> {
    if let Some(env) = launch {
        let world_group = TcpGroup::from_env(None).map_err(|e| TrainError::Engine(e.into()))?;
        let groups = layout.tcp(world_group).map_err(|e| TrainError::Config(e.to_string()))?;
        let device = rank_device::<B>(env.local_rank, devices);
        return body(groups, device);
    }
    let ranks = layout.threads().map_err(|e| TrainError::Config(e.to_string()))?;
    let body = &body;
    let results: Vec<Result<TrainSummary, TrainError>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|groups| {
                let device = rank_device::<B>(groups.world.rank(), devices);
                s.spawn(move || body(groups, device))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|payload| {
                    Err(TrainError::Config(format!(
                        "rank {rank} panicked: {}",
                        crate::ranks::panic_message(&*payload)
                    )))
                })
            })
            .collect()
    });
    first_summary(results)
}
