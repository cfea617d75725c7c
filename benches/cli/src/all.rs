//! `ember bench all`: every scenario in one run, beside the peers that can run here, into one
//! directory: `samples.jsonl` (every sample, written as measured), `table.txt`, `plots/` (a
//! CDF per scenario and measure, SVG and PNG) and `report.html` (self-contained). And
//! `ember bench compare A.jsonl B.jsonl`: the A/B differences with a Mann–Whitney U test.
//!
//! Scenarios (each `--n` runs after warm-ups that are discarded):
//! - `boot`: spawn → boot marker (ember), spawn → `ember-init: ready` on the console (every
//!   system), ember, Firecracker and QEMU `-M microvm` alternating run by run;
//! - `restore`: spawn → vCPU running and spawn → agent ping, ember and Firecracker each
//!   restoring its own snapshot of the same guest, alternating;
//! - `sandbox`: API create → first `run_code` result per template (and the bare restore →
//!   ping of the same snapshot, run by run);
//! - `ready`: API create → answered ("ready") and → first `run_code` result from a primed warm
//!   pool (a server of its own, `--pool 2`), with the first cell's guest work (emulated
//!   instructions, exits, shadow-page fills);
//! - `rtt`: `run_code`, `exec`, file write and read of 4 KiB through the API;
//! - `files`: uploads and downloads of 1 MiB (and 8 MiB) in MiB/s with the guest work per MiB,
//!   beside the guest's own `dd` (`ember bench files`);
//! - `parallel`: creates per second at 1/4/16/64 concurrent clients;
//! - `density`: N idle sandboxes: create latency as N grows, PSS and idle CPU per sandbox;
//! - `pause`: pause and resume latency, and the bytes of the pause snapshot.
//!
//! The wrapped benches live in `ember_benches::{boot, restore, qemu}` and `bench_api` (the
//! in-process server and its client helpers). Ctrl-C stops at the next step, kills what it
//! started, and still writes the report of what was measured.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use ember_benches::boot::BootBench;
use ember_benches::qemu::{self, QemuBoot};
use ember_benches::record::{Environment, Line, Recorder, Sample, Skip};
use ember_benches::restore::RestoreBench;
use ember_benches::{compare, report};
use ember_server::client::{segment, Client};
use ember_vmm::CpuProfile;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use crate::api::{self as bench_api, BenchApiError, Local, Target, INTERRUPTED};
use crate::fail;

/// The scenarios, in run order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// Cold boot.
    Boot,
    /// Snapshot restore.
    Restore,
    /// API create → first result.
    Sandbox,
    /// Create → ready and → first result from a primed warm pool.
    Ready,
    /// Round trips through the API.
    Rtt,
    /// File uploads and downloads: MiB/s and guest work per MiB.
    Files,
    /// Creates per second under concurrency.
    Parallel,
    /// Idle sandboxes: memory, CPU, create latency as N grows.
    Density,
    /// Pause and resume.
    Pause,
}

impl Scenario {
    const ALL: [Scenario; 9] = [
        Scenario::Boot,
        Scenario::Restore,
        Scenario::Sandbox,
        Scenario::Ready,
        Scenario::Rtt,
        Scenario::Files,
        Scenario::Parallel,
        Scenario::Density,
        Scenario::Pause,
    ];

    fn name(self) -> &'static str {
        match self {
            Scenario::Boot => "boot",
            Scenario::Restore => "restore",
            Scenario::Sandbox => "sandbox",
            Scenario::Ready => "ready",
            Scenario::Rtt => "rtt",
            Scenario::Files => "files",
            Scenario::Parallel => "parallel",
            Scenario::Density => "density",
            Scenario::Pause => "pause",
        }
    }

    /// Whether it needs the shared sandbox runtime and server (`ready` starts its own).
    fn needs_server(self) -> bool {
        !matches!(self, Scenario::Boot | Scenario::Restore | Scenario::Ready)
    }
}

/// `ember bench all`.
#[derive(Debug, Args)]
pub struct BenchAllArgs {
    /// Small sizes for CI (about three minutes here); the default is sized for a 2-core
    /// kvm_pvm host (under 15 minutes).
    #[arg(long)]
    pub quick: bool,
    /// Only these scenarios (comma-separated; default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub only: Vec<Scenario>,
    /// Measured runs per scenario (overrides each scenario's default).
    #[arg(long)]
    pub n: Option<usize>,
    /// Warm-up runs per scenario, discarded (overrides each scenario's default).
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Also boot and restore with this Firecracker binary.
    #[arg(long)]
    pub firecracker: Option<PathBuf>,
    /// The QEMU binary (default: `qemu-system-x86_64` on PATH).
    #[arg(long)]
    pub qemu: Option<PathBuf>,
    /// Do not run QEMU.
    #[arg(long)]
    pub no_qemu: bool,
    /// Templates of the `sandbox` scenario (the first is used by the others); default:
    /// default and python-data (`--quick`: default).
    #[arg(short, long)]
    pub template: Vec<String>,
    /// Guest kernel of boot/restore (default: the cached default kernel).
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Root filesystem of boot/restore (default: the default template's).
    #[arg(long)]
    pub rootfs: Option<PathBuf>,
    /// Guest memory of boot/restore, MiB.
    #[arg(long, default_value_t = 128)]
    pub mem_mib: u64,
    /// CPU profile: host, pvm or baseline (default: detected).
    #[arg(long)]
    pub cpu_profile: Option<CpuProfile>,
    /// Output directory (default: ./ember-bench-<UTC time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// `ember bench compare`.
#[derive(Debug, Args)]
pub struct BenchCompareArgs {
    /// The baseline record (samples.jsonl of a run).
    pub a: PathBuf,
    /// The record to compare with it.
    pub b: PathBuf,
    /// Significance level of the two-sided Mann–Whitney U test.
    #[arg(long, default_value_t = 0.05)]
    pub alpha: f64,
    /// JSON lines instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `ember bench compare`.
pub fn compare_main(a: BenchCompareArgs) -> ExitCode {
    let (ra, rb) = match (
        ember_benches::record::read(&a.a),
        ember_benches::record::read(&a.b),
    ) {
        (Ok(x), Ok(y)) => (x, y),
        (Err(e), _) | (_, Err(e)) => return fail(e),
    };
    let rows = compare::compare(&ra, &rb, a.alpha);
    if rows.is_empty() {
        return fail("the two records have no distribution in common");
    }
    if a.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        }
    } else {
        print!("{}", compare::table(&rows, a.alpha));
        let flagged = rows.iter().filter(|r| r.significant).count();
        println!(
            "{flagged} of {} distributions differ significantly (p < {})",
            rows.len(),
            a.alpha
        );
    }
    ExitCode::SUCCESS
}

/// How many runs a scenario makes.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Plan {
    n: usize,
    warmup: usize,
}

