//! Filesystem-only snapshots and the sandboxes booted from a disk alone.
//!
//! A filesystem-only snapshot (`snapshot {memory: false}`) keeps a sandbox's disk layer (its
//! copy-on-write overlay over the template's root image), the host paths of its disks and
//! the runtime's metadata, and no memory. A sandbox created from one — or a paused sandbox
//! resumed with `reboot` — is **booted**: the VMM starts the template's current kernel on
//! that disk in a jail like any other, the guest boots to its agent, and the runtime runs
//! the template's warm-up (code, contexts, spare, services) before the sandbox answers. So
//! it has the files, and none of the processes, interpreter state or connections.
//!
//! The disk is taken after a `sync` in the guest, so what the guest wrote before the
//! snapshot is in it; what it writes between the sync and the snapshot has the semantics of
//! a disk after a power loss (the journal replays at boot). A paused sandbox's disk was not
//! synced for the pause (its memory held the rest): resumed with `reboot`, it keeps what the
//! guest had written back by then.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::jail::SnapshotDisk;
use crate::jailed::{self, Live, StartSpec};
use crate::paths::FS_ONLY;
use crate::store::SandboxRow;
use crate::template::Template;
use crate::{Runtime, RuntimeError};

/// How long a booted guest may take to reach its agent (a cold boot on kvm_pvm is ~10–50 s).
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);

/// How long the template's warm-up may take in a booted sandbox.
const WARMUP_TIMEOUT: Duration = Duration::from_secs(900);

/// The files of a full snapshot that a filesystem-only one drops.
const MEMORY_FILES: &[&str] = &["memory", "state", "workingset"];

/// Turns the full snapshot the runtime just wrote into `dir` into a filesystem-only one: the
/// memory, the VM state and the kept agent connection go, the disks stay.
pub(super) fn drop_memory(dir: &Path) -> Result<(), RuntimeError> {
    for name in MEMORY_FILES {
        let f = dir.join(name);
        match std::fs::remove_file(&f) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(RuntimeError::io("cannot remove", &f)(e)),
        }
    }
    let _ = std::fs::remove_file(dir.join(crate::agent_link::RECORD_FILE));
    let f = dir.join(FS_ONLY);
    let text = serde_json::json!({ "version": 1, "disk": "disk0.overlay" }).to_string();
    std::fs::write(&f, text).map_err(RuntimeError::io("cannot write", &f))
}

/// Why `dir`'s disk layer cannot be booted, if it cannot.
fn boot_disk(dir: &Path) -> Result<(PathBuf, PathBuf), RuntimeError> {
    let disks = jailed::snapshot_disks(dir)?;
    let base = match disks.as_slice() {
        [SnapshotDisk::Overlay { base }] => base.clone(),
        _ => {
            return Err(RuntimeError::Invalid(format!(
                "{}: only a sandbox with one overlay disk (a template's root) can be booted from \
                 its disk; this one has {disks:?}",
                dir.display()
            )))
        }
    };
    let overlay = dir.join("disk0.overlay");
    if !overlay.is_file() {
        return Err(RuntimeError::Internal(format!(
            "{} is missing: the snapshot has no disk layer to boot",
            overlay.display()
        )));
    }
    if !base.is_file() {
        return Err(RuntimeError::Invalid(format!(
            "the root image {} that the disk layer in {} was written over is gone (its \
             template's image was deleted from the cache); the snapshot cannot be booted",
            base.display(),
            dir.display()
        )));
    }
    Ok((overlay, base))
}

/// Copies a sparse file (holes kept; a reflink where the file system can).
fn copy_sparse(src: &Path, dest: &Path) -> Result<(), RuntimeError> {
    let status = std::process::Command::new("cp")
        .args(["--sparse=always", "--reflink=auto"])
        .arg(src)
        .arg(dest)
        .status()
        .map_err(RuntimeError::io("cannot run cp for", dest))?;
    if !status.success() {
        return Err(RuntimeError::Internal(format!(
            "cp {} {}: {status}",
            src.display(),
            dest.display()
        )));
    }
    Ok(())
}

impl Runtime {
    /// Writes the guest's dirty pages back to its disk (`sync` as root in the guest), so a
    /// filesystem-only snapshot holds what the guest wrote.
    pub(super) fn sync_guest(&self, vm: &Live, id: &str) -> Result<(), RuntimeError> {
        let req = ember_agent::protocol::ExecRequest {
            argv: vec!["sync".into()],
            user: ember_agent::protocol::ExecUser::Root,
            timeout_ms: Some(60_000),
            ..Default::default()
        };
        let mut code = None;
        vm.sandbox
            .call(
                &ember_agent::protocol::Call::Exec(req),
                Duration::from_secs(90),
                |ev| {
                    if let ember_agent::protocol::EventKind::Exit(
                        ember_agent::protocol::ExitStatus::Code(c),
                    ) = ev
                    {
                        code = Some(c);
                    }
                    Ok(())
                },
            )
            .map_err(|e| RuntimeError::Internal(format!("sandbox {id}: sync: {e}")))?;
        if code != Some(0) {
            return Err(RuntimeError::Internal(format!(
                "sandbox {id}: `sync` in the guest ended with {code:?}"
            )));
        }
        Ok(())
    }

