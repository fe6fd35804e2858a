//! A port for rank 0 to listen on, chosen by the launcher when the user names none.
//!
//! A port the kernel hands out for `bind(0)` comes from the ephemeral range, the same range it
//! draws the local ports of outgoing connections from; between choosing it and rank 0 listening
//! on it, any connection on the host (another job's ranks, a test beside this one) may take it,
//! and rank 0 then fails with "address in use". A port below that range is never given to an
//! outgoing connection, so only a listener can take it; one is chosen at random there and checked
//! free by binding it.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;

/// The lowest port chosen; below it sit well-known services.
const LOWEST: u16 = 20000;

/// Where Linux's ephemeral range begins when it cannot be read (its default).
const DEFAULT_EPHEMERAL_START: u16 = 32768;

/// The first port of the kernel's ephemeral range.
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(DEFAULT_EPHEMERAL_START)
}

/// A random number, different in every call and every process.
fn random() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// A port free a moment ago and outside the kernel's ephemeral range where the range leaves room
/// below it; otherwise one the kernel picks.
pub fn free_port() -> std::io::Result<u16> {
    let end = ephemeral_start();
    if end > LOWEST + 1000 {
        let span = u64::from(end - LOWEST);
        for _ in 0..64 {
            let port = LOWEST + (random() % span) as u16;
            if TcpListener::bind(("0.0.0.0", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(TcpListener::bind(("0.0.0.0", 0))?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chosen_port_is_below_the_ephemeral_range_and_bindable() {
        let end = ephemeral_start();
        for _ in 0..20 {
            let port = free_port().unwrap();
            if end > LOWEST + 1000 {
                assert!((LOWEST..end).contains(&port), "{port} outside {LOWEST}..{end}");
            }
            TcpListener::bind(("0.0.0.0", port)).unwrap();
        }
    }
}
