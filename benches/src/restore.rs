//! Restore latency: process spawn → guest vCPU running, and spawn → the guest agent answering
//! a vsock ping, for ember and for Firecracker restoring its own snapshot of the same kernel,
//! rootfs and command line in the same run.
//!
//! Both guests run the ember agent (`ember.agent` on the command line) and are snapshotted
//! once it is listening; both VMMs speak the same host-side vsock protocol (`CONNECT <port>`
//! on a Unix socket), so the ping is the same on both sides.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ember_agent::client::Client;
use ember_vmm::report::monotonic_ns;
use ember_vmm::CpuProfile;

use crate::stats::{summarize, Summary};

/// The agent's vsock port.
pub const AGENT_PORT: u32 = 1024;

/// Inputs shared by both systems.
#[derive(Debug, Clone)]
pub struct RestoreBench {
    /// Kernel (vmlinux).
    pub kernel: PathBuf,
    /// Root filesystem (read-only).
    pub rootfs: PathBuf,
    /// Guest memory.
    pub mem_mib: u64,
    /// Restores per system.
    pub n: usize,
    /// CPU profile (its masks go to both guests).
    pub profile: CpuProfile,
    /// ember-vmm.
    pub ember_vmm: PathBuf,
    /// Firecracker, if any.
    pub firecracker: Option<PathBuf>,
    /// Working directory (snapshots, sockets).
    pub workdir: PathBuf,
    /// ember's working-set prefetch mode for the restores.
    pub prefetch: String,
    /// How ember's clones get their vsock connection.
    pub vsock: VsockMode,
}

/// How ember's clones reach the agent after a restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VsockMode {
    /// As restores did before connections were kept: the clone sends the guest a transport
    /// reset (`--vsock-transport-reset`) and the ping connects anew (`CONNECT`).
    Reset,
    /// No transport reset (the template snapshot has no open connection, so nothing needs
    /// resetting) and a new connection (`CONNECT`).
    Connect,
    /// The template snapshot is taken with an idle agent connection open; the clone keeps it
    /// and the ping takes it over (`ATTACH`): one write the agent is already waiting for.
    #[default]
    Attach,
}

impl VsockMode {
    fn keep_connection(self) -> bool {
        self == VsockMode::Attach
    }
}

impl std::str::FromStr for VsockMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reset" => Ok(Self::Reset),
            "connect" => Ok(Self::Connect),
            "attach" => Ok(Self::Attach),
            _ => Err(format!("{s:?}: expected reset, connect or attach")),
        }
    }
}

/// KVM counters reported per restore (ember's VMM reads them at the guest's first answer;
/// Firecracker's cannot be read from outside its process on this host, see
/// `ember_vmm::kvmstats`).
pub const COUNTERS: &[&str] = &[
    "exits",
    "io_exits",
    "mmio_exits",
    "halt_exits",
    "irq_exits",
    "irq_window_exits",
    "request_irq_exits",
    "signal_exits",
    "pf_taken",
    "pf_fixed",
    "pf_guest",
    "pf_emulate",
    "pf_spurious",
    "irq_injections",
    "insn_emulation",
    "halt_wakeup",
];

/// What one restore measured.
#[derive(Debug, Clone, Default)]
pub struct RestoreSample {
    /// Spawn → vCPU running (ember) or → snapshot load returned (Firecracker), ms.
    pub running_ms: f64,
    /// Spawn → agent ping answered, ms.
    pub ping_ms: f64,
    /// Spawn → the guest's first vsock data (the VMM's `guest_first_data` event), ms.
    pub first_answer_ms: Option<f64>,
    /// KVM counters at the guest's first data, as the VMM itself read them (ember only).
    pub vmm_counts: Option<std::collections::BTreeMap<String, u64>>,
}

/// Median and p95 of one counter for one system.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CountResult {
    /// "ember" or "firecracker".
    pub system: String,
    /// The counter (e.g. `exits`), from spawn to the guest's first answer.
    pub counter: String,
    /// Samples.
    pub n: usize,
    /// Median.
    pub median: f64,
    /// 95th percentile.
    pub p95: f64,
}

