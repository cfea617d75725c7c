//! Fencing, for an embedder that may be declared lost by others (the fleet's node): the
//! vCPUs of every running VM stopped and started again under the runtime's feet (its records
//! still say running: a fence is not a pause, nothing is snapshotted or recorded), and the
//! keep-alives of the VMMs' own watchdogs (`{"op":"watchdog"}` on their control sockets: a
//! VMM that hears none for its timeout stops its own vCPUs, so that a frozen embedder's VMs
//! stop acting too).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use crate::types::*;
use crate::{lock, Runtime};

/// How long one control request of a fence or a keep-alive may take.
const CONTROL_TIMEOUT: Duration = Duration::from_millis(500);

impl Runtime {
    /// The sandboxes whose VMM runs (not paused, not in a transition), with their VMMs'
    /// control sockets.
    pub fn running_vmms(&self) -> Vec<(String, PathBuf)> {
        let slots: Vec<_> = lock(&self.inner.slots).values().cloned().collect();
        slots
            .iter()
            .filter_map(|s| {
                let st = lock(&s.st);
                let vm = st.vm.as_ref()?;
                (st.row.state == State::Running)
                    .then(|| (s.id.clone(), vm.sandbox.api_socket().to_path_buf()))
            })
            .collect()
    }

    /// Stops the vCPUs of every running VM (a fence): the ids of those stopped. Their calls
    /// wait (the guest does not answer) until [`Runtime::thaw_vms`] or a kill.
    pub fn freeze_vms(&self) -> Vec<String> {
        let mut frozen = Vec::new();
        for (id, socket) in self.running_vmms() {
            match control(&socket, &serde_json::json!({ "op": "pause" })) {
                Ok(()) => frozen.push(id),
                Err(e) => tracing::warn!("fence: sandbox {id} not frozen: {e}"),
            }
        }
        frozen
    }

    /// Starts again the vCPUs of the VMs of `ids` that still run here.
    pub fn thaw_vms(&self, ids: &[String]) {
        let running: HashMap<String, PathBuf> = self.running_vmms().into_iter().collect();
        for id in ids {
            if let Some(socket) = running.get(id) {
                if let Err(e) = control(socket, &serde_json::json!({ "op": "resume" })) {
                    tracing::warn!("fence lifted: sandbox {id} not thawed: {e}");
                }
            }
        }
    }
}

/// One request on a fresh connection to a VMM's control socket, its reply checked.
fn control(socket: &std::path::Path, req: &serde_json::Value) -> Result<(), String> {
    let mut s = UnixStream::connect(socket).map_err(|e| format!("{}: {e}", socket.display()))?;
    exchange(&mut s, req)
}

fn exchange(s: &mut UnixStream, req: &serde_json::Value) -> Result<(), String> {
    s.set_read_timeout(Some(CONTROL_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(CONTROL_TIMEOUT)))
        .map_err(|e| e.to_string())?;
    let mut line = req.to_string();
    line.push('\n');
    s.write_all(line.as_bytes()).map_err(|e| e.to_string())?;
    let mut reply = String::new();
    BufReader::new(&*s)
        .read_line(&mut reply)
        .map_err(|e| format!("no reply: {e}"))?;
    let v: serde_json::Value =
        serde_json::from_str(reply.trim()).map_err(|e| format!("bad reply {reply:?}: {e}"))?;
    if v["ok"] == true {
        Ok(())
    } else {
        Err(format!("refused: {}", v["error"]))
    }
}

/// The keep-alives of the running VMMs' watchdogs: each [`KeepAlive::beat`] arms (or
/// feeds) the watchdog of every running VMM with `timeout`, on a connection kept per VMM.
#[derive(Debug)]
pub struct KeepAlive {
    timeout: Duration,
    conns: HashMap<String, UnixStream>,
}

impl KeepAlive {
    /// Keep-alives for watchdogs of `timeout`.
    pub fn new(timeout: Duration) -> KeepAlive {
        KeepAlive {
            timeout,
            conns: HashMap::new(),
        }
    }

    /// Feeds every running VMM's watchdog once; answers how many were fed.
    pub fn beat(&mut self, rt: &Runtime) -> usize {
        let running = rt.running_vmms();
        let req = serde_json::json!({
            "op": "watchdog",
            "timeout_ms": u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
        });
        let ids: std::collections::HashSet<&String> = running.iter().map(|(id, _)| id).collect();
        self.conns.retain(|id, _| ids.contains(id));
        let mut fed = 0;
        for (id, socket) in &running {
            let conn = match self.conns.remove(id) {
                Some(c) => Ok(c),
                None => UnixStream::connect(socket).map_err(|e| e.to_string()),
            };
            match conn.and_then(|mut c| exchange(&mut c, &req).map(|()| c)) {
                Ok(c) => {
                    self.conns.insert(id.clone(), c);
                    fed += 1;
                }
                // The next beat connects again.
                Err(e) => tracing::warn!("watchdog keep-alive of sandbox {id}: {e}"),
            }
        }
        fed
    }
}
