//! The layer unpacker: tar layers (plain, gzip or zstd) applied in order to a directory on the
//! host, with nothing ever written or followed outside it.
//!
//! Every path is resolved by the kernel: the parent directory of each entry is opened with
//! `openat2(root, parent, O_PATH | O_DIRECTORY, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS |
//! RESOLVE_NO_XDEV)` — symlinks in the path (the image's own, absolute or relative, and `..`
//! in them) are followed *as the guest will see them*, clamped at the tree's root, so a
//! symlink to `/etc` followed by a write through it lands in the tree's `etc/`, never the
//! host's. The last component is never followed (`O_NOFOLLOW`, `*at` calls on one name).
//!
//! Entry by entry:
//! - a name with `..` or an absolute name is **refused** (no image builder writes one);
//! - whiteouts (`.wh.NAME`: remove NAME from the layers below; `.wh..wh..opq`: the directory
//!   is opaque, everything below from earlier layers goes) are applied in order and never
//!   written;
//! - hard links are made with `linkat` between two names resolved in the tree (a target
//!   outside the tree cannot be named), never to a directory;
//! - character and block devices and FIFOs are **dropped** (counted in the report): the
//!   guest's `/dev` is a devtmpfs, and a device node in a read-only image is either useless
//!   or a way to reach hardware the sandbox should not;
//! - setuid and setgid bits on files are **cleared** and `security.capability` xattrs dropped
//!   (counted and named in the report): code in a sandbox runs as root or `user` by choice,
//!   not by the image's say-so; directories keep setgid and sticky;
//! - ownership (numeric uid/gid, PAX overrides included), modes and mtimes are kept, and
//!   `user.*` xattrs; other xattrs (`trusted.*`, `security.*`, ACLs) are dropped;
//! - caps ([`Limits`]): entries, one file's apparent size (checked from the header before any
//!   byte is written: a 10 GiB sparse file fails at once), total bytes expanded; all-zero
//!   blocks are written as holes;
//! - each layer's uncompressed bytes must hash to its `diff_id`.
//!
//! The caller unpacks into a fresh directory and discards it on any error.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags, Timespec, Timestamps, XattrFlags};
use rustix::io::Errno;
use sha2::{Digest as _, Sha256};

use crate::spec::Digest;
use crate::store::BlobStore;
use crate::{io_err, Layer, OciError, Progress};

/// Caps on what a set of layers may expand to.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Bytes of file content, all layers together.
    pub total_bytes: u64,
    /// Entries (files, directories, links, whiteouts), all layers together.
    pub entries: u64,
    /// One file's apparent size.
    pub file_bytes: u64,
    /// Keep the entries' uid/gid (needs root; off: everything is owned by the caller).
    pub owners: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            total_bytes: 16 << 30,
            entries: 1_000_000,
            file_bytes: 4 << 30,
            owners: rustix::process::geteuid().is_root(),
        }
    }
}

impl Limits {
    /// The defaults, each overridable by the environment: `EMBER_IMAGE_MAX_BYTES`,
    /// `EMBER_IMAGE_MAX_ENTRIES`, `EMBER_IMAGE_MAX_FILE_BYTES` (integers; a value that is not
    /// one is an error naming it).
    pub fn from_env() -> Result<Limits, String> {
        let mut l = Limits::default();
        for (var, field) in [
            ("EMBER_IMAGE_MAX_BYTES", &mut l.total_bytes),
            ("EMBER_IMAGE_MAX_ENTRIES", &mut l.entries),
            ("EMBER_IMAGE_MAX_FILE_BYTES", &mut l.file_bytes),
        ] {
            if let Ok(v) = std::env::var(var) {
                *field = v
                    .trim()
                    .parse()
                    .map_err(|_| format!("{var}={v:?} is not a number of bytes or entries"))?;
            }
        }
        Ok(l)
    }
}

/// What an unpack did besides writing the tree.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct UnpackReport {
    /// Entries read (all layers).
    pub entries: u64,
    /// Bytes of file content written (apparent).
    pub bytes: u64,
    /// Files whose setuid/setgid bits were cleared (first 20 names).
    pub setid_cleared: Vec<String>,
    /// How many in all.
    pub setid_cleared_count: u64,
    /// Device nodes and FIFOs dropped.
    pub devices_dropped: u64,
    /// `security.capability` xattrs dropped.
    pub capabilities_dropped: u64,
    /// Other non-`user.` xattrs dropped.
    pub xattrs_dropped: u64,
    /// Whiteouts applied.
    pub whiteouts: u64,
}

