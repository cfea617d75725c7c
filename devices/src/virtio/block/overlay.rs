//! ember's copy-on-write overlay format ("EMBEROVL", version 1).
//!
//! One read-only **base** image is shared by many VMs; each VM writes to its own **overlay**
//! file. The overlay is a sparse file with a fixed layout, so an unallocated cluster costs no
//! disk space and cluster `i` is always at the same offset (no allocation table to corrupt):
//!
//! | offset | length | content |
//! |---|---|---|
//! | 0 | 512 | header slot A |
//! | 512 | 512 | header slot B |
//! | 1024 | 3072 | zero (reserved) |
//! | 4096 | `bitmap_len` | allocation bitmap: bit `i % 8` (LSB first) of byte `i / 8` set = cluster `i` lives in the overlay |
//! | `data_offset` | `cluster_count × cluster_size` | cluster `i` at `data_offset + i × cluster_size` (holes where unallocated) |
//!
//! `bitmap_len` is `ceil(cluster_count / 8)` rounded up to 4 KiB; `data_offset` is the end of
//! the bitmap rounded up to the cluster size. The file is created at its full length
//! (`ftruncate`, so it is sparse), which lets a truncated file be told apart from a short disk.
//!
//! A header slot (all integers little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `EMBEROVL` |
//! | 8 | 4 | format version (1) |
//! | 12 | 4 | header area length (4096) |
//! | 16 | 4 | cluster size (power of two, 4 KiB ..= 2 MiB; new overlays: 64 KiB) |
//! | 20 | 4 | flags (0) |
//! | 24 | 8 | disk size in bytes (= base size) |
//! | 32 | 8 | cluster count |
//! | 40 | 8 | bitmap offset (4096) |
//! | 48 | 8 | bitmap length |
//! | 56 | 8 | data offset |
//! | 64 | 8 | base size in bytes |
//! | 72 | 8 | base fingerprint ([`base_fingerprint`]) |
//! | 80 | 16 | overlay lineage id (random at creation, kept by copies) |
//! | 96 | 8 | generation |
//! | 104 | 8 | CRC-64/XZ of bytes 0..104 |
//! | 112 | 400 | zero |
//!
//! Header updates (only the generation changes after creation) go to slot `generation % 2`, so
//! the previous header stays intact if the machine dies mid-write; on open the valid slot with
//! the higher generation wins.
//!
//! # Durability
//! - A guest write to an allocated cluster is a `pwrite` into the overlay.
//! - A guest write to an unallocated cluster writes the **whole** cluster (a partial write first
//!   copies the cluster up from the base), then sets the bit in the in-memory bitmap only.
//! - FLUSH: `fdatasync` (data), then the changed 4 KiB bitmap blocks are written, then
//!   `fdatasync` again. So a bit reaches the disk only after its cluster's data, and everything
//!   written before a completed FLUSH survives a VMM or host crash.
//! - After a crash, writes that were not flushed may be lost: a cluster allocated since the last
//!   FLUSH reads from the base again (its data, if any, is overwritten whole by the next
//!   allocation); an allocated cluster rewritten in place holds old or new data, as on a disk
//!   with a volatile write cache. Bitmap blocks only ever gain bits, so a torn bitmap write
//!   cannot mark a cluster whose data is not durable.
//! - Dropping the overlay (clean VMM exit) flushes it. A base is never written.
//!
//! # Base identity
//! The header records the base's size and a fingerprint: CRC-64 over the size, the first
//! 256 KiB, the last 64 KiB and 32 evenly spaced 4 KiB samples. It catches a swapped or rebuilt
//! base (an ext4 image rebuilt by mkfs differs in its first blocks) regardless of the path or
//! inode the base is reached by (jails hard-link or bind-mount it); it is not a cryptographic
//! check of every byte.
//!
//! # Generations and snapshots
//! The generation is bumped when a VMM opens the overlay for writing, when a snapshot is taken
//! (`Block`'s `Persist::save`), and on the first write after a snapshot. A snapshot
//! records the overlay's lineage id and generation; a restore accepts only an overlay with the
//! same pair, i.e. an untouched copy of the overlay as it was at snapshot time.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::{lock_file, BlockError, SECTOR_SIZE};

