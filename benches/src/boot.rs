//! Cold boot: process spawn → the guest's boot marker, for ember and for Firecracker booting
//! the same kernel and rootfs with the same command-line masks in the same run.
//!
//! ember is timed with its boot-marker port (spawn → marker write, host monotonic clock).
//! Firecracker has no such port, so both systems are also timed to the console line
//! `ember-init: ready` that the guest init prints right after writing the marker; the ratio
//! uses that common measure so the comparison is like for like.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ember_vmm::launcher::{launch, Console};
use ember_vmm::vm::VmConfig;
use ember_vmm::CpuProfile;

use crate::stats::{summarize, Summary};

/// The console line both systems are timed to.
pub const READY_LINE: &str = "ember-init: ready";

/// Errors running the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Launching a VMM failed.
    #[error(transparent)]
    Launch(#[from] ember_vmm::launcher::LaunchError),
    /// A boot did not reach the marker.
    #[error("{system} boot {i} failed: {detail}")]
    Boot {
        /// Which system.
        system: String,
        /// Which run.
        i: usize,
        /// What went wrong.
        detail: String,
    },
    /// Files.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// One cold-boot sample.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BootSample {
    /// Spawn → boot marker (ember only).
    pub marker_ms: Option<f64>,
    /// Spawn → `ember-init: ready` on the console.
    pub ready_line_ms: Option<f64>,
}

/// The inputs shared by every system.
#[derive(Debug, Clone)]
pub struct BootBench {
    /// Kernel (vmlinux).
    pub kernel: PathBuf,
    /// Root filesystem image (mounted read-only).
    pub rootfs: PathBuf,
    /// Guest memory.
    pub mem_mib: u64,
    /// vCPUs.
    pub vcpus: u8,
    /// Boots per system.
    pub n: usize,
    /// CPU profile for ember (and whose masks the peer gets).
    pub profile: CpuProfile,
    /// The ember-vmm binary.
    pub ember_vmm: PathBuf,
    /// A Firecracker binary, if one should run beside ember.
    pub firecracker: Option<PathBuf>,
}

/// Result per system.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SystemResult {
    /// "ember" or "firecracker".
    pub system: String,
    /// What was measured.
    pub measure: String,
    /// Statistics.
    #[serde(flatten)]
    pub summary: Summary,
    /// This system's median over ember's median for the same measure (>1: ember is faster).
    pub ratio_vs_ember: Option<f64>,
}

impl BootBench {
    fn ember_config(&self) -> VmConfig {
        let mut c = VmConfig::new(self.kernel.clone());
        c.disks.push(ember_devices_block(&self.rootfs));
        c.mem_mib = self.mem_mib;
        c.vcpus = self.vcpus;
        c.cpu_profile = Some(self.profile);
        c
    }

    /// One ember boot.
    pub fn ember_once(&self, i: usize) -> Result<BootSample, BenchError> {
        let dir = tempfile::tempdir()?;
        let vm = launch(
            &self.ember_vmm,
            &self.ember_config(),
            dir.path(),
            Console::Capture,
            &[],
        )?;
        let out = vm.wait(Some(Duration::from_secs(600)))?;
        if out.boot_marker_ms.is_none() || !out.status.success() {
            return Err(BenchError::Boot {
                system: "ember".into(),
                i,
                detail: out
                    .error_message()
                    .unwrap_or_else(|| format!("exit status {}", out.status)),
            });
        }
        let ready = out
            .console
            .iter()
            .find(|l| l.text.contains(READY_LINE))
            .map(|l| l.ms);
        Ok(BootSample {
            marker_ms: out.boot_marker_ms,
            ready_line_ms: ready,
        })
    }

