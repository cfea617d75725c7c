//! Host memory of many idle clones of one snapshot: the sum of their PSS (shared pages counted
//! once across the clones), each clone's private memory, and the VMM's own overhead (its
//! memory outside guest RAM).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::restore::ping_until_answered;

/// Memory figures of one clone, in KiB, from `/proc/PID/smaps`.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct CloneMemory {
    /// Proportional set size of the whole process.
    pub pss_kib: u64,
    /// Pages only this process maps (guest pages it wrote, VMM heap and stacks).
    pub private_kib: u64,
    /// PSS of the guest-memory mapping (the snapshot's `memory` file).
    pub guest_pss_kib: u64,
    /// Private pages of the guest-memory mapping (copy-on-write copies).
    pub guest_private_kib: u64,
    /// PSS outside guest memory: the VMM's own overhead.
    pub vmm_pss_kib: u64,
}

/// Totals over all clones.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ClonesResult {
    /// Clones measured.
    pub clones: usize,
    /// Guest memory of each clone, in MiB.
    pub mem_mib: u64,
    /// Sum of PSS over all clone processes, MiB.
    pub total_pss_mib: f64,
    /// What N independent (unshared) VMs would take at least: N × guest memory touched.
    pub per_clone_private_mib_median: f64,
    /// Median VMM overhead (PSS outside guest memory), MiB.
    pub vmm_overhead_mib_median: f64,
    /// Median PSS of guest memory per clone, MiB.
    pub guest_pss_mib_median: f64,
}

/// Reads a process's memory figures; `guest_file` names the mapping holding guest memory.
pub fn clone_memory(pid: u32, guest_file: &str) -> std::io::Result<CloneMemory> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let mut m = CloneMemory::default();
    let mut in_guest = false;
    for line in smaps.lines() {
        let mut parts = line.split_whitespace();
        let first = parts.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping header: "start-end perms offset dev inode path".
            in_guest = line.trim_end().ends_with(guest_file);
            continue;
        }
        let kib: u64 = parts.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        match first {
            "Pss:" => {
                m.pss_kib += kib;
                if in_guest {
                    m.guest_pss_kib += kib;
                }
            }
            "Private_Clean:" | "Private_Dirty:" => {
                m.private_kib += kib;
                if in_guest {
                    m.guest_private_kib += kib;
                }
            }
            _ => {}
        }
    }
    m.vmm_pss_kib = m.pss_kib.saturating_sub(m.guest_pss_kib);
    Ok(m)
}

struct Killer(Child);
impl Drop for Killer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// Restores `n` clones of `snap`, waits until each answers a ping (so each has touched what
/// an idle agent touches), then measures them all while they are running.
pub fn measure_clones(
    ember_vmm: &Path,
    snap: &Path,
    workdir: &Path,
    n: usize,
    mem_mib: u64,
    mut progress: impl FnMut(usize),
) -> Result<(ClonesResult, Vec<CloneMemory>), String> {
    let mut clones = Vec::with_capacity(n);
    for i in 0..n {
        let uds = workdir.join(format!("mclone{i}.vsock"));
        let child = Command::new(ember_vmm)
            .arg("--restore")
            .arg(snap)
            .arg("--vsock-uds")
            .arg(&uds)
            .args(["--serial", "none"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start ember-vmm: {e}"))?;
        clones.push(Killer(child));
        ping_until_answered(&uds, Duration::from_secs(120))?;
        progress(i + 1);
    }
    let mem_path = snap.join("memory");
    let guest_file = mem_path.to_string_lossy().into_owned();
    let mut per = Vec::with_capacity(n);
    for c in &clones {
        per.push(clone_memory(c.0.id(), &guest_file).map_err(|e| e.to_string())?);
    }
    let kib = |x: u64| x as f64 / 1024.0;
    let result = ClonesResult {
        clones: n,
        mem_mib,
        total_pss_mib: kib(per.iter().map(|m| m.pss_kib).sum()),
        per_clone_private_mib_median: median(per.iter().map(|m| kib(m.private_kib)).collect()),
        vmm_overhead_mib_median: median(per.iter().map(|m| kib(m.vmm_pss_kib)).collect()),
        guest_pss_mib_median: median(per.iter().map(|m| kib(m.guest_pss_kib)).collect()),
    };
    Ok((result, per))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let m = clone_memory(std::process::id(), "/nonexistent").unwrap();
        assert!(m.pss_kib > 0 && m.private_kib > 0);
        assert_eq!(m.guest_pss_kib, 0);
        assert_eq!(m.vmm_pss_kib, m.pss_kib);
    }
}
