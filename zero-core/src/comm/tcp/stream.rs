//! A connection to a peer: TCP, or a Unix-domain socket when the peer runs on the same host, or
//! a pair of pipes set up over that socket.
//!
//! A Unix socket carries the same byte stream for about half the kernel's work per byte (no TCP
//! and IP processing), so ranks on one machine talk through one when they can; pipes fed by
//! `vmsplice` halve the copies again (see [`super::pipe`]).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;

use super::pipe::Pipes;

/// A connected stream socket.
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// Only ever a data connection, made non-blocking at creation.
    Pipes(Pipes),
}

impl Stream {
    pub(crate) fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(on),
            Stream::Unix(s) => s.set_nonblocking(on),
            Stream::Pipes(_) => Ok(()),
        }
    }

    pub(crate) fn set_read_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Pipes(_) => Ok(()),
        }
    }

    /// Small messages (headers, control) must not wait for more data to fill a segment.
    pub(crate) fn set_nodelay(&self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nodelay(true),
            Stream::Unix(_) | Stream::Pipes(_) => Ok(()),
        }
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
            Stream::Pipes(_) => Ok(()),
        }
    }

    /// Ends this rank's direction: the peer reads the end of the stream.
    pub(crate) fn close_write(&mut self) -> io::Result<()> {
        match self {
            Stream::Pipes(p) => {
                p.close_write();
                Ok(())
            }
            other => other.shutdown(Shutdown::Write),
        }
    }

    /// The descriptor to poll for incoming bytes.
    pub(crate) fn read_fd(&self) -> RawFd {
        match self {
            Stream::Pipes(p) => p.read_fd(),
            other => other.as_raw_fd(),
        }
    }

    /// The descriptor to poll for room to write.
    pub(crate) fn write_fd(&self) -> RawFd {
        match self {
            Stream::Pipes(p) => p.write_fd(),
            other => other.as_raw_fd(),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Pipes(p) => p.read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Pipes(p) => p.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Pipes(p) => p.read_fd(),
        }
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
            Stream::Pipes(p) => p.as_fd(),
        }
    }
}
