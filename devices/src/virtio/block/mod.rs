//! virtio-blk backed by a raw image file (read-write or read-only) or by a copy-on-write overlay
//! on a shared read-only base image ([`overlay`]).
//!
//! Requests are parsed from untrusted descriptor chains: the header must be readable, the status
//! byte must be the last writable byte, data lengths must be whole sectors and inside the disk.
//! A bad request completes with `VIRTIO_BLK_S_IOERR` (or `UNSUPP`) and never touches memory
//! outside the guest. Data moves in bounded chunks, so a huge request cannot make the VMM
//! allocate without limit.
//!
//! The device offers `VIRTIO_BLK_F_FLUSH` (write-back cache): a FLUSH makes every completed
//! write durable (`fdatasync`; for overlays, data then allocation bitmap, see [`overlay`]). A
//! driver that does not accept the feature gets write-through: every write is flushed before it
//! completes.
//!
//! Images are locked with `flock`: a writable image or overlay exclusively, a read-only image or
//! a base shared, so two VMMs cannot write one file and nobody writes a base in use.
//!
//! Snapshots: see [`persist`] for [`Block`]'s `Persist` implementation and what the VMM must do
//! with overlay files.

pub mod overlay;
pub mod persist;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use event_manager::{EventOps, Events, MutEventSubscriber};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::ByteValued;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::{device_type, interrupt_cause, ActivateError, Interrupt, VirtioDevice};
use crate::GuestMemoryMmap;
use overlay::{Create, Overlay};

pub use persist::{BlockState, OverlayState};

/// Sector size of the virtio-blk protocol (a power of two: `x & (SECTOR_SIZE - 1)` is `x % SECTOR_SIZE`).
pub const SECTOR_SIZE: u64 = 512;
const QUEUE_SIZE: u16 = 256;
/// Largest chunk moved between the image and guest memory at once.
const CHUNK: usize = 128 * 1024;
/// Length of the `GET_ID` answer.
const ID_LEN: usize = 20;

/// `VIRTIO_BLK_F_RO`: the device is read-only.
pub const VIRTIO_BLK_F_RO: u64 = 1 << 5;
/// `VIRTIO_BLK_F_FLUSH`: the device has a write-back cache and honours FLUSH.
pub const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;

/// Request types (virtio 1.2 §5.2.6).
pub mod request_type {
    /// Read.
    pub const IN: u32 = 0;
    /// Write.
    pub const OUT: u32 = 1;
    /// Flush the write cache.
    pub const FLUSH: u32 = 4;
    /// Device id (serial).
    pub const GET_ID: u32 = 8;
}
use request_type::{FLUSH as T_FLUSH, GET_ID as T_GET_ID, IN as T_IN, OUT as T_OUT};

/// Request status values written into the last byte of a chain.
pub mod status {
    /// Success.
    pub const OK: u8 = 0;
    /// I/O error (also: malformed request, out of range, write to a read-only disk).
    pub const IOERR: u8 = 1;
    /// Unsupported request type.
    pub const UNSUPP: u8 = 2;
}
use status::{IOERR as S_IOERR, OK as S_OK, UNSUPP as S_UNSUPP};

/// How the guest may use the image.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum BlockMode {
    /// Reads and writes go to the image.
    ReadWrite,
    /// The device advertises read-only; writes fail with an I/O error in the guest.
    ReadOnly,
    /// Copy-on-write: `BlockConfig::path` is this VM's overlay file (created empty when it does
    /// not exist), `base` the shared image, opened read-only and never written.
    Overlay {
        /// The shared base image.
        base: PathBuf,
    },
}

impl BlockMode {
    /// A short name: `rw`, `ro` or `overlay`.
    pub fn name(&self) -> &'static str {
        match self {
            BlockMode::ReadWrite => "rw",
            BlockMode::ReadOnly => "ro",
            BlockMode::Overlay { .. } => "overlay",
        }
    }
}

/// Configuration of one disk.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockConfig {
    /// The image file; in overlay mode, the overlay file.
    pub path: PathBuf,
    /// Access mode.
    pub mode: BlockMode,
    /// Serial reported to the guest (`GET_ID`), at most 20 bytes.
    pub id: String,
}

