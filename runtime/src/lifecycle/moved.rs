//! A paused sandbox moving between hosts, and what an embedder is told so that it can move
//! one.
//!
//! On one host nothing here is used. A fleet's node (`ember-fleet`) sets [`LifecycleHooks`]:
//! it hears of every pause (whatever asked for it: a call, a timeout) with the snapshot's
//! directory, uploads it, and is asked before every resume whether the sandbox is still its
//! own (the directory may have given it to another node meanwhile: then the resume is
//! refused and the sandbox forgotten here, so that it never runs twice). Another node takes
//! the sandbox in with [`Runtime::import_paused`]: its row (as [`Runtime::export_paused`] gave
//! it) and a snapshot directory made from the upload; it is then paused here, and the next
//! call resumes it as any paused sandbox.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::store::SandboxRow;
use crate::types::*;
use crate::{lock, Runtime, RuntimeError, Slot};

/// What a resume may do, as the embedder judges it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeVerdict {
    /// Resume.
    Go,
    /// The sandbox is no longer this host's (the reason names where it went): the runtime
    /// forgets it and answers "no such sandbox".
    Moved(String),
}

/// What the runtime tells its embedder about pauses and resumes. Called on the thread doing
/// the pause or resume: keep them short (queue slow work).
pub trait LifecycleHooks: Send + Sync + std::fmt::Debug {
    /// Sandbox `id` was paused; its snapshot is in `dir` until it resumes or is killed (read
    /// it, never change it). `row` is its record as [`Runtime::export_paused`] gives it.
    fn paused(&self, row: &SandboxRow, dir: &Path);
    /// Paused sandbox `id` is about to resume here (before its VM starts).
    fn resuming(&self, id: &str) -> ResumeVerdict;
    /// Sandbox `id`'s artifacts were copied out into `dir` (all it has so far; read them,
    /// never change them).
    fn artifacts_collected(&self, id: &str, dir: &Path) {
        let _ = (id, dir);
    }
}

impl Runtime {
    /// Sets what pauses and resumes are told to (once, before sandboxes are used).
    pub fn set_hooks(&self, hooks: Arc<dyn LifecycleHooks>) {
        *lock(&self.inner.hooks) = Some(hooks);
    }

    pub(crate) fn hooks(&self) -> Option<Arc<dyn LifecycleHooks>> {
        lock(&self.inner.hooks).clone()
    }

    /// A paused sandbox's row (what another host needs to take it in, with the host's own
    /// parts cleared: uid, jail, pid) and its snapshot's directory.
    pub fn export_paused(&self, id: &str) -> Result<(SandboxRow, PathBuf), RuntimeError> {
        let slot = self.slot(id)?;
        let st = lock(&slot.st);
        let st = self.settle(&slot, st);
        if st.row.state != State::Paused {
            return Err(RuntimeError::conflict(
                id,
                st.row.state,
                "only a paused sandbox can move to another host",
            ));
        }
        let dir = st.row.pause_dir.clone().ok_or_else(|| {
            RuntimeError::Internal(format!("sandbox {id} is paused without a snapshot"))
        })?;
        Ok((portable(&st.row), dir))
    }

    /// Takes in a sandbox paused on another host: `row` as [`Self::export_paused`] gave it
    /// there, `snapshot` a directory holding its pause snapshot made for this host (its
    /// files are moved into the sandbox's directory). The sandbox is then paused here; its
    /// source is `source_dir` (this host's copy of what it was restored from). Refused when
    /// this host already has a sandbox of that id.
    pub fn import_paused(
        &self,
        row: SandboxRow,
        snapshot: &Path,
        source_dir: &Path,
        reason: &str,
    ) -> Result<SandboxInfo, RuntimeError> {
        let id = row.id.clone();
        crate::lifecycle::check_name(&id)?;
        if row.state != State::Paused {
            return Err(RuntimeError::Invalid(format!(
                "sandbox {id}: only a paused sandbox can be taken in (it is {})",
                row.state.as_str()
            )));
        }
        if lock(&self.inner.slots).contains_key(&id) || self.store().sandbox(&id)?.is_some() {
            return Err(RuntimeError::Invalid(format!(
                "sandbox {id} is already known on this host"
            )));
        }
        let sdir = self.inner.cfg.sandbox_dir(&id);
        std::fs::create_dir_all(&sdir).map_err(RuntimeError::io("cannot create", &sdir))?;
        let dest = sdir.join("pause");
        std::fs::rename(snapshot, &dest).map_err(RuntimeError::io("cannot move in", snapshot))?;
        let mut row = portable(&row);
        row.pause_dir = Some(dest);
        row.source_dir = source_dir.to_path_buf();
        row.reason = Some(reason.to_string());
        let slot = Slot::new(row.clone(), Some(crate::store::now_ms()));
        {
            let store = self.store();
            let stored = store
                .insert_sandbox(&row)
                .and_then(|_| store.add_transition(&id, None, State::Paused, Some(reason)));
            if let Err(e) = stored {
                drop(store);
                let _ = std::fs::remove_dir_all(&sdir);
                return Err(e.into());
            }
        }
        lock(&self.inner.slots).insert(id, slot);
        self.wake_timer();
        Ok(row.info())
    }

