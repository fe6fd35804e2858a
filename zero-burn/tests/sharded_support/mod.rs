//! What the `ZeroModule` tests share: a model that is not a chain (three linear units, a skip
//! connection across them) as units and as plain layers, its data, rank threads handing each
//! rank the units' collective, and the error measure.

#![allow(dead_code)]

use crate::common;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use std::sync::Arc;
use zero_burn::params::write_values;
use zero_burn::sharded::{ShardBackend, UnitComm, ZeroModule};
use zero_burn::HostStaged;

/// The model with every linear layer a `ZeroModule`.
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    pub units: Vec<ZeroModule<B, Linear<B>>>,
}

impl<B: ShardBackend> Net<B> {
    /// The units whole, as a model written for Burn builds them.
    pub fn whole(device: &B::Device) -> Self {
        Net {
            units: units::<B>(device).into_iter().map(ZeroModule::new).collect(),
        }
    }

    /// Every unit cut over `comm`'s ranks.
    pub fn new(comm: UnitComm<B::Collective>, device: &B::Device) -> Self {
        zero_burn::sharded::shard_units(Self::whole(device), comm, 0).unwrap()
    }

    /// `loss`'s model, each unit gathered for its one forward.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let u1 = self.units[0].unshard(&x).unwrap();
        let h1 = relu(u1.forward(x));
        let u2 = self.units[1].unshard(&h1).unwrap();
        let h2 = relu(u2.forward(h1.clone()));
        let s = h2 + h1;
        let u3 = self.units[2].unshard(&s).unwrap();
        u3.forward(s)
    }

    pub fn loss(&self, x: Tensor<B, 2>, target: Tensor<B, 2>) -> Tensor<B, 1> {
        (self.forward(x) - target).powf_scalar(2.0).mean()
    }
}

pub const ROWS: usize = 8;
pub const SIZES: [(usize, usize); 3] = [(4, 6), (6, 6), (6, 3)];

/// The three units with weights from a fixed formula.
pub fn units<B: burn::tensor::backend::Backend>(device: &B::Device) -> Vec<Linear<B>> {
    SIZES
        .iter()
        .enumerate()
        .map(|(u, &(i, o))| {
            write_values(LinearConfig::new(i, o).init(device), device, true, |p| {
                let n = if p == 0 { i * o } else { o };
                (0..n)
                    .map(|k| 0.5 * ((k * 7 + u * 131 + p * 17) as f32 * 0.37).sin())
                    .collect()
            })
        })
        .collect()
}

pub fn rows<B: burn::tensor::backend::Backend>(
    range: std::ops::Range<usize>,
    cols: usize,
    salt: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    let n = range.len();
    let values: Vec<f32> = range
        .flat_map(|r| (0..cols).map(move |c| ((r * 11 + c * 3 + salt) as f32 * 0.43).cos()))
        .collect();
    Tensor::from_data(TensorData::new(values, [n, cols]), device)
}

/// The model: h1 = relu(u1 x), h2 = relu(u2 h1), y = u3 (h2 + h1); loss = mean squared error.
pub fn forward<B: Backend>(u: &[Linear<B>], x: Tensor<B, 2>) -> Tensor<B, 2> {
    let h1 = relu(u[0].forward(x));
    let h2 = relu(u[1].forward(h1.clone()));
    u[2].forward(h2 + h1)
}

pub fn loss<B: Backend>(u: &[Linear<B>], x: Tensor<B, 2>, target: Tensor<B, 2>) -> Tensor<B, 1> {
    (forward(u, x) - target).powf_scalar(2.0).mean()
}

/// `body(rank, comm)` on `world` rank threads, `comm` the units' collective over the rank's
/// group; the results in rank order.
pub fn on_ranks<T: Send>(world: usize, body: impl Fn(usize, UnitComm<burn::backend::Flex>) -> T + Sync) -> Vec<T> {
    common::on_ranks(world, |rank, group| body(rank, Arc::new(HostStaged::new(group))))
}

/// The largest magnitude in `v`.
pub fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// max |got - want|.
pub fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max)
}

/// max |got - want| / max |want|.
pub fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    max_diff(got, want) / max_abs(want)
}
