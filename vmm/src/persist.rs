//! Snapshots on disk: writing full, diff and layered snapshots of a paused VM (with its
//! devices' states), loading and checking a snapshot's state before a restore, mapping its
//! memory, and merging a diff snapshot onto its parent.
//!
//! A snapshot is a directory written atomically (temp dir + rename, `ember_snapshot::dir`):
//! `state` (magic, version, bincode body, CRC64: [`VmState`]) and `memory` (guest RAM, sparse:
//! all-zero pages are holes). Disks are referenced by path in the state. A layered snapshot
//! (`crate::layer`) has only the pages that differ from its base memory file in `memory`, and
//! `layer` naming that base; restore maps the base and the layer's pages over it.
//!
//! Restore is a start mode: the state file is read and checked (format, checksum, host kind,
//! CPU profile, CPUID, memory file size) before anything is built; guest memory is the
//! `memory` file mapped `MAP_PRIVATE | MAP_NORESERVE`, so clones of one snapshot share the page
//! cache and copy only the pages they write, and the file is never modified. Building the
//! restored VM is [`crate::builder::build_restore`]'s.
//!
//! Dependencies go one way: the running VM ([`crate::vm`]) calls [`write_snapshot`] with a
//! [`SnapshotSource`] (borrowed parts of the paused VM) and the restore builder calls the
//! loading functions; this module uses neither of them, only the configuration
//! ([`crate::config`]), [`VmError`] ([`crate::error`]) and the lower modules (devices, KVM
//! state, layers).

use std::fs::File;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_devices::legacy::SerialSnapshot;
use ember_devices::GuestMemoryMmap;
use ember_snapshot::{MemoryRegionRef, SnapshotWriter, MEMORY_FILE, STATE_FILE};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap};

use ember_devices::bus::lock;
use ember_devices::virtio::block::{BlockMode, BlockState};
use ember_devices::virtio::mmio::MmioTransportState;
use ember_devices::virtio::net::NetState;
use ember_devices::virtio::vsock::{VsockState, VsockStateV1};
use ember_devices::virtio::QueueSnapshot;
use ember_snapshot::Persist;
use kvm_ioctls::VmFd;

use crate::config::VmConfig;
use crate::cpu::{CpuProfile, HostKvm};
use crate::device_manager::{DeviceManager, VirtioHandle};
use crate::error::VmError;
use crate::report::Reporter;
use crate::vstate::{self, KvmVmState, StateCaps, VcpuState};

