//! The transfer engine: moves byte streams to and from peers over non-blocking sockets, with one
//! `poll` loop per collective.
//!
//! A collective is described as flows: a send flow streams memory segments to a peer, a receive
//! flow fills segments from a peer, either by copying or by reducing into f32 memory. A send can be
//! gated on a receive (a ring forwards what it has just reduced), which pipelines the ring at the
//! granularity of socket reads instead of whole chunks. While a flow waits, the loop also watches
//! every peer's control connection, and gives up when nothing moved for the timeout.

use super::duplex::{self, Wake};
use super::link::Link;
use super::pipe::SPLICE_MIN;
use super::stream::Stream;
use crate::comm::op::OpDesc;
use crate::comm::reduce::{combine, finish};
use crate::comm::{CommError, ReduceOp};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// The acknowledgement byte of a large flow over a pipe (see [`Mesh::acknowledge`]).
const ACK: u8 = 0xAC;

/// f32 elements of the staging buffer of reducing receives.
const SCRATCH_ELEMS: usize = 1 << 18;

/// A raw memory segment: the flows borrow memory the collective owns, in disjoint parts whose
/// reads and writes the gates order; plain slices cannot express that sharing.
#[derive(Clone, Copy)]
pub(crate) struct Seg {
    pub ptr: *mut u8,
    pub len: usize,
}

#[derive(Default)]
struct Cursor {
    seg: usize,
    off: usize,
}

impl Cursor {
    fn advance(&mut self, segs: &[Seg], mut n: usize) {
        while n > 0 || (self.seg < segs.len() && self.off == segs[self.seg].len) {
            if self.seg >= segs.len() {
                return;
            }
            let step = n.min(segs[self.seg].len - self.off);
            self.off += step;
            n -= step;
            if self.off == segs[self.seg].len {
                self.seg += 1;
                self.off = 0;
            }
        }
    }
}

/// Streams `segs` to `peer`; with a gate `(head, r)`, byte `i` goes out only once
/// `i < head + recvs[r].processed`.
pub(crate) struct SendFlow {
    peer: usize,
    segs: Vec<Seg>,
    gate: Option<(usize, usize)>,
    total: usize,
    done: usize,
    cur: Cursor,
}

impl SendFlow {
    pub(crate) fn new(peer: usize, segs: Vec<Seg>, gate: Option<(usize, usize)>) -> Self {
        let total = segs.iter().map(|s| s.len).sum();
        let mut cur = Cursor::default();
        cur.advance(&segs, 0);
        SendFlow {
            peer,
            segs,
            gate,
            total,
            done: 0,
            cur,
        }
    }
}

impl SendFlow {
    /// The rank written to.
    pub(crate) fn peer(&self) -> usize {
        self.peer
    }

    /// Bytes the flow streams in all.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Bytes written so far.
    pub(crate) fn done(&self) -> usize {
        self.done
    }

    /// The gate `(head, receive flow)`: see [`SendFlow`].
    pub(crate) fn gate(&self) -> Option<(usize, usize)> {
        self.gate
    }

    /// The next contiguous bytes to write, at most up to stream offset `limit` (> `done`).
    pub(crate) fn next_bytes(&self, limit: usize) -> (*const u8, usize) {
        let seg = self.segs[self.cur.seg];
        let n = (seg.len - self.cur.off).min(limit - self.done);
        // SAFETY: the cursor stays inside the segment while bytes remain.
        (unsafe { seg.ptr.add(self.cur.off) }, n)
    }

    /// Records `n` bytes written.
    pub(crate) fn advance(&mut self, n: usize) {
        self.done += n;
        self.cur.advance(&self.segs, n);
    }
}

/// How far the gate lets `send` go.
fn send_limit(send: &SendFlow, recvs: &[RecvFlow]) -> usize {
    match send.gate {
        None => send.total,
        Some((head, r)) => (head + recvs[r].processed).min(send.total),
    }
}

