//! Starting the ranks: threads in this process, or this process as one rank of a launched job.

use std::sync::Arc;
use zero_core::comm::{CommError, DistEnv, FlatBuffer, ProcessGroup, ReduceOp, TcpGroup, ThreadGroup};

/// Runs `body(rank, group)` for every rank this process hosts and returns the results in rank
/// order: all `nproc` ranks as threads, or, when a launcher set RANK/WORLD_SIZE (or Slurm's or
/// Open MPI's variables), this process's one rank over TCP.
pub fn run_ranks<T: Send + 'static>(
    nproc: usize,
    body: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Send + Sync + 'static,
) -> Result<Vec<T>, CommError> {
    let launch = DistEnv::launched().map_err(|e| CommError::Setup(format!("the launcher's environment: {e}")))?;
    run_ranks_with(launch.as_ref(), nproc, false, move |rank, group, _| body(rank, group))
}

/// [`run_ranks`] for a caller that has read the launch ([`DistEnv::launched`]) itself:
/// `launch` is this process's rank of a launched job, `None` for `nproc` rank threads. Each
/// rank gets, when `second` is set, a second group of the same ranks for a user of its own
/// (NCCL's control group): a second thread group, or a TCP group split off the launched one.
/// Launched ranks decide `second` each for itself, so they agree first ([`all_agree`]): the
/// second group is made only where every rank asked for it (a split that some ranks skip
/// would wait for them forever), and each rank gets `None` otherwise.
pub fn run_ranks_with<T: Send + 'static>(
    launch: Option<&DistEnv>,
    nproc: usize,
    second: bool,
    body: impl Fn(usize, Arc<dyn ProcessGroup>, Option<Arc<dyn ProcessGroup>>) -> T + Send + Sync + 'static,
) -> Result<Vec<T>, CommError> {
    if let Some(env) = launch {
        let group = TcpGroup::from_env(None)?;
        let other = match all_agree(&group, second)? {
            true => Some(Arc::new(group.split(&[(0..env.world_size).collect()])?) as Arc<dyn ProcessGroup>),
            false => None,
        };
        return Ok(vec![body(env.rank, Arc::new(group), other)]);
    }
    let groups = ThreadGroup::new_group(nproc.max(1))?;
    let others: Vec<Option<Arc<dyn ProcessGroup>>> = match second {
        true => ThreadGroup::new_group(nproc.max(1))?
            .into_iter()
            .map(|g| Some(g as Arc<dyn ProcessGroup>))
            .collect(),
        false => vec![None; groups.len()],
    };
    let body = Arc::new(body);
    let handles: Vec<_> = groups
        .into_iter()
        .zip(others)
        .enumerate()
        .map(|(rank, (group, other))| {
            let body = body.clone();
            std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || body(rank, group as Arc<dyn ProcessGroup>, other))
        })
        .collect::<Result<_, _>>()
        .map_err(|e| CommError::Setup(format!("cannot start a rank thread: {e}")))?;
    handles
        .into_iter()
        .enumerate()
        .map(|(rank, h)| {
            h.join()
                .map_err(|payload| CommError::Setup(format!("rank {rank} panicked: {}", panic_message(&*payload))))
        })
        .collect()
}

/// Whether every rank of `group` passed `mine = true`. A collective: every rank calls it.
pub fn all_agree(group: &dyn ProcessGroup, mine: bool) -> Result<bool, CommError> {
    // The reductions have no minimum: the maximum of "cannot" is 0 only where every rank can.
    let mut cannot = FlatBuffer::F32(vec![if mine { 0.0 } else { 1.0 }]);
    group.all_reduce(&mut cannot, ReduceOp::Max)?;
    Ok(cannot.into_f32().first() == Some(&0.0))
}

/// The message a panic carried, when it is text.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `all_agree` on thread ranks, rank `r` passing `mine(r)`: every rank's answer.
    fn agree(world: usize, mine: fn(usize) -> bool) -> Vec<bool> {
        let groups = ThreadGroup::new_group(world).unwrap();
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| std::thread::spawn(move || all_agree(&*g, mine(rank)).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn ranks_agree_only_when_every_rank_asks() {
        assert_eq!(agree(3, |_| true), [true; 3]);
        // One rank that cannot (rank 0 alone could, as with LOCAL_WORLD_SIZE unset): no rank does.
        assert_eq!(agree(3, |rank| rank == 0), [false; 3]);
        assert_eq!(agree(3, |rank| rank != 2), [false; 3]);
        assert_eq!(agree(1, |_| false), [false]);
    }
}
