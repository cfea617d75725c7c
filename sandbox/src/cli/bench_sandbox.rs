//! `ember bench sandbox`: what a code-interpreter user waits for, per template.
//!
//! - **bare restore → ping**: spawn `ember-vmm --restore` of the template's snapshot, connect to
//!   the agent, `ping` answered (no `sync`): the floor for any restored guest.
//! - **restore → first result**: [`Sandbox::create`] (restore, connect, `sync` of clock and
//!   entropy) and then `run_code('1+1')` answered with its result.
//!
//! The two alternate run by run, so a noisy host hurts both alike; their ratio is the figure
//! (goal: first result within 2× bare restore → ping). Then, on one sandbox, the `run_code`
//! round trip of a trivial statement, and the guest page faults one trivial `run_code` costs
//! in the agent (PID 1) and the context's driver, read from `/proc/PID/stat` (minflt + majflt)
//! around a batch of calls, less the same reads around nothing.

use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use ember_agent::client::Client;
use ember_agent::protocol::{EndStatus, EventKind, ExecRequest, RunCodeRequest};
use ember_benches::stats::{summarize, Summary};
use ember_sandbox::template::{Template, AGENT_PORT};
use ember_sandbox::{Sandbox, SandboxOptions};

use super::fail;

/// `ember bench sandbox`.
#[derive(Debug, Args)]
pub struct BenchSandboxArgs {
    /// Templates to measure (built first if needed).
    #[arg(short, long, default_values_t = vec!["default".to_string()])]
    pub template: Vec<String>,
    /// Runs of each measure.
    #[arg(long, default_value_t = 30)]
    pub n: usize,
    /// Warm-up runs, discarded.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// JSON lines only.
    #[arg(long)]
    pub json: bool,
}

