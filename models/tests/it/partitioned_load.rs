//! GPT-2 read (or randomly drawn) unit by unit into a `ShardedGpt2` cut over the ranks.
//!
//! Reference: the whole model (`Gpt2::load_pretrained`, or `Gpt2Config::init` from the same
//! seed) turned into a `ShardedGpt2` and cut by `zero_burn::sharded::shard_units` at the same
//! world size and threshold: every rank's units must be equal, bit for bit.

use std::path::Path;
use std::sync::{Arc, Mutex};

use burn::backend::Flex;
use burn::prelude::*;
use zero_burn::params::read_values;
use zero_burn::sharded::{shard_units, UnitComm};
use zero_burn::HostStaged;
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_models::gpt2::{CheckpointError, Gpt2Config, PartitionedLoadError, ShardedGpt2};
use zero_models::Gpt2;

/// Burn's CPU generator is one per process: tests that draw from it must not interleave.
static RNG: Mutex<()> = Mutex::new(());

fn config() -> Gpt2Config {
    Gpt2Config::new(96, 16, 32, 3, 4)
}

/// wpe (16 × 32) + wte (96 × 32) is one unit of 3584; each block holds 12 704: the embeddings
/// stay whole, the blocks are cut.
const THRESHOLD: usize = 4000;

/// Runs `f(comm)` on `world` rank threads; results in rank order.
fn on_ranks<T: Send + 'static>(world: usize, f: impl Fn(UnitComm<Flex>) -> T + Send + Sync + 'static) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = ThreadGroup::new_group(world)
        .expect("group")
        .into_iter()
        .map(|g| {
            let f = f.clone();
            std::thread::spawn(move || f(Arc::new(HostStaged::new(g as Arc<dyn ProcessGroup>))))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank panicked")).collect()
}

fn values(model: &ShardedGpt2<Flex>) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    read_values::<Flex, _>(model, |_, v| out.push(v));
    out
}

/// A rank's units read or drawn unit by unit, the reference's, and whether (the embedding, every
/// block) is cut.
type Cut = (Vec<Vec<f32>>, Vec<Vec<f32>>, (bool, bool));

fn assert_cut_alike(results: &[Cut]) {
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
fn a_missing_tensor_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    saved_model(dir.path(), usize::MAX);
    // The file without one tensor of block 1.
    let file = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&file).expect("read");
    let tensors = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .filter(|(name, _)| !name.ends_with("h.1.attn.c_attn.weight"))
        .map(|(name, view)| (name.to_string(), view))
        .collect();
    let rewritten = safetensors::serialize(kept, None).expect("serialize");
    std::fs::write(&file, rewritten).expect("write");
    let path = dir.path().to_path_buf();
    let err = on_ranks(1, move |comm| {
        Gpt2::<Flex>::load_pretrained_sharded(&path, &Default::default(), comm, THRESHOLD).expect_err("must fail")
    })
    .remove(0);
    match err {
        PartitionedLoadError::Checkpoint(CheckpointError::KeyMismatch { missing, .. }) => {
            assert_eq!(missing, ["h.1.attn.c_attn.weight"]);
        }
        other => panic!("expected a key mismatch, got {other}"),
    }
}

/// A config with one more layer than the file holds is named as a config.json its weights
/// contradict (not as the tensors of a fourth block missing).
#[test]
fn a_config_of_more_layers_than_the_file_names_n_layer() {
    let dir = tempfile::tempdir().expect("tempdir");
    saved_model(dir.path(), usize::MAX);
    let mut bigger = config();
    bigger.n_layer = 4;
    std::fs::write(dir.path().join("config.json"), bigger.to_json_string().expect("json")).expect("write");
    let path = dir.path().to_path_buf();
    let err = on_ranks(1, move |comm| {
        Gpt2::<Flex>::load_pretrained_sharded(&path, &Default::default(), comm, THRESHOLD).expect_err("must fail")
    })
    .remove(0);
    match err {
        PartitionedLoadError::Checkpoint(e @ CheckpointError::ConfigContradictsWeights { .. }) => {
            let said = e.to_string();
            assert!(said.contains("n_layer is 4, but the weights say 3"), "{said}");
        }
        other => panic!("expected the config to be named, got {other}"),
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
        Gpt2::<Flex>::load_pretrained_sharded(&path, &Default::default(), comm, THRESHOLD)
            .err()
            .map(|e| e.to_string())
    })
    .remove(0);
    assert!(err.expect("must fail").contains("model.safetensors"));
}

