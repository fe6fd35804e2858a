//! GPT-2's shapes for the estimate: the parameter count, the stage-3 units and what one tensor
//! rank holds of them.

use super::{estimate, gathered_with_prefetch_counted, Estimate, EstimateError, EstimateInput, FitError};
use serde::Serialize;

/// A GPT-2 shape: what the parameter count and the stage-3 gathers depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Gpt2Shape {
    /// Vocabulary size.
    pub vocab: u64,
    /// Positions (context length).
    pub n_positions: u64,
    /// Hidden size.
    pub n_embd: u64,
    /// Transformer blocks.
    pub n_layer: u64,
    /// Attention heads (the count does not change the parameters).
    pub n_head: u64,
    /// MLP inner size (4 × n_embd in every preset).
    pub n_inner: u64,
}

/// The names [`Gpt2Shape::preset`] knows, smallest first.
pub const GPT2_PRESETS: [&str; 6] = ["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt2-10b"];

impl Gpt2Shape {
    fn with(n_embd: u64, n_layer: u64, n_head: u64) -> Self {
        Gpt2Shape {
            vocab: 50257,
            n_positions: 1024,
            n_embd,
            n_layer,
            n_head,
            n_inner: n_embd.saturating_mul(4),
        }
    }

    /// The preset of this name (one of [`GPT2_PRESETS`]): the same shapes as the model zoo's.
    /// A shaped name `gpt2-<layers>x<hidden>` (e.g. `gpt2-40x4096`) is GPT-2 with that many
    /// blocks of that hidden size; see [`Gpt2Shape::shaped`].
    pub fn preset(name: &str) -> Option<Self> {
        Some(match name {
            "tiny" => Self::with(128, 2, 4),
            "gpt2" => Self::with(768, 12, 12),
            "gpt2-medium" => Self::with(1024, 24, 16),
            "gpt2-large" => Self::with(1280, 36, 20),
            "gpt2-xl" => Self::with(1600, 48, 25),
            "gpt2-10b" => Self::with(4096, 50, 32),
            other => {
                let (layers, hidden) = other.strip_prefix("gpt2-")?.split_once('x')?;
                // Written one way only, as `shaped_name` writes it: digits, no sign, no leading 0.
                let count = |s: &str| {
                    let plain = s.bytes().all(|b| b.is_ascii_digit()) && !(s.len() > 1 && s.starts_with('0'));
                    plain.then(|| s.parse().ok()).flatten()
                };
                return Self::shaped(count(layers)?, count(hidden)?);
            }
        })
    }

    /// GPT-2 with `n_layer` blocks of hidden size `n_embd`: heads of 128 (as the 10B model's)
    /// when `n_embd` is a multiple of 128, else of 64 (as GPT-2's own); `None` when `n_embd` is
    /// not a multiple of 64, a count is zero, or the parameter count passes 2^64.
    pub fn shaped(n_layer: u64, n_embd: u64) -> Option<Self> {
        let head_dim = if n_embd.is_multiple_of(128) { 128 } else { 64 };
        if n_layer == 0 || n_embd == 0 || !n_embd.is_multiple_of(head_dim) {
            return None;
        }
        // The MLP's inner size, 4·n_embd, must fit too.
        n_embd.checked_mul(4)?;
        let shape = Self::with(n_embd, n_layer, n_embd / head_dim);
        // Counted once, checked, so that the counting methods below cannot overflow.
        shape.checked_counts().map(|_| shape)
    }

    /// (block, ends, total) parameters, or `None` when one passes 2^64.
    fn checked_counts(&self) -> Option<(u64, u64, u64)> {
        let d = self.n_embd;
        let inner = self.n_inner;
        let layer_norms = d.checked_mul(4)?;
        let attention = d
            .checked_mul(3)?
            .checked_mul(d)?
            .checked_add(d.checked_mul(3)?)?
            .checked_add(d.checked_mul(d)?.checked_add(d)?)?;
        let mlp = d
            .checked_mul(inner)?
            .checked_add(inner)?
            .checked_add(inner.checked_mul(d)?.checked_add(d)?)?;
        let block = layer_norms.checked_add(attention)?.checked_add(mlp)?;
        let ends = self
            .vocab
            .checked_add(self.n_positions)?
            .checked_mul(d)?
            .checked_add(d.checked_mul(2)?)?;
        let total = self.n_layer.checked_mul(block)?.checked_add(ends)?;
        Some((block, ends, total))
    }

