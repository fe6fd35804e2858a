//! Bad input is an error that says what to change.

use crate::common;
use burn::module::Param;
use burn::nn::LinearConfig;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::Tensor;
use common::*;
use zero_burn::{EngineSettings, Stage, ZeroError, ZeroOptimizer};
use zero_core::config::DeepSpeedConfig;
use zero_core::optim::OptimizerSpec;

fn config(text: &str) -> DeepSpeedConfig {
    DeepSpeedConfig::from_str(text, "ds_config.json")
        .expect("valid config")
        .config
}

/// Stage 3 over a model with nothing to partition: a plain Burn module (no `ZeroModule`) under
/// `ZeroOptimizer`, from a config through `initialize` and from settings at the first step.
#[test]
fn stage_3_with_nothing_to_partition_says_what_to_do() {
    let cfg = config(
        r#"{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
        "zero_optimization": {"stage": 3}}"#,
    );
    let err = on_ranks(1, move |_, group| {
        let device = Default::default();
        zero_burn::initialize::<B, _>(&cfg, Net::<B>::new(&device, 2), group)
            .err()
            .map(|e| e.to_string())
    })
    .remove(0)
    .expect("stage 3 over a model without ZeroModules must be refused by initialize");
    assert!(err.contains("stage 3") && err.contains("ZeroModule"), "{err}");

    let err = on_ranks(1, |_, group| {
        let device = Default::default();
        let mut optim =
            ZeroOptimizer::new(EngineSettings::new(Stage::Zero3, OptimizerSpec::adamw()), group).expect("optimizer");
        let model = Net::<B>::new(&device, 2);
        let (x, y) = batch::<B>(0, 0..4, &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        optim.try_step(1e-3, model, grads).err().map(|e| e.to_string())
    })
    .remove(0)
    .expect("stage 3 over a model without ZeroModules must be refused at the first step");
    assert!(err.contains("stage 3") && err.contains("ZeroModule"), "{err}");
}

#[test]
fn a_batch_the_world_size_cannot_split_names_the_values() {
    let cfg = config(
        r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}"#,
    );
    let err = on_ranks(3, move |_, group| {
        let device = Default::default();
        zero_burn::initialize::<B, _>(&cfg, Net::<B>::new(&device, 1), group)
            .err()
            .map(|e| e.to_string())
    })
    .remove(0)
    .expect("8 samples cannot be 2 x 2 x 3 ranks");
    assert!(err.contains("8") && err.contains("world") && err.contains("3"), "{err}");
}

#[test]
fn a_parameter_that_changes_shape_is_named() {
    let message = on_ranks(1, |_, group| {
        let device = Default::default();
        let mut optim =
            ZeroOptimizer::new(EngineSettings::new(Stage::Zero1, OptimizerSpec::adamw()), group).expect("optimizer");
        let model = Net::<B>::new(&device, 1);
        let (x, y) = batch::<B>(0, 0..4, &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        let mut model = Optimizer::<Net<B>, B>::step(&mut optim, 1e-3, model, grads);
        // The same parameter (same id) now wider: the flat layout no longer fits it.
        let id = model.ends.head.weight.id;
        model.ends.head = LinearConfig::new(HIDDEN, OUT + 1).init(&device);
        model.ends.head.weight = Param::initialized(id, Tensor::zeros([HIDDEN, OUT + 1], &device).require_grad());
        let (x, _) = batch::<B>(1, 0..4, &device);
        let grads = GradientsParams::from_grads(model.loss(x, Tensor::zeros([4, OUT + 1], &device)).backward(), &model);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Optimizer::<Net<B>, B>::step(&mut optim, 1e-3, model, grads)
        }));
        match outcome {
            Ok(_) => String::new(),
            Err(payload) => payload.downcast_ref::<String>().cloned().unwrap_or_default(),
        }
    })
    .remove(0);
    assert!(
        message.contains("ends.head.weight") && message.contains("shape"),
        "got: {message:?}"
    );
}

