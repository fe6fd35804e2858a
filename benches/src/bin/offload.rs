//! NVMe-offloaded optimizer step throughput against the disk's own sequential bandwidth,
//! measured in the same run with the same file size and host buffers.
//!
//! Baseline: write a file of the optimizer's swapped size (fp32 masters and Adam's two
//! moments, 12 bytes per parameter) chunk by chunk with positional writes, flush it, drop it
//! from the page cache, and read it back chunk by chunk: bandwidth = 2 × bytes / (write + read
//! time). The offloaded step streams the same file through `--buffers` host buffers (read
//! chunk i+1 while stepping chunk i with AdamW and writing chunk i-1), then flushes; its
//! throughput is 2 × bytes / step time. The ratio is the fraction of the disk's bandwidth the
//! step reaches (the page cache is dropped before every measurement). Each round measures both,
//! back to back, and the ratio is taken per round.
//!
//! Usage: offload [--params 100000000] [--chunk 4194304] [--buffers 4] [--dir PATH] [--steps 3]

use std::path::PathBuf;
use std::time::Instant;
use zero_benches::cli;
use zero_core::offload::{stream_chunks, SwapFile, SwapRegion};
use zero_core::optim::{build, HalfCopy, OptimizerSpec, ShardSegments};

struct Args {
    params: usize,
    chunk: usize,
    buffers: usize,
    dir: PathBuf,
    steps: usize,
}

/// What `--help` prints.
const USAGE: &str = "usage: offload [--params 100000000] [--chunk 4194304] [--buffers 4] [--dir PATH] [--steps 3]";

/// The most parameters `--params` takes: the swap file's 12 bytes per parameter stay far
/// within 64 bits.
const MAX_PARAMS: usize = 1 << 50;

/// The options, every one checked before the file is written (a bad one exits with status 2).
fn args() -> Args {
    let mut a = Args {
        params: 100_000_000,
        chunk: 1 << 22,
        buffers: 4,
        dir: std::env::temp_dir().join("zero-offload-bench"),
        steps: 3,
    };
    let mut args = cli::Args::new("offload", USAGE);
    while let Some(flag) = args.flag() {
        match flag.as_str() {
            "--params" => a.params = args.number(&flag, 1..=MAX_PARAMS),
            "--chunk" => a.chunk = args.count(&flag, 1),
            "--buffers" => a.buffers = args.count(&flag, 1),
            "--steps" => a.steps = args.count(&flag, 1),
            "--dir" => a.dir = PathBuf::from(args.value(&flag, "a directory for the swap file")),
            other => args.unknown(other),
        }
    }
    a
}

fn gbps(bytes: f64, secs: f64) -> f64 {
    bytes / secs / 1e9
}

