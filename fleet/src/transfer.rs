//! What a node puts into the blob store and takes out of it: templates (published when the
//! node starts, pulled on first use) and paused sandboxes (uploaded after each pause,
//! taken in by another node).
//!
//! **A template** is a bundle of its record (`template.json`, `vm.json`), its snapshot
//! (`snapshot/…`) and the root file system image its snapshot's disk overlay sits on
//! (`image/rootfs.ext4`); `templates/<name>` and `template-keys/<key>` name it. A node that
//! pulls it writes the image under `$EMBER_CACHE/images/<hash of its chunk list>/` (shared by
//! every template over the same image), the rest into a staging directory, points the
//! template's record and disk list (`ember-disks.json`) at its own copy of the image, and
//! installs it (`Template::install`) under the same key as everywhere.
//!
//! **A paused sandbox** is a bundle of its pause snapshot and its row. A layered pause's
//! `memory.base` (a hard link to its template's memory) is not uploaded when it is the
//! template's memory: the bundle says so, and the taker links its own copy of that template
//! (pulled first if it has none) and records that file's identity in the layer. Only the
//! layer (the pages the sandbox changed), its disk overlay's blocks and small files move;
//! chunks the store has are not sent again.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use ember_runtime::jail::SnapshotDisk;
use ember_runtime::store::SandboxRow;
use ember_runtime::{LifecycleHooks, ResumeVerdict, Runtime, SandboxInfo, Template};
use serde::{Deserialize, Serialize};

use crate::blobs::{sha256_hex, BlobError, Blobs, Moved};
use crate::db::Db;
use crate::FleetError;

/// A bundle file name: the root file system image of a template.
const IMAGE: &str = "image/rootfs.ext4";
/// Largest pointer object read.
const MAX_POINTER: usize = 64 << 10;

fn blob_err(e: BlobError) -> FleetError {
    FleetError::Blob(e.to_string())
}

fn io(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> FleetError {
    let m = format!("{what} {}", path.display());
    move |e| FleetError::Io(format!("{m}: {e}"))
}

/// `templates/<name>` and `template-keys/<key>`: which bundle holds a template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct TemplatePointer {
    key: String,
    bundle: String,
}

/// Publishes template `t` unless the store already has its key under its name. Returns the
/// bundle and what moved, or `None` when there was nothing to do.
pub fn publish_template(
    blobs: &Blobs,
    t: &Template,
) -> Result<Option<(String, Moved)>, FleetError> {
    let name = t.name().to_string();
    let pointer = format!("templates/{name}");
    if let Some(b) = blobs.get(&pointer, MAX_POINTER).map_err(blob_err)? {
        if serde_json::from_slice::<TemplatePointer>(&b).is_ok_and(|p| p.key == t.info.key) {
            return Ok(None);
        }
    }
    let mut files = vec![("template.json".to_string(), t.dir.join("template.json"))];
    if t.dir.join("vm.json").is_file() {
        files.push(("vm.json".into(), t.dir.join("vm.json")));
    }
    let snap = t.snapshot_dir();
    let entries = std::fs::read_dir(&snap).map_err(io("cannot list", &snap))?;
    let mut names: Vec<String> = Vec::new();
    for e in entries {
        let e = e.map_err(io("cannot list", &snap))?;
        let n = e.file_name().to_string_lossy().into_owned();
        // Host paths: the taker writes its own.
        if n == ember_runtime::jailed::DISKS_FILE || !e.path().is_file() {
            continue;
        }
        names.push(n);
    }
    names.sort();
    for n in names {
        files.push((format!("snapshot/{n}"), snap.join(&n)));
    }
    files.push((IMAGE.into(), t.info.rootfs.clone()));
    let (host_kind, cpu_profile) = crate::host::profile();
    let meta = serde_json::json!({
        "name": name,
        "key": t.info.key,
        "host_kind": host_kind,
        "cpu_profile": cpu_profile,
    });
    let (bundle, moved) = blobs
        .put_bundle("template", &files, meta)
        .map_err(blob_err)?;
    let p = serde_json::to_vec(&TemplatePointer {
        key: t.info.key.clone(),
        bundle: bundle.clone(),
    })
    .map_err(|e| FleetError::Io(e.to_string()))?;
    blobs
        .put(&format!("template-keys/{}", t.info.key), p.clone())
        .map_err(blob_err)?;
    blobs.put(&pointer, p).map_err(blob_err)?;
    Ok(Some((bundle, moved)))
}