/// First bytes of every overlay.
pub const OVERLAY_MAGIC: [u8; 8] = *b"EMBEROVL";
/// The format version this code writes and the newest it reads.
pub const OVERLAY_VERSION: u32 = 1;
/// Bytes reserved for the two header slots.
pub const HEADER_AREA_LEN: u64 = 4096;
/// Cluster size of new overlays.
pub const DEFAULT_CLUSTER_SIZE: u32 = 64 * 1024;
const MIN_CLUSTER_SIZE: u32 = 4096;
const MAX_CLUSTER_SIZE: u32 = 2 * 1024 * 1024;
const SLOT_LEN: usize = 512;
const FIELDS_LEN: usize = 104;
const BITMAP_BLOCK: u64 = 4096;

/// CRC-64/XZ (ECMA-182 polynomial, reflected), the checksum of ember's snapshot files too.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Crc64(u64);

/// Slicing-by-8 tables: `T[0]` is the classic byte table, `T[k][b]` advances `T[0][b]` by `k`
/// more zero bytes.
const CRC64_TABLES: [[u64; 256]; 8] = {
    let mut t = [[0u64; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u64;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xC96C_5795_D787_0F42
            } else {
                c >> 1
            };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[k - 1][i];
            t[k][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            i += 1;
        }
        k += 1;
    }
    t
};

impl Crc64 {
    pub(crate) fn new() -> Self {
        Self(!0)
    }

    pub(crate) fn update(&mut self, data: &[u8]) {
        let t = &CRC64_TABLES;
        let mut crc = self.0;
        let mut chunks = data.chunks_exact(8);
        for c in &mut chunks {
            let x = crc ^ u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            crc = t[7][(x & 0xff) as usize]
                ^ t[6][((x >> 8) & 0xff) as usize]
                ^ t[5][((x >> 16) & 0xff) as usize]
                ^ t[4][((x >> 24) & 0xff) as usize]
                ^ t[3][((x >> 32) & 0xff) as usize]
                ^ t[2][((x >> 40) & 0xff) as usize]
                ^ t[1][((x >> 48) & 0xff) as usize]
                ^ t[0][(x >> 56) as usize];
        }
        for &b in chunks.remainder() {
            crc = t[0][((crc ^ u64::from(b)) & 0xff) as usize] ^ (crc >> 8);
        }
        self.0 = crc;
    }

    pub(crate) fn finish(self) -> u64 {
        !self.0
    }
}

/// The fingerprint of a base image of `size` bytes (see the module docs).
pub fn base_fingerprint(base: &File, size: u64) -> io::Result<u64> {
    const HEAD: u64 = 256 * 1024;
    const TAIL: u64 = 64 * 1024;
    const SAMPLES: u64 = 32;
    const SAMPLE: u64 = 4096;
    let mut crc = Crc64::new();
    crc.update(&size.to_le_bytes());
    let mut ranges = vec![(0, HEAD.min(size)), (size.saturating_sub(TAIL), size)];
    for i in 0..SAMPLES {
        let start = size / SAMPLES * i;
        ranges.push((start, start.saturating_add(SAMPLE).min(size)));
    }
    let mut buf = vec![0u8; HEAD as usize];
    for (start, end) in ranges {
        let len = (end.saturating_sub(start)) as usize;
        let chunk = &mut buf[..len];
        base.read_exact_at(chunk, start)?;
        crc.update(chunk);
    }
    Ok(crc.finish())
}

fn round_up(v: u64, to: u64) -> Option<u64> {
    v.checked_add(to - 1).map(|x| x / to * to)
}

/// The parsed header of an overlay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) cluster_size: u32,
    pub(crate) disk_size: u64,
    pub(crate) cluster_count: u64,
    pub(crate) bitmap_offset: u64,
    pub(crate) bitmap_len: u64,
    pub(crate) data_offset: u64,
    pub(crate) base_size: u64,
    pub(crate) base_fingerprint: u64,
    pub(crate) uuid: [u8; 16],
    pub(crate) generation: u64,
}

/// Why a header slot was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
enum SlotError {
    Magic,
    Version(u32),
    Checksum,
    Layout(String),
}

impl std::fmt::Display for SlotError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotError::Magic => write!(f, "bad magic (not an ember overlay)"),
            SlotError::Version(v) => write!(f, "format version {v}"),
            SlotError::Checksum => write!(f, "header checksum mismatch"),
            SlotError::Layout(s) => write!(f, "{s}"),
        }
    }
}

/// The layout of an overlay for a disk: (cluster count, bitmap length, data offset, file length).
fn layout(disk_size: u64, cluster_size: u32) -> Option<(u64, u64, u64, u64)> {
    let cs = u64::from(cluster_size);
    let count = disk_size.checked_add(cs - 1)? / cs;
    let bitmap_len = round_up(count.checked_add(7)? / 8, BITMAP_BLOCK)?;
    let data_offset = round_up(HEADER_AREA_LEN.checked_add(bitmap_len)?, cs)?;
    let file_len = data_offset.checked_add(count.checked_mul(cs)?)?;
    Some((count, bitmap_len, data_offset, file_len))
}

