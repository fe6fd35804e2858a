//! Loading and saving HuggingFace GPT-2 checkpoint directories.
//!
//! References: the checkpoint transformers wrote (tests/fixtures/gpt2-tiny) and the model loaded
//! from it; variants of it rewritten here with the safetensors crate.

use crate::common;
use std::collections::BTreeMap;
use std::path::Path;

use burn::backend::Flex;
use burn::prelude::*;
use common::{fixture, Reference};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use zero_models::gpt2::{CheckpointError, Gpt2};

type B = Flex;

/// The raw tensors of the fixture's model.safetensors: name → (dtype, shape, bytes).
fn fixture_tensors() -> BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(fixture("gpt2-tiny").join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    file.iter()
        .map(|(name, view)| {
            (
                name.to_string(),
                (view.dtype(), view.shape().to_vec(), view.data().to_vec()),
            )
        })
        .collect()
}

/// Writes a checkpoint directory with the fixture's config and the given tensors.
fn write_checkpoint(dir: &Path, tensors: &BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>) {
    std::fs::copy(fixture("gpt2-tiny").join("config.json"), dir.join("config.json")).unwrap();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (dtype, shape, bytes))| (name.clone(), TensorView::new(*dtype, shape.clone(), bytes).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

fn logits(model: &Gpt2<B>) -> TensorData {
    let device = Default::default();
    let tokens = Reference::read("gpt2-tiny").ints::<B>("input_ids", &device);
    model.forward(tokens).into_data()
}

fn assert_same_params(a: &Gpt2<B>, b: &Gpt2<B>) {
    let (a, b) = (a.hf_tensors(), b.hf_tensors());
    assert_eq!(a.len(), b.len());
    for ((name_a, data_a), (name_b, data_b)) in a.iter().zip(&b) {
        assert_eq!(name_a, name_b);
        assert_eq!(data_a, data_b, "{name_a} differs");
    }
}

#[test]
fn save_then_load_round_trips_exactly() {
    let device = Default::default();
    let (model, config) = Gpt2::<B>::load_pretrained(fixture("gpt2-tiny"), &device).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save_pretrained(dir.path(), &config).unwrap();
    let (again, config_again) = Gpt2::<B>::load_pretrained(dir.path(), &device).unwrap();
    assert_eq!(config, config_again);
    assert_same_params(&model, &again);
    assert_eq!(logits(&model), logits(&again));

    // The written file has transformers' names: exactly the fixture's keys.
    let written = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let written = SafeTensors::deserialize(&written).unwrap();
    let mut names: Vec<String> = written.names().into_iter().map(String::from).collect();
    names.sort();
    let expected: Vec<String> = fixture_tensors().into_keys().collect();
    assert_eq!(names, expected);
}

#[test]
fn sharded_save_round_trips_and_writes_an_index() {
    let device = Default::default();
    let (model, config) = Gpt2::<B>::load_pretrained(fixture("gpt2-tiny"), &device).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save_pretrained_sharded(dir.path(), &config, 64 * 1024).unwrap();
    let index = std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap();
    let index: serde_json::Value = serde_json::from_str(&index).unwrap();
    let weight_map = index["weight_map"].as_object().unwrap();
    assert_eq!(weight_map.len(), model.param_names().len());
    let shards: std::collections::BTreeSet<&str> = weight_map.values().filter_map(|v| v.as_str()).collect();
    assert!(shards.len() > 2, "expected several shards, got {shards:?}");
    assert!(!dir.path().join("model.safetensors").exists());

    let (again, _) = Gpt2::<B>::load_pretrained(dir.path(), &device).unwrap();
    assert_same_params(&model, &again);
}

#[test]
fn accepts_unprefixed_names_and_a_stored_tied_head() {
    let device = Default::default();
    let (model, _) = Gpt2::<B>::load_pretrained(fixture("gpt2-tiny"), &device).unwrap();
    let mut tensors: BTreeMap<_, _> = fixture_tensors()
        .into_iter()
        .map(|(name, t)| (name.trim_start_matches("transformer.").to_string(), t))
        .collect();
    let wte = tensors["wte.weight"].clone();
    tensors.insert("lm_head.weight".to_string(), wte);
    // The causal-mask buffer older checkpoints carry is not a parameter.
    tensors.insert("h.0.attn.bias".to_string(), (Dtype::F32, vec![1, 1, 2, 2], vec![0; 16]));
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &tensors);
    let (loaded, _) = Gpt2::<B>::load_pretrained(dir.path(), &device).unwrap();
    assert_same_params(&model, &loaded);
}

