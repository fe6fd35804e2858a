//! Activation checkpointing (`checkpointed_grads`) changes where activations live, never the
//! result: in Burn's own loop with `ZeroOptimizer`, the model's blocks `ZeroModule`s built by
//! `initialize_settings`, at every stage (at stage 3 each block gathered again for its
//! recomputation in backward), and for a plain Burn model.
//!
//! References:
//! - plain Burn on one thread: the whole model's `loss(x, y).backward()` and Burn's own AdamW
//!   (independent of ZeroOptimizer); parameters after 4 steps agree to 1e-6 relative;
//! - the same run without checkpointing (the same model's `loss(x, y).backward()`):
//!   recomputation reruns the same operations in the same order, so the parameters must be bit
//!   for bit the same.
//!
//! The model has 5 residual blocks, so 2 checkpoints cut it unevenly (3 + 2 blocks).

use crate::common;
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use common::*;
use std::sync::Arc;
use zero_burn::sharded::UnitComm;
use zero_burn::{checkpointed_grads, ActivationCheckpointing, ChainModel, EngineSettings, HostStaged, Stage};
use zero_core::comm::{SharedGroup, ThreadGroup};
use zero_core::optim::OptimizerSpec;
use zero_test_support::assert_close;

const BLOCKS: usize = 5;
const STEPS: usize = 4;
const LR: f64 = 0.01;
/// Micro-batches per step, accumulated by Burn's `GradientsAccumulator`.
const GAS: usize = 2;

fn adamw() -> OptimizerSpec {
    adamw_eps4(LR)
}

fn settings(stage: Stage) -> EngineSettings {
    let mut s = EngineSettings::new(stage, adamw());
    s.gradient_clipping = 0.0;
    s.reduce_bucket_size = 100;
    // Every block (187 elements) is cut under stage 3; the default keeps units this small whole.
    s.param_persistence_threshold = 13;
    s
}

fn reference() -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut model = Net::<B>::new(&device, BLOCKS);
    let mut optim = AdamWConfig::new().with_epsilon(1e-4).with_weight_decay(0.01).init();
    for step in 0..STEPS {
        let (x, y) = batch::<B>(step, 0..GLOBAL_BATCH, &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = optim.step(LR, model, grads);
    }
    values::<B, _>(&model)
}

/// One micro-batch's gradients, scaled by 1/`GAS` for the accumulator: from `checkpointed_grads`
/// with `ac`, or from the whole model's `backward` without.
fn micro_grads(
    model: &UnitNet<B>,
    batch: (Tensor<B, 2>, Tensor<B, 2>),
    ac: Option<&ActivationCheckpointing>,
) -> GradientsParams {
    match ac {
        Some(setting) => {
            let (_, grads) = checkpointed_grads(model, &batch, setting, 1.0 / GAS as f32).expect("checkpointed");
            grads
        }
        None => {
            let loss = model.loss(batch.0, batch.1).div_scalar(GAS as f32);
            GradientsParams::from_grads(loss.backward(), model)
        }
    }
}

/// Trains `UnitNet` through `initialize_settings` on `world` rank threads (`GAS` micro-batches
/// per step), each rank on its own slice of the global batch; `ac` waits at its boundaries on
/// the rank's data-parallel group.
fn run(stage: Stage, world: usize, ac: Option<ActivationCheckpointing>) -> Vec<Vec<f32>> {
    let results = on_ranks(world, move |rank, group| {
        let device = Default::default();
        let units: UnitComm<burn::backend::Flex> = Arc::new(HostStaged::new(group.clone()));
        let ac = ac.clone().map(|ac| ActivationCheckpointing {
            boundary_group: Some(group.clone()),
            ..ac
        });
        let (mut model, mut optim) =
            zero_burn::initialize_settings(settings(stage), UnitNet::<B>::new(&device, BLOCKS), group, units)
                .expect("initialize");
        let per_micro = GLOBAL_BATCH / world / GAS;
        for step in 0..STEPS {
            let mut accumulator = GradientsAccumulator::new();
            for micro in 0..GAS {
                let start = (rank * GAS + micro) * per_micro;
                let grads = micro_grads(&model, batch::<B>(step, start..start + per_micro, &device), ac.as_ref());
                accumulator.accumulate(&model, grads);
            }
            model = optim.try_step(LR, model, accumulator.grads()).expect("step");
        }
        model.weights()
    });
    results.into_iter().next().unwrap_or_default()
}

fn variants() -> Vec<(&'static str, ActivationCheckpointing)> {
    vec![
        ("every block", ActivationCheckpointing::default()),
        (
            "1 checkpoint",
            ActivationCheckpointing {
                number_checkpoints: Some(1),
                ..Default::default()
            },
        ),
        (
            "2 checkpoints, on the host",
            ActivationCheckpointing {
                number_checkpoints: Some(2),
                cpu_checkpointing: true,
                synchronize_checkpoint_boundary: true,
                ..Default::default()
            },
        ),
    ]
}

