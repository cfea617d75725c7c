//! The control socket: a Unix stream socket taking one JSON request per line and answering one
//! JSON reply per line. It lives on the VMM's event loop; requests are queued here and executed
//! by the VM between event-loop iterations, where it owns every piece of state.
//!
//! ```text
//! {"op":"pause"}                                  → {"ok":true}
//! {"op":"resume"}                                 → {"ok":true}
//! {"op":"snapshot","dir":"/s","kind":"full"}      → {"ok":true,"dir":"/s","ms":…}
//! {"op":"snapshot","dir":"/s","kind":"layer","after":"exit"} → {"ok":true,…}  (kind: full|diff|layer)
//! {"op":"stats"}                                  → {"ok":true,"stats":{…,"kvm":{"vcpu":{"exits":…},"vm":{…}},"vsock":{…}}}
//! {"op":"shutdown"}                               → {"ok":true}   (then the VMM exits 0)
//! {"op":"watchdog","timeout_ms":1000}             → {"ok":true,"paused_by_watchdog":false}
//! {"op":"watchdog","timeout_ms":0}                → {"ok":true,"paused_by_watchdog":false}  (disarms)
//! {"op":"watchdog","timeout_ms":5}                → {"ok":false,"error":"watchdog timeout_ms 5 is out of bounds: …"}
//! ```
//!
//! `watchdog` is opt-in ([`crate::watchdog`]): `timeout_ms` > 0 (100 ms to 1 h) arms it, 0
//! disarms it, and every such request is a keep-alive: the deadline becomes now +
//! `timeout_ms`. When a deadline passes without one, the VMM pauses its vCPUs (as `pause`
//! does; a `watchdog_expired` report event) — a VM whose owner froze stops acting. The next
//! keep-alive resumes a VM the watchdog paused (`"paused_by_watchdog":true` in its reply), but
//! not one paused deliberately: an explicit `pause` or `snapshot` takes the VM over from the
//! watchdog, and `resume` resumes as usual. `stats` carries
//! `"watchdog":{"armed_ms":N|null,"paused_by_watchdog":bool,"expiries":N}`. A restored VM
//! starts with it disarmed.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

/// Largest request line accepted; longer lines close the connection.
pub const MAX_REQUEST: usize = 64 * 1024;

/// What to do with the VM once a snapshot is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AfterSnapshot {
    /// Keep running (or stay paused if it was paused before).
    #[default]
    Continue,
    /// Stay paused.
    Pause,
    /// Exit the VMM (status 0).
    Exit,
}

/// Full or diff snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotKind {
    /// All of guest memory.
    #[default]
    Full,
    /// Only pages dirtied since the previous snapshot of this VM.
    Diff,
    /// Only the pages that differ from the memory file this (restored) VM was restored
    /// from, plus a reference to that file: restorable alone while the base exists
    /// (`crate::layer`). Refused for a VM that was booted, not restored.
    Layer,
}

/// A control request.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Stop the vCPUs.
    Pause,
    /// Let them run again.
    Resume,
    /// Write a snapshot directory.
    Snapshot {
        /// Where (created atomically; must not exist).
        dir: PathBuf,
        /// Full or diff.
        #[serde(default)]
        kind: SnapshotKind,
        /// What then.
        #[serde(default)]
        after: AfterSnapshot,
    },
    /// Counters and sizes: the VMM's memory, KVM's own counters for the VM (`kvm`: VM exits by
    /// reason, page faults, injections — `crate::kvmstats`) and the vsock device's (`vsock`).
    Stats,
    /// Record the guest pages this (restored) VM has touched so far into `dir/workingset`,
    /// for later restores of the snapshot in `dir` to prefetch.
    RecordWorkingSet {
        /// The snapshot directory the VM was restored from.
        dir: PathBuf,
    },
    /// Stop the VM and exit 0.
    Shutdown,
    /// Arm (`timeout_ms` > 0) or disarm (0) the VMM watchdog ([`crate::watchdog`]); every such
    /// request is also a keep-alive (the deadline becomes now + `timeout_ms`), and resumes the
    /// VM if the watchdog had paused it.
    Watchdog {
        /// The period: 0 disarms, otherwise [`crate::watchdog::MIN_TIMEOUT_MS`] to
        /// [`crate::watchdog::MAX_TIMEOUT_MS`].
        timeout_ms: u64,
    },
}

/// Id of a client connection.
pub type ConnId = u64;

