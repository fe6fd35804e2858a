//! The loss plot is a chart a person can read: text (title, tick numbers, axis labels, legend)
//! and axes are drawn, not only the curves. The reference is the image itself, decoded: the
//! bare-lines plot the trainer drew before had no pixel outside the curves' colours.

use std::path::Path;
use zero_core::plot::{draw, Run, RunInfo, PLOT_SIZE};

/// A decoded RGB image.
struct Image {
    width: usize,
    height: usize,
    rgb: Vec<u8>,
}

impl Image {
    fn read(path: &Path) -> Image {
        let decoder = png::Decoder::new(std::fs::File::open(path).expect("the PNG exists"));
        let mut reader = decoder.read_info().expect("a PNG header");
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).expect("a PNG frame");
        assert_eq!(info.color_type, png::ColorType::Rgb, "plotters writes RGB");
        buf.truncate(info.buffer_size());
        Image {
            width: info.width as usize,
            height: info.height as usize,
            rgb: buf,
        }
    }

    fn pixel(&self, x: usize, y: usize) -> [u8; 3] {
        let i = 3 * (y * self.width + x);
        [self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]]
    }

    /// Dark grey to black: text, axes, ticks, the legend's frame (the curves are coloured).
    fn is_ink(&self, x: usize, y: usize) -> bool {
        let [r, g, b] = self.pixel(x, y);
        r < 110 && g < 110 && b < 110 && r.abs_diff(g) < 30 && g.abs_diff(b) < 30
    }

    fn ink_in(&self, xs: std::ops::Range<usize>, ys: std::ops::Range<usize>) -> usize {
        ys.flat_map(|y| xs.clone().map(move |x| (x, y)))
            .filter(|&(x, y)| self.is_ink(x, y))
            .count()
    }

    /// The longest run of ink on row `y`.
    fn longest_ink_row(&self, y: usize) -> usize {
        let (mut best, mut run) = (0, 0);
        for x in 0..self.width {
            run = if self.is_ink(x, y) { run + 1 } else { 0 };
            best = best.max(run);
        }
        best
    }

    /// The longest run of ink on column `x`.
    fn longest_ink_column(&self, x: usize) -> usize {
        let (mut best, mut run) = (0, 0);
        for y in 0..self.height {
            run = if self.is_ink(x, y) { run + 1 } else { 0 };
            best = best.max(run);
        }
        best
    }

    fn has_colour(&self, want: [u8; 3]) -> bool {
        self.rgb.chunks(3).any(|p| p == want)
    }
}