#[test]
fn sixteen_bit_masters_are_refused_not_ignored() {
    for (section, key) in [
        (
            r#""bf16": {"enabled": true, "bf16_master_weights_and_grads": true}"#,
            "bf16_master_weights_and_grads",
        ),
        (
            r#""fp16": {"enabled": true, "fp16_master_weights_and_grads": true}"#,
            "fp16_master_weights_and_grads",
        ),
    ] {
        let text = format!(
            r#"{{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "Adam", "params": {{"lr": 0.001}}}}, {section}}}"#
        );
        let cfg = config(&text);
        let resolved = zero_burn::resolve(&cfg, 1, &Default::default()).expect("resolves");
        let err = zero_burn::engine_settings(&resolved).expect_err("must be refused");
        assert!(matches!(err, ZeroError::Config(_)));
        assert!(err.to_string().contains(key), "{err}");
    }
}

/// Gradients are averaged over the ranks: a config asking for their sum is refused, not trained
/// with the mean.
#[test]
fn summed_gradients_are_refused_not_averaged() {
    let text = r#"{"train_micro_batch_size_per_gpu": 2, "gradient_allreduce_op": "sum",
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}"#;
    let resolved = zero_burn::resolve(&config(text), 2, &Default::default()).expect("resolves");
    let err = zero_burn::engine_settings(&resolved).expect_err("must be refused");
    assert!(matches!(err, ZeroError::Config(_)));
    assert!(err.to_string().contains("gradient_allreduce_op"), "{err}");
    let mean = text.replace("\"sum\"", "\"mean\"");
    let resolved = zero_burn::resolve(&config(&mean), 2, &Default::default()).expect("resolves");
    zero_burn::engine_settings(&resolved).expect("the mean is what the engine does");
}

/// A config that names no optimizer trains with the one the program gives
/// (`InitOptions::optimizer`, DeepSpeed's client optimizer), exactly as with the same optimizer
/// named in the config; with neither, or with both, initialize says so.
#[test]
fn a_config_without_optimizer_takes_the_programs() {
    let without =
        config(r#"{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3}}"#);
    let with = config(
        r#"{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "eps": 1e-4, "weight_decay": 0.01}}}"#,
    );
    let client = adamw_eps4(0.01);
    let run = |cfg: &DeepSpeedConfig, optimizer: Option<OptimizerSpec>| {
        on_ranks(2, |rank, group| {
            let device = Default::default();
            let options = zero_burn::InitOptions {
                optimizer: optimizer.clone(),
                ..Default::default()
            };
            let (mut model, mut optim) =
                zero_burn::initialize_with(cfg, UnitNet::<B>::new(&device, 2), group, &options)?;
            for step in 0..3 {
                let (x, y) = batch::<B>(step, rows(rank, 2, 0, 1), &device);
                let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                model = optim.try_step(0.01, model, grads)?;
            }
            Ok::<_, ZeroError>(model.weights())
        })
        .remove(0)
    };
    let given = run(&without, Some(client.clone())).expect("the program's optimizer");
    let named = run(&with, None).expect("the config's optimizer");
    assert_eq!(given, named, "the program's AdamW trains as the config's");
    let neither = run(&without, None).expect_err("no optimizer anywhere");
    assert!(neither.to_string().contains("names no optimizer"), "{neither}");
    let both = run(&with, Some(client)).expect_err("two optimizers");
    assert!(both.to_string().contains("InitOptions::optimizer"), "{both}");
}

/// Ranks given different optimizer settings would each step its shard its own way: initialize
/// refuses, naming the setting and the rank, on every rank.
#[test]
fn ranks_given_other_settings_are_named_at_initialize() {
    let errors = on_ranks(2, |rank, group| {
        let lr = if rank == 0 { 0.01 } else { 0.02 };
        let cfg = config(&format!(
            r#"{{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {{"stage": 1}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": {lr}}}}}}}"#
        ));
        let device = Default::default();
        zero_burn::initialize::<B, _>(&cfg, UnitNet::<B>::new(&device, 2), group)
            .map(|_| ())
            .expect_err("settings differ")
    });
    let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert!(
        text[1].contains("rank 1 was given other settings") && text[1].contains("optimizer"),
        "{text:?}"
    );
    assert!(
        !text[1].contains("gradient_clipping"),
        "only what differs is named: {text:?}"
    );
    assert!(
        text[0].contains("rank 1 was given other settings"),
        "rank 0 stops too: {text:?}"
    );
    // The same settings pass.
    let cfg = config(
        r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
    );
    on_ranks(2, |_, group| {
        let device = Default::default();
        zero_burn::initialize::<B, _>(&cfg, UnitNet::<B>::new(&device, 2), group).expect("the same settings");
    });
}

/// A step whose gradients hold none of the model's parameters (another model's, or none) would
/// still move every parameter by weight decay: refused, and the optimizer goes on.
#[test]
fn a_step_without_the_models_gradients_is_refused() {
    let cfg = config(
        r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}}"#,
    );
    on_ranks(1, |_, group| {
        let device = Default::default();
        let (model, mut optim) =
            zero_burn::initialize::<B, _>(&cfg, UnitNet::<B>::new(&device, 2), group).expect("init");
        let before = values::<B, _>(&model);
        let err = optim
            .try_step(0.01, model.clone(), GradientsParams::new())
            .map(|_| ())
            .expect_err("no gradients");
        assert!(err.to_string().contains("none of the model's parameters"), "{err}");
        // Gradients of another instance of the model.
        let other = UnitNet::<B>::new(&device, 2);
        let (x, y) = batch::<B>(0, 0..2, &device);
        let foreign = GradientsParams::from_grads(other.loss(x.clone(), y.clone()).backward(), &other);
        let err = optim
            .try_step(0.01, model.clone(), foreign)
            .map(|_| ())
            .expect_err("another model's");
        assert!(err.to_string().contains("another model"), "{err}");
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        let model = optim.try_step(0.01, model, grads).expect("the model's own gradients");
        assert_ne!(values::<B, _>(&model), before);
    });
}

