//! What the mixed-precision tests share: 16-bit settings, a training run of the common `Net`
//! with each block a `ZeroModule` (`UnitNet`, `ZeroOptimizer` in Burn's own loop) with an
//! optional poisoned micro-batch, and a process group that records what each collective moved.

#![allow(dead_code)]

use crate::common::*;
use burn::tensor::DType;
use std::sync::{Arc, Mutex};
use zero_burn::{EngineSettings, PrecisionSettings, Stage, StepReport, ZeroError};
use zero_core::comm::{CommError, FlatBuffer, ProcessGroup, ReduceOp, Work};
use zero_core::optim::OptimizerSpec;

pub const LR: f64 = 0.01;

/// AdamW with eps 1e-4 (see exactness.rs for why not 1e-8).
pub fn adamw() -> OptimizerSpec {
    adamw_eps4(LR)
}

/// AdamW with buckets of 100 elements (several per step at stages 1-2) and a persistence
/// threshold of 13 elements (every block of `UnitNet` is larger: all are cut at stage 3), with
/// `precision`.
pub fn settings(stage: Stage, gas: usize, precision: PrecisionSettings) -> EngineSettings {
    let mut s = EngineSettings::new(stage, adamw());
    s.gradient_accumulation_steps = gas;
    s.reduce_bucket_size = 100;
    s.param_persistence_threshold = 13;
    s.prefetch_bucket_size = 400;
    s.precision = precision;
    s
}

/// This rank's rows of micro-batch `micro` (the global batch split in order across ranks, then
/// across micro-batches).
pub fn rows(rank: usize, world: usize, micro: usize, gas: usize) -> std::ops::Range<usize> {
    let per_rank = GLOBAL_BATCH / world;
    let per_micro = per_rank / gas;
    let start = rank * per_rank + micro * per_micro;
    start..start + per_micro
}

/// A poisoned micro-batch: at optimizer step `step` (0-based), rank `rank`'s inputs are all
/// `value` (a huge value overflows fp16; NaN breaks any dtype).
#[derive(Clone, Copy, Debug)]
pub struct Poison {
    pub step: usize,
    pub rank: usize,
    pub value: f32,
}

/// What one rank saw.
#[derive(Debug)]
pub struct RankRun {
    /// Per step: the mean micro-batch loss, and the step's report or error text.
    pub losses: Vec<f32>,
    pub steps: Vec<Result<StepReport, String>>,
    /// The model's parameter values after each step (in the model's dtype, read as f32).
    pub values: Vec<Vec<Vec<f32>>>,
}

/// What a run trains on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Data {
    /// A new global batch every step (targets the model cannot predict from the inputs).
    PerStep,
    /// The batch of step 0 every step, with targets a linear function of the inputs: a loss
    /// the model can drive to zero.
    Fit,
}