fn write_metrics(path: &Path, info: Option<&RunInfo>, loss_at: impl Fn(u64) -> f64, skipped: &[u64]) {
    let mut text = String::new();
    if let Some(info) = info {
        text.push_str(&info.header_line());
        text.push('\n');
    }
    for step in 1..=60u64 {
        let valid = (step % 10 == 0).then(|| loss_at(step) + 0.3);
        let line = serde_json::json!({
            "step": step,
            "loss": loss_at(step),
            "lr": 1e-3,
            "skipped": skipped.contains(&step),
            "valid_loss": valid,
        });
        text.push_str(&line.to_string());
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

fn tiny(stage: u8, precision: &str) -> RunInfo {
    RunInfo {
        model: "GPT-2 tiny".into(),
        parameters: 6_960_000,
        stage,
        world_size: 2,
        precision: precision.into(),
        layout: None,
    }
}

#[test]
fn a_run_is_drawn_with_title_axes_ticks_and_legend() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("run.jsonl");
    write_metrics(
        &metrics,
        Some(&tiny(3, "fp16")),
        |s| 10.8 - 4.0 * (s as f64 / 60.0),
        &[2, 3],
    );
    let run = Run::read(&metrics).unwrap();
    assert_eq!(run.info, Some(tiny(3, "fp16")));
    assert_eq!(run.steps.len(), 60);
    assert_eq!(run.steps.iter().filter(|s| s.skipped).count(), 2);
    assert_eq!(run.steps.iter().filter(|s| s.valid_loss.is_some()).count(), 6);

    let png = dir.path().join("run.png");
    draw(&[run], &png).unwrap();
    let image = Image::read(&png);
    assert_eq!((image.width as u32, image.height as u32), PLOT_SIZE);
    let (w, h) = (image.width, image.height);

    // The title: text in the band above the chart, centred.
    assert!(image.ink_in(w / 4..3 * w / 4, 0..40) > 300, "no title drawn");
    // The x axis: a long horizontal line of ink near the bottom, and tick numbers and the
    // "optimizer step" label below it.
    let axis_row = (h / 2..h).max_by_key(|&y| image.longest_ink_row(y)).unwrap();
    assert!(image.longest_ink_row(axis_row) > w / 2, "no x axis");
    assert!(image.ink_in(60..w, axis_row + 3..h) > 400, "no x tick numbers or label");
    // The y axis: a long vertical line near the left, numbers and "loss" to its left.
    let axis_column = (0..w / 2).max_by_key(|&x| image.longest_ink_column(x)).unwrap();
    assert!(image.longest_ink_column(axis_column) > h / 2, "no y axis");
    assert!(
        image.ink_in(0..axis_column.saturating_sub(3), 40..axis_row) > 400,
        "no y tick numbers or label"
    );
    // The legend: framed in the upper right, with the train and held-out entries in the run's
    // colour; the skipped steps are marked.
    assert!(image.ink_in(w / 2..w, 40..h / 3) > 300, "no legend text");
    assert!(image.has_colour([31, 119, 180]), "the training curve is missing");
}

#[test]
fn runs_are_overlaid_and_files_without_a_header_are_named_by_file() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("stage0.jsonl");
    let b = dir.path().join("stage3.jsonl");
    let c = dir.path().join("no-header.jsonl");
    write_metrics(&a, Some(&tiny(0, "fp32")), |s| 10.0 - s as f64 / 20.0, &[]);
    write_metrics(&b, Some(&tiny(3, "bf16")), |s| 10.0 - s as f64 / 19.0, &[]);
    write_metrics(&c, None, |s| 9.0 - s as f64 / 30.0, &[]);
    let runs: Vec<Run> = [&a, &b, &c].iter().map(|p| Run::read(p).unwrap()).collect();
    assert_eq!(runs[2].info, None);
    let png = dir.path().join("compare.png");
    draw(&runs, &png).unwrap();
    let image = Image::read(&png);
    for colour in [[31, 119, 180], [214, 39, 40], [44, 160, 44]] {
        assert!(image.has_colour(colour), "run drawn in {colour:?} is missing");
    }
}

#[test]
fn bad_metrics_files_are_errors_that_name_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"step\": 1, \"loss\": 2.0}\n{\"step\": 2, \"lo\n{\"step\": 3, \"loss\": 1.0}\n",
    )
    .unwrap();
    let err = Run::read(&path).unwrap_err().to_string();
    assert!(err.contains("bad.jsonl, line 2"), "{err}");
    // A JSON line that is not an object (serde would read `[1, 2]` as step 1, loss 2).
    std::fs::write(&path, "{\"step\": 1, \"loss\": 2.0}\n[1, 2]\n").unwrap();
    let err = Run::read(&path).unwrap_err().to_string();
    assert!(err.contains("line 2: not a step record"), "{err}");
    // The last line of a run that stopped while writing it is left out; the steps before it
    // are drawn.
    std::fs::write(&path, "{\"step\": 1, \"loss\": 2.0}\n{\"step\": 2, \"lo").unwrap();
    let run = Run::read(&path).unwrap();
    assert_eq!(run.steps.len(), 1);

    // A file that is no metrics file (no line ends) is refused after one capped line, not read
    // into memory whole.
    #[cfg(unix)]
    {
        let err = Run::read(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(err.contains("/dev/zero, line 1: longer than"), "{err}");
    }

    // A run whose every loss is NaN (written as null) has nothing to draw: say so, draw nothing.
    std::fs::write(&path, "{\"step\": 1, \"loss\": null}\n").unwrap();
    let run = Run::read(&path).unwrap();
    let png = dir.path().join("nan.png");
    let err = draw(&[run], &png).unwrap_err().to_string();
    assert!(err.contains("no optimizer step with a finite loss"), "{err}");
    assert!(!png.exists());
}

