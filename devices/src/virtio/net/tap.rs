//! A host TAP interface, attached by name through `/dev/net/tun`.
//!
//! The TAP must already exist (the orchestrator creates it, persistent, in the sandbox's network
//! namespace); the VMM only attaches to it, so it needs no `CAP_NET_ADMIN` when the TAP is owned
//! by its user. The file descriptor is non-blocking and speaks `virtio_net_hdr_v1` (12 bytes)
//! in front of every frame, which is what carries checksum and segmentation offloads.
//!
//! Tests and fuzz targets can stand a Unix datagram socket in for the TAP
//! ([`Tap::from_frame_socket`]): one datagram is one frame with its vnet header, as on the TAP,
//! and the tun ioctls are skipped.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixDatagram;

use vm_memory::VolatileSlice;

/// Length of the `virtio_net_hdr_v1` the TAP reads and writes in front of each frame.
pub const VNET_HDR_LEN: usize = 12;
/// `IFNAMSIZ - 1`: the longest interface name Linux accepts.
pub const MAX_NAME_LEN: usize = 15;
/// Most segments one `writev` may carry (`UIO_MAXIOV`).
pub const MAX_IOVECS: usize = 1024;

const TUN_PATH: &str = "/dev/net/tun";

/// Why a TAP could not be attached or configured. Every message names the TAP.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// The name cannot be an interface name.
    #[error("invalid TAP name {name:?}: {reason}")]
    InvalidName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// `/dev/net/tun` cannot be opened.
    #[error("cannot open {TUN_PATH} to attach TAP {name}: {source}")]
    OpenTun {
        /// The TAP.
        name: String,
        /// Why.
        source: io::Error,
    },
    /// No interface of that name exists in the VMM's network namespace.
    #[error(
        "TAP {name} does not exist in this network namespace \
         (create it first, e.g. `ip tuntap add dev {name} mode tap`)"
    )]
    NotFound {
        /// The TAP.
        name: String,
    },
    /// The interface exists but is not a single-queue TAP.
    #[error(
        "interface {name} is not a single-queue TAP device \
         (it is a TUN device, a multi-queue TAP, or not a tun/tap interface at all)"
    )]
    WrongType {
        /// The interface.
        name: String,
    },
    /// Another process holds the TAP open.
    #[error("TAP {name} is busy: another process has it attached")]
    Busy {
        /// The TAP.
        name: String,
    },
    /// The TAP belongs to another user or group and the VMM lacks `CAP_NET_ADMIN`.
    #[error("no permission to attach TAP {name} (its owner/group differ and CAP_NET_ADMIN is missing): {source}")]
    Permission {
        /// The TAP.
        name: String,
        /// The kernel's answer.
        source: io::Error,
    },
    /// A tun ioctl failed for another reason.
    #[error("{op} on TAP {name} failed: {source}")]
    Ioctl {
        /// The TAP.
        name: String,
        /// The ioctl.
        op: &'static str,
        /// Why.
        source: io::Error,
    },
    /// The socket standing in for a TAP ([`Tap::from_frame_socket`]) cannot be made
    /// non-blocking.
    #[error("cannot make the socket standing in for TAP {name} non-blocking: {source}")]
    FrameSocket {
        /// The name given to the stand-in.
        name: String,
        /// Why.
        source: io::Error,
    },
}

/// What a [`Tap`]'s file descriptor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    /// A TAP attached through `/dev/net/tun`.
    Tun,
    /// A Unix datagram socket standing in for a TAP: no tun ioctls.
    FrameSocket,
}

/// An attached TAP interface.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
    backend: Backend,
}

