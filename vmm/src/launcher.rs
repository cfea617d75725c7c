//! Spawning `ember-vmm` as a child process: what the CLI, the benchmarks and orchestrators
//! use so that every VM is its own process. The configuration goes in a JSON file, events come
//! back through the JSON-lines report file.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Instant;

use crate::report::monotonic_ns;
use crate::vm::VmConfig;

/// Errors launching a VMM.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The binary is nowhere to be found.
    #[error("cannot find the ember-vmm binary (set EMBER_VMM=/path/to/ember-vmm or install it next to {0})")]
    NoBinary(String),
    /// Files in the work directory.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Finds `ember-vmm`: `$EMBER_VMM`, then next to the running executable (and its parent, for
/// test binaries under `target/*/deps`), then `$PATH`.
pub fn find_vmm_binary() -> Result<PathBuf, LaunchError> {
    if let Some(p) = std::env::var_os("EMBER_VMM") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dirs: Vec<PathBuf> = exe
        .ancestors()
        .skip(1)
        .take(2)
        .map(Path::to_path_buf)
        .collect();
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    dirs.into_iter()
        .map(|d| d.join("ember-vmm"))
        .find(|p| p.is_file())
        .ok_or_else(|| LaunchError::NoBinary(exe.display().to_string()))
}

/// Where the guest console goes.
#[derive(Debug, Clone)]
pub enum Console {
    /// The child's stdout is ours.
    Inherit,
    /// Guest output is copied to our stderr (keeps our stdout clean for JSON).
    Stderr,
    /// Lines are captured (and timestamped) by [`LaunchedVm::wait`].
    Capture,
    /// Discarded.
    Null,
    /// Output to our stdout, and the child's stdin is a pipe the caller feeds (the VMM is
    /// started with `--serial-input stdin`); take it from [`LaunchedVm::child`].
    Interactive,
}

/// A running `ember-vmm` child.
#[derive(Debug)]
pub struct LaunchedVm {
    /// The process.
    pub child: Child,
    /// CLOCK_MONOTONIC just before spawn.
    pub spawn_mono_ns: u64,
    /// Instant just before spawn.
    pub spawn_at: Instant,
    /// The report file.
    pub report: PathBuf,
    console: Console,
}

/// One console line with its arrival time.
#[derive(Debug, Clone)]
pub struct ConsoleLine {
    /// Milliseconds since spawn.
    pub ms: f64,
    /// The text.
    pub text: String,
}

/// What happened to a VMM child.
#[derive(Debug)]
pub struct VmOutcome {
    /// The process exit status.
    pub status: ExitStatus,
    /// Every report event.
    pub events: Vec<serde_json::Value>,
    /// Captured console lines (with [`Console::Capture`]).
    pub console: Vec<ConsoleLine>,
    /// Wall time from spawn to exit.
    pub total_ms: f64,
    /// Spawn → first boot-marker write, on the host's monotonic clock.
    pub boot_marker_ms: Option<f64>,
    /// The VMM was killed because it outlived the timeout.
    pub timed_out: bool,
    /// CLOCK_MONOTONIC just before spawn (to turn report timestamps into spawn-relative ones).
    pub spawn_mono_ns: u64,
}

impl VmOutcome {
    /// Milliseconds from spawn to the first event of `kind` (by its `mono_ns`).
    pub fn ms_to(&self, kind: &str) -> Option<f64> {
        self.event(kind)
            .and_then(|e| e["mono_ns"].as_u64())
            .map(|ns| ns.saturating_sub(self.spawn_mono_ns) as f64 / 1e6)
    }
}

impl VmOutcome {
    /// The first event of `kind`.
    pub fn event(&self, kind: &str) -> Option<&serde_json::Value> {
        self.events.iter().find(|e| e["event"] == kind)
    }

    /// The VMM's own message for a failure, if it reported one.
    pub fn error_message(&self) -> Option<String> {
        self.event("error")
            .or_else(|| self.event("exit").filter(|e| e["code"] != 0))
            .and_then(|e| e["message"].as_str().map(str::to_string))
    }
}

/// Spawns `ember-vmm` for `config`, with work files (config, report) in `workdir`.
pub fn launch(
    binary: &Path,
    config: &VmConfig,
    workdir: &Path,
    console: Console,
    extra_args: &[String],
) -> Result<LaunchedVm, LaunchError> {
    let cfg_path = workdir.join("vm.json");
    let io = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| LaunchError::Io { what, path, source }
    };
    let json = serde_json::to_vec_pretty(config).map_err(|e| LaunchError::Io {
        what: "serialising the VM config to",
        path: cfg_path.clone(),
        source: std::io::Error::other(e),
    })?;
    std::fs::write(&cfg_path, json).map_err(io("cannot write", &cfg_path))?;
    let mut args: Vec<std::ffi::OsString> = vec!["--config".into(), cfg_path.into()];
    args.extend(extra_args.iter().map(Into::into));
    let report = workdir.join("report.jsonl");
    launch_args(binary, &args, &report, &report, console)
}

