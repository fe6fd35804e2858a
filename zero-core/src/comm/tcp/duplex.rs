//! Sending and receiving on two threads: a ring step over sockets, duplex.
//!
//! Over a socket every byte costs the kernel a copy and its protocol work on both sides, and a
//! rank that alternates between writing to its successor and reading (and reducing) from its
//! predecessor leaves one direction idle while it serves the other: the predecessor's writes
//! stall on a full receive buffer exactly while this rank is busy writing. With the send on a
//! thread of its own, the write of segment k+1 runs while the read and the reduction of segment
//! k go on, and each thread sleeps in the kernel when its direction is blocked.
//!
//! The receiving thread (the caller) keeps every duty of the single-threaded loop: it watches the
//! control connections, owns the timeout (progress in either direction counts), and turns a
//! failure of the sending thread into the same errors, naming the peer, the op and the sequence
//! number. The sending thread only writes what the gate allows, and stops when told.

use super::pump::{Mesh, RecvFlow, SendFlow};
use super::stream::Stream;
use crate::comm::op::OpDesc;
use crate::comm::CommError;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Send flows shorter than this stay on the single-threaded loop: starting a thread and
/// handing bytes between two cost more than they save there (a 1 MB all_reduce at world 2,
/// which sends 1 MB, measured 1.25-1.32 GB/s with the thread against 1.34-1.62 without).
pub(crate) const DUPLEX_MIN: usize = 4 << 20;

/// How long the sending thread sleeps at most before it looks at the stop flag again.
const NAP: Duration = Duration::from_millis(50);

/// A wake-up the sending thread gives the receiving one when it ends (an eventfd).
pub(crate) struct Wake(OwnedFd);