#[derive(Debug, Default)]
struct Shared {
    pending: VecDeque<(ConnId, Result<Request, String>)>,
    conns: HashMap<ConnId, UnixStream>,
}

/// The queue between the socket subscriber and the VM.
#[derive(Debug, Clone, Default)]
pub struct ApiQueue(Arc<Mutex<Shared>>);

impl ApiQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next request, if any (a parse error comes as `Err` and should be answered).
    pub fn pop(&self) -> Option<(ConnId, Result<Request, String>)> {
        self.lock().pending.pop_front()
    }

    /// Sends one reply line; a client that went away is dropped silently.
    pub fn respond(&self, conn: ConnId, reply: &serde_json::Value) {
        let mut sh = self.lock();
        if let Some(stream) = sh.conns.get_mut(&conn) {
            let mut line = reply.to_string();
            line.push('\n');
            // Replies are small; the stream is blocking for writes with a timeout.
            if stream.write_all(line.as_bytes()).is_err() {
                sh.conns.remove(&conn);
            }
        }
    }
}

/// Errors setting up the socket.
#[derive(Debug, thiserror::Error)]
#[error("control socket {path}: {source}")]
pub struct ApiError {
    /// The socket path.
    pub path: PathBuf,
    /// Why.
    pub source: std::io::Error,
}

/// The listening socket and its connections, as an event-loop subscriber.
#[derive(Debug)]
pub struct ApiServer {
    listener: UnixListener,
    queue: ApiQueue,
    next_id: ConnId,
    readers: HashMap<i32, (ConnId, UnixStream, Vec<u8>)>,
}

impl ApiServer {
    /// Listens on `path` (a stale socket file there is replaced).
    pub fn bind(path: &Path, queue: ApiQueue) -> Result<Self, ApiError> {
        let err = |source| ApiError {
            path: path.to_path_buf(),
            source,
        };
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if meta.file_type().is_socket() {
                std::fs::remove_file(path).map_err(err)?;
            }
        }
        let listener = UnixListener::bind(path).map_err(err)?;
        listener.set_nonblocking(true).map_err(err)?;
        Ok(Self {
            listener,
            queue,
            next_id: 1,
            readers: HashMap::new(),
        })
    }

    /// Serves an already bound listener (a VMM that waited for its restore on it,
    /// [`crate::pooled`]).
    pub fn from_listener(listener: UnixListener, queue: ApiQueue) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener,
            queue,
            next_id: 1,
            readers: HashMap::new(),
        })
    }

    fn accept(&mut self, ops: &mut EventOps) {
        while let Ok((stream, _)) = self.listener.accept() {
            let id = self.next_id;
            self.next_id += 1;
            let Ok(writer) = stream.try_clone() else {
                continue;
            };
            let _ = writer.set_write_timeout(Some(std::time::Duration::from_secs(5)));
            let _ = stream.set_nonblocking(true);
            let fd = stream.as_raw_fd();
            if ops
                .add(Events::new(&stream, EventSet::IN | EventSet::READ_HANG_UP))
                .is_err()
            {
                continue;
            }
            self.queue.lock().conns.insert(id, writer);
            self.readers.insert(fd, (id, stream, Vec::new()));
        }
    }

    fn read(&mut self, fd: i32, ops: &mut EventOps) {
        let mut close = false;
        if let Some((id, stream, buf)) = self.readers.get_mut(&fd) {
            let mut chunk = [0u8; 4096];
            loop {
                match stream.read(&mut chunk) {
                    Ok(0) => {
                        close = true;
                        break;
                    }
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        close = true;
                        break;
                    }
                }
            }
            while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=pos).collect();
                let text = String::from_utf8_lossy(&line);
                let text = text.trim();
                if text.is_empty() {
                    continue;
                }
                let req = serde_json::from_str::<Request>(text)
                    .map_err(|e| format!("bad request {text:?}: {e}"));
                self.queue.lock().pending.push_back((*id, req));
            }
            if buf.len() > MAX_REQUEST {
                self.queue
                    .lock()
                    .pending
                    .push_back((*id, Err(format!("request longer than {MAX_REQUEST} bytes"))));
                close = true;
            }
        }
        if close {
            if let Some((id, stream, _)) = self.readers.remove(&fd) {
                let _ = ops.remove(Events::new(&stream, EventSet::IN | EventSet::READ_HANG_UP));
                // Keep the writer until queued requests of this client are answered.
                let has_pending = self.queue.lock().pending.iter().any(|(c, _)| *c == id);
                if !has_pending {
                    self.queue.lock().conns.remove(&id);
                }
            }
        }
    }
}

