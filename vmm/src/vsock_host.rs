//! The host side of the vsock device's Unix-socket protocol, for clients in Rust: connect to
//! the device's socket and send `CONNECT <port>\n` (a new connection: the guest must accept it)
//! or `ATTACH <port> [<host port>]\n` (take over a connection to that guest port that the
//! snapshot kept — with a host port, exactly that one —, or a new one when there is none); the
//! device answers `OK <host port>\n` and the stream is open. The host port in the answer tells
//! an `ATTACH` client which it got: the kept connection's, or a fresh one.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// Longest reply line accepted.
const MAX_REPLY: usize = 32;

/// `ATTACH <port>`: the snapshot's connection to `port` when there is one (the guest then sees
/// nothing until the first request), else a new connection as with [`connect`].
pub fn attach(uds: &Path, port: u32, timeout: Duration) -> io::Result<UnixStream> {
    handshake(uds, &format!("ATTACH {port}\n"), timeout)
}

/// `CONNECT <port>`: a new connection to guest port `port`.
pub fn connect(uds: &Path, port: u32, timeout: Duration) -> io::Result<UnixStream> {
    handshake(uds, &format!("CONNECT {port}\n"), timeout)
}

/// [`connect`], also returning the connection's host port (from the `OK` line).
pub fn connect_port(uds: &Path, port: u32, timeout: Duration) -> io::Result<(UnixStream, u32)> {
    handshake_port(uds, &format!("CONNECT {port}\n"), timeout)
}

/// `ATTACH <port> <host_port>`: the kept connection to `port` with exactly that host port,
/// else a new connection. Returns the stream and the host port it got: `host_port` means the
/// kept connection, anything else a new one (the guest had to accept it).
pub fn attach_exact(
    uds: &Path,
    port: u32,
    host_port: u32,
    timeout: Duration,
) -> io::Result<(UnixStream, u32)> {
    handshake_port(uds, &format!("ATTACH {port} {host_port}\n"), timeout)
}

fn handshake(uds: &Path, line: &str, timeout: Duration) -> io::Result<UnixStream> {
    handshake_port(uds, line, timeout).map(|(s, _)| s)
}

fn handshake_port(uds: &Path, line: &str, timeout: Duration) -> io::Result<(UnixStream, u32)> {
    let deadline = Instant::now() + timeout;
    let mut s = loop {
        match UnixStream::connect(uds) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => break r?,
        }
    };
    s.set_write_timeout(Some(timeout))?;
    s.write_all(line.as_bytes())?;
    // One byte at a time: what follows the line belongs to the caller's protocol.
    let mut reply = Vec::with_capacity(MAX_REPLY);
    let mut b = [0u8; 1];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer to {:?} within {timeout:?}", line.trim_end()),
            ));
        }
        s.set_read_timeout(Some(left))?;
        // A read with a timeout (SO_RCVTIMEO) is never restarted after a signal handler ran,
        // SA_RESTART or not (signal(7)): a caller's SIGCHLD must not fail the handshake.
        let n = match s.read(&mut b) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => r?,
        };
        match n {
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    format!(
                        "the VMM closed the connection after {:?}: nothing listens on that guest \
                         port, or the guest is not up",
                        line.trim_end()
                    ),
                ))
            }
            _ if b[0] == b'\n' => break,
            _ if reply.len() >= MAX_REPLY => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "no newline in the VMM's reply",
                ))
            }
            _ => reply.push(b[0]),
        }
    }
    let text = String::from_utf8_lossy(&reply);
    let host_port = text
        .strip_prefix("OK ")
        .filter(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()))
        .and_then(|n| n.parse::<u32>().ok());
    let Some(host_port) = host_port else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unexpected reply {text:?} to {:?}", line.trim_end()),
        ));
    };
    s.set_read_timeout(None)?;
    s.set_write_timeout(None)?;
    Ok((s, host_port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn fake_vmm(reply: &'static [u8]) -> (tempfile::TempDir, std::path::PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("v.sock");
        let l = UnixListener::bind(&p).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut line = [0u8; 12];
            s.read_exact(&mut line).unwrap();
            assert_eq!(&line, b"ATTACH 1024\n");
            s.write_all(reply).unwrap();
        });
        (d, p)
    }

    #[test]
    fn attach_reads_exactly_the_reply_line() {
        let (_d, p) = fake_vmm(b"OK 1073741825\nrest");
        let mut s = attach(&p, 1024, Duration::from_secs(5)).unwrap();
        let mut rest = [0u8; 4];
        s.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"rest");
    }

    #[test]
    fn the_host_port_comes_back() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("v.sock");
        let l = UnixListener::bind(&p).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut line = [0u8; 16];
            s.read_exact(&mut line).unwrap();
            assert_eq!(&line, b"ATTACH 1024 777\n");
            s.write_all(b"OK 777\n").unwrap();
        });
        let (_s, port) = attach_exact(&p, 1024, 777, Duration::from_secs(5)).unwrap();
        assert_eq!(port, 777);
    }

    #[test]
    fn bad_replies_are_errors() {
        let (_d, p) = fake_vmm(b"NO\n");
        let e = attach(&p, 1024, Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("unexpected reply \"NO\""), "{e}");
        let (_d, p) = fake_vmm(b"");
        let e = attach(&p, 1024, Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
    }

    extern "C" fn noop(_: libc::c_int) {}

    #[test]
    fn a_signal_while_waiting_for_the_answer_is_not_an_error() {
        // A handler without SA_RESTART, as a read with SO_RCVTIMEO gets EINTR whatever the flag.
        // SAFETY: all-zero bytes are a valid `sigaction` (no flags, an empty mask).
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = noop as *const () as usize;
        // SAFETY: `sa` is a valid sigaction whose handler does nothing; SIGUSR2 is used by
        // nothing else in this test binary.
        let rc = unsafe { libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut()) };
        assert_eq!(rc, 0);
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("v.sock");
        let l = UnixListener::bind(&p).unwrap();
        // SAFETY: pthread_self has no preconditions.
        let me = unsafe { libc::pthread_self() };
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut line = [0u8; 13];
            s.read_exact(&mut line).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            // SAFETY: `me` is the test's thread, blocked in the handshake's read until the
            // reply below; SIGUSR2 has the no-op handler installed above.
            unsafe { libc::pthread_kill(me, libc::SIGUSR2) };
            std::thread::sleep(Duration::from_millis(200));
            s.write_all(b"OK 5\n").unwrap();
        });
        let (_s, port) = connect_port(&p, 1024, Duration::from_secs(10)).unwrap();
        assert_eq!(port, 5);
    }
}