/// The sizes of one run.
#[derive(Debug, Clone, PartialEq)]
struct Sizes {
    boot: Plan,
    restore: Plan,
    sandbox: Plan,
    ready: Plan,
    rtt: Plan,
    files: Plan,
    file_sizes: Vec<u64>,
    clients: Vec<usize>,
    creates: usize,
    density: Vec<usize>,
    settle: Duration,
    cpu_window: Duration,
    pause: Plan,
}

impl Sizes {
    fn new(quick: bool, n: Option<usize>, warmup: Option<usize>) -> Self {
        let p = |n_full: usize, w_full: usize, n_quick: usize, w_quick: usize| Plan {
            n: n.unwrap_or(if quick { n_quick } else { n_full }).max(1),
            warmup: warmup.unwrap_or(if quick { w_quick } else { w_full }),
        };
        Sizes {
            // A guest boot costs seconds on kvm_pvm: few boots, no warm-up.
            boot: p(3, 0, 1, 0),
            restore: p(20, 2, 3, 1),
            sandbox: p(5, 1, 1, 1),
            ready: p(10, 1, 2, 1),
            rtt: p(20, 2, 2, 1),
            files: p(3, 0, 1, 0),
            // A MiB through kvm_pvm's guest syscalls costs about a second; CI moves 1 MiB.
            file_sizes: if quick { vec![1] } else { vec![1, 8] },
            clients: if quick {
                vec![1, 4]
            } else {
                vec![1, 4, 16, 64]
            },
            creates: if quick { 4 } else { 16 },
            density: if quick {
                vec![1, 2]
            } else {
                vec![1, 2, 4, 8, 16]
            },
            settle: Duration::from_secs(if quick { 1 } else { 3 }),
            cpu_window: Duration::from_secs(if quick { 2 } else { 5 }),
            pause: p(5, 1, 1, 0),
        }
    }

    /// Steps of the progress bar.
    fn steps(&self, s: Scenario, templates: usize) -> u64 {
        let t = |p: Plan| (p.n + p.warmup) as u64;
        match s {
            Scenario::Boot => t(self.boot),
            Scenario::Restore => t(self.restore) + 1,
            Scenario::Sandbox => t(self.sandbox) * templates as u64,
            Scenario::Ready => t(self.ready) + 1,
            Scenario::Rtt => 3 + 2,
            Scenario::Files => self.files.n as u64 * self.file_sizes.len() as u64,
            Scenario::Parallel => self.clients.len() as u64,
            Scenario::Density => self.density.last().copied().unwrap_or(0) as u64,
            Scenario::Pause => t(self.pause),
        }
    }
}

/// Why a scenario stopped early.
#[derive(Debug, thiserror::Error)]
enum ScenarioError {
    /// The API-side helpers.
    #[error(transparent)]
    Api(#[from] BenchApiError),
    /// The record file.
    #[error(transparent)]
    Record(#[from] ember_benches::record::RecordError),
    /// Anything else, said in words.
    #[error("{0}")]
    Other(String),
}

type Res<T> = Result<T, ScenarioError>;

fn other(e: impl std::fmt::Display) -> ScenarioError {
    ScenarioError::Other(e.to_string())
}

/// What every scenario shares.
struct Ctx<'a> {
    rec: &'a Recorder,
    pb: ProgressBar,
    sizes: Sizes,
    a: &'a BenchAllArgs,
    kernel: PathBuf,
    rootfs: PathBuf,
    profile: CpuProfile,
    vmm: PathBuf,
    templates: Vec<String>,
    qemu: Option<PathBuf>,
}

impl Ctx<'_> {
    #[allow(clippy::too_many_arguments)]
    fn put(
        &self,
        scenario: &str,
        system: &str,
        measure: &str,
        unit: &str,
        run: usize,
        value: f64,
        x: Option<f64>,
    ) -> Res<()> {
        self.rec.sample(Sample {
            scenario: scenario.into(),
            system: system.into(),
            measure: measure.into(),
            unit: unit.into(),
            run,
            value,
            x,
        })?;
        Ok(())
    }

    fn ms(&self, scenario: &str, system: &str, measure: &str, run: usize, v: f64) -> Res<()> {
        self.put(scenario, system, measure, "ms", run, v, None)
    }

    fn skip(&self, scenario: &str, system: &str, reason: impl Into<String>) -> Res<()> {
        let reason = reason.into();
        self.say(format!(
            "  {scenario}: {} skipped: {reason}",
            if system == "*" { "scenario" } else { system }
        ));
        self.rec.push(Line::Skip(Skip {
            scenario: scenario.into(),
            system: system.into(),
            reason,
        }))?;
        Ok(())
    }

