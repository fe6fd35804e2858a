//! Models that are not a chain train under stage 3 exactly, through `initialize` and Burn's
//! own loop: a U-Net-like model (skip connections across wrapped units, concatenated) and an
//! encoder-decoder whose decoder cross-attends to the encoder's output. Reference: the same
//! computation on the plain parts on one process, over the whole batch, trained by Burn's AdamW;
//! after 5 steps every unit and replicated parameter of every rank equals it to 1e-6 of the
//! largest. Worlds 2 and 4, ranks as threads, under `Autodiff<Flex, BalancedCheckpointing>`.

use crate::common;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::activation::relu;
use burn::tensor::{Tensor, TensorData};
use zero_burn::params::{read_values, write_data};
use zero_burn::sharded::ZeroModule;
use zero_core::config::DeepSpeedConfig;
use zero_test_support::assert_close;

type AB = Autodiff<Flex, BalancedCheckpointing>;
const ROWS: usize = 8;
const STEPS: usize = 5;
const EPS: f32 = 1e-4;
const LR: f64 = 1e-3;

/// `module` with every parameter from a fixed formula (`salt` tells modules apart).
fn fixed<M: Module<AB>>(module: M, salt: usize) -> M {
    write_data(module, &Default::default(), true, |p, shape| {
        let n = shape.num_elements();
        let v: Vec<f32> = (0..n)
            .map(|k| 0.4 * ((k * 7 + p * 17 + salt * 131) as f32 * 0.37).sin())
            .collect();
        TensorData::new(v, shape)
    })
}

/// `dims` of a fixed formula (`salt` tells inputs apart), rows `rows` of `ROWS`.
fn input<const D: usize>(rows: std::ops::Range<usize>, dims: [usize; D], salt: usize) -> Tensor<AB, D> {
    let per_row: usize = dims[1..].iter().product();
    let mut shape = dims;
    shape[0] = rows.len();
    let v: Vec<f32> = rows
        .flat_map(|r| (0..per_row).map(move |c| ((r * 11 + c * 3 + salt) as f32 * 0.43).cos()))
        .collect();
    Tensor::from_data(TensorData::new(v, shape), &Default::default())
}

fn flat<M: Module<AB>>(module: &M) -> Vec<f32> {
    let mut v = Vec::new();
    read_values::<AB, M>(module, |_, p| v.extend(p));
    v
}

fn mse<const D: usize>(y: Tensor<AB, D>, target: Tensor<AB, D>) -> Tensor<AB, 1> {
    (y - target).powf_scalar(2.0).mean()
}

/// A model in two forms: its plain parts (the reference) and its training form with units.
trait Case: Sync {
    type Plain: Module<AB> + burn::module::AutodiffModule<AB>;
    type Zero: Module<AB> + burn::module::AutodiffModule<AB>;
    fn plain(&self) -> Self::Plain;
    fn wrap(&self, plain: Self::Plain) -> Self::Zero;
    fn plain_loss(&self, model: &Self::Plain, rows: std::ops::Range<usize>) -> Tensor<AB, 1>;
    fn zero_loss(&self, model: &Self::Zero, rows: std::ops::Range<usize>) -> Tensor<AB, 1>;
    /// Each unit's flat parameters (whole, or this rank's shard), then the replicated ones.
    fn zero_parts(&self, model: &Self::Zero) -> Vec<Vec<f32>>;
}

fn check<C: Case>(case: &C, name: &str) {
    let mut plain = case.plain();
    let mut optim = AdamWConfig::new().with_epsilon(EPS).with_weight_decay(0.01).init();
    for _ in 0..STEPS {
        let grads = GradientsParams::from_grads(case.plain_loss(&plain, 0..ROWS).backward(), &plain);
        plain = optim.step(LR, plain, grads);
    }
    let want = case.zero_parts(&case.wrap(plain));
    let config = DeepSpeedConfig::from_str(
        &format!(
            r#"{{"train_batch_size": {ROWS}, "gradient_clipping": 0.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": {LR}, "eps": {EPS}, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0}}}}"#
        ),
        "ds_config.json",
    )
    .expect("valid config")
    .config;
    for world in [2, 4] {
        let runs = common::on_ranks(world, |rank, group| {
            let (mut model, mut optim) =
                zero_burn::initialize(&config, case.wrap(case.plain()), group).expect("initialize");
            let per = ROWS / world;
            for _ in 0..STEPS {
                let loss = case.zero_loss(&model, rank * per..(rank + 1) * per);
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(LR, model, grads);
            }
            case.zero_parts(&model)
        });
        for (u, whole) in want.iter().enumerate() {
            let got: Vec<f32> = if runs[0][u].len() == whole.len() {
                runs[0][u].clone()
            } else {
                runs.iter().flat_map(|r| r[u].clone()).take(whole.len()).collect()
            };
            assert_close(&format!("{name}, world {world}: part {u}"), &got, whole, 1e-6);
        }
        assert!(
            runs[0][0].len() < want[0].len(),
            "{name}, world {world}: the first unit is sharded"
        );
    }
}

