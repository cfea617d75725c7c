//! virtio-blk end to end through the queue: copy-on-write overlays on real files, crash
//! recovery (a killed child process), snapshot save/restore, and the raw modes.
//!
//! Requests go through a split virtqueue in guest memory and the device's event-loop path
//! (queue eventfd → `MutEventSubscriber::process`), as the VMM drives it.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use ember_devices::legacy::EventTrigger;
use ember_devices::virtio::block::{
    request_type, status, Block, BlockConfig, BlockError, BlockMode, BlockState, SECTOR_SIZE,
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO,
};
use ember_devices::virtio::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use ember_devices::GuestMemoryMmap;
use ember_snapshot::{decode_state, encode_state, Persist};
use event_manager::{EventManager, SubscriberOps};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

const MEM_SIZE: usize = 4 << 20;
const DESC: u64 = 0x1000;
const AVAIL: u64 = 0x2000;
const USED: u64 = 0x3000;
const STATUS: u64 = 0x4000;
const HDR: u64 = 0x5000;
const DATA: u64 = 0x10_0000;
const QSIZE: u16 = 16;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
/// Base images are 1 MiB: 2048 sectors, 16 overlay clusters.
const BASE_SECTORS: u64 = 2048;

/// A guest's view of one disk: memory with a queue, the device on an event loop.
struct Disk {
    mem: GuestMemoryMmap,
    dev: Arc<Mutex<Block>>,
    mgr: EventManager<Arc<Mutex<Block>>>,
    avail_idx: u16,
}

enum Data<'a> {
    None,
    Read(usize),
    Write(&'a [u8]),
}

impl Disk {
    fn open(cfg: BlockConfig) -> Result<Disk, BlockError> {
        Disk::open_with(cfg, VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_FLUSH)
    }

    fn open_with(cfg: BlockConfig, features: u64) -> Result<Disk, BlockError> {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        let mut block = Block::new(cfg)?;
        let mut q = Queue::new(256).unwrap();
        q.set_size(QSIZE);
        q.set_desc_table_address(Some(DESC as u32), Some(0));
        q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
        q.set_used_ring_address(Some(USED as u32), Some(0));
        q.set_ready(true);
        assert!(q.is_valid(&mem));
        assert_ne!(block.avail_features() & VIRTIO_BLK_F_FLUSH, 0);
        block.set_acked_features(features);
        block
            .activate(mem.clone(), Arc::new(irq()), vec![q])
            .unwrap();
        Ok(Disk::on_loop(mem, block, 0))
    }

    fn on_loop(mem: GuestMemoryMmap, block: Block, avail_idx: u16) -> Disk {
        let dev = Arc::new(Mutex::new(block));
        let mut mgr = EventManager::new().unwrap();
        mgr.add_subscriber(dev.clone());
        Disk {
            mem,
            dev,
            mgr,
            avail_idx,
        }
    }

    fn save(&self) -> BlockState {
        // Through the snapshot crate's encoding, as a real snapshot does.
        let state = self.dev.lock().unwrap().save();
        decode_state(&encode_state(&state).unwrap()).unwrap()
    }

    /// Restores a saved disk onto `mem`, the memory the disk was saved with (as a restore maps
    /// the snapshot's); `avail_idx` is where that guest's avail ring stands.
    fn restore(
        mem: &GuestMemoryMmap,
        avail_idx: u16,
        cfg: BlockConfig,
        state: &BlockState,
    ) -> Result<Disk, BlockError> {
        let block = Block::restore((cfg, Some((mem.clone(), Arc::new(irq())))), state)?;
        Ok(Disk::on_loop(mem.clone(), block, avail_idx))
    }

