//! Burn records of models holding `ZeroModule`s: loaded into a wrapped model (on every rank
//! thread, from the same bytes) before `initialize`, and a stage 3 rank's model and optimizer
//! records loaded back after it. References: the same training with the weights loaded into the
//! modules before wrapping them (the route that needs no record of a unit), and the
//! uninterrupted run, bit for bit. A record of another cut is refused with an error, not
//! trained on.

use crate::common;
use burn::module::Module;
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::{GradientsParams, Optimizer};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use common::*;
use std::ops::Range;
use zero_burn::{ZeroError, ZeroOptimizer};
use zero_core::config::DeepSpeedConfig;
use zero_test_support::assert_close;

const BLOCKS: usize = 2;
const WORLD: usize = 2;

fn recorder() -> BinBytesRecorder<FullPrecisionSettings> {
    BinBytesRecorder::default()
}

fn to_bytes<R: burn::record::Record<B>>(record: R) -> Vec<u8> {
    Recorder::<B>::record(&recorder(), record, ()).expect("record")
}

fn from_bytes<R: burn::record::Record<B>>(bytes: &[u8]) -> R {
    Recorder::<B>::load(&recorder(), bytes.to_vec(), &Default::default()).expect("load")
}

fn config(stage: u8) -> DeepSpeedConfig {
    config_kept_whole_below(stage, 0)
}

/// [`config`] whose units of fewer than `threshold` elements stay whole at stage 3.
fn config_kept_whole_below(stage: u8, threshold: usize) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": {threshold}}},
        "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.01}}}}}}"#
    );
    DeepSpeedConfig::from_str(&text, "ds_config.json")
        .expect("config")
        .config
}

/// Steps `steps` of the rank's batches.
fn train(
    mut model: UnitNet<B>,
    optim: &mut ZeroOptimizer,
    rank: usize,
    steps: Range<usize>,
) -> Result<UnitNet<B>, ZeroError> {
    let device = Default::default();
    let mut lr = optim.lr_scheduler();
    for step in steps {
        let (x, y) = batch::<B>(step, rows(rank, WORLD, 2, 1), &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = optim.try_step(lr.step(), model, grads)?;
    }
    Ok(model)
}

/// Every rank thread builds a wrapped model of its own random weights and loads the same
/// record bytes into it: each unit keeps its own parameter id (the units of the threads do not
/// cross), takes the record's values, and trains exactly as the source model's weights loaded
/// before wrapping.
#[test]
fn a_record_loaded_into_wrapped_models_on_every_rank_trains_as_its_source() {
    let source = Net::<B>::new(&Default::default(), BLOCKS);
    let source_values = values(&source);
    let net_bytes = to_bytes(source.clone().into_record());
    let unit_bytes = to_bytes(UnitNet::of(source).into_record());
    for stage in [1u8, 2, 3] {
        let cfg = config(stage);
        let run = |through_units: bool| {
            on_ranks(WORLD, |rank, group| {
                let device = Default::default();
                let model = if through_units {
                    UnitNet::<B>::new(&device, BLOCKS).load_record(from_bytes(&unit_bytes))
                } else {
                    UnitNet::of(Net::<B>::new(&device, BLOCKS).load_record(from_bytes(&net_bytes)))
                };
                let (model, mut optim) = zero_burn::initialize::<B, _>(&cfg, model, group).expect("initialize");
                let start = model.weights();
                let model = train(model, &mut optim, rank, 0..3).expect("steps");
                (start, model.weights())
            })
        };
        let loaded = run(true);
        let reference = run(false);
        for (rank, ((start, end), (_, want))) in loaded.iter().zip(&reference).enumerate() {
            assert_eq!(
                start, &source_values,
                "stage {stage}, rank {rank}: the record's weights"
            );
            assert_eq!(end, want, "stage {stage}, rank {rank}: after 3 steps");
        }
        assert_ne!(loaded[0].1, source_values, "stage {stage}: the steps moved the weights");
    }
}

/// What a stage 3 rank carries between runs with Burn's recorders.
struct Saved {
    model: Vec<u8>,
    optim: Vec<u8>,
}

/// Stage 3: each rank saves its model's record (its shards) and its optimizer's, and a new
/// run (new random weights, cut by `initialize`) loads both back: it continues as the
/// uninterrupted run, bit for bit.
#[test]
fn a_stage_3_rank_resumes_from_the_records_of_its_model_and_optimizer() {
    let cfg = config(3);
    let source = Net::<B>::new(&Default::default(), BLOCKS);
    let bytes = to_bytes(source.into_record());
    let start = |rank: usize, group| {
        let model = UnitNet::of(Net::<B>::new(&Default::default(), BLOCKS).load_record(from_bytes(&bytes)));
        let _ = rank;
        zero_burn::initialize::<B, _>(&cfg, model, group).expect("initialize")
    };
    let whole = on_ranks(WORLD, |rank, group| {
        let (model, mut optim) = start(rank, group);
        train(model, &mut optim, rank, 0..4).expect("steps").weights()
    });
    let saved = on_ranks(WORLD, |rank, group| {
        let (model, mut optim) = start(rank, group);
        let model = train(model, &mut optim, rank, 0..2).expect("steps");
        Saved {
            model: to_bytes(model.into_record()),
            optim: to_bytes(Optimizer::<UnitNet<B>, B>::to_record(&optim)),
        }
    });
    let resumed = on_ranks(WORLD, |rank, group| {
        let fresh = UnitNet::<B>::new(&Default::default(), BLOCKS);
        let (model, optim) = zero_burn::initialize::<B, _>(&cfg, fresh, group).expect("initialize");
        let model = model.load_record(from_bytes(&saved[rank].model));
        let mut optim = Optimizer::<UnitNet<B>, B>::load_record(optim, from_bytes(&saved[rank].optim));
        train(model, &mut optim, rank, 2..4).expect("steps").weights()
    });
    assert_eq!(resumed, whole);
}

/// A record holds what the unit held when it was saved: a stage 3 rank's shard does not load
/// into a whole unit (initialize refuses to cut it) nor into a unit cut over another number of
/// ranks (its forward refuses), each with an error that names the lengths and the way that
/// works.
#[test]
fn a_record_of_another_cut_is_refused() {
    let cfg = config(3);
    let shards: Vec<Vec<u8>> = on_ranks(WORLD, |_, group| {
        let model = UnitNet::<B>::new(&Default::default(), BLOCKS);
        let (model, _) = zero_burn::initialize::<B, _>(&cfg, model, group).expect("initialize");
        to_bytes(model.into_record())
    });
    let check = |err: ZeroError| {
        let text = err.to_string();
        assert!(
            text.contains("ZeroModule holds") && text.contains("load_checkpoint"),
            "{text}"
        );
    };
    // Into whole units, before initialize.
    for err in on_ranks(WORLD, |rank, group| {
        let model = UnitNet::<B>::new(&Default::default(), BLOCKS).load_record(from_bytes(&shards[rank]));
        zero_burn::initialize::<B, _>(&cfg, model, group)
            .map(|_| ())
            .expect_err("a shard into a whole unit")
    }) {
        check(err);
    }
    // Into units cut over 3 ranks, their shards in host memory or in files (`offload_param`:
    // the store would refuse the shard of another length with a panic).
    let swap = std::env::temp_dir().join(format!("zero-record-cut-{}", std::process::id()));
    let offloaded = {
        let text = format!(
            r#"{{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
            "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_param": {{"device": "nvme", "nvme_path": "{}"}}}}}}"#,
            swap.display()
        );
        DeepSpeedConfig::from_str(&text, "ds_config.json")
            .expect("config")
            .config
    };
    for cfg in [&cfg, &offloaded] {
        for err in on_ranks(3, |rank, group| {
            let model = UnitNet::<B>::new(&Default::default(), BLOCKS);
            let (model, _) = zero_burn::initialize::<B, _>(cfg, model, group).expect("initialize");
            let model = model.load_record(from_bytes(&shards[rank % WORLD]));
            let (x, _) = batch::<B>(0, rows(rank, 3, 2, 1), &Default::default());
            model.blocks[0]
                .unshard(&x)
                .map(|_| ())
                .expect_err("a shard of 2 ranks into a unit of 3")
        }) {
            check(err);
        }
    }
    let _ = std::fs::remove_dir_all(&swap);
}

