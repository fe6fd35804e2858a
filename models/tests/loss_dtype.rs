//! The GPT-2 loss is computed in f32 whatever the device's default float dtype: a 16-bit run
//! may set the default to its own dtype (so that the tensors a model creates follow its
//! parameters), and the loss must still come out, in f32.
//!
//! Reference: the next-token cross-entropy computed in the test from the model's own logits
//! (cast to f32, `log_softmax`, the targets' entries averaged), on the same bf16 model. Each
//! test binary of nextest is its own process, so the default set here stays in this one.

use burn::backend::Flex;
use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Int, Tensor, TensorData};
use zero_models::Gpt2Config;

#[test]
fn the_loss_is_f32_under_a_bf16_default_float_dtype() {
    let device = Default::default();
    // Before any tensor exists on the device.
    burn::tensor::set_default_dtypes::<Flex>(&device, DType::BF16, DType::I32).expect("default dtypes");
    let model = Gpt2Config::new(64, 16, 32, 2, 4).init::<Flex>(&device);
    let (batch, seq, vocab) = (2, 8, 64);
    let ids: Vec<i64> = (0..batch * seq).map(|i| ((i * 7) % vocab) as i64).collect();
    let tokens = Tensor::<Flex, 2, Int>::from_data(TensorData::new(ids.clone(), [batch, seq]), &device);
    let loss = model.loss(tokens.clone(), tokens.clone());
    assert_eq!(loss.dtype(), DType::F32);
    let got = loss.into_scalar();
    // By hand: position t predicts token t + 1.
    let logits = model.forward(tokens).cast(DType::F32).narrow(1, 0, seq - 1);
    let log_probs: Vec<f32> = log_softmax(logits.reshape([batch * (seq - 1), vocab]), 1)
        .into_data()
        .to_vec()
        .expect("f32");
    let mut sum = 0.0f64;
    for b in 0..batch {
        for t in 0..seq - 1 {
            let target = ids[b * seq + t + 1] as usize;
            sum -= log_probs[(b * (seq - 1) + t) * vocab + target] as f64;
        }
    }
    let want = sum / (batch * (seq - 1)) as f64;
    assert!(
        got.is_finite() && (got as f64 - want).abs() <= 1e-5 * want.abs(),
        "{got} against {want}"
    );
}
