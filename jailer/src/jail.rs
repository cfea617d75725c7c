//! Building the jail and starting the VMM in it: the order of the steps.
//!
//! Host side (in the jailer's own namespaces): validate, close inherited
//! descriptors, clear the environment, build `<base>/<id>/root`, create the
//! cgroups. Jail side (in the process that becomes the VMM): join the
//! cgroups, join the network namespace, new mount namespace + `pivot_root`,
//! device nodes, optional `/proc`, rlimits, drop privileges, exec.
//!
//! With `new_pid_ns` the jail side runs in a forked child that is pid 1 of
//! a new PID namespace; the jailer stays outside, waits for it, forwards
//! signals to it and reports how it ended ([`VmmExit`]).

use std::convert::Infallible;
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::cgroup::{CgroupError, Cgroups};
use crate::config::{ConfigError, JailConfig, JAIL_EXEC_PATH};
use crate::jailfs::{self, DeviceNode, FsError};
use crate::mount::{self, BindMount, MountError};
use crate::process::{self, ProcessError};
use crate::sys;

/// Any failure of a jail run. [`JailError::exit_code`] maps it to the
/// jailer's exit status.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// Bad arguments (exit 2).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Building the jail's files failed.
    #[error(transparent)]
    Fs(#[from] FsError),
    /// Cgroup setup failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// Mount namespace setup failed.
    #[error(transparent)]
    Mount(#[from] MountError),
    /// Process setup (fds, netns, rlimits, privileges, exec) failed.
    #[error(transparent)]
    Process(#[from] ProcessError),
    /// Creating or managing the PID-namespace child failed.
    #[error("cannot {what} for the new PID namespace: {source}")]
    PidNs {
        /// The step.
        what: &'static str,
        /// Why.
        source: io::Error,
    },
    /// The PID-namespace child failed before exec; its error message.
    #[error("{0}")]
    Child(String),
}

impl JailError {
    /// 2 for usage errors, 1 for setup failures.
    pub fn exit_code(&self) -> i32 {
        match self {
            JailError::Config(_) => crate::EXIT_USAGE,
            _ => crate::EXIT_SETUP,
        }
    }
}

/// How the VMM ended (PID-namespace mode, where the jailer is its parent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmmExit {
    /// Exited with this status.
    Exited(i32),
    /// Killed by a signal.
    Signaled {
        /// The signal.
        signal: i32,
        /// SIGKILL while the memory cgroup's OOM-kill counter went up.
        oom_killed: bool,
        /// The memory limit in force, if any.
        memory_limit: Option<u64>,
    },
}

/// Per-step setup durations, printed with `--print-timings`.
#[derive(Debug, Clone)]
pub struct Timings {
    start: Instant,
    last: Instant,
    steps: Vec<(&'static str, Duration)>,
}

impl Default for Timings {
    fn default() -> Self {
        Self::new()
    }
}

impl Timings {
    /// Starts the clock.
    pub fn new() -> Self {
        let now = Instant::now();
        Self {
            start: now,
            last: now,
            steps: Vec::new(),
        }
    }

    /// Records the time since the previous mark under `step`.
    pub fn mark(&mut self, step: &'static str) {
        let now = Instant::now();
        self.steps.push((step, now - self.last));
        self.last = now;
    }

    /// The recorded steps.
    pub fn steps(&self) -> &[(&'static str, Duration)] {
        &self.steps
    }

    /// `step=NNNus ... total=NNNus`.
    pub fn summary(&self) -> String {
        let mut s: Vec<String> = self
            .steps
            .iter()
            .map(|(n, d)| format!("{n}={}us", d.as_micros()))
            .collect();
        s.push(format!("total={}us", (self.last - self.start).as_micros()));
        s.join(" ")
    }
}

/// Signals the jailer forwards to the VMM in PID-namespace mode. (The VMM is
/// pid 1 there: it only receives those it installs a handler for.)
const FORWARDED: [libc::c_int; 6] = [
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

/// Builds the jail described by `cfg` and starts the VMM in it.
///
/// Without `new_pid_ns` this process becomes the VMM: it only returns on
/// error. With it, it returns how the VMM ended. Must be called while the
/// process is single-threaded (it forks and changes process-wide state).
pub fn run(cfg: &JailConfig) -> Result<VmmExit, JailError> {
    let mut t = Timings::new();
    cfg.validate()?;
    process::close_inherited_fds(&cfg.keep_fds)?;
    process::clear_env();
    process::reset_ignored_signals();
    // SAFETY: umask only changes this process's file-creation mask.
    unsafe { libc::umask(0o022) };
    t.mark("validate");

    let devices = jailfs::host_devices(cfg.userfaultfd)?;
    let mut made = Made::default();
    let host_side = (|| -> Result<Option<Cgroups>, JailError> {
        jailfs::create_jail_dirs(cfg)?;
        made.jail = Some(cfg.jail_dir());
        jailfs::install_exec(cfg)?;
        jailfs::place_files(cfg)?;
        jailfs::prepare_bind_points(cfg)?;
        jailfs::check_interpreter(cfg)?;
        t.mark("files");
        let cgroups = if cfg.limits.is_empty() {
            None
        } else {
            Some(Cgroups::create(
                &cfg.cgroup_root,
                &cfg.cgroup_parent,
                &cfg.id,
                &cfg.limits,
            )?)
        };
        made.cgroups = cgroups.clone();
        t.mark("cgroups");
        Ok(cgroups)
    })();
    let cgroups = match host_side {
        Ok(c) => c,
        Err(e) => {
            made.undo();
            return Err(e);
        }
    };
    let binds: Vec<BindMount> = cfg
        .binds
        .iter()
        .map(|b| BindMount {
            src: b.src.clone(),
            target: cfg.host_path(&b.dest),
            read_only: b.read_only,
        })
        .collect();

    if cfg.new_pid_ns {
        return run_in_pid_ns(cfg, &devices, &binds, cgroups, made, t);
    }
    if let Some(cg) = &cgroups {
        if let Err(e) = cg.join(std::process::id()) {
            made.undo();
            return Err(e.into());
        }
        t.mark("cgroup-join");
    }
    match enter_jail(cfg, &devices, &binds, &mut t, None)? {}
}

/// What the host side created, removed again if setup fails.
#[derive(Debug, Default)]
struct Made {
    jail: Option<PathBuf>,
    cgroups: Option<Cgroups>,
}

impl Made {
    fn undo(&self) {
        if let Some(cg) = &self.cgroups {
            let _ = cg.remove();
        }
        if let Some(dir) = &self.jail {
            // Nothing is mounted under the jail in this namespace: the bind
            // mounts only ever exist in the jail's own mount namespace.
            let _ = fs::remove_dir_all(dir);
        }
    }
}

/// The jail side: from joining the network namespace to exec.
fn enter_jail(
    cfg: &JailConfig,
    devices: &[DeviceNode],
    binds: &[BindMount],
    t: &mut Timings,
    parent_alive: Option<BorrowedFd<'_>>,
) -> Result<Infallible, JailError> {
    if let Some(netns) = &cfg.netns {
        process::join_netns(netns)?;
        t.mark("netns");
    }
    mount::pivot_into(&cfg.root_dir(), binds)?;
    t.mark("pivot-root");
    jailfs::make_devices(Path::new("/"), devices, cfg.uid, cfg.gid)?;
    if cfg.mount_proc {
        mount::mount_proc()?;
    }
    t.mark("devices");
    process::set_rlimits(&cfg.rlimits)?;
    process::drop_privileges(cfg.uid, cfg.gid)?;
    if let Some(fd) = parent_alive {
        die_with_parent(fd)?;
    }
    t.mark("drop-privileges");
    if cfg.print_timings {
        eprintln!("ember-jailer: timings: {}", t.summary());
    }
    Ok(process::exec(
        Path::new(JAIL_EXEC_PATH),
        &cfg.vmm_args,
        &cfg.env,
    )?)
}

/// Asks for SIGKILL when the jailer dies (set after the uid change, which
/// clears it), then checks the jailer did not die before that.
fn die_with_parent(alive: BorrowedFd<'_>) -> Result<(), JailError> {
    let pid_ns = |source| JailError::PidNs {
        what: "set the parent-death signal",
        source,
    };
    // SAFETY: PR_SET_PDEATHSIG takes integer arguments only.
    sys::cvt(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) })
        .map_err(pid_ns)?;
    let mut pfd = libc::pollfd {
        fd: alive.as_raw_fd(),
        events: 0,
        revents: 0,
    };
    // SAFETY: `pfd` is one valid pollfd; timeout 0 means no blocking.
    let n = sys::cvt(unsafe { libc::poll(&mut pfd, 1, 0) }).map_err(pid_ns)?;
    if n > 0 && pfd.revents & libc::POLLHUP != 0 {
        return Err(JailError::Child("the jailer exited during setup".into()));
    }
    Ok(())
}

fn run_in_pid_ns(
    cfg: &JailConfig,
    devices: &[DeviceNode],
    binds: &[BindMount],
    cgroups: Option<Cgroups>,
    made: Made,
    mut t: Timings,
) -> Result<VmmExit, JailError> {
    let pid_ns = |what| move |source| JailError::PidNs { what, source };
    let fail = |e: JailError| {
        made.undo();
        e
    };
    let (go_r, go_w) = sys::pipe().map_err(pid_ns("create a pipe")).map_err(fail)?;
    let (err_r, err_w) = sys::pipe().map_err(pid_ns("create a pipe")).map_err(fail)?;
    let mut waited = FORWARDED.to_vec();
    waited.push(libc::SIGCHLD);
    let waited = sys::sigset(&waited);
    sys::sigprocmask(libc::SIG_BLOCK, &waited)
        .map_err(pid_ns("block signals"))
        .map_err(fail)?;
    sys::unshare(libc::CLONE_NEWPID)
        .map_err(pid_ns("unshare(CLONE_NEWPID)"))
        .map_err(fail)?;
    // SAFETY: the jailer is single-threaded, so the child starts from a
    // consistent state; it only runs the jail setup and then execs or exits.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(fail(pid_ns("fork")(io::Error::last_os_error())));
    }
    if pid == 0 {
        drop(go_w);
        drop(err_r);
        child_main(cfg, devices, binds, &mut t, go_r, err_w);
    }
    drop(go_r);
    drop(err_w);
    let kill_child = || {
        // SAFETY: kill and waitpid on our own child; no memory is passed.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
        let mut status = 0;
        // SAFETY: `status` is a valid int for waitpid to fill.
        unsafe { libc::waitpid(pid, &mut status, 0) };
    };

    // The child waits for this go-ahead, so it is in its cgroups before it
    // does anything else. The jailer itself stays out of them.
    let oom_before = cgroups.as_ref().and_then(Cgroups::oom_kills).unwrap_or(0);
    if let Some(cg) = &cgroups {
        if let Err(e) = cg.join(pid as u32) {
            kill_child();
            return Err(fail(e.into()));
        }
        t.mark("cgroup-join");
    }
    let mut go = fs::File::from(go_w);
    if let Err(e) = go.write_all(b"g") {
        kill_child();
        return Err(fail(pid_ns("start the child")(e)));
    }
    // `go` stays open: the child sees the jailer die as a hang-up on it.

    // The error pipe closes on the child's exec; anything read is its error.
    let mut msg = String::new();
    let _ = fs::File::from(err_r).read_to_string(&mut msg);
    if !msg.is_empty() {
        kill_child();
        return Err(fail(JailError::Child(msg)));
    }
    if cfg.print_timings {
        eprintln!("ember-jailer: timings (jailer): {}", t.summary());
    }

    let status = wait_forwarding(pid, &waited).map_err(pid_ns("wait for the VMM"))?;
    drop(go);
    if libc::WIFSIGNALED(status) {
        let signal = libc::WTERMSIG(status);
        let oom_after = cgroups.as_ref().and_then(Cgroups::oom_kills).unwrap_or(0);
        Ok(VmmExit::Signaled {
            signal,
            oom_killed: signal == libc::SIGKILL && oom_after > oom_before,
            memory_limit: cgroups.as_ref().and_then(Cgroups::memory_limit),
        })
    } else {
        Ok(VmmExit::Exited(libc::WEXITSTATUS(status)))
    }
}

/// Waits for `pid`, forwarding the signals in [`FORWARDED`] to it.
fn wait_forwarding(pid: libc::pid_t, waited: &libc::sigset_t) -> io::Result<libc::c_int> {
    loop {
        let mut status = 0;
        // SAFETY: `status` is a valid int for waitpid to fill.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Ok(status);
        }
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
        }
        // SAFETY: all-zero is a valid siginfo_t for the kernel to fill.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `waited` and `info` are valid for the call.
        let sig = unsafe { libc::sigwaitinfo(waited, &mut info) };
        if sig > 0 && sig != libc::SIGCHLD {
            // SAFETY: sending a signal to our own child.
            unsafe { libc::kill(pid, sig) };
        }
    }
}