    /// Submits one request and runs the event loop until it completes; returns the status
    /// and, for reads, the data.
    fn request(&mut self, kind: u32, sector: u64, data: Data<'_>) -> (u8, Vec<u8>) {
        let mut hdr = [0u8; 16];
        hdr[..4].copy_from_slice(&kind.to_le_bytes());
        hdr[8..].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&hdr, GuestAddress(HDR)).unwrap();
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let mut descs = vec![(HDR, 16u32, F_NEXT)];
        match data {
            Data::None => {}
            Data::Read(len) => descs.push((DATA, len as u32, F_NEXT | F_WRITE)),
            Data::Write(bytes) => {
                self.mem.write_slice(bytes, GuestAddress(DATA)).unwrap();
                descs.push((DATA, bytes.len() as u32, F_NEXT));
            }
        }
        descs.push((STATUS, 1, F_WRITE));
        for (i, &(addr, len, flags)) in descs.iter().enumerate() {
            let at = DESC + 16 * i as u64;
            let next = if flags & F_NEXT != 0 { i as u16 + 1 } else { 0 };
            self.mem.write_obj(addr, GuestAddress(at)).unwrap();
            self.mem.write_obj(len, GuestAddress(at + 8)).unwrap();
            self.mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
            self.mem.write_obj(next, GuestAddress(at + 14)).unwrap();
        }
        let slot = u64::from(self.avail_idx % QSIZE);
        self.mem
            .write_obj(0u16, GuestAddress(AVAIL + 4 + 2 * slot))
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx, GuestAddress(AVAIL + 2))
            .unwrap();
        self.dev.lock().unwrap().queue_events()[0].write(1).unwrap();
        let mut used: u16 = 0;
        for _ in 0..10 {
            self.mgr.run_with_timeout(100).unwrap();
            used = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
            if used == self.avail_idx {
                break;
            }
        }
        assert_eq!(used, self.avail_idx, "request was not completed");
        let st: u8 = self.mem.read_obj(GuestAddress(STATUS)).unwrap();
        let mut out = Vec::new();
        if let Data::Read(len) = data {
            out = vec![0u8; len];
            self.mem.read_slice(&mut out, GuestAddress(DATA)).unwrap();
        }
        (st, out)
    }

    fn write(&mut self, sector: u64, bytes: &[u8]) -> u8 {
        self.request(request_type::OUT, sector, Data::Write(bytes))
            .0
    }

    fn read(&mut self, sector: u64, len: usize) -> Vec<u8> {
        let (st, data) = self.request(request_type::IN, sector, Data::Read(len));
        assert_eq!(st, status::OK, "read of {len} bytes at sector {sector}");
        data
    }

    fn flush(&mut self) {
        assert_eq!(
            self.request(request_type::FLUSH, 0, Data::None).0,
            status::OK
        );
    }
}

fn irq() -> Interrupt {
    Interrupt::new(EventTrigger::new().unwrap())
}

/// Sector `s` of a base is filled with `s as u8 ^ salt`.
fn make_base(dir: &Path, name: &str, salt: u8) -> PathBuf {
    let p = dir.join(name);
    let data: Vec<u8> = (0..BASE_SECTORS * SECTOR_SIZE)
        .map(|i| (i / SECTOR_SIZE) as u8 ^ salt)
        .collect();
    std::fs::write(&p, data).unwrap();
    p
}

fn overlay(path: &Path, base: &Path) -> BlockConfig {
    BlockConfig {
        path: path.to_path_buf(),
        mode: BlockMode::Overlay {
            base: base.to_path_buf(),
        },
        id: "scratch".into(),
    }
}

fn base_sector(s: u64, salt: u8) -> Vec<u8> {
    vec![s as u8 ^ salt; SECTOR_SIZE as usize]
}

#[test]
fn overlay_write_flush_read_back_and_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path(), "base.img", 0);
    let ovl = dir.path().join("vm.ovl");
    let mut d = Disk::open(overlay(&ovl, &base)).unwrap();
    // Untouched sectors come from the base.
    assert_eq!(d.read(5, 512), base_sector(5, 0));
    // A partial-cluster write (one sector of a 64 KiB cluster), a write spanning two
    // clusters, and a whole-cluster write.
    assert_eq!(d.write(3, &[0xa1; 512]), status::OK);
    assert_eq!(d.write(126, &[0xb2; 2048]), status::OK);
    assert_eq!(d.write(256, &vec![0xc3; 64 * 1024]), status::OK);
    d.flush();
    let check = |d: &mut Disk| {
        let all = d.read(0, 640 * 512);
        for (s, sector) in all.chunks(512).enumerate() {
            let s = s as u64;
            let want = match s {
                3 => 0xa1,
                126..=129 => 0xb2,
                256..=383 => 0xc3,
                _ => s as u8,
            };
            assert!(sector.iter().all(|&b| b == want), "sector {s}");
        }
    };
    check(&mut d);
    assert_eq!(d.dev.lock().unwrap().overlay_allocated_clusters(), Some(3));
    drop(d);
    // A new device on the same files sees the same disk.
    let mut d = Disk::open(overlay(&ovl, &base)).unwrap();
    check(&mut d);
    assert_eq!(d.dev.lock().unwrap().overlay_allocated_clusters(), Some(3));
    // The overlay is sparse: 3 clusters of data, not a copy of the base.
    let blocks = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&ovl).unwrap());
    assert!(
        blocks * 512 < 512 * 1024,
        "overlay uses {} bytes",
        blocks * 512
    );
}

