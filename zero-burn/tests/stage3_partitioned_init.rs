//! Partitioned construction (`ChainEngine::new_partitioned`, DeepSpeed's `zero.Init`).
//!
//! Reference: `ChainEngine::new` on the whole model, randomly initialized from the same seed,
//! at the same world size. The two engines must hold the same layout and the same values, bit
//! for bit, and train to the same weights.

mod common;

use burn::nn::LinearConfig;
use burn::tensor::backend::Backend;
use common::{batch, on_ranks, values, Block, Ends, Net, B, GLOBAL_BATCH, HIDDEN, IN, OUT};
use std::sync::Mutex;
use zero_burn::{ChainEngine, ComputeDtype, EngineSettings, InitValues, PrecisionSettings, Stage};
use zero_core::optim::{AdamSpec, OptimizerSpec};

const BLOCKS: usize = 4;
const SEED: u64 = 20261121;

/// Burn's CPU generator is one per process: tests that draw from it must not interleave.
static RNG: Mutex<()> = Mutex::new(());

fn settings(stage: Stage, dtype: ComputeDtype) -> EngineSettings {
    let mut s = EngineSettings::new(
        stage,
        OptimizerSpec::Adam(AdamSpec {
            lr: 0.01,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled_weight_decay: true,
            bias_correction: true,
            amsgrad: false,
        }),
    );
    // Biases stay replicated, weights are sharded.
    s.param_persistence_threshold = 13;
    s.precision = match dtype {
        ComputeDtype::Bf16 => PrecisionSettings::bf16(),
        _ => PrecisionSettings::fp32(),
    };
    s
}

/// Lazily initialized parts (Burn's default initializers): values are drawn when first read.
fn ends<B: Backend>(device: &B::Device) -> Ends<B> {
    Ends {
        input: LinearConfig::new(IN, HIDDEN).init(device),
        head: LinearConfig::new(HIDDEN, OUT).init(device),
    }
}

fn block<B: Backend>(device: &B::Device) -> Block<B> {
    Block {
        up: LinearConfig::new(HIDDEN, 7).init(device),
        down: LinearConfig::new(7, HIDDEN).init(device),
    }
}

/// The whole model from `SEED`, its values drawn in the order `ChainEngine::new` reads them
/// (the ends, then each block).
fn whole_model() -> Net<B> {
    let device = Default::default();
    B::seed(&device, SEED);
    let net = Net {
        ends: ends(&device),
        blocks: (0..BLOCKS).map(|_| block(&device)).collect(),
    };
    // Materialize now, in one thread, so that every rank gets the same values.
    let _ = values::<B, _>(&net);
    net
}

/// Two steps of training on the engine, then every parameter's values (gathered).
fn train_and_read(engine: &mut ChainEngine<B, Net<B>>, rank: usize, world: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let device = Default::default();
    let initial = values::<B, _>(&engine.module().expect("gather"));
    let per_rank = GLOBAL_BATCH / world;
    for step in 0..2 {
        let rows = rank * per_rank..(rank + 1) * per_rank;
        let (x, y) = batch::<B>(step, rows, &device);
        let dtype = engine.compute_dtype().burn();
        let loss = engine.forward((x.cast(dtype), y.cast(dtype))).expect("forward");
        engine.backward(loss).expect("backward");
        engine.step().expect("step");
    }
    (initial, values::<B, _>(&engine.module().expect("gather")))
}

fn check(world: usize, dtype: ComputeDtype) {
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let whole = whole_model();
    let reference = on_ranks(world, move |rank, comm| {
        let mut engine = ChainEngine::new(settings(Stage::Zero3, dtype), whole.clone(), comm).expect("engine");
        let layout = engine.layout().clone();
        (layout, train_and_read(&mut engine, rank, world))
    });

    // Seeded once; only rank 0 materializes (draws) its parts, in the order ends, blocks.
    B::seed(&Default::default(), SEED);
    let partitioned = on_ranks(world, move |rank, comm| {
        let device = Default::default();
        let mut engine = ChainEngine::<B, Net<B>>::new_partitioned(
            settings(Stage::Zero3, dtype),
            ends(&device),
            BLOCKS,
            |_| block(&device),
            InitValues::RankZero,
            comm,
        )
        .expect("partitioned engine");
        let memory = engine.memory();
        let layout = engine.layout().clone();
        (layout, memory, train_and_read(&mut engine, rank, world))
    });

    for (rank, ((ref_layout, (ref_init, ref_trained)), (layout, memory, (init, trained)))) in
        reference.iter().zip(&partitioned).enumerate()
    {
        assert_eq!(layout, ref_layout, "world {world}, rank {rank}: the layouts differ");
        assert_eq!(init, ref_init, "world {world}, rank {rank}: initial values differ");
        assert_eq!(
            trained, ref_trained,
            "world {world}, rank {rank}: values after two steps differ"
        );
        // The rank keeps only its shard: its parameter bytes are its owned elements.
        let element = if dtype == ComputeDtype::F32 { 4 } else { 2 };
        assert_eq!(memory.parameters.current, layout.owned_numel() * element);
        assert_eq!(memory.gathered.current, 0);
    }
    // The values are random (not a constant fill that would pass any equality).
    let first = &partitioned[0].2 .0[0];
    assert!(first.iter().any(|&v| v != first[0]));
}

#[test]
fn equals_new_on_the_whole_model_at_world_1() {
    check(1, ComputeDtype::F32);
}

#[test]
fn equals_new_on_the_whole_model_at_world_2() {
    check(2, ComputeDtype::F32);
}

#[test]
fn equals_new_on_the_whole_model_at_world_4() {
    check(4, ComputeDtype::F32);
}

#[test]
fn equals_new_on_the_whole_model_under_bf16() {
    check(2, ComputeDtype::Bf16);
}

#[test]
fn stage_2_builds_the_whole_model_like_new() {
    // Stages 0-2 keep the whole model on every rank: the blocks are built and handed to `new`,
    // which materializes them on every rank (one rank here, so that no other thread draws).
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let whole = whole_model();
    let reference = values::<B, _>(&whole);
    B::seed(&Default::default(), SEED);
    let got = on_ranks(1, move |_, comm| {
        let device = Default::default();
        let mut engine = ChainEngine::<B, Net<B>>::new_partitioned(
            settings(Stage::Zero2, ComputeDtype::F32),
            ends(&device),
            BLOCKS,
            |_| block(&device),
            InitValues::RankZero,
            comm,
        )
        .expect("engine");
        values::<B, _>(&engine.module().expect("module"))
    });
    for v in got {
        assert_eq!(v, reference);
    }
}

#[test]
fn a_failing_block_constructor_names_the_block() {
    let err = on_ranks(1, |_, comm| {
        let device = Default::default();
        let built = ChainEngine::<B, Net<B>>::try_new_partitioned(
            settings(Stage::Zero3, ComputeDtype::F32),
            ends(&device),
            BLOCKS,
            |b| {
                if b == 2 {
                    Err(std::fmt::Error)
                } else {
                    Ok(block(&device))
                }
            },
            InitValues::Local,
            comm,
        );
        built.err().map(|e| e.to_string())
    });
    let message = err[0].clone().expect("block 2 fails");
    assert!(message.contains("block 2"), "{message}");
}
