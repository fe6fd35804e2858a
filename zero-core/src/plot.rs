//! Loss curves: a training run's metrics file drawn as a PNG that a person can read, with axes,
//! ticks, labels, a legend and a title, and several runs overlaid on the same axes for the
//! comparisons users make most (stage 0 against stage 3, fp32 against bf16).
//!
//! A metrics file is JSON lines: an optional first line `{"run": {...}}` ([`RunInfo`]) and one
//! line per optimizer step with at least `step` and `loss` (and `valid_loss`, `skipped` when
//! the run has them). The GPT-2 trainer writes it with `--metrics`; `zero plot` redraws it.
//!
//! Text is drawn with DejaVu Sans, compiled into the binary: the plot looks the same on a
//! machine without system fonts (a CI runner, a GPU node's minimal image), where a font looked
//! up at run time would leave the axes without numbers.

use plotters::prelude::*;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};
use std::sync::Once;

/// The longest metrics line read (a step line is a few hundred bytes).
const MAX_LINE: usize = 1 << 20;

/// The plot's width and height in pixels.
pub const PLOT_SIZE: (u32, u32) = (1000, 600);

/// Why a metrics file could not be read or drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The file could not be read or the image not written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A line is not a step record.
    #[error("{}, line {line}: {detail}", path.display())]
    Parse {
        /// The metrics file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        detail: String,
    },
    /// Nothing to draw.
    #[error("{}: no optimizer step with a finite loss to draw", path.display())]
    Empty {
        /// The metrics file (the first one, for several).
        path: PathBuf,
    },
    /// The losses span more than a float can: nothing sensible to draw.
    #[error("{}: the losses run from {lo:e} to {hi:e}, a range too wide to draw", path.display())]
    Range {
        /// The metrics file (the first one, for several).
        path: PathBuf,
        /// The lowest finite loss.
        lo: f64,
        /// The highest.
        hi: f64,
    },
    /// The drawing library failed.
    #[error("{}: drawing the loss curve failed: {detail}", path.display())]
    Draw {
        /// The image being drawn.
        path: PathBuf,
        /// The library's message.
        detail: String,
    },
}

/// What a metrics file's header line says about the run, for the title and the legend.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// The model, as a person names it (`GPT-2 tiny`).
    pub model: String,
    /// Number of trained parameters.
    pub parameters: u64,
    /// ZeRO stage.
    pub stage: u8,
    /// Number of ranks.
    pub world_size: usize,
    /// Compute precision: `fp32`, `bf16` or `fp16`.
    pub precision: String,
    /// How the ranks are laid out when more than data-parallel (`2 data × 2 tensor`); left out
    /// of the file otherwise, so older files read as they were written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
}

/// `2 data × 2 tensor × 2 pipeline`: the layout of `data` × `tensor` × `pipeline` ranks, `None`
/// when every rank is a data-parallel one.
pub fn layout_label(data: usize, tensor: usize, pipeline: usize) -> Option<String> {
    if tensor <= 1 && pipeline <= 1 {
        return None;
    }
    let mut parts = vec![format!("{data} data")];
    parts.extend((tensor > 1).then(|| format!("{tensor} tensor")));
    parts.extend((pipeline > 1).then(|| format!("{pipeline} pipeline")));
    Some(parts.join(" × "))
}

impl RunInfo {
    /// The header line of a metrics file (without the newline).
    pub fn header_line(&self) -> String {
        serde_json::json!({ "run": self }).to_string()
    }

    /// `GPT-2 tiny, 6.96M parameters, ZeRO stage 3, 2 ranks, fp32`.
    pub fn describe(&self) -> String {
        format!("{}, {}, {}", self.model, count(self.parameters), self.setup())
    }

    /// `ZeRO stage 3, 2 ranks, fp32` (`4 ranks (2 data × 2 tensor)` with a layout): what tells
    /// runs of one model apart.
    pub fn setup(&self) -> String {
        let ranks = if self.world_size == 1 { "rank" } else { "ranks" };
        let layout = self.layout.as_ref().map(|l| format!(" ({l})")).unwrap_or_default();
        format!(
            "ZeRO stage {}, {} {ranks}{layout}, {}",
            self.stage, self.world_size, self.precision
        )
    }
}

