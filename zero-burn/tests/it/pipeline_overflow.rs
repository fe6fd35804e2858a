//! fp16's overflow decided over every stage: a two-layer pipeline built so that only stage 0's
//! weight gradient overflows (it sums a large input times the incoming gradient), while the
//! activation gradient stage 1 sends back and stage 1's own weight gradient stay finite. Every
//! stage must skip the same steps with the same loss scales; a stage deciding alone would apply
//! a step its neighbour skips, and the two would part ways (or wait on each other forever).
//!
//! Reference: the fp16 arithmetic by hand. Per micro-batch, with loss scale S, input x = 30000
//! on a 4 × 4 batch, w = 1e-3 and v = 1: stage 0's dw = 4 · 30000 · S / 16 = 7500 S overflows
//! fp16 (65504) for S ≥ 16; stage 1's dv = 4 · 30 · S / 16 = 7.5 S, and the gradient it sends,
//! S / 16, stay finite for S < 8192. From S = 2^10 the scale halves on each overflow (hysteresis
//! 1): steps at 1024, 512, …, 16 are skipped on both stages, and the step at 8 applies.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::prelude::*;
use std::sync::mpsc;
use std::time::Duration;
use zero_burn::pipeline::{PartitionMethod, PipeLayer, PipelineEngine, PipelineModule};
use zero_burn::{EngineSettings, PrecisionSettings, Stage, StepReport};
use zero_core::loss_scaler::LossScalerConfig;
use zero_core::optim::{OptimizerSpec, SgdSpec};
use zero_core::parallel::ParallelLayout;

type AB = Autodiff<Flex>;

const N: usize = 4;

/// A weight vector, multiplied into each row.
#[derive(Module, Debug)]
struct Weight<B: Backend> {
    w: Param<Tensor<B, 1>>,
}

/// The input layer (`h = x ⊙ w`) and the loss layer (`mean(h ⊙ v)`).
#[derive(Module, Debug)]
enum Toy<B: Backend> {
    Input(Weight<B>),
    Loss(Weight<B>),
}

impl Toy<AB> {
    fn weight(&self) -> Tensor<AB, 2> {
        match self {
            Toy::Input(w) | Toy::Loss(w) => w.w.val().unsqueeze::<2>(),
        }
    }
}

impl PipeLayer<AB> for Toy<AB> {
    type Batch = Tensor<AB, 2>;
    type Hidden = Tensor<AB, 2>;

    fn input(&self, x: &Tensor<AB, 2>) -> Tensor<AB, 2> {
        let w = self.weight();
        x.clone().cast(w.dtype()) * w
    }
    fn forward(&self, x: Tensor<AB, 2>) -> Tensor<AB, 2> {
        x
    }
    fn loss(&self, h: Tensor<AB, 2>, _: &Tensor<AB, 2>) -> Tensor<AB, 1> {
        (h * self.weight()).mean().reshape([1])
    }
}

fn layers(device: &Device<AB>) -> Vec<Toy<AB>> {
    let w = |v: f32| Weight {
        w: Param::from_tensor(Tensor::full([N], v, device)),
    };
    vec![Toy::Input(w(1e-3)), Toy::Loss(w(1.0))]
}

fn settings() -> EngineSettings {
    let mut s = EngineSettings::new(
        Stage::Zero0,
        OptimizerSpec::Sgd(SgdSpec {
            lr: 1e-6,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }),
    );
    s.precision = PrecisionSettings::fp16(LossScalerConfig {
        initial_scale_power: 10,
        hysteresis: 1,
        ..LossScalerConfig::default()
    });
    s
}

fn run_stage(groups: zero_core::parallel::RankGroups) -> Vec<StepReport> {
    let device = Default::default();
    let module =
        PipelineModule::from_layers::<AB>(layers(&device), 2, PartitionMethod::Uniform, groups.coords.pipeline)
            .expect("module");
    let mut engine = PipelineEngine::<AB, Toy<AB>>::new(settings(), module, &groups).expect("engine");
    let x = Tensor::<AB, 2>::full([N, N], 30000.0, &device);
    (0..8)
        .map(|_| engine.train_batch(std::slice::from_ref(&x)).expect("step").report)
        .collect()
}

#[test]
fn an_overflow_on_one_stage_skips_the_step_on_every_stage() {
    let (tx, rx) = mpsc::channel();
    for groups in ParallelLayout::with_pipeline(1, 1, 2).unwrap().threads().unwrap() {
        let tx = tx.clone();
        let stage = groups.coords.pipeline;
        // Detached: a stage left waiting on its neighbour must not hang the test.
        std::thread::spawn(move || {
            let _ = tx.send((stage, run_stage(groups)));
        });
    }
    let mut runs = vec![Vec::new(); 2];
    for _ in 0..2 {
        let (stage, reports) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("both stages finish their steps (a stage deciding alone waits on the other)");
        runs[stage] = reports;
    }
    let pattern = |r: &[StepReport]| r.iter().map(|r| (r.skipped, r.loss_scale)).collect::<Vec<_>>();
    let want: Vec<(bool, f64)> = [1024.0, 512.0, 256.0, 128.0, 64.0, 32.0, 16.0]
        .into_iter()
        .map(|s| (true, s))
        .chain([(false, 8.0)])
        .collect();
    for (stage, reports) in runs.iter().enumerate() {
        assert_eq!(pattern(reports), want, "stage {stage}: skipped steps and loss scales");
    }
}