impl UnpackReport {
    /// One line per thing neutralised, for the build log.
    pub fn notes(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.setid_cleared_count > 0 {
            out.push(format!(
                "cleared setuid/setgid bits on {} file(s): {}{}",
                self.setid_cleared_count,
                self.setid_cleared.join(", "),
                if self.setid_cleared_count > self.setid_cleared.len() as u64 {
                    ", ..."
                } else {
                    ""
                }
            ));
        }
        if self.devices_dropped > 0 {
            out.push(format!(
                "dropped {} device node(s)/FIFO(s) (the guest's /dev is a devtmpfs)",
                self.devices_dropped
            ));
        }
        if self.capabilities_dropped > 0 {
            out.push(format!(
                "dropped {} file capability xattr(s) (security.capability)",
                self.capabilities_dropped
            ));
        }
        if self.xattrs_dropped > 0 {
            out.push(format!(
                "dropped {} xattr(s) outside user.*",
                self.xattrs_dropped
            ));
        }
        out
    }
}

/// Unpacks `layers` (blobs in `store`) in order into `dest`, which must be an empty directory.
pub fn unpack_layers(
    store: &BlobStore,
    layers: &[Layer],
    dest: &Path,
    limits: &Limits,
    progress: Progress,
) -> Result<UnpackReport, OciError> {
    let mut u = Unpacker::open(dest, *limits)?;
    for (i, l) in layers.iter().enumerate() {
        let name = format!(
            "{}/{} ({})",
            i + 1,
            layers.len(),
            crate::source::short(&l.digest)
        );
        progress(format!("unpacking layer {name}"));
        let path = store.path(&l.digest);
        let f = File::open(&path).map_err(io_err("cannot open layer blob", &path))?;
        u.layer(&name, f, Some(&l.diff_id))?;
    }
    Ok(u.report)
}

/// An unpack in progress (one tree; layers applied with [`Unpacker::layer`]).
#[derive(Debug)]
pub struct Unpacker {
    root: OwnedFd,
    limits: Limits,
    /// What has been done so far.
    pub report: UnpackReport,
}

const RESOLVE: ResolveFlags = ResolveFlags::IN_ROOT
    .union(ResolveFlags::NO_MAGICLINKS)
    .union(ResolveFlags::NO_XDEV);

/// Reads through to a hasher and counts, refusing to expand past a cap.
struct Counting<R> {
    inner: R,
    hash: Sha256,
    n: u64,
    max: u64,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        self.n += n as u64;
        if self.n > self.max {
            return Err(io::Error::other(format!(
                "the layer expands past {} bytes (a decompression bomb?)",
                self.max
            )));
        }
        Ok(n)
    }
}

impl Unpacker {
    /// Starts an unpack into `dest` (an existing, empty directory).
    pub fn open(dest: &Path, limits: Limits) -> Result<Unpacker, OciError> {
        let root = rustix::fs::open(
            dest,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| OciError::Io {
            what: "cannot open",
            path: dest.into(),
            source: e.into(),
        })?;
        Ok(Unpacker {
            root,
            limits,
            report: UnpackReport::default(),
        })
    }

    /// Applies one layer (plain tar, gzip or zstd, sniffed), checking its uncompressed digest
    /// against `diff_id` when given.
    pub fn layer(
        &mut self,
        name: &str,
        blob: impl Read,
        diff_id: Option<&Digest>,
    ) -> Result<(), OciError> {
        let read_err = |e: io::Error| OciError::Refused {
            layer: name.into(),
            entry: String::new(),
            message: format!("cannot read the layer: {e}"),
        };
        let mut buf = BufReader::with_capacity(1 << 20, blob);
        let head = buf.fill_buf().map_err(read_err)?.to_vec();
        let stream: Box<dyn Read> = if head.starts_with(&[0x1f, 0x8b]) {
            Box::new(flate2::read::MultiGzDecoder::new(buf))
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Box::new(zstd::stream::read::Decoder::with_buffer(buf).map_err(read_err)?)
        } else {
            Box::new(buf)
        };
        // A tar adds at most ~1 KiB per entry on top of the content.
        let max = self
            .limits
            .total_bytes
            .saturating_sub(self.report.bytes)
            .saturating_add(self.limits.entries.saturating_mul(1536));
        let mut counting = Counting {
            inner: stream,
            hash: Sha256::new(),
            n: 0,
            max,
        };
        {
            let mut ar = tar::Archive::new(&mut counting);
            let mut this_layer: HashSet<Vec<u8>> = HashSet::new();
            let entries = ar.entries().map_err(read_err)?;
            for e in entries {
                let e = e.map_err(|e| self.too_large_or(name, e))?;
                self.report.entries += 1;
                if self.report.entries > self.limits.entries {
                    return Err(OciError::TooLarge {
                        layer: name.into(),
                        message: format!(
                            "more than {} entries in the image (a tar bomb?)",
                            self.limits.entries
                        ),
                    });
                }
                self.entry(name, e, &mut this_layer)?;
            }
        }
        io::copy(&mut counting, &mut io::sink()).map_err(read_err)?;
        if let Some(want) = diff_id {
            let got = Digest::from_hasher(counting.hash);
            if &got != want {
                return Err(OciError::DigestMismatch {
                    what: format!("layer {name} (uncompressed, against the config's diff_id)"),
                    expected: want.to_string(),
                    actual: got.to_string(),
                });
            }
        }
        Ok(())
    }

