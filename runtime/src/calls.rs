//! Calls into a sandbox by id — code, contexts, programs, files — each audited, and the
//! artifacts copied out of its outputs directory.

use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ember_agent::client::ClientError;
use ember_agent::protocol::{
    self, ContextInfo, DirEntry, EndStatus, ErrorCode, EventKind, ExecRequest, ExecUser, FileStat,
    RunCodeRequest,
};
use sha2::Digest;

use super::jailed::Live;
use super::types::ArtifactInfo;
use super::{Runtime, RuntimeError};
use crate::call::Cancel;
use crate::store::SandboxRow;

/// What a caller's event callback returns: go on, or stop the call (the client went away).
pub type Continue = bool;

fn code_summary(code: &str) -> serde_json::Value {
    let hash = sha2::Sha256::digest(code.as_bytes());
    let hex: String = hash.iter().take(8).map(|b| format!("{b:02x}")).collect();
    serde_json::json!({ "code_bytes": code.len(), "code_sha256": hex })
}

/// A reader that fails once more than `limit` bytes came through, and counts them.
struct Limited<'a> {
    inner: &'a mut dyn Read,
    limit: u64,
    n: u64,
}

impl Read for Limited<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let k = self.inner.read(buf)?;
        self.n += k as u64;
        if self.n > self.limit {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("upload exceeds the limit of {} bytes", self.limit),
            ));
        }
        Ok(k)
    }
}

struct CountingWriter<'a> {
    inner: &'a mut dyn Write,
    n: u64,
}

impl Write for CountingWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn cancelled() -> ClientError {
    ClientError::Protocol("cancelled by the caller".into())
}

impl Runtime {
    /// Runs code in a context (see `run_code` in `agent/PROTOCOL.md`); events go to
    /// `on_event` as the guest produces them. When `on_event` returns false (the client went
    /// away), the code is interrupted in the guest and the call ends.
    pub fn run_code(
        &self,
        id: &str,
        req: &RunCodeRequest,
        on_event: &mut dyn FnMut(&EventKind) -> Continue,
    ) -> Result<crate::RunEnd, RuntimeError> {
        self.run_code_cancellable(id, req, on_event, None)
    }

    /// [`Self::run_code`], which `cancel` also stops from another thread (a client that went
    /// away while the code printed nothing).
    ///
    /// Either way the call's agent connection is closed, and the agent interrupts the run
    /// whose connection went away, if it is still running: that run and no other. (An
    /// `interrupt` of the context, sent after, could reach the context's next cell, which a
    /// client that gave up on this one may already have started.)
    pub fn run_code_cancellable(
        &self,
        id: &str,
        req: &RunCodeRequest,
        on_event: &mut dyn FnMut(&EventKind) -> Continue,
        cancel: Option<Arc<Cancel>>,
    ) -> Result<crate::RunEnd, RuntimeError> {
        let cancel = cancel.unwrap_or_default();
        let mut args = code_summary(&req.code);
        args["context"] = serde_json::json!(req.context);
        args["language"] = serde_json::json!(req.language);
        let cfg = self.config();
        let mut req = req.clone();
        let limit = cfg.default_call_timeout.as_millis() as u64;
        req.timeout_ms = Some(req.timeout_ms.unwrap_or(limit).min(limit));
        req.output_cap = Some(
            req.output_cap
                .unwrap_or(cfg.default_output_cap)
                .min(cfg.default_output_cap),
        );
        let timeout =
            Duration::from_millis(req.timeout_ms.unwrap_or(limit)) + Duration::from_secs(30);
        // The sandbox's environment (create's `env`, secret values included) under the
        // call's own: a template's warm contexts were started before the sandbox had one (the egress
        // proxy's CA variables of a sandbox with network rules among them).
        for (k, v) in self.row_env(id) {
            req.env.entry(k).or_insert(v);
        }
        self.audited(id, "run_code", args, |vm, bytes| {
            bytes.0 = req.code.len() as u64;
            let mut stopped = false;
            let mut gone_at_end = false;
            let r = vm.sandbox.with_client("run_code", |c| {
                if !cancel.arm(c.get_ref()) {
                    stopped = true;
                    return Err(cancelled());
                }
                let r = c.run_code(&req, timeout, |ev| {
                    bytes.1 += event_bytes(&ev);
                    if on_event(&ev) {
                        Ok(())
                    } else {
                        // Ending the call closes the connection, which interrupts the run
                        // in the guest if it has not ended (see above).
                        if ev.is_terminal() {
                            gone_at_end = true;
                        } else {
                            stopped = true;
                        }
                        Err(cancelled())
                    }
                });
                // A connection the cancel shut down must not go back to the pool.
                if cancel.disarm() {
                    stopped = true;
                    return Err(cancelled());
                }
                r
            });
            if gone_at_end {
                return Err(RuntimeError::Cancelled(
                    "run_code cancelled: the caller went away (the code had ended)".into(),
                ));
            }
            if stopped {
                return Err(RuntimeError::Cancelled(
                    "run_code cancelled: the caller went away (the code was interrupted)".into(),
                ));
            }
            Ok(r?)
        })
    }

