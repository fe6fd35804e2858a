//! `zero plot`: draws a run's loss curve from its metrics file, and overlays other runs on the
//! same axes (stage 0 against stage 3, fp32 against bf16).

use std::path::PathBuf;
use std::process::ExitCode;
use zero_core::plot::{draw, Run};

/// Arguments of `zero plot`.
#[derive(clap::Args)]
pub struct Args {
    /// The metrics file a run wrote (`gpt2 train --metrics FILE`: one JSON line per step).
    pub metrics: PathBuf,
    /// Other runs' metrics files, drawn on the same axes; repeatable.
    #[arg(long = "compare", value_name = "OTHER")]
    pub compare: Vec<PathBuf>,
    /// The PNG to write (default: the metrics file with the extension `.png`).
    #[arg(long, short)]
    pub out: Option<PathBuf>,
}

/// Runs the subcommand: the PNG's path on stdout, or the error on stderr with exit status 2.
pub fn run(args: Args) -> ExitCode {
    let out = args.out.clone().unwrap_or_else(|| args.metrics.with_extension("png"));
    if out.is_dir() {
        return crate::print_error(format!(
            "{} is a directory: give a .png file's path with -o",
            out.display()
        ));
    }
    if !out.extension().is_some_and(|e| e.eq_ignore_ascii_case("png")) {
        return crate::print_error(format!(
            "{}: the plot is a PNG image; give a path ending in .png",
            out.display()
        ));
    }
    // The image never replaces a metrics file it reads (by any name or link), nor any other
    // file that is not an image.
    let same = |a: &PathBuf| a == &out || zero_core::files::same_file(a, &out);
    if let Some(input) = std::iter::once(&args.metrics).chain(&args.compare).find(|p| same(p)) {
        return crate::print_error(format!(
            "the plot would overwrite its input {}: give another output with -o",
            input.display()
        ));
    }
    if let Err(why) = zero_core::plot::may_replace(&out) {
        return crate::print_error(format!("{why}: give another output with -o"));
    }
    let drawn = std::iter::once(&args.metrics)
        .chain(&args.compare)
        .map(|path| Run::read(path))
        .collect::<Result<Vec<_>, _>>()
        .and_then(|runs| draw(&runs, &out));
    match drawn {
        Ok(()) => crate::print_output(&format!("wrote {}", out.display())),
        Err(e) => crate::print_error(e),
    }
}