impl Header {
    fn new(
        disk_size: u64,
        cluster_size: u32,
        base_fingerprint: u64,
        uuid: [u8; 16],
    ) -> Option<Self> {
        let (cluster_count, bitmap_len, data_offset, _) = layout(disk_size, cluster_size)?;
        Some(Self {
            cluster_size,
            disk_size,
            cluster_count,
            bitmap_offset: HEADER_AREA_LEN,
            bitmap_len,
            data_offset,
            base_size: disk_size,
            base_fingerprint,
            uuid,
            generation: 0,
        })
    }

    pub(crate) fn file_len(&self) -> Option<u64> {
        layout(self.disk_size, self.cluster_size).map(|l| l.3)
    }

    fn encode(&self) -> [u8; SLOT_LEN] {
        let mut b = [0u8; SLOT_LEN];
        b[0..8].copy_from_slice(&OVERLAY_MAGIC);
        b[8..12].copy_from_slice(&OVERLAY_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(HEADER_AREA_LEN as u32).to_le_bytes());
        b[16..20].copy_from_slice(&self.cluster_size.to_le_bytes());
        b[20..24].copy_from_slice(&0u32.to_le_bytes());
        b[24..32].copy_from_slice(&self.disk_size.to_le_bytes());
        b[32..40].copy_from_slice(&self.cluster_count.to_le_bytes());
        b[40..48].copy_from_slice(&self.bitmap_offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.bitmap_len.to_le_bytes());
        b[56..64].copy_from_slice(&self.data_offset.to_le_bytes());
        b[64..72].copy_from_slice(&self.base_size.to_le_bytes());
        b[72..80].copy_from_slice(&self.base_fingerprint.to_le_bytes());
        b[80..96].copy_from_slice(&self.uuid);
        b[96..104].copy_from_slice(&self.generation.to_le_bytes());
        let mut crc = Crc64::new();
        crc.update(&b[..FIELDS_LEN]);
        b[104..112].copy_from_slice(&crc.finish().to_le_bytes());
        b
    }

    fn decode(b: &[u8; SLOT_LEN]) -> Result<Self, SlotError> {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(x)
        };
        if b[0..8] != OVERLAY_MAGIC {
            return Err(SlotError::Magic);
        }
        let version = u32_at(8);
        if version != OVERLAY_VERSION {
            return Err(SlotError::Version(version));
        }
        let mut crc = Crc64::new();
        crc.update(&b[..FIELDS_LEN]);
        if crc.finish() != u64_at(104) {
            return Err(SlotError::Checksum);
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[80..96]);
        let h = Self {
            cluster_size: u32_at(16),
            disk_size: u64_at(24),
            cluster_count: u64_at(32),
            bitmap_offset: u64_at(40),
            bitmap_len: u64_at(48),
            data_offset: u64_at(56),
            base_size: u64_at(64),
            base_fingerprint: u64_at(72),
            uuid,
            generation: u64_at(96),
        };
        let bad = |s: String| Err(SlotError::Layout(s));
        if u64::from(u32_at(12)) != HEADER_AREA_LEN {
            return bad(format!(
                "header area length {} (expected {HEADER_AREA_LEN})",
                u32_at(12)
            ));
        }
        if u32_at(20) != 0 {
            return bad(format!("unknown flags {:#x}", u32_at(20)));
        }
        if !h.cluster_size.is_power_of_two()
            || !(MIN_CLUSTER_SIZE..=MAX_CLUSTER_SIZE).contains(&h.cluster_size)
        {
            return bad(format!(
                "cluster size {} is not a power of two in 4 KiB..=2 MiB",
                h.cluster_size
            ));
        }
        if h.disk_size == 0 || h.disk_size & (SECTOR_SIZE - 1) != 0 || h.base_size != h.disk_size {
            return bad(format!(
                "disk size {} / base size {} (must be equal, non-zero multiples of 512)",
                h.disk_size, h.base_size
            ));
        }
        match layout(h.disk_size, h.cluster_size) {
            Some((count, bitmap_len, data_offset, _))
                if count == h.cluster_count
                    && bitmap_len == h.bitmap_len
                    && data_offset == h.data_offset
                    && h.bitmap_offset == HEADER_AREA_LEN => {}
            _ => {
                return bad(format!(
                    "layout fields (clusters {}, bitmap {}+{}, data at {}) do not match disk \
                     size {} and cluster size {}",
                    h.cluster_count,
                    h.bitmap_offset,
                    h.bitmap_len,
                    h.data_offset,
                    h.disk_size,
                    h.cluster_size
                ))
            }
        }
        Ok(h)
    }
}

