//! TensorBoard event files, written without TensorFlow: the tfrecord framing around hand-encoded
//! `Event` protobufs holding scalar summaries.
//!
//! A record is `u64 length (LE) | masked CRC32C of those 8 bytes (u32 LE) | data | masked
//! CRC32C of the data (u32 LE)`. The first event carries `file_version = "brain.Event:2"`, the
//! others one `Summary` of `{tag, simple_value}` scalars at a step.

use super::TrainError;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Writes scalars into one `events.out.tfevents.*` file.
pub struct EventWriter {
    file: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates a new event file in `dir` (made if missing) and writes the version record.
    pub fn create(dir: &Path) -> Result<Self, TrainError> {
        std::fs::create_dir_all(dir).map_err(|source| io(dir, source))?;
        let now = wall_time();
        // TensorBoard reads every file matching `*tfevents*`; host and pid keep two runs
        // started in the same second apart.
        let name = format!(
            "events.out.tfevents.{}.{}.{}.0",
            now as u64,
            host_name(),
            std::process::id()
        );
        let path = dir.join(name);
        let file = std::fs::File::create(&path).map_err(|source| io(&path, source))?;
        let mut writer = EventWriter {
            file: std::io::BufWriter::new(file),
            path,
        };
        let mut event = Vec::new();
        put_double(&mut event, 1, now);
        put_bytes(&mut event, 3, b"brain.Event:2");
        writer.record(&event)?;
        Ok(writer)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one event holding every `(tag, value)` scalar at `step`, and flushes it so that a
    /// running TensorBoard sees it.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f32)]) -> Result<(), TrainError> {
        let mut summary = Vec::new();
        for (tag, value) in values {
            let mut v = Vec::new();
            put_bytes(&mut v, 1, tag.as_bytes());
            put_key(&mut v, 2, WIRE_FIXED32);
            v.extend_from_slice(&value.to_le_bytes());
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_key(&mut event, 2, WIRE_VARINT);
        put_varint(&mut event, step);
        put_bytes(&mut event, 5, &summary);
        self.record(&event)
    }

    /// Frames `data` as one tfrecord.
    fn record(&mut self, data: &[u8]) -> Result<(), TrainError> {
        let len = (data.len() as u64).to_le_bytes();
        let mut out = Vec::with_capacity(data.len() + 16);
        out.extend_from_slice(&len);
        out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        out.extend_from_slice(data);
        out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
        self.file
            .write_all(&out)
            .and_then(|_| self.file.flush())
            .map_err(|source| io(&self.path, source))
    }
}

const WIRE_VARINT: u8 = 0;
const WIRE_FIXED64: u8 = 1;
const WIRE_LEN: u8 = 2;
const WIRE_FIXED32: u8 = 5;

fn put_key(out: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(out, ((field as u64) << 3) | wire as u64);
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_double(out: &mut Vec<u8>, field: u32, v: f64) {
    put_key(out, field, WIRE_FIXED64);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, WIRE_LEN);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// CRC32C (Castagnoli), reflected polynomial 0x82F63B78, one byte at a time from a table.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { (c >> 1) ^ 0x82F6_3B78 } else { c >> 1 };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ b as u32) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// The tfrecord mask: a rotation and an offset, so that a CRC of data holding CRCs stays strong.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xA282_EAD8)
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The machine's name for the file name; letters, digits, `-` and `.` only.
fn host_name() -> String {
    let raw = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.')
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
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
    fn crc32c_matches_the_published_check_values() {
        // RFC 3720 (iSCSI) B.4 and the CRC catalogue's check value for "123456789".
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
    }

    #[test]
    fn varints_encode_as_protobuf_does() {
        // Protobuf's encoding guide: 1 is 0x01, 150 is 0x96 0x01, 300 is 0xAC 0x02.
        for (v, want) in [(1u64, vec![0x01u8]), (150, vec![0x96, 0x01]), (300, vec![0xAC, 0x02])] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(out, want, "{v}");
        }
    }
}
