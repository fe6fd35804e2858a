//! Peak memory of loading a HuggingFace GPT-2 checkpoint as a stage-3 `ShardedGpt2` (its
//! embeddings and every block a `ZeroModule` cut over the ranks): the whole model per rank
//! (`Gpt2::load_pretrained`, `into_sharded`, then `shard_units`: the baseline) against the
//! partitioned load (`Gpt2::load_pretrained_sharded`: tensor by tensor, unit by unit).
//!
//! Ranks are threads of one process, so the process's peak resident set (VmHWM of
//! /proc/self/status) counts every rank. Each way is measured in a fresh child process of this
//! binary; the checkpoint (random weights) is written first by another child.
//!
//! `cargo run --release -p zero-benches --bin partitioned_load -- [--model gpt2] [--world 4]
//!  [--dir <checkpoint dir; a temporary one by default>]`

use burn::backend::Flex;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;
use zero_benches::cli::Args;
use zero_burn::sharded::{shard_units, UnitComm};
use zero_burn::HostStaged;
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_models::{Gpt2, Gpt2Config};

type B = Flex;

/// Every unit is cut (`stage3_param_persistence_threshold` 0).
const THRESHOLD: usize = 0;

struct Options {
    model: String,
    world: usize,
    dir: Option<PathBuf>,
    mode: Option<String>,
}

/// What `--help` prints.
const USAGE: &str =
    "usage: partitioned_load [--model gpt2] [--world 4] [--dir <checkpoint dir; a temporary one by default>]";

/// The options, every one checked before anything is written (a bad one exits with status 2).
fn options() -> Options {
    let mut o = Options {
        model: "gpt2".into(),
        world: 4,
        dir: None,
        mode: None,
    };
    let mut args = Args::new("partitioned_load", USAGE);
    while let Some(flag) = args.flag() {
        match flag.as_str() {
            "--model" => o.model = args.preset(&flag).0,
            "--world" => o.world = args.ranks(&flag),
            "--dir" => o.dir = Some(PathBuf::from(args.value(&flag, "the checkpoint's directory"))),
            // Internal: what a child process of this binary does (see `spawn`).
            "--mode" => o.mode = Some(args.choice(&flag, &["prepare", "full", "partitioned"])),
            other => args.unknown(other),
        }
    }
    o
}

fn fail(message: &str) -> ! {
    eprintln!("partitioned_load: {message}");
    std::process::exit(1);
}

/// A field of /proc/self/status, in bytes (0 where there is none).
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Loads the checkpoint on `world` rank threads, one way or the other; returns the most
/// parameter bytes a rank holds.
fn load(dir: &Path, world: usize, partitioned: bool) -> usize {
    let groups = ThreadGroup::new_group(world).unwrap_or_else(|e| fail(&format!("thread group: {e}")));
    let handles: Vec<_> = groups
        .into_iter()
        .map(|g| {
            let dir = dir.to_path_buf();
            std::thread::spawn(move || {
                let comm: UnitComm<B> = Arc::new(HostStaged::new(g as Arc<dyn ProcessGroup>));
                let device = Default::default();
                let model = if partitioned {
                    Gpt2::<B>::load_pretrained_sharded(&dir, &device, comm, THRESHOLD)
                        .map(|(model, _)| model)
                        .map_err(|e| e.to_string())
                } else {
                    Gpt2::<B>::load_pretrained(&dir, &device)
                        .map_err(|e| e.to_string())
                        .and_then(|(model, _)| {
                            shard_units(model.into_sharded(), comm, THRESHOLD).map_err(|e| e.to_string())
                        })
                };
                model.map(|m| {
                    let mut bytes = 0;
                    zero_burn::params::read_values::<B, _>(&m, |_, v| bytes += 4 * v.len());
                    bytes
                })
            })
        })
        .collect();
    let mut bytes = 0;
    for h in handles {
        match h.join() {
            Ok(Ok(b)) => bytes = bytes.max(b),
            Ok(Err(e)) => fail(&e),
            Err(_) => fail("a rank panicked"),
        }
    }
    bytes
}

fn child(o: &Options, mode: &str, dir: &Path) {
    match mode {
        "prepare" => {
            let config = Gpt2Config::preset(&o.model).unwrap_or_else(|e| fail(&e.to_string()));
            let device = Default::default();
            let model = config.init::<Flex>(&device);
            model
                .save_pretrained(dir, &config)
                .unwrap_or_else(|e| fail(&format!("writing the checkpoint: {e}")));
        }
        "full" | "partitioned" => {
            let before = status_bytes("VmRSS:");
            let start = Instant::now();
            let shard = load(dir, o.world, mode == "partitioned");
            let seconds = start.elapsed().as_secs_f64();
            println!("RESULT {} {} {} {seconds:.3}", before, status_bytes("VmHWM:"), shard);
        }
        other => fail(&format!("unknown mode {other}")),
    }
}

/// Runs this binary in `mode`; parses its RESULT line (rss before, peak, shard bytes, seconds).
fn spawn(o: &Options, mode: &str, dir: &Path) -> Option<(u64, u64, u64, f64)> {
    let exe = std::env::current_exe().unwrap_or_else(|e| fail(&format!("own path: {e}")));
    let out = Command::new(exe)
        .args(["--mode", mode, "--model", &o.model, "--world", &o.world.to_string()])
        .arg("--dir")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| fail(&format!("starting the {mode} child: {e}")));
    if !out.status.success() {
        fail(&format!(
            "{mode} child failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("RESULT "))?;
    let f: Vec<&str> = line.split_whitespace().collect();
    Some((
        f.first()?.parse().ok()?,
        f.get(1)?.parse().ok()?,
        f.get(2)?.parse().ok()?,
        f.get(3)?.parse().ok()?,
    ))
}

fn main() {
    let o = options();
    let temp;
    let dir = match &o.dir {
        Some(d) => d.clone(),
        None => {
            temp = std::env::temp_dir().join(format!("zero-partitioned-load-{}", std::process::id()));
            temp.clone()
        }
    };
    if let Some(mode) = &o.mode {
        child(&o, mode, &dir);
        return;
    }
    let config = Gpt2Config::preset(&o.model).unwrap_or_else(|e| fail(&e.to_string()));
    let psi: usize = config
        .param_shapes()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    if !dir.join("model.safetensors").is_file() {
        spawn(&o, "prepare", &dir);
    }
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "{} ({:.1}M parameters, {:.0} MB in fp32), world {} (rank threads of one process)",
        o.model,
        psi as f64 / 1e6,
        mb(psi as u64 * 4),
        o.world
    );
    println!("| load | peak RSS above start (all ranks) | ratio to full | per rank | largest rank shard | seconds |");
    println!("|---|---|---|---|---|---|");
    let mut baseline = None;
    for mode in ["full", "partitioned"] {
        let Some((before, peak, shard, seconds)) = spawn(&o, mode, &dir) else {
            fail(&format!("no result from the {mode} child"));
        };
        let delta = peak.saturating_sub(before);
        let base = *baseline.get_or_insert(delta);
        println!(
            "| {mode} | {:.0} MB | {:.2} | {:.0} MB | {:.0} MB | {seconds:.2} |",
            mb(delta),
            delta as f64 / base as f64,
            mb(delta) / o.world as f64,
            mb(shard)
        );
    }
    if o.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