/// A random lineage id; falls back to time and pid if the kernel refuses `getrandom`.
fn new_uuid() -> [u8; 16] {
    let mut b = [0u8; 16];
    // SAFETY: `getrandom` writes at most `b.len()` bytes into `b`, a live local buffer of that
    // length; it keeps no pointer after returning.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if usize::try_from(n).ok() != Some(b.len()) {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let mut crc = Crc64::new();
        crc.update(&nanos.to_le_bytes());
        crc.update(&std::process::id().to_le_bytes());
        b[..8].copy_from_slice(&crc.finish().to_le_bytes());
        b[8..].copy_from_slice(&(nanos as u64).to_le_bytes());
    }
    b
}

/// How [`Overlay::open`] treats a missing overlay file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Create {
    /// Create an empty overlay if the file does not exist.
    IfMissing,
    /// The overlay must exist.
    Never,
}

/// An open overlay and its base.
pub(crate) struct Overlay {
    path: PathBuf,
    base_path: PathBuf,
    file: File,
    base: File,
    header: Header,
    /// The bitmap as it is (or will be, after the next flush) on disk.
    bitmap: Vec<u8>,
    /// Bitmap blocks changed since the last flush.
    dirty: BTreeSet<u64>,
    allocated: u64,
    /// Current generation (the header's, updated by `&self` snapshot saves).
    generation: Cell<u64>,
    /// A snapshot was taken: bump the generation before the next write.
    bump_before_write: Cell<bool>,
    cluster_buf: Vec<u8>,
    created: bool,
}

impl std::fmt::Debug for Overlay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overlay")
            .field("path", &self.path)
            .field("base", &self.base_path)
            .field("cluster_size", &self.header.cluster_size)
            .field("allocated", &self.allocated)
            .field("generation", &self.generation.get())
            .finish_non_exhaustive()
    }
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> BlockError + 'a {
    move |source| BlockError::Io {
        path: path.to_path_buf(),
        what,
        source,
    }
}

