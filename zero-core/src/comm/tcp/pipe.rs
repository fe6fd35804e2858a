//! Pipes between ranks of one host: the payload is copied once instead of twice.
//!
//! A socket copies every byte twice (into the kernel on write, out of it on read). Between two
//! processes of one host, a pipe fed with `vmsplice(2)` holds references to the sender's pages
//! instead of a copy, and the receiver's `read` copies them straight into its buffer: one copy
//! per byte, and no socket buffers to allocate. Each direction of a link is one pipe, created by
//! its sender, whose read end travels to the receiver over the Unix-domain data connection
//! (`SCM_RIGHTS`).
//!
//! The price: the pipe sees the sender's memory, not a snapshot of it, until the receiver has
//! read it. The collectives never write a byte they have sent before its receiver has consumed
//! it (a ring only gets a chunk back after the next rank has passed it on), and after a large
//! flow the receiver acknowledges it, so the sender hands the memory back only once it was read
//! (`Mesh::acknowledge`).
//! Small writes (headers) are plain copies.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

/// Writes of at least this many bytes are spliced, smaller ones copied.
pub(crate) const SPLICE_MIN: usize = 64 << 10;

/// Capacity asked for each pipe (the unprivileged maximum by default, /proc/sys/fs/pipe-max-size).
const PIPE_BYTES: libc::c_int = 1 << 20;

/// Both directions of a link to one peer.
pub(crate) struct Pipes {
    /// This rank's write end; `None` once closed (the peer then reads the end of the stream).
    tx: Option<File>,
    /// The peer's pipe, read end.
    rx: File,
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn cvt_size(r: isize) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// A fresh non-blocking pipe: (read end, write end).
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 returned two fresh descriptors that nothing else owns.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // Best effort: a larger pipe means fewer wake-ups; the default (64 KiB) still works.
    // SAFETY: plain fcntl on a descriptor this function owns.
    unsafe { libc::fcntl(write_end.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES) };
    Ok((read_end, write_end))
}

fn set_deadline(sock: &UnixStream, deadline: Instant) -> io::Result<()> {
    let wait = deadline.saturating_duration_since(Instant::now());
    sock.set_read_timeout(Some(wait.max(std::time::Duration::from_millis(1))))
}

impl Pipes {
    /// The accepting side of a link whose peer asked for pipes, over the connected Unix socket
    /// `sock`: sends its read end, then receives the peer's.
    pub(crate) fn offer(sock: &UnixStream, deadline: Instant) -> io::Result<Self> {
        let (read_end, write_end) = pipe()?;
        send_fd(sock, Some(read_end.as_raw_fd()))?;
        drop(read_end);
        set_deadline(sock, deadline)?;
        let theirs = recv_fd(sock)?.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no pipe came back"))?;
        Ok(Pipes::from_ends(write_end, theirs))
    }

    /// Tells a peer that asked for pipes that this rank keeps the socket.
    pub(crate) fn decline(sock: &UnixStream) -> io::Result<()> {
        send_fd(sock, None)
    }

    /// The connecting side, after asking for pipes: receives the peer's read end and sends its
    /// own, or learns that the peer keeps the socket (`None`).
    pub(crate) fn answer(sock: &UnixStream, deadline: Instant) -> io::Result<Option<Self>> {
        set_deadline(sock, deadline)?;
        let Some(theirs) = recv_fd(sock)? else {
            return Ok(None);
        };
        let (read_end, write_end) = pipe()?;
        send_fd(sock, Some(read_end.as_raw_fd()))?;
        Ok(Some(Pipes::from_ends(write_end, theirs)))
    }

    fn from_ends(write_end: OwnedFd, theirs: OwnedFd) -> Self {
        // SAFETY: plain fcntl on a descriptor this function owns.
        unsafe {
            let flags = libc::fcntl(theirs.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(theirs.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
        Pipes {
            tx: Some(File::from(write_end)),
            rx: File::from(theirs),
        }
    }

    /// The descriptor to poll for reading.
    pub(crate) fn read_fd(&self) -> RawFd {
        self.rx.as_raw_fd()
    }

    /// The descriptor to poll for writing (the read end's, once the write end is closed: poll
    /// then reports what the peer does, and a write fails).
    pub(crate) fn write_fd(&self) -> RawFd {
        self.tx.as_ref().map_or(self.rx.as_raw_fd(), |t| t.as_raw_fd())
    }

    /// The read end, borrowed.
    pub(crate) fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.rx)
    }

    /// Closes this rank's direction: the peer reads the end of the stream.
    pub(crate) fn close_write(&mut self) {
        self.tx = None;
    }

    /// Writes `buf`, by reference when it is large (see the module documentation).
    pub(crate) fn write(&self, buf: &[u8]) -> io::Result<usize> {
        let Some(tx) = &self.tx else {
            return Err(io::Error::from(io::ErrorKind::BrokenPipe));
        };
        if buf.len() < SPLICE_MIN {
            return (&*tx).write(buf);
        }
        let iov = libc::iovec {
            iov_base: buf.as_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: the iovec describes `buf`; the kernel only reads it (no SPLICE_F_GIFT).
        match cvt_size(unsafe { libc::vmsplice(tx.as_raw_fd(), &iov, 1, libc::SPLICE_F_NONBLOCK) }) {
            // A sandbox that forbids vmsplice (seccomp) still allows a copy.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM | libc::EINVAL)) => (&*tx).write(buf),
            other => other,
        }
    }

    /// Reads what the peer sent.
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.rx).read(buf)
    }
}

/// Sends one descriptor (and one byte, since a message cannot be empty) over `sock`; `None`
/// sends the byte alone, which says "no pipes".
fn send_fd(sock: &UnixStream, fd: Option<RawFd>) -> io::Result<()> {
    let Some(fd) = fd else {
        return (&*sock).write_all(b"N");
    };
    let byte = [b'P'];
    let mut iov = libc::iovec {
        iov_base: byte.as_ptr() as *mut libc::c_void,
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: msghdr is plain data; every pointer below addresses live buffers of the given sizes.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut libc::c_int, fd);
        let sent = cvt_size(libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL))?;
        if sent != 1 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "the descriptor was not sent"));
        }
    }
    Ok(())
}

/// Receives what [`send_fd`] sent: a descriptor, or `None` for "no pipes".
fn recv_fd(sock: &UnixStream) -> io::Result<Option<OwnedFd>> {
    let mut byte = [0u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr() as *mut libc::c_void,
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: as in `send_fd`; the descriptor read from the control message is fresh and ours.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space as _;
        let got = cvt_size(libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC))?;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if got == 1 && byte[0] == b'N' && cmsg.is_null() {
            return Ok(None);
        }
        if got != 1 || byte[0] != b'P' || cmsg.is_null() || (*cmsg).cmsg_type != libc::SCM_RIGHTS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the peer sent no pipe (is it an older build?)",
            ));
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const libc::c_int);
        Ok(Some(OwnedFd::from_raw_fd(fd)))
    }
}
