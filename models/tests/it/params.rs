//! Parameter names, shapes, order and counts.
//!
//! References: Burn's own module visitor (order and count of the built model) and the formula
//! `Gpt2Config::num_params`, itself checked against transformers' published counts in its unit
//! tests.

use burn::backend::Flex;
use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use zero_models::gpt2::{Gpt2Config, HF_PREFIX};

type B = Flex;

struct ShapeCollector(Vec<Vec<usize>>);

impl ModuleVisitor<B> for ShapeCollector {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.val().dims().to_vec());
    }
}

fn small_configs() -> Vec<Gpt2Config> {
    let mut odd = Gpt2Config::new(101, 20, 24, 3, 3);
    odd.n_inner = Some(40);
    vec![Gpt2Config::new(64, 16, 32, 2, 4), odd, Gpt2Config::tiny()]
}

#[test]
fn param_names_follow_visitor_order_with_hf_names() {
    let device = Default::default();
    for config in small_configs() {
        let model = config.init::<B>(&device);
        let names = model.param_names();
        let mut visited = ShapeCollector(Vec::new());
        model.visit(&mut visited);
        let shapes: Vec<Vec<usize>> = names.iter().map(|(_, shape)| shape.clone()).collect();
        assert_eq!(shapes, visited.0);

        let expected: Vec<(String, Vec<usize>)> = config
            .param_shapes()
            .into_iter()
            .map(|(name, shape)| (format!("{HF_PREFIX}{name}"), shape))
            .collect();
        assert_eq!(names, expected);
        assert_eq!(names[0].0, "transformer.wte.weight");
        assert_eq!(names[4].0, "transformer.h.0.attn.c_attn.weight");
        assert_eq!(names[4].1, vec![config.n_embd, 3 * config.n_embd]);
    }
}

#[test]
fn built_model_has_the_formula_count() {
    let device = Default::default();
    for config in small_configs() {
        let model = config.init::<B>(&device);
        assert_eq!(model.num_params() as u64, config.num_params(), "{config:?}");
    }
    assert_eq!(Gpt2Config::tiny().num_params(), 6_960_768);
}

#[test]
fn initialization_follows_gpt2() {
    // GPT-2's init: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 n_layer), zero
    // biases, unit LayerNorm scales. Reference: the sample statistics, with a wide margin.
    let device = Default::default();
    let config = Gpt2Config::new(512, 64, 128, 8, 4);
    let model = config.init::<B>(&device);
    let std = |t: Tensor<B, 2>| t.var(0).mean().sqrt().into_scalar() as f64;
    let wte_std = std(model.wte.weight.val().reshape([1, -1]).transpose());
    assert!((wte_std - 0.02).abs() < 0.001, "wte std {wte_std}");
    let proj = model.blocks[0].mlp.c_proj.weight.val().reshape([1, -1]).transpose();
    let proj_std = std(proj);
    let expected = 0.02 / (16f64).sqrt();
    assert!((proj_std - expected).abs() < 0.1 * expected, "c_proj std {proj_std}");
    let bias = model.blocks[0].attn.c_attn.bias.as_ref().unwrap().val();
    assert_eq!(bias.abs().max().into_scalar(), 0.0);
    let gamma = model.ln_f.gamma.val();
    assert_eq!(gamma.sum().into_scalar(), 128.0);
}