/// U-Net-like: down1 → down2 → mid → up2(mid ‖ down2) → up1(up2 ‖ down1), each a unit.
struct UNet;

#[derive(Module, Debug)]
struct UNetPlain<B: burn::tensor::backend::Backend> {
    layers: Vec<Linear<B>>,
}

#[derive(Module, Debug)]
struct UNetZero<B: burn::tensor::backend::Backend> {
    units: Vec<ZeroModule<B, Linear<B>>>,
}

const UNET: [(usize, usize); 5] = [(4, 8), (8, 8), (8, 8), (16, 8), (16, 3)];

fn unet_forward(layer: impl Fn(usize, &Tensor<AB, 2>) -> Linear<AB>, x: Tensor<AB, 2>) -> Tensor<AB, 2> {
    let d1 = relu(layer(0, &x).forward(x));
    let d2 = relu(layer(1, &d1).forward(d1.clone()));
    let m = relu(layer(2, &d2).forward(d2.clone()));
    let skip2 = Tensor::cat(vec![m, d2], 1);
    let u2 = relu(layer(3, &skip2).forward(skip2));
    let skip1 = Tensor::cat(vec![u2, d1], 1);
    layer(4, &skip1).forward(skip1)
}

impl Case for UNet {
    type Plain = UNetPlain<AB>;
    type Zero = UNetZero<AB>;

    fn plain(&self) -> UNetPlain<AB> {
        let device = Default::default();
        let layers = UNET
            .iter()
            .enumerate()
            .map(|(i, &(a, b))| fixed(LinearConfig::new(a, b).init(&device), i))
            .collect();
        UNetPlain { layers }
    }

    fn wrap(&self, plain: UNetPlain<AB>) -> UNetZero<AB> {
        UNetZero {
            units: plain.layers.into_iter().map(ZeroModule::new).collect(),
        }
    }

    fn plain_loss(&self, model: &UNetPlain<AB>, rows: std::ops::Range<usize>) -> Tensor<AB, 1> {
        let y = unet_forward(|i, _| model.layers[i].clone(), input(rows.clone(), [ROWS, 4], 0));
        mse(y, input(rows, [ROWS, 3], 5))
    }

    fn zero_loss(&self, model: &UNetZero<AB>, rows: std::ops::Range<usize>) -> Tensor<AB, 1> {
        let y = unet_forward(
            |i, x| model.units[i].unshard(x).expect("gather"),
            input(rows.clone(), [ROWS, 4], 0),
        );
        mse(y, input(rows, [ROWS, 3], 5))
    }

    fn zero_parts(&self, model: &UNetZero<AB>) -> Vec<Vec<f32>> {
        model.units.iter().map(|u| flat(u.shard())).collect()
    }
}

#[test]
fn a_u_net_with_skips_across_units_trains_exactly_under_stage_3() {
    check(&UNet, "U-Net");
}

/// Encoder-decoder: a replicated input projection, an encoder layer (self-attention and a
/// feed-forward layer) and a decoder layer (self-attention, cross-attention to the encoder's
/// output, feed-forward), each layer a unit.
struct Seq2Seq;

const D_MODEL: usize = 8;
const SRC: usize = 5;
const TGT: usize = 3;

#[derive(Module, Debug)]
struct Encoder<B: burn::tensor::backend::Backend> {
    attn: MultiHeadAttention<B>,
    ff: Linear<B>,
}

