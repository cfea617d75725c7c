//! The runtime's volume calls (create, list, get, delete and the content API) and the three
//! hooks the sandbox lifecycle calls: register a create's mounts, serve them to each VMM that
//! starts, mount them in the guest after a create. See `volumes/` and `docs/volumes.md`.

use std::io::{Read, Write};

use super::{lock, Runtime, RuntimeError};
use crate::jailed::Live;
use crate::volumes::{api_path, path_error, rfc3339, VolumeEntry, VolumeInfo, VolumeMount};

impl Runtime {
    fn alive(&self) -> impl Fn(&str) -> bool + '_ {
        move |id: &str| lock(&self.inner.slots).contains_key(id)
    }

    /// Creates volume `name` (cap default 1 GiB).
    pub fn create_volume(
        &self,
        name: &str,
        cap_bytes: Option<u64>,
    ) -> Result<VolumeInfo, RuntimeError> {
        self.timed(
            None,
            "volume_create",
            serde_json::json!({ "name": name, "cap_bytes": cap_bytes }),
            || {
                self.inner.volumes.create(name, cap_bytes)?;
                Ok(self.inner.volumes.info(name, &self.alive())?)
            },
        )
    }

    /// Every volume.
    pub fn list_volumes(&self) -> Result<Vec<VolumeInfo>, RuntimeError> {
        let alive = self.alive();
        let mut out = Vec::new();
        for n in self.inner.volumes.names()? {
            match self.inner.volumes.info(&n, &alive) {
                Ok(i) => out.push(i),
                Err(crate::volumes::VolumeError::NotFound(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// One volume.
    pub fn volume(&self, name: &str) -> Result<VolumeInfo, RuntimeError> {
        Ok(self.inner.volumes.info(name, &self.alive())?)
    }

    /// Deletes a volume and its files (refused while a sandbox mounts it, unless `force`:
    /// those sandboxes then get errors from its mount).
    pub fn delete_volume(&self, name: &str, force: bool) -> Result<(), RuntimeError> {
        self.timed(
            None,
            "volume_delete",
            serde_json::json!({ "name": name, "force": force }),
            || Ok(self.inner.volumes.delete(name, force, &self.alive())?),
        )
    }

    /// The entries of directory `path` of a volume.
    pub fn volume_list_files(
        &self,
        name: &str,
        path: &str,
    ) -> Result<Vec<VolumeEntry>, RuntimeError> {
        let v = self.inner.volumes.vol(name)?;
        let p = api_path(path)?;
        let list = v.list(&p).map_err(|e| path_error(name, path, e))?;
        let mut out = Vec::with_capacity(list.len());
        for e in list {
            let child = if p.is_empty() {
                e.name.clone()
            } else {
                format!("{p}/{}", e.name)
            };
            if let Ok(a) = v.stat(&child) {
                out.push(entry(&child, a));
            }
        }
        Ok(out)
    }

    /// One path of a volume.
    pub fn volume_stat(&self, name: &str, path: &str) -> Result<VolumeEntry, RuntimeError> {
        let v = self.inner.volumes.vol(name)?;
        let p = api_path(path)?;
        let a = v.stat(&p).map_err(|e| path_error(name, path, e))?;
        Ok(entry(&p, a))
    }

    /// Streams a volume's file into `out`; answers its length.
    pub fn volume_read_file(
        &self,
        name: &str,
        path: &str,
        out: &mut dyn Write,
    ) -> Result<u64, RuntimeError> {
        let v = self.inner.volumes.vol(name)?;
        let p = api_path(path)?;
        let mut f = v.open_read(&p).map_err(|e| path_error(name, path, e))?;
        std::io::copy(&mut f, out).map_err(|e| RuntimeError::Internal(format!("volume read: {e}")))
    }

    /// Writes what `input` gives to a volume's file (made with its parents, or replaced:
    /// readers see the old or the new content); answers the bytes written.
    pub fn volume_write_file(
        &self,
        name: &str,
        path: &str,
        input: &mut dyn Read,
    ) -> Result<u64, RuntimeError> {
        self.timed(
            None,
            "volume_write_file",
            serde_json::json!({ "name": name, "path": path }),
            || {
                let v = self.inner.volumes.vol(name)?;
                let p = api_path(path)?;
                if let Some((parent, _)) = p.rsplit_once('/') {
                    v.mkdir_all(parent).map_err(|e| path_error(name, path, e))?;
                }
                v.write_from(&p, input)
                    .map_err(|e| match path_error(name, path, e) {
                        crate::volumes::VolumeError::Full { name, .. } => {
                            crate::volumes::VolumeError::Full {
                                name,
                                cap_bytes: v.cap_bytes,
                            }
                        }
                        e => e,
                    })
                    .map_err(Into::into)
            },
        )
    }

    /// Makes a directory (and its parents) in a volume.
    pub fn volume_mkdir(&self, name: &str, path: &str) -> Result<(), RuntimeError> {
        let v = self.inner.volumes.vol(name)?;
        let p = api_path(path)?;
        Ok(v.mkdir_all(&p).map_err(|e| path_error(name, path, e))?)
    }

    /// Removes a path of a volume (a directory with its contents when `recursive`).
    pub fn volume_remove(
        &self,
        name: &str,
        path: &str,
        recursive: bool,
    ) -> Result<(), RuntimeError> {
        let v = self.inner.volumes.vol(name)?;
        let p = api_path(path)?;
        Ok(v.remove(&p, recursive)
            .map_err(|e| path_error(name, path, e))?)
    }

    /// Renames a path of a volume.
    pub fn volume_rename(&self, name: &str, from: &str, to: &str) -> Result<(), RuntimeError> {
        let v = self.inner.volumes.vol(name)?;
        let (f, t) = (api_path(from)?, api_path(to)?);
        Ok(v.rename(&f, &t, false)
            .map_err(|e| path_error(name, from, e))?)
    }

    // ---------------------------------------------------------- lifecycle hooks ---

    /// Create: checks and records the new sandbox `id`'s mounts (a fork: its parent's).
    pub(crate) fn volumes_register(
        &self,
        id: &str,
        mounts: &[VolumeMount],
        parent: Option<&str>,
    ) -> Result<(), RuntimeError> {
        let mounts = match parent {
            Some(p) => self.inner.volumes.mounts_of(p),
            None => mounts.to_vec(),
        };
        Ok(self.inner.volumes.register(id, &mounts)?)
    }

    /// A VMM of sandbox `id` started (create, resume, fork, re-attach): serve its mounts.
    pub(crate) fn volumes_started(&self, id: &str, live: &Live) {
        let uds = live.host_path("/work/vsock");
        if let Err(e) = self.inner.volumes.attach(id, &uds) {
            tracing::error!("sandbox {id}: cannot serve its volumes: {e}");
        }
    }

    /// After a create from a template or snapshot (or a boot from a disk): mounts `mounts`
    /// (registered for `id`) in the guest.
    pub(crate) fn volumes_mount_in_guest(
        &self,
        id: &str,
        mounts: &[VolumeMount],
    ) -> Result<(), RuntimeError> {
        if mounts.is_empty() {
            return Ok(());
        }
        let mut argv = vec![
            "/sbin/ember-agent".to_string(),
            "volume-mount".to_string(),
            ember_agent::volume_wire::VOLUME_PORT.to_string(),
        ];
        for m in mounts {
            argv.push(format!(
                "{}:{}{}",
                m.name,
                m.path,
                if m.read_only { ":ro" } else { "" }
            ));
        }
        let mut req = ember_agent::protocol::ExecRequest::new(argv);
        req.timeout_ms = Some(30_000);
        let vm = {
            let slot = self.slot(id)?;
            let st = lock(&slot.st);
            st.vm.clone()
        }
        .ok_or_else(|| RuntimeError::Internal(format!("sandbox {id} has no VM")))?;
        let mut stderr = Vec::new();
        let mut exit = None;
        vm.sandbox.exec(&req, |ev| match ev {
            ember_agent::protocol::EventKind::Stderr { data } => stderr.extend_from_slice(data),
            ember_agent::protocol::EventKind::Exit(s) => exit = Some(*s),
            _ => {}
        })?;
        match exit {
            Some(s) if s.success() => Ok(()),
            s => Err(RuntimeError::Invalid(format!(
                "mounting volumes in the guest failed ({}): {}",
                s.map(|s| s.to_string())
                    .unwrap_or_else(|| "no exit status".into()),
                String::from_utf8_lossy(&stderr).trim()
            ))),
        }
    }
}

fn entry(path: &str, a: ember_agent::volume_wire::Attr) -> VolumeEntry {
    VolumeEntry {
        path: format!("/{path}"),
        name: path.rsplit('/').next().unwrap_or_default().to_string(),
        kind: if a.dir { "dir" } else { "file" }.to_string(),
        size: a.size,
        mode: a.mode,
        modified_at: rfc3339(a.mtime_ns / 1_000_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_name_their_path_from_the_root() {
        let a = ember_agent::volume_wire::Attr {
            dir: true,
            size: 0,
            mode: 0o755,
            mtime_ns: 1_500_000_000,
        };
        let e = entry("a/b", a);
        assert_eq!(e.path, "/a/b");
        assert_eq!(e.name, "b");
        assert_eq!(e.kind, "dir");
        assert!(
            e.modified_at.starts_with("1970-01-01T00:00:01.5"),
            "{}",
            e.modified_at
        );
    }
}
