//! `zero_optimization.offload_optimizer` and `offload_param`: where optimizer state and
//! parameters are offloaded, and DeepSpeed's deprecated flags for the same (`cpu_offload`, ...).

use super::error::ConfigError;
use super::reader::{Cx, Section, UnknownKeys};
use super::zero::ELEMENTS_1E9;
use serde::Serialize;
use serde_json::Value;

/// Where offloaded state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadDevice {
    /// Host memory.
    Cpu,
    /// NVMe storage (through the `aio` settings).
    Nvme,
}

/// `zero_optimization.offload_optimizer`: optimizer state, and the optimizer step, on the host.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OffloadOptimizerConfig {
    /// Where the optimizer state lives.
    pub device: OffloadDevice,
    /// Directory on the NVMe device (required for `nvme`).
    pub nvme_path: Option<String>,
    /// Page-locked host buffers (default false, as DeepSpeed).
    pub pin_memory: bool,
    /// Buffers in the NVMe swap pool (default 4).
    pub buffer_count: u64,
    /// Overlap the read of the next tile with the step of this one (NVMe; default false).
    pub pipeline_read: bool,
    /// Overlap the write of the previous tile with the step of this one (NVMe; default false).
    pub pipeline_write: bool,
    /// Fast optimizer initialisation with NVMe (default false).
    pub fast_init: bool,
    /// Fraction of the optimizer states offloaded, 0 to 1 (default 1; below 1 only at stage 3).
    pub ratio: f64,
    /// DeepSpeed's offload tuned for superchips (stage 3; default false).
    pub super_offload: bool,
    /// Fraction of CPU cores for the CPU optimizer with `super_offload` (default 0.8).
    pub cpuadam_cores_perc: f64,
    /// ZeRO-Offload's one-step delayed parameter update (default false): the host's update of
    /// step t runs beside the forward and backward of step t+1, whose gradient is then taken on
    /// weights one update older. Not a DeepSpeed key (DeepSpeed's schema refuses it).
    pub delayed_update: bool,
}

/// `zero_optimization.offload_param`: parameters on the host or NVMe (stage 3 only).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OffloadParamConfig {
    /// Where the parameters live.
    pub device: OffloadDevice,
    /// Directory on the NVMe device (required for `nvme`).
    pub nvme_path: Option<String>,
    /// Page-locked host buffers (default false, as DeepSpeed).
    pub pin_memory: bool,
    /// Buffers in the NVMe swap pool (default 5).
    pub buffer_count: u64,
    /// Elements per NVMe swap buffer (default 1e8).
    pub buffer_size: u64,
    /// Parameter elements kept in host memory with NVMe offload (default 1e9).
    pub max_in_cpu: u64,
}

fn read_device(s: &mut Section<'_>, cx: &mut Cx<'_>) -> Result<Option<OffloadDevice>, ConfigError> {
    let device: String = cx.get(s, &["device"], "none".to_string())?;
    match device.to_ascii_lowercase().as_str() {
        "none" => Ok(None),
        "cpu" => Ok(Some(OffloadDevice::Cpu)),
        "nvme" => Ok(Some(OffloadDevice::Nvme)),
        _ => Err(cx.invalid(
            &s.key("device"),
            &Value::String(device),
            "valid devices are \"cpu\", \"nvme\" and \"none\"",
        )),
    }
}

fn nvme_path(
    s: &mut Section<'_>,
    cx: &mut Cx<'_>,
    device: Option<OffloadDevice>,
) -> Result<Option<String>, ConfigError> {
    let path: Option<String> = cx.get(s, &["nvme_path"], None)?;
    if device == Some(OffloadDevice::Nvme) && path.is_none() {
        return Err(ConfigError::InvalidValue {
            source_name: cx.source.to_string(),
            key: s.key("nvme_path"),
            value: "null".into(),
            valid: "device \"nvme\" needs a directory on the NVMe device in nvme_path".into(),
        });
    }
    // The swap files go inside the path. One that does not exist yet is created by the run; one
    // that exists must be a directory, or the run would fail only when it first swaps.
    if let (Some(OffloadDevice::Nvme), Some(p)) = (device, &path) {
        if std::fs::metadata(p).is_ok_and(|m| !m.is_dir()) {
            return Err(ConfigError::InvalidValue {
                source_name: cx.source.to_string(),
                key: s.key("nvme_path"),
                value: Value::String(p.clone()).to_string(),
                valid: "it names a file, and the swap files need a directory (an existing one, or a path \
                        the run can create)"
                    .into(),
            });
        }
    }
    Ok(path)
}