    /// One Firecracker boot of the same kernel, rootfs and masks (`--no-api --config-file`).
    pub fn firecracker_once(&self, fc: &Path, i: usize) -> Result<BootSample, BenchError> {
        let dir = tempfile::tempdir()?;
        let mut boot_args = String::from("console=ttyS0 reboot=k panic=1 pci=off quiet ro");
        if !self.profile.cmdline().is_empty() {
            boot_args.push(' ');
            boot_args.push_str(self.profile.cmdline());
        }
        let cfg = serde_json::json!({
            "boot-source": { "kernel_image_path": self.kernel, "boot_args": boot_args },
            "drives": [{ "drive_id": "rootfs", "path_on_host": self.rootfs,
                         "is_root_device": true, "is_read_only": true }],
            "machine-config": { "vcpu_count": self.vcpus, "mem_size_mib": self.mem_mib },
        });
        let cfg_path = dir.path().join("fc.json");
        std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap_or_default())?;
        let start = Instant::now();
        let mut child = Command::new(fc)
            .arg("--no-api")
            .arg("--config-file")
            .arg(&cfg_path)
            .arg("--level")
            .arg("Error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut ready = None;
        if let Some(out) = child.stdout.take() {
            for line in BufReader::new(out).split(b'\n') {
                let Ok(line) = line else { break };
                if ready.is_none() && String::from_utf8_lossy(&line).contains(READY_LINE) {
                    ready = Some(start.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        let status = child.wait()?;
        if ready.is_none() {
            return Err(BenchError::Boot {
                system: "firecracker".into(),
                i,
                detail: format!("no '{READY_LINE}' line; exit status {status}"),
            });
        }
        Ok(BootSample {
            marker_ms: None,
            ready_line_ms: ready,
        })
    }

    /// Runs every system `n` times, interleaved so that drift in the host affects both alike.
    /// `progress` is told about each sample.
    pub fn run(
        &self,
        mut progress: impl FnMut(&str, usize, &BootSample),
    ) -> Result<Vec<SystemResult>, BenchError> {
        let mut ember = Vec::new();
        let mut fc = Vec::new();
        for i in 0..self.n {
            let s = self.ember_once(i)?;
            progress("ember", i, &s);
            ember.push(s);
            if let Some(bin) = &self.firecracker {
                let s = self.firecracker_once(bin, i)?;
                progress("firecracker", i, &s);
                fc.push(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let col = |v: &[BootSample], f: fn(&BootSample) -> Option<f64>| -> Vec<f64> {
            v.iter().filter_map(f).collect()
        };
        let mut results = Vec::new();
        if let Some(s) = summarize(&col(&ember, |s| s.marker_ms)) {
            results.push(SystemResult {
                system: "ember".into(),
                measure: "spawn_to_marker".into(),
                summary: s,
                ratio_vs_ember: Some(1.0),
            });
        }
        let ember_ready = summarize(&col(&ember, |s| s.ready_line_ms));
        if let Some(s) = ember_ready {
            results.push(SystemResult {
                system: "ember".into(),
                measure: "spawn_to_ready_line".into(),
                summary: s,
                ratio_vs_ember: Some(1.0),
            });
        }
        if let Some(s) = summarize(&col(&fc, |s| s.ready_line_ms)) {
            results.push(SystemResult {
                system: "firecracker".into(),
                measure: "spawn_to_ready_line".into(),
                ratio_vs_ember: ember_ready.map(|e| s.median_ms / e.median_ms),
                summary: s,
            });
        }
        Ok(results)
    }
}

fn ember_devices_block(path: &Path) -> ember_vmm::vm::DiskConfig {
    ember_vmm::vm::DiskConfig {
        path: path.to_path_buf(),
        mode: ember_vmm::vm::DiskMode::ReadOnly,
        id: "rootfs".into(),
    }
}

/// Formats results as a table.
pub fn table(results: &[SystemResult]) -> String {
    let mut s = format!(
        "{:<12} {:<20} {:>4} {:>11} {:>11} {:>14}\n",
        "system", "measure", "n", "median ms", "p95 ms", "vs ember"
    );
    for r in results {
        s.push_str(&format!(
            "{:<12} {:<20} {:>4} {:>11.1} {:>11.1} {:>14}\n",
            r.system,
            r.measure,
            r.summary.n,
            r.summary.median_ms,
            r.summary.p95_ms,
            r.ratio_vs_ember
                .map(|x| format!("{x:.2}x"))
                .unwrap_or_else(|| "-".into())
        ));
    }
    s
}
