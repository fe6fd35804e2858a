//! The integration tests of this crate, one module per file, built as one test binary (one
//! link of the crate and its dependencies instead of one per file). Tests that must own
//! their process (a counting global allocator, a process-wide default) stay files of
//! their own beside this directory.

mod common;
mod pipeline_support;
mod tp_support;

mod checkpoint;
mod estimate_gather;
mod hf_parity;
mod llama_export;
mod llama_parity;
mod llama_partitioned;
mod llama_zero;
mod params;
mod partitioned_load;
mod pipeline_checkpoint;
mod pipeline_gpt2;
mod pipeline_precision;
mod pipeline_tp;
mod random_pretrained;
mod tokenizer;
mod tp_gpt2;
mod tp_layers;
mod tp_training;
