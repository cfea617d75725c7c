//! The guest's PID 1: mount the early file systems, report the boot marker, run the boot command,
//! then serve the sandbox protocol (`ember.agent`) or reboot.
//!
//! A guest syscall costs milliseconds on kvm_pvm (ring 0 is emulated), so this does the least it
//! can: each step below is one or two syscalls, files are not closed (the init keeps them, with
//! `O_CLOEXEC` so children do not), and nothing is probed that the kernel would tell us anyway.
//!
//! PID 1 must never exit (the kernel panics), so every failure prints a line and the init still
//! reboots; a panic (in any thread) does the same through a panic hook. The VMM turns the guest's
//! reboot into a clean exit.
//!
//! With `ember.agent`, PID 1 binds the vsock listener, writes marker 2 ([`Milestone::AgentReady`]),
//! opens what the server keeps (`/dev/urandom`, `/dev/null`, the boot id), starts the server's
//! worker threads ([`crate::server`]) and then spends its main thread reaping children
//! ([`Registry::reap_forever`]).

use std::ffi::CStr;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixListener;
use std::sync::Arc;

use thiserror::Error;

use crate::cmdline::{self, BootConfig};
use crate::console::{self, Console};
use crate::exec::ExecEnv;
use crate::marker::{BootMarker, Method, Milestone};
use crate::process;
use crate::reaper::{Children, Registry};
use crate::server::{self, Listener, PoolConfig, Server};
use crate::system::LinuxSystem;
use crate::vsock::VsockListener;

/// Where the kernel command line is read from.
pub const PROC_CMDLINE: &CStr = c"/proc/cmdline";

/// Environment variable that, when set, replaces `/proc/cmdline` (tests run the init as PID 1 of a
/// PID namespace on a host, whose real command line carries no `ember.*` keys). Reading it costs
/// no syscall. A guest gets it only if the kernel command line sets it, and whoever writes that
/// line decides `ember.run` anyway.
pub const CMDLINE_OVERRIDE_ENV: &str = "EMBER_INIT_CMDLINE";

/// Environment variable that, when set, makes the agent listen on a Unix socket at this path
/// instead of vsock (tests run the init as PID 1 of a namespace on a host, where nothing could
/// connect over vsock). Like [`CMDLINE_OVERRIDE_ENV`], a guest only gets it from its command line.
pub const AGENT_UNIX_LISTEN_ENV: &str = "EMBER_AGENT_UNIX_LISTEN";

const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// A mount that failed.
#[derive(Debug, Error)]
#[error("mounting {fstype} on {target} failed: {source}")]
pub struct MountError {
    /// File system type.
    pub fstype: &'static str,
    /// Mount point.
    pub target: &'static str,
    /// The errno.
    #[source]
    pub source: io::Error,
}

/// One file system the init mounts.
#[derive(Debug, Clone, Copy)]
pub struct MountSpec {
    /// File system type, also used as the source name.
    pub fstype: &'static CStr,
    /// Mount point (must exist, except under `/dev`, where the init creates it).
    pub target: &'static CStr,
    /// `MS_*` flags.
    pub flags: libc::c_ulong,
    /// File-system specific options.
    pub data: Option<&'static CStr>,
    /// When the kernel lacks this file system (ENODEV), skip it without a word.
    pub optional: bool,
}

const NOSUID_NODEV: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV;
const NOSUID_NODEV_NOEXEC: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;

/// `/proc` and `/sys`, mounted first.
pub const PROC_SYS: [MountSpec; 2] = [
    MountSpec {
        fstype: c"proc",
        target: c"/proc",
        flags: NOSUID_NODEV_NOEXEC,
        data: None,
        optional: false,
    },
    MountSpec {
        fstype: c"sysfs",
        target: c"/sys",
        flags: NOSUID_NODEV_NOEXEC,
        data: None,
        optional: true,
    },
];

/// devtmpfs on `/dev`, unless the kernel mounted it already (`CONFIG_DEVTMPFS_MOUNT`).
pub const DEV: MountSpec = MountSpec {
    fstype: c"devtmpfs",
    target: c"/dev",
    flags: libc::MS_NOSUID,
    data: Some(c"mode=0755"),
    optional: false,
};

