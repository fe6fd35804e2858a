//! Rotary position embeddings (Su et al., 2021) as transformers applies them to the Llama
//! family: `x · cos + rotate_half(x) · sin`, the angles `position × inv_freq` in f32.

use burn::prelude::*;
use burn::tensor::DType;

/// The rotary embedding of one attention layer: its inverse frequencies (`head_dim / 2`, from
/// [`super::LlamaConfig::rope_inv_freq`]). Positions are `0..seq` of the sequence attended over.
#[derive(Debug, Clone, PartialEq)]
pub struct RotaryEmbedding {
    /// `1 / theta^(2i / head_dim)`, rescaled for `rope_type: "llama3"`.
    pub inv_freq: Vec<f32>,
}

impl RotaryEmbedding {
    /// `cos` and `sin` of every position's angles, `[seq, head_dim]` each (the `head_dim / 2`
    /// angles twice over, as transformers concatenates them), in `dtype`. Computed in f32 on the
    /// device, whatever the model's dtype, as transformers does.
    pub fn cos_sin<B: Backend>(&self, seq: usize, dtype: DType, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let half = self.inv_freq.len();
        let positions: Vec<f32> = (0..seq).map(|p| p as f32).collect();
        let positions = Tensor::<B, 2>::from_data(TensorData::new(positions, [seq, 1]), (device, DType::F32));
        let inv_freq =
            Tensor::<B, 2>::from_data(TensorData::new(self.inv_freq.clone(), [1, half]), (device, DType::F32));
        let angles = positions.mul(inv_freq);
        let angles = Tensor::cat(vec![angles.clone(), angles], 1);
        (angles.clone().cos().cast(dtype), angles.sin().cast(dtype))
    }
}

/// `x · cos + rotate_half(x) · sin` for `x` `[batch, heads, seq, head_dim]` and `cos`, `sin`
/// `[seq, head_dim]`; `rotate_half` maps the halves `(x1, x2)` of the last axis to `(-x2, x1)`.
pub fn apply_rotary<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 2>, sin: &Tensor<B, 2>) -> Tensor<B, 4> {
    let [_, _, _, head_dim] = x.dims();
    let half = head_dim / 2;
    let x1 = x.clone().narrow(3, 0, half);
    let x2 = x.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos.clone().unsqueeze::<4>() + rotated * sin.clone().unsqueeze::<4>()
}