    fn note(&self, scenario: &str, text: impl Into<String>) -> Res<()> {
        self.rec.push(Line::Note {
            scenario: scenario.into(),
            text: text.into(),
        })?;
        Ok(())
    }

    /// A line above the progress bar (on stderr as is when the bar is hidden: not a terminal).
    fn say(&self, msg: String) {
        if self.pb.is_hidden() {
            eprintln!("{msg}");
        } else {
            self.pb.println(msg);
        }
    }

    fn step(&self, msg: String) {
        self.pb.set_message(msg);
        self.pb.inc(1);
    }
}

fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

fn stop_if_interrupted() -> Res<()> {
    bench_api::check_interrupt()?;
    Ok(())
}

// ----- boot -----

fn boot(cx: &Ctx<'_>) -> Res<()> {
    const SC: &str = "boot";
    let plan = cx.sizes.boot;
    let b = BootBench {
        kernel: cx.kernel.clone(),
        rootfs: cx.rootfs.clone(),
        mem_mib: cx.a.mem_mib,
        vcpus: 1,
        n: plan.n,
        profile: cx.profile,
        ember_vmm: cx.vmm.clone(),
        firecracker: None,
    };
    let mut fc = cx.a.firecracker.clone();
    if fc.is_none() {
        cx.skip(SC, "firecracker", "no --firecracker PATH given")?;
    }
    let mut qm = cx.qemu.clone().map(|bin| QemuBoot {
        bin,
        kernel: cx.kernel.clone(),
        rootfs: cx.rootfs.clone(),
        mem_mib: cx.a.mem_mib,
        vcpus: 1,
        cmdline_extra: cx.profile.cmdline().to_string(),
        cpu: match cx.profile {
            CpuProfile::Pvm => "host,-cx16".into(),
            _ => "host".into(),
        },
        timeout: Duration::from_secs(600),
    });
    for i in 0..plan.warmup + plan.n {
        stop_if_interrupted()?;
        let keep = i >= plan.warmup;
        let run = i.saturating_sub(plan.warmup);
        cx.step(format!("boot {}/{}: ember", i + 1, plan.warmup + plan.n));
        let s = b.ember_once(i).map_err(other)?;
        if keep {
            if let Some(v) = s.marker_ms {
                cx.ms(SC, "ember", "spawn → boot marker", run, v)?;
            }
            if let Some(v) = s.ready_line_ms {
                cx.ms(SC, "ember", "spawn → ready line", run, v)?;
            }
        }
        if let Some(q) = qm.as_mut() {
            // Bounded by a few times ember's boot: a guest that hangs under QEMU here
            // should not hold the run for ten minutes.
            if let Some(e) = s.ready_line_ms {
                q.timeout = Duration::from_secs_f64((e / 1e3 * 2.0).max(30.0));
            }
            cx.pb.set_message(format!("boot {}: qemu", i + 1));
            match q.once() {
                Ok(v) if keep => cx.ms(SC, "qemu", "spawn → ready line", run, v)?,
                Ok(_) => {}
                Err(e) => {
                    stop_if_interrupted()?;
                    cx.skip(SC, "qemu", format!("does not work on this host: {e}"))?;
                    qm = None;
                }
            }
        }
        if let Some(bin) = fc.clone() {
            cx.pb.set_message(format!("boot {}: firecracker", i + 1));
            match b.firecracker_once(&bin, i) {
                Ok(s) if keep => {
                    if let Some(v) = s.ready_line_ms {
                        cx.ms(SC, "firecracker", "spawn → ready line", run, v)?;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    stop_if_interrupted()?;
                    cx.skip(SC, "firecracker", format!("failed: {e}"))?;
                    fc = None;
                }
            }
        }
    }
    Ok(())
}

// ----- restore -----

fn restore(cx: &Ctx<'_>) -> Res<()> {
    const SC: &str = "restore";
    let plan = cx.sizes.restore;
    let work = tempfile::Builder::new()
        .prefix("ember-bench-restore-")
        .tempdir()
        .map_err(other)?;
    let b = RestoreBench {
        kernel: cx.kernel.clone(),
        rootfs: cx.rootfs.clone(),
        mem_mib: cx.a.mem_mib,
        n: plan.n,
        profile: cx.profile,
        ember_vmm: cx.vmm.clone(),
        firecracker: cx.a.firecracker.clone(),
        workdir: work.path().to_path_buf(),
        prefetch: "off".into(),
        vsock: ember_benches::restore::VsockMode::Attach,
    };
    if cx.qemu.is_some() {
        cx.skip(
            SC,
            "qemu",
            "not measured: QEMU restores through incoming migration, not a snapshot load",
        )?;
    }
    cx.pb
        .set_message("restore: booting the guest and taking ember's snapshot");
    let snap = b.prepare_ember().map_err(other)?;
    let mut fc = None;
    match &cx.a.firecracker {
        None => cx.skip(SC, "firecracker", "no --firecracker PATH given")?,
        Some(bin) => {
            cx.pb
                .set_message("restore: booting the guest and taking Firecracker's snapshot");
            match b.prepare_firecracker(bin) {
                Ok(files) => fc = Some((bin.clone(), files)),
                Err(e) => {
                    stop_if_interrupted()?;
                    cx.skip(SC, "firecracker", format!("its snapshot failed: {e}"))?;
                }
            }
        }
    }
    cx.step("restore: snapshots ready".into());
    for i in 0..plan.warmup + plan.n {
        stop_if_interrupted()?;
        let keep = i >= plan.warmup;
        let run = i.saturating_sub(plan.warmup);
        cx.step(format!("restore {}/{}", i + 1, plan.warmup + plan.n));
        let (r, p) = b.ember_once(&snap, i).map_err(other)?;
        if keep {
            cx.ms(SC, "ember", "spawn → vCPU running", run, r)?;
            cx.ms(SC, "ember", "spawn → agent ping", run, p)?;
        }
        if let Some((bin, (state, mem))) = &fc {
            match b.firecracker_once(bin, state, mem, i) {
                Ok((r, p)) if keep => {
                    cx.ms(SC, "firecracker", "spawn → vCPU running", run, r)?;
                    cx.ms(SC, "firecracker", "spawn → agent ping", run, p)?;
                }
                Ok(_) => {}
                Err(e) => {
                    stop_if_interrupted()?;
                    cx.skip(SC, "firecracker", format!("restore failed: {e}"))?;
                    fc = None;
                }
            }
        }
    }
    if cx.a.firecracker.is_some() {
        cx.note(
            SC,
            "Firecracker's \"vCPU running\" is spawn → snapshot load answered with the VM resumed",
        )?;
    }
    Ok(())
}

// ----- sandbox -----

fn sandbox(cx: &Ctx<'_>, target: &Target) -> Res<()> {
    const SC: &str = "sandbox";
    let plan = cx.sizes.sandbox;
    for name in &cx.templates {
        let t = crate::open_or_build(name, true).map_err(other)?;
        let mut bare_ok = true;
        for i in 0..plan.warmup + plan.n {
            stop_if_interrupted()?;
            let run = i.saturating_sub(plan.warmup);
            cx.step(format!("sandbox {name} {}/{}", i + 1, plan.warmup + plan.n));
            // The unjailed baseline is optional: a failure is noted, the API figures go on.
            let bare = if bare_ok {
                match bench_api::bare_restore_ping(&t, &cx.vmm) {
                    Ok(v) => Some(v),
                    Err(e) => {
                        stop_if_interrupted()?;
                        cx.note(SC, format!("no bare restore → ping baseline ({name}): {e}"))?;
                        bare_ok = false;
                        None
                    }
                }
            } else {
                None
            };
            let [created, _synced, first] = bench_api::api_first_result(target, name)?;
            if i >= plan.warmup {
                if let Some(bare) = bare {
                    cx.ms(
                        SC,
                        "ember",
                        &format!("bare restore → ping ({name})"),
                        run,
                        bare,
                    )?;
                }
                cx.ms(
                    SC,
                    "ember",
                    &format!("API create answered ({name})"),
                    run,
                    created,
                )?;
                cx.ms(
                    SC,
                    "ember",
                    &format!("API create → first run_code result ({name})"),
                    run,
                    first,
                )?;
            }
        }
    }
    Ok(())
}

// ----- ready -----

/// The KVM counters of the first cell, as (counter, measure, unit).
const FIRST_CELL_COUNTERS: [(&str, &str, &str); 3] = [
    (
        "insn_emulation",
        "first cell: emulated instructions",
        "instructions",
    ),
    ("exits", "first cell: exits", "exits"),
    ("pf_fixed", "first cell: shadow-page fills", "fills"),
];

/// Create → ready and → first result from a primed warm pool of 2, on a server of its own
/// (the shared one, if running, is stopped first: the two would share jail uids and
/// networks; the next scenario starts it again).
fn ready(cx: &Ctx<'_>, shared: &mut Option<Target>) -> Res<()> {
    const SC: &str = "ready";
    const POOL: usize = 2;
    if let Some(t) = shared.take() {
        let mut problems = t.kill_all();
        if let Some(mut local) = t.local {
            problems.extend(local.shut_down());
        }
        if let Some(p) = problems.first() {
            return Err(other(format!("stopping the shared server: {p}")));
        }
    }
    let name = cx.templates[0].as_str();
    crate::open_or_build(name, true).map_err(other)?;
    cx.pb
        .set_message(format!("ready: a server with a primed pool of {POOL}"));
    let settings = ember_runtime::pool::PoolSettings {
        size: POOL,
        max: POOL,
        prime: true,
        ..Default::default()
    };
    let (target, rt) = Target::start_local(settings)?;
    let counts = |id: &str| crate::pool::kvm_counts(&rt, id);
    cx.step("ready: server up".into());
    let plan = cx.sizes.ready;
    let r = (|| -> Res<()> {
        for i in 0..plan.warmup + plan.n {
            stop_if_interrupted()?;
            cx.step(format!("ready {}/{}", i + 1, plan.warmup + plan.n));
            if !rt.pool_wait_ready(POOL, Duration::from_secs(120)) {
                return Err(other(format!(
                    "the pool did not fill in 120 s: {:?}",
                    rt.pool_stats()
                )));
            }
            let t0 = Instant::now();
            let info = target.create(name)?;
            let answered = bench_api::ms_since(t0);
            let c0 = counts(&info.id);
            let (first, text) = bench_api::api_run(&target.client, &info.id, "1+1", t0)?;
            let c1 = counts(&info.id);
            let primed = crate::pool::start_info(&target, &info.id)["path"] == "pool-primed";
            target.kill(&info.id)?;
            if text != "2" {
                return Err(other(format!("run_code `1+1` gave {text:?}")));
            }
            if i < plan.warmup {
                continue;
            }
            let run = i - plan.warmup;
            // A create the pool could not serve is measured but named apart.
            let from = if primed { "primed pool" } else { "pool miss" };
            cx.ms(
                SC,
                "ember",
                &format!("API create answered ({name}, {from})"),
                run,
                answered,
            )?;
            cx.ms(
                SC,
                "ember",
                &format!("API create → first run_code result ({name}, {from})"),
                run,
                first,
            )?;
            if let (Some(a), Some(b)) = (&c0, &c1) {
                for (k, measure, unit) in FIRST_CELL_COUNTERS {
                    let (Some(x), Some(y)) = (a.get(k), b.get(k)) else {
                        continue;
                    };
                    let v = y.saturating_sub(*x) as f64;
                    cx.put(
                        SC,
                        "ember",
                        &format!("{measure} ({from})"),
                        unit,
                        run,
                        v,
                        None,
                    )?;
                }
            }
        }
        Ok(())
    })();
    let problems = target.kill_all();
    if let Some(mut local) = target.local {
        local.shut_down();
    }
    r?;
    if let Some(p) = problems.first() {
        return Err(other(p));
    }
    Ok(())
}

// ----- rtt -----

/// `POST /exec` of `argv` until its end line; checks exit code 0.
fn api_exec(c: &Client, id: &str, argv: &[&str]) -> Res<()> {
    let last = c
        .stream(
            &format!("/v1/sandboxes/{}/exec", segment(id)),
            &json!({ "argv": argv }),
            &mut |_| true,
        )
        .map_err(other)?;
    match last {
        Some(v) if v["type"] == "end" && v["exit"]["code"] == 0 => Ok(()),
        other_line => Err(ScenarioError::Other(format!(
            "exec {argv:?}: last line {}",
            other_line.unwrap_or(Value::Null)
        ))),
    }
}

fn rtt(cx: &Ctx<'_>, target: &Target) -> Res<()> {
    const SC: &str = "rtt";
    let name = cx.templates[0].as_str();
    let info = target.create(name)?;
    let id = info.id.clone();
    let c = &target.client;
    let r = (|| -> Res<()> {
        // run_code and exec.
        let plan = cx.sizes.rtt;
        cx.step(format!("rtt: run_code × {}", plan.warmup + plan.n));
        for i in 0..plan.warmup + plan.n {
            stop_if_interrupted()?;
            let t0 = Instant::now();
            let (_, text) = bench_api::api_run(c, &id, "1", t0)?;
            let ms = bench_api::ms_since(t0);
            if text != "1" {
                return Err(other(format!("run_code `1` gave {text:?}")));
            }
            if i >= plan.warmup {
                cx.ms(SC, "ember", "run_code `1`", i - plan.warmup, ms)?;
            }
        }
        cx.step(format!("rtt: exec × {}", plan.warmup + plan.n));
        for i in 0..plan.warmup + plan.n {
            stop_if_interrupted()?;
            let t0 = Instant::now();
            api_exec(c, &id, &["true"])?;
            if i >= plan.warmup {
                cx.ms(
                    SC,
                    "ember",
                    "exec `true`",
                    i - plan.warmup,
                    bench_api::ms_since(t0),
                )?;
            }
        }
        // A small file (throughput is the `files` scenario's).
        for (label, bytes, plan) in [("4 KiB", 4usize << 10, cx.sizes.rtt)] {
            let data: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
            let path = format!("/tmp/ember-bench-{bytes}");
            cx.step(format!("rtt: file {label} × {}", plan.warmup + plan.n));
            for i in 0..plan.warmup + plan.n {
                stop_if_interrupted()?;
                let t0 = Instant::now();
                let w = c
                    .upload(&id, &path, &data[..], Some(bytes as u64))
                    .map_err(other)?;
                let write_ms = bench_api::ms_since(t0);
                if w.bytes != bytes as u64 {
                    return Err(other(format!("wrote {} of {bytes} bytes", w.bytes)));
                }
                let t0 = Instant::now();
                let mut back = Vec::with_capacity(bytes);
                let n = c.download(&id, &path, &mut back).map_err(other)?;
                let read_ms = bench_api::ms_since(t0);
                if n != bytes as u64 || back != data {
                    return Err(other(format!(
                        "read back {n} bytes, not the {bytes} written"
                    )));
                }
                if i >= plan.warmup {
                    let run = i - plan.warmup;
                    cx.ms(SC, "ember", &format!("file write {label}"), run, write_ms)?;
                    cx.ms(SC, "ember", &format!("file read {label}"), run, read_ms)?;
                }
            }
        }
        Ok(())
    })();
    let killed = target.kill(&id);
    r?;
    killed?;
    cx.step("rtt: done".into());
    Ok(())
}

// ----- files -----

fn files(cx: &Ctx<'_>, target: &Target) -> Res<()> {
    const SC: &str = "files";
    let name = cx.templates[0].as_str();
    let plan = cx.sizes.files;
    let runs = crate::files::measure(
        target,
        name,
        &cx.sizes.file_sizes,
        plan.n,
        "/tmp/ember-bench-file",
        &|msg| cx.step(msg),
    )
    .map_err(other)?;
    for s in &runs {
        let mib = s.size_mib as f64;
        for (op, o) in s.ops() {
            for (run, ms) in o.ms.iter().enumerate() {
                let label = format!("{op} {} MiB", s.size_mib);
                cx.put(SC, "ember", &label, "MiB/s", run, mib / (ms / 1e3), None)?;
                let Some(c) = o.counts.get(run) else { continue };
                for (k, what) in [
                    ("insn_emulation", "emulated instructions per MiB"),
                    ("exits", "exits per MiB"),
                ] {
                    if let Some(v) = c.get(k) {
                        let m = format!("{label}: {what}");
                        cx.put(SC, "ember", &m, "count", run, *v as f64 / mib, None)?;
                    }
                }
            }
        }
    }
    Ok(())
}

// ----- parallel -----

fn parallel(cx: &Ctx<'_>, target: &Target) -> Res<()> {
    const SC: &str = "parallel";
    let name = cx.templates[0].as_str();
    for &clients in &cx.sizes.clients {
        stop_if_interrupted()?;
        let per_client = cx.sizes.creates.div_ceil(clients).max(1);
        cx.pb.set_message(format!(
            "parallel: {clients} client(s) × {per_client} create+kill"
        ));
        // A level whose creates fail (the host out of breath) is a note; the others still run.
        let rate = match bench_api::create_rate(target, name, clients, per_client) {
            Ok(r) => r,
            Err(e) => {
                stop_if_interrupted()?;
                cx.note(SC, format!("{clients} clients: a create failed: {e}"))?;
                cx.step(format!("parallel: {clients} clients failed"));
                continue;
            }
        };
        let x = Some(clients as f64);
        for (run, v) in rate.create_samples.iter().enumerate() {
            cx.put(
                SC,
                "ember",
                &format!("create latency, {clients:>2} clients"),
                "ms",
                run,
                *v,
                x,
            )?;
        }
        cx.put(
            SC,
            "ember",
            &format!("creates per second, {clients:>2} clients"),
            "creates/s",
            0,
            rate.creates as f64 / rate.wall_s,
            x,
        )?;
        cx.step(format!("parallel: {clients} clients done"));
    }
    Ok(())
}

// ----- density -----

/// utime + stime of `pid`, clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = text.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3, utime 14, stime 15.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn density(cx: &Ctx<'_>, target: &Target) -> Res<()> {
    const SC: &str = "density";
    let name = cx.templates[0].as_str();
    let Some(&max_n) = cx.sizes.density.last() else {
        return Ok(());
    };
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let mut ids: Vec<(String, u32)> = Vec::new();
    let r = (|| -> Res<()> {
        for k in 1..=max_n {
            stop_if_interrupted()?;
            let t0 = Instant::now();
            let info = target.create(name)?;
            let ms = bench_api::ms_since(t0);
            let pid = target
                .client
                .sandbox(&info.id)
                .map_err(other)?
                .pid
                .ok_or_else(|| other(format!("sandbox {} has no VMM pid", info.id)))?;
            ids.push((info.id, pid));
            cx.put(
                SC,
                "ember",
                "create latency with N−1 idle sandboxes",
                "ms",
                k - 1,
                ms,
                Some((k - 1) as f64),
            )?;
            cx.step(format!("density: {k}/{max_n} idle sandboxes"));
            if !cx.sizes.density.contains(&k) {
                continue;
            }
            bench_api::sleep_interruptibly(cx.sizes.settle)?;
            let x = Some(k as f64);
            for (run, (_, pid)) in ids.iter().enumerate() {
                let m = bench_api::vmm_memory(*pid)?;
                cx.put(
                    SC,
                    "ember",
                    &format!("PSS per idle sandbox, N = {k:>2}"),
                    "MiB",
                    run,
                    m.pss as f64 / 1024.0,
                    x,
                )?;
            }
            let before: Vec<Option<u64>> = ids.iter().map(|(_, p)| cpu_ticks(*p)).collect();
            let t0 = Instant::now();
            bench_api::sleep_interruptibly(cx.sizes.cpu_window)?;
            let secs = t0.elapsed().as_secs_f64();
            for (run, ((_, pid), b)) in ids.iter().zip(&before).enumerate() {
                if let (Some(b), Some(a)) = (b, cpu_ticks(*pid)) {
                    let pct = a.saturating_sub(*b) as f64 / hz / secs * 100.0;
                    cx.put(
                        SC,
                        "ember",
                        &format!("idle CPU per sandbox, N = {k:>2}"),
                        "% of a CPU",
                        run,
                        pct,
                        x,
                    )?;
                }
            }
        }
        Ok(())
    })();
    cx.pb
        .set_message(format!("density: killing {} sandboxes", ids.len()));
    for (id, _) in &ids {
        let _ = target.kill(id);
    }
    r
}

