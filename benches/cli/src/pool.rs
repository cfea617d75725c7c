//! `ember bench pool`: the warm pool of jailed VMMs, measured through the HTTP API of an
//! in-process server (jailed, cgroup limits set, as `ember serve` runs them).
//!
//! 1. **create request → restored vCPU in KVM_RUN**, host side, with the pool off and on: the
//!    bench reads `CLOCK_MONOTONIC` just before it sends `POST /v1/sandboxes`, and the VMM's
//!    report records the same clock when its first vCPU thread enters `KVM_RUN`
//!    (`vcpu_first_run`; the runtime copies it into the create's audit record). Beside it the
//!    breakdown: HTTP + runtime up to the claim or spawn, the VMM's restore, then the agent's
//!    answer (create answered) and the first `run_code` result.
//! 2. **throughput**: with the pool on, C clients (1, 4, 16, 64) each create a sandbox, run
//!    `1+1` until its result and hand the sandbox to a killer thread, in a loop for D
//!    seconds: completed creates per second, create → first result latency, the pool's hits
//!    and misses, and the CPU time spent per create by the server (this process) and by the
//!    VMMs and tools it started (reaped children: guest execution counts there).

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use ember_benches::stats::summarize;
use ember_runtime::pool::PoolSettings;
use ember_runtime::AuditFilter;
use ember_server::client::Client;
use serde_json::{json, Value};

use crate::api::{api_run, catch_sigint, check_interrupt, ms_since, Local, Target, Tracker};
use crate::fail;

/// `ember bench pool`.
#[derive(Debug, Args)]
pub struct BenchPoolArgs {
    /// The template.
    #[arg(short, long, default_value = "default")]
    pub template: String,
    /// Sequential creates per pool setting for the latency measure (0: skip it).
    #[arg(short, long, default_value_t = 20)]
    pub n: usize,
    /// Warm VMMs per template when the pool is on.
    #[arg(long, default_value_t = 4)]
    pub pool: usize,
    /// Most warm VMMs per template (the pool grows with the create rate up to this).
    #[arg(long, default_value_t = 64)]
    pub pool_max: usize,
    /// Concurrent clients of the throughput measure (comma-separated; `--clients` with no
    /// value skips it).
    #[arg(long, value_delimiter = ',', num_args = 0.., default_values_t = vec![1, 4, 16, 64])]
    pub clients: Vec<usize>,
    /// The runtime's admission limit on VM starts during the throughput measure (0: no
    /// limit; default: the runtime's, twice the host's CPUs).
    #[arg(long, value_name = "N")]
    pub max_starting: Option<usize>,
    /// Seconds each concurrency level runs.
    #[arg(long, default_value_t = 30)]
    pub secs: u64,
    /// JSON lines only.
    #[arg(long)]
    pub json: bool,
}

/// KVM counters reported per create and per cell.
const COUNTERS: &[&str] = &["insn_emulation", "exits", "pf_fixed", "pf_guest"];

type Counts = std::collections::BTreeMap<String, u64>;

/// The sandbox VMM's KVM counters since its restore (None when they cannot be read).
pub(crate) fn kvm_counts(rt: &ember_runtime::Runtime, id: &str) -> Option<Counts> {
    let s = rt.vmm_stats(id).ok()?;
    serde_json::from_value(s["kvm"]["vcpu"].clone()).ok()
}

fn mono_ns() -> u64 {
    ember_vmm::report::monotonic_ns()
}

/// The `vmm` part of a create's audit record.
pub(crate) fn start_info(target: &Target, id: &str) -> Value {
    let rt = target.local.as_ref().and_then(|l| l.rt.as_ref());
    let recs = rt
        .and_then(|rt| {
            rt.audit(&AuditFilter {
                sandbox: Some(id.to_string()),
                call: Some("create".into()),
                ..Default::default()
            })
            .ok()
        })
        .unwrap_or_default();
    recs.first()
        .map(|r| r.args["vmm"].clone())
        .unwrap_or(Value::Null)
}

fn summary(name: &str, samples: &[f64]) -> Value {
    match summarize(samples) {
        Some(s) => json!({
            "measure": name, "n": s.n, "median_ms": s.median_ms, "p95_ms": s.p95_ms,
            "min_ms": s.min_ms, "max_ms": s.max_ms,
        }),
        None => json!({ "measure": name, "n": 0 }),
    }
}

