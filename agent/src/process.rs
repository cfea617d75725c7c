//! Starting the boot command and waiting for it as PID 1.
//!
//! Every guest syscall costs milliseconds on an emulated ring 0, so the child is started with one
//! `clone(CLONE_VM | CLONE_VFORK)` followed by `execve`, with argv and envp built beforehand. (glibc's
//! `posix_spawn`, which `std::process::Command` uses, resets ~64 signal dispositions one syscall at
//! a time in the child; `fork` copies page tables and then takes copy-on-write faults.)

use std::ffi::{CStr, CString};
use std::fmt;
use std::io;
use std::sync::atomic::{AtomicI32, Ordering};

use thiserror::Error;

/// The shell that runs `ember.run` commands.
pub const SHELL: &CStr = c"/bin/sh";

/// The environment of the boot command.
pub const COMMAND_ENV: [&CStr; 4] = [
    c"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    c"HOME=/root",
    c"TERM=linux",
    c"LANG=C.UTF-8",
];

/// Starting the command failed.
#[derive(Debug, Error)]
pub enum SpawnError {
    /// The command contains a NUL byte, which no argument can carry.
    #[error("the command contains a NUL byte")]
    Nul,
    /// `clone` failed (out of memory or pids).
    #[error("clone failed: {0}")]
    Clone(#[source] io::Error),
    /// `execve` of the shell failed.
    #[error("cannot execute {shell}: {source}")]
    Exec {
        /// The program that could not be executed.
        shell: String,
        /// The errno of `execve`.
        #[source]
        source: io::Error,
    },
}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// It called exit with this status.
    Exited(i32),
    /// A signal killed it.
    Signaled(i32),
}

impl ExitStatus {
    /// Decodes a `waitpid` status word.
    pub fn from_wait_status(status: libc::c_int) -> Self {
        if libc::WIFSIGNALED(status) {
            ExitStatus::Signaled(libc::WTERMSIG(status))
        } else {
            ExitStatus::Exited(libc::WEXITSTATUS(status))
        }
    }
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitStatus::Exited(code) => write!(f, "exited with status {code}"),
            ExitStatus::Signaled(sig) => write!(f, "killed by signal {sig}"),
        }
    }
}

/// What the child of `clone` needs; built by the parent so that the child only calls `execve`.
struct ExecRequest<'a> {
    path: &'a CStr,
    argv: &'a [*const libc::c_char],
    envp: &'a [*const libc::c_char],
    /// errno of a failed `execve`, 0 while none.
    exec_errno: AtomicI32,
}

/// Exit status of a child whose `execve` failed, as shells use.
const EXEC_FAILED: libc::c_int = 127;

