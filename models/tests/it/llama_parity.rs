//! The Llama family in Burn against HuggingFace transformers on the same weights, one model of
//! each family: `LlamaForCausalLM` (llama3 rope scaling, attention and MLP biases, untied head),
//! `Qwen2ForCausalLM` (q/k/v biases, tied, sharded checkpoint), `Qwen3ForCausalLM` (q/k norm,
//! explicit head_dim, tied) and `MistralForCausalLM` (untied).
//!
//! Reference: tools/llama_reference.py's fixtures (float32 PyTorch on the CPU, eager attention):
//! logits, loss and every parameter's gradient of one batch whose labels hold -100s. Error
//! measure: max|a - b| / max|b| < 1e-5.

use crate::common;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use common::{assert_close, fixture, Reference};
use zero_models::hf::CheckpointError;
use zero_models::llama::{Llama, LlamaConfig, LlamaFamily};

type B = Flex;
type AD = Autodiff<Flex>;

/// Collects every float parameter's gradient in visitor order.
struct GradientCollector<'a> {
    grads: &'a GradientsParams,
    out: Vec<Option<TensorData>>,
}

impl ModuleVisitor<AD> for GradientCollector<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AD, D>>) {
        let grad = self.grads.get::<B, D>(param.id);
        self.out.push(grad.map(|g| g.into_data()));
    }
}

/// Burn's `[in, out]` linear weight (or its gradient) in PyTorch's `[out, in]`.
fn to_pytorch_layout(name: &str, data: TensorData) -> TensorData {
    let linear = name.ends_with("_proj.weight") || name == "lm_head.weight";
    if !linear {
        return data;
    }
    let tensor = Tensor::<B, 2>::from_data(data, &Default::default());
    tensor.transpose().into_data()
}

/// Logits, loss, layer 0's output and every gradient of the fixture `name` against
/// transformers'; returns the config for the caller's checks of what the fixture exercises.
fn matches_transformers(name: &str) -> LlamaConfig {
    let device = Default::default();
    let reference = Reference::read(name);
    let (model, config) = Llama::<AD>::load_pretrained(fixture(name), &device).unwrap();
    let tokens = reference.ints::<AD>("input_ids", &device);
    let labels = reference.ints::<AD>("labels", &device);

    let logits = model.forward(tokens.clone());
    assert_close(
        &format!("{name}: logits"),
        &logits.into_data(),
        &reference.get("logits"),
    );
    let h1 = model.layers()[0].forward(model.embed(tokens.clone()));
    assert_close(
        &format!("{name}: layer 0 output"),
        &h1.into_data(),
        &reference.get("hidden.1"),
    );

    let loss = model.loss(tokens, labels);
    assert_close(
        &format!("{name}: loss (labels with -100)"),
        &loss.clone().into_data(),
        &reference.get("loss"),
    );
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let mut collector = GradientCollector {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut collector);
    // param_names lists the parameters in visitor order, so the two zip.
    let names = model.param_names();
    assert_eq!(names.len(), collector.out.len());
    for ((param, _), grad) in names.iter().zip(collector.out) {
        let grad = grad.unwrap_or_else(|| panic!("{name}: {param} has no gradient"));
        assert_close(
            &format!("{name}: gradient of {param}"),
            &to_pytorch_layout(param, grad),
            &reference.get(&format!("grad.{param}")),
        );
    }
    // zero-core's estimate reads the same shape from transformers' config.json.
    let json = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    let shape = zero_core::estimate::LlamaShape::from_config_json(&json).unwrap();
    assert_eq!(shape, config.estimate_shape(), "{name}: the estimate's shape");
    assert_eq!(
        shape.num_params(),
        names
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum::<u64>()
    );
    config
}

#[test]
fn llama_with_llama3_rope_and_biases_matches_transformers() {
    let config = matches_transformers("llama-micro");
    assert_eq!(config.family, LlamaFamily::Llama);
    let scaling = config.rope_scaling.expect("llama3 rope scaling");
    assert_eq!(scaling.factor, 8.0);
    assert!(config.qkv_bias() && config.o_bias() && config.mlp_has_bias());
    assert!(!config.tie_word_embeddings);
}