pub(super) fn read_offload_optimizer(
    z: &mut Section<'_>,
    cx: &mut Cx<'_>,
) -> Result<Option<OffloadOptimizerConfig>, ConfigError> {
    let mut s = z.child("offload_optimizer", cx)?;
    let device = read_device(&mut s, cx)?;
    let nvme_path = nvme_path(&mut s, cx, device)?;
    let fraction = |cx: &mut Cx<'_>, s: &mut Section<'_>, name: &'static str, default: f64| {
        let v: f64 = cx.get(s, &[name], default)?;
        if (0.0..=1.0).contains(&v) {
            Ok(v)
        } else {
            Err(cx.invalid(&s.key(name), &Value::from(v), "it must be between 0 and 1"))
        }
    };
    let config = OffloadOptimizerConfig {
        device: device.unwrap_or(OffloadDevice::Cpu),
        nvme_path,
        pin_memory: cx.get(&mut s, &["pin_memory"], false)?,
        buffer_count: cx.get(&mut s, &["buffer_count"], 4)?,
        pipeline_read: cx.get(&mut s, &["pipeline_read"], false)?,
        pipeline_write: cx.get(&mut s, &["pipeline_write"], false)?,
        fast_init: cx.get(&mut s, &["fast_init"], false)?,
        ratio: fraction(cx, &mut s, "ratio", 1.0)?,
        super_offload: cx.get(&mut s, &["super_offload"], false)?,
        cpuadam_cores_perc: fraction(cx, &mut s, "cpuadam_cores_perc", 0.8)?,
        delayed_update: cx.get(&mut s, &["delayed_update"], false)?,
    };
    let buffer_count_key = s.key("buffer_count");
    s.finish(cx, UnknownKeys::Error)?;
    // The swap file is streamed through these buffers (zero_core::offload::stream_chunks):
    // none cannot hold a chunk, so the engine takes one.
    if device == Some(OffloadDevice::Nvme) && config.buffer_count == 0 {
        cx.warning(
            buffer_count_key,
            "0 buffers cannot hold a chunk of the swap file: it is streamed through 1 buffer instead, each chunk \
             read, stepped and written back in turn (3 or more let the read of the next chunk and the write of the \
             last overlap the step; DeepSpeed's default is 4)",
        );
    }
    Ok(device.map(|_| config))
}

pub(super) fn read_offload_param(
    z: &mut Section<'_>,
    cx: &mut Cx<'_>,
) -> Result<Option<OffloadParamConfig>, ConfigError> {
    let mut s = z.child("offload_param", cx)?;
    let device = read_device(&mut s, cx)?;
    let nvme_path = nvme_path(&mut s, cx, device)?;
    let config = OffloadParamConfig {
        device: device.unwrap_or(OffloadDevice::Cpu),
        nvme_path,
        pin_memory: cx.get(&mut s, &["pin_memory"], false)?,
        buffer_count: cx.get(&mut s, &["buffer_count"], 5)?,
        buffer_size: cx.get(&mut s, &["buffer_size"], 100_000_000)?,
        max_in_cpu: cx.get(&mut s, &["max_in_cpu"], ELEMENTS_1E9)?,
    };
    s.finish(cx, UnknownKeys::Error)?;
    Ok(device.map(|_| config))
}

/// DeepSpeed's deprecated flags: `cpu_offload` means `offload_optimizer: {device: cpu}`,
/// `cpu_offload_param` means `offload_param: {device: cpu}`, `cpu_offload_use_pin_memory` is
/// ignored. Giving a flag and the section it replaces is an error, as in DeepSpeed.
pub(super) fn legacy_offload_flags(
    s: &mut Section<'_>,
    cx: &mut Cx<'_>,
    mut optimizer: Option<OffloadOptimizerConfig>,
    mut param: Option<OffloadParamConfig>,
) -> Result<(Option<OffloadOptimizerConfig>, Option<OffloadParamConfig>), ConfigError> {
    let cpu_offload: Option<bool> = cx.get(s, &["cpu_offload"], None)?;
    let cpu_offload_param: Option<bool> = cx.get(s, &["cpu_offload_param"], None)?;
    let pin: Option<bool> = cx.get(s, &["cpu_offload_use_pin_memory"], None)?;
    let written = |s: &mut Section<'_>, cx: &Cx<'_>, name: &'static str| s.lookup(&[name], cx).map(|v| v.is_some());
    if let Some(flag) = cpu_offload {
        if written(s, cx, "offload_optimizer")? {
            return Err(conflict(cx, "cpu_offload", "offload_optimizer"));
        }
        cx.warning(
            "zero_optimization.cpu_offload",
            if flag {
                "deprecated; use offload_optimizer: {\"device\": \"cpu\"}"
            } else {
                "deprecated; false is the default (no offload): remove the key"
            },
        );
        if flag {
            optimizer = Some(cpu_optimizer_offload());
        }
    }
    if let Some(flag) = cpu_offload_param {
        if written(s, cx, "offload_param")? {
            return Err(conflict(cx, "cpu_offload_param", "offload_param"));
        }
        cx.warning(
            "zero_optimization.cpu_offload_param",
            if flag {
                "deprecated; use offload_param: {\"device\": \"cpu\"}"
            } else {
                "deprecated; false is the default (no offload): remove the key"
            },
        );
        if flag {
            param = Some(OffloadParamConfig {
                device: OffloadDevice::Cpu,
                nvme_path: None,
                pin_memory: false,
                buffer_count: 5,
                buffer_size: 100_000_000,
                max_in_cpu: ELEMENTS_1E9,
            });
        }
    }
    if pin.is_some() {
        cx.warning(
            "zero_optimization.cpu_offload_use_pin_memory",
            "deprecated and ignored; set pin_memory in offload_optimizer / offload_param",
        );
    }
    Ok((optimizer, param))
}

fn cpu_optimizer_offload() -> OffloadOptimizerConfig {
    OffloadOptimizerConfig {
        device: OffloadDevice::Cpu,
        nvme_path: None,
        pin_memory: false,
        buffer_count: 4,
        pipeline_read: false,
        pipeline_write: false,
        fast_init: false,
        ratio: 1.0,
        super_offload: false,
        cpuadam_cores_perc: 0.8,
        delayed_update: false,
    }
}

fn conflict(cx: &Cx<'_>, legacy: &str, current: &str) -> ConfigError {
    ConfigError::Conflict {
        source_name: cx.source.to_string(),
        key: format!("zero_optimization.{legacy}"),
        other: format!("zero_optimization.{current}"),
        reason: format!("{legacy} is the deprecated form of {current}; keep only {current}"),
    }
}
