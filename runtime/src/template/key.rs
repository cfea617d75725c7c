//! A template's key — the hash of everything that changes its snapshot — and the cache it
//! addresses: `$EMBER_CACHE/templates/<key>/`, `names/<name>` links, per-key build locks.

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{io_err, RootfsManifest, TemplateError};
use crate::paths;

/// The cache of built templates: `$EMBER_CACHE/templates`.
pub(super) fn cache_root() -> PathBuf {
    paths::templates_dir()
}

/// Where the cache's name links live: `names/<name>` points at `../<key>`.
pub(super) fn names_dir(root: &Path) -> PathBuf {
    root.join("names")
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String, TemplateError> {
    let mut f = std::fs::File::open(path).map_err(io_err("cannot open", path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err("cannot read", path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// The identity of the kernel: the content-addressed cache directory's name when the kernel
/// lives in the cache (`.../kernel/<key>/vmlinux`), else the file's sha256.
pub(super) fn kernel_identity(kernel: &Path) -> Result<String, TemplateError> {
    let in_cache = kernel
        .parent()
        .and_then(|d| d.parent())
        .and_then(Path::file_name)
        .is_some_and(|n| n == "kernel");
    match kernel.parent().and_then(Path::file_name) {
        Some(dir) if in_cache => Ok(format!("cache:{}", dir.to_string_lossy())),
        _ => sha256_file(kernel),
    }
}

/// The key of a template: everything that changes its snapshot.
pub fn template_key(
    kernel_id: &str,
    recipe: &RootfsManifest,
    profile: &str,
) -> Result<String, TemplateError> {
    // Schema 3: the snapshot keeps the build's idle agent connection (and records it), which
    // templates of schema 2 did not: they rebuild once, and stay usable meanwhile (restores
    // of a snapshot without the record connect anew).
    let inputs = serde_json::json!({
        "schema": 3,
        "kernel": kernel_id,
        "rootfs": recipe.key,
        "vm": recipe.vm,
        "warmup": recipe.warmup,
        "env": recipe.env,
        "outputs": recipe.outputs,
        "snapshot_format": ember_snapshot::FORMAT_VERSION,
        "cpu_profile": profile,
        // The command line the VMM boots the template with (base + the profile's options):
        // a change there changes the guest the snapshot holds.
        "cmdline": [
            ember_vmm::vm::DEFAULT_CMDLINE,
            profile
                .parse::<ember_vmm::cpu::CpuProfile>()
                .map(|p| p.cmdline())
                .unwrap_or(""),
        ],
        "ember": env!("CARGO_PKG_VERSION"),
    });
    let bytes = serde_json::to_vec(&inputs).map_err(|e| TemplateError::BadRecord {
        path: PathBuf::from("<template inputs>"),
        message: e.to_string(),
    })?;
    Ok(hex(&Sha256::digest(&bytes)))
}

/// An exclusive `flock` on `path`, held until the file is dropped.
pub(super) fn lock_file(path: &Path) -> Result<std::fs::File, TemplateError> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io_err("cannot open lock file", path))?;
    loop {
        // SAFETY: flock on a descriptor we own; no memory is involved.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        if r == 0 {
            return Ok(f);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(TemplateError::Io {
                what: "cannot lock",
                path: path.to_path_buf(),
                source: e,
            });
        }
    }
}

/// Points `names/<name>` at `<key>` (atomically: a new link renamed over the old).
pub(super) fn link_name(root: &Path, name: &str, key: &str) -> Result<(), TemplateError> {
    let names = names_dir(root);
    std::fs::create_dir_all(&names).map_err(io_err("cannot create", &names))?;
    let tmp = names.join(format!(".{name}.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(Path::new("..").join(key), &tmp)
        .map_err(io_err("cannot create symlink", &tmp))?;
    let link = names.join(name);
    std::fs::rename(&tmp, &link).map_err(io_err("cannot rename", &link))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> RootfsManifest {
        serde_json::from_str(r#"{"template": "t", "key": "img"}"#).unwrap()
    }

    #[test]
    fn services_parse_and_only_change_the_key_when_present() {
        let m: RootfsManifest = serde_json::from_str(
            r#"{"template": "t", "key": "img", "warmup": {"services": [
                {"name": "b", "argv": ["/bin/b", "-x"], "ready": ["/bin/true"]}]}}"#,
        )
        .unwrap();
        let svc = &m.warmup.services[0];
        assert_eq!(svc.argv, ["/bin/b", "-x"]);
        assert_eq!(svc.user, "root");
        assert_eq!(svc.ready_timeout_s, 300);
        assert_eq!(svc.ready.as_deref(), Some(&["/bin/true".to_string()][..]));
        // A template without services hashes as it did before services existed.
        let plain = manifest();
        let json = serde_json::to_value(&plain.warmup).unwrap();
        assert!(json.get("services").is_none(), "{json}");
        let k = template_key("kern", &plain, "pvm").unwrap();
        let mut with = plain.clone();
        with.warmup.services = m.warmup.services.clone();
        assert_ne!(k, template_key("kern", &with, "pvm").unwrap());
    }

    #[test]
    fn key_changes_with_every_input_and_only_then() {
        let m = manifest();
        let k = template_key("kern", &m, "pvm").unwrap();
        assert_eq!(k, template_key("kern", &m, "pvm").unwrap());
        assert_ne!(k, template_key("kern2", &m, "pvm").unwrap());
        assert_ne!(k, template_key("kern", &m, "host").unwrap());
        let mut m1 = m.clone();
        m1.key = "img2".into();
        assert_ne!(k, template_key("kern", &m1, "pvm").unwrap());
        let mut m2 = m.clone();
        m2.warmup.code = "import json".into();
        assert_ne!(k, template_key("kern", &m2, "pvm").unwrap());
        let mut m3 = m.clone();
        m3.vm.memory_mib = 1024;
        assert_ne!(k, template_key("kern", &m3, "pvm").unwrap());
        let mut m4 = m.clone();
        m4.env.insert("A".into(), "b".into());
        assert_ne!(k, template_key("kern", &m4, "pvm").unwrap());
    }
}