    /// Runs a program (see `exec` in `agent/PROTOCOL.md`). When `on_event` returns false,
    /// the program's process group is killed.
    pub fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        on_event: &mut dyn FnMut(&EventKind) -> Continue,
    ) -> Result<EndStatus, RuntimeError> {
        let args = serde_json::json!({
            "argv": req.argv, "cwd": req.cwd, "background": req.background,
            "stdin_bytes": req.stdin.as_ref().map(Vec::len), "user": req.user,
        });
        let cfg = self.config();
        let mut req = req.clone();
        let limit = cfg.default_call_timeout.as_millis() as u64;
        if !req.background {
            req.timeout_ms = Some(req.timeout_ms.unwrap_or(limit).min(limit));
        }
        self.audited(id, "exec", args, |vm, bytes| {
            let env = self.row_env(id);
            for (k, v) in env {
                req.env.entry(k).or_insert(v);
            }
            bytes.0 = req.stdin.as_ref().map_or(0, |s| s.len() as u64);
            let mut pid = None;
            let mut stopped = false;
            let timeout =
                Duration::from_millis(req.timeout_ms.unwrap_or(limit)) + Duration::from_secs(30);
            let r = vm
                .sandbox
                .call(&protocol::Call::Exec(req.clone()), timeout, |ev| {
                    if let EventKind::Started { pid: p } = ev {
                        pid = Some(p);
                    }
                    bytes.1 += event_bytes(&ev);
                    if on_event(&ev) {
                        Ok(())
                    } else {
                        stopped = true;
                        Err(cancelled())
                    }
                });
            if stopped {
                if let Some(p) = pid {
                    let _ = vm.sandbox.process_signal(p, libc::SIGKILL);
                }
                return Err(RuntimeError::Cancelled(
                    "exec cancelled: the caller went away (the program was killed)".into(),
                ));
            }
            Ok(r?)
        })
    }

    /// Sends `signal` to a program's process group (a background program, or one whose
    /// `exec` call is still streaming).
    pub fn process_signal(&self, id: &str, pid: i32, signal: i32) -> Result<(), RuntimeError> {
        self.audited(
            id,
            "process_signal",
            serde_json::json!({ "pid": pid, "signal": signal }),
            |vm, _| Ok(vm.sandbox.process_signal(pid, signal)?),
        )
    }

    /// Runs `f` on the sandbox's handle with a call slot held (a paused sandbox is resumed
    /// first; a pause waits for `f` to return), audited as `call` with `args`. For layers
    /// that speak to the agent directly (the E2B surface): each use is one audited call.
    pub fn with_sandbox<T>(
        &self,
        id: &str,
        call: &'static str,
        args: serde_json::Value,
        f: impl FnOnce(&crate::Sandbox) -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        self.audited(id, call, args, |vm, _| f(&vm.sandbox))
    }

    /// The VMM's own counters (its `stats` request): KVM's counters since the VM was
    /// restored (`kvm`: exits, `pf_fixed`, `pf_guest`...), the vsock device's (`vsock`:
    /// `transport_resets`, `restore_resets`, `preserved_attached`, ...), memory.
    pub fn vmm_stats(&self, id: &str) -> Result<serde_json::Value, RuntimeError> {
        self.audited(id, "vmm_stats", serde_json::json!({}), |vm, _| {
            let reply =
                ember_vmm::api::call(vm.sandbox.api_socket(), &ember_vmm::api::Request::Stats)
                    .map_err(|e| RuntimeError::Internal(format!("sandbox {id}: stats: {e}")))?;
            if reply["ok"] != true {
                return Err(RuntimeError::Internal(format!(
                    "sandbox {id}: stats refused: {reply}"
                )));
            }
            Ok(reply["stats"].clone())
        })
    }

    /// The sandbox's environment with its secret values (which `get` redacts).
    pub(crate) fn row_env(&self, id: &str) -> std::collections::BTreeMap<String, String> {
        // The slots' lock is released before `get` (which takes it again) can run: a guard
        // in a `match` scrutinee would live through the arms.
        let slot = super::lock(&self.inner.slots).get(id).cloned();
        match slot {
            Some(slot) => super::lock(&slot.st).row.env.clone(),
            None => self.get(id).map(|i| i.env).unwrap_or_default(),
        }
    }

    /// Creates a code context.
    pub fn context_create(
        &self,
        id: &str,
        language: &str,
        cwd: Option<&str>,
    ) -> Result<ContextInfo, RuntimeError> {
        self.context_create_as(id, language, cwd, None)
    }

    /// Creates a code context, under the id `context` when given (one that exists already
    /// is an `exists` guest error).
    pub fn context_create_as(
        &self,
        id: &str,
        language: &str,
        cwd: Option<&str>,
        context: Option<&str>,
    ) -> Result<ContextInfo, RuntimeError> {
        // Aliases (`js`, `ts`, `R`) name their language; whether the template has it, the
        // guest says (refused with the list of those it has).
        let Some(language) = protocol::canonical_language(language) else {
            return Err(RuntimeError::Invalid(format!(
                "language {language:?}: expected one of {}",
                protocol::LANGUAGES.join(", ")
            )));
        };
        let args = serde_json::json!({ "language": language, "cwd": cwd, "context": context });
        self.audited(id, "context_create", args, |vm, _| {
            let ctx = vm.sandbox.context_create_with_id(language, cwd, context)?;
            let list = vm.sandbox.context_list()?;
            list.into_iter().find(|c| c.id == ctx).ok_or_else(|| {
                RuntimeError::Internal(format!("context {ctx} vanished after its creation"))
            })
        })
    }

    /// The contexts of a sandbox.
    pub fn context_list(&self, id: &str) -> Result<Vec<ContextInfo>, RuntimeError> {
        self.audited(id, "context_list", serde_json::json!({}), |vm, _| {
            Ok(vm.sandbox.context_list()?)
        })
    }

    /// Restarts a context (its state is lost).
    pub fn context_restart(&self, id: &str, context: &str) -> Result<(), RuntimeError> {
        self.audited(
            id,
            "context_restart",
            serde_json::json!({ "context": context }),
            |vm, _| Ok(vm.sandbox.context_restart(context)?),
        )
    }

    /// Removes a context.
    pub fn context_remove(&self, id: &str, context: &str) -> Result<(), RuntimeError> {
        self.audited(
            id,
            "context_remove",
            serde_json::json!({ "context": context }),
            |vm, _| Ok(vm.sandbox.context_remove(context)?),
        )
    }

    /// Interrupts the code running in a context.
    pub fn interrupt(&self, id: &str, context: &str) -> Result<(), RuntimeError> {
        self.audited(
            id,
            "interrupt",
            serde_json::json!({ "context": context }),
            |vm, _| Ok(vm.sandbox.interrupt(context)?),
        )
    }

    /// Streams `data` into the guest file `path` (created or replaced atomically); at most
    /// the server's upload limit.
    pub fn write_file(
        &self,
        id: &str,
        path: &str,
        data: &mut dyn Read,
    ) -> Result<u64, RuntimeError> {
        self.write_file_as(id, path, data, ExecUser::Root)
    }

    /// [`Self::write_file`] for `user`: the agent writes as root, then the file and the
    /// directories strictly between the user's home and it (the ones the write may have
    /// made) are given to the user. A failed hand-over is logged, not an error: the bytes
    /// are in place.
    pub fn write_file_as(
        &self,
        id: &str,
        path: &str,
        data: &mut dyn Read,
        user: ExecUser,
    ) -> Result<u64, RuntimeError> {
        let limit = self.config().max_upload_bytes;
        let args = serde_json::json!({ "path": path, "user": user });
        self.audited(id, "file_write", args, |vm, bytes| {
            let mut lim = Limited {
                inner: data,
                limit,
                n: 0,
            };
            let r = vm.sandbox.write_file(path, &mut lim);
            bytes.0 = lim.n;
            if lim.n > limit {
                return Err(RuntimeError::Invalid(format!(
                    "upload exceeds the limit of {limit} bytes"
                )));
            }
            let n = r?;
            if user == ExecUser::User {
                let mut argv = vec!["/bin/chown", "user:user", "--"];
                let parents = owned_parents(path);
                argv.extend(parents.iter().map(String::as_str));
                argv.push(path);
                if let Err((_, text)) = run_as(id, vm, "file_write", &argv, ExecUser::Root) {
                    tracing::warn!("sandbox {id}: cannot give {path} to user: {text}");
                }
            }
            Ok(n)
        })
    }

    /// Streams the guest file `path` into `out`.
    pub fn read_file(
        &self,
        id: &str,
        path: &str,
        out: &mut dyn Write,
    ) -> Result<u64, RuntimeError> {
        self.audited(
            id,
            "file_read",
            serde_json::json!({ "path": path }),
            |vm, bytes| {
                let mut w = CountingWriter { inner: out, n: 0 };
                let r = vm.sandbox.read_file(path, &mut w);
                bytes.1 = w.n;
                Ok(r?)
            },
        )
    }

    /// Lists a guest directory (`depth` levels).
    pub fn list_files(
        &self,
        id: &str,
        path: &str,
        depth: u32,
    ) -> Result<Vec<DirEntry>, RuntimeError> {
        self.audited(
            id,
            "file_list",
            serde_json::json!({ "path": path, "depth": depth }),
            |vm, _| Ok(vm.sandbox.list(path, depth.clamp(1, 64))?),
        )
    }

    /// Metadata of a guest path.
    pub fn stat(&self, id: &str, path: &str) -> Result<FileStat, RuntimeError> {
        self.audited(
            id,
            "file_stat",
            serde_json::json!({ "path": path }),
            |vm, _| Ok(vm.sandbox.stat(path)?),
        )
    }

    /// `mkdir -p` in the guest.
    pub fn mkdir(&self, id: &str, path: &str) -> Result<(), RuntimeError> {
        self.mkdir_as(id, path, ExecUser::Root)
    }

    /// `mkdir -p` in the guest as `user`: by the agent for root; for the unprivileged user
    /// through `exec` as them, so that the directories are theirs and their rights apply (a
    /// refusal is a `permission_denied` guest error, a file in the way `not_a_directory`).
    pub fn mkdir_as(&self, id: &str, path: &str, user: ExecUser) -> Result<(), RuntimeError> {
        let args = serde_json::json!({ "path": path, "user": user });
        self.audited(id, "file_mkdir", args, |vm, _| {
            if user == ExecUser::Root {
                return Ok(vm.sandbox.mkdir(path)?);
            }
            let argv = ["/bin/mkdir", "-p", "--", path];
            run_as(id, vm, "file_mkdir", &argv, user).map_err(|(code, text)| RuntimeError::Guest {
                id: id.to_string(),
                call: "file_mkdir",
                code,
                message: format!("creating directory {path}: {text}"),
            })
        })
    }

    /// Removes a guest path (`recursive` for directories).
    pub fn remove(&self, id: &str, path: &str, recursive: bool) -> Result<(), RuntimeError> {
        self.audited(
            id,
            "file_remove",
            serde_json::json!({ "path": path, "recursive": recursive }),
            |vm, _| Ok(vm.sandbox.remove(path, recursive)?),
        )
    }

    /// Renames a guest path.
    pub fn rename(&self, id: &str, from: &str, to: &str) -> Result<(), RuntimeError> {
        self.audited(
            id,
            "file_rename",
            serde_json::json!({ "from": from, "to": to }),
            |vm, _| Ok(vm.sandbox.rename(from, to)?),
        )
    }

    /// Copies the sandbox's outputs directory into `$EMBER_HOME/artifacts/<id>/` now.
    pub fn collect_artifacts(&self, id: &str) -> Result<Vec<ArtifactInfo>, RuntimeError> {
        self.audited(
            id,
            "collect_artifacts",
            serde_json::json!({}),
            |vm, bytes| {
                let row = self.row_for(id)?;
                let n = self.collect_from(&row, vm)?;
                bytes.1 = n;
                Ok(self.store().artifacts(id)?)
            },
        )
    }

    fn row_for(&self, id: &str) -> Result<SandboxRow, RuntimeError> {
        self.store()
            .sandbox(id)?
            .ok_or_else(|| RuntimeError::NotFound(id.to_string()))
    }

    /// The artifacts kept for a sandbox (also after it ended, until record retention).
    pub fn artifacts(&self, id: &str) -> Result<Vec<ArtifactInfo>, RuntimeError> {
        self.get(id)?;
        Ok(self.store().artifacts(id)?)
    }

    /// The host file of one artifact (`path` relative to the outputs directory, as listed).
    pub fn artifact_path(&self, id: &str, path: &str) -> Result<PathBuf, RuntimeError> {
        self.get(id)?;
        let rel = safe_relative(path)
            .ok_or_else(|| RuntimeError::Invalid(format!("invalid artifact path {path:?}")))?;
        let known = self
            .store()
            .artifacts(id)?
            .iter()
            .any(|a| Path::new(&a.path) == rel);
        if !known {
            return Err(RuntimeError::NoSuchArtifact(format!(
                "sandbox {id} has no artifact {path:?}"
            )));
        }
        Ok(self.config().artifacts_dir(id).join(rel))
    }

    /// Copies files under the sandbox's outputs directory out, within the size caps; returns
    /// the bytes copied. Names come from the guest: each must be a plain relative path.
    pub(super) fn collect_from(&self, row: &SandboxRow, vm: &Live) -> Result<u64, RuntimeError> {
        let cfg = self.config();
        let outputs = row.outputs.trim_end_matches('/');
        if outputs.is_empty() {
            return Ok(0);
        }
        let entries = match vm.sandbox.list(outputs, 16) {
            Ok(e) => e,
            Err(e) => {
                let e: RuntimeError = e.into();
                if e.code() == "guest_not_found" {
                    return Ok(0);
                }
                return Err(e);
            }
        };
        let dest = cfg.artifacts_dir(&row.id);
        let mut total = 0u64;
        let mut files = 0usize;
        for entry in entries {
            if entry.kind != protocol::FileType::File {
                continue;
            }
            let Some(rel) = entry
                .path
                .strip_prefix(outputs)
                .and_then(|r| r.strip_prefix('/'))
                .and_then(safe_relative)
            else {
                tracing::warn!("sandbox {}: skipping artifact {:?}", row.id, entry.path);
                continue;
            };
            if entry.size > cfg.artifact_max_file_bytes
                || total + entry.size > cfg.artifact_max_bytes
                || files >= cfg.artifact_max_files
            {
                tracing::warn!(
                    "sandbox {}: artifact {:?} ({} bytes) is over the caps; not kept",
                    row.id,
                    entry.path,
                    entry.size
                );
                continue;
            }
            let to = dest.join(&rel);
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(RuntimeError::io("cannot create", parent))?;
            }
            let tmp = to.with_extension("ember-partial");
            let mut f =
                std::fs::File::create(&tmp).map_err(RuntimeError::io("cannot create", &tmp))?;
            let cap = cfg.artifact_max_file_bytes;
            let mut w = CapWriter {
                inner: &mut f,
                left: cap,
            };
            let n = match vm.sandbox.read_file(&entry.path, &mut w) {
                Ok(n) => n,
                Err(e) => {
                    let _ = std::fs::remove_file(&tmp);
                    tracing::warn!("sandbox {}: artifact {:?}: {e}", row.id, entry.path);
                    continue;
                }
            };
            std::fs::rename(&tmp, &to).map_err(RuntimeError::io("cannot rename into", &to))?;
            total += n;
            files += 1;
            self.store()
                .put_artifact(&row.id, &rel.to_string_lossy(), n)?;
        }
        if files > 0 {
            if let Some(h) = self.hooks() {
                h.artifacts_collected(&row.id, &dest);
            }
        }
        Ok(total)
    }
}