/// Spawns `ember-vmm --restore SNAPSHOT` (plus `extra_args`), work files in `workdir`.
pub fn launch_restore(
    binary: &Path,
    snapshot: &Path,
    workdir: &Path,
    console: Console,
    extra_args: &[String],
) -> Result<LaunchedVm, LaunchError> {
    let mut args: Vec<std::ffi::OsString> = vec!["--restore".into(), snapshot.into()];
    args.extend(extra_args.iter().map(Into::into));
    let report = workdir.join("report.jsonl");
    launch_args(binary, &args, &report, &report, console)
}

/// Spawns `binary` (`ember-vmm`, or a jailer that execs it) with `args` plus
/// `--report REPORT_ARG`; `report` is where the host reads that file (they differ when the
/// VMM runs in a jail).
pub fn launch_args(
    binary: &Path,
    args: &[std::ffi::OsString],
    report: &Path,
    report_arg: &Path,
    console: Console,
) -> Result<LaunchedVm, LaunchError> {
    let report = report.to_path_buf();
    let io = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| LaunchError::Io { what, path, source }
    };
    let mut cmd = Command::new(binary);
    cmd.args(args)
        .arg("--report")
        .arg(report_arg)
        .stdin(Stdio::null());
    match console {
        Console::Inherit => cmd.stdout(Stdio::inherit()),
        Console::Stderr | Console::Capture => cmd.stdout(Stdio::piped()),
        Console::Null => cmd.arg("--serial").arg("none").stdout(Stdio::null()),
        Console::Interactive => cmd
            .arg("--serial-input")
            .arg("stdin")
            .stdin(Stdio::piped())
            .stdout(Stdio::inherit()),
    };
    let spawn_mono_ns = monotonic_ns();
    let spawn_at = Instant::now();
    let child = cmd.spawn().map_err(io("cannot start", binary))?;
    Ok(LaunchedVm {
        child,
        spawn_mono_ns,
        spawn_at,
        report,
        console,
    })
}

impl LaunchedVm {
    /// Waits for the VMM to exit, forwarding or capturing the console meanwhile. With a
    /// `timeout`, the VMM is killed (SIGKILL) when it runs longer, and the outcome says so.
    pub fn wait(mut self, timeout: Option<std::time::Duration>) -> Result<VmOutcome, LaunchError> {
        let timed_out = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let done = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        if let Some(t) = timeout {
            let pid = self.child.id() as libc::pid_t;
            let (flag, done) = (timed_out.clone(), done.clone());
            std::thread::spawn(move || {
                let (lock, cv) = &*done;
                let guard = lock.lock().unwrap_or_else(|p| p.into_inner());
                let (guard, res) = cv
                    .wait_timeout_while(guard, t, |finished| !*finished)
                    .unwrap_or_else(|p| p.into_inner());
                if res.timed_out() && !*guard {
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                    // SAFETY: plain kill(2) of our own child, which has not been reaped yet
                    // (the waiter holds off reaping until it sets `finished`).
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            });
        }
        let mut console = Vec::new();
        if let Some(out) = self.child.stdout.take() {
            let reader = BufReader::new(out);
            for line in reader.split(b'\n') {
                let Ok(line) = line else { break };
                let text = String::from_utf8_lossy(&line).into_owned();
                match self.console {
                    Console::Stderr => eprintln!("{text}"),
                    Console::Capture => console.push(ConsoleLine {
                        ms: self.spawn_at.elapsed().as_secs_f64() * 1e3,
                        text,
                    }),
                    _ => {}
                }
            }
        }
        // Reap only after telling the watchdog, so it never signals a recycled pid.
        let status = {
            let (lock, cv) = &*done;
            let mut finished = lock.lock().unwrap_or_else(|p| p.into_inner());
            let status = self.child.wait();
            *finished = true;
            cv.notify_all();
            status
        }
        .map_err(|source| LaunchError::Io {
            what: "cannot wait for",
            path: "ember-vmm".into(),
            source,
        })?;
        let total_ms = self.spawn_at.elapsed().as_secs_f64() * 1e3;
        let events: Vec<serde_json::Value> = std::fs::read_to_string(&self.report)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let boot_marker_ms = events
            .iter()
            .find(|e| e["event"] == "boot_marker")
            .and_then(|e| e["mono_ns"].as_u64())
            .map(|ns| ns.saturating_sub(self.spawn_mono_ns) as f64 / 1e6);
        Ok(VmOutcome {
            status,
            events,
            console,
            total_ms,
            boot_marker_ms,
            timed_out: timed_out.load(std::sync::atomic::Ordering::SeqCst),
            spawn_mono_ns: self.spawn_mono_ns,
        })
    }
}