/// Publishes the named templates of this host (`only`: those; empty: all), a log line for
/// each that moved.
pub fn publish_all(blobs: &Blobs, only: &[String]) {
    let list = match Template::list() {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!("templates not published: {e}");
            return;
        }
    };
    for (name, t) in list {
        if name.as_deref() != Some(t.name())
            || (!only.is_empty() && !only.contains(&name.clone().unwrap_or_default()))
        {
            continue;
        }
        let t0 = Instant::now();
        match publish_template(blobs, &t) {
            Ok(Some((bundle, m))) => tracing::info!(
                "template {}: published as bundle {} ({} MiB of data, {} MiB sent) in {:.1} s",
                t.name(),
                &bundle[..12],
                m.data >> 20,
                m.bytes_moved >> 20,
                t0.elapsed().as_secs_f64()
            ),
            Ok(None) => {}
            Err(e) => tracing::warn!("template {}: not published: {e}", t.name()),
        }
    }
}

/// Serialises pulls of one template on this host (two creates of a cold template pull once).
static PULLING: Mutex<()> = Mutex::new(());

/// Opens template `name` (a name or a key), pulling it from the store when this host does
/// not have it; `key`: the build wanted (a paused sandbox needs the very build it was
/// restored from), else the store's latest of that name.
pub fn open_or_pull(
    blobs: Option<&Blobs>,
    name: &str,
    key: Option<&str>,
) -> Result<Template, FleetError> {
    let local = |n: &str| Template::open(n).ok();
    if let Some(k) = key {
        if let Some(t) = local(k) {
            return Ok(t);
        }
    } else if let Some(t) = local(name) {
        return Ok(t);
    }
    let Some(blobs) = blobs else {
        return Err(FleetError::Blob(format!(
            "template {name:?} is not on this node and the node has no blob store (--blobs)"
        )));
    };
    let _one = PULLING.lock().unwrap_or_else(|p| p.into_inner());
    pull_template(blobs, name, key).map(|(t, _)| t)
}

