//! Pause and resume: a pause snapshots the VM to disk and lets its VMM go (memory freed), a
//! resume restores it; with the helpers they share with the rest of the lifecycle — a paused
//! VMM retired off the caller's path, and the waits for a transient state (`settle`) and for
//! calls in flight (`drain`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_jailer::jail::Timings;

use crate::jailed::Live;
use crate::store::{now_ms, SandboxRow};
use crate::types::*;
use crate::{lock, Runtime, RuntimeError, Slot, SlotState};

impl Runtime {
    /// Pauses a sandbox: its artifacts are copied out, its VM is snapshotted to
    /// `$EMBER_HOME/sandboxes/<id>/pause`, its VMM exits (memory freed). Calls in flight are
    /// waited for (30 s at most); calls that arrive meanwhile wait, then resume it.
    pub fn pause(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        self.timed(Some(id), "pause", serde_json::json!({}), || {
            self.pause_inner(id, "paused by request")
        })
    }

    pub(crate) fn pause_inner(&self, id: &str, reason: &str) -> Result<SandboxInfo, RuntimeError> {
        let slot = self.slot(id)?;
        let st = lock(&slot.st);
        let mut st = self.settle(&slot, st);
        match st.row.state {
            State::Running => {}
            State::Paused => return Ok(st.row.info()),
            s => {
                return Err(RuntimeError::conflict(
                    id,
                    s,
                    "only a running sandbox can pause",
                ))
            }
        }
        // Where a pause's time goes, for the log line at the end.
        let mut phases = Timings::new();
        self.transition(&slot, &mut st, State::Pausing, Some(reason.to_string()));
        st.cancel_streams();
        let st = self.drain(&slot, st);
        phases.mark("drain");
        let Some(vm) = st.vm.clone() else {
            return Err(RuntimeError::Internal(format!("sandbox {id} has no VM")));
        };
        let row = st.row.clone();
        drop(st);
        if let Err(e) = self.collect_from(&row, &vm) {
            tracing::warn!("sandbox {id}: artifacts not collected: {e}");
        }
        phases.mark("artifacts");
        let dest = self.inner.cfg.sandbox_dir(id).join("pause");
        let snap = self.pause_snapshot(&vm, &row, &dest);
        phases.mark("snapshot");
        let mut st = lock(&slot.st);
        match snap {
            Ok(()) => {
                self.retire_vm(&mut st);
                phases.mark("stop");
                st.row.pause_dir = Some(dest);
                self.transition(&slot, &mut st, State::Paused, Some(reason.to_string()));
                phases.mark("record");
                tracing::info!("sandbox {id}: paused: {}", phases.summary());
                let (info, row) = (st.row.info(), st.row.clone());
                drop(st);
                if let (Some(h), Some(dir)) = (self.hooks(), &row.pause_dir) {
                    h.paused(&super::moved::portable(&row), dir);
                }
                Ok(info)
            }
            Err(e) => {
                // The VM may still run (the snapshot failed before it exited): keep it.
                let alive = st
                    .vm
                    .as_ref()
                    .is_some_and(|v| v.sandbox.exit_status().is_none());
                if alive {
                    self.transition(
                        &slot,
                        &mut st,
                        State::Running,
                        Some(format!("pause failed: {e}")),
                    );
                } else {
                    self.stop_vm(&mut st);
                    self.transition(
                        &slot,
                        &mut st,
                        State::Failed,
                        Some(format!("pause failed: {e}")),
                    );
                    drop(st);
                    lock(&self.inner.slots).remove(id);
                }
                Err(e)
            }
        }
    }

    /// Writes a pause snapshot into `dest`: a layer (only the pages the VM changed since it
    /// was restored, over a hard link to the memory file it was restored from, so a template
    /// rebuild cannot break it), or a full snapshot when a layer cannot be made (the base is
    /// on another filesystem, or gone). Leaves the VMM paused or exited for `stop_vm`.
    fn pause_snapshot(&self, vm: &Live, row: &SandboxRow, dest: &Path) -> Result<(), RuntimeError> {
        use ember_vmm::api::{AfterSnapshot, SnapshotKind};
        let layered = self
            .snapshot_to(vm, row, dest, SnapshotKind::Layer, AfterSnapshot::Pause)
            .and_then(|()| self.link_pause_base(vm, row, dest));
        match layered {
            Ok(()) => Ok(()),
            Err(e) => {
                tracing::info!(
                    "sandbox {}: no layered pause ({e}); taking a full snapshot",
                    row.id
                );
                self.snapshot_to(vm, row, dest, SnapshotKind::Full, AfterSnapshot::Exit)
            }
        }
    }