// ----- pause -----

/// (apparent bytes, allocated bytes) of everything under `dir`.
fn dir_bytes(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut total = (0, 0);
    let Ok(rd) = std::fs::read_dir(dir) else {
        return total;
    };
    for e in rd.flatten() {
        let Ok(md) = e.path().symlink_metadata() else {
            continue;
        };
        if md.is_dir() {
            let (a, b) = dir_bytes(&e.path());
            total.0 += a;
            total.1 += b;
        } else if md.is_file() {
            total.0 += md.len();
            total.1 += md.blocks() * 512;
        }
    }
    total
}

fn pause(cx: &Ctx<'_>, target: &Target) -> Res<()> {
    const SC: &str = "pause";
    let plan = cx.sizes.pause;
    let name = cx.templates[0].as_str();
    let home = target
        .local
        .as_ref()
        .and_then(|l| l.home.as_ref())
        .map(|h| h.path().to_path_buf());
    for i in 0..plan.warmup + plan.n {
        stop_if_interrupted()?;
        cx.step(format!("pause {}/{}", i + 1, plan.warmup + plan.n));
        let info = target.create(name)?;
        let id = info.id.clone();
        let c = &target.client;
        let r = (|| -> Res<()> {
            bench_api::api_run(c, &id, "x = 41", Instant::now()).or_else(|e| match e {
                // `x = 41` shows no result: the helper wants one.
                BenchApiError::Unexpected(_) => Ok((0.0, String::new())),
                e => Err(e),
            })?;
            let t0 = Instant::now();
            let _: Value = c.action(&id, "pause").map_err(other)?;
            let pause_ms = bench_api::ms_since(t0);
            let bytes = home
                .as_ref()
                .map(|h| dir_bytes(&h.join("sandboxes").join(&id).join("pause")));
            let t0 = Instant::now();
            let _: Value = c.action(&id, "resume").map_err(other)?;
            let resume_ms = bench_api::ms_since(t0);
            let t0 = Instant::now();
            let (_, text) = bench_api::api_run(c, &id, "x + 1", t0)?;
            let first_ms = bench_api::ms_since(t0);
            if text != "42" {
                return Err(other(format!("after resume `x + 1` gave {text:?}, not 42")));
            }
            if i >= plan.warmup {
                let run = i - plan.warmup;
                cx.ms(SC, "ember", "pause", run, pause_ms)?;
                cx.ms(SC, "ember", "resume", run, resume_ms)?;
                cx.ms(SC, "ember", "resume → first run_code result", run, first_ms)?;
                if let Some((apparent, allocated)) = bytes {
                    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
                    cx.put(
                        SC,
                        "ember",
                        "pause snapshot, apparent size",
                        "MiB",
                        run,
                        mib(apparent),
                        None,
                    )?;
                    cx.put(
                        SC,
                        "ember",
                        "pause snapshot, on disk",
                        "MiB",
                        run,
                        mib(allocated),
                        None,
                    )?;
                }
            }
            Ok(())
        })();
        let killed = target.kill(&id);
        r?;
        killed?;
    }
    if home.is_none() {
        cx.note(
            SC,
            "snapshot bytes unavailable: the runtime home is not local",
        )?;
    }
    Ok(())
}

