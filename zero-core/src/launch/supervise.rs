//! Starting the ranks and watching them: the first rank to fail stops all the others.

use super::{LaunchError, LaunchPlan};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// How a rank ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Termination {
    /// It exited with this status.
    Exit(i32),
    /// A signal killed it.
    Signal(i32),
}

impl Termination {
    fn of(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => Termination::Exit(code),
            (None, Some(sig)) => Termination::Signal(sig),
            (None, None) => Termination::Exit(1),
        }
    }

    /// The launcher's own exit status for this: the rank's status, or 128 + the signal as a
    /// shell reports it.
    pub fn exit_code(self) -> u8 {
        match self {
            Termination::Exit(c) => u8::try_from(c).ok().filter(|&c| c != 0).unwrap_or(1),
            Termination::Signal(s) => u8::try_from(128 + s).unwrap_or(255),
        }
    }
}

impl std::fmt::Display for Termination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Termination::Exit(c) => write!(f, "exit code {c}"),
            Termination::Signal(s) => write!(f, "signal {s}"),
        }
    }
}

/// How the launch ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank exited with status 0.
    Success,
    /// This rank failed first; the others were stopped.
    RankFailed {
        /// Global rank.
        rank: usize,
        /// Rank on this node.
        local_rank: usize,
        /// How it ended.
        how: Termination,
    },
    /// The launcher itself got this signal (SIGINT, SIGTERM) and stopped the ranks.
    Interrupted(i32),
}

static INTERRUPTED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    INTERRUPTED.store(sig, Ordering::SeqCst);
}

/// Sends `sig` to the process group of every rank (each rank leads its own group, so helpers it
/// started go too).
fn signal_all(children: &[Child], sig: libc::c_int) {
    for c in children {
        // SAFETY: kill(2) with a negative pid targets a process group; errors (ESRCH) are fine.
        unsafe { libc::kill(-(c.id() as libc::pid_t), sig) };
    }
}

/// Stops every rank still running: SIGTERM, then SIGKILL after `grace`; reaps them all.
fn stop_all(children: &mut [Child], done: &mut [bool], grace: Duration) {
    signal_all(children, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && !reap(children, done) {
        std::thread::sleep(Duration::from_millis(20));
    }
    signal_all(children, libc::SIGKILL);
    for (c, d) in children.iter_mut().zip(done.iter_mut()) {
        if !*d {
            let _ = c.wait();
            *d = true;
        }
    }
}

/// Reaps exited ranks; true when none is left.
fn reap(children: &mut [Child], done: &mut [bool]) -> bool {
    for (c, d) in children.iter_mut().zip(done.iter_mut()) {
        if !*d && matches!(c.try_wait(), Ok(Some(_))) {
            *d = true;
        }
    }
    done.iter().all(|&d| d)
}

/// Starts this node's ranks and waits for them; the first failure stops the others.
pub fn supervise(plan: &LaunchPlan) -> Result<Outcome, LaunchError> {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let mut children: Vec<Child> = Vec::with_capacity(plan.local_world_size);
    for local in 0..plan.local_world_size {
        let spawned = Command::new(&plan.command[0])
            .args(&plan.command[1..])
            .envs(plan.env(local))
            .process_group(0)
            .spawn();
        match spawned {
            Ok(child) => children.push(child),
            Err(e) => {
                let mut done = vec![false; children.len()];
                stop_all(&mut children, &mut done, plan.grace);
                return Err(LaunchError::Io {
                    what: format!("starting rank {} ({:?})", plan.first_rank + local, plan.command[0]),
                    message: e.to_string(),
                });
            }
        }
    }
    let mut done = vec![false; children.len()];
    loop {
        let sig = INTERRUPTED.load(Ordering::SeqCst);
        if sig != 0 {
            stop_all(&mut children, &mut done, plan.grace);
            return Ok(Outcome::Interrupted(sig));
        }
        let mut failed = None;
        for (local, (c, d)) in children.iter_mut().zip(done.iter_mut()).enumerate() {
            if *d {
                continue;
            }
            if let Ok(Some(status)) = c.try_wait() {
                *d = true;
                if !status.success() && failed.is_none() {
                    failed = Some((local, Termination::of(status)));
                }
            }
        }
        if let Some((local, how)) = failed {
            stop_all(&mut children, &mut done, plan.grace);
            return Ok(Outcome::RankFailed {
                rank: plan.first_rank + local,
                local_rank: local,
                how,
            });
        }
        if done.iter().all(|&d| d) {
            return Ok(Outcome::Success);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
