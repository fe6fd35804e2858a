//! `zero`: the command-line tool of zero-burn (configuration check, launcher, estimates,
//! checkpoint consolidation, loss plots). Each subcommand lives in its own file; errors become one clear
//! message and a non-zero exit status.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod check_config;
mod estimate;
mod launch;
mod plot;
mod to_fp32;

#[derive(Parser)]
#[command(name = "zero", version, about = "ZeRO training for Burn: tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Parse and validate a DeepSpeed JSON config; print it resolved, or the error (exit 2).
    CheckConfig(check_config::Args),
    /// Bytes of model states per device, host and NVMe for a stage, cluster and offload.
    Estimate(estimate::Args),
    /// Start the ranks of a distributed program (one process per rank).
    Launch(launch::Args),
    /// Write a checkpoint's fp32 weights, whole, as safetensors (streaming, any world size).
    #[command(name = "to-fp32")]
    ToFp32(to_fp32::Args),
    /// Draw a run's loss curve from its metrics file as a PNG; overlay other runs with --compare.
    Plot(plot::Args),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::CheckConfig(args) => check_config::run(args),
        Command::Estimate(args) => estimate::run(args),
        Command::Launch(args) => launch::run(args),
        Command::ToFp32(args) => to_fp32::run(args),
        Command::Plot(args) => plot::run(args),
    }
}
