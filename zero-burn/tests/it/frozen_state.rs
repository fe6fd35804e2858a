//! What frozen parameters cost under `ZeroOptimizer`'s device state: nothing beyond their
//! values. A PyTorch optimizer keeps no state for a parameter that gets no gradient, and
//! DeepSpeed puts only trained parameters in its optimizer; here a flat group of parameters
//! that do not train holds no optimizer moments, is neither reduced nor stepped, and its
//! parameters keep the module's values. A parameter unfrozen later gets its moments at its first
//! gradient, as Burn's own AdamW makes them (the reference: plain Burn on one thread over the
//! whole global batch, with the same parts frozen and unfrozen at the same step). A checkpoint
//! or a record of a partly frozen model loads back exactly (the reference: the uninterrupted
//! run).

use crate::common;
use burn::module::Module;
use burn::optim::{GradientsParams, Optimizer};
use common::counting::Counting;
use common::*;
use std::sync::Arc;
use zero_burn::{DeviceCollective, EngineSettings, HostStaged, OptimizerOffload, Stage, ZeroOptimizer};
use zero_test_support::assert_close;

type Inner = burn::backend::Flex;

const BLOCKS: usize = 3;
const LR: f64 = 0.01;

/// `Net` with its blocks but the last frozen: a fine-tune of the head.
fn frozen_net(device: &burn::tensor::Device<B>) -> Net<B> {
    let mut net = Net::<B>::new(device, BLOCKS);
    net.ends.input = net.ends.input.no_grad();
    for block in &mut net.blocks[..BLOCKS - 1] {
        *block = block.clone().no_grad();
    }
    net
}

/// `net` with every parameter training again.
fn unfrozen(net: Net<B>) -> Net<B> {
    struct Unfreeze;
    impl burn::module::ModuleMapper<B> for Unfreeze {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<burn::tensor::Tensor<B, D>>,
        ) -> burn::module::Param<burn::tensor::Tensor<B, D>> {
            param.set_require_grad(true)
        }
    }
    net.map(&mut Unfreeze)
}

/// Elements of `net`'s parameters that train, and of all of them.
fn elements(net: &Net<B>) -> (usize, usize) {
    let trains = zero_burn::params::trains::<B, _>(net);
    let sizes: Vec<usize> = values::<B, _>(net).iter().map(Vec::len).collect();
    let trained = sizes.iter().zip(&trains).filter(|(_, &t)| t).map(|(n, _)| n).sum();
    (trained, sizes.iter().sum())
}

/// The optimizer's state swapped to a file under `path`, in chunks smaller than a group.
fn nvme_at(path: &std::path::Path) -> OptimizerOffload {
    OptimizerOffload::Nvme {
        path: path.to_path_buf(),
        buffer_count: 2,
        chunk_elements: 29,
        threads: 1,
    }
}