#[test]
fn checkpointing_gives_the_same_weights_at_every_stage() {
    let want = reference();
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for world in [1, 2] {
            let plain = run(stage, world, None);
            for (label, ac) in variants() {
                let got = run(stage, world, Some(ac));
                assert_close(
                    &format!("{label}, stage {stage:?}, world {world} against plain Burn"),
                    &got,
                    &want,
                    1e-6,
                );
                assert!(
                    got == plain,
                    "{label}, stage {stage:?}, world {world}: not bitwise the unchecked run"
                );
            }
        }
    }
}

#[test]
fn partitioned_checkpoints_are_split_and_gathered_back() {
    // Two ranks that compute the same activation (as tensor-parallel ranks do), each with its own
    // one-rank data-parallel group, share a 2-rank group to split checkpoints in.
    let want = reference();
    for stage in [Stage::Zero0, Stage::Zero3] {
        let pieces = ThreadGroup::new_group(2).expect("group");
        let handles: Vec<_> = pieces
            .into_iter()
            .map(|piece_group| {
                std::thread::spawn(move || {
                    let dp = ThreadGroup::new_group(1).expect("group").remove(0) as SharedGroup;
                    let ac = ActivationCheckpointing {
                        number_checkpoints: Some(2),
                        partition_group: Some(piece_group as SharedGroup),
                        ..Default::default()
                    };
                    let device = Default::default();
                    let units: UnitComm<burn::backend::Flex> = Arc::new(HostStaged::new(dp.clone()));
                    let (mut model, mut optim) =
                        zero_burn::initialize_settings(settings(stage), UnitNet::<B>::new(&device, BLOCKS), dp, units)
                            .expect("initialize");
                    for step in 0..STEPS {
                        let mut accumulator = GradientsAccumulator::new();
                        for micro in 0..GAS {
                            let rows = micro * GLOBAL_BATCH / GAS..(micro + 1) * GLOBAL_BATCH / GAS;
                            let grads = micro_grads(&model, batch::<B>(step, rows, &device), Some(&ac));
                            accumulator.accumulate(&model, grads);
                        }
                        model = optim.try_step(LR, model, accumulator.grads()).expect("step");
                    }
                    model.weights()
                })
            })
            .collect();
        for h in handles {
            let got = h.join().expect("rank");
            assert_close(&format!("stage {stage:?} against plain Burn"), &got, &want, 1e-6);
        }
    }
}

/// Every gradient of `model` in `grads`, flattened, in visit order (empty where there is none).
fn grad_values<M: AutodiffModule<B>>(model: &M, grads: &GradientsParams) -> Vec<Vec<f32>> {
    struct Collect<'a>(&'a GradientsParams, Vec<Vec<f32>>);
    impl ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let g = self.0.get::<<B as AutodiffBackend>::InnerBackend, D>(p.id);
            self.1.push(g.map(zero_burn::params::tensor_to_vec).unwrap_or_default());
        }
    }
    let mut c = Collect(grads, Vec::new());
    model.visit(&mut c);
    c.1
}

#[test]
fn checkpointed_grads_equal_plain_backward() {
    let device = Default::default();
    let model = Net::<B>::new(&device, BLOCKS);
    let (x, y) = batch::<B>(0, 0..GLOBAL_BATCH, &device);
    let loss = model.loss(x.clone(), y.clone());
    let want_loss = loss.clone().into_scalar();
    let want = grad_values(&model, &GradientsParams::from_grads(loss.backward(), &model));
    assert!(want.iter().all(|g| !g.is_empty()), "every parameter has a gradient");
    for (count, cpu) in [
        (None, false),
        (Some(1), false),
        (Some(2), true),
        (Some(BLOCKS + 3), false),
    ] {
        let setting = ActivationCheckpointing {
            number_checkpoints: count,
            cpu_checkpointing: cpu,
            ..Default::default()
        };
        let (value, grads) = checkpointed_grads(&model, &(x.clone(), y.clone()), &setting, 1.0).expect("grads");
        assert_eq!(value, want_loss, "{count:?}: the loss");
        let got = grad_values(&model, &grads);
        assert_close(
            &format!("{count:?} checkpoints (host: {cpu}): gradients vs plain backward"),
            &got,
            &want,
            1e-6,
        );
    }
    // A loss scale (fp16's) scales the gradients, not the loss returned.
    let (value, grads) = checkpointed_grads(
        &model,
        &(x.clone(), y.clone()),
        &ActivationCheckpointing::default(),
        8.0,
    )
    .expect("grads");
    assert_eq!(value, want_loss, "scaled: the loss");
    let scaled: Vec<Vec<f32>> = want.iter().map(|g| g.iter().map(|v| v * 8.0).collect()).collect();
    assert_close("scaled by 8", &grad_values(&model, &grads), &scaled, 1e-6);
}