/// Errors opening or restoring a disk. Each names the file concerned.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The image cannot be opened.
    #[error("cannot open disk image {path}: {source}")]
    Open {
        /// The image.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The image size is not usable.
    #[error("disk image {path} is {size} bytes: it must be a non-zero multiple of 512")]
    BadSize {
        /// The image.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// The id does not fit.
    #[error("disk id {0:?} is longer than 20 bytes")]
    IdTooLong(String),
    /// The queue eventfd could not be made.
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    /// Another process holds a conflicting lock on the file.
    #[error("disk image {path} is in use: another VMM has it open {held} (flock: {source})")]
    Locked {
        /// The image, overlay or base.
        path: PathBuf,
        /// "for writing" or "read-only".
        held: &'static str,
        /// The `flock` error.
        source: std::io::Error,
    },
    /// An I/O operation on the file failed.
    #[error("disk image {path}: cannot {what}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was attempted.
        what: &'static str,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The configuration is inconsistent.
    #[error("disk {path}: {reason}")]
    Config {
        /// The image.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The overlay's header is damaged or is not an overlay header.
    #[error("overlay {path} is not a valid ember overlay: {reason}")]
    OverlayCorrupt {
        /// The overlay.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The overlay was written by a newer ember.
    #[error("overlay {path} has format version {version}; this ember reads version 1")]
    OverlayVersion {
        /// The overlay.
        path: PathBuf,
        /// Its version.
        version: u32,
    },
    /// The overlay file is shorter than its header says.
    #[error("overlay {path} is truncated: {len} bytes, its layout needs {expected}")]
    OverlayTruncated {
        /// The overlay.
        path: PathBuf,
        /// Its length.
        len: u64,
        /// The length its header implies.
        expected: u64,
    },
    /// The overlay was made for another base image.
    #[error("overlay {overlay} does not belong to base {base}: {reason}")]
    BaseMismatch {
        /// The overlay.
        overlay: PathBuf,
        /// The base given.
        base: PathBuf,
        /// What differs.
        reason: String,
    },
    /// The snapshot's disk size differs from the image's.
    #[error(
        "disk image {path} has {image_sectors} sectors but the snapshot's disk had \
         {state_sectors}"
    )]
    SizeMismatch {
        /// The image.
        path: PathBuf,
        /// Sectors in the snapshot.
        state_sectors: u64,
        /// Sectors of the image.
        image_sectors: u64,
    },
    /// The snapshot state cannot be restored onto this disk.
    #[error("cannot restore disk {path} from the snapshot: {reason}")]
    Restore {
        /// The image (overlay) given for the restore.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// Takes a non-blocking `flock` on `file` (shared or exclusive).
pub(crate) fn lock_file(file: &File, exclusive: bool, path: &Path) -> Result<(), BlockError> {
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    } | libc::LOCK_NB;
    // SAFETY: `flock` takes a descriptor that `file` keeps open for the whole call and an
    // integer; it accesses no memory of ours.
    let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
    if rc == 0 {
        return Ok(());
    }
    Err(BlockError::Locked {
        path: path.to_path_buf(),
        // We wanted exclusive: someone has it at all; we wanted shared: someone writes it.
        held: if exclusive { "already" } else { "for writing" },
        source: std::io::Error::last_os_error(),
    })
}

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct RequestHeader {
    kind: u32,
    _reserved: u32,
    sector: u64,
}
// SAFETY: `RequestHeader` is plain old data (integers, `repr(C)`, no padding: 4+4+8 bytes);
// every bit pattern is a valid value.
unsafe impl ByteValued for RequestHeader {}

/// Counters, for stats and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BlockMetrics {
    /// Requests completed successfully.
    pub ok: u64,
    /// Requests completed with an error status.
    pub errors: u64,
    /// Chains dropped because they could not carry a status byte.
    pub malformed: u64,
    /// Bytes read from the image.
    pub read_bytes: u64,
    /// Bytes written to the image.
    pub write_bytes: u64,
}

/// Where the disk's bytes live.
enum Backend {
    Raw { file: File, writable: bool },
    Overlay(Box<Overlay>),
}

impl Backend {
    fn writable(&self) -> bool {
        match self {
            Backend::Raw { writable, .. } => *writable,
            Backend::Overlay(_) => true,
        }
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        match self {
            Backend::Raw { file, .. } => file.read_exact_at(buf, off),
            Backend::Overlay(o) => o.read_at(buf, off),
        }
    }

    fn write_at(&mut self, buf: &[u8], off: u64) -> std::io::Result<()> {
        match self {
            Backend::Raw { file, .. } => file.write_all_at(buf, off),
            Backend::Overlay(o) => o.write_at(buf, off),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Backend::Raw { file, writable } => {
                if *writable {
                    file.sync_data()?;
                }
                Ok(())
            }
            Backend::Overlay(o) => o.flush(),
        }
    }
}

struct Active {
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    queue: Queue,
}

/// A virtio-blk device.
pub struct Block {
    config: BlockConfig,
    backend: Backend,
    sectors: u64,
    acked: u64,
    queue_evt: [EventFd; 1],
    active: Option<Active>,
    broken: bool,
    metrics: BlockMetrics,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("config", &self.config)
            .field("sectors", &self.sectors)
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

fn open_raw(config: &BlockConfig) -> Result<(Backend, u64), BlockError> {
    let writable = config.mode == BlockMode::ReadWrite;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(writable)
        .open(&config.path)
        .map_err(|source| BlockError::Open {
            path: config.path.clone(),
            source,
        })?;
    lock_file(&file, writable, &config.path)?;
    let size = file
        .metadata()
        .map_err(|source| BlockError::Open {
            path: config.path.clone(),
            source,
        })?
        .len();
    if size == 0 || size & (SECTOR_SIZE - 1) != 0 {
        return Err(BlockError::BadSize {
            path: config.path.clone(),
            size,
        });
    }
    Ok((Backend::Raw { file, writable }, size))
}

impl Block {
    /// Opens the image. Read-only mode opens it `O_RDONLY` so the VMM itself cannot write it;
    /// overlay mode opens the base `O_RDONLY` and opens or creates the overlay.
    pub fn new(config: BlockConfig) -> Result<Self, BlockError> {
        Self::open(config, Create::IfMissing)
    }

    fn open(config: BlockConfig, create: Create) -> Result<Self, BlockError> {
        let (backend, size) = Self::open_backend(&config, create)?;
        if let Backend::Overlay(o) = &backend {
            if o.created() {
                tracing::info!("virtio-blk: created overlay {}", config.path.display());
            }
            o.begin_writing()?;
        }
        Self::with_backend(config, backend, size)
    }

    fn open_backend(config: &BlockConfig, create: Create) -> Result<(Backend, u64), BlockError> {
        if config.id.len() > ID_LEN {
            return Err(BlockError::IdTooLong(config.id.clone()));
        }
        match &config.mode {
            BlockMode::ReadWrite | BlockMode::ReadOnly => open_raw(config),
            BlockMode::Overlay { base } => {
                let o = Overlay::open(&config.path, base, create)?;
                let size = o.disk_size();
                Ok((Backend::Overlay(Box::new(o)), size))
            }
        }
    }

    fn with_backend(config: BlockConfig, backend: Backend, size: u64) -> Result<Self, BlockError> {
        Ok(Self {
            backend,
            sectors: size / SECTOR_SIZE,
            acked: 0,
            queue_evt: [EventFd::new(libc::EFD_NONBLOCK).map_err(BlockError::EventFd)?],
            active: None,
            broken: false,
            metrics: BlockMetrics::default(),
            buf: Vec::new(),
            config,
        })
    }

    /// The disk's configuration.
    pub fn config(&self) -> &BlockConfig {
        &self.config
    }

    /// Counters.
    pub fn metrics(&self) -> BlockMetrics {
        self.metrics
    }

    /// Disk size in 512-byte sectors.
    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    /// Clusters this VM has written into its overlay (`None` outside overlay mode).
    pub fn overlay_allocated_clusters(&self) -> Option<u64> {
        match &self.backend {
            Backend::Overlay(o) => Some(o.allocated_clusters()),
            Backend::Raw { .. } => None,
        }
    }

    /// Makes every completed write durable, as a guest FLUSH does. The VMM may call it at a
    /// clean shutdown; dropping the device does it too for overlays.
    pub fn flush(&mut self) -> Result<(), BlockError> {
        self.backend.flush().map_err(|source| BlockError::Io {
            path: self.config.path.clone(),
            what: "flush",
            source,
        })
    }

    fn process_queue(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        if self.broken {
            return;
        }
        let write_through = self.acked & VIRTIO_BLK_F_FLUSH == 0;
        let mut used_any = false;
        loop {
            let mem = &active.mem;
            let chains = match active.queue.iter(mem) {
                Ok(iter) => iter.collect::<Vec<_>>(),
                Err(e) => {
                    crate::warn_limited!("virtio-blk: queue is broken ({e}); device needs reset");
                    self.broken = true;
                    active.interrupt.trigger(interrupt_cause::CONFIG);
                    return;
                }
            };
            if chains.is_empty() {
                if active.queue.event_idx_enabled() {
                    // Re-enable notifications; if more work raced in, go round again.
                    match active.queue.enable_notification(mem) {
                        Ok(true) => continue,
                        Ok(false) => break,
                        Err(_) => break,
                    }
                }
                break;
            }
            for chain in chains {
                let head = chain.head_index();
                let mut req = Request {
                    backend: &mut self.backend,
                    sectors: self.sectors,
                    id: &self.config.id,
                    write_through,
                    metrics: &mut self.metrics,
                    buf: &mut self.buf,
                };
                let written = req.handle(mem, chain);
                if let Err(e) = active.queue.add_used(mem, head, written) {
                    crate::warn_limited!("virtio-blk: cannot complete request {head}: {e}");
                }
                used_any = true;
            }
        }
        if used_any {
            let notify = active.queue.needs_notification(&active.mem).unwrap_or(true);
            if notify {
                active.interrupt.trigger(interrupt_cause::VRING);
            }
        }
    }
}

/// One request's view of the device.
struct Request<'a> {
    backend: &'a mut Backend,
    sectors: u64,
    id: &'a str,
    write_through: bool,
    metrics: &'a mut BlockMetrics,
    buf: &'a mut Vec<u8>,
}

impl Request<'_> {
    /// Executes one request; returns the number of bytes written into guest memory.
    fn handle(
        &mut self,
        mem: &GuestMemoryMmap,
        chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
    ) -> u32 {
        let (mut reader, mut writer) = match (chain.clone().reader(mem), chain.writer(mem)) {
            (Ok(r), Ok(w)) => (r, w),
            _ => {
                self.metrics.malformed += 1;
                return 0;
            }
        };
        let avail = writer.available_bytes();
        if avail == 0 {
            self.metrics.malformed += 1;
            return 0;
        }
        let Ok(mut status_w) = writer.split_at(avail - 1) else {
            self.metrics.malformed += 1;
            return 0;
        };
        let (status, data_written) = match reader.read_obj::<RequestHeader>() {
            Ok(h) => self.execute(h, &mut reader, &mut writer),
            Err(_) => (S_IOERR, 0),
        };
        if status == S_OK {
            self.metrics.ok += 1;
        } else {
            self.metrics.errors += 1;
        }
        if status_w.write_all(&[status]).is_err() {
            self.metrics.malformed += 1;
        }
        u32::try_from(data_written + 1).unwrap_or(u32::MAX)
    }

    fn in_bounds(&self, h: &RequestHeader, len: usize) -> bool {
        let len = len as u64;
        len & (SECTOR_SIZE - 1) == 0
            && h.sector
                .checked_add(len / SECTOR_SIZE)
                .is_some_and(|end| end <= self.sectors)
    }

    fn execute(
        &mut self,
        h: RequestHeader,
        reader: &mut virtio_queue::Reader<'_, crate::GuestBitmapSlice<'_>>,
        writer: &mut virtio_queue::Writer<'_, crate::GuestBitmapSlice<'_>>,
    ) -> (u8, usize) {
        match h.kind {
            T_IN => {
                let len = writer.available_bytes();
                if !self.in_bounds(&h, len) {
                    return (S_IOERR, 0);
                }
                let mut off = h.sector * SECTOR_SIZE;
                let mut done = 0;
                self.buf.resize(len.min(CHUNK), 0);
                while done < len {
                    let n = (len - done).min(CHUNK);
                    if self.backend.read_at(&mut self.buf[..n], off).is_err() {
                        return (S_IOERR, done);
                    }
                    if writer.write_all(&self.buf[..n]).is_err() {
                        return (S_IOERR, done);
                    }
                    done += n;
                    off += n as u64;
                }
                self.metrics.read_bytes += len as u64;
                (S_OK, len)
            }
            T_OUT => {
                if !self.backend.writable() {
                    return (S_IOERR, 0);
                }
                let len = reader.available_bytes();
                if !self.in_bounds(&h, len) {
                    return (S_IOERR, 0);
                }
                let mut off = h.sector * SECTOR_SIZE;
                let mut done = 0;
                self.buf.resize(len.min(CHUNK), 0);
                while done < len {
                    let n = (len - done).min(CHUNK);
                    if reader.read_exact(&mut self.buf[..n]).is_err() {
                        return (S_IOERR, 0);
                    }
                    if self.backend.write_at(&self.buf[..n], off).is_err() {
                        return (S_IOERR, 0);
                    }
                    done += n;
                    off += n as u64;
                }
                self.metrics.write_bytes += len as u64;
                if self.write_through && self.backend.flush().is_err() {
                    return (S_IOERR, 0);
                }
                (S_OK, 0)
            }
            T_FLUSH => {
                if self.backend.flush().is_err() {
                    return (S_IOERR, 0);
                }
                (S_OK, 0)
            }
            T_GET_ID => {
                let mut idb = [0u8; ID_LEN];
                let id = self.id.as_bytes();
                let n = id.len().min(ID_LEN);
                idb[..n].copy_from_slice(&id[..n]);
                let n = writer.available_bytes().min(ID_LEN);
                if writer.write_all(&idb[..n]).is_err() {
                    return (S_IOERR, 0);
                }
                (S_OK, n)
            }
            _ => (S_UNSUPP, 0),
        }
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        device_type::BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        let mut f = super::VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_FLUSH | VIRTIO_RING_F_EVENT_IDX;
        if !self.backend.writable() {
            f |= VIRTIO_BLK_F_RO;
        }
        f
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked = features;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_blk_config starts with `le64 capacity` (in 512-byte sectors).
        super::read_config_bytes(&self.sectors.to_le_bytes(), offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        crate::debug_limited!("virtio-blk: config write at {offset:#x} ignored");
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
        mut queues: Vec<Queue>,
    ) -> Result<(), ActivateError> {
        if queues.len() != 1 {
            return Err(ActivateError::QueueCount {
                expected: 1,
                found: queues.len(),
            });
        }
        let mut queue = queues.remove(0);
        queue.set_event_idx(self.acked & VIRTIO_RING_F_EVENT_IDX != 0);
        self.active = Some(Active {
            mem,
            interrupt,
            queue,
        });
        self.broken = false;
        // Requests may already be waiting (notify raced activation).
        self.process_queue();
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
        self.broken = false;
        self.acked = 0;
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evt
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }
}

impl MutEventSubscriber for Block {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.queue_evt[0], EventSet::IN)) {
            tracing::error!("virtio-blk: cannot watch the queue eventfd: {e:?}");
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if events.event_set().contains(EventSet::IN) {
            let _ = self.queue_evt[0].read();
            self.process_queue();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::EventTrigger;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Address, Bytes, GuestAddress};

    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;