/// Four steps of `optim` on rank `rank` of 2 over [`frozen_net`], every part unfrozen before
/// the third.
fn unfrozen_at_step_2(mut optim: ZeroOptimizer, rank: usize) -> (ZeroOptimizer, Net<B>) {
    let device = Default::default();
    let mut model = optim.synchronize::<B, _>(frozen_net(&device)).expect("synchronize");
    for step in 0..4 {
        if step == 2 {
            model = unfrozen(model);
        }
        let (x, y) = batch::<B>(step, rows(rank, 2, 0, 1), &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = optim.try_step(LR, model, grads).expect("step");
    }
    (optim, model)
}

fn settings(stage: Stage) -> EngineSettings {
    let mut s = EngineSettings::new(stage, adamw_eps4(LR));
    // Small buckets: several groups, frozen and trained apart.
    s.reduce_bucket_size = 100;
    s
}

/// At stages 0-2 over 2 ranks the optimizer's moments are the trained parameters' alone (AdamW:
/// two fp32 moments an element, over the ranks at stages 1-2), with the state on the device, in
/// host buffers or offloaded to the CPU; on the device the reductions of a step carry the
/// trained parameters' gradients alone, and in host buffers the gradient accumulators are the
/// trained parameters' alone.
#[test]
fn frozen_groups_hold_no_moments_and_are_not_reduced() {
    let (trained, total) = elements(&frozen_net(&Default::default()));
    assert!(
        trained * 2 < total,
        "most of the model is frozen ({trained} of {total})"
    );
    let cases = [
        (Stage::Zero0, true, OptimizerOffload::None),
        (Stage::Zero1, true, OptimizerOffload::None),
        (Stage::Zero2, true, OptimizerOffload::None),
        (Stage::Zero0, false, OptimizerOffload::None),
        (Stage::Zero1, false, OptimizerOffload::None),
        (Stage::Zero2, false, OptimizerOffload::Cpu { threads: 1 }),
    ];
    for (stage, tensors, offload) in cases {
        let label = format!("{stage:?}, tensor state {tensors}, {offload:?}");
        let (report, reduced) = on_ranks(2, |rank, group| {
            let device = Default::default();
            let counting = Arc::new(Counting::new(HostStaged::new(group.clone())));
            let collective: Arc<dyn DeviceCollective<Inner>> = counting.clone();
            let mut s = settings(stage);
            s.offload_optimizer = offload.clone();
            let mut optim = ZeroOptimizer::new(s, group)
                .expect("optimizer")
                .with_collective(collective)
                .with_tensor_state(tensors);
            let mut model = optim.synchronize::<B, _>(frozen_net(&device)).expect("synchronize");
            for step in 0..2 {
                let (x, y) = batch::<B>(step, rows(rank, 2, 0, 1), &device);
                let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                counting.take();
                model = optim.try_step(LR, model, grads).expect("step");
            }
            let reduced: usize = counting
                .take()
                .iter()
                .filter(|(op, _, _)| matches!(*op, "all_reduce" | "reduce_scatter"))
                .map(|(_, len, _)| len)
                .sum();
            (optim.memory(), reduced)
        })
        .remove(0);
        let share = if stage == Stage::Zero0 {
            trained
        } else {
            trained.div_ceil(2)
        };
        // Groups are padded to a multiple of the ranks (and their alignment) when sharded.
        let slack = if stage == Stage::Zero0 { 0 } else { 64 };
        let moments = report.optimizer_state.current;
        assert!(
            moments >= share * 8 && moments <= (share + slack) * 8,
            "{label}: {moments} bytes of moments for {trained} trained elements of {total}"
        );
        if tensors && offload == OptimizerOffload::None {
            assert!(
                reduced >= trained && reduced <= trained + 2 * slack + 8,
                "{label}: the step reduced {reduced} elements for {trained} trained of {total}"
            );
        } else {
            // The model's gradients (the trained parameters') and the state's accumulators:
            // the trained groups whole (stages 0-1) or their shards (stage 2).
            let accumulated = report.gradients.current / 4;
            let whole = trained + if stage == Stage::Zero2 { share } else { trained };
            assert!(
                accumulated >= whole && accumulated <= whole + 2 * slack,
                "{label}: {accumulated} accumulated gradient elements for {trained} trained of {total}"
            );
        }
    }
}

/// Two steps with most of the model frozen, then every parameter unfrozen for two more: the
/// same weights as Burn's AdamW, whose state for the unfrozen parameters starts at their first
/// gradient. At stages 0-2 over 2 ranks, with the state on the device, in host buffers, and
/// offloaded to the CPU and to NVMe.
#[test]
fn a_part_unfrozen_later_trains_as_burn_does() {
    let want = {
        let device = Default::default();
        let mut model = frozen_net(&device);
        let mut optim = burn_adamw_eps4().init();
        for step in 0..4 {
            if step == 2 {
                model = unfrozen(model);
            }
            let (x, y) = batch::<B>(step, 0..GLOBAL_BATCH, &device);
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            model = optim.step(LR, model, grads);
        }
        values::<B, _>(&model)
    };
    let swap = std::env::temp_dir().join(format!("zero-unfrozen-{}", std::process::id()));
    let nvme = nvme_at(&swap);
    // (stage, the device state or host buffers, offload)
    let cases = [
        (Stage::Zero0, true, OptimizerOffload::None),
        (Stage::Zero1, true, OptimizerOffload::None),
        (Stage::Zero2, true, OptimizerOffload::None),
        (Stage::Zero0, false, OptimizerOffload::None),
        (Stage::Zero2, false, OptimizerOffload::Cpu { threads: 1 }),
        (Stage::Zero1, false, nvme),
    ];
    for (stage, tensors, offload) in cases {
        let label = format!("{stage:?}, tensor state {tensors}, {offload:?}");
        let got = on_ranks(2, |rank, group| {
            let mut s = settings(stage);
            s.offload_optimizer = offload.clone();
            let optim = ZeroOptimizer::new(s, group)
                .expect("optimizer")
                .with_tensor_state(tensors);
            let (optim, model) = unfrozen_at_step_2(optim, rank);
            assert_eq!(
                optim.tensor_state(),
                Some(tensors && offload == OptimizerOffload::None),
                "{label}"
            );
            values::<B, _>(&model)
        })
        .remove(0);
        assert_close(&label, &got, &want, 1e-5);
    }
    let _ = std::fs::remove_dir_all(&swap);
}

/// How a resumed run gets its state back.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Resume {
    /// `save_checkpoint` / `load_checkpoint`.
    Checkpoint,
    /// Burn's records of the model and of the optimizer (`to_record` / `load_record`).
    Records,
}

fn to_bytes<R: burn::record::Record<B>>(record: R) -> Vec<u8> {
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    Recorder::<B>::record(&BinBytesRecorder::<FullPrecisionSettings>::default(), record, ()).expect("record")
}