impl Overlay {
    /// Opens (or creates) the overlay at `path` on the base at `base_path` and validates it.
    /// The generation is not bumped: call [`Overlay::begin_writing`] once the caller accepts it.
    pub(crate) fn open(path: &Path, base_path: &Path, create: Create) -> Result<Self, BlockError> {
        if path == base_path {
            return Err(BlockError::Config {
                path: path.to_path_buf(),
                reason: "the overlay and its base are the same file".into(),
            });
        }
        let base = OpenOptions::new()
            .read(true)
            .open(base_path)
            .map_err(|source| BlockError::Open {
                path: base_path.to_path_buf(),
                source,
            })?;
        lock_file(&base, false, base_path)?;
        let base_size = base
            .metadata()
            .map_err(io_err(base_path, "stat the base"))?
            .len();
        if base_size == 0 || base_size & (SECTOR_SIZE - 1) != 0 {
            return Err(BlockError::BadSize {
                path: base_path.to_path_buf(),
                size: base_size,
            });
        }
        let fingerprint =
            base_fingerprint(&base, base_size).map_err(io_err(base_path, "read the base"))?;

        let (file, created) = match OpenOptions::new().read(true).write(true).open(path) {
            Ok(f) => (f, false),
            Err(e) if e.kind() == ErrorKind::NotFound && create == Create::IfMissing => {
                match create_file(path, base_size, fingerprint)? {
                    Some(f) => (f, true),
                    // Someone created it between our open and our link: use theirs.
                    None => (
                        OpenOptions::new()
                            .read(true)
                            .write(true)
                            .open(path)
                            .map_err(|source| BlockError::Open {
                                path: path.to_path_buf(),
                                source,
                            })?,
                        false,
                    ),
                }
            }
            Err(source) => {
                return Err(BlockError::Open {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        lock_file(&file, true, path)?;
        let header = read_header(&file, path)?;

        if header.base_size != base_size {
            return Err(BlockError::BaseMismatch {
                overlay: path.to_path_buf(),
                base: base_path.to_path_buf(),
                reason: format!(
                    "the overlay was made for a base of {} bytes, this base has {base_size}",
                    header.base_size
                ),
            });
        }
        if header.base_fingerprint != fingerprint {
            return Err(BlockError::BaseMismatch {
                overlay: path.to_path_buf(),
                base: base_path.to_path_buf(),
                reason: format!(
                    "content fingerprint {fingerprint:#018x} differs from the one recorded at \
                     overlay creation ({:#018x}): the base was replaced or modified",
                    header.base_fingerprint
                ),
            });
        }
        let expected = header.file_len().unwrap_or(u64::MAX);
        let len = file
            .metadata()
            .map_err(io_err(path, "stat the overlay"))?
            .len();
        if len < expected {
            return Err(BlockError::OverlayTruncated {
                path: path.to_path_buf(),
                len,
                expected,
            });
        }
        let bitmap_len =
            usize::try_from(header.bitmap_len).map_err(|_| BlockError::OverlayCorrupt {
                path: path.to_path_buf(),
                reason: format!(
                    "bitmap of {} bytes does not fit in memory",
                    header.bitmap_len
                ),
            })?;
        let mut bitmap = vec![0u8; bitmap_len];
        file.read_exact_at(&mut bitmap, header.bitmap_offset)
            .map_err(io_err(path, "read the allocation bitmap"))?;
        // Bits past the last cluster mean nothing; clear them so counts stay honest.
        let count = header.cluster_count;
        for (i, byte) in bitmap.iter_mut().enumerate() {
            let first = i as u64 * 8;
            if first >= count {
                *byte = 0;
            } else if count - first < 8 {
                *byte &= (1u8 << (count - first)) - 1;
            }
        }
        let allocated = bitmap.iter().map(|b| u64::from(b.count_ones())).sum();
        Ok(Self {
            path: path.to_path_buf(),
            base_path: base_path.to_path_buf(),
            file,
            base,
            generation: Cell::new(header.generation),
            bump_before_write: Cell::new(false),
            cluster_buf: vec![0u8; header.cluster_size as usize],
            header,
            bitmap,
            dirty: BTreeSet::new(),
            allocated,
            created,
        })
    }

    /// Marks the overlay as opened for writing by this VMM (bumps the generation), so
    /// snapshots that recorded the previous generation no longer accept it.
    pub(crate) fn begin_writing(&self) -> Result<(), BlockError> {
        self.write_generation(self.generation.get().wrapping_add(1))
            .map_err(io_err(&self.path, "update the overlay header"))
    }

    /// Whether `open` created the file.
    pub(crate) fn created(&self) -> bool {
        self.created
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Disk size in bytes.
    pub(crate) fn disk_size(&self) -> u64 {
        self.header.disk_size
    }

    pub(crate) fn header(&self) -> Header {
        let mut h = self.header;
        h.generation = self.generation.get();
        h
    }

    /// Clusters allocated in the overlay (including ones not yet flushed).
    pub(crate) fn allocated_clusters(&self) -> u64 {
        self.allocated
    }

    fn write_generation(&self, generation: u64) -> io::Result<()> {
        let mut h = self.header;
        h.generation = generation;
        let slot = (generation % 2) * SLOT_LEN as u64;
        self.file.write_all_at(&h.encode(), slot)?;
        self.generation.set(generation);
        Ok(())
    }

    pub(crate) fn is_allocated(&self, cluster: u64) -> bool {
        usize::try_from(cluster / 8)
            .ok()
            .and_then(|i| self.bitmap.get(i))
            .is_some_and(|b| b & (1 << (cluster % 8)) != 0)
    }

    fn set_allocated(&mut self, cluster: u64) {
        let Some(byte) = usize::try_from(cluster / 8)
            .ok()
            .and_then(|i| self.bitmap.get_mut(i))
        else {
            return;
        };
        if *byte & (1 << (cluster % 8)) == 0 {
            *byte |= 1 << (cluster % 8);
            self.allocated += 1;
            self.dirty.insert(cluster / 8 / BITMAP_BLOCK);
        }
    }

    fn check_range(&self, off: u64, len: usize) -> io::Result<()> {
        match off.checked_add(len as u64) {
            Some(end) if end <= self.header.disk_size => Ok(()),
            _ => Err(io::Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "{len} bytes at {off} lie outside the {}-byte disk",
                    self.header.disk_size
                ),
            )),
        }
    }

    /// Reads `buf.len()` bytes of the virtual disk at `off`.
    pub(crate) fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.check_range(off, buf.len())?;
        let cs = u64::from(self.header.cluster_size);
        let mut done = 0usize;
        while done < buf.len() {
            let pos = off + done as u64;
            let first = pos / cs;
            let alloc = self.is_allocated(first);
            // Extend over following clusters in the same state: with the fixed layout a run is
            // contiguous in the overlay as well as in the base.
            let mut end = (first + 1) * cs;
            let stop = off + buf.len() as u64;
            while end < stop && self.is_allocated(end / cs) == alloc {
                end += cs;
            }
            let n = (end.min(stop) - pos) as usize;
            let dst = &mut buf[done..done + n];
            if alloc {
                self.file
                    .read_exact_at(dst, self.header.data_offset + pos)?;
            } else {
                self.base.read_exact_at(dst, pos)?;
            }
            done += n;
        }
        Ok(())
    }

    /// Writes `buf` to the virtual disk at `off`, copying partially written clusters up from
    /// the base first.
    pub(crate) fn write_at(&mut self, buf: &[u8], off: u64) -> io::Result<()> {
        self.check_range(off, buf.len())?;
        if self.bump_before_write.get() {
            self.write_generation(self.generation.get().wrapping_add(1))?;
            self.bump_before_write.set(false);
        }
        let cs = u64::from(self.header.cluster_size);
        let disk = self.header.disk_size;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = off + done as u64;
            let cluster = pos / cs;
            let start = cluster * cs;
            let in_cluster = pos - start;
            let n = (buf.len() - done).min((cs - in_cluster) as usize);
            let src = &buf[done..done + n];
            if self.is_allocated(cluster) {
                self.file.write_all_at(src, self.header.data_offset + pos)?;
            } else {
                // Bytes of this cluster that belong to the disk (the last may be short).
                let valid = (disk - start).min(cs) as usize;
                if in_cluster == 0 && n == valid {
                    self.file
                        .write_all_at(src, self.header.data_offset + start)?;
                } else {
                    let cbuf = &mut self.cluster_buf[..valid];
                    self.base.read_exact_at(cbuf, start)?;
                    let at = in_cluster as usize;
                    cbuf[at..at + n].copy_from_slice(src);
                    self.file
                        .write_all_at(cbuf, self.header.data_offset + start)?;
                }
                self.set_allocated(cluster);
            }
            done += n;
        }
        Ok(())
    }

    fn write_bitmap_blocks(&self) -> io::Result<()> {
        for &blk in &self.dirty {
            let start = (blk * BITMAP_BLOCK) as usize;
            let end = (start + BITMAP_BLOCK as usize).min(self.bitmap.len());
            if let Some(bytes) = self.bitmap.get(start..end) {
                self.file
                    .write_all_at(bytes, self.header.bitmap_offset + start as u64)?;
            }
        }
        Ok(())
    }

    /// Makes every completed write durable: data, then the bitmap (see the module docs).
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        self.file.sync_data()?;
        if !self.dirty.is_empty() {
            self.write_bitmap_blocks()?;
            self.file.sync_data()?;
            self.dirty.clear();
        }
        Ok(())
    }

