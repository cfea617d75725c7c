//! virtio-vsock with a Unix-socket backend on the host. (Being written: see issue "Devices".)

use std::path::PathBuf;

/// Configuration of the vsock device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// The guest's context id (3 or more).
    pub guest_cid: u64,
    /// Host Unix socket: host-initiated connections connect here and send `CONNECT <port>\n`;
    /// guest connections to host port P go to `<uds_path>_P`.
    pub uds_path: PathBuf,
}
