//! GPT-2 loaded (or randomly built) block by block into a stage-3 engine.
//!
//! Reference: the whole model (`Gpt2::load_pretrained`, or `Gpt2Config::init` from the same
//! seed) handed to `ChainEngine::new` at the same world size. Layouts, values and the loss of a
//! training step must be equal, bit for bit.

use std::path::Path;
use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use zero_burn::params::read_values;
use zero_burn::{ChainEngine, EngineSettings, Stage};
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_core::optim::{OptimizerSpec, SgdSpec};
use zero_core::partition::PartitionLayout;
use zero_models::gpt2::{CheckpointError, Gpt2Config, PartitionedLoadError};
use zero_models::Gpt2;

type B = Autodiff<Flex>;

/// Burn's CPU generator is one per process: tests that draw from it must not interleave.
static RNG: Mutex<()> = Mutex::new(());

fn config() -> Gpt2Config {
    Gpt2Config::new(96, 16, 32, 3, 4)
}

fn settings() -> EngineSettings {
    let mut s = EngineSettings::new(
        Stage::Zero3,
        OptimizerSpec::Sgd(SgdSpec {
            lr: 0.1,
            ..Default::default()
        }),
    );
    // LayerNorms and small biases replicated, matrices sharded.
    s.param_persistence_threshold = 100;
    s
}

/// Runs `f(group)` on `world` rank threads; results in rank order.
fn on_ranks<T: Send + 'static>(world: usize, f: impl Fn(Arc<dyn ProcessGroup>) -> T + Send + Sync + 'static) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = ThreadGroup::new_group(world)
        .expect("group")
        .into_iter()
        .map(|g| {
            let f = f.clone();
            std::thread::spawn(move || f(g as Arc<dyn ProcessGroup>))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank panicked")).collect()
}

/// What two engines must agree on: layout, every value (gathered), the loss of a step and the
/// values after it.
type Summary = (PartitionLayout, Vec<Vec<f32>>, f32, Vec<Vec<f32>>);

fn summarize(mut engine: ChainEngine<B, Gpt2<B>>) -> Summary {
    let device = Default::default();
    let read = |engine: &mut ChainEngine<B, Gpt2<B>>| {
        let mut out = Vec::new();
        read_values::<B, _>(&engine.module().expect("gather"), |_, v| out.push(v));
        out
    };
    let before = read(&mut engine);
    let tokens = Tensor::<B, 2, Int>::from_ints([[1, 5, 9, 2, 7, 3], [4, 4, 8, 0, 95, 6]], &device);
    let loss = engine.forward((tokens.clone(), tokens)).expect("forward");
    let value = engine.backward(loss).expect("backward");
    engine.step().expect("step");
    (engine.layout().clone(), before, value, read(&mut engine))
}

fn check_load(dir: &Path, world: usize) {
    let path = dir.to_path_buf();
    let reference = on_ranks(world, move |comm| {
        let (model, _) = Gpt2::<B>::load_pretrained(&path, &Default::default()).expect("load");
        summarize(ChainEngine::new(settings(), model, comm).expect("engine"))
    });
    let path = dir.to_path_buf();
    let partitioned = on_ranks(world, move |comm| {
        let (engine, config) = Gpt2::<B>::load_pretrained_partitioned(&path, settings(), comm, &Default::default())
            .expect("partitioned load");
        assert_eq!((config.n_layer, config.n_embd), (3, 32));
        summarize(engine)
    });
    for (rank, (got, want)) in partitioned.iter().zip(&reference).enumerate() {
        assert_eq!(got.0, want.0, "world {world}, rank {rank}: layout");
        assert_eq!(got.1, want.1, "world {world}, rank {rank}: loaded values");
        assert_eq!(got.2, want.2, "world {world}, rank {rank}: loss");
        assert_eq!(got.3, want.3, "world {world}, rank {rank}: values after a step");
    }
}

fn saved_model(dir: &Path, max_shard_bytes: usize) {
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let device = Default::default();
    Flex::seed(&device, 7);
    let model = config().init::<Flex>(&device);
    model
        .save_pretrained_sharded(dir, &config(), max_shard_bytes)
        .expect("save");
}

#[test]
fn a_single_file_checkpoint_loads_like_the_whole_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    saved_model(dir.path(), usize::MAX);
    assert!(dir.path().join("model.safetensors").is_file());
    for world in [1, 2, 4] {
        check_load(dir.path(), world);
    }
}