fn print(quiet: bool, v: &Value) {
    if quiet {
        println!("{v}");
        return;
    }
    match v["measure"].as_str() {
        Some(m) if v["median"].is_number() => {
            eprintln!(
                "  {m:<60} median {:>10.0}  (n={})",
                v["median"].as_f64().unwrap_or(0.0),
                v["n"]
            )
        }
        Some(m) if v["median_ms"].is_number() => eprintln!(
            "  {m:<44} median {:>8.2} ms  p95 {:>8.2} ms  (n={})",
            v["median_ms"].as_f64().unwrap_or(0.0),
            v["p95_ms"].as_f64().unwrap_or(0.0),
            v["n"]
        ),
        _ => eprintln!("  {v}"),
    }
}

/// One pool setting: a server with it, `n` sequential creates.
fn latency(a: &BenchPoolArgs, pool: usize, prime: bool) -> Result<Vec<Value>, String> {
    let settings = PoolSettings {
        size: pool,
        max: a.pool_max.max(pool),
        prime,
        ..PoolSettings::default()
    };
    let (target, rt) = Target::start_local(settings).map_err(|e| e.to_string())?;
    let label = match (pool, prime) {
        (0, _) => "fresh",
        (_, false) => "pool (unprimed)",
        (_, true) => "pool (primed)",
    };
    let mut to_first_run = Vec::new();
    let mut to_vmm = Vec::new();
    let mut vcpus_to_run = Vec::new();
    let mut steps: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let mut in_runtime = Vec::new();
    let mut restore = Vec::new();
    let mut answered = Vec::new();
    let mut first_result = Vec::new();
    let mut second_result = Vec::new();
    let mut guest: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let mut paths = std::collections::BTreeMap::<String, usize>::new();
    let r = (|| -> Result<(), String> {
        for i in 0..a.n + 1 {
            check_interrupt().map_err(|e| e.to_string())?;
            if pool > 0 && !rt.pool_wait_ready(pool.min(2), Duration::from_secs(120)) {
                return Err(format!("the pool did not fill: {:?}", rt.pool_stats()));
            }
            let t0 = Instant::now();
            let sent = mono_ns();
            let info = target.create(&a.template).map_err(|e| e.to_string())?;
            let created = ms_since(t0);
            let c0 = kvm_counts(&rt, &info.id);
            let (first, _) =
                api_run(&target.client, &info.id, "1+1", t0).map_err(|e| e.to_string())?;
            let c1 = kvm_counts(&rt, &info.id);
            // The same cell again: a warm round trip in the same conditions, what the first
            // cell costs beyond it is the first-cell overhead.
            let t1 = Instant::now();
            let (again, _) =
                api_run(&target.client, &info.id, "2+2", t1).map_err(|e| e.to_string())?;
            let c2 = kvm_counts(&rt, &info.id);
            let vmm = start_info(&target, &info.id);
            target.kill(&info.id).map_err(|e| e.to_string())?;
            if i == 0 {
                continue; // warm-up
            }
            *paths
                .entry(vmm["path"].as_str().unwrap_or("?").to_string())
                .or_default() += 1;
            // A primed member's vCPUs ran before the create: no create → KVM_RUN figure.
            if let Some(ns) = vmm["first_run_mono_ns"].as_u64().filter(|_| !prime) {
                to_first_run.push(ns.saturating_sub(sent) as f64 / 1e6);
            }
            if let Some(ns) = vmm["vmm_began_mono_ns"].as_u64().filter(|_| !prime) {
                to_vmm.push(ns.saturating_sub(sent) as f64 / 1e6);
            }
            if let (Some(a), Some(b)) = (
                vmm["vcpus_started_mono_ns"].as_u64(),
                vmm["first_run_mono_ns"].as_u64(),
            ) {
                vcpus_to_run.push(b.saturating_sub(a) as f64 / 1e6);
            }
            if let Some(m) = vmm["restore_steps_ms"].as_object() {
                for (k, v) in m {
                    if let Some(v) = v.as_f64() {
                        steps.entry(k.clone()).or_default().push(v);
                    }
                }
            }
            if let Some(ms) = vmm["to_first_run_ms"].as_f64().filter(|_| !prime) {
                in_runtime.push(ms);
            }
            if let Some(ms) = vmm["restore_ms"].as_f64() {
                restore.push(ms);
            }
            answered.push(created);
            first_result.push(first);
            second_result.push(again);
            if i > 0 {
                for k in COUNTERS {
                    let at = |c: &Option<Counts>| c.as_ref().and_then(|c| c.get(*k)).copied();
                    // Since the restore: for a primed member that includes its priming.
                    if let Some(v) = at(&c0).filter(|_| !prime) {
                        guest
                            .entry(format!("restore → create answered: {k}"))
                            .or_default()
                            .push(v as f64);
                    }
                    if let (Some(a), Some(b)) = (at(&c0), at(&c1)) {
                        guest
                            .entry(format!("first cell: {k}"))
                            .or_default()
                            .push(b.saturating_sub(a) as f64);
                    }
                    if let (Some(a), Some(b)) = (at(&c1), at(&c2)) {
                        guest
                            .entry(format!("second cell: {k}"))
                            .or_default()
                            .push(b.saturating_sub(a) as f64);
                    }
                }
            }
            if !a.json {
                eprint!("\r  {label}: {i}/{}   ", a.n);
            }
        }
        Ok(())
    })();
    if !a.json {
        eprintln!();
    }
    let _ = target.kill_all();
    r?;
    let mut out = vec![
        summary(
            &format!("{label}: API create → vCPU in KVM_RUN"),
            &to_first_run,
        ),
        summary(
            &format!("{label}: runtime create → vCPU in KVM_RUN"),
            &in_runtime,
        ),
        summary(
            &format!(
                "{label}: API create → VMM {}",
                if pool > 0 {
                    "gets start request"
                } else {
                    "process starts"
                }
            ),
            &to_vmm,
        ),
        summary(
            &format!(
                "{label}: VMM restore (request → built){}",
                if pool > 0 {
                    ", ahead of the create"
                } else {
                    ""
                }
            ),
            &restore,
        ),
        summary(
            &format!("{label}: vCPU threads started → KVM_RUN"),
            &vcpus_to_run,
        ),
        summary(
            &format!("{label}: API create answered (agent synced)"),
            &answered,
        ),
        summary(
            &format!("{label}: API create → first run_code result"),
            &first_result,
        ),
        summary(
            &format!("{label}: second run_code round trip"),
            &second_result,
        ),
    ];
    for (k, v) in &steps {
        out.push(summary(&format!("{label}:   restore step {k}"), v));
    }
    // Guest work (KVM's counters: what carries over to hardware KVM), medians.
    for (k, v) in &guest {
        let mut v = v.clone();
        v.sort_by(f64::total_cmp);
        out.push(json!({
            "measure": format!("{label}: guest {k}"),
            "median": v.get(v.len() / 2).copied().unwrap_or(f64::NAN),
            "n": v.len(),
        }));
    }
    out.push(json!({ "measure": format!("{label}: VMM paths"), "paths": paths, "pool": rt.pool_stats() }));
    Ok(out)
}

