//! The registry of background processes callers started in their sandboxes: pid, tag and the
//! caller's description, in the store, so that a server restart (or another server process
//! reading the same store) still finds a process by its tag and lists it as it was started.
//! The processes themselves live in the guest (the agent keeps them past the connection that
//! started them); this is only what the host knows about them.
//!
//! The E2B surface's `process.Start` records here and its `List`/`Connect` read here; a record
//! goes when the process is seen ended, when the caller forgets it, or with the sandbox's other
//! records after retention. At most [`MAX_PROCESSES`] are kept in all (the oldest go).

use crate::types::ProcessRecord;
use crate::{Runtime, RuntimeError};

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
