//! The agent connection a snapshot keeps, and how a restored sandbox gets its first one.
//!
//! The VMM's vsock device keeps the quiet, established, host-initiated connections of a VM in
//! its snapshot (snapshot format 2, `docs/architecture.md` → devices → vsock). A restore holds
//! them *detached*, and a host client that sends `ATTACH <port> <host port>` takes one over: the
//! agent's worker that was blocked reading that socket when the snapshot was taken simply gets
//! the client's first request — no transport reset, no RST, no `accept` in the guest.
//!
//! Whoever takes a snapshot while holding an idle agent connection (the template build, the
//! runtime's pause/fork/named snapshots, [`crate::Sandbox::snapshot`]) records that connection
//! in the snapshot directory ([`RECORD_FILE`]); a restore that finds the record attaches to
//! exactly that connection and uses it as its first agent client. A snapshot without a record
//! (templates built before this existed, snapshots taken by other tools) gets a new connection
//! as before (`CONNECT`, which also resets any connection the snapshot kept to that port).

use std::io;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use ember_agent::client::{Client, ClientError};
use serde::{Deserialize, Serialize};

/// The record's file name in a snapshot directory.
pub const RECORD_FILE: &str = "ember-agent-link.json";

/// An idle agent connection that a snapshot kept (what [`RECORD_FILE`] holds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeptConnection {
    /// The guest port (the agent's).
    pub port: u32,
    /// The connection's host port (what `OK <host port>` said when it was made).
    pub host_port: u32,
}

/// Reads the record of the snapshot in `dir`: `None` when there is none (or it cannot be
/// read: the restore then connects anew, which always works).
pub fn recorded(dir: &Path) -> Option<KeptConnection> {
    let path = dir.join(RECORD_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!("{}: {e}; the restore will connect anew", path.display());
            return None;
        }
    };
    match serde_json::from_slice(&bytes) {
        Ok(k) => Some(k),
        Err(e) => {
            tracing::warn!(
                "{}: not a kept-connection record ({e}); the restore will connect anew",
                path.display()
            );
            None
        }
    }
}

/// Writes the record into the snapshot directory `dir`.
pub fn record(dir: &Path, kept: KeptConnection) -> io::Result<()> {
    let json = serde_json::to_vec(&kept).map_err(io::Error::other)?;
    std::fs::write(dir.join(RECORD_FILE), json)
}

/// How a restored sandbox's first agent connection is made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LinkMode {
    /// Take over the connection the snapshot kept, when it recorded one; else connect.
    #[default]
    Attach,
    /// Always a new connection (`CONNECT`: the guest resets the kept one and accepts the new
    /// one) — the path before kept connections, for comparisons.
    Connect,
    /// Restore with `--vsock-transport-reset` (every connection dropped with a transport reset,
    /// as snapshots of format 1 did) and connect: the oldest path, for comparisons.
    TransportReset,
}

impl std::str::FromStr for LinkMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "attach" => Ok(LinkMode::Attach),
            "connect" => Ok(LinkMode::Connect),
            "reset" => Ok(LinkMode::TransportReset),
            other => Err(format!(
                "unknown agent link mode {other:?}: use attach, connect or reset"
            )),
        }
    }
}

impl std::fmt::Display for LinkMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LinkMode::Attach => "attach",
            LinkMode::Connect => "connect",
            LinkMode::TransportReset => "reset",
        })
    }
}

/// How the first agent connection of a restored sandbox was made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "link", rename_all = "snake_case")]
pub enum Link {
    /// The snapshot's kept connection, taken over with `ATTACH`.
    Attached {
        /// Its host port.
        host_port: u32,
    },
    /// A new connection: the snapshot recorded none (or the caller asked for one).
    Connected {
        /// Its host port.
        host_port: u32,
    },
    /// A warm pool member's connection, made (and the guest's first cell run) when the member
    /// was filled; the create only synced it.
    Primed {
        /// Its host port.
        host_port: u32,
    },
    /// The snapshot recorded a kept connection, but it could not be used; a new one was made.
    Fallback {
        /// Its host port.
        host_port: u32,
        /// Why the kept one was not used.
        reason: String,
    },
}

impl Link {
    /// Whether the kept connection was used (at the create, or when a primed pool member
    /// was filled).
    pub fn attached(&self) -> bool {
        matches!(self, Link::Attached { .. } | Link::Primed { .. })
    }

    /// The connection's host port.
    pub fn host_port(&self) -> u32 {
        match self {
            Link::Attached { host_port }
            | Link::Primed { host_port }
            | Link::Connected { host_port }
            | Link::Fallback { host_port, .. } => *host_port,
        }
    }
}

fn handshake_err(what: String, e: io::Error) -> ClientError {
    match e.kind() {
        io::ErrorKind::InvalidData => ClientError::Handshake(e.to_string()),
        _ => ClientError::Io {
            context: what,
            source: e,
        },
    }
}

/// A new connection to guest `port` through the VMM's vsock socket `uds`, and its host port.
pub fn connect(
    uds: &Path,
    port: u32,
    timeout: Duration,
) -> Result<(Client<UnixStream>, u32), ClientError> {
    ember_vmm::vsock_host::connect_port(uds, port, timeout)
        .map(|(s, host_port)| (Client::new(s), host_port))
        .map_err(|e| handshake_err(format!("CONNECT {port} on {}", uds.display()), e))
}

/// `ATTACH` to the kept connection `kept`; the host port returned is `kept.host_port` when
/// that connection was taken over, another one when the VMM had no such connection and made a
/// new one instead.
pub fn attach(
    uds: &Path,
    kept: KeptConnection,
    timeout: Duration,
) -> Result<(Client<UnixStream>, u32), ClientError> {
    ember_vmm::vsock_host::attach_exact(uds, kept.port, kept.host_port, timeout)
        .map(|(s, host_port)| (Client::new(s), host_port))
        .map_err(|e| {
            handshake_err(
                format!(
                    "ATTACH {} {} on {}",
                    kept.port,
                    kept.host_port,
                    uds.display()
                ),
                e,
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_bad_ones_are_ignored() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(recorded(d.path()), None);
        let k = KeptConnection {
            port: 1024,
            host_port: 1 << 30,
        };
        record(d.path(), k).unwrap();
        assert_eq!(recorded(d.path()), Some(k));
        std::fs::write(d.path().join(RECORD_FILE), b"{\"port\": 1}").unwrap();
        assert_eq!(recorded(d.path()), None);
        std::fs::write(d.path().join(RECORD_FILE), b"garbage").unwrap();
        assert_eq!(recorded(d.path()), None);
    }

    #[test]
    fn links_serialize_with_their_kind() {
        let l = Link::Fallback {
            host_port: 7,
            reason: "gone".into(),
        };
        let v = serde_json::to_value(&l).unwrap();
        assert_eq!(v["link"], "fallback");
        assert_eq!(v["reason"], "gone");
        assert!(!l.attached());
        assert!(Link::Attached { host_port: 1 }.attached());
        let p = Link::Primed { host_port: 9 };
        assert!(p.attached());
        assert_eq!(p.host_port(), 9);
        assert_eq!(serde_json::to_value(&p).unwrap()["link"], "primed");
        assert_eq!("reset".parse::<LinkMode>(), Ok(LinkMode::TransportReset));
        assert!("x".parse::<LinkMode>().is_err());
    }
}