/// CPU seconds of this process (self) and of its reaped children.
fn cpu_secs() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = after
        .split_whitespace()
        .map(|x| x.parse::<f64>().unwrap_or(0.0))
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    // Fields 14-17 (utime stime cutime cstime) are at 11..15 after the ')' and state.
    let g = |i: usize| f.get(i).copied().unwrap_or(0.0) / hz;
    (g(11) + g(12), g(13) + g(14))
}

/// The throughput levels on one server with the pool on.
fn throughput(a: &BenchPoolArgs) -> Result<Vec<Value>, String> {
    let settings = PoolSettings {
        size: a.pool,
        max: a.pool_max.max(a.pool),
        ..PoolSettings::default()
    };
    let max_starting = a.max_starting;
    let (local, addr, token) = Local::start_tuned(move |cfg| {
        cfg.pool = settings;
        if let Some(n) = max_starting {
            cfg.max_starting = n;
        }
    })
    .map_err(|e| e.to_string())?;
    let target = Arc::new(Target {
        client: Client::new(&format!("http://{addr}"), Some(token)),
        local: Some(local),
        tracker: Tracker::default(),
    });
    let rt = target
        .local
        .as_ref()
        .and_then(|l| l.rt.clone())
        .ok_or("no runtime")?;
    let mut out = Vec::new();
    for &clients in &a.clients {
        if a.pool > 0 {
            rt.pool_wait_ready(a.pool, Duration::from_secs(300));
        }
        let hits0: u64 = rt.pool_stats().iter().map(|s| s.hits).sum();
        let misses0: u64 = rt.pool_stats().iter().map(|s| s.misses).sum();
        let (own0, kids0) = cpu_secs();
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicUsize::new(0));
        let failures = Arc::new(AtomicUsize::new(0));
        let errors = Arc::new(std::sync::Mutex::new(ErrorTally::default()));
        let (kill_tx, kill_rx) = std::sync::mpsc::channel::<String>();
        let killer = {
            let target = target.clone();
            std::thread::spawn(move || {
                for id in kill_rx {
                    let _ = target.kill(&id);
                }
            })
        };
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(a.secs);
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                let (target, stop, done, failures, errors, kill_tx) = (
                    target.clone(),
                    stop.clone(),
                    done.clone(),
                    failures.clone(),
                    errors.clone(),
                    kill_tx.clone(),
                );
                let fail = move |what: &str, e: String| {
                    failures.fetch_add(1, Ordering::Relaxed);
                    errors
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .add(&format!("{what}: {e}"));
                };
                let template = a.template.clone();
                std::thread::spawn(move || {
                    let mut lat = Vec::new();
                    while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                        if check_interrupt().is_err() {
                            stop.store(true, Ordering::Relaxed);
                            break;
                        }
                        let t = Instant::now();
                        match target.create(&template) {
                            Ok(info) => {
                                match api_run(&target.client, &info.id, "1+1", t) {
                                    Ok((ms, _)) => {
                                        lat.push(ms);
                                        done.fetch_add(1, Ordering::Relaxed);
                                    }
                                    Err(e) => fail("run_code", e.to_string()),
                                }
                                let _ = kill_tx.send(info.id);
                            }
                            Err(e) => {
                                fail("create", e.to_string());
                                std::thread::sleep(Duration::from_millis(50));
                            }
                        }
                    }
                    lat
                })
            })
            .collect();
        drop(kill_tx);
        let mut lat = Vec::new();
        for h in handles {
            lat.extend(h.join().unwrap_or_default());
        }
        let wall = t0.elapsed().as_secs_f64();
        let _ = killer.join();
        let (own1, kids1) = cpu_secs();
        let n = done.load(Ordering::Relaxed);
        let hits: u64 = rt.pool_stats().iter().map(|s| s.hits).sum::<u64>() - hits0;
        let misses: u64 = rt.pool_stats().iter().map(|s| s.misses).sum::<u64>() - misses0;
        let per = |x: f64| if n > 0 { x * 1e3 / n as f64 } else { 0.0 };
        let mut s = summary(
            &format!("throughput {clients} clients: create → first result"),
            &lat,
        );
        s["clients"] = json!(clients);
        s["creates_per_s"] = json!(n as f64 / wall);
        s["completed"] = json!(n);
        s["failures"] = json!(failures.load(Ordering::Relaxed));
        let tally = std::mem::take(&mut *errors.lock().unwrap_or_else(|p| p.into_inner()));
        s["errors"] = tally.to_json();
        s["pool_hits"] = json!(hits);
        s["pool_misses"] = json!(misses);
        s["server_cpu_ms_per_create"] = json!(per(own1 - own0));
        s["vmm_and_tools_cpu_ms_per_create"] = json!(per(kids1 - kids0));
        s["wall_s"] = json!(wall);
        if !a.json {
            eprintln!(
                "  {clients:>3} clients: {:.1} creates/s ({n} in {wall:.1} s, {} failed), create → \
                 first result median {:.0} ms p95 {:.0} ms, pool {hits} hits / {misses} misses, \
                 CPU per create: server {:.1} ms, VMMs+tools {:.1} ms",
                n as f64 / wall,
                failures.load(Ordering::Relaxed),
                s["median_ms"].as_f64().unwrap_or(0.0),
                s["p95_ms"].as_f64().unwrap_or(0.0),
                per(own1 - own0),
                per(kids1 - kids0),
            );
        }
        if !a.json {
            for (msg, n) in tally.top(5) {
                eprintln!("       {n} × {msg}");
            }
        }
        out.push(s);
        if stop.load(Ordering::Relaxed) {
            break;
        }
    }
    let _ = target.kill_all();
    Ok(out)
}

