//! Finding this process's rank from the environment its launcher set.
//!
//! `zero launch` and torchrun set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK.
//! Slurm's `srun` and Open MPI's `mpirun` set their own variables; [`DistEnv::detect`] reads
//! whichever set is present, so a program starts the same way under all of them.

use std::time::Duration;

/// Port used when a launcher gives no MASTER_PORT (Slurm, Open MPI); torch's default too.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Collective timeout when ZERO_COMM_TIMEOUT_SECS is unset.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The variable that overrides [`DEFAULT_TIMEOUT`], in (fractional) seconds.
pub const TIMEOUT_VAR: &str = "ZERO_COMM_TIMEOUT_SECS";

/// Which launcher's variables were found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK (zero launch, torchrun).
    Torchrun,
    /// SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; master from MASTER_ADDR or
    /// SLURM_LAUNCH_NODE_IPADDR.
    Slurm,
    /// OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK; master from
    /// MASTER_ADDR.
    OpenMpi,
}

/// Why the environment does not describe a rank.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// No launcher's variables are set at all.
    #[error(
        "no distributed environment: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (or start \
         the program with `zero launch`, torchrun, srun or mpirun)"
    )]
    NoLauncher,
    /// A launcher was recognised but one of its variables is missing.
    #[error("{var} is not set, one of {launcher}")]
    Missing {
        /// The launcher whose variables were found.
        launcher: Launcher,
        /// The missing variable.
        var: &'static str,
    },
    /// A variable is set but cannot be used.
    #[error("{var}={value:?}: {reason}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What a valid value looks like.
        reason: String,
    },
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "the variables of torchrun and zero launch",
            Launcher::Slurm => "Slurm's variables",
            Launcher::OpenMpi => "Open MPI's variables",
        })
    }
}

/// This process's place in a distributed job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, in `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank among the processes of this node.
    pub local_rank: usize,
    /// Host of rank 0's rendezvous listener.
    pub master_addr: String,
    /// Port of rank 0's rendezvous listener.
    pub master_port: u16,
    /// Where the values came from.
    pub launcher: Launcher,
}

impl DistEnv {
    /// Reads the process environment.
    pub fn detect() -> Result<Self, EnvError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Whether the process environment launched this process as a rank: `None` where no
    /// launcher's variables are set, where Slurm's or Open MPI's lack one of theirs (the
    /// shell of an interactive allocation sets some), or where torchrun's lack one but say
    /// `WORLD_SIZE=1`; an error where a variable is set but
    /// unusable (`RANK=x`, `WORLD_SIZE=0`, a rank beyond the world) or torchrun's set is
    /// incomplete, which a program must not take for "not launched" and run alone.
    pub fn launched() -> Result<Option<Self>, EnvError> {
        Self::launched_from(|k| std::env::var(k).ok())
    }

    /// [`DistEnv::launched`], reading variables through `get`.
    pub fn launched_from(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, EnvError> {
        // torchrun's set left incomplete with a world of one process (a script's or an
        // image's leftover `RANK=0 WORLD_SIZE=1`) asks for no other rank.
        let alone = get("WORLD_SIZE").is_some_and(|w| w.trim() == "1");
        match Self::from_lookup(get) {
            Ok(env) => Ok(Some(env)),
            Err(EnvError::NoLauncher)
            | Err(EnvError::Missing {
                launcher: Launcher::Slurm | Launcher::OpenMpi,
                ..
            }) => Ok(None),
            Err(EnvError::Missing {
                launcher: Launcher::Torchrun,
                ..
            }) if alone => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads variables through `get` (the environment, or a map in tests).
    ///
    /// The torchrun set wins when RANK is present; then Slurm (SLURM_PROCID), then Open MPI
    /// (OMPI_COMM_WORLD_RANK).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let launcher = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            Launcher::Torchrun
        } else if get("SLURM_PROCID").is_some() {
            Launcher::Slurm
        } else if get("OMPI_COMM_WORLD_RANK").is_some() {
            Launcher::OpenMpi
        } else {
            return Err(EnvError::NoLauncher);
        };
        let need = |var: &'static str| get(var).ok_or(EnvError::Missing { launcher, var });
        let number = |var: &'static str, value: String| {
            value.trim().parse::<usize>().map_err(|_| EnvError::Invalid {
                var,
                value,
                reason: "expected a non-negative integer".into(),
            })
        };
        let port = |var: &'static str, value: String| {
            value.trim().parse::<u16>().map_err(|_| EnvError::Invalid {
                var,
                value,
                reason: "expected a port number (0-65535)".into(),
            })
        };
        let (rank_var, world_var, local_var) = match launcher {
            Launcher::Torchrun => ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
            Launcher::Slurm => ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
            Launcher::OpenMpi => (
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ),
        };
        let rank = number(rank_var, need(rank_var)?)?;
        let world_size = number(world_var, need(world_var)?)?;
        let local_rank = match (launcher, get(local_var)) {
            (_, Some(v)) => number(local_var, v)?,
            // torchrun always sets it; a hand-written environment is one node.
            (Launcher::Torchrun, None) => rank,
            (_, None) => {
                return Err(EnvError::Missing {
                    launcher,
                    var: local_var,
                })
            }
        };
        let master_addr = match launcher {
            Launcher::Slurm => {
                get("MASTER_ADDR")
                    .or_else(|| get("SLURM_LAUNCH_NODE_IPADDR"))
                    .ok_or(EnvError::Missing {
                        launcher,
                        var: "MASTER_ADDR",
                    })?
            }
            _ => need("MASTER_ADDR")?,
        };
        let master_port = match (launcher, get("MASTER_PORT")) {
            (_, Some(v)) => port("MASTER_PORT", v)?,
            (Launcher::Torchrun, None) => {
                return Err(EnvError::Missing {
                    launcher,
                    var: "MASTER_PORT",
                })
            }
            (_, None) => DEFAULT_MASTER_PORT,
        };
        if world_size == 0 || rank >= world_size {
            return Err(EnvError::Invalid {
                var: rank_var,
                value: rank.to_string(),
                reason: format!("must be below {world_var}={world_size}"),
            });
        }
        Ok(DistEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            launcher,
        })
    }
}

