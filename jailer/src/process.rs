//! Process state of the jailer: inherited descriptors, environment, network
//! namespace, rlimits, privileges, and the final `execve`.

use std::convert::Infallible;
use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::config::{EnvVar, Rlimit};
use crate::sys;

/// A failure while preparing the process that becomes the VMM.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// Closing inherited descriptors failed.
    #[error("cannot close inherited file descriptors: {0}")]
    CloseFds(#[source] io::Error),
    /// A kept descriptor could not be made inheritable.
    #[error("cannot keep file descriptor {fd} open across exec: {source}")]
    KeepFd {
        /// The descriptor.
        fd: i32,
        /// Why.
        source: io::Error,
    },
    /// Opening the network namespace failed.
    #[error("cannot open network namespace {path:?}: {source}")]
    OpenNetns {
        /// The namespace file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// `setns` failed.
    #[error("cannot join network namespace {path:?}: {source}")]
    Setns {
        /// The namespace file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// `setrlimit` failed.
    #[error("cannot set rlimit {limit}: {source}")]
    Rlimit {
        /// The limit as given.
        limit: String,
        /// Why.
        source: io::Error,
    },
    /// A privilege-dropping call failed.
    #[error("cannot drop privileges ({step}): {source}")]
    DropPrivileges {
        /// The call.
        step: &'static str,
        /// Why.
        source: io::Error,
    },
    /// The ids did not change as asked, or could be changed back.
    #[error("privileges were not dropped: {0}")]
    PrivilegesKept(String),
    /// `PR_SET_NO_NEW_PRIVS` failed.
    #[error("cannot set no_new_privs: {0}")]
    NoNewPrivs(#[source] io::Error),
    /// An argument or variable holds a NUL byte.
    #[error("argument or environment entry {0:?} contains a NUL byte")]
    Nul(String),
    /// `execve` failed.
    #[error("cannot exec {path:?} in the jail: {source}")]
    Exec {
        /// The path inside the jail.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
}

/// Closes every descriptor above 2 except `keep`, and clears `FD_CLOEXEC`
/// on the kept ones so they reach the VMM.
pub fn close_inherited_fds(keep: &[i32]) -> Result<(), ProcessError> {
    let mut keep: Vec<u32> = keep
        .iter()
        .filter_map(|&fd| u32::try_from(fd).ok())
        .filter(|&fd| fd > 2)
        .collect();
    keep.sort_unstable();
    keep.dedup();
    let mut first = 3u32;
    for &fd in &keep {
        if fd > first {
            sys::close_range(first, fd - 1).map_err(ProcessError::CloseFds)?;
        }
        first = fd.saturating_add(1);
    }
    sys::close_range(first, u32::MAX).map_err(ProcessError::CloseFds)?;
    for fd in keep {
        let fd = fd as i32; // came from an i32 above
        sys::clear_cloexec(fd).map_err(|source| ProcessError::KeepFd { fd, source })?;
    }
    Ok(())
}

/// Empties this process's environment (the VMM gets only `--env` values).
pub fn clear_env() {
    // SAFETY: the jailer is single-threaded when it calls this, so no other
    // thread can be reading the environment concurrently.
    unsafe { libc::clearenv() };
}

/// Un-ignores every ignored signal (the caller may have ignored some, and
/// ignored dispositions survive exec; handlers do not). Uses the raw
/// `rt_sigaction` system call because libc refuses to touch the signals it
/// reserves for itself, which a caller can still have ignored. SIGPIPE stays
/// as the Rust runtime set it until [`exec`] resets it.
pub fn reset_ignored_signals() {
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP || sig == libc::SIGPIPE {
            continue;
        }
        if sys::signal_is_ignored(sig) {
            sys::default_signal_raw(sig);
        }
    }
}

/// Joins the network namespace at `path` (e.g. `/var/run/netns/NAME`).
pub fn join_netns(path: &Path) -> Result<(), ProcessError> {
    let file = std::fs::File::open(path).map_err(|source| ProcessError::OpenNetns {
        path: path.to_path_buf(),
        source,
    })?;
    sys::setns(file.as_raw_fd(), libc::CLONE_NEWNET).map_err(|source| ProcessError::Setns {
        path: path.to_path_buf(),
        source,
    })
}

/// Applies each rlimit (soft and hard).
pub fn set_rlimits(limits: &[Rlimit]) -> Result<(), ProcessError> {
    for l in limits {
        let rl = libc::rlimit {
            rlim_cur: to_rlim(l.soft),
            rlim_max: to_rlim(l.hard),
        };
        // SAFETY: `rl` is a valid rlimit struct; the resource is one of the
        // RLIMIT_* constants.
        let ret = unsafe { libc::setrlimit(l.resource.raw() as _, &rl) };
        sys::cvt(ret).map_err(|source| ProcessError::Rlimit {
            limit: l.to_string(),
            source,
        })?;
    }
    Ok(())
}

fn to_rlim(v: u64) -> libc::rlim_t {
    if v == crate::config::RLIM_UNLIMITED {
        libc::RLIM_INFINITY
    } else {
        v as libc::rlim_t
    }
}

/// Drops to `uid`/`gid` for good: no supplementary groups, real, effective
/// and saved ids all changed, then verifies the result (including that
/// root cannot be regained) and sets `no_new_privs`.
pub fn drop_privileges(uid: u32, gid: u32) -> Result<(), ProcessError> {
    let step = |step| move |source| ProcessError::DropPrivileges { step, source };
    // SAFETY: a zero-length list with a null pointer clears the groups.
    sys::cvt(unsafe { libc::setgroups(0, std::ptr::null()) }).map_err(step("setgroups([])"))?;
    // SAFETY: setresgid takes plain ids.
    sys::cvt(unsafe { libc::setresgid(gid, gid, gid) }).map_err(step("setresgid"))?;
    // SAFETY: setresuid takes plain ids.
    sys::cvt(unsafe { libc::setresuid(uid, uid, uid) }).map_err(step("setresuid"))?;

    let (uids, gids) = sys::getres_ids().map_err(step("getresuid/getresgid"))?;
    if uids != [uid; 3] || gids != [gid; 3] {
        return Err(ProcessError::PrivilegesKept(format!(
            "uids {uids:?} gids {gids:?}, wanted {uid}/{gid}"
        )));
    }
    if sys::supplementary_group_count().map_err(step("getgroups"))? != 0 {
        return Err(ProcessError::PrivilegesKept(
            "supplementary groups remain".into(),
        ));
    }
    if uid != 0 {
        // SAFETY: setuid takes a plain id; it must fail here.
        if unsafe { libc::setuid(0) } == 0 {
            return Err(ProcessError::PrivilegesKept("setuid(0) succeeded".into()));
        }
        // SAFETY: setgid takes a plain id; it must fail here.
        if gid != 0 && unsafe { libc::setgid(0) } == 0 {
            return Err(ProcessError::PrivilegesKept("setgid(0) succeeded".into()));
        }
    }
    set_no_new_privs()
}

fn set_no_new_privs() -> Result<(), ProcessError> {
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only.
    let ret = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    sys::cvt(ret).map_err(ProcessError::NoNewPrivs)?;
    Ok(())
}

/// Builds the `argv` and `envp` strings for the VMM.
pub(crate) fn exec_strings(
    path: &Path,
    args: &[String],
    env: &[EnvVar],
) -> Result<(Vec<CString>, Vec<CString>), ProcessError> {
    let c = |s: String| CString::new(s.clone()).map_err(|_| ProcessError::Nul(s));
    let mut argv = vec![c(path.to_string_lossy().into_owned())?];
    for a in args {
        argv.push(c(a.clone())?);
    }
    let envp = env
        .iter()
        .map(|e| c(e.to_string()))
        .collect::<Result<_, _>>()?;
    Ok((argv, envp))
}

/// Replaces this process with `path`: default SIGPIPE, empty signal mask,
/// exactly `env` as the environment. Returns only on failure.
pub fn exec(path: &Path, args: &[String], env: &[EnvVar]) -> Result<Infallible, ProcessError> {
    let (argv, envp) = exec_strings(path, args, env)?;
    let cpath = sys::cpath(path).map_err(|source| ProcessError::Exec {
        path: path.to_path_buf(),
        source,
    })?;
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|s| s.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|s| s.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());
    // The Rust runtime ignores SIGPIPE; an ignored disposition would survive
    // exec, so restore the default. Blocked signals would too.
    sys::default_signal(libc::SIGPIPE);
    let _ = sys::sigprocmask(libc::SIG_SETMASK, &sys::sigset(&[]));
    // SAFETY: `cpath` and every argv/envp entry are NUL-terminated strings
    // kept alive by `argv`/`envp`; both pointer arrays end with a null.
    unsafe { libc::execve(cpath.as_ptr(), argv_ptrs.as_ptr(), envp_ptrs.as_ptr()) };
    Err(ProcessError::Exec {
        path: path.to_path_buf(),
        source: io::Error::last_os_error(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_strings_shape() {
        let env = vec!["A=1".parse().unwrap(), "B=x=y".parse().unwrap()];
        let (argv, envp) =
            exec_strings(Path::new("/ember-vmm"), &["--a".into(), "b".into()], &env).unwrap();
        let argv: Vec<_> = argv.iter().map(|s| s.to_str().unwrap()).collect();
        assert_eq!(argv, ["/ember-vmm", "--a", "b"]);
        let envp: Vec<_> = envp.iter().map(|s| s.to_str().unwrap()).collect();
        assert_eq!(envp, ["A=1", "B=x=y"]);
        assert!(matches!(
            exec_strings(Path::new("/x"), &["a\0b".into()], &[]),
            Err(ProcessError::Nul(_))
        ));
    }

    #[test]
    fn rlim_conversion() {
        assert_eq!(to_rlim(crate::config::RLIM_UNLIMITED), libc::RLIM_INFINITY);
        assert_eq!(to_rlim(5), 5);
    }

    #[test]
    fn missing_netns_is_named() {
        let e = join_netns(Path::new("/nonexistent/netns")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/netns"), "{e}");
    }
}
