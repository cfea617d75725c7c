//! Where the VMM's own log (`tracing`) goes: stderr, or a size-capped file (`--log-file`)
//! written by a thread of its own.
//!
//! With a log file, a thread that logs (a vCPU thread, the event loop, the prefetch thread)
//! formats its line and hands it to the `log-writer` thread through a bounded queue of
//! [`QUEUE_LINES`] lines without waiting: when the queue is full the line is dropped and
//! counted, and the writer adds `ember-vmm: N log lines dropped ...` to the file when it next
//! writes. So a slow or full disk never stalls a vCPU. The writer thread writes into a
//! [`RotatingFile`] and runs under its own seccomp filter (`vmm/seccomp/log.json`:
//! `write`, `ftruncate` and `renameat2(RENAME_EXCHANGE)` for rotation, memory and exit).
//!
//! Lines that guests can cause are rate-limited where they are logged
//! (`ember_devices::ratelimit`); this queue is the last line of defence for the rest.
//!
//! The filter comes from `EMBER_LOG` (`tracing_subscriber::EnvFilter` syntax; default `warn`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use crate::rotating_file::{RotatingFile, RotatingFileError};

/// Lines the queue to the writer thread holds; beyond that, lines are dropped and counted.
pub const QUEUE_LINES: usize = 4096;
/// How long [`LogGuard`]'s drop waits for the writer to write what is queued.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// Where the log goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTarget {
    /// Standard error, written by the thread that logs (the default).
    Stderr,
    /// A file capped at `max_bytes` (rotated to `PATH.1`), written by the `log-writer` thread.
    File {
        /// The file.
        path: PathBuf,
        /// Its size cap.
        max_bytes: u64,
    },
}

/// Errors setting up the log.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    /// The log file cannot be made.
    #[error("log file: {0}")]
    File(#[from] RotatingFileError),
    /// The writer thread cannot be started.
    #[error("cannot start the log writer thread: {0}")]
    Thread(std::io::Error),
    /// A global `tracing` subscriber is already installed.
    #[error("a tracing subscriber is already installed: {0}")]
    AlreadyInstalled(String),
}

enum Msg {
    Line(Vec<u8>),
    Flush(SyncSender<()>),
}

/// The sending side, one per log line (`tracing_subscriber`'s `MakeWriter`).
#[derive(Debug, Clone)]
pub struct QueueWriter {
    tx: SyncSender<Msg>,
    dropped: Arc<AtomicU64>,
}

impl Write for QueueWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // The formatter hands over one whole line per call; never wait for room.
        match self.tx.try_send(Msg::Line(buf.to_vec())) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for QueueWriter {
    type Writer = QueueWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Keeps the log writer alive; dropping it writes out what is queued (waiting at most 1 s).
#[derive(Debug, Default)]
pub struct LogGuard {
    flush: Option<SyncSender<Msg>>,
}

impl LogGuard {
    /// Waits (at most 1 s) until every line queued so far is in the file.
    pub fn flush(&self) {
        let Some(tx) = &self.flush else {
            return;
        };
        let (ack_tx, ack_rx) = mpsc::sync_channel(1);
        // Waiting for room here is fine: this runs on the main thread at exit.
        if tx.send(Msg::Flush(ack_tx)).is_ok() {
            let _ = ack_rx.recv_timeout(FLUSH_TIMEOUT);
        }
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        self.flush();
    }
}

/// A queue to a writer thread that writes into `file`: the writer for the subscriber, and the
/// guard that flushes it.
pub fn spawn_writer(file: RotatingFile) -> Result<(QueueWriter, LogGuard), LoggingError> {
    let (tx, rx) = mpsc::sync_channel(QUEUE_LINES);
    let dropped = Arc::new(AtomicU64::new(0));
    let d2 = dropped.clone();
    std::thread::Builder::new()
        .name("log-writer".into())
        .spawn(move || {
            if let Err(e) = crate::seccomp::install_configured(crate::seccomp::ThreadKind::Log) {
                // Nothing is written unfiltered: the lines queue up and are then dropped.
                eprintln!("ember-vmm: log file disabled: {e}");
                return;
            }
            write_lines(rx, file, &d2);
        })
        .map_err(LoggingError::Thread)?;
    Ok((
        QueueWriter {
            tx: tx.clone(),
            dropped,
        },
        LogGuard { flush: Some(tx) },
    ))
}

/// The writer thread's loop: until every sender is gone.
fn write_lines(rx: Receiver<Msg>, mut out: impl Write, dropped: &AtomicU64) {
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Line(line) => {
                let n = dropped.swap(0, Ordering::Relaxed);
                if n > 0 {
                    let note =
                        format!("ember-vmm: {n} log lines dropped (the log writer fell behind)\n");
                    let _ = out.write_all(note.as_bytes());
                }
                // A full disk or a failed rotation loses the line; there is nowhere to say so.
                let _ = out.write_all(&line);
            }
            Msg::Flush(ack) => {
                let _ = out.flush();
                let _ = ack.send(());
            }
        }
    }
}

