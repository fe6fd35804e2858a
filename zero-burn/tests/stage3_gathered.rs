//! GatheredParameters: reading partitioned parameters whole, and writing one rank's change
//! into every rank's shard.
//!
//! Reference: the same edit applied to the single-process model ([`Net`]), whose loss the
//! engine's next forward must reproduce.

mod common;

use burn::tensor::backend::Backend;
use common::{batch, on_ranks, values, Net, B, GLOBAL_BATCH};
use half::bf16;
use zero_burn::params::write_values;
use zero_burn::{ChainEngine, EngineSettings, PrecisionSettings, Stage};
use zero_core::optim::{OptimizerSpec, SgdSpec};

const BLOCKS: usize = 3;
const TARGET: &str = "blocks.1.up.weight";
/// Index of TARGET in the whole model's visit order: 4 for the ends, 4 per block.
const TARGET_INDEX: usize = 4 + 4;

fn settings(stage: Stage) -> EngineSettings {
    let mut s = EngineSettings::new(
        stage,
        OptimizerSpec::Sgd(SgdSpec {
            lr: 0.1,
            ..Default::default()
        }),
    );
    // Biases stay replicated, weights are sharded (TARGET has 84 elements).
    s.param_persistence_threshold = 13;
    s
}

/// The reference: the single-process model with TARGET scaled by `factor`, and its loss on the
/// full batch of step 0.
fn reference(factor: f32) -> (Vec<Vec<f32>>, f32) {
    let device = Default::default();
    let net = Net::<B>::new(&device, BLOCKS);
    let mut vals = values::<B, _>(&net);
    vals[TARGET_INDEX].iter_mut().for_each(|v| *v *= factor);
    let net = write_values(net, &device, true, |i| vals[i].clone());
    let (x, y) = batch::<B>(0, 0..GLOBAL_BATCH, &device);
    let loss = net.loss(x, y).into_scalar();
    (vals, loss)
}

fn full_batch<Bk: Backend>() -> (burn::tensor::Tensor<Bk, 2>, burn::tensor::Tensor<Bk, 2>) {
    batch::<Bk>(0, 0..GLOBAL_BATCH, &Default::default())
}

fn assert_close(got: f32, want: f32, what: &str) {
    let err = ((got - want) / want).abs();
    assert!(err <= 1e-6, "{what}: {got} vs {want} (relative error {err:e})");
}

fn scale_on_rank_one(stage: Stage, world: usize) {
    let (want_values, want_loss) = reference(2.0);
    let results = on_ranks(world, move |rank, comm| {
        let device = Default::default();
        let mut engine = ChainEngine::new(settings(stage), Net::<B>::new(&device, BLOCKS), comm).expect("engine");
        let before = engine.eval_loss(full_batch()).expect("eval");
        let mut gathered = engine.gather_parameters(&[TARGET], Some(1)).expect("gather");
        assert_eq!(gathered.shape(TARGET).expect("shape"), &[12, 7]);
        let w = gathered.values_mut(TARGET).expect("writable");
        if rank == 1 {
            w.iter_mut().for_each(|v| *v *= 2.0);
        } else {
            // Only the modifier rank's values count.
            w.iter_mut().for_each(|v| *v = 0.0);
        }
        gathered.finish().expect("write back");

        let read = engine.gather_parameters(&[TARGET], None).expect("gather again");
        let after_gather = read.values(TARGET).expect("values").to_vec();
        let as_tensor = read.tensor::<2>(TARGET).expect("tensor");
        assert_eq!(as_tensor.dims(), [12, 7]);
        drop(read);
        let loss = engine.forward(full_batch()).expect("forward");
        let forward_loss = loss.value();
        engine.backward(loss).expect("backward");
        let module = values::<B, _>(&engine.module().expect("module"));
        (
            before,
            after_gather,
            forward_loss,
            module,
            engine.memory().gathered.current,
        )
    });
    for (rank, (before, gathered, forward_loss, module, gathered_now)) in results.into_iter().enumerate() {
        assert_eq!(
            gathered, want_values[TARGET_INDEX],
            "rank {rank}: gathered value after the edit"
        );
        assert_eq!(module, want_values, "rank {rank}: the model after the edit");
        assert_close(forward_loss, want_loss, &format!("rank {rank}: next forward's loss"));
        assert!((before - want_loss).abs() > 1e-4, "the edit must change the loss");
        assert_eq!(gathered_now, 0, "rank {rank}: the gathers are released");
    }
}

