//! What a running sandbox costs the host right now: CPU (sampled), memory (its cgroup, v1
//! or v2), disk (its copy-on-write layer). Read from the host only: no guest call.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{jailed, lock, Runtime, RuntimeError, State, Usage};
use crate::jail::SnapshotDisk;

/// How long CPU time is sampled.
const CPU_SAMPLE: Duration = Duration::from_millis(200);

impl Runtime {
    /// What the running sandbox `id` uses on the host now (blocks for a short CPU sample).
    /// A sandbox that is not running (paused, ended) has no usage: a conflict error.
    pub fn usage(&self, id: &str) -> Result<Usage, RuntimeError> {
        let slot = self.slot(id)?;
        let (vm, resources, state) = {
            let st = lock(&slot.st);
            (st.vm.clone(), st.row.resources.clone(), st.row.state)
        };
        let vm = match (state, vm) {
            (State::Running, Some(vm)) => vm,
            (s, _) => {
                return Err(RuntimeError::conflict(
                    id,
                    s,
                    "only a running sandbox has resource usage",
                ))
            }
        };
        let pid = vm.sandbox.pid();
        let cgroups = jailed::cgroup_dirs(self.config(), &vm.jail.id);
        let cpu_pct = pid
            .and_then(|p| sample_cpu(p, &cgroups, CPU_SAMPLE))
            .map(|busy| 100.0 * busy / f64::from(resources.vcpus.max(1)))
            .unwrap_or(0.0)
            .clamp(0.0, 100.0);
        let (mem_used, mem_cache) = cgroup_memory(&cgroups)
            .or_else(|| pid.and_then(rss_bytes).map(|r| (r, 0)))
            .unwrap_or((0, 0));
        let disk_used = vm
            .disks
            .iter()
            .enumerate()
            .filter_map(|(i, d)| match d {
                SnapshotDisk::Overlay { .. } => {
                    allocated(&vm.host_path(&format!("/work/disk{i}.overlay")))
                }
                SnapshotDisk::Raw { .. } => None,
            })
            .sum();
        Ok(Usage {
            at_ms: crate::store::now_ms(),
            vcpus: resources.vcpus,
            cpu_used_pct: (cpu_pct * 100.0).round() / 100.0,
            mem_used_bytes: mem_used,
            mem_cache_bytes: mem_cache,
            mem_total_bytes: resources.memory_mib << 20,
            disk_used_bytes: disk_used,
            disk_total_bytes: resources.disk_mib << 20,
        })
    }
}

/// Bytes allocated on the host for `path`.
fn allocated(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.blocks() * 512)
}

/// Busy fraction of one CPU over `sample` (1.0 = one CPU fully busy).
fn sample_cpu(pid: u32, cgroups: &[PathBuf], sample: Duration) -> Option<f64> {
    let t0 = Instant::now();
    let a = cpu_ns(pid, cgroups)?;
    std::thread::sleep(sample);
    let b = cpu_ns(pid, cgroups)?;
    let wall = t0.elapsed().as_nanos() as f64;
    Some(b.saturating_sub(a) as f64 / wall.max(1.0))
}

/// CPU time used so far, ns: the cgroup's counter when there is one (v2 `cpu.stat`,
/// v1 `cpuacct.usage`), else the process's utime + stime.
fn cpu_ns(pid: u32, cgroups: &[PathBuf]) -> Option<u64> {
    for dir in cgroups {
        if let Ok(text) = std::fs::read_to_string(dir.join("cpu.stat")) {
            if let Some(us) = keyed(&text, "usage_usec") {
                return Some(us * 1000);
            }
        }
        if let Ok(text) = std::fs::read_to_string(dir.join("cpuacct.usage")) {
            if let Ok(ns) = text.trim().parse() {
                return Some(ns);
            }
        }
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): state is field 3, utime 14,
    // stime 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf takes an integer name and reads no memory of ours.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    Some((utime + stime) * 1_000_000_000 / hz)
}

/// (usage, page cache) in bytes of the memory cgroup among `cgroups`.
fn cgroup_memory(cgroups: &[PathBuf]) -> Option<(u64, u64)> {
    for dir in cgroups {
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
        let stat = read("memory.stat").unwrap_or_default();
        if let Some(v) = read("memory.current").and_then(|t| t.trim().parse().ok()) {
            return Some((v, keyed(&stat, "file").unwrap_or(0)));
        }
        if let Some(v) = read("memory.usage_in_bytes").and_then(|t| t.trim().parse().ok()) {
            let cache = keyed(&stat, "total_cache")
                .or_else(|| keyed(&stat, "cache"))
                .unwrap_or(0);
            return Some((v, cache));
        }
    }
    None
}

/// The process's resident set, bytes.
fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// The value of `key` in a `key value` per line file.
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_files_are_read_by_key() {
        let t = "cache 4096\ntotal_cache 8192\nfile 12\n";
        assert_eq!(keyed(t, "cache"), Some(4096));
        assert_eq!(keyed(t, "total_cache"), Some(8192));
        assert_eq!(keyed(t, "rss"), None);
    }

    #[test]
    fn our_own_cpu_time_and_rss_are_readable() {
        let pid = std::process::id();
        assert!(cpu_ns(pid, &[]).is_some());
        assert!(rss_bytes(pid).unwrap() > 0);
        assert!(sample_cpu(pid, &[], Duration::from_millis(20)).is_some());
    }
}
