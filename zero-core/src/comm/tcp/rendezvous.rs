//! Rendezvous: rank 0 listens at the master address, every rank tells it where its own listeners
//! are, rank 0 answers with the table, and every pair of ranks connects (a full mesh of a data and
//! a control connection). Ranks on the same host (same kernel and network namespace) connect
//! through Unix-domain sockets, others through TCP.

use super::link::Link;
use super::pipe::Pipes;
use super::stream::Stream;
use crate::comm::CommError;
use socket2::SockRef;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

const MESH_MAGIC: u32 = 0x5a4d_5348; // "ZMSH"

/// Socket settings of the mesh.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SocketTuning {
    /// SO_SNDBUF / SO_RCVBUF in bytes; `None` leaves the kernel's autotuning.
    pub buffer: Option<usize>,
    /// Connect to peers on the same host through Unix-domain sockets.
    pub unix_on_same_host: bool,
    /// Upgrade those Unix-domain data connections to pipes (both sides must want it).
    pub pipes: bool,
}

/// What a rank tells rank 0, and rank 0 tells everyone: how to reach each rank.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Entry {
    world: usize,
    rank: usize,
    /// Address of the rank's TCP listener (rank 0 fills in the IP it saw).
    ip: String,
    port: u16,
    /// Same value ⇔ same kernel and network namespace, where abstract Unix sockets are shared.
    host: String,
    /// Abstract Unix socket name of the rank's listener (empty: none).
    unix: String,
}

fn setup(msg: impl std::fmt::Display) -> CommError {
    CommError::Setup(msg.to_string())
}

fn remaining(deadline: Instant) -> Result<Duration, CommError> {
    let now = Instant::now();
    if now >= deadline {
        return Err(setup(
            "rendezvous timed out (are all ranks started, with the same MASTER_ADDR, MASTER_PORT \
             and WORLD_SIZE?)",
        ));
    }
    Ok(deadline - now)
}

/// This host's identity for [`Entry::host`]: the boot id and the network namespace.
fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    if boot.trim().is_empty() || netns.is_empty() {
        // Unknown: never match another rank, fall back to TCP.
        return format!("unknown-{}", std::process::id());
    }
    format!("{}/{}", boot.trim(), netns)
}

fn send_frame(s: &mut TcpStream, value: &impl serde::Serialize) -> Result<(), CommError> {
    let body = serde_json::to_vec(value).map_err(setup)?;
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    s.write_all(&frame)
        .map_err(|e| setup(format!("rendezvous: sending: {e}")))
}

fn recv_frame<T: serde::de::DeserializeOwned>(
    s: &mut TcpStream,
    deadline: Instant,
    what: &str,
) -> Result<T, CommError> {
    s.set_read_timeout(Some(remaining(deadline)?)).map_err(setup)?;
    let mut len = [0u8; 4];
    s.read_exact(&mut len)
        .map_err(|e| setup(format!("rendezvous: reading {what}: {e}")))?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 64 << 20 {
        return Err(setup(format!(
            "rendezvous: {what} claims {len} bytes: not a rank of this group"
        )));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)
        .map_err(|e| setup(format!("rendezvous: reading {what}: {e}")))?;
    serde_json::from_slice(&body).map_err(|e| {
        setup(format!(
            "rendezvous: {what} is unreadable ({e}); is something else using MASTER_PORT?"
        ))
    })
}

/// How long a rendezvous waits for its peers before it says so.
const NOTICE_AFTER: Duration = Duration::from_secs(10);

/// A line said once on stderr when the rendezvous has waited [`NOTICE_AFTER`] for its peers,
/// where its timeout is long enough (a minute or more: the default is 300 s) that the silence
/// would look like a hang; shorter ones end with their error soon enough.
struct Notice {
    at: Instant,
    /// What to say; `None` once said, or for a wait that never speaks.
    line: Option<String>,
}