/// Errors writing or restoring snapshots.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The state file.
    #[error(transparent)]
    State(#[from] ember_snapshot::StateError),
    /// The snapshot directory.
    #[error(transparent)]
    Dir(#[from] ember_snapshot::DirError),
    /// The memory file.
    #[error(transparent)]
    Memory(#[from] ember_snapshot::MemoryError),
    /// KVM state.
    #[error(transparent)]
    Kvm(#[from] vstate::StateError),
    /// A layered snapshot's layer description or base memory file.
    #[error(transparent)]
    Layer(#[from] ember_snapshot::LayerError),
    /// Finding written pages, or laying a layer over guest memory.
    #[error(transparent)]
    LayerMemory(#[from] crate::layer::LayerError),
    /// The snapshot does not fit this host or request.
    #[error("snapshot {dir}: {reason}")]
    Incompatible {
        /// The snapshot.
        dir: PathBuf,
        /// Why.
        reason: String,
    },
    /// Something this VM has cannot be snapshotted yet.
    #[error("cannot snapshot: {0}")]
    Unsupported(String),
    /// Building the restored VM failed.
    #[error("restoring {dir}: {source}")]
    Build {
        /// The snapshot.
        dir: PathBuf,
        /// Why.
        source: Box<VmError>,
    },
    /// A restore-time override does not fit the snapshot's disks.
    #[error("snapshot {dir}: disk {disk}: {reason}")]
    DiskOverride {
        /// The snapshot.
        dir: PathBuf,
        /// The disk's index (the order of `--disk`, `--disk-path` and `--disk-base`).
        disk: usize,
        /// What does not fit.
        reason: String,
    },
    /// I/O on the snapshot's files.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// One guest RAM region and where it lives in the memory file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryRegionState {
    /// Guest physical address.
    pub guest_phys_addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Offset in the memory file.
    pub file_offset: u64,
}

/// Everything in a snapshot's `state` file.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct VmState {
    /// ember version that wrote it.
    pub ember_version: String,
    /// The KVM flavour of the host that wrote it.
    pub host: HostKvm,
    /// The CPU profile the guest ran with.
    pub cpu_profile: CpuProfile,
    /// The VM's configuration.
    pub config: VmConfig,
    /// The kernel command line the guest booted with.
    pub cmdline: String,
    /// Guest RAM layout in the memory file.
    pub memory: Vec<MemoryRegionState>,
    /// VM-wide KVM state.
    pub kvm: KvmVmState,
    /// Per-vCPU KVM state.
    pub vcpus: Vec<VcpuState>,
    /// COM1.
    pub serial: SerialSnapshot,
    /// virtio devices, in placement order.
    pub virtio: Vec<VirtioDeviceState>,
    /// Capabilities the state was saved with.
    pub caps: StateCaps,
    /// Set for a diff snapshot: `memory` holds only these pages; the rest is the parent's.
    pub memory_diff: Option<MemoryDiff>,
}

/// What a diff snapshot's memory file holds.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct MemoryDiff {
    /// The snapshot this one is relative to (a full snapshot, or another diff).
    pub parent: PathBuf,
    /// Pages written since the parent (memory-file page indices).
    pub pages: ember_snapshot::PageSet,
}

/// The parts of a paused VM a snapshot is written from, borrowed from the running VM
/// ([`crate::vm::Vm`], which builds one for each snapshot request).
#[derive(Debug)]
pub struct SnapshotSource<'a> {
    /// The KVM VM.
    pub vm_fd: &'a VmFd,
    /// Guest memory.
    pub memory: &'a GuestMemoryMmap,
    /// Devices.
    pub devices: &'a DeviceManager,
    /// The configuration the VM was built from.
    pub config: &'a VmConfig,
    /// The kernel command line the guest got.
    pub cmdline: &'a str,
    /// The CPU profile in force.
    pub profile: CpuProfile,
    /// Host KVM kind.
    pub host: HostKvm,
    /// KVM state capabilities.
    pub caps: StateCaps,
    /// Number of vCPUs.
    pub vcpu_count: u8,
    /// The snapshot the next diff snapshot is relative to.
    pub diff_parent: Option<&'a Path>,
}

/// Pages written since the last call (KVM's dirty log for the guest's writes, the memory
/// bitmap for the VMM's own), as memory-file page indices; both logs are reset.
pub fn take_dirty_pages(vm: &SnapshotSource<'_>) -> Result<ember_snapshot::PageSet, SnapshotError> {
    let total: u64 = vm.memory.iter().map(|r| r.len()).sum();
    let mut pages = ember_snapshot::PageSet::new(total);
    let mut first = 0u64;
    for (slot, region) in vm.memory.iter().enumerate() {
        let kvm_log = vm
            .vm_fd
            .get_dirty_log(slot as u32, region.len() as usize)
            .map_err(|source| vstate::StateError::Kvm {
                what: "KVM_GET_DIRTY_LOG",
                vcpu: None,
                source,
            })?;
        pages
            .insert_bitmap(first, &kvm_log)
            .map_err(|e| SnapshotError::Unsupported(e.to_string()))?;
        let vmm_log = region.get_mmap().bitmap().get_and_reset();
        pages
            .insert_bitmap(first, &vmm_log)
            .map_err(|e| SnapshotError::Unsupported(e.to_string()))?;
        first += region.len() / 4096;
    }
    Ok(pages)
}

/// A virtio device's device-specific state.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub enum DeviceState {
    /// virtio-blk.
    Block(BlockState),
    /// virtio-net.
    Net(NetState),
    /// virtio-vsock as snapshot format 1 stored it (read only; restored with a transport
    /// reset).
    Vsock(VsockStateV1),
    /// virtio-vsock with its connections (format 2).
    VsockV2(VsockState),
}

/// One placed virtio device: slot, transport registers, device state.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct VirtioDeviceState {
    /// MMIO window base.
    pub base: u64,
    /// GSI.
    pub irq: u32,
    /// Transport registers.
    pub transport: MmioTransportState,
    /// The transport's copy of the queue configuration.
    pub transport_queues: Vec<QueueSnapshot>,
    /// The device.
    pub device: DeviceState,
}

/// Turns the diff snapshot in `diff` into a full snapshot in `out`: the parent's memory with
/// the diff's pages on top, the diff's state and disk copies. Neither input is modified.
pub fn merge_snapshot(diff: &Path, out: &Path) -> Result<SnapshotInfo, SnapshotError> {
    let mut state: VmState = ember_snapshot::read_state(diff.join(STATE_FILE))?;
    let Some(d) = state.memory_diff.take() else {
        return Err(SnapshotError::Incompatible {
            dir: diff.to_path_buf(),
            reason: "is a full snapshot already; nothing to merge".into(),
        });
    };
    if let Some(layer) = ember_snapshot::read_layer(diff)? {
        // A layer names its base memory file itself (no parent state to read).
        let (base, _) = ember_snapshot::open_base(diff, &layer)?;
        return merge_onto(diff, out, &state, &base, &d.pages);
    }
    let parent_state: VmState = ember_snapshot::read_state(d.parent.join(STATE_FILE))?;
    if parent_state.memory_diff.is_some() {
        return Err(SnapshotError::Incompatible {
            dir: d.parent.clone(),
            reason: "the parent is itself a diff snapshot: merge it first".into(),
        });
    }
    let total: u64 = state.memory.iter().map(|r| r.len).sum();
    let parent_total: u64 = parent_state.memory.iter().map(|r| r.len).sum();
    if total != parent_total || d.pages.len_pages() != ember_snapshot::pages_for(total) {
        return Err(SnapshotError::Incompatible {
            dir: diff.to_path_buf(),
            reason: format!("memory size {total} does not match the parent's {parent_total}"),
        });
    }
    merge_onto(diff, out, &state, &d.parent.join(MEMORY_FILE), &d.pages)
}

