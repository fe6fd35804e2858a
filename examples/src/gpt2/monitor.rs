//! The config's `monitors`: `csv_monitor` and `tensorboard` write under
//! `output_path/job_name/`; `wandb` and `comet` need their services and are not written (the
//! config's parse warnings say so).
//!
//! As DeepSpeed's engine does, the scalars are tagged `Train/Samples/...` and recorded against the
//! number of samples trained so far (step × train_batch_size), not against the step.

use super::tensorboard::EventWriter;
use super::train::StepRecord;
use super::TrainError;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use zero_core::config::{FileMonitorConfig, MonitorConfig};

/// The monitors a run writes to (rank 0 only; the other ranks hold none).
pub struct Monitors {
    csv: Option<CsvMonitor>,
    tensorboard: Option<EventWriter>,
    samples_per_step: u64,
}

impl Monitors {
    /// Opens the enabled monitors; `lead` is false on every rank but 0, which writes nothing.
    pub fn open(config: &MonitorConfig, lead: bool, samples_per_step: u64) -> Result<Self, TrainError> {
        let none = Monitors {
            csv: None,
            tensorboard: None,
            samples_per_step,
        };
        if !lead {
            return Ok(none);
        }
        Ok(Monitors {
            csv: config
                .csv_monitor
                .enabled
                .then(|| CsvMonitor::new(log_dir(&config.csv_monitor))),
            tensorboard: if config.tensorboard.enabled {
                Some(EventWriter::create(&log_dir(&config.tensorboard))?)
            } else {
                None
            },
            samples_per_step,
        })
    }

    /// Whether any monitor writes.
    pub fn active(&self) -> bool {
        self.csv.is_some() || self.tensorboard.is_some()
    }

    /// Records one optimizer step.
    pub fn step(&mut self, r: &StepRecord) -> Result<(), TrainError> {
        if !self.active() {
            return Ok(());
        }
        let samples = r.step * self.samples_per_step;
        let mut values = vec![
            ("Train/Samples/train_loss", r.loss),
            ("Train/Samples/lr", r.lr),
            ("Train/Samples/loss_scale", r.loss_scale),
            ("Train/Samples/grad_norm", r.grad_norm),
        ];
        if let Some(v) = r.valid_loss {
            values.push(("Train/Samples/valid_loss", v));
        }
        if let Some(csv) = self.csv.as_mut() {
            for (tag, value) in &values {
                csv.write(tag, samples, *value)?;
            }
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            let scalars: Vec<(&str, f32)> = values.iter().map(|(t, v)| (*t, *v as f32)).collect();
            tb.scalars(samples, &scalars)?;
        }
        Ok(())
    }
}

/// `output_path/job_name` (an empty output_path is the working directory).
pub(crate) fn log_dir(c: &FileMonitorConfig) -> PathBuf {
    Path::new(&c.output_path).join(&c.job_name)
}

/// One CSV file per tag: `Train/Samples/lr` goes to `Train_Samples_lr.csv`, whose first row is
/// `step,lr` and every other row `samples,value`. Files are appended to, so a resumed run
/// continues the curves of the run it resumes.
pub struct CsvMonitor {
    dir: PathBuf,
    files: HashMap<String, std::fs::File>,
}

impl CsvMonitor {
    /// A monitor writing under `dir` (created on the first write).
    pub fn new(dir: PathBuf) -> Self {
        CsvMonitor {
            dir,
            files: HashMap::new(),
        }
    }

    /// The file `tag` is written to.
    pub fn file_of(&self, tag: &str) -> PathBuf {
        self.dir.join(format!("{}.csv", tag.replace(['/', ' '], "_")))
    }

    /// Appends `step,value` to `tag`'s file, with the header first if the file is new.
    pub fn write(&mut self, tag: &str, step: u64, value: f64) -> Result<(), TrainError> {
        let path = self.file_of(tag);
        if !self.files.contains_key(tag) {
            std::fs::create_dir_all(&self.dir).map_err(|source| io(&self.dir, source))?;
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|source| io(&path, source))?;
            let empty = file.metadata().map_err(|source| io(&path, source))?.len() == 0;
            if empty {
                let header = tag.rsplit('/').next().unwrap_or(tag);
                writeln!(file, "step,{header}").map_err(|source| io(&path, source))?;
            }
            self.files.insert(tag.to_string(), file);
        }
        if let Some(file) = self.files.get_mut(tag) {
            // Rust's shortest round-trip float formatting: the value reads back exactly.
            writeln!(file, "{step},{value}").map_err(|source| io(&path, source))?;
        }
        Ok(())
    }
}

fn io(path: &Path, source: std::io::Error) -> TrainError {
    TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_files_are_named_by_tag_and_appended_with_one_header() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut m = CsvMonitor::new(dir.path().join("job"));
        m.write("Train/Samples/lr", 8, 0.5).expect("write");
        m.write("Train/Samples/lr", 16, 0.25).expect("write");
        // A second monitor on the same directory (a resumed run) appends without a new header.
        let mut again = CsvMonitor::new(dir.path().join("job"));
        again.write("Train/Samples/lr", 24, 0.125).expect("write");
        let text = std::fs::read_to_string(dir.path().join("job/Train_Samples_lr.csv")).expect("csv written");
        assert_eq!(text, "step,lr\n8,0.5\n16,0.25\n24,0.125\n");
    }
}
