//! What a run shows and leaves behind: the progress bar, the metrics file (one JSON line per
//! step), the summary and the loss curve.

use super::train::{StepRecord, TrainSummary};
use super::TrainError;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::Write;
use std::path::{Path, PathBuf};
use zero_core::plot::{draw, Run, RunInfo};

/// The progress bar (rank 0 only).
pub struct Progress {
    bar: Option<ProgressBar>,
    header: String,
    lead: bool,
}

impl Progress {
    /// A bar over `steps` optimizer steps when `show` is set; `lead` prints the summary. The
    /// header names the ranks by `layout`: (data, tensor, pipeline) degrees, and `through`, the
    /// device collectives when the ranks' collectives do not go through host memory (NCCL).
    /// `backend` (`--backend`) says what the first step is waiting for.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        lead: bool,
        show: bool,
        backend: &str,
        steps: u64,
        parameters: usize,
        layout: [usize; 3],
        stage: u8,
        through: Option<&str>,
    ) -> Self {
        let [data, tensor, pipeline] = layout;
        let world = data * tensor * pipeline;
        let mut ranks = format!("{world} rank{}", if world == 1 { "" } else { "s" });
        if let Some(label) = zero_core::plot::layout_label(data, tensor, pipeline) {
            ranks.push_str(&format!(" ({label})"));
        }
        if let Some(collective) = through {
            ranks.push_str(&format!(", collectives through {collective}"));
        }
        let header = format!(
            "GPT-2 {:.2}M parameters, ZeRO stage {stage}, {ranks}",
            parameters as f64 / 1e6
        );
        let bar = (lead && show).then(|| {
            let bar = ProgressBar::new(steps);
            bar.set_style(
                ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            bar.set_prefix("train");
            bar.println(&header);
            // Redrawn while a step runs, so that a long first step shows its time passing.
            bar.enable_steady_tick(std::time::Duration::from_millis(500));
            bar.set_message(match backend {
                "cuda" => "first step: the GPU kernels compile at their first use",
                _ => "first step",
            });
            bar
        });
        Progress { bar, header, lead }
    }

    /// Shows one finished step.
    pub fn step(&mut self, r: &StepRecord) {
        if let Some(bar) = &self.bar {
            let memory: usize = r.memory.first().map(|m| m.total_current()).unwrap_or(0);
            bar.set_message(format!(
                "loss {:.4} lr {:.2e} scale {} {:.0} tok/s mem {:.1} MB{}",
                r.loss,
                r.lr,
                r.loss_scale,
                r.tokens_per_s,
                memory as f64 / 1e6,
                r.valid_loss.map(|v| format!(" valid {v:.4}")).unwrap_or_default()
            ));
            bar.inc(1);
        }
    }

    /// Prints a line above the bar (or plainly without one, or when the bar is hidden because
    /// the output is not a terminal: a hidden bar prints nothing); rank 0 only.
    pub fn println(&self, line: &str) {
        match (&self.bar, self.lead) {
            (Some(bar), _) if !bar.is_hidden() => bar.println(line),
            (_, true) => say(line),
            (_, false) => {}
        }
    }

    /// Ends the bar and prints the summary (rank 0 only, bar or not).
    pub fn finish(&mut self, s: &TrainSummary) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        let (Some(first), Some(last)) = (s.steps.first(), s.steps.last()) else {
            return;
        };
        if !self.lead {
            return;
        }
        let tokens_per_s = s.steps.iter().map(|r| r.tokens_per_s).sum::<f64>() / s.steps.len() as f64;
        say(&self.header);
        let skipped = s.steps.iter().filter(|r| r.skipped).count();
        say(format_args!(
            "{} step{} in {:.1} s{}: loss {:.4} -> {:.4}{}, {:.0} tokens/s",
            s.steps.len(),
            if s.steps.len() == 1 { "" } else { "s" },
            s.seconds,
            match skipped {
                0 => String::new(),
                n => format!(" ({n} skipped on fp16 overflow, the loss scale backed off)"),
            },
            first.loss,
            last.loss,
            last.valid_loss
                .map(|v| format!(" (held-out {v:.4})"))
                .unwrap_or_default(),
            tokens_per_s
        ));
        if let Some(m) = last.memory.first() {
            say(format_args!(
                "rank 0 holds {:.1} MB in memory: parameters {:.1}, gradients {:.1}, master weights {:.1}, optimizer state {:.1}, gathered peak {:.1}",
                m.total_current() as f64 / 1e6,
                m.parameters.current as f64 / 1e6,
                m.gradients.current as f64 / 1e6,
                m.master_weights.current as f64 / 1e6,
                m.optimizer_state.current as f64 / 1e6,
                m.gathered.peak as f64 / 1e6
            ));
            let l = &m.locations;
            let kinds = [
                ("parameters", l.parameters),
                ("gradients", l.gradients),
                ("master weights", l.master_weights),
                ("optimizer state", l.optimizer_state),
                ("gathered", l.gathered),
            ];
            // Offload: say which of it is host memory, and what sits in the swap files (on
            // disk, not counted above); a place or kind that holds nothing is left out.
            let place = |name: &str, bytes: &dyn Fn(&zero_burn::Locations) -> usize| {
                let total: usize = kinds.iter().map(|(_, k)| bytes(k)).sum();
                let parts: Vec<String> = kinds
                    .iter()
                    .filter(|(_, k)| bytes(k) > 0)
                    .map(|(kind, k)| format!("{kind} {:.1}", bytes(k) as f64 / 1e6))
                    .collect();
                (total > 0).then(|| format!("{name} {:.1} MB ({})", total as f64 / 1e6, parts.join(", ")))
            };
            let places: Vec<String> = [place("in host memory", &|k| k.host), place("on NVMe", &|k| k.nvme)]
                .into_iter()
                .flatten()
                .collect();
            if !places.is_empty() {
                say(format_args!("  of which {}", places.join("; ")));
            }
        }
    }
}

