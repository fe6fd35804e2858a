//! Bus bandwidth of all_reduce, reduce_scatter and all_gather (f32) on the threads and TCP
//! backends, against the machine's memory bandwidth and torch's gloo, measured in the same run.
//!
//! nccl-tests conventions, `bytes` being the full buffer: all_reduce busbw = bytes·2(n-1)/n / t;
//! reduce_scatter and all_gather busbw = bytes·(n-1)/n / t. The TCP group runs one process per
//! rank (this binary re-executed with the torchrun variables), over TCP loopback, Unix-domain
//! sockets, and pipes (its default between ranks of one host).
//!
//! Usage: collectives [--sizes 1,16,64,256] [--worlds 2,4] [--no-gloo] [--no-tcp] [--no-threads]
//!   [--transports tcp,unix,pipes] [--socket-buffer BYTES]

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use zero_benches::cli::Args;
use zero_core::comm::{CommError, DistEnv, FlatBuffer, ProcessGroup, ReduceOp, TcpGroup, TcpOptions, ThreadGroup};

const OPS: [&str; 3] = ["all_reduce", "reduce_scatter", "all_gather"];

/// gloo on this kind of machine, from ANCHORS.md (GB/s busbw; world, op, MB), used only when
/// torch cannot be imported here.
const ANCHOR_GLOO: &[(usize, &str, usize, f64)] = &[
    (2, "all_reduce", 1, 0.34),
    (2, "all_reduce", 16, 0.73),
    (2, "all_reduce", 64, 0.91),
    (2, "all_reduce", 256, 0.84),
    (2, "reduce_scatter", 1, 0.18),
    (2, "reduce_scatter", 16, 0.28),
    (2, "reduce_scatter", 64, 0.24),
    (2, "reduce_scatter", 256, 0.26),
    (2, "all_gather", 1, 0.42),
    (2, "all_gather", 16, 0.49),
    (2, "all_gather", 64, 0.25),
    (2, "all_gather", 256, 0.31),
    (4, "all_reduce", 1, 0.21),
    (4, "all_reduce", 16, 0.65),
    (4, "all_reduce", 64, 0.66),
    (4, "reduce_scatter", 1, 0.09),
    (4, "reduce_scatter", 16, 0.23),
    (4, "reduce_scatter", 64, 0.17),
    (4, "all_gather", 1, 0.16),
    (4, "all_gather", 16, 0.53),
    (4, "all_gather", 64, 0.26),
];

fn iterations(bytes: usize) -> usize {
    (64usize << 20).checked_div(bytes.max(1)).unwrap_or(1).clamp(3, 20)
}

fn busbw(op: &str, bytes: usize, world: usize, secs: f64) -> f64 {
    let n = world as f64;
    let factor = if op == "all_reduce" {
        2.0 * (n - 1.0) / n
    } else {
        (n - 1.0) / n
    };
    bytes as f64 * factor / secs / 1e9
}

