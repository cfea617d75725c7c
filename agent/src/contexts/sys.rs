//! Low-level helpers of the code contexts: pipes, socket pairs, descriptor passing, and
//! starting a context's process (`clone(CLONE_VM | CLONE_VFORK | CLONE_PIDFD)`, like `exec`,
//! with a fourth descriptor: the control socket on fd 3).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicI32, Ordering};

use crate::reaper::Children;

/// Moves `fd` to 4 or above, so that the child's `dup2` onto 0-3 never overwrites a descriptor
/// it still has to copy.
fn above_3(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 3 {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor we own; no memory is involved.
    let dup = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 4) };
    if dup < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `dup` was just returned by fcntl and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// A close-on-exec pipe whose read end (ours) is non-blocking: (read end, write end).
pub fn pipe() -> io::Result<(File, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid out-pointer for two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 just returned this descriptor; nobody else owns it.
    let r = unsafe { OwnedFd::from_raw_fd(fds[0]) };
    // SAFETY: as above, for the write end.
    let w = unsafe { OwnedFd::from_raw_fd(fds[1]) };
    // SAFETY: F_SETFL on a descriptor we own; no memory is involved.
    if unsafe { libc::fcntl(r.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((File::from(above_3(r)?), above_3(w)?))
}

/// A close-on-exec stream socket pair: (ours, the context's).
pub fn socket_pair() -> io::Result<(UnixStream, OwnedFd)> {
    let (ours, theirs) = UnixStream::pair()?;
    Ok((ours, above_3(OwnedFd::from(theirs))?))
}

/// A control message carrying `N` descriptors, laid out as `CMSG_SPACE(N * 4)` bytes: the
/// header, then the descriptors, padded to the header's alignment.
#[repr(C)]
pub struct FdMessage<const N: usize> {
    header: libc::cmsghdr,
    /// The descriptors.
    pub fds: [libc::c_int; N],
}

impl<const N: usize> FdMessage<N> {
    /// A message carrying `fds`.
    pub fn new(fds: [RawFd; N]) -> Self {
        let payload = (N * std::mem::size_of::<libc::c_int>()) as u32;
        Self {
            header: libc::cmsghdr {
                // SAFETY: CMSG_LEN is a pure computation.
                cmsg_len: unsafe { libc::CMSG_LEN(payload) } as usize,
                cmsg_level: libc::SOL_SOCKET,
                cmsg_type: libc::SCM_RIGHTS,
            },
            fds,
        }
    }
}

/// Sends `data` on `sock` with `fds` attached (SCM_RIGHTS), never raising SIGPIPE.
pub fn send_with_fds<const N: usize>(
    sock: &UnixStream,
    data: &[u8],
    fds: [RawFd; N],
) -> io::Result<()> {
    let mut control = FdMessage::new(fds);
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = std::ptr::from_mut(&mut control).cast();
    msg.msg_controllen = std::mem::size_of::<FdMessage<N>>();
    let sent = loop {
        // SAFETY: `msg` points at `iov` (describing `data`) and at `control`, a control message
        // of `msg_controllen` bytes; all are alive for the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n as usize;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    };
    // The descriptors went with the first byte; the rest (rare: the frame is small) follows.
    send_all(sock, &data[sent..])
}

/// `send` all of `data`, never raising SIGPIPE.
pub fn send_all(sock: &UnixStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        // SAFETY: the pointer and length describe `data`.
        let n = unsafe {
            libc::send(
                sock.as_raw_fd(),
                data.as_ptr().cast(),
                data.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        data = &data[n as usize..];
    }
    Ok(())
}

/// Sends `signal` to the process group `pgid` (a context leads its own session).
pub fn signal_group(pgid: libc::pid_t, signal: libc::c_int) {
    if pgid > 0 {
        // SAFETY: kill has no memory effects.
        unsafe { libc::kill(-pgid, signal) };
    }
}

/// Sets the CPU priority (nice value) of thread `tid` (0: the calling thread; a process started
/// by it inherits it, threads it makes too). Best effort: a failure leaves the priority as it was.
pub fn set_nice(tid: libc::pid_t, nice: libc::c_int) {
    // SAFETY: setpriority has no memory effects.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
}

/// [`set_nice`] for every thread of process `pid` (Linux keeps a nice value per thread).
pub fn set_nice_all(pid: libc::pid_t, nice: libc::c_int) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return;
    };
    for task in tasks.flatten() {
        if let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) {
            set_nice(tid, nice);
        }
    }
}

/// What the child of `clone` reads; built by the parent, which is suspended (CLONE_VFORK)
/// until the child has exec'd or exited.
struct ChildArgs {
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    cwd: *const libc::c_char,
    fds: [libc::c_int; 4],
    reset_sigpipe: bool,
    failed_step: AtomicI32,
    failed_errno: AtomicI32,
}

const STEP_SETSID: i32 = 1;
const STEP_DUP: i32 = 2;
const STEP_CHDIR: i32 = 3;
const STEP_EXEC: i32 = 4;

fn errno() -> i32 {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn child_fail(args: &ChildArgs, step: i32) -> ! {
    args.failed_errno.store(errno(), Ordering::Relaxed);
    args.failed_step.store(step, Ordering::Relaxed);
    // SAFETY: _exit ends the child without running atexit handlers or touching shared stdio.
    unsafe { libc::_exit(127) }
}

extern "C" fn spawn_child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` passed to clone by `spawn`, alive and unchanged until this
    // child execs or exits (the parent is suspended); only its atomics are written.
    let args = unsafe { &*arg.cast::<ChildArgs>() };
    // SAFETY: setsid has no memory effects.
    if unsafe { libc::setsid() } < 0 {
        child_fail(args, STEP_SETSID);
    }
    for (target, &fd) in (0..).zip(args.fds.iter()) {
        // SAFETY: dup2 on descriptors the parent keeps open (all above 3, so none is overwritten
        // before it is copied); no memory effects.
        if unsafe { libc::dup2(fd, target) } < 0 {
            child_fail(args, STEP_DUP);
        }
    }
    if args.reset_sigpipe {
        // SAFETY: restores the default action of one signal; no handler runs in this child.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    crate::exec::reset_interrupt_signals();
    if !args.cwd.is_null() {
        // SAFETY: `cwd` is a NUL-terminated string kept alive by the parent.
        if unsafe { libc::chdir(args.cwd) } != 0 {
            child_fail(args, STEP_CHDIR);
        }
    }
    // SAFETY: program, argv and envp are NUL-terminated strings and NULL-terminated arrays of
    // them, kept alive by the suspended parent. execve only returns on failure.
    unsafe { libc::execve(args.program, args.argv, args.envp) };
    child_fail(args, STEP_EXEC)
}

/// A process started by [`spawn`]: it leads its own session and process group.
#[derive(Debug)]
pub struct Started {
    /// Its pid (also its process group and session id).
    pub pid: libc::pid_t,
    /// Readable when it exits.
    pub pidfd: OwnedFd,
}

/// Why [`spawn`] failed.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// An argument, variable or the directory contains a NUL byte.
    #[error("{0} contains a NUL byte")]
    Nul(&'static str),
    /// `clone` failed.
    #[error("clone failed: {0}")]
    Clone(#[source] io::Error),
    /// A step in the child failed.
    #[error("{step} failed for {program}: {source}")]
    Child {
        /// Which step.
        step: &'static str,
        /// The program.
        program: String,
        /// Its errno.
        #[source]
        source: io::Error,
    },
}

/// Starts `argv` (argv[0] is the program's path) with `env`, in `cwd`, with `fds` as its
/// descriptors 0-3, in a new session.
pub fn spawn(
    argv: &[String],
    env: &[(String, String)],
    cwd: Option<&str>,
    fds: [RawFd; 4],
    reset_sigpipe: bool,
    children: &Children,
) -> Result<Started, SpawnError> {
    let c_argv = argv
        .iter()
        .map(|a| CString::new(a.as_str()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| SpawnError::Nul("an argument"))?;
    let c_env = env
        .iter()
        .map(|(k, v)| CString::new(format!("{k}={v}")))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| SpawnError::Nul("the environment"))?;
    let c_cwd = cwd
        .map(CString::new)
        .transpose()
        .map_err(|_| SpawnError::Nul("the working directory"))?;
    let Some(program) = c_argv.first() else {
        return Err(SpawnError::Nul("an empty argv"));
    };
    let argv_ptrs: Vec<*const libc::c_char> = c_argv
        .iter()
        .map(|a| a.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let env_ptrs: Vec<*const libc::c_char> = c_env
        .iter()
        .map(|a| a.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let args = ChildArgs {
        program: program.as_ptr(),
        argv: argv_ptrs.as_ptr(),
        envp: env_ptrs.as_ptr(),
        cwd: c_cwd.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
        fds,
        reset_sigpipe,
        failed_step: AtomicI32::new(0),
        failed_errno: AtomicI32::new(0),
    };
    let (pid, pidfd) = children.spawn(|| {
        const STACK_SIZE: usize = 16 * 1024;
        let mut stack = std::mem::MaybeUninit::<[u8; STACK_SIZE]>::uninit();
        let stack_top = stack.as_mut_ptr().cast::<u8>().wrapping_add(STACK_SIZE);
        let mut pidfd: libc::c_int = -1;
        // SAFETY: the stack top is one past the end of a live local buffer; the buffer, `args`
        // and everything it points to outlive the child's use of them, because CLONE_VFORK
        // suspends this thread until the child has exec'd or exited. The child runs only
        // `spawn_child`. With CLONE_PIDFD the kernel writes the pidfd through the parent_tid
        // argument, a valid pointer to a local int.
        let pid = unsafe {
            libc::clone(
                spawn_child,
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
        return Err(SpawnError::Child {
            step: match step {
                STEP_SETSID => "setsid",
                STEP_DUP => "redirecting descriptors",
                STEP_CHDIR => "chdir",
                _ => "execve",
            },
            program: argv.first().cloned().unwrap_or_default(),
            source: io::Error::from_raw_os_error(args.failed_errno.load(Ordering::Relaxed)),
        });
    }
    let _ = STEP_EXEC;
    Ok(Started { pid, pidfd })
}

/// Opens `/dev/null` read-write, close-on-exec, above fd 3.
pub fn open_devnull() -> io::Result<OwnedFd> {
    // SAFETY: the path is NUL-terminated; open has no other memory effects.
    let fd = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by open and is owned by nobody else.
    above_3(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Eight random hex digits (one `getrandom`).
pub fn random_hex() -> String {
    let mut bytes = [0u8; 4];
    // SAFETY: the pointer and length describe `bytes`.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        // Practically unreachable; fall back on something that still differs per call.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        bytes = t.to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn descriptors_pass_over_a_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut r, w) = pipe().unwrap();
        send_with_fds(&a, b"x", [w.as_raw_fd()]).unwrap();
        drop(w);
        let mut buf = [0u8; 1];
        let mut control = FdMessage::new([-1]);
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: 1,
        };
        // SAFETY: zeroed msghdr is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = std::ptr::from_mut(&mut control).cast();
        msg.msg_controllen = std::mem::size_of::<FdMessage<1>>();
        // SAFETY: the buffers `msg` points at outlive the call.
        assert_eq!(unsafe { libc::recvmsg(b.as_raw_fd(), &mut msg, 0) }, 1);
        let fd = control.fds[0];
        assert!(fd >= 0);
        // SAFETY: the received descriptor is ours now.
        let mut w = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        std::io::Write::write_all(&mut w, b"hi").unwrap();
        drop(w);
        let mut out = [0u8; 2];
        r.read_exact(&mut out).unwrap();
        assert_eq!(&out, b"hi");
    }

    #[test]
    fn children_start_with_interrupts_unblocked_whatever_the_spawning_thread_blocks() {
        // Block SIGINT in a thread of our own (the mask is per thread) and spawn from it.
        let status = std::thread::spawn(|| {
            // SAFETY: an all-zero sigset_t is a valid value for sigemptyset to initialise.
            let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
            // SAFETY: `set` is a live sigset_t on this stack.
            unsafe { libc::sigemptyset(&mut set) };
            // SAFETY: as above.
            unsafe { libc::sigaddset(&mut set, libc::SIGINT) };
            // SAFETY: changes only this thread's mask, from a valid set.
            unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
            let (mut r, w) = pipe().unwrap();
            let null = open_devnull().unwrap();
            let started = spawn(
                &["/bin/cat".into(), "/proc/self/status".into()],
                &[],
                None,
                [
                    null.as_raw_fd(),
                    w.as_raw_fd(),
                    null.as_raw_fd(),
                    null.as_raw_fd(),
                ],
                true,
                &Children::Direct,
            )
            .unwrap();
            drop(w);
            // The read end is non-blocking: let the child finish first (its output fits in
            // the pipe).
            let _ = Children::Direct.wait(started.pid);
            let mut out = String::new();
            r.read_to_string(&mut out).unwrap();
            out
        })
        .join()
        .unwrap();
        let field = |name: &str| {
            let line = status
                .lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no {name} in {status}"));
            u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
        };
        let sigint = 1u64 << (libc::SIGINT - 1);
        assert_eq!(field("SigBlk:") & sigint, 0, "SIGINT blocked in the child");
        assert_eq!(field("SigIgn:") & sigint, 0, "SIGINT ignored in the child");
    }

    #[test]
    fn spawn_reports_failures() {
        let null = open_devnull().unwrap();
        let fd = null.as_raw_fd();
        let err = spawn(
            &["/nonexistent/ember".into()],
            &[],
            None,
            [fd; 4],
            true,
            &Children::Direct,
        )
        .unwrap_err();
        assert!(err.to_string().contains("execve failed"), "{err}");
        let err = spawn(
            &["/bin/true".into()],
            &[],
            Some("/nonexistent/ember"),
            [fd; 4],
            true,
            &Children::Direct,
        )
        .unwrap_err();
        assert!(err.to_string().contains("chdir failed"), "{err}");
        assert_eq!(random_hex().len(), 8);
    }
}
