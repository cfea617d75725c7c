//! The `exec` call: start a program with pipes, stream its output, enforce its time limit.
//!
//! The program is started like the boot command ([`crate::process`]): one
//! `clone(CLONE_VM | CLONE_VFORK | CLONE_PIDFD)` whose child only runs `setsid`, three `dup2`,
//! maybe `chdir`, and `execve` (once per `PATH` candidate), everything else prepared beforehand.
//! The parent then waits in one `poll` on the stdout and stderr pipes, the pidfd (readable when
//! the program exits), the connection (hang-up cancels the call) and, while there is stdin
//! left, the stdin pipe. Each wake-up reads what is ready (at most [`MAX_CHUNK`] per pipe) and
//! sends the resulting events in one write.
//!
//! The program leads a new session and process group, so the time limit kills the whole group
//! (`kill(-pid, SIGKILL)`); processes that started their own session escape it. When the
//! program exits, output already in the pipes is still sent (for at most [`DRAIN_LIMIT`]);
//! background processes that keep the pipes open do not hold the call up.
//!
//! Version 2: the program may run on a pseudo-terminal (`/dev/ptmx`, the slave opened with
//! `TIOCGPTPEER` and made the controlling terminal in the child) and as the unprivileged
//! account (raw `setgroups`/`setresgid`/`setresuid` in the child). [`crate::procs`] builds the
//! process table, background execs and attaching on [`start`], [`pump`] and [`finish`].

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::protocol::{
    EndStatus, ErrorCode, ErrorInfo, EventKind, ExecRequest, PtySize, MAX_CHUNK,
};
use crate::reaper::Children;

/// How long output is still collected after the program exited while a pipe stays readable
/// (a background process that keeps writing).
pub const DRAIN_LIMIT: Duration = Duration::from_millis(100);

/// Most `PATH` entries tried for a program name without `/`.
const MAX_PATH_CANDIDATES: usize = 64;

/// Bytes written to the stdin pipe per wake-up: a pipe that polls writable takes this many
/// without blocking.
const STDIN_CHUNK: usize = libc::PIPE_BUF;

/// Where an exec's events go (the connection, in the server).
pub trait Sink {
    /// Queues an event of the current call.
    fn event(&mut self, kind: EventKind);
    /// Sends the queued events.
    fn flush(&mut self) -> io::Result<()>;
    /// The connection's descriptor, watched for hang-up while the program runs.
    fn peer_fd(&self) -> Option<RawFd>;
}

/// What every program gets from the agent.
#[derive(Debug)]
pub struct ExecEnv {
    base_env: BTreeMap<String, String>,
    devnull: Option<OwnedFd>,
    reset_sigpipe: bool,
}

impl ExecEnv {
    /// Programs start with [`crate::process::COMMAND_ENV`]; stdin is `devnull` when the request
    /// has none (an empty pipe if that is `None`). `reset_sigpipe` restores `SIGPIPE`'s default
    /// action in the child, for agents running in a process that ignores it (tests); PID 1
    /// never changes it.
    pub fn new(devnull: Option<OwnedFd>, reset_sigpipe: bool) -> Self {
        let base_env = crate::process::COMMAND_ENV
            .iter()
            .filter_map(|var| {
                let (key, value) = var.to_str().ok()?.split_once('=')?;
                Some((key.to_owned(), value.to_owned()))
            })
            .collect();
        Self {
            base_env,
            devnull,
            reset_sigpipe,
        }
    }