    fn too_large_or(&self, layer: &str, e: io::Error) -> OciError {
        OciError::Refused {
            layer: layer.into(),
            entry: String::new(),
            message: format!("not a valid tar stream: {e}"),
        }
    }

    fn entry<R: Read>(
        &mut self,
        layer: &str,
        mut e: tar::Entry<R>,
        this_layer: &mut HashSet<Vec<u8>>,
    ) -> Result<(), OciError> {
        let raw = e.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&raw).into_owned();
        let refuse = |message: String| OciError::Refused {
            layer: layer.into(),
            entry: shown.clone(),
            message,
        };
        let comps = split(&raw).map_err(&refuse)?;
        let kind = e.header().entry_type();
        let Some((last, parents)) = comps.split_last() else {
            return Ok(()); // the root itself ("./"): its metadata stays ours
        };
        let sys = |what: &str, err: Errno| refuse(format!("{what}: {}", describe(err)));

        // Whiteouts.
        if let Some(hidden) = last.as_bytes().strip_prefix(b".wh.") {
            self.report.whiteouts += 1;
            let parent = match self.open_dir(parents, false) {
                Ok(p) => p,
                Err(Errno::NOENT) => return Ok(()),
                Err(err) => return Err(sys("cannot open its directory", err)),
            };
            if hidden == b".wh..opq" {
                let prefix = join(parents);
                clear_dir(&parent, &prefix, this_layer)
                    .map_err(|err| sys("cannot clear the opaque directory", err))?;
            } else {
                if hidden.is_empty() || hidden == b"." || hidden == b".." {
                    return Err(refuse("a whiteout without a name".into()));
                }
                remove_all(&parent, OsStr::from_bytes(hidden))
                    .map_err(|err| sys("cannot apply the whiteout", err))?;
            }
            return Ok(());
        }
        this_layer.insert(join(&comps));

        if matches!(
            kind,
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo
        ) {
            self.report.devices_dropped += 1;
            return Ok(());
        }
        let header_mode = e
            .header()
            .mode()
            .map_err(|err| refuse(format!("bad mode: {err}")))?;
        let (uid, gid) = owner(&mut e).map_err(|err| refuse(format!("bad owner: {err}")))?;
        let mtime = e.header().mtime().unwrap_or(0);
        let xattrs = self.xattrs(&mut e);
        let parent = self
            .open_dir(parents, true)
            .map_err(|err| sys("cannot open or create its directory", err))?;
        let existing = rustix::fs::statat(&parent, *last, AtFlags::SYMLINK_NOFOLLOW).ok();
        let existing_is_dir = existing
            .as_ref()
            .is_some_and(|s| s.st_mode & libc::S_IFMT == libc::S_IFDIR);

