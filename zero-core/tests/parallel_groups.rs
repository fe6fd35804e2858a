//! The process groups of a parallel layout, on threads and over TCP.
//!
//! Reference: the members of each group, computed by hand from the rank formula
//! `rank = (pipeline · data + d) · tensor + t`; a collective over a group must combine exactly
//! those ranks' buffers, in group-rank order.

use std::time::Duration;
use zero_core::comm::{CommError, FlatBuffer, ProcessGroup, ReduceOp, TcpGroup, TcpOptions};
use zero_core::parallel::{Axis, ParallelLayout, RankGroups};

fn free_port() -> u16 {
    zero_core::launch::free_port().expect("a free port")
}

/// What rank `rank` sees over each of its groups: the sum of the members' world ranks (an
/// all-reduce) and the members in order (an all-gather of the world rank).
fn probe(rank: usize, groups: &RankGroups) -> Vec<(Axis, f32, Vec<f32>)> {
    Axis::ALL
        .iter()
        .map(|&axis| {
            let g = groups.along(axis);
            let mut sum = FlatBuffer::F32(vec![rank as f32]);
            g.all_reduce(&mut sum, ReduceOp::Sum).expect("all-reduce");
            let order = g.all_gather(FlatBuffer::F32(vec![rank as f32])).expect("all-gather");
            (axis, sum.into_f32()[0], order.into_f32())
        })
        .collect()
}

fn expect_members(layout: &ParallelLayout, rank: usize, seen: &[(Axis, f32, Vec<f32>)]) {
    for (axis, sum, order) in seen {
        let members = layout.members(*axis, rank).unwrap();
        let want: Vec<f32> = members.iter().map(|&m| m as f32).collect();
        assert_eq!(order, &want, "rank {rank} {axis:?} group members");
        assert_eq!(*sum, want.iter().sum::<f32>(), "rank {rank} {axis:?} sum");
    }
}

#[test]
fn thread_groups_follow_the_layout() {
    let layout = ParallelLayout::with_pipeline(2, 2, 2).unwrap();
    // By hand: rank 5 = pipeline 1, data 0, tensor 1.
    assert_eq!(layout.members(Axis::Tensor, 5).unwrap(), vec![4, 5]);
    assert_eq!(layout.members(Axis::Data, 5).unwrap(), vec![5, 7]);
    assert_eq!(layout.members(Axis::Pipeline, 5).unwrap(), vec![1, 5]);
    let ranks = layout.threads().unwrap();
    let seen: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(r, g)| s.spawn(move || probe(r, g)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, seen) in seen.iter().enumerate() {
        assert_eq!(ranks[rank].coords, layout.coords(rank).unwrap());
        expect_members(&layout, rank, seen);
    }
}

fn tcp_world(world: usize, unix: bool) -> Vec<Result<TcpGroup, CommError>> {
    let port = free_port();
    let options = TcpOptions {
        timeout: Duration::from_secs(20),
        unix_on_same_host: unix,
        ..TcpOptions::default()
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| s.spawn(move || TcpGroup::connect(r, world, "127.0.0.1", port, options)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn tcp_subgroups_follow_the_layout_over_both_transports() {
    for unix in [true, false] {
        let layout = ParallelLayout::new(2, 3).unwrap();
        let worlds = tcp_world(6, unix);
        let seen: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = worlds
                .into_iter()
                .map(|w| {
                    s.spawn(move || {
                        let w = w.expect("world rendezvous");
                        let rank = w.rank();
                        let groups = layout.tcp(w).expect("subgroups");
                        (rank, probe(rank, &groups))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, seen) in seen {
            expect_members(&layout, rank, &seen);
        }
    }
}

#[test]
fn ranks_that_disagree_on_the_partition_fail_instead_of_hanging() {
    let worlds = tcp_world(4, true);
    let errors: Vec<CommError> = std::thread::scope(|s| {
        let handles: Vec<_> = worlds
            .into_iter()
            .map(|w| {
                s.spawn(move || {
                    let w = w.expect("world rendezvous");
                    let groups = if w.rank() == 3 {
                        vec![vec![0, 2], vec![1, 3]]
                    } else {
                        vec![vec![0, 1], vec![2, 3]]
                    };
                    w.split(&groups).expect_err("disagreeing partitions must fail")
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errors {
        assert!(e.to_string().contains("other subgroups"), "{e}");
    }
}

#[test]
fn a_layout_that_does_not_fit_the_world_is_refused() {
    let worlds = tcp_world(2, true);
    let layout = ParallelLayout::new(2, 2).unwrap();
    for w in worlds {
        let e = layout.tcp(w.expect("world")).unwrap_err();
        assert!(e.to_string().contains("needs 4 ranks"), "{e}");
    }
}