/// How received bytes land.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sink {
    /// Copied into the segments.
    Copy,
    /// Combined (as f32) into the f32 values the segments hold.
    Reduce(ReduceOp),
}

/// Fills `segs` from `peer`.
pub(crate) struct RecvFlow {
    peer: usize,
    segs: Vec<Seg>,
    sink: Sink,
    total: usize,
    /// Bytes read from the socket.
    done: usize,
    /// Bytes landed in the segments (copied or reduced).
    processed: usize,
    /// With a reducing sink, the leading bytes that are reduced; the rest is copied.
    reduce_bytes: usize,
    /// A segment whose values are final once combined: `(segment, world)` divides them by the
    /// world size (the mean of an all-reduce, applied as the last contribution lands).
    finish: Option<(usize, usize)>,
    cur: Cursor,
}

impl RecvFlow {
    pub(crate) fn new(peer: usize, segs: Vec<Seg>, sink: Sink) -> Self {
        let total = segs.iter().map(|s| s.len).sum();
        let mut cur = Cursor::default();
        cur.advance(&segs, 0);
        let reduce_bytes = if sink == Sink::Copy { 0 } else { total };
        RecvFlow {
            peer,
            segs,
            sink,
            total,
            done: 0,
            processed: 0,
            reduce_bytes,
            finish: None,
            cur,
        }
    }

    /// Appends segments that are copied into once the reduced ones are complete (an all-reduce's
    /// all-gather phase, streamed right behind its reduce-scatter).
    pub(crate) fn then_copy(mut self, segs: Vec<Seg>) -> Self {
        self.total += segs.iter().map(|s| s.len).sum::<usize>();
        self.segs.extend(segs);
        self
    }

    /// Divides segment `seg`'s values by `world` as soon as they are combined.
    pub(crate) fn finishing(mut self, seg: usize, world: usize) -> Self {
        self.finish = Some((seg, world));
        self
    }
}

impl RecvFlow {
    /// The rank read from.
    pub(crate) fn peer(&self) -> usize {
        self.peer
    }

    /// Bytes the flow receives in all.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Bytes read so far.
    pub(crate) fn done(&self) -> usize {
        self.done
    }

    /// Bytes landed so far.
    pub(crate) fn processed(&self) -> usize {
        self.processed
    }
}

/// All connections of one rank, indexed by peer rank (`None` at this rank's own index).
pub(crate) struct Mesh {
    pub rank: usize,
    pub links: Vec<Option<Link>>,
    pub timeout: Duration,
    scratch: Vec<f32>,
    pending: usize,
    /// Wakes this rank's receiving loop when its sending thread ends (see [`super::duplex`]).
    pub(super) wake: Option<Wake>,
}

impl Mesh {
    pub(crate) fn new(rank: usize, links: Vec<Option<Link>>, timeout: Duration) -> Self {
        Mesh {
            rank,
            links,
            timeout,
            scratch: Vec::new(),
            pending: 0,
            wake: None,
        }
    }

    fn link(&self, peer: usize) -> &Link {
        // Flows are built only for peers of the mesh.
        self.links[peer].as_ref().expect("a flow names a peer of the mesh")
    }

    /// The descriptor to write `peer`'s data to.
    pub(super) fn link_data_fd(&self, peer: usize) -> std::os::fd::RawFd {
        self.link(peer).data.write_fd()
    }

    /// The descriptor to read `peer`'s data from.
    pub(super) fn link_read_fd(&self, peer: usize) -> std::os::fd::RawFd {
        self.link(peer).data.read_fd()
    }

    /// Runs the flows to completion, or fails naming the peer at fault and the collective.
    pub(crate) fn pump(
        &mut self,
        desc: &OpDesc,
        sends: &mut [SendFlow],
        recvs: &mut [RecvFlow],
    ) -> Result<(), CommError> {
        match (&mut *sends, &mut *recvs) {
            ([send], [recv]) if duplex::wanted(self, send, recv) => {
                self.prepare_scratch(std::slice::from_ref(recv));
                self.pending = 0;
                self.run_duplex(desc, send, recv)?;
            }
            _ => self.run_flows(desc, sends, recvs)?,
        }
        self.acknowledge(desc, sends, recvs)
    }