/// Writes the full snapshot `out`: the memory file `base` with the `pages` of `diff`'s memory
/// on top, `state` (already without its diff), and `diff`'s disk copies.
fn merge_onto(
    diff: &Path,
    out: &Path,
    state: &VmState,
    base: &Path,
    pages: &ember_snapshot::PageSet,
) -> Result<SnapshotInfo, SnapshotError> {
    let total: u64 = state.memory.iter().map(|r| r.len).sum();
    if pages.len_pages() != ember_snapshot::pages_for(total) {
        return Err(SnapshotError::Incompatible {
            dir: diff.to_path_buf(),
            reason: format!("its page list does not cover its {total} bytes of memory"),
        });
    }
    ember_snapshot::check_memory_file(base, total)?;
    ember_snapshot::check_memory_file(diff.join(MEMORY_FILE), total)?;
    let writer = SnapshotWriter::create(out)?;
    let mem = writer.path(MEMORY_FILE)?;
    sparse_copy(base, &mem)?;
    let stats = ember_snapshot::merge_diff(&mem, diff.join(MEMORY_FILE), pages)?;
    for entry in std::fs::read_dir(diff).map_err(|source| SnapshotError::Io {
        what: "cannot list",
        path: diff.to_path_buf(),
        source,
    })? {
        let name = entry
            .map_err(|source| SnapshotError::Io {
                what: "cannot list",
                path: diff.to_path_buf(),
                source,
            })?
            .file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".overlay") {
            sparse_copy(&diff.join(&*name), &writer.path(&name)?)?;
        }
    }
    let state_path = writer.path(STATE_FILE)?;
    ember_snapshot::write_state(&state_path, state)?;
    let state_bytes = std::fs::metadata(&state_path).map(|m| m.len()).unwrap_or(0);
    writer.commit()?;
    Ok(SnapshotInfo {
        memory_bytes_written: stats.bytes_written,
        memory_file_len: total,
        state_bytes,
        layer: None,
    })
}

/// Name of the copy of disk `i`'s overlay inside a snapshot directory.
pub fn overlay_file_name(i: usize) -> String {
    format!("disk{i}.overlay")
}

/// Copies `src` to a new file `dst`, keeping holes (SEEK_DATA/SEEK_HOLE + copy_file_range).
pub fn sparse_copy(src: &Path, dst: &Path) -> Result<u64, SnapshotError> {
    use std::os::unix::io::AsRawFd;
    let io = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| SnapshotError::Io { what, path, source }
    };
    let from = File::open(src).map_err(io("cannot open", src))?;
    let len = from.metadata().map_err(io("cannot stat", src))?.len();
    let to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)
        .map_err(io("cannot create", dst))?;
    to.set_len(len).map_err(io("cannot size", dst))?;
    let (fi, fo) = (from.as_raw_fd(), to.as_raw_fd());
    let mut off: i64 = 0;
    let mut copied = 0u64;
    while (off as u64) < len {
        // SAFETY: lseek on a descriptor we own; no memory is involved.
        let data = unsafe { libc::lseek(fi, off, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: only a hole remains.
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fi, data, libc::SEEK_HOLE) };
        let end = if hole < 0 { len as i64 } else { hole };
        let (mut a, mut b) = (data, data);
        while a < end {
            // SAFETY: both descriptors are ours; the offsets are valid in-out pointers to
            // locals; the kernel copies at most `end - a` bytes between the files.
            let n = unsafe { libc::copy_file_range(fi, &mut a, fo, &mut b, (end - a) as usize, 0) };
            if n <= 0 {
                return Err(SnapshotError::Io {
                    what: "cannot copy",
                    path: src.to_path_buf(),
                    source: std::io::Error::last_os_error(),
                });
            }
            copied += n as u64;
        }
        off = end;
    }
    to.sync_all().map_err(io("cannot sync", dst))?;
    Ok(copied)
}

/// What a snapshot write produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SnapshotInfo {
    /// Memory bytes actually written (zero pages are holes).
    pub memory_bytes_written: u64,
    /// Size of the memory file.
    pub memory_file_len: u64,
    /// Size of the state file.
    pub state_bytes: u64,
    /// For a layered snapshot: what it holds and what finding it cost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layer: Option<LayerInfo>,
}

/// What a layered snapshot holds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LayerInfo {
    /// Pages in the layer (they differ from the base).
    pub pages: u64,
    /// Of those, pages pagemap showed as private copies.
    pub written_pages: u64,
    /// Of those, pages carried from the layer this VM was restored from.
    pub carried_pages: u64,
    /// pagemap entries read.
    pub scanned_pages: u64,
    /// Time to find the pages.
    pub scan_ms: f64,
    /// The base memory file (as this VMM sees it).
    pub base: PathBuf,
}

