//! Token batches: a fixed array of sequences (`--tokens`), or windows sampled from a tokenized
//! text (`--data`), split between ranks so that every rank sees different data.

use super::TrainError;
use std::path::Path;
use zero_models::Gpt2Tokenizer;

/// A batch of equal-length token sequences.
pub type TokenBatch = Vec<Vec<u32>>;

/// Where training sequences come from.
#[derive(Clone, Debug)]
pub enum DataSource {
    /// The same global batch at every step (a JSON array of equal-length sequences).
    Fixed(TokenBatch),
    /// Windows of `seq_len + 1` tokens sampled from a token stream, with a held-out tail.
    Text {
        /// Training tokens.
        train: Vec<u32>,
        /// Held-out tokens (the last 5 % of the text).
        valid: Vec<u32>,
        /// Tokens per sequence.
        seq_len: usize,
    },
}

impl DataSource {
    /// Reads `--tokens FILE`: a JSON array of equal-length arrays of token ids.
    pub fn from_tokens_file(path: &Path) -> Result<Self, TrainError> {
        let text = zero_core::files::read_to_string(path, zero_core::files::data_limit(path))
            .map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))?;
        let batch: TokenBatch = serde_json::from_str(&text).map_err(|e| {
            TrainError::Data(format!(
                "{}: expected a JSON array of token-id arrays: {e}",
                path.display()
            ))
        })?;
        let len = batch.first().map(Vec::len).unwrap_or(0);
        if len < 2 || batch.iter().any(|s| s.len() != len) {
            return Err(TrainError::Data(format!(
                "{}: every sequence must have the same length, at least 2 tokens",
                path.display()
            )));
        }
        Ok(DataSource::Fixed(batch))
    }

    /// Tokenizes `text` (`what` names it in errors) with GPT-2's BPE and keeps the last 5 % for
    /// validation, for sequences of `seq_len` tokens: at least 2 (each token predicts the next),
    /// at most `n_positions` (the model's) and what the text can hold
    /// ([`DataSource::longest_text_sequence`]). Each refusal names `--seq-len` and its range.
    pub fn from_text(text: &str, what: &str, seq_len: usize, n_positions: usize) -> Result<Self, TrainError> {
        if seq_len < 2 {
            return Err(TrainError::Config(format!(
                "--seq-len {seq_len}: expected 2..={n_positions}, as a sequence needs at least 2 tokens (each \
                 predicts the next)"
            )));
        }
        if seq_len > n_positions {
            return Err(TrainError::Config(format!(
                "--seq-len {seq_len}: expected 2..={n_positions}, as the model's n_positions is {n_positions}"
            )));
        }
        let tokenizer = Gpt2Tokenizer::new().map_err(|e| TrainError::Data(e.to_string()))?;
        let tokens = tokenizer.encode(text);
        let longest = Self::longest_text_sequence(tokens.len());
        if longest < 2 {
            let least = (tokens.len()..)
                .find(|&n| Self::longest_text_sequence(n) >= 2)
                .unwrap_or(usize::MAX);
            return Err(TrainError::Data(format!(
                "{what} has {} tokens, too few to cut into training and held-out sequences (at least {least} \
                 are needed: the 95 % trained on must hold 4 sequences of 2, the 5 % held out 1)",
                tokens.len()
            )));
        }
        if seq_len > longest {
            return Err(TrainError::Config(format!(
                "--seq-len {seq_len}: expected 2..={longest}, as {what} has {} tokens, enough for sequences of \
                 at most {longest} (the 95 % trained on must hold 4 of them, the 5 % held out 1)",
                tokens.len()
            )));
        }
        let split = tokens.len() - tokens.len() / 20;
        Ok(DataSource::Text {
            valid: tokens[split..].to_vec(),
            train: tokens[..split].to_vec(),
            seq_len,
        })
    }

    /// The longest sequence a text of `tokens` tokens gives: the 95 % trained on must hold 4
    /// windows of `seq_len + 1` tokens, the 5 % held out one.
    pub fn longest_text_sequence(tokens: usize) -> usize {
        let split = tokens - tokens / 20;
        (split / 4).min(tokens - split).saturating_sub(1)
    }

    /// Tokens per sequence.
    pub fn seq_len(&self) -> usize {
        match self {
            DataSource::Fixed(b) => b.first().map(Vec::len).unwrap_or(0),
            DataSource::Text { seq_len, .. } => *seq_len,
        }
    }

    /// The largest token id used.
    pub fn max_token(&self) -> u32 {
        match self {
            DataSource::Fixed(b) => b.iter().flatten().copied().max().unwrap_or(0),
            DataSource::Text { train, valid, .. } => train.iter().chain(valid).copied().max().unwrap_or(0),
        }
    }

    /// The global batch of optimizer step `step`: `size` sequences. A fixed batch must have
    /// exactly `size` sequences; sampled windows are a deterministic function of
    /// `(seed, step, index)`, so every rank computes the same global batch and takes its rows.
    pub fn global_batch(&self, step: u64, size: usize, seed: u64) -> Result<TokenBatch, TrainError> {
        match self {
            DataSource::Fixed(batch) if batch.len() == size => Ok(batch.clone()),
            DataSource::Fixed(batch) => Err(TrainError::Data(format!(
                "the token file has {} sequences but the config's train_batch_size is {size}: every step uses the whole file as the global batch",
                batch.len()
            ))),
            DataSource::Text { train, seq_len, .. } => {
                let windows = train.len() - seq_len;
                Ok((0..size)
                    .map(|i| {
                        let start = (mix(seed, step, i as u64) % windows as u64) as usize;
                        train[start..start + seq_len].to_vec()
                    })
                    .collect())
            }
        }
    }

    /// Held-out sequences for validation (consecutive windows from the held-out text).
    pub fn validation(&self, count: usize) -> TokenBatch {
        match self {
            DataSource::Fixed(_) => Vec::new(),
            DataSource::Text { valid, seq_len, .. } => {
                valid.chunks_exact(*seq_len).take(count).map(<[u32]>::to_vec).collect()
            }
        }
    }
}