#[test]
fn rank_one_scales_a_weight_under_stage_3() {
    scale_on_rank_one(Stage::Zero3, 2);
    scale_on_rank_one(Stage::Zero3, 4);
}

#[test]
fn rank_one_scales_a_weight_under_stage_1() {
    // Stages 0-2 keep a replica: it must follow the masters.
    scale_on_rank_one(Stage::Zero1, 2);
}

#[test]
fn both_the_masters_and_the_sixteen_bit_copy_are_written() {
    // Reference: `half`'s round-to-nearest-even of the exact values rank 0 wrote.
    let results = on_ranks(2, |rank, comm| {
        let device = Default::default();
        let mut s = settings(Stage::Zero3);
        s.precision = PrecisionSettings::bf16();
        let mut engine = ChainEngine::new(s, Net::<B>::new(&device, BLOCKS), comm).expect("engine");
        let mut gathered = engine.gather_parameters(&[TARGET], Some(0)).expect("gather");
        let written: Vec<f32> = (0..84).map(|k| 0.1 + k as f32 * 1.0e-3).collect();
        if rank == 0 {
            gathered.values_mut(TARGET).expect("writable").copy_from_slice(&written);
        }
        drop(gathered); // the drop writes back too
        let masters = engine
            .gather_parameters(&[TARGET], None)
            .expect("gather")
            .values(TARGET)
            .expect("values")
            .to_vec();
        let model = values::<B, _>(&engine.module().expect("module"));
        (written, masters, model[TARGET_INDEX].clone())
    });
    for (written, masters, model) in results {
        assert_eq!(masters, written, "the fp32 masters hold the exact values");
        let rounded: Vec<f32> = written.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        assert_eq!(model, rounded, "the model sees them rounded to bf16");
        assert_ne!(model, written);
    }
}

#[test]
fn a_block_is_gathered_as_a_module_and_set_back() {
    let (want_values, want_loss) = reference(3.0);
    let results = on_ranks(2, |rank, comm| {
        let device = Default::default();
        let mut engine =
            ChainEngine::new(settings(Stage::Zero3), Net::<B>::new(&device, BLOCKS), comm).expect("engine");
        let mut gathered = engine.gather_block(1, Some(0)).expect("gather block");
        let block = gathered.block().expect("module");
        if rank == 0 {
            let vals = values::<B, _>(&block);
            let scaled = write_values(block, &device, false, |i| {
                // The block's first parameter is `up.weight` (TARGET).
                vals[i].iter().map(|v| if i == 0 { v * 3.0 } else { *v }).collect()
            });
            gathered.set_block(&scaled).expect("set");
        }
        gathered.finish().expect("write back");
        let loss = engine.eval_loss(full_batch()).expect("eval");
        (values::<B, _>(&engine.module().expect("module")), loss)
    });
    for (model, loss) in results {
        assert_eq!(model, want_values);
        assert_close(loss, want_loss, "loss after the block edit");
    }
}

#[test]
fn a_read_only_gather_changes_nothing_and_misuse_is_an_error() {
    let results = on_ranks(2, |_, comm| {
        let device = Default::default();
        let mut engine =
            ChainEngine::new(settings(Stage::Zero3), Net::<B>::new(&device, BLOCKS), comm).expect("engine");
        let before = values::<B, _>(&engine.module().expect("module"));
        let mut read = engine
            .gather_parameters(&[TARGET, "ends.head.bias"], None)
            .expect("gather");
        assert_eq!(read.names(), vec![TARGET, "ends.head.bias"]);
        let refused = read.values_mut(TARGET).is_err();
        drop(read);
        let unknown = engine
            .gather_parameters(&["blocks.9.up.weight"], None)
            .err()
            .map(|e| e.to_string());
        let bad_rank = engine.gather_parameters(&[TARGET], Some(2)).is_err();
        let after = values::<B, _>(&engine.module().expect("module"));
        (before == after, refused, unknown, bad_rank)
    });
    for (unchanged, refused, unknown, bad_rank) in results {
        assert!(unchanged);
        assert!(refused, "a read-only gather refuses changes");
        assert!(unknown.expect("unknown name").contains("blocks.9.up.weight"));
        assert!(bad_rank, "modifier rank 2 of a world of 2");
    }
}