impl Notice {
    fn new(timeout: Duration, line: String) -> Self {
        Notice {
            at: Instant::now() + NOTICE_AFTER,
            line: (timeout >= Duration::from_secs(60)).then_some(line),
        }
    }

    /// One that never speaks (the mesh's own connections, after the rendezvous).
    fn silent() -> Self {
        Notice {
            at: Instant::now(),
            line: None,
        }
    }

    /// What to say if the wait goes on (unless already said).
    fn set(&mut self, line: String) {
        if let Some(l) = &mut self.line {
            *l = line;
        }
    }

    fn poll(&mut self) {
        if Instant::now() >= self.at {
            if let Some(line) = self.line.take() {
                eprintln!("{line}");
            }
        }
    }
}

/// Accepts one connection on either listener before `deadline`.
fn accept(
    tcp: &TcpListener,
    unix: Option<&UnixListener>,
    deadline: Instant,
    notice: &mut Notice,
) -> Result<Stream, CommError> {
    tcp.set_nonblocking(true).map_err(setup)?;
    if let Some(u) = unix {
        u.set_nonblocking(true).map_err(setup)?;
    }
    loop {
        match tcp.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(setup)?;
                return Ok(Stream::Tcp(s));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(setup(format!("rendezvous: accept failed: {e}"))),
        }
        if let Some(u) = unix {
            match u.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false).map_err(setup)?;
                    return Ok(Stream::Unix(s));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(setup(format!("rendezvous: accept failed: {e}"))),
            }
        }
        remaining(deadline)?;
        notice.poll();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Connects to `addr`, retrying while nobody listens yet, until `deadline`.
fn connect(addr: SocketAddr, deadline: Instant, notice: &mut Notice) -> Result<TcpStream, CommError> {
    loop {
        notice.poll();
        let wait = remaining(deadline)?.min(Duration::from_secs(5));
        match TcpStream::connect_timeout(&addr, wait) {
            Ok(s) => return Ok(s),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionRefused | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(setup(format!("rendezvous: cannot connect to {addr}: {e}"))),
        }
    }
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr, CommError> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| setup(format!("cannot resolve MASTER_ADDR {host:?}: {e}")))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| setup(format!("MASTER_ADDR {host:?} resolves to no address")))
}

fn tune(s: &Stream, tuning: SocketTuning) -> Result<(), CommError> {
    s.set_nodelay().map_err(setup)?;
    if let Some(size) = tuning.buffer {
        let sock = SockRef::from(s);
        // Best effort: the kernel caps the sizes at net.core.[rw]mem_max.
        let _ = sock.set_send_buffer_size(size);
        let _ = sock.set_recv_buffer_size(size);
    }
    Ok(())
}

fn write_hello(s: &mut Stream, rank: usize, kind: u32) -> Result<(), CommError> {
    let words: Vec<u8> = [MESH_MAGIC, rank as u32, kind]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    (&*s)
        .write_all(&words)
        .map_err(|e| setup(format!("rendezvous: sending a mesh hello: {e}")))
}

fn read_hello(s: &mut Stream, deadline: Instant) -> Result<(u32, usize, u32), CommError> {
    s.set_read_timeout(Some(remaining(deadline)?)).map_err(setup)?;
    let mut raw = [0u8; 12];
    (&*s)
        .read_exact(&mut raw)
        .map_err(|e| setup(format!("rendezvous: reading a mesh hello: {e}")))?;
    let w = |i: usize| u32::from_le_bytes([raw[i], raw[i + 1], raw[i + 2], raw[i + 3]]);
    Ok((w(0), w(4) as usize, w(8)))
}

/// How the rest of the job reaches one rank's host: what a group's subgroups need to connect
/// without a rendezvous of their own.
#[derive(Clone, Debug)]
pub(crate) struct PeerHost {
    /// The rank's IP as this rank reaches it.
    pub ip: String,
    /// Host identity (see [`Entry::host`]).
    pub host: String,
}

