//! `gpt2`: train GPT-2 with ZeRO from a DeepSpeed config; score and sample checkpoints.

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use zero_examples::gpt2::{generate, score, train, GenerateArgs, ScoreArgs, TrainArgs};

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
}

fn main() -> ExitCode {
    let outcome = match Cli::parse().command {
        Command::Train(args) => train(&args).map(|_| ()),
        Command::Score(args) => score(&args).map(|loss| println!("loss {loss}")),
        Command::Generate(args) => generate(&args).map(|text| println!("{text}")),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpt2: {e}");
            ExitCode::FAILURE
        }
    }
}