#[test]
fn reads_half_precision_tensors() {
    let device = Default::default();
    let tensors: BTreeMap<_, _> = fixture_tensors()
        .into_iter()
        .map(|(name, (_, shape, bytes))| {
            let halves: Vec<u8> = bytes
                .chunks_exact(4)
                .flat_map(|c| {
                    let v = f32::from_le_bytes(c.try_into().unwrap());
                    half::bf16::from_f32(v).to_le_bytes()
                })
                .collect();
            (name, (Dtype::BF16, shape, halves))
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &tensors);
    let (loaded, _) = Gpt2::<B>::load_pretrained(dir.path(), &device).unwrap();
    // Reference: the f32 weights rounded to bf16 in this test.
    let wte = loaded.hf_tensors()[0].1.to_vec::<f32>().unwrap();
    let (_, _, raw) = &fixture_tensors()["transformer.wte.weight"];
    let expected: Vec<f32> = raw
        .chunks_exact(4)
        .map(|c| half::bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_f32())
        .collect();
    assert_eq!(wte, expected);
}

#[test]
fn missing_and_unknown_keys_are_listed() {
    let device = Default::default();
    let mut tensors = fixture_tensors();
    tensors.remove("transformer.h.1.mlp.c_fc.bias");
    tensors.remove("transformer.ln_f.weight");
    let extra = tensors["transformer.ln_f.bias"].clone();
    tensors.insert("transformer.h.7.ln_1.weight".to_string(), extra);
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &tensors);
    match Gpt2::<B>::load_pretrained(dir.path(), &device) {
        Err(CheckpointError::KeyMismatch {
            path,
            missing,
            unexpected,
        }) => {
            assert!(path.ends_with("model.safetensors"));
            assert_eq!(missing, ["h.1.mlp.c_fc.bias", "ln_f.weight"]);
            assert_eq!(unexpected, ["transformer.h.7.ln_1.weight"]);
        }
        other => panic!("expected a key mismatch, got {other:?}"),
    }
}

/// A config.json describing far more layers than the weights hold is refused before anything
/// of its size is built (not after enumerating a billion layers' tensors).
#[test]
fn a_config_larger_than_its_weights_is_refused_at_once() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &fixture_tensors());
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["n_layer"] = serde_json::json!(1_000_000);
    std::fs::write(&path, config.to_string()).unwrap();
    match Gpt2::<B>::load_pretrained(dir.path(), &device) {
        Err(e @ CheckpointError::ConfigContradictsWeights { .. }) => {
            let message = e.to_string();
            assert!(
                message.contains("config.json") && message.contains("n_layer is 1000000, but the weights say 2"),
                "{message}"
            );
        }
        other => panic!("expected the config to be refused, got {:?}", other.map(|_| ())),
    }
    // More parameters than the files hold, by a size no tensor's shape gives: refused by the
    // bytes the files hold.
    let mut tensors = fixture_tensors();
    tensors.remove("transformer.wpe.weight");
    write_checkpoint(dir.path(), &tensors);
    config["n_layer"] = serde_json::json!(2);
    config["n_positions"] = serde_json::json!(1_000_000);
    std::fs::write(&path, config.to_string()).unwrap();
    match Gpt2::<B>::load_pretrained(dir.path(), &device) {
        Err(e @ CheckpointError::Config { .. }) => {
            let message = e.to_string();
            assert!(
                message.contains("config.json") && message.contains("weight files hold"),
                "{message}"
            );
        }
        other => panic!("expected the config to be refused, got {:?}", other.map(|_| ())),
    }
}

