//! The registry of background processes callers started in their sandboxes: pid, tag and the
//! caller's description, in the store, so that a server restart (or another server process
//! reading the same store) still finds a process by its tag and lists it as it was started.
//! The processes themselves live in the guest (the agent keeps them past the connection that
//! started them); this is only what the host knows about them.
//!
//! The E2B surface's `process.Start` records here and its `List`/`Connect` read here; a record
//! goes when the process is seen ended, when the caller forgets it, or with the sandbox's other
//! records after retention. At most [`MAX_PROCESSES`] are kept in all (the oldest go).

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use ember_agent::client::ClientError;
use ember_agent::protocol::{Call, EventKind, ExecRequest, PidRequest, ProcessInfo};

use crate::call::Cancel;
use crate::types::{ProcessEnd, ProcessRecord};
use crate::{Runtime, RuntimeError};

/// Longest an attach may last (the agent client needs a deadline).
const ATTACH_LIMIT: Duration = Duration::from_secs(30 * 24 * 3600);
/// Most bytes one `stdin_write` frame carries.
const STDIN_CHUNK: usize = 64 * 1024;

fn guest_pid(pid: u32) -> Result<i32, RuntimeError> {
    i32::try_from(pid).map_err(|_| RuntimeError::Invalid(format!("pid {pid} is out of range")))
}

/// Most process records kept (all sandboxes together).
pub const MAX_PROCESSES: usize = 4096;

fn store_error(e: rusqlite::Error) -> RuntimeError {
    RuntimeError::Internal(format!("the process registry: {e}"))
}

impl Runtime {
    /// Records a background process of sandbox `id`.
    pub fn remember_process(&self, id: &str, process: ProcessRecord) -> Result<(), RuntimeError> {
        self.get(id)?;
        self.store()
            .put_process(id, &process, MAX_PROCESSES)
            .map_err(store_error)
    }

    /// The processes recorded for sandbox `id`, oldest first. With `running`, the records of
    /// processes not in it (ended) are forgotten first.
    pub fn process_records(
        &self,
        id: &str,
        running: Option<&[u32]>,
    ) -> Result<Vec<ProcessRecord>, RuntimeError> {
        let store = self.store();
        let all = store.processes(id).map_err(store_error)?;
        let Some(running) = running else {
            return Ok(all);
        };
        let (keep, gone): (Vec<_>, Vec<_>) =
            all.into_iter().partition(|p| running.contains(&p.pid));
        for p in gone {
            store
                .forget_processes(id, Some(p.pid))
                .map_err(store_error)?;
        }
        Ok(keep)
    }

    /// Starts a background program in sandbox `id` with the template's environment, the
    /// sandbox's, then `req`'s, and records it (`tag`, `config`); answers its pid. The record
    /// failing does not fail the start (the program runs; only its tag is not kept).
    pub fn process_start(
        &self,
        id: &str,
        mut req: ExecRequest,
        tag: Option<String>,
        config: serde_json::Value,
    ) -> Result<u32, RuntimeError> {
        if req.argv.is_empty() || req.argv[0].is_empty() {
            return Err(RuntimeError::Invalid(
                "the program to start is empty".into(),
            ));
        }
        req.background = true;
        let args = serde_json::json!({
            "argv": req.argv, "cwd": req.cwd, "user": req.user, "pty": req.pty.is_some(),
            "tag": tag, "timeout_ms": req.timeout_ms,
        });
        self.get(id)?;
        let row_env = self.row_env(id);
        let pid = self.audited(id, "process_start", args, |vm, _| {
            let mut env = vm.sandbox.template_env().clone();
            env.extend(row_env);
            env.append(&mut req.env);
            req.env = env;
            Ok(vm.sandbox.exec_background(&req)?)
        })?;
        let pid = u32::try_from(pid)
            .map_err(|_| RuntimeError::Internal(format!("the agent answered pid {pid}")))?;
        let record = ProcessRecord { pid, tag, config };
        if let Err(e) = self.remember_process(id, record) {
            tracing::warn!("sandbox {id}: process {pid} started but not recorded: {e}");
        }
        Ok(pid)
    }

    /// Streams background program `pid`'s output to `on_event`: first `Started { pid }` when
    /// the attach call has been sent to the guest, then what the program wrote so far and
    /// live output, until it exits, `on_event` says stop or `cancel` fires. A program seen
    /// ending is forgotten from the registry.
    pub fn process_attach(
        &self,
        id: &str,
        pid: u32,
        on_event: &mut dyn FnMut(&EventKind) -> bool,
        cancel: Option<Arc<Cancel>>,
    ) -> Result<ProcessEnd, RuntimeError> {
        let gpid = guest_pid(pid)?;
        let cancel = cancel.unwrap_or_default();
        let args = serde_json::json!({ "pid": pid });
        let mut exit = None;
        let r = self.audited_stream(id, "process_attach", args, &cancel, |vm, bytes| {
            let r = vm.sandbox.with_client("process_attach", |c| {
                if !cancel.arm(c.get_ref()) {
                    return Err(ClientError::Closed);
                }
                // The caller learns that the attach is on its way before the guest answers
                // anything (a quiet program says nothing for a long time): a surface can
                // confirm its stream then, so that what its client does next (a signal)
                // reaches the guest after the attach.
                if !on_event(&EventKind::Started { pid: gpid }) {
                    cancel.fire();
                    return Err(ClientError::Closed);
                }
                let call = Call::ProcessAttach(PidRequest { pid: gpid });
                let r = c.call(&call, ATTACH_LIMIT, |ev| {
                    bytes.1 += crate::calls::event_bytes(&ev);
                    if let EventKind::Exit(s) = ev {
                        exit = Some(s);
                    }
                    if on_event(&ev) {
                        Ok(())
                    } else {
                        cancel.fire();
                        Err(ClientError::Closed)
                    }
                });
                // A connection the cancel shut down must not go back to the pool.
                if cancel.disarm() {
                    return Err(ClientError::Closed);
                }
                r
            });
            if cancel.fired() {
                return Err(RuntimeError::Cancelled(format!(
                    "process_attach {pid}: cancelled"
                )));
            }
            Ok(r?)
        });
        let status = r?;
        if exit.is_some() || status == ember_agent::protocol::EndStatus::TimedOut {
            let _ = self.forget_processes(id, Some(pid));
        }
        Ok(ProcessEnd { status, exit })
    }