    /// The shaped name of this model, `gpt2-<layers>x<hidden>`, which [`Gpt2Shape::preset`]
    /// reads back.
    pub fn shaped_name(&self) -> String {
        format!("gpt2-{}x{}", self.n_layer, self.n_embd)
    }

    /// The deepest GPT-2 of hidden size `n_embd` whose model states, as [`estimate`] counts them
    /// for `input`'s stage, cluster, offload and dtype, fit `host_bytes` per host and
    /// `device_bytes` per device. An error when not even one block fits (saying what one block
    /// needs), or when the limits do not bound the depth (no model state that grows with it is
    /// held where a limit applies), rather than a depth no limit chose.
    pub fn deepest_fitting(
        n_embd: u64,
        input: &EstimateInput,
        host_bytes: u64,
        device_bytes: u64,
    ) -> Result<Self, FitError> {
        let at = |layers: u64| -> Option<Result<Estimate, EstimateError>> {
            let shape = Self::shaped(layers, n_embd)?;
            Some(estimate(&shape.input(input)))
        };
        let within = |e: &Estimate| e.per_host.total() <= host_bytes && e.per_device.total() <= device_bytes;
        // A depth whose counts pass 2^64 fits no limit.
        let fits = |layers: u64| matches!(at(layers), Some(Ok(e)) if within(&e));
        let one = at(1).ok_or(FitError::BadHidden(n_embd))??;
        if !within(&one) {
            return Err(FitError::NothingFits {
                host_bytes: one.per_host.total(),
                device_bytes: one.per_device.total(),
            });
        }
        // Bytes grow with the depth only where a block adds to them; if a second block adds
        // nothing anywhere a limit applies, every depth "fits" and no answer is meaningful.
        let two = at(2).ok_or(FitError::BadHidden(n_embd))??;
        let host_grows = two.per_host.total() > one.per_host.total();
        let device_grows = device_bytes < u64::MAX && two.per_device.total() > one.per_device.total();
        if !host_grows && !device_grows {
            return Err(FitError::Unbounded);
        }
        // Double to an upper bound, then bisect.
        let (mut lo, mut hi) = (1u64, 2u64);
        while fits(hi) {
            lo = hi;
            hi = hi.checked_mul(2).ok_or(FitError::Unbounded)?;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Self::shaped(lo, n_embd).ok_or(FitError::BadHidden(n_embd))
    }

    /// Parameters of one transformer block: two layer norms, attention (qkv and projection),
    /// the MLP, each with biases. (For a shape built by hand whose counts pass 2^64, which
    /// [`Gpt2Shape::shaped`] refuses, the counts saturate at `u64::MAX`.)
    pub fn block_params(&self) -> u64 {
        self.checked_counts().map_or(u64::MAX, |(block, _, _)| block)
    }

    /// Parameters outside the blocks: token and position embeddings, the final layer norm (the
    /// LM head is tied to the token embedding).
    pub fn ends_params(&self) -> u64 {
        self.checked_counts().map_or(u64::MAX, |(_, ends, _)| ends)
    }

    /// Trainable parameters.
    pub fn num_params(&self) -> u64 {
        self.checked_counts().map_or(u64::MAX, |(_, _, total)| total)
    }

    /// `base` (stage, cluster, offload, dtype, prefetch budget, tensor-parallel degree) for this
    /// model: its parameters (one tensor rank's, with tensor parallelism), what stage 3 holds
    /// gathered at once (with the budget; none on one data-parallel device, where nothing is
    /// gathered ahead), and its largest partitioned group.
    pub fn input(&self, base: &EstimateInput) -> EstimateInput {
        let rank = self.tensor_slice(base.tensor_parallel);
        EstimateInput {
            params: rank.num_params(),
            gathered_at_once: Some(rank.gathered_at_once(match base.data_parallel() {
                Ok(w) if w > 1 => base.prefetch_bucket_size,
                _ => 0,
            })),
            largest_group: Some(rank.block_params().max(rank.ends_params())),
            ..base.clone()
        }
    }

    /// Whether the model splits over `tensor` ranks as the zoo's tensor-parallel GPT-2 splits
    /// it: its heads and its MLP's inner size multiples of `tensor` (the vocabulary is padded).
    pub fn splits_over(&self, tensor: u64) -> bool {
        tensor > 0 && self.n_head.is_multiple_of(tensor) && self.n_inner.is_multiple_of(tensor)
    }

    /// What one of `tensor` ranks holds of the model as the zoo's tensor-parallel GPT-2 splits
    /// it (`TpGpt2`): each block's q|k|v and MLP input columns, and its projections' rows,
    /// divided by `tensor`, the layer norms and the projections' biases whole; the token
    /// embedding's rows divided, rounded up (the vocabulary padded); the position embedding and
    /// the final norm whole. `tensor` 1: the counts of the model itself.
    pub fn tensor_slice(&self, tensor: u64) -> RankShape {
        let t = tensor.max(1);
        let (d, inner) = (self.n_embd, self.n_inner);
        let whole = self.checked_counts();
        let block = (|| {
            let split = d
                .checked_mul(3)?
                .checked_mul(d)?
                .checked_add(d.checked_mul(3)?)?
                .checked_add(d.checked_mul(d)?)?
                .checked_add(d.checked_mul(inner)?.checked_add(inner)?)?
                .checked_add(inner.checked_mul(d)?)?;
            split.checked_div(t)?.checked_add(d.checked_mul(6)?)
        })();
        let embed = (|| self.vocab.div_ceil(t).checked_add(self.n_positions)?.checked_mul(d))();
        RankShape {
            block: if t == 1 { whole.map(|c| c.0) } else { block },
            embed,
            n_layer: self.n_layer,
            n_embd: d,
        }
    }

    /// Parameters of the token and position embeddings: the zoo's first unit (`ShardedGpt2`'s
    /// `embed`, which the tied LM head gathers again).
    pub fn embed_params(&self) -> u64 {
        self.vocab.saturating_add(self.n_positions).saturating_mul(self.n_embd)
    }

    /// The most parameters stage 3 holds gathered at once for the zoo's `ShardedGpt2` (the
    /// embeddings and each block a unit, gathered one at a time; the final layer norm
    /// replicated), with a prefetch budget of `prefetch_bucket_size` elements (0: none): by
    /// [`gathered_with_prefetch`](super::gathered_with_prefetch).
    pub fn gathered_at_once(&self, prefetch_bucket_size: u64) -> u64 {
        gathered_with_prefetch_counted(
            &[(self.embed_params(), 1), (self.block_params(), self.n_layer)],
            prefetch_bucket_size,
        )
    }
}

/// What one tensor rank holds of a GPT-2 ([`Gpt2Shape::tensor_slice`]): the counts stage 3's
/// units and the estimate take. Counts that pass 2^64 saturate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankShape {
    block: Option<u64>,
    embed: Option<u64>,
    n_layer: u64,
    n_embd: u64,
}

impl RankShape {
    /// Parameters of one block's slice.
    pub fn block_params(&self) -> u64 {
        self.block.unwrap_or(u64::MAX)
    }

    /// Parameters of the embeddings' slice (the first unit).
    pub fn embed_params(&self) -> u64 {
        self.embed.unwrap_or(u64::MAX)
    }

    /// Parameters outside the blocks: the embeddings and the final layer norm.
    pub fn ends_params(&self) -> u64 {
        self.embed_params().saturating_add(self.n_embd.saturating_mul(2))
    }

    /// Parameters the rank holds.
    pub fn num_params(&self) -> u64 {
        self.n_layer
            .saturating_mul(self.block_params())
            .saturating_add(self.ends_params())
    }

    /// [`Gpt2Shape::gathered_at_once`] of the slice.
    pub fn gathered_at_once(&self, prefetch_bucket_size: u64) -> u64 {
        gathered_with_prefetch_counted(
            &[(self.embed_params(), 1), (self.block_params(), self.n_layer)],
            prefetch_bucket_size,
        )
    }
}