#[test]
fn zero_checkpoints_is_an_error_naming_the_key() {
    let err = zero_burn::segments(4, Some(0)).expect_err("0 checkpoints");
    assert!(err.to_string().contains("number_checkpoints"), "{err}");
    let cut = zero_burn::segments(5, Some(2)).expect("segments");
    assert_eq!(cut, vec![0..3, 3..5]);
    assert_eq!(zero_burn::segments(3, None).expect("segments"), vec![0..1, 1..2, 2..3]);
    assert_eq!(zero_burn::segments(2, Some(7)).expect("segments"), vec![0..1, 1..2]);
}

/// Block calls, counted by [`Counted`].
static BLOCK_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// [`Net`] with its block calls counted.
#[derive(burn::module::Module, Debug)]
struct Counted<B: burn::tensor::backend::Backend> {
    net: Net<B>,
}

impl<B: AutodiffBackend> ChainModel<B> for Counted<B> {
    type Batch = <Net<B> as ChainModel<B>>::Batch;
    type Hidden = Tensor<B, 2>;
    type Ends = Ends<B>;
    type Block = Block<B>;
    fn into_parts(self) -> (Ends<B>, Vec<Block<B>>) {
        self.net.into_parts()
    }
    fn from_parts(ends: Ends<B>, blocks: Vec<Block<B>>) -> Self {
        Counted {
            net: Net::from_parts(ends, blocks),
        }
    }
    fn embed(ends: &Ends<B>, batch: &Self::Batch) -> Tensor<B, 2> {
        Net::embed(ends, batch)
    }
    fn block_forward(block: &Block<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        BLOCK_CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Net::block_forward(block, x)
    }
    fn head_loss(ends: &Ends<B>, h: Tensor<B, 2>, batch: &Self::Batch) -> Tensor<B, 1> {
        Net::head_loss(ends, h, batch)
    }
}

#[test]
fn checkpointed_blocks_run_twice() {
    // Reference: the definition. Forward runs every block once without a graph; backward reruns
    // every block once from its segment's checkpoint, however the blocks are cut.
    use std::sync::atomic::Ordering::SeqCst;
    let device = Default::default();
    let model = Counted {
        net: Net::<B>::new(&device, BLOCKS),
    };
    for count in [None, Some(1), Some(2), Some(BLOCKS)] {
        let setting = ActivationCheckpointing {
            number_checkpoints: count,
            ..Default::default()
        };
        BLOCK_CALLS.store(0, SeqCst);
        checkpointed_grads(&model, &batch::<B>(0, 0..4, &device), &setting, 1.0).expect("grads");
        assert_eq!(BLOCK_CALLS.load(SeqCst), 2 * BLOCKS, "{count:?} checkpoints");
    }
}

#[test]
fn the_config_section_turns_checkpointing_on() {
    use zero_core::config::DeepSpeedConfig;
    let settings_of = |text: &str| {
        let config = DeepSpeedConfig::from_str(text, "test.json").expect("config").config;
        let resolved = zero_burn::resolve(&config, 2, &Default::default()).expect("resolve");
        zero_burn::engine_settings(&resolved).expect("settings")
    };
    let off = settings_of(r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}"#);
    assert!(off.activation_checkpointing.is_none(), "no section, no checkpointing");
    let on = settings_of(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "activation_checkpointing": {"number_checkpoints": 3,
            "cpu_checkpointing": true, "partition_activations": true}}"#,
    );
    let ac = on.activation_checkpointing.expect("section present");
    assert_eq!(ac.number_checkpoints, Some(3));
    assert!(ac.cpu_checkpointing);
    assert!(
        ac.partition_group.is_none(),
        "the caller names the tensor-parallel group"
    );
}

#[test]
fn a_checkpoint_kept_on_the_host_comes_back_in_its_own_dtype() {
    // Reference: the activation itself. A bf16 model's checkpoint came back as the device's
    // default float (f32), which the next block's bf16 weights then refused.
    use zero_burn::Hidden;
    let device = Default::default();
    let values: Vec<f32> = (0..12).map(|i| 0.37 * i as f32 - 1.5).collect();
    for dtype in [
        burn::tensor::DType::BF16,
        burn::tensor::DType::F16,
        burn::tensor::DType::F32,
    ] {
        let h = Tensor::<B, 1>::from_floats(values.as_slice(), &device)
            .reshape([3, 4])
            .cast(dtype);
        let back = <Tensor<B, 2> as Hidden<B>>::from_host(h.to_host(), &device);
        assert_eq!(back.dtype(), dtype);
        assert_eq!(back.into_data(), h.clone().into_data(), "{dtype:?}");
        assert_eq!(h.bytes(), 12 * dtype.size(), "{dtype:?}");
    }
}
