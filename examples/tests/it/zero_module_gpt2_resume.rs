//! The `ZeroModule` GPT-2 of zero_module_gpt2.rs resumed and measured: a stage-3 checkpoint
//! resumed at other stages and world sizes and exported under HuggingFace names, a Burn record
//! resumed exactly, and the memory report. References: the uninterrupted run (bit for bit, or
//! to 1e-6 at another stage), and the model's own shapes for the memory report.

use crate::support;
use crate::zero_module;
use support::*;
use zero_models::gpt2::Gpt2;
use zero_module::*;
use zero_test_support::assert_close;

/// A checkpoint of `ShardedGpt2` saved at stage 3 on 2 ranks is the model's: it resumes at
/// stage 3 on 4 ranks, stage 1 on 1 and stage 0 on 3, each then following the uninterrupted
/// stage-3 run on 2 ranks (the reference) to 1e-5 of the largest weight; and `zero to-fp32`
/// with its GPT-2 naming gives HuggingFace's tensors, which the zoo's HuggingFace loader reads
/// back as the trained weights exactly.
#[test]
fn a_stage_3_checkpoint_resumes_at_any_stage_and_world_and_exports_huggingface_names() {
    use zero_core::checkpoint::{to_fp32, Checkpoint, NameMap};
    let batch = matrix_batch();
    let lens: Vec<usize> = parts(&fixture_gpt2().into_sharded()).iter().map(Vec::len).collect();
    let config = |stage, world| matrix_config(stage, world, 1, 0.5);
    let uninterrupted = put_together(&train_zero(&config(3, 2), 2, 12, 1, &batch, 4), &lens);

    let dir = tempfile::tempdir().expect("tempdir");
    let saved = dir.path().join("ckpt");
    // Saved by host buffers, loaded by the state as tensors: one format.
    let save = RunOptions {
        save: Some(&saved),
        tensors: Some(false),
        ..Default::default()
    };
    let first = put_together(&train_zero_between(&config(3, 2), 2, 12, 1, &batch, 2, save), &lens);
    let load = RunOptions {
        load: Some(&saved),
        ..Default::default()
    };
    for (stage, world) in [(3u8, 4usize), (1, 1), (0, 3)] {
        let runs = train_zero_between(&config(stage, world), world, 24 / world, 1, &batch, 2, load);
        for (u, (got, want)) in put_together(&runs, &lens).iter().zip(&uninterrupted).enumerate() {
            assert_close(
                &format!("resumed at stage {stage} on {world} ranks: unit {u}"),
                got,
                want,
                1e-5,
            );
        }
    }

    // The checkpoint names every weight as the unwrapped model does.
    let checkpoint = Checkpoint::open(&saved, None).expect("open");
    let hf = NameMap::gpt2_huggingface();
    let names: Vec<String> = checkpoint
        .meta
        .layout
        .params
        .iter()
        .map(|p| hf.apply(&p.name).expect("kept"))
        .collect();
    let (_, model_config) = Gpt2::<B>::load_pretrained(fixture_model(), &Default::default()).expect("fixture");
    let want: Vec<String> = model_config
        .param_shapes()
        .into_iter()
        .map(|(name, _)| format!("transformer.{name}"))
        .collect();
    assert_eq!(names, want);

    let out = dir.path().join("hf");
    to_fp32(&checkpoint, &out, None, &|n| hf.apply(n)).expect("to-fp32");
    std::fs::copy(fixture_model().join("config.json"), out.join("config.json")).expect("config");
    let exported = Gpt2::<B>::load_pretrained(&out, &Default::default())
        .expect("a HuggingFace directory")
        .0;
    assert_eq!(
        parts(&exported.into_sharded()),
        first,
        "the exported weights are the trained ones"
    );
}

