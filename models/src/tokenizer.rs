//! GPT-2's byte-level BPE tokenizer (OpenAI's `r50k_base` vocabulary, embedded in tiktoken-rs,
//! so no file or download is needed).

use tiktoken_rs::CoreBPE;

/// Id of `<|endoftext|>`, GPT-2's document separator and its only special token.
pub const EOT_TOKEN: u32 = 50256;

/// Why text could not be tokenized or ids decoded.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The embedded vocabulary could not be built.
    #[error("cannot build GPT-2's BPE vocabulary: {0}")]
    Vocabulary(String),
    /// An id outside GPT-2's vocabulary.
    #[error("token id {id} at position {position} is outside GPT-2's vocabulary (0..=50256)")]
    UnknownId {
        /// The id.
        id: u32,
        /// Its index in the input.
        position: usize,
    },
    /// The ids decode to bytes that are not UTF-8 (a multi-byte character cut between ids).
    #[error("token ids do not decode to valid UTF-8: {0}")]
    InvalidUtf8(String),
}

/// GPT-2's tokenizer: the same ids as HuggingFace's `GPT2TokenizerFast` and `tiktoken`'s
/// `gpt2` encoding.
///
/// ```
/// use zero_models::tokenizer::{Gpt2Tokenizer, EOT_TOKEN};
///
/// let tokenizer = Gpt2Tokenizer::new().unwrap();
/// let ids = tokenizer.encode("Hello world");
/// assert_eq!(ids, [15496, 995]);
/// assert_eq!(tokenizer.decode(&ids).unwrap(), "Hello world");
/// assert_eq!(tokenizer.eot_token(), EOT_TOKEN);
/// ```
pub struct Gpt2Tokenizer {
    bpe: CoreBPE,
}

impl std::fmt::Debug for Gpt2Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt2Tokenizer").finish_non_exhaustive()
    }
}

impl Gpt2Tokenizer {
    /// Builds the tokenizer from the vocabulary embedded in tiktoken-rs.
    pub fn new() -> Result<Self, TokenizerError> {
        let bpe = tiktoken_rs::r50k_base().map_err(|error| TokenizerError::Vocabulary(error.to_string()))?;
        Ok(Self { bpe })
    }

    /// Size of the vocabulary, `<|endoftext|>` included.
    pub fn vocab_size(&self) -> usize {
        EOT_TOKEN as usize + 1
    }

    /// The `<|endoftext|>` id.
    pub fn eot_token(&self) -> u32 {
        EOT_TOKEN
    }

    /// Token ids of `text`, read as plain text: a literal `<|endoftext|>` in it is encoded as
    /// ordinary characters, never as the special token, so data cannot inject separators.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// Token ids of `text` in which the literal `<|endoftext|>` is the special token.
    pub fn encode_with_special_tokens(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_with_special_tokens(text)
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let bytes = self.decode_bytes(ids)?;
        String::from_utf8(bytes).map_err(|error| TokenizerError::InvalidUtf8(error.to_string()))
    }

    /// The bytes of `ids`; unlike [`decode`](Self::decode) this accepts ids that split a
    /// multi-byte character.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        // Checked here so that the error names the position of the bad id.
        if let Some((position, &id)) = ids.iter().enumerate().find(|(_, &id)| id > EOT_TOKEN) {
            return Err(TokenizerError::UnknownId { id, position });
        }
        self.bpe
            .decode_bytes(ids)
            .map_err(|error| TokenizerError::InvalidUtf8(error.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_token_only_when_asked() {
        let tokenizer = Gpt2Tokenizer::new().unwrap();
        let text = "a<|endoftext|>b";
        assert!(!tokenizer.encode(text).contains(&EOT_TOKEN));
        assert!(tokenizer.encode_with_special_tokens(text).contains(&EOT_TOKEN));
        assert_eq!(tokenizer.decode(&[EOT_TOKEN]).unwrap(), "<|endoftext|>");
    }

    #[test]
    fn rejects_unknown_ids() {
        let tokenizer = Gpt2Tokenizer::new().unwrap();
        assert!(matches!(
            tokenizer.decode(&[15496, 50257]),
            Err(TokenizerError::UnknownId { id: 50257, position: 1 })
        ));
    }

    #[test]
    fn round_trips_unicode() {
        let tokenizer = Gpt2Tokenizer::new().unwrap();
        let text = "Ünïcödé — “quotes” 日本語 🦀\n\tend";
        assert_eq!(tokenizer.decode(&tokenizer.encode(text)).unwrap(), text);
    }
}
