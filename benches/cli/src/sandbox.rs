//! `ember bench sandbox`: what a code-interpreter user waits for, per template.
//!
//! - **bare restore → ping**: spawn `ember-vmm --restore` of the template's snapshot, connect to
//!   the agent, `ping` answered (no `sync`): the floor for any restored guest.
//! - **restore → first result**: [`Sandbox::create`] (restore, connect, `sync` of clock and
//!   entropy) and then `run_code('1+1')` answered with its result.
//!
//! The two alternate run by run, so a noisy host hurts both alike; their ratio is the figure
//! (goal: first result within 2× bare restore → ping). Both are measured for each `--vsock`
//! mode, also alternating: `attach` (the first connection takes over the idle agent connection
//! the template's snapshot kept: no reset, no `accept` in the guest), `connect` (a new
//! connection, as before kept connections: the guest resets the kept one and accepts) and
//! `reset` (the VMM restores with `--vsock-transport-reset`). For each, KVM's counters from
//! the restore to the ping's answer and to the first result (the VMM's `stats`: exits,
//! `pf_fixed`, `pf_guest` ≈ guest syscalls on kvm_pvm). Then, on one sandbox, the `run_code`
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
use ember_runtime::agent_link::{self, LinkMode};
use ember_runtime::template::{Template, AGENT_PORT};
use ember_runtime::{Sandbox, SandboxOptions};

use crate::fail;

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
    /// How restored guests get their first agent connection, each measured in turn:
    /// `attach` (the kept connection), `connect` (a new one), `reset` (transport reset).
    #[arg(long, value_delimiter = ',', default_values_t = vec![LinkMode::Attach, LinkMode::Connect])]
    pub vsock: Vec<LinkMode>,
    /// Also measure these languages' contexts on one sandbox of each template (e.g.
    /// `javascript,typescript,r,java` on `code-interpreter`): `context_create` (a warm spare),
    /// the first and second trivial cell, and the guest syscalls one trivial cell costs in
    /// the context's process (strace -f -c, when the template ships strace).
    #[arg(long, value_delimiter = ',')]
    pub languages: Vec<String>,
}

/// A cell that does next to nothing in `language`, and the text its result must have (None:
/// no result, only a clean end).
fn trivial_cell(language: &str) -> (&'static str, Option<&'static str>) {
    match language {
        "bash" => ("true", None),
        "r" => ("1 + 1", Some("[1] 2")),
        _ => ("1 + 1", Some("2")),
    }
}

/// What one language's context measured on a restored sandbox.
struct LanguageFigures {
    context_create_ms: f64,
    first_cell_ms: f64,
    second_cell_ms: f64,
    /// Per trivial cell, in the context's process (all its threads); None: no strace.
    syscalls: Option<Result<f64, String>>,
}

fn language_figures(sb: &Sandbox, language: &str) -> Result<LanguageFigures, String> {
    let t0 = Instant::now();
    let ctx = sb
        .context_create(language, None)
        .map_err(|e| format!("context_create: {e}"))?;
    let context_create_ms = t0.elapsed().as_secs_f64() * 1e3;
    let (code, text) = trivial_cell(language);
    let req = RunCodeRequest {
        context: Some(ctx.clone()),
        ..RunCodeRequest::new(code)
    };
    let cell = || -> Result<f64, String> {
        let t = Instant::now();
        let mut got = None;
        let end = sb
            .run_code(&req, |ev| {
                if let EventKind::Result(r) = ev {
                    got = r
                        .data
                        .get("text/plain")
                        .and_then(|v| v.as_str())
                        .map(str::to_owned);
                }
            })
            .map_err(|e| e.to_string())?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if end.status != EndStatus::Ok || text.is_some_and(|want| got.as_deref() != Some(want)) {
            return Err(format!("{code:?} ended {:?} with {got:?}", end.status));
        }
        Ok(ms)
    };
    let first_cell_ms = cell()?;
    let second_cell_ms = cell()?;
    let syscalls = match sb.stat(STRACE) {
        Ok(_) => {
            let pid = sb
                .context_list()
                .map_err(|e| e.to_string())?
                .into_iter()
                .find(|c| c.id == ctx)
                .map(|c| i64::from(c.pid))
                .ok_or_else(|| format!("context {ctx} is not listed"))?;
            const KS: u64 = 5;
            Some(
                traced_syscalls(sb, pid, 0, &req)
                    .and_then(|base| Ok((base, traced_syscalls(sb, pid, KS, &req)?)))
                    .map(|(base, with)| with.saturating_sub(base) as f64 / KS as f64),
            )
        }
        Err(_) => None,
    };
    let _ = sb.context_remove(&ctx);
    Ok(LanguageFigures {
        context_create_ms,
        first_cell_ms,
        second_cell_ms,
        syscalls,
    })
}

/// KVM counters (per vCPU, summed) reported from the restore to an answer.
const COUNTERS: &[&str] = &[
    "exits",
    "pf_fixed",
    "pf_guest",
    "irq_injections",
    "insn_emulation",
];