/// Pseudo-terminals, when the kernel has them.
pub const DEV_PTS: MountSpec = MountSpec {
    fstype: c"devpts",
    target: c"/dev/pts",
    flags: libc::MS_NOSUID | libc::MS_NOEXEC,
    data: Some(c"gid=5,mode=0620,ptmxmode=0666"),
    optional: true,
};

/// Writable scratch space on the read-only root.
pub const TMPFS: [MountSpec; 2] = [
    MountSpec {
        fstype: c"tmpfs",
        target: c"/tmp",
        flags: NOSUID_NODEV,
        data: Some(c"mode=1777"),
        optional: false,
    },
    MountSpec {
        fstype: c"tmpfs",
        target: c"/run",
        flags: NOSUID_NODEV,
        data: Some(c"mode=0755"),
        optional: false,
    },
];

/// The links a devtmpfs lacks (udev would make them); shells use `/dev/fd` and `/dev/std*`.
pub const DEV_LINKS: [(&CStr, &CStr); 4] = [
    (c"/proc/self/fd", c"/dev/fd"),
    (c"/proc/self/fd/0", c"/dev/stdin"),
    (c"/proc/self/fd/1", c"/dev/stdout"),
    (c"/proc/self/fd/2", c"/dev/stderr"),
];

fn static_str(s: &'static CStr) -> &'static str {
    s.to_str().unwrap_or("?")
}

/// Mounts one file system. `Ok(false)` when it is optional and the kernel does not have it.
pub fn mount(spec: &MountSpec) -> Result<bool, MountError> {
    let data = spec.data.map_or(std::ptr::null(), |d| d.as_ptr().cast());
    // SAFETY: every pointer is a NUL-terminated static string or NULL (data), as mount(2) expects.
    let r = unsafe {
        libc::mount(
            spec.fstype.as_ptr(),
            spec.target.as_ptr(),
            spec.fstype.as_ptr(),
            spec.flags,
            data,
        )
    };
    if r == 0 {
        return Ok(true);
    }
    let source = io::Error::last_os_error();
    if spec.optional && source.raw_os_error() == Some(libc::ENODEV) {
        return Ok(false);
    }
    Err(MountError {
        fstype: static_str(spec.fstype),
        target: static_str(spec.target),
        source,
    })
}

/// `mkdir`, where an existing directory is fine.
fn make_dir(path: &CStr, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: `path` is a NUL-terminated string.
    if unsafe { libc::mkdir(path.as_ptr(), mode) } == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EEXIST) {
        Ok(())
    } else {
        Err(err)
    }
}

/// Whether `path` is on a tmpfs or ramfs, i.e. a devtmpfs is mounted there already.
fn is_devtmpfs(path: &CStr) -> bool {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `path` is NUL-terminated and `st` is a valid out-pointer for one statfs.
    if unsafe { libc::statfs(path.as_ptr(), st.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: statfs succeeded, so it filled `st`.
    let f_type = unsafe { st.assume_init() }.f_type;
    // The root of an ember guest is ext4, never tmpfs, so a tmpfs here is the devtmpfs.
    f_type == TMPFS_MAGIC || f_type == RAMFS_MAGIC
}

/// Mounts everything the guest needs before the boot command runs. Failures are printed, and the
/// boot goes on.
pub fn mount_early(console: &Console) {
    for spec in &PROC_SYS {
        if let Err(e) = mount(spec) {
            console.warn(format_args!("{e}"));
        }
    }

    let dev_ok = is_devtmpfs(DEV.target) || {
        match mount(&DEV) {
            Ok(_) => true,
            Err(e) => {
                console.warn(format_args!("{e}; keeping the root file system's /dev"));
                false
            }
        }
    };
    if dev_ok {
        populate_dev(console);
    }

    for spec in &TMPFS {
        if let Err(e) = mount(spec) {
            console.warn(format_args!("{e}"));
        }
    }
}

/// Adds to a fresh devtmpfs what udev would: `/dev/pts`, `/dev/shm`, `/dev/fd` and `/dev/std*`.
fn populate_dev(console: &Console) {
    match make_dir(DEV_PTS.target, 0o755) {
        Ok(()) => {
            if let Err(e) = mount(&DEV_PTS) {
                console.warn(format_args!("{e}"));
            }
        }
        Err(e) => console.warn(format_args!("mkdir /dev/pts failed: {e}")),
    }

    // POSIX semaphores and shared memory (Python's multiprocessing) live in /dev/shm; the devtmpfs
    // is itself writable memory, so a sticky world-writable directory is enough.
    let shm = c"/dev/shm";
    let shm_result = make_dir(shm, 0o1777).and_then(|()| {
        // mkdir's mode was masked by the umask.
        // SAFETY: `shm` is NUL-terminated; chmod only changes the mode.
        if unsafe { libc::chmod(shm.as_ptr(), 0o1777) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    });
    if let Err(e) = shm_result {
        console.warn(format_args!("creating /dev/shm failed: {e}"));
    }

    for (target, link) in DEV_LINKS {
        // SAFETY: both are NUL-terminated static strings.
        if unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) } != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EEXIST) {
                console.warn(format_args!(
                    "symlink {} failed: {err}",
                    link.to_string_lossy()
                ));
            }
        }
    }
}

