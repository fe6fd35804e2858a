//! Subgroups of a TCP group, each with connections of its own.
//!
//! A subgroup needs no rendezvous of its own: every rank opens fresh listeners, one all-gather
//! over the parent group tells every rank where the others listen, and each subgroup connects
//! its members as the parent's rendezvous did. Since the subgroup's collectives travel on their
//! own connections and worker thread, they run concurrently with the parent's and the other
//! subgroups' without any multiplexing, and a failure in one surfaces there, with its own
//! sequence numbers, like in any group.

use super::rendezvous::{connect_submesh, split_unix_name, subgroup_entry, MeshListeners, SocketTuning};
use super::{CommError, FlatBuffer, ProcessGroup, TcpGroup};
use std::net::IpAddr;

/// Fields each rank announces in the split's all-gather.
const ANNOUNCE: usize = 5;

fn invalid(message: String) -> CommError {
    CommError::InvalidArgument {
        op: "split".into(),
        message,
    }
}

/// A 24-bit fingerprint of a partition, exact in an f32, so that ranks which were given
/// different partitions find out before connecting anything.
fn fingerprint(groups: &[Vec<usize>]) -> u32 {
    // FNV-1a over the members, with a separator between groups.
    let mut h: u32 = 0x811c_9dc5;
    for g in groups {
        for &m in g.iter().chain(std::iter::once(&usize::MAX)) {
            for b in (m as u64).to_le_bytes() {
                h ^= u32::from(b);
                h = h.wrapping_mul(0x0100_0193);
            }
        }
    }
    h & 0x00ff_ffff
}

impl TcpGroup {
    /// Splits this group into the subgroups `groups` (each a list of this group's ranks, in the
    /// subgroup's rank order; together a partition of the group) and returns this rank's.
    ///
    /// A collective: every rank must call it with the same partition, in the same place of its
    /// sequence of collectives. Different partitions on different ranks are reported on every
    /// rank before any connection is made.
    ///
    /// ```no_run
    /// use zero_core::comm::{ProcessGroup, TcpGroup};
    ///
    /// let world = TcpGroup::from_env(None).unwrap(); // 4 ranks
    /// let pairs = world.split(&[vec![0, 1], vec![2, 3]]).unwrap();
    /// assert_eq!(pairs.world_size(), 2);
    /// ```
    pub fn split(&self, groups: &[Vec<usize>]) -> Result<TcpGroup, CommError> {
        let world = self.world;
        let mut seen = vec![false; world];
        for g in groups {
            for &m in g {
                if m >= world {
                    return Err(invalid(format!("rank {m} is not a rank of this group of {world}")));
                }
                if std::mem::replace(&mut seen[m], true) {
                    return Err(invalid(format!("rank {m} is in two subgroups")));
                }
            }
        }
        if let Some(missing) = seen.iter().position(|&s| !s) {
            return Err(invalid(format!("rank {missing} is in no subgroup")));
        }
        let (members, local) = groups
            .iter()
            .find_map(|g| g.iter().position(|&m| m == self.rank).map(|i| (g, i)))
            .ok_or_else(|| invalid(format!("rank {} is in no subgroup", self.rank)))?;

        let ipv6 = self.hosts[self.rank].ip.parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv6());
        let (listeners, port) = MeshListeners::open(self.rank, ipv6, self.options.unix_on_same_host)?;
        let pid = std::process::id();
        let mine = [
            f32::from(port),
            (pid >> 16) as f32,
            (pid & 0xffff) as f32,
            fingerprint(groups) as f32,
            if listeners.has_unix() { 1.0 } else { 0.0 },
        ];
        let all = self.all_gather(FlatBuffer::F32(mine.to_vec()))?.into_f32();
        let field = |r: usize, i: usize| all[r * ANNOUNCE + i];
        if let Some(other) = (0..world).find(|&r| field(r, 3) != mine[3]) {
            return Err(CommError::Setup(format!(
                "split: rank {other} split the group into other subgroups than rank {} did",
                self.rank
            )));
        }
        let table = members
            .iter()
            .enumerate()
            .map(|(i, &m)| {
                let port = field(m, 0) as u16;
                let pid = ((field(m, 1) as u32) << 16) | field(m, 2) as u32;
                let unix = if field(m, 4) == 1.0 {
                    split_unix_name(pid, m, port)
                } else {
                    String::new()
                };
                subgroup_entry(members.len(), i, &self.hosts[m], port, unix)
            })
            .collect();
        let tuning = SocketTuning {
            buffer: self.options.socket_buffer,
            unix_on_same_host: self.options.unix_on_same_host,
            pipes: self.options.unix_on_same_host && super::pipes_wanted(),
        };
        let links = connect_submesh(local, table, listeners, self.options.timeout, tuning)?;
        let hosts = members.iter().map(|&m| self.hosts[m].clone()).collect();
        TcpGroup::from_links(local, links, hosts, self.options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_tells_partitions_apart_and_fits_an_f32() {
        let a = fingerprint(&[vec![0, 1], vec![2, 3]]);
        let b = fingerprint(&[vec![0, 2], vec![1, 3]]);
        let c = fingerprint(&[vec![0, 1, 2], vec![3]]);
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_eq!(a, fingerprint(&[vec![0, 1], vec![2, 3]]));
        assert_eq!(a as f32 as u32, a, "24 bits survive the trip through f32");
    }
}
