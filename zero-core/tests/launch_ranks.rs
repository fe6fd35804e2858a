//! `zero launch` end to end: the environment each rank gets, and a failing rank stopping the
//! others.

mod launch_support;

use launch_support::{alive, scratch_dir, zero};
use std::time::{Duration, Instant};

#[test]
fn every_rank_gets_the_torchrun_environment() {
    let out = zero()
        .args(["launch", "--nproc-per-node", "3", "--"])
        .args([
            "sh",
            "-c",
            "echo \"ENV $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT\"",
        ])
        .output()
        .expect("zero launch");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| l.starts_with("ENV "))
        .map(|l| l.split(' ').collect())
        .collect();
    lines.sort();
    assert_eq!(lines.len(), 3, "{text}");
    let port = lines[0][6];
    for (rank, l) in lines.iter().enumerate() {
        let want = ["ENV", &rank.to_string(), "3", &rank.to_string(), "3", "127.0.0.1", port];
        assert_eq!(l, &want.to_vec());
    }
    assert!(
        port.parse::<u16>().map(|p| p != 0).unwrap_or(false),
        "a free port: {port}"
    );
}

#[test]
fn a_failing_rank_stops_the_others_and_its_status_is_the_launchers() {
    let dir = scratch_dir("fail");
    // Every rank records its pid; rank 2 fails with status 3, the others would run for a minute.
    let script = format!(
        "echo $$ > {d}/pid.$RANK; if [ \"$RANK\" = 2 ]; then sleep 0.5; exit 3; fi; exec sleep 60",
        d = dir.display()
    );
    let start = Instant::now();
    let out = zero()
        .args([
            "launch",
            "--nproc-per-node",
            "4",
            "--grace-secs",
            "2",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .output()
        .expect("zero launch");
    let took = start.elapsed();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 2") && err.contains("exit code 3"), "{err}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    for rank in [0, 1, 3] {
        let pid: i32 = std::fs::read_to_string(dir.join(format!("pid.{rank}")))
            .expect("pid file")
            .trim()
            .parse()
            .expect("pid");
        assert!(!alive(pid), "rank {rank} (pid {pid}) still runs");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_rank_killed_by_a_signal_is_reported_as_such() {
    let out = zero()
        .args(["launch", "--nproc-per-node", "2", "--grace-secs", "1", "--"])
        .args(["sh", "-c", "if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; exec sleep 60"])
        .output()
        .expect("zero launch");
    assert_eq!(out.status.code(), Some(128 + 9), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 1") && err.contains("signal 9"), "{err}");
}

#[test]
fn bad_options_are_explained() {
    let out = zero().args(["launch", "--", "true"]).output().expect("zero launch");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--nproc-per-node"));
}