/// Bytes every rank together must read and write in shared memory (the threads backend's
/// minimum): an all-reduce reads and writes every buffer once, a reduce-scatter reads every input
/// and writes one output slice per rank, an all-gather reads the shards and writes every output.
fn traffic(op: &str, bytes: usize, world: usize) -> f64 {
    let (b, n) = (bytes as f64, world as f64);
    match op {
        "reduce_scatter" => (n + 1.0) * b,
        _ => 2.0 * n * b,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Elements of an f32 buffer of `mb` MiB, rounded down to a multiple of `world`.
fn elems(mb: usize, world: usize) -> usize {
    let n = (mb << 20) / 4;
    n - n % world
}

/// Runs the schedule on one rank; returns (op, bytes, median seconds) as seen by this rank.
///
/// Buffers are allocated and filled outside the timed region and reused: all_reduce works in
/// place, all_gather writes into a reused output (`all_gather_into`), reduce_scatter reads a
/// reused input and writes a reused output (`reduce_scatter_into`).
fn schedule(g: &dyn ProcessGroup, sizes: &[usize]) -> Vec<(String, usize, f64)> {
    let world = g.world_size();
    let fail = |op: &str, e: CommError| -> ! {
        eprintln!("rank {}: {op}: {e}", g.rank());
        std::process::exit(1)
    };
    let mut out = Vec::new();
    for &mb in sizes {
        let n = elems(mb, world);
        let bytes = n * 4;
        for op in OPS {
            let mut full = FlatBuffer::F32(vec![1.0; n]);
            let mut shard = FlatBuffer::F32(vec![1.0; n / world]);
            let mut times = Vec::new();
            // One warm-up round, then the measured ones.
            for _ in 0..=iterations(bytes) {
                if op == "all_reduce" {
                    // Keep the values finite and equal on every rank.
                    if let FlatBuffer::F32(v) = &mut full {
                        v.fill(1.0);
                    }
                }
                g.barrier().unwrap_or_else(|e| fail("barrier", e));
                let t = Instant::now();
                let done = match op {
                    "all_reduce" => g.all_reduce(&mut full, ReduceOp::Sum),
                    "reduce_scatter" => g.reduce_scatter_into(&mut full, &mut shard, ReduceOp::Sum),
                    _ => {
                        // The shard is moved in and comes back in the output; copy it back
                        // outside the timed region below.
                        let part = std::mem::replace(&mut shard, FlatBuffer::F32(Vec::new()));
                        let r = g.all_gather_into(part, &mut full);
                        times.push(t.elapsed().as_secs_f64());
                        shard = FlatBuffer::F32(vec![1.0; n / world]);
                        r.unwrap_or_else(|e| fail(op, e));
                        continue;
                    }
                };
                times.push(t.elapsed().as_secs_f64());
                done.unwrap_or_else(|e| fail(op, e));
                if op == "reduce_scatter" {
                    // The input's values are unspecified afterwards (TCP works in it).
                    if let FlatBuffer::F32(v) = &mut full {
                        v.fill(1.0);
                    }
                }
            }
            times.remove(0);
            out.push((op.to_string(), bytes, median(times)));
        }
    }
    out
}

/// Copy bandwidth (STREAM convention: read + write bytes) of a 256 MiB buffer with `threads`
/// threads, best of 5.
fn memcpy_bandwidth(threads: usize) -> f64 {
    let n = 64 << 20;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        thread::scope(|s| {
            let chunk = n.div_ceil(threads);
            for (d, sr) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(sr));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    2.0 * (n * 4) as f64 / best / 1e9
}

fn threads_backend(world: usize, sizes: &[usize]) -> Vec<(String, usize, f64)> {
    let ranks = ThreadGroup::with_timeout(world, Duration::from_secs(600)).expect("thread group");
    let results: Vec<Vec<(String, usize, f64)>> = thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|g: Arc<ThreadGroup>| s.spawn(move || schedule(&*g, sizes)))
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    results.into_iter().next().unwrap_or_default()
}

fn free_port() -> u16 {
    zero_core::launch::free_port().unwrap_or(29517)
}

/// Starts `world` processes of `program args` with the torchrun variables and parses rank 0's
/// `RESULT op bytes seconds` lines.
fn processes(world: usize, program: &str, args: &[String], envs: &[(&str, &str)]) -> Option<Vec<(String, usize, f64)>> {
    let port = free_port().to_string();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(program)
                .args(args)
                .envs(envs.iter().copied())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
        })
        .collect::<Result<_, _>>()
        .ok()?;
    let mut lines = Vec::new();
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().ok()?;
        if !out.status.success() {
            eprintln!("{program} rank {rank} failed: {}", out.status);
            return None;
        }
        if rank == 0 {
            lines = String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(str::to_string)
                .collect();
        }
    }
    Some(
        lines
            .iter()
            .filter_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                (w.len() == 4 && w[0] == "RESULT")
                    .then(|| Some((w[1].to_string(), w[2].parse().ok()?, w[3].parse().ok()?)))
                    .flatten()
            })
            .collect(),
    )
}

/// What `--help` prints.
const USAGE: &str = "usage: collectives [--sizes 1,16,64,256] [--worlds 2,4] [--no-gloo] [--no-tcp] [--no-threads]
  [--transports tcp,unix,pipes] [--socket-buffer BYTES]";

