//! A size-capped, rotating output file: the guest console (`--serial file:PATH`) and the VMM's
//! own log (`--log-file PATH`) go through it, so neither a chatty guest nor a log flood can fill
//! the host's disk.
//!
//! `PATH` grows up to the cap. A write that would take it past the cap first rotates: the full
//! file becomes `PATH.1` (replacing the previous `PATH.1`) and `PATH` starts empty. Disk use is
//! therefore at most twice the cap, and what was written last is always in `PATH.1` + `PATH`,
//! in that order. A write never splits across the two files unless it alone is larger than
//! the remaining room of an empty file (then it is cut at the cap, as a byte stream must be).
//!
//! # How rotation works, and why that way
//! Both files are opened (created, emptied) when the writer is made; `PATH.1` therefore exists
//! from the start, empty until the first rotation. A rotation empties the spare file
//! (`ftruncate`) and then swaps the two names in one `renameat2(RENAME_EXCHANGE)` relative to
//! a descriptor of their directory: `PATH` always exists, no file is opened or created after
//! set-up, and the thread that rotates needs only `ftruncate` and `renameat2` in its seccomp
//! allow-list (`vmm/seccomp/vcpu.json` — the console is written by the vCPU thread that writes
//! the UART's data register — and `log.json`), never `openat`. Both descriptors are
//! `O_APPEND`, so writes land at the end of whichever file is current.
//!
//! A filesystem without `RENAME_EXCHANGE` (EINVAL; every common local one has it) makes a
//! rotation empty `PATH` in place instead: the cap still holds, but the older half is lost.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Default cap of the console and log files (4 MiB).
pub const DEFAULT_MAX_BYTES: u64 = 4 << 20;

/// Errors setting up a rotating file.
#[derive(Debug, thiserror::Error)]
pub enum RotatingFileError {
    /// The cap is zero.
    #[error("{path}: the size cap must be at least 1 byte")]
    ZeroCap {
        /// The file.
        path: PathBuf,
    },
    /// The path names no file (empty, `/`, ending in `..`) or contains a NUL byte.
    #[error("{path}: not a usable file path")]
    BadPath {
        /// The path.
        path: PathBuf,
    },
    /// The directory the file goes in cannot be opened.
    #[error("cannot open the directory {dir} for {path}: {source}")]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The file (or its `.1`) cannot be created or emptied.
    #[error("cannot create {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
}

/// A file capped at `max_bytes`, rotated to `PATH.1` when full (see the module docs).
#[derive(Debug)]
pub struct RotatingFile {
    path: PathBuf,
    /// The directory holding both files (an `O_PATH` descriptor for `renameat2`).
    dir: OwnedFd,
    name: std::ffi::CString,
    old_name: std::ffi::CString,
    /// The file at `PATH`.
    current: File,
    /// The file at `PATH.1`.
    spare: File,
    /// Bytes in `current`.
    len: u64,
    max_bytes: u64,
    /// Cleared when the filesystem refused `RENAME_EXCHANGE`; rotations then empty `PATH`.
    can_exchange: bool,
    rotations: u64,
}

impl RotatingFile {
    /// Creates (or empties) `path` and `path.1` and returns a writer capped at `max_bytes`.
    pub fn create(path: &Path, max_bytes: u64) -> Result<Self, RotatingFileError> {
        let bad_path = || RotatingFileError::BadPath {
            path: path.to_path_buf(),
        };
        if max_bytes == 0 {
            return Err(RotatingFileError::ZeroCap {
                path: path.to_path_buf(),
            });
        }
        let file_name = path.file_name().ok_or_else(bad_path)?;
        let mut old = file_name.to_os_string();
        old.push(".1");
        let name = std::ffi::CString::new(file_name.as_bytes()).map_err(|_| bad_path())?;
        let old_name = std::ffi::CString::new(old.as_bytes()).map_err(|_| bad_path())?;
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let dir = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
            .open(parent)
            .map_err(|source| RotatingFileError::Dir {
                dir: parent.to_path_buf(),
                path: path.to_path_buf(),
                source,
            })?;
        let open = |p: &Path| {
            let f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .and_then(|f| f.set_len(0).map(|()| f))
                .map_err(|source| RotatingFileError::Open {
                    path: p.to_path_buf(),
                    source,
                })?;
            Ok::<_, RotatingFileError>(f)
        };
        let spare = open(&parent.join(&old))?;
        let current = open(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            dir: dir.into(),
            name,
            old_name,
            current,
            spare,
            len: 0,
            max_bytes,
            can_exchange: true,
            rotations: 0,
        })
    }

    /// The file being written (`PATH`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file the previous contents go to (`PATH.1`).
    pub fn old_path(&self) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(".1");
        PathBuf::from(p)
    }

    /// How many times the file was rotated.
    pub fn rotations(&self) -> u64 {
        self.rotations
    }

    /// Moves the full file to `PATH.1` and starts an empty `PATH`.
    fn rotate(&mut self) -> io::Result<()> {
        if self.can_exchange {
            self.spare.set_len(0)?;
            // SAFETY: renameat2 reads two NUL-terminated names we own; `dir` is an open
            // directory descriptor we own. It only renames directory entries.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_renameat2,
                    self.dir.as_raw_fd(),
                    self.name.as_ptr(),
                    self.dir.as_raw_fd(),
                    self.old_name.as_ptr(),
                    libc::RENAME_EXCHANGE,
                )
            };
            if r == 0 {
                std::mem::swap(&mut self.current, &mut self.spare);
                self.len = 0;
                self.rotations += 1;
                return Ok(());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => {
                    self.can_exchange = false
                }
                _ => return Err(e),
            }
        }
        self.current.set_len(0)?;
        self.len = 0;
        self.rotations += 1;
        Ok(())
    }
}

