//! A tree unpacked from an image, made bootable and inspected — all by reading and writing
//! files through the same in-root resolution as the unpacker; nothing in the tree is run.
//!
//! [`prepare`] adds what ember's guest needs whatever the image: the mount points the agent
//! mounts over (`/proc`, `/sys`, `/dev`, `/tmp`, `/run`), `/workspace` and its `outputs`
//! (mode 0777, owned by `user`), the account `user` (uid/gid 1000) when `/etc/passwd` has no
//! `user`, `/usr/bin/python3` as a link to `/usr/local/bin/python3` when only the latter
//! exists (the official `python` images), `/etc/hostname`, `/etc/hosts`, `/etc/resolv.conf`
//! → `/run/resolv.conf`, and the recipe's `[[files]]`.
//!
//! [`inspect`] says what the tree offers ([`Features`]): Python and its version (from the
//! `lib/python3.N` directory holding the standard library), IPython, Chromium, a shell.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use serde::Serialize;

use crate::unpack::{remove_all, split, Limits, Unpacker};
use crate::OciError;

/// The uid/gid of the sandbox account `user`.
pub const USER_ID: u32 = 1000;

/// A file the recipe writes into the tree.
#[derive(Debug, Clone)]
pub struct ExtraFile {
    /// Absolute guest path.
    pub path: String,
    /// Content.
    pub data: Vec<u8>,
    /// Permission bits.
    pub mode: u32,
}

struct Tree {
    u: Unpacker,
    path: std::path::PathBuf,
}

impl Tree {
    fn open(dest: &Path) -> Result<Tree, OciError> {
        Ok(Tree {
            u: Unpacker::open(dest, Limits::default())?,
            path: dest.into(),
        })
    }

    fn err(&self, guest: &str, what: &str, e: Errno) -> OciError {
        OciError::Io {
            what: "cannot prepare",
            path: self.path.join(guest.trim_start_matches('/')),
            source: std::io::Error::other(format!("{what}: {e}")),
        }
    }

    fn parent(&self, guest: &str, create: bool) -> Result<(OwnedFd, Vec<u8>), OciError> {
        let comps = split(guest.trim_start_matches('/').as_bytes())
            .map_err(|m| self.err(guest, &m, Errno::INVAL))?;
        let Some((last, parents)) = comps.split_last() else {
            return Err(self.err(guest, "the root", Errno::INVAL));
        };
        let fd = self
            .u
            .open_dir(parents, create)
            .map_err(|e| self.err(guest, "its directory", e))?;
        Ok((fd, last.as_bytes().to_vec()))
    }

    /// Whether `guest` exists (symlinks followed in the tree).
    fn exists(&self, guest: &str) -> bool {
        self.open_read(guest).is_ok()
    }

    fn open_read(&self, guest: &str) -> Result<OwnedFd, Errno> {
        let rel = guest.trim_start_matches('/');
        rustix::fs::openat2(
            self.u_root(),
            OsStr::new(if rel.is_empty() { "." } else { rel }),
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK,
            Mode::empty(),
            ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV,
        )
    }

    fn u_root(&self) -> OwnedFd {
        self.u.open_dir(&[], false).expect("the tree's root opens")
    }

    fn read(&self, guest: &str, max: u64) -> Option<Vec<u8>> {
        let fd = self.open_read(guest).ok()?;
        let mut out = Vec::new();
        std::fs::File::from(fd)
            .take(max)
            .read_to_end(&mut out)
            .ok()?;
        Some(out)
    }

