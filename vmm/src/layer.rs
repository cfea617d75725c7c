//! Layered snapshots: a snapshot of a restored VM that holds only the pages the VM changed,
//! over the memory file it was restored from.
//!
//! A restored VM's guest memory is its snapshot's memory file mapped `MAP_PRIVATE`: a page
//! the guest (or a device) writes becomes a private anonymous copy, every other page is still
//! the file's. So the pages that differ from the base are exactly those `/proc/self/pagemap`
//! shows present (or swapped) and *not* file-backed — found at snapshot time by reading 8
//! bytes per guest page, with nothing tracked while the guest runs (no dirty logging).
//!
//! A layered snapshot restores by mapping the base privately and then mapping each run of
//! the layer's pages over it (`MAP_FIXED | MAP_PRIVATE` from the layer's memory file at the
//! same offsets), so layer pages stay lazily loaded and shared like the base's. Those pages
//! are then file-backed by the *layer* file, which pagemap cannot tell from the base: the
//! restore remembers them ([`Origin::carried`]) and the next layered snapshot adds them to
//! what pagemap reports. Every layer is therefore relative to the same base (the template's
//! memory): a chain of pauses never grows deeper than one layer.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};

use ember_devices::GuestMemoryMmap;
use ember_snapshot::{BaseIdentity, PageSet, PAGE_SIZE};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap};

use vm_memory::bitmap::AtomicBitmap;

type Region = GuestRegionMmap<AtomicBitmap>;

/// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PM_FILE_OR_SHARED_ANON: u64 = 1 << 61;

/// Above this many runs a layer is read into memory instead of mapped run by run, to stay
/// well inside the process's mapping limit (`vm.max_map_count`, 65530 by default; each run
/// can split a mapping in three).
pub const MAX_MAPPED_RUNS: usize = 8192;

