//! `gpt2`: train GPT-2 with ZeRO from a DeepSpeed config; score and sample checkpoints; write a
//! randomly initialised starting checkpoint.

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use zero_examples::gpt2::{generate, init, score, train, GenerateArgs, InitArgs, ScoreArgs, TrainArgs};

#[derive(Parser)]
#[command(name = "gpt2", about = "GPT-2 with ZeRO on Burn")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train (ranks as threads with --nproc, or one rank per process under `zero launch`).
    Train(Box<TrainArgs>),
    /// Print the loss of a checkpoint on a token batch (last line: `loss <value>`).
    Score(ScoreArgs),
    /// Continue a prompt greedily.
    Generate(GenerateArgs),
    /// Write a randomly initialised HuggingFace GPT-2 directory of a preset, block by block
    /// (the starting checkpoint for sizes without public weights).
    Init(InitArgs),
}

fn main() -> ExitCode {
    let outcome = match Cli::parse().command {
        Command::Train(args) => train(&args).map(|_| None),
        Command::Score(args) => score(&args).map(|loss| Some(format!("loss {loss}"))),
        // The text is written as it is generated; the result line only ends it.
        Command::Generate(args) => generate(&args, &mut std::io::stdout()).map(|_| Some(String::new())),
        Command::Init(args) => init(&args).map(Some),
    };
    match outcome {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(result)) => print_result(&result),
        Err(e) => {
            eprintln!("gpt2: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes the result line to stdout (`println!` panics when it cannot). A reader that went away
/// (`gpt2 score ... | head -0`) had what it wanted: success; any other failure (a full disk)
/// is one line on stderr and exit status 1.
fn print_result(result: &str) -> ExitCode {
    use std::io::{ErrorKind, Write};
    match writeln!(std::io::stdout().lock(), "{result}") {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpt2: cannot write the result to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}
