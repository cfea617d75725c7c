//! Snapshot save and restore of [`Block`].
//!
//! # What the VMM must do with disk files
//! A snapshot's `BlockState` references the disk file by the path it had at snapshot time
//! (`state.config.path`); the bytes of the disk are in that file, not in the state.
//!
//! **Saving** (vCPUs paused, queues idle): call [`Persist::save`]. For an overlay it makes the
//! file a complete, durable image of the disk (data `fdatasync`, bitmap written, `fdatasync`)
//! and bumps the overlay's generation, which the state records together with the overlay's
//! lineage id. Then either
//! - the VMM exits (pause to disk): the overlay stays where it is and is restored in place; or
//! - the VM goes on running: the VMM must copy the overlay **before resuming the vCPUs**
//!   (`cp --sparse=always` or `cp --reflink=auto`, or `FICLONE`), e.g. into the snapshot
//!   directory. The first guest write after the snapshot bumps the live overlay's generation,
//!   so the live file no longer restores this snapshot.
//!
//! For a raw read-write image, `save` only `fdatasync`s it; the VMM must copy or reflink the
//! image likewise if the VM goes on. Read-only images and bases are shared as they are.
//!
//! **Restoring** (and cloning): give each restored VM its own copy (reflink) of the snapshot's
//! overlay and pass a [`BlockConfig`] with `path` = that copy, the same mode (the base may be
//! reached by another path, e.g. inside a jail: the overlay checks the base's content
//! fingerprint, not its path) and the same `id`. Restore accepts only an overlay whose lineage
//! id and generation equal the snapshot's, i.e. an untouched copy, and then bumps the
//! generation: one copy restores once. If the snapshot's overlay held no cluster
//! (`OverlayState::allocated_clusters == 0`, e.g. a template snapshotted before any disk write),
//! the clone may instead start from a missing overlay, which is created empty, or from any
//! empty overlay on the same base.
//!
//! A state whose disk size differs from the image's is refused, as are features the device
//! does not offer and queues that do not fit guest memory.

use std::io::ErrorKind;
use std::sync::Arc;

use ember_snapshot::Persist;
use virtio_queue::QueueT;

use super::overlay::{Create, Overlay};
use super::{
    open_raw, Active, Backend, Block, BlockConfig, BlockError, BlockMode, QUEUE_SIZE, SECTOR_SIZE,
    VIRTIO_RING_F_EVENT_IDX,
};
use crate::virtio::{Interrupt, QueueSnapshot, VirtioDevice};
use crate::GuestMemoryMmap;

/// A disk's state in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockState {
    /// The configuration at snapshot time (`path` is the file that held the disk then).
    pub config: BlockConfig,
    /// Disk size in sectors.
    pub sectors: u64,
    /// Features the driver accepted.
    pub acked_features: u64,
    /// Whether the driver had started the device.
    pub activated: bool,
    /// Whether the device had stopped on a broken queue (needs a reset).
    pub broken: bool,
    /// The device's queues (empty when not activated).
    pub queues: Vec<QueueSnapshot>,
    /// Overlay mode only: which overlay file contents the snapshot goes with.
    pub overlay: Option<OverlayState>,
}

/// The overlay a snapshot was taken with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OverlayState {
    /// The overlay's lineage id (random at creation, kept by copies).
    pub lineage: [u8; 16],
    /// The overlay's generation after the snapshot; `None` if the overlay could not be made
    /// durable at snapshot time (such a state is refused at restore).
    pub generation: Option<u64>,
    /// Clusters held by the overlay.
    pub allocated_clusters: u64,
    /// Fingerprint of the base (see [`super::overlay::base_fingerprint`]).
    pub base_fingerprint: u64,
}

/// What [`Block`]'s restore needs besides the state: the configuration to open (its `path` may
/// differ from the snapshot's: a clone's own overlay) and, if the device was active, guest
/// memory and the interrupt line of its transport.
pub type BlockRestoreArgs = (BlockConfig, Option<(GuestMemoryMmap, Arc<Interrupt>)>);

impl Persist for Block {
    type State = BlockState;
    type ConstructorArgs = BlockRestoreArgs;
    type Error = BlockError;