/// Reads the kernel command line in one `read` (it is at most 2 KiB on x86).
pub fn read_cmdline(path: &CStr) -> io::Result<String> {
    // SAFETY: `path` is NUL-terminated; open has no other memory effects.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let file = std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
    // The file is deliberately never closed: PID 1 lives until reboot, and close is one more
    // slow syscall. O_CLOEXEC keeps it out of children.
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    loop {
        match (&*file).read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => {
                len += n;
                if len < buf.len() {
                    break; // procfs returned everything in one go
                }
                buf.resize(buf.len() * 2, 0);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(len);
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Flushes file systems, waits for the console to drain, and reboots. Never returns.
///
/// Only [`run`] calls this, after checking that it is PID 1 (of the guest, or of a PID namespace,
/// where the kernel turns reboot into SIGHUP for the namespace's init).
fn shutdown() -> ! {
    // SAFETY: sync has no memory effects.
    unsafe { libc::sync() };
    drain_console();
    // SAFETY: reboot has no memory effects; as PID 1 with CAP_SYS_BOOT it does not return.
    unsafe { libc::reboot(libc::RB_AUTOBOOT) };
    let err = io::Error::last_os_error();
    Console::default().error(format_args!("reboot failed: {err}; powering off"));
    // SAFETY: as above.
    unsafe { libc::reboot(libc::RB_POWER_OFF) };
    loop {
        // SAFETY: pause has no memory effects. PID 1 must not exit, so it waits forever.
        unsafe { libc::pause() };
    }
}

/// Longest wait for the console to drain before rebooting anyway.
const DRAIN_TIMEOUT_SECS: libc::c_uint = 2;

extern "C" fn on_alarm(_signal: libc::c_int) {}

/// Waits (at most [`DRAIN_TIMEOUT_SECS`]) until the console has sent what was written to it.
///
/// The boot command's output may still sit in the serial driver's buffer, and a reboot would lose
/// it. tcdrain waits until it is on the wire; it would wait forever if the UART never signalled
/// (a VMM bug), so an alarm interrupts it (the handler is installed without SA_RESTART, so tcdrain
/// returns EINTR). ENOTTY, when stdout is no tty, is ignored like any other failure.
fn drain_console() {
    // SAFETY: an all-zero sigaction is a valid "no flags, empty mask" value.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_alarm as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: installs a handler that does nothing, so it is async-signal-safe.
    if unsafe { libc::sigaction(libc::SIGALRM, &action, std::ptr::null_mut()) } != 0 {
        return; // without the timeout, draining could hang the guest; skip it
    }
    // SAFETY: alarm has no memory effects.
    unsafe { libc::alarm(DRAIN_TIMEOUT_SECS) };
    // SAFETY: tcdrain only waits on fd 1.
    unsafe { libc::tcdrain(libc::STDOUT_FILENO) };
}

/// Makes a panic print a line and reboot, instead of killing PID 1 (a kernel panic).
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        // Raw write: the panic may have happened while stdout was locked.
        let line = console::line("error: ", format_args!("internal error: {info}; rebooting"));
        // SAFETY: writes a live buffer to fd 2; the result is irrelevant.
        unsafe { libc::write(libc::STDERR_FILENO, line.as_ptr().cast(), line.len()) };
        shutdown()
    }));
}