extern "C" fn exec_child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ExecRequest` passed to clone by `spawn_shell`, alive until this child
    // execs or exits (CLONE_VFORK suspends the parent until then); it is only read here, apart
    // from the atomic.
    let request = unsafe { &*arg.cast::<ExecRequest<'_>>() };
    // SAFETY: path, argv and envp are NUL-terminated strings and NULL-terminated arrays of them,
    // kept alive by the suspended parent. execve only returns on failure.
    unsafe {
        libc::execve(
            request.path.as_ptr(),
            request.argv.as_ptr(),
            request.envp.as_ptr(),
        )
    };
    // The child shares the parent's TLS (no CLONE_SETTLS), so this is the errno execve just set;
    // the suspended parent does not touch it meanwhile.
    let errno = io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::ENOEXEC);
    request.exec_errno.store(errno, Ordering::Relaxed);
    // SAFETY: _exit ends this child without running the parent's atexit handlers or touching
    // the shared stdio state.
    unsafe { libc::_exit(EXEC_FAILED) }
}

/// Starts `/bin/sh -c <command>` with [`COMMAND_ENV`], inheriting stdin/stdout/stderr.
///
/// Returns the child's pid. The child is created with `SIGCHLD` as its exit signal, so any
/// `waitpid` reaps it.
pub fn spawn_shell(command: &[u8]) -> Result<libc::pid_t, SpawnError> {
    spawn_shell_at(SHELL, command)
}

fn spawn_shell_at(shell: &CStr, command: &[u8]) -> Result<libc::pid_t, SpawnError> {
    let command = CString::new(command).map_err(|_| SpawnError::Nul)?;
    let argv = [
        c"sh".as_ptr(),
        c"-c".as_ptr(),
        command.as_ptr(),
        std::ptr::null(),
    ];
    let mut envp = [std::ptr::null(); COMMAND_ENV.len() + 1];
    for (slot, var) in envp.iter_mut().zip(COMMAND_ENV) {
        *slot = var.as_ptr();
    }
    let request = ExecRequest {
        path: shell,
        argv: &argv,
        envp: &envp,
        exec_errno: AtomicI32::new(0),
    };

    // The child only needs a little stack for the execve call; it runs on this buffer while we
    // are suspended.
    const STACK_SIZE: usize = 16 * 1024;
    let mut stack = std::mem::MaybeUninit::<[u8; STACK_SIZE]>::uninit();
    let stack_top = stack.as_mut_ptr().cast::<u8>().wrapping_add(STACK_SIZE);
    // SAFETY: the stack top is one past the end of a live local buffer (glibc aligns it); the
    // buffer, `request` and everything it points to outlive the child's use of them, because
    // CLONE_VFORK suspends this thread until the child has exec'd or exited. The child runs only
    // `exec_child`.
    let pid = unsafe {
        libc::clone(
            exec_child,
            stack_top.cast(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::from_ref(&request).cast_mut().cast(),
        )
    };
    if pid < 0 {
        return Err(SpawnError::Clone(io::Error::last_os_error()));
    }
    let errno = request.exec_errno.load(Ordering::Relaxed);
    if errno != 0 {
        // The child has exited with EXEC_FAILED; reap it before reporting.
        let _ = wait_for(pid, false);
        return Err(SpawnError::Exec {
            shell: shell.to_string_lossy().into_owned(),
            source: io::Error::from_raw_os_error(errno),
        });
    }
    Ok(pid)
}

/// Waits until `pid` ends and returns how.
///
/// With `reap_all` (PID 1), it waits for any child and throws away the status of every other one
/// on the way (orphans re-parented to init), so that no zombie is left behind.
pub fn wait_for(pid: libc::pid_t, reap_all: bool) -> io::Result<ExitStatus> {
    let target = if reap_all { -1 } else { pid };
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: `status` is a valid out-pointer for the duration of the call.
        let r = unsafe { libc::waitpid(target, &mut status, 0) };
        if r == pid {
            return Ok(ExitStatus::from_wait_status(status));
        }
        if r > 0 {
            continue; // an orphan, reaped
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // These tests run /bin/sh on the host; they wait for their own pid only, because the test
    // harness runs tests on several threads of one process.

    #[test]
    fn runs_a_command_and_reports_its_status() {
        let pid = spawn_shell(b"exit 7").unwrap();
        assert_eq!(wait_for(pid, false).unwrap(), ExitStatus::Exited(7));
    }

    #[test]
    fn reports_a_signal() {
        let pid = spawn_shell(b"kill -9 $$").unwrap();
        assert_eq!(wait_for(pid, false).unwrap(), ExitStatus::Signaled(9));
    }

    #[test]
    fn command_sees_the_documented_environment() {
        let script = b"[ \"$HOME\" = /root ] && [ \"$TERM\" = linux ] && [ \"$LANG\" = C.UTF-8 ] \
                       && [ -z \"$CARGO\" ] && case \"$PATH\" in /usr/local/sbin:*) exit 0;; esac; exit 1";
        let pid = spawn_shell(script).unwrap();
        assert_eq!(wait_for(pid, false).unwrap(), ExitStatus::Exited(0));
    }

    #[test]
    fn nul_is_refused_before_anything_runs() {
        assert!(matches!(spawn_shell(b"echo a\0b"), Err(SpawnError::Nul)));
    }

    #[test]
    fn status_lines() {
        assert_eq!(ExitStatus::Exited(0).to_string(), "exited with status 0");
        assert_eq!(ExitStatus::Signaled(9).to_string(), "killed by signal 9");
        // A raw wait status: exit 3 is 3 << 8; SIGKILL is 9.
        assert_eq!(ExitStatus::from_wait_status(3 << 8), ExitStatus::Exited(3));
        assert_eq!(ExitStatus::from_wait_status(9), ExitStatus::Signaled(9));
    }

    #[test]
    fn exec_failure_is_reported_and_the_child_reaped() {
        let err = spawn_shell_at(c"/nonexistent/ember/sh", b"true").unwrap_err();
        match &err {
            SpawnError::Exec { source, .. } => {
                assert_eq!(source.raw_os_error(), Some(libc::ENOENT))
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(
            err.to_string()
                .starts_with("cannot execute /nonexistent/ember/sh: "),
            "{err}"
        );
    }
}