/// Pulls template `name` (build `key`, or the latest) from the store and installs it.
pub fn pull_template(
    blobs: &Blobs,
    name: &str,
    key: Option<&str>,
) -> Result<(Template, Moved), FleetError> {
    ember_runtime::template::check_name(name).map_err(|e| FleetError::Blob(e.to_string()))?;
    let pointer = match key {
        Some(k) => format!("template-keys/{k}"),
        None => format!("templates/{name}"),
    };
    let p = blobs
        .get(&pointer, MAX_POINTER)
        .map_err(blob_err)?
        .ok_or_else(|| {
            FleetError::Missing(format!(
                "template {name:?}{} is neither on this node nor in the blob store {}",
                key.map(|k| format!(" (build {})", &k[..k.len().min(12)]))
                    .unwrap_or_default(),
                blobs.url()
            ))
        })?;
    let p: TemplatePointer =
        serde_json::from_slice(&p).map_err(|e| FleetError::Blob(format!("{pointer}: {e}")))?;
    if let Ok(t) = Template::open(&p.key) {
        return Ok((t, Moved::default()));
    }
    let t0 = Instant::now();
    let bundle = blobs.get_bundle(&p.bundle).map_err(blob_err)?;
    if bundle.kind != "template" || bundle.meta["key"] != p.key.as_str() {
        return Err(FleetError::Blob(format!(
            "bundle {} is not template build {}",
            p.bundle, p.key
        )));
    }
    // Its snapshot restores only on a host like the one that made it.
    let here = crate::host::profile();
    let made = (
        bundle.meta["host_kind"].as_str().unwrap_or_default(),
        bundle.meta["cpu_profile"].as_str().unwrap_or_default(),
    );
    if made != (here.0.as_str(), here.1.as_str()) {
        return Err(FleetError::Blob(format!(
            "template {name} was built on a {} host with CPU profile {}; this node is {} with {}: \
             it cannot restore it (build it on a host like this one)",
            made.0, made.1, here.0, here.1
        )));
    }
    // The image, shared by the templates over it: named by its chunk list.
    let image = bundle
        .file(IMAGE)
        .ok_or_else(|| FleetError::Blob(format!("bundle {}: no {IMAGE}", p.bundle)))?;
    let image_id = sha256_hex(&serde_json::to_vec(image).unwrap_or_default());
    let image_dir = ember_runtime::paths::cache_dir()
        .join("images")
        .join(&image_id);
    let image_path = image_dir.join("rootfs.ext4");
    let mut moved = Moved::default();
    if !image_path.is_file() {
        std::fs::create_dir_all(&image_dir).map_err(io("cannot create", &image_dir))?;
        let m = blobs.get_file(image, &image_path).map_err(blob_err)?;
        moved = add(moved, m);
    }
    let stage = Template::staging_dir(&p.key[..12]).map_err(|e| FleetError::Blob(e.to_string()))?;
    let staged = (|| -> Result<Template, FleetError> {
        let mut rest = bundle.clone();
        rest.files.retain(|f| f.name != IMAGE);
        let m = blobs.get_files(&rest, &stage).map_err(blob_err)?;
        moved = add(moved, m);
        // The record and the disks name this host's copy of the image.
        let record = stage.join("template.json");
        let text = std::fs::read(&record).map_err(io("cannot read", &record))?;
        let mut info: ember_runtime::TemplateInfo = serde_json::from_slice(&text)
            .map_err(|e| FleetError::Blob(format!("{}: {e}", record.display())))?;
        if info.key != p.key {
            return Err(FleetError::Blob(format!(
                "bundle {}: its record is of build {}, not {}",
                p.bundle, info.key, p.key
            )));
        }
        let origin = info.rootfs.clone();
        info.rootfs = image_path.clone();
        let json = serde_json::to_vec_pretty(&info).map_err(|e| FleetError::Io(e.to_string()))?;
        std::fs::write(&record, json).map_err(io("cannot write", &record))?;
        let snap = stage.join("snapshot");
        let disks = ember_runtime::jailed::snapshot_disks(&snap)
            .map_err(|e| FleetError::Blob(format!("bundle {}: {e}", p.bundle)))?;
        let disks = local_disks(disks, &origin, &image_path)?;
        ember_runtime::jailed::write_disks(&snap, &disks)
            .map_err(|e| FleetError::Io(e.to_string()))?;
        Template::install(&stage, name).map_err(|e| FleetError::Blob(e.to_string()))
    })();
    if staged.is_err() {
        let _ = std::fs::remove_dir_all(&stage);
    }
    let t = staged?;
    tracing::info!(
        "template {name}: pulled build {} ({} MiB of data, {} MiB fetched) in {:.1} s",
        &p.key[..12],
        moved.data >> 20,
        moved.bytes_moved >> 20,
        t0.elapsed().as_secs_f64()
    );
    Ok((t, moved))
}

fn add(mut a: Moved, b: Moved) -> Moved {
    a.data += b.data;
    a.chunks += b.chunks;
    a.chunks_moved += b.chunks_moved;
    a.bytes_moved += b.bytes_moved;
    a
}