// ----- the run -----

fn first_line(cmd: &Path, arg: &str) -> Result<String, String> {
    let out = std::process::Command::new(cmd)
        .arg(arg)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", cmd.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .next()
        .filter(|_| out.status.success())
        .map(str::to_owned)
        .ok_or_else(|| format!("{} {arg} failed ({})", cmd.display(), out.status))
}

fn read_trim(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

/// The module behind /dev/kvm.
fn kvm_kind() -> String {
    let found: Vec<&str> = ["kvm_pvm", "kvm_intel", "kvm_amd"]
        .into_iter()
        .filter(|m| Path::new("/sys/module").join(m).exists())
        .collect();
    if found.is_empty() {
        format!("{:?} (no kvm_* module found)", ember_vmm::HostKvm::detect())
    } else {
        found.join(", ")
    }
}

fn git_revision() -> String {
    if let Some(r) = option_env!("EMBER_GIT_REV") {
        return r.to_string();
    }
    // The source tree this binary was built from, when it is still there.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => "unknown (no git tree beside the binary)".into(),
    }
}

fn key_of(p: &Path) -> String {
    let key = p
        .parent()
        .and_then(|d| d.file_name())
        .map(|k| k.to_string_lossy().chars().take(16).collect::<String>())
        .unwrap_or_default();
    format!("{key} ({})", p.display())
}

