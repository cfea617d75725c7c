//! The jail's directory tree on the host: `<base>/<id>/root`, the VMM
//! binary, the files the VM needs, bind-mount points, and device nodes.

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::config::{BindSpec, FileSpec, JailConfig, JAIL_EXEC_PATH};

/// A failure while building the jail's files.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// A directory could not be created.
    #[error("cannot create directory {path:?}: {source}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The chroot base is on a mount that forbids devices or exec.
    #[error("chroot base {path:?} is on a `{flag}` mount; the jail needs device nodes and exec")]
    BaseMountFlags {
        /// The chroot base.
        path: PathBuf,
        /// `nodev` or `noexec`.
        flag: &'static str,
    },
    /// Inspecting a path failed.
    #[error("cannot inspect {path:?}: {source}")]
    Stat {
        /// The path.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Copying failed.
    #[error("cannot copy {src:?} to {dest:?}: {source}")]
    Copy {
        /// Host source.
        src: PathBuf,
        /// Destination (host path inside the jail).
        dest: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Creating a file or symlink in the jail failed.
    #[error("cannot create {path:?}: {source}")]
    Create {
        /// The path.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Changing owner or mode failed.
    #[error("cannot set owner/mode of {path:?}: {source}")]
    Chown {
        /// The path.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A path component inside the jail exists but is not a directory.
    #[error("{path:?} exists in the jail but is not a directory (symlinks are not followed)")]
    NotADirectory {
        /// The component.
        path: PathBuf,
    },
    /// A directory tree holds something other than files, dirs and symlinks.
    #[error("{path:?} is a {kind}; only regular files, directories and symlinks can be placed")]
    UnsupportedType {
        /// The path.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// The binary is dynamically linked and its loader is not in the jail.
    #[error(
        "VMM binary {binary:?} is dynamically linked (interpreter {interp:?}) but the \
         interpreter is not placed in the jail; build it statically, or pass its loader \
         and libraries with --file/--bind (see jailer/README.md)"
    )]
    MissingInterpreter {
        /// The binary.
        binary: PathBuf,
        /// Its `PT_INTERP`.
        interp: PathBuf,
    },
    /// A host device node is missing or not a character device.
    #[error("host device {path:?} is unusable: {reason}")]
    HostDevice {
        /// The device.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// mknod in the jail failed.
    #[error("cannot create device node {path:?}: {source}")]
    Mknod {
        /// The node inside the jail.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
}

/// A device node to recreate in the jail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceNode {
    /// Path, the same on the host and in the jail.
    pub path: PathBuf,
    /// Host device number.
    pub rdev: u64,
    /// Permission bits.
    pub mode: u32,
}

/// The devices the VMM gets: `/dev/kvm`, `/dev/net/tun`, `/dev/urandom`,
/// and `/dev/userfaultfd` when asked. Reads the host's major/minor numbers.
pub fn host_devices(userfaultfd: bool) -> Result<Vec<DeviceNode>, FsError> {
    let mut list = vec![
        ("/dev/kvm", 0o600),
        ("/dev/net/tun", 0o600),
        ("/dev/urandom", 0o666),
    ];
    if userfaultfd {
        list.push(("/dev/userfaultfd", 0o600));
    }
    list.into_iter()
        .map(|(path, mode)| {
            let path = PathBuf::from(path);
            let meta = fs::metadata(&path).map_err(|e| FsError::HostDevice {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            if meta.mode() & libc::S_IFMT != libc::S_IFCHR {
                return Err(FsError::HostDevice {
                    path,
                    reason: "not a character device".into(),
                });
            }
            Ok(DeviceNode {
                path,
                rdev: meta.rdev(),
                mode,
            })
        })
        .collect()
}

/// Creates `nodes` under `root` (normally `/` after `pivot_root`), owned by
/// `uid:gid`, with their exact modes. Parent directories are 0755 root.
pub fn make_devices(root: &Path, nodes: &[DeviceNode], uid: u32, gid: u32) -> Result<(), FsError> {
    for node in nodes {
        let rel = node.path.strip_prefix("/").unwrap_or(&node.path);
        let path = root.join(rel);
        if let Some(parent) = rel.parent() {
            dir_in_root(root, parent)?;
        }
        crate::sys::mknod_char(&path, node.mode, node.rdev).map_err(|source| FsError::Mknod {
            path: path.clone(),
            source,
        })?;
        // mknod's mode went through the umask: set it exactly.
        let chown = |source| FsError::Chown {
            path: path.clone(),
            source,
        };
        crate::sys::lchown(&path, uid, gid).map_err(chown)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(node.mode)).map_err(chown)?;
    }
    Ok(())
}

/// `mkdir -p` with `mode` for the directories it creates.
fn mkdir_p(path: &Path, mode: u32) -> Result<(), FsError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
        .map_err(|source| FsError::CreateDir {
            path: path.to_path_buf(),
            source,
        })
}

/// `path` (absolute inside the jail) relative to the jail root.
fn in_root(path: &Path) -> &Path {
    path.strip_prefix("/").unwrap_or(path)
}

/// Makes sure `root/rel` is a directory, creating missing components (0755)
/// one by one. An existing component that is not a real directory (e.g. a
/// symlink placed by `--file`) is refused: following it would resolve
/// against the host's root.
fn dir_in_root(root: &Path, rel: &Path) -> Result<PathBuf, FsError> {
    let mut dir = root.to_path_buf();
    for comp in rel.components() {
        let std::path::Component::Normal(name) = comp else {
            continue;
        };
        dir.push(name);
        match fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(FsError::NotADirectory { path: dir });
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .mode(0o755)
                    .create(&dir)
                    .map_err(|source| FsError::CreateDir {
                        path: dir.clone(),
                        source,
                    })?;
            }
            Err(source) => return Err(FsError::Stat { path: dir, source }),
        }
    }
    Ok(dir)
}

/// Creates the chroot base if missing, checks it allows devices and exec,
/// then creates `<base>/<id>` (which must not exist) and `<base>/<id>/root`.
pub fn create_jail_dirs(cfg: &JailConfig) -> Result<(), FsError> {
    mkdir_p(&cfg.chroot_base, 0o755)?;
    let flags = crate::sys::mount_flags(&cfg.chroot_base).map_err(|source| FsError::Stat {
        path: cfg.chroot_base.clone(),
        source,
    })?;
    for (bit, flag) in [(libc::ST_NODEV, "nodev"), (libc::ST_NOEXEC, "noexec")] {
        #[allow(clippy::unnecessary_cast)] // ST_* widths differ between libcs.
        if flags & (bit as u64) != 0 {
            return Err(FsError::BaseMountFlags {
                path: cfg.chroot_base.clone(),
                flag,
            });
        }
    }
    for dir in [cfg.jail_dir(), cfg.root_dir()] {
        fs::DirBuilder::new()
            .mode(0o755)
            .create(&dir)
            .map_err(|source| FsError::CreateDir {
                path: dir.clone(),
                source,
            })?;
        // Make the mode exact regardless of the umask.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).map_err(|source| {
            FsError::Chown {
                path: dir.clone(),
                source,
            }
        })?;
    }
    Ok(())
}

