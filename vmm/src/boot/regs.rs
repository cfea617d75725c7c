//! Long-mode entry state for the boot vCPU and the per-vCPU architectural set-up every vCPU
//! needs (MSRs, FPU, LAPIC LINT pins).

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};

use ember_devices::GuestMemoryMmap;

use crate::memory::ZERO_PAGE_START;

/// GDT location.
pub const BOOT_GDT_START: u64 = 0x500;
/// IDT location (an empty IDT: the kernel installs its own before enabling interrupts).
pub const BOOT_IDT_START: u64 = 0x520;
/// Top of the boot stack.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Page-map level 4.
pub const PML4_START: u64 = 0x9000;
/// Page directory pointer table.
pub const PDPTE_START: u64 = 0xa000;
/// Page directory (512 × 2 MiB pages = the first 1 GiB).
pub const PDE_START: u64 = 0xb000;

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

/// Errors configuring a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    /// A KVM vCPU ioctl failed.
    #[error("KVM {what} failed on vCPU {vcpu}: {source}")]
    Kvm {
        /// The ioctl.
        what: &'static str,
        /// The vCPU.
        vcpu: u8,
        /// Why.
        source: kvm_ioctls::Error,
    },
    /// KVM accepted fewer MSRs than given.
    #[error("KVM set {set} of {wanted} boot MSRs on vCPU {vcpu}")]
    Msrs {
        /// Set.
        set: usize,
        /// Wanted.
        wanted: usize,
        /// The vCPU.
        vcpu: u8,
    },
    /// Writing tables into guest memory failed.
    #[error("cannot write {0} into guest memory")]
    Memory(&'static str),
}

/// A GDT descriptor from access/flags bits (`flags` = access byte in bits 0-7, G/DB/L/AVL in
/// bits 12-15), base and 20-bit limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((flags as u64 & 0xf0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

/// The boot GDT: selectors 0x10 (64-bit code) and 0x18 (data) are what the Linux 64-bit boot
/// protocol names `__BOOT_CS` / `__BOOT_DS`; 0x20 is a TSS so that TR is valid.
pub const BOOT_GDT: [u64; 5] = [
    0,
    0,
    gdt_entry(0xa09b, 0, 0xfffff), // code: present, ring 0, exec/read, accessed, L=1, G=1
    gdt_entry(0xc093, 0, 0xfffff), // data: present, ring 0, read/write, accessed, D/B=1, G=1
    gdt_entry(0x808b, 0, 0xfffff), // TSS: present, busy 64-bit TSS, G=1
];

/// The KVM segment a GDT entry at `index` describes.
pub fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let flags = ((entry >> 40) & 0xf0ff) as u16;
    let limit = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
    let g = (flags >> 15) & 1;
    kvm_segment {
        base: ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000),
        limit: if g == 1 { (limit << 12) | 0xfff } else { limit },
        selector: u16::from(index) * 8,
        type_: (flags & 0xf) as u8,
        present: ((flags >> 7) & 1) as u8,
        dpl: ((flags >> 5) & 3) as u8,
        db: ((flags >> 14) & 1) as u8,
        s: ((flags >> 4) & 1) as u8,
        l: ((flags >> 13) & 1) as u8,
        g: g as u8,
        avl: ((flags >> 12) & 1) as u8,
        unusable: if (flags >> 7) & 1 == 1 { 0 } else { 1 },
        padding: 0,
    }
}

/// Writes the GDT, IDT and identity page tables into guest memory.
pub fn write_boot_tables(mem: &GuestMemoryMmap) -> Result<(), RegsError> {
    for (i, e) in BOOT_GDT.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(BOOT_GDT_START + i as u64 * 8))
            .map_err(|_| RegsError::Memory("the GDT"))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START))
        .map_err(|_| RegsError::Memory("the IDT"))?;
    mem.write_obj(PDPTE_START | 0x3, GuestAddress(PML4_START))
        .map_err(|_| RegsError::Memory("the PML4"))?;
    mem.write_obj(PDE_START | 0x3, GuestAddress(PDPTE_START))
        .map_err(|_| RegsError::Memory("the PDPT"))?;
    let mut pd = [0u8; 4096];
    for i in 0..512u64 {
        // Present, writable, 2 MiB page (PS).
        let e = (i << 21) | 0x83;
        pd[i as usize * 8..i as usize * 8 + 8].copy_from_slice(&e.to_le_bytes());
    }
    mem.write_slice(&pd, GuestAddress(PDE_START))
        .map_err(|_| RegsError::Memory("the page directory"))
}

/// Special registers for 64-bit entry, starting from what KVM reports.
pub fn long_mode_sregs(mut sregs: kvm_sregs) -> kvm_sregs {
    let code = segment_from_gdt(BOOT_GDT[2], 2);
    let data = segment_from_gdt(BOOT_GDT[3], 3);
    let tss = segment_from_gdt(BOOT_GDT[4], 4);
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&BOOT_GDT) - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    sregs.cr0 |= X86_CR0_PE | X86_CR0_ET | X86_CR0_PG;
    sregs.cr3 = PML4_START;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.efer |= EFER_LME | EFER_LMA;
    sregs
}

