//! `Gpt2Config::write_random_pretrained`: a starting checkpoint for a size without public
//! weights, written one unit per shard. The reference is the loader (`Gpt2::load_pretrained`,
//! itself checked against transformers' files) and GPT-2's initialization statistics.

use burn::backend::Flex;
use zero_models::gpt2::{Gpt2, Gpt2Config};

type B = Flex;

fn config() -> Gpt2Config {
    Gpt2Config::new(96, 16, 32, 3, 4)
}

fn std_of(values: &[f32]) -> f64 {
    let n = values.len() as f64;
    let mean = values.iter().map(|&v| v as f64).sum::<f64>() / n;
    (values.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt()
}

#[test]
fn one_shard_per_unit_that_loads_back_with_gpt2_initialization() {
    let dir = tempfile::tempdir().unwrap();
    let config = config();
    let device = Default::default();
    config
        .write_random_pretrained::<B>(dir.path(), &device, |_, _| {})
        .unwrap();

    // The embeddings and each of the 3 blocks in a shard of its own, and the index.
    let mut files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "config.json",
            "model-00001-of-00004.safetensors",
            "model-00002-of-00004.safetensors",
            "model-00003-of-00004.safetensors",
            "model-00004-of-00004.safetensors",
            "model.safetensors.index.json",
        ]
    );

    let (model, loaded_config) = Gpt2::<B>::load_pretrained(dir.path(), &device).unwrap();
    // The written config.json also names the architecture for transformers' AutoModel.
    let mut plain = loaded_config.clone();
    plain.extra.clear();
    assert_eq!(plain, config);
    let tensors = model.hf_tensors();
    assert_eq!(tensors.len(), config.param_shapes().len());
    for (name, data) in tensors {
        let values = data.to_vec::<f32>().unwrap();
        if name.contains("ln_") && name.ends_with(".weight") {
            assert!(values.iter().all(|&v| v == 1.0), "{name}: LayerNorm scale is not 1");
        } else if name.ends_with(".bias") {
            assert!(values.iter().all(|&v| v == 0.0), "{name}: bias is not 0");
        } else if name == "wte.weight" || name.ends_with("c_attn.weight") || name.ends_with("c_fc.weight") {
            let std = std_of(&values);
            let want = config.initializer_range;
            assert!(
                (std - want).abs() < 0.1 * want,
                "{name}: std {std}, GPT-2 initializes with {want}"
            );
        }
    }
}

#[test]
fn a_sharded_write_replaces_a_single_file_checkpoint_in_the_same_directory() {
    let dir = tempfile::tempdir().unwrap();
    let device = Default::default();
    let config = config();
    let old = config.init::<B>(&device);
    old.save_pretrained(dir.path(), &config).unwrap();
    config
        .write_random_pretrained::<B>(dir.path(), &device, |_, _| {})
        .unwrap();
    // A reader takes model.safetensors before the index: left behind, it would load the old
    // weights instead of the new ones.
    assert!(!dir.path().join("model.safetensors").exists());
    let (new, _) = Gpt2::<B>::load_pretrained(dir.path(), &device).unwrap();
    let old_wte = old.wte.weight.val().into_data().to_vec::<f32>().unwrap();
    let new_wte = new.wte.weight.val().into_data().to_vec::<f32>().unwrap();
    assert_ne!(old_wte, new_wte);
}