/// Burn's own way to save an optimizer: each rank's model and `ZeroOptimizer::to_record`
/// through a Burn recorder, loaded into a fresh `initialize` at stage 3 (the units' shards, in
/// either state) and trained on: the run that never stopped, exactly.
#[test]
fn a_stage_3_burn_record_resumes_exactly() {
    let batch = matrix_batch();
    let lens: Vec<usize> = parts(&fixture_gpt2().into_sharded()).iter().map(Vec::len).collect();
    let config = matrix_config(3, 2, 1, 0.5);
    let uninterrupted = put_together(&train_zero(&config, 2, 12, 1, &batch, 4), &lens);
    for tensors in [true, false] {
        let out = std::sync::Mutex::new(vec![None, None]);
        let first = RunOptions {
            tensors: Some(tensors),
            records_out: Some(&out),
            ..Default::default()
        };
        train_zero_between(&config, 2, 12, 1, &batch, 2, first);
        let saved: Vec<Saved> = out
            .into_inner()
            .expect("records")
            .into_iter()
            .map(|s| s.expect("saved"))
            .collect();
        let resume = RunOptions {
            tensors: Some(tensors),
            records_in: Some(&saved),
            ..Default::default()
        };
        let resumed = put_together(&train_zero_between(&config, 2, 12, 1, &batch, 2, resume), &lens);
        assert_eq!(resumed, uninterrupted, "tensors {tensors}: resumed from Burn records");
    }
}

/// The memory report of stage 3 on 2 ranks is ZeRO's accounting of what each rank holds
/// (reference: the model's own shapes): its shard of every unit and `ln_f` whole as parameters,
/// fp32 masters and AdamW's two moments of what it owns, and one unit gathered whole at a
/// time under `BalancedCheckpointing` (padded to the ranks), plus what may be in flight beside
/// it: fewer elements than the prefetch budget (here one transformer block) before the last unit
/// started, so the budget and the largest other unit.
#[test]
fn the_stage_3_memory_report_counts_each_ranks_shards_and_the_largest_unit_gathered() {
    let batch = matrix_batch();
    let whole = parts(&fixture_gpt2().into_sharded());
    let (units, ln_f) = whole.split_at(whole.len() - 1);
    let padded = |u: &Vec<f32>| 2 * zero_burn::sharded::shard_len(u.len(), 2);
    let block = padded(&units[1]);
    let config = matrix_config(3, 2, 1, 0.0).replace(
        r#""stage3_param_persistence_threshold": 0"#,
        &format!(r#""stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": {block}"#),
    );
    let runs = train_zero(&config, 2, 12, 1, &batch, 1);
    let shards: usize = units.iter().map(|u| zero_burn::sharded::shard_len(u.len(), 2)).sum();
    let largest = units.iter().map(padded).max().unwrap();
    let all: usize = units.iter().map(padded).sum();
    assert!(all - largest > block, "more than one block besides the largest unit");
    // For each unit in use: what is in flight beside it is started while less than the budget
    // (a block) is: the largest other unit, after up to a budget's worth of smaller units when
    // there are any (the embeddings here are smaller than a block); never more than all the
    // others.
    let sizes: Vec<usize> = units.iter().map(padded).collect();
    let most = sizes
        .iter()
        .enumerate()
        .map(|(i, &u)| {
            let others: Vec<usize> = sizes
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, &v)| v)
                .collect();
            let (largest, smallest) = (*others.iter().max().unwrap(), *others.iter().min().unwrap());
            let before_last = if smallest >= block { 0 } else { block };
            u + (before_last + largest).min(all - u)
        })
        .max()
        .unwrap();
    for (rank, run) in runs.iter().enumerate() {
        let m = &run.memory;
        assert_eq!(m.parameters.current, 4 * (shards + ln_f[0].len()), "rank {rank}: {m:?}");
        assert_eq!(m.gathered.current, 4 * most, "rank {rank}: {m:?}");
        // ln_f's masters are sharded too (stage 3 shards what is not a unit as stage 2 does).
        assert!(m.master_weights.current >= 4 * shards, "rank {rank}: {m:?}");
        assert!(
            m.master_weights.current < 4 * (shards + ln_f[0].len()),
            "rank {rank}: {m:?}"
        );
        assert_eq!(
            m.optimizer_state.current,
            2 * m.master_weights.current,
            "rank {rank}: AdamW's two moments"
        );
    }
}
