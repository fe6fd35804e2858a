//! `ZeroOptimizer`'s Burn record: each rank's `to_record`, written and read back by a Burn
//! recorder, and `load_record` into a fresh optimizer, with the model's own record. The
//! reference is the same optimizer's uninterrupted run: bit for bit at the same stage, to 1e-6
//! (another reduction order) at another stage or in the other state.

use crate::common;
use burn::module::Module;
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::GradientsParams;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, HalfPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use common::*;
use std::ops::Range;
use std::sync::Arc;
use zero_burn::{EngineSettings, Stage, ZeroError, ZeroOptimizer, ZeroOptimizerRecord};
use zero_test_support::{assert_close, max_relative_error};

const BLOCKS: usize = 3;

fn settings(stage: Stage) -> EngineSettings {
    let mut s = EngineSettings::new(stage, adamw_eps4(0.01));
    s.reduce_bucket_size = 100;
    // A schedule, so that a resume that lost its position would use the wrong rate.
    s.lr_schedule = Some(Arc::new(|step| 0.01 / (1.0 + step as f64)));
    s
}

/// How a record travels: through bytes, as a Burn recorder writes them.
#[derive(Clone, Copy, Debug)]
enum Bytes {
    Bin,
    /// Half precision settings: must not round the fp32 masters.
    MpkHalf,
}

fn to_bytes(record: ZeroOptimizerRecord, how: Bytes) -> Vec<u8> {
    match how {
        Bytes::Bin => Recorder::<B>::record(&BinBytesRecorder::<FullPrecisionSettings>::default(), record, ()),
        Bytes::MpkHalf => Recorder::<B>::record(&NamedMpkBytesRecorder::<HalfPrecisionSettings>::default(), record, ()),
    }
    .expect("record")
}

fn from_bytes(bytes: Vec<u8>, how: Bytes) -> ZeroOptimizerRecord {
    let device = Default::default();
    match how {
        Bytes::Bin => Recorder::<B>::load(&BinBytesRecorder::<FullPrecisionSettings>::default(), bytes, &device),
        Bytes::MpkHalf => Recorder::<B>::load(
            &NamedMpkBytesRecorder::<HalfPrecisionSettings>::default(),
            bytes,
            &device,
        ),
    }
    .expect("load")
}

/// What each rank carries from one run to the next: its optimizer record and its model's, as
/// bytes (so that a rank loading another's record gets tensors of its own: rank threads sharing
/// autodiff tensors can deadlock in burn 0.21's graph locks).
#[derive(Clone)]
struct Saved {
    optim: Vec<u8>,
    model: Vec<u8>,
}

fn model_bytes(model: &Net<B>) -> Vec<u8> {
    Recorder::<B>::record(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        model.clone().into_record(),
        (),
    )
    .expect("model record")
}

fn model_from(model: Net<B>, bytes: Vec<u8>) -> Net<B> {
    let record = Recorder::<B>::load(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        bytes,
        &Default::default(),
    )
    .expect("model record");
    model.load_record(record)
}