/// Places the VMM binary at `/ember-vmm` in the jail, mode 0555, root-owned: a copy, so
/// that the jailed process does not share an inode with the host's binary; or, with
/// `exec_link` (a root-owned file made for sharing, checked by `validate`), a hard link
/// when the jail is on the same file system, so that the jails' VMMs share its pages.
pub fn install_exec(cfg: &JailConfig) -> Result<PathBuf, FsError> {
    let dest = cfg.host_path(Path::new(JAIL_EXEC_PATH));
    if cfg.exec_link && fs::hard_link(&cfg.exec_file, &dest).is_ok() {
        return Ok(dest);
    }
    copy_file(&cfg.exec_file, &dest, 0o555)?;
    Ok(dest)
}

/// Copies `src` to a new file `dest` and sets `mode`.
fn copy_file(src: &Path, dest: &Path, mode: u32) -> Result<(), FsError> {
    let err = |source| FsError::Copy {
        src: src.to_path_buf(),
        dest: dest.to_path_buf(),
        source,
    };
    let mut input = fs::File::open(src).map_err(err)?;
    let mut output = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dest)
        .map_err(err)?;
    io::copy(&mut input, &mut output).map_err(err)?;
    output
        .set_permissions(fs::Permissions::from_mode(mode))
        .map_err(err)?;
    Ok(())
}