fn environment(cx: &Ctx<'_>) -> Environment {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let mut peers = Vec::new();
    if let Some(fc) = &cx.a.firecracker {
        peers.push((
            "firecracker".into(),
            first_line(fc, "--version").unwrap_or_else(|e| e),
        ));
    }
    if let Some(q) = &cx.qemu {
        peers.push(("qemu".into(), qemu::version(q).unwrap_or_else(|e| e)));
    }
    Environment {
        host_kernel: read_trim("/proc/sys/kernel/osrelease"),
        kvm: kvm_kind(),
        cpu_model: cpu,
        host_cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_profile: cx.profile.to_string(),
        guest_kernel: key_of(&cx.kernel),
        guest_rootfs: key_of(&cx.rootfs),
        ember_version: env!("CARGO_PKG_VERSION").into(),
        git_revision: git_revision(),
        peers,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        started: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
    }
}

fn start_server(cx: &Ctx<'_>) -> Res<Target> {
    cx.pb.set_message("starting the in-process server");
    let (local, addr, token): (Local, _, _) = Local::start()?;
    Ok(Target {
        client: Client::new(&format!("http://{addr}"), Some(token)),
        local: Some(local),
        tracker: Default::default(),
    })
}

fn run_scenario(cx: &Ctx<'_>, s: Scenario, target: &mut Option<Target>) -> Res<()> {
    if s.needs_server() && target.is_none() {
        *target = Some(start_server(cx)?);
    }
    let t = target.as_ref();
    match (s, t) {
        (Scenario::Ready, _) => ready(cx, target),
        (Scenario::Boot, _) => boot(cx),
        (Scenario::Restore, _) => restore(cx),
        (Scenario::Sandbox, Some(t)) => sandbox(cx, t),
        (Scenario::Rtt, Some(t)) => rtt(cx, t),
        (Scenario::Files, Some(t)) => files(cx, t),
        (Scenario::Parallel, Some(t)) => parallel(cx, t),
        (Scenario::Density, Some(t)) => density(cx, t),
        (Scenario::Pause, Some(t)) => pause(cx, t),
        (_, None) => Err(other("no server")),
    }
}

