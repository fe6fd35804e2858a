//! Ranks as processes, collectives over TCP (like torch's gloo backend).
//!
//! Ranks that find themselves on the same host (same kernel and network namespace) connect
//! through Unix-domain sockets instead, unless ZERO_COMM_TRANSPORT=tcp or
//! [`TcpOptions::unix_on_same_host`] is off: same stream protocol, about half the kernel's work
//! per byte. Their data connections then become pipes fed by `vmsplice` (one copy per byte
//! instead of two), unless ZERO_COMM_PIPES=0.
//!
//! Rendezvous follows torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), or
//! Slurm's or Open MPI's through [`DistEnv::detect`]. Reductions run as a ring: a reduce-scatter
//! in which every rank forwards a chunk as soon as its part has been combined (pipelined at the
//! granularity of socket reads), then an all-gather around the same ring; for f32 the two phases
//! are one stream, the all-gather forwarding each reduced chunk while it still arrives. Each rank
//! sends and receives (n-1)/n of the buffer per phase, the bandwidth optimum. 16-bit buffers are
//! reduced in f32 (partial sums travel as f32, twice the bytes) so that the result is rounded
//! once; their all-gather phase moves 16-bit values. Over sockets (TCP, Unix), a ring step that
//! sends at least 4 MiB writes from a thread of its own while the collective's thread reads and
//! reduces, so neither direction of a link waits for the other (see `duplex`;
//! ZERO_COMM_DUPLEX=0 keeps both on one thread).
//!
//! Every collective starts with an exchange of headers (op, sequence number, dtype, length)
//! between all ranks, so a mismatch is seen by every rank before any payload moves.

mod duplex;
mod link;
mod pipe;
mod pump;
mod rendezvous;
mod stream;
mod subgroup;

use super::env::{timeout_from_env, DistEnv};
use super::op::{validate, OpDesc, OpKind, DESC_BYTES};
use super::reduce::{finish, widen, Element};
use super::threads::{into_flat, split};
use super::worker::{BackendState, Worker};
use super::{CommError, FlatBuffer, ProcessGroup, ReduceOp, Subject};
use half::{bf16, f16};
use link::Control;
use pump::{Mesh, RecvFlow, Seg, SendFlow, Sink};
use rendezvous::{connect_mesh, PeerHost, SocketTuning};
use std::ops::Range;
use std::time::Duration;

/// Options of a TCP group beyond its place in the job.
#[derive(Clone, Copy, Debug)]
pub struct TcpOptions {
    /// How long any wait (rendezvous, a collective without progress) may last.
    pub timeout: Duration,
    /// SO_SNDBUF and SO_RCVBUF of the data connections, in bytes (`None`: the kernel's
    /// autotuning; the kernel doubles what is asked and caps it at net.core.wmem_max /
    /// rmem_max). The default, 256 KiB, keeps the bytes in flight small enough to stay in the
    /// CPU caches between the sender's copy into the kernel and the receiver's copy out: over
    /// loopback it measured faster than 4 MiB or autotuning (see BENCHMARKS.md), and it still
    /// covers the bandwidth-delay product of a 10 Gb/s link with a 200 µs round trip.
    pub socket_buffer: Option<usize>,
    /// Reach peers on the same host (same kernel and network namespace) through Unix-domain
    /// sockets, which cost the kernel about half as much per byte as TCP over loopback.
    /// `TcpGroup::from_env` turns it off when ZERO_COMM_TRANSPORT=tcp.
    pub unix_on_same_host: bool,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            timeout: super::env::DEFAULT_TIMEOUT,
            socket_buffer: Some(256 << 10),
            unix_on_same_host: true,
        }
    }
}

/// How a rank reaches one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// A TCP connection.
    Tcp,
    /// A Unix-domain socket (the peer runs on the same host).
    Unix,
    /// A pair of pipes set up over a Unix-domain socket, fed by `vmsplice` (the peer runs on the
    /// same host): one copy per byte instead of two.
    Pipe,
}