/// No wrapping.
pub fn plain(group: Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup> {
    group
}

/// The dtypes of the parameters of the model `initialize_settings` gives back (one rank): of a
/// replicated layer (the input layer) and of a unit's gathered block.
pub fn param_dtypes(settings: &EngineSettings) -> [DType; 2] {
    let device = Default::default();
    let group: Arc<dyn ProcessGroup> = zero_core::comm::ThreadGroup::new_group(1).expect("group").remove(0);
    let units: zero_burn::sharded::UnitComm<burn::backend::Flex> = Arc::new(zero_burn::HostStaged::new(group.clone()));
    let (model, _) = zero_burn::initialize_settings(settings.clone(), UnitNet::<B>::new(&device, 1), group, units)
        .expect("initialize");
    let block = model.blocks[0].gathered().expect("gather");
    [model.ends.input.weight.val().dtype(), block.up.weight.val().dtype()]
}

/// One collective as a rank issued it.
#[derive(Clone, Debug, PartialEq)]
pub struct Issued {
    pub op: &'static str,
    pub dtype: zero_core::comm::DType,
    pub bytes: usize,
}

/// A process group that records every collective it is asked for, then runs it on `inner`.
#[derive(Debug)]
pub struct Recording {
    pub inner: Arc<dyn ProcessGroup>,
    pub log: Arc<Mutex<Vec<Issued>>>,
}

impl Recording {
    fn note(&self, op: &'static str, b: &FlatBuffer) {
        let issued = Issued {
            op,
            dtype: b.dtype(),
            bytes: b.byte_len(),
        };
        self.log.lock().unwrap_or_else(|e| e.into_inner()).push(issued);
    }
}

impl ProcessGroup for Recording {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_async(&self, buffer: FlatBuffer, op: ReduceOp) -> Work<FlatBuffer> {
        self.note("all_reduce", &buffer);
        self.inner.all_reduce_async(buffer, op)
    }
    fn reduce_scatter_async(&self, input: FlatBuffer, op: ReduceOp) -> Work<FlatBuffer> {
        self.note("reduce_scatter", &input);
        self.inner.reduce_scatter_async(input, op)
    }
    fn all_gather_async(&self, shard: FlatBuffer) -> Work<FlatBuffer> {
        self.note("all_gather", &shard);
        self.inner.all_gather_async(shard)
    }
    fn broadcast_async(&self, buffer: FlatBuffer, root: usize) -> Work<FlatBuffer> {
        self.note("broadcast", &buffer);
        self.inner.broadcast_async(buffer, root)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }
}

/// Trains `UnitNet` (3 blocks) for `steps` optimizer steps on `world` ranks, stopping a rank at
/// its first failed step: the model and `ZeroOptimizer` from `initialize_settings` in Burn's own
/// loop (Burn's `GradientsAccumulator` over `settings.gradient_accumulation_steps`
/// micro-batches, the optimizer's loss scale and LR schedule), the state in host buffers
/// (`host`) or as tensors.
pub fn train_zero(
    settings: EngineSettings,
    world: usize,
    steps: usize,
    poison: Vec<Poison>,
    host: bool,
) -> Vec<RankRun> {
    train_zero_on(settings, world, steps, poison, host, Data::PerStep, plain)
}

/// [`train_zero`] on the given data, each rank's process group wrapped by `wrap`.
pub fn train_zero_on(
    settings: EngineSettings,
    world: usize,
    steps: usize,
    poison: Vec<Poison>,
    host: bool,
    data: Data,
    wrap: impl Fn(Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup> + Send + Sync + 'static,
) -> Vec<RankRun> {
    use burn::optim::lr_scheduler::LrScheduler;
    use burn::optim::{GradientsAccumulator, GradientsParams};
    use burn::tensor::ElementConversion;
    on_ranks(world, move |rank, group| {
        let group = wrap(group);
        let device = Default::default();
        let gas = settings.gradient_accumulation_steps;
        let dtype = settings.precision.dtype.burn();
        let mut s = settings.clone();
        s.gradient_accumulation_steps = 1;
        let units: zero_burn::sharded::UnitComm<burn::backend::Flex> =
            Arc::new(zero_burn::HostStaged::new(group.clone()));
        let (mut model, optim) =
            zero_burn::initialize_settings(s, UnitNet::<B>::new(&device, 3), group, units).expect("initialize");
        let mut optim = optim.with_tensor_state(!host);
        let mut lr = optim.lr_scheduler();
        let mut run = RankRun {
            losses: Vec::new(),
            steps: Vec::new(),
            values: Vec::new(),
        };
        for step in 0..steps {
            let mut loss_sum = 0.0;
            let mut accumulator = GradientsAccumulator::new();
            for micro in 0..gas {
                let data_step = if data == Data::Fit { 0 } else { step };
                let (mut x, mut y) = batch::<B>(data_step, rows(rank, world, micro, gas), &device);
                if data == Data::Fit {
                    y = x.clone().narrow(1, 0, OUT).mul_scalar(0.8);
                }
                if let Some(p) = poison.iter().find(|p| p.step == step && p.rank == rank) {
                    x = x.zeros_like().add_scalar(p.value);
                }
                let loss = model.loss(x.cast(dtype), y.cast(dtype));
                let value = loss.clone().into_scalar().elem::<f32>();
                optim.note_loss(value as f64);
                loss_sum += value;
                let scaled = optim.scale_loss(loss.div_scalar(gas as f32));
                accumulator.accumulate(&model, GradientsParams::from_grads(scaled.backward(), &model));
            }
            run.losses.push(loss_sum / gas as f32);
            let rate = lr.step();
            match optim.try_step(rate, model.clone(), accumulator.grads()) {
                Ok(next) => {
                    model = next;
                    run.steps.push(Ok(optim.last_step().expect("a step")));
                }
                Err(e) => {
                    run.steps.push(Err(e.to_string()));
                    assert!(
                        matches!(e, ZeroError::NonFinite { .. } | ZeroError::LossScale { .. }),
                        "{e}"
                    );
                    break;
                }
            }
            assert_eq!(optim.tensor_state(), Some(!host), "where the state lives");
            run.values.push(model.weights());
        }
        run
    })
}
