//! `gpt2 train --backend` and `--collectives`: a backend this build cannot run, or collectives
//! it cannot use, are refused before anything starts, with the flag, the value and what would
//! be valid.

use crate::support;
use support::*;

use std::path::PathBuf;
use zero_examples::gpt2::{train, TrainArgs};

fn args(backend: &str) -> TrainArgs {
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/gpt2-tiny-zero3.json");
    TrainArgs {
        backend: backend.into(),
        ..fixture_args(&config, 1, 1)
    }
}

#[test]
fn an_unknown_backend_is_refused_with_the_valid_ones() {
    let err = train(&args("tpu")).expect_err("tpu is no backend").to_string();
    assert!(err.contains("--backend tpu") && err.contains("cpu or cuda"), "{err}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_names_the_feature() {
    let err = train(&args("cuda")).expect_err("no CUDA in this build").to_string();
    assert!(
        err.contains("--backend cuda") && err.contains("--features cuda"),
        "{err}"
    );
}

/// The error of training on the CPU with `--collectives collectives`.
fn collectives_refusal(collectives: &str) -> String {
    train(&TrainArgs {
        collectives: collectives.into(),
        ..args("cpu")
    })
    .expect_err("refused")
    .to_string()
}

#[test]
fn unknown_collectives_are_refused_with_the_valid_ones() {
    let err = collectives_refusal("mpi");
    assert!(
        err.contains("--collectives mpi") && err.contains("auto, nccl, host"),
        "{err}"
    );
}

#[test]
fn nccl_on_the_cpu_backend_is_refused() {
    let err = collectives_refusal("nccl");
    assert!(
        err.contains("--collectives nccl") && err.contains("--backend cuda"),
        "{err}"
    );
}

#[test]
fn host_collectives_train_on_the_cpu() {
    let summary = train(&TrainArgs {
        collectives: "host".into(),
        // The config's batch is two ranks' of 4 × 2 sequences, drawn from the shipped corpus
        // for the tiny preset.
        nproc: 2,
        tokens: None,
        model: None,
        preset: Some("tiny".into()),
        ..args("cpu")
    })
    .expect("host collectives are the CPU's own");
    assert_eq!(summary.steps.len(), 1);
}