/// The most seconds a user's wait (a timeout, a grace period) may be: about 31 years. Longer
/// ones would overflow the clock's arithmetic where a deadline is computed.
pub const MAX_WAIT_SECS: f64 = 1e9;

/// A number of seconds a user gave (fractional, finite, ≥ 0, at most [`MAX_WAIT_SECS`]) as a
/// duration; the error says what would be valid.
pub fn parse_seconds(text: &str) -> Result<Duration, String> {
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|e| format!("{text:?} is not a number of seconds: {e}"))?;
    if !(0.0..=MAX_WAIT_SECS).contains(&secs) {
        return Err(format!(
            "{text}: expected a number of seconds from 0 to {MAX_WAIT_SECS:e} (about 31 years)"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The collective timeout: ZERO_COMM_TIMEOUT_SECS if set, else [`DEFAULT_TIMEOUT`].
pub fn timeout_from_env() -> Result<Duration, EnvError> {
    match std::env::var(TIMEOUT_VAR) {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(value) => match parse_seconds(&value) {
            Ok(d) if !d.is_zero() => Ok(d),
            Ok(_) => Err(EnvError::Invalid {
                var: TIMEOUT_VAR,
                value,
                reason: "expected a positive number of seconds".into(),
            }),
            Err(reason) => Err(EnvError::Invalid {
                var: TIMEOUT_VAR,
                value,
                reason,
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn torchrun_variables() {
        let e = DistEnv::from_lookup(env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.master_port), (3, 4, 1, 1234));
        assert_eq!(e.launcher, Launcher::Torchrun);
        let missing = DistEnv::from_lookup(env(&[("RANK", "0"), ("WORLD_SIZE", "2")]));
        assert_eq!(
            missing,
            Err(EnvError::Missing {
                launcher: Launcher::Torchrun,
                var: "MASTER_ADDR"
            })
        );
    }

    #[test]
    fn slurm_and_openmpi_variables() {
        let e = DistEnv::from_lookup(env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"),
        ]))
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (5, 8, 1));
        assert_eq!(
            (e.master_addr.as_str(), e.master_port),
            ("10.1.2.3", DEFAULT_MASTER_PORT)
        );
        let err = DistEnv::from_lookup(env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
        ]))
        .unwrap_err();
        assert!(err.to_string().contains("OMPI_COMM_WORLD_LOCAL_RANK"), "{err}");
        let bad = DistEnv::from_lookup(env(&[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("MASTER_ADDR", "h"),
        ]));
        assert!(matches!(
            bad,
            Err(EnvError::Invalid {
                var: "SLURM_PROCID",
                ..
            })
        ));
        assert_eq!(DistEnv::from_lookup(env(&[])), Err(EnvError::NoLauncher));
    }

    #[test]
    fn seconds_are_bounded_where_a_deadline_could_overflow() {
        assert_eq!(parse_seconds(" 2.5 "), Ok(Duration::from_millis(2500)));
        assert_eq!(parse_seconds("0"), Ok(Duration::ZERO));
        assert_eq!(parse_seconds("1e9"), Ok(Duration::from_secs(1_000_000_000)));
        // The longest wait still leaves a deadline the clock can hold.
        let longest = parse_seconds("1e9").unwrap();
        assert!(std::time::Instant::now().checked_add(longest).is_some());
        for bad in ["1e19", "1e300", "inf", "NaN", "-1", "ten"] {
            let err = parse_seconds(bad).unwrap_err();
            assert!(err.contains(bad) && err.contains("seconds"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_malformed_launch_is_an_error_and_not_a_run_alone() {
        let launched = |pairs: &[(&str, &str)]| DistEnv::launched_from(env(pairs));
        assert_eq!(launched(&[]), Ok(None));
        // An interactive allocation's shell: Slurm's rank without the rest.
        assert_eq!(launched(&[("SLURM_PROCID", "0")]), Ok(None));
        let full = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
        ];
        assert_eq!(launched(&full).unwrap().map(|e| e.rank), Some(1));
        for (var, bad) in [
            ("RANK", "x"),
            ("RANK", "5"),
            ("WORLD_SIZE", "0"),
            ("MASTER_PORT", "abc"),
        ] {
            let pairs: Vec<(&str, &str)> = full.iter().map(|&(k, v)| (k, if k == var { bad } else { v })).collect();
            let err = launched(&pairs).expect_err(&format!("{var}={bad}")).to_string();
            assert!(err.contains(var), "{var}={bad}: {err}");
        }
        let err = launched(&[("RANK", "0")]).unwrap_err();
        assert!(
            matches!(
                err,
                EnvError::Missing {
                    launcher: Launcher::Torchrun,
                    ..
                }
            ),
            "{err}"
        );
        // A one-process leftover asks for no other rank.
        assert_eq!(launched(&[("RANK", "0"), ("WORLD_SIZE", "1")]), Ok(None));
    }
}
