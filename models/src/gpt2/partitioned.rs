//! GPT-2 cut over the ranks unit by unit, never the whole model in one rank's memory
//! (DeepSpeed's `zero.Init`), for `zero_burn::initialize`:
//!
//! - [`Gpt2::load_pretrained_sharded`]: a HuggingFace checkpoint (one file or shards with an
//!   index) read tensor by tensor, by offset, into a [`ShardedGpt2`] whose units (the
//!   embeddings, each block) are cut over the ranks as they are read: a rank holds at most one
//!   unit whole and its shards, where [`Gpt2::load_pretrained`] holds the file and the whole
//!   model.
//! - [`Gpt2Config::init_sharded`]: a random GPT-2 drawn unit by unit, each cut as it is drawn:
//!   equal to [`Gpt2Config::init`] followed by `into_sharded` and the cut.

use std::path::Path;

use burn::module::Param;
use burn::nn::{Embedding, LayerNorm, Linear};
use burn::prelude::*;
use zero_burn::sharded::{shard_units, ShardBackend, UnitComm, ZeroModule};
use zero_burn::ZeroError;

use super::attention::Gpt2Attention;
use super::block::Gpt2Block;
use super::checkpoint::TensorIndex;
use super::config::Gpt2Config;
use super::error::CheckpointError;
use super::init::{layer_norm, normal_embedding};
use super::mlp::Gpt2Mlp;
use super::model::Gpt2;
use super::pipeline::Gpt2Embed;
use super::sharded::ShardedGpt2;