/// The allocation bitmap's first byte as it is on disk.
fn bitmap_byte_on_disk(ovl: &Path) -> u8 {
    let mut b = [0u8; 1];
    std::fs::File::open(ovl)
        .unwrap()
        .read_exact_at(&mut b, 4096)
        .unwrap();
    b[0]
}

#[test]
fn allocations_reach_the_disk_at_flush_or_at_once_without_the_flush_feature() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path(), "base.img", 0);
    let ovl = dir.path().join("wb.ovl");
    let mut d = Disk::open(overlay(&ovl, &base)).unwrap();
    assert_eq!(d.write(0, &[1; 512]), status::OK);
    assert_eq!(bitmap_byte_on_disk(&ovl), 0);
    d.flush();
    assert_eq!(bitmap_byte_on_disk(&ovl), 1);
    // A driver without VIRTIO_BLK_F_FLUSH gets write-through.
    let ovl = dir.path().join("wt.ovl");
    let mut d = Disk::open_with(overlay(&ovl, &base), VIRTIO_F_VERSION_1).unwrap();
    assert_eq!(d.write(128, &[1; 512]), status::OK);
    assert_eq!(bitmap_byte_on_disk(&ovl), 2);
}

#[test]
fn base_is_never_modified() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path(), "base.img", 0x5a);
    let before = std::fs::read(&base).unwrap();
    let mtime = std::fs::metadata(&base).unwrap().modified().unwrap();
    let mut d = Disk::open(overlay(&dir.path().join("o"), &base)).unwrap();
    for s in (0..BASE_SECTORS).step_by(97) {
        assert_eq!(d.write(s, &[0xee; 512]), status::OK);
    }
    d.flush();
    drop(d);
    assert_eq!(std::fs::read(&base).unwrap(), before);
    assert_eq!(std::fs::metadata(&base).unwrap().modified().unwrap(), mtime);
}

#[test]
fn two_vms_share_one_base_and_see_only_their_writes() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path(), "base.img", 0);
    let before = std::fs::read(&base).unwrap();
    let mut a = Disk::open(overlay(&dir.path().join("a.ovl"), &base)).unwrap();
    let mut b = Disk::open(overlay(&dir.path().join("b.ovl"), &base)).unwrap();
    assert_eq!(a.write(10, &[0xaa; 512]), status::OK);
    assert_eq!(b.write(10, &[0xbb; 512]), status::OK);
    assert_eq!(b.write(20, &[0xbb; 512]), status::OK);
    assert_eq!(a.read(10, 512), vec![0xaa; 512]);
    assert_eq!(b.read(10, 512), vec![0xbb; 512]);
    assert_eq!(a.read(20, 512), base_sector(20, 0));
    a.flush();
    b.flush();
    assert_eq!(std::fs::read(&base).unwrap(), before);
}

#[test]
fn overlay_requests_are_validated_like_raw_ones() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path(), "base.img", 0);
    let mut d = Disk::open(overlay(&dir.path().join("o"), &base)).unwrap();
    // Partial sectors.
    assert_eq!(d.write(0, &[1; 100]), status::IOERR);
    assert_eq!(
        d.request(request_type::IN, 0, Data::Read(700)).0,
        status::IOERR
    );
    // Out of range, including overflow.
    assert_eq!(d.write(BASE_SECTORS - 1, &[1; 1024]), status::IOERR);
    assert_eq!(d.write(u64::MAX, &[1; 512]), status::IOERR);
    assert_eq!(
        d.request(request_type::IN, BASE_SECTORS, Data::Read(512)).0,
        status::IOERR
    );
    // The last sector is fine, and nothing above was written.
    assert_eq!(d.write(BASE_SECTORS - 1, &[9; 512]), status::OK);
    assert_eq!(d.read(0, 512), base_sector(0, 0));
    assert_eq!(d.dev.lock().unwrap().overlay_allocated_clusters(), Some(1));
    // Unsupported request types and GET_ID.
    assert_eq!(d.request(77, 0, Data::None).0, status::UNSUPP);
    let (st, id) = d.request(request_type::GET_ID, 0, Data::Read(20));
    assert_eq!(st, status::OK);
    assert_eq!(&id[..7], b"scratch");
    assert!(id[7..].iter().all(|&b| b == 0));
}