fn main() {
    let a = args();
    if let Err(e) = run(&a) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(a: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let width = 3; // master, exp_avg, exp_avg_sq
    let region = SwapRegion::new(0, a.params, width, a.chunk);
    let bytes = region.elements() as f64 * 4.0;
    let file = SwapFile::create(&a.dir, "bench")?;
    println!(
        "{} parameters, file {:.2} GB, chunks of {} elements × {width} buffers, {} host buffers, dir {}",
        a.params,
        bytes / 1e9,
        a.chunk,
        a.buffers,
        a.dir.display()
    );

    // A first pass allocates the file's blocks: the step overwrites, so the baseline must too.
    let mut staging = vec![0.5f32; a.chunk.min(a.params) * width];
    for c in 0..region.chunks() {
        let n = region.chunk_range(c).len() * width;
        file.write_at(region.chunk_offset(c), &staging[..n])?;
    }
    file.drop_cache()?;

    // The offloaded AdamW step, as the engine runs it: one optimizer of a chunk's length,
    // reloaded from each chunk's moments.
    let spec = OptimizerSpec::adamw();
    let mut full = build(
        &spec,
        a.chunk.min(a.params),
        ShardSegments::single(a.chunk.min(a.params)),
    )?;
    let mut tail = None;
    let grads = vec![1e-3f32; a.params];
    let mut half = vec![half::bf16::ZERO; a.params];
    let mut pool = Vec::new();
    let mut rounds = Vec::new();
    let (mut disks, mut steps) = (Vec::new(), Vec::new());
    // Each round measures the disk and the step back to back (in alternating order), so that
    // the shared machine's drifting load falls on both sides of each ratio alike.
    for step in 0..a.steps {
        let mut disk = 0.0;
        let mut line = String::new();
        for side in [step % 2, 1 - step % 2] {
            if side == 0 {
                // Baseline: sequential overwrite (flushed) then read, one chunk-sized buffer.
                file.drop_cache()?;
                let t = Instant::now();
                for c in 0..region.chunks() {
                    let n = region.chunk_range(c).len() * width;
                    file.write_at(region.chunk_offset(c), &staging[..n])?;
                }
                file.drop_cache()?;
                let write = t.elapsed().as_secs_f64();
                let t = Instant::now();
                for c in 0..region.chunks() {
                    let n = region.chunk_range(c).len() * width;
                    file.read_at(region.chunk_offset(c), &mut staging[..n])?;
                }
                let read = t.elapsed().as_secs_f64();
                disk = gbps(2.0 * bytes, write + read);
                line.push_str(&format!(
                    "disk write {:.2} read {:.2} read+write {disk:.2} GB/s; ",
                    gbps(bytes, write),
                    gbps(bytes, read)
                ));
                continue;
            }
            file.drop_cache()?;
            let t = Instant::now();
            let stats = stream_chunks(&file, &region, a.buffers, &mut pool, |c, chunk| {
                let range = region.chunk_range(c);
                let n = range.len();
                let opt = if n == full.len() {
                    &mut full
                } else {
                    tail.get_or_insert_with(|| build(&spec, n, ShardSegments::single(n)).expect("tail optimizer"))
                };
                let (master, states) = chunk.split_at_mut(n);
                {
                    let (m, v) = states.split_at(n);
                    opt.load_state(step as u64, &[("exp_avg", m), ("exp_avg_sq", v)])?;
                }
                opt.step_with_copy(master, &grads[range.clone()], 1e-4, HalfCopy::Bf16(&mut half[range]))?;
                for ((_, data), target) in opt.state().iter().zip(states.chunks_exact_mut(n)) {
                    target.copy_from_slice(data);
                }
                Ok::<(), zero_core::optim::OptimError>(())
            })?;
            file.sync()?;
            let secs = t.elapsed().as_secs_f64();
            line.push_str(&format!(
                "step {secs:.2} s, {:.2} ns/param, {:.2} GB/s read+write (reader busy {:.2} s, writer {:.2} s, \
                 AdamW {:.2} s); ",
                secs * 1e9 / a.params as f64,
                gbps(2.0 * bytes, secs),
                stats.read_time.as_secs_f64(),
                stats.write_time.as_secs_f64(),
                stats.compute_time.as_secs_f64()
            ));
            rounds.push(secs);
        }
        let through = gbps(2.0 * bytes, rounds[step]);
        let ratio = through / disk;
        disks.push(disk);
        steps.push(through);
        println!("round {step}: {line}= {:.0}% of the disk", 100.0 * ratio);
        rounds[step] = ratio;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let (disk, step) = (median(&mut disks), median(&mut steps));
    println!(
        "medians: disk {disk:.2} GB/s ({:.2}-{:.2}), step {step:.2} GB/s ({:.2}-{:.2}): the step reaches {:.0}% of the \
         disk",
        disks.first().copied().unwrap_or(f64::NAN),
        disks.last().copied().unwrap_or(f64::NAN),
        steps.first().copied().unwrap_or(f64::NAN),
        steps.last().copied().unwrap_or(f64::NAN),
        100.0 * step / disk
    );
    let mut ratios = rounds;
    ratios.sort_by(f64::total_cmp);
    if let (Some(median), Some(lo), Some(hi)) = (ratios.get(ratios.len() / 2), ratios.first(), ratios.last()) {
        println!(
            "per round: median {:.0}% of the disk's read+write bandwidth (rounds {:.0}%-{:.0}%)",
            100.0 * median,
            100.0 * lo,
            100.0 * hi
        );
    }
    Ok(())
}