#[derive(Module, Debug)]
struct Decoder<B: burn::tensor::backend::Backend> {
    attn: MultiHeadAttention<B>,
    cross: MultiHeadAttention<B>,
    ff: Linear<B>,
}

#[derive(Module, Debug)]
struct Seq2SeqPlain<B: burn::tensor::backend::Backend> {
    src_in: Linear<B>,
    encoder: Encoder<B>,
    decoder: Decoder<B>,
}

#[derive(Module, Debug)]
struct Seq2SeqZero<B: burn::tensor::backend::Backend> {
    src_in: Linear<B>,
    encoder: ZeroModule<B, Encoder<B>>,
    decoder: ZeroModule<B, Decoder<B>>,
}

fn mha(salt: usize) -> MultiHeadAttention<AB> {
    let attn = MultiHeadAttentionConfig::new(D_MODEL, 2)
        .with_dropout(0.0)
        .init(&Default::default());
    fixed(attn, salt)
}

fn encode(encoder: &Encoder<AB>, x: Tensor<AB, 3>) -> Tensor<AB, 3> {
    let h = x.clone() + encoder.attn.forward(MhaInput::self_attn(x)).context;
    h.clone() + relu(encoder.ff.forward(h))
}

fn decode(decoder: &Decoder<AB>, y: Tensor<AB, 3>, memory: Tensor<AB, 3>) -> Tensor<AB, 3> {
    let h = y.clone() + decoder.attn.forward(MhaInput::self_attn(y)).context;
    let h = h.clone() + decoder.cross.forward(MhaInput::new(h, memory.clone(), memory)).context;
    h.clone() + relu(decoder.ff.forward(h))
}

fn seq2seq_inputs(rows: std::ops::Range<usize>) -> (Tensor<AB, 3>, Tensor<AB, 3>, Tensor<AB, 3>) {
    (
        input(rows.clone(), [ROWS, SRC, D_MODEL], 0),
        input(rows.clone(), [ROWS, TGT, D_MODEL], 3),
        input(rows, [ROWS, TGT, D_MODEL], 7),
    )
}

impl Case for Seq2Seq {
    type Plain = Seq2SeqPlain<AB>;
    type Zero = Seq2SeqZero<AB>;

    fn plain(&self) -> Seq2SeqPlain<AB> {
        let device = Default::default();
        let linear = |salt| fixed(LinearConfig::new(D_MODEL, D_MODEL).init(&device), salt);
        Seq2SeqPlain {
            src_in: linear(1),
            encoder: Encoder {
                attn: mha(2),
                ff: linear(3),
            },
            decoder: Decoder {
                attn: mha(4),
                cross: mha(5),
                ff: linear(6),
            },
        }
    }

    fn wrap(&self, plain: Seq2SeqPlain<AB>) -> Seq2SeqZero<AB> {
        Seq2SeqZero {
            src_in: plain.src_in,
            encoder: ZeroModule::new(plain.encoder),
            decoder: ZeroModule::new(plain.decoder),
        }
    }

    fn plain_loss(&self, model: &Seq2SeqPlain<AB>, rows: std::ops::Range<usize>) -> Tensor<AB, 1> {
        let (src, tgt, target) = seq2seq_inputs(rows);
        let memory = encode(&model.encoder, model.src_in.forward(src));
        mse(decode(&model.decoder, tgt, memory), target)
    }

    fn zero_loss(&self, model: &Seq2SeqZero<AB>, rows: std::ops::Range<usize>) -> Tensor<AB, 1> {
        let (src, tgt, target) = seq2seq_inputs(rows);
        let x = model.src_in.forward(src);
        let memory = encode(&model.encoder.unshard(&x).expect("gather"), x);
        let decoder = model.decoder.unshard(&memory).expect("gather");
        mse(decode(&decoder, tgt, memory), target)
    }

    fn zero_parts(&self, model: &Seq2SeqZero<AB>) -> Vec<Vec<f32>> {
        vec![
            flat(model.encoder.shard()),
            flat(model.decoder.shard()),
            flat(&model.src_in),
        ]
    }
}

#[test]
fn an_encoder_decoder_with_cross_attention_trains_exactly_under_stage_3() {
    check(&Seq2Seq, "encoder-decoder");
}
