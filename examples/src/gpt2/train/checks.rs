//! What `gpt2 train` refuses before any rank starts: counts that mean nothing, directories it
//! could not write at the end (or at the first step), a micro-batch the machine's memory cannot
//! hold. A run must not learn of these only when its work is done.

use super::{TrainArgs, TrainError};
use crate::gpt2::host_memory_bytes;
use std::path::Path;
use zero_core::config::{OffloadDevice, ResolvedConfig};
use zero_models::Gpt2Config;

/// Refuses an NVMe offload directory (`device: nvme`) this process cannot write, naming its
/// key: the swap files are written at the first step. So too an enabled monitor's log
/// directory (`output_path/job_name`), where rank 0 (`lead`) writes it.
pub(super) fn output_paths_writable(resolved: &ResolvedConfig, lead: bool) -> Result<(), TrainError> {
    let monitors = &resolved.monitors;
    for (name, monitor) in [
        ("tensorboard", &monitors.tensorboard),
        ("csv_monitor", &monitors.csv_monitor),
    ] {
        if lead && monitor.enabled {
            writable(
                &format!("{name}.output_path/job_name"),
                &crate::gpt2::monitor::log_dir(monitor),
            )?;
        }
    }
    let zero = &resolved.zero;
    let nvme = [
        (
            "zero_optimization.offload_optimizer.nvme_path",
            (zero.offload_optimizer.as_ref())
                .filter(|o| o.device == OffloadDevice::Nvme)
                .and_then(|o| o.nvme_path.as_ref()),
        ),
        (
            "zero_optimization.offload_param.nvme_path",
            (zero.offload_param.as_ref())
                .filter(|o| o.device == OffloadDevice::Nvme)
                .and_then(|o| o.nvme_path.as_ref()),
        ),
    ];
    for (key, path) in nvme {
        if let Some(path) = path {
            writable(key, Path::new(path))?;
        }
    }
    Ok(())
}

/// Refuses, before any rank starts, a micro-batch whose activations cannot fit this machine's
/// memory (rather than be killed by the kernel in the first step). The bound is a floor: one
/// micro-batch holds at least its logits (micro × seq × vocab values) and each block's input
/// (micro × seq × n_embd), at 2 bytes a value; what Burn's autodiff keeps is several times more
/// (BENCHMARKS.md, "Activation checkpointing").
pub(super) fn activations_fit(model: &Gpt2Config, micro: u64, seq: usize, ranks: usize) -> Result<(), TrainError> {
    let Some(total) = host_memory_bytes() else {
        return Ok(());
    };
    let values_per_token = model.vocab_size as u128 + (model.n_layer as u128) * (model.n_embd as u128);
    let floor = micro as u128 * seq as u128 * values_per_token * 2 * ranks as u128;
    if floor <= total as u128 {
        return Ok(());
    }
    Err(TrainError::Config(format!(
        "train_micro_batch_size_per_gpu {micro} × --seq-len {seq} on {ranks} rank(s): the activations need at \
         least {:.1} GB (the logits alone {:.1} GB), more than this machine's {:.1} GB of memory; lower the \
         micro-batch and raise gradient_accumulation_steps",
        floor as f64 / 1e9,
        (micro as u128 * seq as u128 * model.vocab_size as u128 * 2 * ranks as u128) as f64 / 1e9,
        total as f64 / 1e9
    )))
}

