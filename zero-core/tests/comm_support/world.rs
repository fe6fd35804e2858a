//! Ranks as processes: the test binary re-executes itself once per rank (its `rank_main` test,
//! ignored in an ordinary run and selected with `--ignored --exact`), with the torchrun
//! variables, on loopback.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A port that was free a moment ago, outside the range outgoing connections draw from.
pub fn free_port() -> u16 {
    zero_core::launch::free_port().expect("a free port")
}

/// Starts `world` ranks in `mode` with the collective timeout `timeout_secs` and
/// ZERO_COMM_TRANSPORT `transport` ("tcp" forces TCP between ranks of this host, "auto" lets
/// them use Unix-domain sockets); a watchdog kills a rank still running after `watchdog`, so
/// that a hang fails the test instead of stalling it. Returns each rank's (exit success,
/// stdout + stderr).
pub fn run_ranks(
    world: usize,
    mode: &str,
    timeout_secs: f64,
    transport: &str,
    watchdog: Duration,
) -> Vec<(bool, String)> {
    let port = free_port().to_string();
    let exe = std::env::current_exe().expect("test binary");
    let children: Vec<Child> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args(["--ignored", "--exact", "rank_main", "--nocapture", "--test-threads=1"])
                .env("ZERO_TEST_MODE", mode)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("ZERO_COMM_TIMEOUT_SECS", timeout_secs.to_string())
                .env("ZERO_COMM_TRANSPORT", transport)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn rank")
        })
        .collect();
    let deadline = Instant::now() + watchdog;
    children
        .into_iter()
        .map(|mut child| {
            while child.try_wait().expect("try_wait").is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let out = child.wait_with_output().expect("output");
            let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
            (out.status.success(), text)
        })
        .collect()
}
