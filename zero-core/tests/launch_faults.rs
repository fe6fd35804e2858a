//! `zero launch` when a rank or the launcher itself goes away: a rank that exits with status 0
//! while the others wait for it is named within seconds (not after the communication timeout),
//! ranks that finish a little apart still succeed, and stopping or killing the launcher stops
//! its ranks.

mod launch_support;

use launch_support::{alive, scratch_dir, zero};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// The pids the ranks wrote into `dir` (`pid.<rank>`), waiting up to 10 s for all `n`.
fn rank_pids(dir: &Path, n: usize) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pids: Vec<i32> = (0..n)
            .filter_map(|r| std::fs::read_to_string(dir.join(format!("pid.{r}"))).ok())
            .filter_map(|t| t.trim().parse().ok())
            .collect();
        if pids.len() == n {
            return pids;
        }
        assert!(Instant::now() < deadline, "the ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits up to `limit` for every pid to be gone.
fn all_gone_within(pids: &[i32], limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if pids.iter().all(|&p| !alive(p)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn a_rank_that_exits_0_while_the_others_wait_is_named_within_seconds() {
    let dir = scratch_dir("faults-early");
    // Rank 1 ends at once with status 0; rank 0 would wait for it for ten minutes.
    let script = format!(
        "echo $$ > {d}/pid.$RANK; if [ \"$RANK\" = 1 ]; then exit 0; fi; exec sleep 600",
        d = dir.display()
    );
    let start = Instant::now();
    let out = zero()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--exit-grace-secs",
            "1",
            "--grace-secs",
            "1",
            "--",
        ])
        .args(["sh", "-c", &script])
        .output()
        .expect("zero launch");
    let took = start.elapsed();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank 1") && err.contains("ended early") && err.contains("status 0"),
        "{err}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
    let pids = rank_pids(&dir, 2);
    assert!(!alive(pids[0]), "rank 0 (pid {}) still runs", pids[0]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn ranks_that_finish_a_little_apart_succeed() {
    // Rank 0 finishes half a second after the others, as a rank that writes files after the
    // last collective does.
    let out = zero()
        .args(["launch", "--nproc-per-node", "3", "--exit-grace-secs", "5", "--"])
        .args(["sh", "-c", "if [ \"$RANK\" = 0 ]; then sleep 0.5; fi; exit 0"])
        .output()
        .expect("zero launch");
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn a_failure_after_an_early_exit_names_both() {
    // Rank 1 leaves with status 0; rank 0 notices (as a peer whose connection closed would)
    // and fails before the grace is over.
    let out = zero()
        .args(["launch", "--nproc-per-node", "2", "--exit-grace-secs", "30", "--"])
        .args(["sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 0; fi; sleep 0.5; exit 7"])
        .output()
        .expect("zero launch");
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank 0") && err.contains("exit code 7") && err.contains("after rank 1 had exited with status 0"),
        "{err}"
    );
}

/// Starts `zero launch` with two ranks that record their pids in `dir` and sleep.
fn sleeping_launch(dir: &Path) -> (Child, Vec<i32>) {
    let script = format!("echo $$ > {d}/pid.$RANK; exec sleep 600", d = dir.display());
    let launcher = zero()
        .args(["launch", "--nproc-per-node", "2", "--grace-secs", "1", "--"])
        .args(["sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("zero launch");
    let pids = rank_pids(dir, 2);
    (launcher, pids)
}

#[test]
fn stopping_the_launcher_stops_its_ranks() {
    for (name, signal) in [("term", libc::SIGTERM), ("int", libc::SIGINT)] {
        let dir = scratch_dir(&format!("faults-{name}"));
        let (mut launcher, pids) = sleeping_launch(&dir);
        // SAFETY: kill(2) on the launcher's pid, which this test started and has not reaped.
        unsafe { libc::kill(launcher.id() as libc::pid_t, signal) };
        let status = launcher.wait().expect("wait");
        assert_eq!(status.code(), Some(128 + signal), "{name}: {status:?}");
        assert!(
            all_gone_within(&pids, Duration::from_secs(5)),
            "{name}: ranks {pids:?} still run"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn killing_the_launcher_outright_kills_its_ranks() {
    let dir = scratch_dir("faults-kill");
    let (mut launcher, pids) = sleeping_launch(&dir);
    launcher.kill().expect("SIGKILL the launcher");
    launcher.wait().expect("wait");
    assert!(
        all_gone_within(&pids, Duration::from_secs(5)),
        "ranks {pids:?} outlived the launcher"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn seconds_that_are_not_a_duration_are_refused_not_a_panic() {
    for flag in ["--grace-secs", "--exit-grace-secs"] {
        for value in ["inf", "NaN", "-1", "1e300", "soon"] {
            let out = zero()
                .args([
                    "launch",
                    "--nproc-per-node",
                    "1",
                    &format!("{flag}={value}"),
                    "--",
                    "true",
                ])
                .output()
                .expect("zero launch");
            assert_eq!(out.status.code(), Some(2), "{flag} {value}: {out:?}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(flag) && err.contains(value), "{flag} {value}: {err}");
        }
    }
}

/// Counts whose world overflows (nodes × processes, or a hostfile's slots) are refused with
/// the bound, not a panic on the overflow.
#[test]
fn a_world_past_the_bound_is_refused_not_a_panic() {
    let dir = tempfile::tempdir().expect("temp dir");
    let hostfile = dir.path().join("hostfile");
    std::fs::write(&hostfile, "localhost slots=2\nother slots=18446744073709551615\n").expect("write");
    let max = u64::MAX.to_string();
    let cases: [(&[&str], &str); 3] = [
        (&["--nproc-per-node", "1024", "--nnodes", &max], "--nnodes"),
        (
            &[
                "--nproc-per-node",
                "2",
                "--nnodes",
                &max,
                "--node-rank",
                "18446744073709551614",
            ],
            "--nnodes",
        ),
        (
            &["--hostfile", &hostfile.to_string_lossy(), "--node-rank", "0"],
            "slots",
        ),
    ];
    for (args, want) in cases {
        let out = zero()
            .arg("launch")
            .args(args)
            .args(["--", "true"])
            .output()
            .expect("zero launch");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want) && err.contains("16777216 ranks"), "{args:?}: {err}");
    }
}