/// A NaN in the weights (the file's last element) is refused by the sharded loader too, naming
/// the file.
#[test]
fn a_nan_weight_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    saved_model(dir.path(), usize::MAX);
    let file = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&file).expect("read");
    let end = bytes.len();
    bytes[end - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&file, bytes).expect("write");
    let path = dir.path().to_path_buf();
    let err = on_ranks(1, move |comm| {
        Gpt2::<Flex>::load_pretrained_sharded(&path, &Default::default(), comm, THRESHOLD).expect_err("must fail")
    })
    .remove(0);
    match err {
        PartitionedLoadError::Checkpoint(e @ CheckpointError::NonFinite { .. }) => {
            assert!(
                e.to_string().contains("model.safetensors") && e.to_string().contains("NaN"),
                "{e}"
            );
        }
        other => panic!("expected a non-finite refusal, got {other}"),
    }
}

/// `Gpt2Config::init_sharded` on 2 ranks, each seeded alike and drawing one rank at a time (as
/// the trainer's rank threads do): every rank's units equal `init` from the same seed, then
/// `into_sharded` and the cut.
#[test]
fn a_sharded_random_init_cuts_each_unit_as_the_whole_model_cut_does() {
    let results = on_ranks(2, |comm| {
        let device = Default::default();
        let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
        Flex::seed(&device, 11);
        let drawn = config()
            .init_sharded::<Flex>(&device, comm.clone(), THRESHOLD)
            .expect("init");
        Flex::seed(&device, 11);
        let whole = config().init::<Flex>(&device).into_sharded();
        let cut = shard_units(whole, comm, THRESHOLD).expect("cut");
        let sharded = (drawn.embed.is_sharded(), drawn.blocks.iter().all(|b| b.is_sharded()));
        (values(&drawn), values(&cut), sharded)
    });
    assert_cut_alike(&results);
}

/// `Gpt2::load_pretrained_sharded` on 2 ranks: every rank's units equal the whole model's
/// (`load_pretrained`, `into_sharded`, `shard_units`, the reference) cut at the same threshold,
/// bit for bit, from one file and from several; a unit under the threshold stays whole.
#[test]
fn a_sharded_load_cuts_each_unit_as_the_whole_model_cut_does() {
    for max_shard_bytes in [usize::MAX, 20_000] {
        let dir = tempfile::tempdir().expect("tempdir");
        saved_model(dir.path(), max_shard_bytes);
        if max_shard_bytes == usize::MAX {
            assert!(dir.path().join("model.safetensors").is_file());
        } else {
            assert!(dir.path().join("model.safetensors.index.json").is_file());
        }
        let path = dir.path().to_path_buf();
        let results = on_ranks(2, move |comm| {
            let device = Default::default();
            let (loaded, config) =
                Gpt2::<Flex>::load_pretrained_sharded(&path, &device, comm.clone(), THRESHOLD).expect("sharded load");
            assert_eq!((config.n_layer, config.n_embd), (3, 32));
            let whole = Gpt2::<Flex>::load_pretrained(&path, &device)
                .expect("load")
                .0
                .into_sharded();
            let cut = shard_units(whole, comm, THRESHOLD).expect("cut");
            let sharded = (loaded.embed.is_sharded(), loaded.blocks.iter().all(|b| b.is_sharded()));
            (values(&loaded), values(&cut), sharded)
        });
        assert_cut_alike(&results);
    }
}
