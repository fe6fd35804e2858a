//! `zero check-config` (being written; see its issue).

use std::process::ExitCode;

/// Arguments of `zero check-config`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the subcommand.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("zero check-config: not available in this build yet");
    ExitCode::from(2)
}