/// A snapshot's disks with the image `origin` (a path on the host that made it) replaced by
/// `local`; any other host path is refused (it would not exist here).
fn local_disks(
    disks: Vec<SnapshotDisk>,
    origin: &Path,
    local: &Path,
) -> Result<Vec<SnapshotDisk>, FleetError> {
    disks
        .into_iter()
        .map(|d| match d {
            SnapshotDisk::Overlay { base } if base == origin => Ok(SnapshotDisk::Overlay {
                base: local.to_path_buf(),
            }),
            SnapshotDisk::Overlay { base } => Err(FleetError::Blob(format!(
                "a disk's base image {} is not its template's image {}: it cannot move",
                base.display(),
                origin.display()
            ))),
            SnapshotDisk::Raw { path, .. } => Err(FleetError::Blob(format!(
                "disk {} is a host file: it cannot move",
                path.display()
            ))),
        })
        .collect()
}

/// The part of a pause bundle's meta that says how to rebuild it on another host.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PauseMeta {
    row: SandboxRow,
    /// Its template's name and build.
    template: String,
    key: String,
    /// The layer's base is the template's memory (not uploaded).
    base_is_template: bool,
}

/// The regular files of `dir` to upload, by name, without the host's disk list and `skip`.
fn snapshot_files(dir: &Path, skip: Option<&str>) -> Result<Vec<(String, PathBuf)>, FleetError> {
    let mut names: Vec<String> = Vec::new();
    // The disks' host paths are rewritten by the taker; a snapshot with a VM state names its
    // disks there, one without (filesystem-only) only in the disks file, which then goes too.
    let fs_only = ember_runtime::paths::is_fs_only(dir);
    for e in std::fs::read_dir(dir).map_err(io("cannot list", dir))? {
        let e = e.map_err(io("cannot list", dir))?;
        let n = e.file_name().to_string_lossy().into_owned();
        if !e.path().is_file()
            || (n == ember_runtime::jailed::DISKS_FILE && !fs_only)
            || Some(n.as_str()) == skip
        {
            continue;
        }
        names.push(n);
    }
    names.sort();
    Ok(names.iter().map(|n| (n.clone(), dir.join(n))).collect())
}

/// A named snapshot's bundle meta.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SnapshotMeta {
    info: ember_runtime::SnapshotInfo,
    template: String,
    key: String,
}

/// Uploads named snapshot `info` (its directory `dir`); returns the bundle and what moved.
pub fn upload_snapshot(
    blobs: &Blobs,
    info: &ember_runtime::SnapshotInfo,
    dir: &Path,
) -> Result<(String, Moved), FleetError> {
    let name = info.template.clone().ok_or_else(|| {
        FleetError::Blob(format!(
            "snapshot {}: no template: it cannot move",
            info.name
        ))
    })?;
    let t = Template::open(&name)
        .map_err(|e| FleetError::Blob(format!("snapshot {}: its template: {e}", info.name)))?;
    let disks = ember_runtime::jailed::snapshot_disks(dir)
        .map_err(|e| FleetError::Blob(format!("snapshot {}: {e}", info.name)))?;
    local_disks(disks, &t.info.rootfs, &t.info.rootfs)?;
    let files = snapshot_files(dir, None)?;
    let meta = SnapshotMeta {
        info: info.clone(),
        template: t.name().to_string(),
        key: t.info.key.clone(),
    };
    let meta = serde_json::to_value(&meta).map_err(|e| FleetError::Io(e.to_string()))?;
    blobs.put_bundle("snapshot", &files, meta).map_err(blob_err)
}

