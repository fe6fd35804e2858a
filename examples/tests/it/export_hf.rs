//! A `gpt2 train` checkpoint exported the way `zero to-fp32` does by default is a HuggingFace
//! GPT-2 directory: the checkpoint records its model, so the export takes HuggingFace's names
//! and writes `config.json` beside them, and the zoo's HuggingFace loader reads it back.
//! Reference: the same checkpoint exported under the engine's own names, tensor by tensor.

use crate::support;
use burn::backend::Flex;
use burn::tensor::Device;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::Path;
use zero_core::checkpoint::{to_fp32, write_model_config, Checkpoint, ExportNaming, NameMap};
use zero_models::gpt2::Gpt2;
use zero_test_support::max_abs;

/// Every tensor of the safetensors files in `dir`, by name, as f32.
fn read_all(dir: &Path) -> HashMap<String, Vec<f32>> {
    let mut out = HashMap::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            out.extend(read_file(&path));
        }
    }
    out
}

/// Every tensor of one (F32) safetensors file, by name.
fn read_file(path: &Path) -> HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    SafeTensors::deserialize(&bytes)
        .unwrap()
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, values)
        })
        .collect()
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

/// A tensor-parallel run's checkpoint (2 tensor × 2 data ranks, ZeRO 3: each rank's slices cut
/// again over the data ranks) exports whole: `zero to-fp32` of the directory merges every split
/// parameter's slices (the fused q|k|v projection block by block) into a HuggingFace GPT-2
/// directory the zoo's loader reads. References: with a learning rate of 0, the HuggingFace
/// fixture the run started from, bit for bit; trained, the same training without tensor
/// parallelism (2 data ranks, which trains like PyTorch to 1e-5: pipeline_train.rs), exported
/// the same way, to float rounding of the other order of sums.
#[test]
fn a_tensor_parallel_checkpoint_exports_whole() {
    let dir = tempfile::tempdir().unwrap();
    let untouched = export(dir.path(), 2, 1, 4, 0.0);
    matches_fixture(&untouched);

    let (got, want) = (
        read_all(&export(dir.path(), 2, 1, 4, 1e-3)),
        read_all(&export(dir.path(), 1, 1, 2, 1e-3)),
    );
    agree_to_rounding(&got, &want);
}

/// The same with the tensor-parallel ranks cut into pipeline stages (2 tensor × 2 pipeline
/// ranks, ZeRO 1): each stage's first data rank writes the slices of its tensor index for every
/// stage, and the export merges them. References as above: the fixture bit for bit with a
/// learning rate of 0, the trained run without tensor parallelism nor pipeline to rounding.
#[test]
fn a_pipelined_tensor_parallel_checkpoint_exports_whole() {
    let dir = tempfile::tempdir().unwrap();
    let untouched = export(dir.path(), 2, 2, 4, 0.0);
    matches_fixture(&untouched);
    agree_to_rounding(
        &read_all(&export(dir.path(), 2, 2, 4, 1e-3)),
        &read_all(&export(dir.path(), 1, 1, 2, 1e-3)),
    );
}

/// The export in `dir` holds the HuggingFace fixture the runs start from, bit for bit.
fn matches_fixture(dir: &Path) {
    let want = read_file(&support::fixture_model().join("model.safetensors"));
    let got = read_all(dir);
    assert_eq!(got.len(), want.len(), "the same tensors");
    for (name, values) in &want {
        assert!(
            &got[name] == values,
            "{name}: the merged export differs from the fixture"
        );
    }
}