/// Builds the mesh of `rank` in a group of `world`; returns one link per peer and how each
/// rank's host is reached.
pub(crate) fn connect_mesh(
    rank: usize,
    world: usize,
    master_addr: &str,
    master_port: u16,
    timeout: Duration,
    tuning: SocketTuning,
) -> Result<(Vec<Option<Link>>, Vec<PeerHost>), CommError> {
    if rank >= world {
        return Err(setup(format!("rank {rank} is not below the world size {world}")));
    }
    if world == 1 {
        let me = PeerHost {
            ip: String::new(),
            host: host_identity(),
        };
        return Ok((vec![None], vec![me]));
    }
    let deadline = Instant::now() + timeout;
    let master = resolve(master_addr, master_port)?;
    let unspecified: IpAddr = if master.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    let listener =
        TcpListener::bind((unspecified, 0)).map_err(|e| setup(format!("cannot open a listening socket: {e}")))?;
    let my_port = listener.local_addr().map_err(setup)?.port();
    let host = host_identity();
    // An abstract name: nothing to clean up in the file system, unique per process.
    let unix_name = format!("zero-comm-{}-{rank}-{master_port}", std::process::id());
    let unix_listener = if tuning.unix_on_same_host {
        UnixAddr::from_abstract_name(unix_name.as_bytes())
            .and_then(|a| UnixListener::bind_addr(&a))
            .ok()
    } else {
        None
    };
    let me = Entry {
        world,
        rank,
        ip: String::new(),
        port: my_port,
        host: host.clone(),
        unix: if unix_listener.is_some() {
            unix_name
        } else {
            String::new()
        },
    };

    // 1. The address table, through rank 0.
    let table: Vec<Entry> = if rank == 0 {
        let master_listener = TcpListener::bind((unspecified, master_port))
            .map_err(|e| setup(format!("rank 0 cannot listen on MASTER_PORT {master_port}: {e}")))?;
        let mut table: Vec<Option<Entry>> = (0..world).map(|_| None).collect();
        let mut conns: Vec<TcpStream> = Vec::new();
        let waiting = |joined: usize| {
            format!(
                "rank 0: waiting on port {master_port} for {} more of the {world} ranks to join (the rendezvous \
                 gives up {} s after it began; ZERO_COMM_TIMEOUT_SECS sets that)",
                world - joined,
                timeout.as_secs()
            )
        };
        let mut notice = Notice::new(timeout, waiting(1));
        for joined in 1..world {
            notice.set(waiting(joined));
            let Stream::Tcp(mut s) = accept(&master_listener, None, deadline, &mut notice)? else {
                return Err(setup("rendezvous: unexpected connection type"));
            };
            let mut e: Entry = recv_frame(&mut s, deadline, "a rank's hello")?;
            if e.world != world {
                return Err(setup(format!(
                    "rank {} has WORLD_SIZE {}, rank 0 has {world}",
                    e.rank, e.world
                )));
            }
            if e.rank == 0 || e.rank >= world || table[e.rank].is_some() {
                return Err(setup(format!(
                    "two ranks claim rank {} (or it is out of range)",
                    e.rank
                )));
            }
            e.ip = s.peer_addr().map_err(setup)?.ip().to_string();
            let r = e.rank;
            table[r] = Some(e);
            conns.push(s);
        }
        table[0] = Some(Entry {
            ip: master.ip().to_string(),
            ..me.clone()
        });
        let table: Vec<Entry> = table.into_iter().flatten().collect();
        for s in conns.iter_mut() {
            // Rank 0's IP as this peer reached it.
            let mut view = table.clone();
            view[0].ip = s.local_addr().map_err(setup)?.ip().to_string();
            send_frame(s, &view)?;
        }
        table
    } else {
        let mut notice = Notice::new(
            timeout,
            format!(
                "rank {rank}: waiting to reach rank 0 at {master} (MASTER_ADDR, MASTER_PORT; the rendezvous gives up \
                 {} s after it began; ZERO_COMM_TIMEOUT_SECS sets that)",
                timeout.as_secs()
            ),
        );
        let mut s = connect(master, deadline, &mut notice)?;
        send_frame(&mut s, &me)?;
        let table: Vec<Entry> = recv_frame(&mut s, deadline, "the address table from rank 0")?;
        if table.len() != world {
            return Err(setup(format!(
                "rank 0 sent a table of {} ranks, expected {world}",
                table.len()
            )));
        }
        table
    };

    let hosts = table
        .iter()
        .map(|e| PeerHost {
            ip: e.ip.clone(),
            host: e.host.clone(),
        })
        .collect();
    let mine = MeshListeners {
        tcp: listener,
        unix: unix_listener,
    };
    let links = mesh_from_table(rank, &table, &host, mine, deadline, tuning)?;
    Ok((links, hosts))
}