/// Takes in named snapshot `name` from bundle `blob` (pulling its template first when this
/// host lacks it).
pub fn import_snapshot(
    blobs: &Blobs,
    rt: &Runtime,
    name: &str,
    blob: &str,
) -> Result<(ember_runtime::SnapshotInfo, Moved), FleetError> {
    let (bundle, meta) = read_bundle::<SnapshotMeta>(blobs, blob, "snapshot")?;
    if meta.info.name != name {
        return Err(FleetError::Blob(format!(
            "bundle {blob} is snapshot {}, not {name}",
            meta.info.name
        )));
    }
    let t = open_or_pull(Some(blobs), &meta.template, Some(&meta.key))?;
    let stage = rt
        .config()
        .snapshots_dir()
        .join(format!(".in-{name}-{}", ember_runtime::paths::random_id()));
    let r = (|| {
        let moved = blobs.get_files(&bundle, &stage).map_err(blob_err)?;
        rebase_disks(&stage, &t, blob)?;
        let info = rt
            .import_snapshot(meta.info.clone(), &stage)
            .map_err(|e| FleetError::Blob(e.to_string()))?;
        Ok((info, moved))
    })();
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&stage);
    }
    r
}

/// Reads bundle `blob`, checks it is of `kind`, and its meta.
fn read_bundle<M: serde::de::DeserializeOwned>(
    blobs: &Blobs,
    blob: &str,
    kind: &str,
) -> Result<(crate::blobs::Bundle, M), FleetError> {
    let bundle = blobs.get_bundle(blob).map_err(blob_err)?;
    if bundle.kind != kind {
        return Err(FleetError::Blob(format!(
            "bundle {blob} is a {}, not a {kind}",
            bundle.kind
        )));
    }
    let meta = serde_json::from_value(bundle.meta.clone())
        .map_err(|e| FleetError::Blob(format!("bundle {blob}: {e}")))?;
    Ok((bundle, meta))
}

/// Points the overlay disks of the snapshot in `stage` (its disk list names the maker's image
/// path) at this host's copy of template `t`'s image.
fn rebase_disks(stage: &Path, t: &Template, blob: &str) -> Result<(), FleetError> {
    let disks: Vec<SnapshotDisk> = ember_runtime::jailed::snapshot_disks(stage)
        .map_err(|e| FleetError::Blob(format!("bundle {blob}: {e}")))?
        .into_iter()
        .map(|d| match d {
            SnapshotDisk::Overlay { .. } => SnapshotDisk::Overlay {
                base: t.info.rootfs.clone(),
            },
            raw => raw,
        })
        .collect();
    ember_runtime::jailed::write_disks(stage, &disks).map_err(|e| FleetError::Io(e.to_string()))
}

/// Uploads paused sandbox `row`'s snapshot in `dir`; returns the bundle and what moved.
pub fn upload_pause(
    blobs: &Blobs,
    row: &SandboxRow,
    dir: &Path,
) -> Result<(String, Moved), FleetError> {
    let name = row.template.clone().ok_or_else(|| {
        FleetError::Blob(format!(
            "sandbox {}: it has no template: it cannot move",
            row.id
        ))
    })?;
    let t = Template::open_dir(row.source_dir.parent().unwrap_or(Path::new("/")))
        .or_else(|_| Template::open(&name))
        .map_err(|e| FleetError::Blob(format!("sandbox {}: its template: {e}", row.id)))?;
    let base = dir.join(ember_snapshot::BASE_MEMORY_FILE);
    let tmem = t.snapshot_dir().join("memory");
    let same = |a: &Path, b: &Path| match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    };
    let base_is_template = base.exists() && same(&base, &tmem);
    let files = snapshot_files(
        dir,
        base_is_template.then_some(ember_snapshot::BASE_MEMORY_FILE),
    )?;
    // Its disks must be over its template's image (what the taker has).
    let disks = ember_runtime::jailed::snapshot_disks(dir)
        .map_err(|e| FleetError::Blob(format!("sandbox {}: {e}", row.id)))?;
    local_disks(disks, &t.info.rootfs, &t.info.rootfs)?;
    let meta = PauseMeta {
        row: row.clone(),
        template: t.name().to_string(),
        key: t.info.key.clone(),
        base_is_template,
    };
    let meta = serde_json::to_value(&meta).map_err(|e| FleetError::Io(e.to_string()))?;
    blobs.put_bundle("pause", &files, meta).map_err(blob_err)
}

