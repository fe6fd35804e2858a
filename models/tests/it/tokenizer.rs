//! GPT-2 tokenization against reference ids.
//!
//! Reference: tests/fixtures/tokenizer_ids.json, written by tools/tokenizer_reference.py with
//! transformers' GPT2Tokenizer on OpenAI's GPT-2 vocabulary files (cross-checked there with the
//! JavaScript gpt-3-encoder).

use zero_models::tokenizer::{Gpt2Tokenizer, EOT_TOKEN};

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizer_ids.json");
    let text = std::fs::read_to_string(path).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn encodes_like_transformers() {
    let tokenizer = Gpt2Tokenizer::new().unwrap();
    let cases = cases();
    assert!(cases.len() >= 5);
    for case in cases {
        assert_eq!(tokenizer.encode(&case.text), case.ids, "{:?}", case.text);
        assert_eq!(tokenizer.decode(&case.ids).unwrap(), case.text);
    }
}

#[test]
fn end_of_text_is_50256() {
    let tokenizer = Gpt2Tokenizer::new().unwrap();
    assert_eq!(EOT_TOKEN, 50256);
    assert_eq!(tokenizer.vocab_size(), 50257);
    assert_eq!(tokenizer.encode_with_special_tokens("<|endoftext|>"), [EOT_TOKEN]);
}
