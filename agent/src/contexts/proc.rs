//! One context process (a python, javascript, typescript, R or java driver, or a bash) and the
//! agent's end of its descriptors.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::sys;
use crate::protocol::{self, Exception, ExitStatus, FrameReader, MimeBundle, MAX_FRAME};
use crate::reaper::Children;

/// What a driver sends on its control socket (see `agent/python/ember_driver.py`).
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum DriverEvent {
    /// The driver is ready (started, forked, or set up).
    Ready {
        /// Its pid.
        pid: i32,
        /// Its working directory.
        #[serde(default)]
        cwd: String,
    },
    /// The value of the cell's last expression.
    Result {
        /// The MIME bundle.
        data: MimeBundle,
        /// The cell's number.
        #[serde(default)]
        execution_count: Option<u64>,
    },
    /// A display.
    Display {
        /// The MIME bundle.
        data: MimeBundle,
        /// Its metadata.
        #[serde(default)]
        metadata: Option<MimeBundle>,
    },
    /// The cell raised.
    Exception(Exception),
    /// The cell is over.
    End {
        /// `ok`, `error` or `interrupted`.
        status: String,
        /// The cell's number.
        #[serde(default)]
        execution_count: Option<u64>,
    },
    /// A request failed (setup).
    Error {
        /// Why.
        message: String,
    },
    /// Something newer.
    #[serde(other)]
    Unknown,
}

/// The bash context's files: the cell the loop sources, and the env restore script.
#[derive(Debug)]
pub struct BashFiles {
    /// The context's directory under the state directory.
    pub dir: PathBuf,
    /// `dir/cell`, kept open: a cell costs a `pwrite` and an `ftruncate`.
    pub cell: File,
}

/// A running context process.
#[derive(Debug)]
pub struct Proc {
    /// Its pid (and process group: it leads its own session).
    pub pid: libc::pid_t,
    /// Its pidfd, when it is the agent's own child (bash, a cold driver, the zygote); forked
    /// python contexts are re-parented to PID 1 and are watched through `ctl` only.
    pub pidfd: Option<OwnedFd>,
    /// The control socket (python: framed JSON both ways; the other drivers: field requests in
    /// (see [`fields_frame`]), events out on `events`; bash: a trigger line in, a status line out).
    pub ctl: UnixStream,
    /// The javascript, typescript, R and java drivers' events (the read end of a pipe: those
    /// runtimes cannot write to a socket they inherited, but can open a pipe by its /dev/fd path).
    pub events: Option<File>,
    /// Frames from a python driver.
    pub reader: FrameReader,
    /// Status line bytes from bash.
    pub line: Vec<u8>,
    /// Its stdout and stderr (read ends, non-blocking); None once at EOF.
    pub pipes: [Option<File>; 2],
    /// Its working directory when it started.
    pub cwd: String,
    /// Bash only.
    pub bash: Option<BashFiles>,
    /// To reap it (when it is our child).
    pub children: Children,
    /// Whether it was reaped (its status is known).
    pub status: Option<ExitStatus>,
    /// The `sync` generation its RNGs were last seeded in (see `Contexts::note_sync`).
    pub seeded_gen: u64,
    /// Started at the lowest CPU priority (a spare made in a sandbox).
    pub niced: bool,
}

impl Proc {
    /// A process around its descriptors.
    pub fn new(
        pid: libc::pid_t,
        pidfd: Option<OwnedFd>,
        ctl: UnixStream,
        pipes: [File; 2],
        children: Children,
    ) -> Self {
        let [out, err] = pipes;
        Self {
            pid,
            pidfd,
            ctl,
            events: None,
            reader: FrameReader::new(MAX_FRAME),
            line: Vec::new(),
            pipes: [Some(out), Some(err)],
            cwd: String::new(),
            bash: None,
            children,
            status: None,
            seeded_gen: 0,
            niced: false,
        }
    }

    /// Sends one framed JSON message to a python driver.
    pub fn send_json(&self, msg: &serde_json::Value) -> io::Result<()> {
        let mut frame = Vec::new();
        protocol::encode_frame(msg, &mut frame, MAX_FRAME)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        sys::send_all(&self.ctl, &frame)
    }

