//! Durable named snapshots and forks, and the snapshot writer they share with pause
//! (`snapshot_to`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{check_name, SnapshotMeta};
use crate::jailed::{self, Live};
use crate::store::{now_ms, rfc3339, SandboxRow};
use crate::types::*;
use crate::{lock, Runtime, RuntimeError};

impl Runtime {
    /// Takes a durable named snapshot of a running sandbox, which keeps running: memory and
    /// disk, or with `memory: false` the disk alone (`boot.rs`). `create` accepts the name as
    /// `snapshot`.
    pub fn snapshot(&self, id: &str, req: &SnapshotRequest) -> Result<SnapshotInfo, RuntimeError> {
        let name = req
            .name
            .clone()
            .unwrap_or_else(|| format!("{id}-{}", now_ms()));
        check_name(&name)?;
        if self.store().snapshot(&name)?.is_some() {
            return Err(RuntimeError::Invalid(format!(
                "a snapshot named {name:?} exists"
            )));
        }
        let dest = self.inner.cfg.snapshots_dir().join(&name);
        let memory = req.memory.unwrap_or(true);
        self.audited(
            id,
            "snapshot",
            serde_json::json!({ "name": name, "memory": memory }),
            |vm, _| {
                let row = self.row(id)?;
                if !memory {
                    // The disk alone: what the guest wrote must be on it, not in its cache.
                    self.sync_guest(vm, id)?;
                }
                self.snapshot_to(
                    vm,
                    &row,
                    &dest,
                    ember_vmm::api::SnapshotKind::Full,
                    ember_vmm::api::AfterSnapshot::Continue,
                )?;
                if !memory {
                    if let Err(e) = super::boot::drop_memory(&dest) {
                        let _ = std::fs::remove_dir_all(&dest);
                        return Err(e);
                    }
                }
                let info = SnapshotInfo {
                    name: name.clone(),
                    sandbox: id.to_string(),
                    template: row.template.clone(),
                    created_at: rfc3339(now_ms()),
                    bytes: dir_bytes(&dest),
                    memory,
                };
                self.store().put_snapshot(&info, &dest, now_ms())?;
                Ok(info)
            },
        )
    }

    /// Named snapshots.
    pub fn snapshots(&self) -> Result<Vec<SnapshotInfo>, RuntimeError> {
        Ok(self.store().snapshots()?)
    }

    /// Deletes a named snapshot (sandboxes restored from it are not affected).
    pub fn delete_snapshot(&self, name: &str) -> Result<(), RuntimeError> {
        check_name(name)?;
        let Some((_, dir)) = self.store().snapshot(name)? else {
            return Err(RuntimeError::NoSuchSnapshot(format!(
                "no snapshot {name:?}"
            )));
        };
        self.store().delete_snapshot(name)?;
        let _ = std::fs::remove_dir_all(dir);
        Ok(())
    }

    fn row(&self, id: &str) -> Result<SandboxRow, RuntimeError> {
        Ok(lock(&self.slot(id)?.st).row.clone())
    }

