//! The Llama family cut over the ranks unit by unit, never the whole model in one rank's memory
//! (DeepSpeed's `zero.Init`), for `zero_burn::initialize` at stage 3:
//!
//! - [`Llama::load_pretrained_sharded`]: a HuggingFace directory read tensor by tensor, by
//!   offset, into a [`ShardedLlama`] whose units (the embedding, each layer, an untied head) are
//!   cut over the ranks as they are read: a rank holds at most one unit whole and its shards.
//! - [`LlamaConfig::init_sharded`]: a random model drawn unit by unit, each cut as it is drawn,
//!   equal to [`LlamaConfig::init`] followed by `into_sharded` and the cut.

use std::path::Path;

use zero_burn::sharded::{shard_units, ShardBackend, UnitComm, ZeroModule};
use zero_burn::ZeroError;

use super::block::LlamaDecoderLayer;
use super::checkpoint::LlamaCheckpoint;
use super::config::LlamaConfig;
use super::init::{normal_embedding, normal_linear, rms_norm};
use super::model::Llama;
use super::names::{embedding, layer_from_hf, linear, norm, EMBED_TOKENS, LM_HEAD, NORM};
use super::sharded::ShardedLlama;
use crate::gpt2::PartitionedLoadError;

impl<B: ShardBackend> Llama<B> {
    /// Loads a HuggingFace directory of the Llama family as a [`ShardedLlama`] whose units of at
    /// least `min_numel` elements are cut over `comm`'s ranks as they are read (DeepSpeed's
    /// `zero.Init` for pretrained weights): a rank holds at most one unit whole, never the model.
    /// The same values as [`Llama::load_pretrained`], `into_sharded` and
    /// `zero_burn::sharded::shard_units`; `zero_burn::initialize` keeps the cut.
    pub fn load_pretrained_sharded(
        dir: impl AsRef<Path>,
        device: &B::Device,
        comm: UnitComm<B::Collective>,
        min_numel: usize,
    ) -> Result<(ShardedLlama<B>, LlamaConfig), PartitionedLoadError> {
        let (index, config) = LlamaCheckpoint::open(dir.as_ref())?;
        let embed = embedding(index.read(EMBED_TOKENS)?, device);
        let embed_tokens = shard_units(ZeroModule::new(embed), comm.clone(), min_numel)?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for layer in 0..config.num_hidden_layers {
            let block: LlamaDecoderLayer<B> = layer_from_hf(&config, layer, &mut |name| index.read(name), device)
                .map_err(|source| PartitionedLoadError::Block { block: layer, source })?;
            layers.push(shard_units(ZeroModule::new(block), comm.clone(), min_numel)?);
        }
        let norm = norm(&config, index.read(NORM)?, device);
        let lm_head = match config.tie_word_embeddings {
            true => None,
            false => {
                let head = linear(LM_HEAD, index.read(LM_HEAD)?, None, device)?;
                Some(shard_units(ZeroModule::new(head), comm, min_numel)?)
            }
        };
        let model = ShardedLlama {
            embed_tokens,
            layers,
            norm,
            lm_head,
        };
        Ok((model, config))
    }
}

impl LlamaConfig {
    /// A randomly initialized [`ShardedLlama`] whose units of at least `min_numel` elements are
    /// cut over `comm`'s ranks as they are drawn: a rank holds at most one unit whole. The draws
    /// follow [`LlamaConfig::init`]'s order (the embedding, each layer, the norm, an untied
    /// head), so from the same generator state the values equal, bit for bit, `init` followed by
    /// `into_sharded` and `zero_burn::sharded::shard_units`. Seed Burn's generator alike on every
    /// rank (rank threads of one process share it: draw one rank at a time). No collective runs.
    ///
    /// # Errors
    ///
    /// An invalid configuration (checked first), or a unit that cannot be cut.
    pub fn init_sharded<B: ShardBackend>(
        &self,
        device: &B::Device,
        comm: UnitComm<B::Collective>,
        min_numel: usize,
    ) -> Result<ShardedLlama<B>, ZeroError> {
        self.validate()
            .map_err(|e| ZeroError::Model(format!("{} configuration: {e}", self.family.model_type())))?;
        let h = self.hidden_size;
        let embed = normal_embedding(self.vocab_size, h, self.initializer_range, device);
        let embed_tokens = shard_units(ZeroModule::new(embed), comm.clone(), min_numel)?;
        let mut layers = Vec::with_capacity(self.num_hidden_layers);
        for _ in 0..self.num_hidden_layers {
            let layer = ZeroModule::new(LlamaDecoderLayer::new(self, device));
            layers.push(shard_units(layer, comm.clone(), min_numel)?);
        }
        let norm = rms_norm(h, self.rms_norm_eps, device);
        let lm_head = match self.tie_word_embeddings {
            true => None,
            false => {
                let head = normal_linear(h, self.vocab_size, false, self.initializer_range, device);
                Some(shard_units(ZeroModule::new(head), comm, min_numel)?)
            }
        };
        Ok(ShardedLlama {
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }
}
