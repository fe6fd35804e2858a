//! Times GPT-2's forward and backward passes on the CPU (Flex), and optionally saves the model
//! as a HuggingFace checkpoint.
//!
//! ```text
//! cargo run --release -p zero-models --example gpt2_step -- [preset] [batch] [seq] [steps] [save_dir]
//! cargo run --release -p zero-models --example gpt2_step -- tiny 8 64 5
//! ```
//!
//! The batch is the tokens `(7 * i + 3) mod vocab`, so the printed loss can be recomputed with
//! transformers on a saved checkpoint.

use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::prelude::*;
use zero_models::gpt2::Gpt2Config;

type B = Autodiff<Flex>;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let preset = args.first().map(String::as_str).unwrap_or("tiny");
    let number = |index: usize, default: usize| -> usize {
        match args.get(index) {
            None => default,
            Some(text) => text.parse().unwrap_or_else(|_| {
                eprintln!("argument {} must be a number, got `{text}`", index + 1);
                std::process::exit(2)
            }),
        }
    };
    let (batch, seq, steps) = (number(1, 8), number(2, 64), number(3, 5));
    let config = Gpt2Config::preset(preset).unwrap_or_else(|error| {
        eprintln!("{error}");
        std::process::exit(2)
    });

    let device = Default::default();
    let model = config.init::<B>(&device);
    let ids: Vec<i64> = (0..batch * seq)
        .map(|i| ((7 * i + 3) % config.vocab_size) as i64)
        .collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, seq]), &device);

    let mut forward_ms = Vec::new();
    let mut backward_ms = Vec::new();
    let mut loss_value = 0.0;
    for _ in 0..steps + 1 {
        let start = Instant::now();
        let loss = model.loss(tokens.clone(), tokens.clone());
        loss_value = loss.clone().into_scalar();
        let forward = start.elapsed();
        let _grads = loss.backward();
        forward_ms.push(forward.as_secs_f64() * 1e3);
        backward_ms.push((start.elapsed() - forward).as_secs_f64() * 1e3);
    }
    // The first step warms up allocators and caches.
    let median = |mut v: Vec<f64>| {
        v.remove(0);
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (fwd, bwd) = (median(forward_ms), median(backward_ms));
    println!(
        "{preset} ({} params) batch {batch} x seq {seq}: loss {loss_value:.6}, forward {fwd:.1} ms, \
         backward {bwd:.1} ms, {:.0} tokens/s (forward + backward, median of {steps})",
        config.num_params(),
        (batch * seq) as f64 / ((fwd + bwd) / 1e3)
    );

    if let Some(dir) = args.get(4) {
        if let Err(error) = model.save_pretrained(dir, &config) {
            eprintln!("{error}");
            std::process::exit(1);
        }
        println!("saved to {dir}");
    }
}
