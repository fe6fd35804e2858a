//! Streaming a computation over a swapped region through a few host buffers, with the read of
//! the next chunk and the write-back of the previous one overlapping the computation.

use super::{OffloadError, SwapFile, SwapRegion};
use std::sync::mpsc::sync_channel;
use std::time::{Duration, Instant};

/// What one [`stream_chunks`] call did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StreamStats {
    /// Chunks computed.
    pub chunks: usize,
    /// Bytes read from the file.
    pub bytes_read: u64,
    /// Bytes written to the file.
    pub bytes_written: u64,
    /// Time the reader thread spent in reads.
    pub read_time: Duration,
    /// Time the writer thread spent in writes.
    pub write_time: Duration,
    /// Time spent in the computation.
    pub compute_time: Duration,
    /// Wall time of the whole call.
    pub wall_time: Duration,
}

/// Runs `compute(c, chunk)` on every chunk `c` of `region` in order, then writes the chunk back.
///
/// `chunk` holds the chunk of each of the region's `width` buffers one after the other (split
/// it with `chunks_exact_mut(chunk.len() / width)`). At most `buffer_count` chunks are in host
/// memory at once: a reader thread fills free buffers ahead, a writer thread writes computed
/// ones back and frees them, and the calling thread computes, so with 3 or more buffers the
/// read of chunk i+1, the computation of chunk i and the write of chunk i-1 overlap.
///
/// `pool` keeps the host buffers between calls (they are allocated on first use). The call
/// stops at the first failure (read, computation or write) and returns it; chunks computed
/// before it have been written back, later ones are untouched.
pub fn stream_chunks<E: std::fmt::Display>(
    file: &SwapFile,
    region: &SwapRegion,
    buffer_count: usize,
    pool: &mut Vec<Vec<f32>>,
    mut compute: impl FnMut(usize, &mut [f32]) -> Result<(), E>,
) -> Result<StreamStats, OffloadError> {
    if buffer_count == 0 {
        return Err(OffloadError::NoBuffers);
    }
    let chunks = region.chunks();
    let mut stats = StreamStats {
        chunks,
        ..Default::default()
    };
    if chunks == 0 {
        return Ok(stats);
    }
    let start = Instant::now();
    let width = region.width;
    let in_flight = buffer_count.min(chunks);
    // Exactly `in_flight` buffers circulate, so no send on a channel of that capacity blocks.
    let (free_tx, free_rx) = sync_channel::<Vec<f32>>(in_flight);
    for _ in 0..in_flight {
        let buf = pool.pop().unwrap_or_default();
        // Capacity is fixed: the channel holds at most `in_flight` buffers.
        let _ = free_tx.send(buf);
    }
    let (filled_tx, filled_rx) = sync_channel::<Result<(usize, Vec<f32>), OffloadError>>(in_flight);
    let (done_tx, done_rx) = sync_channel::<(usize, Vec<f32>)>(in_flight);

    let outcome = std::thread::scope(|s| {
        let reader = s.spawn(move || {
            let mut busy = Duration::ZERO;
            for c in 0..chunks {
                let Ok(mut buf) = free_rx.recv() else { break };
                let n = region.chunk_range(c).len() * width;
                if buf.len() < n {
                    buf.resize(n, 0.0);
                }
                let t = Instant::now();
                let read = file.read_at(region.chunk_offset(c), &mut buf[..n]);
                busy += t.elapsed();
                let failed = read.is_err();
                if filled_tx.send(read.map(|()| (c, buf))).is_err() || failed {
                    break;
                }
            }
            (free_rx, busy)
        });
        let writer = s.spawn(move || {
            let mut busy = Duration::ZERO;
            let mut error = None;
            for (c, buf) in done_rx {
                if error.is_none() {
                    let n = region.chunk_range(c).len() * width;
                    let t = Instant::now();
                    error = file.write_at(region.chunk_offset(c), &buf[..n]).err();
                    busy += t.elapsed();
                }
                let _ = free_tx.send(buf);
            }
            (error, busy)
        });

        let mut first_error = None;
        let mut compute_time = Duration::ZERO;
        let mut computed = 0;
        for message in filled_rx.iter() {
            let (c, mut buf) = match message {
                Ok(m) => m,
                Err(e) => {
                    first_error = Some(e);
                    break;
                }
            };
            let n = region.chunk_range(c).len() * width;
            let t = Instant::now();
            let result = compute(c, &mut buf[..n]);
            compute_time += t.elapsed();
            if let Err(e) = result {
                first_error = Some(OffloadError::Compute {
                    chunk: c,
                    message: e.to_string(),
                });
                pool.push(buf);
                break;
            }
            computed += 1;
            if done_tx.send((c, buf)).is_err() {
                break;
            }
        }
        drop(done_tx);
        drop(filled_rx);
        let (write_error, write_time) = writer.join().map_err(|_| OffloadError::ThreadPanicked("writer"))?;
        let (free_rx, read_time) = reader.join().map_err(|_| OffloadError::ThreadPanicked("reader"))?;
        pool.extend(free_rx.try_iter());
        stats.read_time = read_time;
        stats.write_time = write_time;
        stats.compute_time = compute_time;
        if let Some(e) = first_error.or(write_error) {
            return Err(e);
        }
        Ok(computed)
    });
    let computed = outcome?;
    let bytes: u64 = (0..computed)
        .map(|c| region.chunk_range(c).len() as u64 * width as u64 * 4)
        .sum();
    stats.bytes_read = bytes;
    stats.bytes_written = bytes;
    stats.wall_time = start.elapsed();
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> (std::path::PathBuf, SwapFile) {
        let dir = std::env::temp_dir().join(format!("zero-stream-unit-{}-{name}", std::process::id()));
        let file = SwapFile::create(&dir, "s").expect("create");
        (dir, file)
    }

    // Reference: the same update applied to in-memory vectors.
    #[test]
    fn every_chunk_is_computed_once_and_written_back() {
        let (dir, file) = scratch("once");
        let len = 1003;
        let a: Vec<f32> = (0..len).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..len).map(|i| (i * 2) as f32).collect();
        let region = SwapRegion::new(16, len, 2, 100);
        file.write_region(&region, &[&a, &b]).expect("write");
        for buffers in [1, 2, 3, 5] {
            let mut pool = Vec::new();
            let mut seen = Vec::new();
            let stats = stream_chunks(&file, &region, buffers, &mut pool, |c, chunk| {
                seen.push(c);
                let n = chunk.len() / 2;
                let (x, y) = chunk.split_at_mut(n);
                for (xi, yi) in x.iter_mut().zip(y.iter_mut()) {
                    *xi += *yi;
                    *yi += 1.0;
                }
                Ok::<(), String>(())
            })
            .expect("stream");
            assert_eq!(seen, (0..11).collect::<Vec<_>>(), "{buffers} buffers: chunks in order");
            assert_eq!(stats.bytes_read, (len * 2 * 4) as u64);
            assert_eq!(pool.len(), buffers.min(11), "{buffers} buffers return to the pool");
        }
        let back = file.read_region(&region).expect("read");
        // Four passes: y grows by 1 each pass, x adds the current y each pass.
        for i in 0..len {
            let (x0, y0) = (a[i], b[i]);
            let want_x = x0 + 4.0 * y0 + (0.0 + 1.0 + 2.0 + 3.0);
            assert_eq!(back[0][i], want_x, "element {i}");
            assert_eq!(back[1][i], y0 + 4.0);
        }
        drop(file);
        let _ = std::fs::remove_dir(&dir);
    }

    #[test]
    fn a_failing_computation_stops_the_stream_and_says_where() {
        let (dir, file) = scratch("fail");
        let region = SwapRegion::new(0, 50, 1, 10);
        file.write_region(&region, &[&[1.0; 50]]).expect("write");
        let mut pool = Vec::new();
        let err = stream_chunks(&file, &region, 3, &mut pool, |c, chunk| {
            if c == 2 {
                return Err("bad chunk".to_string());
            }
            chunk.iter_mut().for_each(|v| *v = 2.0);
            Ok(())
        })
        .expect_err("the computation fails");
        assert!(err.to_string().contains("chunk 2: bad chunk"), "{err}");
        let back = file.read_region(&region).expect("read");
        assert!(
            back[0][..20].iter().all(|&v| v == 2.0),
            "chunks before the failure were written"
        );
        assert!(back[0][20..].iter().all(|&v| v == 1.0), "chunks after it were not");
        drop(file);
        let _ = std::fs::remove_dir(&dir);
    }
}