/// What the command line asked for, after warnings and errors were printed.
fn boot_config(console: &mut Console) -> Option<BootConfig> {
    let line = match std::env::var_os(CMDLINE_OVERRIDE_ENV) {
        Some(line) => Ok(line.to_string_lossy().into_owned()),
        None => read_cmdline(PROC_CMDLINE),
    };
    let line = match line {
        Ok(line) => line,
        Err(e) => {
            console.error(format_args!("reading /proc/cmdline failed: {e}"));
            return None;
        }
    };
    match cmdline::parse(&line) {
        Ok(config) => {
            console.set_quiet(config.quiet);
            Some(config)
        }
        Err(e) => {
            console.error(format_args!("bad kernel command line: {e}"));
            None
        }
    }
}

/// [`run`] was called in a process that is not PID 1.
#[derive(Debug, Error)]
#[error("the init must run as PID 1 (this is pid {pid})")]
pub struct NotPid1 {
    /// This process's pid.
    pub pid: u32,
}

/// Runs the init if this process is PID 1, and then never returns: it ends in a reboot.
///
/// Anywhere else it returns [`NotPid1`] at once, having done nothing (it must never mount over a
/// host's file systems or reboot a host).
pub fn run() -> Result<std::convert::Infallible, NotPid1> {
    let pid = std::process::id();
    if pid != 1 {
        return Err(NotPid1 { pid });
    }
    install_panic_hook();
    let mut console = Console::default();

    mount_early(&console);
    let config = boot_config(&mut console);

    let mut marker = BootMarker::new();
    let marker_result = marker.write(Milestone::InitReady);
    console.info(format_args!("ready"));
    match marker_result {
        Ok(Method::DevPort) => {}
        Ok(Method::Outb) => console.info(format_args!("boot marker written with outb")),
        Err(e) => console.warn(format_args!("{e}")),
    }

    let Some(config) = config else {
        console.error(format_args!("not running anything; rebooting"));
        shutdown()
    };
    for warning in &config.warnings {
        console.warn(format_args!("{warning}"));
    }
    if let Err(e) = crate::netcfg::configure(config.net.as_ref()) {
        console.error(format_args!("{e}"));
    }
    if let Some(command) = &config.run {
        match process::spawn_shell(command.as_bytes()) {
            Ok(pid) => match process::wait_for(pid, true) {
                Ok(status) => console.result(format_args!("command {status}")),
                Err(e) => console.error(format_args!("waiting for the command failed: {e}")),
            },
            Err(e) => console.error(format_args!("starting the command failed: {e}")),
        }
    }
    match config.agent {
        Some(port) => serve_agent(port, &console, &mut marker),
        None if config.run.is_none() => {
            console.info(format_args!("no command given; rebooting"));
            shutdown()
        }
        None => shutdown(),
    }
}

/// Binds the agent's listener (vsock `port`, or the Unix socket of [`AGENT_UNIX_LISTEN_ENV`])
/// and serves forever; reboots if the listener cannot be set up.
fn serve_agent(port: u32, console: &Console, marker: &mut BootMarker) -> ! {
    match std::env::var_os(AGENT_UNIX_LISTEN_ENV) {
        Some(path) => match UnixListener::bind(&path) {
            Ok(listener) => {
                let what = format!("unix socket {}", path.to_string_lossy());
                run_agent(listener, &what, console, marker)
            }
            Err(e) => {
                console.error(format_args!(
                    "listening on {} failed: {e}; rebooting",
                    path.to_string_lossy()
                ));
                shutdown()
            }
        },
        None => match VsockListener::bind(port) {
            Ok(listener) => run_agent(listener, &format!("vsock port {port}"), console, marker),
            Err(e) => {
                console.error(format_args!(
                    "listening on vsock port {port} failed: {e}; rebooting"
                ));
                shutdown()
            }
        },
    }
}