/// The TCP group's transports, in the order they run.
const TRANSPORTS: [&str; 3] = ["tcp", "unix", "pipes"];

struct Options {
    /// Buffer sizes in MiB.
    sizes: Vec<usize>,
    /// World sizes, each measured on every backend.
    worlds: Vec<usize>,
    /// torch's gloo measured beside (`--no-gloo`: the ANCHORS.md figures instead).
    gloo: bool,
    /// The TCP group runs (`--no-tcp`: not).
    tcp: bool,
    /// The threads backend runs (`--no-threads`: not).
    threads: bool,
    /// Which of [`TRANSPORTS`] run.
    transports: Vec<String>,
    /// SO_SNDBUF / SO_RCVBUF in bytes (0: kernel autotuning; `None`: `TcpOptions`' default).
    socket_buffer: Option<usize>,
    /// This process is one rank of the TCP group (the parent starts it so).
    tcp_rank: bool,
    /// The TCP rank's transport: `tcp` (loopback only) or `auto`.
    transport: String,
}

/// The options, every one checked before anything runs (a bad one exits with status 2).
fn options() -> Options {
    let mut o = Options {
        sizes: vec![1, 16, 64, 256],
        worlds: vec![2, 4],
        gloo: true,
        tcp: true,
        threads: true,
        transports: TRANSPORTS.iter().map(|t| t.to_string()).collect(),
        socket_buffer: None,
        tcp_rank: false,
        transport: "auto".into(),
    };
    let mut args = Args::new("collectives", USAGE);
    while let Some(flag) = args.flag() {
        match flag.as_str() {
            "--sizes" => o.sizes = args.counts(&flag, 1),
            "--worlds" => o.worlds = args.ranks_list(&flag),
            "--no-gloo" => o.gloo = false,
            "--no-tcp" => o.tcp = false,
            "--no-threads" => o.threads = false,
            "--transports" => o.transports = args.choices(&flag, &TRANSPORTS),
            "--socket-buffer" => o.socket_buffer = Some(args.number(&flag, 0..=usize::MAX)),
            "--tcp-rank" => o.tcp_rank = true,
            "--transport" => o.transport = args.choice(&flag, &["tcp", "auto"]),
            other => args.unknown(other),
        }
    }
    o
}

