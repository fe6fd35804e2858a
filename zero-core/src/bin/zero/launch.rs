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
                  exits with the failed rank's status; so they are when a rank exits with status 0 \
                  and the others do not finish within --exit-grace-secs (exit status 1). Stopping \
                  `zero launch` (SIGINT, SIGTERM, or on Linux any signal) stops its ranks."
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
    #[arg(long, default_value = "5", value_parser = seconds)]
    grace_secs: Duration,
    /// Seconds the other ranks may run on once one rank exited with status 0; past that, the
    /// rank counts as ended early (its peers would wait for it) and the job is stopped
    /// [default: 30].
    #[arg(long, value_parser = seconds)]
    exit_grace_secs: Option<Duration>,
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
        grace: args.grace_secs,
        exit_grace: args.exit_grace_secs,
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
        Ok(Outcome::RankFailed {
            rank,
            local_rank,
            how,
            after_early_exit,
        }) => {
            let cause = after_early_exit
                .map(|r| format!(" (after rank {r} had exited with status 0 while the others still ran)"))
                .unwrap_or_default();
            eprintln!(
                "zero launch: rank {rank} (local rank {local_rank}) failed with {how}{cause}; the other ranks were stopped"
            );
            ExitCode::from(how.exit_code())
        }
        Ok(Outcome::EndedEarly {
            rank,
            local_rank,
            still_running,
        }) => {
            let others: Vec<String> = still_running.iter().map(usize::to_string).collect();
            eprintln!(
                "zero launch: rank {rank} (local rank {local_rank}) ended early: it exited with status 0 while \
                 rank(s) {} still ran and had not finished {} s later (they would wait for it until their \
                 communication timeout); the other ranks were stopped. If ranks of this program finish that far \
                 apart on purpose, raise --exit-grace-secs",
                others.join(", "),
                plan.exit_grace.as_secs_f64(),
            );
            ExitCode::from(1)
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

/// A number of seconds (fractional, ≥ 0, finite, at most about 31 years) as a duration.
fn seconds(text: &str) -> Result<Duration, String> {
    zero_core::comm::env::parse_seconds(text)
}