    /// Forks a running sandbox into `count` new ones that continue from its current state
    /// (each with its own overlay, clock, entropy and vsock). The parent pauses only for the
    /// snapshot and keeps running.
    pub fn fork(&self, id: &str, req: &ForkRequest) -> Result<Vec<SandboxInfo>, RuntimeError> {
        if req.count == 0 || req.count > 64 {
            return Err(RuntimeError::Invalid("count must be 1 to 64".into()));
        }
        let dir = self
            .inner
            .cfg
            .home
            .join("forks")
            .join(crate::paths::random_id());
        let parent = self.audited(
            id,
            "fork",
            serde_json::json!({ "count": req.count }),
            |vm, _| {
                let row = self.row(id)?;
                self.snapshot_to(
                    vm,
                    &row,
                    &dir,
                    ember_vmm::api::SnapshotKind::Full,
                    ember_vmm::api::AfterSnapshot::Continue,
                )?;
                Ok(row)
            },
        )?;
        let create = CreateRequest {
            template: parent.template.clone(),
            timeout_secs: Some(
                req.timeout_secs
                    .unwrap_or((parent.timeout_ms / 1000).max(1) as u64),
            ),
            on_timeout: parent.on_timeout,
            cpu_percent: parent.resources.cpu_percent,
            pids_max: Some(parent.resources.pids_max),
            env: BTreeMap::new(),
            metadata: req.metadata.clone().unwrap_or(parent.metadata.clone()),
            ..Default::default()
        };
        let results: Vec<Result<SandboxInfo, RuntimeError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..req.count)
                .map(|_| {
                    let create = &create;
                    let dir = &dir;
                    let parent = &parent;
                    s.spawn(move || {
                        let at = now_ms();
                        let t0 = Instant::now();
                        let r = self.create_fork(create, parent, dir);
                        let child = r.as_ref().ok().map(|i| i.id.clone());
                        self.record(
                            at,
                            child.as_deref(),
                            "create",
                            &serde_json::json!({ "forked_from": parent.id }),
                            t0.elapsed().as_secs_f64() * 1e3,
                            &r,
                            (0, 0),
                        );
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(RuntimeError::Internal("fork thread panicked".into()))
                    })
                })
                .collect()
        });
        // Every clone has mapped the snapshot: it can go.
        let _ = std::fs::remove_dir_all(&dir);
        let mut out = Vec::new();
        for r in results {
            match r {
                Ok(i) => out.push(i),
                Err(e) => {
                    for i in &out {
                        let _ = self.stop(&i.id, "fork failed");
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    fn create_fork(
        &self,
        req: &CreateRequest,
        parent: &SandboxRow,
        dir: &Path,
    ) -> Result<SandboxInfo, RuntimeError> {
        self.create_inner(req, Some((parent, dir)))
    }

    /// Snapshots the VM into the host directory `dest` (through its jail's /work), with
    /// the host paths of its disks recorded.
    pub(super) fn snapshot_to(
        &self,
        vm: &Live,
        row: &SandboxRow,
        dest: &Path,
        kind: ember_vmm::api::SnapshotKind,
        after: ember_vmm::api::AfterSnapshot,
    ) -> Result<(), RuntimeError> {
        let name = format!("snap-{}", &crate::paths::random_id()[..8]);
        let in_jail = PathBuf::from("/work").join(&name);
        let host = vm.host_path(&format!("/work/{name}"));
        // One idle agent connection is held out of the pool through the snapshot, so that the
        // snapshot keeps it with nothing in flight; restores of it take it over. Without one
        // (the agent does not answer) the snapshot is taken all the same and its restores
        // connect anew.
        let held = match vm.sandbox.hold_connection() {
            Ok(h) => Some(h),
            Err(e) => {
                tracing::info!(
                    "sandbox {}: snapshot without a kept agent connection: {e}",
                    row.id
                );
                None
            }
        };
        let reply = ember_vmm::api::call(
            vm.sandbox.api_socket(),
            &ember_vmm::api::Request::Snapshot {
                dir: in_jail,
                kind,
                after,
            },
        )
        .map_err(|m| RuntimeError::Internal(format!("sandbox {}: snapshot: {m}", row.id)))?;
        if reply["ok"] != true {
            let _ = std::fs::remove_dir_all(&host);
            return Err(RuntimeError::Internal(format!(
                "sandbox {}: snapshot refused: {reply}",
                row.id
            )));
        }
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(RuntimeError::io("cannot create", parent))?;
        }
        let _ = std::fs::remove_dir_all(dest);
        if std::fs::rename(&host, dest).is_err() {
            copy_dir(&host, dest)?;
            let _ = std::fs::remove_dir_all(&host);
        }
        jailed::write_disks(dest, &vm.disks)?;
        if let Some(h) = held {
            crate::agent_link::record(dest, h.kept()).map_err(RuntimeError::io(
                "cannot write the kept-connection record in",
                dest,
            ))?;
        }
        // Secret values stay out of the snapshot's metadata (`crate::secret_env`).
        let mut env = row.env.clone();
        env.retain(|k, _| !row.secret_env.contains(k));
        let meta = SnapshotMeta {
            env,
            outputs: row.outputs.clone(),
            resources: row.resources.clone(),
            volumes: self.inner.volumes.mounts_of(&row.id),
        };
        let f = dest.join("ember-snapshot.json");
        std::fs::write(&f, serde_json::to_vec(&meta).unwrap_or_default())
            .map_err(RuntimeError::io("cannot write", &f))?;
        Ok(())
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .map(|es| {
            es.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}

/// Copies a snapshot directory (files only, sparse holes kept where the filesystem allows).
fn copy_dir(src: &Path, dest: &Path) -> Result<(), RuntimeError> {
    std::fs::create_dir_all(dest).map_err(RuntimeError::io("cannot create", dest))?;
    let entries = std::fs::read_dir(src).map_err(RuntimeError::io("cannot read", src))?;
    for e in entries.flatten() {
        let to = dest.join(e.file_name());
        let status = std::process::Command::new("cp")
            .arg("--sparse=always")
            .arg(e.path())
            .arg(&to)
            .status()
            .map_err(RuntimeError::io("cannot run cp for", &to))?;
        if !status.success() {
            return Err(RuntimeError::Internal(format!(
                "cp {} {}: {status}",
                e.path().display(),
                to.display()
            )));
        }
    }
    Ok(())
}
