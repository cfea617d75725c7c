//! virtio-blk under a hostile driver: whatever the queue holds, the device must not panic,
//! touch memory outside the guest, or write a read-only image or a base.
//!
//! `selector` bits: 0..=1 mode (0 read-only, 1 read-write, 2 and 3 overlay), 2
//! `VIRTIO_BLK_F_FLUSH` acked, 3 snapshot the device afterwards and restore it (the restore
//! must accept the device's own state).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_devices::legacy::EventTrigger;
use ember_devices::virtio::block::{Block, BlockConfig, BlockMode, VIRTIO_BLK_F_FLUSH};
use ember_devices::virtio::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};

use crate::queue::{used_idx, FuzzInput};
use crate::ScratchDir;

/// Disk size: 256 sectors, so two 64 KiB overlay clusters.
pub const DISK_SIZE: usize = 128 * 1024;
const QUEUE_MAX: u16 = 256;
const EVENT_IDX: u64 = 1 << 29;

struct Scratch {
    dir: ScratchDir,
    base: PathBuf,
    base_bytes: Vec<u8>,
}

thread_local! {
    /// Per-thread disk images (tests run in parallel threads; the disks are locked).
    static SCRATCH: Scratch = make_scratch();
}

fn make_scratch() -> Scratch {
    let dir = ScratchDir::new("block");
    let base = dir.path().join("base.img");
    let base_bytes: Vec<u8> = (0..DISK_SIZE).map(|i| (i / 512) as u8 ^ 0x5a).collect();
    std::fs::write(&base, &base_bytes).expect("fuzz harness: base image");
    Scratch {
        dir,
        base,
        base_bytes,
    }
}

fn config(s: &Scratch, mode: u8) -> (BlockConfig, Option<&Path>) {
    match mode & 3 {
        0 => (
            BlockConfig {
                path: s.base.clone(),
                mode: BlockMode::ReadOnly,
                id: "fuzz-ro".into(),
            },
            Some(&s.base),
        ),
        1 => {
            let path = s.dir.path().join("rw.img");
            std::fs::write(&path, &s.base_bytes).expect("fuzz harness: rw image");
            (
                BlockConfig {
                    path,
                    mode: BlockMode::ReadWrite,
                    id: "fuzz-rw-disk-id-20by".into(),
                },
                None,
            )
        }
        _ => {
            let path = s.dir.path().join("overlay");
            let _ = std::fs::remove_file(&path);
            (
                BlockConfig {
                    path,
                    mode: BlockMode::Overlay {
                        base: s.base.clone(),
                    },
                    id: String::new(),
                },
                Some(&s.base),
            )
        }
    }
}

/// Runs one fuzz input through a virtio-blk device.
pub fn run(data: &[u8]) {
    let _ = run_and_return_memory(data);
}

/// [`run`], returning guest memory afterwards (for tests that check the completions).
pub fn run_and_return_memory(data: &[u8]) -> ember_devices::GuestMemoryMmap {
    SCRATCH.with(|s| run_in(s, data))
}

fn run_in(s: &Scratch, data: &[u8]) -> ember_devices::GuestMemoryMmap {
    use ember_snapshot::Persist;
    let input = FuzzInput::parse(data, &[QUEUE_MAX]);
    let event_idx = input.queues.first().is_some_and(|q| q.event_idx);
    let avail_idx = input.queues.first().map_or(0, |q| q.avail_idx);
    let (cfg, read_only) = config(s, input.selector);
    let mut dev = Block::new(cfg.clone()).expect("fuzz harness: open the disk");
    let mut features = VIRTIO_F_VERSION_1;
    if input.selector & 4 != 0 {
        features |= VIRTIO_BLK_F_FLUSH;
    }
    if event_idx {
        features |= EVENT_IDX;
    }
    dev.set_acked_features(features & dev.avail_features());
    let mem = input.memory();
    let irq = Arc::new(Interrupt::new(
        EventTrigger::new().expect("fuzz harness: eventfd"),
    ));
    // Activation processes whatever the avail ring holds.
    dev.activate(mem.clone(), irq.clone(), input.virtqueues(&[QUEUE_MAX]))
        .expect("fuzz harness: activation of a valid queue");
    let used = used_idx(&mem, 0);
    assert!(
        used <= avail_idx,
        "used index {used} ran past the avail index {avail_idx}"
    );
    if input.selector & 8 != 0 {
        let state = dev.save();
        drop(dev);
        let back = Block::restore((cfg, Some((mem.clone(), irq))), &state);
        assert!(back.is_ok(), "the device's own state was refused: {back:?}");
    } else {
        drop(dev);
    }
    if let Some(path) = read_only {
        let now = std::fs::read(path).expect("fuzz harness: read back the base");
        assert!(
            now == s.base_bytes,
            "a read-only image or base was modified"
        );
    }
    mem
}
