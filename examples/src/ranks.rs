//! Starting the ranks: threads in this process, or this process as one rank of a launched job.

use std::sync::Arc;
use zero_core::comm::{CommError, DistEnv, ProcessGroup, TcpGroup, ThreadGroup};

/// Runs `body(rank, group)` for every rank this process hosts and returns the results in rank
/// order: all `nproc` ranks as threads, or, when a launcher set RANK/WORLD_SIZE (or Slurm's or
/// Open MPI's variables), this process's one rank over TCP.
pub fn run_ranks<T: Send + 'static>(
    nproc: usize,
    body: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Send + Sync + 'static,
) -> Result<Vec<T>, CommError> {
    run_ranks_with(nproc, false, move |rank, group, _| body(rank, group))
}

/// [`run_ranks`], handing each rank, when `second` is set, a second group of the same ranks
/// for a user of its own (NCCL's control group): a second thread group, or a TCP group split
/// off the launched one.
pub fn run_ranks_with<T: Send + 'static>(
    nproc: usize,
    second: bool,
    body: impl Fn(usize, Arc<dyn ProcessGroup>, Option<Arc<dyn ProcessGroup>>) -> T + Send + Sync + 'static,
) -> Result<Vec<T>, CommError> {
    if let Ok(env) = DistEnv::detect() {
        let group = TcpGroup::from_env(None)?;
        let other = match second {
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

/// The message a panic carried, when it is text.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}
