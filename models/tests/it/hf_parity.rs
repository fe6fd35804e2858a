//! The Burn GPT-2 against HuggingFace transformers' GPT2LMHeadModel on the same weights.
//!
//! Reference: tools/gpt2_reference.py's fixtures (float32 PyTorch on the CPU): logits, loss and
//! every parameter's gradient of one batch. Error measure: max|a - b| / max|b| < 1e-5.

use crate::common;
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use common::{assert_close, fixture, Reference};
use zero_models::gpt2::Gpt2;

type B = Flex;
type AD = Autodiff<Flex>;

#[test]
fn logits_and_loss_match_transformers() {
    let device = Default::default();
    let reference = Reference::read("gpt2-tiny");
    let (model, config) = Gpt2::<B>::load_pretrained(fixture("gpt2-tiny"), &device).unwrap();
    assert_eq!(config.n_layer, 2);

    let tokens = reference.ints::<B>("input_ids", &device);
    let labels = reference.ints::<B>("labels", &device);
    let logits = model.forward(tokens.clone());
    assert_close("logits", &logits.into_data(), &reference.get("logits"));

    let loss = model.loss(tokens.clone(), labels);
    assert_close("loss (labels with -100)", &loss.into_data(), &reference.get("loss"));
    let loss = model.loss(tokens.clone(), tokens);
    assert_close(
        "loss (labels = input_ids)",
        &loss.into_data(),
        &reference.get("loss_unmasked"),
    );
}

#[test]
fn chain_stages_match_transformers_hidden_states() {
    let device = Default::default();
    let reference = Reference::read("gpt2-tiny");
    let (model, _) = Gpt2::<B>::load_pretrained(fixture("gpt2-tiny"), &device).unwrap();
    let tokens = reference.ints::<B>("input_ids", &device);

    let h0 = model.embed(tokens);
    assert_close("embedding output", &h0.clone().into_data(), &reference.get("hidden.0"));

    // A block alone, fed HF's own hidden state: the unit the ZeRO engine runs by itself.
    let block_input = reference.floats::<B, 3>("hidden.0", &device);
    let h1 = model.blocks()[0].forward(block_input);
    assert_close("block 0 output", &h1.into_data(), &reference.get("hidden.1"));

    let h = model.run_blocks(h0);
    assert_close(
        "head logits",
        &model.head_logits(h).into_data(),
        &reference.get("logits"),
    );
}

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

#[test]
fn gradients_match_transformers() {
    let device = Default::default();
    let reference = Reference::read("gpt2-tiny");
    let (model, _) = Gpt2::<AD>::load_pretrained(fixture("gpt2-tiny"), &device).unwrap();
    let tokens = reference.ints::<AD>("input_ids", &device);
    let labels = reference.ints::<AD>("labels", &device);

    let loss = model.loss(tokens, labels);
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let mut collector = GradientCollector {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut collector);

    // param_names lists the parameters in visitor order, so the two zip.
    let names = model.param_names();
    assert_eq!(names.len(), collector.out.len());
    for ((name, _), grad) in names.iter().zip(collector.out) {
        let grad = grad.unwrap_or_else(|| panic!("{name} has no gradient"));
        assert_close(
            &format!("gradient of {name}"),
            &grad,
            &reference.get(&format!("grad.{name}")),
        );
    }
}

#[test]
fn sharded_checkpoint_with_other_options_matches_transformers() {
    // n_inner 48, scale_attn_by_inverse_layer_idx, epsilon 1e-6, weights in several shards
    // listed by model.safetensors.index.json as transformers writes them.
    let device = Default::default();
    let dir = fixture("gpt2-micro-sharded");
    assert!(dir.join("model.safetensors.index.json").is_file());
    let reference = Reference::read("gpt2-micro-sharded");
    let (model, config) = Gpt2::<B>::load_pretrained(&dir, &device).unwrap();
    assert!(config.scale_attn_by_inverse_layer_idx);
    assert_eq!(config.inner_size(), 48);
    let logits = model.forward(reference.ints::<B>("input_ids", &device));
    assert_close("logits", &logits.into_data(), &reference.get("logits"));
}