        match kind {
            tar::EntryType::Directory => {
                if existing.is_some() && !existing_is_dir {
                    remove_all(&parent, last).map_err(|err| sys("cannot replace", err))?;
                }
                if !existing_is_dir {
                    match rustix::fs::mkdirat(&parent, *last, Mode::from_raw_mode(0o700)) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(err) => return Err(sys("cannot create the directory", err)),
                    }
                }
                let fd = rustix::fs::openat(
                    &parent,
                    *last,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|err| sys("cannot open the directory", err))?;
                self.set_meta(&fd, uid, gid, header_mode & 0o3777, &xattrs, None)
                    .map_err(|err| sys("cannot set its metadata", err))?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                let size = e.size();
                if size > self.limits.file_bytes {
                    return Err(OciError::TooLarge {
                        layer: layer.into(),
                        message: format!(
                            "entry {shown:?} is {size} bytes, over the cap of {} for one file",
                            self.limits.file_bytes
                        ),
                    });
                }
                if self.report.bytes + size > self.limits.total_bytes {
                    return Err(OciError::TooLarge {
                        layer: layer.into(),
                        message: format!(
                            "the image expands past {} bytes (at {shown:?})",
                            self.limits.total_bytes
                        ),
                    });
                }
                if existing.is_some() {
                    remove_all(&parent, last).map_err(|err| sys("cannot replace", err))?;
                }
                let fd = rustix::fs::openat(
                    &parent,
                    *last,
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(|err| sys("cannot create the file", err))?;
                let mut f = File::from(fd);
                let written = copy_sparse(&mut e, &mut f, size)
                    .map_err(|err| refuse(format!("cannot write the file: {err}")))?;
                self.report.bytes += written;
                let mut mode = header_mode & 0o7777;
                if mode & 0o6000 != 0 {
                    mode &= !0o6000;
                    self.report.setid_cleared_count += 1;
                    if self.report.setid_cleared.len() < 20 {
                        self.report
                            .setid_cleared
                            .push(format!("/{}", String::from_utf8_lossy(&join(&comps))));
                    }
                }
                self.set_meta(f.as_fd(), uid, gid, mode, &xattrs, Some(mtime))
                    .map_err(|err| sys("cannot set its metadata", err))?;
            }
            tar::EntryType::Symlink => {
                let target = e
                    .link_name_bytes()
                    .ok_or_else(|| refuse("a symlink without a target".into()))?
                    .into_owned();
                if target.is_empty() || target.len() > 4095 {
                    return Err(refuse(
                        "a symlink target that is empty or longer than 4095 bytes".into(),
                    ));
                }
                if existing.is_some() {
                    remove_all(&parent, last).map_err(|err| sys("cannot replace", err))?;
                }
                rustix::fs::symlinkat(OsStr::from_bytes(&target), &parent, *last)
                    .map_err(|err| sys("cannot create the symlink", err))?;
                if self.limits.owners {
                    rustix::fs::chownat(
                        &parent,
                        *last,
                        Some(uid_of(uid)),
                        Some(gid_of(gid)),
                        AtFlags::SYMLINK_NOFOLLOW,
                    )
                    .map_err(|err| sys("cannot set its owner", err))?;
                }
            }
            tar::EntryType::Link => {
                let target = e
                    .link_name_bytes()
                    .ok_or_else(|| refuse("a hard link without a target".into()))?
                    .into_owned();
                let tcomps =
                    split(&target).map_err(|m| refuse(format!("hard link target: {m}")))?;
                let Some((tlast, tparents)) = tcomps.split_last() else {
                    return Err(refuse("a hard link to the root directory".into()));
                };
                let tparent = self
                    .open_dir(tparents, false)
                    .map_err(|err| sys("hard link target's directory", err))?;
                let tstat = rustix::fs::statat(&tparent, *tlast, AtFlags::SYMLINK_NOFOLLOW)
                    .map_err(|err| sys("hard link target", err))?;
                if tstat.st_mode & libc::S_IFMT == libc::S_IFDIR {
                    return Err(refuse("a hard link to a directory".into()));
                }
                if let Some(s) = &existing {
                    if s.st_ino == tstat.st_ino && s.st_dev == tstat.st_dev {
                        return Ok(());
                    }
                    remove_all(&parent, last).map_err(|err| sys("cannot replace", err))?;
                }
                rustix::fs::linkat(&tparent, *tlast, &parent, *last, AtFlags::empty())
                    .map_err(|err| sys("cannot create the hard link", err))?;
            }
            tar::EntryType::XGlobalHeader
            | tar::EntryType::XHeader
            | tar::EntryType::GNULongName
            | tar::EntryType::GNULongLink => {}
            other => return Err(refuse(format!("unsupported entry type {other:?}"))),
        }
        Ok(())
    }

    fn xattrs<R: Read>(&mut self, e: &mut tar::Entry<R>) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut out = Vec::new();
        let Ok(Some(exts)) = e.pax_extensions() else {
            return out;
        };
        for ext in exts.flatten() {
            let Some(name) = ext.key_bytes().strip_prefix(b"SCHILY.xattr.") else {
                continue;
            };
            if name.starts_with(b"user.") {
                out.push((name.to_vec(), ext.value_bytes().to_vec()));
            } else if name == b"security.capability" {
                self.report.capabilities_dropped += 1;
            } else {
                self.report.xattrs_dropped += 1;
            }
        }
        out
    }

    fn set_meta(
        &self,
        fd: impl AsFd,
        uid: u64,
        gid: u64,
        mode: u32,
        xattrs: &[(Vec<u8>, Vec<u8>)],
        mtime: Option<u64>,
    ) -> Result<(), Errno> {
        if self.limits.owners {
            rustix::fs::fchown(&fd, Some(uid_of(uid)), Some(gid_of(gid)))?;
        }
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
        for (k, v) in xattrs {
            match rustix::fs::fsetxattr(&fd, OsStr::from_bytes(k), v, XattrFlags::empty()) {
                Ok(()) | Err(Errno::OPNOTSUPP) => {}
                Err(e) => return Err(e),
            }
        }
        if let Some(t) = mtime {
            let ts = Timespec {
                tv_sec: t.min(i64::MAX as u64) as i64,
                tv_nsec: 0,
            };
            rustix::fs::futimens(
                &fd,
                &Timestamps {
                    last_access: ts,
                    last_modification: ts,
                },
            )?;
        }
        Ok(())
    }

    /// Opens (creating when `create`) the directory `comps` under the root, every component
    /// resolved in the root.
    pub(crate) fn open_dir(&self, comps: &[&OsStr], create: bool) -> Result<OwnedFd, Errno> {
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let whole = join(comps);
        let path = if whole.is_empty() {
            b".".to_vec()
        } else {
            whole
        };
        match rustix::fs::openat2(
            &self.root,
            OsStr::from_bytes(&path),
            flags,
            Mode::empty(),
            RESOLVE,
        ) {
            Err(Errno::NOENT) if create => {}
            other => return other,
        }
        let mut fd = rustix::fs::openat2(&self.root, ".", flags, Mode::empty(), RESOLVE)?;
        for i in 0..comps.len() {
            let prefix = join(&comps[..=i]);
            fd = match rustix::fs::openat2(
                &self.root,
                OsStr::from_bytes(&prefix),
                flags,
                Mode::empty(),
                RESOLVE,
            ) {
                Ok(f) => f,
                Err(Errno::NOENT) => {
                    match rustix::fs::mkdirat(&fd, comps[i], Mode::from_raw_mode(0o755)) {
                        Ok(()) => {}
                        // A dangling symlink (its target is not in the image).
                        Err(Errno::EXIST) => return Err(Errno::NOLINK),
                        Err(e) => return Err(e),
                    }
                    rustix::fs::openat2(
                        &self.root,
                        OsStr::from_bytes(&prefix),
                        flags,
                        Mode::empty(),
                        RESOLVE,
                    )?
                }
                Err(e) => return Err(e),
            };
        }
        Ok(fd)
    }
}

