//! A state every rank holds in memory (its owned slices, as the optimizer's Burn record keeps
//! them), re-cut over the same ranks for another stage: each rank's new slices must equal the
//! reference function of (parameter, element) exactly, as a sharded checkpoint loads them
//! (checkpoint_reshard.rs); another world size is refused on every rank.

mod checkpoint_support;

use checkpoint_support::*;
use zero_core::checkpoint::{self, LoadedGroup, SaveRequest};
use zero_core::partition::PartitionLayout;

/// Rank `rank`'s owned slices of `layout` at `step`, with their description.
fn held(layout: &PartitionLayout, rank: usize, step: u64) -> (checkpoint::CheckpointMeta, Vec<LoadedGroup>) {
    let groups: Vec<LoadedGroup> = (0..layout.groups.len())
        .map(|g| LoadedGroup {
            master: owned(layout, g, rank, step, 0),
            state: vec![
                ("exp_avg".to_string(), owned(layout, g, rank, step, 1)),
                ("exp_avg_sq".to_string(), owned(layout, g, rank, step, 2)),
            ],
        })
        .collect();
    let request = SaveRequest {
        layout,
        groups: groups.iter().map(LoadedGroup::as_shard).collect(),
        stage: 0,
        global_step: step,
        skipped_steps: 0,
        optimizer_name: "adamw".into(),
        optimizer_step: step,
        group_steps: Vec::new(),
        lr_next: None,
        loss_scaler: None,
        rng: None,
        client_state: serde_json::Value::Null,
        model: None,
        tensor_parallel: None,
        tensor_ranks: None,
        lineage: None,
        options: Default::default(),
    };
    let meta = checkpoint::describe(&request, layout.world_size, "record").expect("describe");
    (meta, groups)
}

#[test]
fn every_stage_recuts_to_every_other_over_the_same_ranks() {
    for world in 1..=4 {
        for s in 0..=3u8 {
            for t in 0..=3u8 {
                on_ranks(world, move |rank, comm| {
                    let (meta, mine) = held(&layout(specs(""), world, s), rank, 7);
                    let new = layout(specs(""), world, t);
                    let got = checkpoint::recut(comm.as_ref(), "the record", &meta, rank, mine, &new).expect("recut");
                    assert_eq!(got.len(), new.groups.len());
                    for (g, loaded) in got.iter().enumerate() {
                        let label = format!("world {world}, stage {s} -> {t}, rank {rank}, group {g}");
                        assert_eq!(loaded.master, owned(&new, g, rank, 7, 0), "{label}: master");
                        assert_eq!(
                            loaded.state[0],
                            ("exp_avg".into(), owned(&new, g, rank, 7, 1)),
                            "{label}"
                        );
                        assert_eq!(
                            loaded.state[1],
                            ("exp_avg_sq".into(), owned(&new, g, rank, 7, 2)),
                            "{label}"
                        );
                    }
                });
            }
        }
    }
}

#[test]
fn another_world_size_or_another_ranks_record_is_refused_on_every_rank() {
    // Saved over 2 ranks, loaded over 3: every rank fails, naming both sizes.
    on_ranks(3, |rank, comm| {
        let (meta, mine) = held(&layout(specs(""), 2, 1), rank.min(1), 3);
        let err = checkpoint::recut(
            comm.as_ref(),
            "the record",
            &meta,
            rank.min(1),
            mine,
            &layout(specs(""), 3, 1),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("2 ranks") && err.contains("has 3"), "rank {rank}: {err}");
    });
    // Rank 1 handed rank 0's record: rank 1 names the mix-up, rank 0 hears that a peer failed.
    on_ranks(2, |rank, comm| {
        let l = layout(specs(""), 2, 2);
        let (meta, mine) = held(&l, 0, 3);
        let err = checkpoint::recut(comm.as_ref(), "the record", &meta, 0, mine, &l)
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 0's slices"), "rank {rank}: {err}");
    });
}
