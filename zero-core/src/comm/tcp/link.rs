//! The connections to one peer, and the control messages they carry.
//!
//! Each pair of ranks holds two connections: `data` (TCP, a Unix socket, or a pair of pipes
//! between ranks of one host) carries collective headers and payload in a fixed order both sides
//! know, `ctrl` (a socket) carries small framed messages at any time: why a rank
//! aborted, or that it is leaving. A peer whose `ctrl` closes without a goodbye has died; every
//! wait watches every peer's `ctrl`, so a death is seen at once, even by ranks that were not
//! exchanging data with it.

use super::stream::Stream;
use crate::comm::CommError;
use std::io::{ErrorKind, Read, Write};
use std::time::{Duration, Instant};

/// A message on a control connection.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) enum Control {
    /// The sender's group failed with this cause; the receiver fails with it too.
    Abort(CommError),
    /// The sender dropped its group after its last collective.
    Goodbye(String),
}

/// Both connections to one peer.
pub(crate) struct Link {
    pub data: Stream,
    pub ctrl: Stream,
    ctrl_in: Vec<u8>,
    /// Set once the peer said goodbye or its control connection ended.
    pub gone: Option<String>,
    /// Set once the peer said it aborted, with its cause.
    pub aborted: Option<CommError>,
}

impl Link {
    /// Wraps two connected, non-blocking streams.
    pub(crate) fn new(data: Stream, ctrl: Stream) -> Self {
        Link {
            data,
            ctrl,
            ctrl_in: Vec::new(),
            gone: None,
            aborted: None,
        }
    }

    /// What makes this peer unusable, if anything was heard: its abort cause, or why it is gone.
    pub(crate) fn trouble(&self) -> Option<Result<CommError, String>> {
        match (&self.aborted, &self.gone) {
            (Some(cause), _) => Some(Ok(cause.clone())),
            (None, Some(reason)) => Some(Err(reason.clone())),
            (None, None) => None,
        }
    }

    /// Reads what the control connection holds without blocking, and records what it says in
    /// `aborted` and `gone`.
    pub(crate) fn poll_ctrl(&mut self) {
        if self.gone.is_some() || self.aborted.is_some() {
            return;
        }
        let mut buf = [0u8; 4096];
        let mut ended = None;
        loop {
            match (&self.ctrl).read(&mut buf) {
                Ok(0) => {
                    ended = Some("its process exited or its connection closed".to_string());
                    break;
                }
                Ok(n) => self.ctrl_in.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    ended = Some(format!("its connection failed: {e}"));
                    break;
                }
            }
        }
        // Frames first: a goodbye or an abort may precede the end of the stream. Every frame
        // is one of those, so the first settles this peer's state.
        let framed = match self.ctrl_in.get(..4) {
            Some(&[a, b, c, d]) => Some(u32::from_le_bytes([a, b, c, d]) as usize),
            _ => None,
        };
        if let Some(len) = framed.filter(|&len| self.ctrl_in.len() >= 4 + len) {
            let frame: Vec<u8> = self.ctrl_in.drain(..4 + len).skip(4).collect();
            match serde_json::from_slice::<Control>(&frame) {
                Ok(Control::Abort(cause)) => {
                    self.aborted = Some(cause);
                    return;
                }
                Ok(Control::Goodbye(reason)) => {
                    self.gone = Some(reason);
                    return;
                }
                Err(e) => {
                    let reason = format!("it sent an unreadable control message ({e})");
                    self.gone = Some(reason);
                    return;
                }
            }
        }
        if ended.is_some() {
            self.gone = ended;
        }
    }

    /// Sends a control message, best effort, waiting at most `patience` on a full socket.
    pub(crate) fn send_ctrl(&mut self, msg: &Control, patience: Duration) {
        let Ok(body) = serde_json::to_vec(msg) else {
            return;
        };
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        let deadline = Instant::now() + patience;
        let mut sent = 0;
        while sent < frame.len() && Instant::now() < deadline {
            match (&self.ctrl).write(&frame[sent..]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    }
}
