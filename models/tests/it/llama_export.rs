//! A checkpoint of a Llama-family run exported by `zero to-fp32`'s code (`ExportNaming::resolve`
//! of what the checkpoint records, then `export_fp32`) is a HuggingFace directory: the zoo's
//! HuggingFace loader (`Llama::load_pretrained`, which reads transformers' names and
//! `[out, in]` linear weights and refuses a missing, unexpected or misshapen tensor) reads it.
//!
//! References: the checkpoint's own fp32 master weights (the same checkpoint exported under the
//! engine's names, tensor by tensor), which the loaded model holds bit for bit; and the trained
//! model's loss on the batch, which the loaded model computes exactly. The names alone are held
//! against `LlamaConfig::param_shapes`, transformers' names and shapes, for each family and both
//! of the zoo's layouts.
//!
//! `ZERO_LLAMA_EXPORT_DIR=DIR` keeps each export as `DIR/<fixture>` with the batch as
//! `DIR/tokens.json`, for `tools/hf_export_loss.py --llama DIR/<fixture> DIR/tokens.json`, which
//! prints transformers' loss beside the one this test prints.

use crate::common::fixture;
use crate::llama_zero::{batch, on_ranks, tokens};

use std::collections::HashMap;
use std::path::Path;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use safetensors::SafeTensors;
use zero_burn::sharded::{held_params, HeldParam};
use zero_burn::InitOptions;
use zero_core::checkpoint::{
    export_fp32, to_fp32, Checkpoint, ExportNaming, Fp32Source, NameMap, TensorLayout, CONFIG_FILE, SINGLE_FILE,
};
use zero_core::config::DeepSpeedConfig;
use zero_models::llama::{Llama, LlamaConfig, ShardedLlama};

type B = Autodiff<Flex, BalancedCheckpointing>;

const WORLD: usize = 2;
const STEPS: usize = 2;

/// A fixture, as the zoo loads it.
fn load(name: &str) -> (Llama<B>, LlamaConfig) {
    Llama::<B>::load_pretrained(fixture(name), &Default::default()).expect("the fixture loads")
}

/// What a rank trains: the plain `Llama` (stages 0-2) or its `ShardedLlama` (any stage).
trait Trained: AutodiffModule<B> {
    /// The mean next-token loss of `t` (labels the tokens themselves).
    fn batch_loss(&self, t: Tensor<B, 2, Int>) -> Tensor<B, 1>;
}

impl Trained for Llama<B> {
    fn batch_loss(&self, t: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.loss(t.clone(), t)
    }
}

impl Trained for ShardedLlama<B> {
    fn batch_loss(&self, t: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.loss(t.clone(), t).expect("the units gather")
    }
}

/// [`STEPS`] AdamW steps of `model` (every rank's) at `stage` on [`WORLD`] ranks, each rank its
/// half of the batch, the engine's settings recording `config`'s model; then a checkpoint into
/// `dir`. Returns the trained model's loss on the whole batch (every rank computes the same).
fn train_and_save<M: Trained>(model: impl Fn() -> M + Sync, config: &LlamaConfig, stage: u8, dir: &Path) -> f32 {
    let micro = batch().len() / WORLD;
    let ds = format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": {micro}, "gradient_accumulation_steps": 1,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.01}}}},
        "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    );
    let ds = DeepSpeedConfig::from_str(&ds, "ds_config.json")
        .expect("valid config")
        .config;
    // What a Llama run's settings carry, so that its checkpoints say which model they hold.
    let options = InitOptions {
        model: Some(config.model_record()),
        ..Default::default()
    };
    let losses = on_ranks(WORLD, |rank, group| {
        let (mut model, mut optim) = zero_burn::initialize_with(&ds, model(), group, &options).expect("initialize");
        let mine = tokens(&batch()[rank * micro..(rank + 1) * micro]);
        for _ in 0..STEPS {
            let loss = model.batch_loss(mine.clone());
            let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
            model = optim.step(0.01, model, grads);
        }
        optim.save_checkpoint(dir, None, &serde_json::json!({})).expect("save");
        model.batch_loss(tokens(&batch())).into_scalar().to_f32()
    });
    assert_eq!(losses[0], losses[1], "every rank's model is the same");
    losses[0]
}

/// Every tensor of the (F32) safetensors files in `dir`, by name: shape and values.
fn read_all(dir: &Path) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let mut out = HashMap::new();
    for entry in std::fs::read_dir(dir).expect("the export").flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).expect("read");
            for (name, view) in SafeTensors::deserialize(&bytes).expect("safetensors").tensors() {
                let values = view
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                out.insert(name, (view.shape().to_vec(), values));
            }
        }
    }
    out
}

/// Every parameter of `model` under its engine name (a checkpoint's layout names), as f32.
fn by_engine_name(model: &Llama<B>) -> HashMap<String, Vec<f32>> {
    let specs = zero_burn::params::describe::<B, _>(model);
    let mut out = HashMap::new();
    zero_burn::params::read_values::<B, _>(model, |i, values| {
        out.insert(specs[i].1.name.clone(), values);
    });
    out
}