/// `got` (merged from tensor-parallel slices) against `want` (trained without them), to the
/// rounding of sums taken in another order.
fn agree_to_rounding(got: &HashMap<String, Vec<f32>>, want: &HashMap<String, Vec<f32>>) {
    assert_eq!(got.len(), want.len(), "the same tensors");
    assert!(got.keys().any(|n| n.contains("c_attn")));
    // The tolerance of the other tensor-parallel tests (models/tests/it/tp_training.rs): 1e-5 of the
    // model's largest weight.
    let every: Vec<f32> = want.values().flatten().copied().collect();
    let scale = max_abs("the tensors trained without tensor parallelism", &every) as f32;
    for (name, w) in want {
        let g = &got[name];
        assert_eq!(g.len(), w.len(), "{name}");
        let bias_k = name.ends_with("c_attn.bias").then(|| w.len() / 3..2 * w.len() / 3);
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            // The keys' bias moves no score within a softmax row: its true gradient is 0, and
            // Adam turns the rounding left in it into steps of up to the learning rate, in either
            // direction, in any two runs that sum in another order.
            let limit = if bias_k.as_ref().is_some_and(|k| k.contains(&i)) {
                4.0 * 1e-3 * 2.0
            } else {
                1e-5 * scale
            };
            assert!(
                (a - b).abs() <= limit,
                "{name}[{i}]: {a} merged against {b} without tensor parallelism"
            );
        }
    }
}

/// Trains the fixture 4 steps with learning rate `lr` over `tensor` tensor ranks × `stages`
/// pipeline stages (of `nproc` ranks; ZeRO 3, or 1 with a pipeline, which refuses 3), saves,
/// and exports the checkpoint as `zero to-fp32 DIR OUT` does; returns OUT.
fn export(dir: &Path, tensor: usize, stages: usize, nproc: usize, lr: f64) -> std::path::PathBuf {
    use zero_core::checkpoint::{to_fp32_tensor_parallel, TensorParallelCheckpoint};
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(support::fixture("train_config.json")).unwrap()).unwrap();
    config["gradient_accumulation_steps"] = serde_json::json!(8 / (nproc / (tensor * stages)));
    config["zero_optimization"] = serde_json::json!({ "stage": if stages > 1 { 1 } else { 3 } });
    config["tensor_parallel"] = serde_json::json!({ "autotp_size": tensor });
    config["pipeline"] = serde_json::json!({ "stages": stages, "partition": "uniform" });
    config["optimizer"]["params"]["lr"] = serde_json::json!(lr);
    let name = format!("tp{tensor}-pp{stages}-lr{lr}");
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, config.to_string()).unwrap();
    let save = dir.join(format!("ckpt-{name}"));
    let args = zero_examples::gpt2::TrainArgs {
        save: Some(save.clone()),
        ..support::fixture_args(&path, 4, nproc)
    };
    zero_examples::gpt2::train(&args).expect("training runs");
    let out = dir.join(format!("export-{name}"));
    match TensorParallelCheckpoint::open(&save, None).unwrap() {
        Some(tp) => {
            assert_eq!(tp.ranks.len(), tensor);
            // One tensor rank on its own holds slices: converting it alone is refused.
            let alone = to_fp32(&tp.ranks[1], &dir.join("alone"), None, &|n| Some(n.to_string()));
            assert!(alone.unwrap_err().to_string().contains("tensor rank 1 of 2"));
            let naming = ExportNaming::resolve(&tp.ranks[0].meta, None).unwrap();
            to_fp32_tensor_parallel(&tp, &out, None, &|n| naming.names.apply(n)).unwrap();
            write_model_config(&out, naming.config.as_ref().expect("the trainer records its model")).unwrap();
        }
        None => {
            let checkpoint = Checkpoint::open(&save, None).unwrap();
            let naming = ExportNaming::resolve(&checkpoint.meta, None).unwrap();
            to_fp32(&checkpoint, &out, None, &|n| naming.names.apply(n)).unwrap();
            write_model_config(&out, naming.config.as_ref().expect("the trainer records its model")).unwrap();
        }
    }
    let device: Device<Flex> = Default::default();
    Gpt2::<Flex>::load_pretrained(&out, &device).expect("a HuggingFace GPT-2 directory");
    out
}
