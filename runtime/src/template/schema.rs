//! The one template schema: a recipe (`rootfs/templates/NAME.toml`) is [`Recipe`], and these
//! types are the whole of what a recipe may say — `rootfs/build.py` keeps no schema of its own.
//!
//! [`Recipe::load`] reads a recipe, checks it (unknown keys at any level, types, ranges, names,
//! paths) and normalises it (defaults filled in, guest paths cleaned, file modes as integers,
//! `[[files]] source` resolved to an absolute path). The rootfs builder reads that normalised
//! recipe as JSON ([`Recipe::builder_json`]: `ember template check --json FILE`, or the file
//! [`super::rootfs::default_rootfs`] hands it with `--recipe-json`), so what it builds is
//! exactly what was checked here. A mistake fails with the file, the key with its table path
//! and, for a misspelt key, the nearest valid name:
//!
//! ```text
//! rootfs/templates/x.toml:41: unknown key `warmup.servces`: did you mean `services`? (valid keys in `warmup`: code, contexts, spare, services)
//! ```
//!
//! The rootfs build writes the recipe's run-time part into `manifest.json` beside the image,
//! which templates read back as [`RootfsManifest`] ([`WarmupSpec`] is the same type on both
//! sides; the built VM's shape is [`VmShape`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use regex::Regex;
use serde::{Deserialize, Serialize};

use super::{io_err, TemplateError};
use crate::images;

/// The version of [`Recipe::builder_json`]'s document (`ember_recipe`): `rootfs/build.py`
/// refuses another.
pub const RECIPE_FORMAT: u32 = 1;

/// Where a sandbox's artifacts are written unless the recipe says otherwise.
pub const DEFAULT_OUTPUTS: &str = "/workspace/outputs";

/// The languages a context (and a spare) can be (the agent's; each needs its runtime in the
/// image: docs/e2b.md).
pub const LANGUAGES: [&str; 6] = ember_agent::protocol::LANGUAGES;

/// The languages that get one spare unless `[warmup] spare` says otherwise (every image has
/// them); the others default to none, so a recipe asks for them by name.
pub const DEFAULT_SPARE: [&str; 2] = ["python", "bash"];

// ------------------------------------------------------------------------------------------
// The recipe

/// A template recipe: how to build the root filesystem (`[debian]`, `[pip]`, `[[files]]`,
/// `[checks]`, `[vm] disk_mib`) and how to run it (`[vm]`, `[warmup]`, `[env]`, `outputs`).
/// `rootfs/README.md` describes each key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// The template's name; after [`Recipe::load`] always set (default: the file name without
    /// `.toml`).
    #[serde(default)]
    pub name: Option<String>,
    /// Free text.
    #[serde(default)]
    pub description: String,
    /// Where sandbox code leaves its artifacts (an absolute guest path).
    #[serde(default = "default_outputs")]
    pub outputs: String,
    /// The Debian tree (exactly one of `debian` and `image`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debian: Option<DebianSpec>,
    /// An OCI/Docker image as the tree instead (docs/images.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSpec>,
    /// pip requirements installed into the tree.
    #[serde(default)]
    pub pip: PipSpec,
    /// Files written into the tree after the packages.
    #[serde(default)]
    pub files: Vec<FileSpec>,
    /// Checks run in the tree when it is built.
    #[serde(default)]
    pub checks: ChecksSpec,
    /// The VM the template runs in.
    #[serde(default)]
    pub vm: VmSpec,
    /// What runs before the snapshot.
    #[serde(default)]
    pub warmup: WarmupSpec,
    /// Environment of code run in the sandbox.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// `[debian]`: what mmdebstrap installs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DebianSpec {
    /// A suite the host's apt sources carry (`bookworm`).
    pub suite: String,
    /// An mmdebstrap variant.
    #[serde(default = "minbase")]
    pub variant: String,
    /// Extra packages (`name`, `name:arch` or `name=version`).
    #[serde(default)]
    pub packages: Vec<String>,
}

/// `[image]`: the root tree comes from an OCI/Docker image instead of mmdebstrap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageSpec {
    /// A registry reference, `docker-archive:PATH`, `oci-archive:PATH` or `oci:DIR` (paths
    /// relative to the recipe; absolute after [`Recipe::load`]).
    #[serde(rename = "ref")]
    pub reference: String,
    /// Start the image's `Entrypoint` + `Cmd` as a service (`start`) before the snapshot.
    #[serde(default)]
    pub start: bool,
}

/// `[pip]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipSpec {
    /// Requirements (`numpy==2.1.3`); no options.
    #[serde(default)]
    pub packages: Vec<String>,
}

/// A `[[files]]` entry: a file written into the tree (owner root).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSpec {
    /// Absolute path in the guest.
    pub path: String,
    /// Inline text (exactly one of `content` and `source`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// A file relative to the recipe; after [`Recipe::load`], its absolute path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Permission bits: an octal string (`"0644"`) or an integer in the recipe, an integer after.
    #[serde(default)]
    pub mode: FileMode,
}

/// A file's permission bits (default 0644).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct FileMode(pub u32);

impl Default for FileMode {
    fn default() -> Self {
        FileMode(0o644)
    }
}

impl<'de> Deserialize<'de> for FileMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = FileMode;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an octal string such as \"0644\"")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<FileMode, E> {
                match u32::try_from(v) {
                    Ok(m) if m <= 0o7777 => Ok(FileMode(m)),
                    _ => Err(E::custom(format!("mode {v} out of range"))),
                }
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<FileMode, E> {
                self.visit_i64(i64::try_from(v).unwrap_or(i64::MAX))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<FileMode, E> {
                static OCTAL: LazyLock<Regex> = LazyLock::new(|| full(r"0?[0-7]{3,4}"));
                if !OCTAL.is_match(v) {
                    return Err(E::custom(format!(
                        "mode {v:?} is not an octal string such as \"0644\""
                    )));
                }
                let m = u32::from_str_radix(v, 8).map_err(E::custom)?;
                if m > 0o7777 {
                    return Err(E::custom(format!("mode {v:?} out of range")));
                }
                Ok(FileMode(m))
            }
        }
        d.deserialize_any(V)
    }
}