    /// Named snapshot `name` and its directory (what another host needs to restore from it).
    pub fn export_snapshot(&self, name: &str) -> Result<(SnapshotInfo, PathBuf), RuntimeError> {
        crate::lifecycle::check_name(name)?;
        self.store()
            .snapshot(name)?
            .ok_or_else(|| RuntimeError::NoSuchSnapshot(format!("no snapshot {name:?}")))
    }

    /// Takes in a named snapshot made on another host: `staged` (a directory on this host's
    /// state file system holding it, with this host's disk paths) becomes the snapshot
    /// `info.name`. Refused when this host has a snapshot of that name.
    pub fn import_snapshot(
        &self,
        info: SnapshotInfo,
        staged: &Path,
    ) -> Result<SnapshotInfo, RuntimeError> {
        crate::lifecycle::check_name(&info.name)?;
        if self.store().snapshot(&info.name)?.is_some() {
            return Err(RuntimeError::Invalid(format!(
                "a snapshot named {:?} exists",
                info.name
            )));
        }
        let dest = self.inner.cfg.snapshots_dir().join(&info.name);
        std::fs::rename(staged, &dest).map_err(RuntimeError::io("cannot move in", staged))?;
        if let Err(e) = self
            .store()
            .put_snapshot(&info, &dest, crate::store::now_ms())
        {
            let _ = std::fs::remove_dir_all(&dest);
            return Err(e.into());
        }
        Ok(info)
    }

    /// Drops every trace of sandbox `id` on this host — its VM (stopped), snapshot, files and
    /// records — because it lives elsewhere now (`why` goes to the log). A no-op for an id
    /// this host does not know.
    pub fn forget(&self, id: &str, why: &str) {
        let slot = lock(&self.inner.slots).remove(id);
        if let Some(slot) = slot {
            let st = lock(&slot.st);
            let mut st = self.settle(&slot, st);
            st.cancel_streams();
            self.stop_vm(&mut st);
            st.row.pause_dir = None;
            drop(st);
            slot.cv.notify_all();
        }
        self.forget_watchers(id);
        if let Err(e) = self.store().purge_sandbox(id) {
            tracing::warn!("sandbox {id}: its records not removed: {e}");
        }
        let _ = std::fs::remove_dir_all(self.inner.cfg.sandbox_dir(id));
        tracing::info!("sandbox {id}: forgotten on this host: {why}");
    }

    /// The resume verdict of the hooks (`Go` without hooks). A `Moved` sandbox is forgotten
    /// here and answered as unknown.
    pub(crate) fn may_resume(&self, id: &str) -> Result<(), RuntimeError> {
        let Some(h) = self.hooks() else {
            return Ok(());
        };
        match h.resuming(id) {
            ResumeVerdict::Go => Ok(()),
            ResumeVerdict::Moved(why) => {
                self.forget(id, &why);
                Err(RuntimeError::NotFound(id.to_string()))
            }
        }
    }
}

/// `row` without what belongs to one host, and without its secret environment values
/// (`crate::secret_env`: they never leave the server's memory).
pub(super) fn portable(row: &SandboxRow) -> SandboxRow {
    let mut r = row.clone();
    r.env = crate::secret_env::at_rest(&r.env, &r.secret_env);
    crate::secret_env::restore(&mut r.env, &mut r.secret_env);
    r.uid = None;
    r.jail_id = None;
    r.pid = None;
    r
}