    /// Makes the overlay file a complete, durable image of the disk now (data and bitmap) and
    /// bumps the generation; returns the generation the snapshot must record. The next write
    /// bumps the generation again, so a copy taken after the VM went on is refused.
    pub(crate) fn persist_for_snapshot(&self) -> io::Result<u64> {
        self.file.sync_data()?;
        // The dirty set stays: the next flush rewrites those blocks, which is harmless.
        self.write_bitmap_blocks()?;
        let generation = self.generation.get().wrapping_add(1);
        self.write_generation(generation)?;
        self.file.sync_data()?;
        self.bump_before_write.set(true);
        Ok(generation)
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::error!(
                "virtio-blk: cannot flush overlay {} on close: {e}",
                self.path.display()
            );
        }
    }
}

/// Reads and validates the header of an overlay.
pub(crate) fn read_header(file: &File, path: &Path) -> Result<Header, BlockError> {
    let len = file
        .metadata()
        .map_err(io_err(path, "stat the overlay"))?
        .len();
    if len < HEADER_AREA_LEN {
        return Err(BlockError::OverlayTruncated {
            path: path.to_path_buf(),
            len,
            expected: HEADER_AREA_LEN,
        });
    }
    let mut slots = [[0u8; SLOT_LEN]; 2];
    for (i, slot) in slots.iter_mut().enumerate() {
        file.read_exact_at(slot, (i * SLOT_LEN) as u64)
            .map_err(io_err(path, "read the overlay header"))?;
    }
    let a = Header::decode(&slots[0]);
    let b = Header::decode(&slots[1]);
    match (a, b) {
        (Ok(a), Ok(b)) => Ok(if b.generation > a.generation { b } else { a }),
        (Ok(h), Err(e)) | (Err(e), Ok(h)) => {
            tracing::warn!(
                "virtio-blk: overlay {}: one header slot is damaged ({e}), using the other",
                path.display()
            );
            Ok(h)
        }
        (Err(SlotError::Version(v)), _) | (_, Err(SlotError::Version(v)))
            if v > OVERLAY_VERSION =>
        {
            Err(BlockError::OverlayVersion {
                path: path.to_path_buf(),
                version: v,
            })
        }
        (Err(e), Err(_)) => Err(BlockError::OverlayCorrupt {
            path: path.to_path_buf(),
            reason: e.to_string(),
        }),
    }
}

