//! The two small collectives that save and load need: every rank learns whether any rank
//! failed, and with what error (so that all fail together, instead of some waiting on the
//! others, and whichever rank's error is printed names every failed rank's file and problem),
//! and rank 0 learns every rank's file record.

use super::error::{CheckpointError, RankFailure};
pub(crate) use crate::comm::all_gather_bytes;
use crate::comm::{gather_failures, ProcessGroup};

/// Longest error message a rank sends to the others: far more than any real one, and a bound
/// on what the gather moves.
const MAX_MESSAGE_BYTES: usize = 8 << 10;

/// Every rank passes its own outcome; when any rank failed, every rank fails, and every rank
/// learns every failed rank's message:
/// - a rank that succeeded gets [`CheckpointError::PeerFailed`] with the others' messages;
/// - a rank that failed gets its own error, or, when other ranks failed with other messages,
///   [`CheckpointError::AlsoFailed`] holding its own error and theirs.
pub fn agree<T>(
    comm: &dyn ProcessGroup,
    action: &'static str,
    outcome: Result<T, CheckpointError>,
) -> Result<T, CheckpointError> {
    if comm.world_size() == 1 {
        return outcome;
    }
    let rank = comm.rank();
    let own = outcome.as_ref().err().map(|e| bounded(e.to_string()));
    let failures: Vec<RankFailure> = match gather_failures(comm, own.as_deref()) {
        Ok(f) if f.is_empty() => return outcome,
        Ok(f) => f
            .into_iter()
            .map(|f| RankFailure {
                rank: f.rank,
                message: f.message,
            })
            .collect(),
        // This rank's own error says more than the collective's.
        Err(e) => return Err(outcome.err().unwrap_or(e.into())),
    };
    match outcome {
        Ok(_) => Err(CheckpointError::PeerFailed { action, failures }),
        Err(e) => {
            // Another rank's identical message (the same missing file, seen by both) is said once.
            let others: Vec<RankFailure> = failures
                .into_iter()
                .filter(|f| f.rank != rank && Some(&f.message) != own.as_ref())
                .collect();
            if others.is_empty() {
                Err(e)
            } else {
                Err(CheckpointError::AlsoFailed {
                    own: Box::new(e),
                    action,
                    others,
                })
            }
        }
    }
}

/// `message`, cut (at a character boundary) to [`MAX_MESSAGE_BYTES`], and never empty, so that a
/// failed rank always says something.
fn bounded(mut message: String) -> String {
    if message.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("...");
    }
    if message.is_empty() {
        message.push_str("(no message)");
    }
    message
}
