//! `zero launch`: start the ranks of a distributed program on this node.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use zero_core::launch::{supervise, LaunchOptions, LaunchPlan, Outcome};

/// Arguments of `zero launch`.
#[derive(clap::Args)]
#[command(
    after_help = "Each rank gets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and \
                  LOCAL_WORLD_SIZE. If a rank fails, the others are stopped and `zero launch` \
                  exits with the failed rank's status."
)]
pub struct Args {
    /// Ranks to start on this node (default with --hostfile: this host's slots).
    #[arg(long)]
    nproc_per_node: Option<usize>,
    /// Number of nodes (default 1, or the hostfile's).
    #[arg(long)]
    nnodes: Option<usize>,
    /// This node's index (default 0, or found by host name in the hostfile).
    #[arg(long)]
    node_rank: Option<usize>,
    /// Host of rank 0 (default 127.0.0.1, or the hostfile's first host).
    #[arg(long)]
    master_addr: Option<String>,
    /// Rendezvous port of rank 0 (one node: default or 0 picks a free port; several: 29500).
    #[arg(long)]
    master_port: Option<u16>,
    /// DeepSpeed hostfile: `hostname slots=N` per line.
    #[arg(long, conflicts_with = "nnodes")]
    hostfile: Option<PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when stopping the ranks.
    #[arg(long, default_value_t = 5.0)]
    grace_secs: f64,
    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Runs the subcommand.
pub fn run(args: Args) -> ExitCode {
    let opts = LaunchOptions {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        hostfile: args.hostfile,
        command: args.command,
        grace: Duration::from_secs_f64(args.grace_secs.max(0.0)),
    };
    let plan = match LaunchPlan::resolve(&opts) {
        Ok(plan) => plan,
        Err(e) => {
            eprintln!("zero launch: {e}");
            return ExitCode::from(2);
        }
    };
    match supervise(&plan) {
        Ok(Outcome::Success) => ExitCode::SUCCESS,
        Ok(Outcome::RankFailed { rank, local_rank, how }) => {
            eprintln!(
                "zero launch: rank {rank} (local rank {local_rank}) failed with {how}; the other ranks were stopped"
            );
            ExitCode::from(how.exit_code())
        }
        Ok(Outcome::Interrupted(sig)) => {
            eprintln!("zero launch: interrupted by signal {sig}; the ranks were stopped");
            ExitCode::from(u8::try_from(128 + sig).unwrap_or(255))
        }
        Err(e) => {
            eprintln!("zero launch: {e}");
            ExitCode::from(1)
        }
    }
}
