//! The tail of a running sandbox's VMM log or serial console, read from the host: both are
//! files the VMM writes in its jail (`/work/vmm.log`, `/work/console.log`; `jailed::vmm_args`),
//! each capped at `log_max_bytes`. No guest call. The serial console's bytes are the guest's:
//! callers must treat them as untrusted text.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{lock, Runtime, RuntimeError};

/// Largest tail answered, bytes.
pub const LOG_TAIL_MAX: u64 = 256 << 10;

/// Which of a sandbox's host-side logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum LogKind {
    /// The VMM's own log (`--log-file`).
    Vmm,
    /// What the guest wrote to its serial console (kernel messages, `/dev/ttyS0`).
    Serial,
}

impl LogKind {
    /// Its file inside the jail.
    fn path_in_jail(self) -> &'static str {
        match self {
            LogKind::Vmm => "/work/vmm.log",
            LogKind::Serial => "/work/console.log",
        }
    }
}

/// The end of a log.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LogTail {
    /// The log's size now, bytes.
    pub size: u64,
    /// Its last bytes (at most the asked for), as UTF-8 (invalid sequences replaced).
    pub text: String,
    /// Whether the tail starts after the log's first byte.
    pub cut: bool,
}

impl Runtime {
    /// The last `max_bytes` (at most [`LOG_TAIL_MAX`]) of sandbox `id`'s `kind` log. Only a
    /// sandbox with a VMM (creating, running, pausing) has one: the logs go with its jail.
    pub fn log_tail(
        &self,
        id: &str,
        kind: LogKind,
        max_bytes: u64,
    ) -> Result<LogTail, RuntimeError> {
        let slot = self.slot(id)?;
        let (vm, state) = {
            let st = lock(&slot.st);
            (st.vm.clone(), st.row.state)
        };
        let Some(vm) = vm else {
            return Err(RuntimeError::conflict(
                id,
                state,
                "only a sandbox with a VMM has logs (a paused or ended one has none)",
            ));
        };
        read_tail(
            &vm.host_path(kind.path_in_jail()),
            max_bytes.min(LOG_TAIL_MAX),
        )
    }
}

/// The last `max` bytes of `path` (a missing file: empty, the VMM has not written it yet).
/// The jail's `/work` is writable by the jailed VMM, so the file is opened without following
/// a symlink and without blocking (a FIFO), and read only if it is a regular file.
fn read_tail(path: &Path, max: u64) -> Result<LogTail, RuntimeError> {
    use std::os::unix::fs::OpenOptionsExt;
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path);
    let mut f = match opened {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(LogTail::default()),
        Err(e) => return Err(RuntimeError::io("open a sandbox log", path)(e)),
    };
    let meta = f
        .metadata()
        .map_err(RuntimeError::io("stat a sandbox log", path))?;
    if !meta.is_file() {
        return Err(RuntimeError::Internal(format!(
            "{}: not a regular file",
            path.display()
        )));
    }
    let size = meta.len();
    let start = size.saturating_sub(max);
    f.seek(SeekFrom::Start(start))
        .map_err(RuntimeError::io("seek in a sandbox log", path))?;
    let mut buf = Vec::with_capacity((size - start) as usize);
    f.take(max)
        .read_to_end(&mut buf)
        .map_err(RuntimeError::io("read a sandbox log", path))?;
    Ok(LogTail {
        size,
        text: String::from_utf8_lossy(&buf).into_owned(),
        cut: start > 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_is_the_last_bytes_and_says_when_cut() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("console.log");
        assert_eq!(read_tail(&p, 10).unwrap(), LogTail::default());
        std::fs::write(&p, b"first line\nsecond \xff line\n").unwrap();
        let t = read_tail(&p, 13).unwrap();
        assert_eq!((t.size, t.cut), (25, true));
        assert_eq!(t.text, "econd \u{fffd} line\n");
        let t = read_tail(&p, 1000).unwrap();
        assert!(!t.cut && t.text.starts_with("first line\n"));
        // Neither a symlink (to a host file) nor a FIFO (which would block) is read.
        let link = dir.path().join("vmm.log");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(read_tail(&link, 10).is_err());
        let fifo = dir.path().join("fifo.log");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) with a NUL-terminated path that lives for the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(read_tail(&fifo, 10).is_err());
    }
}
