//! File operations inside one volume's data directory, each resolved beneath it.
//!
//! Every path is checked by [`ember_agent::volume_wire::check_path`] and then opened with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` from the data
//! directory's descriptor: no `..`, no symlink (nothing can make one: the protocol has no
//! symlink call, and one placed on the host is refused, never followed), no escape.
//!
//! Writes go to a staging file beside the data (`staging/`, same filesystem) that [`Handle::commit`]
//! fsyncs and renames over the target: a reader sees the old or the new content, never a mix.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ember_agent::volume_wire::{check_path, Attr, Entry};

/// One volume's directories and its usage counter.
#[derive(Debug)]
pub struct Vol {
    pub name: String,
    pub cap_bytes: u64,
    data: File,
    staging_dir: PathBuf,
    staging: File,
    /// Bytes in regular files, committed and staged.
    used: Mutex<u64>,
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| errno(libc::EINVAL))
}

fn check(path: &str) -> io::Result<()> {
    check_path(path).map_err(|m| io::Error::new(io::ErrorKind::InvalidInput, m))
}

/// `openat2` beneath `dir`.
fn open_beneath(dir: &File, path: &str, flags: i32, mode: u32) -> io::Result<File> {
    #[repr(C)]
    struct OpenHow {
        flags: u64,
        mode: u64,
        resolve: u64,
    }
    const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
    const RESOLVE_NO_SYMLINKS: u64 = 0x04;
    const RESOLVE_BENEATH: u64 = 0x08;
    let p = cstr(if path.is_empty() { "." } else { path })?;
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC | libc::O_NOFOLLOW) as u64,
        mode: if flags & libc::O_CREAT != 0 {
            mode as u64
        } else {
            0
        },
        resolve: RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: `p` is NUL-terminated, `how` is a valid open_how of the size passed; both outlive
    // the call, and the returned descriptor is checked.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            p.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor this function owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
}

/// Splits `path` into its parent and its last component (refuses the root).
fn split(path: &str) -> io::Result<(&str, &str)> {
    check(path)?;
    if path.is_empty() {
        return Err(errno(libc::EBUSY));
    }
    Ok(match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    })
}

fn attr_of(m: &std::fs::Metadata) -> io::Result<Attr> {
    let ft = m.file_type();
    if !ft.is_dir() && !ft.is_file() {
        // A symlink or a special file someone put there on the host: not ours to follow.
        return Err(errno(libc::ENOENT));
    }
    Ok(Attr {
        dir: ft.is_dir(),
        size: if ft.is_dir() { 0 } else { m.len() },
        mode: m.mode() & 0o7777,
        mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
    })
}

fn fstatat_nofollow(dir: &File, leaf: &str) -> io::Result<Option<libc::stat>> {
    let c = cstr(leaf)?;
    // SAFETY: stat is plain old data; zeroes are valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor, NUL-terminated name and a stat buffer that outlive the call.
    let r = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            c.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENOENT) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(Some(st))
}

fn is_reg(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFREG
}

/// Sum of the sizes of the regular files under `dir` (no symlinks followed).
pub fn du(dir: &Path) -> u64 {
    let mut total = 0;
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in rd.flatten() {
        let Ok(m) = e.metadata() else { continue };
        if m.is_dir() {
            total += du(&e.path());
        } else if m.is_file() {
            total += m.len();
        }
    }
    total
}

