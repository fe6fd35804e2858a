//! Checkpoints: sharded, verified, re-cut for any world size on load, consolidated by streaming.
//!
//! Each rank writes its owned slices of the fp32 master weights and of the optimizer state as a
//! safetensors shard; rank 0 writes one JSON metadata file with the layout (every parameter's
//! name, shape, dtype, group and offset), the world size, stage, step, scheduler and loss
//! scaler state and the caller's own state, and the checksums of every file. See
//! [`format`](mod@format) for the directory structure and [`save`](save::save) for the crash-safe order of
//! writes.
//!
//! Loading ([`load`](load::load)) needs no conversion step: the layout is a pure function of the
//! shapes, the grouping and the world size, so each rank plans which element ranges of which old
//! shard files make up its new owned slices ([`reshard`]) and reads only those, verifying each
//! chunk's checksum as it goes. [`to_fp32`] writes the whole weights as one (or several)
//! safetensors file(s), holding one tensor at a time.
//!
//! This module knows no tensors: the engines in `zero-burn` hand it flat slices.

mod atomic;
mod collective;
mod consolidate;
mod error;
pub mod format;
mod load;
mod names;
mod reader;
mod recut;
pub mod reshard;
mod retention;
mod save;
mod sources;
mod tensor_parallel;
mod writer;

pub use collective::agree;
pub use consolidate::{
    export_fp32, parse_size, to_fp32, to_fp32_tensor_parallel, write_model_config, ConsolidateReport, ExportNaming,
    Fp32Source, GroupExport, CONFIG_FILE, INDEX_FILE, SINGLE_FILE,
};
pub use error::{CheckpointError, RankFailure};
pub use format::{
    CheckpointMeta, FileRecord, ModelRecord, OptimizerRecord, ParamRecord, TensorParallelRecord, TensorSplit,
    LATEST_FILE, META_FILE,
};
pub use load::{load, resolve_tag, Checkpoint, LoadedGroup};
pub use names::{
    ExportedTensor, NameMap, NameRule, TensorLayout, GPT2_HF_NAMING, INTERNAL_NAMING, LLAMA_HF_NAMING, NAMINGS,
};
pub use reader::ShardReader;
pub use recut::recut;
pub use retention::{describe_tags, tags, tags_after, Lineage, SaveOptions, Saved, SavedTag};
pub use save::{describe, save, GroupShard, SaveRequest};
pub use tensor_parallel::{
    check_same_kind, check_tensor_degree, holds_checkpoint, merge_slices, tensor_rank_dir, tensor_rank_of,
    TensorParallelCheckpoint,
};
pub use writer::{HalfDtype, SafetensorsStream, TensorEntry, CHUNK_BYTES};