/// `[checks]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChecksSpec {
    /// Snippets run as `python3 -c` in the tree; the build fails if one fails.
    #[serde(default)]
    pub python: Vec<String>,
}

/// `[vm]` of a recipe. The built template's shape is [`VmShape`] (`manifest.json`'s `vm`, with
/// the image's actual size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    /// vCPUs (1..64).
    #[serde(default = "one")]
    pub vcpus: u32,
    /// Guest memory, MiB (64..).
    #[serde(default = "default_memory")]
    pub memory_mib: u64,
    /// The root image's size, MiB; None: sized to the content. Always written (as `null`) in
    /// the normalised recipe: the image key hashes it.
    #[serde(default)]
    pub disk_mib: Option<u64>,
    /// A network device (eth0): sandboxes get a namespace and a policy.
    #[serde(default = "yes")]
    pub network: bool,
}

impl Default for VmSpec {
    fn default() -> Self {
        Self {
            vcpus: one(),
            memory_mib: default_memory(),
            disk_mib: None,
            network: true,
        }
    }
}

/// A context the template starts before its snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextSpec {
    /// Its id (`default` is what `run_code` without a context uses).
    pub id: String,
    /// One of [`LANGUAGES`] (`python`, `bash`, `javascript`, `typescript`, `r`, `java`).
    #[serde(default = "python")]
    pub language: String,
    /// Working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Extra environment.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

/// The `[warmup]` of a recipe; the rootfs build carries it into `manifest.json` as it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarmupSpec {
    /// Python run in the zygote before any context is forked (imports, a first figure...).
    #[serde(default)]
    pub code: String,
    /// The contexts to start.
    #[serde(default = "default_contexts")]
    pub contexts: Vec<ContextSpec>,
    /// Spare contexts kept ready per language (`python`, `bash`); a recipe's language left out
    /// keeps its default of 1.
    #[serde(default = "default_spare")]
    pub spare: BTreeMap<String, u32>,
    /// Long-lived programs started (in the background, through the agent) after the warm-up
    /// and before the snapshot, so that every sandbox restores with them running (the
    /// `browser` template's Chromium). Left out of the key's JSON when empty, so templates
    /// without services keep their keys.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<ServiceSpec>,
}

impl Default for WarmupSpec {
    fn default() -> Self {
        Self {
            code: String::new(),
            contexts: default_contexts(),
            spare: default_spare(),
            services: Vec::new(),
        }
    }
}

/// A `[[warmup.services]]` entry: a guest program the template starts before its snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    /// Its name (for messages).
    pub name: String,
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Extra environment.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// `root` or `user`.
    #[serde(default = "root")]
    pub user: String,
    /// A command run in the guest until it exits 0: the service is ready. Repeated after a
    /// pause of four times its own run time (2 to 30 s). None: ready once started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<Vec<String>>,
    /// Longest wait for `ready`, seconds.
    #[serde(default = "default_ready_timeout")]
    pub ready_timeout_s: u64,
}

fn python() -> String {
    "python".into()
}
fn root() -> String {
    "root".into()
}
fn minbase() -> String {
    "minbase".into()
}
fn one() -> u32 {
    1
}
fn yes() -> bool {
    true
}
fn default_ready_timeout() -> u64 {
    300
}
fn default_memory() -> u64 {
    512
}
fn default_outputs() -> String {
    DEFAULT_OUTPUTS.into()
}
fn default_contexts() -> Vec<ContextSpec> {
    vec![ContextSpec {
        id: "default".into(),
        language: python(),
        cwd: None,
        env: BTreeMap::new(),
    }]
}
fn default_spare() -> BTreeMap<String, u32> {
    DEFAULT_SPARE.iter().map(|l| (l.to_string(), 1)).collect()
}

// ------------------------------------------------------------------------------------------
// What the rootfs build wrote

/// The VM shape of a built template (`manifest.json`'s and `template.json`'s `vm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmShape {
    /// vCPUs.
    #[serde(default = "one_u8")]
    pub vcpus: u8,
    /// Guest memory, MiB.
    #[serde(default = "default_memory")]
    pub memory_mib: u64,
    /// Root disk size, MiB (informational: the image is built at this size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u64>,
    /// A network device (eth0 at [`crate::netpolicy::GUEST_ADDR`]): sandboxes get a
    /// namespace and a policy. Missing in manifests older than networking: none.
    #[serde(default)]
    pub network: bool,
}

impl Default for VmShape {
    fn default() -> Self {
        Self {
            vcpus: 1,
            memory_mib: default_memory(),
            disk_mib: None,
            network: false,
        }
    }
}

fn one_u8() -> u8 {
    1
}

/// What the rootfs build wrote next to the image (`manifest.json`): the recipe's warm-up, VM
/// shape, environment and artifact directory, and the keys of the image. Only the fields
/// templates use; unknown ones are ignored so the two sides can grow independently.
#[derive(Debug, Clone, Deserialize)]
pub struct RootfsManifest {
    /// The recipe's name.
    #[serde(default)]
    pub template: String,
    /// The key of this entry (image + everything of the recipe that is not in the image).
    pub key: String,
    /// The key of the ext4 image alone (shared by recipes that differ only in warm-up, VM
    /// shape or environment).
    #[serde(default)]
    pub image_key: String,
    /// Warm-up.
    #[serde(default)]
    pub warmup: WarmupSpec,
    /// VM shape.
    #[serde(default)]
    pub vm: VmShape,
    /// Environment for code in the sandbox.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Where the sandbox's artifacts are written.
    #[serde(default = "default_outputs")]
    pub outputs: String,
}

/// The `manifest.json` beside a root filesystem image.
pub(super) fn read_manifest(rootfs: &Path) -> Result<RootfsManifest, TemplateError> {
    let path = rootfs.with_file_name("manifest.json");
    let text = std::fs::read_to_string(&path).map_err(io_err("cannot read", &path))?;
    serde_json::from_str(&text).map_err(|e| TemplateError::BadRecord {
        path,
        message: format!("not a rootfs manifest this ember understands: {e}"),
    })
}

