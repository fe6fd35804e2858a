//! `--collectives`: whether a data-parallel run's ranks reduce and gather through NCCL on their
//! GPUs' own buffers, or through host memory.
//!
//! NCCL wants one GPU per rank: two ranks on one device is an error of NCCL's. So `auto` takes
//! NCCL only where every rank of this node has a GPU of its own and there is something to
//! reduce (more than one rank); ranks sharing a GPU, and one rank alone, stay on the host path
//! (at world size 1 it copies nothing). The host group still carries what is not a tensor
//! collective: checkpoints, the agreement on a step, the memory reports.

use super::{TrainArgs, TrainError};
use zero_burn::sharded::{ShardBackend, UnitComm};
use zero_core::comm::SharedGroup;

/// Makes a rank's device collective from a control group of its own (see
/// `NcclGroup::over`), its device, and whether the ranks are threads of one process.
pub(super) type DeviceUnits<B> = fn(
    SharedGroup,
    &<B as burn::tensor::backend::BackendTypes>::Device,
    bool,
) -> Result<UnitComm<<B as ShardBackend>::Collective>, TrainError>;

/// The values `--collectives` takes.
const CHOICES: [&str; 3] = ["auto", "nccl", "host"];

/// Refuses a `--collectives` value other than auto, nccl or host.
pub(super) fn check(args: &TrainArgs) -> Result<(), TrainError> {
    if CHOICES.contains(&args.collectives.as_str()) {
        return Ok(());
    }
    Err(TrainError::Config(format!(
        "--collectives {}: expected one of {}",
        args.collectives,
        CHOICES.join(", ")
    )))
}

/// Whether a CUDA run on `gpus` visible GPUs takes NCCL (see [`choose`]): its ranks on this
/// node are the launcher's LOCAL_WORLD_SIZE processes, or the `--nproc` rank threads.
///
/// This is one rank's wish. Without LOCAL_WORLD_SIZE (Slurm, Open MPI) a rank counts the ranks
/// up to its own, so the ranks of a node may wish differently under `auto`: they agree before
/// the NCCL group is made (`crate::ranks::run_ranks_with`), and take NCCL only if every rank
/// can.
#[cfg(feature = "cuda")]
pub(super) fn nccl_wanted(
    args: &TrainArgs,
    launch: Option<&zero_core::comm::DistEnv>,
    gpus: usize,
) -> Result<bool, TrainError> {
    let ranks = match launch {
        Some(env) => Ranks {
            local: std::env::var("LOCAL_WORLD_SIZE")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(env.local_rank + 1),
            world: env.world_size,
            what: "processes on this node",
        },
        None => Ranks {
            local: args.nproc,
            world: args.nproc,
            what: "rank threads (--nproc)",
        },
    };
    choose(&args.collectives, &ranks, gpus)
}

/// A run's ranks, as `--collectives` sees them.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Ranks {
    /// On this node.
    local: usize,
    /// In all.
    world: usize,
    /// What they are, for an error.
    what: &'static str,
}

/// `--collectives` on `gpus` GPUs: NCCL always with `nccl` (refused where ranks would share a
/// GPU), never with `host`, and with `auto` when there are several ranks and each has a GPU of
/// its own.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn choose(collectives: &str, ranks: &Ranks, gpus: usize) -> Result<bool, TrainError> {
    let own_gpus = ranks.local <= gpus;
    match collectives {
        "host" => Ok(false),
        "nccl" if !own_gpus => Err(TrainError::Config(format!(
            "--collectives nccl: {} {} on {gpus} GPU(s); NCCL needs a GPU per rank. Give \
             --collectives host (or auto) to share GPUs through host memory",
            ranks.local, ranks.what
        ))),
        "nccl" => Ok(true),
        _ => Ok(own_gpus && ranks.world > 1),
    }
}

/// The NCCL collective of the rank on `device`: a communicator built over `ctrl` (its own
/// control group), on the GPU the model is on.
#[cfg(feature = "cuda")]
pub(super) fn nccl_units(
    ctrl: SharedGroup,
    device: &burn::backend::cuda::CudaDevice,
    threads: bool,
) -> Result<UnitComm<burn::backend::Cuda>, TrainError> {
    use std::sync::Arc;
    use zero_core::comm::NcclGroup;
    let timeout = zero_core::comm::env::timeout_from_env().map_err(|e| TrainError::Config(e.to_string()))?;
    let group = NcclGroup::over(ctrl, device.index, timeout).map_err(|e| TrainError::Engine(e.into()))?;
    let nccl = zero_burn::NcclDevice::new(Arc::new(group), device)?;
    Ok(Arc::new(if threads { nccl.thread_ranks() } else { nccl }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn threads(n: usize) -> Ranks {
        Ranks {
            local: n,
            world: n,
            what: "rank threads (--nproc)",
        }
    }

    #[test]
    fn auto_takes_nccl_only_for_several_ranks_with_a_gpu_each() {
        assert!(choose("auto", &threads(4), 4).unwrap());
        assert!(choose("auto", &threads(2), 8).unwrap());
        // Ranks sharing a GPU, and one rank alone: the host path.
        assert!(!choose("auto", &threads(2), 1).unwrap());
        assert!(!choose("auto", &threads(1), 1).unwrap());
        // Launched processes: each node's own ranks against its GPUs.
        let nodes = Ranks {
            local: 8,
            world: 16,
            what: "processes on this node",
        };
        assert!(choose("auto", &nodes, 8).unwrap());
        assert!(!choose("auto", &nodes, 4).unwrap());
    }

    #[test]
    fn nccl_is_taken_at_one_rank_and_refused_on_shared_gpus() {
        assert!(choose("nccl", &threads(1), 1).unwrap());
        let err = choose("nccl", &threads(2), 1).unwrap_err().to_string();
        assert!(
            err.contains("--collectives nccl") && err.contains("2 rank threads (--nproc) on 1 GPU"),
            "{err}"
        );
        assert!(!choose("host", &threads(4), 4).unwrap());
    }
}