/// Failures of the throughput measure, counted by message (so that a failing level says why).
#[derive(Debug, Default)]
struct ErrorTally {
    counts: std::collections::BTreeMap<String, usize>,
}

impl ErrorTally {
    /// Most distinct messages kept (a hostile or broken server must not grow this without end).
    const MAX_KINDS: usize = 32;

    fn add(&mut self, msg: &str) {
        let msg: String = Self::normalize(msg).chars().take(200).collect();
        if let Some(n) = self.counts.get_mut(&msg) {
            *n += 1;
        } else if self.counts.len() < Self::MAX_KINDS {
            self.counts.insert(msg, 1);
        } else {
            *self.counts.entry("(other messages)".into()).or_insert(0) += 1;
        }
    }

    /// The message with sandbox ids (16 hex digits) replaced, so that one cause is one
    /// line.
    fn normalize(msg: &str) -> String {
        let mut out = String::with_capacity(msg.len());
        let mut word = String::new();
        let flush = |word: &mut String, out: &mut String| {
            if word.len() == 16 && word.bytes().all(|b| b.is_ascii_hexdigit()) {
                out.push_str("<id>");
            } else {
                out.push_str(word);
            }
            word.clear();
        };
        for c in msg.chars() {
            if c.is_ascii_alphanumeric() {
                word.push(c);
            } else {
                flush(&mut word, &mut out);
                out.push(c);
            }
        }
        flush(&mut word, &mut out);
        out
    }