fn main() {
    let o = options();
    let sizes = o.sizes.clone();
    if o.tcp_rank {
        let env = DistEnv::detect().unwrap_or_else(|e| {
            eprintln!("environment: {e}");
            std::process::exit(1)
        });
        // --socket-buffer BYTES (0: kernel autotuning), to compare socket settings.
        let socket_buffer = match o.socket_buffer {
            Some(0) => None,
            Some(n) => Some(n),
            None => TcpOptions::default().socket_buffer,
        };
        let unix_on_same_host = o.transport != "tcp";
        let options = TcpOptions {
            timeout: Duration::from_secs(600),
            socket_buffer,
            unix_on_same_host,
        };
        let g = TcpGroup::connect(env.rank, env.world_size, &env.master_addr, env.master_port, options).unwrap_or_else(
            |e| {
                eprintln!("rendezvous: {e}");
                std::process::exit(1)
            },
        );
        for (op, bytes, secs) in schedule(&g, &sizes) {
            if g.rank() == 0 {
                println!("RESULT {op} {bytes} {secs:.6}");
            }
        }
        return;
    }
    let worlds = o.worlds.clone();
    let sizes_arg = sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "load average at the start: {}",
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    let mem1 = memcpy_bandwidth(1);
    let mem2 = memcpy_bandwidth(2);
    println!("memory bandwidth (copy of 256 MiB, read+write bytes, best of 5): 1 thread {mem1:.1} GB/s, 2 threads {mem2:.1} GB/s");

    let torch = o.gloo
        && Command::new("python3")
            .args(["-c", "import torch"])
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
    let gloo_script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tools/gloo_collectives.py");
    println!(
        "gloo baseline: {}",
        if torch {
            "torch.distributed gloo, measured in this run (tools/gloo_collectives.py)"
        } else {
            "torch not importable: figures taken from ANCHORS.md"
        }
    );

    let exe = std::env::current_exe().expect("own path").display().to_string();
    let mut rows: Vec<(String, usize, String, usize, f64, f64, String)> = Vec::new();
    for &world in &worlds {
        // --no-threads skips the in-process baseline (it takes both cores for a while).
        let threads = if !o.threads {
            Vec::new()
        } else {
            threads_backend(world, &sizes)
        };
        let mem = if world >= 2 { mem2 } else { mem1 };
        for (op, bytes, secs) in threads {
            let bw = busbw(&op, bytes, world, secs);
            let moved = traffic(&op, bytes, world) / secs / 1e9;
            let vs = format!(
                "memory traffic {moved:.1} GB/s = {:.0}% of copy bw",
                100.0 * moved / mem
            );
            rows.push(("threads".into(), world, op, bytes, secs, bw, vs));
        }
        let mut tcp_runs = Vec::new();
        // TCP over loopback; Unix-domain sockets between ranks of this host; pipes fed by
        // vmsplice (the default between ranks of one host).
        // --transports tcp,unix,pipes picks which of them run (all by default).
        for transport in TRANSPORTS.into_iter().filter(|t| o.transports.iter().any(|c| c == t)) {
            let mut tcp_args = vec![
                "--tcp-rank".to_string(),
                "--sizes".into(),
                sizes_arg.clone(),
                "--transport".into(),
                if transport == "tcp" { "tcp" } else { "auto" }.into(),
            ];
            let pipes = if transport == "pipes" { "1" } else { "0" };
            if let Some(b) = o.socket_buffer {
                tcp_args.extend(["--socket-buffer".to_string(), b.to_string()]);
            }
            if o.tcp {
                let name = match transport {
                    "tcp" => "tcp group, tcp loopback",
                    "unix" => "tcp group, unix sockets",
                    _ => "tcp group, pipes",
                };
                let results = processes(world, &exe, &tcp_args, &[("ZERO_COMM_PIPES", pipes)]);
                tcp_runs.push((name, results.unwrap_or_default()));
            }
        }
        let gloo: BTreeMap<(String, usize), f64> = if torch {
            processes(world, "python3", &[gloo_script.into(), sizes_arg.clone()], &[])
                .unwrap_or_default()
                .into_iter()
                .map(|(op, bytes, secs)| ((op.clone(), bytes), busbw(&op, bytes, world, secs)))
                .collect()
        } else {
            ANCHOR_GLOO
                .iter()
                .filter(|a| a.0 == world)
                .map(|&(_, op, mb, bw)| ((op.to_string(), elems(mb, world) * 4), bw))
                .collect()
        };
        for (name, results) in tcp_runs {
            for (op, bytes, secs) in results {
                let bw = busbw(&op, bytes, world, secs);
                let vs = match gloo.get(&(op.clone(), bytes)) {
                    Some(g) => format!(
                        "{:.2}x gloo ({g:.2} GB/s{})",
                        bw / g,
                        if torch { "" } else { ", ANCHORS" }
                    ),
                    None => "no gloo figure".into(),
                };
                rows.push((name.into(), world, op, bytes, secs, bw, vs));
            }
        }
        if torch {
            for ((op, bytes), bw) in &gloo {
                rows.push((
                    "gloo (torch)".into(),
                    world,
                    op.clone(),
                    *bytes,
                    f64::NAN,
                    *bw,
                    "baseline".into(),
                ));
            }
        }
    }
    println!();
    println!("| backend | world | op | size | time | busbw | baseline |");
    println!("|---|---|---|---|---|---|---|");
    for (backend, world, op, bytes, secs, bw, vs) in rows {
        println!(
            "| {backend} | {world} | {op} | {:.0} MB | {} | {bw:.2} GB/s | {vs} |",
            bytes as f64 / (1 << 20) as f64,
            if secs.is_nan() {
                "-".to_string()
            } else {
                format!("{:.2} ms", secs * 1e3)
            }
        );
    }
}
