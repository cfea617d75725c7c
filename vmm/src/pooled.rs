//! A VMM started ahead of demand: `ember-vmm --wait-restore --api-sock PATH` builds no VM. It
//! binds its control socket, installs the `restore` seccomp filter on its main thread
//! ([`crate::seccomp::ThreadKind::Restore`]) and waits for one request naming the snapshot to
//! restore and the per-clone overrides. The runtime's warm pool (`runtime/src/pool.rs`) starts
//! such VMMs already jailed (namespaces, `pivot_root`, cgroup, uid dropped), so a create only
//! pays for the restore itself.
//!
//! Requests before the restore, one JSON object per line (one request per connection):
//!
//! ```text
//! {"op":"ping"}                                      → {"ok":true,"waiting":true}
//! {"op":"restore","dir":"/snapshot","vsock_uds":"/work/vsock",
//!  "disk_paths":["/work/disk0.overlay"],"disk_bases":["/disk0.base"]}
//!                                                    → {"ok":true,"ms":…}
//! {"op":"shutdown"}                                  → {"ok":true}   (then the VMM exits 0)
//! ```
//!
//! With `"hold":true` the VM is restored at once but its vCPUs wait for a second request,
//! `{"op":"start"}` → `{"ok":true}`: the pool builds the VM ahead too, so that a create only
//! starts it (`ping` then answers `"held":true`).
//!
//! After a successful restore (or the `start` of a held one) the same socket serves the
//! running VM's requests ([`crate::api`]). A failed restore is answered with `{"ok":false,"error":…}` and the VMM
//! exits non-zero: a half-built VM is never reused. A bad request line is answered with an
//! error and the VMM keeps waiting.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::persist::RestoreOptions;
use crate::workingset::Prefetch;

/// What to restore and the clone's own paths (the fields of [`RestoreOptions`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreRequest {
    /// The snapshot directory.
    pub dir: PathBuf,
    /// A new host socket path for the vsock device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_uds: Option<PathBuf>,
    /// New TAP names for the network interfaces, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub taps: Vec<String>,
    /// New disk paths, in order (`null` keeps a disk's path).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_paths: Vec<Option<PathBuf>>,
    /// New overlay base images, in order (`null` keeps a disk's base).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_bases: Vec<Option<PathBuf>>,
    /// Working-set prefetch.
    #[serde(default)]
    pub prefetch: Prefetch,
    /// Track dirty pages (diff snapshots).
    #[serde(default)]
    pub track_dirty_pages: bool,
    /// Restore now but start no vCPU until a `start` request: the VM is built ahead and a
    /// claim only starts it.
    #[serde(default)]
    pub hold: bool,
    /// Reset the vsock transport at restore instead of keeping the snapshot's connections
    /// for `ATTACH` (`--vsock-transport-reset`).
    #[serde(default)]
    pub vsock_transport_reset: bool,
}

impl RestoreRequest {
    /// The restore options it asks for.
    pub fn options(&self) -> RestoreOptions {
        RestoreOptions {
            cpu_profile: None,
            track_dirty_pages: self.track_dirty_pages,
            prefetch: self.prefetch,
            vsock_uds: self.vsock_uds.clone(),
            net_taps: self.taps.clone(),
            disk_paths: self.disk_paths.clone(),
            disk_bases: self.disk_bases.clone(),
            vsock_transport_reset: self.vsock_transport_reset,
        }
    }
}

/// A request to a waiting VMM.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum WaitRequest {
    /// Is it alive and waiting?
    Ping,
    /// Restore a snapshot and run it (or hold it, see [`RestoreRequest::hold`]).
    Restore(RestoreRequest),
    /// Start the vCPUs of a VM restored with `hold`.
    Start,
    /// Exit 0 without building a VM.
    Shutdown,
}

/// Errors of the waiting loop.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// The control socket.
    #[error("control socket {path}: {source}")]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Longest a client may take to send its request line once connected.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Binds the control socket (a stale socket file there is replaced). Blocking: the waiting
/// loop accepts one connection at a time.
pub fn bind(path: &Path) -> Result<UnixListener, WaitError> {
    let err = |source| WaitError::Socket {
        path: path.to_path_buf(),
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if meta.file_type().is_socket() {
            std::fs::remove_file(path).map_err(err)?;
        }
    }
    UnixListener::bind(path).map_err(err)
}

/// A client connection with its request.
#[derive(Debug)]
pub struct Pending {
    conn: UnixStream,
    /// The request.
    pub request: WaitRequest,
}

impl Pending {
    /// Answers the request (a client that went away is ignored).
    pub fn reply(mut self, reply: &serde_json::Value) {
        let mut line = reply.to_string();
        line.push('\n');
        let _ = self.conn.write_all(line.as_bytes());
    }
}

