//! Watching guest directories: a streaming watch (`Watch`: changes as they happen, for as long
//! as the caller listens) and polling watchers (`WatcherCreate` / `WatcherEvents` /
//! `WatcherRemove`: the runtime watches, the caller collects what changed now and then).
//!
//! A polling watcher is a record in the store (sandbox, path, recursive) plus, in this
//! process, a thread that runs the watch and buffers its changes ([`LiveWatcher`]). The record
//! is what lasts: a restarted server watches again for every running sandbox's watchers as it
//! opens, and a watch that a pause or a transport error ended is started again by the next
//! poll. Changes made while nothing watched (a restart, a pause) are not seen; a guest error
//! (the directory went away) ends the watcher, and every later poll answers that error.
//!
//! The agent's own temporary files (`.<name>.ember-<hex>`, the atomic write's) are left out:
//! a write shows as its target's `create`, as on any other host.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ember_agent::client::ClientError;
use ember_agent::protocol::{Call, ErrorCode, EventKind, FileType, FileWatchRequest};

use crate::call::Cancel;
use crate::store::WatcherRow;
use crate::types::FsChange;
use crate::{Runtime, RuntimeError};

/// Most polling watchers per sandbox.
pub const MAX_WATCHERS_PER_SANDBOX: usize = 64;
/// Most polling watchers in the runtime (each is a thread while it watches).
pub const MAX_WATCHERS: usize = 1024;
/// Most changes a polling watcher keeps between two polls; older ones are dropped.
pub const MAX_WATCHER_EVENTS: usize = 10_000;
/// Longest one watch call may last (the agent client needs a deadline).
const WATCH_LIMIT: Duration = Duration::from_secs(30 * 24 * 3600);
/// How long a new watch is given to reach the guest before `WatcherCreate` answers, so that
/// a change the caller makes right after is seen.
const ARM_WAIT: Duration = Duration::from_secs(5);
/// What the agent takes to read the watch call and add its inotify watches, after the call
/// left the host.
const SETTLE: Duration = Duration::from_millis(50);

/// A polling watcher's thread and what it has seen.
#[derive(Debug)]
pub(crate) struct LiveWatcher {
    sandbox: String,
    cancel: Arc<Cancel>,
    state: Mutex<WatchState>,
}

#[derive(Debug, Default)]
struct WatchState {
    /// The watch call has been sent to the guest.
    armed: bool,
    changes: VecDeque<FsChange>,
    /// How the watch ended, if it did.
    ended: Option<Ended>,
}

#[derive(Debug, Clone)]
enum Ended {
    /// By a pause, a transport error or a restart: the next poll watches again.
    Transient,
    /// By the guest (the directory went away): every later poll answers this.
    Guest { code: ErrorCode, message: String },
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `path` names the agent's temporary file of an atomic write (`.<name>.ember-<hex>`).
pub(crate) fn is_agent_temp(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with('.')
        && name.rsplit_once(".ember-").is_some_and(|(head, hex)| {
            head.len() > 1 && !hex.is_empty() && hex.bytes().all(|c| c.is_ascii_hexdigit())
        })
}

/// `path` relative to the watched directory `root` (`path` itself when it is not under it).
pub fn relative_name<'a>(root: &str, path: &'a str) -> &'a str {
    if root == "/" {
        return path.trim_start_matches('/');
    }
    path.strip_prefix(root)
        .and_then(|r| r.strip_prefix('/'))
        .unwrap_or(path)
}

