//! Thin safe wrappers over the few libc calls the jailer needs.
//!
//! Each wrapper turns a `-1`/errno return into an `io::Error`; callers attach
//! the path or step that failed when they turn it into their own error type.

use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::RawFd;
use std::path::Path;

/// Converts a libc-style return value into an `io::Result`.
pub(crate) fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Converts a path into a C string; a path with an interior NUL is refused.
pub(crate) fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "path contains an interior NUL byte",
        )
    })
}

/// `mount(2)`. `source`, `fstype` and `data` are optional as in C.
pub(crate) fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> io::Result<()> {
    let source = source.map(cpath).transpose()?;
    let target = cpath(target)?;
    let src_ptr = source.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    let fs_ptr = fstype.map_or(std::ptr::null(), |s| s.as_ptr());
    let data_ptr = data.map_or(std::ptr::null(), |s| s.as_ptr().cast::<libc::c_void>());
    // SAFETY: every pointer is either null (allowed by mount(2) for these
    // arguments) or points to a NUL-terminated string that outlives the call.
    cvt(unsafe { libc::mount(src_ptr, target.as_ptr(), fs_ptr, flags, data_ptr) })?;
    Ok(())
}

/// `umount2(2)`.
pub(crate) fn umount2(target: &Path, flags: libc::c_int) -> io::Result<()> {
    let target = cpath(target)?;
    // SAFETY: `target` is a valid NUL-terminated string for the whole call.
    cvt(unsafe { libc::umount2(target.as_ptr(), flags) })?;
    Ok(())
}

/// `pivot_root(2)` (no libc wrapper exists, so it goes through `syscall`).
pub(crate) fn pivot_root(new_root: &Path, put_old: &Path) -> io::Result<()> {
    let new_root = cpath(new_root)?;
    let put_old = cpath(put_old)?;
    // SAFETY: SYS_pivot_root takes two string pointers, both valid and
    // NUL-terminated for the duration of the call.
    let ret = unsafe { libc::syscall(libc::SYS_pivot_root, new_root.as_ptr(), put_old.as_ptr()) };
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `unshare(2)`.
pub(crate) fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: unshare only takes flags; it has no memory-safety preconditions.
    cvt(unsafe { libc::unshare(flags) })?;
    Ok(())
}

/// `setns(2)`.
pub(crate) fn setns(fd: RawFd, nstype: libc::c_int) -> io::Result<()> {
    // SAFETY: setns takes an fd and flags; an invalid fd is reported as EBADF.
    cvt(unsafe { libc::setns(fd, nstype) })?;
    Ok(())
}

/// `mknod(2)` for a character device.
pub(crate) fn mknod_char(path: &Path, mode: libc::mode_t, rdev: libc::dev_t) -> io::Result<()> {
    let path = cpath(path)?;
    // SAFETY: `path` is a valid NUL-terminated string for the whole call.
    cvt(unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR | mode, rdev) })?;
    Ok(())
}

/// `lchown(2)`: changes the owner of `path` itself (never a symlink's target).
pub(crate) fn lchown(path: &Path, uid: u32, gid: u32) -> io::Result<()> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))
}

/// `statfs(2)`, returning the filesystem magic number.
pub(crate) fn fs_magic(path: &Path) -> io::Result<i64> {
    let cpath = cpath(path)?;
    // SAFETY: all-zero is a valid bit pattern for the plain C struct `statfs`.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `cpath` is NUL-terminated and `buf` is a valid, writable statfs.
    cvt(unsafe { libc::statfs(cpath.as_ptr(), &mut buf) })?;
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libcs.
    Ok(buf.f_type as i64)
}