/// Takes in paused sandbox `id` from bundle `blob` (pulling its template first when this
/// host lacks it). Returns it and what moved.
pub fn import_pause(
    blobs: &Blobs,
    rt: &Runtime,
    id: &str,
    blob: &str,
    from: &str,
) -> Result<(SandboxInfo, Moved), FleetError> {
    let (bundle, meta) = read_bundle::<PauseMeta>(blobs, blob, "pause")?;
    if meta.row.id != id {
        return Err(FleetError::Blob(format!(
            "bundle {blob} is sandbox {}, not {id}",
            meta.row.id
        )));
    }
    let t = open_or_pull(Some(blobs), &meta.template, Some(&meta.key))?;
    let stage = rt
        .config()
        .home
        .join("sandboxes")
        .join(format!(".in-{id}-{}", ember_runtime::paths::random_id()));
    let r = (|| -> Result<(SandboxInfo, Moved), FleetError> {
        let moved = blobs.get_files(&bundle, &stage).map_err(blob_err)?;
        let base = stage.join(ember_snapshot::BASE_MEMORY_FILE);
        if meta.base_is_template {
            let tmem = t.snapshot_dir().join("memory");
            std::fs::hard_link(&tmem, &base).map_err(io("cannot link", &tmem))?;
        }
        // A layer names its base by identity (inode, time): this host's copy's.
        if base.exists() {
            let mut layer = ember_snapshot::read_layer(&stage)
                .map_err(|e| FleetError::Blob(format!("bundle {blob}: {e}")))?
                .ok_or_else(|| FleetError::Blob(format!("bundle {blob}: no layer")))?;
            let meta = std::fs::metadata(&base).map_err(io("cannot stat", &base))?;
            layer.base = ember_snapshot::BaseIdentity::from_metadata(&meta);
            ember_snapshot::write_layer(stage.join(ember_snapshot::LAYER_FILE), &layer)
                .map_err(|e| FleetError::Io(e.to_string()))?;
        }
        rebase_disks(&stage, &t, blob)?;
        let info = rt
            .import_paused(
                meta.row.clone(),
                &stage,
                &t.snapshot_dir(),
                &format!("continued from node {from}"),
            )
            .map_err(|e| FleetError::Blob(e.to_string()))?;
        Ok((info, moved))
    })();
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&stage);
    }
    r
}

/// An upload to do.
enum Upload {
    /// A pause (generation `gen`).
    Pause {
        row: Box<SandboxRow>,
        dir: PathBuf,
        gen: i64,
    },
    /// A named snapshot.
    Snapshot {
        info: ember_runtime::SnapshotInfo,
        dir: PathBuf,
    },
    /// A sandbox's artifacts.
    Artifacts { id: String, dir: PathBuf },
}