    /// Hard-links the base memory file of the layered snapshot in `dest` into it. The VMM
    /// names the base as it sees it in its jail: found on the host through the jail's bind
    /// mounts, or as the base a resume kept in the sandbox's directory (the pause snapshot it
    /// came from is gone by then). The link must be the file the layer was taken over.
    fn link_pause_base(
        &self,
        vm: &Live,
        row: &SandboxRow,
        dest: &Path,
    ) -> Result<(), RuntimeError> {
        let layer = ember_snapshot::read_layer(dest)
            .map_err(|e| RuntimeError::Internal(e.to_string()))?
            .ok_or_else(|| {
                RuntimeError::Internal(format!("{} is not a layered snapshot", dest.display()))
            })?;
        let kept = self
            .inner
            .cfg
            .sandbox_dir(&row.id)
            .join(ember_snapshot::BASE_MEMORY_FILE);
        let mut candidates: Vec<PathBuf> = vm
            .jail
            .binds
            .iter()
            .filter_map(|b| {
                let rest = layer.base_path.strip_prefix(&b.dest).ok()?;
                Some(b.src.join(rest))
            })
            .collect();
        candidates.push(kept.clone());
        let mut why = Vec::new();
        for c in &candidates {
            match ember_snapshot::link_base(dest, &layer, c) {
                Ok(_) => {
                    // The previous pause's base, if any, is now linked here.
                    let _ = std::fs::remove_file(&kept);
                    return Ok(());
                }
                Err(e) => why.push(e.to_string()),
            }
        }
        Err(RuntimeError::Internal(format!(
            "sandbox {}: cannot keep the base memory file {} of its pause: {}",
            row.id,
            layer.base_path.display(),
            why.join("; ")
        )))
    }

    /// [`Self::stop_vm`] for a VMM whose work is done (a pause snapshot is on disk): the slot
    /// lets go of it at once and a thread kills it and releases its jail, network and uid, off
    /// the caller's path (the kernel's teardown of a VM and of a network namespace take tens
    /// of milliseconds). [`Self::settle`], which every later operation on the slot goes
    /// through, waits for that thread first.
    fn retire_vm(&self, st: &mut SlotState) {
        st.expected_exit = true;
        let uid = st.row.uid.take();
        st.row.jail_id = None;
        st.row.pid = None;
        let Some(vm) = st.vm.take() else {
            self.free_uid(uid);
            return;
        };
        let (rt, id, theirs) = (self.clone(), st.row.id.clone(), Arc::clone(&vm));
        let spawned = std::thread::Builder::new()
            .name("ember-retire".into())
            .spawn(move || {
                rt.release_vm(&id, &theirs);
                rt.free_uid(uid);
            });
        match spawned {
            Ok(handle) => st.retiring = Some(handle),
            Err(e) => {
                tracing::warn!("sandbox {}: stopping its VM inline: {e}", st.row.id);
                self.release_vm(&st.row.id, &vm);
                self.free_uid(uid);
            }
        }
    }

