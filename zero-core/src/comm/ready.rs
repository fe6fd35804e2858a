//! Every rank's readiness before a step that waits for all of them with no deadline of its own
//! (NCCL's communicator set-up): a rank whose preparation failed says so, and the others stop
//! with an error that names it instead of waiting for it forever.

use super::{all_gather_bytes, CommError, FlatBuffer, ProcessGroup, ReduceOp};

/// A failed rank's error message, as every rank learns it from [`gather_failures`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The rank that failed.
    pub rank: usize,
    /// Its error, as it wrote it.
    pub message: String,
}

/// Every rank passes its own error message (`None` when it succeeded); every rank learns every
/// failed rank's message, in rank order: empty when none failed, which costs one all-reduce of
/// one flag per rank. A failed rank whose message could not be collected is still listed.
pub fn gather_failures(group: &dyn ProcessGroup, own: Option<&str>) -> Result<Vec<Failure>, CommError> {
    let (rank, world) = (group.rank(), group.world_size());
    if world == 1 {
        return Ok(own
            .map(|m| Failure {
                rank,
                message: m.to_string(),
            })
            .into_iter()
            .collect());
    }
    let mut flags = vec![0f32; world];
    flags[rank] = if own.is_some() { 1.0 } else { 0.0 };
    let mut buffer = FlatBuffer::F32(flags);
    group.all_reduce(&mut buffer, ReduceOp::Max)?;
    let flags = buffer.into_f32();
    let failed: Vec<usize> = (0..world).filter(|&r| flags.get(r).is_some_and(|&f| f > 0.0)).collect();
    if failed.is_empty() {
        return Ok(Vec::new());
    }
    let messages = all_gather_bytes(group, own.unwrap_or("").as_bytes())
        .map_err(|e| format!("(its error could not be collected: {e})"));
    Ok(failed
        .into_iter()
        .map(|r| Failure {
            rank: r,
            message: match &messages {
                Ok(all) => String::from_utf8_lossy(all.get(r).map_or(&[][..], Vec::as_slice)).into_owned(),
                Err(e) => e.clone(),
            },
        })
        .collect())
}

/// Every rank passes the outcome of its own preparation for `what`; when any rank failed, every
/// rank fails: a failed rank with its own error, the others with [`CommError::Setup`] naming
/// every failed rank and its error ([`gather_failures`]).
pub fn all_ready<T>(group: &dyn ProcessGroup, what: &str, own: Result<T, CommError>) -> Result<T, CommError> {
    let message = own.as_ref().err().map(|e| e.to_string());
    let failures = match gather_failures(group, message.as_deref()) {
        // This rank's own error says more than the collective's.
        Err(e) => return Err(own.err().unwrap_or(e)),
        Ok(f) => f,
    };
    match own {
        Err(e) => Err(e),
        Ok(value) if failures.is_empty() => Ok(value),
        Ok(_) => {
            let ranks: Vec<usize> = failures.iter().map(|f| f.rank).collect();
            let said: Vec<String> = failures
                .iter()
                .map(|f| format!("rank {}: {}", f.rank, f.message))
                .collect();
            Err(CommError::Setup(format!(
                "{what}: rank {} stops because {} failed to prepare: {}",
                group.rank(),
                plural_ranks(&ranks),
                said.join("; ")
            )))
        }
    }
}

/// "rank 3" or "ranks 1, 2".
fn plural_ranks(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ThreadGroup;
    use std::time::Duration;

    /// Runs `outcome(rank)` through `all_ready` on every rank of a thread group.
    fn run(world: usize, outcome: fn(usize) -> Result<usize, CommError>) -> Vec<Result<usize, CommError>> {
        let groups = ThreadGroup::with_timeout(world, Duration::from_secs(20)).unwrap();
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| std::thread::spawn(move || all_ready(&*g, "NCCL set-up", outcome(g.rank()))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_ranks_ready_keep_their_values() {
        let got = run(3, Ok);
        assert_eq!(got.into_iter().map(Result::unwrap).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn a_failed_rank_stops_every_rank_with_its_name_and_error() {
        let got = run(4, |r| {
            if r == 2 {
                Err(CommError::Setup("cannot open GPU 2: no such device".into()))
            } else {
                Ok(r)
            }
        });
        for (rank, outcome) in got.into_iter().enumerate() {
            let err = outcome.expect_err("every rank fails").to_string();
            if rank == 2 {
                assert!(err.contains("cannot open GPU 2"), "{err}");
                assert!(!err.contains("stops because"), "the failed rank's own error: {err}");
            } else {
                assert!(
                    err.contains(&format!("rank {rank} stops because rank 2 failed"))
                        && err.contains("rank 2: process group setup: cannot open GPU 2"),
                    "{err}"
                );
            }
        }
    }

    #[test]
    fn several_failed_ranks_are_all_named() {
        let got = run(3, |r| match r {
            0 => Ok(0),
            r => Err(CommError::Setup(format!("rank {r}'s GPU is busy"))),
        });
        let err = got[0].as_ref().expect_err("rank 0 fails too").to_string();
        assert!(
            err.contains("ranks 1, 2 failed") && err.contains("rank 1's GPU") && err.contains("rank 2's GPU"),
            "{err}"
        );
    }
}