/// The PID-namespace child: waits for the go-ahead, builds the jail side,
/// execs. On failure it sends its error to the jailer and exits 1.
fn child_main(
    cfg: &JailConfig,
    devices: &[DeviceNode],
    binds: &[BindMount],
    t: &mut Timings,
    go_r: OwnedFd,
    err_w: OwnedFd,
) -> ! {
    let mut go = fs::File::from(go_r);
    let mut byte = [0u8; 1];
    if !matches!(go.read(&mut byte), Ok(1)) {
        // The jailer failed or died before the go-ahead.
        // SAFETY: _exit ends the process without running any Rust code.
        unsafe { libc::_exit(crate::EXIT_SETUP) };
    }
    t.mark("child-start");
    let result = enter_jail(cfg, devices, binds, t, Some(std::os::fd::AsFd::as_fd(&go)));
    let Err(e) = result;
    let _ = fs::File::from(err_w).write_all(e.to_string().as_bytes());
    // SAFETY: _exit ends the child without unwinding into the parent's
    // state (no destructors of the shared setup run twice).
    unsafe { libc::_exit(crate::EXIT_SETUP) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_summary() {
        let mut t = Timings::new();
        t.mark("a");
        t.mark("b");
        let s = t.summary();
        assert!(
            s.starts_with("a=") && s.contains(" b=") && s.contains(" total="),
            "{s}"
        );
        assert_eq!(t.steps().len(), 2);
    }

    #[test]
    fn exit_codes() {
        let usage = JailError::Config(ConfigError::InvalidId { id: "x/".into() });
        assert_eq!(usage.exit_code(), crate::EXIT_USAGE);
        assert_eq!(JailError::Child("x".into()).exit_code(), crate::EXIT_SETUP);
    }
}
