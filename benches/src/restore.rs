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
    let t = Instant::now();
    let mut last = String::new();
    while t.elapsed() < timeout {
        match Client::connect_uds(uds, AGENT_PORT, Duration::from_secs(10)) {
            Ok(mut c) => match c.ping() {
                Ok(_) => return Ok(()),
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
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
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start ember-vmm: {e}"))?;
        let _vm = Killer(child);
        ping_until_answered(&uds, Duration::from_secs(60))?;
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
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start ember-vmm: {e}"))?;
        let _vm = Killer(child);
        ping_until_answered(&uds, Duration::from_secs(60))?;
        let ping_ms = start.elapsed().as_secs_f64() * 1e3;
        let running = wait_until("vcpu_first_run", Duration::from_secs(10), || {
            events(&report)
                .iter()
                .find(|e| e["event"] == "vcpu_first_run")
                .and_then(|e| e["mono_ns"].as_u64())
        })?;
        let _ = std::fs::remove_file(&uds);
        Ok((running.saturating_sub(t0) as f64 / 1e6, ping_ms))
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
        let _vm = Killer(child);
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
        let _ = std::fs::remove_file(&api);
        Ok((loaded, ping))
    }

    /// Prepares both snapshots, then restores each system `n` times, interleaved.
    pub fn run(
        &self,
        mut progress: impl FnMut(&str, usize, f64, f64),
    ) -> Result<Vec<RestoreResult>, String> {
        let snap = self.prepare_ember()?;
        let fc = match &self.firecracker {
            Some(bin) => Some((bin.clone(), self.prepare_firecracker(bin)?)),
            None => None,
        };
        let (mut er, mut ep, mut fr, mut fp) = (vec![], vec![], vec![], vec![]);
        for i in 0..self.n {
            let (r, p) = self.ember_once(&snap, i)?;
            progress("ember", i, r, p);
            er.push(r);
            ep.push(p);
            if let Some((bin, (state, mem))) = &fc {
                let (r, p) = self.firecracker_once(bin, state, mem, i)?;
                progress("firecracker", i, r, p);
                fr.push(r);
                fp.push(p);
            }
        }
        let mut out = Vec::new();
        let e_run = summarize(&er);
        let e_ping = summarize(&ep);
        for (sys, measure, s, base) in [
            ("ember", "spawn_to_running", e_run, e_run),
            ("ember", "spawn_to_ping", e_ping, e_ping),
            ("firecracker", "spawn_to_running", summarize(&fr), e_run),
            ("firecracker", "spawn_to_ping", summarize(&fp), e_ping),
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
        Ok(out)
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