#[test]
fn qwen2_with_qkv_bias_from_shards_matches_transformers() {
    assert!(fixture("qwen2-micro").join("model.safetensors.index.json").is_file());
    let config = matches_transformers("qwen2-micro");
    assert_eq!(config.family, LlamaFamily::Qwen2);
    assert!(config.qkv_bias() && !config.o_bias());
    assert!(config.tie_word_embeddings);
}

#[test]
fn qwen3_with_qk_norm_and_head_dim_matches_transformers() {
    let config = matches_transformers("qwen3-micro");
    assert_eq!(config.family, LlamaFamily::Qwen3);
    assert!(config.qk_norm());
    assert_eq!(config.head_dim, 32);
    assert_ne!(config.head_dim, config.hidden_size / config.num_attention_heads);
}

#[test]
fn mistral_matches_transformers_within_its_window() {
    let config = matches_transformers("mistral-micro");
    assert_eq!(config.family, LlamaFamily::Mistral);
    assert_eq!(config.attention_window(), Some(32));
    // Past the window transformers would mask what this implementation attends to: refused,
    // at the edge and by the forward pass.
    let err = config.check_sequence(33).unwrap_err().to_string();
    assert!(err.contains("sliding_window = 32"), "{err}");
    let (model, _) = Llama::<B>::load_pretrained(fixture("mistral-micro"), &Default::default()).unwrap();
    let long = Tensor::<B, 2, Int>::zeros([1, 33], &Default::default());
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.forward(long))).unwrap_err();
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains("exceeds the attention's sliding_window = 32"),
        "{message}"
    );
}

/// Every tensor's name, shape and values.
fn values(model: &Llama<B>) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    model
        .hf_tensors()
        .into_iter()
        .map(|(name, data)| (name, data.shape.to_vec(), data.to_vec::<f32>().unwrap()))
        .collect()
}

#[test]
fn written_directories_load_back_bit_exact() {
    // Reference: the fixture as loaded; the written directory must hold the same config and
    // the same bits (one file, and shards with an index). That transformers loads it:
    // `python3 tools/llama_reference.py --check DIR FIXTURE`.
    let device = Default::default();
    for name in ["llama-micro", "qwen2-micro", "qwen3-micro", "mistral-micro"] {
        let (model, config) = Llama::<B>::load_pretrained(fixture(name), &device).unwrap();
        let want = values(&model);
        for max_shard_bytes in [usize::MAX, 16 * 1024] {
            let dir = tempfile::tempdir().unwrap();
            model
                .save_pretrained_sharded(dir.path(), &config, max_shard_bytes)
                .unwrap();
            let sharded = dir.path().join("model.safetensors.index.json").is_file();
            assert_eq!(sharded, max_shard_bytes != usize::MAX, "{name}: layout");
            let (again, again_config) = Llama::<B>::load_pretrained(dir.path(), &device).unwrap();
            assert_eq!(again_config, config, "{name}: config");
            assert!(values(&again) == want, "{name}: tensors differ after a round trip");
        }
    }
}

/// A copy of a fixture's config.json and single weights file in a temporary directory, the
/// config edited by `edit`.
fn edited_copy(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut config);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        fixture(name).join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    dir
}

fn load_error(dir: &std::path::Path) -> String {
    Llama::<B>::load_pretrained(dir, &Default::default())
        .map(|_| ())
        .unwrap_err()
        .to_string()
}