    fn save(&self) -> BlockState {
        let overlay = match &self.backend {
            Backend::Overlay(o) => {
                let generation = match o.persist_for_snapshot() {
                    Ok(g) => Some(g),
                    Err(e) => {
                        tracing::error!(
                            "virtio-blk: cannot make overlay {} durable for the snapshot ({e}); \
                             the snapshot will refuse to restore this disk",
                            o.path().display()
                        );
                        None
                    }
                };
                let h = o.header();
                Some(OverlayState {
                    lineage: h.uuid,
                    generation,
                    allocated_clusters: o.allocated_clusters(),
                    base_fingerprint: h.base_fingerprint,
                })
            }
            Backend::Raw {
                file,
                writable: true,
            } => {
                if let Err(e) = file.sync_data() {
                    tracing::error!(
                        "virtio-blk: cannot sync {} for the snapshot: {e}",
                        self.config.path.display()
                    );
                }
                None
            }
            Backend::Raw { .. } => None,
        };
        BlockState {
            config: self.config.clone(),
            sectors: self.sectors,
            acked_features: self.acked,
            activated: self.active.is_some(),
            broken: self.broken,
            queues: self
                .active
                .as_ref()
                .map(|a| vec![QueueSnapshot::from(&a.queue)])
                .unwrap_or_default(),
            overlay,
        }
    }

    fn restore(args: BlockRestoreArgs, state: &BlockState) -> Result<Self, BlockError> {
        let (config, resources) = args;
        let path = config.path.clone();
        let fail = |reason: String| BlockError::Restore {
            path: path.clone(),
            reason,
        };
        if config.id != state.config.id {
            return Err(fail(format!(
                "disk id {:?} differs from the snapshot's {:?} (the guest has seen it)",
                config.id, state.config.id
            )));
        }
        if config.mode.name() != state.config.mode.name() {
            return Err(fail(format!(
                "mode {} differs from the snapshot's {}",
                config.mode.name(),
                state.config.mode.name()
            )));
        }
        if config.id.len() > super::ID_LEN {
            return Err(BlockError::IdTooLong(config.id));
        }
        let (backend, size) = match &config.mode {
            BlockMode::Overlay { base } => {
                let os = state
                    .overlay
                    .ok_or_else(|| fail("the snapshot has no overlay state".into()))?;
                let o = open_overlay_for_restore(&config, base, &os)?;
                let size = o.disk_size();
                (Backend::Overlay(Box::new(o)), size)
            }
            BlockMode::ReadWrite | BlockMode::ReadOnly => open_raw(&config)?,
        };
        if size / SECTOR_SIZE != state.sectors {
            return Err(BlockError::SizeMismatch {
                path,
                state_sectors: state.sectors,
                image_sectors: size / SECTOR_SIZE,
            });
        }
        let mut block = Block::with_backend(config, backend, size)?;
        let offered = block.avail_features();
        if state.acked_features & !offered != 0 {
            return Err(fail(format!(
                "the snapshot's features {:#x} include some this disk does not offer ({offered:#x})",
                state.acked_features
            )));
        }
        block.acked = state.acked_features;
        block.broken = state.broken;
        if state.activated {
            let Some((mem, interrupt)) = resources else {
                return Err(fail(
                    "the device was active: guest memory and its interrupt are needed".into(),
                ));
            };
            let [qs] = state.queues.as_slice() else {
                return Err(fail(format!(
                    "the snapshot has {} queues, virtio-blk has 1",
                    state.queues.len()
                )));
            };
            if qs.max_size != QUEUE_SIZE || !qs.ready {
                return Err(fail(format!(
                    "queue 0 has maximum size {} (expected {QUEUE_SIZE}) or is not ready",
                    qs.max_size
                )));
            }
            let mut queue = qs
                .to_queue(Some(&mem))
                .map_err(|e| fail(format!("queue 0: {e}")))?;
            queue.set_event_idx(block.acked & VIRTIO_RING_F_EVENT_IDX != 0);
            block.active = Some(Active {
                mem,
                interrupt,
                queue,
            });
        }
        // Only now, with every check passed, does this VMM claim the overlay.
        if let Backend::Overlay(o) = &block.backend {
            o.begin_writing()?;
        }
        if block.active.is_some() {
            // Requests queued before the snapshot may not have been processed yet: wake the
            // event loop once so they are.
            if let Err(e) = block.queue_evt[0].write(1) {
                tracing::warn!("virtio-blk: cannot kick the restored queue: {e}");
            }
        }
        Ok(block)
    }
}