fn uid_of(u: u64) -> rustix::fs::Uid {
    rustix::fs::Uid::from_raw(u.min(u32::MAX as u64 - 1) as u32)
}

fn gid_of(g: u64) -> rustix::fs::Gid {
    rustix::fs::Gid::from_raw(g.min(u32::MAX as u64 - 1) as u32)
}

/// uid and gid, PAX `uid`/`gid` first.
fn owner<R: Read>(e: &mut tar::Entry<R>) -> io::Result<(u64, u64)> {
    let mut uid = e.header().uid()?;
    let mut gid = e.header().gid()?;
    if let Ok(Some(exts)) = e.pax_extensions() {
        for ext in exts.flatten() {
            let parse = || {
                std::str::from_utf8(ext.value_bytes())
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
            };
            match ext.key_bytes() {
                b"uid" => uid = parse().unwrap_or(uid),
                b"gid" => gid = parse().unwrap_or(gid),
                _ => {}
            }
        }
    }
    Ok((uid, gid))
}

/// Copies `size` bytes, leaving all-zero 4 KiB blocks as holes. Returns the bytes written.
fn copy_sparse(r: &mut dyn Read, f: &mut File, size: u64) -> io::Result<u64> {
    let mut buf = vec![0u8; 1 << 16];
    let mut done = 0u64;
    while done < size {
        let want = ((size - done) as usize).min(buf.len());
        let n = r.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the layer ends inside the file",
            ));
        }
        for chunk in buf[..n].chunks(4096) {
            if chunk.iter().all(|&b| b == 0) {
                f.seek(SeekFrom::Current(chunk.len() as i64))?;
            } else {
                f.write_all(chunk)?;
            }
        }
        done += n as u64;
    }
    f.set_len(size)?;
    Ok(done)
}