/// The VMM's KVM counters now (its `stats` request on `api`).
fn kvm_counts(api: &std::path::Path) -> Option<std::collections::BTreeMap<String, u64>> {
    let r = ember_vmm::api::call(api, &ember_vmm::api::Request::Stats).ok()?;
    serde_json::from_value(r["stats"]["kvm"]["vcpu"].clone()).ok()
}

/// One bare restore: spawn → the agent's `ping` answered (ms), and KVM's counters then.
fn bare_restore_ping(
    t: &Template,
    vmm: &std::path::Path,
    mode: LinkMode,
) -> Result<(f64, Option<std::collections::BTreeMap<String, u64>>), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let uds = dir.path().join("vsock");
    let api = dir.path().join("api.sock");
    let kept = match mode {
        LinkMode::Attach => agent_link::recorded(&t.snapshot_dir()),
        _ => None,
    };
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
        .arg("--api-sock")
        .arg(&api)
        .args((mode == LinkMode::TransportReset).then_some("--vsock-transport-reset"))
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
            let attempt = match kept {
                Some(k) => agent_link::attach(&uds, k, Duration::from_secs(60)).map(|(c, _)| c),
                None => Client::connect_uds(&uds, AGENT_PORT, Duration::from_secs(60)),
            };
            match attempt {
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
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok((ms, kvm_counts(&api)))
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// What one sandbox measured.
struct First {
    /// Spawn → synced, spawn → first `1+1` result, `context_create` python and bash (ms).
    ms: [f64; 4],
    /// KVM's counters at the first result.
    counts: Option<std::collections::BTreeMap<String, u64>>,
    /// Whether the first connection was the kept one.
    attached: bool,
}

fn first_result(t: &Template, vmm: &std::path::Path, mode: LinkMode) -> Result<First, String> {
    let t0 = Instant::now();
    let opts = SandboxOptions {
        vmm: Some(vmm.to_path_buf()),
        link: mode,
        ..Default::default()
    };
    let sb = Sandbox::create(t, &opts).map_err(|e| e.to_string())?;
    let synced = t0.elapsed().as_secs_f64() * 1e3;
    let x = sb.run("1+1").map_err(|e| e.to_string())?;
    let total = t0.elapsed().as_secs_f64() * 1e3;
    let counts = kvm_counts(sb.api_socket());
    if x.text() != Some("2") {
        return Err(format!("1+1 gave {:?}", x.text()));
    }
    let attached = sb.link().is_some_and(|l| l.attached());
    let mut ctx = [0.0; 2];
    for (i, lang) in ["python", "bash"].into_iter().enumerate() {
        let t1 = Instant::now();
        sb.context_create(lang, None).map_err(|e| e.to_string())?;
        ctx[i] = t1.elapsed().as_secs_f64() * 1e3;
    }
    Ok(First {
        ms: [synced, total, ctx[0], ctx[1]],
        counts,
        attached,
    })
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
    measure: String,
    summary: Summary,
}

/// Samples of one `--vsock` mode.
#[derive(Default)]
struct ModeSamples {
    ping: Vec<f64>,
    synced: Vec<f64>,
    first: Vec<f64>,
    ctx_py: Vec<f64>,
    ctx_bash: Vec<f64>,
    /// Counter → values at the ping's answer.
    ping_counts: std::collections::BTreeMap<String, Vec<f64>>,
    /// Counter → values at the first result.
    first_counts: std::collections::BTreeMap<String, Vec<f64>>,
    /// Creates whose first connection was the kept one.
    attached: usize,
}

fn push_counts(
    into: &mut std::collections::BTreeMap<String, Vec<f64>>,
    counts: Option<std::collections::BTreeMap<String, u64>>,
) {
    for (k, v) in counts.unwrap_or_default() {
        if COUNTERS.contains(&k.as_str()) {
            into.entry(k).or_default().push(v as f64);
        }
    }
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
        let t = match crate::open_or_build(name, a.json) {
            Ok(t) => t,
            Err(e) => return fail(e),
        };
        let modes = a.vsock.clone();
        let mut per_mode: Vec<ModeSamples> = modes.iter().map(|_| ModeSamples::default()).collect();
        if modes.contains(&LinkMode::Attach) && agent_link::recorded(&t.snapshot_dir()).is_none() {
            eprintln!(
                "{name}: the template's snapshot records no kept agent connection (built \
                 before they existed?): `attach` connects anew"
            );
        }
        for i in 0..a.warmup + a.n {
            // Modes alternate run by run (a noisy host hurts them alike).
            for (m, &mode) in modes.iter().enumerate() {
                let (p, pc) = match bare_restore_ping(&t, &vmm, mode) {
                    Ok(v) => v,
                    Err(e) => return fail(format!("{name}: bare restore ({mode}): {e}")),
                };
                let f = match first_result(&t, &vmm, mode) {
                    Ok(v) => v,
                    Err(e) => return fail(format!("{name}: first run_code ({mode}): {e}")),
                };
                if i >= a.warmup {
                    let s = &mut per_mode[m];
                    s.ping.push(p);
                    s.synced.push(f.ms[0]);
                    s.first.push(f.ms[1]);
                    s.ctx_py.push(f.ms[2]);
                    s.ctx_bash.push(f.ms[3]);
                    push_counts(&mut s.ping_counts, pc);
                    push_counts(&mut s.first_counts, f.counts);
                    s.attached += usize::from(f.attached);
                }
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
        for language in &a.languages {
            if !a.json {
                eprintln!("{name}: {language} contexts");
            }
            let f = match language_figures(&sb, language) {
                Ok(f) => f,
                Err(e) => return fail(format!("{name}: {language}: {e}")),
            };
            extra.push(serde_json::json!({
                "template": name,
                "language": language,
                "context_create_ms": f.context_create_ms,
                "first_cell_ms": f.first_cell_ms,
                "second_cell_ms": f.second_cell_ms,
                "guest_syscalls_per_cell": match f.syscalls {
                    Some(Ok(n)) => serde_json::json!(n),
                    Some(Err(e)) => serde_json::json!({"unavailable": e}),
                    None => serde_json::json!({"unavailable": "the template has no strace"}),
                },
            }));
        }
        let _ = sb.kill();
        for (mode, s) in modes.iter().zip(&per_mode) {
            for (measure, samples) in [
                ("bare restore → ping", &s.ping),
                ("restore → synced", &s.synced),
                ("restore → first run_code result", &s.first),
                ("context_create python (spare)", &s.ctx_py),
                ("context_create bash (spare)", &s.ctx_bash),
            ] {
                if let Some(summary) = summarize(samples) {
                    rows.push(Row {
                        template: name.clone(),
                        measure: format!("{measure} [{mode}]"),
                        summary,
                    });
                }
            }
            let median = |v: &Vec<f64>| summarize(v).map(|s| s.median_ms);
            let counts = |m: &std::collections::BTreeMap<String, Vec<f64>>| {
                m.iter()
                    .map(|(k, v)| (k.clone(), serde_json::json!(median(v))))
                    .collect::<serde_json::Map<_, _>>()
            };
            extra.push(serde_json::json!({
                "template": name,
                "vsock": mode.to_string(),
                "attached_creates": s.attached,
                "creates": s.first.len(),
                "kvm_median_restore_to_ping": counts(&s.ping_counts),
                "kvm_median_restore_to_first_result": counts(&s.first_counts),
            }));
        }
        if let Some(summary) = summarize(&rtt) {
            rows.push(Row {
                template: name.clone(),
                measure: "run_code round trip (x = 1)".into(),
                summary,
            });
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
            "\n{:<14} {:<44} {:>4} {:>10} {:>10} {:>8}",
            "template", "measure", "n", "median ms", "p95 ms", "vs ping"
        );
        for r in &rows {
            // Against the bare restore of the same mode (the mode is the bracketed suffix).
            let mode = r.measure.rsplit_once(" [").map(|(_, m)| m).unwrap_or("");
            let base = rows
                .iter()
                .find(|b| {
                    b.template == r.template
                        && b.measure.starts_with("bare restore → ping")
                        && b.measure.ends_with(&format!("[{mode}"))
                })
                .map(|b| b.summary.median_ms)
                .unwrap_or(f64::NAN);
            let ratio = if r.measure.starts_with("restore") || r.measure.starts_with("bare") {
                format!("{:.2}", r.summary.median_ms / base)
            } else {
                "-".into()
            };
            println!(
                "{:<14} {:<44} {:>4} {:>10.2} {:>10.2} {:>8}",
                r.template, r.measure, r.summary.n, r.summary.median_ms, r.summary.p95_ms, ratio
            );
        }
    }
    if !a.json {
        for e in &extra {
            if let Some(language) = e["language"].as_str() {
                println!(
                    "{} [{language}]: context_create {:.0} ms, first cell {:.0} ms, second cell \
                     {:.0} ms, guest syscalls per trivial cell {}",
                    e["template"].as_str().unwrap_or("?"),
                    e["context_create_ms"].as_f64().unwrap_or(f64::NAN),
                    e["first_cell_ms"].as_f64().unwrap_or(f64::NAN),
                    e["second_cell_ms"].as_f64().unwrap_or(f64::NAN),
                    e["guest_syscalls_per_cell"]
                );
                continue;
            }
            if let Some(mode) = e["vsock"].as_str() {
                println!(
                    "{} [{mode}]: {}/{} first connections attached; KVM counters (median) \
                     restore → ping {} ; restore → first result {}",
                    e["template"].as_str().unwrap_or("?"),
                    e["attached_creates"],
                    e["creates"],
                    e["kvm_median_restore_to_ping"],
                    e["kvm_median_restore_to_first_result"]
                );
                continue;
            }
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