    /// Sends one request to a javascript, typescript, R or java driver (see [`fields_frame`]).
    pub fn send_fields(&self, fields: &[(&str, &str)]) -> io::Result<()> {
        let frame = fields_frame(fields)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        sys::send_all(&self.ctl, &frame)
    }

    /// One read from the control socket (or the events pipe), then every complete driver
    /// message buffered. `Ok(None)` at EOF.
    pub fn read_driver(&mut self) -> io::Result<Option<Vec<DriverEvent>>> {
        let n = match &mut self.events {
            Some(events) => self.reader.fill(events)?,
            None => self.reader.fill(&mut self.ctl)?,
        };
        if n == 0 {
            return Ok(None);
        }
        let mut events = Vec::new();
        loop {
            match self.reader.next_buffered() {
                Ok(Some(body)) => events.push(
                    serde_json::from_slice(body)
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?,
                ),
                Ok(None) => return Ok(Some(events)),
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
            }
        }
    }

    /// One read from bash's control socket, then the complete status lines. `Ok(None)` at EOF.
    pub fn read_status_lines(&mut self) -> io::Result<Option<Vec<i32>>> {
        let mut buf = [0u8; 256];
        let n = loop {
            match (&self.ctl).read(&mut buf) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        };
        if n == 0 {
            return Ok(None);
        }
        self.line.extend_from_slice(&buf[..n]);
        let mut codes = Vec::new();
        while let Some(nl) = self.line.iter().position(|&b| b == b'\n') {
            let text = String::from_utf8_lossy(&self.line[..nl]).trim().to_owned();
            self.line.drain(..=nl);
            codes.push(text.parse().unwrap_or(1));
        }
        if self.line.len() > 64 {
            self.line.clear();
        }
        Ok(Some(codes))
    }