/// A module mapper that gives a unit a new flat parameter (a new id, which no unit of this
/// process answers to): initialize says so instead of leaving the unit uncut (every rank holding
/// it whole at stage 3). A Burn record keeps the unit's id (tests/sharded_record.rs).
#[test]
fn a_unit_whose_parameter_a_mapper_replaced_is_refused() {
    use burn::module::{Module, ModuleMapper};
    struct Renew;
    impl ModuleMapper<B> for Renew {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            Param::from_tensor(param.val())
        }
    }
    let cfg = config(
        r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
    );
    let errors = on_ranks(2, |_, group| {
        let model = UnitNet::<B>::new(&Default::default(), 2).map(&mut Renew);
        zero_burn::initialize::<B, _>(&cfg, model, group)
            .map(|_| ())
            .expect_err("units with new parameters")
    });
    for err in errors {
        assert!(
            err.to_string().contains("blocks.0") && err.to_string().contains("ZeroModule::modify"),
            "{err}"
        );
    }
}

/// Units do not nest: a `ZeroModule` inside another's module is refused, at the cut (stage 3)
/// and at the forward (stages 0-2), not a panic on an emptied parameter.
#[test]
fn nested_units_are_refused() {
    use burn::module::Module;
    use burn::tensor::backend::Backend;
    use zero_burn::sharded::ZeroModule;
    #[derive(Module, Debug)]
    struct Outer<B: Backend> {
        lin: burn::nn::Linear<B>,
        inner: ZeroModule<B, Block<B>>,
    }
    #[derive(Module, Debug)]
    struct Nested<B: Backend> {
        outer: ZeroModule<B, Outer<B>>,
    }
    let build = |device: &burn::tensor::Device<B>| Nested {
        outer: ZeroModule::new(Outer {
            lin: LinearConfig::new(HIDDEN, HIDDEN).init(device),
            inner: ZeroModule::new(Net::<B>::new(device, 1).blocks.remove(0)),
        }),
    };
    for stage in [1, 3] {
        let cfg = config(&format!(
            r#"{{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {{"stage": {stage}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}}}}"#
        ));
        let errors = on_ranks(2, |_, group| {
            let device = Default::default();
            let x = Tensor::<B, 2>::zeros([2, HIDDEN], &device);
            match zero_burn::initialize::<B, _>(&cfg, build(&device), group) {
                Err(e) => e,
                Ok((model, _)) => model
                    .outer
                    .unshard(&x)
                    .map(|_| ())
                    .expect_err("a nested unit's forward"),
            }
        });
        for err in errors {
            assert!(err.to_string().contains("do not nest"), "stage {stage}: {err}");
        }
    }
}
