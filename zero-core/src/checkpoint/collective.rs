//! The two small collectives that save and load need: every rank learns whether any rank
//! failed (so that all fail together instead of some waiting on the others), and rank 0 learns
//! every rank's file record.

use super::error::CheckpointError;
use crate::comm::{FlatBuffer, ProcessGroup, ReduceOp};

/// Every rank passes its own outcome; every rank gets back its own error, or
/// [`CheckpointError::PeerFailed`] naming the first failed rank when only others failed.
pub fn agree<T>(
    comm: &dyn ProcessGroup,
    action: &'static str,
    outcome: Result<T, CheckpointError>,
) -> Result<T, CheckpointError> {
    if comm.world_size() == 1 {
        return outcome;
    }
    // One flag per rank (small integers are exact in f32): the maximum over ranks of
    // `world - rank` for the failed ones names the lowest failed rank.
    let world = comm.world_size();
    let flag = if outcome.is_err() {
        (world - comm.rank()) as f32
    } else {
        0.0
    };
    let mut buf = FlatBuffer::F32(vec![flag]);
    comm.all_reduce(&mut buf, ReduceOp::Max)?;
    let worst = buf.into_f32().first().copied().unwrap_or(0.0) as usize;
    match outcome {
        Err(e) => Err(e),
        Ok(_) if worst > 0 => Err(CheckpointError::PeerFailed {
            rank: world - worst,
            action,
        }),
        Ok(v) => Ok(v),
    }
}

/// Every rank's `bytes`, in rank order, on every rank. Bytes travel one per f32 element (exact),
/// which is wasteful but only ever used for records of a few hundred bytes.
pub(crate) fn all_gather_bytes(comm: &dyn ProcessGroup, bytes: &[u8]) -> Result<Vec<Vec<u8>>, CheckpointError> {
    if comm.world_size() == 1 {
        return Ok(vec![bytes.to_vec()]);
    }
    // Lengths first, as two 16-bit halves each (exact in f32), so buffers can be padded alike.
    let len = bytes.len() as u32;
    let lens = comm
        .all_gather(FlatBuffer::F32(vec![(len >> 16) as f32, (len & 0xffff) as f32]))?
        .into_f32();
    let lens: Vec<usize> = lens
        .chunks(2)
        .map(|c| ((c[0] as usize) << 16) | c[1] as usize)
        .collect();
    let max = lens.iter().copied().max().unwrap_or(0);
    let mut mine: Vec<f32> = bytes.iter().map(|&b| b as f32).collect();
    mine.resize(max, 0.0);
    let all = comm.all_gather(FlatBuffer::F32(mine))?.into_f32();
    Ok(lens
        .iter()
        .enumerate()
        .map(|(r, &n)| all[r * max..r * max + n].iter().map(|&v| v as u8).collect())
        .collect())
}
