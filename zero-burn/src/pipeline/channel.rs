//! Point-to-point messages between two stages.
//!
//! [`ProcessGroup`] has no send/recv, so a channel is a 2-rank group used in one direction: a
//! send is a broadcast rooted at the sender, a receive the same broadcast posted by the peer.
//! Each message is a small header (the shape) then the values, so the receiver needs to know
//! nothing in advance. Values travel as f32 (16-bit activations widen exactly and are rounded
//! back, exactly, on arrival). Sends are asynchronous (the schedule never blocks on one); their handles
//! are kept and waited for at [`Channel::flush`]. Every wait has the group's timeout. A native
//! send/recv can replace the broadcasts behind this type without changing its users.

use crate::error::ZeroError;
use zero_core::comm::{FlatBuffer, SharedGroup, Work};

/// Most dimensions an activation may have.
const MAX_DIMS: usize = 8;

/// One direction between two stages.
#[derive(Debug)]
pub struct Channel {
    group: SharedGroup,
    /// The sending rank of the 2-rank group.
    root: usize,
    /// What the channel carries, for error messages ("activations to stage 2").
    what: String,
    /// Sends not yet known to be complete.
    pending: Vec<Work<FlatBuffer>>,
}

impl Channel {
    /// The sending end over `group` (this rank sends).
    pub fn sender(group: SharedGroup, what: impl Into<String>) -> Result<Self, ZeroError> {
        let root = group.rank();
        Self::new(group, root, what.into())
    }

    /// The receiving end over `group` (the other rank sends).
    pub fn receiver(group: SharedGroup, what: impl Into<String>) -> Result<Self, ZeroError> {
        let root = 1 - group.rank().min(1);
        Self::new(group, root, what.into())
    }

    fn new(group: SharedGroup, root: usize, what: String) -> Result<Self, ZeroError> {
        if group.world_size() != 2 {
            return Err(ZeroError::Model(format!(
                "the channel for {what} needs a group of 2 ranks, not {}",
                group.world_size()
            )));
        }
        Ok(Channel {
            group,
            root,
            what,
            pending: Vec::new(),
        })
    }

    /// Queues `values` of `shape` for the peer and returns at once.
    pub fn send(&mut self, shape: &[usize], values: Vec<f32>) -> Result<(), ZeroError> {
        if self.root != self.group.rank() {
            return Err(ZeroError::Usage(format!(
                "send on the receiving end of the channel for {}",
                self.what
            )));
        }
        let header = encode_shape(shape).ok_or_else(|| {
            ZeroError::Model(format!(
                "{}: an activation of shape {shape:?} has more than {MAX_DIMS} dimensions",
                self.what
            ))
        })?;
        self.pending
            .push(self.group.broadcast_async(FlatBuffer::F32(header), self.root));
        self.pending
            .push(self.group.broadcast_async(FlatBuffer::F32(values), self.root));
        Ok(())
    }

    /// Waits (at most the group's timeout) for the peer's next message: its shape and values. A
    /// peer that fails or never sends is a [`ZeroError::Comm`] naming the rank and the op.
    pub fn recv(&mut self) -> Result<(Vec<usize>, Vec<f32>), ZeroError> {
        let header = self
            .group
            .broadcast_async(FlatBuffer::F32(vec![0.0; MAX_DIMS + 1]), self.root)
            .wait()?
            .into_f32();
        let shape = decode_shape(&header)
            .ok_or_else(|| ZeroError::Model(format!("receiving {}: a malformed header {header:?}", self.what)))?;
        let n = shape.iter().product();
        let values = self
            .group
            .broadcast_async(FlatBuffer::F32(vec![0.0; n]), self.root)
            .wait()?
            .into_f32();
        Ok((shape, values))
    }

    /// Waits for every send queued so far.
    pub fn flush(&mut self) -> Result<(), ZeroError> {
        for work in self.pending.drain(..) {
            work.wait()?;
        }
        Ok(())
    }
}

/// `[ndim, d0, d1, …]`, padded to `MAX_DIMS + 1` f32 (exact for dimensions below 2^24).
fn encode_shape(shape: &[usize]) -> Option<Vec<f32>> {
    if shape.len() > MAX_DIMS || shape.iter().any(|&d| d >= 1 << 24) {
        return None;
    }
    let mut header = vec![0.0; MAX_DIMS + 1];
    header[0] = shape.len() as f32;
    for (slot, &d) in header[1..].iter_mut().zip(shape) {
        *slot = d as f32;
    }
    Some(header)
}

fn decode_shape(header: &[f32]) -> Option<Vec<usize>> {
    let ndim = *header.first()? as usize;
    if ndim > MAX_DIMS || header.len() != MAX_DIMS + 1 {
        return None;
    }
    Some(header[1..=ndim].iter().map(|&d| d as usize).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use zero_core::comm::ThreadGroup;

    /// Two messages sent before the receiver looks arrive whole and in order.
    #[test]
    fn sends_do_not_wait_for_the_receiver() {
        let mut ends = ThreadGroup::new_group(2).unwrap().into_iter();
        let (a, b) = (ends.next().unwrap(), ends.next().unwrap());
        let mut tx = Channel::sender(a, "test").unwrap();
        let mut rx = Channel::receiver(b, "test").unwrap();
        tx.send(&[2, 3], (0..6).map(|v| v as f32).collect()).unwrap();
        tx.send(&[1], vec![7.0]).unwrap();
        let receiver = std::thread::spawn(move || (rx.recv().unwrap(), rx.recv().unwrap()));
        let (first, second) = receiver.join().unwrap();
        tx.flush().unwrap();
        assert_eq!(first, (vec![2, 3], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]));
        assert_eq!(second, (vec![1], vec![7.0]));
    }

    /// A receive whose peer never sends fails after the group's timeout instead of hanging.
    #[test]
    fn a_silent_peer_times_out() {
        let mut ends = ThreadGroup::with_timeout(2, std::time::Duration::from_millis(200))
            .unwrap()
            .into_iter();
        let (_peer, b) = (ends.next().unwrap(), ends.next().unwrap());
        let mut rx = Channel::receiver(b, "test").unwrap();
        let started = std::time::Instant::now();
        assert!(matches!(rx.recv(), Err(ZeroError::Comm(_))));
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn shape_header_round_trips() {
        let h = encode_shape(&[4, 16, 128]).unwrap();
        assert_eq!(decode_shape(&h).unwrap(), vec![4, 16, 128]);
        assert!(encode_shape(&[1; 9]).is_none());
    }
}