/// A tar name split into components; `..` and absolute names are errors.
pub(crate) fn split(raw: &[u8]) -> Result<Vec<&OsStr>, String> {
    if raw.first() == Some(&b'/') {
        return Err("an absolute name (images name their files relative to the root)".into());
    }
    let mut out = Vec::new();
    for c in raw.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err("a '..' component (it would climb out of the image)".into()),
            c if c.len() > 255 => return Err("a name component longer than 255 bytes".into()),
            c => out.push(OsStr::from_bytes(c)),
        }
    }
    Ok(out)
}

fn join(comps: &[&OsStr]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, c) in comps.iter().enumerate() {
        if i > 0 {
            out.push(b'/');
        }
        out.extend_from_slice(c.as_bytes());
    }
    out
}

/// Removes `name` in `dir`, recursively when it is a directory (never following symlinks).
pub(crate) fn remove_all(dir: &OwnedFd, name: &OsStr) -> Result<(), Errno> {
    match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => return Ok(()),
        Err(Errno::ISDIR) | Err(Errno::PERM) => {}
        Err(e) => return Err(e),
    }
    let sub = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    clear_dir(&sub, &[], &HashSet::new())?;
    rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR)
}

/// Removes every entry of `dir` (at tree path `prefix`) except those in `keep`.
fn clear_dir(dir: &OwnedFd, prefix: &[u8], keep: &HashSet<Vec<u8>>) -> Result<(), Errno> {
    let fd = rustix::fs::openat(
        dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut names = Vec::new();
    for ent in rustix::fs::Dir::read_from(&fd)? {
        let ent = ent?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(n.to_vec());
        }
    }
    for n in names {
        if !keep.is_empty() {
            let mut full = prefix.to_vec();
            if !full.is_empty() {
                full.push(b'/');
            }
            full.extend_from_slice(&n);
            if keep.contains(&full) {
                continue;
            }
        }
        remove_all(&fd, OsStr::from_bytes(&n))?;
    }
    Ok(())
}

