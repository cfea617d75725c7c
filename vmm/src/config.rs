//! What a VM is built from: [`VmConfig`], the kernel command line ember starts from, and the
//! device configurations they name.
//!
//! A leaf of the crate's module graph (it uses only [`crate::cpu`] and the device crate): the
//! builders ([`crate::builder`]), the running VM ([`crate::vm`]) and snapshots
//! ([`crate::persist`], whose state file carries the configuration) all use it without using
//! one another. [`crate::vm`] re-exports these names, where other crates find them.

use std::path::PathBuf;

use ember_devices::virtio::block::BlockConfig;
pub use ember_devices::virtio::block::{BlockConfig as DiskConfig, BlockMode as DiskMode};
pub use ember_devices::virtio::net::NetConfig;
pub use ember_devices::virtio::vsock::VsockConfig;

use crate::cpu::CpuProfile;

/// The kernel command line ember starts from (before the root device, CPU-profile masks,
/// device entries and user additions).
///
/// `rcupdate.rcu_cpu_stall_suppress=1`: a guest whose vCPU the host did not run for a while
/// (an overcommitted host: hundreds of idle sandboxes while a burst of creates runs) sees an
/// RCU "stall" that is only the host's scheduling, and prints a warning with a stack dump to
/// the serial console, each line an exit (and on kvm_pvm ~8 ms of emulated work). Measured
/// here with 750 idle sandboxes under load: every guest went from idle to printing stall
/// reports at once, which kept all their vCPUs runnable and the host at load 775.
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 pci=off quiet rcupdate.rcu_cpu_stall_suppress=1";

/// What to boot.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// Kernel image (ELF vmlinux or bzImage).
    pub kernel: PathBuf,
    /// Disks, in order: the first is `/dev/vda` (and the root device when `root` is set).
    #[serde(default)]
    pub disks: Vec<BlockConfig>,
    /// Mount the first disk as the root filesystem.
    #[serde(default = "yes")]
    pub root: bool,
    /// Guest memory in MiB.
    #[serde(default = "default_mem")]
    pub mem_mib: u64,
    /// Number of vCPUs.
    #[serde(default = "one")]
    pub vcpus: u8,
    /// Replaces [`DEFAULT_CMDLINE`].
    #[serde(default)]
    pub cmdline: Option<String>,
    /// Appended after everything ember adds.
    #[serde(default)]
    pub cmdline_extra: Vec<String>,
    /// CPU profile; detected from the host when absent.
    #[serde(default)]
    pub cpu_profile: Option<CpuProfile>,
    /// Network interfaces (TAP-backed virtio-net), `eth0` first.
    #[serde(default)]
    pub net: Vec<NetConfig>,
    /// The vsock device (host side: a Unix socket).
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    /// Log dirty pages (KVM dirty log + the device-write bitmap) so that diff snapshots can
    /// be taken. Costs a write-protection fault on the first guest write to each page after
    /// every snapshot.
    #[serde(default)]
    pub track_dirty_pages: bool,
}

fn yes() -> bool {
    true
}
fn one() -> u8 {
    1
}
fn default_mem() -> u64 {
    128
}

impl VmConfig {
    /// A config booting `kernel` with defaults.
    pub fn new(kernel: PathBuf) -> Self {
        Self {
            kernel,
            disks: Vec::new(),
            root: true,
            mem_mib: default_mem(),
            vcpus: 1,
            cmdline: None,
            cmdline_extra: Vec::new(),
            cpu_profile: None,
            net: Vec::new(),
            vsock: None,
            track_dirty_pages: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_json_defaults_and_unknown_fields() {
        let c: VmConfig = serde_json::from_str(r#"{"kernel": "/k"}"#).unwrap();
        assert_eq!((c.mem_mib, c.vcpus, c.root), (128, 1, true));
        assert!(serde_json::from_str::<VmConfig>(r#"{"kernel": "/k", "mem": 1}"#).is_err());
    }
}