/// General registers for 64-bit entry at `entry`.
pub fn boot_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    }
}

/// Sets the boot vCPU's registers for the 64-bit boot protocol.
pub fn setup_boot_vcpu(vcpu: &VcpuFd, id: u8, entry: u64) -> Result<(), RegsError> {
    let kvm = |what| {
        move |source| RegsError::Kvm {
            what,
            vcpu: id,
            source,
        }
    };
    let sregs = vcpu.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
    vcpu.set_sregs(&long_mode_sregs(sregs))
        .map_err(kvm("KVM_SET_SREGS"))?;
    vcpu.set_regs(&boot_regs(entry))
        .map_err(kvm("KVM_SET_REGS"))?;
    Ok(())
}

// MSR indices.
const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MISC_ENABLE_FAST_STRING: u64 = 1;
const MTRR_ENABLE: u64 = 1 << 11;
const MTRR_TYPE_WRBACK: u64 = 6;

/// The MSRs every vCPU starts with, limited to those KVM lists (`supported`).
pub fn boot_msrs(supported: &[u32]) -> Vec<kvm_msr_entry> {
    [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE | MTRR_TYPE_WRBACK),
    ]
    .into_iter()
    .filter(|(i, _)| supported.contains(i))
    .map(|(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    })
    .collect()
}

/// FPU, MSR and LAPIC set-up every vCPU needs (boot processor or not).
pub fn setup_common(vcpu: &VcpuFd, id: u8, supported_msrs: &[u32]) -> Result<(), RegsError> {
    let kvm = |what| {
        move |source| RegsError::Kvm {
            what,
            vcpu: id,
            source,
        }
    };
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(kvm("KVM_SET_FPU"))?;

    let entries = boot_msrs(supported_msrs);
    let msrs = Msrs::from_entries(&entries).map_err(|_| RegsError::Msrs {
        set: 0,
        wanted: entries.len(),
        vcpu: id,
    })?;
    let set = vcpu.set_msrs(&msrs).map_err(kvm("KVM_SET_MSRS"))?;
    if set != entries.len() {
        return Err(RegsError::Msrs {
            set,
            wanted: entries.len(),
            vcpu: id,
        });
    }

    // LINT0 delivers the 8259's ExtINT, LINT1 NMIs (what firmware would program).
    let mut lapic = vcpu.get_lapic().map_err(kvm("KVM_GET_LAPIC"))?;
    set_lapic_reg(&mut lapic.regs, APIC_LVT0, lvt(APIC_MODE_EXTINT));
    set_lapic_reg(&mut lapic.regs, APIC_LVT1, lvt(APIC_MODE_NMI));
    vcpu.set_lapic(&lapic).map_err(kvm("KVM_SET_LAPIC"))?;
    Ok(())
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

const fn lvt(mode: u32) -> u32 {
    mode << 8
}

fn set_lapic_reg(regs: &mut [std::os::raw::c_char; 1024], offset: usize, value: u32) {
    for (i, b) in value.to_le_bytes().iter().enumerate() {
        regs[offset + i] = *b as std::os::raw::c_char;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_decode_to_the_segments_we_mean() {
        let code = segment_from_gdt(BOOT_GDT[2], 2);
        assert_eq!(
            (code.selector, code.l, code.db, code.present, code.type_),
            (0x10, 1, 0, 1, 0xb)
        );
        assert_eq!(code.limit, 0xffff_ffff);
        let data = segment_from_gdt(BOOT_GDT[3], 3);
        assert_eq!(
            (data.selector, data.db, data.s, data.type_),
            (0x18, 1, 1, 3)
        );
        let tss = segment_from_gdt(BOOT_GDT[4], 4);
        assert_eq!((tss.selector, tss.s, tss.type_), (0x20, 0, 0xb));
        // A known encoding: flat 64-bit code segment.
        assert_eq!(BOOT_GDT[2], 0x00af_9b00_0000_ffff);
    }

    #[test]
    fn long_mode_bits() {
        let s = long_mode_sregs(kvm_sregs::default());
        assert_eq!(s.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_ne!(s.cr0 & X86_CR0_PG, 0);
        assert_ne!(s.cr4 & X86_CR4_PAE, 0);
        assert_eq!(s.cr3, PML4_START);
        let r = boot_regs(0x100_0000);
        assert_eq!((r.rip, r.rsi, r.rflags), (0x100_0000, ZERO_PAGE_START, 2));
    }

    #[test]
    fn identity_map_covers_the_first_gib() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_boot_tables(&mem).unwrap();
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_START)).unwrap();
        assert_eq!(pml4 & !0xfff, PDPTE_START);
        let last: u64 = mem.read_obj(GuestAddress(PDE_START + 511 * 8)).unwrap();
        assert_eq!(last, (511 << 21) | 0x83);
    }

    #[test]
    fn msrs_are_filtered_to_supported() {
        let m = boot_msrs(&[MSR_LSTAR, MSR_IA32_MISC_ENABLE]);
        assert_eq!(m.len(), 2);
        assert!(m
            .iter()
            .any(|e| e.index == MSR_IA32_MISC_ENABLE && e.data == 1));
        assert!(boot_msrs(&[]).is_empty());
    }
}
