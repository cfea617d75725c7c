//! `ember bench density`: how many idle sandboxes this host holds at once, and what each one
//! costs.
//!
//! It starts the server of `ember serve` in-process (a runtime on a temporary home, with the
//! running and committed-memory caps lifted to the target), creates sandboxes of one template
//! through the HTTP API with a few concurrent clients, and at each report point lets them
//! settle and takes:
//!
//! - **host memory per sandbox**: the drop of `MemAvailable` since before the first create,
//!   divided by the number of sandboxes (everything: VMM processes, page tables, KVM and
//!   cgroup structures, the server's bookkeeping), with the kernel's share (`Slab`,
//!   `PageTables`, `KernelStack`) beside it;
//! - **PSS per sandbox**: the VMM processes' proportional set size from `/proc/PID/smaps`,
//!   total and without the guest-memory mapping (the snapshot's `memory` file, mapped private,
//!   whose page cache the clones share);
//! - **idle CPU** of all the VMM processes together (guest time included: a vCPU thread's
//!   guest time is its user time) and of the server process, as a percentage of one CPU over a
//!   window;
//! - the server's own footprint: open file descriptors, threads, RSS;
//! - **answers**: every sandbox must answer through the API: by default it runs `1`
//!   (`run_code`: the interpreter's first cell in that sandbox), with `--answer ping` it
//!   stats `/` (one agent round trip, one guest system call); and what the answers cost
//!   in host memory (the further drop of `MemAvailable`, per answer: the pages the guest
//!   wrote become the sandbox's own).
//!
//! With `--until-failure` it keeps creating past `--n` until a create fails, and reports what
//! failed: that is the ceiling. Every sandbox is killed at the end (also after an error or a
//! first Ctrl-C).

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use serde_json::{json, Value};

use crate::api::{
    api_run, catch_sigint, check_interrupt, ms_since, sleep_interruptibly, vmm_memory,
    BenchApiError, Local, Result, Target,
};
use crate::fail;
use ember_runtime::{CreateRequest, SandboxInfo};
use ember_server::client::{segment, Client};

/// `ember bench density`.
#[derive(Debug, Args)]
pub struct BenchDensityArgs {
    /// Template of the idle sandboxes (`small`: the default image in 256 MiB, no NIC).
    #[arg(short, long, default_value = "small")]
    pub template: String,
    /// Idle sandboxes to hold at once.
    #[arg(short, long, default_value_t = 1000)]
    pub n: usize,
    /// Report points, comma-separated (default: 1, 10, 100, 250, 500, 1000, … up to N).
    #[arg(long, value_delimiter = ',')]
    pub at: Vec<usize>,
    /// Concurrent clients creating sandboxes.
    #[arg(long, default_value_t = 2)]
    pub clients: usize,
    /// Seconds the sandboxes sit before each report point's figures.
    #[arg(long, default_value_t = 10)]
    pub settle: u64,
    /// Seconds over which idle CPU is measured.
    #[arg(long, default_value_t = 10)]
    pub cpu_window: u64,
    /// Keep creating past N until a create fails (the ceiling), with a report point every N.
    #[arg(long)]
    pub until_failure: bool,
    /// Do not ask every sandbox for an answer at the report points (only at the last one).
    #[arg(long)]
    pub answer_last_only: bool,
    /// How each sandbox answers: `code` runs `1` (the interpreter's first cell in it, which
    /// writes a few MiB of guest memory), `ping` stats `/` through the agent.
    #[arg(long, value_enum, default_value_t = Answer::Code)]
    pub answer: Answer,
    /// Also write every figure as one JSON object per line here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// What each sandbox is asked, to show it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Answer {
    /// `run_code` of `1`: must give `1`.
    Code,
    /// A stat of `/` through the agent: must say it is a directory.
    Ping,
}

