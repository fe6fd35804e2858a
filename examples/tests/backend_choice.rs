//! `gpt2 train --backend`: a backend this build cannot run is refused before anything starts,
//! with the flag, the value and what would be valid.

mod support;

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
