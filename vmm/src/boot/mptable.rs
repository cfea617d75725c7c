//! The Intel MultiProcessor Specification (v1.4) tables that tell a guest without ACPI how many
//! CPUs it has and how the I/O APIC is wired. Written into the EBDA, where Linux scans for the
//! floating pointer structure.

use vm_memory::{Bytes, GuestAddress};

use ember_devices::GuestMemoryMmap;

use crate::memory::EBDA_START;

/// Local APIC base address (architectural default).
pub const APIC_DEFAULT_PHYS_BASE: u32 = 0xfee0_0000;
/// I/O APIC base address (architectural default).
pub const IO_APIC_DEFAULT_PHYS_BASE: u32 = 0xfec0_0000;
/// Number of I/O APIC pins KVM's in-kernel IOAPIC has.
pub const IOAPIC_PINS: u8 = 24;
/// Most vCPUs ember gives a guest: the MP tables must fit in the 1 KiB EBDA (0x9fc00-0xa0000)
/// where they are written, which holds 37 processor entries; 32 keeps a round margin.
pub const MAX_VCPUS: u8 = 32;
/// Bytes available for the tables in the EBDA.
const EBDA_LEN: usize = 0xa0000 - EBDA_START as usize;

const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTPROCESSOR: u8 = 2;
const CPU_STEPPING: u32 = 0x600;
const CPU_FEATURE_APIC: u32 = 1 << 9;
const CPU_FEATURE_FPU: u32 = 1;

const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;

/// Errors writing MP tables.
#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    /// Too many vCPUs for an MP table.
    #[error("{0} vCPUs do not fit in an MP table (at most {MAX_VCPUS})")]
    TooManyCpus(u8),
    /// Zero vCPUs.
    #[error("an MP table needs at least one vCPU")]
    NoCpus,
    /// Guest memory write failed.
    #[error("cannot write the MP table into guest memory: {0}")]
    Write(String),
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |a, b| a.wrapping_add(*b))
        .wrapping_neg()
}

/// Builds the floating pointer and configuration table for `num_cpus` CPUs, as they are laid
/// out at `base` (the floating pointer first, the table right after it).
pub fn build(base: u64, num_cpus: u8) -> Result<Vec<u8>, MptableError> {
    if num_cpus == 0 {
        return Err(MptableError::NoCpus);
    }
    if num_cpus > MAX_VCPUS {
        return Err(MptableError::TooManyCpus(num_cpus));
    }
    let table_addr = base + 16;
    let ioapic_id = num_cpus;

    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..num_cpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BOOTPROCESSOR } else { 0 };
        entries.extend_from_slice(&[ENTRY_PROCESSOR, cpu, APIC_VERSION, flags]);
        entries.extend_from_slice(&CPU_STEPPING.to_le_bytes());
        entries.extend_from_slice(&(CPU_FEATURE_APIC | CPU_FEATURE_FPU).to_le_bytes());
        entries.extend_from_slice(&[0u8; 8]);
        count += 1;
    }
    entries.extend_from_slice(&[ENTRY_BUS, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    entries.extend_from_slice(&[ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&IO_APIC_DEFAULT_PHYS_BASE.to_le_bytes());
    count += 1;
    for irq in 0..IOAPIC_PINS {
        // ISA IRQ n on bus 0 goes to IOAPIC pin n, polarity/trigger as the bus defines.
        entries.extend_from_slice(&[
            ENTRY_IO_INTERRUPT,
            INT_TYPE_INT,
            0,
            0,
            0,
            irq,
            ioapic_id,
            irq,
        ]);
        count += 1;
    }
    // LINT0 is the 8259's ExtINT, LINT1 NMI, on every local APIC (0xff).
    entries.extend_from_slice(&[ENTRY_LOCAL_INTERRUPT, INT_TYPE_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[ENTRY_LOCAL_INTERRUPT, INT_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let table_len = 44 + entries.len();
    let mut table = Vec::with_capacity(table_len);
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&(table_len as u16).to_le_bytes());
    table.push(4); // spec revision 1.4
    table.push(0); // checksum, below
    table.extend_from_slice(b"EMBER   "); // OEM id
    table.extend_from_slice(b"MICROVM     "); // product id
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&APIC_DEFAULT_PHYS_BASE.to_le_bytes());
    table.extend_from_slice(&[0, 0, 0, 0]); // extended table length, checksum, reserved
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut fp = Vec::with_capacity(16);
    fp.extend_from_slice(b"_MP_");
    fp.extend_from_slice(&(table_addr as u32).to_le_bytes());
    fp.push(1); // length in 16-byte units
    fp.push(4); // spec revision
    fp.push(0); // checksum, below
    fp.extend_from_slice(&[0u8; 5]); // feature bytes: a configuration table is present
    fp[10] = checksum(&fp);

    fp.extend_from_slice(&table);
    debug_assert!(
        fp.len() <= EBDA_LEN,
        "MAX_VCPUS keeps the tables inside the EBDA"
    );
    Ok(fp)
}

/// Writes the MP tables for `num_cpus` CPUs at the start of the EBDA.
pub fn setup(mem: &GuestMemoryMmap, num_cpus: u8) -> Result<(), MptableError> {
    let bytes = build(EBDA_START, num_cpus)?;
    mem.write_slice(&bytes, GuestAddress(EBDA_START))
        .map_err(|e| MptableError::Write(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    #[test]
    fn checksums_and_counts() {
        for cpus in [1u8, 2, 8, MAX_VCPUS] {
            assert!(build(EBDA_START, cpus).unwrap().len() <= EBDA_LEN);
            let b = build(EBDA_START, cpus).unwrap();
            assert_eq!(&b[..4], b"_MP_");
            assert_eq!(sum(&b[..16]), 0, "floating pointer checksum");
            let table = &b[16..];
            assert_eq!(&table[..4], b"PCMP");
            let len = u16::from_le_bytes([table[4], table[5]]) as usize;
            assert_eq!(len, table.len());
            assert_eq!(sum(table), 0, "table checksum");
            let count = u16::from_le_bytes([table[34], table[35]]);
            assert_eq!(count, u16::from(cpus) + 2 + u16::from(IOAPIC_PINS) + 2);
            // Pointer points right after itself.
            let ptr = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as u64;
            assert_eq!(ptr, EBDA_START + 16);
            // Fits below the VGA hole.
            assert!(EBDA_START + b.len() as u64 <= 0xa0000);
        }
    }

    #[test]
    fn processor_entries_mark_only_cpu0_as_boot_processor() {
        let b = build(EBDA_START, 4).unwrap();
        let entries = &b[16 + 44..];
        for cpu in 0..4usize {
            let e = &entries[cpu * 20..cpu * 20 + 20];
            assert_eq!(e[0], ENTRY_PROCESSOR);
            assert_eq!(e[1] as usize, cpu);
            assert_eq!(e[3] & CPU_BOOTPROCESSOR != 0, cpu == 0);
            assert_ne!(e[3] & CPU_ENABLED, 0);
        }
    }

    #[test]
    fn cpu_count_limits() {
        assert!(matches!(build(EBDA_START, 0), Err(MptableError::NoCpus)));
        assert!(matches!(
            build(EBDA_START, MAX_VCPUS + 1),
            Err(MptableError::TooManyCpus(_))
        ));
    }
}