#[test]
fn damaged_overlays_and_wrong_bases_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path(), "base.img", 0);
    let ovl = dir.path().join("o");
    let mut d = Disk::open(overlay(&ovl, &base)).unwrap();
    assert_eq!(d.write(0, &[1; 512]), status::OK);
    drop(d);
    let pristine = std::fs::read(&ovl).unwrap();
    let restore = || std::fs::write(&ovl, &pristine).unwrap();
    let open = |cfg: BlockConfig| Block::new(cfg).map(|_| ()).unwrap_err();

    // Both header slots damaged.
    let f = std::fs::OpenOptions::new().write(true).open(&ovl).unwrap();
    f.write_all_at(&[0x42; 1024], 0).unwrap();
    drop(f);
    let e = open(overlay(&ovl, &base));
    assert!(matches!(e, BlockError::OverlayCorrupt { .. }), "{e}");
    assert!(e.to_string().contains(&*ovl.to_string_lossy()), "{e}");
    // One flipped bit in each slot: checksum.
    restore();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&ovl)
        .unwrap();
    for slot in [0u64, 512] {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, slot + 30).unwrap();
        f.write_all_at(&[b[0] ^ 4], slot + 30).unwrap();
    }
    drop(f);
    let e = open(overlay(&ovl, &base));
    assert!(e.to_string().contains("checksum"), "{e}");

    // Truncated: inside the header, and in the data area.
    restore();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&ovl)
        .unwrap()
        .set_len(1000)
        .unwrap();
    let e = open(overlay(&ovl, &base));
    assert!(
        matches!(e, BlockError::OverlayTruncated { len: 1000, .. }),
        "{e}"
    );
    restore();
    let len = pristine.len() as u64;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&ovl)
        .unwrap()
        .set_len(len - 4096)
        .unwrap();
    let e = open(overlay(&ovl, &base));
    assert!(matches!(e, BlockError::OverlayTruncated { .. }), "{e}");

    // Not an overlay at all.
    let raw = dir.path().join("raw.img");
    std::fs::write(&raw, vec![0u8; 1 << 20]).unwrap();
    let e = open(overlay(&raw, &base));
    assert!(e.to_string().contains("magic"), "{e}");

    // Another base: same size, other content; and another size.
    restore();
    let other = make_base(dir.path(), "other.img", 0x80);
    let e = open(overlay(&ovl, &other));
    assert!(matches!(e, BlockError::BaseMismatch { .. }), "{e}");
    assert!(e.to_string().contains("fingerprint"), "{e}");
    let small = dir.path().join("small.img");
    std::fs::write(&small, vec![0u8; 512 * 1024]).unwrap();
    let e = open(overlay(&ovl, &small));
    assert!(matches!(e, BlockError::BaseMismatch { .. }), "{e}");
    // A missing base, a base of a bad size, and an overlay that is its own base.
    let e = open(overlay(&ovl, &dir.path().join("nope")));
    assert!(matches!(e, BlockError::Open { .. }), "{e}");
    std::fs::write(&small, vec![0u8; 1000]).unwrap();
    assert!(matches!(
        open(overlay(&dir.path().join("n"), &small)),
        BlockError::BadSize { .. }
    ));
    assert!(matches!(
        open(overlay(&base, &base)),
        BlockError::Config { .. }
    ));

    // The intact overlay still opens and holds its data.
    restore();
    let mut d = Disk::open(overlay(&ovl, &base)).unwrap();
    assert_eq!(d.read(0, 512), vec![1; 512]);
}

#[test]
fn an_overlay_or_a_writable_image_is_used_by_one_vmm_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path(), "base.img", 0);
    let ovl = dir.path().join("o");
    let _a = Block::new(overlay(&ovl, &base)).unwrap();
    let e = Block::new(overlay(&ovl, &base)).unwrap_err();
    assert!(matches!(e, BlockError::Locked { .. }), "{e}");
    // The base is shared by overlays but cannot be opened for writing meanwhile.
    let rw = BlockConfig {
        path: base.clone(),
        mode: BlockMode::ReadWrite,
        id: String::new(),
    };
    assert!(matches!(Block::new(rw), Err(BlockError::Locked { .. })));
    let ro = BlockConfig {
        path: base.clone(),
        mode: BlockMode::ReadOnly,
        id: String::new(),
    };
    Block::new(ro).unwrap();
}