/// How many ticks the step axis from `lo` to `hi` asks for: at most one per step (a short run's
/// ticks would otherwise fall between steps and print the same rounded step twice), at most 10.
fn step_ticks(lo: u64, hi: u64) -> usize {
    (hi.max(lo.saturating_add(1)) - lo).saturating_add(1).min(10) as usize
}

/// At most 60 characters of `text`, for quoting a line in an error.
fn clip(text: &str) -> String {
    match text.char_indices().nth(60) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_string(),
    }
}

/// A step axis tick's label: the step, or nothing for a position between two steps; from ten
/// million on, in exponent form (`1.84e19`), so that ten labels fit side by side.
fn step_label(x: &f64) -> String {
    if (x - x.round()).abs() >= 1e-6 {
        String::new()
    } else if x.abs() >= 1e7 {
        format!("{x:.2e}")
    } else {
        format!("{x:.0}")
    }
}

/// `6.96M parameters`, `1.56B parameters`.
fn count(parameters: u64) -> String {
    let p = parameters as f64;
    match p {
        p if p >= 1e9 => format!("{:.2}B parameters", p / 1e9),
        p if p >= 1e6 => format!("{:.2}M parameters", p / 1e6),
        p if p >= 1e3 => format!("{:.1}K parameters", p / 1e3),
        _ => format!("{parameters} parameters"),
    }
}

/// One optimizer step, as far as a plot needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct StepPoint {
    /// 1-based optimizer step.
    pub step: u64,
    /// Training loss (not finite: not drawn).
    pub loss: f64,
    /// Held-out loss, where measured.
    pub valid_loss: Option<f64>,
    /// Skipped by the fp16 loss scaler (overflow).
    pub skipped: bool,
}

/// The fields of a step line a plot reads; a non-finite loss is written as `null` by JSON.
#[derive(Deserialize)]
struct StepLine {
    step: u64,
    loss: Option<f64>,
    #[serde(default)]
    valid_loss: Option<f64>,
    #[serde(default)]
    skipped: bool,
}

/// One run: its steps and, when the file has a header, what the run was.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    /// The file the run was read from (the legend's fallback name).
    pub path: PathBuf,
    /// The header line, if the file has one.
    pub info: Option<RunInfo>,
    /// Every step, in file order.
    pub steps: Vec<StepPoint>,
}

impl Run {
    /// Reads a metrics file.
    pub fn read(path: &Path) -> Result<Run, PlotError> {
        let io = |source| PlotError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = crate::files::open(path).map_err(io)?;
        let mut reader = std::io::BufReader::new(file);
        let mut run = Run {
            path: path.to_path_buf(),
            info: None,
            steps: Vec::new(),
        };
        let mut bytes = Vec::new();
        for number in 1.. {
            let bad = |detail: String| PlotError::Parse {
                path: path.to_path_buf(),
                line: number,
                detail,
            };
            bytes.clear();
            // A step line is a few hundred bytes; reading at most MAX_LINE keeps a file that is
            // no metrics file at all (a device, a binary) from growing memory without bound.
            let read = (&mut reader)
                .take(MAX_LINE as u64 + 1)
                .read_until(b'\n', &mut bytes)
                .map_err(io)?;
            if read == 0 {
                break;
            }
            if bytes.len() > MAX_LINE {
                return Err(bad(format!("longer than {} KiB: not a metrics line", MAX_LINE / 1024)));
            }
            let line = std::str::from_utf8(&bytes).map_err(|e| bad(format!("not UTF-8 text: {e}")))?;
            if line.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = match serde_json::from_str(line) {
                Ok(v) => v,
                // The last line of a run that stopped while writing it: the steps before it
                // are still the run's.
                Err(_) if !bytes.ends_with(b"\n") && !run.steps.is_empty() => break,
                Err(e) => return Err(bad(format!("not a JSON line: {e}"))),
            };
            if !value.is_object() {
                return Err(bad(format!(
                    "not a step record: a JSON object with `step` and `loss` is expected, found {}",
                    clip(&value.to_string())
                )));
            }
            if let Some(header) = value.get("run") {
                let info = serde_json::from_value(header.clone())
                    .map_err(|e| bad(format!("the run header is not readable: {e}")))?;
                run.info = Some(info);
                continue;
            }
            let s: StepLine = serde_json::from_value(value)
                .map_err(|e| bad(format!("not a step record (`step` and `loss` expected): {e}")))?;
            run.steps.push(StepPoint {
                step: s.step,
                loss: s.loss.unwrap_or(f64::NAN),
                valid_loss: s.valid_loss,
                skipped: s.skipped,
            });
        }
        Ok(run)
    }