/// A sharded checkpoint saved at stage 3 with every unit kept whole (under the persistence
/// threshold) loads into a run at the same stage and world size whose units are cut: the new
/// state lays the units out as its own groups (the checkpoint's groups, which mix them with
/// other parameters, do not fit), and the steps that follow are the saving run's, continued.
#[test]
fn a_checkpoint_whose_units_were_whole_loads_into_cut_units() {
    let dir = std::env::temp_dir().join(format!("zero-record-whole-to-cut-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let bytes = to_bytes(Net::<B>::new(&Default::default(), BLOCKS).into_record());
    let start = || UnitNet::of(Net::<B>::new(&Default::default(), BLOCKS).load_record(from_bytes(&bytes)));
    let whole = config_kept_whole_below(3, 1_000_000);
    let continued = on_ranks(WORLD, |rank, group| {
        let (model, mut optim) = zero_burn::initialize::<B, _>(&whole, start(), group).expect("initialize");
        let model = train(model, &mut optim, rank, 0..2).expect("steps");
        optim
            .save_checkpoint(&dir, None, &serde_json::Value::Null)
            .expect("save");
        train(model, &mut optim, rank, 2..4).expect("steps").weights()
    });
    let cut = config(3);
    let resumed = on_ranks(WORLD, |rank, group| {
        let fresh = UnitNet::<B>::new(&Default::default(), BLOCKS);
        let (model, mut optim) = zero_burn::initialize::<B, _>(&cut, fresh, group).expect("initialize");
        assert!(model.blocks.iter().all(|b| b.is_sharded()), "the units are cut");
        let (model, _) = optim.load_checkpoint::<B, _>(&dir, None, model).expect("load");
        train(model, &mut optim, rank, 2..4).expect("steps").weights()
    });
    let _ = std::fs::remove_dir_all(&dir);
    for (rank, (got, want)) in resumed.iter().zip(&continued).enumerate() {
        assert_close(&format!("rank {rank}"), got, want, 1e-6);
    }
}
