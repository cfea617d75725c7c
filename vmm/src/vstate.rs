//! KVM state of vCPUs and of the VM (interrupt controllers, PIT, clock), saved into and
//! restored from snapshots.
//!
//! Restore order follows what KVM needs: CPUID first (it decides which MSRs and XSAVE
//! components exist), then MP state, regs, sregs, XSAVE (or FPU), XCRs, debug registers,
//! LAPIC, MSRs with the TSC before the TSC deadline, and vCPU events last (pending exceptions and
//! NMIs refer to the state set before them). VM state (irqchip, PIT, clock) is restored before
//! any vCPU is created.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
    CpuId, Msrs, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::{VcpuFd, VmFd};

/// `IA32_TSC`: restored before the TSC deadline so the deadline is not taken as already past.
pub const MSR_IA32_TSC: u32 = 0x10;
/// `IA32_TSC_DEADLINE`.
pub const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;
/// Most entries KVM_GET_MSRS / KVM_SET_MSRS take at once (`KVM_MAX_MSR_ENTRIES`).
const MSR_CHUNK: usize = 255;

/// Errors saving or restoring KVM state.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// An ioctl failed.
    #[error("KVM {what} failed{on}: {source}", on = .vcpu.map(|v| format!(" on vCPU {v}")).unwrap_or_default())]
    Kvm {
        /// The ioctl.
        what: &'static str,
        /// The vCPU, if any.
        vcpu: Option<u8>,
        /// Why.
        source: kvm_ioctls::Error,
    },
    /// Some MSRs were refused.
    #[error("KVM refused MSR {index:#x} on vCPU {vcpu} (set {set} of {total})")]
    MsrRefused {
        /// The first refused MSR.
        index: u32,
        /// The vCPU.
        vcpu: u8,
        /// How many were set.
        set: usize,
        /// How many were given.
        total: usize,
    },
    /// Building a KVM array failed (too many entries).
    #[error("{0} entries do not fit a KVM array")]
    TooMany(usize),
}

/// Everything KVM holds about one vCPU.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct VcpuState {
    /// vCPU index.
    pub id: u8,
    /// The CPUID table the vCPU ran with.
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// Multiprocessing state (running, halted, waiting for SIPI).
    pub mp_state: kvm_mp_state,
    /// General registers.
    pub regs: kvm_regs,
    /// Special registers.
    pub sregs: kvm_sregs,
    /// XSAVE area (FPU, SSE and whatever extended state the CPUID exposes).
    pub xsave: kvm_xsave,
    /// Extended control registers, when the host has KVM_CAP_XCRS.
    pub xcrs: Option<kvm_xcrs>,
    /// Debug registers.
    pub debug_regs: kvm_debugregs,
    /// Local APIC.
    pub lapic: kvm_lapic_state,
    /// MSRs, TSC first.
    pub msrs: Vec<kvm_msr_entry>,
    /// Pending exceptions, interrupts, NMIs, SMIs.
    pub events: kvm_vcpu_events,
}

/// Capabilities that decide which optional state is saved.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct StateCaps {
    /// KVM_CAP_XCRS.
    pub xcrs: bool,
}

impl StateCaps {
    /// Reads the capabilities from a VM.
    pub fn probe(vm: &VmFd) -> Self {
        Self {
            xcrs: vm.check_extension(kvm_ioctls::Cap::Xcrs),
        }
    }
}

/// Orders MSR indices so that the TSC comes first (and the deadline after it).
pub fn order_msrs(mut indices: Vec<u32>) -> Vec<u32> {
    indices.sort_by_key(|&i| match i {
        MSR_IA32_TSC => 0,
        MSR_IA32_TSC_DEADLINE => 2,
        _ => 1,
    });
    indices
}

/// Reads every MSR in `indices` that KVM lets us read (unreadable ones are skipped).
pub fn read_msrs(fd: &VcpuFd, id: u8, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, StateError> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(MSR_CHUNK)];
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs =
            Msrs::from_entries(&entries).map_err(|_| StateError::TooMany(entries.len()))?;
        let n = fd.get_msrs(&mut msrs).map_err(|source| StateError::Kvm {
            what: "KVM_GET_MSRS",
            vcpu: Some(id),
            source,
        })?;
        out.extend_from_slice(&msrs.as_slice()[..n]);
        // KVM stops at the first MSR it cannot read: skip that one and go on.
        let consumed = if n < chunk.len() { n + 1 } else { n };
        rest = &rest[consumed..];
    }
    Ok(out)
}

/// Captures a vCPU's state. Call on a vCPU that is not running (after a `KVM_RUN` with
/// `immediate_exit` has completed any pending I/O).
pub fn save_vcpu(
    fd: &VcpuFd,
    id: u8,
    cpuid: &CpuId,
    msr_indices: &[u32],
    caps: StateCaps,
) -> Result<VcpuState, StateError> {
    let kvm = |what| {
        move |source| StateError::Kvm {
            what,
            vcpu: Some(id),
            source,
        }
    };
    Ok(VcpuState {
        id,
        cpuid: cpuid.as_slice().to_vec(),
        mp_state: fd.get_mp_state().map_err(kvm("KVM_GET_MP_STATE"))?,
        regs: fd.get_regs().map_err(kvm("KVM_GET_REGS"))?,
        sregs: fd.get_sregs().map_err(kvm("KVM_GET_SREGS"))?,
        xsave: fd.get_xsave().map_err(kvm("KVM_GET_XSAVE"))?,
        xcrs: if caps.xcrs {
            Some(fd.get_xcrs().map_err(kvm("KVM_GET_XCRS"))?)
        } else {
            None
        },
        debug_regs: fd.get_debug_regs().map_err(kvm("KVM_GET_DEBUGREGS"))?,
        lapic: fd.get_lapic().map_err(kvm("KVM_GET_LAPIC"))?,
        msrs: read_msrs(fd, id, msr_indices)?,
        events: fd.get_vcpu_events().map_err(kvm("KVM_GET_VCPU_EVENTS"))?,
    })
}