// ------------------------------------------------------------------------------------------
// Loading and checking

/// A recipe that is not valid: the file, where in it, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}: {message}", file.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
pub struct RecipeError {
    /// The recipe file.
    pub file: PathBuf,
    /// The line (1-based), when the parser knows it.
    pub line: Option<usize>,
    /// The key with its table path (`warmup.services[1].ready`; arrays count from 0); empty
    /// for the file as a whole.
    pub key: String,
    /// What is wrong (it names the key).
    pub message: String,
    /// For an unknown key: the nearest valid name, when one is near.
    pub suggestion: Option<String>,
}

impl RecipeError {
    fn new(file: &Path, key: impl Into<String>, message: impl Into<String>) -> Self {
        RecipeError {
            file: file.to_path_buf(),
            line: None,
            key: key.into(),
            message: message.into(),
            suggestion: None,
        }
    }

    /// `key` is not one of `valid` (the keys of the table at `table`).
    fn unknown_key<S: AsRef<str>>(file: &Path, table: &str, key: &str, valid: &[S]) -> Self {
        let path = join(table, key);
        let suggestion = nearest(key, valid);
        let valid: Vec<&str> = valid.iter().map(AsRef::as_ref).collect();
        let within = if table.is_empty() {
            "valid top-level keys".to_string()
        } else {
            format!("valid keys in `{table}`")
        };
        let hint = match &suggestion {
            Some(s) => format!(": did you mean `{s}`?"),
            None => String::new(),
        };
        RecipeError {
            message: format!(
                "unknown key `{path}`{hint} ({within}: {})",
                valid.join(", ")
            ),
            suggestion,
            ..RecipeError::new(file, path, "")
        }
    }
}

/// `table.key` (`key` at the top level).
fn join(table: &str, key: &str) -> String {
    if table.is_empty() {
        key.to_string()
    } else {
        format!("{table}.{key}")
    }
}

/// The valid name nearest to `key` (edit distance, a swap counting as one edit), if it is near
/// enough to be a misspelling: at most 2 edits, or a third of the name.
fn nearest<S: AsRef<str>>(key: &str, valid: &[S]) -> Option<String> {
    let key_lower = key.to_ascii_lowercase();
    valid
        .iter()
        .map(|v| {
            let v = v.as_ref();
            (
                strsim::damerau_levenshtein(&key_lower, &v.to_ascii_lowercase()),
                v,
            )
        })
        .filter(|(d, v)| *d <= 2.max(v.len() / 3))
        .min_by_key(|(d, _)| *d)
        .map(|(_, v)| v.to_string())
}

/// A regex that must match the whole string.
fn full(re: &str) -> Regex {
    Regex::new(&format!("^(?:{re})$")).expect("valid regex")
}

impl Recipe {
    /// Reads, checks and normalises the recipe in `file`.
    pub fn load(file: &Path) -> Result<Recipe, RecipeError> {
        let text = std::fs::read_to_string(file).map_err(|e| {
            let message = if e.kind() == std::io::ErrorKind::NotFound {
                "no such recipe".to_string()
            } else {
                format!("cannot read: {e}")
            };
            RecipeError::new(file, "", message)
        })?;
        Recipe::parse(&text, file)
    }

    /// Checks and normalises recipe `text`, read from `file` (which names it in errors, gives
    /// the default name and is where `[[files]] source` paths are relative to).
    pub fn parse(text: &str, file: &Path) -> Result<Recipe, RecipeError> {
        let de = toml::Deserializer::parse(text).map_err(|e| RecipeError {
            line: e.span().map(|s| line_of(text, s.start)),
            ..RecipeError::new(file, "", format!("not valid TOML: {}", e.message()))
        })?;
        let mut recipe: Recipe =
            serde_path_to_error::deserialize(de).map_err(|e| serde_error(file, text, e))?;
        recipe.check(file)?;
        Ok(recipe)
    }

