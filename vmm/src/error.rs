//! [`VmError`]: what building or running a VM can fail with.
//!
//! A leaf of the crate's module graph, like [`crate::config`]: the builders
//! ([`crate::builder`]) and the running VM ([`crate::vm`], which re-exports it) return it, and
//! [`crate::persist::SnapshotError`] carries it when building a restored VM fails.

use kvm_ioctls::Cap;

use crate::boot::BootError;
use crate::device_manager::DeviceError;
use crate::memory::MemoryError;
use ember_devices::virtio::block::BlockError;
use ember_devices::virtio::net::NetError;
use ember_devices::virtio::vsock::VsockError;

/// Errors building or running a VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// /dev/kvm missing or not accessible.
    #[error("cannot open /dev/kvm: {0} ({hint})", hint = kvm_hint(.0))]
    KvmOpen(kvm_ioctls::Error),
    /// A capability ember relies on is missing.
    #[error("this host's KVM lacks {0:?}, which ember needs")]
    MissingCap(Cap),
    /// A KVM ioctl failed.
    #[error("KVM {what} failed: {source}")]
    Kvm {
        /// The ioctl.
        what: &'static str,
        /// Why.
        source: kvm_ioctls::Error,
    },
    /// Bad vCPU count.
    #[error("{requested} vCPUs requested: must be between 1 and {max} on this host")]
    VcpuCount {
        /// Requested.
        requested: u8,
        /// Most allowed.
        max: usize,
    },
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// Kernel loading.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// MP table.
    #[error(transparent)]
    Mptable(#[from] crate::boot::mptable::MptableError),
    /// vCPU register set-up.
    #[error(transparent)]
    Regs(#[from] crate::boot::regs::RegsError),
    /// Devices.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A disk.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// A network interface.
    #[error(transparent)]
    Net(#[from] NetError),
    /// The vsock device.
    #[error(transparent)]
    Vsock(#[from] VsockError),
    /// Seccomp.
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
    /// Event loop.
    #[error("event loop: {0:?}")]
    EventLoop(event_manager::Error),
    /// Threads, eventfds, signals.
    #[error("{what}: {source}")]
    Os {
        /// What failed.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

fn kvm_hint(e: &kvm_ioctls::Error) -> &'static str {
    match e.errno() {
        libc::ENOENT => "no /dev/kvm: KVM is not available on this host (no kvm module loaded?)",
        libc::EACCES | libc::EPERM => {
            "permission denied: run as root or add the user to the group owning /dev/kvm"
        }
        _ => "is KVM usable on this host?",
    }
}