/// Restores a vCPU's state in the order KVM requires.
pub fn restore_vcpu(fd: &VcpuFd, s: &VcpuState) -> Result<(), StateError> {
    let id = s.id;
    let kvm = |what| {
        move |source| StateError::Kvm {
            what,
            vcpu: Some(id),
            source,
        }
    };
    let cpuid = CpuId::from_entries(&s.cpuid).map_err(|_| StateError::TooMany(s.cpuid.len()))?;
    fd.set_cpuid2(&cpuid).map_err(kvm("KVM_SET_CPUID2"))?;
    fd.set_mp_state(s.mp_state)
        .map_err(kvm("KVM_SET_MP_STATE"))?;
    fd.set_regs(&s.regs).map_err(kvm("KVM_SET_REGS"))?;
    fd.set_sregs(&s.sregs).map_err(kvm("KVM_SET_SREGS"))?;
    // SAFETY: `kvm_xsave` is the fixed 4 KiB legacy XSAVE buffer, fully owned by `s`; KVM
    // copies exactly that size and validates the XSAVE header itself, failing the ioctl on a
    // bad one. (The unsafety of `set_xsave` is about larger KVM_GET_XSAVE2 buffers.)
    unsafe { fd.set_xsave(&s.xsave) }.map_err(kvm("KVM_SET_XSAVE"))?;
    if let Some(x) = &s.xcrs {
        fd.set_xcrs(x).map_err(kvm("KVM_SET_XCRS"))?;
    }
    fd.set_debug_regs(&s.debug_regs)
        .map_err(kvm("KVM_SET_DEBUGREGS"))?;
    fd.set_lapic(&s.lapic).map_err(kvm("KVM_SET_LAPIC"))?;
    let mut entries = s.msrs.clone();
    let order: Vec<u32> = order_msrs(entries.iter().map(|e| e.index).collect());
    entries.sort_by_key(|e| order.iter().position(|&i| i == e.index));
    for chunk in entries.chunks(MSR_CHUNK) {
        let msrs = Msrs::from_entries(chunk).map_err(|_| StateError::TooMany(chunk.len()))?;
        let n = fd.set_msrs(&msrs).map_err(kvm("KVM_SET_MSRS"))?;
        if n != chunk.len() {
            return Err(StateError::MsrRefused {
                index: chunk[n].index,
                vcpu: id,
                set: n,
                total: chunk.len(),
            });
        }
    }
    fd.set_vcpu_events(&s.events)
        .map_err(kvm("KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}

/// The VM-wide KVM state.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct KvmVmState {
    /// PIC (master), PIC (slave), IOAPIC.
    pub irqchips: Vec<kvm_irqchip>,
    /// The PIT.
    pub pit: kvm_pit_state2,
    /// kvmclock.
    pub clock: kvm_clock_data,
}

/// Captures the VM-wide state.
pub fn save_vm(vm: &VmFd) -> Result<KvmVmState, StateError> {
    let kvm = |what| {
        move |source| StateError::Kvm {
            what,
            vcpu: None,
            source,
        }
    };
    let mut irqchips = Vec::with_capacity(3);
    for chip_id in [
        KVM_IRQCHIP_PIC_MASTER,
        KVM_IRQCHIP_PIC_SLAVE,
        KVM_IRQCHIP_IOAPIC,
    ] {
        let mut c = kvm_irqchip {
            chip_id,
            ..Default::default()
        };
        vm.get_irqchip(&mut c).map_err(kvm("KVM_GET_IRQCHIP"))?;
        irqchips.push(c);
    }
    let mut clock = vm.get_clock().map_err(kvm("KVM_GET_CLOCK"))?;
    // Only the clock value is restored; the flags describe this host's clock source.
    clock.flags = 0;
    Ok(KvmVmState {
        irqchips,
        pit: vm.get_pit2().map_err(kvm("KVM_GET_PIT2"))?,
        clock,
    })
}

/// Restores the VM-wide state (after the irqchip and PIT exist, before vCPUs run).
pub fn restore_vm(vm: &VmFd, s: &KvmVmState) -> Result<(), StateError> {
    let kvm = |what| {
        move |source| StateError::Kvm {
            what,
            vcpu: None,
            source,
        }
    };
    for c in &s.irqchips {
        vm.set_irqchip(c).map_err(kvm("KVM_SET_IRQCHIP"))?;
    }
    vm.set_pit2(&s.pit).map_err(kvm("KVM_SET_PIT2"))?;
    vm.set_clock(&s.clock).map_err(kvm("KVM_SET_CLOCK"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tsc_goes_first_and_the_deadline_after_it() {
        let o = order_msrs(vec![
            MSR_IA32_TSC_DEADLINE,
            0xc000_0082,
            MSR_IA32_TSC,
            0x174,
        ]);
        assert_eq!(o[0], MSR_IA32_TSC);
        assert_eq!(*o.last().unwrap(), MSR_IA32_TSC_DEADLINE);
    }
}