/// Installs the global `tracing` subscriber writing to `target` with the `EMBER_LOG` filter.
/// Keep the guard until the process ends.
pub fn init(target: &LogTarget) -> Result<LogGuard, LoggingError> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("EMBER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    match target {
        LogTarget::Stderr => {
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .try_init()
                .map_err(|e| LoggingError::AlreadyInstalled(e.to_string()))?;
            Ok(LogGuard::default())
        }
        LogTarget::File { path, max_bytes } => {
            let (writer, guard) = spawn_writer(RotatingFile::create(path, *max_bytes)?)?;
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_ansi(false)
                .with_writer(writer)
                .try_init()
                .map_err(|e| LoggingError::AlreadyInstalled(e.to_string()))?;
            Ok(guard)
        }
    }
}

/// The log target for `--log-file`/`--log-max-bytes`.
pub fn target(path: Option<&Path>, max_bytes: Option<u64>) -> LogTarget {
    match path {
        None => LogTarget::Stderr,
        Some(p) => LogTarget::File {
            path: p.to_path_buf(),
            max_bytes: max_bytes.unwrap_or(crate::rotating_file::DEFAULT_MAX_BYTES),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::fmt::MakeWriter;

    #[test]
    fn lines_reach_the_capped_file_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("vmm.log");
        let (w, guard) = spawn_writer(RotatingFile::create(&p, 1 << 20).unwrap()).unwrap();
        for i in 0..100 {
            w.make_writer()
                .write_all(format!("line {i}\n").as_bytes())
                .unwrap();
        }
        guard.flush();
        let text = std::fs::read_to_string(&p).unwrap();
        let want: String = (0..100).map(|i| format!("line {i}\n")).collect();
        assert_eq!(text, want);
    }

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_waiting() {
        // No writer thread: nothing drains the queue.
        let (tx, rx) = mpsc::sync_channel(2);
        let dropped = Arc::new(AtomicU64::new(0));
        let w = QueueWriter {
            tx,
            dropped: dropped.clone(),
        };
        let t = std::time::Instant::now();
        for i in 0..10 {
            let n = w.make_writer().write(format!("l{i}\n").as_bytes()).unwrap();
            assert_eq!(n, 3);
        }
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(dropped.load(Ordering::Relaxed), 8);
        // The writer reports the drops before the next line it writes.
        drop(w);
        let mut out = Vec::new();
        write_lines(rx, &mut out, &dropped);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            "ember-vmm: 8 log lines dropped (the log writer fell behind)\nl0\nl1\n"
        );
    }

    #[test]
    fn the_file_target_is_capped_by_default() {
        assert_eq!(target(None, Some(5)), LogTarget::Stderr);
        assert_eq!(
            target(Some(Path::new("/l")), None),
            LogTarget::File {
                path: "/l".into(),
                max_bytes: 4 << 20
            }
        );
    }
}
