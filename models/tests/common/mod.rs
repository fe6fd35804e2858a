//! Helpers shared by the integration tests: fixture paths, reading reference tensors written by
//! tools/gpt2_reference.py, and the error measure.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use burn::prelude::*;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

/// Tolerance of every comparison with HuggingFace in fp32.
pub const TOLERANCE: f64 = 1e-5;

/// A committed fixture directory under models/tests/fixtures.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures")).join(name)
}

/// The tensors of a reference file, as f32 or i64 `TensorData`.
pub struct Reference {
    tensors: HashMap<String, TensorData>,
}

impl Reference {
    /// Reads `<fixture>/reference.safetensors`.
    pub fn read(fixture_name: &str) -> Self {
        let path = fixture(fixture_name).join("reference.safetensors");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors = HashMap::new();
        for (name, view) in file.iter() {
            let shape = view.shape().to_vec();
            let data = match view.dtype() {
                Dtype::F32 => TensorData::new(
                    view.data()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect::<Vec<f32>>(),
                    shape,
                ),
                Dtype::I64 => TensorData::new(
                    view.data()
                        .chunks_exact(8)
                        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                        .collect::<Vec<i64>>(),
                    shape,
                ),
                other => panic!("{name}: unexpected dtype {other:?}"),
            };
            tensors.insert(name.to_string(), data);
        }
        Self { tensors }
    }

    /// A tensor by name.
    pub fn get(&self, name: &str) -> TensorData {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("reference has no tensor `{name}`"))
            .clone()
    }

    /// An integer tensor (token ids, labels) on a backend.
    pub fn ints<B: Backend>(&self, name: &str, device: &B::Device) -> Tensor<B, 2, Int> {
        Tensor::from_data(self.get(name), device)
    }

    /// A float tensor on a backend.
    pub fn floats<B: Backend, const D: usize>(&self, name: &str, device: &B::Device) -> Tensor<B, D> {
        Tensor::from_data(self.get(name), device)
    }
}

/// max|actual - expected| / max|expected|: relative to the reference's scale, so that entries
/// near zero do not blow the measure up.
pub fn relative_error(actual: &TensorData, expected: &TensorData) -> f64 {
    assert_eq!(actual.shape, expected.shape, "shapes differ");
    let a = actual.to_vec::<f32>().unwrap();
    let b = expected.to_vec::<f32>().unwrap();
    let mut max_diff = 0.0f64;
    let mut max_ref = 0.0f64;
    for (x, y) in a.iter().zip(&b) {
        assert!(x.is_finite(), "non-finite value in the result");
        max_diff = max_diff.max((*x as f64 - *y as f64).abs());
        max_ref = max_ref.max((*y as f64).abs());
    }
    assert!(
        max_ref > 0.0,
        "reference is all zeros: the comparison would mean nothing"
    );
    max_diff / max_ref
}

/// Asserts [`relative_error`] is below [`TOLERANCE`], naming `what` otherwise.
pub fn assert_close(what: &str, actual: &TensorData, expected: &TensorData) {
    let error = relative_error(actual, expected);
    println!("{what}: relative error {error:.3e}");
    assert!(
        error < TOLERANCE,
        "{what}: relative error {error:e} exceeds {TOLERANCE:e}"
    );
}