    /// Replaces `guest` with a regular file (root-owned unless `owner`).
    fn write(&self, guest: &str, data: &[u8], mode: u32, owner: u32) -> Result<(), OciError> {
        let (dir, name) = self.parent(guest, true)?;
        let name = OsStr::from_bytes(&name);
        remove_all(&dir, name).map_err(|e| self.err(guest, "cannot replace", e))?;
        let fd = rustix::fs::openat(
            &dir,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| self.err(guest, "cannot create", e))?;
        let chown = rustix::process::geteuid().is_root();
        if chown {
            rustix::fs::fchown(
                &fd,
                Some(rustix::fs::Uid::from_raw(owner)),
                Some(rustix::fs::Gid::from_raw(owner)),
            )
            .map_err(|e| self.err(guest, "cannot chown", e))?;
        }
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode & 0o1777))
            .map_err(|e| self.err(guest, "cannot chmod", e))?;
        std::fs::File::from(fd)
            .write_all(data)
            .map_err(|e| OciError::Io {
                what: "cannot write",
                path: self.path.join(guest.trim_start_matches('/')),
                source: e,
            })
    }

    fn mkdir(&self, guest: &str, mode: u32, owner: u32) -> Result<(), OciError> {
        let (dir, name) = self.parent(guest, true)?;
        let name = OsStr::from_bytes(&name);
        let is_dir = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .is_ok_and(|s| s.st_mode & libc::S_IFMT == libc::S_IFDIR);
        if !is_dir {
            remove_all(&dir, name).map_err(|e| self.err(guest, "cannot replace", e))?;
            rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o700))
                .map_err(|e| self.err(guest, "cannot create", e))?;
        }
        let fd = rustix::fs::openat(
            &dir,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| self.err(guest, "cannot open", e))?;
        if rustix::process::geteuid().is_root() {
            rustix::fs::fchown(
                &fd,
                Some(rustix::fs::Uid::from_raw(owner)),
                Some(rustix::fs::Gid::from_raw(owner)),
            )
            .map_err(|e| self.err(guest, "cannot chown", e))?;
        }
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))
            .map_err(|e| self.err(guest, "cannot chmod", e))
    }

    fn symlink(&self, guest: &str, target: &str) -> Result<(), OciError> {
        let (dir, name) = self.parent(guest, true)?;
        let name = OsStr::from_bytes(&name);
        remove_all(&dir, name).map_err(|e| self.err(guest, "cannot replace", e))?;
        rustix::fs::symlinkat(target, &dir, name).map_err(|e| self.err(guest, "cannot create", e))
    }
}

/// Makes the unpacked tree at `dest` bootable by ember (see the module doc); returns notes
/// for the build log.
pub fn prepare(dest: &Path, files: &[ExtraFile]) -> Result<Vec<String>, OciError> {
    let t = Tree::open(dest)?;
    let mut notes = Vec::new();
    for d in ["proc", "sys", "dev", "tmp", "run", "root"] {
        if !t.exists(d) {
            t.mkdir(d, if d == "tmp" { 0o1777 } else { 0o755 }, 0)?;
        }
    }
    let shell = if t.exists("/bin/bash") {
        "/bin/bash"
    } else {
        "/bin/sh"
    };
    let passwd = t.read("/etc/passwd", 1 << 20).unwrap_or_default();
    let has_user = passwd
        .split(|&b| b == b'\n')
        .any(|l| l.starts_with(b"user:"));
    if !has_user {
        let mut p = passwd.clone();
        if p.is_empty() {
            p.extend_from_slice(b"root:x:0:0:root:/root:/bin/sh\n");
        } else if !p.ends_with(b"\n") {
            p.push(b'\n');
        }
        p.extend_from_slice(
            format!("user:x:{USER_ID}:{USER_ID}:ember sandbox user:/home/user:{shell}\n")
                .as_bytes(),
        );
        t.write("/etc/passwd", &p, 0o644, 0)?;
        let mut g = t.read("/etc/group", 1 << 20).unwrap_or_default();
        if g.is_empty() {
            g.extend_from_slice(b"root:x:0:\n");
        } else if !g.ends_with(b"\n") {
            g.push(b'\n');
        }
        if !g.split(|&b| b == b'\n').any(|l| l.starts_with(b"user:")) {
            g.extend_from_slice(format!("user:x:{USER_ID}:\n").as_bytes());
            t.write("/etc/group", &g, 0o644, 0)?;
        }
        notes.push(format!(
            "added the account user ({USER_ID}:{USER_ID}, shell {shell}) to /etc/passwd"
        ));
    }
    if !t.exists("/home/user") {
        t.mkdir("/home/user", 0o755, USER_ID)?;
    }
    t.mkdir("/workspace", 0o777, USER_ID)?;
    t.mkdir("/workspace/outputs", 0o777, USER_ID)?;
    if !t.exists("/usr/bin/python3") && t.exists("/usr/local/bin/python3") {
        t.symlink("/usr/bin/python3", "/usr/local/bin/python3")?;
        notes.push("linked /usr/bin/python3 to /usr/local/bin/python3".into());
    }
    t.write("/etc/hostname", b"ember\n", 0o644, 0)?;
    t.write(
        "/etc/hosts",
        b"127.0.0.1 localhost ember\n::1 localhost ip6-localhost\n",
        0o644,
        0,
    )?;
    t.symlink("/etc/resolv.conf", "/run/resolv.conf")?;
    for f in files {
        t.write(&f.path, &f.data, f.mode, 0)?;
    }
    Ok(notes)
}