    /// Opens `/dev/null` for [`ExecEnv::new`] (one syscall).
    pub fn open_devnull() -> io::Result<OwnedFd> {
        // SAFETY: the path is NUL-terminated; open has no other memory effects.
        let fd = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by open and is owned by nobody else.
        above_stdio(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// Starting the program failed.
#[derive(Debug, Error)]
pub enum SpawnError {
    /// A pipe could not be created.
    #[error("creating a pipe failed: {0}")]
    Pipe(#[source] io::Error),
    /// `clone` failed (out of memory or pids).
    #[error("clone failed: {0}")]
    Clone(#[source] io::Error),
    /// The pseudo-terminal could not be set up.
    #[error("opening a pseudo-terminal failed: {0}")]
    Pty(#[source] io::Error),
    /// A step before `execve` failed in the child.
    #[error("{step} failed: {source}")]
    Setup {
        /// Which step.
        step: &'static str,
        /// Its errno.
        #[source]
        source: io::Error,
    },
    /// No candidate could be executed.
    #[error("cannot execute {program:?}: {source}")]
    Exec {
        /// The program as requested (`argv[0]`).
        program: String,
        /// The errno of the last relevant `execve`.
        #[source]
        source: io::Error,
    },
}

/// A request turned into what `execve` takes; built before the clone.
#[derive(Debug)]
struct Prepared {
    programs: Vec<CString>,
    argv: Vec<CString>,
    envp: Vec<CString>,
    cwd: Option<CString>,
}

fn c_string(what: &str, s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("exec: {what} contains a NUL byte"))
}

/// An account a program runs as (from the guest's `/etc/passwd`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Creds {
    /// User id.
    pub uid: u32,
    /// Primary group id (the only group the program gets).
    pub gid: u32,
    /// The account's name (`USER`, `LOGNAME`).
    pub name: String,
    /// Its home directory (`HOME`).
    pub home: String,
}

impl Creds {
    /// Finds `name` in the text of a passwd file (`name:x:uid:gid:gecos:home:shell` lines).
    pub fn from_passwd(passwd: &str, name: &str) -> Option<Creds> {
        passwd.lines().find_map(|line| {
            let mut fields = line.split(':');
            if fields.next()? != name {
                return None;
            }
            let _password = fields.next()?;
            let uid = fields.next()?.parse().ok()?;
            let gid = fields.next()?.parse().ok()?;
            let _gecos = fields.next()?;
            let home = fields.next()?;
            Some(Creds {
                uid,
                gid,
                name: name.to_owned(),
                home: if home.is_empty() {
                    "/".into()
                } else {
                    home.into()
                },
            })
        })
    }
}

/// How an `exec`'s program is started, beyond its request.
#[derive(Debug, Clone, Copy, Default)]
pub struct StartOptions<'a> {
    /// Run as this account (default: the agent's, root).
    pub creds: Option<&'a Creds>,
    /// Keep stdin a pipe whose write end is returned (for `stdin_write`), even without bytes.
    pub stdin_stream: bool,
}

fn prepare_as(req: &ExecRequest, env: &ExecEnv, creds: Option<&Creds>) -> Result<Prepared, String> {
    let Some(program) = req.argv.first() else {
        return Err("exec: argv is empty".into());
    };
    if program.is_empty() {
        return Err("exec: argv[0] is empty".into());
    }
    let argv = req
        .argv
        .iter()
        .map(|arg| c_string("an argument", arg))
        .collect::<Result<Vec<_>, _>>()?;

    let mut vars = env.base_env.clone();
    if let Some(creds) = creds {
        vars.insert("HOME".into(), creds.home.clone());
        vars.insert("USER".into(), creds.name.clone());
        vars.insert("LOGNAME".into(), creds.name.clone());
    }
    if req.pty.is_some() {
        vars.insert("TERM".into(), "xterm".into());
    }
    for (key, value) in &req.env {
        if key.is_empty() || key.contains('=') {
            return Err(format!(
                "exec: environment variable name {key:?} is empty or contains '='"
            ));
        }
        vars.insert(key.clone(), value.clone());
    }
    let envp = vars
        .iter()
        .map(|(key, value)| c_string("the environment", &format!("{key}={value}")))
        .collect::<Result<Vec<_>, _>>()?;

    let programs = if program.contains('/') {
        vec![c_string("argv[0]", program)?]
    } else {
        let path = vars.get("PATH").map_or("", String::as_str);
        path.split(':')
            .take(MAX_PATH_CANDIDATES)
            .map(|dir| {
                let dir = if dir.is_empty() { "." } else { dir };
                c_string("PATH", &format!("{}/{program}", dir.trim_end_matches('/')))
            })
            .collect::<Result<Vec<_>, _>>()?
    };
    let cwd = match &req.cwd {
        Some(cwd) if cwd.is_empty() => return Err("exec: cwd is empty".into()),
        Some(cwd) => Some(c_string("cwd", cwd)?),
        None => None,
    };
    Ok(Prepared {
        programs,
        argv,
        envp,
        cwd,
    })
}

/// Moves `fd` above 0-2 if it is there (only when the agent's own stdio was closed), so that
/// the child's `dup2` onto 0-2 never overwrites a descriptor it still has to copy.
fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor we own; no memory is involved.
    let dup = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if dup < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `dup` was just returned by fcntl and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// A close-on-exec pipe: (read end, write end).
fn pipe() -> Result<(OwnedFd, OwnedFd), SpawnError> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid out-pointer for two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(SpawnError::Pipe(io::Error::last_os_error()));
    }
    // SAFETY: pipe2 just returned this descriptor; nobody else owns it.
    let r = unsafe { OwnedFd::from_raw_fd(fds[0]) };
    // SAFETY: as above, for the write end.
    let w = unsafe { OwnedFd::from_raw_fd(fds[1]) };
    Ok((
        above_stdio(r).map_err(SpawnError::Pipe)?,
        above_stdio(w).map_err(SpawnError::Pipe)?,
    ))
}

const STEP_SETSID: i32 = 1;
const STEP_DUP: i32 = 2;
const STEP_SIGPIPE: i32 = 3;
const STEP_CHDIR: i32 = 4;
const STEP_EXEC: i32 = 5;
const STEP_CTTY: i32 = 6;
const STEP_CREDS: i32 = 7;

fn step_name(step: i32) -> &'static str {
    match step {
        STEP_SETSID => "setsid",
        STEP_DUP => "redirecting stdio",
        STEP_SIGPIPE => "resetting SIGPIPE",
        STEP_CHDIR => "chdir",
        STEP_CTTY => "taking the terminal (TIOCSCTTY)",
        STEP_CREDS => "changing the user",
        _ => "exec",
    }
}

