//! The boot-complete marker: one byte written to a dedicated I/O port.
//!
//! The VMM traps guest writes to [`BOOT_MARKER_PORT`] and logs the time since its process started;
//! benchmarks and tests use that instead of scraping the console. The byte says which milestone
//! was reached (values 1..=255, see [`Milestone`]).
//!
//! How the byte reaches the port, in order of preference:
//! 1. `/dev/port` (needs `CONFIG_DEVPORT`): `pwrite` of one byte at offset [`BOOT_MARKER_PORT`]
//!    makes the kernel execute the `outb` itself. One syscall after the open, and no user-mode I/O
//!    privilege tricks.
//! 2. `ioperm(BOOT_MARKER_PORT, 1, 1)` and an `outb` instruction in user mode. This runs in a
//!    short-lived child sharing our memory (`clone(CLONE_VM | CLONE_VFORK)`), so that a host which
//!    faults the instruction kills the child, never PID 1 (a PID 1 killed by a signal panics the
//!    kernel).

use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;

use thiserror::Error;

/// The I/O port the VMM watches for boot milestones (one byte, `outb`).
pub const BOOT_MARKER_PORT: u16 = 0x0ef0;

/// Where the kernel exposes I/O ports as a file (offset = port number).
pub const DEV_PORT: &CStr = c"/dev/port";

/// The milestones the guest reports. The byte value is what the VMM sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Milestone {
    /// PID 1 has mounted the early file systems and read its command line.
    InitReady = 0x01,
    /// The agent's vsock listener is up (`ember.agent`): connections are queued from now on.
    AgentReady = 0x02,
}

/// How a marker byte was delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `pwrite` to `/dev/port`.
    DevPort,
    /// `ioperm` + `outb` in a helper child.
    Outb,
}

/// Neither way of writing the marker worked.
#[derive(Debug, Error)]
#[error("boot marker (port {port:#06x}) not written: /dev/port: {dev_port}; ioperm+outb: {outb}")]
pub struct MarkerError {
    /// The port.
    pub port: u16,
    /// Why `/dev/port` failed.
    pub dev_port: io::Error,
    /// Why the `outb` fallback failed.
    pub outb: OutbError,
}