/// Prints one line on stdout. A stdout that cannot be written (a reader that went away, as in
/// `gpt2 train | head -1`) is ignored: the run's work (checkpoints, metrics) is done or goes
/// on, and only what it would have shown is lost; `println!` would panic instead.
pub fn say(line: impl std::fmt::Display) {
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

/// One JSON line per step.
pub struct MetricsWriter {
    file: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
}

impl MetricsWriter {
    /// Opens the file for a run that starts after optimizer step `first_step` and writes its
    /// header line, what `zero plot` titles the curve with. A fresh run (`first_step` 0)
    /// creates (truncates) it; a resumed run keeps the steps up to the checkpoint it resumed
    /// from (a run that went past it before it stopped wrote later ones, which this run
    /// writes again), so that the file and its curve hold the whole run.
    pub fn create(path: &Path, run: &RunInfo, first_step: u64) -> Result<Self, TrainError> {
        let kept: Vec<String> = if first_step == 0 {
            Vec::new()
        } else {
            zero_core::files::read_to_string(path, zero_core::files::data_limit(path))
                .unwrap_or_default()
                .lines()
                .filter(|line| {
                    serde_json::from_str::<serde_json::Value>(line)
                        .ok()
                        .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64))
                        .is_some_and(|step| step <= first_step)
                })
                .map(str::to_string)
                .collect()
        };
        let file = std::fs::File::create(path)
            .map_err(|e| TrainError::Config(format!("--metrics {}: cannot create the file: {e}", path.display())))?;
        let mut file = std::io::BufWriter::new(file);
        writeln!(file, "{}", run.header_line()).map_err(|source| io(path, source))?;
        for line in kept {
            writeln!(file, "{line}").map_err(|source| io(path, source))?;
        }
        file.flush().map_err(|source| io(path, source))?;
        Ok(MetricsWriter {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Appends one step.
    pub fn write(&mut self, record: &StepRecord) -> Result<(), TrainError> {
        let line = serde_json::to_string(record).map_err(|e| io(&self.path, std::io::Error::other(e)))?;
        writeln!(self.file, "{line}")
            .and_then(|_| self.file.flush())
            .map_err(|source| io(&self.path, source))
    }

    /// Flushes and closes.
    pub fn finish(mut self) -> Result<(), TrainError> {
        self.file.flush().map_err(|source| io(&self.path, source))
    }
}

fn io(path: &Path, source: std::io::Error) -> TrainError {
    TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Draws the metrics file's loss curve into `METRICS.png` beside it, as `zero plot` does. A
/// file there that is not a PNG image is kept, and said so (the curve is a convenience).
pub fn write_loss_curve(metrics: &Path) -> Result<(), TrainError> {
    let out = metrics.with_extension("png");
    if let Err(why) = zero_core::plot::may_replace(&out) {
        eprintln!(
            "note: the loss curve is not drawn: {why} (`zero plot {} -o OUT` draws it)",
            metrics.display()
        );
        return Ok(());
    }
    let drawn = Run::read(metrics).and_then(|run| draw(&[run], &out));
    drawn.map_err(|e| io(&out, std::io::Error::other(e.to_string())))
}
