//! CPU profiles: what the guest is told about the CPU.
//!
//! A profile edits the CPUID table KVM offers (`KVM_GET_SUPPORTED_CPUID`) before it is given to
//! each vCPU, and may add kernel command-line masks. The masks exist for kvm_pvm: that host
//! overrides leaf 1 ECX (except a few bits) and leaves 7.0 and 0xD with its own values, so
//! features there can only be hidden from a Linux guest with `noxsave` / `clearcpuid=`.
//!
//! | feature | CPUID bit | instruction that failed on kvm_pvm | mask |
//! |---|---|---|---|
//! | XSAVE | 1:ECX[26] | `xrstor` in `fpu__init_system_xstate` | `noxsave` |
//! | POPCNT | 1:ECX[23] | `popcnt` (alternatives-patched `__sw_hweight64`) | `clearcpuid=151` |
//! | SMAP | 7.0:EBX[20] | `clac` in interrupt entry | `clearcpuid=308` |
//! | ERMS | 7.0:EBX[9] | `rep movsb/stosb` emulated per byte (speed) | `clearcpuid=297` |
//! | FSRM | 7.0:EDX[4] | `rep movsb` (speed) | `clearcpuid=580` |
//! | CX16 | 1:ECX[13] | `lock cmpxchg16b` in SLUB's `___slab_alloc` | CPUID (this bit follows the VMM), and `clearcpuid=141` so a peer VMM given the same command line is covered |
//!
//! Every profile hides the KVM paravirtual features whose guest side issues hypercalls
//! (`vmcall`/`vmmcall` spin forever on kvm_pvm): PV_UNHALT, PV_SEND_IPI, PV_SCHED_YIELD,
//! HC_MAP_GPA_RANGE and friends. The clock features (kvm-clock) stay.

use std::fmt;
use std::str::FromStr;

use kvm_bindings::{kvm_cpuid_entry2, CpuId};

/// Which CPU model the guest sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpuProfile {
    /// Everything KVM supports, minus hypercall-using PV features.
    Host,
    /// For kvm_pvm hosts: `host` plus hiding what the emulated ring 0 cannot run.
    Pvm,
    /// A conservative x86-64-v2-like feature set, for snapshots that must move between hosts.
    Baseline,
}

impl fmt::Display for CpuProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CpuProfile::Host => "host",
            CpuProfile::Pvm => "pvm",
            CpuProfile::Baseline => "baseline",
        })
    }
}

impl FromStr for CpuProfile {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "host" => Ok(Self::Host),
            "pvm" => Ok(Self::Pvm),
            "baseline" => Ok(Self::Baseline),
            other => Err(format!(
                "unknown CPU profile {other:?} (expected host, pvm or baseline)"
            )),
        }
    }
}

/// What kind of KVM this host has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostKvm {
    /// kvm_pvm: page-table-based KVM without hardware virtualization.
    Pvm,
    /// kvm_intel / kvm_amd (or anything else).
    Hardware,
}

impl HostKvm {
    /// Detects the KVM flavour behind /dev/kvm. kvm_intel and kvm_amd need VMX or SVM, so a
    /// CPU with neither (read with the CPUID instruction, which works inside a jail without
    /// /sys or /proc) means a page-table-based KVM; the loaded module list confirms it where
    /// /sys is visible.
    pub fn detect() -> Self {
        if std::path::Path::new("/sys/module/kvm_pvm").exists() || !host_has_hw_virt() {
            HostKvm::Pvm
        } else {
            HostKvm::Hardware
        }
    }

    /// The profile ember uses on this host unless told otherwise.
    pub fn default_profile(self) -> CpuProfile {
        match self {
            HostKvm::Pvm => CpuProfile::Pvm,
            HostKvm::Hardware => CpuProfile::Host,
        }
    }
}