/// One system's figures for one measure.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RestoreResult {
    /// "ember" or "firecracker".
    pub system: String,
    /// `spawn_to_running` or `spawn_to_ping`.
    pub measure: String,
    /// Statistics.
    #[serde(flatten)]
    pub summary: Summary,
    /// This system's median over ember's for the same measure.
    pub ratio_vs_ember: Option<f64>,
}

struct Killer(Child);
impl Drop for Killer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn events(report: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(report)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn wait_until<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> Result<T, String> {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if t.elapsed() > timeout {
            return Err(format!("timed out waiting for {what}"));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Pings the agent through a vsock Unix socket until it answers; returns when it did.
pub fn ping_until_answered(uds: &Path, timeout: Duration) -> Result<(), String> {
    ping_until_answered_by(uds, timeout, false).map(drop)
}

/// Like [`ping_until_answered`], with `ATTACH` instead of `CONNECT` when `attach` is set;
/// returns the client that got the answer.
pub fn ping_until_answered_by(
    uds: &Path,
    timeout: Duration,
    attach: bool,
) -> Result<Client<UnixStream>, String> {
    let t = Instant::now();
    let mut last = String::new();
    while t.elapsed() < timeout {
        let client = if attach {
            ember_vmm::vsock_host::attach(uds, AGENT_PORT, Duration::from_secs(10))
                .map(Client::new)
                .map_err(|e| e.to_string())
        } else {
            Client::connect_uds(uds, AGENT_PORT, Duration::from_secs(10)).map_err(|e| e.to_string())
        };
        match client {
            Ok(mut c) => match c.ping() {
                Ok(_) => return Ok(c),
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    Err(format!(
        "agent never answered through {}: {last}",
        uds.display()
    ))
}

impl RestoreBench {
    fn boot_args(&self) -> String {
        let mut s = String::from("console=ttyS0 reboot=k panic=1 pci=off quiet ro ember.agent");
        if !self.profile.cmdline().is_empty() {
            s.push(' ');
            s.push_str(self.profile.cmdline());
        }
        s
    }

    /// Boots ember's template VM and snapshots it once the agent answers.
    pub fn prepare_ember(&self) -> Result<PathBuf, String> {
        let d = self.workdir.join("ember");
        std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
        let snap = d.join("snap");
        let _ = std::fs::remove_dir_all(&snap);
        let uds = d.join("template.vsock");
        let api = d.join("api.sock");
        let child = Command::new(&self.ember_vmm)
            .arg("--kernel")
            .arg(&self.kernel)
            .arg("--disk")
            .arg(format!("path={},mode=ro,id=rootfs", self.rootfs.display()))
            .arg("--vsock")
            .arg(format!("cid=3,uds={}", uds.display()))
            .arg("--mem-mib")
            .arg(self.mem_mib.to_string())
            .arg("--cpu-profile")
            .arg(self.profile.to_string())
            .args(["--cmdline-append", "ember.agent", "--serial", "none"])
            .arg("--api-sock")
            .arg(&api)
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start ember-vmm: {e}"))?;
        let mut vm = Killer(child);
        ping_until_answered(&uds, Duration::from_secs(600))?;
        // An idle connection (the agent waits in `read` on it) for the snapshot to keep.
        let _kept = if self.vsock.keep_connection() {
            Some(ping_until_answered_by(
                &uds,
                Duration::from_secs(60),
                false,
            )?)
        } else {
            None
        };
        let reply = ember_vmm::api::call(
            &api,
            &ember_vmm::api::Request::Snapshot {
                dir: snap.clone(),
                kind: ember_vmm::api::SnapshotKind::Full,
                after: ember_vmm::api::AfterSnapshot::Exit,
            },
        )?;
        if reply["ok"] != true {
            return Err(format!("snapshot failed: {reply}"));
        }
        let _ = vm.0.wait();
        if self.prefetch != "off" {
            self.record_working_set(&snap)?;
        }
        Ok(snap)
    }

    /// `ember-vmm` flags of the clones' restores (the working-set recording uses them too, so
    /// that it sees the same guest work).
    fn vsock_flags(&self) -> &'static [&'static str] {
        if self.vsock == VsockMode::Reset {
            &["--vsock-transport-reset"]
        } else {
            &[]
        }
    }

    /// Restores the snapshot once, lets the guest answer a ping, and records the pages it
    /// touched as the snapshot's working set (what later restores prefetch).
    pub fn record_working_set(&self, snap: &Path) -> Result<(), String> {
        let d = self.workdir.join("ember");
        let uds = d.join("ws.vsock");
        let api = d.join("ws.api");
        let child = Command::new(&self.ember_vmm)
            .arg("--restore")
            .arg(snap)
            .arg("--vsock-uds")
            .arg(&uds)
            .arg("--api-sock")
            .arg(&api)
            .args(["--serial", "none", "--prefetch", "off"])
            .args(self.vsock_flags())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start ember-vmm: {e}"))?;
        let _vm = Killer(child);
        ping_until_answered_by(&uds, Duration::from_secs(60), self.vsock.keep_connection())?;
        let reply = ember_vmm::api::call(
            &api,
            &ember_vmm::api::Request::RecordWorkingSet {
                dir: snap.to_path_buf(),
            },
        )?;
        if reply["ok"] != true {
            return Err(format!("recording the working set failed: {reply}"));
        }
        Ok(())
    }

    /// One ember restore: (spawn → vCPU running, spawn → ping answered), in ms.
    pub fn ember_once(&self, snap: &Path, i: usize) -> Result<(f64, f64), String> {
        self.ember_sample(snap, i)
            .map(|s| (s.running_ms, s.ping_ms))
    }

    /// One ember restore with everything measured.
    pub fn ember_sample(&self, snap: &Path, i: usize) -> Result<RestoreSample, String> {
        let d = self.workdir.join("ember");
        let uds = d.join(format!("clone{i}.vsock"));
        let report = d.join(format!("clone{i}.jsonl"));
        let _ = std::fs::remove_file(&report);
        let t0 = monotonic_ns();
        let start = Instant::now();
        let child = Command::new(&self.ember_vmm)
            .arg("--restore")
            .arg(snap)
            .arg("--vsock-uds")
            .arg(&uds)
            .arg("--report")
            .arg(&report)
            .args(["--serial", "none", "--prefetch", &self.prefetch])
            .args(self.vsock_flags())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start ember-vmm: {e}"))?;
        let vm = Killer(child);
        ping_until_answered_by(&uds, Duration::from_secs(60), self.vsock.keep_connection())?;
        let ping_ms = start.elapsed().as_secs_f64() * 1e3;
        let running = wait_until("vcpu_first_run", Duration::from_secs(10), || {
            events(&report)
                .iter()
                .find(|e| e["event"] == "vcpu_first_run")
                .and_then(|e| e["mono_ns"].as_u64())
        })?;
        let first = events(&report)
            .into_iter()
            .find(|e| e["event"] == "guest_first_data");
        let first_answer_ms = first
            .as_ref()
            .and_then(|e| e["mono_ns"].as_u64())
            .map(|ns| ns.saturating_sub(t0) as f64 / 1e6);
        let vmm_counts = first.and_then(|e| {
            serde_json::from_value::<std::collections::BTreeMap<String, u64>>(
                e["kvm"]["vcpu"].clone(),
            )
            .ok()
        });
        drop(vm);
        let _ = std::fs::remove_file(&uds);
        Ok(RestoreSample {
            running_ms: running.saturating_sub(t0) as f64 / 1e6,
            ping_ms,
            first_answer_ms,
            vmm_counts,
        })
    }

    /// Boots Firecracker's template VM and snapshots it once the agent answers.
    pub fn prepare_firecracker(&self, fc: &Path) -> Result<(PathBuf, PathBuf), String> {
        let d = self.workdir.join("firecracker");
        std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
        let uds = d.join("fc.vsock");
        let api = d.join("fc.api");
        let _ = std::fs::remove_file(&uds);
        let _ = std::fs::remove_file(&api);
        let cfg = serde_json::json!({
            "boot-source": { "kernel_image_path": self.kernel, "boot_args": self.boot_args() },
            "drives": [{ "drive_id": "rootfs", "path_on_host": self.rootfs,
                         "is_root_device": true, "is_read_only": true }],
            "machine-config": { "vcpu_count": 1, "mem_size_mib": self.mem_mib },
            "vsock": { "guest_cid": 3, "uds_path": uds },
        });
        let cfg_path = d.join("fc.json");
        std::fs::write(&cfg_path, cfg.to_string()).map_err(|e| e.to_string())?;
        let child = Command::new(fc)
            .arg("--api-sock")
            .arg(&api)
            .arg("--config-file")
            .arg(&cfg_path)
            .args(["--level", "Error"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start firecracker: {e}"))?;
        let mut vm = Killer(child);
        ping_until_answered(&uds, Duration::from_secs(900))?;
        // The same idle connection as ember's template has (Firecracker resets it at restore).
        let _kept = if self.vsock.keep_connection() {
            Some(ping_until_answered_by(
                &uds,
                Duration::from_secs(60),
                false,
            )?)
        } else {
            None
        };
        http(&api, "PATCH", "/vm", r#"{"state":"Paused"}"#)?;
        let state = d.join("snap.state");
        let mem = d.join("snap.mem");
        let body = serde_json::json!({ "snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem });
        http(&api, "PUT", "/snapshot/create", &body.to_string())?;
        let _ = vm.0.kill();
        let _ = vm.0.wait();
        Ok((state, mem))
    }

    /// One Firecracker restore: (spawn → load returned with the VM resumed, spawn → ping).
    pub fn firecracker_once(
        &self,
        fc: &Path,
        state: &Path,
        mem: &Path,
        i: usize,
    ) -> Result<(f64, f64), String> {
        self.firecracker_sample(fc, state, mem, i)
            .map(|s| (s.running_ms, s.ping_ms))
    }

    /// One Firecracker restore with its KVM counters.
    pub fn firecracker_sample(
        &self,
        fc: &Path,
        state: &Path,
        mem: &Path,
        i: usize,
    ) -> Result<RestoreSample, String> {
        let d = self.workdir.join("firecracker");
        let uds = d.join("fc.vsock");
        let api = d.join(format!("fc{i}.api"));
        let _ = std::fs::remove_file(&uds);
        let _ = std::fs::remove_file(&api);
        let start = Instant::now();
        let child = Command::new(fc)
            .arg("--api-sock")
            .arg(&api)
            .args(["--level", "Error"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start firecracker: {e}"))?;
        let vm = Killer(child);
        wait_until("firecracker's API socket", Duration::from_secs(10), || {
            UnixStream::connect(&api).ok()
        })?;
        let body = serde_json::json!({
            "snapshot_path": state,
            "mem_backend": { "backend_type": "File", "backend_path": mem },
            "resume_vm": true,
        });
        http(&api, "PUT", "/snapshot/load", &body.to_string())?;
        let loaded = start.elapsed().as_secs_f64() * 1e3;
        ping_until_answered(&uds, Duration::from_secs(60))?;
        let ping = start.elapsed().as_secs_f64() * 1e3;
        drop(vm);
        let _ = std::fs::remove_file(&api);
        Ok(RestoreSample {
            running_ms: loaded,
            ping_ms: ping,
            first_answer_ms: None,
            vmm_counts: None,
        })
    }

    /// Prepares both snapshots, then restores each system `n` times, interleaved.
    pub fn run(
        &self,
        mut progress: impl FnMut(&str, usize, f64, f64),
    ) -> Result<(Vec<RestoreResult>, Vec<CountResult>), String> {
        let snap = self.prepare_ember()?;
        let fc = match &self.firecracker {
            Some(bin) => Some((bin.clone(), self.prepare_firecracker(bin)?)),
            None => None,
        };
        let (mut es, mut fs) = (Vec::new(), Vec::new());
        for i in 0..self.n {
            let s = self.ember_sample(&snap, i)?;
            progress("ember", i, s.running_ms, s.ping_ms);
            es.push(s);
            if let Some((bin, (state, mem))) = &fc {
                let s = self.firecracker_sample(bin, state, mem, i)?;
                progress("firecracker", i, s.running_ms, s.ping_ms);
                fs.push(s);
            }
        }
        let col = |v: &[RestoreSample], f: fn(&RestoreSample) -> Option<f64>| {
            v.iter().filter_map(f).collect::<Vec<f64>>()
        };
        let e_run = summarize(&col(&es, |s| Some(s.running_ms)));
        let e_ping = summarize(&col(&es, |s| Some(s.ping_ms)));
        let mut out = Vec::new();
        for (sys, measure, s, base) in [
            ("ember", "spawn_to_running", e_run, e_run),
            ("ember", "spawn_to_ping", e_ping, e_ping),
            (
                "ember",
                "spawn_to_first_answer",
                summarize(&col(&es, |s| s.first_answer_ms)),
                None,
            ),
            (
                "firecracker",
                "spawn_to_running",
                summarize(&col(&fs, |s| Some(s.running_ms))),
                e_run,
            ),
            (
                "firecracker",
                "spawn_to_ping",
                summarize(&col(&fs, |s| Some(s.ping_ms))),
                e_ping,
            ),
        ] {
            if let Some(s) = s {
                out.push(RestoreResult {
                    system: sys.into(),
                    measure: measure.into(),
                    ratio_vs_ember: base.map(|b| s.median_ms / b.median_ms),
                    summary: s,
                });
            }
        }
        let mut counts = Vec::new();
        for name in COUNTERS {
            let v: Vec<f64> = es
                .iter()
                .filter_map(|s| s.vmm_counts.as_ref()?.get(*name).map(|&x| x as f64))
                .collect();
            if let Some(sm) = summarize(&v) {
                counts.push(CountResult {
                    system: "ember".into(),
                    counter: (*name).to_string(),
                    n: sm.n,
                    median: sm.median_ms,
                    p95: sm.p95_ms,
                });
            }
        }
        Ok((out, counts))
    }
}

/// A minimal HTTP/1.1 request over a Unix socket (Firecracker's API); Ok on a 2xx status.
pub fn http(sock: &Path, method: &str, path: &str, body: &str) -> Result<String, String> {
    let mut s = UnixStream::connect(sock).map_err(|e| format!("{}: {e}", sock.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(60))).ok();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Accept: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 16384];
    let n = s
        .read(&mut buf)
        .map_err(|e| format!("{method} {path}: {e}"))?;
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    let status: u16 = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    if (200..300).contains(&status) {
        Ok(text)
    } else {
        Err(format!(
            "{method} {path} answered: {}",
            text.lines().last().unwrap_or(&text)
        ))
    }
}

/// Formats the counters as a table (median and p95 per counter).
pub fn counts_table(counts: &[CountResult]) -> String {
    let mut s = format!(
        "{:<8} {:<20} {:>4} {:>10} {:>10}\n",
        "system", "KVM counter", "n", "median", "p95"
    );
    for c in counts {
        s.push_str(&format!(
            "{:<8} {:<20} {:>4} {:>10.0} {:>10.0}\n",
            c.system, c.counter, c.n, c.median, c.p95
        ));
    }
    s
}

/// Formats results as a table.
pub fn table(results: &[RestoreResult]) -> String {
    let mut s = format!(
        "{:<12} {:<18} {:>4} {:>10} {:>10} {:>10}\n",
        "system", "measure", "n", "median ms", "p95 ms", "vs ember"
    );
    for r in results {
        s.push_str(&format!(
            "{:<12} {:<18} {:>4} {:>10.2} {:>10.2} {:>10}\n",
            r.system,
            r.measure,
            r.summary.n,
            r.summary.median_ms,
            r.summary.p95_ms,
            r.ratio_vs_ember
                .map(|x| format!("{x:.2}x"))
                .unwrap_or("-".into())
        ));
    }
    s
}