/// Refuses writes past a cap (a file that grew after it was listed).
struct CapWriter<'a> {
    inner: &'a mut std::fs::File,
    left: u64,
}

impl Write for CapWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() as u64 > self.left {
            return Err(std::io::Error::other("artifact grew over the size cap"));
        }
        let n = self.inner.write(buf)?;
        self.left -= n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// `p` as a relative path of plain components (no `..`, no root, no empty), or None.
pub fn safe_relative(p: &str) -> Option<PathBuf> {
    if p.is_empty() || p.contains('\0') {
        return None;
    }
    let path = Path::new(p);
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            _ => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

pub(crate) fn event_bytes(ev: &EventKind) -> u64 {
    match ev {
        EventKind::Stdout { data } | EventKind::Stderr { data } => data.len() as u64,
        _ => 0,
    }
}

/// Runs `argv` in the guest as `user` (30 s at most) for a file call; `Err` holds the guest
/// error code its stderr means and that text.
fn run_as(
    id: &str,
    vm: &Live,
    call: &'static str,
    argv: &[&str],
    user: ExecUser,
) -> Result<(), (ErrorCode, String)> {
    let req = ExecRequest {
        argv: argv.iter().map(|a| a.to_string()).collect(),
        timeout_ms: Some(30_000),
        user,
        ..Default::default()
    };
    let mut stderr = Vec::new();
    let mut exit = None;
    let r = vm.sandbox.exec(&req, |ev| match ev {
        EventKind::Stderr { data } if stderr.len() < 4096 => stderr.extend_from_slice(data),
        EventKind::Exit(s) => exit = Some(*s),
        _ => {}
    });
    if let Err(e) = r {
        tracing::debug!("sandbox {id}: {call}: {argv:?}: {e}");
        return Err((ErrorCode::Internal, e.to_string()));
    }
    if exit == Some(protocol::ExitStatus::Code(0)) {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&stderr).trim().to_string();
    let code = if text.contains("Permission denied") || text.contains("Read-only file system") {
        ErrorCode::PermissionDenied
    } else if text.contains("File exists") || text.contains("Not a directory") {
        ErrorCode::NotADirectory
    } else {
        ErrorCode::Internal
    };
    let text = if text.is_empty() {
        format!("{} failed ({exit:?})", argv[0])
    } else {
        text
    };
    Err((code, text))
}

/// The directories a write as the user gives them with a file: those strictly between
/// `/home/user` and the file.
pub(crate) fn owned_parents(path: &str) -> Vec<String> {
    let Some(rel) = path.strip_prefix("/home/user/") else {
        return vec![];
    };
    let parts: Vec<&str> = rel.split('/').filter(|p| !p.is_empty()).collect();
    (1..parts.len())
        .map(|i| format!("/home/user/{}", parts[..i].join("/")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents_under_the_home_are_given_to_the_user() {
        assert_eq!(
            owned_parents("/home/user/a/b/c.txt"),
            vec!["/home/user/a".to_string(), "/home/user/a/b".to_string()]
        );
        assert!(owned_parents("/home/user/c.txt").is_empty());
        assert!(owned_parents("/tmp/a/c.txt").is_empty());
    }

    #[test]
    fn artifact_paths_from_the_guest_must_be_plain_relative_paths() {
        assert_eq!(safe_relative("a/b.png"), Some(PathBuf::from("a/b.png")));
        assert_eq!(safe_relative("./a"), Some(PathBuf::from("a")));
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a\0b", "."] {
            assert_eq!(safe_relative(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn uploads_over_the_limit_fail() {
        let mut src: &[u8] = &[0u8; 100];
        let mut l = Limited {
            inner: &mut src,
            limit: 50,
            n: 0,
        };
        let mut sink = Vec::new();
        assert!(std::io::copy(&mut l, &mut sink).is_err());
    }

    #[test]
    fn code_is_audited_by_size_and_hash_not_content() {
        let s = code_summary("print('secret')");
        assert_eq!(s["code_bytes"], 15);
        assert!(!s.to_string().contains("secret"));
    }
}