/// Checks `name` the way the kernel's `dev_valid_name` does, for a clear error up front.
pub fn validate_name(name: &str) -> Result<(), TapError> {
    let bad = |reason| {
        Err(TapError::InvalidName {
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > MAX_NAME_LEN {
        return bad("longer than 15 bytes");
    }
    if name == "." || name == ".." {
        return bad("reserved name");
    }
    if name
        .bytes()
        .any(|b| b == b'/' || b == b':' || b == 0 || b.is_ascii_whitespace())
    {
        return bad("contains '/', ':', NUL or whitespace");
    }
    Ok(())
}

fn ifreq_for(name: &str) -> libc::ifreq {
    // SAFETY: `ifreq` is a C struct of integers, byte arrays and a union of such; all-zero is a
    // valid value of every field.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    ifr
}

impl Tap {
    /// Attaches to the existing TAP `name` in the current network namespace, non-blocking, with
    /// 12-byte vnet headers and every offload towards the VMM off (see [`Tap::set_offload`]).
    pub fn open(name: &str) -> Result<Self, TapError> {
        validate_name(name)?;
        let cname = CString::new(name).map_err(|_| TapError::InvalidName {
            name: name.to_string(),
            reason: "contains NUL",
        })?;
        // SAFETY: `cname` is a valid NUL-terminated string that outlives the call, which only
        // reads it.
        if unsafe { libc::if_nametoindex(cname.as_ptr()) } == 0 {
            return Err(TapError::NotFound {
                name: name.to_string(),
            });
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(TUN_PATH)
            .map_err(|source| TapError::OpenTun {
                name: name.to_string(),
                source,
            })?;
        let mut ifr = ifreq_for(name);
        ifr.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
        // SAFETY: TUNSETIFF reads and writes one `ifreq`; `ifr` is a properly initialised
        // `ifreq` that lives across the call, and `file` is an open tun fd.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut ifr) };
        if r < 0 {
            let source = io::Error::last_os_error();
            let name = name.to_string();
            return Err(match source.raw_os_error() {
                Some(libc::EBUSY) => TapError::Busy { name },
                Some(libc::EINVAL) => TapError::WrongType { name },
                Some(libc::EPERM) | Some(libc::EACCES) => TapError::Permission { name, source },
                _ => TapError::Ioctl {
                    name,
                    op: "TUNSETIFF",
                    source,
                },
            });
        }
        let tap = Self {
            file,
            name: name.to_string(),
            backend: Backend::Tun,
        };
        // TUNSETIFF creates a TAP when none exists; one created here is not persistent and is
        // destroyed when `tap` drops. That only happens if the TAP vanished after the check
        // above: report it as missing rather than run on a TAP nobody configured.
        let mut ifr = ifreq_for(name);
        // SAFETY: TUNGETIFF writes one `ifreq` into `ifr`, which lives across the call.
        let r = unsafe { libc::ioctl(tap.file.as_raw_fd(), libc::TUNGETIFF, &mut ifr) };
        if r < 0 {
            return Err(tap.ioctl_error("TUNGETIFF"));
        }
        // SAFETY: the kernel filled the flags member; any bit pattern is a valid `c_short`.
        let flags = i32::from(unsafe { ifr.ifr_ifru.ifru_flags });
        if flags & libc::IFF_PERSIST == 0 {
            return Err(TapError::NotFound {
                name: name.to_string(),
            });
        }
        if flags & libc::IFF_TAP == 0 {
            return Err(TapError::WrongType {
                name: name.to_string(),
            });
        }
        tap.set_vnet_hdr_len()?;
        tap.set_offload(0)?;
        Ok(tap)
    }

    /// A stand-in for a TAP over one end of a Unix datagram socket pair, for tests and fuzzing.
    ///
    /// A datagram socket keeps frame boundaries, so it behaves like a TAP with `IFF_VNET_HDR`:
    /// each read returns one frame (truncated to the buffer) and each write sends one, with the
    /// 12-byte vnet header in front. The offload settings are accepted and ignored: the peer
    /// sees the headers as the device sanitised them and may send any header back, which the
    /// device checks against the guest's features as it does for a TAP. The socket is made
    /// non-blocking; `name` (checked like an interface name) labels it in messages.
    #[doc(hidden)]
    pub fn from_frame_socket(sock: UnixDatagram, name: &str) -> Result<Self, TapError> {
        validate_name(name)?;
        sock.set_nonblocking(true)
            .map_err(|source| TapError::FrameSocket {
                name: name.to_string(),
                source,
            })?;
        Ok(Self {
            file: File::from(OwnedFd::from(sock)),
            name: name.to_string(),
            backend: Backend::FrameSocket,
        })
    }

    /// The interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn ioctl_error(&self, op: &'static str) -> TapError {
        TapError::Ioctl {
            name: self.name.clone(),
            op,
            source: io::Error::last_os_error(),
        }
    }

    fn set_vnet_hdr_len(&self) -> Result<(), TapError> {
        if self.backend == Backend::FrameSocket {
            return Ok(());
        }
        let len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one `c_int` through the pointer, which is valid for the
        // duration of the call.
        let r = unsafe { libc::ioctl(self.file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &len) };
        if r < 0 {
            return Err(self.ioctl_error("TUNSETVNETHDRSZ"));
        }
        // virtio 1.x headers are little-endian; on a little-endian host that is already the
        // tun default, elsewhere it must be asked for.
        let le: libc::c_int = 1;
        // SAFETY: TUNSETVNETLE reads one `c_int` through the pointer, valid during the call.
        let r = unsafe { libc::ioctl(self.file.as_raw_fd(), libc::TUNSETVNETLE, &le) };
        if r < 0 && cfg!(target_endian = "big") {
            return Err(self.ioctl_error("TUNSETVNETLE"));
        }
        Ok(())
    }

    /// Tells the kernel which offloads the reader (the guest) accepts: a combination of
    /// `TUN_F_CSUM`, `TUN_F_TSO4`, `TUN_F_TSO6`, `TUN_F_TSO_ECN`. Frames the host sends to the
    /// TAP are checksummed and segmented by the host stack for whatever is not accepted.
    /// A no-op on a stand-in made by [`Tap::from_frame_socket`].
    pub fn set_offload(&self, flags: libc::c_uint) -> Result<(), TapError> {
        if self.backend == Backend::FrameSocket {
            return Ok(());
        }
        // SAFETY: TUNSETOFFLOAD takes its argument by value; no memory is passed.
        let r = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                libc::TUNSETOFFLOAD,
                libc::c_ulong::from(flags),
            )
        };
        if r < 0 {
            return Err(self.ioctl_error("TUNSETOFFLOAD"));
        }
        Ok(())
    }

    /// Reads one frame (vnet header first). Returns the frame's full length, which exceeds
    /// `buf.len()` when the kernel had to truncate it.
    pub fn read_frame(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.file).read(buf)
    }

    /// Writes one frame: `hdr` (a vnet header) followed by `body`, gathered from guest memory
    /// without a copy.
    pub fn write_frame(
        &self,
        hdr: &[u8; VNET_HDR_LEN],
        body: &[VolatileSlice<'_, crate::GuestBitmapSlice<'_>>],
    ) -> io::Result<usize> {
        if body.len() + 1 > MAX_IOVECS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "frame has too many segments",
            ));
        }
        let guards: Vec<_> = body.iter().map(|s| s.ptr_guard()).collect();
        let mut iov = Vec::with_capacity(body.len() + 1);
        iov.push(libc::iovec {
            iov_base: hdr.as_ptr() as *mut libc::c_void,
            iov_len: hdr.len(),
        });
        for (g, s) in guards.iter().zip(body) {
            iov.push(libc::iovec {
                iov_base: g.as_ptr() as *mut libc::c_void,
                iov_len: s.len(),
            });
        }
        // SAFETY: every iovec describes memory that stays valid for the call: `hdr` is borrowed,
        // and each guest-memory segment is kept mapped by its `VolatileSlice` (borrowing the
        // guest memory) and pointer guard. writev only reads from them; the count is at most
        // MAX_IOVECS, checked above.
        let n = unsafe { libc::writev(self.file.as_raw_fd(), iov.as_ptr(), iov.len() as i32) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_before_any_syscall() {
        for (n, ok) in [
            ("tap0", true),
            ("a234567890abcde", true),
            ("", false),
            ("a234567890abcdef", false),
            ("..", false),
            ("tap/0", false),
            ("tap:0", false),
            ("tap 0", false),
            ("tap\n", false),
        ] {
            assert_eq!(validate_name(n).is_ok(), ok, "{n:?}");
        }
        let e = Tap::open("bad/name").unwrap_err();
        assert!(e.to_string().contains("bad/name"), "{e}");
    }

    #[test]
    fn missing_tap_is_reported_by_name() {
        let e = Tap::open("ember-no-such0").unwrap_err();
        assert!(matches!(e, TapError::NotFound { .. }), "{e}");
        assert!(e.to_string().contains("ember-no-such0"), "{e}");
    }

    #[test]
    fn a_non_tap_interface_is_refused() {
        // Every network namespace has `lo`; attaching to it as a TAP must fail cleanly (EINVAL
        // when we may open /dev/net/tun, or an open/permission error otherwise).
        match Tap::open("lo") {
            Err(TapError::WrongType { name }) => assert_eq!(name, "lo"),
            Err(TapError::OpenTun { .. }) | Err(TapError::Permission { .. }) => {}
            other => panic!("attaching lo as a TAP: {other:?}"),
        }
    }

    #[test]
    fn a_frame_socket_stands_in_for_a_tap() {
        use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

        let (ours, peer) = UnixDatagram::pair().unwrap();
        assert!(matches!(
            Tap::from_frame_socket(ours.try_clone().unwrap(), "bad/name"),
            Err(TapError::InvalidName { .. })
        ));
        let tap = Tap::from_frame_socket(ours, "fake0").unwrap();
        assert_eq!(tap.name(), "fake0");
        tap.set_offload(libc::TUN_F_CSUM | libc::TUN_F_TSO4)
            .unwrap();
        tap.set_offload(0).unwrap();

        // Non-blocking, like the TAP.
        let mut buf = [0u8; 64];
        let e = tap.read_frame(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);

        // One datagram is one frame, both ways.
        peer.send(&[1u8; 30]).unwrap();
        peer.send(&[2u8; 40]).unwrap();
        assert_eq!(tap.read_frame(&mut buf).unwrap(), 30);
        assert_eq!(buf[..30], [1u8; 30]);
        let mut small = [0u8; 16];
        assert_eq!(
            tap.read_frame(&mut small).unwrap(),
            16,
            "truncated to the buffer"
        );
        let mem = crate::GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        mem.write_slice(&[7u8; 20], GuestAddress(0x100)).unwrap();
        let body = [
            mem.get_slice(GuestAddress(0x100), 5).unwrap(),
            mem.get_slice(GuestAddress(0x105), 15).unwrap(),
        ];
        let hdr = [9u8; VNET_HDR_LEN];
        assert_eq!(tap.write_frame(&hdr, &body).unwrap(), 32);
        let n = peer.recv(&mut buf).unwrap();
        assert_eq!(n, 32);
        assert_eq!(buf[..12], hdr);
        assert_eq!(buf[12..32], [7u8; 20]);
    }
}
