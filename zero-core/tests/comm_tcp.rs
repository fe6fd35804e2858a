//! The TCP backend with real processes: this test binary re-executes itself once per rank (the
//! `rank_main` test, ignored in an ordinary run: the parent selects it with `--ignored --exact`
//! and sets ZERO_TEST_MODE), with the torchrun environment variables set, on loopback.

mod comm_support;

use comm_support::run_ranks;
use std::process::Command;
use std::time::{Duration, Instant};
use zero_core::comm::{CommError, FlatBuffer, ProcessGroup, ReduceOp, TcpGroup, TcpOptions};

/// Starts `world` ranks in `mode`; returns each rank's (exit success, stdout + stderr).
fn run_world(world: usize, mode: &str, timeout_secs: f64) -> Vec<(bool, String)> {
    run_world_over(world, mode, timeout_secs, "auto")
}

/// As [`run_world`]; `transport` "tcp" forces TCP between ranks of this host, "auto" lets them
/// use Unix-domain sockets.
fn run_world_over(world: usize, mode: &str, timeout_secs: f64, transport: &str) -> Vec<(bool, String)> {
    run_ranks(world, mode, timeout_secs, transport, Duration::from_secs(120))
}

/// One rank's program, selected by ZERO_TEST_MODE; prints `RESULT ...` lines the parent checks.
#[test]
#[ignore = "child process of the tests that start ranks (run_world, zero launch)"]
fn rank_main() {
    let mode = std::env::var("ZERO_TEST_MODE").expect("ZERO_TEST_MODE: run by the tests that start ranks only");
    let start = Instant::now();
    let g = TcpGroup::from_env(None).expect("rendezvous");
    let (rank, world) = (g.rank(), g.world_size());
    match mode.as_str() {
        "exercise" => {
            let n = comm_support::exercise(&g);
            println!("RESULT rank {rank} ran {n}");
            println!("TRANSPORTS {:?}", g.transports());
        }
        "mismatch" => {
            let mut b = FlatBuffer::F32(vec![1.0; 10]);
            g.all_reduce(&mut b, ReduceOp::Sum).expect("seq 0 agrees");
            let e = if rank == world - 1 {
                g.all_gather(FlatBuffer::F32(vec![0.0; 10])).unwrap_err()
            } else {
                g.all_reduce(&mut b, ReduceOp::Sum).unwrap_err()
            };
            let again = g.barrier().unwrap_err();
            assert_eq!(again, e, "poisoned group repeats the cause");
            println!("RESULT {e:?}");
        }
        "late" => {
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(4));
                println!("RESULT late rank woke");
                return;
            }
            let t = Instant::now();
            let mut b = FlatBuffer::F16(vec![half::f16::ONE; 100]);
            let e = g.all_reduce(&mut b, ReduceOp::Avg).unwrap_err();
            println!("RESULT {e:?} after {:.2} s", t.elapsed().as_secs_f64());
        }
        "kill" => {
            for step in 0..10 {
                if rank == 2 && step == 3 {
                    // Dies without a word, in the middle of the job.
                    std::process::abort();
                }
                let mut b = FlatBuffer::F32(vec![rank as f32; 1 << 20]);
                let t = Instant::now();
                match g.all_reduce(&mut b, ReduceOp::Sum) {
                    Ok(()) => {}
                    Err(e) => {
                        println!("RESULT {e:?} after {:.2} s", t.elapsed().as_secs_f64());
                        return;
                    }
                }
            }
            println!("RESULT no error");
        }
        other => panic!("unknown mode {other}"),
    }
    eprintln!("rank {rank} done in {:.2} s", start.elapsed().as_secs_f64());
}

#[test]
fn every_op_dtype_and_length_matches_the_reference_at_world_sizes_2_to_4() {
    for transport in ["tcp", "auto"] {
        for world in 2..=4 {
            let results = run_world_over(world, "exercise", 60.0, transport);
            for (rank, (ok, out)) in results.iter().enumerate() {
                let want = format!("RESULT rank {rank} ran {}", comm_support::EXERCISE_COUNT);
                assert!(
                    *ok && out.contains(&want),
                    "{transport} world {world} rank {rank}:\n{out}"
                );
            }
        }
    }
}