/// `statvfs(3)`, returning the mount flags (`ST_*`).
pub(crate) fn mount_flags(path: &Path) -> io::Result<u64> {
    let cpath = cpath(path)?;
    // SAFETY: all-zero is a valid bit pattern for the plain C struct `statvfs`.
    let mut buf: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `cpath` is NUL-terminated and `buf` is a valid, writable statvfs.
    cvt(unsafe { libc::statvfs(cpath.as_ptr(), &mut buf) })?;
    #[allow(clippy::unnecessary_cast)] // f_flag's width differs between libcs.
    Ok(buf.f_flag as u64)
}

/// Is `fd` an open file descriptor of this process?
pub(crate) fn fd_is_open(fd: RawFd) -> bool {
    // SAFETY: F_GETFD only reads the descriptor flags; a closed fd gives EBADF.
    unsafe { libc::fcntl(fd, libc::F_GETFD) != -1 }
}

/// Clears `FD_CLOEXEC` so that `fd` survives `execve`.
pub(crate) fn clear_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFD only reads the descriptor flags.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    // SAFETY: F_SETFD only changes the descriptor flags of `fd`.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) })?;
    Ok(())
}

/// Closes every descriptor in `first..=last` (`close_range(2)`).
///
/// Falls back to closing them one by one (driven by `/proc/self/fd`) on
/// kernels without `close_range`.
pub(crate) fn close_range(first: u32, last: u32) -> io::Result<()> {
    if first > last {
        return Ok(());
    }
    // SAFETY: close_range takes two integers and flags; no memory is passed.
    let ret = unsafe { libc::syscall(libc::SYS_close_range, first, last, 0u32) };
    if ret == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::ENOSYS) {
        return Err(err);
    }
    let mut fds = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let name = entry?.file_name();
        if let Some(fd) = name.to_str().and_then(|s| s.parse::<u32>().ok()) {
            fds.push(fd);
        }
    }
    // The directory handle used above is closed by now; closing its number
    // again is harmless (EBADF is ignored).
    for fd in fds.into_iter().filter(|fd| (first..=last).contains(fd)) {
        // SAFETY: closing a descriptor number has no memory-safety
        // preconditions; nothing else in this process owns it any more.
        unsafe { libc::close(fd as RawFd) };
    }
    Ok(())
}

/// Creates a pipe with `O_CLOEXEC` on both ends: `(read, write)`.
pub(crate) fn pipe() -> io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use std::os::fd::FromRawFd;
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two c_ints for pipe2 to fill.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by us.
    let read = unsafe { std::os::fd::OwnedFd::from_raw_fd(fds[0]) };
    // SAFETY: as above, for the write end.
    let write = unsafe { std::os::fd::OwnedFd::from_raw_fd(fds[1]) };
    Ok((read, write))
}

/// Real, effective and saved ids, as returned by `getresuid`/`getresgid`.
pub(crate) fn getres_ids() -> io::Result<([u32; 3], [u32; 3])> {
    let (mut ru, mut eu, mut su) = (0, 0, 0);
    let (mut rg, mut eg, mut sg) = (0, 0, 0);
    // SAFETY: the three pointers are valid, writable uid_t locations.
    cvt(unsafe { libc::getresuid(&mut ru, &mut eu, &mut su) })?;
    // SAFETY: the three pointers are valid, writable gid_t locations.
    cvt(unsafe { libc::getresgid(&mut rg, &mut eg, &mut sg) })?;
    Ok(([ru, eu, su], [rg, eg, sg]))
}

/// Number of supplementary groups of this process.
pub(crate) fn supplementary_group_count() -> io::Result<usize> {
    // SAFETY: with size 0, getgroups only returns the count and writes nothing.
    let n = cvt(unsafe { libc::getgroups(0, std::ptr::null_mut()) })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Resets a signal's disposition to the default action.
pub(crate) fn default_signal(sig: libc::c_int) {
    // SAFETY: installing SIG_DFL has no memory-safety preconditions; an
    // invalid signal number only yields EINVAL, which is ignored here.
    unsafe { libc::signal(sig, libc::SIG_DFL) };
}

/// The kernel's `struct sigaction` for `rt_sigaction` (x86-64 layout, also
/// used by aarch64 and riscv64 apart from the restorer field's use).
#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: libc::sighandler_t,
    mask: u64,
}