/// Errors finding written pages or laying a layer over guest memory.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// Reading /proc/self/pagemap failed.
    #[error("cannot read /proc/self/pagemap: {0}")]
    Pagemap(std::io::Error),
    /// A page set does not fit guest memory.
    #[error(transparent)]
    PageSet(#[from] ember_snapshot::PageSetError),
    /// The layer's page list does not fit guest memory.
    #[error("layer page list covers {pages} pages, guest memory has {expected}")]
    Size {
        /// Pages in the list.
        pages: u64,
        /// Pages of guest memory.
        expected: u64,
    },
    /// Mapping or reading the layer file failed.
    #[error("layer memory file {path}: cannot {op}: {source}")]
    Io {
        /// The layer file.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

/// What a restored VM's memory is relative to.
#[derive(Debug, Clone)]
pub struct Origin {
    /// The base memory file, as this process opened it.
    pub base_path: PathBuf,
    /// Its identity.
    pub base: BaseIdentity,
    /// Pages that differ from the base but are file-backed (mapped from a layer file), so
    /// pagemap does not show them as written.
    pub carried: PageSet,
}

/// Restored VMs' origins, by their first guest-memory region. The `Weak` keeps the region's
/// allocation, so its address cannot be reused by another VM's region while the entry lives.
static ORIGINS: Mutex<Vec<(Weak<Region>, Arc<Origin>)>> = Mutex::new(Vec::new());

fn origins() -> std::sync::MutexGuard<'static, Vec<(Weak<Region>, Arc<Origin>)>> {
    ORIGINS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records that the guest memory whose first region is `first` was restored over `origin`.
pub fn remember(first: &Arc<Region>, origin: Origin) {
    let mut all = origins();
    all.retain(|(w, _)| w.strong_count() > 0);
    all.push((Arc::downgrade(first), Arc::new(origin)));
}

/// What `mem` was restored over, if it was restored from a snapshot in this process.
pub fn origin_of(mem: &GuestMemoryMmap) -> Option<Arc<Origin>> {
    let first: *const Region = mem.iter().next()?;
    origins()
        .iter()
        .find(|(w, _)| std::ptr::eq(w.as_ptr(), first) && w.strong_count() > 0)
        .map(|(_, o)| o.clone())
}

/// Total guest memory in pages.
fn total_pages(mem: &GuestMemoryMmap) -> u64 {
    mem.iter().map(|r| r.len()).sum::<u64>() / PAGE_SIZE
}

/// The guest pages (memory-file page indices) that hold private copies: present and not
/// file-backed, or swapped out (a private file mapping swaps only its anonymous copies).
/// Returns the set and how many pagemap entries were read.
pub fn written_pages(mem: &GuestMemoryMmap) -> Result<(PageSet, u64), LayerError> {
    use std::os::unix::fs::FileExt;
    let mut set = PageSet::with_len_pages(total_pages(mem));
    let pagemap = File::open("/proc/self/pagemap").map_err(LayerError::Pagemap)?;
    let mut buf = vec![0u8; 8 * 8192];
    let mut file_page = 0u64;
    let mut scanned = 0u64;
    for region in mem.iter() {
        let start = region.as_ptr() as u64 / PAGE_SIZE;
        let pages = region.len() / PAGE_SIZE;
        let mut done = 0u64;
        while done < pages {
            let n = (pages - done).min(8192);
            let bytes = buf.get_mut(..(n * 8) as usize).unwrap_or_default();
            pagemap
                .read_exact_at(bytes, (start + done) * 8)
                .map_err(LayerError::Pagemap)?;
            for (i, e) in bytes.chunks_exact(8).enumerate() {
                let entry = u64::from_le_bytes(e.try_into().unwrap_or_default());
                let private = (entry & PM_PRESENT != 0 && entry & PM_FILE_OR_SHARED_ANON == 0)
                    || entry & PM_SWAPPED != 0;
                if private {
                    set.insert(file_page + done + i as u64)?;
                }
            }
            scanned += n;
            done += n;
        }
        file_page += pages;
    }
    Ok((set, scanned))
}

/// Host ranges (address, file offset, length) of `pages` in `mem`.
fn host_runs(mem: &GuestMemoryMmap, pages: &PageSet) -> Vec<(usize, u64, usize)> {
    let mut regions = Vec::new();
    let mut first = 0u64;
    for r in mem.iter() {
        let n = r.len() / PAGE_SIZE;
        regions.push((first, n, r.as_ptr() as usize));
        first += n;
    }
    let mut out = Vec::new();
    for run in pages.runs() {
        for &(rfirst, rpages, base) in &regions {
            let (a, b) = (run.start.max(rfirst), run.end.min(rfirst + rpages));
            if a < b {
                out.push((
                    base + ((a - rfirst) * PAGE_SIZE) as usize,
                    a * PAGE_SIZE,
                    ((b - a) * PAGE_SIZE) as usize,
                ));
            }
        }
    }
    out
}

/// How a layer was laid over guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overlay {
    /// Pages in the layer.
    pub pages: u64,
    /// Runs of consecutive pages.
    pub runs: usize,
    /// Whether the runs were mapped (lazily loaded) rather than read in.
    pub mapped: bool,
}

/// Lays the layer's `pages` from `layer` (a memory file of the full size, same offsets) over
/// `mem`. Call before the memory is registered with KVM and before any vCPU runs.
pub fn overlay(
    mem: &GuestMemoryMmap,
    layer: &File,
    path: &std::path::Path,
    pages: &PageSet,
) -> Result<Overlay, LayerError> {
    if pages.len_pages() != total_pages(mem) {
        return Err(LayerError::Size {
            pages: pages.len_pages(),
            expected: total_pages(mem),
        });
    }
    let io = |op: &'static str| {
        let path = path.to_path_buf();
        move |source| LayerError::Io { path, op, source }
    };
    let runs = host_runs(mem, pages);
    let mapped = runs.len() <= MAX_MAPPED_RUNS;
    for &(addr, off, len) in &runs {
        if mapped {
            let off = libc::off_t::try_from(off)
                .map_err(|_| io("map a run")(std::io::Error::from_raw_os_error(libc::EOVERFLOW)))?;
            // SAFETY: [addr, addr + len) lies inside one live private mapping of guest memory
            // owned by `mem` (computed from its regions), which no vCPU or device uses yet; the
            // new mapping replaces those pages with the same protection and stays inside the
            // region, which unmaps it with the rest on drop. `layer` is open for reading.
            let p = unsafe {
                libc::mmap(
                    addr as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    layer.as_raw_fd(),
                    off,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io("map a run")(std::io::Error::last_os_error()));
            }
        } else {
            use std::os::unix::fs::FileExt;
            // SAFETY: as above, the range is inside a live guest-memory mapping owned by
            // `mem` that nothing else accesses yet; the slice does not outlive this call.
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            layer.read_exact_at(dst, off).map_err(io("read a run"))?;
        }
    }
    Ok(Overlay {
        pages: pages.count(),
        runs: runs.len(),
        mapped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroUsize;
    use vm_memory::mmap::MmapRegionBuilder;
    use vm_memory::{Bytes, FileOffset, GuestAddress};

    /// `len` bytes of `file` mapped privately as guest memory at 0.
    fn map_private(file: &File, len: usize) -> (GuestMemoryMmap, Arc<Region>) {
        let mapping = MmapRegionBuilder::new_with_bitmap(
            len,
            AtomicBitmap::new(len, NonZeroUsize::MIN.saturating_add(4095)),
        )
        .with_file_offset(FileOffset::new(file.try_clone().unwrap(), 0))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
        .build()
        .unwrap();
        let region = Arc::new(GuestRegionMmap::new(mapping, GuestAddress(0)).unwrap());
        (
            GuestMemoryMmap::from_arc_regions(vec![region.clone()]).unwrap(),
            region,
        )
    }

    #[test]
    fn written_pages_are_the_private_copies_only() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("memory");
        std::fs::write(&base, vec![7u8; 64 * 4096]).unwrap();
        let f = File::open(&base).unwrap();
        let (mem, _) = map_private(&f, 64 * 4096);
        // Reads map file pages: not written.
        for p in 0..64u64 {
            let _: u8 = mem.read_obj(GuestAddress(p * 4096)).unwrap();
        }
        mem.write_obj(1u8, GuestAddress(3 * 4096)).unwrap();
        mem.write_obj(1u8, GuestAddress(40 * 4096 + 9)).unwrap();
        let (set, scanned) = written_pages(&mem).unwrap();
        assert_eq!(scanned, 64);
        assert_eq!(set.iter().collect::<Vec<_>>(), [3, 40]);
        // The base file is unchanged.
        assert_eq!(std::fs::read(&base).unwrap(), vec![7u8; 64 * 4096]);
    }

    #[test]
    fn overlay_maps_or_reads_the_layer_pages_over_the_base() {
        let dir = tempfile::tempdir().unwrap();
        let n = 64usize;
        let base = dir.path().join("memory");
        std::fs::write(&base, vec![7u8; n * 4096]).unwrap();
        let lpath = dir.path().join("layer");
        let mut layer_bytes = vec![0u8; n * 4096];
        let mut pages = PageSet::with_len_pages(n as u64);
        for p in [0usize, 1, 2, 10, 63] {
            layer_bytes[p * 4096..(p + 1) * 4096].fill(p as u8 + 100);
            pages.insert(p as u64).unwrap();
        }
        // A layer page that is zero (a hole in the layer file) must read as zero.
        layer_bytes[20 * 4096..21 * 4096].fill(0);
        pages.insert(20).unwrap();
        std::fs::write(&lpath, &layer_bytes).unwrap();
        let lf = File::open(&lpath).unwrap();
        for mapped in [true, false] {
            let f = File::open(&base).unwrap();
            let (mem, region) = map_private(&f, n * 4096);
            let o = if mapped {
                overlay(&mem, &lf, &lpath, &pages).unwrap()
            } else {
                // Force the read-in path by asking for the runs directly.
                let runs = host_runs(&mem, &pages);
                for &(addr, off, len) in &runs {
                    use std::os::unix::fs::FileExt;
                    // SAFETY: test: the range is inside `mem`'s live mapping.
                    let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
                    lf.read_exact_at(dst, off).unwrap();
                }
                Overlay {
                    pages: pages.count(),
                    runs: runs.len(),
                    mapped: false,
                }
            };
            assert_eq!((o.pages, o.runs), (6, 4));
            for p in 0..n as u64 {
                let want = if pages.contains(p) {
                    layer_bytes[p as usize * 4096]
                } else {
                    7
                };
                let got: u8 = mem.read_obj(GuestAddress(p * 4096 + 17)).unwrap();
                assert_eq!(got, want, "page {p} mapped={mapped}");
            }
            // Writes stay private: neither file changes.
            mem.write_obj(9u8, GuestAddress(4096)).unwrap();
            let (w, _) = written_pages(&mem).unwrap();
            assert!(w.contains(1));
            remember(
                &region,
                Origin {
                    base_path: base.clone(),
                    base: BaseIdentity::of(&f).unwrap(),
                    carried: pages.clone(),
                },
            );
            assert_eq!(origin_of(&mem).unwrap().carried, pages);
        }
        assert_eq!(std::fs::read(&lpath).unwrap(), layer_bytes);
        assert_eq!(std::fs::read(&base).unwrap(), vec![7u8; n * 4096]);
        // A VM that was never restored has no origin.
        let anon = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        assert!(origin_of(&anon).is_none());
        // A page list of the wrong size is refused.
        let (mem, _) = map_private(&File::open(&base).unwrap(), n * 4096);
        let e = overlay(&mem, &lf, &lpath, &PageSet::with_len_pages(3)).unwrap_err();
        assert!(matches!(e, LayerError::Size { .. }), "{e}");
    }
}