/// The host-side view of guest RAM as byte slices.
///
/// # Safety
/// The caller must guarantee nothing writes guest memory while the slices live: all vCPUs are
/// paused and the caller is the event-loop thread (the only thread running device code).
unsafe fn memory_slices(mem: &GuestMemoryMmap) -> Vec<(u64, &[u8])> {
    mem.iter()
        .map(|r| {
            let ptr = r.as_ptr();
            // SAFETY: `ptr` is the start of a live mapping of `r.len()` bytes owned by `mem`,
            // which outlives the returned slices; the caller guarantees no concurrent writes.
            let bytes = unsafe { std::slice::from_raw_parts(ptr, r.len() as usize) };
            (r.start_addr().0, bytes)
        })
        .collect()
}

/// Writes a full snapshot of `vm` (whose vCPUs are paused with `vcpu_states`) into `dir`.
pub fn write_snapshot(
    vm: &SnapshotSource<'_>,
    vcpu_states: &[VcpuState],
    dir: &Path,
    kind: crate::api::SnapshotKind,
) -> Result<SnapshotInfo, SnapshotError> {
    let diff_parent = match kind {
        crate::api::SnapshotKind::Full => None,
        crate::api::SnapshotKind::Layer => return write_layered(vm, vcpu_states, dir),
        crate::api::SnapshotKind::Diff => {
            if !vm.config.track_dirty_pages {
                return Err(SnapshotError::Unsupported(
                    "diff snapshots need dirty-page tracking from the start (--track-dirty-pages)"
                        .into(),
                ));
            }
            Some(vm.diff_parent.map(Path::to_path_buf).ok_or_else(|| {
                SnapshotError::Unsupported(
                    "no earlier snapshot of this VM to diff against: take a full snapshot first"
                        .into(),
                )
            })?)
        }
    };
    if vcpu_states.len() != usize::from(vm.vcpu_count) {
        return Err(SnapshotError::Unsupported(format!(
            "{} of {} vCPU states captured",
            vcpu_states.len(),
            vm.vcpu_count
        )));
    }
    let writer = SnapshotWriter::create(dir)?;
    // SAFETY: the vCPUs are paused (we hold their states) and this is the event-loop thread.
    let (regions, refs) = unsafe { memory_layout(vm.memory) };
    // With tracking on, every snapshot restarts the dirty logs (the next diff is relative to
    // this snapshot).
    let dirty = if vm.config.track_dirty_pages {
        Some(take_dirty_pages(vm)?)
    } else {
        None
    };
    let (stats, memory_diff) = match (diff_parent, dirty) {
        (Some(parent), Some(pages)) => (
            ember_snapshot::write_diff_regions(writer.path(MEMORY_FILE)?, &refs, &pages)?,
            Some(MemoryDiff { parent, pages }),
        ),
        _ => (
            ember_snapshot::write_full(writer.path(MEMORY_FILE)?, &refs)?,
            None,
        ),
    };
    let state_bytes = write_state_and_disks(vm, vcpu_states, &writer, regions, memory_diff)?;
    writer.commit()?;
    Ok(SnapshotInfo {
        memory_bytes_written: stats.bytes_written,
        memory_file_len: stats.file_len,
        state_bytes,
        layer: None,
    })
}

/// Guest memory's layout in the memory file (regions back to back) and the regions as
/// byte slices.
///
/// # Safety
/// As [`memory_slices`]: nothing may write guest memory while the references live.
unsafe fn memory_layout(
    mem: &GuestMemoryMmap,
) -> (Vec<MemoryRegionState>, Vec<MemoryRegionRef<'_>>) {
    // SAFETY: the caller's guarantee, passed on.
    let slices = unsafe { memory_slices(mem) };
    let mut regions = Vec::with_capacity(slices.len());
    let mut refs = Vec::with_capacity(slices.len());
    let mut off = 0u64;
    for (gpa, bytes) in slices {
        regions.push(MemoryRegionState {
            guest_phys_addr: gpa,
            len: bytes.len() as u64,
            file_offset: off,
        });
        refs.push(MemoryRegionRef::new(gpa, off, bytes));
        off += bytes.len() as u64;
    }
    (regions, refs)
}