/// A config.json whose sizes its weights contradict is named as such, field by field, with what
/// the weights say, by the loaders and by `Gpt2Config::from_pretrained_dir` (which reads no
/// weight): a run checks its data and flags against these sizes, and used to blame them.
#[test]
fn a_config_of_other_sizes_than_its_weights_names_the_field() {
    use zero_models::Gpt2Config;
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &fixture_tensors());
    let path = dir.path().join("config.json");
    let fixture_config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    Gpt2Config::from_pretrained_dir(dir.path()).expect("the fixture's own config");
    for (field, value, says) in [
        (
            "n_embd",
            32,
            "n_embd is 32, but the weights say 64: `transformer.wte.weight` in model.safetensors is [512, 64]",
        ),
        (
            "vocab_size",
            100,
            "vocab_size is 100, but the weights say 512: `transformer.wte.weight`",
        ),
        (
            "n_positions",
            8,
            "n_positions is 8, but the weights say 32: `transformer.wpe.weight` in model.safetensors is [32, 64]",
        ),
        (
            "n_layer",
            1,
            "n_layer is 1, but the weights say 2: model.safetensors holds blocks h.0 to h.1",
        ),
        (
            "n_layer",
            3,
            "n_layer is 3, but the weights say 2: model.safetensors holds blocks h.0 to h.1",
        ),
        (
            "n_inner",
            128,
            "n_inner is 128, but the weights say 256: `transformer.h.0.mlp.c_fc.weight`",
        ),
    ] {
        let mut config = fixture_config.clone();
        config[field] = serde_json::json!(value);
        std::fs::write(&path, config.to_string()).unwrap();
        let quick = Gpt2Config::from_pretrained_dir(dir.path())
            .expect_err(field)
            .to_string();
        let loaded = Gpt2::<B>::load_pretrained(dir.path(), &device)
            .map(|_| ())
            .expect_err(field)
            .to_string();
        for message in [&quick, &loaded] {
            assert!(
                message.contains("config.json: ")
                    && message.contains(says)
                    && message.contains("does not belong to these weights"),
                "{field} {value}: {message}"
            );
        }
    }
}

#[test]
fn a_different_head_or_shape_is_an_error() {
    let device = Default::default();
    let mut tensors = fixture_tensors();
    let (dtype, shape, mut bytes) = tensors["transformer.wte.weight"].clone();
    bytes[0] ^= 0x01;
    tensors.insert("lm_head.weight".to_string(), (dtype, shape, bytes));
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &tensors);
    assert!(matches!(
        Gpt2::<B>::load_pretrained(dir.path(), &device),
        Err(CheckpointError::UntiedHead { .. })
    ));

    let mut tensors = fixture_tensors();
    let (dtype, _, bytes) = tensors["transformer.ln_f.bias"].clone();
    tensors.insert(
        "transformer.ln_f.bias".to_string(),
        (dtype, vec![bytes.len() / 8, 2], bytes),
    );
    write_checkpoint(dir.path(), &tensors);
    match Gpt2::<B>::load_pretrained(dir.path(), &device) {
        Err(CheckpointError::ShapeMismatch { key, .. }) => assert_eq!(key, "transformer.ln_f.bias"),
        other => panic!("expected a shape mismatch, got {other:?}"),
    }
}

