//! The threads backend against the f64 single-process reference, and its failure modes.

mod comm_support;

use comm_support::exercise;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use zero_core::comm::{CommError, FlatBuffer, ProcessGroup, ReduceOp, ThreadGroup};

/// Runs `f` on every rank of a fresh group, each on its own thread; returns the results in rank
/// order.
fn on_ranks<T: Send>(world: usize, timeout: Duration, f: impl Fn(Arc<ThreadGroup>) -> T + Sync) -> Vec<T> {
    let ranks = ThreadGroup::with_timeout(world, timeout).expect("group");
    thread::scope(|s| {
        let handles: Vec<_> = ranks.into_iter().map(|g| s.spawn(|| f(g))).collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

#[test]
fn every_op_dtype_and_length_matches_the_reference_at_world_sizes_1_to_4() {
    for world in 1..=4 {
        let counts = on_ranks(world, Duration::from_secs(60), |g| exercise(&*g));
        assert_eq!(counts, vec![comm_support::EXERCISE_COUNT; world], "world {world}");
    }
}

#[test]
fn a_different_op_on_one_rank_fails_every_rank_and_poisons_the_group() {
    let errors = on_ranks(3, Duration::from_secs(30), |g| {
        let mut warm = FlatBuffer::F32(vec![1.0; 5]);
        g.all_reduce(&mut warm, ReduceOp::Sum).expect("seq 0 agrees");
        let err = if g.rank() == 2 {
            g.all_gather(FlatBuffer::F32(vec![0.0; 5])).unwrap_err()
        } else {
            let mut b = FlatBuffer::F32(vec![0.0; 5]);
            g.all_reduce(&mut b, ReduceOp::Sum).unwrap_err()
        };
        let again = g.barrier().unwrap_err();
        (err, again)
    });
    for (rank, (err, again)) in errors.into_iter().enumerate() {
        match &err {
            CommError::Mismatch {
                seq: 1,
                rank: r,
                op,
                peer,
                peer_op,
            } => {
                assert_eq!(*r, rank);
                if rank == 2 {
                    assert_eq!((op.as_str(), peer_op.as_str()), ("all_gather", "all_reduce"));
                } else {
                    assert_eq!((op.as_str(), *peer, peer_op.as_str()), ("all_reduce", 2, "all_gather"));
                }
            }
            other => panic!("rank {rank}: expected a mismatch at seq 1, got {other}"),
        }
        assert_eq!(again, err, "rank {rank}: the poisoned group repeats the original cause");
    }
}

#[test]
fn a_different_length_or_dtype_is_a_shape_mismatch_naming_both() {
    let errors = on_ranks(2, Duration::from_secs(30), |g| {
        let mut b = if g.rank() == 0 {
            FlatBuffer::F32(vec![0.0; 7])
        } else {
            FlatBuffer::F32(vec![0.0; 8])
        };
        g.all_reduce(&mut b, ReduceOp::Avg).unwrap_err()
    });
    for (rank, e) in errors.iter().enumerate() {
        let msg = e.to_string();
        assert!(
            matches!(e, CommError::ShapeMismatch { seq: 0, .. }),
            "rank {rank}: {msg}"
        );
        assert!(
            msg.contains("7 F32") && msg.contains("8 F32") && msg.contains("all_reduce"),
            "{msg}"
        );
    }
    let errors = on_ranks(2, Duration::from_secs(30), |g| {
        let b = FlatBuffer::from_f32(
            &[1.0; 4],
            if g.rank() == 0 {
                zero_core::comm::DType::F16
            } else {
                zero_core::comm::DType::BF16
            },
        );
        g.all_gather(b).unwrap_err()
    });
    assert!(errors
        .iter()
        .all(|e| e.to_string().contains("F16") && e.to_string().contains("BF16")));
}

#[test]
fn a_rank_that_never_comes_times_out_naming_it() {
    let timeout = Duration::from_millis(300);
    let results = on_ranks(3, timeout, |g| {
        if g.rank() == 1 {
            thread::sleep(Duration::from_millis(900));
            return None;
        }
        let start = Instant::now();
        let mut b = FlatBuffer::F32(vec![1.0; 3]);
        let e = g.all_reduce(&mut b, ReduceOp::Max).unwrap_err();
        Some((e, start.elapsed()))
    });
    for (e, took) in results.into_iter().flatten() {
        assert!(
            matches!(&e, CommError::Timeout { seq: 0, peer: 1, op, .. } if op == "all_reduce"),
            "{e}"
        );
        assert!(took < Duration::from_millis(800), "took {took:?}");
    }
}

#[test]
fn a_dropped_handle_or_a_panicking_rank_fails_its_peers_at_once() {
    let long = Duration::from_secs(60);
    for panic in [false, true] {
        let ranks = ThreadGroup::with_timeout(3, long).expect("group");
        let mut it = ranks.into_iter();
        let (g0, g1, g2) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        let start = Instant::now();
        let doomed = thread::spawn(move || {
            thread::sleep(Duration::from_millis(50));
            let _held = g2;
            if panic {
                panic!("rank 2 fails on purpose");
            }
        });
        let survivors: Vec<_> = [g0, g1]
            .into_iter()
            .map(|g| {
                thread::spawn(move || {
                    let mut b = FlatBuffer::F32(vec![1.0; 1001]);
                    g.all_reduce(&mut b, ReduceOp::Sum).unwrap_err()
                })
            })
            .collect();
        assert_eq!(doomed.join().is_err(), panic);
        for s in survivors {
            let e = s.join().expect("survivor");
            let want = if panic { "panicked" } else { "dropped" };
            match &e {
                CommError::PeerLost {
                    seq: 0,
                    peer: 2,
                    op,
                    reason,
                } => {
                    assert_eq!(op, "all_reduce");
                    assert!(reason.contains(want), "{reason}");
                }
                other => panic!("expected rank 2 lost, got {other}"),
            }
        }
        assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    }
}

#[test]
fn invalid_arguments_are_reported_with_the_op() {
    let errors = on_ranks(2, Duration::from_secs(30), |g| {
        let e = g
            .reduce_scatter(FlatBuffer::F32(vec![0.0; 3]), ReduceOp::Sum)
            .unwrap_err();
        let mut b = FlatBuffer::F32(vec![0.0; 3]);
        // Poisoned: the first cause comes back, not a new one about the root.
        let again = g.broadcast(&mut b, 5).unwrap_err();
        (e, again)
    });
    for (e, again) in errors {
        assert!(
            matches!(&e, CommError::InvalidArgument { op, .. } if op == "reduce_scatter"),
            "{e}"
        );
        assert!(e.to_string().contains("multiple of the world size 2"));
        assert_eq!(again, e);
    }
}