impl Vol {
    /// Opens the volume at `root` (`data/` and `staging/` beneath it; leftover staging files —
    /// writes a crash cut off — are discarded).
    pub fn open(name: &str, root: &Path, cap_bytes: u64) -> io::Result<Arc<Vol>> {
        let data_dir = root.join("data");
        let staging_dir = root.join("staging");
        std::fs::create_dir_all(&data_dir)?;
        let _ = std::fs::remove_dir_all(&staging_dir);
        std::fs::create_dir_all(&staging_dir)?;
        std::fs::set_permissions(&staging_dir, std::fs::Permissions::from_mode(0o700))?;
        let open_dir = |p: &Path| {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECTORY)
                .open(p)
        };
        use std::os::unix::fs::OpenOptionsExt;
        Ok(Arc::new(Vol {
            name: name.to_string(),
            cap_bytes,
            data: open_dir(&data_dir)?,
            staging: open_dir(&staging_dir)?,
            staging_dir,
            used: Mutex::new(du(&data_dir)),
        }))
    }

    /// Bytes used (committed and staged).
    pub fn used(&self) -> u64 {
        *self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts `grow` more bytes, or refuses with ENOSPC when that passes the cap.
    fn reserve(&self, grow: u64) -> io::Result<()> {
        let mut u = self.used.lock().unwrap_or_else(|p| p.into_inner());
        if grow > 0 && *u + grow > self.cap_bytes {
            return Err(errno(libc::ENOSPC));
        }
        *u += grow;
        Ok(())
    }

    fn release_bytes(&self, n: u64) {
        let mut u = self.used.lock().unwrap_or_else(|p| p.into_inner());
        *u = u.saturating_sub(n);
    }

    pub fn stat(&self, path: &str) -> io::Result<Attr> {
        check(path)?;
        let f = open_beneath(&self.data, path, libc::O_PATH, 0)?;
        attr_of(&f.metadata()?)
    }

    pub fn list(&self, path: &str) -> io::Result<Vec<Entry>> {
        check(path)?;
        let d = open_beneath(&self.data, path, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        // Read through /proc/self/fd: read_dir wants a path; the descriptor pins the directory.
        let mut out = Vec::new();
        for e in std::fs::read_dir(format!("/proc/self/fd/{}", d.as_raw_fd()))? {
            let e = e?;
            let Ok(ft) = e.file_type() else { continue };
            if !ft.is_dir() && !ft.is_file() {
                continue;
            }
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            out.push(Entry {
                name,
                dir: ft.is_dir(),
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Up to `len` bytes of `path` at `off`.
    pub fn read_at(&self, path: &str, off: u64, len: usize) -> io::Result<Vec<u8>> {
        check(path)?;
        let f = open_beneath(&self.data, path, libc::O_RDONLY, 0)?;
        read_file_at(&f, off, len)
    }

    /// Opens a file for reading (the content API streams it).
    pub fn open_read(&self, path: &str) -> io::Result<File> {
        check(path)?;
        let f = open_beneath(&self.data, path, libc::O_RDONLY, 0)?;
        if f.metadata()?.is_dir() {
            return Err(errno(libc::EISDIR));
        }
        Ok(f)
    }

    fn parent(&self, path: &str) -> io::Result<(File, String)> {
        let (parent, leaf) = split(path)?;
        let d = open_beneath(&self.data, parent, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        Ok((d, leaf.to_string()))
    }

    pub fn mkdir(&self, path: &str, mode: u32) -> io::Result<()> {
        let (d, leaf) = self.parent(path)?;
        let c = cstr(&leaf)?;
        // SAFETY: valid descriptor and NUL-terminated name.
        if unsafe { libc::mkdirat(d.as_raw_fd(), c.as_ptr(), (mode & 0o777) | 0o700) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Makes `path` and its missing parents.
    pub fn mkdir_all(&self, path: &str) -> io::Result<()> {
        check(path)?;
        let mut cur = String::new();
        for c in path.split('/').filter(|c| !c.is_empty()) {
            if !cur.is_empty() {
                cur.push('/');
            }
            cur.push_str(c);
            match self.mkdir(&cur, 0o755) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    if !self.stat(&cur)?.dir {
                        return Err(errno(libc::ENOTDIR));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    pub fn unlink(&self, path: &str) -> io::Result<()> {
        let (d, leaf) = self.parent(path)?;
        let size = fstatat_nofollow(&d, &leaf)?
            .filter(is_reg)
            .map(|s| s.st_size as u64)
            .unwrap_or(0);
        let c = cstr(&leaf)?;
        // SAFETY: valid descriptor and NUL-terminated name.
        if unsafe { libc::unlinkat(d.as_raw_fd(), c.as_ptr(), 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
        self.release_bytes(size);
        Ok(())
    }

    pub fn rmdir(&self, path: &str) -> io::Result<()> {
        let (d, leaf) = self.parent(path)?;
        let c = cstr(&leaf)?;
        // SAFETY: valid descriptor and NUL-terminated name.
        if unsafe { libc::unlinkat(d.as_raw_fd(), c.as_ptr(), libc::AT_REMOVEDIR) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Removes `path`; a directory with everything in it when `recursive`.
    pub fn remove(&self, path: &str, recursive: bool) -> io::Result<()> {
        let a = self.stat(path)?;
        if !a.dir {
            return self.unlink(path);
        }
        if recursive {
            for e in self.list(path)? {
                self.remove(&format!("{path}/{}", e.name), true)?;
            }
        }
        self.rmdir(path)
    }

    pub fn rename(&self, from: &str, to: &str, noreplace: bool) -> io::Result<()> {
        let (fd, fl) = self.parent(from)?;
        let (td, tl) = self.parent(to)?;
        let replaced = fstatat_nofollow(&td, &tl)?
            .filter(is_reg)
            .map(|s| s.st_size as u64)
            .unwrap_or(0);
        let (a, b) = (cstr(&fl)?, cstr(&tl)?);
        let flags = if noreplace { libc::RENAME_NOREPLACE } else { 0 };
        // SAFETY: valid descriptors and NUL-terminated names.
        let r = unsafe {
            libc::renameat2(
                fd.as_raw_fd(),
                a.as_ptr(),
                td.as_raw_fd(),
                b.as_ptr(),
                flags,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        self.release_bytes(replaced);
        Ok(())
    }

    /// Opens `path` for writing through a staging file. A file made by `create` exists (empty)
    /// from now on, as after open(2) with `O_CREAT`.
    pub fn open_write(
        self: &Arc<Self>,
        path: &str,
        create: bool,
        excl: bool,
        trunc: bool,
        mode: u32,
    ) -> io::Result<Handle> {
        self.open_write_as(path, create, excl, trunc, mode, true)
    }

    fn open_write_as(
        self: &Arc<Self>,
        path: &str,
        create: bool,
        excl: bool,
        trunc: bool,
        mode: u32,
        make_now: bool,
    ) -> io::Result<Handle> {
        let (d, leaf) = self.parent(path)?;
        let existing = fstatat_nofollow(&d, &leaf)?;
        match &existing {
            Some(st) if !is_reg(st) => {
                return Err(errno(if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                    libc::EISDIR
                } else {
                    libc::EACCES
                }))
            }
            Some(_) if excl => return Err(errno(libc::EEXIST)),
            None if !create => return Err(errno(libc::ENOENT)),
            None if !make_now => {}
            None => {
                // The file exists from now on (empty), as after open(O_CREAT); another writer
                // that made it first is fine unless this one is exclusive.
                match open_beneath(
                    &self.data,
                    path,
                    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
                    (mode & 0o777) | 0o600,
                ) {
                    Ok(_) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) && !excl => {}
                    Err(e) => return Err(e),
                }
            }
            _ => {}
        }
        let mut h = Handle {
            vol: self.clone(),
            path: path.to_string(),
            staging: None,
            size: 0,
            mode: existing.map(|s| s.st_mode & 0o7777).unwrap_or(mode & 0o777) | 0o600,
        };
        if trunc {
            h.stage(false)?;
        }
        Ok(h)
    }

    /// A new staging file in `staging/`.
    fn new_staging(&self, mode: u32) -> io::Result<(File, PathBuf)> {
        let name = format!(".w{}", crate::paths::random_id());
        let f = open_beneath(
            &self.staging,
            &name,
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
            mode & 0o777,
        )?;
        Ok((f, self.staging_dir.join(name)))
    }

    /// Writes everything `r` gives to `path` (made or replaced), atomically; answers the bytes.
    pub fn write_from(self: &Arc<Self>, path: &str, r: &mut dyn Read) -> io::Result<u64> {
        // The file appears (or changes) only when it is complete: nothing is left behind by a
        // write that fails (the cap, a client that goes away).
        let mut h = self.open_write_as(path, true, false, true, 0o644, false)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        loop {
            let n = match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            h.write_at(off, &buf[..n])?;
            off += n as u64;
        }
        h.commit()?;
        Ok(off)
    }
}

fn read_file_at(f: &File, off: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match f.read_at(&mut buf[got..], off + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(got);
    Ok(buf)
}

/// An open write: the staging file (made at the first change) that `commit` publishes.
#[derive(Debug)]
pub struct Handle {
    vol: Arc<Vol>,
    path: String,
    staging: Option<(File, PathBuf)>,
    /// The staging file's size (counted in the volume's usage).
    size: u64,
    mode: u32,
}

impl Handle {
    /// Makes the staging file: a copy of the current content, or empty.
    fn stage(&mut self, copy: bool) -> io::Result<()> {
        if self.staging.is_some() {
            return Ok(());
        }
        let (mut f, p) = self.vol.new_staging(self.mode)?;
        let mut size = 0;
        if copy {
            if let Ok(mut src) = open_beneath(&self.vol.data, &self.path, libc::O_RDONLY, 0) {
                let len = src.metadata()?.len();
                if let Err(e) = self.vol.reserve(len) {
                    let _ = std::fs::remove_file(&p);
                    return Err(e);
                }
                if let Err(e) = io::copy(&mut src, &mut f) {
                    self.vol.release_bytes(len);
                    let _ = std::fs::remove_file(&p);
                    return Err(e);
                }
                size = len;
            }
        }
        self.size = size;
        self.staging = Some((f, p));
        Ok(())
    }

    pub fn write_at(&mut self, off: u64, data: &[u8]) -> io::Result<()> {
        self.stage(true)?;
        let end = off
            .checked_add(data.len() as u64)
            .ok_or_else(|| errno(libc::EFBIG))?;
        let grow = end.saturating_sub(self.size);
        self.vol.reserve(grow)?;
        let Some((f, _)) = &self.staging else {
            return Err(errno(libc::EIO));
        };
        if let Err(e) = f.write_all_at(data, off) {
            self.vol.release_bytes(grow);
            return Err(e);
        }
        self.size = self.size.max(end);
        Ok(())
    }

    pub fn set_size(&mut self, size: u64) -> io::Result<()> {
        self.stage(true)?;
        let Some((f, _)) = &self.staging else {
            return Err(errno(libc::EIO));
        };
        if size > self.size {
            self.vol.reserve(size - self.size)?;
        } else {
            self.vol.release_bytes(self.size - size);
        }
        f.set_len(size)?;
        self.size = size;
        Ok(())
    }

    pub fn read_at(&self, off: u64, len: usize) -> io::Result<Vec<u8>> {
        match &self.staging {
            Some((f, _)) => read_file_at(f, off, len),
            None => self.vol.read_at(&self.path, off, len),
        }
    }

    pub fn stat(&self) -> io::Result<Attr> {
        match &self.staging {
            Some((f, _)) => attr_of(&f.metadata()?),
            None => self.vol.stat(&self.path),
        }
    }

    /// Publishes the staged content: fsync, then rename over the target (atomic), then fsync
    /// its directory. Nothing staged: nothing to do.
    pub fn commit(&mut self) -> io::Result<()> {
        let Some((f, p)) = self.staging.take() else {
            return Ok(());
        };
        let r = (|| {
            f.sync_all()?;
            let (d, leaf) = self.vol.parent(&self.path)?;
            let old = fstatat_nofollow(&d, &leaf)?
                .filter(is_reg)
                .map(|s| s.st_size as u64)
                .unwrap_or(0);
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            let (a, b) = (cstr(name)?, cstr(&leaf)?);
            // SAFETY: valid descriptors and NUL-terminated names.
            let r = unsafe {
                libc::renameat(
                    self.vol.staging.as_raw_fd(),
                    a.as_ptr(),
                    d.as_raw_fd(),
                    b.as_ptr(),
                )
            };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
            self.vol.release_bytes(old);
            // SAFETY: fsync of a directory descriptor we hold.
            unsafe { libc::fsync(d.as_raw_fd()) };
            Ok(())
        })();
        if r.is_err() {
            self.vol.release_bytes(self.size);
            let _ = std::fs::remove_file(&p);
        }
        self.size = 0;
        r
    }

    /// Drops what was staged and not committed.
    pub fn discard(&mut self) {
        if let Some((_, p)) = self.staging.take() {
            let _ = std::fs::remove_file(&p);
            self.vol.release_bytes(self.size);
            self.size = 0;
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.discard();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(cap: u64) -> (tempfile::TempDir, Arc<Vol>) {
        let d = tempfile::tempdir().unwrap();
        let v = Vol::open("t", d.path(), cap).unwrap();
        (d, v)
    }

    #[test]
    fn write_is_atomic_and_counted() {
        let (_d, v) = vol(1 << 20);
        v.write_from("a.txt", &mut &b"old"[..]).unwrap();
        assert_eq!(v.used(), 3);
        let mut h = v.open_write("a.txt", false, false, true, 0o644).unwrap();
        h.write_at(0, b"new content").unwrap();
        assert_eq!(v.read_at("a.txt", 0, 100).unwrap(), b"old");
        h.commit().unwrap();
        assert_eq!(v.read_at("a.txt", 0, 100).unwrap(), b"new content");
        drop(h);
        assert_eq!(v.used(), 11);
        // A handle dropped without commit leaves the old content and no usage behind.
        let mut h = v.open_write("a.txt", false, false, true, 0o644).unwrap();
        h.write_at(0, b"torn").unwrap();
        drop(h);
        assert_eq!(v.read_at("a.txt", 0, 100).unwrap(), b"new content");
        assert_eq!(v.used(), 11);
    }

    #[test]
    fn cap_refuses_with_enospc() {
        let (_d, v) = vol(10);
        let e = v.write_from("big", &mut &[0u8; 11][..]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(v.used(), 0);
        assert!(v.stat("big").is_err());
        v.write_from("ok", &mut &[0u8; 10][..]).unwrap();
        v.unlink("ok").unwrap();
        assert_eq!(v.used(), 0);
    }

    #[test]
    fn traversal_and_symlinks_are_refused() {
        let (d, v) = vol(1 << 20);
        for bad in ["../x", "/etc/passwd", "a/../../x"] {
            assert!(v.stat(bad).is_err(), "{bad}");
            assert!(v.write_from(bad, &mut &b"x"[..]).is_err(), "{bad}");
        }
        std::os::unix::fs::symlink("/etc", d.path().join("data/link")).unwrap();
        assert!(v.stat("link/passwd").is_err());
        assert!(v.read_at("link/passwd", 0, 10).is_err());
        assert!(v.write_from("link/x", &mut &b"x"[..]).is_err());
        assert!(!v.list("").unwrap().iter().any(|e| e.name == "link"));
    }

    #[test]
    fn dirs_rename_and_remove() {
        let (_d, v) = vol(1 << 20);
        v.mkdir_all("a/b").unwrap();
        v.write_from("a/b/f", &mut &b"12345"[..]).unwrap();
        v.rename("a", "c", false).unwrap();
        assert_eq!(v.read_at("c/b/f", 0, 10).unwrap(), b"12345");
        assert!(v.remove("c", false).is_err());
        v.remove("c", true).unwrap();
        assert_eq!(v.used(), 0);
        assert!(v.list("").unwrap().is_empty());
    }
}
