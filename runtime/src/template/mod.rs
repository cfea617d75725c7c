//! Templates: a recipe (`rootfs/templates/NAME.toml`) + the VM shape + warm-up code + the
//! contexts to pre-start, built into a full snapshot that sandboxes restore from.
//!
//! - [`schema`]: the recipe's types — the one template schema, which also checks recipes
//!   (unknown keys, with the nearest valid name) and hands the rootfs builder the normalised
//!   recipe — and the rootfs build's `manifest.json` ([`RootfsManifest`]).
//! - [`key`]: a template's key (the hash of everything that goes into its snapshot) and the
//!   cache's paths, lock and name links.
//! - [`image`]: `[image]` recipes (templates from OCI/Docker images, docs/images.md): pull,
//!   unpack into the rootfs build's layer 1, feature checks, the image config folded in.
//! - [`rootfs`]: the root filesystem of a recipe ([`default_rootfs`]: `rootfs/build.sh` on the
//!   checked recipe, after [`image`] for an `[image]` recipe).
//! - [`build`]: the build ([`Template::build`]: boot, warm-up, services, snapshot).
//! - here: [`Template`] (open, list, remove), its record [`TemplateInfo`] and the errors.
//!
//! Building: the root filesystem (`rootfs/build.sh`, cached by its recipe) and the guest kernel
//! (`guest-kernel/build.sh`) are resolved first; their identities, the recipe's VM shape,
//! environment and warm-up, and the VMM's snapshot format version make the template's **key**.
//! A template with that key already in `$EMBER_CACHE/templates/<key>/` is done (a rebuild of an
//! unchanged template is a no-op). Otherwise the image is booted with its root disk as a
//! copy-on-write overlay (so the snapshot carries the guest's writes and the shared image is
//! never written), the agent runs the warm-up — it imports IPython and what the warm-up names
//! in a *zygote* driver, forks the default context(s) from it and keeps spare contexts ready —
//! and a full snapshot is taken with the VMM exiting after it — while the build still holds its
//! idle agent connection, which the snapshot keeps and records ([`crate::agent_link`]): every
//! sandbox's first connection takes it over instead of making a new one. The result is
//! written into a temporary directory and renamed into place, so a crash never leaves half a
//! template.
//!
//! Layout of `$EMBER_CACHE/templates/`:
//! - `<key>/template.json` — [`TemplateInfo`]; `<key>/snapshot/` — the VMM snapshot (`state`,
//!   `memory`, `disk0.overlay`) and the kept agent connection's record
//!   ([`crate::agent_link::RECORD_FILE`]); `<key>/build.log` — the guest console during the
//!   build.
//! - `names/<name>` — a symlink to `../<key>`: the latest build of that name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::images;

pub mod build;
pub mod dockerfile;
pub mod image;
pub mod key;
pub mod rootfs;
pub mod schema;
pub mod steps;

pub use build::{BuildEvent, BuildOptions, Layer};
pub use dockerfile::{DockerIgnore, Dockerfile, DockerfileError};
pub use key::{sha256_file, template_key};
pub use rootfs::{default_rootfs, default_rootfs_with};
pub use schema::{
    recipe_path, ChecksSpec, ContextSpec, DebianSpec, FileMode, FileSpec, ImageSpec, PipSpec,
    Recipe, RecipeError, RootfsManifest, ServiceSpec, VmShape, VmSpec, WarmupSpec,
};
pub use steps::{build_from_steps, StepsSpec};

/// The agent's vsock port.
pub const AGENT_PORT: u32 = 1024;