#[test]
fn config_errors_name_the_file_the_key_and_what_is_valid() {
    let dir = edited_copy("llama-micro", |c| c["model_type"] = "gpt_neox".into());
    let err = load_error(dir.path());
    assert!(
        err.contains("config.json") && err.contains("model_type = \"gpt_neox\"") && err.contains("qwen3"),
        "{err}"
    );
    let dir = edited_copy("llama-micro", |c| c["rope_parameters"]["rope_type"] = "yarn".into());
    let err = load_error(dir.path());
    assert!(
        err.contains("config.json")
            && err.contains("rope_parameters.rope_type = \"yarn\"")
            && err.contains("default, llama3"),
        "{err}"
    );
    let dir = edited_copy("mistral-micro", |c| c["hidden_act"] = "gelu".into());
    assert!(load_error(dir.path()).contains("hidden_act = \"gelu\""));
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let device = Default::default();
    let (model, config) = Llama::<B>::load_pretrained(fixture("mistral-micro"), &device).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save_pretrained(dir.path(), &config).unwrap();

    // The config asks for an untied head the weights do not hold.
    let mut untied_qwen3 = LlamaConfig::from_pretrained_dir(fixture("qwen3-micro")).unwrap();
    untied_qwen3.tie_word_embeddings = false;
    let qwen3 = tempfile::tempdir().unwrap();
    let (model3, config3) = Llama::<B>::load_pretrained(fixture("qwen3-micro"), &device).unwrap();
    model3.save_pretrained(qwen3.path(), &config3).unwrap();
    std::fs::write(qwen3.path().join("config.json"), untied_qwen3.to_json_string()).unwrap();
    match Llama::<B>::load_pretrained(qwen3.path(), &device)
        .map(|_| ())
        .unwrap_err()
    {
        CheckpointError::KeyMismatch {
            missing, unexpected, ..
        } => {
            assert_eq!(missing, vec!["lm_head.weight".to_string()]);
            assert!(unexpected.is_empty());
        }
        other => panic!("expected the missing lm_head.weight to be named, got {other}"),
    }

    // A wider MLP in the config than in the weights (the first tensor in the file's order named).
    let mut wider = config.clone();
    wider.intermediate_size = 128;
    std::fs::write(dir.path().join("config.json"), wider.to_json_string()).unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("model.layers.0.mlp.down_proj.weight")
            && err.contains("[48, 96]")
            && err.contains("needs [48, 128]"),
        "{err}"
    );

    // One layer more in the config than in the weights: every tensor of it is listed missing.
    let mut deeper = config.clone();
    deeper.num_hidden_layers = 3;
    std::fs::write(dir.path().join("config.json"), deeper.to_json_string()).unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("missing [model.layers.2.input_layernorm.weight")
            && err.contains("model.layers.2.mlp.up_proj.weight"),
        "{err}"
    );
}

/// A checkpoint stored in BF16 (as most published Llama-family weights are) or F16 loads widened
/// to f32. Reference: the fixture's f32 values rounded to the 16-bit type by the `half` crate.
#[test]
fn bf16_and_f16_checkpoints_load_widened() {
    use safetensors::tensor::{Dtype, TensorView};
    let device = Default::default();
    let (model, config) = Llama::<B>::load_pretrained(fixture("qwen3-micro"), &device).unwrap();
    let tensors = model.hf_tensors();
    for dtype in [Dtype::BF16, Dtype::F16] {
        let narrow = |v: f32| match dtype {
            Dtype::BF16 => half::bf16::from_f32(v).to_le_bytes(),
            _ => half::f16::from_f32(v).to_le_bytes(),
        };
        let widen = |v: f32| match dtype {
            Dtype::BF16 => half::bf16::from_f32(v).to_f32(),
            _ => half::f16::from_f32(v).to_f32(),
        };
        let stored: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(name, data)| {
                let bytes = data.to_vec::<f32>().unwrap().into_iter().flat_map(narrow).collect();
                (name.clone(), data.shape.to_vec(), bytes)
            })
            .collect();
        let views = stored
            .iter()
            .map(|(name, shape, bytes)| (name.as_str(), TensorView::new(dtype, shape.clone(), bytes).unwrap()));
        let dir = tempfile::tempdir().unwrap();
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        std::fs::write(dir.path().join("config.json"), config.to_json_string()).unwrap();
        let (loaded, _) = Llama::<B>::load_pretrained(dir.path(), &device).unwrap();
        for ((name, got), (_, want)) in loaded.hf_tensors().iter().zip(&tensors) {
            let want: Vec<f32> = want.to_vec::<f32>().unwrap().into_iter().map(widen).collect();
            assert!(got.to_vec::<f32>().unwrap() == want, "{dtype:?}: {name}");
        }
    }
}