    /// The `n` most frequent messages, most frequent first.
    fn top(&self, n: usize) -> Vec<(&str, usize)> {
        let mut v: Vec<_> = self.counts.iter().map(|(m, c)| (m.as_str(), *c)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        v.truncate(n);
        v
    }

    fn to_json(&self) -> Value {
        json!(self
            .top(usize::MAX)
            .into_iter()
            .map(|(m, c)| json!({"message": m, "count": c}))
            .collect::<Vec<_>>())
    }
}

/// Runs `ember bench pool`.
pub fn main(a: BenchPoolArgs) -> ExitCode {
    catch_sigint();
    if a.pool == 0 {
        return fail("--pool must be at least 1 (the bench compares it with no pool)");
    }
    let mut lines = Vec::new();
    if a.n > 0 {
        // No pool, the pool with members held (the create starts the guest), the pool with
        // primed members (the guest already runs, connected, its first cell's pages mapped).
        for (pool, prime) in [(0, false), (a.pool, false), (a.pool, true)] {
            if !a.json {
                eprintln!(
                    "latency, pool {}:",
                    match (pool, prime) {
                        (0, _) => "off".to_string(),
                        (n, false) => format!("{n}, unprimed"),
                        (n, true) => format!("{n}, primed"),
                    }
                );
            }
            match latency(&a, pool, prime) {
                Ok(v) => {
                    for l in &v {
                        print(a.json, l);
                    }
                    lines.extend(v)
                }
                Err(e) => return fail(e),
            }
        }
    }
    if !a.clients.is_empty() {
        if !a.json {
            eprintln!("throughput, pool {} (max {}):", a.pool, a.pool_max);
        }
        match throughput(&a) {
            Ok(v) => {
                if a.json {
                    for l in &v {
                        print(true, l);
                    }
                }
                lines.extend(v)
            }
            Err(e) => return fail(e),
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchPoolArgs,
    }

    #[test]
    fn clients_alone_skips_the_throughput_measure() {
        use clap::Parser;
        assert!(Cli::parse_from(["x", "--clients"]).a.clients.is_empty());
        assert_eq!(Cli::parse_from(["x"]).a.clients, vec![1, 4, 16, 64]);
        assert_eq!(
            Cli::parse_from(["x", "--clients", "2,8"]).a.clients,
            vec![2, 8]
        );
    }

    #[test]
    fn error_tally_counts_by_message_and_is_bounded() {
        let mut t = ErrorTally::default();
        for _ in 0..3 {
            t.add("create: timed out");
        }
        t.add("run_code: reset");
        assert_eq!(t.top(1), vec![("create: timed out", 3)]);
        assert_eq!(
            ErrorTally::normalize("sandbox 02fc4e0cec27f0f6: connect: x1"),
            "sandbox <id>: connect: x1"
        );
        for i in 0..100 {
            t.add(&format!("distinct {i}"));
        }
        assert!(t.counts.len() <= ErrorTally::MAX_KINDS + 1);
        let other = t.counts.get("(other messages)").copied().unwrap_or(0);
        assert_eq!(other, 100 - (ErrorTally::MAX_KINDS - 2));
        assert_eq!(
            t.to_json().as_array().map(|a| a.len()),
            Some(t.counts.len())
        );
        t.add(&"x".repeat(1000));
        assert!(t.counts.keys().all(|k| k.chars().count() <= 200));
    }
}