/// `/proc/meminfo` fields, KiB.
#[derive(Debug, Default, Clone, Copy)]
struct MemInfo {
    available: u64,
    slab: u64,
    page_tables: u64,
    kernel_stack: u64,
}

fn meminfo() -> MemInfo {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mut m = MemInfo::default();
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let (Some(k), Some(v)) = (f.next(), f.next().and_then(|v| v.parse::<u64>().ok())) else {
            continue;
        };
        match k {
            "MemAvailable:" => m.available = v,
            "Slab:" => m.slab = v,
            "PageTables:" => m.page_tables = v,
            "KernelStack:" => m.kernel_stack = v,
            _ => {}
        }
    }
    m
}

/// utime + stime of a process (all its threads), clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = text.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// (open fds, threads, RSS KiB) of this process.
fn own_footprint() -> (usize, u64, u64) {
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (fds, field("Threads:"), field("VmRSS:"))
}

/// Raises this process's open-file limit to its hard limit: the server holds a few
/// descriptors per sandbox.
fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 0;
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: setrlimit reads the struct we pass; raising the soft limit up to the hard
    // limit is always allowed.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    lim.rlim_cur
}

fn default_points(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = [1, 10, 100, 250, 500, 1000, 2000, 3000, 5000]
        .into_iter()
        .filter(|&k| k < n)
        .collect();
    v.push(n);
    v
}

/// Creates one idle sandbox through the API, with a timeout longer than any run.
fn create(target: &Target, template: &str) -> Result<SandboxInfo> {
    check_interrupt()?;
    let req = CreateRequest {
        template: Some(template.to_string()),
        timeout_secs: Some(6 * 3600),
        metadata: [("created_by".to_string(), "ember bench density".to_string())].into(),
        ..Default::default()
    };
    let info = target
        .client
        .create(&req)
        .map_err(|source| BenchApiError::Api {
            what: format!("create a sandbox of {template}"),
            source,
        })?;
    target.tracker.ids().insert(info.id.clone());
    Ok(info)
}

/// The figures of one report point.
fn measure(
    a: &BenchDensityArgs,
    target: &Target,
    live: &[(String, u32)],
    base: MemInfo,
    answer: bool,
) -> Result<Value> {
    let k = live.len();
    sleep_interruptibly(Duration::from_secs(a.settle))?;
    let mem = meminfo();
    let per = |now: u64, then: u64| (now as f64 - then as f64) / 1024.0 / k as f64;
    let host_mib = (base.available as f64 - mem.available as f64) / 1024.0 / k as f64;
    let mut pss = 0u64;
    let mut pss_guest = 0u64;
    let mut unreadable = 0usize;
    for (_, pid) in live {
        match vmm_memory(*pid) {
            Ok(m) => {
                pss += m.pss;
                pss_guest += m.guest_pss_kib();
            }
            Err(_) => unreadable += 1,
        }
    }
    // Idle CPU over the window: all VMMs together, and this process (the server).
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let own = std::process::id();
    let before: Vec<Option<u64>> = live.iter().map(|(_, p)| cpu_ticks(*p)).collect();
    let own_before = cpu_ticks(own);
    let t0 = Instant::now();
    sleep_interruptibly(Duration::from_secs(a.cpu_window))?;
    let secs = t0.elapsed().as_secs_f64();
    let vmm_ticks: u64 = live
        .iter()
        .zip(&before)
        .filter_map(|((_, p), b)| Some(cpu_ticks(*p)?.saturating_sub((*b)?)))
        .sum();
    let own_ticks = match (own_before, cpu_ticks(own)) {
        (Some(b), Some(a)) => a.saturating_sub(b),
        _ => 0,
    };
    let (fds, threads, rss) = own_footprint();
    let mut answered = Value::Null;
    if answer {
        answered = answer_all(a, &target.client, live)?;
        // What answering cost the host: pages the guests wrote became their own.
        let after = meminfo();
        let n = answered["answered"].as_u64().unwrap_or(0).max(1);
        answered["host_mib_per_answer"] =
            json!((mem.available as f64 - after.available as f64) / 1024.0 / n as f64);
    }
    Ok(json!({
        "sandboxes": k,
        "host_mib_per_sandbox": host_mib,
        "kernel_slab_mib_per_sandbox": per(mem.slab, base.slab),
        "kernel_page_tables_mib_per_sandbox": per(mem.page_tables, base.page_tables),
        "kernel_stack_mib_per_sandbox": per(mem.kernel_stack, base.kernel_stack),
        "pss_mib_per_sandbox": pss as f64 / 1024.0 / k as f64,
        "pss_without_guest_memory_mib_per_sandbox": (pss - pss_guest.min(pss)) as f64 / 1024.0 / k as f64,
        "pss_unreadable": unreadable,
        "idle_cpu_percent_all_vmms": vmm_ticks as f64 / hz / secs * 100.0,
        "idle_cpu_percent_server": own_ticks as f64 / hz / secs * 100.0,
        "server_fds": fds,
        "server_threads": threads,
        "server_rss_mib": rss as f64 / 1024.0,
        "answers": answered,
    }))
}

