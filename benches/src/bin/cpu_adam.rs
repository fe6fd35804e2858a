//! CPU Adam benchmark: the fused AdamW step of zero-core on a flat fp32 shard, beside a plain
//! scalar loop measured in the same run and, when python3 has torch, `torch.optim.AdamW(fused=
//! True)` run by tools/bench_torch_adamw.py in the same run.
//!
//! ```text
//! cargo run --release -p zero-benches --bin cpu_adam -- [--params N] [--steps S] [--no-torch]
//! ```
//!
//! Prints, for each of `--threads` (default 1 and 2), the median step time of S steps after warm-up in ns/param and
//! GB/s (28 bytes/param move: read p, g, m, v; write p, m, v; 30 with a 16-bit copy-back), and
//! the ratios to the scalar loop and to torch. The Rust contenders take turns step by step (the
//! machines are shared and their load drifts); torch runs right after, in its own process.

use std::process::Command;
use std::time::Instant;

use zero_benches::cli::Args;
use zero_core::optim::adam_kernel::{adam_step, bf16, f16, AdamScalars, HalfCopy, Isa};
use zero_core::optim::CpuPool;

const LR: f64 = 1e-3;
const WD: f64 = 0.01;
const BYTES_PER_PARAM: f64 = 28.0;
const WARMUP: usize = 2;

/// What `--help` prints.
const USAGE: &str = "usage: cpu_adam [--params N] [--steps S] [--threads 1,2] [--no-torch]";

/// The most parameters `--params` takes: the four buffers' byte counts stay far within 64 bits.
const MAX_PARAMS: usize = 1 << 50;

struct Buffers {
    p: Vec<f32>,
    g: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl Buffers {
    fn new(n: usize) -> Self {
        // Distinct, non-trivial values; written once so that every page is resident.
        Buffers {
            p: (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect(),
            g: (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-5).collect(),
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    }
}

/// The textbook loop (what the plain C AdamW baseline computes), one thread per contiguous part.
fn scalar_adamw(b: &mut Buffers, step: u64, threads: usize) {
    let (b1, b2, eps) = (0.9_f32, 0.999_f32, 1e-8_f32);
    let bc1 = 1.0 - 0.9_f64.powi(step as i32);
    let bc2 = 1.0 - 0.999_f64.powi(step as i32);
    let step_size = (LR / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let decay = (1.0 - LR * WD) as f32;
    let part = b.p.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (((p, g), m), v) in
            b.p.chunks_mut(part)
                .zip(b.g.chunks(part))
                .zip(b.m.chunks_mut(part))
                .zip(b.v.chunks_mut(part))
        {
            s.spawn(move || {
                for i in 0..p.len() {
                    p[i] *= decay;
                    m[i] = b1 * m[i] + (1.0 - b1) * g[i];
                    v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
                    p[i] -= step_size * m[i] / (v[i].sqrt() / bc2_sqrt + eps);
                }
            });
        }
    });
}

#[derive(Clone, Copy)]
enum Copy16 {
    None,
    Bf16,
    F16,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// What one contender runs per step.
#[derive(Clone, Copy)]
enum Contender {
    ScalarLoop,
    Ours(Isa, Copy16),
}

impl Contender {
    fn label(self) -> String {
        match self {
            Contender::ScalarLoop => "plain scalar loop".to_string(),
            Contender::Ours(isa, Copy16::None) => format!("zero-core {}", isa.name()),
            Contender::Ours(isa, Copy16::Bf16) => format!("zero-core {} + bf16 copy", isa.name()),
            Contender::Ours(isa, Copy16::F16) => format!("zero-core {} + f16 copy", isa.name()),
        }
    }

    fn bytes(self) -> f64 {
        match self {
            Contender::Ours(_, Copy16::Bf16 | Copy16::F16) => BYTES_PER_PARAM + 2.0,
            _ => BYTES_PER_PARAM,
        }
    }
}

/// Median seconds per step of every contender. The contenders take turns step by step, so that
/// the load of a shared machine falls on all of them alike.
fn race(n: usize, threads: usize, steps: usize, contenders: &[Contender]) -> Vec<f64> {
    let pool = CpuPool::new(threads).expect("optimizer threads");
    let mut b = Buffers::new(n);
    let mut out_bf16 = vec![bf16::ZERO; n];
    let mut out_f16 = vec![f16::ZERO; n];
    let mut times = vec![Vec::with_capacity(steps); contenders.len()];
    for round in 0..WARMUP + steps {
        let step = round as u64 + 1;
        for (c, contender) in contenders.iter().enumerate() {
            let t0 = Instant::now();
            match *contender {
                Contender::ScalarLoop => scalar_adamw(&mut b, step, threads),
                Contender::Ours(isa, copy) => {
                    let s = AdamScalars::new(LR, 0.9, 0.999, 1e-8, WD, true, true, step);
                    let out = match copy {
                        Copy16::None => HalfCopy::None,
                        Copy16::Bf16 => HalfCopy::Bf16(&mut out_bf16),
                        Copy16::F16 => HalfCopy::F16(&mut out_f16),
                    };
                    pool.install(|| adam_step(isa, &mut b.p, &b.g, &mut b.m, &mut b.v, out, &s))
                        .expect("buffers of equal length");
                }
            }
            if round >= WARMUP {
                times[c].push(t0.elapsed().as_secs_f64());
            }
        }
    }
    times.into_iter().map(median).collect()
}

fn torch(n: usize, threads: usize, steps: usize) -> Option<f64> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tools/bench_torch_adamw.py");
    let out = Command::new("python3")
        .args([script, "--params", &n.to_string(), "--threads", &threads.to_string()])
        .args(["--steps", &steps.to_string()])
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "torch peer not run: {}",
            String::from_utf8_lossy(&out.stderr).lines().last()?
        );
        return None;
    }
    // One JSON line; only its median is needed.
    let line = String::from_utf8_lossy(&out.stdout);
    let rest = line.split("\"median_s\":").nth(1)?;
    rest.split([',', '}']).next()?.trim().parse().ok()
}

