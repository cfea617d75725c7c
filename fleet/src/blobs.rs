//! The fleet's blob store: templates, paused sandboxes and named snapshots as immutable,
//! content-addressed objects in an S3-compatible store (or a local directory), so that any
//! node can restore what another made.
//!
//! A directory of files (a snapshot) is stored as a **bundle**: a JSON manifest naming each
//! file, its length and its **chunks**, and the chunks themselves. A file is cut at fixed
//! 4 MiB boundaries; only windows that hold data are stored (the holes of sparse files — a
//! guest's untouched memory, a disk overlay's unwritten blocks — are found with
//! `SEEK_DATA`/`SEEK_HOLE` and never read), and a window of zeros is not stored either. A
//! chunk's name is the SHA-256 of its bytes; it is stored zstd-compressed, and it is
//! uploaded only when the store does not have it yet. So a paused sandbox's snapshot, whose
//! memory is a layer over its template's, uploads the pages it changed and nothing of the
//! template (the template's chunks are there already): diff layers travel as diffs. A
//! bundle's name is the SHA-256 of its manifest.
//!
//! Objects under the store's prefix:
//! - `chunks/<sha256>`: a chunk, zstd-compressed;
//! - `bundles/<sha256>`: a manifest ([`Bundle`]);
//! - `templates/<name>`: which bundle is template `name`'s latest build (the one mutable
//!   kind of object; a bundle never changes).
//!
//! Reading verifies everything: a manifest's hash, every chunk's length and hash after
//! decompression, file names (relative, no `..`), lengths and offsets. A file is written
//! into a temporary name, sparse (zero pages are skipped, not written), and renamed only when
//! all of it checked out; a corrupt or hostile object is an error naming it, never a file.

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures_util::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, PutPayload};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Chunk size: files are cut at multiples of this.
pub const CHUNK: u64 = 4 << 20;
/// The manifest format this version writes and reads.
pub const BUNDLE_FORMAT: u32 = 1;
/// Chunks moved at once.
const PARALLEL: usize = 4;
/// Largest manifest read (a bundle of a few files of a few GiB is well under this).
const MAX_MANIFEST: usize = 16 << 20;
/// Largest file a bundle may describe.
const MAX_FILE: u64 = 1 << 40;
/// zstd level: fast (level 1 compresses memory images ~3x at hundreds of MB/s).
const ZSTD_LEVEL: i32 = 1;

/// What goes wrong with blobs. Each names the object or file.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// `--blobs` is not a usable location.
    #[error("--blobs {url:?}: {why}")]
    BadUrl {
        /// What was given.
        url: String,
        /// Why it is refused.
        why: String,
    },
    /// The store refused or could not be reached.
    #[error("blob store {store}: {op} {key}: {why}")]
    Store {
        /// The store (its URL).
        store: String,
        /// What was being done.
        op: &'static str,
        /// The object.
        key: String,
        /// The store's error.
        why: String,
    },
    /// The object is not in the store.
    #[error("blob store {store}: no object {key}")]
    Missing {
        /// The store (its URL).
        store: String,
        /// The object.
        key: String,
    },
    /// An object is not what its name or its manifest says.
    #[error("blob {key} is corrupt: {why}")]
    Corrupt {
        /// The object.
        key: String,
        /// What is wrong.
        why: String,
    },
    /// A local file could not be read or written.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> BlobError {
    let path = path.to_path_buf();
    move |source| BlobError::Io { op, path, source }
}

/// A bundle's manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bundle {
    /// [`BUNDLE_FORMAT`].
    pub format: u32,
    /// What it holds: `template`, `pause`, `snapshot`.
    pub kind: String,
    /// Its files.
    pub files: Vec<BundleFile>,
    /// What the kind needs besides the files (a template's record, a sandbox's row).
    #[serde(default)]
    pub meta: serde_json::Value,
}

/// One file of a bundle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BundleFile {
    /// Its name in the bundle (relative, `/`-separated).
    pub name: String,
    /// Its length (the rest of it, beyond its chunks, is zeros: holes).
    pub len: u64,
    /// Its chunks.
    pub chunks: Vec<ChunkRef>,
}

