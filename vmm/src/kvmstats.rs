//! KVM's own counters for this VM: VM exits by reason, page faults as KVM sees them, interrupt
//! injections, halts — read from the binary statistics descriptors KVM gives each VM and vCPU
//! (`KVM_GET_STATS_FD`, Linux 5.14 and later).
//!
//! These count what the VMM never sees: most exits (page faults, interrupts, halts) are handled
//! inside KVM and never return from `KVM_RUN`. On kvm_pvm, where guest page tables are shadowed
//! and a guest user-mode `syscall` enters the guest kernel as a page fault the host injects
//! (guest-kernel patch 0003), `pf_guest` counts the guest's system calls plus its own
//! user-mode page faults; `pf_fixed` counts shadow-page fills (first touches of pages after a
//! restore). On hardware KVM with EPT the shadow-paging counters stay zero and `exits` counts
//! real VM exits.
//!
//! The descriptors are opened while the VM is built (before any seccomp filter); reading them
//! later takes one `pread` per descriptor. Only the VM's own process can open them (KVM
//! answers `EIO` to ioctls on a VM from another address space, so a descriptor duplicated
//! with `pidfd_getfd` does not help), and KVM's per-VM debugfs files are not readable on the
//! kvm_pvm hosts here: another VMM's counters (Firecracker's) cannot be read from outside. A kernel without the ioctl gives an empty set: the
//! counters are then simply absent from `stats` and the report.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;

/// `KVM_GET_STATS_FD` = `_IO(KVMIO, 0xce)`.
const KVM_GET_STATS_FD: libc::c_ulong = 0xae_ce;
/// Size of `struct kvm_stats_header`.
const HEADER_LEN: usize = 24;
/// Size of `struct kvm_stats_desc` without its name.
const DESC_FIXED_LEN: usize = 16;
/// `KVM_STATS_TYPE_MASK` and the types kept.
const TYPE_MASK: u32 = 0xf;
const TYPE_CUMULATIVE: u32 = 0;
const TYPE_INSTANT: u32 = 1;
const TYPE_PEAK: u32 = 2;
/// Longest descriptor list accepted (KVM has ~50 per vCPU).
const MAX_DESCRIPTORS: u32 = 4096;
/// Longest name accepted.
const MAX_NAME: u32 = 256;

#[derive(Debug)]
struct Desc {
    name: String,
    /// Byte offset of the value within the data block.
    offset: u64,
    /// Cumulative counters are summed over vCPUs; instant and peak values are too (they are
    /// per-vCPU gauges such as `blocking`), which keeps one number per name.
    kind: u32,
}

/// One statistics descriptor (the VM's or one vCPU's).
#[derive(Debug)]
struct StatsFd {
    file: File,
    data_offset: u64,
    descs: Vec<Desc>,
}

impl StatsFd {
    /// `KVM_GET_STATS_FD` on `fd` (a VM or vCPU descriptor) and the descriptor list.
    fn open(fd: &impl AsRawFd) -> std::io::Result<Self> {
        // SAFETY: KVM_GET_STATS_FD takes no argument and returns a new descriptor or -1.
        let sfd = unsafe { libc::ioctl(fd.as_raw_fd(), KVM_GET_STATS_FD, 0) };
        if sfd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `sfd` was just returned by the ioctl and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(sfd) };
        let mut hdr = [0u8; HEADER_LEN];
        file.read_exact_at(&mut hdr, 0)?;
        let word = |i: usize| u32::from_le_bytes([hdr[i], hdr[i + 1], hdr[i + 2], hdr[i + 3]]);
        let (name_size, num_desc, desc_offset, data_offset) =
            (word(4), word(8), word(16), word(20));
        if num_desc > MAX_DESCRIPTORS || name_size > MAX_NAME {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("implausible KVM stats header: {num_desc} descriptors, names of {name_size} bytes"),
            ));
        }
        let desc_len = DESC_FIXED_LEN + name_size as usize;
        let mut raw = vec![0u8; desc_len * num_desc as usize];
        file.read_exact_at(&mut raw, u64::from(desc_offset))?;
        let descs = raw.chunks_exact(desc_len).filter_map(parse_desc).collect();
        Ok(Self {
            file,
            data_offset: u64::from(data_offset),
            descs,
        })
    }

    /// Adds every counter to `into` (summing same-named ones).
    fn read_into(&self, into: &mut BTreeMap<String, u64>) -> std::io::Result<()> {
        let end = self.descs.iter().map(|d| d.offset + 8).max().unwrap_or(0);
        let mut data = vec![0u8; end as usize];
        self.file.read_exact_at(&mut data, self.data_offset)?;
        for d in &self.descs {
            let o = d.offset as usize;
            let mut v = [0u8; 8];
            v.copy_from_slice(&data[o..o + 8]);
            let v = u64::from_le_bytes(v);
            let e = into.entry(d.name.clone()).or_insert(0);
            *e = if d.kind == TYPE_PEAK {
                (*e).max(v)
            } else {
                e.saturating_add(v)
            };
        }
        Ok(())
    }
}