/// What a tree offers to ember's features.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Features {
    /// `/usr/bin/python3` exists.
    pub python3: bool,
    /// The Python version (`3.11`), from the standard library's directory.
    pub python_version: Option<String>,
    /// IPython is importable (its package directory is on a standard path).
    pub ipython: bool,
    /// A Chromium binary, if any.
    pub chromium: Option<String>,
    /// `/bin/sh` exists.
    pub sh: bool,
    /// `/bin/bash` exists.
    pub bash: bool,
}

impl Features {
    /// The Python version as (major, minor).
    pub fn python(&self) -> Option<(u32, u32)> {
        let v = self.python_version.as_deref()?;
        let (a, b) = v.split_once('.')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    }
}

/// Whether `guest` (an absolute guest path) exists in the tree at `dest`, its symlinks followed
/// inside the tree (never on the host).
pub fn exists(dest: &Path, guest: &str) -> Result<bool, OciError> {
    Ok(Tree::open(dest)?.exists(guest))
}

/// Reads what the tree at `dest` offers.
pub fn inspect(dest: &Path) -> Result<Features, OciError> {
    let t = Tree::open(dest)?;
    let mut f = Features {
        python3: t.exists("/usr/bin/python3"),
        sh: t.exists("/bin/sh"),
        bash: t.exists("/bin/bash"),
        ..Features::default()
    };
    let mut best: Option<(u32, u32, String)> = None;
    for lib in ["/usr/lib", "/usr/local/lib"] {
        let Ok(fd) = t.open_read(lib) else { continue };
        let Ok(dir) = rustix::fs::Dir::read_from(&fd) else {
            continue;
        };
        for ent in dir.flatten() {
            let name = String::from_utf8_lossy(ent.file_name().to_bytes()).into_owned();
            let Some(v) = name.strip_prefix("python") else {
                continue;
            };
            let Some((a, b)) = v.split_once('.') else {
                continue;
            };
            let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) else {
                continue;
            };
            let stdlib = format!("{lib}/{name}");
            if !t.exists(&format!("{stdlib}/os.py")) {
                continue;
            }
            for site in ["site-packages", "dist-packages"] {
                if t.exists(&format!("{stdlib}/{site}/IPython/__init__.py")) {
                    f.ipython = true;
                }
            }
            if best.as_ref().is_none_or(|(x, y, _)| (a, b) > (*x, *y)) {
                best = Some((a, b, name));
            }
        }
    }
    if t.exists("/usr/lib/python3/dist-packages/IPython/__init__.py") {
        f.ipython = true;
    }
    f.python_version = best.map(|(a, b, _)| format!("{a}.{b}"));
    f.chromium = [
        "/usr/lib/chromium/chromium",
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
        "/opt/google/chrome/chrome",
        "/headless-shell/headless-shell",
    ]
    .into_iter()
    .find(|p| t.exists(p))
    .map(str::to_string);
    Ok(f)
}