    /// The programs the agent started in sandbox `id` that run or were not yet collected.
    pub fn process_list(&self, id: &str) -> Result<Vec<ProcessInfo>, RuntimeError> {
        self.audited(id, "process_list", serde_json::json!({}), |vm, _| {
            Ok(vm.sandbox.process_list()?)
        })
    }

    /// Feeds program `pid`'s stdin with all of `input`; answers the bytes written.
    pub fn stdin_write(
        &self,
        id: &str,
        pid: u32,
        input: &mut dyn Read,
    ) -> Result<u64, RuntimeError> {
        let gpid = guest_pid(pid)?;
        self.audited(
            id,
            "stdin_write",
            serde_json::json!({ "pid": pid }),
            |vm, bytes| {
                let mut buf = vec![0u8; STDIN_CHUNK];
                loop {
                    let n = match input.read(&mut buf) {
                        Ok(0) => return Ok(bytes.0),
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            return Err(RuntimeError::Invalid(format!(
                                "stdin for process {pid}: reading the input: {e}"
                            )))
                        }
                    };
                    vm.sandbox.stdin_write(gpid, &buf[..n])?;
                    bytes.0 += n as u64;
                }
            },
        )
    }

    /// Closes program `pid`'s stdin.
    pub fn stdin_close(&self, id: &str, pid: u32) -> Result<(), RuntimeError> {
        let gpid = guest_pid(pid)?;
        self.audited(
            id,
            "stdin_close",
            serde_json::json!({ "pid": pid }),
            |vm, _| Ok(vm.sandbox.stdin_close(gpid)?),
        )
    }

    /// Resizes program `pid`'s terminal.
    pub fn process_resize(
        &self,
        id: &str,
        pid: u32,
        cols: u16,
        rows: u16,
    ) -> Result<(), RuntimeError> {
        let gpid = guest_pid(pid)?;
        let args = serde_json::json!({ "pid": pid, "cols": cols, "rows": rows });
        self.audited(id, "process_resize", args, |vm, _| {
            Ok(vm.sandbox.process_resize(gpid, cols, rows)?)
        })
    }

    /// Forgets process `pid` of sandbox `id`, or all of its processes.
    pub fn forget_processes(&self, id: &str, pid: Option<u32>) -> Result<(), RuntimeError> {
        self.store().forget_processes(id, pid).map_err(store_error)
    }
}

#[cfg(test)]
mod tests {
    use crate::store::Store;
    use crate::types::ProcessRecord;

    fn rec(pid: u32, tag: Option<&str>) -> ProcessRecord {
        ProcessRecord {
            pid,
            tag: tag.map(str::to_string),
            config: serde_json::json!({ "cmd": "sleep", "args": ["9"] }),
        }
    }

    #[test]
    fn records_survive_reopening_the_store_and_keep_their_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ember.db");
        {
            let s = Store::open(&path).unwrap();
            s.put_process("sb1", &rec(10, Some("web")), 100).unwrap();
            s.put_process("sb1", &rec(11, None), 100).unwrap();
            s.put_process("sb2", &rec(10, Some("other")), 100).unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(
            s.processes("sb1").unwrap(),
            vec![rec(10, Some("web")), rec(11, None)]
        );
        s.forget_processes("sb1", Some(10)).unwrap();
        assert_eq!(s.processes("sb1").unwrap(), vec![rec(11, None)]);
        s.forget_processes("sb2", None).unwrap();
        assert!(s.processes("sb2").unwrap().is_empty());
    }

    #[test]
    fn past_the_cap_the_oldest_records_go() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("ember.db")).unwrap();
        for pid in 0..5 {
            s.put_process("sb", &rec(pid, None), 3).unwrap();
        }
        let pids: Vec<u32> = s.processes("sb").unwrap().iter().map(|p| p.pid).collect();
        assert_eq!(pids, vec![2, 3, 4]);
    }

    #[test]
    fn a_recorded_pid_started_again_is_replaced_not_doubled() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("ember.db")).unwrap();
        s.put_process("sb", &rec(7, Some("a")), 10).unwrap();
        s.put_process("sb", &rec(7, Some("b")), 10).unwrap();
        assert_eq!(s.processes("sb").unwrap(), vec![rec(7, Some("b"))]);
    }
}
