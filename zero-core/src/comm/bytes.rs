//! Small records (a file's checksums, an error message, a memory report) exchanged between ranks
//! over any [`ProcessGroup`], whose collectives carry numbers, not bytes.

use super::{CommError, FlatBuffer, ProcessGroup};

/// Every rank's `bytes`, in rank order, on every rank. Three bytes travel per f32 element (24
/// bits are exact in an f32's mantissa), so this is for records of a few KiB, not for tensors.
pub fn all_gather_bytes(group: &dyn ProcessGroup, bytes: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
    if group.world_size() == 1 {
        return Ok(vec![bytes.to_vec()]);
    }
    // Lengths first, as two 16-bit halves each (exact in f32), so every rank pads alike.
    let len = bytes.len() as u32;
    let lens = group
        .all_gather(FlatBuffer::F32(vec![(len >> 16) as f32, (len & 0xffff) as f32]))?
        .into_f32();
    let lens: Vec<usize> = lens
        .chunks(2)
        .map(|c| ((c[0] as usize) << 16) | c[1] as usize)
        .collect();
    let words = lens.iter().copied().max().unwrap_or(0).div_ceil(3);
    let mut mine: Vec<f32> = bytes
        .chunks(3)
        .map(|c| c.iter().rev().fold(0u32, |word, &b| (word << 8) | b as u32) as f32)
        .collect();
    mine.resize(words, 0.0);
    let all = group.all_gather(FlatBuffer::F32(mine))?.into_f32();
    Ok(lens
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            all[r * words..(r + 1) * words]
                .iter()
                .flat_map(|&w| (w as u32).to_le_bytes().into_iter().take(3))
                .take(n)
                .collect()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ThreadGroup;

    #[test]
    fn records_of_different_lengths_arrive_whole_on_every_rank() {
        // Every byte value, and lengths that are and are not multiples of three.
        let record = |rank: usize| -> Vec<u8> { (0..=255u8).cycle().skip(rank * 7).take(256 + rank).collect() };
        let groups = ThreadGroup::new_group(3).unwrap();
        let gathered: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, g)| s.spawn(move || all_gather_bytes(g.as_ref(), &record(rank)).unwrap()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for on_rank in gathered {
            assert_eq!(on_rank, (0..3).map(record).collect::<Vec<_>>());
        }
    }
}