/// What the child of `clone` reads; every pointer was built by the parent, which is suspended
/// (CLONE_VFORK) until the child has exec'd or exited.
struct ChildArgs<'a> {
    programs: &'a [*const libc::c_char],
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    cwd: *const libc::c_char,
    stdio: [libc::c_int; 3],
    reset_sigpipe: bool,
    /// stdin is a terminal that becomes the new session's controlling terminal.
    ctty: bool,
    /// Switch to this uid/gid (raw syscalls: glibc's wrappers would signal the agent's threads).
    creds: Option<(u32, u32)>,
    /// The failed step (0: none) and its errno.
    failed_step: AtomicI32,
    failed_errno: AtomicI32,
    /// Index of the candidate whose errno is reported.
    failed_program: AtomicUsize,
}

/// Exit status of a child that failed before or at `execve`.
const CHILD_FAILED: libc::c_int = 127;

fn errno() -> i32 {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Gives a child about to exec the default actions of SIGINT and SIGQUIT and an empty signal
/// mask. Both are inherited across exec: a context started while its parent ignored SIGINT
/// (a process started in the background by a non-interactive shell does, as a CI job may be)
/// could never be interrupted (bash cannot trap a signal ignored at its start), and one
/// started from a thread that blocks signals would hold them pending forever.
pub(crate) fn reset_interrupt_signals() {
    // SAFETY: restores a default action (no handler runs in this child); no memory effects.
    unsafe { libc::signal(libc::SIGINT, libc::SIG_DFL) };
    // SAFETY: as above.
    unsafe { libc::signal(libc::SIGQUIT, libc::SIG_DFL) };
    // SAFETY: an all-zero sigset_t is a valid value for sigemptyset to initialise.
    let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `empty` is a live sigset_t on this stack.
    unsafe { libc::sigemptyset(&mut empty) };
    // SAFETY: sets this thread's mask from a valid set; the old mask is not asked for.
    unsafe { libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) };
}

fn child_fail(args: &ChildArgs<'_>, step: i32, errno: i32) -> ! {
    args.failed_errno.store(errno, Ordering::Relaxed);
    args.failed_step.store(step, Ordering::Relaxed);
    // SAFETY: _exit ends the child without running atexit handlers or touching shared stdio.
    unsafe { libc::_exit(CHILD_FAILED) }
}