    /// The template's name.
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or_default()
    }

    /// The document the rootfs builder reads (`rootfs/build.py --recipe-json`): the checked,
    /// normalised recipe, the file it came from and [`RECIPE_FORMAT`].
    pub fn builder_json(&self, file: &Path) -> serde_json::Value {
        serde_json::json!({
            "ember_recipe": RECIPE_FORMAT,
            "file": file,
            "recipe": self,
        })
    }

    /// Everything serde's types do not say: names, ranges, guest paths, uniqueness; fills in
    /// the defaults that depend on the file and normalises paths.
    fn check(&mut self, file: &Path) -> Result<(), RecipeError> {
        static NAME: LazyLock<Regex> = LazyLock::new(|| full(r"[A-Za-z0-9][A-Za-z0-9._-]*"));
        static ID: LazyLock<Regex> = LazyLock::new(|| full(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"));
        let bad = |key: &str, message: String| RecipeError::new(file, key, message);

        let name = match self.name.take() {
            Some(n) => n,
            None => file
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
        };
        if !NAME.is_match(&name) {
            return Err(bad(
                "name",
                format!("`name` {name:?} must be letters, digits, '.', '_' or '-'"),
            ));
        }
        self.name = Some(name);
        self.outputs = guest_path(&self.outputs).ok_or_else(|| {
            bad(
                "outputs",
                format!(
                    "`outputs` must be an absolute guest path without '..' (got {:?})",
                    self.outputs
                ),
            )
        })?;

        match (&self.debian, &mut self.image) {
            (Some(d), None) => check_debian(d, file)?,
            (None, Some(img)) => {
                img.reference =
                    image_reference(&img.reference, file.parent().unwrap_or(Path::new(".")))
                        .map_err(|m| bad("image.ref", m))?;
                if !self.pip.packages.is_empty() {
                    return Err(bad(
                        "pip.packages",
                        "`pip.packages` is for [debian] recipes (pip runs in a chroot on the host, \
                         which an image's code never does): install the packages in the image"
                            .into(),
                    ));
                }
                if !self.checks.python.is_empty() {
                    return Err(bad(
                        "checks.python",
                        "`checks.python` is for [debian] recipes (checks run in a chroot on the \
                         host, which an image's code never does): use `warmup.code`, run in the \
                         template's VM"
                            .into(),
                    ));
                }
            }
            (None, None) => {
                return Err(bad(
                    "debian",
                    "`debian` is required: a recipe starts from [debian] (a Debian tree) or \
                     [image] (an OCI/Docker image)"
                        .into(),
                ))
            }
            (Some(_), Some(_)) => {
                return Err(bad(
                    "image",
                    "give one of [debian] and [image], not both".into(),
                ))
            }
        }
        for (i, p) in self.pip.packages.iter().enumerate() {
            let key = format!("pip.packages[{i}]");
            if p.is_empty() {
                return Err(bad(&key, format!("`{key}` is empty")));
            }
            if p.starts_with('-') {
                return Err(bad(
                    &key,
                    format!("`{key}`: {p:?}: options are not allowed, only requirements"),
                ));
            }
        }
        for (i, c) in self.checks.python.iter().enumerate() {
            if c.is_empty() {
                let key = format!("checks.python[{i}]");
                return Err(bad(&key, format!("`{key}` is empty")));
            }
        }
        let dir = file.parent().unwrap_or(Path::new("."));
        for (i, f) in self.files.iter_mut().enumerate() {
            let key = format!("files[{i}]");
            if !f.path.starts_with('/') || f.path == "/" || f.path.split('/').any(|c| c == "..") {
                return Err(bad(
                    &format!("{key}.path"),
                    format!(
                        "`{key}.path` must be an absolute path in the guest without '..' (got {:?})",
                        f.path
                    ),
                ));
            }
            match (&f.content, &f.source) {
                (Some(_), None) => {}
                (None, Some(src)) => {
                    let path = dir.join(src);
                    let resolved = path.canonicalize().map_err(|e| {
                        bad(
                            &format!("{key}.source"),
                            format!("`{key}.source`: cannot read {}: {e}", path.display()),
                        )
                    })?;
                    if let Err(e) = std::fs::File::open(&resolved) {
                        return Err(bad(
                            &format!("{key}.source"),
                            format!("`{key}.source`: cannot read {}: {e}", resolved.display()),
                        ));
                    }
                    f.source = Some(resolved.to_string_lossy().into_owned());
                }
                _ => {
                    return Err(bad(
                        &key,
                        format!("`{key}`: give exactly one of content (text) or source (a file)"),
                    ))
                }
            }
        }

        let vm = &self.vm;
        in_range("vm.vcpus", vm.vcpus.into(), 1, 64).map_err(|m| bad("vm.vcpus", m))?;
        in_range("vm.memory_mib", vm.memory_mib, 64, 1 << 20)
            .map_err(|m| bad("vm.memory_mib", m))?;
        if let Some(disk) = vm.disk_mib {
            in_range("vm.disk_mib", disk, 16, 1 << 24).map_err(|m| bad("vm.disk_mib", m))?;
        }
        check_env("env", &self.env).map_err(|(k, m)| bad(&k, m))?;

        let w = &mut self.warmup;
        let mut ids = BTreeSet::new();
        for (i, c) in w.contexts.iter_mut().enumerate() {
            let key = format!("warmup.contexts[{i}]");
            if !ID.is_match(&c.id) {
                return Err(bad(
                    &format!("{key}.id"),
                    format!(
                        "`{key}.id` must be 1-64 letters, digits, '.', '_' or '-' (got {:?})",
                        c.id
                    ),
                ));
            }
            if !ids.insert(c.id.clone()) {
                return Err(bad(
                    &format!("{key}.id"),
                    format!("`{key}.id`: duplicate context id {:?}", c.id),
                ));
            }
            if !LANGUAGES.contains(&c.language.as_str()) {
                return Err(bad(
                    &format!("{key}.language"),
                    format!(
                        "`{key}.language` must be one of {} (got {:?})",
                        LANGUAGES.join(", "),
                        c.language
                    ),
                ));
            }
            if let Some(cwd) = &c.cwd {
                c.cwd = Some(guest_path(cwd).ok_or_else(|| {
                    bad(
                        &format!("{key}.cwd"),
                        format!(
                            "`{key}.cwd` must be an absolute guest path without '..' (got {cwd:?})"
                        ),
                    )
                })?);
            }
            check_env(&format!("{key}.env"), &c.env).map_err(|(k, m)| bad(&k, m))?;
        }
        for (lang, n) in &w.spare {
            if !LANGUAGES.contains(&lang.as_str()) {
                return Err(RecipeError::unknown_key(
                    file,
                    "warmup.spare",
                    lang,
                    &LANGUAGES,
                ));
            }
            let key = format!("warmup.spare.{lang}");
            in_range(&key, (*n).into(), 0, 64).map_err(|m| bad(&key, m))?;
        }
        for lang in DEFAULT_SPARE {
            w.spare.entry(lang.to_string()).or_insert(1);
        }
        let mut names = BTreeSet::new();
        for (i, s) in w.services.iter_mut().enumerate() {
            let key = format!("warmup.services[{i}]");
            if !ID.is_match(&s.name) {
                return Err(bad(
                    &format!("{key}.name"),
                    format!(
                        "`{key}.name` must be 1-64 letters, digits, '.', '_' or '-' (got {:?})",
                        s.name
                    ),
                ));
            }
            if !names.insert(s.name.clone()) {
                return Err(bad(
                    &format!("{key}.name"),
                    format!("`{key}.name`: duplicate service name {:?}", s.name),
                ));
            }
            for (field, argv) in [("argv", Some(&s.argv)), ("ready", s.ready.as_ref())] {
                let Some(argv) = argv else { continue };
                if argv.is_empty() || argv[0].is_empty() || argv.iter().any(|a| a.contains('\0')) {
                    return Err(bad(
                        &format!("{key}.{field}"),
                        format!(
                            "`{key}.{field}` must be a non-empty list of strings (a program and \
                             its arguments)"
                        ),
                    ));
                }
            }
            check_env(&format!("{key}.env"), &s.env).map_err(|(k, m)| bad(&k, m))?;
            if let Some(cwd) = &s.cwd {
                s.cwd = Some(guest_path(cwd).ok_or_else(|| {
                    bad(
                        &format!("{key}.cwd"),
                        format!(
                            "`{key}.cwd` must be an absolute guest path without '..' (got {cwd:?})"
                        ),
                    )
                })?);
            }
            if s.user != "root" && s.user != "user" {
                return Err(bad(
                    &format!("{key}.user"),
                    format!(
                        "`{key}.user` must be \"root\" or \"user\" (got {:?})",
                        s.user
                    ),
                ));
            }
            let k = format!("{key}.ready_timeout_s");
            in_range(&k, s.ready_timeout_s, 1, 3600).map_err(|m| bad(&k, m))?;
        }
        Ok(())
    }
}

/// `[debian]`'s suite, variant and packages.
fn check_debian(d: &DebianSpec, file: &Path) -> Result<(), RecipeError> {
    static SUITE: LazyLock<Regex> = LazyLock::new(|| full(r"[a-z][a-z0-9-]*"));
    static PACKAGE: LazyLock<Regex> =
        LazyLock::new(|| full(r"[a-z0-9][a-z0-9+.-]*(:[a-z0-9]+)?(=[A-Za-z0-9.+:~-]+)?"));
    const VARIANTS: [&str; 6] = [
        "minbase",
        "essential",
        "apt",
        "required",
        "important",
        "standard",
    ];
    let bad = |key: &str, message: String| RecipeError::new(file, key, message);
    if !SUITE.is_match(&d.suite) {
        return Err(bad(
            "debian.suite",
            format!(
                "`debian.suite` must be a Debian code name such as \"bookworm\" (got {:?})",
                d.suite
            ),
        ));
    }
    if !VARIANTS.contains(&d.variant.as_str()) {
        return Err(bad(
            "debian.variant",
            format!(
                "`debian.variant` {:?} is not one of {}",
                d.variant,
                VARIANTS.join(", ")
            ),
        ));
    }
    for (i, p) in d.packages.iter().enumerate() {
        if !PACKAGE.is_match(p) {
            return Err(bad(
                &format!("debian.packages[{i}]"),
                format!("`debian.packages[{i}]`: {p:?} is not a Debian package name"),
            ));
        }
    }
    Ok(())
}

/// An `[image] ref`, checked, with the path of a local source made absolute (relative to the
/// recipe's directory).
fn image_reference(text: &str, dir: &Path) -> Result<String, String> {
    let parsed = ember_oci::ImageRef::parse(text).map_err(|e| format!("`image.ref`: {e}"))?;
    let abs = |p: &Path| {
        let p = dir.join(p);
        p.canonicalize().unwrap_or(p).to_string_lossy().into_owned()
    };
    Ok(match parsed {
        ember_oci::ImageRef::Registry(_) => text.to_string(),
        ember_oci::ImageRef::DockerArchive(p) => format!("docker-archive:{}", abs(&p)),
        ember_oci::ImageRef::OciArchive(p) => format!("oci-archive:{}", abs(&p)),
        ember_oci::ImageRef::OciLayout(p) => format!("oci:{}", abs(&p)),
    })
}

/// `value` within `min..=max`, else the message.
fn in_range(key: &str, value: u64, min: u64, max: u64) -> Result<(), String> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(format!(
            "`{key}` must be an integer from {min} to {max} (got {value})"
        ))
    }
}