    /// Writes a bash cell (one `pwrite`, one `ftruncate`).
    pub fn write_cell(&self, code: &[u8]) -> io::Result<()> {
        let Some(bash) = &self.bash else {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "not a bash context",
            ));
        };
        bash.cell.write_all_at(code, 0)?;
        bash.cell.set_len(code.len() as u64)
    }

    /// The descriptors watched while code runs: where events come from (ctl or the events
    /// pipe), stdout, stderr, pidfd (-1: none).
    pub fn poll_fds(&self) -> [RawFd; 4] {
        let pipe = |i: usize| self.pipes[i].as_ref().map_or(-1, AsRawFd::as_raw_fd);
        [
            self.events
                .as_ref()
                .map_or_else(|| self.ctl.as_raw_fd(), AsRawFd::as_raw_fd),
            pipe(0),
            pipe(1),
            self.pidfd.as_ref().map_or(-1, AsRawFd::as_raw_fd),
        ]
    }

    /// Reads a pipe until it is empty (or at EOF); hands each chunk to `out`.
    pub fn drain_pipe(&mut self, index: usize, buf: &mut [u8], mut out: impl FnMut(&[u8])) {
        let Some(pipe) = &mut self.pipes[index] else {
            return;
        };
        loop {
            match pipe.read(buf) {
                Ok(0) => {
                    self.pipes[index] = None;
                    return;
                }
                Ok(n) => {
                    out(&buf[..n]);
                    if n < buf.len() {
                        return; // a pipe read returns all there is: it is empty now
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => {
                    self.pipes[index] = None;
                    return;
                }
            }
        }
    }

    /// Reaps the process if it is our child and has exited (after its pidfd was readable or
    /// after a kill); returns its status when known.
    pub fn reap(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() && self.pidfd.is_some() {
            self.status = self.children.wait(self.pid).ok();
        }
        self.status
    }

    /// The exit status of a process that is exiting (its control socket closed): waits up to
    /// `limit` for our child to exit, then kills it. None when it is not our child.
    pub fn reap_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let fd = self.pidfd.as_ref()?.as_raw_fd();
        if self.status.is_none() {
            let exited = poll(&[(fd, libc::POLLIN)], Some(Instant::now() + limit));
            if !matches!(exited, Ok(Some(_))) {
                sys::signal_group(self.pid, libc::SIGKILL);
            }
        }
        self.reap()
    }

    /// Kills the whole process group and reaps the process if it is our child.
    pub fn kill(&mut self) {
        if self.status.is_none() {
            sys::signal_group(self.pid, libc::SIGKILL);
            self.reap();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if let Some(bash) = &self.bash {
            let _ = std::fs::remove_dir_all(&bash.dir);
        }
    }
}

/// A request to a javascript, typescript, R or java driver: one frame (u32 LE length) whose body
/// is the fields in order, each `NAME LEN\n` + LEN bytes + `\n` (LEN in bytes, decimal). Simpler
/// to read than JSON in a driver written in R or Java with their standard libraries only. A
/// name has no space or newline (the agent's own names: `op`, `code`, `cwd`, `reseed`, `env.KEY`
/// with a checked KEY).
pub fn fields_frame(fields: &[(&str, &str)]) -> Result<Vec<u8>, protocol::FrameError> {
    let mut body = Vec::new();
    for (name, value) in fields {
        body.extend_from_slice(name.as_bytes());
        body.extend_from_slice(format!(" {}\n", value.len()).as_bytes());
        body.extend_from_slice(value.as_bytes());
        body.push(b'\n');
    }
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&n| n <= MAX_FRAME)
        .ok_or(protocol::FrameError::TooLarge {
            len: body.len() as u64,
            max: MAX_FRAME,
        })?;
    let mut frame = Vec::with_capacity(body.len() + 4);
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Milliseconds until `deadline` for `poll` (rounded up; -1: none).
pub fn poll_timeout(deadline: Option<Instant>) -> libc::c_int {
    match deadline {
        None => -1,
        Some(deadline) => {
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = left.as_millis() + u128::from(left.subsec_nanos() % 1_000_000 != 0);
            libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
        }
    }
}

/// `poll` on `fds` (negative entries ignored) with `events` each; returns the revents, or
/// None on timeout. EINTR is retried.
pub fn poll(
    fds: &[(RawFd, libc::c_short)],
    deadline: Option<Instant>,
) -> io::Result<Option<Vec<libc::c_short>>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&(fd, events)| libc::pollfd {
            fd,
            events,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: `pfds` is a valid array of pollfd for its length.
        let n = unsafe {
            libc::poll(
                pfds.as_mut_ptr(),
                pfds.len() as libc::nfds_t,
                poll_timeout(deadline),
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Ok(None);
        }
        return Ok(Some(pfds.iter().map(|p| p.revents).collect()));
    }
}

/// Waits for a driver's `ready`, discarding its start-up output. Returns (pid, cwd).
pub fn wait_ready(proc: &mut Proc, timeout: Duration) -> Result<(i32, String), String> {
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let [ctl, out, err, pidfd] = proc.poll_fds();
        let revents = poll(
            &[
                (ctl, libc::POLLIN),
                (out, libc::POLLIN),
                (err, libc::POLLIN),
                (pidfd, libc::POLLIN),
            ],
            Some(deadline),
        )
        .map_err(|e| format!("poll failed: {e}"))?
        .ok_or_else(|| format!("no answer within {timeout:?}"))?;
        for i in 0..2 {
            if revents[i + 1] != 0 {
                proc.drain_pipe(i, &mut buf, |_| {});
            }
        }
        if revents[0] != 0 {
            match proc.read_driver() {
                Ok(Some(events)) => {
                    for event in events {
                        match event {
                            DriverEvent::Ready { pid, cwd } => return Ok((pid, cwd)),
                            DriverEvent::Error { message } => return Err(message),
                            _ => {}
                        }
                    }
                }
                Ok(None) => return Err(exit_reason(proc, "the driver closed its control socket")),
                Err(e) => return Err(format!("reading the driver failed: {e}")),
            }
        } else if revents[3] != 0 {
            return Err(exit_reason(proc, "the driver exited"));
        }
    }
}

/// "the driver exited: exited with status 1" (when the status is known).
fn exit_reason(proc: &mut Proc, what: &str) -> String {
    match proc.reap_within(Duration::from_secs(1)) {
        Some(status) => format!("{what} ({status})"),
        None => what.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_frame_is_length_prefixed_fields() {
        let frame = fields_frame(&[("op", "run"), ("code", "é\n1")]).unwrap();
        let body = b"op 3\nrun\ncode 4\n\xc3\xa9\n1\n";
        assert_eq!(&frame[..4], &(body.len() as u32).to_le_bytes());
        assert_eq!(&frame[4..], body);
        assert_eq!(fields_frame(&[]).unwrap(), vec![0, 0, 0, 0]);
    }
}