    /// Boots `row`'s VM in a fresh jail on the disk layer in `dir` (a filesystem-only
    /// snapshot, or a pause snapshot whose memory is ignored), runs its template's warm-up,
    /// and hands back the live VM. The VMM starts the template's current kernel; the disk
    /// keeps the root image it was written over.
    pub(super) fn start_booted(
        &self,
        dir: &Path,
        row: &SandboxRow,
    ) -> Result<(u32, Live), (RuntimeError, Option<u32>)> {
        let uid = self.alloc_uid().map_err(|e| (e, None))?;
        self.boot_in_jail(dir, row, uid)
            .map(|live| (uid, live))
            .map_err(|e| (e, Some(uid)))
    }

    fn boot_in_jail(&self, dir: &Path, row: &SandboxRow, uid: u32) -> Result<Live, RuntimeError> {
        let cfg = &self.inner.cfg;
        let name = row.template.as_deref().ok_or_else(|| {
            RuntimeError::Invalid(format!(
                "sandbox {} has no template: there is no kernel or warm-up to boot its disk with",
                row.id
            ))
        })?;
        let t = Template::open(name).map_err(|e| {
            RuntimeError::Invalid(format!(
                "booting sandbox {} needs its template {name:?}: {e}",
                row.id
            ))
        })?;
        let (overlay, base) = boot_disk(dir)?;
        // The template build's own VM description: kernel, command line, shape, network.
        let vm_json = t.dir.join("vm.json");
        let mut vm: ember_vmm::vm::VmConfig = std::fs::read(&vm_json)
            .map_err(RuntimeError::io("cannot read", &vm_json))
            .and_then(|b| {
                serde_json::from_slice(&b)
                    .map_err(|e| RuntimeError::Internal(format!("{}: {e}", vm_json.display())))
            })?;
        let state = cfg.sandbox_dir(&row.id);
        std::fs::create_dir_all(&state).map_err(RuntimeError::io("cannot create", &state))?;
        // Each boot writes its own copy of the layer; the snapshot stays as it was.
        let own = state.join("boot-disk0.overlay");
        let _ = std::fs::remove_file(&own);
        copy_sparse(&overlay, &own)?;
        vm.disks = vec![ember_vmm::vm::DiskConfig {
            path: own,
            mode: ember_vmm::vm::DiskMode::Overlay { base: base.clone() },
            id: "rootfs".into(),
        }];
        vm.vsock = Some(ember_vmm::vm::VsockConfig {
            guest_cid: 3,
            uds_path: PathBuf::from("/work/vsock"),
        });
        let jail_id = format!("{}-{}", row.id, &crate::paths::random_id()[..6]);
        let net = self.setup_net_with(!vm.net.is_empty(), &jail_id, uid, &row.network.policy)?;
        let disks = vec![SnapshotDisk::Overlay { base }];
        let spec = StartSpec {
            id: &row.id,
            jail_id: &jail_id,
            uid,
            snapshot: dir,
            disks: &disks,
            limits: self.limits(&row.resources),
            net,
            kept: None,
            boot: Some((&vm, BOOT_TIMEOUT.max(cfg.connect_timeout))),
        };
        let live = self.start_jailed(&spec)?;
        let warmed = live.sandbox.with_client("warmup", |c| {
            Ok(crate::template::build::warm_up(
                c,
                name,
                &t.info.warmup,
                &t.info.env,
                WARMUP_TIMEOUT,
                &mut |_| {},
            ))
        });
        let err = match warmed {
            Ok(Ok((warmup_ms, services_ms))) => {
                tracing::info!(
                    "sandbox {}: booted from its disk; warm-up {warmup_ms} ms, services \
                     {services_ms} ms",
                    row.id
                );
                return Ok(live);
            }
            Ok(Err(e)) => RuntimeError::Internal(format!("sandbox {}: {e}", row.id)),
            Err(e) => RuntimeError::from(e),
        };
        self.release_vm(&row.id, &live);
        Err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paths::is_fs_only;

    #[test]
    fn dropping_memory_leaves_the_disks_and_a_marker() {
        let d = tempfile::tempdir().unwrap();
        for f in ["memory", "state", "disk0.overlay", "ember-disks.json"] {
            std::fs::write(d.path().join(f), b"x").unwrap();
        }
        assert!(!is_fs_only(d.path()));
        drop_memory(d.path()).unwrap();
        assert!(is_fs_only(d.path()));
        assert!(!d.path().join("memory").exists());
        assert!(!d.path().join("state").exists());
        assert!(d.path().join("disk0.overlay").exists());
        assert!(d.path().join("ember-disks.json").exists());
        // Twice is fine (nothing left to remove).
        drop_memory(d.path()).unwrap();
    }

    #[test]
    fn a_layer_without_its_overlay_or_base_is_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let base = d.path().join("base.ext4");
        crate::jailed::write_disks(d.path(), &[SnapshotDisk::Overlay { base: base.clone() }])
            .unwrap();
        let e = boot_disk(d.path()).unwrap_err().to_string();
        assert!(e.contains("disk0.overlay"), "{e}");
        std::fs::write(d.path().join("disk0.overlay"), b"x").unwrap();
        let e = boot_disk(d.path()).unwrap_err().to_string();
        assert!(e.contains("base.ext4") && e.contains("gone"), "{e}");
        std::fs::write(&base, b"x").unwrap();
        assert_eq!(
            boot_disk(d.path()).unwrap(),
            (d.path().join("disk0.overlay"), base)
        );
        crate::jailed::write_disks(
            d.path(),
            &[SnapshotDisk::Raw {
                path: "/x".into(),
                writable: true,
            }],
        )
        .unwrap();
        assert!(boot_disk(d.path())
            .unwrap_err()
            .to_string()
            .contains("one overlay"));
    }
}