/// Why a partitioned load failed: the checkpoint, or the cut.
#[derive(Debug, thiserror::Error)]
pub enum PartitionedLoadError {
    /// The checkpoint could not be read or does not match its config (the error names the file
    /// and the tensor).
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A block could not be read.
    #[error("block {block}: {source}")]
    Block {
        /// The block (HuggingFace's `h.{block}`).
        block: usize,
        /// What went wrong.
        source: CheckpointError,
    },
    /// A unit could not be cut over the ranks.
    #[error(transparent)]
    Engine(#[from] ZeroError),
}

impl<B: ShardBackend> Gpt2<B> {
    /// Loads a HuggingFace GPT-2 checkpoint directory as a [`ShardedGpt2`] whose units of at
    /// least `min_numel` elements are cut over `comm`'s ranks as they are read (DeepSpeed's
    /// `zero.Init` for pretrained weights): a rank holds at most one unit whole, never the
    /// model. The same values as [`Gpt2::load_pretrained`], `into_sharded` and
    /// `zero_burn::sharded::shard_units`; `zero_burn::initialize` keeps the cut.
    pub fn load_pretrained_sharded(
        dir: impl AsRef<Path>,
        device: &B::Device,
        comm: UnitComm<B::Collective>,
        min_numel: usize,
    ) -> Result<(ShardedGpt2<B>, Gpt2Config), PartitionedLoadError> {
        let (index, config) = TensorIndex::open(dir.as_ref())?;
        let embed = ZeroModule::new(Gpt2Embed {
            wte: Embedding {
                weight: param(&index, "wte.weight", device)?,
            },
            wpe: Embedding {
                weight: param(&index, "wpe.weight", device)?,
            },
        });
        let embed = shard_units(embed, comm.clone(), min_numel)?;
        let mut blocks = Vec::with_capacity(config.n_layer);
        for layer in 0..config.n_layer {
            let block = read_block(&index, &config, layer, device)
                .map_err(|source| PartitionedLoadError::Block { block: layer, source })?;
            blocks.push(shard_units(ZeroModule::new(block), comm.clone(), min_numel)?);
        }
        let ln_f = norm(&index, "ln_f", &config, device)?;
        Ok((ShardedGpt2 { embed, blocks, ln_f }, config))
    }
}

impl Gpt2Config {
    /// A randomly initialized [`ShardedGpt2`] whose units of at least `min_numel` elements are
    /// cut over `comm`'s ranks as they are drawn: a rank holds at most one unit whole, never the
    /// model. The draws follow [`Gpt2Config::init`]'s order (`wte`, `wpe`, then each block;
    /// `ln_f` draws none), so from the same generator state the values equal, bit for bit,
    /// `init` followed by `into_sharded` and `zero_burn::sharded::shard_units`. Every rank must
    /// draw the same values: seed Burn's generator alike on every rank (rank threads of one
    /// process share the generator: draw one rank at a time). No collective runs.
    ///
    /// # Errors
    ///
    /// An invalid configuration (checked first), or a unit that cannot be cut.
    pub fn init_sharded<B: ShardBackend>(
        &self,
        device: &B::Device,
        comm: UnitComm<B::Collective>,
        min_numel: usize,
    ) -> Result<ShardedGpt2<B>, ZeroError> {
        self.validate()
            .map_err(|e| ZeroError::Model(format!("GPT-2 configuration: {e}")))?;
        let d = self.n_embd;
        let embed = ZeroModule::new(Gpt2Embed {
            wte: normal_embedding(self.vocab_size, d, self.initializer_range, device),
            wpe: normal_embedding(self.n_positions, d, self.initializer_range, device),
        });
        let embed = shard_units(embed, comm.clone(), min_numel)?;
        let mut blocks = Vec::with_capacity(self.n_layer);
        for layer in 0..self.n_layer {
            let block = ZeroModule::new(Gpt2Block::new(self, layer, device));
            blocks.push(shard_units(block, comm.clone(), min_numel)?);
        }
        let ln_f = layer_norm(d, self.layer_norm_epsilon, device);
        Ok(ShardedGpt2 { embed, blocks, ln_f })
    }
}

/// Block `layer` read from the checkpoint, tensor by tensor.
fn read_block<B: Backend>(
    index: &TensorIndex,
    config: &Gpt2Config,
    layer: usize,
    device: &B::Device,
) -> Result<Gpt2Block<B>, CheckpointError> {
    let p = format!("h.{layer}.");
    let ln_1 = norm(index, &format!("{p}ln_1"), config, device)?;
    let c_attn = linear(index, &format!("{p}attn.c_attn"), device)?;
    let c_proj = linear(index, &format!("{p}attn.c_proj"), device)?;
    let ln_2 = norm(index, &format!("{p}ln_2"), config, device)?;
    let c_fc = linear(index, &format!("{p}mlp.c_fc"), device)?;
    let mlp_proj = linear(index, &format!("{p}mlp.c_proj"), device)?;
    Ok(Gpt2Block {
        ln_1,
        attn: Gpt2Attention::from_linears(config, layer, c_attn, c_proj),
        ln_2,
        mlp: Gpt2Mlp::from_linears(config, c_fc, mlp_proj),
    })
}

fn param<B: Backend, const D: usize>(
    index: &TensorIndex,
    name: &str,
    device: &B::Device,
) -> Result<Param<Tensor<B, D>>, CheckpointError> {
    let data = index.read(name)?;
    if data.shape.len() != D {
        return Err(CheckpointError::TensorData {
            key: name.to_string(),
            reason: format!("rank {} where {D} is needed", data.shape.len()),
        });
    }
    Ok(Param::from_tensor(Tensor::from_data(data, device)))
}

fn linear<B: Backend>(index: &TensorIndex, name: &str, device: &B::Device) -> Result<Linear<B>, CheckpointError> {
    Ok(Linear {
        weight: param(index, &format!("{name}.weight"), device)?,
        bias: Some(param(index, &format!("{name}.bias"), device)?),
    })
}

fn norm<B: Backend>(
    index: &TensorIndex,
    name: &str,
    config: &Gpt2Config,
    device: &B::Device,
) -> Result<LayerNorm<B>, CheckpointError> {
    // LayerNorm's epsilon is private to Burn: build one from its config, then set the weights.
    let mut norm = layer_norm(config.n_embd, config.layer_norm_epsilon, device);
    norm.gamma = param(index, &format!("{name}.weight"), device)?;
    norm.beta = Some(param(index, &format!("{name}.bias"), device)?);
    Ok(norm)
}
