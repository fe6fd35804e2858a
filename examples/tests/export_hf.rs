//! A `gpt2 train` checkpoint exported the way `zero to-fp32` does by default is a HuggingFace
//! GPT-2 directory: the checkpoint records its model, so the export takes HuggingFace's names
//! and writes `config.json` beside them, and the zoo's HuggingFace loader reads it back.
//! Reference: the same checkpoint exported under the engine's own names, tensor by tensor.

mod support;

use burn::backend::Flex;
use burn::tensor::Device;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::Path;
use zero_core::checkpoint::{to_fp32, write_model_config, Checkpoint, ExportNaming, NameMap};
use zero_models::gpt2::Gpt2;

/// Every tensor of the safetensors files in `dir`, by name, as f32.
fn read_all(dir: &Path) -> HashMap<String, Vec<f32>> {
    let mut out = HashMap::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            for (name, view) in SafeTensors::deserialize(&bytes).unwrap().tensors() {
                let values = view
                    .data()
                    .chunks(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                out.insert(name, values);
            }
        }
    }
    out
}

#[test]
fn a_trained_checkpoint_exports_as_a_huggingface_directory_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("ckpt");
    let run = support::train_shipped(2, &["--save", save.to_str().unwrap()]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));

    let checkpoint = Checkpoint::open(&save, None).unwrap();
    let record = checkpoint.meta.model.clone().expect("the trainer records its model");
    assert_eq!(record.naming, "gpt2-hf");

    // What `zero to-fp32 SAVE OUT` does with no --names.
    let hf = dir.path().join("hf");
    let naming = ExportNaming::resolve(&checkpoint.meta, None).unwrap();
    to_fp32(&checkpoint, &hf, None, &|n| naming.names.apply(n)).unwrap();
    write_model_config(&hf, naming.config.as_ref().expect("the recorded config comes along")).unwrap();

    // The zoo's HuggingFace loader reads it: every name and shape as GPT2LMHeadModel has them.
    let device: Device<Flex> = Default::default();
    let (model, loaded) = Gpt2::<Flex>::load_pretrained(&hf, &device).expect("a HuggingFace GPT-2 directory");
    assert_eq!(loaded.n_layer, 2);

    // And holds the trained weights: those of the engine-named export, renamed.
    let internal = dir.path().join("internal");
    to_fp32(&checkpoint, &internal, None, &|n| Some(n.to_string())).unwrap();
    let want = read_all(&internal);
    let rename = NameMap::gpt2_huggingface();
    let want: HashMap<String, Vec<f32>> = want
        .into_iter()
        .map(|(name, values)| (rename.apply(&name).unwrap(), values))
        .collect();
    let got = model.hf_tensors();
    assert_eq!(got.len(), want.len(), "the same tensors");
    for (name, data) in got {
        let name = format!("transformer.{name}");
        let values: Vec<f32> = data.to_vec().unwrap();
        assert_eq!(&values, &want[&name], "{name}");
    }
}