/// Trains fixture `name` as `model` builds it, saves, exports as `zero to-fp32 CKPT OUT` does
/// and checks the export against the checkpoint's masters and the trained loss.
fn exports_as_huggingface<M: Trained>(name: &str, model: impl Fn() -> M + Sync, stage: u8) {
    let (_, config) = load(name);
    let dir = tempfile::tempdir().expect("tempdir");
    let saved = dir.path().join("ckpt");
    let trained_loss = train_and_save(model, &config, stage, &saved);

    let checkpoint = Checkpoint::open(&saved, None).expect("the checkpoint opens");
    let record = checkpoint.meta.model.clone().expect("the run records its model");
    assert_eq!(record, config.model_record());
    assert_eq!(record.naming, "llama-hf");

    // `zero to-fp32 CKPT OUT` with no --names: the recorded naming and config.
    let hf = dir.path().join("hf");
    let naming = ExportNaming::resolve(&checkpoint.meta, None).expect("a known naming");
    let report = export_fp32(
        Fp32Source::Checkpoint(&checkpoint),
        &hf,
        None,
        &|n| naming.names.export(n),
        naming.config.as_ref(),
    )
    .expect("export");
    assert_eq!(report.files, vec![hf.join(SINGLE_FILE)]);
    assert_eq!(report.config, Some(hf.join(CONFIG_FILE)));
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join(CONFIG_FILE)).expect("config.json")).expect("JSON");
    assert_eq!(
        written["architectures"],
        serde_json::json!([config.family.architecture()])
    );
    assert_eq!(written["model_type"], config.family.model_type());
    let tensors = read_all(&hf);
    assert_eq!(
        tensors.contains_key("lm_head.weight"),
        !config.tie_word_embeddings,
        "a tied head is not stored"
    );

    // The reference: the checkpoint's masters under the engine's names, as stored.
    let internal = dir.path().join("internal");
    to_fp32(&checkpoint, &internal, None, &|n| Some(n.to_string())).expect("internal export");
    let masters = read_all(&internal);

    let (exported, loaded) = Llama::<B>::load_pretrained(&hf, &Default::default()).expect("a HuggingFace directory");
    assert_eq!(loaded, config, "config.json reads back as the run's config");
    let got = by_engine_name(&exported);
    assert_eq!(got.len(), masters.len(), "{name}: every parameter, nothing else");
    for (param, (_, want)) in &masters {
        let got = &got[param];
        let same = got.len() == want.len() && got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: {param} differs from the checkpoint's master");
    }
    // The export holds trained weights, not the fixture's.
    let (fixture_model, _) = load(name);
    assert_ne!(by_engine_name(&fixture_model), got, "{name}: the weights moved");

    let exported_loss = exported.batch_loss(tokens(&batch())).into_scalar().to_f32();
    println!("{name}: the trained model's loss {trained_loss:.6}, the exported directory's {exported_loss:.6}");
    assert_eq!(exported_loss, trained_loss, "{name}: the loss of the exported model");

    if let Some(keep) = std::env::var_os("ZERO_LLAMA_EXPORT_DIR") {
        let keep = Path::new(&keep);
        let out = keep.join(name);
        std::fs::create_dir_all(&out).expect("create");
        for file in [SINGLE_FILE, CONFIG_FILE] {
            std::fs::copy(hf.join(file), out.join(file)).expect("keep the export");
        }
        std::fs::write(keep.join("tokens.json"), serde_json::to_vec(&batch()).expect("JSON")).expect("tokens");
    }
}

/// llama-micro (untied head, attention and MLP biases, Llama 3's rotary scaling) as
/// `ShardedLlama` at stage 3: the embedding, each layer and the head a unit of its own.
#[test]
fn a_sharded_untied_llama_at_stage_3_exports_as_a_huggingface_directory() {
    exports_as_huggingface("llama-micro", || load("llama-micro").0.into_sharded(), 3);
}

/// qwen3-micro (tied head, per-head q/k norms, its own head_dim) as the plain `Llama` at
/// stage 2.
#[test]
fn a_plain_tied_qwen3_at_stage_2_exports_as_a_huggingface_directory() {
    exports_as_huggingface("qwen3-micro", || load("qwen3-micro").0, 2);
}

/// The `llama-hf` naming turns both layouts' engine names (the plain model's, and
/// `ShardedLlama`'s, whose units leave no trace in a name) into transformers' names and shapes,
/// in order, for each family: exactly `LlamaConfig::param_shapes`, every transposed tensor a
/// linear weight.
#[test]
fn the_llama_naming_gives_transformers_names_and_shapes_for_both_layouts() {
    let naming = NameMap::named("llama-hf").expect("a known naming");
    for name in ["llama-micro", "qwen2-micro", "qwen3-micro", "mistral-micro"] {
        let (model, config) = load(name);
        let plain: Vec<(String, Vec<usize>)> = zero_burn::params::describe::<B, _>(&model)
            .into_iter()
            .map(|(_, spec)| (spec.name, spec.shape))
            .collect();
        let mut sharded = Vec::new();
        for (_, held) in held_params::<B, _>(&model.into_sharded()) {
            match held {
                HeldParam::Plain(spec) => sharded.push((spec.name, spec.shape)),
                HeldParam::Unit { params, .. } => sharded.extend(params.into_iter().map(|s| (s.name, s.shape))),
                HeldParam::Skeleton => {}
            }
        }
        assert_eq!(sharded, plain, "{name}: both layouts name their parameters alike");
        let exported: Vec<(String, Vec<usize>)> = plain
            .iter()
            .map(|(engine, shape)| {
                let t = naming.export(engine).expect("no parameter is dropped");
                let shape = match t.layout {
                    TensorLayout::AsStored => shape.clone(),
                    TensorLayout::Transposed => {
                        assert!(
                            t.name.ends_with("_proj.weight") || t.name == "lm_head.weight",
                            "{}",
                            t.name
                        );
                        vec![shape[1], shape[0]]
                    }
                };
                (t.name, shape)
            })
            .collect();
        assert_eq!(exported, config.param_shapes(), "{name}");
    }
}
