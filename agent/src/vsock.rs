//! The guest's `AF_VSOCK` listening socket (three syscalls to set up, one `accept4` per
//! connection).

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::server::Listener;

/// Connections waiting to be accepted before the kernel refuses more.
pub const BACKLOG: libc::c_int = 128;

/// Receive buffer of each connection (inherited from the listener). The kernel's default is
/// 256 KiB; a larger one gives the host credit for whole 1 MiB binary frames (file uploads),
/// which the server then takes in one `recv(MSG_WAITALL)` (a vsock `recv` refuses to wait for
/// as much as its buffer holds). Memory is only used while data waits in it.
pub const BUFFER_SIZE: u64 = 2 << 20;

// `<linux/vm_sockets.h>` socket options (level AF_VSOCK).
const SO_VM_SOCKETS_BUFFER_SIZE: libc::c_int = 0;
const SO_VM_SOCKETS_BUFFER_MAX_SIZE: libc::c_int = 2;

fn set_vsock_u64(fd: BorrowedFd<'_>, option: libc::c_int, value: u64) -> io::Result<()> {
    // SAFETY: `value` is a valid u64 that outlives the call, and its size is passed.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::AF_VSOCK,
            option,
            std::ptr::from_ref(&value).cast(),
            std::mem::size_of::<u64>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A listening vsock stream socket on `VMADDR_CID_ANY`.
#[derive(Debug)]
pub struct VsockListener {
    fd: OwnedFd,
}

fn socket_addr(port: u32) -> libc::sockaddr_vm {
    // SAFETY: sockaddr_vm is plain old data; all zeroes is valid (and zeroes svm_zero).
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = libc::VMADDR_CID_ANY;
    addr.svm_port = port;
    addr
}

impl VsockListener {
    /// `socket` + `bind(VMADDR_CID_ANY, port)` + `listen`.
    pub fn bind(port: u32) -> io::Result<Self> {
        // SAFETY: plain syscall with constant arguments; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by socket and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let addr = socket_addr(port);
        // SAFETY: `addr` is an initialised sockaddr_vm that outlives the call, and the length
        // passed is its size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::from_ref(&addr).cast(),
                std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        // Best effort: without it connections keep the kernel's default buffer, and the
        // server falls back to smaller waits (see `FrameReader::read_any_socket`).
        let _ = set_vsock_u64(fd.as_fd(), SO_VM_SOCKETS_BUFFER_MAX_SIZE, BUFFER_SIZE)
            .and_then(|()| set_vsock_u64(fd.as_fd(), SO_VM_SOCKETS_BUFFER_SIZE, BUFFER_SIZE));
        // SAFETY: listen on a socket we own; no memory effects.
        if unsafe { libc::listen(fd.as_raw_fd(), BACKLOG) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd })
    }

    /// The port bound (useful after binding `VMADDR_PORT_ANY`).
    pub fn port(&self) -> io::Result<u32> {
        let mut addr = socket_addr(0);
        let mut len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
        // SAFETY: `addr` and `len` are valid out-pointers; the kernel writes at most `len`
        // bytes.
        let r = unsafe {
            libc::getsockname(
                self.fd.as_raw_fd(),
                std::ptr::from_mut(&mut addr).cast(),
                &mut len,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(addr.svm_port)
    }
}

impl AsFd for VsockListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Listener for VsockListener {
    type Stream = VsockStream;

    fn accept(&self) -> io::Result<VsockStream> {
        // SAFETY: the address out-pointers may be NULL; no other memory is involved.
        let fd = unsafe {
            libc::accept4(
                self.fd.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by accept4 and is owned by nobody else.
        Ok(VsockStream(File::from(unsafe { OwnedFd::from_raw_fd(fd) })))
    }
}

/// An accepted vsock connection: plain `read`/`write` on the socket.
#[derive(Debug)]
pub struct VsockStream(File);

impl Read for VsockStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for VsockStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsFd for VsockStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_and_listens_where_the_kernel_has_vsock() {
        // Binding needs only the vsock core; there is no transport on the test host, so nothing
        // can connect, but the set-up path runs for real.
        match VsockListener::bind(libc::VMADDR_PORT_ANY) {
            Ok(listener) => {
                let port = listener.port().unwrap();
                assert_ne!(port, libc::VMADDR_PORT_ANY);
                // The same port cannot be bound twice.
                let err = VsockListener::bind(port).unwrap_err();
                assert_eq!(err.raw_os_error(), Some(libc::EADDRINUSE));
            }
            Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
                eprintln!("skipped: no AF_VSOCK in this kernel");
            }
            Err(e) => panic!("{e}"),
        }
    }
}