/// Writes a layered snapshot of `vm` (restored from a snapshot, vCPUs paused with
/// `vcpu_states`) into `dir`: only the pages that differ from the memory file it was
/// restored from, the page list (as `memory_diff`, so builds without layers refuse it) and
/// the base's identity in [`ember_snapshot::LAYER_FILE`].
fn write_layered(
    vm: &SnapshotSource<'_>,
    vcpu_states: &[VcpuState],
    dir: &Path,
) -> Result<SnapshotInfo, SnapshotError> {
    let origin = crate::layer::origin_of(vm.memory).ok_or_else(|| {
        SnapshotError::Unsupported(
            "a layered snapshot needs a VM restored from a snapshot (this one was booted)".into(),
        )
    })?;
    if vcpu_states.len() != usize::from(vm.vcpu_count) {
        return Err(SnapshotError::Unsupported(format!(
            "{} of {} vCPU states captured",
            vcpu_states.len(),
            vm.vcpu_count
        )));
    }
    let t = std::time::Instant::now();
    let (mut pages, scanned) = crate::layer::written_pages(vm.memory)?;
    let written = pages.count();
    pages
        .union_with(&origin.carried)
        .map_err(crate::layer::LayerError::from)?;
    let scan_ms = t.elapsed().as_secs_f64() * 1e3;
    // Dirty logs restart here too, as after any snapshot.
    if vm.config.track_dirty_pages {
        take_dirty_pages(vm)?;
    }
    let writer = SnapshotWriter::create(dir)?;
    // SAFETY: the vCPUs are paused (we hold their states) and this is the event-loop thread.
    let (regions, refs) = unsafe { memory_layout(vm.memory) };
    let stats = ember_snapshot::write_diff_regions(writer.path(MEMORY_FILE)?, &refs, &pages)?;
    let layer = ember_snapshot::LayerState {
        base_path: origin.base_path.clone(),
        base: origin.base,
        pages: pages.count(),
    };
    ember_snapshot::write_layer(writer.path(ember_snapshot::LAYER_FILE)?, &layer)?;
    let parent = origin
        .base_path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let info = LayerInfo {
        pages: pages.count(),
        written_pages: written,
        carried_pages: origin.carried.count(),
        scanned_pages: scanned,
        scan_ms,
        base: origin.base_path.clone(),
    };
    let state_bytes = write_state_and_disks(
        vm,
        vcpu_states,
        &writer,
        regions,
        Some(MemoryDiff { parent, pages }),
    )?;
    writer.commit()?;
    Ok(SnapshotInfo {
        memory_bytes_written: stats.bytes_written,
        memory_file_len: stats.file_len,
        state_bytes,
        layer: Some(info),
    })
}

/// Writes the state file (and copies of overlay disks) of a snapshot being built in `writer`.
/// Returns the state file's size.
fn write_state_and_disks(
    vm: &SnapshotSource<'_>,
    vcpu_states: &[VcpuState],
    writer: &SnapshotWriter,
    regions: Vec<MemoryRegionState>,
    memory_diff: Option<MemoryDiff>,
) -> Result<u64, SnapshotError> {
    let serial = vm
        .devices
        .serial
        .as_ref()
        .map(|s| ember_devices::bus::lock(s).snapshot())
        .ok_or_else(|| SnapshotError::Unsupported("VM has no serial port".into()))?;
    // Overlay disks: the VM may keep writing its overlay after the snapshot, so the snapshot
    // carries its own copy (sparse), taken while the vCPUs are paused and right after the
    // device made the overlay durable (`save`).
    let mut disk_index = 0usize;
    let mut overlay_copies: Vec<(PathBuf, String)> = Vec::new();
    let virtio: Vec<VirtioDeviceState> = vm
        .devices
        .virtio
        .iter()
        .map(|slot| {
            let t = lock(&slot.transport);
            let device = match &slot.handle {
                VirtioHandle::Block(d) => {
                    let dev = lock(d);
                    let st = dev.save();
                    if matches!(st.config.mode, BlockMode::Overlay { .. }) {
                        overlay_copies
                            .push((st.config.path.clone(), overlay_file_name(disk_index)));
                    }
                    disk_index += 1;
                    DeviceState::Block(st)
                }
                VirtioHandle::Net(d) => DeviceState::Net(lock(d).save()),
                VirtioHandle::Vsock(d) => DeviceState::VsockV2(lock(d).save()),
            };
            VirtioDeviceState {
                base: slot.base,
                irq: slot.irq,
                transport: t.state(),
                transport_queues: t.queue_snapshots(),
                device,
            }
        })
        .collect();
    for (src, name) in &overlay_copies {
        sparse_copy(src, &writer.path(name)?)?;
    }
    let state = VmState {
        virtio,
        ember_version: env!("CARGO_PKG_VERSION").to_string(),
        host: vm.host,
        cpu_profile: vm.profile,
        config: vm.config.clone(),
        cmdline: vm.cmdline.to_string(),
        memory: regions,
        kvm: vstate::save_vm(vm.vm_fd)?,
        vcpus: vcpu_states
            .iter()
            .map(|s| ember_snapshot::decode_state(&ember_snapshot::encode_state(s)?))
            .collect::<Result<Vec<VcpuState>, _>>()?,
        serial,
        caps: vm.caps,
        memory_diff,
    };
    let state_path = writer.path(STATE_FILE)?;
    ember_snapshot::write_state(&state_path, &state)?;
    Ok(std::fs::metadata(&state_path).map(|m| m.len()).unwrap_or(0))
}

/// What a restore may change about the snapshot's VM.
#[derive(Debug, Clone, Default)]
pub struct RestoreOptions {
    /// Must match the snapshot's profile when given.
    pub cpu_profile: Option<CpuProfile>,
    /// Track dirty pages in the restored VM (for diff snapshots relative to this one).
    pub track_dirty_pages: bool,
    /// What to do with a recorded working set.
    pub prefetch: crate::workingset::Prefetch,
    /// A new host socket for the vsock device (clones must not share one).
    pub vsock_uds: Option<PathBuf>,
    /// Drop every vsock connection the snapshot kept and send the guest a transport reset (what
    /// restores of format-1 snapshots always do), instead of keeping the quiet ones for
    /// `ATTACH` and resetting only the others.
    pub vsock_transport_reset: bool,
    /// New TAP names for the network interfaces, in order.
    pub net_taps: Vec<String>,
    /// New paths for the disks, in order (for overlay disks: the clone's own overlay file,
    /// which must start as a copy of the snapshot-time overlay).
    pub disk_paths: Vec<Option<PathBuf>>,
    /// New base images for the overlay disks, in disk order (`None` keeps a disk's base; a
    /// path for a disk that is not an overlay is refused). The base may live at another path
    /// (e.g. inside a jail) but must be the same image: the overlay records the base's size
    /// and content fingerprint, and the snapshot the fingerprint, and both are checked when
    /// the disk is opened.
    pub disk_bases: Vec<Option<PathBuf>>,
}