fn default_out() -> PathBuf {
    let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    PathBuf::from(format!("ember-bench-{}", now.replace(':', "")))
}

/// Runs `ember bench all`.
pub fn main(a: BenchAllArgs) -> ExitCode {
    bench_api::catch_sigint();
    let out = a.out.clone().unwrap_or_else(default_out);
    if let Err(e) = std::fs::create_dir_all(&out) {
        return fail(format!("cannot create {}: {e}", out.display()));
    }
    let kernel = match &a.kernel {
        Some(k) => k.clone(),
        None => match ember_runtime::images::default_kernel() {
            Ok(k) => k,
            Err(e) => return fail(e),
        },
    };
    let rootfs = match &a.rootfs {
        Some(r) => r.clone(),
        None => match ember_runtime::template::default_rootfs("default") {
            Ok(r) => r,
            Err(e) => return fail(e),
        },
    };
    let vmm = match ember_vmm::launcher::find_vmm_binary() {
        Ok(v) => v,
        Err(e) => return fail(e),
    };
    let rec = match Recorder::create(&out.join("samples.jsonl")) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let scenarios: Vec<Scenario> = if a.only.is_empty() {
        Scenario::ALL.to_vec()
    } else {
        Scenario::ALL
            .into_iter()
            .filter(|s| a.only.contains(s))
            .collect()
    };
    let templates = if !a.template.is_empty() {
        a.template.clone()
    } else if a.quick {
        vec!["default".to_string()]
    } else {
        vec!["default".to_string(), "python-data".to_string()]
    };
    let qemu_bin = if a.no_qemu {
        None
    } else {
        a.qemu.clone().or_else(qemu::find)
    };
    let sizes = Sizes::new(a.quick, a.n, a.warmup);
    let total: u64 = scenarios
        .iter()
        .map(|s| sizes.steps(*s, templates.len()))
        .sum();
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.enable_steady_tick(Duration::from_millis(200));
    let cx = Ctx {
        rec: &rec,
        pb,
        sizes,
        a: &a,
        kernel,
        rootfs,
        profile: a
            .cpu_profile
            .unwrap_or_else(|| ember_vmm::HostKvm::detect().default_profile()),
        vmm,
        templates,
        qemu: qemu_bin,
    };
    let env = environment(&cx);
    if let Err(e) = rec.push(Line::Env(env)) {
        return fail(e);
    }
    let mut problems = Vec::new();
    if scenarios.contains(&Scenario::Boot) && cx.qemu.is_none() && !a.no_qemu {
        let _ = cx.skip(
            "boot",
            "qemu",
            "qemu-system-x86_64 is not installed (Debian: apt-get install qemu-system-x86)",
        );
    }
    let mut target: Option<Target> = None;
    for &s in &scenarios {
        if interrupted() {
            break;
        }
        let t0 = Instant::now();
        cx.say(format!("ember bench all: {}", s.name()));
        match run_scenario(&cx, s, &mut target) {
            Ok(()) => cx.say(format!(
                "  {} done in {:.0} s",
                s.name(),
                t0.elapsed().as_secs_f64()
            )),
            Err(_) if interrupted() => break,
            Err(e) => {
                let msg = format!("{} stopped: {e}", s.name());
                cx.say(format!("  {msg}"));
                let _ = cx.note(s.name(), format!("stopped early: {e}"));
                problems.push(msg);
            }
        }
    }
    cx.pb.finish_and_clear();
    if interrupted() {
        eprintln!("ember: interrupted (Ctrl-C): writing the report of what was measured");
        let _ = rec.push(Line::Note {
            scenario: "*".into(),
            text: "interrupted (Ctrl-C)".into(),
        });
    }
    if let Some(t) = target.take() {
        let left = t.tracker.ids().len();
        if left > 0 {
            eprintln!("ember: killing the {left} sandbox(es) left");
        }
        problems.extend(t.kill_all());
        if let Some(mut local) = t.local {
            problems.extend(local.shut_down());
        }
    }
    let lines = rec.lines();
    let (plots, plot_problems) = report::write_all(&out, &lines);
    problems.extend(plot_problems);
    print!("{}", report::tables(&lines));
    println!(
        "\nsamples: {}\ntable:   {}\nreport:  {}\nplots:   {} ({} charts, SVG and PNG)",
        rec.path().display(),
        out.join("table.txt").display(),
        out.join("report.html").display(),
        out.join("plots").display(),
        plots.len()
    );
    for p in &problems {
        eprintln!("ember: warning: {p}");
    }
    if interrupted() {
        ExitCode::from(130)
    } else if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_is_smaller_and_n_overrides() {
        let full = Sizes::new(false, None, None);
        let quick = Sizes::new(true, None, None);
        assert!(quick.restore.n < full.restore.n);
        assert_eq!(full.clients, vec![1, 4, 16, 64]);
        assert!(quick.density.last() < full.density.last());
        assert!(quick.file_sizes.len() < full.file_sizes.len());
        assert_eq!(full.file_sizes, vec![1, 8]);
        let n = Sizes::new(true, Some(7), Some(0));
        assert_eq!((n.boot.n, n.pause.n, n.rtt.warmup), (7, 7, 0));
        assert_eq!(Sizes::new(false, Some(0), None).boot.n, 1);
    }

    #[test]
    fn proc_stat_ticks_of_this_process() {
        assert!(cpu_ticks(std::process::id()).is_some());
        assert!(cpu_ticks(u32::MAX).is_none());
    }

    #[test]
    fn directory_sizes_add_up() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("s")).unwrap();
        std::fs::write(d.path().join("a"), vec![1u8; 5000]).unwrap();
        std::fs::write(d.path().join("s/b"), vec![1u8; 100]).unwrap();
        let (apparent, allocated) = dir_bytes(d.path());
        assert_eq!(apparent, 5100);
        assert!(allocated >= 4096);
        assert_eq!(dir_bytes(&d.path().join("missing")), (0, 0));
    }

    #[test]
    fn cache_keys_are_the_directory_names() {
        assert_eq!(
            key_of(Path::new("/c/kernel/3250af6024e499fd6e2d/vmlinux")),
            "3250af6024e499fd (/c/kernel/3250af6024e499fd6e2d/vmlinux)"
        );
    }
}
