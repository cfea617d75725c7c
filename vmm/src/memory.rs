//! Guest physical memory: layout, allocation and the e820 map.
//!
//! ```text
//! 0x0000_0000  real-mode IVT / BDA (unused)
//! 0x0000_0500  GDT, then IDT (boot)
//! 0x0000_7000  boot_params ("zero page")
//! 0x0000_8ff0  boot stack top
//! 0x0000_9000  PML4, 0xa000 PDPT, 0xb000 PD (identity map of the first 1 GiB)
//! 0x0002_0000  kernel command line (up to 64 KiB)
//! 0x0009_fc00  EBDA: MP floating pointer + MP configuration table
//! 0x000a_0000  legacy VGA/ROM hole (reserved in e820)
//! 0x0010_0000  kernel (bzImage protected-mode part / ELF segments at their physical address)
//! ...          RAM up to min(size, MMIO_GAP_START)
//! 0xd000_0000  MMIO gap: virtio-mmio windows (4 KiB each), then IOAPIC / LAPIC at the top
//! 4 GiB        RAM above the gap, if any
//! ```

use vm_memory::GuestAddress;

use ember_devices::GuestMemoryMmap;

/// Start of the EBDA, where the MP tables live; RAM below it is usable.
pub const EBDA_START: u64 = 0x9fc00;
/// Start of high memory (the kernel loads at or above it).
pub const HIMEM_START: u64 = 0x10_0000;
/// Where the kernel command line is written.
pub const CMDLINE_START: u64 = 0x2_0000;
/// Largest command line accepted.
pub const CMDLINE_MAX_SIZE: usize = 0x1_0000;
/// Where boot_params (the zero page) is written.
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Start of the 32-bit MMIO hole.
pub const MMIO_GAP_START: u64 = 0xd000_0000;
/// End (exclusive) of the 32-bit MMIO hole.
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// First virtio-mmio window.
pub const VIRTIO_MMIO_BASE: u64 = MMIO_GAP_START;

/// Smallest guest accepted: a Linux kernel plus a userspace needs more than this anyway.
pub const MIN_MEM_MIB: u64 = 32;

/// Errors building guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// Size below the minimum.
    #[error("guest memory of {0} MiB is too small (at least {MIN_MEM_MIB} MiB)")]
    TooSmall(u64),
    /// Size above what the host can back.
    #[error("guest memory of {requested} MiB exceeds this host's {host} MiB of RAM")]
    TooLarge {
        /// Requested MiB.
        requested: u64,
        /// Host MiB.
        host: u64,
    },
    /// mmap failed.
    #[error("cannot map {mib} MiB of guest memory: {source}")]
    Map {
        /// Requested MiB.
        mib: u64,
        /// Why.
        source: vm_memory::mmap::FromRangesError,
    },
}

/// The guest-physical RAM ranges for `mem_bytes` of memory, split around the MMIO gap.
pub fn ram_ranges(mem_bytes: u64) -> Vec<(GuestAddress, usize)> {
    let low = mem_bytes.min(MMIO_GAP_START);
    let mut v = vec![(GuestAddress(0), low as usize)];
    if mem_bytes > MMIO_GAP_START {
        v.push((
            GuestAddress(MMIO_GAP_END),
            (mem_bytes - MMIO_GAP_START) as usize,
        ));
    }
    v
}

/// Total RAM on this host, in MiB.
pub fn host_ram_mib() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    (pages.max(0) as u64).saturating_mul(page.max(0) as u64) >> 20
}

/// Checks a requested size against the minimum and the host.
pub fn validate_size(mib: u64) -> Result<(), MemoryError> {
    if mib < MIN_MEM_MIB {
        return Err(MemoryError::TooSmall(mib));
    }
    let host = host_ram_mib();
    if mib > host {
        return Err(MemoryError::TooLarge {
            requested: mib,
            host,
        });
    }
    Ok(())
}

/// Anonymous, private, unreserved guest memory of `mib` MiB.
pub fn create_anonymous(mib: u64) -> Result<GuestMemoryMmap, MemoryError> {
    validate_size(mib)?;
    GuestMemoryMmap::from_ranges(&ram_ranges(mib << 20))
        .map_err(|source| MemoryError::Map { mib, source })
}

/// e820 entry type: usable RAM.
pub const E820_RAM: u32 = 1;
/// e820 entry type: reserved.
pub const E820_RESERVED: u32 = 2;

/// The e820 map for `mem_bytes` of RAM: (address, size, type).
pub fn e820_map(mem_bytes: u64) -> Vec<(u64, u64, u32)> {
    let mut v = vec![
        (0, EBDA_START, E820_RAM),
        (EBDA_START, HIMEM_START - EBDA_START, E820_RESERVED),
    ];
    let low_end = mem_bytes.min(MMIO_GAP_START);
    v.push((HIMEM_START, low_end - HIMEM_START, E820_RAM));
    if mem_bytes > MMIO_GAP_START {
        v.push((MMIO_GAP_END, mem_bytes - MMIO_GAP_START, E820_RAM));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e820_small_guest() {
        let m = e820_map(128 << 20);
        assert_eq!(
            m,
            vec![
                (0, 0x9fc00, E820_RAM),
                (0x9fc00, 0x60400, E820_RESERVED),
                (0x10_0000, (128 << 20) - 0x10_0000, E820_RAM)
            ]
        );
        // RAM entries never overlap the EBDA or the MMIO gap.
        for (a, len, t) in m {
            if t == E820_RAM {
                assert!(a + len <= EBDA_START || a >= HIMEM_START);
                assert!(a + len <= MMIO_GAP_START || a >= MMIO_GAP_END);
            }
        }
    }

    #[test]
    fn e820_and_ranges_split_around_the_gap() {
        let mem = 4u64 << 30;
        let m = e820_map(mem);
        assert_eq!(m[2], (HIMEM_START, MMIO_GAP_START - HIMEM_START, E820_RAM));
        assert_eq!(m[3], (MMIO_GAP_END, mem - MMIO_GAP_START, E820_RAM));
        let r = ram_ranges(mem);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].1 as u64 + r[1].1 as u64, mem);
        assert_eq!(r[1].0, GuestAddress(MMIO_GAP_END));
    }

    #[test]
    fn size_limits() {
        assert!(matches!(validate_size(8), Err(MemoryError::TooSmall(8))));
        assert!(matches!(
            validate_size(u64::MAX >> 21),
            Err(MemoryError::TooLarge { .. })
        ));
        assert!(validate_size(64).is_ok());
    }
}