/// Reads and checks a snapshot's state against this host, before anything is built.
pub fn load_state(dir: &Path, opts: &RestoreOptions) -> Result<VmState, SnapshotError> {
    let incompatible = |reason: String| SnapshotError::Incompatible {
        dir: dir.to_path_buf(),
        reason,
    };
    if !dir.is_dir() {
        return Err(incompatible("not a directory".into()));
    }
    let state: VmState = ember_snapshot::read_state(dir.join(STATE_FILE))?;
    let layer = ember_snapshot::read_layer(dir)?;
    if let (Some(d), Some(l)) = (&state.memory_diff, &layer) {
        if d.pages.count() != l.pages {
            return Err(incompatible(format!(
                "the layer lists {} pages, the state {}",
                l.pages,
                d.pages.count()
            )));
        }
    }
    if let (Some(d), None) = (&state.memory_diff, &layer) {
        return Err(incompatible(format!(
            "is a diff snapshot of {} ({} pages): merge it onto its parent first \
             (`ember vm merge-snapshot --diff {} --out NEW_DIR`)",
            d.parent.display(),
            d.pages.count(),
            dir.display()
        )));
    }
    let host = HostKvm::detect();
    if state.host != host {
        return Err(incompatible(format!(
            "taken on a {:?} KVM host, this host is {:?}",
            state.host, host
        )));
    }
    if let Some(p) = opts.cpu_profile {
        if p != state.cpu_profile {
            return Err(incompatible(format!(
                "taken with CPU profile '{}', restore asked for '{p}'",
                state.cpu_profile
            )));
        }
    }
    if state.vcpus.len() != usize::from(state.config.vcpus) || state.vcpus.is_empty() {
        return Err(incompatible(format!(
            "{} vCPU states for {} vCPUs",
            state.vcpus.len(),
            state.config.vcpus
        )));
    }
    let total: u64 = state.memory.iter().map(|r| r.len).sum();
    if total != state.config.mem_mib << 20 {
        return Err(incompatible(format!(
            "memory regions add up to {total} bytes, config says {} MiB",
            state.config.mem_mib
        )));
    }
    let mut expect_off = 0;
    for r in &state.memory {
        if r.file_offset != expect_off || r.len == 0 {
            return Err(incompatible(
                "memory regions are not laid out back to back".into(),
            ));
        }
        expect_off += r.len;
    }
    ember_snapshot::check_memory_file(dir.join(MEMORY_FILE), total)?;
    Ok(state)
}

/// Maps the memory file privately: reads come from the page cache shared with every other
/// clone, writes go to private copies, the file is never modified.
pub fn map_memory(
    dir: &Path,
    regions: &[MemoryRegionState],
) -> Result<GuestMemoryMmap, SnapshotError> {
    let path = dir.join(MEMORY_FILE);
    let file = File::open(&path).map_err(|source| SnapshotError::Io {
        what: "cannot open",
        path: path.clone(),
        source,
    })?;
    let carried = ember_snapshot::PageSet::new(regions.iter().map(|r| r.len).sum());
    map_memory_file(dir, &path, file, regions, carried)
}