/// A NaN or an infinity in any tensor (a run that diverged, a damaged file) is refused, naming
/// the tensor, in whatever dtype it is stored, by both loaders.
#[test]
fn non_finite_weights_are_refused() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    for (key, bad) in [
        ("transformer.h.0.attn.c_attn.weight", f32::NAN),
        ("transformer.ln_f.weight", f32::INFINITY),
    ] {
        let mut tensors = fixture_tensors();
        let (dtype, shape, mut bytes) = tensors[key].clone();
        assert_eq!(dtype, Dtype::F32);
        let at = bytes.len() / 2 / 4 * 4;
        bytes[at..at + 4].copy_from_slice(&bad.to_le_bytes());
        tensors.insert(key.to_string(), (dtype, shape, bytes));
        write_checkpoint(dir.path(), &tensors);
        match Gpt2::<B>::load_pretrained(dir.path(), &device) {
            Err(e @ CheckpointError::NonFinite { .. }) => {
                let text = e.to_string();
                assert!(text.contains(key) && text.contains(&bad.to_string()), "{text}");
            }
            other => panic!("{key}: expected a non-finite refusal, got {other:?}"),
        }
    }
}

/// A weights file cut short, or whose header was edited, is refused naming the file and the
/// tensor (not blamed on config.json, nor reported as a bare format error).
#[test]
fn a_truncated_or_edited_weights_file_names_the_tensor() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_checkpoint(dir.path(), &fixture_tensors());
    let whole = std::fs::read(&path).unwrap();
    let refused = |expect: &[&str]| {
        let e = Gpt2::<B>::load_pretrained(dir.path(), &device).expect_err("refused");
        let text = e.to_string();
        assert!(text.contains("model.safetensors"), "{text}");
        for part in expect {
            assert!(text.contains(part), "expected `{part}` in: {text}");
        }
    };

    // Cut in the tensors' data (the file then holds far fewer bytes than the config's weights).
    std::fs::write(&path, &whole[..whole.len() / 4]).unwrap();
    refused(&["truncated: tensor `transformer.", &format!("it is {}", whole.len() / 4)]);
    // Cut inside the header.
    std::fs::write(&path, &whole[..20]).unwrap();
    refused(&["truncated: its header needs"]);

    // A dtype edited in the header: the offsets no longer fit it.
    let header_len = u64::from_le_bytes(whole[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&whole[8..8 + header_len]).unwrap();
    header["transformer.ln_f.bias"]["dtype"] = serde_json::json!("F16");
    let text = header.to_string();
    let mut edited = (text.len() as u64).to_le_bytes().to_vec();
    edited.extend_from_slice(text.as_bytes());
    edited.extend_from_slice(&whole[8 + header_len..]);
    std::fs::write(&path, &edited).unwrap();
    refused(&["tensor `transformer.ln_f.bias`: dtype F16 and shape", "take"]);
}

#[test]
fn a_directory_without_weights_is_an_error() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("gpt2-tiny").join("config.json"), dir.path().join("config.json")).unwrap();
    let error = Gpt2::<B>::load_pretrained(dir.path(), &device).unwrap_err();
    assert!(matches!(error, CheckpointError::NoWeights { .. }));
    assert!(error.to_string().contains("model.safetensors"));
}

#[test]
fn saving_with_a_config_of_another_shape_is_refused() {
    let device = Default::default();
    let (model, config) = Gpt2::<B>::load_pretrained(fixture("gpt2-tiny"), &device).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut wider = config.clone();
    wider.n_inner = Some(2 * config.inner_size());
    match model.save_pretrained(dir.path(), &wider) {
        Err(CheckpointError::ShapeMismatch { key, .. }) => assert_eq!(key, "h.0.mlp.c_fc.weight"),
        other => panic!("expected a shape mismatch, got {other:?}"),
    }
    let mut deeper = config.clone();
    deeper.n_layer += 1;
    match model.save_pretrained(dir.path(), &deeper) {
        Err(CheckpointError::KeyMismatch { missing, .. }) => {
            assert!(missing.contains(&"h.2.attn.c_attn.weight".to_string()))
        }
        other => panic!("expected a key mismatch, got {other:?}"),
    }
    assert!(!dir.path().join("model.safetensors").exists());
}