/// Environment names are shell names; values have no NUL.
fn check_env(table: &str, env: &BTreeMap<String, String>) -> Result<(), (String, String)> {
    static VAR: LazyLock<Regex> = LazyLock::new(|| full(r"[A-Za-z_][A-Za-z0-9_]*"));
    for (k, v) in env {
        let key = join(table, k);
        if !VAR.is_match(k) {
            return Err((
                key,
                format!("`{table}`: {k:?} is not an environment variable name"),
            ));
        }
        if v.contains('\0') {
            return Err((key.clone(), format!("`{key}` contains a NUL")));
        }
    }
    Ok(())
}

/// An absolute guest path without `..` or NUL, with empty components dropped
/// (`/workspace//out/` is `/workspace/out`); None if it is not one.
fn guest_path(value: &str) -> Option<String> {
    if !value.starts_with('/') || value.contains('\0') || value.split('/').any(|c| c == "..") {
        return None;
    }
    let parts: Vec<&str> = value.split('/').filter(|p| !p.is_empty()).collect();
    Some(format!("/{}", parts.join("/")))
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// A deserialization error as a [`RecipeError`]: the key's table path from
/// `serde_path_to_error`, the line from the TOML parser, and for serde's unknown-field error
/// (`#[serde(deny_unknown_fields)]`: ``unknown field `x`, expected one of `a`, `b` ``) the
/// nearest valid name.
fn serde_error(
    file: &Path,
    text: &str,
    e: serde_path_to_error::Error<toml::de::Error>,
) -> RecipeError {
    use serde_path_to_error::Segment;
    let inner = e.inner();
    let msg = inner.message();
    let unknown = msg.strip_prefix("unknown field `").map(|rest| {
        let (field, expected) = rest.split_once('`').unwrap_or((rest, ""));
        // The names serde lists are each between backticks.
        let valid: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
        (field, valid)
    });
    let mut segments: Vec<&Segment> = e.path().iter().collect();
    // The path of an unknown key ends with the key itself: the table is what is before it.
    if let (Some((field, _)), Some(Segment::Map { key })) = (&unknown, segments.last()) {
        if key == field {
            segments.pop();
        }
    }
    let mut table = String::new();
    for seg in segments {
        match seg {
            Segment::Seq { index } => table.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !table.is_empty() {
                    table.push('.');
                }
                table.push_str(key);
            }
            Segment::Unknown => table.push_str(".?"),
        }
    }
    let line = inner.span().map(|s| line_of(text, s.start));
    let mut err = if let Some((field, valid)) = unknown {
        RecipeError::unknown_key(file, &table, field, &valid)
    } else if let Some(field) = msg
        .strip_prefix("missing field `")
        .and_then(|r| r.strip_suffix('`'))
    {
        let key = join(&table, field);
        RecipeError::new(file, key.clone(), format!("`{key}` is required"))
    } else if table.is_empty() {
        RecipeError::new(file, "", msg)
    } else {
        RecipeError::new(file, table.clone(), format!("`{table}`: {msg}"))
    };
    err.line = line;
    err
}