/// Errors building, opening or removing templates. Each names what it was working on.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The name is not usable (path separators, empty, too long).
    #[error(
        "template name {0:?} is not valid: use letters, digits, '-', '_' and '.' (at most 64)"
    )]
    BadName(String),
    /// No build of that name is in the cache.
    #[error("template {name:?} is not built (run `ember template build {name}`)")]
    NotBuilt {
        /// The name asked for.
        name: String,
    },
    /// The guest images could not be built or found.
    #[error(transparent)]
    Images(#[from] images::ImageError),
    /// A file could not be read or written.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The rootfs manifest or a template record is not what this version expects.
    #[error("{path}: {message}")]
    BadRecord {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The VMM could not be started or failed during the build.
    #[error("template {name}: the VMM {what}")]
    Vmm {
        /// The template.
        name: String,
        /// What happened (with the VMM's own message when it gave one).
        what: String,
    },
    /// A Dockerfile that ember cannot build (its line and why).
    #[error(transparent)]
    Dockerfile(#[from] dockerfile::DockerfileError),
    /// A build step failed: its line (the Dockerfile's, or the step's number) and why.
    #[error("build step at line {line}: {message}")]
    Step {
        /// The step's line.
        line: usize,
        /// What went wrong (the command's exit status, a COPY source that is not there...).
        message: String,
    },
    /// The image lacks what the template asks for (the fix is named).
    #[error("{0}")]
    Feature(String),
    /// The guest's agent failed the warm-up.
    #[error("template {name}: warm-up failed: {message}")]
    Warmup {
        /// The template.
        name: String,
        /// The agent's or the code's error.
        message: String,
    },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TemplateError {
    let path = path.to_path_buf();
    move |source| TemplateError::Io { what, path, source }
}

/// A built template's record (`template.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateInfo {
    /// The name it was built as.
    pub name: String,
    /// The hash of everything that went in.
    pub key: String,
    /// The guest kernel.
    pub kernel: PathBuf,
    /// The shared root filesystem image (the snapshot's overlay sits on it).
    pub rootfs: PathBuf,
    /// The rootfs build's key (image + recipe).
    pub rootfs_key: String,
    /// The ext4 image's own key.
    #[serde(default)]
    pub image_key: String,
    /// VM shape.
    pub vm: VmShape,
    /// Warm-up that ran.
    pub warmup: WarmupSpec,
    /// Environment for code in the sandbox.
    pub env: BTreeMap<String, String>,
    /// Artifact directory in the guest.
    pub outputs: String,
    /// When it was built (RFC 3339, UTC).
    pub built_at: String,
    /// Timings of the build, milliseconds: `boot`, `warmup`, `snapshot`, `total`.
    pub timings_ms: BTreeMap<String, u64>,
    /// Bytes of the snapshot on disk (allocated).
    pub snapshot_bytes: u64,
}

/// A built template.
#[derive(Debug, Clone)]
pub struct Template {
    /// Its record.
    pub info: TemplateInfo,
    /// Its directory (`$EMBER_CACHE/templates/<key>`).
    pub dir: PathBuf,
}

/// Checks a template name (it becomes a path component).
pub fn check_name(name: &str) -> Result<(), TemplateError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(TemplateError::BadName(name.into()))
    }
}

impl Template {
    /// Opens template `name`, building it first (default options) when it has not been built
    /// yet; `progress` sees that build's events, and nothing when the template was there.
    pub fn open_or_build(
        name: &str,
        progress: &mut dyn FnMut(BuildEvent),
    ) -> Result<Template, TemplateError> {
        match Template::open(name) {
            Err(TemplateError::NotBuilt { .. }) => {
                Template::build(name, &BuildOptions::default(), progress)
            }
            other => other,
        }
    }

    /// Opens the latest build of `name` (or a key, or a template directory).
    pub fn open(name: &str) -> Result<Template, TemplateError> {
        let root = key::cache_root();
        if Path::new(name).is_absolute() {
            return Template::open_dir(Path::new(name));
        }
        check_name(name)?;
        let by_name = key::names_dir(&root).join(name);
        if by_name.join("template.json").is_file() {
            return Template::open_dir(&by_name);
        }
        let by_key = root.join(name);
        if by_key.join("template.json").is_file() {
            return Template::open_dir(&by_key);
        }
        Err(TemplateError::NotBuilt { name: name.into() })
    }

    /// Opens a template directory.
    pub fn open_dir(dir: &Path) -> Result<Template, TemplateError> {
        let record = dir.join("template.json");
        let text = std::fs::read_to_string(&record).map_err(io_err("cannot read", &record))?;
        let info: TemplateInfo =
            serde_json::from_str(&text).map_err(|e| TemplateError::BadRecord {
                path: record.clone(),
                message: e.to_string(),
            })?;
        let dir = dir.canonicalize().map_err(io_err("cannot resolve", dir))?;
        Ok(Template { info, dir })
    }