/// Why the `ioperm` + `outb` fallback failed.
#[derive(Debug, Error)]
pub enum OutbError {
    /// The helper child could not be created.
    #[error("clone of the helper failed: {0}")]
    Clone(#[source] io::Error),
    /// `ioperm` was refused (needs CAP_SYS_RAWIO).
    #[error("ioperm refused: {0}")]
    Ioperm(#[source] io::Error),
    /// The helper died on a signal, most likely the `outb` faulting.
    #[error("the outb instruction killed the helper with signal {0}")]
    Signal(i32),
    /// Waiting for the helper failed.
    #[error("waiting for the helper failed: {0}")]
    Wait(#[source] io::Error),
}

/// Writes boot markers. Keeps `/dev/port` open so that later milestones cost one syscall each.
#[derive(Debug, Default)]
pub struct BootMarker {
    dev_port: Option<File>,
}

impl BootMarker {
    /// A marker writer that opens `/dev/port` on first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reports `milestone` to the VMM.
    pub fn write(&mut self, milestone: Milestone) -> Result<Method, MarkerError> {
        let value = milestone as u8;
        let dev_port = match self.write_dev_port(DEV_PORT, value) {
            Ok(()) => return Ok(Method::DevPort),
            Err(e) => e,
        };
        match outb_in_helper(BOOT_MARKER_PORT, value) {
            Ok(()) => Ok(Method::Outb),
            Err(outb) => Err(MarkerError {
                port: BOOT_MARKER_PORT,
                dev_port,
                outb,
            }),
        }
    }

    /// Writes `value` at offset [`BOOT_MARKER_PORT`] of the file `path` (normally `/dev/port`).
    fn write_dev_port(&mut self, path: &CStr, value: u8) -> io::Result<()> {
        let file = match &self.dev_port {
            Some(file) => file,
            None => self.dev_port.insert(open_write_only(path)?),
        };
        let written = file.write_at(&[value], u64::from(BOOT_MARKER_PORT))?;
        if written == 1 {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "short write to /dev/port",
            ))
        }
    }
}

/// `open(path, O_WRONLY | O_CLOEXEC)`: one syscall (std's `OpenOptions` is the same, but this keeps
/// the path a `CStr` with no allocation).
fn open_write_only(path: &CStr) -> io::Result<File> {
    // SAFETY: `path` is a valid NUL-terminated string; open has no other memory effects.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by open and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// What the helper child reads and reports back through the shared memory.
struct OutbRequest {
    port: u16,
    value: u8,
    /// errno of a failed `ioperm`, 0 if it succeeded.
    ioperm_errno: libc::c_int,
}

/// Exit status of the helper when `ioperm` failed (the errno is in the request).
const HELPER_IOPERM_FAILED: libc::c_int = 2;

extern "C" fn outb_helper(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `OutbRequest` that `outb_in_helper` passed to clone; the parent is
    // suspended (CLONE_VFORK) until this child exits, so this is the only live reference.
    let request = unsafe { &mut *arg.cast::<OutbRequest>() };
    // SAFETY: ioperm only changes this task's I/O permission bitmap.
    if unsafe { libc::ioperm(libc::c_ulong::from(request.port), 1, 1) } != 0 {
        // The child shares the parent's TLS (no CLONE_SETTLS), so errno is the parent thread's;
        // the parent is suspended and does not touch it meanwhile.
        request.ioperm_errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
        return HELPER_IOPERM_FAILED;
    }
    // SAFETY: ioperm just granted this task access to exactly this port, so the instruction is
    // permitted; it writes one byte to the port and touches no memory. If the hypervisor faults
    // it anyway, only this helper dies.
    unsafe {
        std::arch::asm!(
            "out dx, al",
            in("dx") request.port,
            in("al") request.value,
            options(nomem, nostack, preserves_flags)
        );
    }
    0
}

/// Runs `ioperm` + `outb` in a child that shares our memory and dies alone if the `outb` faults.
fn outb_in_helper(port: u16, value: u8) -> Result<(), OutbError> {
    const STACK_SIZE: usize = 16 * 1024;
    let mut stack = std::mem::MaybeUninit::<[u8; STACK_SIZE]>::uninit();
    let mut request = OutbRequest {
        port,
        value,
        ioperm_errno: 0,
    };
    let stack_top = stack.as_mut_ptr().cast::<u8>().wrapping_add(STACK_SIZE);
    // SAFETY: the stack top is one past the end of a live local buffer, which the child uses as its
    // stack (glibc aligns it); the buffer and `request` outlive the child because CLONE_VFORK
    // suspends us until the child exits. The child only runs `outb_helper`, which touches nothing
    // but `request` and its own stack.
    let pid = unsafe {
        libc::clone(
            outb_helper,
            stack_top.cast(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::from_mut(&mut request).cast(),
        )
    };
    if pid < 0 {
        return Err(OutbError::Clone(io::Error::last_os_error()));
    }
    let status = wait_pid(pid).map_err(OutbError::Wait)?;
    if libc::WIFSIGNALED(status) {
        return Err(OutbError::Signal(libc::WTERMSIG(status)));
    }
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == HELPER_IOPERM_FAILED {
        return Err(OutbError::Ioperm(io::Error::from_raw_os_error(
            request.ioperm_errno,
        )));
    }
    Ok(())
}

fn wait_pid(pid: libc::pid_t) -> io::Result<libc::c_int> {
    let mut status = 0;
    loop {
        // SAFETY: `status` is a valid out-pointer for the duration of the call.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            return Ok(status);
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
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn port_and_milestone_values_are_stable() {
        // The VMM and the benchmarks depend on these exact numbers.
        assert_eq!(BOOT_MARKER_PORT, 0x0ef0);
        assert_eq!(Milestone::InitReady as u8, 1);
        assert_eq!(Milestone::AgentReady as u8, 2);
    }

    #[test]
    fn writes_one_byte_at_the_port_offset() {
        // A regular file stands in for /dev/port: the byte must land at offset 0x0ef0.
        let path = std::env::temp_dir().join(format!("ember-marker-test-{}", std::process::id()));
        std::fs::write(&path, []).unwrap();
        let cpath = CString::new(path.as_os_str().as_bytes()).unwrap();
        let mut marker = BootMarker::new();
        marker.write_dev_port(&cpath, 0x01).unwrap();
        marker.write_dev_port(&cpath, 0x07).unwrap(); // reuses the open file
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(bytes.len(), usize::from(BOOT_MARKER_PORT) + 1);
        assert_eq!(bytes[usize::from(BOOT_MARKER_PORT)], 0x07);
        assert!(bytes[..usize::from(BOOT_MARKER_PORT)]
            .iter()
            .all(|&b| b == 0));
    }

    #[test]
    fn missing_dev_port_is_an_error_not_a_panic() {
        let mut marker = BootMarker::new();
        let err = marker
            .write_dev_port(c"/nonexistent/ember/port", 1)
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn error_message_names_port_and_both_causes() {
        let err = MarkerError {
            port: BOOT_MARKER_PORT,
            dev_port: io::Error::from_raw_os_error(libc::ENOENT),
            outb: OutbError::Signal(libc::SIGSEGV),
        };
        let msg = err.to_string();
        assert!(msg.contains("0x0ef0"), "{msg}");
        assert!(
            msg.contains("/dev/port") && msg.contains("signal 11"),
            "{msg}"
        );
    }
}
