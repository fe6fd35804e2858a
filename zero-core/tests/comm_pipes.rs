//! The TCP group's pipes between ranks of one host: buffers large enough to be sent by reference
//! (vmsplice), reused from one collective to the next with new values, must match the f64
//! reference of `comm_support` every time (a sender that handed its memory back before the
//! receiver read it would corrupt the next round); ranks that disagree about pipes fall back to
//! Unix sockets.

mod comm_support;

use comm_support::{assert_close, free_port, held, input, reference};
use std::process::Command;
use std::thread;
use std::time::Duration;
use zero_core::comm::{DType, FlatBuffer, ProcessGroup, ReduceOp, TcpGroup, TcpOptions, Transport};

fn options() -> TcpOptions {
    TcpOptions {
        timeout: Duration::from_secs(60),
        ..TcpOptions::default()
    }
}

/// Three rounds of every collective on buffers of `len` elements per rank, the same
/// allocations each round with new values; returns the number of checked results.
fn large_rounds(g: &dyn ProcessGroup, len: usize) -> usize {
    let (rank, world) = (g.rank(), g.world_size());
    let mut checked = 0;
    for dtype in [DType::F32, DType::BF16] {
        let mut buf = FlatBuffer::zeros(dtype, len);
        let mut gathered = FlatBuffer::zeros(dtype, len * world);
        let mut shard = FlatBuffer::zeros(dtype, len / world);
        for round in 0..3u64 {
            let salt = 1000 + round + 10 * (dtype == DType::BF16) as u64;
            let what = format!("rank {rank}/{world} {dtype:?} round {round}");
            assert!(buf.copy_from(&FlatBuffer::from_f32(&input(rank, len, salt), dtype)));
            g.all_reduce(&mut buf, ReduceOp::Sum)
                .unwrap_or_else(|e| panic!("{what} all_reduce: {e}"));
            let (want, scale) = reference(world, len, salt, dtype, ReduceOp::Sum);
            assert_close(&buf, &want, &scale, dtype, ReduceOp::Sum, &format!("{what} all_reduce"));

            assert!(buf.copy_from(&FlatBuffer::from_f32(&input(rank, len, salt + 100), dtype)));
            g.reduce_scatter_into(&mut buf, &mut shard, ReduceOp::Avg)
                .unwrap_or_else(|e| panic!("{what} reduce_scatter: {e}"));
            let (want, scale) = reference(world, len, salt + 100, dtype, ReduceOp::Avg);
            let c = len / world;
            let mine = rank * c..(rank + 1) * c;
            assert_close(
                &shard,
                &want[mine.clone()],
                &scale[mine],
                dtype,
                ReduceOp::Avg,
                &format!("{what} rs"),
            );

            let part = FlatBuffer::from_f32(&input(rank, len, salt + 200), dtype);
            g.all_gather_into(part, &mut gathered)
                .unwrap_or_else(|e| panic!("{what} all_gather: {e}"));
            let want: Vec<f64> = (0..world).flat_map(|r| held(r, len, salt + 200, dtype)).collect();
            let zero = vec![0.0; want.len()];
            assert_close(
                &gathered,
                &want,
                &zero,
                dtype,
                ReduceOp::Max,
                &format!("{what} all_gather"),
            );

            assert!(buf.copy_from(&FlatBuffer::from_f32(&input(rank, len, salt + 300), dtype)));
            g.broadcast(&mut buf, world - 1)
                .unwrap_or_else(|e| panic!("{what} broadcast: {e}"));
            let want = held(world - 1, len, salt + 300, dtype);
            assert_close(
                &buf,
                &want,
                &vec![0.0; len],
                dtype,
                ReduceOp::Max,
                &format!("{what} broadcast"),
            );
            checked += 4;
        }
    }
    checked
}

#[test]
fn large_buffers_over_pipes_match_the_reference_round_after_round() {
    // The variable is the process's: a test cannot turn pipes back on for its own groups.
    if std::env::var("ZERO_COMM_PIPES").is_ok_and(|v| v.trim() == "0") {
        return zero_test_support::skip("ZERO_COMM_PIPES=0 turns pipes off");
    }
    // 3 · 2^17 elements: 1.5 MiB of f32, chunks well above the splicing threshold.
    let len = 3 << 17;
    for world in 2..=3 {
        let port = free_port();
        let counts: Vec<usize> = thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    s.spawn(move || {
                        let g = TcpGroup::connect(rank, world, "127.0.0.1", port, options()).expect("rendezvous");
                        let peers: Vec<Option<Transport>> = g.transports().to_vec();
                        for (p, t) in peers.iter().enumerate().filter(|(p, _)| *p != rank) {
                            assert_eq!(*t, Some(Transport::Pipe), "rank {rank} reaches rank {p}");
                        }
                        large_rounds(&g, len)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        assert_eq!(counts, vec![24; world], "world {world}");
    }
}

/// One rank of the disagreement test, in its own process (ZERO_PIPES_TEST_RANK set).
#[test]
#[ignore = "child process of ranks_that_disagree_about_pipes_keep_the_unix_socket"]
fn pipes_rank_main() {
    let var = |name| std::env::var(name).unwrap_or_else(|_| panic!("{name}: run by the disagreement test only"));
    let rank: usize = var("ZERO_PIPES_TEST_RANK").parse().expect("rank");
    let port: u16 = var("ZERO_PIPES_TEST_PORT").parse().expect("port");
    let g = TcpGroup::connect(rank, 2, "127.0.0.1", port, options()).expect("rendezvous");
    let n = large_rounds(&g, 1 << 17);
    println!("RESULT rank {rank} ran {n} over {:?}", g.transports()[1 - rank]);
}

#[test]
fn ranks_that_disagree_about_pipes_keep_the_unix_socket() {
    let port = free_port().to_string();
    let exe = std::env::current_exe().expect("own path");
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args(["--ignored", "--exact", "pipes_rank_main", "--nocapture"])
                .env("ZERO_PIPES_TEST_RANK", rank.to_string())
                .env("ZERO_PIPES_TEST_PORT", &port)
                // Rank 1 wants pipes, rank 0 does not.
                .env("ZERO_COMM_PIPES", if rank == 0 { "0" } else { "1" })
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    let outputs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("a rank's output"))
        .collect();
    for (rank, out) in outputs.iter().enumerate() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("RESULT rank {rank} ran 24 over Some(Unix)")),
            "rank {rank}:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
