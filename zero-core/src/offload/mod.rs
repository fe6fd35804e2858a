//! NVMe offload of flat f32 buffers (ZeRO-Infinity's optimizer swapping).
//!
//! A rank's fp32 master weights and optimizer moments can live in a scratch file on a fast
//! disk instead of in memory. The file stores each flat buffer cut into chunks, and each chunk
//! of all the buffers that are updated together side by side (`[master | exp_avg | exp_avg_sq]`
//! for chunk 0, then for chunk 1, ...), so that one chunk is one sequential read and one
//! sequential write. [`stream_chunks`] runs a computation over every chunk of a region through a
//! fixed number of host buffers, reading chunk i+1 while chunk i is computed and chunk i-1 is
//! written back.
//!
//! This module knows files and f32 slices only; what is computed on a chunk (an optimizer
//! step) is the caller's.

mod error;
mod region;
mod stream;
mod swap_file;

pub use error::OffloadError;
pub use region::SwapRegion;
pub use stream::{stream_chunks, StreamStats};
pub use swap_file::SwapFile;

/// The most elements of one chunk a stream moves at once (`sub_group_size` is capped here): 4 Mi
/// elements, 16 MiB per state buffer, large enough for sequential disk I/O, small enough that a
/// few buffers stay a small share of host memory (DeepSpeed's default sub-group, 1e9 elements,
/// would make each of the `buffer_count` buffers 12 GB).
pub const MAX_CHUNK_ELEMENTS: usize = 1 << 22;

/// The fewest elements of one chunk (`sub_group_size` is raised to it): 64 Ki elements, 256 KiB
/// per state buffer. Smaller chunks save no memory worth having, and each costs a read and a
/// write of its own (a `sub_group_size` of 1 made two steps of a tiny model take minutes).
pub const MIN_CHUNK_ELEMENTS: usize = 1 << 16;

/// The elements of one streamed chunk for a `sub_group_size`: within
/// [`MIN_CHUNK_ELEMENTS`]`..=`[`MAX_CHUNK_ELEMENTS`].
pub fn chunk_elements(sub_group_size: u64) -> usize {
    usize::try_from(sub_group_size)
        .unwrap_or(usize::MAX)
        .clamp(MIN_CHUNK_ELEMENTS, MAX_CHUNK_ELEMENTS)
}