extern "C" fn exec_child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` passed to clone by `spawn`, alive and unchanged until
    // this child execs or exits (the parent is suspended); it is only read here, apart from
    // the atomics.
    let args = unsafe { &*arg.cast::<ChildArgs<'_>>() };
    // The child shares the parent's TLS (no CLONE_SETTLS), so errno is the suspended parent
    // thread's, which nobody else touches meanwhile.
    // SAFETY: setsid has no memory effects.
    if unsafe { libc::setsid() } < 0 {
        child_fail(args, STEP_SETSID, errno());
    }
    for (target, &fd) in (0..).zip(args.stdio.iter()) {
        // SAFETY: dup2 on descriptors the parent keeps open (all above 2, so none is
        // overwritten before it is copied); no memory effects.
        if unsafe { libc::dup2(fd, target) } < 0 {
            child_fail(args, STEP_DUP, errno());
        }
    }
    if args.ctty {
        // SAFETY: ioctl on fd 0, a terminal this new session leader now has; no memory effects.
        if unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) } < 0 {
            child_fail(args, STEP_CTTY, errno());
        }
    }
    if let Some((uid, gid)) = args.creds {
        // Raw syscalls change only this task's credentials (the child shares the parent's
        // memory but not its credentials: no CLONE_THREAD); glibc's wrappers would signal
        // the agent's threads to change theirs too.
        let groups = [gid];
        // SAFETY: `groups` is a live array of one gid; no other memory is touched.
        if unsafe { libc::syscall(libc::SYS_setgroups, 1usize, groups.as_ptr()) } != 0 {
            child_fail(args, STEP_CREDS, errno());
        }
        // SAFETY: takes three ids by value; no memory effects.
        if unsafe { libc::syscall(libc::SYS_setresgid, gid, gid, gid) } != 0 {
            child_fail(args, STEP_CREDS, errno());
        }
        // SAFETY: as above.
        if unsafe { libc::syscall(libc::SYS_setresuid, uid, uid, uid) } != 0 {
            child_fail(args, STEP_CREDS, errno());
        }
    }
    if args.reset_sigpipe {
        // SAFETY: restores the default action of one signal; no handler runs in this child.
        if unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) } == libc::SIG_ERR {
            child_fail(args, STEP_SIGPIPE, errno());
        }
    }
    // A program's time limit and interrupt are SIGINT first: it must not start with it
    // ignored or blocked (see `reset_interrupt_signals`).
    reset_interrupt_signals();
    if !args.cwd.is_null() {
        // SAFETY: `cwd` is a NUL-terminated string kept alive by the parent.
        if unsafe { libc::chdir(args.cwd) } != 0 {
            child_fail(args, STEP_CHDIR, errno());
        }
    }
    // Like execvp: try each candidate; "not here" errors move on, EACCES is remembered, any
    // other error stops the search.
    let mut reported = (0, libc::ENOENT);
    for (index, &program) in args.programs.iter().enumerate() {
        // SAFETY: program, argv and envp are NUL-terminated strings and NULL-terminated arrays
        // of them, kept alive by the suspended parent. execve only returns on failure.
        unsafe { libc::execve(program, args.argv, args.envp) };
        match errno() {
            libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENAMETOOLONG | libc::ELOOP => {
                if reported.1 != libc::EACCES {
                    reported = (index, libc::ENOENT);
                }
            }
            libc::EACCES => reported = (index, libc::EACCES),
            other => {
                reported = (index, other);
                break;
            }
        }
    }
    args.failed_program.store(reported.0, Ordering::Relaxed);
    child_fail(args, STEP_EXEC, reported.1)
}

/// A started program.
#[derive(Debug)]
pub(crate) struct Spawned {
    pub(crate) pid: libc::pid_t,
    pub(crate) pidfd: OwnedFd,
    /// Write end of the program's stdin (a pipe, or a copy of the pty master).
    pub(crate) stdin: Option<File>,
    /// The program's stdout pipe, or the pty master.
    pub(crate) stdout: File,
    /// The program's stderr pipe (none on a pty).
    pub(crate) stderr: Option<File>,
    /// A copy of the pty master, for resizing and writing.
    pub(crate) master: Option<OwnedFd>,
}

/// Opens a new pseudo-terminal of `size`: (master, slave), both close-on-exec.
fn open_pty(size: PtySize) -> io::Result<(OwnedFd, OwnedFd)> {
    // SAFETY: the path is NUL-terminated; open has no other memory effects.
    let fd = unsafe {
        libc::open(
            c"/dev/ptmx".as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by open and is owned by nobody else.
    let master = above_stdio(unsafe { OwnedFd::from_raw_fd(fd) })?;
    let unlock: libc::c_int = 0;
    // SAFETY: TIOCSPTLCK reads one int through the pointer, which is valid.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) } < 0 {
        return Err(io::Error::last_os_error());
    }
    set_pty_size(&master, size)?;
    // TIOCGPTPEER opens the slave without a path lookup (Linux 4.13+).
    // SAFETY: the ioctl takes open flags by value and returns a new descriptor.
    let slave = unsafe {
        libc::ioctl(
            master.as_raw_fd(),
            libc::TIOCGPTPEER,
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if slave < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `slave` was just returned by the ioctl and is owned by nobody else.
    let slave = above_stdio(unsafe { OwnedFd::from_raw_fd(slave) })?;
    Ok((master, slave))
}

/// Sets a terminal's window size (`TIOCSWINSZ`; the foreground group gets `SIGWINCH`).
pub(crate) fn set_pty_size(fd: &OwnedFd, size: PtySize) -> io::Result<()> {
    let winsize = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize through the pointer, which is valid.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &winsize) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn dup_file(fd: &OwnedFd) -> Result<File, SpawnError> {
    fd.try_clone().map(File::from).map_err(SpawnError::Pipe)
}

fn null_terminated(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn spawn(
    prepared: &Prepared,
    env: &ExecEnv,
    children: &Children,
    with_stdin: bool,
    pty: Option<PtySize>,
    creds: Option<(u32, u32)>,
    program_name: &str,
) -> Result<Spawned, SpawnError> {
    if let Some(size) = pty {
        let (master, slave) = open_pty(size).map_err(SpawnError::Pty)?;
        let stdin = if with_stdin {
            Some(dup_file(&master)?)
        } else {
            None
        };
        let handle = master.try_clone().map_err(SpawnError::Pipe)?;
        let fd = slave.as_raw_fd();
        let (pid, pidfd) =
            clone_child(prepared, env, children, [fd; 3], true, creds, program_name)?;
        drop(slave);
        return Ok(Spawned {
            pid,
            pidfd,
            stdin,
            stdout: File::from(master),
            stderr: None,
            master: Some(handle),
        });
    }
    // The child's stdin: a pipe we feed, /dev/null, or an empty pipe.
    let (child_stdin, stdin_writer, stdin_fd) = match (&env.devnull, with_stdin) {
        (Some(devnull), false) => (None, None, devnull.as_raw_fd()),
        (None, false) => {
            let (r, _closed_writer) = pipe()?;
            let fd = r.as_raw_fd();
            (Some(r), None, fd)
        }
        (_, true) => {
            let (r, w) = pipe()?;
            let fd = r.as_raw_fd();
            (Some(r), Some(w), fd)
        }
    };
    let (stdout_r, stdout_w) = pipe()?;
    let (stderr_r, stderr_w) = pipe()?;
    let stdio = [stdin_fd, stdout_w.as_raw_fd(), stderr_w.as_raw_fd()];
    let spawned = clone_child(prepared, env, children, stdio, false, creds, program_name);
    // The child's ends are in the child now (or it is gone).
    drop((child_stdin, stdout_w, stderr_w));
    let (pid, pidfd) = spawned?;
    Ok(Spawned {
        pid,
        pidfd,
        stdin: stdin_writer.map(File::from),
        stdout: File::from(stdout_r),
        stderr: Some(File::from(stderr_r)),
        master: None,
    })
}

/// Clones the child with `stdio` and waits (CLONE_VFORK) until it has exec'd or failed.
fn clone_child(
    prepared: &Prepared,
    env: &ExecEnv,
    children: &Children,
    stdio: [libc::c_int; 3],
    ctty: bool,
    creds: Option<(u32, u32)>,
    program_name: &str,
) -> Result<(libc::pid_t, OwnedFd), SpawnError> {
    let programs: Vec<*const libc::c_char> = prepared.programs.iter().map(|p| p.as_ptr()).collect();
    let argv = null_terminated(&prepared.argv);
    let envp = null_terminated(&prepared.envp);
    let args = ChildArgs {
        programs: &programs,
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        cwd: prepared
            .cwd
            .as_ref()
            .map_or(std::ptr::null(), |c| c.as_ptr()),
        stdio,
        reset_sigpipe: env.reset_sigpipe,
        ctty,
        creds,
        failed_step: AtomicI32::new(0),
        failed_errno: AtomicI32::new(0),
        failed_program: AtomicUsize::new(0),
    };

    let (pid, pidfd) = children.spawn(|| {
        const STACK_SIZE: usize = 16 * 1024;
        let mut stack = std::mem::MaybeUninit::<[u8; STACK_SIZE]>::uninit();
        let stack_top = stack.as_mut_ptr().cast::<u8>().wrapping_add(STACK_SIZE);
        let mut pidfd: libc::c_int = -1;
        // SAFETY: the stack top is one past the end of a live local buffer (glibc aligns it);
        // the buffer, `args` and everything it points to outlive the child's use of them,
        // because CLONE_VFORK suspends this thread until the child has exec'd or exited. The
        // child runs only `exec_child`. With CLONE_PIDFD the kernel writes the pidfd through
        // the parent_tid argument, a valid pointer to a local int.
        let pid = unsafe {
            libc::clone(
                exec_child,
                stack_top.cast(),
                libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD | libc::SIGCHLD,
                std::ptr::from_ref(&args).cast_mut().cast(),
                std::ptr::from_mut(&mut pidfd),
            )
        };
        if pid < 0 {
            return Err(SpawnError::Clone(io::Error::last_os_error()));
        }
        // SAFETY: clone succeeded with CLONE_PIDFD, so `pidfd` is a new descriptor we own.
        Ok((pid, unsafe { OwnedFd::from_raw_fd(pidfd) }))
    })?;
    let step = args.failed_step.load(Ordering::Relaxed);
    if step != 0 {
        let _ = children.wait(pid);
        let source = io::Error::from_raw_os_error(args.failed_errno.load(Ordering::Relaxed));
        if step != STEP_EXEC {
            return Err(SpawnError::Setup {
                step: step_name(step),
                source,
            });
        }
        let index = args.failed_program.load(Ordering::Relaxed);
        let program = if prepared.programs.len() > 1 {
            format!(
                "{program_name} (searched PATH; last tried {})",
                prepared.programs[index.min(prepared.programs.len() - 1)].to_string_lossy()
            )
        } else {
            program_name.to_owned()
        };
        return Err(SpawnError::Exec { program, source });
    }
    Ok((pid, pidfd))
}

/// How the pump loop ended.
pub(crate) enum Pumped {
    /// The program exited; `timed_out` if the time limit killed it.
    Exited { timed_out: bool },
    /// The connection is gone (or poll failed); the process group was killed.
    Abandoned(io::Error),
}

fn kill_group(pid: libc::pid_t) {
    // SAFETY: kill has no memory effects. The group leader is our unreaped child (or zombie),
    // so the group id cannot have been reused.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
}

fn poll_timeout(deadline: Option<Instant>) -> libc::c_int {
    match deadline {
        None => -1,
        Some(deadline) => {
            let left = deadline.saturating_duration_since(Instant::now());
            // Round up so that the deadline has passed when poll returns 0.
            let ms = left.as_millis() + u128::from(left.subsec_nanos() % 1_000_000 != 0);
            libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
        }
    }
}

/// Moves the program's output to `sink` (flushed after each wake-up) and feeds it `stdin`
/// through `stdin_pipe`, until it has exited and its pipes are drained (or [`DRAIN_LIMIT`]
/// passed), the deadline killed it, or the sink's peer hung up (the group is killed).
pub(crate) fn pump(
    pid: libc::pid_t,
    pidfd: &OwnedFd,
    mut stdin_pipe: Option<File>,
    stdin: &[u8],
    pipes: [Option<File>; 2],
    mut deadline: Option<Instant>,
    sink: &mut dyn Sink,
) -> Pumped {
    const OUT: usize = 0;
    const ERR: usize = 1;
    const PID: usize = 2;
    const PEER: usize = 3;
    const IN: usize = 4;
    let mut pipes = pipes;
    let mut stdin_pos = 0;
    let mut exited_at: Option<Instant> = None;
    let mut timed_out = false;
    let mut buf = vec![0u8; MAX_CHUNK];

    loop {
        let fd_of = |file: &Option<File>| file.as_ref().map_or(-1, AsRawFd::as_raw_fd);
        let pid_fd = if exited_at.is_some() {
            -1
        } else {
            pidfd.as_raw_fd()
        };
        let mut fds = [
            (fd_of(&pipes[OUT]), libc::POLLIN),
            (fd_of(&pipes[ERR]), libc::POLLIN),
            (pid_fd, libc::POLLIN),
            (sink.peer_fd().unwrap_or(-1), libc::POLLRDHUP),
            (fd_of(&stdin_pipe), libc::POLLOUT),
        ]
        .map(|(fd, events)| libc::pollfd {
            fd,
            events,
            revents: 0,
        });
        let timeout = if exited_at.is_some() {
            0
        } else {
            poll_timeout(deadline)
        };
        // SAFETY: `fds` is a valid array of pollfd for its length; negative fds are ignored.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            kill_group(pid);
            return Pumped::Abandoned(err);
        }
        if n == 0 {
            if exited_at.is_some() {
                return Pumped::Exited { timed_out };
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                kill_group(pid);
                timed_out = true;
                deadline = None;
            }
            continue;
        }

        for slot in [OUT, ERR] {
            if fds[slot].revents == 0 {
                continue;
            }
            let Some(pipe) = &mut pipes[slot] else {
                continue;
            };
            match pipe.read(&mut buf) {
                Ok(0) | Err(_) => pipes[slot] = None,
                Ok(n) => {
                    let data = buf[..n].to_vec();
                    sink.event(if slot == OUT {
                        EventKind::Stdout { data }
                    } else {
                        EventKind::Stderr { data }
                    });
                }
            }
        }
        if fds[PID].revents != 0 {
            exited_at = Some(Instant::now());
            stdin_pipe = None;
        }
        if fds[PEER].revents & (libc::POLLHUP | libc::POLLERR | libc::POLLRDHUP) != 0 {
            kill_group(pid);
            return Pumped::Abandoned(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the host closed the connection during the call",
            ));
        }
        let revents = fds[IN].revents;
        if let Some(pipe) = stdin_pipe.as_mut().filter(|_| revents != 0) {
            if revents & libc::POLLOUT != 0 && revents & libc::POLLERR == 0 {
                let end = stdin.len().min(stdin_pos + STDIN_CHUNK);
                match pipe.write(&stdin[stdin_pos..end]) {
                    Ok(n) => stdin_pos += n,
                    // EPIPE: the program closed its stdin and gets no more.
                    Err(_) => stdin_pos = stdin.len(),
                }
            } else {
                stdin_pos = stdin.len();
            }
            if stdin_pos >= stdin.len() {
                // Closing our end makes the program see EOF.
                stdin_pipe = None;
            }
        }
        if let Err(e) = sink.flush() {
            kill_group(pid);
            return Pumped::Abandoned(e);
        }
        if let Some(at) = exited_at {
            if pipes.iter().all(Option::is_none) || at.elapsed() >= DRAIN_LIMIT {
                return Pumped::Exited { timed_out };
            }
        }
    }
}

/// Validates `req` and starts its program; on failure, the error event to send
/// (`bad_request` or `spawn_failed`).
pub(crate) fn start(
    env: &ExecEnv,
    children: &Children,
    req: &ExecRequest,
    opts: StartOptions<'_>,
) -> Result<Spawned, ErrorInfo> {
    let stdin = req.stdin.as_deref().unwrap_or_default();
    if opts.stdin_stream && !stdin.is_empty() {
        return Err(ErrorInfo::new(
            ErrorCode::BadRequest,
            "exec: `stdin` and `stdin_stream` exclude each other",
        ));
    }
    if req.pty.is_some_and(|p| p.cols == 0 || p.rows == 0) {
        return Err(ErrorInfo::new(
            ErrorCode::BadRequest,
            "exec: pty cols and rows must be at least 1",
        ));
    }
    let prepared = prepare_as(req, env, opts.creds)
        .map_err(|message| ErrorInfo::new(ErrorCode::BadRequest, message))?;
    let program_name = req.argv.first().map_or("", String::as_str);
    spawn(
        &prepared,
        env,
        children,
        !stdin.is_empty() || opts.stdin_stream,
        req.pty,
        opts.creds.map(|c| (c.uid, c.gid)),
        program_name,
    )
    .map_err(|e| ErrorInfo::new(ErrorCode::SpawnFailed, e.to_string()))
}

/// The instant `req`'s time limit runs out.
pub(crate) fn deadline(req: &ExecRequest) -> Option<Instant> {
    req.timeout_ms
        .and_then(|ms| Instant::now().checked_add(Duration::from_millis(ms)))
}

/// Reaps the program and queues `exit` and `end` (or the error); `Err` when the pump lost the
/// connection.
pub(crate) fn finish(
    children: &Children,
    pid: libc::pid_t,
    pumped: Pumped,
    sink: &mut dyn Sink,
) -> io::Result<()> {
    let status = children.wait(pid);
    match (pumped, status) {
        (Pumped::Abandoned(e), _) => Err(e),
        (Pumped::Exited { timed_out }, Ok(status)) => {
            sink.event(EventKind::Exit(status));
            sink.event(EventKind::end(if timed_out {
                EndStatus::TimedOut
            } else {
                EndStatus::Ok
            }));
            Ok(())
        }
        (Pumped::Exited { .. }, Err(e)) => {
            sink.event(EventKind::Error(ErrorInfo::new(
                ErrorCode::Internal,
                format!("waiting for pid {pid} failed: {e}"),
            )));
            Ok(())
        }
    }
}

/// Serves one foreground `exec` call outside any process table: `started`, output, `exit`,
/// `end` go to `sink` (flushed as they come); the terminal event is queued but not flushed.
/// Returns an error only when the connection is unusable.
pub fn run(
    env: &ExecEnv,
    children: &Children,
    req: &ExecRequest,
    sink: &mut dyn Sink,
) -> io::Result<()> {
    let spawned = match start(env, children, req, StartOptions::default()) {
        Ok(spawned) => spawned,
        Err(info) => {
            sink.event(EventKind::Error(info));
            return Ok(());
        }
    };
    let Spawned {
        pid,
        pidfd,
        stdin: stdin_pipe,
        stdout,
        stderr,
        master: _,
    } = spawned;
    sink.event(EventKind::Started { pid });
    let pumped = pump(
        pid,
        &pidfd,
        stdin_pipe,
        req.stdin.as_deref().unwrap_or_default(),
        [Some(stdout), stderr],
        deadline(req),
        sink,
    );
    finish(children, pid, pumped, sink)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::ExitStatus;

    /// Collects events; optionally watches a descriptor for hang-up.
    #[derive(Default)]
    struct Collect {
        events: Vec<EventKind>,
        flushes: usize,
        peer: Option<RawFd>,
    }

    impl Sink for Collect {
        fn event(&mut self, kind: EventKind) {
            self.events.push(kind);
        }
        fn flush(&mut self) -> io::Result<()> {
            self.flushes += 1;
            Ok(())
        }
        fn peer_fd(&self) -> Option<RawFd> {
            self.peer
        }
    }

    impl Collect {
        fn stdout(&self) -> Vec<u8> {
            self.events
                .iter()
                .filter_map(|e| match e {
                    EventKind::Stdout { data } => Some(data.as_slice()),
                    _ => None,
                })
                .flatten()
                .copied()
                .collect()
        }
        fn stderr(&self) -> Vec<u8> {
            self.events
                .iter()
                .filter_map(|e| match e {
                    EventKind::Stderr { data } => Some(data.as_slice()),
                    _ => None,
                })
                .flatten()
                .copied()
                .collect()
        }
        fn tail(&self) -> &[EventKind] {
            &self.events[self.events.len().saturating_sub(2)..]
        }
    }

    fn env() -> ExecEnv {
        ExecEnv::new(Some(ExecEnv::open_devnull().unwrap()), true)
    }

    fn exec(req: ExecRequest) -> Collect {
        let mut sink = Collect::default();
        run(&env(), &Children::Direct, &req, &mut sink).unwrap();
        sink
    }

    fn sh(script: &str) -> ExecRequest {
        ExecRequest::new(["/bin/sh", "-c", script])
    }

    fn ended(status: ExitStatus, end: EndStatus) -> [EventKind; 2] {
        [EventKind::Exit(status), EventKind::end(end)]
    }

    #[test]
    fn runs_and_streams_output_and_status() {
        let out = exec(sh("echo out; echo err >&2; exit 3"));
        assert_eq!(out.stdout(), b"out\n");
        assert_eq!(out.stderr(), b"err\n");
        assert_eq!(out.tail(), ended(ExitStatus::Code(3), EndStatus::Ok));
    }

    #[test]
    fn looks_programs_up_in_path_and_passes_env_and_cwd() {
        let mut req = ExecRequest::new(["sh", "-c", "echo \"$FOO $HOME\"; pwd"]);
        req.env.insert("FOO".into(), "bar baz".into());
        req.cwd = Some("/tmp".into());
        let out = exec(req);
        assert_eq!(out.stdout(), b"bar baz /root\n/tmp\n");
        assert_eq!(out.tail(), ended(ExitStatus::Code(0), EndStatus::Ok));
    }

    #[test]
    fn feeds_stdin_larger_than_a_pipe() {
        let input: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut req = ExecRequest::new(["cat"]);
        req.stdin = Some(input.clone());
        let out = exec(req);
        assert_eq!(out.stdout(), input);
        assert!(out
            .events
            .iter()
            .all(|e| !matches!(e, EventKind::Stdout { data } if data.len() > MAX_CHUNK)));
        assert_eq!(out.tail(), ended(ExitStatus::Code(0), EndStatus::Ok));
    }

    #[test]
    fn stdin_defaults_to_dev_null_or_an_empty_pipe() {
        let out = exec(sh("cat; echo done"));
        assert_eq!(out.stdout(), b"done\n");
        let mut sink = Collect::default();
        let no_devnull = ExecEnv::new(None, true);
        run(
            &no_devnull,
            &Children::Direct,
            &sh("cat; echo done"),
            &mut sink,
        )
        .unwrap();
        assert_eq!(sink.stdout(), b"done\n");
    }

    #[test]
    fn a_program_that_ignores_stdin_does_not_hang_the_call() {
        let mut req = sh("exit 0");
        req.stdin = Some(vec![b'x'; 1 << 20]);
        let out = exec(req);
        assert_eq!(out.tail(), ended(ExitStatus::Code(0), EndStatus::Ok));
    }

    #[test]
    fn timeout_kills_the_process_group() {
        let marker = std::env::temp_dir().join(format!("ember-exec-bg-{}", std::process::id()));
        let mut req = sh(&format!("(sleep 1; touch {}) & sleep 30", marker.display()));
        req.timeout_ms = Some(200);
        let started = Instant::now();
        let out = exec(req);
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            out.tail(),
            ended(ExitStatus::Signal(libc::SIGKILL), EndStatus::TimedOut)
        );
        // The background job was in the group and died too.
        std::thread::sleep(Duration::from_millis(1200));
        assert!(!marker.exists());
    }

    #[test]
    fn background_jobs_holding_the_pipes_do_not_hold_up_the_call() {
        let started = Instant::now();
        let out = exec(sh("echo fg; sleep 3 & exit 0"));
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(out.stdout(), b"fg\n");
        assert_eq!(out.tail(), ended(ExitStatus::Code(0), EndStatus::Ok));
    }

    #[test]
    fn large_output_comes_in_bounded_chunks_in_order() {
        let out = exec(sh("head -c 1000000 /dev/zero | tr '\\0' 'a'; echo"));
        let stdout = out.stdout();
        assert_eq!(stdout.len(), 1_000_001);
        assert!(stdout[..1_000_000].iter().all(|&b| b == b'a'));
        assert!(out.events.len() >= 1_000_000 / MAX_CHUNK);
        assert!(out.flushes >= 2);
    }

    #[test]
    fn signals_are_reported() {
        let out = exec(sh("kill -TERM $$"));
        assert_eq!(
            out.tail(),
            ended(ExitStatus::Signal(libc::SIGTERM), EndStatus::Ok)
        );
    }

    #[test]
    fn sigpipe_is_default_in_the_program() {
        // With SIGPIPE ignored (the test harness's setting leaking through), `yes` would get
        // EPIPE and print an error instead of dying quietly.
        let out = exec(sh("yes | head -n 1"));
        assert_eq!(out.stdout(), b"y\n");
        assert_eq!(out.stderr(), b"");
    }

    #[test]
    fn spawn_failures_are_error_events() {
        let cases: [(ExecRequest, &str); 4] = [
            (
                ExecRequest::new(["/nonexistent/ember/prog"]),
                "cannot execute \"/nonexistent/ember/prog\": No such file",
            ),
            (
                ExecRequest::new(["ember-no-such-program"]),
                "(searched PATH; last tried /bin/ember-no-such-program)",
            ),
            (ExecRequest::new(["/etc/passwd"]), "Permission denied"),
            (
                ExecRequest {
                    cwd: Some("/nonexistent/ember".into()),
                    ..ExecRequest::new(["true"])
                },
                "chdir failed: No such file",
            ),
        ];
        for (req, expected) in cases {
            let out = exec(req);
            match out.events.as_slice() {
                [EventKind::Error(info)] => {
                    assert_eq!(info.code, ErrorCode::SpawnFailed);
                    assert!(info.message.contains(expected), "{}", info.message);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn bad_requests_are_refused_before_anything_runs() {
        let mut bad_env = ExecRequest::new(["true"]);
        bad_env.env.insert("A=B".into(), "c".into());
        for req in [
            ExecRequest::default(),
            ExecRequest::new([""]),
            ExecRequest::new(["a\0b"]),
            ExecRequest::new(["true", "x\0"]),
            bad_env,
            ExecRequest {
                cwd: Some(String::new()),
                ..ExecRequest::new(["true"])
            },
        ] {
            let out = exec(req.clone());
            match out.events.as_slice() {
                [EventKind::Error(info)] => assert_eq!(info.code, ErrorCode::BadRequest, "{req:?}"),
                other => panic!("{req:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn peer_hang_up_kills_the_program() {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut sink = Collect {
            peer: Some(ours.as_raw_fd()),
            ..Collect::default()
        };
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(theirs);
        });
        let started = Instant::now();
        let err = run(&env(), &Children::Direct, &sh("sleep 30"), &mut sink).unwrap_err();
        closer.join().unwrap();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn poll_timeouts_round_up() {
        assert_eq!(poll_timeout(None), -1);
        let t = poll_timeout(Some(Instant::now() + Duration::from_micros(1500)));
        assert!((1..=2).contains(&t), "{t}");
        assert_eq!(
            poll_timeout(Some(Instant::now() - Duration::from_secs(1))),
            0
        );
    }
}