fn describe(e: Errno) -> String {
    match e {
        Errno::NOTDIR => "a component of its path is not a directory".into(),
        Errno::NOLINK => {
            "a component of its path is a symlink to a directory that does not exist in the image"
                .into()
        }
        Errno::XDEV => "its path crosses a mount point".into(),
        Errno::LOOP => "too many symlinks in its path".into(),
        Errno::NOSYS => {
            "openat2 is not available (ember needs Linux 5.6 or later to unpack images)".into()
        }
        e => io::Error::from(e).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// One raw tar entry (names written as given: the tar crate's builder refuses hostile ones).
    fn raw(name: &[u8], kind: tar::EntryType, data: &[u8], link: &[u8], mode: u32) -> Vec<u8> {
        let mut h = tar::Header::new_ustar();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.as_old_mut().linkname[..link.len()].copy_from_slice(link);
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(data.len() as u64);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        let mut out = h.as_bytes().to_vec();
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
        out
    }

    fn file(name: &str, data: &str) -> Vec<u8> {
        raw(
            name.as_bytes(),
            tar::EntryType::Regular,
            data.as_bytes(),
            b"",
            0o644,
        )
    }

    fn dir(name: &str) -> Vec<u8> {
        raw(name.as_bytes(), tar::EntryType::Directory, b"", b"", 0o755)
    }

    fn link(name: &str, target: &str, kind: tar::EntryType) -> Vec<u8> {
        raw(name.as_bytes(), kind, b"", target.as_bytes(), 0o777)
    }

    fn tar_of(entries: &[Vec<u8>]) -> Vec<u8> {
        let mut out: Vec<u8> = entries.concat();
        out.extend_from_slice(&[0u8; 1024]);
        out
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        tree: std::path::PathBuf,
        outside: std::path::PathBuf,
    }

    /// A tree to unpack into and, beside it, an "outside" directory with a canary file.
    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        let outside = dir.path().join("outside");
        std::fs::create_dir(&tree).unwrap();
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("canary"), "unchanged").unwrap();
        Fixture {
            _dir: dir,
            tree,
            outside,
        }
    }

    impl Fixture {
        fn unpacker(&self) -> Unpacker {
            Unpacker::open(
                &self.tree,
                Limits {
                    owners: false,
                    ..Limits::default()
                },
            )
            .unwrap()
        }

        fn outside_unchanged(&self) {
            let names: Vec<_> = std::fs::read_dir(&self.outside)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(names, vec![std::ffi::OsString::from("canary")]);
            assert_eq!(
                std::fs::read_to_string(self.outside.join("canary")).unwrap(),
                "unchanged"
            );
        }
    }

    #[test]
    fn layers_apply_in_order_with_links_and_whiteouts() {
        let fx = fixture();
        let mut u = fx.unpacker();
        let l1 = tar_of(&[
            dir("etc/"),
            file("etc/a", "one"),
            file("etc/b", "two"),
            dir("opt/"),
            file("opt/x", "x"),
            link("etc/link", "a", tar::EntryType::Symlink),
            link("etc/hard", "etc/a", tar::EntryType::Link),
            dir("usr/"),
            dir("usr/lib/"),
            link("lib", "usr/lib", tar::EntryType::Symlink),
            file("lib/libc.so", "elf"),
        ]);
        let d1 = Digest::of(&l1);
        u.layer("1", &l1[..], Some(&d1)).unwrap();
        // Layer 2: gzip; removes etc/b, makes opt opaque (keeping what this layer adds), rewrites a.
        let l2 = tar_of(&[
            file("opt/new", "n"),
            file("opt/.wh..wh..opq", ""),
            file("etc/.wh.b", ""),
            file("etc/a", "ONE"),
        ]);
        let d2 = Digest::of(&l2);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&l2).unwrap();
        u.layer("2", &gz.finish().unwrap()[..], Some(&d2)).unwrap();
        let t = &fx.tree;
        assert_eq!(std::fs::read_to_string(t.join("etc/a")).unwrap(), "ONE");
        assert!(!t.join("etc/b").exists());
        assert_eq!(
            std::fs::read_link(t.join("etc/link")).unwrap(),
            Path::new("a")
        );
        assert_eq!(
            std::fs::read_to_string(t.join("etc/hard")).unwrap(),
            "one",
            "the hard link kept the old inode"
        );
        assert!(!t.join("opt/x").exists() && t.join("opt/new").exists());
        assert_eq!(
            std::fs::read_to_string(t.join("usr/lib/libc.so")).unwrap(),
            "elf",
            "written through the in-tree symlink"
        );
        assert_eq!(u.report.whiteouts, 2);
        assert_eq!(
            std::fs::metadata(t.join("etc/a")).unwrap().mtime(),
            1_700_000_000
        );
    }

    #[test]
    fn zstd_layers_are_read() {
        let fx = fixture();
        let l = tar_of(&[file("z", "zstd")]);
        let blob = zstd::stream::encode_all(&l[..], 3).unwrap();
        fx.unpacker()
            .layer("1", &blob[..], Some(&Digest::of(&l)))
            .unwrap();
        assert_eq!(std::fs::read_to_string(fx.tree.join("z")).unwrap(), "zstd");
    }

    #[test]
    fn climbing_and_absolute_names_are_refused() {
        let fx = fixture();
        for name in [
            "../outside/pwned",
            "a/../../outside/pwned",
            "/tmp/pwned-by-oci-test",
        ] {
            let e = fx
                .unpacker()
                .layer("1", &tar_of(&[file(name, "x")])[..], None)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(name) && (e.contains("'..'") || e.contains("absolute")),
                "{e}"
            );
        }
        assert!(!Path::new("/tmp/pwned-by-oci-test").exists());
        fx.outside_unchanged();
    }

    #[test]
    fn a_symlink_out_then_a_write_through_it_stays_in_the_tree() {
        let fx = fixture();
        let out = fx.outside.to_str().unwrap();
        // Through a dangling symlink: refused, with the reason.
        let l = tar_of(&[
            link("abs", out, tar::EntryType::Symlink),
            file("abs/canary", "pwned"),
        ]);
        let e = fx
            .unpacker()
            .layer("1", &l[..], None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("symlink to a directory that does not exist"),
            "{e}"
        );
        fx.outside_unchanged();
        // Through a symlink whose target exists in the image: the write lands in the image.
        let mut dirs = Vec::new();
        let mut p = String::new();
        for c in out.trim_start_matches('/').split('/') {
            p = format!("{p}{c}/");
            dirs.push(dir(&p));
        }
        let l = tar_of(&[
            dirs.concat(),
            link("abs", out, tar::EntryType::Symlink),
            file("abs/canary", "pwned"),
            link("up", "../../../../../../..", tar::EntryType::Symlink),
            file(&format!("up{out}/pwned"), "pwned"),
            link("abs/chain", "../../..", tar::EntryType::Symlink),
        ]);
        fx.unpacker().layer("1", &l[..], None).unwrap();
        fx.outside_unchanged();
        // Both writes landed under the tree, at the path the guest would see.
        assert_eq!(
            std::fs::read_to_string(fx.tree.join(out.trim_start_matches('/')).join("canary"))
                .unwrap(),
            "pwned"
        );
        assert!(fx
            .tree
            .join(out.trim_start_matches('/'))
            .join("pwned")
            .exists());
    }

    #[test]
    fn hard_links_out_of_the_tree_are_refused() {
        let fx = fixture();
        let out = fx.outside.to_str().unwrap();
        let canary = format!("{out}/canary");
        for (target, why) in [("../outside/canary", "'..'"), (canary.as_str(), "absolute")] {
            let e = fx
                .unpacker()
                .layer(
                    "1",
                    &tar_of(&[link("h", target, tar::EntryType::Link)])[..],
                    None,
                )
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{e}");
        }
        // Through a symlink: resolved in the tree, where the target does not exist.
        let l = tar_of(&[
            link("o", out, tar::EntryType::Symlink),
            link("h", "o/canary", tar::EntryType::Link),
        ]);
        let e = fx
            .unpacker()
            .layer("1", &l[..], None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hard link target"), "{e}");
        assert_eq!(
            std::fs::metadata(fx.outside.join("canary"))
                .unwrap()
                .nlink(),
            1
        );
        fx.outside_unchanged();
    }

    #[test]
    fn devices_are_dropped_and_setid_bits_cleared() {
        let fx = fixture();
        let l = tar_of(&[
            raw(b"dev/sda", tar::EntryType::Block, b"", b"", 0o660),
            raw(b"dev/mem", tar::EntryType::Char, b"", b"", 0o660),
            raw(b"fifo", tar::EntryType::Fifo, b"", b"", 0o644),
            raw(b"bin/su", tar::EntryType::Regular, b"elf", b"", 0o6755),
        ]);
        let mut u = fx.unpacker();
        u.layer("1", &l[..], None).unwrap();
        assert_eq!(u.report.devices_dropped, 3);
        assert!(!fx.tree.join("dev/sda").exists() && !fx.tree.join("fifo").exists());
        assert_eq!(
            std::fs::metadata(fx.tree.join("bin/su"))
                .unwrap()
                .permissions()
                .mode()
                & 0o7777,
            0o755
        );
        assert_eq!(u.report.setid_cleared, vec!["/bin/su".to_string()]);
        assert!(u.report.notes().iter().any(|n| n.contains("setuid")));
    }

    #[test]
    fn size_and_count_caps_stop_sparse_files_and_tar_bombs() {
        let fx = fixture();
        // A 10 GiB file (header only): refused before a byte is written.
        let mut h = tar::Header::new_gnu();
        h.set_path("huge").unwrap();
        h.set_size(10 << 30);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_cksum();
        let e = fx
            .unpacker()
            .layer("1", &h.as_bytes()[..], None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("10737418240 bytes") && e.contains("cap"), "{e}");
        assert!(!fx.tree.join("huge").exists());
        // Entries.
        let many: Vec<Vec<u8>> = (0..50).map(|i| file(&format!("f{i}"), "")).collect();
        let mut u = Unpacker::open(
            &fx.tree,
            Limits {
                entries: 20,
                owners: false,
                ..Limits::default()
            },
        )
        .unwrap();
        let e = u
            .layer("1", &tar_of(&many)[..], None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 20 entries"), "{e}");
        // Total bytes (a gzip bomb: 64 MiB of zeros in a tiny blob).
        let big = tar_of(&[raw(
            b"z",
            tar::EntryType::Regular,
            &vec![0u8; 64 << 20],
            b"",
            0o644,
        )]);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&big).unwrap();
        let blob = gz.finish().unwrap();
        assert!(blob.len() < 1 << 20);
        let mut u = Unpacker::open(
            &fx.tree,
            Limits {
                total_bytes: 1 << 20,
                entries: 10,
                owners: false,
                ..Limits::default()
            },
        )
        .unwrap();
        let e = u.layer("1", &blob[..], None).unwrap_err().to_string();
        assert!(e.contains("expands past") || e.contains("cap"), "{e}");
    }

    #[test]
    fn a_layer_that_does_not_match_its_diff_id_is_refused() {
        let fx = fixture();
        let l = tar_of(&[file("a", "x")]);
        let wrong = Digest::of(b"something else");
        let e = fx.unpacker().layer("1", &l[..], Some(&wrong)).unwrap_err();
        assert!(matches!(e, OciError::DigestMismatch { .. }), "{e}");
    }
}
