//! Working-set prefetch for restores.
//!
//! Every guest page a restored VM touches first costs a host page fault (and on kvm_pvm a
//! shadow-MMU fault as well). A template's clones all touch nearly the same pages right after
//! restore, so ember records that set once — the pages present in the restored VMM's page
//! tables after the template has served its first request (read from `/proc/self/pagemap`) —
//! stores it next to the snapshot as `workingset`, and on later restores maps those pages in
//! with `MADV_POPULATE_READ` before (`sync`) or while (`async`) the vCPU starts. Populating for
//! read keeps the pages shared with the page cache: a guest write still copies on write, so
//! clones keep sharing what they do not change.
//!
//! Measured on the kvm_pvm development host (Linux guest, 128 MiB, memory file in the page
//! cache, 50 restores each, spawn → agent ping): off 78.8 ms median, sync 82.1 ms. The cost
//! after a restore there is the guest's own work and KVM's shadow-MMU faults, which host-side
//! population cannot avoid, so prefetch is off by default; it is meant for memory files that
//! are not in the page cache (cold hosts, network storage).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use ember_snapshot::PageSet;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use ember_devices::GuestMemoryMmap;

/// Name of the working-set file inside a snapshot directory.
pub const WORKING_SET_FILE: &str = "workingset";
const PAGE: u64 = 4096;
const PAGEMAP_PRESENT: u64 = 1 << 63;

/// How a restore uses a recorded working set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Prefetch {
    /// Ignore it.
    #[default]
    Off,
    /// Populate before the vCPUs start.
    Sync,
    /// Populate on a helper thread while the vCPUs start.
    Async,
}

impl std::str::FromStr for Prefetch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "sync" => Ok(Self::Sync),
            "async" => Ok(Self::Async),
            o => Err(format!("prefetch mode {o:?}: expected off, sync or async")),
        }
    }
}

/// Errors recording or applying a working set.
#[derive(Debug, thiserror::Error)]
pub enum WorkingSetError {
    /// Reading /proc/self/pagemap failed.
    #[error("cannot read /proc/self/pagemap: {0}")]
    Pagemap(std::io::Error),
    /// The page set.
    #[error(transparent)]
    PageSet(#[from] ember_snapshot::PageSetError),
    /// The file.
    #[error(transparent)]
    State(#[from] ember_snapshot::StateError),
}

/// The guest pages (as memory-file page indices) present in this process's page tables.
pub fn record(mem: &GuestMemoryMmap) -> Result<PageSet, WorkingSetError> {
    let total: u64 = mem.iter().map(|r| r.len()).sum();
    let mut set = PageSet::new(total);
    let mut pagemap = File::open("/proc/self/pagemap").map_err(WorkingSetError::Pagemap)?;
    let mut file_page = 0u64;
    let mut buf = vec![0u8; 8 * 4096];
    for region in mem.iter() {
        let start = region.as_ptr() as u64 / PAGE;
        let pages = region.len() / PAGE;
        let mut done = 0u64;
        while done < pages {
            let n = (pages - done).min(4096);
            pagemap
                .seek(SeekFrom::Start((start + done) * 8))
                .map_err(WorkingSetError::Pagemap)?;
            let bytes = &mut buf[..(n * 8) as usize];
            pagemap
                .read_exact(bytes)
                .map_err(WorkingSetError::Pagemap)?;
            for (i, e) in bytes.chunks_exact(8).enumerate() {
                let entry = u64::from_le_bytes(e.try_into().unwrap_or_default());
                if entry & PAGEMAP_PRESENT != 0 {
                    set.insert(file_page + done + i as u64)?;
                }
            }
            done += n;
        }
        file_page += pages;
    }
    Ok(set)
}

/// Stores a working set in a snapshot directory.
pub fn save(dir: &Path, set: &PageSet) -> Result<(), WorkingSetError> {
    ember_snapshot::write_state(dir.join(WORKING_SET_FILE), set)?;
    Ok(())
}

/// Loads a snapshot's working set, if it has one.
pub fn load(dir: &Path) -> Result<Option<PageSet>, WorkingSetError> {
    let p = dir.join(WORKING_SET_FILE);
    if !p.exists() {
        return Ok(None);
    }
    Ok(Some(ember_snapshot::read_state(p)?))
}

/// Host addresses of the runs of `set` in `mem`, as (address, length) pairs.
pub fn ranges(mem: &GuestMemoryMmap, set: &PageSet) -> Vec<(usize, usize)> {
    let mut regions = Vec::new();
    let mut first = 0u64;
    for r in mem.iter() {
        let pages = r.len() / PAGE;
        regions.push((first, pages, r.as_ptr() as usize));
        first += pages;
    }
    let mut out = Vec::new();
    for run in set.runs() {
        let (mut s, e) = (run.start, run.end);
        for &(rfirst, rpages, base) in &regions {
            let rend = rfirst + rpages;
            if s >= rend || e <= rfirst {
                continue;
            }
            let a = s.max(rfirst);
            let b = e.min(rend);
            out.push((
                base + ((a - rfirst) * PAGE) as usize,
                ((b - a) * PAGE) as usize,
            ));
            s = b;
        }
    }
    out
}

/// Maps the given ranges in for reading. Returns how many bytes were requested.
pub fn populate(ranges: &[(usize, usize)]) -> u64 {
    let mut total = 0;
    for &(addr, len) in ranges {
        // SAFETY: each range lies inside a live guest-memory mapping of this process (built by
        // `ranges` from the mapping itself, which outlives this call); MADV_POPULATE_READ only
        // faults pages in and never changes their contents.
        let rc = unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_POPULATE_READ) };
        if rc != 0 {
            // Older kernels lack MADV_POPULATE_READ: fall back to read-ahead of the file.
            // SAFETY: as above; MADV_WILLNEED is advisory.
            unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_WILLNEED) };
        }
        total += len as u64;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn records_touched_pages_and_maps_runs_to_host_ranges() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        mem.write_obj(1u8, GuestAddress(3 * PAGE)).unwrap();
        mem.write_obj(1u8, GuestAddress(4 * PAGE + 5)).unwrap();
        mem.write_obj(1u8, GuestAddress(200 * PAGE)).unwrap();
        let set = record(&mem).unwrap();
        assert!(set.contains(3) && set.contains(4) && set.contains(200));
        assert!(
            !set.contains(100),
            "untouched anonymous pages are not present"
        );
        let r = ranges(&mem, &set);
        let base = mem.iter().next().unwrap().as_ptr() as usize;
        assert!(
            r.contains(&(base + 3 * PAGE as usize, 2 * PAGE as usize)),
            "{r:?}"
        );
        assert_eq!(populate(&r), r.iter().map(|x| x.1 as u64).sum::<u64>());
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &set).unwrap();
        assert_eq!(load(dir.path()).unwrap().unwrap().count(), set.count());
        assert!(load(&dir.path().join("none")).unwrap().is_none());
    }
}
