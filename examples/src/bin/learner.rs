//! Burn's `Learner` training with ZeRO: 2 ranks as threads, each a `Learner` with a
//! `ZeroOptimizer` from a DeepSpeed config, under the ZeRO stage given on the command line (0, 1
//! or 2; default 2).
//!
//! `cargo run -p zero-examples --bin learner -- 2`

use burn::backend::{Autodiff, Flex};
use zero_core::config::DeepSpeedConfig;
use zero_examples::learner::{example, train_rank, RankRun, Regressor};
use zero_examples::ranks::run_ranks;

type B = Autodiff<Flex>;

/// Mean squared error of `model` over examples `range`.
fn mse(model: &Regressor<Flex>, range: std::ops::Range<usize>) -> f32 {
    use burn::data::dataloader::batcher::Batcher;
    use zero_examples::learner::{Batch, ExampleBatcher};
    let batch: Batch<Flex> = ExampleBatcher.batch(range.map(example).collect(), &Default::default());
    model.forward_regression(batch).loss.into_scalar()
}

fn main() {
    let stage: u8 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    if stage > 2 {
        eprintln!(
            "stage {stage}: this example's model holds no ZeroModule to partition; choose 0, 1 or 2 (the simple \
             example trains stage 3: cargo run -p zero-examples --bin simple -- 3)"
        );
        std::process::exit(2);
    }
    let text = format!(
        r#"{{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "zero_optimization": {{"stage": {stage}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-2, "weight_decay": 0.01}}}}}}"#
    );
    let config = match DeepSpeedConfig::from_str(&text, "inline config") {
        Ok(parsed) => parsed.config,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let dir = std::env::temp_dir().join(format!("zero-learner-{}", std::process::id()));
    println!("Burn Learner + ZeroOptimizer, ZeRO stage {stage}, 2 ranks, 64 global batches of 32 a epoch");
    let logs = dir.clone();
    let untrained = mse(&Regressor::new(&Default::default()), 0..2048);
    let models = run_ranks(2, move |rank, group| {
        let run = RankRun {
            config: &config,
            lr: 1e-2,
            batches: 64,
            epochs: 3,
            dir: &dir.join(format!("rank{rank}")),
        };
        train_rank::<B>(rank, group, &run)
    });
    // The Learners' metric logs, one directory per rank: shown nowhere here.
    let _ = std::fs::remove_dir_all(&logs);
    match models {
        Ok(models) => match models.into_iter().collect::<Result<Vec<_>, _>>() {
            Ok(models) => println!(
                "mean squared error over 2048 examples: {untrained:.4} before, {:.4} after 3 epochs",
                mse(&models[0], 0..2048)
            ),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        },
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