/// Waits for the next valid request. Bad lines and `ping` are answered here (`held`: a VM
/// is restored and waits for `start`).
pub fn next_request(listener: &UnixListener, held: bool) -> Result<Pending, WaitError> {
    loop {
        let (conn, _) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(WaitError::Socket {
                    path: PathBuf::new(),
                    source,
                })
            }
        };
        let _ = conn.set_read_timeout(Some(REQUEST_TIMEOUT));
        let _ = conn.set_write_timeout(Some(REQUEST_TIMEOUT));
        let Ok(reader) = conn.try_clone() else {
            continue;
        };
        let mut line = String::new();
        let read = BufReader::new(reader.take(crate::api::MAX_REQUEST as u64)).read_line(&mut line);
        let mut pending = Pending {
            conn,
            request: WaitRequest::Ping,
        };
        match read {
            Ok(0) | Err(_) => continue,
            Ok(_) => {}
        }
        match serde_json::from_str::<WaitRequest>(line.trim()) {
            Ok(WaitRequest::Ping) => pending.reply(&serde_json::json!({
                "ok": true, "waiting": true, "held": held,
            })),
            Ok(request) => {
                pending.request = request;
                return Ok(pending);
            }
            Err(e) => pending.reply(&serde_json::json!({
                "ok": false,
                "error": format!("bad request {:?} (waiting for a restore): {e}", line.trim()),
            })),
        }
    }
}

/// Sends one request to a waiting VMM and reads its reply (for the runtime and tests).
pub fn call(
    socket: &Path,
    req: &WaitRequest,
    timeout: Duration,
) -> Result<serde_json::Value, String> {
    let mut s = UnixStream::connect(socket)
        .map_err(|e| format!("cannot connect to {}: {e}", socket.display()))?;
    let _ = s.set_read_timeout(Some(timeout));
    let mut line = serde_json::to_string(req).map_err(|e| e.to_string())?;
    line.push('\n');
    s.write_all(line.as_bytes())
        .map_err(|e| format!("cannot send to {}: {e}", socket.display()))?;
    let mut reply = String::new();
    BufReader::new(s)
        .read_line(&mut reply)
        .map_err(|e| format!("no reply from {}: {e}", socket.display()))?;
    serde_json::from_str(reply.trim()).map_err(|e| {
        format!(
            "bad reply {:?} from {}: {e}",
            reply.trim(),
            socket.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_wire_format() {
        let r: WaitRequest = serde_json::from_str(
            r#"{"op":"restore","dir":"/snapshot","vsock_uds":"/work/vsock","disk_paths":["/work/d",null]}"#,
        )
        .unwrap();
        let WaitRequest::Restore(r) = r else {
            panic!("not a restore")
        };
        assert_eq!(r.dir, PathBuf::from("/snapshot"));
        assert_eq!(r.disk_paths, vec![Some(PathBuf::from("/work/d")), None]);
        assert_eq!(r.options().vsock_uds, Some(PathBuf::from("/work/vsock")));
        assert!(serde_json::from_str::<WaitRequest>(r#"{"op":"restore"}"#).is_err());
        assert!(
            serde_json::from_str::<WaitRequest>(r#"{"op":"restore","dir":"/s","colour":1}"#)
                .is_err()
        );
        assert_eq!(
            serde_json::from_str::<WaitRequest>(r#"{"op":"shutdown"}"#).unwrap(),
            WaitRequest::Shutdown
        );
        assert_eq!(
            serde_json::from_str::<WaitRequest>(r#"{"op":"start"}"#).unwrap(),
            WaitRequest::Start
        );
        let WaitRequest::Restore(r) =
            serde_json::from_str(r#"{"op":"restore","dir":"/s","hold":true}"#).unwrap()
        else {
            panic!("not a restore")
        };
        assert!(r.hold);
    }

    #[test]
    fn bad_lines_are_answered_and_the_loop_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.sock");
        let listener = bind(&path).unwrap();
        let p2 = path.clone();
        let client = std::thread::spawn(move || {
            let t = Duration::from_secs(5);
            let bad = {
                let mut s = UnixStream::connect(&p2).unwrap();
                s.write_all(b"{\"op\":\"format_disk\"}\n").unwrap();
                let mut r = String::new();
                BufReader::new(s).read_line(&mut r).unwrap();
                r
            };
            let ping = call(&p2, &WaitRequest::Ping, t).unwrap();
            let shut = call(&p2, &WaitRequest::Shutdown, t).unwrap();
            (bad, ping, shut)
        });
        let p = next_request(&listener, false).unwrap();
        assert_eq!(p.request, WaitRequest::Shutdown);
        p.reply(&serde_json::json!({"ok": true}));
        let (bad, ping, shut) = client.join().unwrap();
        assert!(bad.contains("format_disk"), "{bad}");
        assert_eq!(ping["waiting"], true);
        assert_eq!(shut["ok"], true);
    }
}