/// Places every `--file` entry in the jail.
pub fn place_files(cfg: &JailConfig) -> Result<(), FsError> {
    let jail_dev = fs::metadata(cfg.root_dir())
        .map_err(|source| FsError::Stat {
            path: cfg.root_dir(),
            source,
        })?
        .dev();
    for spec in &cfg.files {
        place_one(cfg, spec, jail_dev)?;
    }
    Ok(())
}

fn place_one(cfg: &JailConfig, spec: &FileSpec, jail_dev: u64) -> Result<(), FsError> {
    // Resolve symlinks on the host side: a link into the jail must point at
    // the real file, not at a host-relative path.
    let src = fs::canonicalize(&spec.src).map_err(|source| FsError::Stat {
        path: spec.src.clone(),
        source,
    })?;
    let dest = cfg.host_path(&spec.dest);
    if let Some(parent) = in_root(&spec.dest).parent() {
        dir_in_root(&cfg.root_dir(), parent)?;
    }
    let owner = spec.writable.then_some((cfg.uid, cfg.gid));
    place_tree(&src, &dest, jail_dev, owner)
}

/// Places `src` at `dest`: files are hard-linked when on the jail's
/// filesystem, copied otherwise; directories are recreated and recursed into;
/// symlinks are recreated as they are. `owner` chowns everything placed.
fn place_tree(
    src: &Path,
    dest: &Path,
    jail_dev: u64,
    owner: Option<(u32, u32)>,
) -> Result<(), FsError> {
    let meta = fs::symlink_metadata(src).map_err(|source| FsError::Stat {
        path: src.to_path_buf(),
        source,
    })?;
    let ft = meta.file_type();
    if ft.is_file() {
        let linked = meta.dev() == jail_dev && fs::hard_link(src, dest).is_ok();
        if !linked {
            // Copies keep the permission bits but never set-id bits.
            copy_file(src, dest, meta.mode() & 0o777)?;
        }
    } else if ft.is_dir() {
        fs::DirBuilder::new()
            .mode(0o700)
            .create(dest)
            .map_err(|source| FsError::CreateDir {
                path: dest.to_path_buf(),
                source,
            })?;
        let entries = fs::read_dir(src).map_err(|source| FsError::Stat {
            path: src.to_path_buf(),
            source,
        })?;
        for entry in entries {
            let entry = entry.map_err(|source| FsError::Stat {
                path: src.to_path_buf(),
                source,
            })?;
            place_tree(
                &entry.path(),
                &dest.join(entry.file_name()),
                jail_dev,
                owner,
            )?;
        }
        fs::set_permissions(dest, fs::Permissions::from_mode(meta.mode() & 0o777)).map_err(
            |source| FsError::Chown {
                path: dest.to_path_buf(),
                source,
            },
        )?;
    } else if ft.is_symlink() {
        let target = fs::read_link(src).map_err(|source| FsError::Stat {
            path: src.to_path_buf(),
            source,
        })?;
        std::os::unix::fs::symlink(&target, dest).map_err(|source| FsError::Create {
            path: dest.to_path_buf(),
            source,
        })?;
    } else {
        use std::os::unix::fs::FileTypeExt;
        let kind = if ft.is_socket() {
            "socket"
        } else if ft.is_fifo() {
            "fifo"
        } else {
            "device node"
        };
        return Err(FsError::UnsupportedType {
            path: src.to_path_buf(),
            kind,
        });
    }
    if let Some((uid, gid)) = owner {
        crate::sys::lchown(dest, uid, gid).map_err(|source| FsError::Chown {
            path: dest.to_path_buf(),
            source,
        })?;
    }
    Ok(())
}

