//! Starting the ranks and watching them: the first rank to fail, or to end while the others
//! still wait for it, stops all the others.

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
#[derive(Clone, Debug, PartialEq, Eq)]
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
        /// The global rank that had exited with status 0 while the others still ran, before
        /// this one failed (often the cause: its peers lost it mid-collective).
        after_early_exit: Option<usize>,
    },
    /// This rank exited with status 0 while other ranks still ran, and they had not all
    /// finished [`LaunchPlan::exit_grace`] later: it ended early (before the rendezvous, or
    /// mid-job), and the others, which would wait for it until their communication timeout,
    /// were stopped.
    EndedEarly {
        /// Global rank.
        rank: usize,
        /// Rank on this node.
        local_rank: usize,
        /// Global ranks still running when the job was stopped.
        still_running: Vec<usize>,
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

/// Makes the kernel kill this rank when the launcher dies, whatever kills it (SIGKILL
/// included, which the launcher cannot catch to stop its ranks itself). Runs in the child
/// between fork and exec, so it makes only async-signal-safe calls.
fn die_with_launcher(launcher: libc::pid_t) -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid are async-signal-safe and touch no memory of
    // ours.
    #[cfg(target_os = "linux")]
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // The launcher may have died between the fork and the prctl: then no signal will come.
        if libc::getppid() != launcher {
            libc::_exit(1);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = launcher;
    Ok(())
}

/// Starts this node's ranks and waits for them; the first failure stops the others.
///
/// A rank that exits with status 0 while others still run is not a failure at once: ranks
/// finish a job at slightly different times (rank 0 may write files after the last
/// collective). But when the others have not all finished [`LaunchPlan::exit_grace`] later, it
/// ended early, and they are waiting for a peer that will never answer (before the rendezvous,
/// until their communication timeout): the job is stopped with [`Outcome::EndedEarly`].
///
/// SIGINT and SIGTERM to the launcher stop the ranks (SIGTERM, then SIGKILL after the grace);
/// on Linux, a launcher killed outright takes its ranks with it (`PR_SET_PDEATHSIG`).
pub fn supervise(plan: &LaunchPlan) -> Result<Outcome, LaunchError> {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let launcher = std::process::id() as libc::pid_t;
    let mut children: Vec<Child> = Vec::with_capacity(plan.local_world_size);
    for local in 0..plan.local_world_size {
        let mut command = Command::new(&plan.command[0]);
        command.args(&plan.command[1..]).envs(plan.env(local)).process_group(0);
        // SAFETY: the closure makes only async-signal-safe calls (see die_with_launcher).
        unsafe {
            command.pre_exec(move || die_with_launcher(launcher));
        }
        match command.spawn() {
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
    // The first rank that exited with status 0 while others still ran, and when.
    let mut first_exit: Option<(usize, Instant)> = None;
    loop {
        let sig = INTERRUPTED.load(Ordering::SeqCst);
        if sig != 0 {
            stop_all(&mut children, &mut done, plan.grace);
            return Ok(Outcome::Interrupted(sig));
        }
        let mut failed = None;
        let mut exited_ok = None;
        for (local, (c, d)) in children.iter_mut().zip(done.iter_mut()).enumerate() {
            if *d {
                continue;
            }
            if let Ok(Some(status)) = c.try_wait() {
                *d = true;
                if !status.success() {
                    failed.get_or_insert((local, Termination::of(status)));
                } else {
                    exited_ok.get_or_insert(local);
                }
            }
        }
        if let Some((local, how)) = failed {
            stop_all(&mut children, &mut done, plan.grace);
            return Ok(Outcome::RankFailed {
                rank: plan.first_rank + local,
                local_rank: local,
                how,
                after_early_exit: first_exit.map(|(l, _)| plan.first_rank + l),
            });
        }
        if done.iter().all(|&d| d) {
            return Ok(Outcome::Success);
        }
        if let Some(local) = exited_ok {
            first_exit.get_or_insert((local, Instant::now()));
        }
        if let Some((local, at)) = first_exit {
            if at.elapsed() >= plan.exit_grace {
                let still_running = done
                    .iter()
                    .enumerate()
                    .filter(|(_, &d)| !d)
                    .map(|(l, _)| plan.first_rank + l)
                    .collect();
                stop_all(&mut children, &mut done, plan.grace);
                return Ok(Outcome::EndedEarly {
                    rank: plan.first_rank + local,
                    local_rank: local,
                    still_running,
                });
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