/// Not a test on its own: the child process of `flushed_data_survives_a_crash`.
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var("EMBER_BLOCK_CRASH_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let mut d = Disk::open(overlay(&dir.join("o"), &dir.join("base.img"))).unwrap();
    assert_eq!(d.write(1, &[0x11; 512]), status::OK);
    assert_eq!(d.write(1000, &[0x22; 4096]), status::OK);
    d.flush();
    // Written but never flushed: a new cluster, whose allocation is still only in memory.
    assert_eq!(d.write(1500, &[0x33; 512]), status::OK);
    println!("EMBER-READY");
    std::thread::sleep(std::time::Duration::from_secs(60));
}

#[test]
fn flushed_data_survives_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path(), "base.img", 0);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
        .env("EMBER_BLOCK_CRASH_DIR", dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let ready = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .any(|l| l.contains("EMBER-READY"));
    // SIGKILL: no destructor, no clean close, like a VMM that crashed.
    child.kill().unwrap();
    let st = child.wait().unwrap();
    assert!(ready, "the child did not get ready ({st})");
    assert!(!st.success());
    let mut d = Disk::open(overlay(&dir.path().join("o"), &base)).unwrap();
    assert_eq!(d.read(1, 512), vec![0x11; 512]);
    assert_eq!(d.read(1000, 4096), vec![0x22; 4096]);
    // The unflushed allocation is gone: the sector reads from the base again.
    assert_eq!(d.read(1500, 512), base_sector(1500, 0));
    assert_eq!(d.dev.lock().unwrap().overlay_allocated_clusters(), Some(2));
}

#[test]
fn snapshot_restore_and_clone_with_overlays() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path(), "base.img", 0);
    let o1 = dir.path().join("template.ovl");
    let mut d = Disk::open(overlay(&o1, &base)).unwrap();
    assert_eq!(d.write(10, &[0x10; 512]), status::OK);
    let stale = dir.path().join("stale.ovl");
    std::fs::copy(&o1, &stale).unwrap();
    // No FLUSH from the guest: the snapshot itself makes the overlay complete and durable.
    assert_eq!(d.write(600, &[0x60; 512]), status::OK);
    let state = d.save();
    assert!(state.activated);
    assert_eq!(state.sectors, BASE_SECTORS);
    assert_eq!(state.queues.len(), 1);
    assert_eq!(state.queues[0].next_avail, 2);
    let os = state.overlay.unwrap();
    assert_eq!(os.allocated_clusters, 2);
    // The VM goes on: copy the overlay before it writes again.
    let copies: Vec<PathBuf> = (1..=3)
        .map(|i| {
            let c = dir.path().join(format!("clone{i}.ovl"));
            std::fs::copy(&o1, &c).unwrap();
            c
        })
        .collect();
    assert_eq!(d.write(10, &[0x99; 512]), status::OK);
    let (mem, idx) = (d.mem.clone(), d.avail_idx - 1);

    // Clones: each restores from its own copy, sees the snapshot-time disk, and diverges.
    let mut k1 = Disk::restore(&mem, idx, overlay(&copies[0], &base), &state).unwrap();
    assert!(k1.dev.lock().unwrap().is_activated());
    assert_eq!(k1.read(10, 512), vec![0x10; 512]);
    assert_eq!(k1.read(600, 512), vec![0x60; 512]);
    assert_eq!(k1.read(11, 512), base_sector(11, 0));
    assert_eq!(k1.write(20, &[0xc1; 512]), status::OK);
    drop(k1);
    let mut k2 = Disk::restore(&mem, idx, overlay(&copies[1], &base), &state).unwrap();
    assert_eq!(k2.read(10, 512), vec![0x10; 512]);
    assert_eq!(k2.read(20, 512), base_sector(20, 0));
    drop(k2);
    drop(d); // The live VM exits; its overlay went on after the snapshot.

    // What must be refused, and clearly.
    let refuse = |cfg: BlockConfig, st: &BlockState| {
        Disk::restore(&mem, idx, cfg, st).map(|_| ()).unwrap_err()
    };
    let e = refuse(overlay(&o1, &base), &state);
    assert!(e.to_string().contains("generation"), "{e}");
    // The same copy a second time: the first restore claimed it.
    let e = refuse(overlay(&copies[1], &base), &state);
    assert!(e.to_string().contains("generation"), "{e}");
    // A copy taken before the snapshot.
    let e = refuse(overlay(&stale, &base), &state);
    assert!(e.to_string().contains("generation"), "{e}");
    // No overlay at all, or an empty one of another lineage.
    let fresh = dir.path().join("fresh.ovl");
    let e = refuse(overlay(&fresh, &base), &state);
    assert!(e.to_string().contains("does not exist"), "{e}");
    drop(Block::new(overlay(&fresh, &base)).unwrap());
    let e = refuse(overlay(&fresh, &base), &state);
    assert!(e.to_string().contains("lineage"), "{e}");
    // Another disk size, another base, another mode or id.
    let c3 = &copies[2];
    let mut grown = state.clone();
    grown.sectors += 8;
    let e = refuse(overlay(c3, &base), &grown);
    assert!(matches!(e, BlockError::SizeMismatch { .. }), "{e}");
    let other = make_base(dir.path(), "other.img", 3);
    let e = refuse(overlay(c3, &other), &state);
    assert!(matches!(e, BlockError::BaseMismatch { .. }), "{e}");
    let mut cfg = overlay(c3, &base);
    cfg.mode = BlockMode::ReadWrite;
    assert!(matches!(refuse(cfg, &state), BlockError::Restore { .. }));
    let mut cfg = overlay(c3, &base);
    cfg.id = "other".into();
    assert!(matches!(refuse(cfg, &state), BlockError::Restore { .. }));
    // None of the refusals consumed the untouched copy.
    let mut k3 = Disk::restore(&mem, idx, overlay(c3, &base), &state).unwrap();
    assert_eq!(k3.read(600, 512), vec![0x60; 512]);
}