/// Whether this CPU offers VMX (Intel, CPUID.1:ECX[5]) or SVM (AMD, CPUID.80000001h:ECX[2]).
pub fn host_has_hw_virt() -> bool {
    use std::arch::x86_64::__cpuid;
    // CPUID exists on every x86-64 CPU; leaf 0x80000000 reports the highest extended leaf.
    let vmx = __cpuid(1).ecx & (1 << 5) != 0;
    let max_ext = __cpuid(0x8000_0000).eax;
    let svm = max_ext >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 2) != 0;
    vmx || svm
}

// Leaf 1 ECX.
const ECX_FMA: u32 = 1 << 12;
const ECX_CX16: u32 = 1 << 13;
const ECX_PCID: u32 = 1 << 17;
const ECX_POPCNT: u32 = 1 << 23;
const ECX_TSC_DEADLINE: u32 = 1 << 24;
const ECX_XSAVE: u32 = 1 << 26;
const ECX_OSXSAVE: u32 = 1 << 27;
const ECX_AVX: u32 = 1 << 28;
const ECX_F16C: u32 = 1 << 29;
const ECX_HYPERVISOR: u32 = 1 << 31;
// Leaf 1 EDX.
const EDX_HTT: u32 = 1 << 28;
// Leaf 7.0.
const EBX7_AVX2: u32 = 1 << 5;
const EBX7_ERMS: u32 = 1 << 9;
const EBX7_AVX512F: u32 = 1 << 16;
const EBX7_SMAP: u32 = 1 << 20;
const EDX7_FSRM: u32 = 1 << 4;
// KVM feature leaf 0x4000_0001 EAX: the bits ember keeps (no hypercalls behind them).
const KVM_FEATURE_CLOCKSOURCE: u32 = 1 << 0;
const KVM_FEATURE_NOP_IO_DELAY: u32 = 1 << 1;
const KVM_FEATURE_CLOCKSOURCE2: u32 = 1 << 3;
const KVM_FEATURE_CLOCKSOURCE_STABLE_BIT: u32 = 1 << 24;
/// PV features that are safe everywhere: clock sources and "no I/O delay".
pub const KVM_FEATURES_KEPT: u32 = KVM_FEATURE_CLOCKSOURCE
    | KVM_FEATURE_NOP_IO_DELAY
    | KVM_FEATURE_CLOCKSOURCE2
    | KVM_FEATURE_CLOCKSOURCE_STABLE_BIT;

/// Kernel command-line options the pvm profile adds: the feature masks above (141 CX16,
/// 151 POPCNT, 308 SMAP, 297 ERMS, 580 FSRM: `word * 32 + bit` in the kernel's numbering), plus boot-time
/// options that only matter where ring 0 is emulated (`rodata=off`: page-attribute changes at
/// 4 KiB granularity cost ~7 s there; `noreplace-smp`: per-site LOCK-prefix patching;
/// `tsc=reliable`: no clocksource watchdog), plus `ember_fault_resched_ipi` (guest-kernel patch
/// 0009): a task switch due at the end of a user page fault is taken from a self-IPI instead,
/// because this host loses a task's AVX/AVX-512 register state when the switch happens on the
/// way out of a page fault.
pub const PVM_CMDLINE: &str = "noxsave clearcpuid=141,151,308,297,580 rodata=off noreplace-smp \
     tsc=reliable ember_fault_resched_ipi";