    /// Every built template: the named ones first (by name), then unnamed older builds.
    pub fn list() -> Result<Vec<(Option<String>, Template)>, TemplateError> {
        let root = key::cache_root();
        let mut named = BTreeMap::new();
        if let Ok(entries) = std::fs::read_dir(key::names_dir(&root)) {
            for e in entries.flatten() {
                if let Ok(target) = std::fs::read_link(e.path()) {
                    if let Some(key) = target.file_name() {
                        named.insert(
                            key.to_string_lossy().into_owned(),
                            e.file_name().to_string_lossy().into_owned(),
                        );
                    }
                }
            }
        }
        let mut out = Vec::new();
        let Ok(entries) = std::fs::read_dir(&root) else {
            return Ok(out);
        };
        for e in entries.flatten() {
            let path = e.path();
            if !path.join("template.json").is_file() {
                continue;
            }
            let key = e.file_name().to_string_lossy().into_owned();
            if let Ok(t) = Template::open_dir(&path) {
                out.push((named.get(&key).cloned(), t));
            }
        }
        out.sort_by(|a, b| {
            (a.0.is_none(), &a.0, &a.1.info.built_at).cmp(&(
                b.0.is_none(),
                &b.0,
                &b.1.info.built_at,
            ))
        });
        Ok(out)
    }

    /// Removes the build `name` points at (and the name); `name` may also be a key.
    pub fn remove(name: &str) -> Result<Template, TemplateError> {
        let t = Template::open(name)?;
        let root = key::cache_root();
        let link = key::names_dir(&root).join(name);
        if link.symlink_metadata().is_ok() {
            std::fs::remove_file(&link).map_err(io_err("cannot remove", &link))?;
        }
        // Names pointing at the same build go too.
        if let Ok(entries) = std::fs::read_dir(key::names_dir(&root)) {
            for e in entries.flatten() {
                if std::fs::read_link(e.path())
                    .ok()
                    .and_then(|t| t.file_name().map(|n| n.to_os_string()))
                    .is_some_and(|k| k.to_string_lossy() == t.info.key)
                {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        // Rename first so a sandbox being created never sees half a directory.
        let gone = root.join(format!(".rm-{}-{}", t.info.key, std::process::id()));
        std::fs::rename(&t.dir, &gone).map_err(io_err("cannot remove", &t.dir))?;
        std::fs::remove_dir_all(&gone).map_err(io_err("cannot remove", &gone))?;
        Ok(t)
    }

    /// A new empty directory on the template cache's file system, for a template made
    /// elsewhere (a fleet's node pulling one) to be staged in before [`Template::install`].
    pub fn staging_dir(tag: &str) -> Result<PathBuf, TemplateError> {
        let root = key::cache_root();
        let dir = root.join(format!(".stage-{tag}-{}", crate::paths::random_id()));
        std::fs::create_dir_all(&dir).map_err(io_err("cannot create", &dir))?;
        Ok(dir)
    }

    /// Installs a template made on another host: `staged` (from [`Template::staging_dir`],
    /// holding its `template.json` and `snapshot/`, with disk paths already this host's)
    /// becomes `$EMBER_CACHE/templates/<key>` and `name` points at it. When that key is
    /// already installed (a concurrent pull), `staged` is dropped and the one there kept.
    pub fn install(staged: &Path, name: &str) -> Result<Template, TemplateError> {
        check_name(name)?;
        let t = Template::open_dir(staged)?;
        let key = t.info.key.clone();
        if key.len() != 64 || !key.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(TemplateError::BadRecord {
                path: staged.join("template.json"),
                message: format!("key {key:?} is not a SHA-256"),
            });
        }
        let root = key::cache_root();
        let _lock = key::lock_file(&root.join(format!(".lock-{key}")))?;
        let dest = root.join(&key);
        if dest.join("template.json").is_file() {
            let _ = std::fs::remove_dir_all(staged);
        } else {
            std::fs::rename(staged, &dest).map_err(io_err("cannot install", &dest))?;
        }
        key::link_name(&root, name, &key)?;
        Template::open_dir(&dest)
    }

    /// The snapshot directory sandboxes restore from.
    pub fn snapshot_dir(&self) -> PathBuf {
        self.dir.join("snapshot")
    }

    /// The template's name.
    pub fn name(&self) -> &str {
        &self.info.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_path_safe() {
        for ok in ["default", "python-data", "a.b_c"] {
            check_name(ok).unwrap();
        }
        for bad in ["", "a/b", "..", ".hidden", "a b", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
    }
}
