//! The launcher behind `zero launch`: starts this node's ranks with the torchrun environment and
//! supervises them.
//!
//! Every rank gets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE,
//! which [`crate::comm::DistEnv::detect`] reads. When a rank fails, the others are stopped
//! (SIGTERM, then SIGKILL after a grace period) and the launch reports which rank failed and how.
//! A rank that exits with status 0 while the others still run, and they do not finish soon
//! after, ended early: the others would wait for it, so they are stopped too, naming it.

mod hostfile;
mod port;
mod supervise;

pub use hostfile::{find_host, hostname, parse_hostfile, read_hostfile, Host};
pub use port::free_port;
pub use supervise::{supervise, Outcome, Termination};

use std::path::PathBuf;
use std::time::Duration;

/// Port used for several nodes when none is given (every node must agree on it).
pub const DEFAULT_MULTI_NODE_PORT: u16 = 29500;

/// What can stop a launch before or while it runs.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The options contradict each other or are incomplete.
    #[error("{0}")]
    Options(String),
    /// A hostfile line cannot be used.
    #[error("{file}{}: {message}", if *line > 0 { format!(":{line}") } else { String::new() })]
    Hostfile {
        /// The hostfile.
        file: String,
        /// 1-based line number (0: the file as a whole).
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// An operating-system call failed.
    #[error("{what}: {message}")]
    Io {
        /// What was being done.
        what: String,
        /// The system's error.
        message: String,
    },
}

/// The launch as the user asked for it (the command line).
#[derive(Clone, Debug, Default)]
pub struct LaunchOptions {
    /// Ranks on this node; with a hostfile, defaults to this node's slots.
    pub nproc_per_node: Option<usize>,
    /// Number of nodes (default 1, or the hostfile's host count).
    pub nnodes: Option<usize>,
    /// This node's index (default 0, or its place in the hostfile by host name).
    pub node_rank: Option<usize>,
    /// Rank 0's host (default 127.0.0.1, or the hostfile's first host).
    pub master_addr: Option<String>,
    /// Rank 0's rendezvous port; absent or 0 on one node: a free port is picked.
    pub master_port: Option<u16>,
    /// A DeepSpeed hostfile.
    pub hostfile: Option<PathBuf>,
    /// The program and its arguments.
    pub command: Vec<String>,
    /// Time between SIGTERM and SIGKILL when the ranks are stopped.
    pub grace: Duration,
    /// How long the other ranks may go on after one exited with status 0 before that one
    /// counts as ended early and the job is stopped; `None`: [`DEFAULT_EXIT_GRACE`].
    pub exit_grace: Option<Duration>,
}

/// How long the other ranks may run on once one rank exited with status 0, by default: far
/// longer than ranks that finished the same job take to exit after one another, far shorter
/// than the communication timeout (300 s) its peers would otherwise wait for it.
pub const DEFAULT_EXIT_GRACE: Duration = Duration::from_secs(30);

/// A resolved launch: which global ranks this node starts, and their environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchPlan {
    /// Global rank of this node's local rank 0.
    pub first_rank: usize,
    /// Ranks started on this node.
    pub local_world_size: usize,
    /// Ranks in the whole job.
    pub world_size: usize,
    /// Rank 0's host.
    pub master_addr: String,
    /// Rank 0's port.
    pub master_port: u16,
    /// The program and its arguments.
    pub command: Vec<String>,
    /// Time between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// How long the other ranks may run on once one exited with status 0 (see
    /// [`supervise`]).
    pub exit_grace: Duration,
}

/// The most ranks one launch counts (over all nodes): far past any real cluster, and a bound
/// that keeps every rank count and node offset from overflowing.
pub const MAX_WORLD: usize = 1 << 24;

/// The most processes started on one node: far more than any node's GPUs, few enough that a
/// mistyped count does not fork until the system refuses.
pub const MAX_PROCS_PER_NODE: usize = 1024;