/// Whether same-host data connections become pipes: yes unless ZERO_COMM_PIPES=0.
pub(crate) fn pipes_wanted() -> bool {
    std::env::var("ZERO_COMM_PIPES").map_or(true, |v| v.trim() != "0")
}

/// One rank of a group of processes connected over TCP (or Unix-domain sockets on one host).
pub struct TcpGroup {
    rank: usize,
    world: usize,
    transports: Vec<Option<Transport>>,
    worker: Worker<TcpRank>,
    /// How every member's host is reached, for [`TcpGroup::split`].
    hosts: Vec<PeerHost>,
    options: TcpOptions,
}

impl std::fmt::Debug for TcpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TcpGroup(rank {} of {})", self.rank, self.world)
    }
}

impl TcpGroup {
    /// Joins the group the environment describes ([`DistEnv::detect`]). `timeout` overrides
    /// ZERO_COMM_TIMEOUT_SECS (default 300 s).
    pub fn from_env(timeout: Option<Duration>) -> Result<Self, CommError> {
        let env = DistEnv::detect().map_err(|e| CommError::Setup(e.to_string()))?;
        let timeout = match timeout {
            Some(t) => t,
            None => timeout_from_env().map_err(|e| CommError::Setup(e.to_string()))?,
        };
        let forced_tcp = std::env::var("ZERO_COMM_TRANSPORT").is_ok_and(|v| v.trim().eq_ignore_ascii_case("tcp"));
        let options = TcpOptions {
            timeout,
            unix_on_same_host: !forced_tcp,
            ..TcpOptions::default()
        };
        Self::connect(env.rank, env.world_size, &env.master_addr, env.master_port, options)
    }

    /// Joins a group explicitly: rank 0 listens on `master_port` of the host `master_addr`
    /// names; every rank must call this with the same world size, master and port.
    pub fn connect(
        rank: usize,
        world: usize,
        master_addr: &str,
        master_port: u16,
        options: TcpOptions,
    ) -> Result<Self, CommError> {
        let tuning = SocketTuning {
            buffer: options.socket_buffer,
            unix_on_same_host: options.unix_on_same_host,
            pipes: options.unix_on_same_host && pipes_wanted(),
        };
        let (links, hosts) = connect_mesh(rank, world, master_addr, master_port, options.timeout, tuning)?;
        Self::from_links(rank, links, hosts, options)
    }

    /// The group over an established mesh.
    fn from_links(
        rank: usize,
        links: Vec<Option<link::Link>>,
        hosts: Vec<PeerHost>,
        options: TcpOptions,
    ) -> Result<Self, CommError> {
        let world = links.len();
        let transports = links
            .iter()
            .map(|l| {
                l.as_ref().map(|l| match l.data {
                    stream::Stream::Tcp(_) => Transport::Tcp,
                    stream::Stream::Unix(_) => Transport::Unix,
                    stream::Stream::Pipes(_) => Transport::Pipe,
                })
            })
            .collect();
        let state = TcpRank {
            mesh: Mesh::new(rank, links, options.timeout),
            world,
            seq: 0,
        };
        let worker = Worker::spawn(format!("zero-comm-tcp-rank{rank}"), state)?;
        Ok(TcpGroup {
            rank,
            world,
            transports,
            worker,
            hosts,
            options,
        })
    }
}

impl TcpGroup {
    /// How this rank reaches each peer (`None` at its own index).
    pub fn transports(&self) -> &[Option<Transport>] {
        &self.transports
    }
}

crate::comm::worker::process_group_on_worker!(TcpGroup);

/// The worker-side state of one rank.
struct TcpRank {
    mesh: Mesh,
    world: usize,
    seq: u64,
}

impl BackendState for TcpRank {
    fn run(
        &mut self,
        kind: OpKind,
        subject: Subject,
        buffer: FlatBuffer,
        reduce: Option<ReduceOp>,
        root: usize,
        out: Option<FlatBuffer>,
    ) -> Result<(FlatBuffer, Option<FlatBuffer>), CommError> {
        self.run_collective(kind, subject, buffer, reduce, root, out)
    }