/// A rank's listeners for the mesh connections of its peers.
pub(crate) struct MeshListeners {
    tcp: TcpListener,
    unix: Option<UnixListener>,
}

impl MeshListeners {
    /// Opens a TCP listener on an ephemeral port (on every interface of `ip`'s family) and,
    /// when `unix_on_same_host`, an abstract Unix-domain listener named after the process,
    /// `rank` and that port. Returns them with the port and the Unix name (empty: none).
    pub(crate) fn open(rank: usize, ipv6: bool, unix_on_same_host: bool) -> Result<(Self, u16), CommError> {
        let unspecified: IpAddr = if ipv6 {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        } else {
            Ipv4Addr::UNSPECIFIED.into()
        };
        let tcp =
            TcpListener::bind((unspecified, 0)).map_err(|e| setup(format!("cannot open a listening socket: {e}")))?;
        let port = tcp.local_addr().map_err(setup)?.port();
        let unix = if unix_on_same_host {
            UnixAddr::from_abstract_name(split_unix_name(std::process::id(), rank, port).as_bytes())
                .and_then(|a| UnixListener::bind_addr(&a))
                .ok()
        } else {
            None
        };
        Ok((MeshListeners { tcp, unix }, port))
    }

    /// Whether a Unix-domain listener is open.
    pub(crate) fn has_unix(&self) -> bool {
        self.unix.is_some()
    }
}

/// The abstract Unix socket name of a subgroup listener, derivable by every peer that knows the
/// process id, the world rank and the listener's TCP port.
pub(crate) fn split_unix_name(pid: u32, rank: usize, port: u16) -> String {
    format!("zero-comm-split-{pid}-{rank}-{port}")
}

/// How a subgroup member is reached: built from the world's [`PeerHost`] and what the member
/// announced for the subgroup.
pub(crate) fn subgroup_entry(world: usize, rank: usize, peer: &PeerHost, port: u16, unix: String) -> SubEntry {
    SubEntry(Entry {
        world,
        rank,
        ip: peer.ip.clone(),
        port,
        host: peer.host.clone(),
        unix,
    })
}

/// One row of a subgroup's address table.
pub(crate) struct SubEntry(Entry);

/// Builds the mesh of a subgroup whose address table every member already has: local rank
/// `rank` connects to the lower members and accepts the higher ones on `mine`.
pub(crate) fn connect_submesh(
    rank: usize,
    table: Vec<SubEntry>,
    mine: MeshListeners,
    timeout: Duration,
    tuning: SocketTuning,
) -> Result<Vec<Option<Link>>, CommError> {
    let table: Vec<Entry> = table.into_iter().map(|e| e.0).collect();
    if table.len() <= 1 {
        return Ok(vec![None]);
    }
    let deadline = Instant::now() + timeout;
    mesh_from_table(rank, &table, &host_identity(), mine, deadline, tuning)
}