fn open_overlay_for_restore(
    config: &BlockConfig,
    base: &std::path::Path,
    os: &OverlayState,
) -> Result<Overlay, BlockError> {
    let path = &config.path;
    let fail = |reason: String| BlockError::Restore {
        path: path.clone(),
        reason,
    };
    let generation = os.generation.ok_or_else(|| {
        fail("the overlay could not be made durable when the snapshot was taken".into())
    })?;
    let create = if os.allocated_clusters == 0 {
        Create::IfMissing
    } else {
        Create::Never
    };
    let o = match Overlay::open(path, base, create) {
        Err(BlockError::Open { source, .. }) if source.kind() == ErrorKind::NotFound => {
            return Err(fail(format!(
                "the overlay does not exist; the snapshot's overlay ({}) holds {} clusters: copy \
                 it here first",
                config.path.display(),
                os.allocated_clusters
            )))
        }
        r => r?,
    };
    let h = o.header();
    if h.base_fingerprint != os.base_fingerprint {
        return Err(BlockError::BaseMismatch {
            overlay: path.clone(),
            base: base.to_path_buf(),
            reason: "the snapshot was taken on a base with another content fingerprint".into(),
        });
    }
    let empty_ok = os.allocated_clusters == 0 && o.allocated_clusters() == 0;
    if !empty_ok {
        if h.uuid != os.lineage {
            return Err(fail(
                "the overlay is not a copy of the snapshot's overlay (lineage id differs)".into(),
            ));
        }
        if h.generation != generation {
            return Err(fail(format!(
                "the overlay is at generation {}, the snapshot recorded {generation}: it was \
                 used after the snapshot or is an older copy",
                h.generation
            )));
        }
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::EventTrigger;
    use std::path::{Path, PathBuf};
    use virtio_queue::Queue;
    use vm_memory::GuestAddress;

    fn base(dir: &Path) -> PathBuf {
        let p = dir.join("base.img");
        std::fs::write(&p, vec![7u8; 64 * 1024]).unwrap();
        p
    }

    fn overlay_cfg(dir: &Path, name: &str, base: &Path) -> BlockConfig {
        BlockConfig {
            path: dir.join(name),
            mode: BlockMode::Overlay {
                base: base.to_path_buf(),
            },
            id: "d".into(),
        }
    }

    fn resources() -> (GuestMemoryMmap, Arc<Interrupt>) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        (mem, Arc::new(Interrupt::new(EventTrigger::new().unwrap())))
    }

    fn activate(b: &mut Block, mem: &GuestMemoryMmap, irq: &Arc<Interrupt>) {
        let mut q = Queue::new(QUEUE_SIZE).unwrap();
        q.set_size(8);
        q.set_desc_table_address(Some(0x1000), Some(0));
        q.set_avail_ring_address(Some(0x2000), Some(0));
        q.set_used_ring_address(Some(0x3000), Some(0));
        q.set_ready(true);
        b.set_acked_features(crate::virtio::VIRTIO_F_VERSION_1 | super::super::VIRTIO_BLK_F_FLUSH);
        b.activate(mem.clone(), irq.clone(), vec![q]).unwrap();
    }

    #[test]
    fn inactive_device_round_trips_without_resources() {
        let dir = tempfile::tempdir().unwrap();
        let b = base(dir.path());
        let dev = Block::new(overlay_cfg(dir.path(), "o", &b)).unwrap();
        let state = dev.save();
        drop(dev);
        let back = Block::restore((overlay_cfg(dir.path(), "o", &b), None), &state).unwrap();
        assert!(!back.is_activated());
        assert_eq!(back.sectors(), 128);
    }

    #[test]
    fn active_device_needs_resources_and_sane_queues() {
        let dir = tempfile::tempdir().unwrap();
        let b = base(dir.path());
        let (mem, irq) = resources();
        let mut dev = Block::new(overlay_cfg(dir.path(), "o", &b)).unwrap();
        activate(&mut dev, &mem, &irq);
        let state = dev.save();
        drop(dev);
        let cfg = overlay_cfg(dir.path(), "o", &b);
        assert!(matches!(
            Block::restore((cfg.clone(), None), &state),
            Err(BlockError::Restore { .. })
        ));
        let mut bad = state.clone();
        bad.queues[0].used_ring = 0xffff_0000;
        assert!(Block::restore((cfg.clone(), Some(resources())), &bad).is_err());
        let mut bad = state.clone();
        bad.acked_features |= super::super::VIRTIO_BLK_F_RO;
        assert!(Block::restore((cfg.clone(), Some(resources())), &bad).is_err());
        let mut bad = state.clone();
        bad.queues.push(bad.queues[0]);
        assert!(Block::restore((cfg.clone(), Some(resources())), &bad).is_err());
        let mut bad = state.clone();
        bad.config.id = "other".into();
        assert!(Block::restore((cfg.clone(), Some(resources())), &bad).is_err());
        // None of the refusals claimed the overlay: the good state still restores.
        let back = Block::restore((cfg, Some(resources())), &state).unwrap();
        assert!(back.is_activated());
        assert_eq!(back.save().queues, state.queues);
    }

    #[test]
    fn a_state_whose_overlay_was_not_made_durable_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let b = base(dir.path());
        let dev = Block::new(overlay_cfg(dir.path(), "o", &b)).unwrap();
        let mut state = dev.save();
        drop(dev);
        let cfg = overlay_cfg(dir.path(), "o", &b);
        let mut s = state.clone();
        s.overlay = None;
        assert!(matches!(
            Block::restore((cfg.clone(), None), &s),
            Err(BlockError::Restore { .. })
        ));
        if let Some(o) = state.overlay.as_mut() {
            o.generation = None;
        }
        let e = Block::restore((cfg, None), &state).unwrap_err();
        assert!(e.to_string().contains("durable"), "{e}");
    }

    #[test]
    fn a_clone_may_reach_its_base_by_another_path_but_not_use_another_base() {
        let dir = tempfile::tempdir().unwrap();
        let b = base(dir.path());
        let dev = Block::new(overlay_cfg(dir.path(), "o", &b)).unwrap();
        let state = dev.save();
        drop(dev);
        // The same image at another path (a jail's hard link or bind mount, or a copy).
        std::fs::create_dir(dir.path().join("jail")).unwrap();
        let moved = dir.path().join("jail/disk0.base");
        std::fs::copy(&b, &moved).unwrap();
        let back = Block::restore((overlay_cfg(dir.path(), "o", &moved), None), &state).unwrap();
        assert_eq!(back.config().mode, BlockMode::Overlay { base: moved });
        drop(back);
        // Another image of the same size: the content fingerprint differs.
        let other = dir.path().join("other.img");
        std::fs::write(&other, vec![8u8; 64 * 1024]).unwrap();
        let e = Block::restore((overlay_cfg(dir.path(), "o", &other), None), &state).unwrap_err();
        assert!(matches!(e, BlockError::BaseMismatch { .. }), "{e}");
        assert!(e.to_string().contains("fingerprint"), "{e}");
        assert!(e.to_string().contains("other.img"), "{e}");
        // Another size.
        std::fs::write(&other, vec![7u8; 128 * 1024]).unwrap();
        let e = Block::restore((overlay_cfg(dir.path(), "o", &other), None), &state).unwrap_err();
        assert!(matches!(e, BlockError::BaseMismatch { .. }), "{e}");
        assert!(e.to_string().contains("65536"), "{e}");
    }

    #[test]
    fn raw_mode_size_mismatch_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("raw.img");
        std::fs::write(&img, vec![0u8; 4096]).unwrap();
        let cfg = BlockConfig {
            path: img.clone(),
            mode: BlockMode::ReadWrite,
            id: String::new(),
        };
        let state = Block::new(cfg.clone()).unwrap().save();
        std::fs::write(&img, vec![0u8; 8192]).unwrap();
        assert!(matches!(
            Block::restore((cfg, None), &state),
            Err(BlockError::SizeMismatch {
                state_sectors: 8,
                image_sectors: 16,
                ..
            })
        ));
    }
}