fn run_agent<L: Listener>(
    listener: L,
    what: &str,
    console: &Console,
    marker: &mut BootMarker,
) -> ! {
    if let Err(e) = marker.write(Milestone::AgentReady) {
        console.warn(format_args!("{e}"));
    }
    console.info(format_args!("agent listening on {what}"));
    // Opened once here so that no call pays for it (a restored clone inherits them).
    let system = LinuxSystem::open();
    let devnull = match ExecEnv::open_devnull() {
        Ok(fd) => Some(fd),
        Err(e) => {
            console.warn(format_args!(
                "opening /dev/null failed: {e}; exec stdin will be empty pipes"
            ));
            None
        }
    };
    // One malloc arena for every thread: a thread's own arena costs four syscalls (mmap,
    // munmap twice, mprotect) on its first allocation, and the agent's threads allocate little.
    // SAFETY: mallopt only changes malloc's tuning.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    let registry = Arc::new(Registry::new());
    let server = Arc::new(Server::new(
        Box::new(system),
        Children::Registry(registry.clone()),
        ExecEnv::new(devnull, false),
    ));
    if let Err(e) = server::serve(server, Arc::new(listener), PoolConfig::default()) {
        console.error(format_args!(
            "starting the agent's threads failed: {e}; rebooting"
        ));
        shutdown()
    }
    registry.reap_forever()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_table_matches_the_design() {
        let names: Vec<(&str, &str)> = PROC_SYS
            .iter()
            .chain([&DEV, &DEV_PTS])
            .chain(TMPFS.iter())
            .map(|m| (static_str(m.fstype), static_str(m.target)))
            .collect();
        assert_eq!(
            names,
            [
                ("proc", "/proc"),
                ("sysfs", "/sys"),
                ("devtmpfs", "/dev"),
                ("devpts", "/dev/pts"),
                ("tmpfs", "/tmp"),
                ("tmpfs", "/run"),
            ]
        );
        // Only sysfs and devpts may be missing from the kernel without a word.
        let optional: Vec<&str> = PROC_SYS
            .iter()
            .chain([&DEV, &DEV_PTS])
            .chain(TMPFS.iter())
            .filter(|m| m.optional)
            .map(|m| static_str(m.target))
            .collect();
        assert_eq!(optional, ["/sys", "/dev/pts"]);
        // The root is read-only; nothing here remounts it.
        assert!(!names.iter().any(|&(_, target)| target == "/"));
    }

    #[test]
    fn reads_proc_cmdline() {
        // Whatever the host booted with, it is one line ending in a newline.
        let line = read_cmdline(PROC_CMDLINE).unwrap();
        assert!(line.ends_with('\n'), "{line:?}");
    }

    #[test]
    fn reads_a_long_file_completely() {
        let path = std::env::temp_dir().join(format!("ember-cmdline-test-{}", std::process::id()));
        let text = "x".repeat(10_000);
        std::fs::write(&path, &text).unwrap();
        let cpath = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        let read = read_cmdline(&cpath);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(read.unwrap(), text);
    }

    #[test]
    fn missing_cmdline_is_an_error() {
        let err = read_cmdline(c"/nonexistent/ember/cmdline").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn mount_errors_say_what_and_where() {
        let err = MountError {
            fstype: "tmpfs",
            target: "/tmp",
            source: io::Error::from_raw_os_error(libc::EPERM),
        };
        let msg = err.to_string();
        assert!(msg.starts_with("mounting tmpfs on /tmp failed: "), "{msg}");
    }

    #[test]
    fn refuses_to_run_outside_pid_1() {
        let err = run().unwrap_err();
        assert_eq!(err.pid, std::process::id());
        assert!(err.to_string().contains("must run as PID 1"), "{err}");
    }

    #[test]
    fn mkdir_of_an_existing_directory_is_fine() {
        make_dir(c"/", 0o755).unwrap();
    }
}