#[test]
fn a_sharded_checkpoint_loads_like_the_whole_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    // About 20 kB per shard: several files, blocks spread over them.
    saved_model(dir.path(), 20_000);
    assert!(dir.path().join("model.safetensors.index.json").is_file());
    check_load(dir.path(), 2);
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    saved_model(dir.path(), usize::MAX);
    // A config with one more layer than the file holds.
    let mut bigger = config();
    bigger.n_layer = 4;
    std::fs::write(dir.path().join("config.json"), bigger.to_json_string().expect("json")).expect("write");
    let path = dir.path().to_path_buf();
    let err = on_ranks(1, move |comm| {
        Gpt2::<B>::load_pretrained_partitioned(&path, settings(), comm, &Default::default())
            .err()
            .expect("must fail")
    })
    .remove(0);
    match err {
        PartitionedLoadError::Checkpoint(CheckpointError::KeyMismatch { missing, .. }) => {
            assert!(missing.iter().any(|m| m == "h.3.attn.c_attn.weight"), "{missing:?}");
        }
        other => panic!("expected a key mismatch, got {other}"),
    }
}

#[test]
fn a_corrupt_header_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    saved_model(dir.path(), usize::MAX);
    let file = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&file).expect("read");
    // Claim a header longer than the file.
    let claimed = bytes.len() as u64;
    bytes[..8].copy_from_slice(&claimed.to_le_bytes());
    std::fs::write(&file, bytes).expect("write");
    let path = dir.path().to_path_buf();
    let err = on_ranks(1, move |comm| {
        Gpt2::<B>::load_pretrained_partitioned(&path, settings(), comm, &Default::default())
            .err()
            .map(|e| e.to_string())
    })
    .remove(0);
    assert!(err.expect("must fail").contains("model.safetensors"));
}

#[test]
fn random_init_partitioned_equals_init_then_new() {
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let device = Default::default();
    // Reference at world 1: every value drawn in one thread.
    B::seed(&device, 11);
    let reference = on_ranks(1, |comm| {
        summarize(ChainEngine::new(settings(), config().init::<B>(&Default::default()), comm).expect("engine"))
    });
    B::seed(&device, 11);
    let partitioned = on_ranks(1, |comm| {
        summarize(
            config()
                .init_partitioned::<B>(settings(), comm, &Default::default())
                .expect("engine"),
        )
    });
    assert_eq!(partitioned[0].0, reference[0].0);
    assert_eq!(partitioned[0].1, reference[0].1);
    assert_eq!(partitioned[0].3, reference[0].3);
}

/// `Gpt2::load_pretrained_sharded` on 2 ranks: every rank's units equal the whole model's
/// (`load_pretrained`, `into_sharded`, `shard_units`, the reference) cut at the same threshold,
/// bit for bit, from one file and from several; a unit under the threshold stays whole.
#[test]
fn a_sharded_load_cuts_each_unit_as_the_whole_model_cut_does() {
    use zero_burn::sharded::{shard_units, UnitComm};
    use zero_burn::HostStaged;
    let values = |model: &zero_models::gpt2::ShardedGpt2<Flex>| {
        let mut out = Vec::new();
        read_values::<Flex, _>(model, |_, v| out.push(v));
        out
    };
    for max_shard_bytes in [usize::MAX, 20_000] {
        let dir = tempfile::tempdir().expect("tempdir");
        saved_model(dir.path(), max_shard_bytes);
        let path = dir.path().to_path_buf();
        // wpe (16 × 32) + wte (96 × 32) is one unit of 3584; each block holds 12 704.
        let threshold = 4000;
        let results = on_ranks(2, move |group| {
            let device = Default::default();
            let comm: UnitComm<Flex> = Arc::new(HostStaged::new(group));
            let (loaded, _) =
                Gpt2::<Flex>::load_pretrained_sharded(&path, &device, comm.clone(), threshold).expect("sharded load");
            let whole = Gpt2::<Flex>::load_pretrained(&path, &device)
                .expect("load")
                .0
                .into_sharded();
            let cut = shard_units(whole, comm, threshold).expect("cut");
            let sharded = (loaded.embed.is_sharded(), loaded.blocks.iter().all(|b| b.is_sharded()));
            (values(&loaded), values(&cut), sharded)
        });
        for (rank, (got, want, sharded)) in results.iter().enumerate() {
            assert_eq!(got, want, "rank {rank}: the units as the whole model's cut");
            assert_eq!(
                *sharded,
                (false, true),
                "rank {rank}: blocks cut, the embedding under the threshold"
            );
        }
        assert_ne!(results[0].0, results[1].0, "the ranks hold different shards");
    }
}