/// The held-out sequences data-parallel rank `index` of `ranks` scores: an equal share of
/// `validation`, or all of them on every rank when there are fewer than ranks (each then
/// computes the same loss, and the mean over the ranks is that loss).
pub fn validation_share(validation: &[Vec<u32>], ranks: usize, index: usize) -> &[Vec<u32>] {
    let per = validation.len() / ranks.max(1);
    if per == 0 {
        validation
    } else {
        &validation[index * per..(index + 1) * per]
    }
}

/// A well-mixed 64-bit hash of three integers (splitmix64 finalizer over a combined key).
fn mix(seed: u64, step: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(step.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(index.wrapping_mul(0x94D0_49BB_1331_11EB));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank scores a share, or, with fewer sequences than ranks, all of them.
    #[test]
    fn every_rank_scores_some_held_out_sequences() {
        let v: Vec<Vec<u32>> = (0..5).map(|i| vec![i]).collect();
        assert_eq!(validation_share(&v, 2, 1), &v[2..4]);
        assert_eq!(validation_share(&v[..1], 4, 3), &v[..1]);
        assert_eq!(validation_share(&v, 1, 0), &v[..]);
    }

    #[test]
    fn sampled_batches_are_deterministic_and_differ_by_step() {
        let data = DataSource::Text {
            train: (0..1000).collect(),
            valid: (0..100).collect(),
            seq_len: 8,
        };
        let a = data.global_batch(3, 4, 42).expect("batch");
        assert_eq!(a, data.global_batch(3, 4, 42).expect("batch"));
        assert_ne!(a, data.global_batch(4, 4, 42).expect("batch"));
        assert!(a.iter().all(|s| s.len() == 8 && s.windows(2).all(|w| w[1] == w[0] + 1)));
        assert_eq!(data.validation(3).len(), 3);
    }

    #[test]
    fn a_text_takes_sequences_from_2_to_what_it_and_the_model_hold() {
        let text = "the quick brown fox jumps over the lazy dog. ".repeat(40);
        let tokens = Gpt2Tokenizer::new().expect("tokenizer").encode(&text).len();
        let longest = DataSource::longest_text_sequence(tokens);
        assert!(DataSource::from_text(&text, "t", 2, 1024).is_ok());
        assert!(DataSource::from_text(&text, "t", longest, 1024).is_ok());
        for (seq_len, n_positions, range) in [
            (0, 1024, "2..=1024".to_string()),
            (1, 1024, "2..=1024".to_string()),
            (100, 64, "2..=64".to_string()),
            (longest + 1, 1024, format!("2..={longest}")),
        ] {
            let err = DataSource::from_text(&text, "t", seq_len, n_positions)
                .expect_err("out of range")
                .to_string();
            assert!(
                err.contains(&format!("--seq-len {seq_len}")) && err.contains(&range),
                "{err}"
            );
        }
        let err = DataSource::from_text("tiny", "t", 2, 1024)
            .expect_err("too short")
            .to_string();
        assert!(err.contains("too few"), "{err}");
    }

    #[test]
    fn a_fixed_batch_must_match_the_batch_size() {
        let data = DataSource::Fixed(vec![vec![1, 2, 3]; 4]);
        assert!(data.global_batch(0, 4, 0).is_ok());
        let err = data.global_batch(0, 8, 0).expect_err("size mismatch").to_string();
        assert!(err.contains("4 sequences") && err.contains("8"), "{err}");
    }
}