impl MutEventSubscriber for ApiServer {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.listener, EventSet::IN)) {
            tracing::error!("cannot watch the control socket: {e:?}");
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        if events.fd() == self.listener.as_raw_fd() {
            self.accept(ops);
        } else {
            self.read(events.fd(), ops);
        }
    }
}

/// Sends one request to a VMM's control socket and waits for the reply (for the CLI and
/// tests).
pub fn call(socket: &Path, req: &Request) -> Result<serde_json::Value, String> {
    let mut s = UnixStream::connect(socket)
        .map_err(|e| format!("cannot connect to {}: {e}", socket.display()))?;
    let mut line = serde_json::to_string(req).map_err(|e| e.to_string())?;
    line.push('\n');
    s.write_all(line.as_bytes())
        .map_err(|e| format!("cannot send to {}: {e}", socket.display()))?;
    let mut reply = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        let n = match s.read(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => r.map_err(|e| format!("no reply from {}: {e}", socket.display()))?,
        };
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&b[..n]);
        if reply.contains(&b'\n') {
            break;
        }
    }
    let text = String::from_utf8_lossy(&reply);
    serde_json::from_str(text.trim())
        .map_err(|e| format!("bad reply {:?} from {}: {e}", text.trim(), socket.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_wire_format() {
        let r: Request = serde_json::from_str(r#"{"op":"snapshot","dir":"/s"}"#).unwrap();
        assert_eq!(
            r,
            Request::Snapshot {
                dir: "/s".into(),
                kind: SnapshotKind::Full,
                after: AfterSnapshot::Continue
            }
        );
        let r: Request =
            serde_json::from_str(r#"{"op":"snapshot","dir":"/s","kind":"diff","after":"exit"}"#)
                .unwrap();
        assert!(matches!(
            r,
            Request::Snapshot {
                kind: SnapshotKind::Diff,
                after: AfterSnapshot::Exit,
                ..
            }
        ));
        assert!(serde_json::from_str::<Request>(r#"{"op":"format_disk"}"#).is_err());
        assert!(
            serde_json::from_str::<Request>(r#"{"op":"snapshot","dir":"/s","colour":1}"#).is_err()
        );
    }

    #[test]
    fn watchdog_wire_format() {
        let r: Request = serde_json::from_str(r#"{"op":"watchdog","timeout_ms":1000}"#).unwrap();
        assert_eq!(r, Request::Watchdog { timeout_ms: 1000 });
        let r: Request = serde_json::from_str(r#"{"op":"watchdog","timeout_ms":0}"#).unwrap();
        assert_eq!(r, Request::Watchdog { timeout_ms: 0 });
        assert_eq!(
            serde_json::to_value(Request::Watchdog { timeout_ms: 250 }).unwrap(),
            serde_json::json!({"op": "watchdog", "timeout_ms": 250})
        );
        // The period is required, a whole number of ms, not negative; nothing else is taken.
        for bad in [
            r#"{"op":"watchdog"}"#,
            r#"{"op":"watchdog","timeout_ms":-1}"#,
            r#"{"op":"watchdog","timeout_ms":1.5}"#,
            r#"{"op":"watchdog","timeout_ms":"1000"}"#,
            r#"{"op":"watchdog","timeout_ms":1000,"action":"reset"}"#,
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
        // Out-of-bounds values parse; the VM refuses them (crate::watchdog::period).
        let r: Request = serde_json::from_str(r#"{"op":"watchdog","timeout_ms":5}"#).unwrap();
        assert_eq!(r, Request::Watchdog { timeout_ms: 5 });
    }

    #[test]
    fn socket_round_trip_through_an_event_loop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let q = ApiQueue::default();
        let server = ApiServer::bind(&path, q.clone()).unwrap();
        let mut em: event_manager::EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> =
            event_manager::EventManager::new().unwrap();
        event_manager::SubscriberOps::add_subscriber(&mut em, Arc::new(Mutex::new(server)));
        let p2 = path.clone();
        let client = std::thread::spawn(move || call(&p2, &Request::Stats));
        // Serve until the request arrives, then answer it.
        let (conn, req) = loop {
            em.run_with_timeout(1000).unwrap();
            if let Some(x) = q.pop() {
                break x;
            }
        };
        assert_eq!(req.unwrap(), Request::Stats);
        q.respond(conn, &serde_json::json!({"ok": true, "n": 1}));
        let reply = client.join().unwrap().unwrap();
        assert_eq!(reply["n"], 1);
    }
}