fn main() {
    let mut n: usize = 100_000_000;
    let mut steps = 7;
    let mut with_torch = true;
    // How the step scales with the optimizer's threads (the GPU host's 16 cores: 1,2,4,8,16).
    let mut thread_counts = vec![1usize, 2];
    let mut args = Args::new("cpu_adam", USAGE);
    while let Some(flag) = args.flag() {
        match flag.as_str() {
            "--params" => n = args.number(&flag, 1..=MAX_PARAMS),
            "--steps" => steps = args.count(&flag, 1),
            "--no-torch" => with_torch = false,
            "--threads" => thread_counts = args.numbers(&flag, 1..=zero_benches::cli::MAX_THREADS),
            other => args.unknown(other),
        }
    }
    let isas = Isa::available();
    println!(
        "CPU AdamW step, {n} fp32 params, median of {steps} steps after {WARMUP} warm-up; kernels available: {}",
        isas.iter().map(|i| i.name()).collect::<Vec<_>>().join(", ")
    );
    let report = |label: &str, secs: f64, bytes: f64, base: Option<(f64, &str)>| {
        let ns = secs * 1e9 / n as f64;
        let gbs = bytes * n as f64 / secs / 1e9;
        let ratio = base.map_or(String::new(), |(b, name)| format!("  {:.2}x {name}", b / secs));
        println!("  {label:<34} {ns:6.3} ns/param  {gbs:6.1} GB/s{ratio}");
    };
    // The kernel the engine runs: the one that measures fastest here, not the widest.
    let (best, measured) = CpuPool::new(2)
        .expect("optimizer threads")
        .install(|| Isa::measure_fastest(1 << 22, 3));
    println!(
        "  the engine's choice, measured on 4M parameters, 2 threads: {}{}",
        best.name(),
        measured
            .iter()
            .map(|(isa, secs)| format!(" {} {:.2} ms", isa.name(), secs * 1e3))
            .collect::<Vec<_>>()
            .join(",")
    );
    let mut contenders = vec![Contender::ScalarLoop];
    contenders.extend(isas.iter().map(|&isa| Contender::Ours(isa, Copy16::None)));
    contenders.push(Contender::Ours(best, Copy16::Bf16));
    contenders.push(Contender::Ours(best, Copy16::F16));
    for threads in thread_counts {
        println!("threads = {threads}");
        let medians = race(n, threads, steps, &contenders);
        let scalar = medians[0];
        for (c, &t) in contenders.iter().zip(&medians) {
            let base = (!matches!(c, Contender::ScalarLoop)).then_some((scalar, "vs scalar loop"));
            report(&c.label(), t, c.bytes(), base);
        }
        if with_torch {
            match torch(n, threads, steps) {
                Some(t) => {
                    report(
                        "torch AdamW fused=True (after)",
                        t,
                        BYTES_PER_PARAM,
                        Some((scalar, "vs scalar loop")),
                    );
                    for (c, &ours) in contenders.iter().zip(&medians) {
                        if let Contender::Ours(isa, Copy16::None) = c {
                            if *isa != Isa::Scalar {
                                println!("  torch fused / zero-core {}: {:.2}x", isa.name(), t / ours);
                            }
                        }
                    }
                }
                None => {
                    println!("  torch AdamW fused=True: not run (python3 with torch not found)")
                }
            }
        }
    }
}
