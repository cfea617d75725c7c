//! Host Unix-socket helpers: the listening socket, non-blocking connects, the `CONNECT` line.

use std::ffi::OsString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// Longest `CONNECT <port>\n` line accepted from a host client (`ATTACH <port> <host port>\r\n`
/// with two 10-digit numbers is 30 bytes).
pub const MAX_CONNECT_LINE: usize = 32;

/// A listening socket this device created, with the identity of its file so that only that
/// file is ever unlinked.
#[derive(Debug)]
pub struct Listener {
    pub sock: UnixListener,
    pub path: PathBuf,
    ident: (u64, u64),
}

impl Listener {
    /// Binds `path` (non-blocking). A stale socket file there (nobody accepts on it) is removed
    /// first; a live one, or any other kind of file, is left alone and the bind fails.
    pub fn bind(path: &Path) -> io::Result<Self> {
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => {
                if connect_nonblocking(path).is_ok() {
                    return Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        "another process is listening on this socket",
                    ));
                }
                std::fs::remove_file(path)?
            }
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "a file that is not a socket exists there",
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let sock = UnixListener::bind(path)?;
        sock.set_nonblocking(true)?;
        let m = std::fs::symlink_metadata(path)?;
        Ok(Self {
            sock,
            path: path.to_path_buf(),
            ident: (m.dev(), m.ino()),
        })
    }

    /// Removes the socket file if it is still the one this listener created.
    pub fn unlink(&self) {
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.ident {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

/// `<base>_<port>`: where guest connections to host port `port` go.
pub fn port_path(base: &Path, port: u32) -> PathBuf {
    let mut p = OsString::from(base.as_os_str());
    p.push(format!("_{port}"));
    PathBuf::from(p)
}

/// Connects to the Unix stream socket at `path` without ever blocking: a listener whose
/// backlog is full fails with `WouldBlock` instead of stalling the event loop. The stream is
/// returned in non-blocking mode.
pub fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: `sockaddr_un` is plain old data; all zeroes is a valid (empty) address.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    // Leave room for the terminating NUL; an empty path or an embedded NUL is not a path.
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path is empty, too long or contains NUL",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: plain syscall with constant arguments; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `addr` is a valid, initialised `sockaddr_un` that outlives the call and `len`
    // does not exceed its size (checked above); `fd` is an open socket.
    let r = unsafe {
        libc::connect(
            fd,
            std::ptr::addr_of!(addr).cast::<libc::sockaddr>(),
            len as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(owned))
}

/// `send(2)` with `MSG_NOSIGNAL`: a peer that went away yields `EPIPE`, never a `SIGPIPE`,
/// whatever the process's signal disposition.
pub fn send_nosignal(sock: &UnixStream, buf: &[u8]) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: `buf` is a valid readable slice for its length for the duration of the call and
    // `sock` is an open socket; the result is checked.
    let r = unsafe {
        libc::send(
            sock.as_raw_fd(),
            buf.as_ptr().cast::<libc::c_void>(),
            buf.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    usize::try_from(r).map_err(|_| io::Error::last_os_error())
}

/// What a host client's first line asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectLine {
    /// More bytes are needed.
    Incomplete,
    /// `CONNECT <port>`; `consumed` bytes (through the newline) belong to the line.
    Connect {
        /// The guest port.
        port: u32,
        /// Length of the line including `\n`.
        consumed: usize,
    },
    /// `ATTACH <port>` or `ATTACH <port> <host port>`: take over a connection to that guest
    /// port kept by the snapshot this device was restored from (with `host_port`, exactly the
    /// one with that host port), or else connect as `CONNECT` does.
    Attach {
        /// The guest port.
        port: u32,
        /// The kept connection's host port, when the client names one.
        host_port: Option<u32>,
        /// Length of the line including `\n`.
        consumed: usize,
    },
    /// Anything else.
    Invalid,
}

/// Parses `CONNECT <port>\n`, `ATTACH <port>\n` or `ATTACH <port> <host port>\n` (a `\r`
/// before the newline is tolerated) from the start of `buf`.
pub fn parse_connect_line(buf: &[u8]) -> ConnectLine {
    let Some(nl) = buf.iter().position(|&b| b == b'\n') else {
        return if buf.len() >= MAX_CONNECT_LINE {
            ConnectLine::Invalid
        } else {
            ConnectLine::Incomplete
        };
    };
    if nl >= MAX_CONNECT_LINE {
        return ConnectLine::Invalid;
    }
    let line = &buf[..nl];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let consumed = nl + 1;
    if let Some(port) = line.strip_prefix(b"CONNECT ") {
        return match decimal(port) {
            Some(port) => ConnectLine::Connect { port, consumed },
            None => ConnectLine::Invalid,
        };
    }
    let Some(rest) = line.strip_prefix(b"ATTACH ") else {
        return ConnectLine::Invalid;
    };
    let mut words = rest.splitn(2, |&b| b == b' ');
    let port = words.next().and_then(decimal);
    let host_port = match words.next() {
        None => Some(None),
        Some(w) => decimal(w).map(Some),
    };
    match (port, host_port) {
        (Some(port), Some(host_port)) => ConnectLine::Attach {
            port,
            host_port,
            consumed,
        },
        _ => ConnectLine::Invalid,
    }
}

/// A `u32` written as plain ASCII digits (no sign, no spaces, not empty).
fn decimal(s: &[u8]) -> Option<u32> {
    if s.is_empty() || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(s).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn connect_line_parsing() {
        assert_eq!(
            parse_connect_line(b"CONNECT 52\nxyz"),
            ConnectLine::Connect {
                port: 52,
                consumed: 11
            }
        );
        assert_eq!(
            parse_connect_line(b"CONNECT 4294967295\r\n"),
            ConnectLine::Connect {
                port: u32::MAX,
                consumed: 20
            }
        );
        assert_eq!(parse_connect_line(b"CONNECT 5"), ConnectLine::Incomplete);
        assert_eq!(
            parse_connect_line(b"ATTACH 1024\n"),
            ConnectLine::Attach {
                port: 1024,
                host_port: None,
                consumed: 12
            }
        );
        assert_eq!(
            parse_connect_line(b"ATTACH 4294967295 4294967295\r\nrest"),
            ConnectLine::Attach {
                port: u32::MAX,
                host_port: Some(u32::MAX),
                consumed: 30
            }
        );
        assert_eq!(parse_connect_line(b""), ConnectLine::Incomplete);
        for bad in [
            &b"CONNECT 4294967296\n"[..],
            b"CONNECT -1\n",
            b"CONNECT +1\n",
            b"CONNECT \n",
            b"connect 5\n",
            b"CONNECT  5\n",
            b"HELLO\n",
            b"ATTACH\n",
            b"ATTACH x\n",
            b"attach 5\n",
            b"ATTACH 5 \n",
            b"ATTACH 5  6\n",
            b"ATTACH 5 6 7\n",
            b"ATTACH 5 x\n",
            b"ATTACH 5 4294967296\n",
            &[b'1'; 40],
        ] {
            assert_eq!(parse_connect_line(bad), ConnectLine::Invalid, "{bad:?}");
        }
    }

    #[test]
    fn bind_replaces_stale_sockets_but_not_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("v.sock");
        let first = Listener::bind(&p).unwrap();
        drop(first);
        // The stale socket file is still there; binding again replaces it.
        let l = Listener::bind(&p).unwrap();
        // A live listener is not taken over.
        let live_path = dir.path().join("live.sock");
        let live = UnixListener::bind(&live_path).unwrap();
        assert_eq!(
            Listener::bind(&live_path).unwrap_err().kind(),
            io::ErrorKind::AddrInUse
        );
        drop(live);
        let f = dir.path().join("plain");
        std::fs::write(&f, b"keep me").unwrap();
        assert!(Listener::bind(&f).is_err());
        assert_eq!(std::fs::read(&f).unwrap(), b"keep me");
        // Unlink only removes our own file.
        l.unlink();
        assert!(!p.exists());
        let other = UnixListener::bind(&p).unwrap();
        l.unlink();
        assert!(p.exists());
        drop(other);
    }

    #[test]
    fn nonblocking_connect() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("v.sock");
        let p = port_path(&base, 77);
        assert!(p.to_string_lossy().ends_with("v.sock_77"));
        assert!(connect_nonblocking(&p).is_err());
        let l = UnixListener::bind(&p).unwrap();
        let mut c = connect_nonblocking(&p).unwrap();
        let (mut s, _) = l.accept().unwrap();
        s.write_all(b"hi").unwrap();
        let mut b = [0u8; 2];
        // Non-blocking: data is there already.
        c.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"hi");
        let mut more = [0u8; 1];
        assert_eq!(
            c.read(&mut more).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        let long = dir.path().join("x".repeat(200));
        assert!(connect_nonblocking(&long).is_err());
    }
}