/// The recipe file for `template`: a path (it has a `/` or ends in `.toml`) or a name in the
/// source tree's `rootfs/templates/`.
pub fn recipe_path(template: &str) -> Result<PathBuf, images::ImageError> {
    if template.contains('/') || template.ends_with(".toml") {
        let p = PathBuf::from(template);
        return Ok(p.canonicalize().unwrap_or(p));
    }
    Ok(images::source_root()?
        .join("rootfs/templates")
        .join(format!("{template}.toml")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "[debian]\nsuite = \"bookworm\"\npackages = [\"python3\"]\n";

    fn parse(text: &str) -> Result<Recipe, RecipeError> {
        Recipe::parse(text, Path::new("/recipes/t.toml"))
    }

    fn shipped() -> Vec<PathBuf> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rootfs/templates");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .collect();
        files.sort();
        files
    }

    #[test]
    fn an_image_recipe_replaces_debian() {
        let r = parse("[image]\nref = \"oci:layout\"\nstart = true\n").unwrap();
        let img = r.image.as_ref().unwrap();
        assert_eq!(
            img.reference, "oci:/recipes/layout",
            "local paths are made absolute"
        );
        assert!(img.start && r.debian.is_none());
        for (text, key, want) in [
            (
                "[image]\nref = \"x\"\n[debian]\nsuite = \"bookworm\"\n",
                "image",
                "not both",
            ),
            (
                "[image]\nref = \"Bad Ref\"\n",
                "image.ref",
                "not a reference",
            ),
            (
                "[image]\nref = \"x\"\n[pip]\npackages = [\"numpy\"]\n",
                "pip.packages",
                "install the packages in the image",
            ),
            (
                "[image]\nref = \"x\"\n[checks]\npython = [\"import os\"]\n",
                "checks.python",
                "warmup.code",
            ),
            (
                "[image]\nreff = \"x\"\n",
                "image.reff",
                "did you mean `ref`",
            ),
        ] {
            let e = parse(text).unwrap_err();
            assert_eq!(e.key, key, "{text}: {e}");
            assert!(e.to_string().contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn every_shipped_recipe_parses() {
        let files = shipped();
        let names: Vec<String> = files
            .iter()
            .map(|f| {
                Recipe::load(f)
                    .unwrap_or_else(|e| panic!("{e}"))
                    .name()
                    .to_string()
            })
            .collect();
        assert_eq!(
            names,
            [
                "browser",
                "code-interpreter",
                "default",
                "python-data",
                "small"
            ]
        );
        let browser = Recipe::load(&files[0]).unwrap();
        let svc: Vec<&str> = browser
            .warmup
            .services
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(svc, ["chromium", "cdp-relay"]);
        assert_eq!(browser.warmup.services[0].user, "user");
        assert_eq!(browser.warmup.services[1].ready_timeout_s, 1800);
        let ci = Recipe::load(&files[1]).unwrap();
        for lang in LANGUAGES {
            assert!(
                ci.warmup.spare[lang] >= 1,
                "code-interpreter keeps a {lang} spare"
            );
        }
        let small = Recipe::load(&files[4]).unwrap();
        assert!(!small.vm.network);
        assert_eq!(small.vm.memory_mib, 256);
        let default = Recipe::load(&files[2]).unwrap();
        assert!(default.vm.network);
        assert_eq!(default.vm.disk_mib, Some(1024));
        assert_eq!(default.pip.packages, Vec::<String>::new());
    }

    /// The part of each shipped template's key that the recipe decides (`vm`, `warmup`, `env`,
    /// `outputs`, as [`super::super::key::template_key`] hashes them from the manifest the
    /// rootfs build writes), against digests taken with the code before the schema moved here
    /// (from the manifests the old `rootfs/build.py` wrote): the cache keys of existing
    /// templates did not change. Change these only with a deliberate change of the keys.
    #[test]
    fn shipped_recipes_keep_their_key_inputs() {
        use sha2::{Digest, Sha256};
        let golden = [
            (
                "browser",
                "1ccd5f7b9b907263a417535e66fe4c348d2a1349c08bafe7e3259e43c5e1a8e8",
            ),
            (
                "default",
                "392d9d981e6cc3a6b764212bff15a6ddc8cc38081d9d4e168b1ee0b3fdedea4f",
            ),
            (
                "python-data",
                "00d466bcf89b2c2b1734700115dccc39eba19f2f5fe9fb3da2b2f52d3274a153",
            ),
            (
                "small",
                "93c805a68576d0d5d52a75ce0ff3a9f6dd7a533f4db418c50b49996e19a25033",
            ),
        ];
        let files: Vec<PathBuf> = shipped()
            .into_iter()
            .filter(|f| golden.iter().any(|(n, _)| f.ends_with(format!("{n}.toml"))))
            .collect();
        assert_eq!(files.len(), golden.len());
        for (file, (name, digest)) in files.iter().zip(golden) {
            let r = Recipe::load(file).unwrap();
            assert_eq!(r.name(), name);
            // The manifest's `vm`: the recipe's, with the image's size (here: the recipe's).
            let vm = VmShape {
                vcpus: r.vm.vcpus as u8,
                memory_mib: r.vm.memory_mib,
                disk_mib: r.vm.disk_mib,
                network: r.vm.network,
            };
            let part = serde_json::to_vec(&serde_json::json!({
                "vm": vm, "warmup": r.warmup, "env": r.env, "outputs": r.outputs,
            }))
            .unwrap();
            let hex: String = Sha256::digest(&part)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(hex, digest, "{name}");
        }
    }

    #[test]
    fn a_misspelt_top_level_key_names_file_key_and_suggestion() {
        let e = parse(&format!("descripton = \"x\"\n{MINIMAL}")).unwrap_err();
        assert_eq!(e.file, Path::new("/recipes/t.toml"));
        assert_eq!(e.key, "descripton");
        assert_eq!(e.suggestion.as_deref(), Some("description"));
        assert_eq!(e.line, Some(1));
        let text = e.to_string();
        assert!(
            text.starts_with("/recipes/t.toml:1: unknown key `descripton`"),
            "{text}"
        );
        assert!(text.contains("did you mean `description`?"), "{text}");
    }

    #[test]
    fn a_misspelt_nested_key_names_its_table_path() {
        let text = format!(
            "{MINIMAL}[warmup]\ncode = \"\"\n[[warmup.services]]\nname = \"s\"\nargv = [\"x\"]\nredy = [\"y\"]\n"
        );
        let e = parse(&text).unwrap_err();
        assert_eq!(e.key, "warmup.services[0].redy");
        assert_eq!(e.suggestion.as_deref(), Some("ready"));
        assert_eq!(e.line, Some(9));
        let msg = e.to_string();
        assert!(msg.contains("/recipes/t.toml:9"), "{msg}");
        assert!(msg.contains("did you mean `ready`?"), "{msg}");

        let e = parse(&format!("{MINIMAL}[warmup]\nservces = []\n")).unwrap_err();
        assert_eq!(e.key, "warmup.servces");
        assert_eq!(e.suggestion.as_deref(), Some("services"));
        assert!(e
            .to_string()
            .contains("unknown key `warmup.servces`: did you mean `services`?"));

        let e = parse(&format!("{MINIMAL}[vm]\ncpus = 2\n")).unwrap_err();
        assert_eq!(
            (e.key.as_str(), e.suggestion.as_deref()),
            ("vm.cpus", Some("vcpus"))
        );
        let e = parse(&format!(
            "{MINIMAL}[warmup]\ncontexts = [{{ id = \"a\", langauge = \"bash\" }}]\n"
        ))
        .unwrap_err();
        assert_eq!(
            (e.key.as_str(), e.suggestion.as_deref()),
            ("warmup.contexts[0].langauge", Some("language"))
        );
        let e = parse(&format!("{MINIMAL}[warmup]\nspare = {{ pyhton = 2 }}\n")).unwrap_err();
        assert_eq!(
            (e.key.as_str(), e.suggestion.as_deref()),
            ("warmup.spare.pyhton", Some("python"))
        );
        let e = parse("[debian]\nsuite = \"bookworm\"\npackage = [\"x\"]\n").unwrap_err();
        assert_eq!(
            (e.key.as_str(), e.suggestion.as_deref()),
            ("debian.package", Some("packages"))
        );
        // Nothing near: no guess, but the valid names.
        let e = parse(&format!("extra = 1\n{MINIMAL}")).unwrap_err();
        assert_eq!((e.key.as_str(), e.suggestion.as_deref()), ("extra", None));
        assert!(
            e.to_string()
                .contains("valid top-level keys: name, description"),
            "{e}"
        );
    }

    #[test]
    fn defaults_and_normalisation() {
        let r = parse(MINIMAL).unwrap();
        assert_eq!(r.name(), "t");
        assert_eq!(r.outputs, "/workspace/outputs");
        assert_eq!(r.debian.as_ref().unwrap().variant, "minbase");
        assert_eq!(
            r.vm,
            VmSpec {
                vcpus: 1,
                memory_mib: 512,
                disk_mib: None,
                network: true
            }
        );
        assert_eq!(r.warmup, WarmupSpec::default());
        let json = r.builder_json(Path::new("/recipes/t.toml"));
        assert_eq!(json["ember_recipe"], RECIPE_FORMAT);
        assert_eq!(json["recipe"]["vm"]["disk_mib"], serde_json::Value::Null);
        assert!(json["recipe"]["warmup"].get("services").is_none());

        let r = parse(&format!(
            "outputs = \"/workspace//out/\"\n{MINIMAL}[vm]\nvcpus = 2\nmemory_mib = 1024\n\
             disk_mib = 900\n[warmup]\ncode = \"import os\"\nspare = {{ bash = 0 }}\n\
             contexts = [{{ id = \"default\" }}, {{ id = \"sh\", language = \"bash\", \
             cwd = \"/tmp/\", env = {{ A = \"1\" }} }}]\n[env]\nB = \"\"\n\
             [[files]]\npath = \"/etc/x\"\ncontent = \"x\"\nmode = \"0600\"\n\
             [[files]]\npath = \"/etc/y\"\ncontent = \"y\"\nmode = 0o755\n"
        ))
        .unwrap();
        assert_eq!(r.outputs, "/workspace/out");
        assert_eq!(
            r.warmup.spare,
            BTreeMap::from([("bash".into(), 0), ("python".into(), 1)])
        );
        assert_eq!(r.warmup.contexts[1].cwd.as_deref(), Some("/tmp"));
        assert_eq!(r.files[0].mode, FileMode(0o600));
        assert_eq!(r.files[1].mode, FileMode(0o755));
        let json = serde_json::to_value(&r.files).unwrap();
        assert_eq!(json[0]["mode"], 0o600);
    }

    #[test]
    fn file_sources_resolve_against_the_recipe() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("motd"), "hi\n").unwrap();
        let file = dir.path().join("t.toml");
        let text = format!("{MINIMAL}[[files]]\npath = \"/etc/motd\"\nsource = \"motd\"\n");
        std::fs::write(&file, &text).unwrap();
        let r = Recipe::load(&file).unwrap();
        let src = PathBuf::from(r.files[0].source.as_ref().unwrap());
        assert!(src.is_absolute());
        assert_eq!(std::fs::read_to_string(src).unwrap(), "hi\n");
        let missing = text.replace("\"motd\"", "\"nope\"");
        std::fs::write(&file, missing).unwrap();
        let e = Recipe::load(&file).unwrap_err();
        assert_eq!(e.key, "files[0].source");
    }

    #[test]
    fn invalid_recipes_say_where_and_why() {
        let cases: &[(&str, &str, &str)] = &[
            ("[debian]\npackages = []\n", "debian.suite", "is required"),
            ("", "debian", "is required"),
            ("[debian]\nsuite = \"Bookworm\"\n", "debian.suite", "Debian code name"),
            ("[debian]\nsuite = \"b\"\nvariant = \"big\"\n", "debian.variant", "not one of"),
            ("[debian]\nsuite = \"b\"\npackages = [\"Py\"]\n", "debian.packages[0]", "package name"),
            ("[pip]\npackages = [\"--index-url=x\"]\n", "pip.packages[0]", "options are not allowed"),
            ("[[files]]\npath = \"etc/x\"\ncontent = \"\"\n", "files[0].path", "absolute path"),
            ("[[files]]\npath = \"/x\"\ncontent = \"\"\nmode = \"rw\"\n", "files[0].mode", "octal"),
            ("[[files]]\npath = \"/x\"\n", "files[0]", "exactly one of content"),
            ("[warmup]\ncode = 1\n", "warmup.code", "invalid type"),
            ("[warmup]\ncontexts = [{ language = \"python\" }]\n", "warmup.contexts[0].id", "is required"),
            ("[warmup]\ncontexts = [{ id = \"a b\" }]\n", "warmup.contexts[0].id", "must be 1-64"),
            ("[warmup]\ncontexts = [{ id = \"a\", language = \"ruby\" }]\n", "warmup.contexts[0].language", "one of python, bash, javascript"),
            ("[warmup]\ncontexts = [{ id = \"a\" }, { id = \"a\" }]\n", "warmup.contexts[1].id", "duplicate context id"),
            ("[warmup]\ncontexts = \"default\"\n", "warmup.contexts", "invalid type"),
            ("[warmup]\nspare = { python = -1 }\n", "warmup.spare.python", "invalid value"),
            ("[warmup]\nspare = { python = 65 }\n", "warmup.spare.python", "from 0 to 64"),
            ("[[warmup.services]]\nname = \"s\"\n", "warmup.services[0].argv", "is required"),
            ("[[warmup.services]]\nname = \"s\"\nargv = []\n", "warmup.services[0].argv", "non-empty list"),
            ("[[warmup.services]]\nname = \"a b\"\nargv = [\"x\"]\n", "warmup.services[0].name", "must be 1-64"),
            ("[[warmup.services]]\nname = \"s\"\nargv = [\"x\"]\nuser = \"nobody\"\n", "warmup.services[0].user", "\"root\" or \"user\""),
            ("[[warmup.services]]\nname = \"s\"\nargv = [\"x\"]\nready = \"x\"\n", "warmup.services[0].ready", "invalid type"),
            ("[[warmup.services]]\nname = \"s\"\nargv = [\"x\"]\nready_timeout_s = 0\n", "warmup.services[0].ready_timeout_s", "from 1 to 3600"),
            ("[[warmup.services]]\nname = \"s\"\nargv = [\"x\"]\n[[warmup.services]]\nname = \"s\"\nargv = [\"y\"]\n", "warmup.services[1].name", "duplicate service name"),
            ("[vm]\nvcpus = 0\n", "vm.vcpus", "from 1 to 64"),
            ("[vm]\nvcpus = true\n", "vm.vcpus", "invalid type"),
            ("[vm]\nmemory_mib = \"512\"\n", "vm.memory_mib", "invalid type"),
            ("[vm]\ndisk_mib = 1.5\n", "vm.disk_mib", "invalid type"),
            ("[vm]\nnetwork = 1\n", "vm.network", "invalid type"),
            ("[env]\n\"A-B\" = \"x\"\n", "env.A-B", "not an environment variable name"),
            ("[env]\nA = 1\n", "env.A", "invalid type"),
            ("[checks]\npython = \"import x\"\n", "checks.python", "invalid type"),
            ("outputs = \"out\"\n", "outputs", "absolute guest path"),
            ("env = 1\n", "env", "invalid type"),
            ("name = \"a b\"\n", "name", "must be letters"),
        ];
        for (extra, key, message) in cases {
            // The debian cases stand alone; the others go with a valid [debian].
            let text = if extra.contains("[debian]") || extra.is_empty() {
                extra.to_string()
            } else if extra.starts_with('[') {
                format!("{MINIMAL}{extra}")
            } else {
                format!("{extra}{MINIMAL}")
            };
            let e = parse(&text).expect_err(extra);
            assert_eq!(e.key, *key, "{extra:?}: {e}");
            assert!(e.to_string().contains(message), "{extra:?}: {e}");
            assert!(e.to_string().starts_with("/recipes/t.toml"), "{e}");
        }
        let e = parse("[debian\n").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("/recipes/t.toml:1: not valid TOML"),
            "{e}"
        );
    }

    #[test]
    fn nearest_names_are_near() {
        let valid = ["code", "contexts", "spare", "services"];
        assert_eq!(nearest("servces", &valid).as_deref(), Some("services"));
        assert_eq!(nearest("Spare", &valid).as_deref(), Some("spare"));
        assert_eq!(nearest("contxets", &valid).as_deref(), Some("contexts"));
        assert_eq!(nearest("zzzzzzzz", &valid), None);
    }

    #[test]
    fn manifests_of_older_builds_still_read() {
        let m: RootfsManifest = serde_json::from_str(r#"{"template": "t", "key": "img"}"#).unwrap();
        assert_eq!(m.vm.memory_mib, 512);
        assert!(!m.vm.network);
        assert_eq!(m.warmup.contexts[0].id, "default");
        assert_eq!(m.outputs, "/workspace/outputs");
        // Fields this version does not know at the top level are ignored.
        let m: RootfsManifest =
            serde_json::from_str(r#"{"key": "img", "manifest_version": 1, "pip": []}"#).unwrap();
        assert_eq!(m.key, "img");
    }
}
