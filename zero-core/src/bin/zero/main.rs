//! `zero`: the command-line tool of zero-burn (configuration check, launcher, estimates,
//! checkpoint consolidation, loss plots). Each subcommand lives in its own file; errors become one clear
//! message and a non-zero exit status.

use clap::{Parser, Subcommand};
use std::fmt::Display;
use std::io::{ErrorKind, Write};
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

/// Writes a subcommand's output (and a newline) to stdout and says how the tool ends. Every
/// subcommand's output goes through here: `println!` panics on a closed stdout.
/// - The reader went away (`zero ... | head -1`): it has what it wanted; end quietly with
///   success, as Unix tools do.
/// - Any other failure (`>/dev/full`): one line on stderr, exit status 1.
pub(crate) fn print_output(text: &str) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            print_note(format_args!("error: cannot write the output: {e}"));
            ExitCode::from(1)
        }
    }
}

/// Writes one line to stderr (a warning, a note). A stderr that cannot be written is ignored:
/// there is nowhere left to say so, and the exit status still tells.
pub(crate) fn print_note(line: impl Display) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Reports a subcommand's error: `error: MESSAGE` on stderr, exit status 2.
pub(crate) fn print_error(message: impl Display) -> ExitCode {
    print_note(format_args!("error: {message}"));
    ExitCode::from(2)
}