    fn on_error(&mut self, error: &CommError) {
        let msg = Control::Abort(error.clone());
        for link in self.mesh.links.iter_mut().flatten() {
            link.send_ctrl(&msg, Duration::from_millis(200));
            // A peer blocked on this rank's data sees the end of the stream at once, and reads
            // the cause above; a peer that needs nothing more from this rank is not disturbed.
            let _ = link.data.close_write();
        }
    }

    fn on_exit(&mut self, reason: &str) {
        let msg = Control::Goodbye(reason.to_string());
        for link in self.mesh.links.iter_mut().flatten() {
            // Drain first: closing a socket with unread data resets it, which could destroy the
            // goodbye before the peer reads it.
            link.poll_ctrl();
            link.send_ctrl(&msg, Duration::from_millis(200));
            let _ = link.ctrl.shutdown(std::net::Shutdown::Write);
        }
    }
}

fn seg_of<T>(base: *mut T, r: &Range<usize>) -> Seg {
    // SAFETY: callers pass ranges inside the buffer `base` points into.
    Seg {
        ptr: unsafe { base.add(r.start) } as *mut u8,
        len: r.len() * std::mem::size_of::<T>(),
    }
}

impl TcpRank {
    fn next(&self) -> usize {
        (self.mesh.rank + 1) % self.world
    }

    fn prev(&self) -> usize {
        (self.mesh.rank + self.world - 1) % self.world
    }

    fn run_collective(
        &mut self,
        kind: OpKind,
        subject: Subject,
        buffer: FlatBuffer,
        reduce: Option<ReduceOp>,
        root: usize,
        out: Option<FlatBuffer>,
    ) -> Result<(FlatBuffer, Option<FlatBuffer>), CommError> {
        let world = self.world;
        let desc = OpDesc {
            kind,
            seq: self.seq,
            dtype: buffer.dtype(),
            len: buffer.len() as u64,
            reduce,
            root: root as u64,
            subject,
        };
        self.seq += 1;
        validate(kind, &buffer, world, root, out.as_ref())?;
        if world > 1 {
            self.exchange_headers(&desc)?;
        }
        match buffer {
            FlatBuffer::F32(v) => self.dispatch(&desc, v, out),
            FlatBuffer::F16(v) => self.dispatch::<f16>(&desc, v, out),
            FlatBuffer::BF16(v) => self.dispatch::<bf16>(&desc, v, out),
        }
    }

    /// Every rank sends its header to every other and checks what it receives.
    fn exchange_headers(&mut self, desc: &OpDesc) -> Result<(), CommError> {
        let rank = self.mesh.rank;
        self.mesh.check_peers(|_| true)?;
        let mut mine = desc.encode();
        let mut theirs = vec![[0u8; DESC_BYTES]; self.world];
        let peers: Vec<usize> = (0..self.world).filter(|&p| p != rank).collect();
        let mut sends: Vec<SendFlow> = peers
            .iter()
            .map(|&p| {
                SendFlow::new(
                    p,
                    vec![Seg {
                        ptr: mine.as_mut_ptr(),
                        len: DESC_BYTES,
                    }],
                    None,
                )
            })
            .collect();
        let mut recvs: Vec<RecvFlow> = peers
            .iter()
            .map(|&p| {
                let seg = Seg {
                    ptr: theirs[p].as_mut_ptr(),
                    len: DESC_BYTES,
                };
                RecvFlow::new(p, vec![seg], Sink::Copy)
            })
            .collect();
        self.mesh.pump(desc, &mut sends, &mut recvs)?;
        for &p in &peers {
            let Some(other) = OpDesc::decode(&theirs[p]) else {
                return Err(CommError::PeerLost {
                    seq: desc.seq,
                    op: desc.kind.name().to_string(),
                    peer: p,
                    reason: "it sent an unreadable header (its stream is out of step)".into(),
                });
            };
            desc.check(rank, p, &other)?;
        }
        Ok(())
    }

