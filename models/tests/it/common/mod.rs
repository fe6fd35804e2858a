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

/// Asserts that `actual` has `expected`'s shape and is within [`TOLERANCE`] of it (max
/// |actual - expected| / max |expected|, relative to the reference's scale so that entries near
/// zero do not blow the measure up), naming `what` otherwise.
pub fn assert_close(what: &str, actual: &TensorData, expected: &TensorData) {
    assert_eq!(actual.shape, expected.shape, "{what}: shapes differ");
    let (a, b) = (actual.to_vec::<f32>().unwrap(), expected.to_vec::<f32>().unwrap());
    let error = zero_test_support::max_relative_error(what, &a, &b);
    println!("{what}: relative error {error:.3e}");
    zero_test_support::assert_close(what, &a, &b, TOLERANCE);
}