impl CpuProfile {
    /// Extra kernel command line for this profile.
    pub fn cmdline(self) -> &'static str {
        match self {
            CpuProfile::Pvm => PVM_CMDLINE,
            CpuProfile::Host | CpuProfile::Baseline => "",
        }
    }

    /// Rewrites `cpuid` (as KVM supports it) for vCPU `vcpu_id` of `vcpu_count`.
    pub fn apply(self, cpuid: &mut CpuId, vcpu_id: u8, vcpu_count: u8) {
        for e in cpuid.as_mut_slice() {
            apply_topology(e, vcpu_id, vcpu_count);
            match (e.function, e.index) {
                (1, _) => {
                    e.ecx |= ECX_HYPERVISOR | ECX_TSC_DEADLINE;
                    match self {
                        CpuProfile::Host => {}
                        CpuProfile::Pvm => {
                            e.ecx &= !(ECX_POPCNT
                                | ECX_XSAVE
                                | ECX_OSXSAVE
                                | ECX_AVX
                                | ECX_F16C
                                | ECX_FMA
                                | ECX_CX16);
                        }
                        CpuProfile::Baseline => {
                            e.ecx &= !(ECX_XSAVE
                                | ECX_OSXSAVE
                                | ECX_AVX
                                | ECX_F16C
                                | ECX_FMA
                                | ECX_PCID);
                        }
                    }
                }
                (7, 0) => match self {
                    CpuProfile::Host => {}
                    CpuProfile::Pvm => {
                        e.ebx &= !(EBX7_SMAP | EBX7_ERMS | EBX7_AVX2 | avx512_bits());
                        e.edx &= !EDX7_FSRM;
                    }
                    CpuProfile::Baseline => {
                        // Keep only FSGSBASE(0), BMI1(3), SMEP(7), BMI2(8), ADX(19), SMAP(20)
                        // and CLFLUSHOPT(23).
                        e.ebx &= (1 << 0)
                            | (1 << 3)
                            | (1 << 7)
                            | (1 << 8)
                            | (1 << 19)
                            | (1 << 20)
                            | (1 << 23);
                        e.ecx = 0;
                        e.edx = 0;
                    }
                },
                (0xd, _) if self != CpuProfile::Host => {
                    e.eax = 0;
                    e.ebx = 0;
                    e.ecx = 0;
                    e.edx = 0;
                }
                (0x4000_0001, _) => {
                    e.eax &= KVM_FEATURES_KEPT;
                    e.edx = 0;
                }
                _ => {}
            }
        }
    }
}

fn avx512_bits() -> u32 {
    // AVX512F, DQ, IFMA, PF, ER, CD, BW, VL.
    EBX7_AVX512F | (1 << 17) | (1 << 21) | (1 << 26) | (1 << 27) | (1 << 28) | (1 << 30) | (1 << 31)
}

/// Presents `vcpu_count` single-threaded cores in one socket, with APIC ids 0..n.
fn apply_topology(e: &mut kvm_cpuid_entry2, vcpu_id: u8, vcpu_count: u8) {
    match e.function {
        1 => {
            // EBX[31:24] initial APIC id, EBX[23:16] logical processors per package,
            // EBX[15:8] CLFLUSH line size in quadwords.
            e.ebx = (u32::from(vcpu_id) << 24) | (u32::from(vcpu_count) << 16) | (8 << 8);
            if vcpu_count > 1 {
                e.edx |= EDX_HTT;
            } else {
                e.edx &= !EDX_HTT;
            }
        }
        4 => {
            // Cache parameters: EAX[31:26] = cores per package - 1; one core shares each cache.
            e.eax &= !(0xfc00_0000 | 0x03ff_c000);
            e.eax |= u32::from(vcpu_count.saturating_sub(1)) << 26;
        }
        0xb | 0x1f => {
            // Extended topology (leaf 0x1f is the v2 form, same layout for these two levels):
            // level 0 = SMT (1 thread), level 1 = core (n cores). EDX is the x2APIC id, which
            // KVM reports as that of the host CPU the VMM happened to run on.
            e.edx = u32::from(vcpu_id);
            // A host without leaf 0x1f reports it as all-invalid levels (type 0): keep it so,
            // and the guest uses leaf 0xb.
            if e.function == 0x1f && (e.ecx >> 8) & 0xff == 0 {
                return;
            }
            match e.index {
                0 => {
                    e.eax = 0;
                    e.ebx = 1;
                    e.ecx = 1 << 8;
                }
                1 => {
                    e.eax = u32::from(8 - u8::leading_zeros(vcpu_count.max(1) - 1).min(8) as u8);
                    e.ebx = u32::from(vcpu_count);
                    e.ecx = (2 << 8) | 1;
                }
                _ => {
                    e.eax = 0;
                    e.ebx = 0;
                    e.ecx = e.index;
                }
            }
        }
        0x8000_001e => {
            // AMD: EAX extended APIC id, EBX[7:0] core id, EBX[15:8] threads per core - 1,
            // ECX[7:0] node id — the host CPU's, as KVM reports them.
            e.eax = u32::from(vcpu_id);
            e.ebx = (e.ebx & !0xffff) | u32::from(vcpu_id);
            e.ecx &= !0xff;
        }
        _ => {}
    }
}

