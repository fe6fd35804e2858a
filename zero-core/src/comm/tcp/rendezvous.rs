//! Rendezvous: rank 0 listens at the master address, every rank tells it where its own listener
//! is, rank 0 answers with the table, and every pair of ranks connects (a full mesh of a data and
//! a control connection).

use super::link::Link;
use crate::comm::CommError;
use socket2::SockRef;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const HELLO_MAGIC: u32 = 0x5a52_4456; // "ZRDV"
const MESH_MAGIC: u32 = 0x5a4d_5348; // "ZMSH"

/// Socket settings of the mesh.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SocketTuning {
    /// SO_SNDBUF / SO_RCVBUF in bytes; `None` leaves the kernel's autotuning.
    pub buffer: Option<usize>,
}

fn setup(msg: impl std::fmt::Display) -> CommError {
    CommError::Setup(msg.to_string())
}

fn remaining(deadline: Instant) -> Result<Duration, CommError> {
    let now = Instant::now();
    if now >= deadline {
        return Err(setup("rendezvous timed out (are all ranks started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?)"));
    }
    Ok(deadline - now)
}

fn read_exact(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    what: &str,
) -> Result<(), CommError> {
    s.set_read_timeout(Some(remaining(deadline)?))
        .map_err(setup)?;
    s.read_exact(buf)
        .map_err(|e| setup(format!("rendezvous: reading {what}: {e}")))
}

fn read_u32s<const N: usize>(
    s: &mut TcpStream,
    deadline: Instant,
    what: &str,
) -> Result<[u32; N], CommError> {
    let mut raw = vec![0u8; 4 * N];
    read_exact(s, &mut raw, deadline, what)?;
    let mut out = [0u32; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u32::from_le_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]]);
    }
    Ok(out)
}

fn write_u32s(s: &mut TcpStream, words: &[u32]) -> Result<(), CommError> {
    let raw: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    s.write_all(&raw)
        .map_err(|e| setup(format!("rendezvous: sending: {e}")))
}

/// Accepts one connection before `deadline`.
fn accept(listener: &TcpListener, deadline: Instant) -> Result<TcpStream, CommError> {
    listener.set_nonblocking(true).map_err(setup)?;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(setup)?;
                return Ok(s);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                remaining(deadline)?;
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(setup(format!("rendezvous: accept failed: {e}"))),
        }
    }
}