/// The files under `dir`, by their path relative to it (`a/b.png`), sorted; temporary files
/// of a collection under way are left out.
fn tree_files(dir: &Path) -> Result<Vec<(String, PathBuf)>, FleetError> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).map_err(io("cannot list", &d))? {
            let e = e.map_err(io("cannot list", &d))?;
            let p = e.path();
            let ft = e.file_type().map_err(io("cannot stat", &p))?;
            if ft.is_dir() {
                todo.push(p);
            } else if ft.is_file() && p.extension().is_none_or(|x| x != "ember-partial") {
                if let Ok(rel) = p.strip_prefix(dir) {
                    out.push((rel.to_string_lossy().into_owned(), p.clone()));
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Uploads sandbox `id`'s artifacts (the directory they were collected into).
pub fn upload_artifacts(
    blobs: &Blobs,
    id: &str,
    dir: &Path,
) -> Result<(String, Moved), FleetError> {
    let files = tree_files(dir)?;
    let meta = serde_json::json!({
        "sandbox": id,
        "collected_at": ember_runtime::store::rfc3339(ember_runtime::store::now_ms()),
    });
    blobs
        .put_bundle("artifacts", &files, meta)
        .map_err(blob_err)
}

/// The node's [`LifecycleHooks`]: a pause is recorded in the directory at once and uploaded
/// by a thread of its own (with retries); a resume is recorded first, and refused when the
/// directory gave the sandbox to another node.
#[derive(Debug)]
pub struct NodeHooks {
    db: Arc<Db>,
    node: String,
    uploads: Mutex<mpsc::Sender<Upload>>,
    /// Sandboxes being taken in here (the heartbeat leaves them be).
    pub importing: Mutex<HashSet<String>>,
}

/// How often an upload is tried.
const UPLOAD_TRIES: u32 = 5;

impl NodeHooks {
    /// Hooks for node `node`, uploading to `blobs` (none: pauses are recorded only).
    pub fn start(
        db: Arc<Db>,
        node: &str,
        blobs: Option<Arc<Blobs>>,
    ) -> Result<Arc<NodeHooks>, FleetError> {
        let (tx, rx) = mpsc::channel::<Upload>();
        let hooks = Arc::new(NodeHooks {
            db: db.clone(),
            node: node.to_string(),
            uploads: Mutex::new(tx),
            importing: Mutex::new(HashSet::new()),
        });
        let node = node.to_string();
        std::thread::Builder::new()
            .name("ember-upload".into())
            .spawn(move || {
                for u in rx {
                    let Some(blobs) = &blobs else { continue };
                    upload_with_retries(blobs, &db, &node, u);
                }
            })
            .map_err(|e| FleetError::Io(format!("cannot start the upload thread: {e}")))?;
        Ok(hooks)
    }

    /// Queues the upload of every paused sandbox of `rt` the directory has no upload of (a
    /// node that stopped before its uploads were done).
    pub fn resume_uploads(&self, rt: &Runtime) {
        let Ok(list) = rt.list(&ember_runtime::ListFilter::default()) else {
            return;
        };
        for s in list
            .iter()
            .filter(|s| s.state == ember_runtime::State::Paused)
        {
            let Ok((row, dir)) = rt.export_paused(&s.id) else {
                continue;
            };
            if let Ok(Some(gen)) = self.db.pending_upload(&s.id, &self.node) {
                self.queue(Upload::Pause {
                    row: Box::new(row),
                    dir,
                    gen,
                });
            }
        }
    }

    /// Named snapshot `info` was taken here (in `dir`): recorded in the directory at once,
    /// uploaded by the upload thread.
    pub fn snapshot_taken(&self, info: &ember_runtime::SnapshotInfo, dir: &Path) {
        let json = serde_json::to_value(info).unwrap_or_default();
        if let Err(e) = self.db.set_snapshot(&info.name, &self.node, &json, None) {
            tracing::warn!("snapshot {}: not recorded in the directory: {e}", info.name);
        }
        self.queue(Upload::Snapshot {
            info: info.clone(),
            dir: dir.to_path_buf(),
        });
    }

    fn queue(&self, u: Upload) {
        let tx = self.uploads.lock().unwrap_or_else(|p| p.into_inner());
        if tx.send(u).is_err() {
            tracing::error!("the upload thread is gone: a pause is not uploaded");
        }
    }
}

fn upload_with_retries(blobs: &Blobs, db: &Db, node: &str, u: Upload) {
    match u {
        Upload::Pause { row, dir, gen } => {
            let id = &row.id;
            with_retries(&format!("sandbox {id}: its pause"), &dir, || {
                let t0 = Instant::now();
                let (bundle, m) = upload_pause(blobs, &row, &dir)?;
                if db.set_uploaded(id, node, gen, &bundle)? {
                    tracing::info!(
                        "sandbox {id}: pause uploaded as bundle {} ({} KiB of data, {} KiB \
                         sent, {} of {} chunks) in {:.0} ms",
                        &bundle[..12],
                        m.data >> 10,
                        m.bytes_moved >> 10,
                        m.chunks_moved,
                        m.chunks,
                        t0.elapsed().as_secs_f64() * 1e3
                    );
                } else {
                    tracing::info!("sandbox {id}: uploaded, but it resumed or moved meanwhile");
                }
                Ok(())
            })
        }
        Upload::Snapshot { info, dir } => {
            with_retries(&format!("snapshot {}", info.name), &dir, || {
                let t0 = Instant::now();
                let (bundle, m) = upload_snapshot(blobs, &info, &dir)?;
                let json = serde_json::to_value(&info).unwrap_or_default();
                db.set_snapshot(&info.name, node, &json, Some(&bundle))?;
                tracing::info!(
                    "snapshot {}: uploaded as bundle {} ({} MiB of data, {} KiB sent) in {:.0} ms",
                    info.name,
                    &bundle[..12],
                    m.data >> 20,
                    m.bytes_moved >> 10,
                    t0.elapsed().as_secs_f64() * 1e3
                );
                Ok(())
            })
        }
        Upload::Artifacts { id, dir } => {
            with_retries(&format!("sandbox {id}: its artifacts"), &dir, || {
                let (bundle, m) = upload_artifacts(blobs, &id, &dir)?;
                db.set_artifacts(&id, &bundle)?;
                tracing::info!(
                    "sandbox {id}: artifacts uploaded as bundle {} ({} KiB)",
                    &bundle[..12],
                    m.data >> 10
                );
                Ok(())
            })
        }
    }
}

/// Runs an upload up to [`UPLOAD_TRIES`] times, backing off, while `dir` (what it uploads)
/// is there: a sandbox that resumed, or was killed, or a snapshot deleted, needs none.
fn with_retries(what: &str, dir: &Path, mut upload: impl FnMut() -> Result<(), FleetError>) {
    for attempt in 1..=UPLOAD_TRIES {
        if !dir.exists() {
            return;
        }
        match upload() {
            Ok(()) => return,
            Err(e) if attempt < UPLOAD_TRIES => {
                tracing::warn!("{what}: upload failed (try {attempt}): {e}");
                std::thread::sleep(Duration::from_millis(500 << attempt));
            }
            Err(e) => tracing::error!(
                "{what}: upload failed {UPLOAD_TRIES} times; it stays on this node only: {e}"
            ),
        }
    }
}

impl LifecycleHooks for NodeHooks {
    fn paused(&self, row: &SandboxRow, dir: &Path) {
        match self.db.set_paused(&row.id, &self.node) {
            Ok(Some(gen)) => self.queue(Upload::Pause {
                row: Box::new(row.clone()),
                dir: dir.to_path_buf(),
                gen,
            }),
            Ok(None) => {} // not a fleet sandbox (the node's own API made it)
            Err(e) => tracing::warn!(
                "sandbox {}: pause not recorded in the directory (it stays here): {e}",
                row.id
            ),
        }
    }

    fn artifacts_collected(&self, id: &str, dir: &Path) {
        self.queue(Upload::Artifacts {
            id: id.to_string(),
            dir: dir.to_path_buf(),
        });
    }

    fn resuming(&self, id: &str) -> ResumeVerdict {
        match self.db.claim_resume(id, &self.node) {
            Ok(None) => ResumeVerdict::Go,
            Ok(Some(other)) => ResumeVerdict::Moved(format!("it continued on node {other}")),
            Err(e) => {
                // The directory is away: this node still holds it (nothing moves a sandbox
                // without the directory).
                tracing::warn!("sandbox {id}: resume not recorded in the directory: {e}");
                ResumeVerdict::Go
            }
        }
    }
}
