//! ember-snapshot: the on-disk format of ember snapshots and the contract for saving and
//! restoring components.
//!
//! A snapshot is a directory (see [`dir`]):
//! - [`STATE_FILE`]: one serde value (the VMM's `VmState`) in a versioned, checksummed frame
//!   ([`state`]): magic `EMBERSNP`, format version, body length, bincode body, CRC-64/XZ.
//!   A truncated, corrupt or newer-version file is refused before anything is built.
//! - [`MEMORY_FILE`]: raw guest memory, sparse (all-zero pages are holes), written with
//!   [`write_full`]; restore maps it `MAP_PRIVATE`.
//! - [`MEMORY_DIFF_FILE`] for diff snapshots: only the dirty pages ([`write_diff`],
//!   [`write_diff_regions`]), with a [`PageSet`] saved in the state saying which, so
//!   [`merge_diff`] can fold it onto its base.
//! - [`LAYER_FILE`] for layered snapshots ([`layer`]): the memory file holds only the pages a
//!   restored VM changed; the layer names the base memory file under them (and
//!   [`BASE_MEMORY_FILE`], a hard link to it, keeps it alive).
//!
//! [`SnapshotWriter`] builds the directory under a temporary name and renames it into place on
//! commit, so a crash never leaves a partial snapshot at the final name. Components implement
//! [`Persist`].
//!
//! This crate depends on nothing else of ember's and knows nothing of KVM: it works on byte
//! slices and serde values the VMM hands it.
//!
//! ```no_run
//! use ember_snapshot::*;
//! # #[derive(serde::Serialize, serde::Deserialize)] struct VmState { mem_len: u64 }
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let guest_memory = vec![0u8; 1 << 20];
//! // Save.
//! let writer = SnapshotWriter::create("/var/lib/ember/snapshots/tpl-1")?;
//! write_full(writer.path(MEMORY_FILE)?, &[MemoryRegionRef::new(0, 0, &guest_memory)])?;
//! write_state(writer.path(STATE_FILE)?, &VmState { mem_len: guest_memory.len() as u64 })?;
//! writer.commit()?;
//!
//! // Restore.
//! let snap = SnapshotDir::open("/var/lib/ember/snapshots/tpl-1")?;
//! let state: VmState = snap.read_state()?;
//! check_memory_file(snap.path(MEMORY_FILE)?, state.mem_len)?;
//! // ... mmap the memory file and rebuild the VM from `state`.
//! # Ok(()) }
//! ```

pub mod dir;
mod fsutil;
pub mod layer;
pub mod memory;
pub mod pageset;
pub mod persist;
pub mod state;

pub use dir::{
    remove_temp_dirs, DirError, SnapshotDir, SnapshotWriter, MEMORY_DIFF_FILE, MEMORY_FILE,
    STATE_FILE,
};
pub use layer::{
    link_base, open_base, read_layer, write_layer, BaseIdentity, LayerError, LayerState,
    BASE_MEMORY_FILE, LAYER_FILE,
};
pub use memory::{
    check_memory_file, merge_diff, write_diff, write_diff_regions, write_full, MemoryError,
    MemoryRegionRef, WriteStats,
};
pub use pageset::{pages_for, PageSet, PageSetError, PAGE_SIZE};
pub use persist::Persist;
pub use state::{
    decode_state, encode_state, read_state, verify_state, verify_state_file, write_state,
    StateError, StateInfo, FORMAT_VERSION, MIN_FORMAT_VERSION, STATE_MAGIC,
};