/// A run laid out over tensor (or pipeline) ranks says so in its title and legend, and its
/// header line carries the layout; a header written without one (a data-parallel run, or a
/// file from before the field) reads back without it.
#[test]
fn a_layout_beyond_data_parallel_is_named_and_older_headers_still_read() {
    let mut run = tiny(3, "bf16");
    run.world_size = 4;
    run.layout = zero_core::plot::layout_label(2, 2, 1);
    assert_eq!(run.setup(), "ZeRO stage 3, 4 ranks (2 data × 2 tensor), bf16");
    let line = run.header_line();
    assert!(line.contains("\"layout\":\"2 data × 2 tensor\""), "{line}");

    let plain = tiny(3, "bf16");
    let line = plain.header_line();
    assert!(
        !line.contains("layout"),
        "a data-parallel run's header stays as it was: {line}"
    );
    let back: serde_json::Value = serde_json::from_str(&line).unwrap();
    let read: RunInfo = serde_json::from_value(back["run"].clone()).unwrap();
    assert_eq!(read, plain);
    assert_eq!(zero_core::plot::layout_label(4, 1, 1), None);
    assert_eq!(
        zero_core::plot::layout_label(1, 2, 2).as_deref(),
        Some("1 data × 2 tensor × 2 pipeline")
    );
}

/// `zero plot` never writes its image over a metrics file it reads (one named `.png`, whose
/// default output is itself): refused with status 2, the file as it was.
#[test]
fn the_plot_never_overwrites_its_input() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("run.png");
    write_metrics(&metrics, Some(&tiny(3, "fp32")), |s| 5.0 - s as f64 * 0.1, &[]);
    let before = std::fs::read(&metrics).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_zero"))
        .args(["plot", metrics.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("overwrite its input"), "{stderr}");
    assert_eq!(std::fs::read(&metrics).unwrap(), before, "the metrics are intact");

    // A hard link to the input is the input; a file there that is not an image is kept.
    let link = dir.path().join("link.png");
    std::fs::hard_link(&metrics, &link).unwrap();
    let notes = dir.path().join("notes.png");
    std::fs::write(&notes, "not an image").unwrap();
    // An output that is a directory, or not a .png, is said to be so.
    for (out, says) in [
        (dir.path().to_path_buf(), "is a directory"),
        (dir.path().join("plot"), "ending in .png"),
        (link, "overwrite its input"),
        (notes.clone(), "not a PNG image"),
    ] {
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_zero"))
            .args(["plot", metrics.to_str().unwrap(), "-o", out.to_str().unwrap()])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(says), "{stderr}");
    }
    assert_eq!(std::fs::read(&metrics).unwrap(), before, "the metrics are intact");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "not an image");
}

/// Inputs at the edges of the numbers draw or are refused by name, never panic or spin: the
/// last step a u64 holds, losses whose range overflows a float, a compared run with nothing to
/// draw, an image in a directory that does not exist.
#[test]
fn extreme_inputs_are_drawn_or_named() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        Run::read(&path).unwrap()
    };
    let png = dir.path().join("out.png");
    let last = write(
        "last.jsonl",
        "{\"step\": 0, \"loss\": 1}\n{\"step\": 18446744073709551615, \"loss\": 2}\n",
    );
    draw(std::slice::from_ref(&last), &png).expect("the whole step range draws");
    let only = write("only.jsonl", "{\"step\": 18446744073709551615, \"loss\": 2}\n");
    draw(&[only], &png).expect("one step at the end of the range draws");
    let wide = write(
        "wide.jsonl",
        "{\"step\": 1, \"loss\": 1e308}\n{\"step\": 2, \"loss\": -1e308}\n",
    );
    let err = draw(&[wide], &png).unwrap_err().to_string();
    assert!(err.contains("wide.jsonl") && err.contains("too wide to draw"), "{err}");
    let empty = write("empty.jsonl", "");
    let err = draw(&[last.clone(), empty], &png).unwrap_err().to_string();
    assert!(err.contains("empty.jsonl: no optimizer step"), "{err}");
    let err = draw(&[last], &dir.path().join("missing").join("out.png"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing: no such directory"), "{err}");
}