    /// The run's name in a legend that shows several runs.
    fn label(&self) -> String {
        match &self.info {
            Some(info) => info.setup(),
            None => self
                .path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| self.path.display().to_string()),
        }
    }
}

/// The plot's title: the run itself for one, what the runs share for several.
fn title(runs: &[Run]) -> String {
    match runs {
        [run] => match &run.info {
            Some(info) => format!("Training loss: {}", info.describe()),
            None => format!("Training loss: {}", run.label()),
        },
        _ => {
            let models: Vec<String> = runs
                .iter()
                .filter_map(|r| r.info.as_ref().map(|i| format!("{}, {}", i.model, count(i.parameters))))
                .collect();
            match models.first() {
                Some(first) if models.len() == runs.len() && models.iter().all(|m| m == first) => {
                    format!("Training loss: {first}, {} runs", runs.len())
                }
                _ => format!("Training loss, {} runs", runs.len()),
            }
        }
    }
}

fn register_fonts() {
    static FONTS: Once = Once::new();
    FONTS.call_once(|| {
        // Both are valid TrueType files compiled in; a failure here would be a broken build of
        // the font crate, and the plot then only lacks its text.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
        let _ = plotters::style::register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold());
    });
}

/// One colour per run; the train and held-out curves of a run share it.
const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Whether `path` reads as a metrics file by its first line: a run's header (`{"run": ...}`)
/// or a step record (`step` and `loss`: what files written before headers begin with). An empty
/// file is one too. What may be replaced by a run's metrics without losing anything else.
pub fn is_metrics_file(path: &Path) -> bool {
    let Ok(file) = crate::files::open(path) else {
        return false;
    };
    let mut line = Vec::new();
    if std::io::BufReader::new(file)
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', &mut line)
        .is_err()
    {
        return false;
    }
    if line.iter().all(u8::is_ascii_whitespace) {
        return true;
    }
    serde_json::from_slice::<serde_json::Value>(&line).is_ok_and(|v| {
        v.get("run").is_some() || (v.get("step").is_some_and(serde_json::Value::is_u64) && v.get("loss").is_some())
    })
}

/// Refuses to draw over `out` when it is there and is not a PNG image (a plot drawn before is
/// replaced; any other file is kept): the reason, for an error or a note.
pub fn may_replace(out: &Path) -> Result<(), String> {
    if out.is_dir() {
        return Err(format!("{} is a directory", out.display()));
    }
    let Ok(mut file) = crate::files::open(out) else {
        // Not there (or not readable, which the write will say).
        return Ok(());
    };
    let mut magic = [0u8; 8];
    let png = std::io::Read::read_exact(&mut file, &mut magic).is_ok() && magic == *b"\x89PNG\r\n\x1a\n";
    if png || out.metadata().is_ok_and(|m| m.is_file() && m.len() == 0) {
        Ok(())
    } else {
        Err(format!(
            "{} is there and is not a PNG image; the plot does not replace it",
            out.display()
        ))
    }
}