/// Creates an empty overlay at `path` without ever exposing a half-written file there: the
/// file is built under a temporary name, synced, then hard-linked into place (which fails if
/// `path` appeared meanwhile: `Ok(None)`).
fn create_file(path: &Path, base_size: u64, fingerprint: u64) -> Result<Option<File>, BlockError> {
    let header =
        Header::new(base_size, DEFAULT_CLUSTER_SIZE, fingerprint, new_uuid()).ok_or_else(|| {
            BlockError::BadSize {
                path: path.to_path_buf(),
                size: base_size,
            }
        })?;
    let file_len = header.file_len().ok_or_else(|| BlockError::BadSize {
        path: path.to_path_buf(),
        size: base_size,
    })?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let cleanup = |e: BlockError| {
        let _ = std::fs::remove_file(&tmp);
        e
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|source| BlockError::Open {
            path: tmp.clone(),
            source,
        })?;
    let init = || -> io::Result<()> {
        let slot = header.encode();
        file.write_all_at(&slot, 0)?;
        file.write_all_at(&slot, SLOT_LEN as u64)?;
        file.set_len(file_len)?;
        file.sync_all()
    };
    init()
        .map_err(io_err(path, "initialise the new overlay"))
        .map_err(cleanup)?;
    match std::fs::hard_link(&tmp, path) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            let _ = std::fs::remove_file(&tmp);
            return Ok(None);
        }
        // Filesystems without hard links: a rename (path did not exist a moment ago).
        Err(_) => std::fs::rename(&tmp, path)
            .map_err(io_err(path, "move the new overlay into place"))
            .map_err(cleanup)?,
    }
    let _ = std::fs::remove_file(&tmp);
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(Some(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base(dir: &Path, sectors: u64) -> PathBuf {
        let p = dir.join("base.img");
        let data: Vec<u8> = (0..sectors * SECTOR_SIZE)
            .map(|i| (i / 512) as u8)
            .collect();
        std::fs::write(&p, data).unwrap();
        p
    }

    #[test]
    fn crc64_xz_check_value() {
        let mut c = Crc64::new();
        c.update(b"123456789");
        assert_eq!(c.finish(), 0x995d_c9bb_df19_39fa);
        // Split anywhere, the slicing path and the byte path agree.
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let mut whole = Crc64::new();
        whole.update(&data);
        for split in [0, 1, 7, 8, 9, 500, 999] {
            let mut c = Crc64::new();
            c.update(&data[..split]);
            c.update(&data[split..]);
            assert_eq!(c.finish(), whole.finish(), "split at {split}");
        }
        let mut bytewise = !0u64;
        for &b in &data {
            bytewise =
                CRC64_TABLES[0][((bytewise ^ u64::from(b)) & 0xff) as usize] ^ (bytewise >> 8);
        }
        assert_eq!(!bytewise, whole.finish());
    }

    #[test]
    fn header_round_trip_and_layout() {
        let h = Header::new(10 * 1024 * 1024 + 512, 64 * 1024, 7, [3; 16]).unwrap();
        assert_eq!(h.cluster_count, 161);
        assert_eq!(h.bitmap_len, 4096);
        assert_eq!(h.data_offset, 64 * 1024);
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut raw = h.encode();
        raw[30] ^= 1;
        assert_eq!(Header::decode(&raw), Err(SlotError::Checksum));
        raw = h.encode();
        raw[0] = b'X';
        assert_eq!(Header::decode(&raw), Err(SlotError::Magic));
    }

    #[test]
    fn header_with_inconsistent_layout_is_refused() {
        let mut h = Header::new(1 << 20, 4096, 0, [0; 16]).unwrap();
        h.cluster_count += 1;
        assert!(matches!(
            Header::decode(&h.encode()),
            Err(SlotError::Layout(_))
        ));
        let mut h = Header::new(1 << 20, 4096, 0, [0; 16]).unwrap();
        h.cluster_size = 3000;
        assert!(matches!(
            Header::decode(&h.encode()),
            Err(SlotError::Layout(_))
        ));
    }

    #[test]
    fn reads_fall_through_and_partial_writes_copy_up() {
        let dir = tempfile::tempdir().unwrap();
        let b = base(dir.path(), 300); // 150 KiB: 3 clusters, the last one short
        let o = dir.path().join("ovl");
        let mut ov = Overlay::open(&o, &b, Create::IfMissing).unwrap();
        assert!(ov.created());
        ov.write_at(&[0xee; 512], 130 * 512).unwrap();
        assert_eq!(ov.allocated_clusters(), 1);
        let mut all = vec![0u8; 300 * 512];
        ov.read_at(&mut all, 0).unwrap();
        for (s, sector) in all.chunks(512).enumerate() {
            let want = if s == 130 { 0xee } else { s as u8 };
            assert!(sector.iter().all(|&x| x == want), "sector {s}");
        }
        // The short last cluster: a write covering all of it needs no copy-up.
        ov.write_at(&vec![0x11; 44 * 512], 256 * 512).unwrap();
        assert!(ov.is_allocated(2));
        assert!(ov.read_at(&mut [0u8; 512], 300 * 512).is_err());
        assert!(ov.write_at(&[0u8; 512], u64::MAX - 10).is_err());
    }

    #[test]
    fn snapshot_generation_bumps_once_then_on_next_write() {
        let dir = tempfile::tempdir().unwrap();
        let b = base(dir.path(), 256);
        let o = dir.path().join("ovl");
        let mut ov = Overlay::open(&o, &b, Create::IfMissing).unwrap();
        let g0 = ov.header().generation;
        let g1 = ov.persist_for_snapshot().unwrap();
        assert_eq!(g1, g0 + 1);
        ov.write_at(&[1; 512], 0).unwrap();
        assert_eq!(ov.header().generation, g1 + 1);
        ov.write_at(&[1; 512], 0).unwrap();
        assert_eq!(ov.header().generation, g1 + 1);
        drop(ov);
        let f = File::open(&o).unwrap();
        assert_eq!(read_header(&f, &o).unwrap().generation, g1 + 1);
    }

    #[test]
    fn newer_versions_are_named_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let o = dir.path().join("ovl");
        let mut slot = Header::new(1 << 20, 4096, 0, [0; 16]).unwrap().encode();
        slot[8..12].copy_from_slice(&2u32.to_le_bytes());
        let mut crc = Crc64::new();
        crc.update(&slot[..FIELDS_LEN]);
        slot[104..112].copy_from_slice(&crc.finish().to_le_bytes());
        let mut file = slot.to_vec();
        file.extend_from_slice(&slot);
        file.resize(HEADER_AREA_LEN as usize, 0);
        std::fs::write(&o, file).unwrap();
        let f = File::open(&o).unwrap();
        assert!(matches!(
            read_header(&f, &o),
            Err(BlockError::OverlayVersion { version: 2, .. })
        ));
    }

    #[test]
    fn stray_bitmap_bits_past_the_disk_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let b = base(dir.path(), 300); // 3 clusters
        let o = dir.path().join("ovl");
        drop(Overlay::open(&o, &b, Create::IfMissing).unwrap());
        let f = OpenOptions::new().write(true).open(&o).unwrap();
        f.write_all_at(&[0xff; 16], HEADER_AREA_LEN).unwrap();
        drop(f);
        let ov = Overlay::open(&o, &b, Create::Never).unwrap();
        assert_eq!(ov.allocated_clusters(), 3);
        assert!(!ov.is_allocated(3));
    }

    #[test]
    fn one_torn_header_slot_is_survived() {
        let dir = tempfile::tempdir().unwrap();
        let b = base(dir.path(), 256);
        let o = dir.path().join("ovl");
        let ov = Overlay::open(&o, &b, Create::IfMissing).unwrap();
        ov.begin_writing().unwrap(); // generation 1 in slot B
        drop(ov);
        let f = OpenOptions::new().read(true).write(true).open(&o).unwrap();
        f.write_all_at(&[0xff; 100], SLOT_LEN as u64).unwrap();
        let h = read_header(&f, &o).unwrap();
        assert_eq!(h.generation, 0);
    }
}