fn from_bytes<R: burn::record::Record<B>>(bytes: &[u8]) -> R {
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    Recorder::<B>::load(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        bytes.to_vec(),
        &Default::default(),
    )
    .expect("load")
}

/// Most of the model frozen for two steps, then unfrozen; saved after three steps (the
/// unfrozen part has stepped once, the rest three times) and resumed into a fresh optimizer
/// and a model of other weights, every part training: the next two steps are the
/// uninterrupted run's, bit for bit (each group's step count comes back as it was). Through a
/// sharded checkpoint and through Burn's records, with the state on the device, in host
/// buffers and on NVMe.
#[test]
fn a_part_unfrozen_before_a_save_resumes_exactly() {
    let dir = std::env::temp_dir().join(format!("zero-frozen-state-{}", std::process::id()));
    let swap = std::env::temp_dir().join(format!("zero-frozen-state-swap-{}", std::process::id()));
    let source = to_bytes(frozen_net(&Default::default()).into_record());
    let nvme = nvme_at(&swap);
    let cases = [
        (Resume::Checkpoint, true, OptimizerOffload::None),
        (Resume::Checkpoint, false, OptimizerOffload::None),
        (Resume::Checkpoint, false, nvme.clone()),
        (Resume::Records, true, OptimizerOffload::None),
        (Resume::Records, false, nvme),
    ];
    for (how, tensors, offload) in cases {
        let label = format!("{how:?}, tensor state {tensors}, {offload:?}");
        let _ = std::fs::remove_dir_all(&dir);
        // (steps, resumed from) -> (rank 0's values, each rank's model and optimizer records)
        let run = |steps: std::ops::Range<usize>, resumed: Option<&Vec<(Vec<u8>, Vec<u8>)>>| {
            on_ranks(2, |rank, group| {
                let device = Default::default();
                let mut s = settings(Stage::Zero1);
                s.offload_optimizer = offload.clone();
                // One bucket for all that trains, one for all that does not: a layout built
                // with every part training would put them in one group.
                s.reduce_bucket_size = 100_000;
                let mut optim = ZeroOptimizer::new(s, group)
                    .expect("optimizer")
                    .with_tensor_state(tensors);
                // Other weights than the source's, every part training: what is resumed brings
                // the saved weights back.
                let fresh = || unfrozen(frozen_net(&device));
                let mut model = match (resumed, how) {
                    (None, _) => optim
                        .synchronize::<B, _>(frozen_net(&device).load_record(from_bytes(&source)))
                        .expect("synchronize"),
                    (Some(_), Resume::Checkpoint) => {
                        optim
                            .load_checkpoint::<B, _>(dir.as_path(), None, fresh())
                            .expect("load")
                            .0
                    }
                    (Some(records), Resume::Records) => {
                        let (model, optimizer) = &records[rank];
                        optim = Optimizer::<Net<B>, B>::load_record(optim, from_bytes(optimizer));
                        fresh().load_record(from_bytes(model))
                    }
                };
                for step in steps.clone() {
                    if step == 2 {
                        model = unfrozen(model);
                    }
                    let (x, y) = batch::<B>(step, rows(rank, 2, 0, 1), &device);
                    let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                    model = optim.try_step(LR, model, grads).expect("step");
                }
                if how == Resume::Checkpoint && resumed.is_none() && steps.end == 3 {
                    optim
                        .save_checkpoint(dir.as_path(), None, &serde_json::Value::Null)
                        .expect("save");
                }
                let records = (
                    to_bytes(model.clone().into_record()),
                    to_bytes(Optimizer::<Net<B>, B>::to_record(&optim)),
                );
                (values::<B, _>(&model), records)
            })
        };
        let whole = run(0..5, None).remove(0).0;
        let saved: Vec<(Vec<u8>, Vec<u8>)> = run(0..3, None).into_iter().map(|(_, r)| r).collect();
        let resumed = run(3..5, Some(&saved)).remove(0).0;
        assert_eq!(resumed, whole, "{label}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&swap);
}

/// A part unfrozen under a schedule that cycles the momentum (OneCycle's) gets its moments with
/// the betas the schedule gives at that step, in host buffers as on the device (the reference:
/// the device state, which sets them when it makes a group's moments).
#[test]
fn a_part_unfrozen_under_cycled_momentum_takes_the_scheduled_betas() {
    let run = |tensors: bool| {
        on_ranks(2, |rank, group| {
            let mut s = settings(Stage::Zero1);
            s.betas_schedule = Some(Arc::new(|step| (0.95 - 0.05 * step as f64, 0.99)));
            let optim = ZeroOptimizer::new(s, group)
                .expect("optimizer")
                .with_tensor_state(tensors);
            values::<B, _>(&unfrozen_at_step_2(optim, rank).1)
        })
        .remove(0)
    };
    let device_state = run(true);
    assert_close("host buffers", &run(false), &device_state, 1e-6);
}