impl Wake {
    /// A fresh, non-blocking eventfd.
    pub(crate) fn new() -> Result<Self, CommError> {
        // SAFETY: eventfd takes no pointers; a non-negative result is a fresh descriptor.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(CommError::Setup(format!("eventfd failed: {e}")));
        }
        // SAFETY: `fd` was just created and nothing else owns it.
        Ok(Wake(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Clears pending wake-ups.
    fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64; EAGAIN (nothing pending) is fine.
        unsafe { libc::read(self.0.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

// SAFETY: a send flow's segments point into memory the collective owns for its whole duration;
// the sending thread only reads bytes below the gate, which the receiving side has finished
// writing (published with release ordering through `Shared::processed`).
unsafe impl Send for SendFlow {}

/// What the two threads share.
struct Shared {
    /// Bytes the receive flow has landed (its `processed`), for the send gate.
    processed: AtomicUsize,
    /// Bytes the sending thread has written, for the timeout.
    sent: AtomicUsize,
    /// Set by the receiving thread when it fails: the sending thread gives up.
    stop: AtomicBool,
    /// Set by the sending thread when it has ended, well or not.
    finished: AtomicBool,
    /// Set by the sending thread (before `finished`) when it ended short of its flow.
    failed: AtomicBool,
}

/// Wakes the receiving thread through the eventfd `fd` (owned by the mesh, which outlives the
/// sending thread).
fn signal(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64. The counter cannot overflow (one write per flow,
    // drained by every wait); a failed write would only delay the end by one poll timeout.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Why the sending thread stopped short.
enum SendFail {
    /// The connection failed or closed; the text says how.
    Broken(String),
    /// The receiving side asked it to stop.
    Stopped,
}

/// Whether `send` and `recv` should run on two threads: both stream through sockets (pipes are
/// cheap enough on one thread, and their sender must stay on the thread that acknowledges) and
/// the send is large enough to pay for a thread.
pub(crate) fn wanted(mesh: &Mesh, send: &SendFlow, recv: &RecvFlow) -> bool {
    let socket = |peer: usize| {
        mesh.links[peer]
            .as_ref()
            .is_some_and(|l| matches!(l.data, Stream::Tcp(_) | Stream::Unix(_)))
    };
    duplex_enabled()
        && send.total() >= DUPLEX_MIN
        && socket(send.peer())
        && socket(recv.peer())
        && send.gate().is_none_or(|(_, r)| r == 0)
}

/// Whether the two-thread path may run: yes unless ZERO_COMM_DUPLEX=0 (to compare the two).
fn duplex_enabled() -> bool {
    std::env::var("ZERO_COMM_DUPLEX").map_or(true, |v| v.trim() != "0")
}

impl Mesh {
    /// Runs one send and one receive flow to completion, the send on a thread of its own.
    pub(crate) fn run_duplex(
        &mut self,
        desc: &OpDesc,
        send: &mut SendFlow,
        recv: &mut RecvFlow,
    ) -> Result<(), CommError> {
        if self.wake.is_none() {
            self.wake = Some(Wake::new()?);
        }
        let to = send.peer();
        let fd = self.link_data_fd(to);
        let shared = Shared {
            processed: AtomicUsize::new(recv.processed()),
            sent: AtomicUsize::new(send.done()),
            stop: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            failed: AtomicBool::new(false),
        };
        let wake = self.wake.as_ref().map_or(-1, |w| w.0.as_raw_fd());
        let outcome = std::thread::scope(|s| {
            let sh = &shared;
            let sender = std::thread::Builder::new()
                .name(format!("zero-comm-send{}", self.rank))
                .spawn_scoped(s, move || {
                    let r = push(send, fd, sh);
                    sh.failed.store(r.is_err(), Ordering::Release);
                    sh.finished.store(true, Ordering::Release);
                    signal(wake);
                    r
                })
                .map_err(|e| CommError::Setup(format!("cannot start a sending thread: {e}")))?;
            let received = self.receive_beside(desc, recv, to, &shared, sender.thread());
            if received.is_err() {
                shared.stop.store(true, Ordering::Release);
                sender.thread().unpark();
            }
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err(SendFail::Broken("the sending thread panicked".into())));
            Ok::<_, CommError>((received, sent))
        })?;
        match outcome {
            (Err(e), _) => Err(e),
            (Ok(()), Err(SendFail::Broken(what))) => Err(self.lost(desc, to, &what)),
            (Ok(()), Err(SendFail::Stopped)) | (Ok(()), Ok(())) => Ok(()),
        }
    }

    /// The receiving thread's loop: reads and lands `recv`, publishes its progress to the send
    /// gate, watches the control connections, and waits for the sending thread to end.
    fn receive_beside(
        &mut self,
        desc: &OpDesc,
        recv: &mut RecvFlow,
        to: usize,
        shared: &Shared,
        sender: &std::thread::Thread,
    ) -> Result<(), CommError> {
        let mut last_progress = Instant::now();
        let mut last_sent = shared.sent.load(Ordering::Acquire);
        loop {
            let got = self.drive_recv_with(desc, recv, &mut |processed| {
                shared.processed.store(processed, Ordering::Release);
                sender.unpark();
            })?;
            let finished = shared.finished.load(Ordering::Acquire);
            if recv.done() == recv.total() && finished {
                return Ok(());
            }
            if finished && shared.failed.load(Ordering::Acquire) {
                // The sending thread ended early: its error is reported by the caller.
                return Ok(());
            }
            let sent = shared.sent.load(Ordering::Acquire);
            if got || sent != last_sent {
                last_progress = Instant::now();
                last_sent = sent;
                if got {
                    continue;
                }
            }
            let deadline = last_progress + self.timeout;
            // The poll below sleeps at most a nap, so the sending thread's progress (which
            // does not wake it) still resets the deadline.
            if Instant::now() >= deadline {
                let peer = if recv.done() < recv.total() { recv.peer() } else { to };
                return Err(CommError::Timeout {
                    seq: desc.seq,
                    op: desc.kind.name().to_string(),
                    peer,
                    seconds: self.timeout.as_secs_f64(),
                });
            }
            let recv_fd = (recv.done() < recv.total()).then(|| self.link_read_fd(recv.peer()));
            self.wait_beside(recv_fd, deadline.min(Instant::now() + NAP))?;
            let involved = |p: usize| (p == recv.peer() && recv.done() < recv.total()) || (p == to && !finished);
            self.check_peers(involved)?;
        }
    }
}

impl Mesh {
    /// Sleeps until `recv_fd` has data, the sending thread ends, a control connection speaks,
    /// or `until`.
    fn wait_beside(&mut self, recv_fd: Option<RawFd>, until: Instant) -> Result<(), CommError> {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut add = |fd: RawFd| {
            fds.push(libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
        };
        if let Some(fd) = recv_fd {
            add(fd);
        }
        if let Some(w) = &self.wake {
            add(w.0.as_raw_fd());
        }
        for link in self
            .links
            .iter()
            .flatten()
            .filter(|l| l.gone.is_none() && l.aborted.is_none())
        {
            add(link.ctrl.as_raw_fd());
        }
        let ms = until
            .saturating_duration_since(Instant::now())
            .as_millis()
            .clamp(1, i32::MAX as u128) as i32;
        // SAFETY: `fds` is a valid array of pollfd of the given length.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if ready < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(CommError::Setup(format!("poll failed: {e}")));
            }
        }
        if let Some(w) = &self.wake {
            w.drain();
        }
        Ok(())
    }
}

/// The sending thread: writes what the gate allows through the raw socket `fd`.
fn push(flow: &mut SendFlow, fd: RawFd, shared: &Shared) -> Result<(), SendFail> {
    while flow.done() < flow.total() {
        if shared.stop.load(Ordering::Acquire) {
            return Err(SendFail::Stopped);
        }
        let limit = match flow.gate() {
            None => flow.total(),
            Some((head, _)) => (head + shared.processed.load(Ordering::Acquire)).min(flow.total()),
        };
        if flow.done() >= limit {
            std::thread::park_timeout(NAP);
            continue;
        }
        let (ptr, n) = flow.next_bytes(limit);

        // SAFETY: `ptr..ptr + n` lies in a segment of the flow, below the gate (final bytes).
        let r = unsafe { libc::send(fd, ptr.cast(), n, libc::MSG_NOSIGNAL) };
        if r > 0 {
            flow.advance(r as usize);
            shared.sent.store(flow.done(), Ordering::Release);
            continue;
        }
        if r == 0 {
            return Err(SendFail::Broken("stopped accepting data".into()));
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => {
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one valid pollfd. Errors and timeouts just loop back to the checks.
                unsafe { libc::poll(&mut p, 1, NAP.as_millis() as i32) };
            }
            std::io::ErrorKind::Interrupted => {}
            _ => return Err(SendFail::Broken(format!("connection error: {e}"))),
        }
    }
    Ok(())
}
