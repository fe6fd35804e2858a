//! The collectives the device engine calls at each stage, counted per micro-batch and per step
//! through a recording `DeviceCollective`.

mod common;

use common::*;
use std::sync::Arc;
use zero_burn::{DeviceCollective, DeviceEngine, EngineSettings, HostStaged, PrecisionSettings, Stage, ZeroError};

const BLOCKS: usize = 3;

fn settings(stage: Stage, gas: usize, clip: f64, precision: PrecisionSettings) -> EngineSettings {
    small_bucket_settings(stage, gas, clip, precision)
}

/// Records every collective the engine calls, then runs it through `HostStaged`.
#[derive(Debug)]
struct Counting {
    inner: HostStaged,
    log: std::sync::Mutex<Vec<(&'static str, usize)>>,
}

type Inner = burn::backend::Flex;

impl Counting {
    fn note(&self, op: &'static str, len: usize) {
        self.log.lock().expect("log").push((op, len));
    }
    fn take(&self) -> Vec<(&'static str, usize)> {
        std::mem::take(&mut *self.log.lock().expect("log"))
    }
}

impl DeviceCollective<Inner> for Counting {
    fn rank(&self) -> usize {
        DeviceCollective::<Inner>::rank(&self.inner)
    }
    fn world_size(&self) -> usize {
        DeviceCollective::<Inner>::world_size(&self.inner)
    }
    fn all_reduce(
        &self,
        t: burn::tensor::Tensor<Inner, 1>,
        op: zero_core::comm::ReduceOp,
    ) -> Result<burn::tensor::Tensor<Inner, 1>, ZeroError> {
        self.note("all_reduce", t.dims()[0]);
        self.inner.all_reduce(t, op)
    }
    fn reduce_scatter(
        &self,
        t: burn::tensor::Tensor<Inner, 1>,
        op: zero_core::comm::ReduceOp,
    ) -> Result<burn::tensor::Tensor<Inner, 1>, ZeroError> {
        self.note("reduce_scatter", t.dims()[0]);
        self.inner.reduce_scatter(t, op)
    }
    fn all_gather(&self, t: burn::tensor::Tensor<Inner, 1>) -> Result<burn::tensor::Tensor<Inner, 1>, ZeroError> {
        self.note("all_gather", t.dims()[0]);
        self.inner.all_gather(t)
    }
    fn broadcast(
        &self,
        t: burn::tensor::Tensor<Inner, 1>,
        root: usize,
    ) -> Result<burn::tensor::Tensor<Inner, 1>, ZeroError> {
        self.note("broadcast", t.dims()[0]);
        self.inner.broadcast(t, root)
    }
    fn all_reduce_scalars(&self, v: &mut [f32], op: zero_core::comm::ReduceOp) -> Result<(), ZeroError> {
        self.note("scalars", v.len());
        DeviceCollective::<Inner>::all_reduce_scalars(&self.inner, v, op)
    }
}

#[test]
fn each_stage_communicates_as_zero_prescribes() {
    // Reference: the ZeRO paper's schedule, counted per group of the layout. Stage 0
    // all-reduces whole groups at the boundary; stage 1 reduce-scatters them there and
    // all-gathers the updated shards; stage 2 reduce-scatters every micro-batch. Sizes: the
    // padded group for reductions, the shard (padded / world) for gathers.
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        let logs = on_ranks(2, move |rank, group| {
            let device = Default::default();
            let counting = Arc::new(Counting {
                inner: HostStaged::new(group),
                log: Default::default(),
            });
            let comm: Arc<dyn DeviceCollective<Inner>> = counting.clone();
            let s = settings(stage, 2, 0.05, PrecisionSettings::fp32());
            let mut engine = DeviceEngine::<B, _>::new(s, Net::<B>::new(&device, BLOCKS), comm).expect("engine");
            let padded: Vec<usize> = engine.layout().groups.iter().map(|g| g.padded).collect();
            let construction = counting.take();
            let mut per_micro = Vec::new();
            for micro in 0..2 {
                let (x, y) = batch::<B>(0, rows(rank, 2, micro, 2), &device);
                let loss = engine.forward(|m| m.loss(x, y));
                engine.backward(loss).expect("backward");
                per_micro.push(counting.take());
            }
            engine.step().expect("step");
            (padded, construction, per_micro, counting.take())
        });
        let (padded, construction, per_micro, at_step) = &logs[0];
        let each = |op: &'static str, len: &dyn Fn(usize) -> usize| -> Vec<(&'static str, usize)> {
            padded.iter().map(|&p| (op, len(p))).collect()
        };
        assert_eq!(
            construction,
            &each("broadcast", &|p| p),
            "{stage:?}: rank 0's weights, group by group"
        );
        let scatter_now = each("reduce_scatter", &|p| p);
        let mut want_step = match stage {
            Stage::Zero0 => each("all_reduce", &|p| p),
            Stage::Zero1 => scatter_now.clone(),
            _ => Vec::new(),
        };
        // One scalar to agree on a non-finite loss or gradient (fp32 fails such a step), one
        // for the gradient norm.
        want_step.extend([("scalars", 1), ("scalars", 1)]);
        if stage != Stage::Zero0 {
            want_step.extend(each("all_gather", &|p| p / 2));
        }
        for (micro, log) in per_micro.iter().enumerate() {
            let want = if stage == Stage::Zero2 {
                scatter_now.clone()
            } else {
                Vec::new()
            };
            assert_eq!(log, &want, "{stage:?}: micro-batch {micro}");
        }
        assert_eq!(at_step, &want_step, "{stage:?}: the step");
    }
}