impl Runtime {
    /// Watches guest directory `path` of sandbox `id`: first an `EventKind::Started { pid: 0 }`
    /// when the watch call has been sent to the guest, then an `EventKind::FsEvent` per change,
    /// until `on_event` returns false (`Ok`) or `cancel` fires (`Cancelled`: the caller went
    /// away, or the sandbox pauses or ends).
    pub fn watch(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
        on_event: &mut dyn FnMut(&EventKind) -> bool,
        cancel: Option<Arc<Cancel>>,
    ) -> Result<(), RuntimeError> {
        let cancel = cancel.unwrap_or_default();
        let args = serde_json::json!({ "path": path, "recursive": recursive });
        let mut stopped = false;
        let r = self.audited_stream(id, "watch", args, &cancel, |vm, bytes| {
            let r = vm.sandbox.with_client("file_watch", |c| {
                if !cancel.arm(c.get_ref()) {
                    return Err(ClientError::Closed);
                }
                if !on_event(&EventKind::Started { pid: 0 }) {
                    stopped = true;
                    cancel.fire();
                    return Err(ClientError::Closed);
                }
                let call = Call::FileWatch(FileWatchRequest {
                    path: path.to_string(),
                    recursive,
                });
                let r = c.call(&call, WATCH_LIMIT, |ev| {
                    if let EventKind::FsEvent { path: p, .. } = &ev {
                        if is_agent_temp(p) {
                            return Ok(());
                        }
                        bytes.1 += p.len() as u64;
                    }
                    if on_event(&ev) {
                        Ok(())
                    } else {
                        stopped = true;
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
            if stopped {
                return Ok(());
            }
            if cancel.fired() {
                return Err(RuntimeError::Cancelled(format!("watch {path}: cancelled")));
            }
            r.map(drop).map_err(RuntimeError::from)
        });
        r
    }

    /// Creates a polling watcher on guest directory `path`; answers its id once the watch
    /// reached the guest.
    pub fn watcher_create(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<String, RuntimeError> {
        let st = self.stat(id, path)?;
        if st.kind != FileType::Dir {
            return Err(RuntimeError::Invalid(format!(
                "path {path} is not a directory"
            )));
        }
        let row = {
            let store = self.store();
            if store.watchers(Some(id))?.len() >= MAX_WATCHERS_PER_SANDBOX {
                return Err(RuntimeError::Capacity(format!(
                    "sandbox {id} has {MAX_WATCHERS_PER_SANDBOX} watchers already; remove some"
                )));
            }
            if store.watchers(None)?.len() >= MAX_WATCHERS {
                return Err(RuntimeError::Capacity(format!(
                    "the server has {MAX_WATCHERS} watchers already"
                )));
            }
            let row = WatcherRow {
                id: format!("w{}", crate::paths::random_id()),
                sandbox: id.to_string(),
                path: path.to_string(),
                recursive,
            };
            store.put_watcher(&row)?;
            row
        };
        let w = self.start_watcher(&row)?;
        if !self.wait_armed(&w) {
            let ended = lock(&w.state).ended.clone();
            self.drop_watcher(id, &row.id);
            return Err(match ended {
                Some(Ended::Guest { code, message }) => RuntimeError::Guest {
                    id: id.to_string(),
                    call: "file_watch",
                    code,
                    message,
                },
                _ => RuntimeError::Timeout {
                    id: id.to_string(),
                    message: format!("watching {path}: the watch did not start"),
                },
            });
        }
        Ok(row.id)
    }

    /// What polling watcher `watcher` of sandbox `id` saw since the last poll. A watch that a
    /// pause, a transport error or a restart ended is started again (what changed meanwhile
    /// was not seen).
    pub fn watcher_events(&self, id: &str, watcher: &str) -> Result<Vec<FsChange>, RuntimeError> {
        let row = self.watcher_row(id, watcher)?;
        let live = lock(&self.inner.watches).get(watcher).cloned();
        let w = match live {
            Some(w) => w,
            None => {
                let w = self.start_watcher(&row)?;
                self.wait_armed(&w);
                w
            }
        };
        let (changes, ended) = {
            let mut st = lock(&w.state);
            (st.changes.drain(..).collect::<Vec<_>>(), st.ended.clone())
        };
        match ended {
            None => {}
            Some(Ended::Transient) => {
                let w = self.start_watcher(&row)?;
                self.wait_armed(&w);
            }
            Some(Ended::Guest { code, message }) if changes.is_empty() => {
                return Err(RuntimeError::Guest {
                    id: id.to_string(),
                    call: "file_watch",
                    code,
                    message,
                });
            }
            Some(Ended::Guest { .. }) => {}
        }
        Ok(changes)
    }

    /// Removes polling watcher `watcher` of sandbox `id`.
    pub fn watcher_remove(&self, id: &str, watcher: &str) -> Result<(), RuntimeError> {
        self.watcher_row(id, watcher)?;
        self.drop_watcher(id, watcher);
        Ok(())
    }

    /// Forgets every polling watcher of sandbox `id` (it ended).
    pub(crate) fn forget_watchers(&self, id: &str) {
        let gone: Vec<Arc<LiveWatcher>> = {
            let mut all = lock(&self.inner.watches);
            let ids: Vec<String> = all
                .iter()
                .filter(|(_, w)| w.sandbox == id)
                .map(|(k, _)| k.clone())
                .collect();
            ids.iter().filter_map(|k| all.remove(k)).collect()
        };
        for w in gone {
            w.cancel.fire();
        }
        if let Err(e) = self.store().forget_watchers(id, None) {
            tracing::warn!("sandbox {id}: its watchers not forgotten: {e}");
        }
    }

    /// Watches again for the stored watchers of running sandboxes (a restarted server), on a
    /// thread of its own: opening the runtime does not wait for guests.
    pub(crate) fn rearm_watchers(&self) {
        let rows = match self.store().watchers(None) {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!("watchers not restored: {e}");
                return;
            }
        };
        let rows: Vec<WatcherRow> = rows
            .into_iter()
            .filter(|r| {
                self.get(&r.sandbox)
                    .is_ok_and(|i| i.state == crate::State::Running)
            })
            .collect();
        if rows.is_empty() {
            return;
        }
        let rt = self.clone();
        let spawned = std::thread::Builder::new()
            .name("ember-rewatch".into())
            .spawn(move || {
                for row in rows {
                    match rt.start_watcher(&row) {
                        Ok(w) => {
                            rt.wait_armed(&w);
                        }
                        Err(e) => tracing::warn!(
                            "sandbox {}: watcher {} not restored: {e}",
                            row.sandbox,
                            row.id
                        ),
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("watchers not restored: {e}");
        }
    }

    fn watcher_row(&self, id: &str, watcher: &str) -> Result<WatcherRow, RuntimeError> {
        self.store()
            .watchers(Some(id))?
            .into_iter()
            .find(|w| w.id == watcher)
            .ok_or_else(|| {
                RuntimeError::NoSuchWatcher(format!("watcher with id {watcher} not found"))
            })
    }

    fn drop_watcher(&self, id: &str, watcher: &str) {
        if let Some(w) = lock(&self.inner.watches).remove(watcher) {
            w.cancel.fire();
        }
        if let Err(e) = self.store().forget_watchers(id, Some(watcher)) {
            tracing::warn!("sandbox {id}: watcher {watcher} not forgotten: {e}");
        }
    }

    /// Starts (or restarts) the watch of `row` on a thread of its own.
    fn start_watcher(&self, row: &WatcherRow) -> Result<Arc<LiveWatcher>, RuntimeError> {
        let w = Arc::new(LiveWatcher {
            sandbox: row.sandbox.clone(),
            cancel: Cancel::new(),
            state: Mutex::new(WatchState::default()),
        });
        if let Some(old) = lock(&self.inner.watches).insert(row.id.clone(), w.clone()) {
            old.cancel.fire();
        }
        let (rt, tw, row2) = (self.clone(), w.clone(), row.clone());
        let spawned = std::thread::Builder::new()
            .name("ember-watcher".into())
            .spawn(move || rt.run_watcher(&row2, &tw));
        if let Err(e) = spawned {
            lock(&self.inner.watches).remove(&row.id);
            return Err(RuntimeError::Internal(format!(
                "cannot start a watcher thread: {e}"
            )));
        }
        Ok(w)
    }

    fn run_watcher(&self, row: &WatcherRow, w: &LiveWatcher) {
        let r = self.watch(
            &row.sandbox,
            &row.path,
            row.recursive,
            &mut |ev| {
                let mut st = lock(&w.state);
                match ev {
                    EventKind::Started { .. } => st.armed = true,
                    EventKind::FsEvent { path, op } => {
                        if st.changes.len() >= MAX_WATCHER_EVENTS {
                            st.changes.pop_front();
                        }
                        st.changes.push_back(FsChange {
                            path: path.clone(),
                            name: relative_name(&row.path, path).to_string(),
                            op: *op,
                        });
                    }
                    _ => {}
                }
                true
            },
            Some(w.cancel.clone()),
        );
        let ended = match r {
            Err(RuntimeError::Guest { code, message, .. }) => Ended::Guest { code, message },
            Err(RuntimeError::NotFound(message)) => Ended::Guest {
                code: ErrorCode::NotFound,
                message,
            },
            Err(RuntimeError::Conflict { message, .. }) => Ended::Guest {
                code: ErrorCode::NotFound,
                message,
            },
            _ => Ended::Transient,
        };
        lock(&w.state).ended = Some(ended);
    }

    /// Waits until `w`'s watch reached the guest, or ended (false then, or after
    /// [`ARM_WAIT`]).
    fn wait_armed(&self, w: &LiveWatcher) -> bool {
        let deadline = std::time::Instant::now() + ARM_WAIT;
        loop {
            {
                let st = lock(&w.state);
                if st.armed {
                    break;
                }
                if st.ended.is_some() {
                    return false;
                }
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(SETTLE);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;

    #[test]
    fn names_are_relative_to_the_watched_directory() {
        assert_eq!(
            relative_name("/home/user/d", "/home/user/d/a/b.txt"),
            "a/b.txt"
        );
        assert_eq!(relative_name("/", "/x"), "x");
        assert_eq!(relative_name("/d", "/elsewhere"), "/elsewhere");
    }

    #[test]
    fn agent_temp_files_are_recognised() {
        assert!(is_agent_temp("/w/.data.csv.ember-1f2e"));
        assert!(!is_agent_temp("/w/data.csv"));
        assert!(!is_agent_temp("/w/.ember-12"));
        assert!(!is_agent_temp("/w/.x.ember-zz"));
    }

    #[test]
    fn watcher_records_survive_reopening_the_store_and_go_with_their_sandbox() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ember.db");
        let row = |id: &str, sb: &str| WatcherRow {
            id: id.into(),
            sandbox: sb.into(),
            path: "/home/user".into(),
            recursive: true,
        };
        {
            let s = Store::open(&path).unwrap();
            s.put_watcher(&row("w1", "sb1")).unwrap();
            s.put_watcher(&row("w2", "sb1")).unwrap();
            s.put_watcher(&row("w3", "sb2")).unwrap();
        }
        let s = Store::open(&path).unwrap();
        let ids: Vec<String> = s
            .watchers(Some("sb1"))
            .unwrap()
            .into_iter()
            .map(|w| w.id)
            .collect();
        assert_eq!(ids, ["w1", "w2"]);
        assert_eq!(s.watchers(None).unwrap().len(), 3);
        assert_eq!(
            s.forget_watchers("sb2", Some("w1")).unwrap(),
            0,
            "another's"
        );
        assert_eq!(s.forget_watchers("sb1", Some("w1")).unwrap(), 1);
        s.purge_sandbox("sb1").unwrap();
        assert!(s.watchers(Some("sb1")).unwrap().is_empty());
        assert_eq!(s.watchers(None).unwrap()[0], row("w3", "sb2"));
    }
}