/// Refuses, before any rank starts, a model whose states cannot fit this machine's memory on
/// the CPU backend (rather than abort in an allocation): `zero estimate`'s bytes for the run's
/// stage, precision and offload, per rank times the `ranks` of this process, plus what
/// `offload_optimizer: cpu` puts beside them (NVMe offload counts nothing here). `data` is the
/// data-parallel size ZeRO partitions over, `split` the pieces tensor and pipeline parallelism
/// cut the model into (each rank holds one).
pub(super) fn model_states_fit(
    model: &Gpt2Config,
    resolved: &ResolvedConfig,
    data: usize,
    split: usize,
    ranks: usize,
) -> Result<(), TrainError> {
    use zero_core::config::Precision;
    use zero_core::estimate::{estimate, Dtype, EstimateInput, OffloadTarget};
    let Some(total) = host_memory_bytes() else {
        return Ok(());
    };
    let dtype = match resolved.precision {
        Precision::Fp32 => Dtype::Fp32,
        Precision::Fp16(_) => Dtype::Fp16,
        Precision::Bf16(_) => Dtype::Bf16,
    };
    let target = |d: OffloadDevice| match d {
        OffloadDevice::Cpu => OffloadTarget::Cpu,
        OffloadDevice::Nvme => OffloadTarget::Nvme,
    };
    let mut input = EstimateInput::new(
        model.num_params() / split.max(1) as u64,
        resolved.zero.stage.number(),
        data.max(1) as u64,
        dtype,
    );
    input.offload_optimizer = resolved.zero.offload_optimizer.as_ref().map(|o| target(o.device));
    input.offload_param = resolved.zero.offload_param.as_ref().map(|o| target(o.device));
    let Ok(e) = estimate(&input) else {
        // Beyond what 64 bits count: far beyond any machine.
        return Err(TrainError::Config(format!(
            "the model's {} parameters: their states are beyond counting in bytes, let alone this machine's \
             {:.1} GB of memory",
            model.num_params(),
            total as f64 / 1e9
        )));
    };
    // Per host: every device's offloaded share; this process hosts `ranks` of the `data` devices.
    let host = e.per_host.total() as u128 * ranks as u128 / data.max(1) as u128;
    let need = e.per_device.total() as u128 * ranks as u128 + host;
    if need <= total as u128 {
        return Ok(());
    }
    Err(TrainError::Config(format!(
        "the model's {:.2}B parameters at ZeRO stage {} over {data} data-parallel rank(s): the {ranks} rank(s) of \
         this process hold {:.1} GB of model states ({:.1} GB each{}), more than this machine's {:.1} GB of memory; \
         `zero estimate` shows the terms: {}more ranks, or offload to NVMe lowers them",
        model.num_params() as f64 / 1e9,
        resolved.zero.stage.number(),
        need as f64 / 1e9,
        e.per_device.total() as f64 / 1e9,
        if host > 0 {
            format!(", and {:.1} GB offloaded beside them", host as f64 / 1e9)
        } else {
            String::new()
        },
        total as f64 / 1e9,
        if resolved.zero.stage.number() < 3 {
            "a higher stage, "
        } else {
            ""
        }
    )))
}

/// The most ranks `--nproc` starts as threads of this process.
const MAX_THREAD_RANKS: usize = 1024;

/// Refuses counts that cannot mean anything, before any work; each error names the flag and
/// what it takes. (`--seq-len` is checked against the model and the text when the text is
/// read.)
pub(super) fn counts(args: &TrainArgs, launched: bool) -> Result<(), TrainError> {
    if args.steps == 0 {
        return Err(TrainError::Config(
            "--steps 0: nothing to train; --steps is the total number of optimizer steps, at least 1".into(),
        ));
    }
    if args.nproc == 0 {
        return Err(TrainError::Config("--nproc 0: at least 1 rank is needed".into()));
    }
    if args.nproc > MAX_THREAD_RANKS && !launched {
        return Err(TrainError::Config(format!(
            "--nproc {}: at most {MAX_THREAD_RANKS} ranks run as threads of one process (each builds its \
             model); start more with zero launch, one process per rank",
            args.nproc
        )));
    }
    match (args.save_total_limit, &args.save) {
        (Some(0), _) => {
            return Err(TrainError::Config(
                "--save-total-limit 0: expected at least 1 checkpoint to keep (the newest is always kept; leave it \
                 out to keep every one)"
                    .into(),
            ))
        }
        (Some(n), None) => {
            return Err(TrainError::Config(format!(
                "--save-total-limit {n} without --save: give the directory to save into"
            )))
        }
        _ => {}
    }
    if args.discard_later_tags && args.save.is_none() {
        return Err(TrainError::Config(
            "--discard-later-tags without --save: it removes the tags of a --save directory that a run resumed \
             from an older tag would replace; give the directory to save into"
                .into(),
        ));
    }
    match (args.save_every, &args.save) {
        (Some(0), _) => Err(TrainError::Config(
            "--save-every 0: expected at least 1 step (leave it out to save only at the end)".into(),
        )),
        (Some(k), None) => Err(TrainError::Config(format!(
            "--save-every {k} without --save: give the directory to save into"
        ))),
        _ => Ok(()),
    }
}