/// A chunk of a file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// Offset in the file (a multiple of [`CHUNK`]).
    pub at: u64,
    /// Length (at most [`CHUNK`]).
    pub len: u64,
    /// SHA-256 of its bytes, hex.
    pub sha256: String,
}

impl Bundle {
    /// The file called `name`.
    pub fn file(&self, name: &str) -> Option<&BundleFile> {
        self.files.iter().find(|f| f.name == name)
    }

    /// Bytes of data its files hold (their chunks).
    pub fn data_bytes(&self) -> u64 {
        self.files
            .iter()
            .flat_map(|f| &f.chunks)
            .map(|c| c.len)
            .sum()
    }

    /// Checks what a hostile manifest could use against its reader: names, lengths,
    /// offsets, hashes.
    fn check(&self, key: &str) -> Result<(), BlobError> {
        let bad = |why: String| BlobError::Corrupt {
            key: key.to_string(),
            why,
        };
        if self.format != BUNDLE_FORMAT {
            return Err(bad(format!(
                "manifest format {} (this ember reads {BUNDLE_FORMAT})",
                self.format
            )));
        }
        let mut names = HashSet::new();
        for f in &self.files {
            check_name(&f.name).map_err(|why| bad(format!("file {:?}: {why}", f.name)))?;
            if !names.insert(f.name.as_str()) {
                return Err(bad(format!("file {:?} named twice", f.name)));
            }
            if f.len > MAX_FILE {
                return Err(bad(format!(
                    "file {:?}: length {} too large",
                    f.name, f.len
                )));
            }
            let mut next = 0;
            for c in &f.chunks {
                if c.at % CHUNK != 0 || c.at < next || c.len == 0 || c.len > CHUNK {
                    return Err(bad(format!(
                        "file {:?}: chunk at {} of {} bytes is out of place",
                        f.name, c.at, c.len
                    )));
                }
                if c.at + c.len > f.len {
                    return Err(bad(format!(
                        "file {:?}: chunk at {} of {} bytes runs past its length {}",
                        f.name, c.at, c.len, f.len
                    )));
                }
                if !is_sha256(&c.sha256) {
                    return Err(bad(format!("file {:?}: chunk hash {:?}", f.name, c.sha256)));
                }
                next = c.at + c.len;
            }
        }
        Ok(())
    }
}

/// A bundle file's name: relative, `/`-separated plain components.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 255 {
        return Err("empty or too long".into());
    }
    let p = Path::new(name);
    if !p.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err("not a plain relative path".into());
    }
    Ok(())
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// SHA-256, hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// What a [`Blobs::put_bundle`] or [`Blobs::get_file`] moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Moved {
    /// Bytes of data in the files (their chunks, uncompressed).
    pub data: u64,
    /// Chunks in the files.
    pub chunks: u64,
    /// Chunks sent or fetched (the others the store, or the reader, had).
    pub chunks_moved: u64,
    /// Bytes sent or fetched (compressed).
    pub bytes_moved: u64,
}

impl Moved {
    fn add(&mut self, o: Moved) {
        self.data += o.data;
        self.chunks += o.chunks;
        self.chunks_moved += o.chunks_moved;
        self.bytes_moved += o.bytes_moved;
    }
}

