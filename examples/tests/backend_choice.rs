//! `gpt2 train --backend`: a backend this build cannot run is refused before anything starts,
//! with the flag, the value and what would be valid.

use std::path::PathBuf;
use zero_examples::gpt2::{train, TrainArgs};

fn args(backend: &str) -> TrainArgs {
    TrainArgs {
        config: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/gpt2-tiny-zero3.json"),
        model: None,
        preset: Some("tiny".into()),
        data: None,
        tokens: None,
        seq_len: 16,
        steps: 1,
        nproc: 1,
        seed: 0,
        metrics: None,
        save: None,
        save_every: None,
        load: None,
        backend: backend.into(),
        quiet: true,
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