/// Refuses a `--metrics` file that the run would lose something by writing: one of its inputs
/// (the config, the token file or the text, by any name or link), a file there that is not a
/// metrics file (model weights, a checkpoint's `latest`), or a `.png` path, which the loss
/// curve drawn beside it (`METRICS.png`) would replace.
pub(super) fn metrics_spare_inputs(args: &TrainArgs) -> Result<(), TrainError> {
    let Some(metrics) = args.metrics.as_deref() else {
        return Ok(());
    };
    let refuse = |why: String| TrainError::Config(format!("--metrics {}: {why}", metrics.display()));
    if metrics.extension().is_some_and(|e| e.eq_ignore_ascii_case("png")) {
        return Err(refuse(
            "the loss curve is drawn beside the metrics as the same name ending in .png, which would replace \
             them: give a path ending in .jsonl"
                .into(),
        ));
    }
    let inputs = [
        ("--config", Some(args.config.as_path())),
        ("--tokens", args.tokens.as_deref()),
        ("--data", args.data.as_deref()),
    ];
    for (flag, path) in inputs {
        if let Some(path) = path.filter(|p| zero_core::files::same_file(p, metrics)) {
            return Err(refuse(format!(
                "the file {flag} reads ({}); the metrics would overwrite it: give another path",
                path.display()
            )));
        }
    }
    // A file there is replaced only if it is a metrics file (or empty); a terminal or a pipe
    // is written to, not replaced.
    let Ok(meta) = std::fs::metadata(metrics) else {
        return Ok(());
    };
    if meta.is_dir() {
        return Err(refuse("a directory: give a file's path".into()));
    }
    if meta.is_file() && !zero_core::plot::is_metrics_file(metrics) {
        return Err(refuse(
            "is there and is not a metrics file (its first line is neither a run's header nor a step); the run \
             would overwrite it: give another path, or remove the file"
                .into(),
        ));
    }
    Ok(())
}

/// Refuses a `--save` directory that holds another run's checkpoint: a run that does not resume
/// from it (`--load` names another directory, or none) would replace its tags and move its
/// `latest`, losing what it points to. Resuming in place (`--load` the same directory) is what
/// saving there means; but resumed from an older tag than its newest, the run would replace
/// the tags saved after that one (by the run that went on from it) and leave the rest beside
/// its own `latest`: refused too, unless `--discard-later-tags` (the saves then remove them,
/// as they also refuse to, with `tensor` ranks under `tensor_rank_0`).
pub(super) fn save_spares_other_runs(args: &TrainArgs, tensor: usize) -> Result<(), TrainError> {
    let Some(save) = args.save.as_deref() else {
        return Ok(());
    };
    let holds = zero_core::checkpoint::holds_checkpoint(save);
    let load = args.load_target();
    let resumed_here = load.as_ref().is_some_and(|(dir, _)| same_dir(dir, save));
    if holds && !resumed_here {
        return Err(TrainError::Config(format!(
            "--save {}: holds another run's checkpoint, whose tags and `latest` this run would replace: resume it \
             with --load {}, or save into another directory",
            save.display(),
            save.display()
        )));
    }
    let (Some((dir, tag)), true, false) = (load, resumed_here, args.discard_later_tags) else {
        return Ok(());
    };
    // What the run resumes from; one that does not open is said by the load itself.
    let tags_dir = |d: &Path| match tensor {
        1 => d.to_path_buf(),
        _ => zero_core::checkpoint::tensor_rank_dir(d, 0),
    };
    let Ok(loaded) = zero_core::checkpoint::Checkpoint::open(&tags_dir(&dir), tag.as_deref()) else {
        return Ok(());
    };
    let later = zero_core::checkpoint::tags_after(&tags_dir(save), loaded.meta.global_step);
    if later.is_empty() {
        return Ok(());
    }
    Err(TrainError::Config(format!(
        "--save {}: holds {}, saved after {} (step {}) by the run that went on from it; this run, resumed from \
         {}, would replace them one by one and leave the rest beside its own `latest`: save into another \
         directory, or give --discard-later-tags to remove them once this run has saved its first checkpoint",
        save.display(),
        zero_core::checkpoint::describe_tags(&later),
        loaded.meta.tag,
        loaded.meta.global_step,
        loaded.meta.tag
    )))
}

/// Whether `a` and `b` name one directory (by any path to it).
fn same_dir(a: &Path, b: &Path) -> bool {
    matches!((std::fs::canonicalize(a), std::fs::canonicalize(b)), (Ok(x), Ok(y)) if x == y)
}

/// Fails unless `dir` (the value of `flag`) is a directory this process can write into:
/// created when missing, then a probe file created and removed. A run must not learn that it
/// cannot save only when its work is done.
pub(super) fn writable(flag: &str, dir: &Path) -> Result<(), TrainError> {
    let refuse = |why: String| TrainError::Config(format!("{flag} {}: {why}", dir.display()));
    if dir.exists() && !dir.is_dir() {
        return Err(refuse("not a directory".into()));
    }
    std::fs::create_dir_all(dir).map_err(|e| refuse(format!("cannot create the directory: {e}")))?;
    // One probe per process: ranks launched as processes may share the directory.
    let probe = dir.join(format!(".write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| refuse(format!("cannot write into the directory: {e}")))?;
    std::fs::remove_file(&probe)
        .map_err(|e| refuse(format!("cannot remove a file written there ({}): {e}", probe.display())))
}