/// A blob store: `s3://bucket/prefix` (endpoint, region and credentials from the usual AWS
/// variables: `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`)
/// or `file:///dir`. Its methods block (they run the store's client on a runtime of their
/// own): call them from plain threads, never from async code.
pub struct Blobs {
    url: String,
    store: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    rt: tokio::runtime::Runtime,
    /// Chunks known to be in the store (uploaded or seen): not asked about again.
    known: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for Blobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blobs")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl Blobs {
    /// Opens the store at `url`.
    pub fn open(url: &str) -> Result<Blobs, BlobError> {
        let bad = |why: String| BlobError::BadUrl {
            url: url.to_string(),
            why,
        };
        let (store, prefix): (Arc<dyn ObjectStore>, String) =
            if let Some(rest) = url.strip_prefix("s3://") {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(bad("no bucket (s3://BUCKET/PREFIX)".into()));
                }
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_bucket_name(bucket)
                    // MinIO, moto and most S3-compatible servers want path-style requests.
                    .with_virtual_hosted_style_request(false);
                if let Ok(ep) = std::env::var("AWS_ENDPOINT_URL") {
                    b = b
                        .with_endpoint(&ep)
                        .with_allow_http(ep.starts_with("http://"));
                }
                if std::env::var_os("AWS_REGION").is_none()
                    && std::env::var_os("AWS_DEFAULT_REGION").is_none()
                {
                    b = b.with_region("us-east-1");
                }
                let s = b.build().map_err(|e| bad(e.to_string()))?;
                (Arc::new(s), prefix.trim_matches('/').to_string())
            } else if let Some(dir) = url.strip_prefix("file://") {
                if !dir.starts_with('/') {
                    return Err(bad("a directory is an absolute path: file:///DIR".into()));
                }
                std::fs::create_dir_all(dir).map_err(|e| bad(e.to_string()))?;
                let s = object_store::local::LocalFileSystem::new_with_prefix(dir)
                    .map_err(|e| bad(e.to_string()))?;
                (Arc::new(s), String::new())
            } else {
                return Err(bad("expected s3://BUCKET/PREFIX or file:///DIR".into()));
            };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("ember-blobs")
            .enable_all()
            .build()
            .map_err(|e| bad(format!("cannot start its client: {e}")))?;
        Ok(Blobs {
            url: url.to_string(),
            store,
            prefix: ObjPath::from(prefix),
            rt,
            known: Mutex::new(HashSet::new()),
        })
    }

    /// The store's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn path(&self, key: &str) -> ObjPath {
        key.split('/')
            .fold(self.prefix.clone(), |p, part| p.child(part))
    }

    fn store_err(&self, op: &'static str, key: &str, e: object_store::Error) -> BlobError {
        match e {
            object_store::Error::NotFound { .. } => BlobError::Missing {
                store: self.url.clone(),
                key: key.to_string(),
            },
            e => BlobError::Store {
                store: self.url.clone(),
                op,
                key: key.to_string(),
                why: e.to_string(),
            },
        }
    }

    /// Writes object `key`.
    pub fn put(&self, key: &str, bytes: Vec<u8>) -> Result<(), BlobError> {
        self.rt.block_on(self.put_async(key, bytes))
    }

    async fn put_async(&self, key: &str, bytes: Vec<u8>) -> Result<(), BlobError> {
        self.store
            .put(&self.path(key), PutPayload::from(bytes))
            .await
            .map_err(|e| self.store_err("cannot write", key, e))?;
        Ok(())
    }

    /// Reads object `key` (`None` when it is not there), refusing one larger than `max`.
    pub fn get(&self, key: &str, max: usize) -> Result<Option<Vec<u8>>, BlobError> {
        match self.rt.block_on(self.get_async(key, max)) {
            Ok(b) => Ok(Some(b)),
            Err(BlobError::Missing { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn get_async(&self, key: &str, max: usize) -> Result<Vec<u8>, BlobError> {
        let r = self
            .store
            .get(&self.path(key))
            .await
            .map_err(|e| self.store_err("cannot read", key, e))?;
        if r.meta.size as u128 > max as u128 {
            return Err(BlobError::Corrupt {
                key: key.to_string(),
                why: format!(
                    "{} bytes, more than the {max} expected at most",
                    r.meta.size
                ),
            });
        }
        let b = r
            .bytes()
            .await
            .map_err(|e| self.store_err("cannot read", key, e))?;
        Ok(b.to_vec())
    }

    async fn has_chunk(&self, hash: &str) -> Result<bool, BlobError> {
        if self
            .known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(hash)
        {
            return Ok(true);
        }
        let key = format!("chunks/{hash}");
        match self.store.head(&self.path(&key)).await {
            Ok(_) => {
                self.remember(hash);
                Ok(true)
            }
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.store_err("cannot look up", &key, e)),
        }
    }

    fn remember(&self, hash: &str) {
        self.known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(hash.to_string());
    }

    /// Stores the files `(name in the bundle, local path)` as a bundle of `kind` with
    /// `meta`; returns its hash and what was moved.
    pub fn put_bundle(
        &self,
        kind: &str,
        files: &[(String, PathBuf)],
        meta: serde_json::Value,
    ) -> Result<(String, Moved), BlobError> {
        let mut bundle = Bundle {
            format: BUNDLE_FORMAT,
            kind: kind.to_string(),
            files: Vec::new(),
            meta,
        };
        let mut moved = Moved::default();
        for (name, path) in files {
            check_name(name).map_err(|why| BlobError::Corrupt {
                key: name.clone(),
                why,
            })?;
            let (f, m) = self.rt.block_on(self.put_file(name, path))?;
            moved.add(m);
            bundle.files.push(f);
        }
        let json = serde_json::to_vec(&bundle).map_err(|e| BlobError::Corrupt {
            key: kind.to_string(),
            why: e.to_string(),
        })?;
        let hash = sha256_hex(&json);
        moved.bytes_moved += json.len() as u64;
        self.put(&format!("bundles/{hash}"), json)?;
        Ok((hash, moved))
    }

    async fn put_file(&self, name: &str, path: &Path) -> Result<(BundleFile, Moved), BlobError> {
        let file = File::open(path).map_err(io_err("cannot open", path))?;
        let len = file.metadata().map_err(io_err("cannot stat", path))?.len();
        let windows = data_windows(&file, len).map_err(io_err("cannot map the data of", path))?;
        let file = Arc::new(file);
        let results: Vec<Option<(ChunkRef, u64)>> = futures_util::stream::iter(windows)
            .map(|at| {
                let file = file.clone();
                async move {
                    let n = CHUNK.min(len - at);
                    let mut buf = vec![0u8; n as usize];
                    file.read_exact_at(&mut buf, at)
                        .map_err(io_err("cannot read", path))?;
                    if buf.iter().all(|&b| b == 0) {
                        return Ok::<_, BlobError>(None);
                    }
                    let hash = sha256_hex(&buf);
                    let mut sent = 0;
                    if !self.has_chunk(&hash).await? {
                        let z = zstd::bulk::compress(&buf, ZSTD_LEVEL)
                            .map_err(io_err("cannot compress a chunk of", path))?;
                        sent = z.len() as u64;
                        self.put_async(&format!("chunks/{hash}"), z).await?;
                        self.remember(&hash);
                    }
                    Ok(Some((
                        ChunkRef {
                            at,
                            len: n,
                            sha256: hash,
                        },
                        sent,
                    )))
                }
            })
            .buffered(PARALLEL)
            .try_collect()
            .await?;
        let mut moved = Moved::default();
        let mut chunks = Vec::new();
        for (c, sent) in results.into_iter().flatten() {
            moved.data += c.len;
            moved.chunks += 1;
            if sent > 0 {
                moved.chunks_moved += 1;
                moved.bytes_moved += sent;
            }
            chunks.push(c);
        }
        Ok((
            BundleFile {
                name: name.to_string(),
                len,
                chunks,
            },
            moved,
        ))
    }

    /// Reads and checks bundle `hash`.
    pub fn get_bundle(&self, hash: &str) -> Result<Bundle, BlobError> {
        let key = format!("bundles/{hash}");
        if !is_sha256(hash) {
            return Err(BlobError::Corrupt {
                key,
                why: "not a SHA-256 name".into(),
            });
        }
        let bytes = self
            .get(&key, MAX_MANIFEST)?
            .ok_or_else(|| BlobError::Missing {
                store: self.url.clone(),
                key: key.clone(),
            })?;
        let got = sha256_hex(&bytes);
        if got != hash {
            return Err(BlobError::Corrupt {
                key,
                why: format!("its contents hash to {got}"),
            });
        }
        let b: Bundle = serde_json::from_slice(&bytes).map_err(|e| BlobError::Corrupt {
            key: key.clone(),
            why: e.to_string(),
        })?;
        b.check(&key)?;
        Ok(b)
    }

    /// Writes `f` of a bundle to `dest` (through a temporary name beside it; sparse: zero
    /// pages are not written). Every chunk is checked against its hash.
    pub fn get_file(&self, f: &BundleFile, dest: &Path) -> Result<Moved, BlobError> {
        let tmp = dest.with_file_name(format!(
            ".{}.part-{}",
            dest.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            std::process::id()
        ));
        let r = self.rt.block_on(self.get_file_async(f, &tmp));
        match r {
            Ok(m) => {
                std::fs::rename(&tmp, dest).map_err(io_err("cannot rename into", dest))?;
                Ok(m)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    async fn get_file_async(&self, f: &BundleFile, tmp: &Path) -> Result<Moved, BlobError> {
        let out = File::create(tmp).map_err(io_err("cannot create", tmp))?;
        out.set_len(f.len).map_err(io_err("cannot size", tmp))?;
        let out = Arc::new(out);
        let got: Vec<u64> = futures_util::stream::iter(f.chunks.iter())
            .map(|c| {
                let out = out.clone();
                async move {
                    let key = format!("chunks/{}", c.sha256);
                    let z = self.get_async(&key, (CHUNK as usize) * 2).await?;
                    let n = z.len() as u64;
                    let data = zstd::bulk::decompress(&z, c.len as usize).map_err(|e| {
                        BlobError::Corrupt {
                            key: key.clone(),
                            why: format!("does not decompress: {e}"),
                        }
                    })?;
                    if data.len() as u64 != c.len {
                        return Err(BlobError::Corrupt {
                            key,
                            why: format!("{} bytes, the manifest says {}", data.len(), c.len),
                        });
                    }
                    let h = sha256_hex(&data);
                    if h != c.sha256 {
                        return Err(BlobError::Corrupt {
                            key,
                            why: format!("its bytes hash to {h}"),
                        });
                    }
                    write_sparse(&out, c.at, &data).map_err(io_err("cannot write", tmp))?;
                    // It is in the store: an upload of the same bytes need not ask.
                    self.remember(&c.sha256);
                    Ok(n)
                }
            })
            .buffer_unordered(PARALLEL)
            .try_collect()
            .await?;
        out.sync_all().map_err(io_err("cannot sync", tmp))?;
        Ok(Moved {
            data: f.chunks.iter().map(|c| c.len).sum(),
            chunks: f.chunks.len() as u64,
            chunks_moved: got.len() as u64,
            bytes_moved: got.iter().sum(),
        })
    }

    /// Writes `f`'s bytes, in order, to `out` (holes as zeros); every chunk is checked.
    /// Returns the length.
    pub fn read_file(
        &self,
        f: &BundleFile,
        out: &mut dyn std::io::Write,
    ) -> Result<u64, BlobError> {
        let mut at = 0u64;
        let zeros = vec![0u8; 64 << 10];
        let pad = |out: &mut dyn std::io::Write, mut n: u64| -> Result<(), BlobError> {
            while n > 0 {
                let k = n.min(zeros.len() as u64) as usize;
                out.write_all(&zeros[..k])
                    .map_err(io_err("cannot send", Path::new(&f.name)))?;
                n -= k as u64;
            }
            Ok(())
        };
        for c in &f.chunks {
            pad(out, c.at - at)?;
            let key = format!("chunks/{}", c.sha256);
            let z = self
                .rt
                .block_on(self.get_async(&key, (CHUNK as usize) * 2))?;
            let data =
                zstd::bulk::decompress(&z, c.len as usize).map_err(|e| BlobError::Corrupt {
                    key: key.clone(),
                    why: format!("does not decompress: {e}"),
                })?;
            if data.len() as u64 != c.len || sha256_hex(&data) != c.sha256 {
                return Err(BlobError::Corrupt {
                    key,
                    why: "its bytes are not what the manifest says".into(),
                });
            }
            out.write_all(&data)
                .map_err(io_err("cannot send", Path::new(&f.name)))?;
            at = c.at + c.len;
        }
        pad(out, f.len - at)?;
        Ok(f.len)
    }

    /// Writes every file of `bundle` into directory `dir` (made if absent).
    pub fn get_files(&self, bundle: &Bundle, dir: &Path) -> Result<Moved, BlobError> {
        let mut moved = Moved::default();
        for f in &bundle.files {
            let dest = dir.join(&f.name);
            if let Some(parent) = dest.parent() {
                std::fs::create_dir_all(parent).map_err(io_err("cannot create", parent))?;
            }
            moved.add(self.get_file(f, &dest)?);
        }
        Ok(moved)
    }
}

/// The [`CHUNK`]-aligned offsets of `file`'s windows that hold data (by `SEEK_DATA` and
/// `SEEK_HOLE`; a file system without them reports one data extent: every window).
fn data_windows(file: &File, len: u64) -> std::io::Result<Vec<u64>> {
    let fd = file.as_raw_fd();
    let mut out: Vec<u64> = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: lseek on a descriptor we own; no memory is touched.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after pos
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let first = data as u64 / CHUNK;
        let last = (hole as u64).div_ceil(CHUNK);
        for w in first..last {
            if out.last() != Some(&(w * CHUNK)) {
                out.push(w * CHUNK);
            }
        }
        pos = hole;
    }
    Ok(out)
}

/// Writes `data` at `at`, leaving 4 KiB pages of zeros as holes.
fn write_sparse(out: &File, at: u64, data: &[u8]) -> std::io::Result<()> {
    const PAGE: usize = 4096;
    let mut i = 0;
    while i < data.len() {
        // A run of non-zero pages, written at once.
        let start = i;
        while i < data.len() && !is_zero(&data[i..(i + PAGE).min(data.len())]) {
            i = (i + PAGE).min(data.len());
        }
        if i > start {
            out.write_all_at(&data[start..i], at + start as u64)?;
        }
        while i < data.len() && is_zero(&data[i..(i + PAGE).min(data.len())]) {
            i = (i + PAGE).min(data.len());
        }
    }
    Ok(())
}

fn is_zero(b: &[u8]) -> bool {
    b.iter().all(|&x| x == 0)
}

/// Reads a whole small local file (records, pointers).
pub fn read_small(path: &Path) -> Result<Vec<u8>, BlobError> {
    let mut f = File::open(path).map_err(io_err("cannot open", path))?;
    let mut v = Vec::new();
    f.read_to_end(&mut v).map_err(io_err("cannot read", path))?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempdir::Dir, Blobs) {
        let d = tempdir::Dir::new("blobs");
        let b = Blobs::open(&format!("file://{}", d.0.join("store").display())).unwrap();
        (d, b)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new(tag: &str) -> Dir {
                let p = std::env::temp_dir()
                    .join(format!("ember-{tag}-{}", ember_runtime::paths::random_id()));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    /// A sparse file: 64 MiB long, data at 1 MiB (8 KiB), at 20 MiB (5 MiB, crossing a
    /// chunk boundary) and 4 KiB of zeros written at 40 MiB.
    fn sparse(path: &Path) {
        let f = File::create(path).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&[7u8; 8192], 1 << 20).unwrap();
        let big: Vec<u8> = (0..5 << 20).map(|i| (i % 251) as u8).collect();
        f.write_all_at(&big, 20 << 20).unwrap();
        f.write_all_at(&[0u8; 4096], 40 << 20).unwrap();
    }

    #[test]
    fn a_sparse_file_round_trips_and_only_its_data_is_stored() {
        let (d, b) = store();
        let src = d.0.join("mem");
        sparse(&src);
        let (hash, moved) = b
            .put_bundle(
                "test",
                &[("a/mem".into(), src.clone())],
                serde_json::json!({"x": 1}),
            )
            .unwrap();
        // Chunks 0 (1 MiB), 4 and 5 (20-25 MiB); the zeros at 40 MiB are not stored.
        assert_eq!(moved.chunks, 3, "{moved:?}");
        assert_eq!(moved.chunks_moved, 3);
        assert!(moved.bytes_moved < 2 << 20, "compressed: {moved:?}");
        let bundle = b.get_bundle(&hash).unwrap();
        assert_eq!(bundle.meta["x"], 1);
        let out = d.0.join("out");
        b.get_files(&bundle, &out).unwrap();
        let (x, y) = (
            std::fs::read(&src).unwrap(),
            std::fs::read(out.join("a/mem")).unwrap(),
        );
        assert!(x == y, "contents differ");
        // Still sparse: far fewer blocks than its length.
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(out.join("a/mem")).unwrap();
        assert!(
            m.blocks() * 512 < 16 << 20,
            "{} bytes allocated",
            m.blocks() * 512
        );
        // Storing it again moves nothing but the manifest.
        let (hash2, again) = b
            .put_bundle(
                "test",
                &[("a/mem".into(), src)],
                serde_json::json!({"x": 1}),
            )
            .unwrap();
        assert_eq!(hash, hash2);
        assert_eq!(again.chunks_moved, 0, "{again:?}");
    }

    #[test]
    fn corrupt_chunks_and_hostile_manifests_are_refused_by_name() {
        let (d, b) = store();
        let src = d.0.join("f");
        std::fs::write(&src, b"hello world").unwrap();
        let (hash, _) = b
            .put_bundle("test", &[("f".into(), src)], serde_json::Value::Null)
            .unwrap();
        let bundle = b.get_bundle(&hash).unwrap();
        // A chunk whose bytes were swapped for others (validly compressed).
        let c = &bundle.files[0].chunks[0];
        b.put(
            &format!("chunks/{}", c.sha256),
            zstd::bulk::compress(b"HELLO WORLD", 1).unwrap(),
        )
        .unwrap();
        let b2 = Blobs::open(b.url()).unwrap();
        let e = b2.get_files(&bundle, &d.0.join("out")).unwrap_err();
        assert!(matches!(e, BlobError::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains(&c.sha256), "{e}");
        assert!(!d.0.join("out/f").exists(), "a corrupt file was left");
        // A manifest that is not what its name says.
        let fake = "0".repeat(64);
        b.put(&format!("bundles/{fake}"), b"{}".to_vec()).unwrap();
        let e = b.get_bundle(&fake).unwrap_err();
        assert!(e.to_string().contains("hash to"), "{e}");
        // Hostile names and offsets.
        for (name, at, len, flen) in [
            ("../../etc/passwd", 0, 1, 1),
            ("/abs", 0, 1, 1),
            ("ok", 0, 10, 5),
            ("ok", 1, 1, 10),
        ] {
            let m = Bundle {
                format: BUNDLE_FORMAT,
                kind: "x".into(),
                files: vec![BundleFile {
                    name: name.into(),
                    len: flen,
                    chunks: vec![ChunkRef {
                        at,
                        len,
                        sha256: "a".repeat(64),
                    }],
                }],
                meta: serde_json::Value::Null,
            };
            let json = serde_json::to_vec(&m).unwrap();
            let h = sha256_hex(&json);
            b.put(&format!("bundles/{h}"), json).unwrap();
            let e = b.get_bundle(&h).unwrap_err();
            assert!(matches!(e, BlobError::Corrupt { .. }), "{name}: {e}");
        }
        assert!(matches!(
            b.get_bundle(&"1".repeat(64)).unwrap_err(),
            BlobError::Missing { .. }
        ));
    }

    #[test]
    fn urls_are_checked() {
        for bad in ["", "http://x", "s3://", "file://relative"] {
            assert!(
                matches!(Blobs::open(bad), Err(BlobError::BadUrl { .. })),
                "{bad:?} accepted"
            );
        }
    }
}