/// One CPUID entry as compared across hosts: function, index, flags, EAX, EBX, ECX, EDX.
pub type FeatureKey = (u32, u32, u32, u32, u32, u32, u32);

/// CPUID as the guest sees it, less what names one CPU rather than what the CPU can do:
/// the (x2)APIC ids of leaves 1, 0xb, 0x1f and 0x8000_001e (and the latter's core and node). KVM fills these with the id of
/// whichever host CPU the VMM ran on (kvm_pvm does), so two VMMs on one host may differ
/// only there. Restores compare this key, not the raw leaves.
pub fn feature_key(e: &kvm_cpuid_entry2) -> FeatureKey {
    let (mut eax, mut ebx, mut ecx, mut edx) = (e.eax, e.ebx, e.ecx, e.edx);
    match e.function {
        1 => ebx &= 0x00ff_ffff,
        0xb | 0x1f => edx = 0,
        0x8000_001e => {
            eax = 0;
            ebx &= !0xff;
            ecx &= !0xff;
        }
        _ => {}
    }
    (e.function, e.index, e.flags, eax, ebx, ecx, edx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(
        function: u32,
        index: u32,
        eax: u32,
        ebx: u32,
        ecx: u32,
        edx: u32,
    ) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax,
            ebx,
            ecx,
            edx,
            ..Default::default()
        }
    }

    fn table() -> CpuId {
        CpuId::from_entries(&[
            entry(1, 0, 0, 0, !ECX_HYPERVISOR, u32::MAX),
            entry(7, 0, 0, u32::MAX, u32::MAX, u32::MAX),
            entry(0xd, 0, 7, 0x340, 0x340, 0),
            entry(0xb, 1, 0, 0, 0, 0),
            entry(0x4000_0001, 0, u32::MAX, 0, 0, 1),
        ])
        .unwrap()
    }

    fn find(c: &CpuId, f: u32, i: u32) -> kvm_cpuid_entry2 {
        *c.as_slice()
            .iter()
            .find(|e| e.function == f && e.index == i)
            .unwrap()
    }

    #[test]
    fn pvm_profile_hides_what_kvm_pvm_cannot_run() {
        let mut c = table();
        CpuProfile::Pvm.apply(&mut c, 0, 1);
        let l1 = find(&c, 1, 0);
        assert_eq!(
            l1.ecx & (ECX_POPCNT | ECX_XSAVE | ECX_OSXSAVE | ECX_AVX | ECX_CX16),
            0
        );
        assert_ne!(l1.ecx & ECX_HYPERVISOR, 0);
        let l7 = find(&c, 7, 0);
        assert_eq!(l7.ebx & (EBX7_SMAP | EBX7_ERMS), 0);
        assert_eq!(l7.edx & EDX7_FSRM, 0);
        assert_eq!(find(&c, 0xd, 0).eax, 0);
        // And the masks that reach the guest on a host that overrides those leaves.
        for m in ["noxsave", "151", "308", "297", "580"] {
            assert!(CpuProfile::Pvm.cmdline().contains(m), "{m}");
        }
    }

    #[test]
    fn every_profile_hides_hypercall_pv_features() {
        for p in [CpuProfile::Host, CpuProfile::Pvm, CpuProfile::Baseline] {
            let mut c = table();
            p.apply(&mut c, 0, 2);
            let kvm = find(&c, 0x4000_0001, 0);
            assert_eq!(kvm.eax, KVM_FEATURES_KEPT, "{p}");
            assert_eq!(kvm.edx, 0);
        }
    }

    #[test]
    fn host_profile_keeps_features() {
        let mut c = table();
        CpuProfile::Host.apply(&mut c, 0, 1);
        assert_ne!(find(&c, 1, 0).ecx & ECX_POPCNT, 0);
        assert_ne!(find(&c, 7, 0).ebx & EBX7_SMAP, 0);
        assert!(CpuProfile::Host.cmdline().is_empty());
    }

    #[test]
    fn topology_reports_apic_ids_and_counts() {
        let mut c = table();
        CpuProfile::Host.apply(&mut c, 3, 4);
        let l1 = find(&c, 1, 0);
        assert_eq!(l1.ebx >> 24, 3);
        assert_eq!((l1.ebx >> 16) & 0xff, 4);
        assert_ne!(l1.edx & EDX_HTT, 0);
        let b = find(&c, 0xb, 1);
        assert_eq!(b.ebx, 4);
        assert_eq!(b.edx, 3);
        assert_eq!(b.eax, 2, "shift to the package level for 4 cores");
        // A host with leaf 0x1f: the same levels as 0xb.
        let mut v2 = CpuId::from_entries(&[entry(0x1f, 1, 4, 16, (2 << 8) | 1, 9)]).unwrap();
        CpuProfile::Host.apply(&mut v2, 3, 4);
        let f = find(&v2, 0x1f, 1);
        assert_eq!((f.eax, f.ebx, f.ecx, f.edx), (2, 4, (2 << 8) | 1, 3));
    }

    #[test]
    fn apic_ids_of_the_host_cpu_do_not_leak_into_the_guest_or_the_key() {
        // KVM_GET_SUPPORTED_CPUID as kvm_pvm reports it on host CPU 1 and on host CPU 0.
        let on = |apic: u32| {
            CpuId::from_entries(&[
                entry(1, 0, 0xa0671, (apic << 24) | 0x20800, 0, 0),
                entry(0xb, 1, 0, 0, 0, apic),
                entry(0x1f, 1, 0, 0, 0, apic),
                entry(0x8000_001e, 0, apic, 0x100 | apic, apic, 0),
            ])
            .unwrap()
        };
        let (mut a, mut b) = (on(1), on(0));
        CpuProfile::Pvm.apply(&mut a, 0, 1);
        CpuProfile::Pvm.apply(&mut b, 0, 1);
        assert_eq!(a.as_slice(), b.as_slice());
        assert_eq!(find(&a, 0x1f, 1).edx, 0);
        assert_eq!(
            (find(&a, 0x1f, 1).ebx, find(&a, 0x1f, 1).ecx),
            (0, 0),
            "a leaf 0x1f the host does not have stays invalid"
        );
        assert_eq!(find(&a, 0x8000_001e, 0).eax, 0);
        // The key ignores the ids (a snapshot from before they were set still matches)
        // and nothing else.
        let (x, y) = (on(1), on(0));
        for (p, q) in x.as_slice().iter().zip(y.as_slice()) {
            assert_eq!(feature_key(p), feature_key(q));
        }
        let mut z = find(&x, 0x1f, 1);
        z.ecx ^= 1;
        assert_ne!(feature_key(&z), feature_key(&find(&y, 0x1f, 1)));
    }

    #[test]
    fn detection_agrees_with_the_module_list() {
        // Where /sys shows kvm_pvm, the CPU must also lack VMX/SVM (that is why kvm_pvm is
        // there), so CPUID-only detection (used in jails) gives the same answer.
        if std::path::Path::new("/sys/module/kvm_pvm").exists() {
            assert!(!host_has_hw_virt());
        }
        if std::path::Path::new("/sys/module/kvm_intel").exists()
            || std::path::Path::new("/sys/module/kvm_amd").exists()
        {
            assert!(host_has_hw_virt());
            assert_eq!(HostKvm::detect(), HostKvm::Hardware);
        }
    }

    #[test]
    fn parses_profile_names() {
        assert_eq!("pvm".parse::<CpuProfile>().unwrap(), CpuProfile::Pvm);
        assert!("fast"
            .parse::<CpuProfile>()
            .unwrap_err()
            .contains("host, pvm or baseline"));
    }
}
