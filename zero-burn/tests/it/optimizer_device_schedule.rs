//! The collectives `ZeroOptimizer`'s device state calls at each stage, counted per micro-batch
//! and per step through a recording `DeviceCollective` handed over with `with_collective`.
//!
//! Reference: the ZeRO paper's schedule, counted per flat group of ZeRO's bucketed layout at the
//! same settings (built here with zero-core's `LayoutBuilder`: buckets of about
//! `reduce_bucket_size` elements in visit order). Stage 0 all-reduces
//! whole groups; stages 1 and 2 reduce-scatter them and all-gather the updated shards. Burn's
//! `GradientsAccumulator` sums the micro-batches' gradients before the optimizer sees them, so
//! no micro-batch communicates and stages 1 and 2 communicate alike, once per step. Then two
//! scalar all-reduces: the agreement on a non-finite loss or gradient (unless the policy is
//! `Ignore` without a loss scaler), and the sum of the sharded groups' squares for the norm
//! (none on a step fp16's loss scaler skips, and none at stage 0, where no group is sharded).
//! Sizes: the padded group for reductions, the shard (padded / world) for gathers; dtypes: the
//! communication dtype for reductions, the compute dtype for gathers. At world size 1 nothing is
//! called.

use crate::common;
use common::counting::{Call, Counting};

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::DType;
use common::*;
use std::sync::Arc;
use zero_burn::{
    ComputeDtype, DeviceCollective, EngineSettings, HostStaged, NonFinitePolicy, PrecisionSettings, Stage,
    ZeroOptimizer,
};

const BLOCKS: usize = 3;
const GAS: usize = 2;

type Inner = burn::backend::Flex;

/// The padded length of each flat group as ZeRO buckets `Net`'s parameters at `settings` over
/// `world` ranks: in visit order, in buckets of about `reduce_bucket_size` elements, replicated
/// at stage 0 and sharded (padded to a multiple of `world` × `alignment`) at stages 1-2.
fn padded_groups(settings: &EngineSettings, world: usize) -> Vec<usize> {
    use zero_core::partition::{LayoutBuilder, Placement};
    let specs: Vec<_> = zero_burn::params::describe::<B, _>(&Net::<B>::new(&Default::default(), BLOCKS))
        .into_iter()
        .map(|(_, spec)| spec)
        .collect();
    let all: Vec<usize> = (0..specs.len()).collect();
    let placement = match settings.stage {
        Stage::Zero0 => Placement::Replicated,
        _ => Placement::Sharded,
    };
    let mut builder = LayoutBuilder::new(specs, world, settings.alignment);
    builder.buckets(&all, settings.reduce_bucket_size, placement);
    let layout = builder.finish();
    let numel: usize = layout.groups.iter().map(|g| g.numel).sum();
    assert_eq!(numel, psi(BLOCKS), "every parameter in one group");
    layout.groups.iter().map(|g| g.padded).collect()
}

/// What rank 0's recording collective saw over two steps of `settings` on `world` ranks: the
/// padded size of each group ([`padded_groups`]), then each micro-batch's calls (two per
/// step) and each step's.
struct Seen {
    padded: Vec<usize>,
    micro: Vec<Vec<Call>>,
    steps: Vec<Vec<Call>>,
    skipped: Vec<bool>,
}

fn record(settings: EngineSettings, world: usize) -> Seen {
    on_ranks(world, |rank, group| {
        let device = Default::default();
        let padded = padded_groups(&settings, world);
        let counting = Arc::new(Counting::new(HostStaged::new(group.clone())));
        let collective: Arc<dyn DeviceCollective<Inner>> = counting.clone();
        let mut optim = ZeroOptimizer::new(settings.clone(), group)
            .expect("optimizer")
            .with_collective(collective);
        let dtype = settings.precision.dtype.burn();
        let mut model = optim
            .synchronize::<B, _>(Net::<B>::new(&device, BLOCKS))
            .expect("synchronize");
        let (mut micro_logs, mut steps, mut skipped) = (vec![counting.take()], Vec::new(), Vec::new());
        for step in 0..2 {
            let mut accumulator = GradientsAccumulator::new();
            for micro in 0..GAS {
                let (x, y) = batch::<B>(step, rows(rank, world, micro, GAS), &device);
                let loss = model.loss(x.cast(dtype), y.cast(dtype));
                let grads = optim.scale_loss(loss).div_scalar(GAS as f64).backward();
                accumulator.accumulate(&model, GradientsParams::from_grads(grads, &model));
                micro_logs.push(counting.take());
            }
            model = optim.try_step(0.01, model, accumulator.grads()).expect("step");
            steps.push(counting.take());
            skipped.push(optim.last_step().expect("a report").skipped);
        }
        assert_eq!(optim.tensor_state(), Some(true), "the device state ran");
        Seen {
            padded,
            micro: micro_logs,
            steps,
            skipped,
        }
    })
    .swap_remove(0)
}