    fn dispatch<T: Element>(
        &mut self,
        desc: &OpDesc,
        v: Vec<T>,
        out: Option<FlatBuffer>,
    ) -> Result<(FlatBuffer, Option<FlatBuffer>), CommError> {
        let (world, rank) = (self.world, self.mesh.rank);
        let op = desc.reduce.unwrap_or(ReduceOp::Sum);
        match desc.kind {
            OpKind::AllReduce => {
                let ranges = split(v.len(), world);
                // The chunk this rank holds reduced after the ring reduce-scatter.
                let owned = (rank + 1) % world;
                match bytemuck::allocation::try_cast_vec::<T, f32>(v) {
                    Ok(mut work) => {
                        self.ring_all_reduce_f32(desc, &mut work, &ranges, op)?;
                        Ok((into_flat(work), None))
                    }
                    Err((_, mut v)) => {
                        let mut work = widen(&v);
                        self.ring_reduce_scatter(desc, &mut work, &ranges, rank, op)?;
                        let r = ranges[owned].clone();
                        finish(&mut work[r.clone()], op, world);
                        T::store(&work[r.clone()], &mut v[r]);
                        drop(work);
                        self.ring_all_gather(desc, &mut v, &ranges, owned)?;
                        Ok((into_flat(v), None))
                    }
                }
            }
            OpKind::ReduceScatter => {
                let c = v.len() / world;
                let ranges: Vec<Range<usize>> = (0..world).map(|i| i * c..(i + 1) * c).collect();
                let mine = ranges[rank].clone();
                // Starting one chunk back leaves this rank with its own chunk reduced.
                let first = (rank + world - 1) % world;
                let out = out.and_then(FlatBuffer::into_vec::<T>);
                // Without an output, the result stays in the input's allocation (see
                // `keep_range`); with one, it lands there and the input goes back.
                match bytemuck::allocation::try_cast_vec::<T, f32>(v) {
                    Ok(mut work) => {
                        self.ring_reduce_scatter(desc, &mut work, &ranges, first, op)?;
                        finish(&mut work[mine.clone()], op, world);
                        match out {
                            // T is f32 here: the store is a copy.
                            Some(mut o) => {
                                T::store(&work[mine], &mut o);
                                Ok((into_flat(o), Some(FlatBuffer::F32(work))))
                            }
                            None => Ok((FlatBuffer::F32(work).keep_range(mine), None)),
                        }
                    }
                    Err((_, mut v)) => {
                        let mut work = widen(&v);
                        self.ring_reduce_scatter(desc, &mut work, &ranges, first, op)?;
                        finish(&mut work[mine.clone()], op, world);
                        match out {
                            Some(mut o) => {
                                T::store(&work[mine], &mut o);
                                Ok((into_flat(o), Some(into_flat(v))))
                            }
                            None => {
                                T::store(&work[mine.clone()], &mut v[mine.clone()]);
                                drop(work);
                                Ok((into_flat(v).keep_range(mine), None))
                            }
                        }
                    }
                }
            }
            OpKind::AllGather => {
                let c = v.len();
                let ranges: Vec<Range<usize>> = (0..world).map(|i| i * c..(i + 1) * c).collect();
                let mut out = match out.and_then(FlatBuffer::into_vec::<T>) {
                    Some(v) => v,
                    None => vec![T::zeroed(); c * world],
                };
                out[ranges[rank].clone()].copy_from_slice(&v);
                self.ring_all_gather(desc, &mut out, &ranges, rank)?;
                Ok((into_flat(out), Some(into_flat(v))))
            }
            OpKind::Broadcast => {
                let mut v = v;
                self.chain_broadcast(desc, &mut v, desc.root as usize)?;
                Ok((into_flat(v), None))
            }
            OpKind::Barrier => Ok((into_flat(v), None)),
        }
    }

    /// Ring reduce-scatter of `work` cut in `ranges` (one per rank): this rank first sends chunk
    /// `first`, and ends with chunk `first + 1` holding the combination of every rank's values
    /// (before [`finish`]).
    fn ring_reduce_scatter(
        &mut self,
        desc: &OpDesc,
        work: &mut [f32],
        ranges: &[Range<usize>],
        first: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let n = self.world;
        if n == 1 {
            return Ok(());
        }
        let base = work.as_mut_ptr();
        let sends = (0..n - 1).map(|k| seg_of(base, &ranges[(first + n - k) % n])).collect();
        let recvs = (0..n - 1)
            .map(|k| seg_of(base, &ranges[(first + 2 * n - 1 - k) % n]))
            .collect();
        let head = ranges[first].len() * 4;
        let mut sends = [SendFlow::new(self.next(), sends, Some((head, 0)))];
        let mut recvs = [RecvFlow::new(self.prev(), recvs, Sink::Reduce(op))];
        self.mesh.pump(desc, &mut sends, &mut recvs)
    }