#[test]
fn a_single_rank_group_needs_no_peer() {
    let g = TcpGroup::connect(0, 1, "127.0.0.1", 0, TcpOptions::default()).expect("world 1");
    assert_eq!(comm_support::exercise(&g), comm_support::EXERCISE_COUNT);
}

#[test]
fn a_different_op_on_one_rank_is_reported_by_every_rank() {
    for (rank, (ok, out)) in run_world(3, "mismatch", 60.0).into_iter().enumerate() {
        assert!(ok, "rank {rank}:\n{out}");
        // A rank reports the mismatch it saw itself, or the one a peer's abort message carried
        // if that arrived first; both name rank 2, its op and the sequence number.
        let own = if rank == 2 {
            "Mismatch { seq: 1, rank: 2, op: \"all_gather\", peer: 0, peer_op: \"all_reduce\" }".to_string()
        } else {
            format!("Mismatch {{ seq: 1, rank: {rank}, op: \"all_reduce\", peer: 2, peer_op: \"all_gather\" }}")
        };
        let relayed = ["0", "1"].iter().any(|r| {
            out.contains(&format!(
                "Mismatch {{ seq: 1, rank: {r}, op: \"all_reduce\", peer: 2, peer_op: \"all_gather\" }}"
            ))
        }) || out
            .contains("Mismatch { seq: 1, rank: 2, op: \"all_gather\", peer: 0, peer_op: \"all_reduce\" }");
        assert!(out.contains(&own) || relayed, "rank {rank}: want {own}\n{out}");
    }
}

#[test]
fn a_late_rank_is_named_in_a_timeout() {
    let results = run_world(3, "late", 1.0);
    for (rank, (ok, out)) in results.iter().enumerate() {
        assert!(ok, "rank {rank}:\n{out}");
        if rank != 1 {
            assert!(
                out.contains("RESULT Timeout { seq: 0, op: \"all_reduce\", peer: 1, seconds: 1.0 }"),
                "rank {rank}:\n{out}"
            );
            let secs: f64 = out
                .split("after ")
                .nth(1)
                .and_then(|s| s.split(' ').next())
                .and_then(|s| s.parse().ok())
                .expect("elapsed");
            assert!(secs < 3.0, "rank {rank} took {secs} s");
        }
    }
}

#[test]
fn a_killed_rank_fails_every_other_rank_fast_naming_it() {
    for transport in ["tcp", "auto"] {
        killed_rank(transport);
    }
}

fn killed_rank(transport: &str) {
    // Timeout 60 s: the survivors must notice the death, not wait it out. Rank 2 dies after its
    // collective #2, so #2 completes everywhere and #3 fails everywhere.
    let results = run_world_over(4, "kill", 60.0, transport);
    assert!(!results[2].0, "rank 2 aborted");
    for rank in [0, 1, 3] {
        let (ok, out) = &results[rank];
        assert!(ok, "{transport} rank {rank}:\n{out}");
        assert!(
            out.contains("RESULT PeerLost { seq: 3, op: \"all_reduce\", peer: 2,"),
            "{transport} rank {rank}:\n{out}"
        );
        let secs: f64 = out
            .split("after ")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .expect("elapsed");
        assert!(secs < 5.0, "rank {rank} took {secs} s to notice");
    }
}

#[test]
fn errors_are_typed() {
    // The error names what went wrong where: a garbage master address fails setup.
    let e = TcpGroup::connect(1, 2, "no-such-host.invalid", 1, TcpOptions::default()).unwrap_err();
    assert!(
        matches!(e, CommError::Setup(ref m) if m.contains("no-such-host.invalid")),
        "{e}"
    );
}

#[test]
fn ranks_started_by_zero_launch_find_each_other() {
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new(env!("CARGO_BIN_EXE_zero"))
        .args(["launch", "--nproc-per-node", "3", "--"])
        .arg(exe)
        .args(["--ignored", "--exact", "rank_main", "--nocapture", "--test-threads=1"])
        .env("ZERO_TEST_MODE", "exercise")
        .env("ZERO_COMM_TIMEOUT_SECS", "60")
        .output()
        .expect("zero launch");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    for rank in 0..3 {
        let want = format!("RESULT rank {rank} ran {}", comm_support::EXERCISE_COUNT);
        assert!(text.contains(&want), "rank {rank}:\n{text}");
    }
}