    /// Runs the flows to completion (the body of [`Mesh::pump`]).
    fn run_flows(&mut self, desc: &OpDesc, sends: &mut [SendFlow], recvs: &mut [RecvFlow]) -> Result<(), CommError> {
        self.prepare_scratch(recvs);
        self.pending = 0;
        let mut last_progress = Instant::now();
        loop {
            let mut progressed = false;
            for recv in recvs.iter_mut() {
                progressed |= self.drive_recv(desc, recv)?;
            }
            for send in sends.iter_mut() {
                let limit = send_limit(send, recvs);
                progressed |= self.drive_send(desc, send, limit)?;
            }
            if sends.iter().all(|s| s.done == s.total) && recvs.iter().all(|r| r.done == r.total) {
                return Ok(());
            }
            if progressed {
                last_progress = Instant::now();
                continue;
            }
            self.wait(desc, sends, recvs, last_progress + self.timeout)?;
        }
    }

    /// Allocates the staging buffer of reducing receives once.
    fn prepare_scratch(&mut self, recvs: &[RecvFlow]) {
        if recvs.iter().any(|r| r.sink != Sink::Copy) && self.scratch.is_empty() {
            self.scratch = vec![0f32; SCRATCH_ELEMS];
        }
    }

    /// Over pipes, a large payload travels by reference (see [`super::pipe`]): its memory goes
    /// back to the caller, who may write it, only once the peer has read it. So after every
    /// flow of at least [`SPLICE_MIN`] bytes over a pipe, its receiver sends one byte back and
    /// its sender waits for it; both sides know which flows these are, since every send flow
    /// is a peer's receive flow of the same length. The acknowledgement follows everything the
    /// peer sent in the collective, so it is the next byte on its stream.
    fn acknowledge(&mut self, desc: &OpDesc, sends: &[SendFlow], recvs: &[RecvFlow]) -> Result<(), CommError> {
        let piped = |mesh: &Mesh, peer: usize| matches!(mesh.link(peer).data, Stream::Pipes(_));
        let ack_to: Vec<usize> = recvs
            .iter()
            .filter(|r| r.total >= SPLICE_MIN && piped(self, r.peer))
            .map(|r| r.peer)
            .collect();
        let ack_from: Vec<usize> = sends
            .iter()
            .filter(|s| s.total >= SPLICE_MIN && piped(self, s.peer))
            .map(|s| s.peer)
            .collect();
        if ack_to.is_empty() && ack_from.is_empty() {
            return Ok(());
        }
        let mut out = [ACK];
        let mut got = vec![0u8; ack_from.len()];
        let mut acks: Vec<SendFlow> = ack_to
            .iter()
            .map(|&p| {
                let seg = Seg {
                    ptr: out.as_mut_ptr(),
                    len: 1,
                };
                SendFlow::new(p, vec![seg], None)
            })
            .collect();
        let mut waits: Vec<RecvFlow> = ack_from
            .iter()
            .zip(got.iter_mut())
            .map(|(&p, b)| RecvFlow::new(p, vec![Seg { ptr: b, len: 1 }], Sink::Copy))
            .collect();
        self.run_flows(desc, &mut acks, &mut waits)?;
        drop(waits);
        match ack_from.iter().zip(&got).find(|(_, &b)| b != ACK) {
            Some((&peer, _)) => Err(CommError::PeerLost {
                seq: desc.seq,
                op: desc.kind.name().to_string(),
                peer,
                reason: "it sent something else than an acknowledgement (its stream is out of step)".into(),
            }),
            None => Ok(()),
        }
    }

    /// Reads what is available; true if anything arrived.
    fn drive_recv(&mut self, desc: &OpDesc, flow: &mut RecvFlow) -> Result<bool, CommError> {
        self.drive_recv_with(desc, flow, &mut |_| {})
    }