/// Connects to `addr`, retrying while nobody listens yet, until `deadline`.
fn connect(addr: SocketAddr, deadline: Instant) -> Result<TcpStream, CommError> {
    loop {
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

fn tune(s: &TcpStream, tuning: SocketTuning) -> Result<(), CommError> {
    s.set_nodelay(true).map_err(setup)?;
    if let Some(size) = tuning.buffer {
        let sock = SockRef::from(s);
        // Best effort: the kernel caps the sizes at net.core.[rw]mem_max.
        let _ = sock.set_send_buffer_size(size);
        let _ = sock.set_recv_buffer_size(size);
    }
    Ok(())
}

fn ip_bytes(ip: IpAddr) -> [u32; 5] {
    match ip {
        IpAddr::V4(v4) => [4, u32::from_be_bytes(v4.octets()), 0, 0, 0],
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let w = |i: usize| u32::from_be_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            [6, w(0), w(4), w(8), w(12)]
        }
    }
}

fn ip_from(words: &[u32]) -> IpAddr {
    if words[0] == 4 {
        IpAddr::V4(Ipv4Addr::from(words[1]))
    } else {
        let mut o = [0u8; 16];
        for i in 0..4 {
            o[4 * i..4 * i + 4].copy_from_slice(&words[1 + i].to_be_bytes());
        }
        IpAddr::from(o)
    }
}

/// Builds the mesh of `rank` in a group of `world`; returns one link per peer.
pub(crate) fn connect_mesh(
    rank: usize,
    world: usize,
    master_addr: &str,
    master_port: u16,
    timeout: Duration,
    tuning: SocketTuning,
) -> Result<Vec<Option<Link>>, CommError> {
    if rank >= world {
        return Err(setup(format!(
            "rank {rank} is not below the world size {world}"
        )));
    }
    let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
    if world == 1 {
        return Ok(links);
    }
    let deadline = Instant::now() + timeout;
    let master = resolve(master_addr, master_port)?;
    let unspecified: IpAddr = if master.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    let listener = TcpListener::bind((unspecified, 0))
        .map_err(|e| setup(format!("cannot open a listening socket: {e}")))?;
    let my_port = listener.local_addr().map_err(setup)?.port() as u32;

    // 1. The address table, through rank 0.
    let table: Vec<SocketAddr> = if rank == 0 {
        let master_listener = TcpListener::bind((unspecified, master_port)).map_err(|e| {
            setup(format!(
                "rank 0 cannot listen on MASTER_PORT {master_port}: {e}"
            ))
        })?;
        let mut peers: Vec<Option<(TcpStream, SocketAddr)>> = (0..world).map(|_| None).collect();
        for _ in 1..world {
            let mut s = accept(&master_listener, deadline)?;
            let [magic, their_world, their_rank, port] =
                read_u32s::<4>(&mut s, deadline, "a rank's hello")?;
            let (their_world, their_rank) = (their_world as usize, their_rank as usize);
            if magic != HELLO_MAGIC {
                return Err(setup(format!(
                    "something that is not a rank connected to MASTER_PORT {master_port}"
                )));
            }
            if their_world != world {
                return Err(setup(format!(
                    "rank {their_rank} has WORLD_SIZE {their_world}, rank 0 has {world}"
                )));
            }
            if their_rank == 0 || their_rank >= world || peers[their_rank].is_some() {
                return Err(setup(format!(
                    "two ranks claim rank {their_rank} (or it is out of range)"
                )));
            }
            let ip = s.peer_addr().map_err(setup)?.ip();
            peers[their_rank] = Some((s, SocketAddr::new(ip, port as u16)));
        }
        let addrs: Vec<SocketAddr> = peers
            .iter()
            .map(|p| p.as_ref().map(|(_, a)| *a).unwrap_or(master))
            .collect();
        for (_, entry) in peers.iter_mut().enumerate().skip(1) {
            let Some((s, _)) = entry.as_mut() else {
                continue;
            };
            // Rank 0's address as this peer reached it.
            let me = SocketAddr::new(s.local_addr().map_err(setup)?.ip(), my_port as u16);
            let mut words = Vec::new();
            for (r, a) in addrs.iter().enumerate() {
                let a = if r == 0 { me } else { *a };
                words.extend_from_slice(&ip_bytes(a.ip()));
                words.push(a.port() as u32);
            }
            write_u32s(s, &words)?;
        }
        addrs
    } else {
        let mut s = connect(master, deadline)?;
        write_u32s(&mut s, &[HELLO_MAGIC, world as u32, rank as u32, my_port])?;
        let mut raw = vec![0u8; world * 6 * 4];
        read_exact(&mut s, &mut raw, deadline, "the address table from rank 0")?;
        let words: Vec<u32> = raw
            .chunks(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        words
            .chunks(6)
            .map(|w| SocketAddr::new(ip_from(&w[..5]), w[5] as u16))
            .collect()
    };

    // 2. The mesh: connect to lower ranks, accept from higher ones.
    let mut data: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut ctrl: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    for peer in 0..rank {
        for kind in 0..2u32 {
            let mut s = connect(table[peer], deadline)?;
            write_u32s(&mut s, &[MESH_MAGIC, rank as u32, kind])?;
            if kind == 0 {
                data[peer] = Some(s)
            } else {
                ctrl[peer] = Some(s)
            }
        }
    }
    for _ in 0..2 * (world - 1 - rank) {
        let mut s = accept(&listener, deadline)?;
        let [magic, peer, kind] = read_u32s::<3>(&mut s, deadline, "a peer's mesh hello")?;
        let peer = peer as usize;
        if magic != MESH_MAGIC || peer <= rank || peer >= world || kind > 1 {
            return Err(setup(
                "an unexpected connection reached this rank's mesh listener",
            ));
        }
        let slot = if kind == 0 {
            &mut data[peer]
        } else {
            &mut ctrl[peer]
        };
        if slot.replace(s).is_some() {
            return Err(setup(format!("rank {peer} connected twice")));
        }
    }
    for peer in (0..world).filter(|&p| p != rank) {
        let (Some(d), Some(c)) = (data[peer].take(), ctrl[peer].take()) else {
            return Err(setup(format!("no connection to rank {peer}")));
        };
        tune(&d, tuning)?;
        c.set_nodelay(true).map_err(setup)?;
        d.set_nonblocking(true).map_err(setup)?;
        c.set_nonblocking(true).map_err(setup)?;
        links[peer] = Some(Link::new(d, c));
    }
    Ok(links)
}
