//! The TCP backend's two-thread path (a rank sends on one thread while it receives and reduces
//! on another), taken by ring steps over sockets that send at least 4 MiB: large collectives
//! over forced TCP checked against the f64 single-process reference, and a rank that dies in the
//! middle of a large transfer. This binary re-executes itself once per rank (the `rank_main`
//! test, ignored in an ordinary run: the parent selects it with `--ignored --exact` and sets
//! ZERO_TEST_MODE), on loopback.

mod comm_support;

use comm_support::{assert_close, held, input, reference, run_ranks};
use std::time::{Duration, Instant};
use zero_core::comm::{DType, FlatBuffer, ProcessGroup, ReduceOp, TcpGroup, Transport};

/// Elements per buffer: 8 MiB of f32 and a remainder, so that every ring stream of f32 values
/// (and the f32 partial sums of the bf16 all_reduce) at world 2-3 sends more than the 4 MiB
/// from which sends get their own thread, and the chunks are uneven.
const LEN: usize = (2 << 20) + 7;

/// Starts `world` ranks in `mode` over forced TCP; returns each rank's (success, output).
fn run_world(world: usize, mode: &str, timeout_secs: f64) -> Vec<(bool, String)> {
    run_ranks(world, mode, timeout_secs, "tcp", Duration::from_secs(240))
}

/// Every large collective once, checked against the f64 reference; returns how many ran.
fn large_collectives(g: &TcpGroup) -> usize {
    let (rank, world) = (g.rank(), g.world_size());
    let mut count = 0;
    let cases = [
        (DType::F32, ReduceOp::Sum),
        (DType::F32, ReduceOp::Avg),
        (DType::F32, ReduceOp::Max),
        (DType::BF16, ReduceOp::Sum),
    ];
    for (salt, (dtype, op)) in (1u64..).zip(cases) {
        let what = format!("rank {rank}/{world} all_reduce {op:?} {dtype:?}");
        let mut buf = FlatBuffer::from_f32(&input(rank, LEN, salt), dtype);
        g.all_reduce(&mut buf, op).unwrap_or_else(|e| panic!("{what}: {e}"));
        let (want, scale) = reference(world, LEN, salt, dtype, op);
        assert_close(&buf, &want, &scale, dtype, op, &what);
        count += 1;
    }

    let what = format!("rank {rank}/{world} reduce_scatter Sum F32");
    let full = LEN * world;
    let out = g
        .reduce_scatter(FlatBuffer::from_f32(&input(rank, full, 10), DType::F32), ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let (want, scale) = reference(world, full, 10, DType::F32, ReduceOp::Sum);
    let mine = rank * LEN..(rank + 1) * LEN;
    assert_close(
        &out,
        &want[mine.clone()],
        &scale[mine],
        DType::F32,
        ReduceOp::Sum,
        &what,
    );
    count += 1;

    let what = format!("rank {rank}/{world} all_gather F32");
    let out = g
        .all_gather(FlatBuffer::from_f32(&input(rank, LEN, 11), DType::F32))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let want: Vec<f64> = (0..world).flat_map(|r| held(r, LEN, 11, DType::F32)).collect();
    assert_close(&out, &want, &vec![0.0; want.len()], DType::F32, ReduceOp::Max, &what);
    count += 1;

    let root = world - 1;
    let what = format!("rank {rank}/{world} broadcast from {root}");
    let mut buf = FlatBuffer::from_f32(&input(rank, LEN, 12), DType::F32);
    g.broadcast(&mut buf, root).unwrap_or_else(|e| panic!("{what}: {e}"));
    let want = held(root, LEN, 12, DType::F32);
    assert_close(&buf, &want, &vec![0.0; LEN], DType::F32, ReduceOp::Max, &what);
    count += 1;
    count
}

/// One rank's program, selected by ZERO_TEST_MODE; prints `RESULT ...` lines the parent checks.
#[test]
#[ignore = "child process of the tests that start ranks (run_world)"]
fn rank_main() {
    let mode = std::env::var("ZERO_TEST_MODE").expect("ZERO_TEST_MODE: run by the tests that start ranks only");
    let g = TcpGroup::from_env(None).expect("rendezvous");
    let rank = g.rank();
    assert!(
        g.transports().iter().flatten().all(|t| *t == Transport::Tcp),
        "forced TCP: {:?}",
        g.transports()
    );
    match mode.as_str() {
        "large" => {
            let n = large_collectives(&g);
            println!("RESULT rank {rank} ran {n}");
        }
        "die_mid_transfer" => {
            if rank == 1 {
                // Dies without a word while a large all_reduce is streaming.
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(400));
                    std::process::abort();
                });
            }
            let mut b = FlatBuffer::F32(vec![1.0; 16 << 20]);
            for _ in 0..1000 {
                let t = Instant::now();
                if let Err(e) = g.all_reduce(&mut b, ReduceOp::Sum) {
                    println!("RESULT {e:?} after {:.2} s", t.elapsed().as_secs_f64());
                    return;
                }
            }
            println!("RESULT no error");
        }
        other => panic!("unknown mode {other}"),
    }
}

#[test]
fn large_collectives_over_tcp_match_the_f64_reference_at_worlds_2_and_3() {
    for world in [2, 3] {
        let results = run_world(world, "large", 120.0);
        for (rank, (ok, out)) in results.iter().enumerate() {
            assert!(ok, "world {world} rank {rank} failed:\n{out}");
            assert!(
                out.contains(&format!("RESULT rank {rank} ran 7")),
                "world {world} rank {rank}:\n{out}"
            );
        }
    }
}

#[test]
fn a_rank_dying_mid_transfer_fails_the_others_fast_naming_it() {
    // Timeout 60 s: the survivors must notice the death through the connections, not wait it
    // out, and every error names rank 1 and the op (the neighbours see its connection end, the
    // third rank gets their abort with the same cause).
    let results = run_world(3, "die_mid_transfer", 60.0);
    assert!(!results[1].0, "rank 1 aborted");
    for rank in [0, 2] {
        let (ok, out) = &results[rank];
        assert!(ok, "rank {rank}:\n{out}");
        assert!(out.contains("op: \"all_reduce\", peer: 1,"), "rank {rank}:\n{out}");
        let secs: f64 = out
            .split("after ")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("rank {rank} reported no elapsed time:\n{out}"));
        assert!(secs < 10.0, "rank {rank} took {secs} s to notice");
    }
}