/// Phase 2 of a rendezvous: with every rank's address known, connect to lower ranks and accept
/// from higher ones (a data and a control connection per pair).
fn mesh_from_table(
    rank: usize,
    table: &[Entry],
    host: &str,
    mine: MeshListeners,
    deadline: Instant,
    tuning: SocketTuning,
) -> Result<Vec<Option<Link>>, CommError> {
    let world = table.len();
    let MeshListeners {
        tcp: listener,
        unix: unix_listener,
    } = mine;
    let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
    let mut data: Vec<Option<Stream>> = (0..world).map(|_| None).collect();
    let mut ctrl: Vec<Option<Stream>> = (0..world).map(|_| None).collect();
    // Per peer: whichever side connected asked for pipes.
    let mut asked_pipes = vec![false; world];
    for peer in 0..rank {
        let e = &table[peer];
        for kind in 0..2u32 {
            let local = e.host == host && !e.unix.is_empty() && tuning.unix_on_same_host;
            let unix = if local {
                UnixAddr::from_abstract_name(e.unix.as_bytes())
                    .and_then(|a| UnixStream::connect_addr(&a))
                    .ok()
            } else {
                None
            };
            let mut s = match unix {
                Some(u) => Stream::Unix(u),
                None => {
                    let ip: IpAddr =
                        e.ip.parse()
                            .map_err(|_| setup(format!("rank {peer} has an unreadable address {:?}", e.ip)))?;
                    Stream::Tcp(connect(SocketAddr::new(ip, e.port), deadline, &mut Notice::silent())?)
                }
            };
            // Kind 2: a data connection that would rather be pipes.
            let asked = kind == 0 && tuning.pipes && matches!(s, Stream::Unix(_));
            write_hello(&mut s, rank, if asked { 2 } else { kind })?;
            asked_pipes[peer] |= asked;
            if kind == 0 {
                data[peer] = Some(s)
            } else {
                ctrl[peer] = Some(s)
            }
        }
    }
    for _ in 0..2 * (world - 1 - rank) {
        let mut s = accept(&listener, unix_listener.as_ref(), deadline, &mut Notice::silent())?;
        let (magic, peer, kind) = read_hello(&mut s, deadline)?;
        if magic != MESH_MAGIC || peer <= rank || peer >= world || kind > 2 {
            return Err(setup("an unexpected connection reached this rank's mesh listener"));
        }
        if kind == 2 {
            asked_pipes[peer] = true;
        }
        let slot = if kind == 1 { &mut ctrl[peer] } else { &mut data[peer] };
        if slot.replace(s).is_some() {
            return Err(setup(format!("rank {peer} connected twice")));
        }
    }
    for peer in (0..world).filter(|&p| p != rank) {
        let (Some(d), Some(c)) = (data[peer].take(), ctrl[peer].take()) else {
            return Err(setup(format!("no connection to rank {peer}")));
        };
        tune(&d, tuning)?;
        let d = match d {
            Stream::Unix(u) if asked_pipes[peer] => {
                let failed = |e: std::io::Error| setup(format!("rendezvous: pipes to rank {peer}: {e}"));
                let pipes = if peer < rank {
                    Pipes::answer(&u, deadline).map_err(failed)?
                } else if tuning.pipes {
                    Some(Pipes::offer(&u, deadline).map_err(failed)?)
                } else {
                    Pipes::decline(&u).map_err(failed)?;
                    None
                };
                match pipes {
                    Some(p) => Stream::Pipes(p),
                    None => Stream::Unix(u),
                }
            }
            d => d,
        };
        c.set_nodelay().map_err(setup)?;
        d.set_read_timeout(None).map_err(setup)?;
        c.set_read_timeout(None).map_err(setup)?;
        d.set_nonblocking(true).map_err(setup)?;
        c.set_nonblocking(true).map_err(setup)?;
        links[peer] = Some(Link::new(d, c));
    }
    Ok(links)
}
