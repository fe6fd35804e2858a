//! `gpt2 init`: a randomly initialised HuggingFace GPT-2 directory of any preset, the starting
//! checkpoint for sizes that have no public weights (`gpt2-10b`, a shaped `gpt2-48x4096`).
//! Written one transformer block at a time, so it needs memory for one block, not the model.

use super::TrainError;
use burn::backend::Flex;
use burn::tensor::backend::Backend;
use std::path::PathBuf;
use zero_models::Gpt2Config;

/// Arguments of `gpt2 init`.
#[derive(clap::Args, Clone, Debug)]
pub struct InitArgs {
    /// tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-10b, or a shape such as gpt2-52x1024 (layers x hidden).
    #[arg(long)]
    pub preset: String,
    /// The directory to write (config.json, one safetensors shard per block, the index).
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the initialisation.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

/// Writes the directory; returns what was written, for the user.
pub fn init(args: &InitArgs) -> Result<String, TrainError> {
    let config = Gpt2Config::preset(&args.preset).map_err(|e| TrainError::Model(format!("--preset: {e}")))?;
    let refuse = |why: String| TrainError::Model(format!("--out {}: {why}", args.out.display()));
    if args.out.exists() && !args.out.is_dir() {
        return Err(refuse("exists and is not a directory".into()));
    }
    // A model already there is never overwritten, even in part: `init` writes a new directory.
    if std::fs::read_dir(&args.out).is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(refuse(
            "already holds files; gpt2 init writes a new directory (give another --out, or remove this one)".into(),
        ));
    }
    // Written beside it, then renamed into place: an interrupted or failed init leaves no
    // directory that looks like a model.
    let name = args
        .out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let staging = args
        .out
        .with_file_name(format!("{}{}", partial_prefix(&name), std::process::id()));
    for stale in stale_partials(&args.out, &name) {
        if std::fs::remove_dir_all(&stale).is_ok() {
            eprintln!(
                "gpt2 init: removed {}, left by an init of {} that did not finish",
                stale.display(),
                args.out.display()
            );
        }
    }
    fits(&config, &args.preset, &args.out)?;
    let device = Default::default();
    Flex::seed(&device, args.seed);
    let written = config
        .write_random_pretrained::<Flex>(&staging, &device, |done, units| {
            // On a terminal, a line that counts the units (a 10B model takes minutes).
            if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                eprint!("\rgpt2 init: {done} of {units} units written");
            }
        })
        .map_err(|e| TrainError::Model(e.to_string()))
        .and_then(|()| {
            // An empty directory named by --out is replaced.
            let _ = std::fs::remove_dir(&args.out);
            std::fs::rename(&staging, &args.out).map_err(|e| refuse(format!("cannot move the model into place: {e}")))
        });
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprint!("\r\x1b[2K");
    }
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    written?;
    Ok(format!(
        "wrote {}: GPT-2 {} ({:.2}M parameters) in {} shards",
        args.out.display(),
        args.preset,
        config.num_params() as f64 / 1e6,
        config.n_layer + 1
    ))
}

/// The start of the name of a directory an init of `name` writes before moving it into place;
/// the writing process's id follows.
fn partial_prefix(name: &str) -> String {
    format!(".{name}.partial")
}

/// Directories beside `out` that an init of it wrote and never moved into place: their writer
/// (the process named in them) is gone. Linux only (it asks /proc); elsewhere none.
fn stale_partials(out: &std::path::Path, name: &str) -> Vec<PathBuf> {
    let prefix = partial_prefix(name);
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !std::path::Path::new("/proc/self").exists() {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir(&parent) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let file = e.file_name().to_string_lossy().into_owned();
            let pid: u32 = file.strip_prefix(&prefix)?.parse().ok()?;
            let gone = !std::path::Path::new(&format!("/proc/{pid}")).exists();
            (gone && e.path().is_dir()).then(|| e.path())
        })
        .collect()
}

/// Refuses, before writing, a model whose largest unit (the embeddings, or one block) cannot be
/// drawn in this machine's memory, or whose files cannot fit the free space where `out` goes.
/// The unit is held twice while it is written (the tensor and its bytes), 4 bytes a value; the
/// files hold 4 bytes a parameter.
fn fits(config: &Gpt2Config, preset: &str, out: &std::path::Path) -> Result<(), TrainError> {
    let d = config.n_embd as u128;
    let ends = (config.vocab_size as u128 + config.n_positions as u128) * d;
    let block = 12 * d * d + 13 * d;
    let unit = ends.max(block) * 4 * 2;
    if let Some(memory) = crate::gpt2::host_memory_bytes() {
        if unit > memory as u128 {
            return Err(TrainError::Model(format!(
                "--preset {preset}: its largest unit ({}) needs {:.1} GB while it is drawn and written, more than \
                 this machine's {:.1} GB of memory",
                if ends >= block { "the embeddings" } else { "one block" },
                unit as f64 / 1e9,
                memory as f64 / 1e9
            )));
        }
    }
    let files = config.num_params() as u128 * 4;
    if let Some(free) = free_bytes(out) {
        if files > free as u128 {
            return Err(TrainError::Model(format!(
                "--out {}: the model's files need {} and its file system has {} free",
                out.display(),
                zero_core::estimate::human_bytes(u64::try_from(files).unwrap_or(u64::MAX)),
                zero_core::estimate::human_bytes(free)
            )));
        }
    }
    Ok(())
}

/// Free bytes for an unprivileged writer on the file system `path` would be written to (its
/// nearest existing ancestor's); `None` where the system does not say.
fn free_bytes(path: &std::path::Path) -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let existing = path
            .ancestors()
            .map(|p| {
                if p.as_os_str().is_empty() {
                    std::path::Path::new(".")
                } else {
                    p
                }
            })
            .find(|p| p.exists())?;
        let c = std::ffi::CString::new(existing.as_os_str().as_bytes()).ok()?;
        let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a valid NUL-terminated path and `stat` a writable statvfs.
        if unsafe { libc::statvfs(c.as_ptr(), &mut stat) } != 0 {
            return None;
        }
        (stat.f_bavail as u64).checked_mul(stat.f_frsize as u64)
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}