/// Draws `runs` on one pair of axes into the PNG `out`: per run the training loss (a line),
/// the held-out loss (a lighter line with dots) and the steps the fp16 scaler skipped (crosses).
pub fn draw(runs: &[Run], out: &Path) -> Result<(), PlotError> {
    let first = runs.first().map(|r| r.path.clone()).unwrap_or_default();
    let finite = |v: f64| v.is_finite();
    let points = runs.iter().flat_map(|r| {
        r.steps.iter().flat_map(|s| {
            [Some(s.loss), s.valid_loss]
                .into_iter()
                .flatten()
                .map(move |l| (s.step, l))
        })
    });
    let (mut x_lo, mut x_hi, mut y_lo, mut y_hi) = (u64::MAX, 0u64, f64::MAX, f64::MIN);
    for (step, loss) in points.filter(|p| finite(p.1)) {
        x_lo = x_lo.min(step);
        x_hi = x_hi.max(step);
        y_lo = y_lo.min(loss);
        y_hi = y_hi.max(loss);
    }
    if x_lo > x_hi {
        return Err(PlotError::Empty { path: first });
    }
    // A run given to be compared that has nothing to draw is named, not left out.
    if let Some(empty) = runs.iter().find(|r| {
        !r.steps
            .iter()
            .any(|s| finite(s.loss) || s.valid_loss.is_some_and(finite))
    }) {
        return Err(PlotError::Empty {
            path: empty.path.clone(),
        });
    }
    if !(y_hi - y_lo).is_finite() {
        return Err(PlotError::Range {
            path: first,
            lo: y_lo,
            hi: y_hi,
        });
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty() && !d.is_dir()) {
        return Err(PlotError::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory for the image"),
        });
    }
    register_fonts();
    let x_range = x_lo as f64..(x_hi.max(x_lo.saturating_add(1))) as f64;
    let pad = ((y_hi - y_lo) * 0.05).max(1e-3);
    let y_range = (y_lo - pad)..(y_hi + pad);

    let failed = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: out.to_path_buf(),
        detail: e.to_string(),
    };
    // The image's file first, so that a place it cannot be written is the system's plain
    // sentence, not the drawing library's nested one.
    std::fs::File::create(out).map_err(|source| PlotError::Io {
        path: out.to_path_buf(),
        source,
    })?;
    let root = BitMapBackend::new(out, PLOT_SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| failed(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title(runs), ("sans-serif", 22).into_font().style(FontStyle::Bold))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(x_range, y_range)
        .map_err(|e| failed(&e))?;
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .y_desc("loss")
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .light_line_style(RGBColor(235, 235, 235))
        .x_labels(step_ticks(x_lo, x_hi))
        .x_label_formatter(&step_label)
        .y_label_formatter(&|y| format!("{y:.2}"))
        .draw()
        .map_err(|e| failed(&e))?;

    let several = runs.len() > 1;
    for (i, run) in runs.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let name = |what: &str| {
            if several {
                format!("{what}: {}", run.label())
            } else {
                what.to_string()
            }
        };
        let train: Vec<(f64, f64)> = run
            .steps
            .iter()
            .filter(|s| finite(s.loss))
            .map(|s| (s.step as f64, s.loss))
            .collect();
        chart
            .draw_series(LineSeries::new(train, colour.stroke_width(2)))
            .map_err(|e| failed(&e))?
            .label(name("train"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], colour.stroke_width(2)));

        let valid: Vec<(f64, f64)> = run
            .steps
            .iter()
            .filter_map(|s| s.valid_loss.filter(|v| finite(*v)).map(|v| (s.step as f64, v)))
            .collect();
        if !valid.is_empty() {
            let light = colour.mix(0.55);
            chart
                .draw_series(LineSeries::new(valid.clone(), light.stroke_width(2)))
                .map_err(|e| failed(&e))?
                .label(name("held-out"))
                .legend(move |(x, y)| {
                    EmptyElement::at((x, y))
                        + PathElement::new(vec![(0, 0), (24, 0)], light.stroke_width(2))
                        + Circle::new((12, 0), 4, light.filled())
                });
            chart
                .draw_series(valid.into_iter().map(|p| Circle::new(p, 4, light.filled())))
                .map_err(|e| failed(&e))?;
        }

        let skipped: Vec<(f64, f64)> = run
            .steps
            .iter()
            .filter(|s| s.skipped && finite(s.loss))
            .map(|s| (s.step as f64, s.loss))
            .collect();
        if !skipped.is_empty() {
            chart
                .draw_series(skipped.into_iter().map(|p| Cross::new(p, 6, BLACK.stroke_width(2))))
                .map_err(|e| failed(&e))?
                .label(name("skipped step (fp16 overflow)"))
                .legend(|(x, y)| Cross::new((x + 12, y), 6, BLACK.stroke_width(2)));
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(|e| failed(&e))?;
    root.present().map_err(|e| failed(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 4-step run once printed its step ticks as 1 2 2 2 3 4 4: ticks between steps, rounded.
    #[test]
    fn step_ticks_fall_on_whole_steps() {
        assert_eq!(step_ticks(1, 4), 4);
        assert_eq!(step_label(&1200.0), "1200");
        assert_eq!(step_label(&1.5), "");
        assert_eq!(step_label(&(u64::MAX as f64)), "1.84e19");
        assert_eq!(step_ticks(1, 1), 2);
        assert_eq!(step_ticks(1, 120), 10);
        assert_eq!(step_label(&2.0), "2");
        assert_eq!(step_label(&2.5), "");
        assert_eq!(step_label(&119.9999999), "120");
    }
}