#[test]
fn a_snapshot_of_an_empty_overlay_restores_onto_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path(), "base.img", 0);
    let d = Disk::open(overlay(&dir.path().join("tpl.ovl"), &base)).unwrap();
    let state = d.save();
    assert_eq!(state.overlay.unwrap().allocated_clusters, 0);
    let fresh = dir.path().join("sandbox-1.ovl");
    let mut k = Disk::restore(&d.mem, d.avail_idx, overlay(&fresh, &base), &state).unwrap();
    assert!(fresh.exists());
    assert_eq!(k.read(7, 512), base_sector(7, 0));
    assert_eq!(k.write(7, &[1; 512]), status::OK);
}

#[test]
fn raw_modes_still_work_and_persist() {
    let dir = tempfile::tempdir().unwrap();
    let img = make_base(dir.path(), "disk.img", 0);
    let rw = BlockConfig {
        path: img.clone(),
        mode: BlockMode::ReadWrite,
        id: "rw".into(),
    };
    let mut d = Disk::open(rw.clone()).unwrap();
    assert_eq!(d.dev.lock().unwrap().avail_features() & VIRTIO_BLK_F_RO, 0);
    assert_eq!(d.write(4, &[0x44; 1024]), status::OK);
    d.flush();
    assert_eq!(
        &std::fs::read(&img).unwrap()[4 * 512..6 * 512],
        &[0x44; 1024][..]
    );
    let state = d.save();
    assert!(state.overlay.is_none());
    let (mem, idx) = (d.mem.clone(), d.avail_idx);
    drop(d);
    let mut back = Disk::restore(&mem, idx, rw, &state).unwrap();
    assert_eq!(back.read(4, 1024), vec![0x44; 1024]);

    // Read-only: advertised, and writes fail without touching the file.
    let ro_img = make_base(dir.path(), "ro.img", 0);
    let before = std::fs::read(&ro_img).unwrap();
    let mut ro = Disk::open(BlockConfig {
        path: ro_img.clone(),
        mode: BlockMode::ReadOnly,
        id: String::new(),
    })
    .unwrap();
    assert_ne!(ro.dev.lock().unwrap().avail_features() & VIRTIO_BLK_F_RO, 0);
    assert_eq!(ro.write(0, &[0xff; 512]), status::IOERR);
    ro.flush();
    assert_eq!(std::fs::read(&ro_img).unwrap(), before);
}