    /// Ring all-reduce of f32 values as one stream: the all-gather phase forwards each reduced
    /// chunk while it is still arriving, instead of waiting for the reduce-scatter to drain.
    fn ring_all_reduce_f32(
        &mut self,
        desc: &OpDesc,
        work: &mut [f32],
        ranges: &[Range<usize>],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (n, rank) = (self.world, self.mesh.rank);
        if n == 1 {
            finish(work, op, 1);
            return Ok(());
        }
        let base = work.as_mut_ptr();
        let chunk = |i: usize| seg_of(base, &ranges[i % n]);
        // Reduce-scatter starting from this rank's chunk leaves it owning chunk rank + 1, which
        // the all-gather then starts from; send byte h + x is always received byte x.
        let own = rank + 1;
        let sends: Vec<Seg> = (0..n - 1)
            .map(|k| chunk(rank + n - k))
            .chain((0..n - 1).map(|k| chunk(own + n - k)))
            .collect();
        let reduced: Vec<Seg> = (0..n - 1).map(|k| chunk(rank + 2 * n - 1 - k)).collect();
        let copied: Vec<Seg> = (0..n - 1).map(|k| chunk(own + 2 * n - 1 - k)).collect();
        let mut recv = RecvFlow::new(self.prev(), reduced, Sink::Reduce(op)).then_copy(copied);
        if op == ReduceOp::Avg {
            // The last reduced segment is the owned chunk: every contribution is in once it lands.
            recv = recv.finishing(n - 2, n);
        }
        let head = ranges[rank].len() * 4;
        let mut sends = [SendFlow::new(self.next(), sends, Some((head, 0)))];
        self.mesh.pump(desc, &mut sends, &mut [recv])
    }

    /// Ring all-gather: this rank holds chunk `own` of `buf` and receives all others.
    fn ring_all_gather<T: Element>(
        &mut self,
        desc: &OpDesc,
        buf: &mut [T],
        ranges: &[Range<usize>],
        own: usize,
    ) -> Result<(), CommError> {
        let n = self.world;
        if n == 1 {
            return Ok(());
        }
        let base = buf.as_mut_ptr();
        let sends = (0..n - 1).map(|k| seg_of(base, &ranges[(own + n - k) % n])).collect();
        let recvs = (0..n - 1)
            .map(|k| seg_of(base, &ranges[(own + 2 * n - 1 - k) % n]))
            .collect();
        let head = ranges[own].len() * std::mem::size_of::<T>();
        let mut sends = [SendFlow::new(self.next(), sends, Some((head, 0)))];
        let mut recvs = [RecvFlow::new(self.prev(), recvs, Sink::Copy)];
        self.mesh.pump(desc, &mut sends, &mut recvs)
    }

    /// Pipelined chain root → root+1 → …: each rank forwards bytes as they arrive.
    fn chain_broadcast<T: Element>(&mut self, desc: &OpDesc, buf: &mut [T], root: usize) -> Result<(), CommError> {
        let n = self.world;
        if n == 1 {
            return Ok(());
        }
        let pos = (self.mesh.rank + n - root) % n;
        let whole = seg_of(buf.as_mut_ptr(), &(0..buf.len()));
        let mut recvs = Vec::new();
        let mut sends = Vec::new();
        if pos > 0 {
            recvs.push(RecvFlow::new(self.prev(), vec![whole], Sink::Copy));
        }
        if pos < n - 1 {
            let gate = if pos > 0 { Some((0, 0)) } else { None };
            sends.push(SendFlow::new(self.next(), vec![whole], gate));
        }
        self.mesh.pump(desc, &mut sends, &mut recvs)
    }
}
