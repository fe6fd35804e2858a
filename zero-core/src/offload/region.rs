//! Where a set of equally long flat buffers lives in a swap file, chunk by chunk.

/// `width` flat buffers of `len` f32 elements each, stored from element `offset` of a swap file
/// in chunks of `chunk` elements: chunk c holds elements `c·chunk ..` of buffer 0, then the same
/// elements of buffer 1, and so on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwapRegion {
    /// First element (f32) of the region in the file.
    pub offset: u64,
    /// Elements per buffer.
    pub len: usize,
    /// Buffers stored side by side (e.g. 3 for an fp32 master and Adam's two moments).
    pub width: usize,
    /// Elements per buffer in one chunk (the last chunk may be shorter).
    pub chunk: usize,
}

impl SwapRegion {
    /// A region of `width` buffers of `len` elements at `offset`, in chunks of `chunk` (at
    /// least 1).
    pub fn new(offset: u64, len: usize, width: usize, chunk: usize) -> Self {
        SwapRegion {
            offset,
            len,
            width,
            chunk: chunk.max(1),
        }
    }

    /// Elements the region takes in the file.
    pub fn elements(&self) -> u64 {
        self.len as u64 * self.width as u64
    }

    /// Number of chunks.
    pub fn chunks(&self) -> usize {
        self.len.div_ceil(self.chunk)
    }

    /// Elements per buffer of chunk `c` and the chunk's first element within a buffer.
    pub fn chunk_range(&self, c: usize) -> std::ops::Range<usize> {
        let start = c * self.chunk;
        start..(start + self.chunk).min(self.len)
    }

    /// First element (f32) of chunk `c` in the file.
    pub fn chunk_offset(&self, c: usize) -> u64 {
        self.offset + (c * self.chunk) as u64 * self.width as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_region_without_overlap() {
        let r = SwapRegion::new(100, 10, 3, 4);
        assert_eq!(r.chunks(), 3);
        assert_eq!(r.chunk_range(2), 8..10);
        // Each chunk starts where the previous one's `width` buffers end.
        assert_eq!(r.chunk_offset(0), 100);
        assert_eq!(r.chunk_offset(1), 100 + 4 * 3);
        assert_eq!(r.chunk_offset(2), 100 + 8 * 3);
        assert_eq!(r.chunk_offset(2) + 2 * 3, 100 + r.elements());
    }
}