fn rt_sigaction(sig: libc::c_int, new: Option<&KernelSigaction>) -> Option<KernelSigaction> {
    let mut old = KernelSigaction {
        handler: 0,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    let new_ptr = new.map_or(std::ptr::null(), |n| n as *const KernelSigaction);
    // SAFETY: both pointers are null or point to a live KernelSigaction of
    // the layout the kernel expects; the set size is 8 bytes (64 signals).
    let ret = unsafe {
        libc::syscall(
            libc::SYS_rt_sigaction,
            sig,
            new_ptr,
            &mut old as *mut KernelSigaction,
            std::mem::size_of::<u64>(),
        )
    };
    (ret == 0).then_some(old)
}

/// Is `sig` currently ignored (`SIG_IGN`)?
pub(crate) fn signal_is_ignored(sig: libc::c_int) -> bool {
    rt_sigaction(sig, None).is_some_and(|old| old.handler == libc::SIG_IGN)
}

/// Sets `sig` to `SIG_DFL` with the raw system call (works for the signals
/// libc reserves, too).
pub(crate) fn default_signal_raw(sig: libc::c_int) {
    let dfl = KernelSigaction {
        handler: libc::SIG_DFL,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    let _ = rt_sigaction(sig, Some(&dfl));
}

/// Builds a signal set holding `signals`.
pub(crate) fn sigset(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: all-zero is a valid sigset_t; sigemptyset then initialises it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for &sig in signals {
        // SAFETY: `set` is a valid, initialised sigset_t.
        unsafe { libc::sigaddset(&mut set, sig) };
    }
    set
}

/// `sigprocmask(how, set)`, returning the previous mask.
pub(crate) fn sigprocmask(how: libc::c_int, set: &libc::sigset_t) -> io::Result<libc::sigset_t> {
    // SAFETY: all-zero is a valid sigset_t for the kernel to overwrite.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` and `old` are valid sigset_t values for the whole call.
    cvt(unsafe { libc::sigprocmask(how, set, &mut old) })?;
    Ok(old)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpath_rejects_interior_nul() {
        let p = Path::new(std::ffi::OsStr::from_bytes(b"/a\0b"));
        assert_eq!(cpath(p).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(cpath(Path::new("/a/b")).unwrap().as_bytes(), b"/a/b");
    }

    #[test]
    fn fd_open_and_cloexec() {
        let (r, _w) = pipe().unwrap();
        use std::os::fd::AsRawFd;
        let fd = r.as_raw_fd();
        assert!(fd_is_open(fd));
        // SAFETY: F_GETFD only reads flags of an fd we own.
        let before = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        assert_ne!(before & libc::FD_CLOEXEC, 0);
        clear_cloexec(fd).unwrap();
        // SAFETY: as above.
        let after = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        assert_eq!(after & libc::FD_CLOEXEC, 0);
        assert!(!fd_is_open(100_000));
    }

    #[test]
    fn raw_sigaction_round_trip() {
        // SIGURG is ignored by default only in the sense of its default
        // action; its disposition starts as SIG_DFL.
        assert!(!signal_is_ignored(libc::SIGURG));
        // SAFETY: setting SIG_IGN on SIGURG in this test process is harmless.
        unsafe { libc::signal(libc::SIGURG, libc::SIG_IGN) };
        assert!(signal_is_ignored(libc::SIGURG));
        default_signal_raw(libc::SIGURG);
        assert!(!signal_is_ignored(libc::SIGURG));
    }

    #[test]
    fn statfs_of_proc_is_procfs() {
        assert_eq!(fs_magic(Path::new("/proc")).unwrap(), 0x9fa0); // PROC_SUPER_MAGIC
    }
}