impl LaunchPlan {
    /// Resolves the options (reading the hostfile, finding this node, picking a port).
    pub fn resolve(opts: &LaunchOptions) -> Result<Self, LaunchError> {
        if opts.command.is_empty() {
            return Err(LaunchError::Options("no program to launch (give it after `--`)".into()));
        }
        let (first_rank, local, world, nnodes, default_master) = match &opts.hostfile {
            Some(path) => {
                let hosts = read_hostfile(path)?;
                let node = match opts.node_rank {
                    Some(r) if r < hosts.len() => r,
                    Some(r) => {
                        return Err(LaunchError::Options(format!(
                            "--node-rank {r} but the hostfile lists {} hosts",
                            hosts.len()
                        )))
                    }
                    None => {
                        let me = hostname().unwrap_or_default();
                        find_host(&hosts, &me).ok_or_else(|| {
                            LaunchError::Options(format!(
                                "this host ({me:?}) is not in {}; pass --node-rank",
                                path.display()
                            ))
                        })?
                    }
                };
                if let Some(n) = opts.nnodes.filter(|&n| n != hosts.len()) {
                    return Err(LaunchError::Options(format!(
                        "--nnodes {n} but the hostfile lists {} hosts",
                        hosts.len()
                    )));
                }
                let slots = hosts[node].slots;
                if let Some(n) = opts.nproc_per_node.filter(|&n| n != slots) {
                    return Err(LaunchError::Options(format!(
                        "--nproc-per-node {n} but the hostfile gives {} slots={slots}",
                        hosts[node].name
                    )));
                }
                let world = hosts
                    .iter()
                    .try_fold(0usize, |n, h| n.checked_add(h.slots))
                    .filter(|&w| w <= MAX_WORLD)
                    .ok_or_else(|| {
                        LaunchError::Options(format!(
                            "the hostfile's slots add up to more than {MAX_WORLD} ranks, more than any launch this \
                             launcher starts"
                        ))
                    })?;
                let first: usize = hosts[..node].iter().map(|h| h.slots).sum();
                (first, slots, world, hosts.len(), hosts[0].name.clone())
            }
            None => {
                let nproc = opts
                    .nproc_per_node
                    .ok_or_else(|| LaunchError::Options("--nproc-per-node is required without a hostfile".into()))?;
                let nnodes = opts.nnodes.unwrap_or(1);
                let node = opts.node_rank.unwrap_or(0);
                if nproc == 0 || nnodes == 0 || node >= nnodes {
                    return Err(LaunchError::Options(format!(
                        "need --nproc-per-node ≥ 1, --nnodes ≥ 1 and --node-rank < --nnodes (got {nproc}, {nnodes}, {node})"
                    )));
                }
                let world = nnodes.checked_mul(nproc).filter(|&w| w <= MAX_WORLD).ok_or_else(|| {
                    LaunchError::Options(format!(
                        "--nnodes {nnodes} × --nproc-per-node {nproc}: more than {MAX_WORLD} ranks, more than any \
                         launch this launcher starts"
                    ))
                })?;
                // node < nnodes, so node × nproc < world.
                (node * nproc, nproc, world, nnodes, "127.0.0.1".to_string())
            }
        };
        if local > MAX_PROCS_PER_NODE {
            return Err(LaunchError::Options(format!(
                "{local} processes on this node: at most {MAX_PROCS_PER_NODE} are started on one node \
                 (one per GPU is the usual count)"
            )));
        }
        let master_port = match (opts.master_port, nnodes) {
            (Some(p), _) if p != 0 => p,
            (_, 1) => free_port().map_err(|e| LaunchError::Io {
                what: "picking a free port".into(),
                message: e.to_string(),
            })?,
            (None, _) => DEFAULT_MULTI_NODE_PORT,
            (Some(_), _) => {
                return Err(LaunchError::Options(
                    "--master-port 0 cannot be used with several nodes: they must agree on a port".into(),
                ))
            }
        };
        Ok(LaunchPlan {
            first_rank,
            local_world_size: local,
            world_size: world,
            master_addr: opts.master_addr.clone().unwrap_or(default_master),
            master_port,
            command: opts.command.clone(),
            grace: opts.grace,
            exit_grace: opts.exit_grace.unwrap_or(DEFAULT_EXIT_GRACE),
        })
    }

    /// The environment of local rank `local`.
    pub fn env(&self, local: usize) -> Vec<(String, String)> {
        [
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            ("RANK", (self.first_rank + local).to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_RANK", local.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world_size.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_node_defaults_and_rank_offsets() {
        let opts = LaunchOptions {
            nproc_per_node: Some(4),
            nnodes: Some(2),
            node_rank: Some(1),
            master_addr: Some("10.0.0.1".into()),
            master_port: Some(1234),
            command: vec!["prog".into()],
            ..Default::default()
        };
        let plan = LaunchPlan::resolve(&opts).unwrap();
        assert_eq!((plan.first_rank, plan.world_size, plan.local_world_size), (4, 8, 4));
        let env = plan.env(3);
        assert!(env.contains(&("RANK".into(), "7".into())));
        assert!(env.contains(&("LOCAL_RANK".into(), "3".into())));
        let single = LaunchOptions {
            nproc_per_node: Some(2),
            command: vec!["p".into()],
            ..Default::default()
        };
        let plan = LaunchPlan::resolve(&single).unwrap();
        assert_ne!(plan.master_port, 0, "a free port is picked");
        assert_eq!(plan.master_addr, "127.0.0.1");
        let no_port = LaunchOptions {
            nnodes: Some(2),
            master_port: Some(0),
            ..opts
        };
        assert!(LaunchPlan::resolve(&no_port).is_err());
    }

    #[test]
    fn a_process_count_beyond_any_node_is_refused_before_starting_any() {
        let opts = LaunchOptions {
            nproc_per_node: Some(100_000),
            command: vec!["prog".into()],
            ..Default::default()
        };
        let e = LaunchPlan::resolve(&opts).unwrap_err().to_string();
        assert!(e.contains("100000 processes") && e.contains("at most 1024"), "{e}");
    }

    #[test]
    fn hostfile_gives_slots_and_offsets() {
        let dir = std::env::temp_dir().join(format!("zero-hostfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("hostfile");
        std::fs::write(&path, "a slots=2\nb slots=3\n").unwrap();
        let opts = LaunchOptions {
            hostfile: Some(path.clone()),
            node_rank: Some(1),
            command: vec!["p".into()],
            ..Default::default()
        };
        let plan = LaunchPlan::resolve(&opts).unwrap();
        assert_eq!((plan.first_rank, plan.local_world_size, plan.world_size), (2, 3, 5));
        assert_eq!(
            (plan.master_addr.as_str(), plan.master_port),
            ("a", DEFAULT_MULTI_NODE_PORT)
        );
        let wrong = LaunchOptions {
            nproc_per_node: Some(4),
            ..opts
        };
        assert!(LaunchPlan::resolve(&wrong).unwrap_err().to_string().contains("slots=3"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