/// Steps `steps` at `(world, stage)` (tensor state or host buffers), from a fresh model or from
/// each rank's `resume`, records travelling as `how` writes them; returns rank 0's parameters,
/// each rank's saved state, and each rank's error if a step failed.
fn run(
    stage: Stage,
    world: usize,
    tensors: bool,
    steps: Range<usize>,
    resume: Option<Vec<Saved>>,
    how: Bytes,
) -> (Vec<Vec<f32>>, Vec<Saved>, Vec<Option<ZeroError>>) {
    let results = on_ranks(world, |rank, group| {
        let device = Default::default();
        let mut optim = ZeroOptimizer::new(settings(stage), group)
            .expect("optimizer")
            .with_tensor_state(tensors);
        let mut model = Net::<B>::new(&device, BLOCKS);
        if let Some(saved) = &resume {
            let mine = &saved[rank.min(saved.len() - 1)];
            model = model_from(model, mine.model.clone());
            optim = optim.load_record(from_bytes(mine.optim.clone(), how));
        }
        let mut lr = optim.lr_scheduler();
        let mut failed = None;
        for step in steps.clone() {
            let (x, y) = batch::<B>(step, rows(rank, world, 0, 1), &device);
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            match optim.try_step(lr.step(), model.clone(), grads) {
                Ok(m) => model = m,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let saved = Saved {
            optim: to_bytes(optim.to_record(), how),
            model: model_bytes(&model),
        };
        (values::<B, _>(&model), saved, failed)
    });
    let mut params = Vec::new();
    let mut saved = Vec::new();
    let mut errors = Vec::new();
    for (p, s, e) in results {
        if params.is_empty() {
            params = p;
        }
        saved.push(s);
        errors.push(e);
    }
    (params, saved, errors)
}

#[test]
fn a_record_resumes_exactly_at_each_stage_in_either_state() {
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        for (tensors, how) in [(true, Bytes::Bin), (false, Bytes::MpkHalf), (true, Bytes::MpkHalf)] {
            let label = format!("{stage:?}, tensors {tensors}, {how:?}");
            let (want, _, _) = run(stage, 2, tensors, 0..5, None, Bytes::Bin);
            let (_, saved, _) = run(stage, 2, tensors, 0..3, None, how);
            let (got, _, errors) = run(stage, 2, tensors, 3..5, Some(saved), how);
            assert!(errors.iter().all(Option::is_none), "{label}: {errors:?}");
            assert_eq!(
                got, want,
                "{label}: resumed from the record, against the run that never stopped"
            );
        }
    }
}

#[test]
fn a_record_loads_at_another_stage_and_into_the_other_state() {
    let initial = values::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS));
    let (_, saved, _) = run(Stage::Zero1, 2, true, 0..3, None, Bytes::Bin);
    for (stage, tensors) in [
        (Stage::Zero0, false),
        (Stage::Zero2, true),
        (Stage::Zero2, false),
        (Stage::Zero1, false),
    ] {
        let label = format!("saved at stage 1 as tensors, loaded at {stage:?}, tensors {tensors}");
        let (want, _, _) = run(stage, 2, tensors, 0..5, None, Bytes::Bin);
        let (got, _, errors) = run(stage, 2, tensors, 3..5, Some(saved.clone()), Bytes::Bin);
        assert!(errors.iter().all(Option::is_none), "{label}: {errors:?}");
        assert_close(&label, &got, &want, 1e-6);
        assert!(
            max_relative_error(&format!("{label}: the initial weights"), &initial, &want) > 1e-3,
            "the reference must have trained"
        );
    }
}

#[test]
fn a_record_lost_would_be_seen() {
    // The control: resuming from the model alone (the optimizer's record empty, as before a
    // first step) is not the uninterrupted run, so the exactness above depends on the record.
    let (want, _, _) = run(Stage::Zero1, 2, true, 0..5, None, Bytes::Bin);
    let (_, mut saved, _) = run(Stage::Zero1, 2, true, 0..3, None, Bytes::Bin);
    let empty = ZeroOptimizer::new(
        settings(Stage::Zero1),
        zero_core::comm::ThreadGroup::new_group(1).expect("group").remove(0),
    )
    .expect("optimizer")
    .to_record();
    assert!(empty.is_empty(), "no state before the first step");
    for s in &mut saved {
        s.optim = to_bytes(empty.clone(), Bytes::Bin);
    }
    let (got, _, errors) = run(Stage::Zero1, 2, true, 3..5, Some(saved), Bytes::Bin);
    assert!(errors.iter().all(Option::is_none), "{errors:?}");
    assert!(
        max_relative_error("resumed with fresh moments", &got, &want) > 1e-4,
        "fresh moments must change the trajectory"
    );
}

#[test]
fn another_world_size_fails_the_step_and_names_both() {
    let (_, saved, _) = run(Stage::Zero2, 2, true, 0..2, None, Bytes::Bin);
    // One rank handed rank 1's record of a two-rank run.
    let one = vec![saved[1].clone()];
    let (_, _, errors) = run(Stage::Zero2, 1, true, 2..3, Some(one), Bytes::Bin);
    let err = errors[0].as_ref().expect("the step must fail").to_string();
    assert!(err.contains("2 ranks") && err.contains("has 1"), "{err}");
    // Two ranks, each handed rank 0's record: rank 1 names the mix-up.
    let swapped = vec![saved[0].clone(), saved[0].clone()];
    let (_, _, errors) = run(Stage::Zero2, 2, true, 2..3, Some(swapped), Bytes::Bin);
    for (rank, e) in errors.iter().enumerate() {
        let err = e.as_ref().expect("every rank's step must fail").to_string();
        assert!(err.contains("rank 0's slices"), "rank {rank}: {err}");
    }
}