/// One answer of sandbox `id`: how long it took (ms), or why it was not the right one.
fn ask(a: &BenchDensityArgs, client: &Client, id: &str) -> std::result::Result<f64, String> {
    let t0 = Instant::now();
    match a.answer {
        Answer::Code => match api_run(client, id, "1", t0) {
            Ok((ms, text)) if text == "1" => Ok(ms),
            Ok((_, text)) => Err(format!("{id}: `1` gave {text:?}")),
            Err(e) => Err(e.to_string()),
        },
        Answer::Ping => {
            let path = format!("/v1/sandboxes/{}/files/stat", segment(id));
            match client.get::<Value>(&path, &[("path", "/".to_string())]) {
                Ok(v) if v["type"] == "dir" => Ok(ms_since(t0)),
                Ok(v) => Err(format!("{id}: stat of / gave {v}")),
                Err(e) => Err(format!("{id}: stat of /: {e}")),
            }
        }
    }
}

/// Asks every live sandbox for an answer with the bench's clients; every one must answer.
fn answer_all(a: &BenchDensityArgs, client: &Client, live: &[(String, u32)]) -> Result<Value> {
    let next = AtomicUsize::new(0);
    let times = Mutex::new(Vec::with_capacity(live.len()));
    let errors = Mutex::new(Vec::new());
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..a.clients.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((id, _)) = live.get(i) else { break };
                if check_interrupt().is_err() {
                    break;
                }
                match ask(a, client, id) {
                    Ok(ms) => times.lock().unwrap().push(ms),
                    Err(e) => errors.lock().unwrap().push(e),
                }
            });
        }
    });
    check_interrupt()?;
    let mut times = times.into_inner().unwrap_or_default();
    let errors = errors.into_inner().unwrap_or_default();
    times.sort_by(f64::total_cmp);
    let q = |p: f64| {
        times
            .get(((times.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    Ok(json!({
        "answered": times.len(),
        "failed": errors.len(),
        "first_errors": errors.iter().take(5).collect::<Vec<_>>(),
        "median_ms": q(0.5),
        "p95_ms": q(0.95),
        "max_ms": q(1.0),
        "wall_s": t0.elapsed().as_secs_f64(),
    }))
}

fn print_point(v: &Value) {
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let ans = &v["answers"];
    let answers = if ans.is_null() {
        "-".to_string()
    } else {
        format!(
            "{}/{} (median {:.0} ms, p95 {:.0} ms, {:.2} MiB each)",
            ans["answered"],
            v["sandboxes"],
            ans["median_ms"].as_f64().unwrap_or(f64::NAN),
            ans["p95_ms"].as_f64().unwrap_or(f64::NAN),
            ans["host_mib_per_answer"].as_f64().unwrap_or(f64::NAN)
        )
    };
    println!(
        "{:>6} | {:>9.2} | {:>6.2} | {:>9.2} | {:>9.2} | {:>8.2} | {:>6.1} | {:>5} | {}",
        v["sandboxes"],
        f("host_mib_per_sandbox"),
        f("kernel_slab_mib_per_sandbox")
            + f("kernel_page_tables_mib_per_sandbox")
            + f("kernel_stack_mib_per_sandbox"),
        f("pss_mib_per_sandbox"),
        f("pss_without_guest_memory_mib_per_sandbox"),
        f("idle_cpu_percent_all_vmms"),
        f("idle_cpu_percent_server"),
        v["server_fds"],
        answers
    );
}

/// `ember bench density`.
pub fn main(a: BenchDensityArgs) -> ExitCode {
    match run(&a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(BenchApiError::Interrupted) => {
            eprintln!("ember: interrupted");
            ExitCode::from(130)
        }
        Err(e) => fail(e),
    }
}

use std::process::ExitCode;

fn run(a: &BenchDensityArgs) -> Result<()> {
    if a.n == 0 {
        return Err(BenchApiError::Unexpected("--n must be at least 1".into()));
    }
    catch_sigint();
    let nofile = raise_nofile();
    let cap = if a.until_failure { usize::MAX } else { a.n };
    let points = if a.at.is_empty() {
        default_points(a.n)
    } else {
        let mut v = a.at.clone();
        v.retain(|&k| k > 0 && k <= a.n);
        v.sort_unstable();
        v.dedup();
        v
    };
    let big = a.n.saturating_mul(if a.until_failure { 10 } else { 1 });
    let (local, addr, token) = Local::start_tuned(|cfg| {
        cfg.max_running = big.max(cfg.max_running);
        cfg.max_committed_memory_mib = u64::MAX / 2;
        cfg.uid_count = cfg.uid_count.max(u32::try_from(big).unwrap_or(u32::MAX));
    })?;
    let target = Target {
        client: Client::new(&format!("http://{addr}"), Some(token)),
        local: Some(local),
        tracker: Default::default(),
    };
    let mut out = match &a.json {
        Some(p) => Some(std::fs::File::create(p).map_err(|e| {
            BenchApiError::Unexpected(format!("cannot create {}: {e}", p.display()))
        })?),
        None => None,
    };
    eprintln!(
        "density: template {}, up to {} sandboxes{}, {} clients, answers by {:?}, open-file limit {nofile}",
        a.template,
        a.n,
        if a.until_failure {
            " (then until a create fails)"
        } else {
            ""
        },
        a.clients,
        a.answer
    );
    let base = meminfo();
    let live: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());
    let create_ms: Mutex<Vec<f64>> = Mutex::new(Vec::new());
    let stop_reason: Mutex<Option<String>> = Mutex::new(None);
    println!(
        "{:>6} | {:>9} | {:>6} | {:>9} | {:>9} | {:>8} | {:>6} | {:>5} | answers",
        "N", "host MiB", "kernel", "PSS MiB", "PSS-guest", "VMMs CPU", "server", "fds"
    );
    let started = Instant::now();
    let mut goal_iter = points.clone().into_iter().peekable();
    let mut next_goal = goal_iter.next().unwrap_or(a.n);
    let r = (|| -> Result<()> {
        loop {
            // Create up to the next report point with the clients.
            let failed = AtomicBool::new(false);
            // Slots taken by clients (created or being created), so that no report point is
            // overshot.
            let reserved = AtomicUsize::new(live.lock().unwrap().len());
            std::thread::scope(|s| {
                for _ in 0..a.clients.max(1) {
                    s.spawn(|| loop {
                        if failed.load(Ordering::Relaxed) || check_interrupt().is_err() {
                            break;
                        }
                        if reserved.fetch_add(1, Ordering::Relaxed) >= next_goal {
                            break;
                        }
                        let t0 = Instant::now();
                        let created = create(&target, &a.template).and_then(|info| {
                            let pid = target
                                .client
                                .sandbox(&info.id)
                                .ok()
                                .and_then(|i| i.pid)
                                .ok_or_else(|| {
                                    BenchApiError::Unexpected(format!(
                                        "sandbox {} has no VMM pid",
                                        info.id
                                    ))
                                })?;
                            Ok((info.id, pid))
                        });
                        match created {
                            Ok(x) => {
                                create_ms.lock().unwrap().push(ms_since(t0));
                                let mut l = live.lock().unwrap();
                                l.push(x);
                                let n = l.len();
                                if n.is_multiple_of(25) {
                                    eprint!(
                                        "\rdensity: {n} sandboxes up ({:.0} s)   ",
                                        started.elapsed().as_secs_f64()
                                    );
                                    let _ = std::io::stderr().flush();
                                }
                            }
                            Err(e) => {
                                reserved.fetch_sub(1, Ordering::Relaxed);
                                let mut r = stop_reason.lock().unwrap();
                                if r.is_none() {
                                    *r = Some(format!(
                                        "create #{} failed: {e}",
                                        live.lock().unwrap().len() + 1
                                    ));
                                }
                                failed.store(true, Ordering::Relaxed);
                            }
                        }
                    });
                }
            });
            check_interrupt()?;
            eprintln!();
            let snapshot = live.lock().unwrap().clone();
            let k = snapshot.len();
            if k == 0 {
                break;
            }
            let stopped = failed.load(Ordering::Relaxed);
            let last = stopped || k >= cap;
            let answer = !a.answer_last_only || last || (k >= a.n && !a.until_failure);
            let mut v = measure(a, &target, &snapshot, base, answer)?;
            {
                let mut cm = create_ms.lock().unwrap().clone();
                cm.sort_by(f64::total_cmp);
                let q = |p: f64| {
                    cm.get(((cm.len() as f64 - 1.0) * p).round() as usize)
                        .copied()
                        .unwrap_or(f64::NAN)
                };
                v["create_ms_median"] = json!(q(0.5));
                v["create_ms_p95"] = json!(q(0.95));
                v["elapsed_s"] = json!(started.elapsed().as_secs_f64());
            }
            print_point(&v);
            if let Some(f) = out.as_mut() {
                let _ = writeln!(f, "{v}");
            }
            if last {
                break;
            }
            next_goal = match goal_iter.next() {
                Some(g) => g,
                None if a.until_failure => k + a.n,
                None => break,
            };
            let _ = goal_iter.peek();
        }
        Ok(())
    })();
    let reason = stop_reason.into_inner().unwrap_or(None);
    let held = live.lock().unwrap().len();
    match &reason {
        Some(why) => println!("largest N held: {held}; then {why}"),
        None => println!("held {held} idle sandboxes"),
    }
    if let Some(f) = out.as_mut() {
        let _ = writeln!(f, "{}", json!({"held": held, "stopped_by": reason}));
    }
    eprintln!("density: killing {held} sandboxes");
    let failures = target.kill_all();
    if !failures.is_empty() {
        eprintln!(
            "ember: warning: {} kills failed, first: {}",
            failures.len(),
            failures[0]
        );
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_points_end_at_n() {
        assert_eq!(default_points(1), vec![1]);
        assert_eq!(default_points(300), vec![1, 10, 100, 250, 300]);
        assert_eq!(default_points(1000), vec![1, 10, 100, 250, 500, 1000]);
    }

    #[test]
    fn meminfo_reads_this_host() {
        let m = meminfo();
        assert!(m.available > 0 && m.slab > 0, "{m:?}");
    }

    #[test]
    fn own_footprint_counts_descriptors() {
        let (fds, threads, rss) = own_footprint();
        assert!(fds >= 3 && threads >= 1 && rss > 0);
    }
}