/// Creates an empty file or directory at each bind destination, matching
/// the source's type, so the mount has something to land on.
pub fn prepare_bind_points(cfg: &JailConfig) -> Result<(), FsError> {
    for BindSpec { src, dest, .. } in &cfg.binds {
        let meta = fs::metadata(src).map_err(|source| FsError::Stat {
            path: src.clone(),
            source,
        })?;
        let target = cfg.host_path(dest);
        if meta.is_dir() {
            dir_in_root(&cfg.root_dir(), in_root(dest))?;
        } else {
            if let Some(parent) = in_root(dest).parent() {
                dir_in_root(&cfg.root_dir(), parent)?;
            }
            fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&target)
                .map_err(|source| FsError::Create {
                    path: target.clone(),
                    source,
                })?;
        }
    }
    Ok(())
}

/// Reads the `PT_INTERP` (program interpreter) of a 64-bit little-endian ELF
/// file. Returns `None` for static binaries and anything that is not such an
/// ELF file.
pub fn elf_interpreter(path: &Path) -> io::Result<Option<PathBuf>> {
    let mut file = fs::File::open(path)?;
    let mut data = Vec::new();
    // Program headers sit near the start; 64 KiB is plenty.
    file.by_ref().take(64 * 1024).read_to_end(&mut data)?;
    Ok(parse_interp(&data))
}

fn parse_interp(data: &[u8]) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    const PT_INTERP: u32 = 3;
    let bytes = |o: usize, n: usize| data.get(o..o.checked_add(n)?);
    let u16_at = |o| Some(u16::from_le_bytes(bytes(o, 2)?.try_into().ok()?));
    let u32_at = |o| Some(u32::from_le_bytes(bytes(o, 4)?.try_into().ok()?));
    let u64_at = |o| Some(u64::from_le_bytes(bytes(o, 8)?.try_into().ok()?));
    // ELF magic, ELFCLASS64, ELFDATA2LSB.
    if data.get(0..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    for i in 0..phnum {
        let ph = phoff.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(ph)? == PT_INTERP {
            let off = usize::try_from(u64_at(ph.checked_add(0x08)?)?).ok()?;
            let len = usize::try_from(u64_at(ph.checked_add(0x20)?)?).ok()?;
            let raw = data.get(off..off.checked_add(len)?)?;
            let raw = raw.split(|&b| b == 0).next()?;
            return Some(PathBuf::from(std::ffi::OsStr::from_bytes(raw)));
        }
    }
    None
}

