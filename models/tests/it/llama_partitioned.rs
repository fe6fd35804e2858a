//! The Llama family read (or randomly drawn) unit by unit into a `ShardedLlama` cut over the
//! ranks, for stage 3.
//!
//! Reference: the whole model (`Llama::load_pretrained`, or `LlamaConfig::init` from the same
//! seed) turned into a `ShardedLlama` and cut by `zero_burn::sharded::shard_units` at the same
//! world size and threshold: every rank's units must be equal, bit for bit.

use crate::common;

use std::sync::{Arc, Mutex};

use burn::backend::Flex;
use burn::prelude::*;
use common::fixture;
use zero_burn::params::read_values;
use zero_burn::sharded::{shard_units, UnitComm};
use zero_burn::HostStaged;
use zero_core::comm::{ProcessGroup, ThreadGroup};
use zero_models::llama::{Llama, LlamaConfig, ShardedLlama};

/// Burn's CPU generator is one per process: tests that draw from it must not interleave.
static RNG: Mutex<()> = Mutex::new(());

/// The fixtures' embedding and head (192 × 48 = 9216) stay whole; each layer (about 20 000) is
/// cut.
const THRESHOLD: usize = 10_000;

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

fn values(model: &ShardedLlama<Flex>) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    read_values::<Flex, _>(model, |_, v| out.push(v));
    out
}

/// Whether the embedding, every layer and the head (if untied) are cut.
fn cut_units(model: &ShardedLlama<Flex>) -> (bool, bool, Option<bool>) {
    (
        model.embed_tokens.is_sharded(),
        model.layers.iter().all(|l| l.is_sharded()),
        model.lm_head.as_ref().map(|h| h.is_sharded()),
    )
}

type Cut = (Vec<Vec<f32>>, Vec<Vec<f32>>, (bool, bool, Option<bool>));

fn assert_cut_alike(results: &[Cut], untied: bool) {
    for (rank, (got, want, cut)) in results.iter().enumerate() {
        assert_eq!(got, want, "rank {rank}: the units as the whole model's cut");
        assert_eq!(
            *cut,
            (false, true, untied.then_some(false)),
            "rank {rank}: layers cut, the embedding and head under the threshold"
        );
    }
    assert_ne!(results[0].0, results[1].0, "the ranks hold different shards");
}

#[test]
fn a_sharded_load_cuts_each_unit_as_the_whole_model_cut_does() {
    // llama-micro: one file, untied head; qwen2-micro: shards with an index, tied.
    for (name, untied) in [("llama-micro", true), ("qwen2-micro", false)] {
        let results = on_ranks(2, move |comm| {
            let device = Default::default();
            let (loaded, config) =
                Llama::<Flex>::load_pretrained_sharded(fixture(name), &device, comm.clone(), THRESHOLD)
                    .expect("sharded load");
            assert_eq!(config.num_hidden_layers, 2);
            let whole = Llama::<Flex>::load_pretrained(fixture(name), &device)
                .expect("load")
                .0
                .into_sharded();
            let cut = shard_units(whole, comm, THRESHOLD).expect("cut");
            (values(&loaded), values(&cut), cut_units(&loaded))
        });
        assert_cut_alike(&results, untied);
    }
}

#[test]
fn a_sharded_random_init_cuts_each_unit_as_the_whole_model_cut_does() {
    let config = LlamaConfig::from_pretrained_dir(fixture("llama-micro")).expect("config");
    let results = on_ranks(2, move |comm| {
        let device = Default::default();
        let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
        Flex::seed(&device, 11);
        let drawn = config
            .init_sharded::<Flex>(&device, comm.clone(), THRESHOLD)
            .expect("init");
        Flex::seed(&device, 11);
        let whole = config.init::<Flex>(&device).into_sharded();
        let cut = shard_units(whole, comm, THRESHOLD).expect("cut");
        (values(&drawn), values(&cut), cut_units(&drawn))
    });
    assert_cut_alike(&results, true);
}

#[test]
fn a_sharded_load_of_a_config_deeper_than_its_weights_lists_what_is_missing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let device = Default::default();
    let (model, mut config) = Llama::<Flex>::load_pretrained(fixture("mistral-micro"), &device).expect("load");
    model.save_pretrained(dir.path(), &config).expect("save");
    config.num_hidden_layers = 3;
    std::fs::write(dir.path().join("config.json"), config.to_json_string()).expect("write");
    let path = dir.path().to_path_buf();
    let errors = on_ranks(2, move |comm| {
        Llama::<Flex>::load_pretrained_sharded(&path, &Default::default(), comm, THRESHOLD)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    });
    for err in errors {
        assert!(err.contains("missing [model.layers.2.input_layernorm.weight"), "{err}");
    }
}

/// `LlamaConfig::write_random_pretrained` draws unit by unit what `init` draws whole. Reference:
/// `init` from the same seed; the written directory (a shard per unit, with an index) loads
/// back equal, bit for bit, tied and untied.
#[test]
fn a_random_directory_written_unit_by_unit_loads_as_init_draws_it() {
    for name in ["llama-micro", "qwen3-micro"] {
        let config = LlamaConfig::from_pretrained_dir(fixture(name)).expect("config");
        let dir = tempfile::tempdir().expect("tempdir");
        let device = Default::default();
        let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
        Flex::seed(&device, 5);
        let mut calls = Vec::new();
        config
            .write_random_pretrained::<Flex>(dir.path(), &device, |done, units| calls.push((done, units)))
            .expect("write");
        Flex::seed(&device, 5);
        let want = config.init::<Flex>(&device).hf_tensors();
        let units = config.num_hidden_layers + 1 + usize::from(!config.tie_word_embeddings);
        assert_eq!(
            calls,
            (0..units).map(|u| (u, units)).collect::<Vec<_>>(),
            "{name}: progress"
        );
        assert!(dir.path().join("model.safetensors.index.json").is_file());
        let (loaded, again) = Llama::<Flex>::load_pretrained(dir.path(), &device).expect("load");
        assert_eq!(again, config, "{name}: config");
        assert!(loaded.hf_tensors() == want, "{name}: the directory holds init's draws");
    }
}
