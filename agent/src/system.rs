//! What the agent asks of the guest kernel for `ping` and `sync`, behind a trait so that the
//! server can be tested on a host without touching the host's clock.
//!
//! [`LinuxSystem`] opens what it needs once (`/dev/urandom`, the boot id), so that a `sync`
//! costs three syscalls (`clock_settime`, `RNDADDENTROPY`, `RNDRESEEDCRNG`) and a `ping` none:
//! the clocks are read through the vDSO.

use std::ffi::CStr;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd};

/// The kernel services behind `ping` and `sync`.
pub trait System: Send + Sync {
    /// Milliseconds since boot.
    fn uptime_ms(&self) -> u64;
    /// The kernel's boot id, if known.
    fn boot_id(&self) -> Option<String>;
    /// The wall clock, nanoseconds since the Unix epoch (negative before it).
    fn wall_clock_ns(&self) -> i128;
    /// Sets the wall clock (`CLOCK_REALTIME`) to `ns` since the Unix epoch.
    fn set_wall_clock(&self, ns: u64) -> io::Result<()>;
    /// Mixes `bytes` into the kernel's entropy pool and makes the RNG reseed from it.
    fn add_entropy(&self, bytes: &[u8]) -> io::Result<()>;
}

/// `RNDADDENTROPY` = `_IOW('R', 0x03, int[2])`: mix bytes into the input pool, crediting entropy.
pub const RNDADDENTROPY: libc::Ioctl = 0x4008_5203;
/// `RNDRESEEDCRNG` = `_IO('R', 0x07)`: reseed the CRNG from the input pool now.
pub const RNDRESEEDCRNG: libc::Ioctl = 0x5207;

const URANDOM: &CStr = c"/dev/urandom";
const BOOT_ID: &CStr = c"/proc/sys/kernel/random/boot_id";

/// The real kernel.
#[derive(Debug)]
pub struct LinuxSystem {
    urandom: io::Result<File>,
    boot_id: Option<String>,
}

impl LinuxSystem {
    /// Opens `/dev/urandom` and reads the boot id (three or four syscalls, once). Failures are
    /// kept: `sync` reports a missing `/dev/urandom`, and `ping` goes without a boot id.
    pub fn open() -> Self {
        Self {
            urandom: open_read_only(URANDOM),
            boot_id: read_boot_id(),
        }
    }
}

fn open_read_only(path: &CStr) -> io::Result<File> {
    // SAFETY: `path` is NUL-terminated; open has no other memory effects.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by open and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

fn read_boot_id() -> Option<String> {
    let mut file = open_read_only(BOOT_ID).ok()?;
    let mut buf = [0u8; 64];
    let n = file.read(&mut buf).ok()?;
    let id = std::str::from_utf8(&buf[..n]).ok()?.trim();
    (!id.is_empty()).then(|| id.to_owned())
}

/// Reads `clock` through the vDSO (no syscall with a vDSO clock source).
pub fn clock_ns(clock: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; clock_gettime only writes it.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0;
    }
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

/// The `rand_pool_info` argument of `RNDADDENTROPY`: entropy credit in bits, buffer size in
/// bytes, then the bytes.
pub fn rand_pool_info(bytes: &[u8]) -> io::Result<Vec<u8>> {
    let too_big = || io::Error::new(io::ErrorKind::InvalidInput, "entropy buffer too large");
    let size = libc::c_int::try_from(bytes.len()).map_err(|_| too_big())?;
    let bits = size.checked_mul(8).ok_or_else(too_big)?;
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&bits.to_ne_bytes());
    info.extend_from_slice(&size.to_ne_bytes());
    info.extend_from_slice(bytes);
    Ok(info)
}

impl System for LinuxSystem {
    fn uptime_ms(&self) -> u64 {
        u64::try_from(clock_ns(libc::CLOCK_BOOTTIME) / 1_000_000).unwrap_or(0)
    }

    fn boot_id(&self) -> Option<String> {
        self.boot_id.clone()
    }

    fn wall_clock_ns(&self) -> i128 {
        clock_ns(libc::CLOCK_REALTIME)
    }

    fn set_wall_clock(&self, ns: u64) -> io::Result<()> {
        let invalid = || io::Error::new(io::ErrorKind::InvalidInput, "time out of range");
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(ns / 1_000_000_000).map_err(|_| invalid())?,
            tv_nsec: libc::c_long::try_from(ns % 1_000_000_000).map_err(|_| invalid())?,
        };
        // SAFETY: `ts` is a valid timespec that outlives the call.
        if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn add_entropy(&self, bytes: &[u8]) -> io::Result<()> {
        let urandom = match &self.urandom {
            Ok(file) => file,
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("/dev/urandom could not be opened: {e}"),
                ))
            }
        };
        let info = rand_pool_info(bytes)?;
        // SAFETY: `info` is a live buffer laid out as `struct rand_pool_info` (two ints, then
        // `buf_size` bytes); the kernel only reads it.
        if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("RNDADDENTROPY: {e}")));
        }
        // SAFETY: RNDRESEEDCRNG takes no argument.
        if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG) } != 0 {
            let e = io::Error::last_os_error();
            // ENODATA: the CRNG is not initialised yet; it will seed from the pool (which now
            // holds these bytes) when it is, so nothing stale can come out of it.
            if e.raw_os_error() != Some(libc::ENODATA) {
                return Err(io::Error::new(e.kind(), format!("RNDRESEEDCRNG: {e}")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_linux_random_h() {
        // _IOC(dir, type, nr, size) = dir << 30 | size << 16 | type << 8 | nr
        let iow = |nr: u32, size: u32| (1u32 << 30) | (size << 16) | (u32::from(b'R') << 8) | nr;
        assert_eq!(RNDADDENTROPY as u32, iow(0x03, 8));
        assert_eq!(RNDRESEEDCRNG as u32, (u32::from(b'R') << 8) | 0x07);
    }

    #[test]
    fn rand_pool_info_layout() {
        let info = rand_pool_info(&[0xaa; 40]).unwrap();
        assert_eq!(info.len(), 48);
        assert_eq!(i32::from_ne_bytes(info[0..4].try_into().unwrap()), 320);
        assert_eq!(i32::from_ne_bytes(info[4..8].try_into().unwrap()), 40);
        assert!(info[8..].iter().all(|&b| b == 0xaa));
    }

    #[test]
    fn clocks_and_boot_id_read() {
        let system = LinuxSystem::open();
        let id = system.boot_id().expect("the host has a boot id");
        assert_eq!(id.len(), 36, "{id}");
        assert!(system.uptime_ms() > 0);
        // 2020-01-01 < now < 2200-01-01
        let now = system.wall_clock_ns();
        assert!(now > 1_577_836_800 * 1_000_000_000 && now < 7_258_118_400 * 1_000_000_000);
    }

    #[test]
    fn entropy_ioctls_work_as_root() {
        // Mixing bytes into the host's pool and reseeding cannot weaken it, so this runs the
        // real ioctls when it can. The clock is never set in tests.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root");
            return;
        }
        let system = LinuxSystem::open();
        system.add_entropy(&[0x5a; 64]).unwrap();
    }

    #[test]
    fn missing_urandom_is_reported() {
        let system = LinuxSystem {
            urandom: Err(io::Error::from_raw_os_error(libc::ENOENT)),
            boot_id: None,
        };
        let err = system.add_entropy(&[1; 32]).unwrap_err();
        assert!(err.to_string().contains("/dev/urandom"), "{err}");
        assert_eq!(system.boot_id(), None);
    }
}