fn bare_restore_ping(t: &Template, vmm: &std::path::Path) -> Result<f64, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let uds = dir.path().join("vsock");
    // A networked template's TAP, in an isolated namespace made before the clock starts.
    let netns = ember_vmm::netns::for_snapshot(&t.snapshot_dir())?;
    let mut command = Command::new(vmm);
    if let Some(ns) = &netns {
        ns.enter_on_exec(&mut command).map_err(|e| e.to_string())?;
    }
    let t0 = Instant::now();
    let mut child = command
        .arg("--restore")
        .arg(t.snapshot_dir())
        .arg("--vsock-uds")
        .arg(&uds)
        .arg("--disk-path")
        .arg(dir.path().join("root.overlay"))
        .arg("--serial")
        .arg("none")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", vmm.display()))?;
    let result = (|| {
        while !uds.exists() {
            if let Ok(Some(st)) = child.try_wait() {
                return Err(format!("VMM exited ({st})"));
            }
            if t0.elapsed() > Duration::from_secs(60) {
                return Err("no vsock socket after 60 s".into());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // Refused until the VMM's listen() follows the bind() that made the file.
        let mut c = loop {
            match Client::connect_uds(&uds, AGENT_PORT, Duration::from_secs(60)) {
                Ok(c) => break c,
                Err(ember_agent::client::ClientError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::ConnectionRefused
                        && t0.elapsed() < Duration::from_secs(60) =>
                {
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err(e) => return Err(e.to_string()),
            }
        };
        c.ping().map_err(|e| e.to_string())?;
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// One sandbox: (spawn → synced, spawn → first `1+1` result, `context_create` python,
/// `context_create` bash), milliseconds.
fn first_result(t: &Template, vmm: &std::path::Path) -> Result<[f64; 4], String> {
    let t0 = Instant::now();
    let opts = SandboxOptions {
        vmm: Some(vmm.to_path_buf()),
        ..Default::default()
    };
    let sb = Sandbox::create(t, &opts).map_err(|e| e.to_string())?;
    let synced = t0.elapsed().as_secs_f64() * 1e3;
    let x = sb.run("1+1").map_err(|e| e.to_string())?;
    let total = t0.elapsed().as_secs_f64() * 1e3;
    if x.text() != Some("2") {
        return Err(format!("1+1 gave {:?}", x.text()));
    }
    let mut ctx = [0.0; 2];
    for (i, lang) in ["python", "bash"].into_iter().enumerate() {
        let t1 = Instant::now();
        sb.context_create(lang, None).map_err(|e| e.to_string())?;
        ctx[i] = t1.elapsed().as_secs_f64() * 1e3;
    }
    Ok([synced, total, ctx[0], ctx[1]])
}

/// minflt + majflt of guest process `pid`, read through the file API.
fn faults(sb: &Sandbox, pid: i64) -> Result<u64, String> {
    let mut buf = Vec::new();
    sb.read_file(&format!("/proc/{pid}/stat"), &mut buf)
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf);
    // Fields after the parenthesised command name: state is field 3; minflt 10, majflt 12.
    let rest = text.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let min: u64 = f.get(7).and_then(|v| v.parse().ok()).ok_or("bad stat")?;
    let maj: u64 = f.get(9).and_then(|v| v.parse().ok()).ok_or("bad stat")?;
    Ok(min + maj)
}

/// Guest processes are traced with `strace -c` (in the template when it ships strace).
const STRACE: &str = "/usr/bin/strace";

/// Syscalls `pid` makes while `k` trivial `run_code`s run, counted by `strace -f -c` in the
/// guest (all its threads). The tracer's own start and stop cost the traced process a few
/// calls; callers subtract a run with `k = 0`.
fn traced_syscalls(sb: &Sandbox, pid: i64, k: u64, req: &RunCodeRequest) -> Result<u64, String> {
    let out = format!("/tmp/ember-strace-{pid}-{k}.txt");
    let argv = [
        STRACE.to_string(),
        "-f".into(),
        "-c".into(),
        "-qq".into(),
        "-o".into(),
        out.clone(),
        "-p".into(),
        pid.to_string(),
    ];
    let tracer = sb
        .exec_background(&ExecRequest::new(argv))
        .map_err(|e| e.to_string())?;
    // Wait until the tracer is attached (TracerPid in the traced process's status).
    let t0 = Instant::now();
    loop {
        let mut buf = Vec::new();
        sb.read_file(&format!("/proc/{pid}/status"), &mut buf)
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&buf);
        let traced = text
            .lines()
            .find_map(|l| l.strip_prefix("TracerPid:"))
            .is_some_and(|v| v.trim() != "0");
        if traced {
            // The main thread is traced first; give strace time to seize the others (a
            // SIGINT in the middle of attaching ends it without a summary).
            std::thread::sleep(Duration::from_secs(2));
            break;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            return Err(format!("strace did not attach to {pid} within 60 s"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..k {
        sb.run_code(req, |_: &EventKind| {})
            .map_err(|e| e.to_string())?;
    }
    sb.process_signal(tracer, libc::SIGINT)
        .map_err(|e| e.to_string())?;
    sb.process_attach(tracer, |_| {})
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    sb.read_file(&out, &mut buf).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf);
    // No syscall at all while traced: strace -c writes no table.
    if text.trim().is_empty() {
        return Ok(0);
    }
    // The summary's last line: "100.00 <secs> <usecs/call> <calls> [errors] total".
    text.lines()
        .rev()
        .find(|l| l.trim_end().ends_with("total"))
        .and_then(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(3).and_then(|v| v.parse().ok())
        })
        .ok_or_else(|| format!("no strace summary in {out}: {text}"))
}

struct Row {
    template: String,
    measure: &'static str,
    summary: Summary,
}

/// Runs the benchmark.
pub fn main(a: BenchSandboxArgs) -> ExitCode {
    let vmm: PathBuf = match ember_vmm::launcher::find_vmm_binary() {
        Ok(v) => v,
        Err(e) => return fail(e),
    };
    let mut rows = Vec::new();
    let mut extra = Vec::new();
    for name in &a.template {
        let t = match super::run::open_or_build(name, a.json) {
            Ok(t) => t,
            Err(e) => return fail(e),
        };
        let (mut ping, mut synced, mut first) = (Vec::new(), Vec::new(), Vec::new());
        let (mut ctx_py, mut ctx_bash) = (Vec::new(), Vec::new());
        for i in 0..a.warmup + a.n {
            let p = match bare_restore_ping(&t, &vmm) {
                Ok(v) => v,
                Err(e) => return fail(format!("{name}: bare restore: {e}")),
            };
            let [s, f, cp, cb] = match first_result(&t, &vmm) {
                Ok(v) => v,
                Err(e) => return fail(format!("{name}: first run_code: {e}")),
            };
            if i >= a.warmup {
                ping.push(p);
                synced.push(s);
                first.push(f);
                ctx_py.push(cp);
                ctx_bash.push(cb);
            }
            if !a.json {
                eprint!("\r{name}: {}/{}   ", i + 1, a.warmup + a.n);
            }
        }
        if !a.json {
            eprintln!();
        }
        // Round trips and guest page faults on one sandbox.
        let opts = SandboxOptions {
            vmm: Some(vmm.clone()),
            ..Default::default()
        };
        let sb = match Sandbox::create(&t, &opts) {
            Ok(s) => s,
            Err(e) => return fail(e),
        };
        let mut rtt = Vec::new();
        let req = RunCodeRequest {
            code: "x = 1".into(),
            ..Default::default()
        };
        for i in 0..a.warmup + a.n {
            let t0 = Instant::now();
            match sb.run_code(&req, |_| {}) {
                Ok(end) if end.status == EndStatus::Ok => {}
                Ok(end) => return fail(format!("x = 1 ended {:?}", end.status)),
                Err(e) => return fail(e),
            }
            if i >= a.warmup {
                rtt.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        let driver_pid = match sb.context_list() {
            Ok(list) => list
                .iter()
                .find(|c| c.id == "default")
                .map(|c| c.pid as i64)
                .unwrap_or(0),
            Err(e) => return fail(e),
        };
        let count = |sb: &Sandbox| -> Result<(u64, u64), String> {
            Ok((faults(sb, 1)?, faults(sb, driver_pid)?))
        };
        const K: u64 = 20;
        let per_call = (|| -> Result<(f64, f64), String> {
            // Baseline: the reads themselves.
            let a0 = count(&sb)?;
            let a1 = count(&sb)?;
            let base_agent = a1.0.saturating_sub(a0.0);
            let base_driver = a1.1.saturating_sub(a0.1);
            let b0 = count(&sb)?;
            for _ in 0..K {
                sb.run_code(&req, |_: &EventKind| {})
                    .map_err(|e| e.to_string())?;
            }
            let b1 = count(&sb)?;
            let agent = b1.0.saturating_sub(b0.0).saturating_sub(base_agent) as f64 / K as f64;
            let driver = b1.1.saturating_sub(b0.1).saturating_sub(base_driver) as f64 / K as f64;
            Ok((agent, driver))
        })();
        let per_call = match per_call {
            Ok(v) => v,
            Err(e) => return fail(format!("page-fault count: {e}")),
        };
        // Guest syscalls per trivial run_code, agent and driver, when the template has strace.
        let syscalls = match sb.stat(STRACE) {
            Ok(_) => {
                const KS: u64 = 10;
                let count = |pid: i64| -> Result<f64, String> {
                    let base = traced_syscalls(&sb, pid, 0, &req)?;
                    let with = traced_syscalls(&sb, pid, KS, &req)?;
                    Ok(with.saturating_sub(base) as f64 / KS as f64)
                };
                match (count(1), count(driver_pid)) {
                    (Ok(a), Ok(d)) => Some(Ok((a, d))),
                    (Err(e), _) | (_, Err(e)) => Some(Err(e)),
                }
            }
            Err(_) => None,
        };
        let _ = sb.kill();
        for (measure, samples) in [
            ("bare restore → ping", &ping),
            ("restore → synced", &synced),
            ("restore → first run_code result", &first),
            ("run_code round trip (x = 1)", &rtt),
            ("context_create python (spare)", &ctx_py),
            ("context_create bash (spare)", &ctx_bash),
        ] {
            if let Some(summary) = summarize(samples) {
                rows.push(Row {
                    template: name.clone(),
                    measure,
                    summary,
                });
            }
        }
        extra.push(serde_json::json!({
            "template": name,
            "guest_page_faults_per_run_code": {"agent": per_call.0, "driver": per_call.1},
            "guest_syscalls_per_run_code": match syscalls {
                Some(Ok((a, d))) => serde_json::json!({"agent": a, "driver": d}),
                Some(Err(e)) => serde_json::json!({"unavailable": e}),
                None => serde_json::json!({"unavailable": "the template has no strace"}),
            },
        }));
    }
    for r in &rows {
        println!(
            "{}",
            serde_json::json!({"bench": "sandbox", "template": r.template, "measure": r.measure, "summary": r.summary})
        );
    }
    for e in &extra {
        println!("{e}");
    }
    if !a.json {
        println!(
            "\n{:<14} {:<34} {:>4} {:>10} {:>10} {:>10}",
            "template", "measure", "n", "median ms", "p95 ms", "vs ping"
        );
        for r in &rows {
            let base = rows
                .iter()
                .find(|b| b.template == r.template && b.measure == "bare restore → ping")
                .map(|b| b.summary.median_ms)
                .unwrap_or(f64::NAN);
            let ratio = if r.measure.starts_with("restore") || r.measure.starts_with("bare") {
                format!("{:.2}", r.summary.median_ms / base)
            } else {
                "-".into()
            };
            println!(
                "{:<14} {:<34} {:>4} {:>10.2} {:>10.2} {:>10}",
                r.template, r.measure, r.summary.n, r.summary.median_ms, r.summary.p95_ms, ratio
            );
        }
    }
    if !a.json {
        for e in &extra {
            println!(
                "{}: per trivial run_code in the guest: page faults {} ; syscalls {}",
                e["template"].as_str().unwrap_or("?"),
                e["guest_page_faults_per_run_code"],
                e["guest_syscalls_per_run_code"]
            );
        }
    }
    ExitCode::SUCCESS
}