    struct Fixture {
        mem: GuestMemoryMmap,
        dev: Block,
        _img: tempfile::NamedTempFile,
    }

    fn fixture(mode: BlockMode, sectors: u64) -> Fixture {
        let img = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..sectors * SECTOR_SIZE)
            .map(|i| (i / 512) as u8)
            .collect();
        std::fs::write(img.path(), &data).unwrap();
        let dev = Block::new(BlockConfig {
            path: img.path().to_path_buf(),
            mode,
            id: "ember-disk".into(),
        })
        .unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap();
        Fixture {
            mem,
            dev,
            _img: img,
        }
    }

    /// Builds a queue holding one chain and activates the device on it; returns the status
    /// byte and the used length.
    fn run(f: &mut Fixture, descs: &[(u64, u32, u16)], header: Option<RequestHeader>) -> (u8, u32) {
        let mock = MockSplitQueue::new(&f.mem, 16);
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, flags))| {
                let next = if flags & F_NEXT != 0 { i as u16 + 1 } else { 0 };
                RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
            })
            .collect();
        mock.add_desc_chains(&raw, 0).unwrap();
        if let Some(h) = header {
            f.mem.write_obj(h, GuestAddress(descs[0].0)).unwrap();
        }
        let q: Queue = mock.create_queue().unwrap();
        f.dev.set_acked_features(super::super::VIRTIO_F_VERSION_1);
        let irq = Arc::new(Interrupt::new(EventTrigger::new().unwrap()));
        f.dev.activate(f.mem.clone(), irq, vec![q]).unwrap();
        let used_len: u32 = f.mem.read_obj(mock.used_addr().unchecked_add(8)).unwrap();
        let status_desc = descs.iter().rev().find(|d| d.2 & F_WRITE != 0);
        let status = status_desc
            .map(|&(addr, len, _)| {
                f.mem
                    .read_obj::<u8>(GuestAddress(addr + u64::from(len) - 1))
                    .unwrap()
            })
            .unwrap_or(0xff);
        (status, used_len)
    }

    fn hdr(kind: u32, sector: u64) -> Option<RequestHeader> {
        Some(RequestHeader {
            kind,
            _reserved: 0,
            sector,
        })
    }

    #[test]
    fn reads_sectors_into_guest_memory() {
        let mut f = fixture(BlockMode::ReadOnly, 8);
        let (st, used) = run(
            &mut f,
            &[
                (0x1000, 16, F_NEXT),
                (0x2000, 1024, F_NEXT | F_WRITE),
                (0x3000, 1, F_WRITE),
            ],
            hdr(T_IN, 2),
        );
        assert_eq!((st, used), (S_OK, 1025));
        let mut got = [0u8; 1024];
        f.mem.read_slice(&mut got, GuestAddress(0x2000)).unwrap();
        assert!(got[..512].iter().all(|&b| b == 2) && got[512..].iter().all(|&b| b == 3));
        assert_eq!(f.dev.metrics().read_bytes, 1024);
    }

    #[test]
    fn writes_reach_the_image_in_rw_mode() {
        let mut f = fixture(BlockMode::ReadWrite, 8);
        f.mem
            .write_slice(&[0xabu8; 512], GuestAddress(0x2000))
            .unwrap();
        let (st, _) = run(
            &mut f,
            &[
                (0x1000, 16, F_NEXT),
                (0x2000, 512, F_NEXT),
                (0x3000, 1, F_WRITE),
            ],
            hdr(T_OUT, 7),
        );
        assert_eq!(st, S_OK);
        let img = std::fs::read(f.dev.config().path.clone()).unwrap();
        assert!(img[7 * 512..].iter().all(|&b| b == 0xab));
        assert!(img[6 * 512..7 * 512].iter().all(|&b| b == 6));
    }

    #[test]
    fn read_only_mode_refuses_writes_and_advertises_ro() {
        let mut f = fixture(BlockMode::ReadOnly, 8);
        assert_ne!(f.dev.avail_features() & VIRTIO_BLK_F_RO, 0);
        let before = std::fs::read(f.dev.config().path.clone()).unwrap();
        let (st, _) = run(
            &mut f,
            &[
                (0x1000, 16, F_NEXT),
                (0x2000, 512, F_NEXT),
                (0x3000, 1, F_WRITE),
            ],
            hdr(T_OUT, 0),
        );
        assert_eq!(st, S_IOERR);
        assert_eq!(before, std::fs::read(f.dev.config().path.clone()).unwrap());
    }

    #[test]
    fn out_of_range_and_partial_sectors_fail() {
        for (sector, len) in [(7u64, 1024u32), (u64::MAX, 512), (0, 100)] {
            let mut f = fixture(BlockMode::ReadWrite, 8);
            let (st, _) = run(
                &mut f,
                &[
                    (0x1000, 16, F_NEXT),
                    (0x2000, len, F_NEXT | F_WRITE),
                    (0x3000, 1, F_WRITE),
                ],
                hdr(T_IN, sector),
            );
            assert_eq!(st, S_IOERR, "sector {sector} len {len}");
        }
    }

    #[test]
    fn get_id_and_unsupported_requests() {
        let mut f = fixture(BlockMode::ReadOnly, 8);
        let (st, used) = run(
            &mut f,
            &[
                (0x1000, 16, F_NEXT),
                (0x2000, 20, F_NEXT | F_WRITE),
                (0x3000, 1, F_WRITE),
            ],
            hdr(T_GET_ID, 0),
        );
        assert_eq!((st, used), (S_OK, 21));
        let mut id = [0u8; 10];
        f.mem.read_slice(&mut id, GuestAddress(0x2000)).unwrap();
        assert_eq!(&id, b"ember-disk");
        let mut f = fixture(BlockMode::ReadOnly, 8);
        let (st, _) = run(
            &mut f,
            &[(0x1000, 16, F_NEXT), (0x3000, 1, F_WRITE)],
            hdr(99, 0),
        );
        assert_eq!(st, S_UNSUPP);
    }

    #[test]
    fn hostile_chains_do_not_panic() {
        // No writable status byte at all.
        let mut f = fixture(BlockMode::ReadWrite, 8);
        let (_, used) = run(&mut f, &[(0x1000, 16, 0)], hdr(T_IN, 0));
        assert_eq!(used, 0);
        assert_eq!(f.dev.metrics().malformed, 1);
        // Data buffer outside guest memory.
        let mut f = fixture(BlockMode::ReadWrite, 8);
        let (_, used) = run(
            &mut f,
            &[
                (0x1000, 16, F_NEXT),
                (0xffff_f000, 4096, F_NEXT | F_WRITE),
                (0x3000, 1, F_WRITE),
            ],
            hdr(T_IN, 0),
        );
        assert_eq!(used, 0);
        // Header shorter than a request header.
        let mut f = fixture(BlockMode::ReadWrite, 8);
        let (st, _) = run(
            &mut f,
            &[(0x1000, 4, F_NEXT), (0x3000, 1, F_WRITE)],
            hdr(T_IN, 0),
        );
        assert_eq!(st, S_IOERR);
    }

    #[test]
    fn a_guest_breaking_its_queue_over_and_over_is_rate_limited() {
        use crate::ratelimit::capture::{suppressed_counts, Capture};
        use crate::ratelimit::{test_clock, BURST, REFILL_INTERVAL};
        let mut f = fixture(BlockMode::ReadWrite, 8);
        let irq = Arc::new(Interrupt::new(EventTrigger::new().unwrap()));
        // What a hostile driver can repeat: reset, start the device on a ring whose available
        // index is far ahead of its size (the queue is broken), and again.
        let mut break_queue = || {
            let mock = MockSplitQueue::new(&f.mem, 16);
            mock.avail().idx().store(0x8000);
            let q: Queue = mock.create_queue().unwrap();
            f.dev.reset();
            f.dev.set_acked_features(super::super::VIRTIO_F_VERSION_1);
            f.dev.activate(f.mem.clone(), irq.clone(), vec![q]).unwrap();
            assert!(f.dev.broken);
        };
        let capture = Capture::default();
        tracing::subscriber::with_default(capture.clone(), || {
            for _ in 0..1000 {
                break_queue();
            }
            test_clock::advance(REFILL_INTERVAL);
            break_queue();
        });
        let lines = capture.lines();
        let broken = lines
            .iter()
            .filter(|(_, m)| m.contains("virtio-blk: queue is broken"))
            .count() as u64;
        // The burst, then one line after the refill interval, preceded by the count of the
        // 990 dropped in between; nothing else.
        assert_eq!(broken, BURST + 1, "{lines:#?}");
        assert_eq!(suppressed_counts(&lines), vec![1000 - BURST], "{lines:#?}");
        assert_eq!(lines.len() as u64, BURST + 2, "{lines:#?}");
    }

    #[test]
    fn rejects_bad_images() {
        let img = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(img.path(), [0u8; 100]).unwrap();
        let cfg = |p: &Path| BlockConfig {
            path: p.to_path_buf(),
            mode: BlockMode::ReadOnly,
            id: String::new(),
        };
        assert!(matches!(
            Block::new(cfg(img.path())),
            Err(BlockError::BadSize { .. })
        ));
        assert!(matches!(
            Block::new(cfg(Path::new("/nonexistent/disk.img"))),
            Err(BlockError::Open { .. })
        ));
    }
}