/// Maps `file` (at `path`, of the snapshot in `dir`) privately as guest memory, and
/// remembers it as the memory's base for layered snapshots, with the `carried` pages that
/// differ from it (those a layer will be mapped over).
fn map_memory_file(
    dir: &Path,
    path: &Path,
    file: File,
    regions: &[MemoryRegionState],
    carried: ember_snapshot::PageSet,
) -> Result<GuestMemoryMmap, SnapshotError> {
    let path = path.to_path_buf();
    let identity = ember_snapshot::BaseIdentity::of(&file).map_err(|source| SnapshotError::Io {
        what: "cannot stat",
        path: path.clone(),
        source,
    })?;
    let file = Arc::new(file);
    let mut out = Vec::with_capacity(regions.len());
    for r in regions {
        let mapping = MmapRegionBuilder::new_with_bitmap(
            r.len as usize,
            AtomicBitmap::new(r.len as usize, NonZeroUsize::MIN.saturating_add(4095)),
        )
        .with_file_offset(FileOffset::from_arc(file.clone(), r.file_offset))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
        .build()
        .map_err(|e| SnapshotError::Io {
            what: "cannot map",
            path: path.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let region =
            GuestRegionMmap::new(mapping, GuestAddress(r.guest_phys_addr)).ok_or_else(|| {
                SnapshotError::Incompatible {
                    dir: dir.to_path_buf(),
                    reason: format!("memory region at {:#x} overflows", r.guest_phys_addr),
                }
            })?;
        out.push(Arc::new(region));
    }
    let first = out.first().cloned();
    let mem = GuestMemoryMmap::from_arc_regions(out).map_err(|e| SnapshotError::Incompatible {
        dir: dir.to_path_buf(),
        reason: format!("memory regions: {e}"),
    })?;
    if let Some(first) = first {
        crate::layer::remember(
            &first,
            crate::layer::Origin {
                base_path: path,
                base: identity,
                carried,
            },
        );
    }
    Ok(mem)
}

/// Maps the memory of the layered snapshot in `dir`: its base privately, then the layer's
/// `pages` over it; remembers the base and the pages for the next layered snapshot.
pub(crate) fn map_layered_memory(
    dir: &Path,
    layer: &ember_snapshot::LayerState,
    pages: &ember_snapshot::PageSet,
    regions: &[MemoryRegionState],
    reporter: &Reporter,
) -> Result<GuestMemoryMmap, SnapshotError> {
    let (base_path, base) = ember_snapshot::open_base(dir, layer)?;
    let total: u64 = regions.iter().map(|r| r.len).sum();
    if layer.base.len != total {
        return Err(SnapshotError::Incompatible {
            dir: dir.to_path_buf(),
            reason: format!(
                "base memory file {} has {} bytes, guest memory is {total}",
                base_path.display(),
                layer.base.len
            ),
        });
    }
    let mem = map_memory_file(dir, &base_path, base, regions, pages.clone())?;
    let path = dir.join(MEMORY_FILE);
    let file = File::open(&path).map_err(|source| SnapshotError::Io {
        what: "cannot open",
        path: path.clone(),
        source,
    })?;
    let o = crate::layer::overlay(&mem, &file, &path, pages)?;
    reporter.event(
        "layer_restored",
        serde_json::json!({
            "pages": o.pages, "runs": o.runs, "mapped": o.mapped,
            "base": base_path,
        }),
    );
    Ok(mem)
}

/// Applies restore-time overrides to the snapshot's configuration (`dir` names the snapshot
/// in errors). Base overrides must name overlay disks the snapshot has.
pub(crate) fn apply_overrides(
    dir: &Path,
    config: &mut VmConfig,
    opts: &RestoreOptions,
) -> Result<(), SnapshotError> {
    let refuse = |disk: usize, reason: String| SnapshotError::DiskOverride {
        dir: dir.to_path_buf(),
        disk,
        reason,
    };
    if opts.disk_bases.len() > config.disks.len() {
        return Err(refuse(
            config.disks.len(),
            format!(
                "{} base images given (--disk-base), the snapshot has {} disks",
                opts.disk_bases.len(),
                config.disks.len()
            ),
        ));
    }
    if let (Some(v), Some(uds)) = (config.vsock.as_mut(), &opts.vsock_uds) {
        v.uds_path = uds.clone();
    }
    for (n, tap) in config.net.iter_mut().zip(&opts.net_taps) {
        n.tap = tap.clone();
    }
    for (d, p) in config.disks.iter_mut().zip(&opts.disk_paths) {
        if let Some(p) = p {
            d.path = p.clone();
        }
    }
    for (i, (d, b)) in config.disks.iter_mut().zip(&opts.disk_bases).enumerate() {
        let Some(new) = b else { continue };
        match &mut d.mode {
            BlockMode::Overlay { base } => *base = new.clone(),
            other => {
                return Err(refuse(
                    i,
                    format!(
                        "{} is a {} disk, not a copy-on-write overlay: it has no base image to \
                         replace with {} (give `-` for it)",
                        d.path.display(),
                        other.name(),
                        new.display()
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// Compares two CPUID tables entry by entry, ignoring order and the APIC ids that name one
/// host CPU ([`crate::cpu::feature_key`]). `None` when they match, else the first leaf that
/// differs, as `expected` (this host) against `saved` (the snapshot).
pub(crate) fn cpuid_difference(
    expected: &[kvm_bindings::kvm_cpuid_entry2],
    saved: &[kvm_bindings::kvm_cpuid_entry2],
) -> Option<String> {
    let mut x: Vec<_> = expected.iter().map(crate::cpu::feature_key).collect();
    let mut y: Vec<_> = saved.iter().map(crate::cpu::feature_key).collect();
    x.sort_unstable();
    y.sort_unstable();
    if x == y {
        return None;
    }
    let show = |k: Option<&crate::cpu::FeatureKey>| match k {
        Some(k) => format!(
            "{:#x}.{}: {:08x} {:08x} {:08x} {:08x}",
            k.0, k.1, k.3, k.4, k.5, k.6
        ),
        None => "absent".into(),
    };
    let i = (0..x.len().max(y.len()))
        .find(|&i| x.get(i) != y.get(i))
        .unwrap_or(0);
    // Name the leaf of whichever side sorts first at the first difference.
    let leaf = match (x.get(i), y.get(i)) {
        (Some(a), Some(b)) => (a.0, a.1).min((b.0, b.1)),
        (Some(a), None) | (None, Some(a)) => (a.0, a.1),
        (None, None) => (0, 0),
    };
    let find = |v: &[crate::cpu::FeatureKey]| v.iter().find(|k| (k.0, k.1) == leaf).copied();
    Some(format!(
        "leaf {} here, {} in the snapshot",
        show(find(&x).as_ref()),
        show(find(&y).as_ref())
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_devices::virtio::block::BlockConfig;

    fn config() -> VmConfig {
        let mut c = VmConfig::new("/vmlinux".into());
        c.disks = vec![
            BlockConfig {
                path: "/host/root.overlay".into(),
                mode: BlockMode::Overlay {
                    base: "/host/root.ext4".into(),
                },
                id: "root".into(),
            },
            BlockConfig {
                path: "/host/data.img".into(),
                mode: BlockMode::ReadWrite,
                id: String::new(),
            },
            BlockConfig {
                path: "/host/tools.img".into(),
                mode: BlockMode::ReadOnly,
                id: String::new(),
            },
        ];
        c
    }

    fn opts(paths: &[&str], bases: &[&str]) -> RestoreOptions {
        let keep = |v: &[&str]| {
            v.iter()
                .map(|p| (*p != "-").then(|| PathBuf::from(p)))
                .collect()
        };
        RestoreOptions {
            disk_paths: keep(paths),
            disk_bases: keep(bases),
            ..RestoreOptions::default()
        }
    }

    #[test]
    fn disk_base_replaces_the_base_of_an_overlay_disk() {
        let mut c = config();
        let o = opts(
            &["/work/disk0.overlay", "/disk1"],
            &["/disk0.base", "-", "-"],
        );
        apply_overrides(Path::new("/snap"), &mut c, &o).unwrap();
        assert_eq!(c.disks[0].path, PathBuf::from("/work/disk0.overlay"));
        assert_eq!(
            c.disks[0].mode,
            BlockMode::Overlay {
                base: "/disk0.base".into()
            }
        );
        assert_eq!(c.disks[1].path, PathBuf::from("/disk1"));
        assert_eq!(c.disks[1].mode, BlockMode::ReadWrite);
        assert_eq!(c.disks[2].path, PathBuf::from("/host/tools.img"));
        assert_eq!(c.disks[2].mode, BlockMode::ReadOnly);
    }

    #[test]
    fn without_disk_base_the_snapshot_base_is_kept() {
        for bases in [&[][..], &["-"][..]] {
            let mut c = config();
            apply_overrides(Path::new("/snap"), &mut c, &opts(&[], bases)).unwrap();
            assert_eq!(c.disks, config().disks);
        }
    }

    #[test]
    fn a_base_for_a_disk_without_one_is_refused_naming_the_disk() {
        for (i, bases) in [(1, &["-", "/b"][..]), (2, &["/a", "-", "/b"][..])] {
            let mut c = config();
            let e = apply_overrides(Path::new("/snap"), &mut c, &opts(&[], bases)).unwrap_err();
            match &e {
                SnapshotError::DiskOverride { disk, .. } => assert_eq!(*disk, i),
                other => panic!("{other:?}"),
            }
            let msg = e.to_string();
            assert!(msg.contains(&format!("disk {i}")), "{msg}");
            assert!(msg.contains("not a copy-on-write overlay"), "{msg}");
            assert!(msg.contains("/b"), "{msg}");
        }
    }

    #[test]
    fn more_bases_than_disks_are_refused() {
        let mut c = config();
        let e = apply_overrides(
            Path::new("/snap"),
            &mut c,
            &opts(&[], &["-", "-", "-", "/x"]),
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("4 base images given") && msg.contains("3 disks"),
            "{msg}"
        );
        // Nothing was changed.
        assert_eq!(c.disks, config().disks);
    }

    #[test]
    fn cpuid_check_ignores_host_apic_ids_and_names_a_differing_leaf() {
        let e = |function, index, ebx, ecx, edx| kvm_bindings::kvm_cpuid_entry2 {
            function,
            index,
            ebx,
            ecx,
            edx,
            ..Default::default()
        };
        // Taken on host CPU 1, restored on host CPU 0, in another order.
        let saved = [e(1, 0, 0x0102_0800, 0x8120_2000, 0), e(0x1f, 1, 0, 0, 1)];
        let here = [e(0x1f, 1, 0, 0, 0), e(1, 0, 0x0002_0800, 0x8120_2000, 0)];
        assert_eq!(cpuid_difference(&here, &saved), None);
        // A feature bit is a difference, named by its leaf.
        let popcnt = [e(0x1f, 1, 0, 0, 0), e(1, 0, 0x0002_0800, 0x8160_2000, 0)];
        let msg = cpuid_difference(&popcnt, &saved).unwrap();
        assert!(
            msg.contains("leaf 0x1.0: 00000000 00020800 81602000"),
            "{msg}"
        );
        assert!(
            msg.contains("00020800 81202000 00000000 in the snapshot"),
            "{msg}"
        );
        // A leaf only one side has.
        let msg = cpuid_difference(&here[..1], &saved).unwrap();
        assert!(msg.contains("leaf absent here"), "{msg}");
    }
}