    /// [`Mesh::drive_recv`], telling `landed` the flow's `processed` after every read, so that
    /// a sending thread gated on it can go on while this one reads more.
    pub(super) fn drive_recv_with(
        &mut self,
        desc: &OpDesc,
        flow: &mut RecvFlow,
        landed: &mut dyn FnMut(usize),
    ) -> Result<bool, CommError> {
        let mut progressed = false;
        while flow.done < flow.total {
            let Some(link) = self.links[flow.peer].as_ref() else {
                return Err(self.lost(desc, flow.peer, "it is not connected"));
            };
            let stream = &link.data;
            let reducing = flow.done < flow.reduce_bytes;
            let result = if reducing {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch);
                let room = (bytes.len() - self.pending).min(flow.reduce_bytes - flow.done);
                (&*stream).read(&mut bytes[self.pending..self.pending + room])
            } else {
                let seg = flow.segs[flow.cur.seg];
                // SAFETY: the segment is this flow's to write until processed passes it.
                let dst = unsafe { std::slice::from_raw_parts_mut(seg.ptr.add(flow.cur.off), seg.len - flow.cur.off) };
                (&*stream).read(dst)
            };
            match result {
                Ok(0) => return Err(self.lost(desc, flow.peer, "closed its connection mid-collective")),
                Ok(n) => {
                    progressed = true;
                    flow.done += n;
                    match (reducing, flow.sink) {
                        (true, Sink::Reduce(op)) => self.reduce_staged(flow, n, op),
                        _ => {
                            flow.cur.advance(&flow.segs, n);
                            flow.processed += n;
                        }
                    }
                    landed(flow.processed);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.lost(desc, flow.peer, &format!("connection error: {e}"))),
            }
        }
        Ok(progressed)
    }

    /// Combines the complete f32 values staged in `scratch` into the flow's segments.
    fn reduce_staged(&mut self, flow: &mut RecvFlow, n: usize, op: ReduceOp) {
        let avail = self.pending + n;
        let whole = avail / 4;
        let mut from = 0;
        while from < whole {
            let seg = flow.segs[flow.cur.seg];
            let elems = ((seg.len - flow.cur.off) / 4).min(whole - from);
            // SAFETY: f32-aligned segment of f32 values owned by this flow until processed.
            let dst = unsafe { std::slice::from_raw_parts_mut(seg.ptr.add(flow.cur.off) as *mut f32, elems) };
            combine(dst, &self.scratch[from..from + elems], op);
            if let Some((_, world)) = flow.finish.filter(|&(seg, _)| seg == flow.cur.seg) {
                finish(dst, ReduceOp::Avg, world);
            }
            flow.cur.advance(&flow.segs, elems * 4);
            from += elems;
        }
        flow.processed += whole * 4;
        let rest = avail - whole * 4;
        if rest > 0 {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch);
            bytes.copy_within(whole * 4..avail, 0);
        }
        self.pending = rest;
    }

    /// Writes what the gate allows; true if anything left.
    fn drive_send(&mut self, desc: &OpDesc, flow: &mut SendFlow, limit: usize) -> Result<bool, CommError> {
        let mut progressed = false;
        while flow.done < limit {
            let seg = flow.segs[flow.cur.seg];
            let n = (seg.len - flow.cur.off).min(limit - flow.done);
            // SAFETY: bytes below the gate are final; nobody writes them during the collective.
            let src = unsafe { std::slice::from_raw_parts(seg.ptr.add(flow.cur.off), n) };
            match (&self.link(flow.peer).data).write(src) {
                Ok(0) => return Err(self.lost(desc, flow.peer, "stopped accepting data")),
                Ok(n) => {
                    progressed = true;
                    flow.done += n;
                    flow.cur.advance(&flow.segs, n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.lost(desc, flow.peer, &format!("connection error: {e}"))),
            }
        }
        Ok(progressed)
    }

    /// The error for a broken data connection: the peer's own abort message if it sent one (it
    /// names the original cause), else that the peer is gone.
    pub(super) fn lost(&mut self, desc: &OpDesc, peer: usize, what: &str) -> CommError {
        // An aborting peer writes its cause on the control connection before it shuts its data
        // connections; the two connections are not ordered, so give the message a moment.
        let until = Instant::now() + Duration::from_millis(200);
        while let Some(link) = self.links[peer].as_mut() {
            link.poll_ctrl();
            if link.trouble().is_some() || Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let trouble = self.links[peer].as_ref().and_then(|l| l.trouble());
        match trouble {
            Some(Ok(cause)) => cause,
            Some(Err(reason)) => CommError::PeerLost {
                seq: desc.seq,
                op: desc.kind.name().to_string(),
                peer,
                reason,
            },
            None => CommError::PeerLost {
                seq: desc.seq,
                op: desc.kind.name().to_string(),
                peer,
                reason: what.to_string(),
            },
        }
    }

    /// Reads every control connection; fails if a peer in `involved` aborted. A peer that is
    /// gone fails the collective through its data connection instead, once the data it sent
    /// before leaving is used up: a peer may well exit right after its last collective.
    pub(crate) fn check_peers(&mut self, involved: impl Fn(usize) -> bool) -> Result<(), CommError> {
        for peer in 0..self.links.len() {
            let Some(link) = self.links[peer].as_mut() else {
                continue;
            };
            link.poll_ctrl();
            if let (true, Some(cause)) = (involved(peer), &link.aborted) {
                return Err(cause.clone());
            }
        }
        Ok(())
    }

    /// Blocks until a flow can move or a control connection speaks, at most until `deadline`.
    fn wait(
        &mut self,
        desc: &OpDesc,
        sends: &[SendFlow],
        recvs: &[RecvFlow],
        deadline: Instant,
    ) -> Result<(), CommError> {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut add = |fd: i32, events: i16| match fds.iter_mut().find(|p| p.fd == fd) {
            Some(p) => p.events |= events,
            None => fds.push(libc::pollfd { fd, events, revents: 0 }),
        };
        for r in recvs.iter().filter(|r| r.done < r.total) {
            add(self.link(r.peer).data.read_fd(), libc::POLLIN);
        }
        for s in sends.iter().filter(|s| s.done < s.total) {
            if s.done < send_limit(s, recvs) {
                add(self.link(s.peer).data.write_fd(), libc::POLLOUT);
            }
        }
        for link in self
            .links
            .iter()
            .flatten()
            .filter(|l| l.gone.is_none() && l.aborted.is_none())
        {
            add(link.ctrl.as_raw_fd(), libc::POLLIN);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(self.timed_out(desc, sends, recvs));
        }
        let ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: `fds` is a valid array of pollfd of the given length.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if ready < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                return Err(CommError::Setup(format!("poll failed: {e}")));
            }
        }
        let involved = |p: usize| {
            recvs.iter().any(|r| r.peer == p && r.done < r.total)
                || sends.iter().any(|s| s.peer == p && s.done < s.total)
        };
        self.check_peers(involved)?;
        if ready == 0 && Instant::now() >= deadline {
            return Err(self.timed_out(desc, sends, recvs));
        }
        Ok(())
    }

    /// A timeout blames the peer a receive waits on, else the one a send waits on.
    fn timed_out(&self, desc: &OpDesc, sends: &[SendFlow], recvs: &[RecvFlow]) -> CommError {
        let peer = recvs
            .iter()
            .find(|r| r.done < r.total)
            .map(|r| r.peer)
            .or_else(|| sends.iter().find(|s| s.done < s.total).map(|s| s.peer))
            .unwrap_or(self.rank);
        CommError::Timeout {
            seq: desc.seq,
            op: desc.kind.name().to_string(),
            peer,
            seconds: self.timeout.as_secs_f64(),
        }
    }
}