/// The calls ZeRO prescribes for one step (see the header); `check`: the non-finite agreement.
fn prescribed(
    stage: Stage,
    padded: &[usize],
    world: usize,
    precision: &PrecisionSettings,
    check: bool,
    skipped: bool,
) -> Vec<Call> {
    let comm = precision.comm_dtype().burn();
    let compute = precision.dtype.burn();
    let reduce = if stage == Stage::Zero0 {
        "all_reduce"
    } else {
        "reduce_scatter"
    };
    let mut want: Vec<Call> = padded.iter().map(|&p| (reduce, p, comm)).collect();
    if check {
        want.push(("scalars", 1, DType::F32));
    }
    // A skipped step (fp16 overflow) computes no norm; at stage 0 every group is whole on
    // every rank, so there is no partial sum to add.
    if !skipped && stage != Stage::Zero0 {
        want.push(("scalars", 1, DType::F32));
    }
    if stage != Stage::Zero0 {
        want.extend(padded.iter().map(|&p| ("all_gather", p / world, compute)));
    }
    want
}

#[test]
fn each_stage_communicates_as_zero_prescribes() {
    let mut bf16_fp32_comm = PrecisionSettings::bf16();
    bf16_fp32_comm.communication_dtype = Some(ComputeDtype::F32);
    let mut unchecked = PrecisionSettings::fp32();
    unchecked.non_finite = NonFinitePolicy::Ignore;
    // An initial loss scale of 2^19 overflows the first two steps' fp16 gradients (asserted).
    let overflowing = PrecisionSettings::fp16(zero_core::loss_scaler::LossScalerConfig {
        initial_scale_power: 19,
        hysteresis: 1,
        ..Default::default()
    });
    // (precision, the non-finite agreement is called, the two steps are skipped)
    let cases = [
        (PrecisionSettings::fp32(), true, false),
        (PrecisionSettings::bf16(), true, false),
        (bf16_fp32_comm, true, false),
        (PrecisionSettings::fp16(Default::default()), true, false),
        (overflowing, true, true),
        (unchecked, false, false),
    ];
    for (precision, check, skipped) in cases {
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
            let label = format!("{stage:?}, {precision:?}");
            let seen = record(small_bucket_settings(stage, GAS, 0.05, precision.clone()), 2);
            assert!(seen.padded.len() > 2, "{label}: several groups: {:?}", seen.padded);
            for (i, log) in seen.micro.iter().enumerate() {
                assert_eq!(
                    log,
                    &Vec::new(),
                    "{label}: synchronize and micro-batch {i} call nothing"
                );
            }
            assert_eq!(seen.skipped, [skipped; 2], "{label}: skipped steps");
            let want = prescribed(stage, &seen.padded, 2, &precision, check, skipped);
            for (step, log) in seen.steps.iter().enumerate() {
                assert_eq!(log, &want, "{label}: step {}", step + 1);
            }
        }
    }
    println!(
        "groups: {:?}",
        record(
            small_bucket_settings(Stage::Zero1, GAS, 0.05, PrecisionSettings::fp32()),
            2
        )
        .padded
    );
}

#[test]
fn one_rank_calls_no_collective() {
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        let seen = record(small_bucket_settings(stage, GAS, 0.05, PrecisionSettings::fp32()), 1);
        for log in seen.micro.iter().chain(&seen.steps) {
            assert_eq!(log, &Vec::new(), "{stage:?}");
        }
    }
}