/// Parses one `struct kvm_stats_desc`: flags u32, exponent i16, size u16, offset u32, bucket
/// size u32, then the NUL-padded name. Only single 64-bit values of the cumulative, instant
/// and peak types are kept (histograms are not).
fn parse_desc(d: &[u8]) -> Option<Desc> {
    let flags = u32::from_le_bytes(d.get(0..4)?.try_into().ok()?);
    let size = u16::from_le_bytes(d.get(6..8)?.try_into().ok()?);
    let offset = u32::from_le_bytes(d.get(8..12)?.try_into().ok()?);
    let kind = flags & TYPE_MASK;
    if size != 1 || !matches!(kind, TYPE_CUMULATIVE | TYPE_INSTANT | TYPE_PEAK) {
        return None;
    }
    let name = d.get(DESC_FIXED_LEN..)?;
    let len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let name = std::str::from_utf8(&name[..len]).ok()?;
    if name.is_empty() {
        return None;
    }
    Some(Desc {
        name: name.to_owned(),
        offset: u64::from(offset),
        kind,
    })
}

/// The VM's and all its vCPUs' statistics descriptors.
#[derive(Debug, Default)]
pub struct KvmStats {
    vm: Option<StatsFd>,
    vcpus: Vec<StatsFd>,
}

impl KvmStats {
    /// Opens the descriptors of `vm` and `vcpus`; whatever cannot be opened is left out (with a
    /// debug line: old kernels have no binary statistics).
    pub fn open<'a>(
        vm: &impl AsRawFd,
        vcpus: impl IntoIterator<Item = &'a kvm_ioctls::VcpuFd>,
    ) -> Self {
        let vm = StatsFd::open(vm)
            .map_err(|e| tracing::debug!("KVM_GET_STATS_FD on the VM: {e}"))
            .ok();
        let vcpus = vcpus
            .into_iter()
            .filter_map(|v| {
                StatsFd::open(v)
                    .map_err(|e| tracing::debug!("KVM_GET_STATS_FD on a vCPU: {e}"))
                    .ok()
            })
            .collect();
        Self { vm, vcpus }
    }

    /// Whether any counter can be read.
    pub fn available(&self) -> bool {
        self.vm.is_some() || !self.vcpus.is_empty()
    }

    /// vCPU counters summed over all vCPUs (`exits`, `pf_fixed`, `halt_exits`, ...).
    pub fn vcpu_totals(&self) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        for v in &self.vcpus {
            if let Err(e) = v.read_into(&mut m) {
                tracing::debug!("reading vCPU statistics: {e}");
            }
        }
        m
    }

    /// The VM-wide counters (shadow MMU: `mmu_cache_miss`, `pages_4k`, ...).
    pub fn vm_totals(&self) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        if let Some(v) = &self.vm {
            if let Err(e) = v.read_into(&mut m) {
                tracing::debug!("reading VM statistics: {e}");
            }
        }
        m
    }

    /// `{"vcpu": {...}, "vm": {...}}` with every counter, or `null` when none is available.
    pub fn to_json(&self) -> serde_json::Value {
        if !self.available() {
            return serde_json::Value::Null;
        }
        serde_json::json!({ "vcpu": self.vcpu_totals(), "vm": self.vm_totals() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_parsing_keeps_single_values_only() {
        let mut d = vec![0u8; DESC_FIXED_LEN + 48];
        d[6..8].copy_from_slice(&1u16.to_le_bytes());
        d[8..12].copy_from_slice(&904u32.to_le_bytes());
        d[DESC_FIXED_LEN..DESC_FIXED_LEN + 5].copy_from_slice(b"exits");
        let p = parse_desc(&d).unwrap();
        assert_eq!((p.name.as_str(), p.offset, p.kind), ("exits", 904, 0));
        // A histogram (type 4) and a 32-bucket array are left out.
        let mut h = d.clone();
        h[0] = 4;
        assert!(parse_desc(&h).is_none());
        let mut arr = d.clone();
        arr[6..8].copy_from_slice(&32u16.to_le_bytes());
        assert!(parse_desc(&arr).is_none());
        // No name, or a name that is not UTF-8.
        let mut empty = d.clone();
        empty[DESC_FIXED_LEN..].fill(0);
        assert!(parse_desc(&empty).is_none());
        let mut bad = d;
        bad[DESC_FIXED_LEN] = 0xff;
        assert!(parse_desc(&bad).is_none());
    }

    #[test]
    fn counters_of_a_real_vm_are_read() {
        let kvm = match kvm_ioctls::Kvm::new() {
            Ok(k) => k,
            Err(e) if std::env::var_os("CI").is_some() => panic!("no /dev/kvm in CI: {e}"),
            Err(e) => {
                eprintln!("skipped: no /dev/kvm ({e})");
                return;
            }
        };
        let vm = kvm.create_vm().unwrap();
        let vcpu = vm.create_vcpu(0).unwrap();
        let stats = KvmStats::open(&vm, [&vcpu]);
        if !stats.available() && std::env::var_os("CI").is_none() {
            eprintln!("skipped: this kernel has no KVM_GET_STATS_FD");
            return;
        }
        assert!(stats.available(), "KVM_GET_STATS_FD is missing");
        let before = stats.vcpu_totals();
        assert!(before.contains_key("exits"), "{before:?}");
        assert!(stats.vm_totals().contains_key("remote_tlb_flush"));
        let json = stats.to_json();
        assert!(json["vcpu"]["exits"].is_u64(), "{json}");
    }
}