    /// Waits while the sandbox is in a transient state.
    pub(super) fn settle<'a>(
        &self,
        slot: &'a Slot,
        mut st: std::sync::MutexGuard<'a, SlotState>,
    ) -> std::sync::MutexGuard<'a, SlotState> {
        // A VMM retired by a pause is gone, with its jail and network, before anything else
        // happens to the sandbox (the thread never takes a slot lock).
        if let Some(retiring) = st.retiring.take() {
            if retiring.join().is_err() {
                tracing::error!("sandbox {}: stopping its VM panicked", st.row.id);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(600);
        while matches!(
            st.row.state,
            State::Creating | State::Pausing | State::Resuming
        ) && Instant::now() < deadline
        {
            st = slot
                .cv
                .wait_timeout(st, Duration::from_secs(1))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st
    }

    /// Waits (up to 30 s) for calls in flight to finish.
    fn drain<'a>(
        &self,
        slot: &'a Slot,
        mut st: std::sync::MutexGuard<'a, SlotState>,
    ) -> std::sync::MutexGuard<'a, SlotState> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while st.inflight > 0 && Instant::now() < deadline {
            st = slot
                .cv
                .wait_timeout(st, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st
    }

    /// Resumes a paused sandbox (a no-op for a running one).
    pub fn resume(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        self.resume_with(id, false)
    }

    /// Resumes a paused sandbox; with `reboot`, from its disk alone: the memory of its pause
    /// snapshot is ignored (kept, not modified) and the VM boots its template's kernel on the
    /// disk (`boot.rs`), losing its processes and in-memory state. A no-op for a running one.
    pub fn resume_with(&self, id: &str, reboot: bool) -> Result<SandboxInfo, RuntimeError> {
        self.timed(
            Some(id),
            "resume",
            serde_json::json!({ "reboot": reboot }),
            || self.resume_inner(id, reboot),
        )
    }

    fn resume_inner(&self, id: &str, reboot: bool) -> Result<SandboxInfo, RuntimeError> {
        let slot = self.slot(id)?;
        // The embedder may have given it to another host (a fleet): then it is not ours.
        if lock(&slot.st).row.state == State::Paused {
            self.may_resume(id)?;
        }
        let gate = lock(&self.inner.capacity);
        let (n, mem) = self.committed();
        let st = lock(&slot.st);
        let mut st = self.settle(&slot, st);
        match st.row.state {
            State::Paused => {}
            State::Running => return Ok(st.row.info()),
            s => {
                return Err(RuntimeError::conflict(
                    id,
                    s,
                    "only a paused sandbox can resume",
                ))
            }
        }
        let Some(dir) = st.row.pause_dir.clone() else {
            return Err(RuntimeError::Internal(format!(
                "sandbox {id} is paused without a snapshot"
            )));
        };
        {
            let cfg = &self.inner.cfg;
            if n >= cfg.max_running
                || mem + st.row.resources.memory_mib > cfg.max_committed_memory_mib
            {
                return Err(RuntimeError::Capacity(format!(
                    "cannot resume {id}: {n} sandboxes running with {mem} MiB committed (caps {} \
                     and {} MiB)",
                    cfg.max_running, cfg.max_committed_memory_mib
                )));
            }
        }
        // A resumed sandbox gets a fresh timeout.
        st.row.ends_ms = Some(now_ms() + st.row.timeout_ms);
        self.transition(&slot, &mut st, State::Resuming, None);
        drop(st);
        drop(gate);
        let what = if reboot {
            "resumed (booted from its disk)"
        } else {
            "resumed"
        };
        self.start_vm(&slot, &dir, what, reboot)?;
        if reboot {
            // A booted guest has none of the mounts its memory had.
            let mounts = self.inner.volumes.mounts_of(id);
            if let Err(e) = self.volumes_mount_in_guest(id, &mounts) {
                tracing::warn!("sandbox {id}: its volumes are not mounted after the reboot: {e}");
            }
        }
        let mut st = lock(&slot.st);
        st.row.pause_dir = None;
        let _ = self.store().update_sandbox(&st.row);
        let info = st.row.info();
        drop(st);
        // The restored VM has mapped what it needs; the snapshot can go. A layered one's
        // base is kept in the sandbox's directory: the next pause links it again.
        let base = dir.join(ember_snapshot::BASE_MEMORY_FILE);
        if base.exists() {
            let kept = self
                .inner
                .cfg
                .sandbox_dir(id)
                .join(ember_snapshot::BASE_MEMORY_FILE);
            if let Err(e) = std::fs::rename(&base, &kept) {
                tracing::warn!("sandbox {id}: cannot keep {}: {e}", base.display());
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        self.wake_timer();
        Ok(info)
    }
}