impl Write for RotatingFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let room = self.max_bytes.saturating_sub(self.len);
        if buf.len() as u64 > room && self.len > 0 {
            self.rotate()?;
        }
        let room = self.max_bytes.saturating_sub(self.len);
        let n = usize::try_from(room).unwrap_or(usize::MAX).min(buf.len());
        let written = self.current.write(&buf[..n])?;
        self.len += written as u64;
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.current.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(p: &Path) -> Vec<u8> {
        std::fs::read(p).unwrap()
    }

    #[test]
    fn below_the_cap_everything_is_kept_in_one_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("console");
        let mut f = RotatingFile::create(&p, 1000).unwrap();
        let mut all = Vec::new();
        for i in 0..100u8 {
            // Byte by byte, as the UART writes.
            f.write_all(&[i]).unwrap();
            all.push(i);
        }
        f.write_all(&[7u8; 900]).unwrap();
        all.extend_from_slice(&[7u8; 900]);
        f.flush().unwrap();
        assert_eq!(read(&p), all);
        assert_eq!(read(&f.old_path()), b"");
        assert_eq!(f.rotations(), 0);
    }

    #[test]
    fn a_full_file_moves_to_dot_1_and_a_fresh_one_starts() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("vmm.log");
        let mut f = RotatingFile::create(&p, 10).unwrap();
        f.write_all(b"0123456789").unwrap();
        assert_eq!(read(&p), b"0123456789");
        f.write_all(b"abc").unwrap();
        assert_eq!(read(&p), b"abc");
        assert_eq!(read(&dir.path().join("vmm.log.1")), b"0123456789");
        // Exactly the room left: no rotation yet.
        f.write_all(b"defghij").unwrap();
        assert_eq!(read(&p), b"abcdefghij");
        // A line that does not fit the room left goes whole into a fresh file.
        f.write_all(b"line\n").unwrap();
        assert_eq!(read(&p), b"line\n");
        assert_eq!(read(&dir.path().join("vmm.log.1")), b"abcdefghij");
        assert_eq!(f.rotations(), 2);
        // Only the two files exist.
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["vmm.log", "vmm.log.1"]);
    }

    #[test]
    fn the_cap_holds_and_the_newest_bytes_survive_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c");
        let cap = 4096;
        let mut f = RotatingFile::create(&p, cap).unwrap();
        let mut all = Vec::new();
        for i in 0..5000u32 {
            let line = format!("line {i}\n");
            f.write_all(line.as_bytes()).unwrap();
            all.extend_from_slice(line.as_bytes());
            let (a, b) = (read(&p).len() as u64, read(&f.old_path()).len() as u64);
            assert!(a <= cap && b <= cap, "{a} {b}");
        }
        let mut kept = read(&f.old_path());
        kept.extend(read(&p));
        assert!(all.ends_with(&kept));
        // Lines are never split between the files: each starts with a whole line.
        assert!(read(&p).starts_with(b"line "));
        assert!(read(&f.old_path()).starts_with(b"line "));
        // At least a cap's worth, less one line, of the newest output is kept.
        assert!(kept.len() as u64 >= cap - 10, "{}", kept.len());
    }

    #[test]
    fn a_write_larger_than_the_cap_is_cut_into_cap_sized_pieces() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c");
        let mut f = RotatingFile::create(&p, 4).unwrap();
        f.write_all(b"abcdefghij").unwrap();
        assert_eq!(read(&p), b"ij");
        assert_eq!(read(&f.old_path()), b"efgh");
    }

    #[test]
    fn creating_empties_old_files_and_refuses_bad_settings() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c");
        std::fs::write(&p, b"old run").unwrap();
        std::fs::write(dir.path().join("c.1"), b"older run").unwrap();
        let f = RotatingFile::create(&p, 10).unwrap();
        assert_eq!(read(&p), b"");
        assert_eq!(read(&f.old_path()), b"");
        assert!(matches!(
            RotatingFile::create(&p, 0),
            Err(RotatingFileError::ZeroCap { .. })
        ));
        assert!(matches!(
            RotatingFile::create(Path::new("/"), 10),
            Err(RotatingFileError::BadPath { .. })
        ));
        let e = RotatingFile::create(&dir.path().join("no/such/dir/c"), 10).unwrap_err();
        assert!(matches!(e, RotatingFileError::Dir { .. }), "{e}");
        assert!(e.to_string().contains("no/such/dir/c"), "{e}");
        // A directory where the file should be.
        std::fs::create_dir(dir.path().join("d")).unwrap();
        let e = RotatingFile::create(&dir.path().join("d"), 10).unwrap_err();
        assert!(matches!(e, RotatingFileError::Open { .. }), "{e}");
    }
}
