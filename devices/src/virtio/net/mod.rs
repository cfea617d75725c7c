//! virtio-net backed by a host TAP device. (Being written: see issue "Devices".)

use std::path::PathBuf;

/// Configuration of one network interface.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// Name of an existing TAP device (created by the orchestrator, possibly in a netns).
    pub tap: String,
    /// Guest MAC address, `aa:bb:cc:dd:ee:ff`; a locally administered one is derived otherwise.
    #[serde(default)]
    pub mac: Option<String>,
}

#[allow(dead_code)]
fn _unused(_: PathBuf) {}