/// Fails if the VMM binary needs an ELF interpreter that the jail will not
/// have (neither placed with `--file` nor under a `--bind` destination).
pub fn check_interpreter(cfg: &JailConfig) -> Result<(), FsError> {
    let interp = elf_interpreter(&cfg.exec_file).map_err(|source| FsError::Stat {
        path: cfg.exec_file.clone(),
        source,
    })?;
    let Some(interp) = interp else {
        return Ok(());
    };
    let in_jail = fs::symlink_metadata(cfg.host_path(&interp)).is_ok();
    let under_bind = cfg.binds.iter().any(|b| interp.starts_with(&b.dest));
    if in_jail || under_bind {
        Ok(())
    } else {
        Err(FsError::MissingInterpreter {
            binary: cfg.exec_file.clone(),
            interp,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(base: &Path) -> JailConfig {
        JailConfig::new("t1", "/bin/true", 4321, 4321, base)
    }

    #[test]
    fn interp_of_real_binaries() {
        // The test binary itself is a normal dynamically linked executable.
        let me = std::env::current_exe().unwrap();
        let interp = elf_interpreter(&me).unwrap().expect("dynamic test binary");
        assert!(interp.to_string_lossy().contains("ld-linux"), "{interp:?}");
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("s");
        fs::write(&script, "#!/bin/sh\n").unwrap();
        assert_eq!(elf_interpreter(&script).unwrap(), None);
    }

    #[test]
    fn interp_parser_is_bounds_checked() {
        assert_eq!(parse_interp(b""), None);
        assert_eq!(parse_interp(b"\x7fELF\x02\x01"), None);
        let mut h = vec![0u8; 0x40];
        h[..6].copy_from_slice(b"\x7fELF\x02\x01");
        h[0x20..0x28].copy_from_slice(&u64::MAX.to_le_bytes()); // phoff far away
        h[0x36] = 56;
        h[0x38] = 1;
        assert_eq!(parse_interp(&h), None);
        // One PT_INTERP header pointing at "/ld.so\0".
        let mut h = vec![0u8; 0x40 + 56 + 8];
        h[..6].copy_from_slice(b"\x7fELF\x02\x01");
        h[0x20..0x28].copy_from_slice(&0x40u64.to_le_bytes());
        h[0x36] = 56;
        h[0x38] = 1;
        h[0x40..0x44].copy_from_slice(&3u32.to_le_bytes());
        h[0x48..0x50].copy_from_slice(&(0x40u64 + 56).to_le_bytes());
        h[0x60..0x68].copy_from_slice(&7u64.to_le_bytes());
        h[0x40 + 56..].copy_from_slice(b"/ld.so\0\0");
        assert_eq!(parse_interp(&h), Some(PathBuf::from("/ld.so")));
    }

    #[test]
    fn jail_tree_files_and_exec() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("base");
        let src = tmp.path().join("src");
        fs::create_dir_all(src.join("snap/sub")).unwrap();
        fs::write(src.join("kernel"), b"kernel").unwrap();
        fs::set_permissions(src.join("kernel"), fs::Permissions::from_mode(0o4755)).unwrap();
        fs::write(src.join("snap/state"), b"state").unwrap();
        fs::write(src.join("snap/sub/memory"), b"mem").unwrap();
        std::os::unix::fs::symlink("state", src.join("snap/link")).unwrap();
        let exe = src.join("vmm");
        fs::write(&exe, b"#!/bin/true\n").unwrap();

        let mut c = cfg(&base);
        c.exec_file = exe;
        c.files.push(
            format!("{}:/boot/vmlinux", src.join("kernel").display())
                .parse()
                .unwrap(),
        );
        c.files.push(
            format!("{}:/snap:rw", src.join("snap").display())
                .parse()
                .unwrap(),
        );
        c.binds
            .push(format!("{}:/data", src.display()).parse().unwrap());
        c.binds.push(
            format!("{}:/etc/one:ro", src.join("kernel").display())
                .parse()
                .unwrap(),
        );

        create_jail_dirs(&c).unwrap();
        assert!(matches!(
            create_jail_dirs(&c),
            Err(FsError::CreateDir { .. })
        ));
        let exec = install_exec(&c).unwrap();
        let m = fs::metadata(&exec).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o555);
        assert_ne!(
            m.ino(),
            fs::metadata(&c.exec_file).unwrap().ino(),
            "must be a copy"
        );
        place_files(&c).unwrap();
        prepare_bind_points(&c).unwrap();

        let root = c.root_dir();
        // Same filesystem: hard link (same inode), owner unchanged.
        let k = fs::metadata(root.join("boot/vmlinux")).unwrap();
        assert_eq!(k.ino(), fs::metadata(src.join("kernel")).unwrap().ino());
        // Writable tree: recreated, files linked, all chowned.
        for p in ["snap", "snap/state", "snap/sub", "snap/sub/memory"] {
            let m = fs::symlink_metadata(root.join(p)).unwrap();
            assert_eq!((m.uid(), m.gid()), (4321, 4321), "{p}");
        }
        assert_eq!(
            fs::read_link(root.join("snap/link")).unwrap(),
            Path::new("state")
        );
        assert!(root.join("data").is_dir());
        assert!(root.join("etc/one").is_file());
    }

    #[test]
    fn exec_link_shares_the_inode_and_validate_refuses_a_writable_binary() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("base");
        fs::create_dir_all(&base).unwrap();
        let exe = tmp.path().join("vmm");
        fs::write(&exe, b"#!/bin/true\n").unwrap();
        fs::set_permissions(&exe, fs::Permissions::from_mode(0o555)).unwrap();
        let mut c = cfg(&base);
        c.exec_file = exe.clone();
        c.exec_link = true;
        // Owned by whoever runs the test: root in CI, where validate accepts it.
        let owner = fs::metadata(&exe).unwrap().uid();
        if owner == 0 {
            c.validate().unwrap();
        }
        create_jail_dirs(&c).unwrap();
        let placed = install_exec(&c).unwrap();
        assert_eq!(
            fs::metadata(&placed).unwrap().ino(),
            fs::metadata(&exe).unwrap().ino(),
            "must be a link"
        );
        // Group- or world-writable, or set-id: refused, naming the binary.
        for mode in [0o775, 0o557, 0o4555] {
            fs::set_permissions(&exe, fs::Permissions::from_mode(mode)).unwrap();
            let mut c2 = cfg(&tmp.path().join(format!("b{mode:o}")));
            fs::create_dir_all(&c2.chroot_base).unwrap();
            c2.exec_file = exe.clone();
            c2.exec_link = true;
            let e = c2.validate().unwrap_err().to_string();
            assert!(
                e.contains("--exec-link") && e.contains("vmm"),
                "{mode:o}: {e}"
            );
        }
    }

    #[test]
    fn copy_strips_setid_bits() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("s");
        fs::write(&src, b"x").unwrap();
        fs::set_permissions(&src, fs::Permissions::from_mode(0o6755)).unwrap();
        let dest = tmp.path().join("d");
        let meta = fs::metadata(&src).unwrap();
        // Force the copy path with a device number that cannot match.
        place_tree(&src, &dest, meta.dev().wrapping_add(1), None).unwrap();
        let m = fs::metadata(&dest).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o755);
        assert_ne!(m.ino(), meta.ino());
    }

    #[test]
    fn missing_interpreter_is_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = cfg(tmp.path());
        c.exec_file = std::env::current_exe().unwrap();
        create_jail_dirs(&c).unwrap();
        let e = check_interpreter(&c).unwrap_err();
        assert!(e.to_string().contains("dynamically linked"), "{e}");
        c.binds.push("/lib64:ro".parse().unwrap());
        check_interpreter(&c).unwrap();
    }

    #[test]
    fn symlinks_in_the_jail_are_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let outside = tmp.path().join("outside");
        fs::create_dir_all(&root).unwrap();
        fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        let e = dir_in_root(&root, Path::new("link/sub")).unwrap_err();
        assert!(matches!(e, FsError::NotADirectory { .. }), "{e}");
        assert!(!outside.join("sub").exists());
        assert_eq!(
            dir_in_root(&root, Path::new("a/b")).unwrap(),
            root.join("a/b")
        );
        assert!(root.join("a/b").is_dir());
    }

    #[test]
    fn unsupported_types() {
        let tmp = tempfile::tempdir().unwrap();
        let sock = tmp.path().join("sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let e = place_tree(&sock, &tmp.path().join("x"), 0, None).unwrap_err();
        assert!(matches!(e, FsError::UnsupportedType { kind: "socket", .. }));
    }

    #[test]
    fn devices_are_char_devices() {
        let devs = host_devices(false);
        if let Ok(devs) = devs {
            assert_eq!(devs.len(), 3);
            assert_eq!(devs[2].mode, 0o666);
        }
    }
}
