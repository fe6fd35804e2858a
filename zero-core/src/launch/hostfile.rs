//! DeepSpeed's hostfile: one `hostname slots=N` line per node, `#` comments, blank lines.

use super::LaunchError;
use std::path::Path;

/// One node of a hostfile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    /// The host name, as written.
    pub name: String,
    /// Processes (ranks) to start on it.
    pub slots: usize,
}

/// Parses hostfile text; `origin` names the file in errors.
pub fn parse_hostfile(text: &str, origin: &str) -> Result<Vec<Host>, LaunchError> {
    let mut hosts: Vec<Host> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| LaunchError::Hostfile {
            file: origin.to_string(),
            line: i + 1,
            message: format!("{why} (in {raw:?}; expected `hostname slots=N`)"),
        };
        let mut words = line.split_whitespace();
        let name = words.next().ok_or_else(|| bad("no host name"))?;
        let slots = match words.next() {
            Some(w) => {
                let n = w
                    .strip_prefix("slots=")
                    .ok_or_else(|| bad("the second field is not slots=N"))?;
                n.parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| bad("slots must be a positive integer"))?
            }
            None => return Err(bad("missing slots=N")),
        };
        if words.next().is_some() {
            return Err(bad("unexpected text after slots=N"));
        }
        if hosts.iter().any(|h| h.name == name) {
            return Err(bad("this host is listed twice"));
        }
        hosts.push(Host {
            name: name.to_string(),
            slots,
        });
    }
    if hosts.is_empty() {
        return Err(LaunchError::Hostfile {
            file: origin.to_string(),
            line: 0,
            message: "no host listed".into(),
        });
    }
    Ok(hosts)
}

/// Reads and parses a hostfile.
pub fn read_hostfile(path: &Path) -> Result<Vec<Host>, LaunchError> {
    let text = crate::files::read_to_string(path, crate::files::SMALL).map_err(|e| LaunchError::Io {
        what: format!("reading hostfile {}", path.display()),
        message: e.to_string(),
    })?;
    parse_hostfile(&text, &path.display().to_string())
}

/// This machine's host name.
pub fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8(buf[..end].to_vec()).ok()
}

/// The index of `name` among `hosts`, comparing full names, then the part before the first dot;
/// else the host named `localhost` (or a loopback address), which is whatever machine reads the
/// file (DeepSpeed's single-node hostfiles say `localhost slots=8`).
pub fn find_host(hosts: &[Host], name: &str) -> Option<usize> {
    let short = |s: &str| s.split('.').next().unwrap_or(s).to_string();
    let loopback = |s: &str| s == "localhost" || s.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    hosts
        .iter()
        .position(|h| h.name == name)
        .or_else(|| hosts.iter().position(|h| short(&h.name) == short(name)))
        .or_else(|| hosts.iter().position(|h| loopback(&h.name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `localhost` (and a loopback address) is the machine reading the file, whatever its name.
    #[test]
    fn localhost_is_this_host() {
        for name in ["localhost", "127.0.0.1", "::1"] {
            let hosts = parse_hostfile(&format!("{name} slots=2\n"), "hf").unwrap();
            assert_eq!(find_host(&hosts, "vm"), Some(0), "{name}");
        }
        let hosts = parse_hostfile("worker-1 slots=2\nlocalhost slots=2\n", "hf").unwrap();
        assert_eq!(find_host(&hosts, "worker-1"), Some(0));
        assert_eq!(find_host(&hosts, "worker-9"), Some(1));
        let hosts = parse_hostfile("worker-1 slots=2\n", "hf").unwrap();
        assert_eq!(find_host(&hosts, "vm"), None);
    }

    #[test]
    fn parses_deepspeed_hostfiles() {
        let text = "# cluster\nworker-1 slots=4\n\nworker-2.example.org slots=2  # the small one\n";
        let hosts = parse_hostfile(text, "hf").unwrap();
        assert_eq!(
            hosts,
            vec![
                Host {
                    name: "worker-1".into(),
                    slots: 4
                },
                Host {
                    name: "worker-2.example.org".into(),
                    slots: 2
                }
            ]
        );
        assert_eq!(find_host(&hosts, "worker-2"), Some(1));
        assert_eq!(find_host(&hosts, "worker-1.example.org"), Some(0));
        assert_eq!(find_host(&hosts, "other"), None);
    }

    #[test]
    fn reports_the_bad_line() {
        let e = parse_hostfile("a slots=1\nb slots=zero\n", "hf").unwrap_err();
        assert!(matches!(e, LaunchError::Hostfile { line: 2, .. }), "{e}");
        let e = parse_hostfile("a 4\n", "hf").unwrap_err().to_string();
        assert!(e.contains("slots=N") && e.contains("hf:1"), "{e}");
        assert!(parse_hostfile("# nothing\n", "hf").is_err());
    }
}
