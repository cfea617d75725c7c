//! `ember bench`: the benchmark subcommands. The harness itself (boot, restore, clones,
//! devices, statistics, records, plots) is the `ember-benches` library; this crate adds the
//! command-line side and the scenarios that need the runtime and the server (`sandbox`, `api`,
//! `density`, `pool`, `all`).

pub mod all;
pub mod api;
pub mod density;
pub mod files;
pub mod pool;
pub mod sandbox;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use ember_benches::boot::BootBench;
use ember_runtime::images;
use ember_vmm::launcher::find_vmm_binary;
use ember_vmm::CpuProfile;

/// Opens template `name`, or builds it once (printing its steps unless `quiet`): the
/// benchmarks and `ember run` start from a template the user may not have built yet.
pub fn open_or_build(
    name: &str,
    quiet: bool,
) -> Result<ember_runtime::Template, ember_runtime::TemplateError> {
    let t0 = std::time::Instant::now();
    let mut announced = false;
    ember_runtime::Template::open_or_build(name, &mut |ev| {
        if !announced {
            announced = true;
            eprintln!("ember: template {name} is not built yet; building it (once)");
        }
        match ev {
            ember_runtime::BuildEvent::Step(s) if !quiet => {
                eprintln!("[{:7.1}s] {s}", t0.elapsed().as_secs_f64())
            }
            _ => {}
        }
    })
}

/// Prints `ember: error: MSG` and returns exit status 1.
pub fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("ember: error: {msg}");
    ExitCode::from(1)
}

#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// Cold boot: process spawn → boot marker.
    Boot(BenchBootArgs),
    /// Restore from a snapshot: spawn → vCPU running, spawn → agent ping answered.
    Restore(BenchRestoreArgs),
    /// Host memory of N idle clones of one snapshot (PSS sum, private per clone, VMM overhead).
    Clones(BenchClonesArgs),
    /// Device throughput and latency in a guest (vsock, net, blk) beside the same on the host.
    Devices(BenchDevicesArgs),
    /// Code interpreter: bare restore → ping vs restore → first `run_code` result, `run_code`
    /// round trip, guest page faults per call.
    Sandbox(sandbox::BenchSandboxArgs),
    /// Runtime + HTTP server end to end: create → first result vs bare restore → ping,
    /// run_code round trip vs the library in-process, creates/s, host memory per idle sandbox.
    Api(api::BenchApiArgs),
    /// How many idle sandboxes the host holds: host memory, PSS and idle CPU per sandbox as N
    /// grows, every sandbox answering, and (with --until-failure) what stops it.
    Density(density::BenchDensityArgs),
    /// File uploads and downloads through the API (1, 8, 64 MiB): MiB/s, the guest work per
    /// MiB (emulated instructions, exits, faults) and the guest's own `dd` beside them.
    Files(files::BenchFilesArgs),
    /// Warm pool of jailed VMMs: API create → vCPU in KVM_RUN with and without it, and
    /// creates/s (create → first run_code result) at 1/4/16/64 clients.
    Pool(pool::BenchPoolArgs),
    /// Every scenario (boot, restore, sandbox, rtt, parallel, density, pause) beside the peers
    /// that run here: tables, JSON lines of every sample, CDF plots and an HTML report.
    All(all::BenchAllArgs),
    /// Compare two `ember bench all` records (samples.jsonl) with a Mann–Whitney U test.
    Compare(all::BenchCompareArgs),
}

#[derive(Debug, Args)]
pub struct BenchDevicesArgs {
    #[command(flatten)]
    guest: GuestArgs,
    /// Move less data (about a minute and a half of guest work).
    #[arg(long)]
    quick: bool,
    /// JSON lines only.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct BenchClonesArgs {
    #[command(flatten)]
    guest: GuestArgs,
    /// Clones to run at once.
    #[arg(long, default_value_t = 100)]
    n: usize,
    /// JSON only.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct BenchRestoreArgs {
    #[command(flatten)]
    guest: GuestArgs,
    /// Restores per system.
    #[arg(long, default_value_t = 100)]
    n: usize,
    /// Also restore Firecracker's snapshot of the same guest with this binary.
    #[arg(long)]
    firecracker: Option<PathBuf>,
    /// ember's working-set prefetch for the restores: off, sync or async.
    #[arg(long, default_value = "off")]
    prefetch: String,
    /// How ember's clones reach the agent: `attach` (the template snapshot keeps an idle agent
    /// connection, which the clone takes over with `ATTACH`), `connect` (a new connection, no
    /// transport reset) or `reset` (transport reset + new connection, as restores did before
    /// connections were kept).
    #[arg(long, default_value = "attach")]
    vsock: ember_benches::restore::VsockMode,
    /// JSON lines only (one object per system and measure, then one per KVM counter).
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct GuestArgs {
    /// Kernel image (ELF vmlinux or bzImage); default: the cached default kernel.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Root filesystem image; default: the cached image of --template.
    #[arg(long)]
    pub rootfs: Option<PathBuf>,
    /// Template whose root filesystem is used when --rootfs is not given.
    #[arg(long, default_value = "default")]
    pub template: String,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    pub mem_mib: u64,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub vcpus: u8,
    /// CPU profile: host, pvm or baseline (default: detected).
    #[arg(long)]
    pub cpu_profile: Option<CpuProfile>,
}

#[derive(Debug, Args)]
pub struct BenchBootArgs {
    #[command(flatten)]
    guest: GuestArgs,
    /// Boots per system.
    #[arg(long, default_value_t = 5)]
    n: usize,
    /// Also boot the same kernel and rootfs with this Firecracker binary.
    #[arg(long)]
    firecracker: Option<PathBuf>,
    /// JSON lines only (one object per system and measure).
    #[arg(long)]
    json: bool,
}

fn err(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("ember: error: {msg}");
    ExitCode::from(1)
}

pub fn images_and_vmm(g: &GuestArgs) -> Result<(PathBuf, PathBuf, PathBuf), String> {
    let (kernel, rootfs) = resolve_images(g)?;
    let vmm = find_vmm_binary().map_err(|e| e.to_string())?;
    Ok((kernel, rootfs, vmm))
}

pub fn resolve_images(g: &GuestArgs) -> Result<(PathBuf, PathBuf), String> {
    let kernel = match &g.kernel {
        Some(k) => k.clone(),
        None => images::default_kernel().map_err(|e| e.to_string())?,
    };
    let rootfs = match &g.rootfs {
        Some(r) => r.clone(),
        None => ember_runtime::template::default_rootfs(&g.template).map_err(|e| e.to_string())?,
    };
    for (what, p) in [("kernel", &kernel), ("root filesystem", &rootfs)] {
        if !p.is_file() {
            return Err(format!(
                "{what} {} does not exist or is not a file",
                p.display()
            ));
        }
    }
    Ok((kernel, rootfs))
}

fn bench_restore(a: BenchRestoreArgs) -> ExitCode {
    let (kernel, rootfs, vmm) = match images_and_vmm(&a.guest) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    if a.n == 0 {
        return err("--n must be at least 1");
    }
    let work = match tempfile::Builder::new().prefix("ember-bench-").tempdir() {
        Ok(d) => d,
        Err(e) => return err(format!("cannot create a work directory: {e}")),
    };
    let bench = ember_benches::restore::RestoreBench {
        kernel,
        rootfs,
        mem_mib: a.guest.mem_mib,
        n: a.n,
        profile: a
            .guest
            .cpu_profile
            .unwrap_or_else(|| ember_vmm::HostKvm::detect().default_profile()),
        ember_vmm: vmm,
        firecracker: a.firecracker,
        workdir: work.path().to_path_buf(),
        prefetch: a.prefetch,
        vsock: a.vsock,
    };
    if !a.json {
        eprintln!(
            "ember: booting the template guests and taking their snapshots (this takes a while)"
        );
    }
    let json = a.json;
    let n = a.n;
    let results = bench.run(|sys, i, r, p| {
        if !json && (i < 3 || i + 1 == n || (i + 1) % 25 == 0) {
            eprintln!(
                "  {sys:<12} restore {:>3}: running {r:.2} ms, ping {p:.2} ms",
                i + 1
            );
        }
    });
    match results {
        Ok((rs, counts)) => {
            if json {
                for r in &rs {
                    println!("{}", serde_json::to_string(r).unwrap_or_default());
                }
                for c in &counts {
                    println!("{}", serde_json::to_string(c).unwrap_or_default());
                }
            } else {
                print!("{}", ember_benches::restore::table(&rs));
                if !counts.is_empty() {
                    println!(
                        "KVM counters from spawn to the guest's first answer (ember's VMM reads \
                         them; Firecracker's cannot be read from outside its process here)"
                    );
                    print!("{}", ember_benches::restore::counts_table(&counts));
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => err(e),
    }
}

fn bench_clones(a: BenchClonesArgs) -> ExitCode {
    let (kernel, rootfs, vmm) = match images_and_vmm(&a.guest) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    let work = match tempfile::Builder::new().prefix("ember-bench-").tempdir() {
        Ok(d) => d,
        Err(e) => return err(format!("cannot create a work directory: {e}")),
    };
    let bench = ember_benches::restore::RestoreBench {
        kernel,
        rootfs,
        mem_mib: a.guest.mem_mib,
        n: 0,
        profile: a
            .guest
            .cpu_profile
            .unwrap_or_else(|| ember_vmm::HostKvm::detect().default_profile()),
        ember_vmm: vmm.clone(),
        firecracker: None,
        workdir: work.path().to_path_buf(),
        prefetch: "off".into(),
        vsock: ember_benches::restore::VsockMode::Connect,
    };
    if !a.json {
        eprintln!("ember: booting the template guest and taking its snapshot");
    }
    let snap = match bench.prepare_ember() {
        Ok(s) => s,
        Err(e) => return err(e),
    };
    let json = a.json;
    let r = ember_benches::clones::measure_clones(
        &vmm,
        &snap,
        work.path(),
        a.n,
        a.guest.mem_mib,
        |i| {
            if !json && (i % 10 == 0 || i == a.n) {
                eprintln!("  {i} clones running");
            }
        },
    );
    match r {
        Ok((res, _)) => {
            if json {
                println!("{}", serde_json::to_string(&res).unwrap_or_default());
            } else {
                println!(
                    "{} clones of a {} MiB guest: total PSS {:.1} MiB ({:.2} MiB per clone); \
                     per clone: private {:.2} MiB, guest-memory PSS {:.2} MiB, VMM overhead {:.2} MiB",
                    res.clones,
                    res.mem_mib,
                    res.total_pss_mib,
                    res.total_pss_mib / res.clones as f64,
                    res.per_clone_private_mib_median,
                    res.guest_pss_mib_median,
                    res.vmm_overhead_mib_median
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => err(e),
    }
}

fn bench_devices(a: BenchDevicesArgs) -> ExitCode {
    let (kernel, rootfs, vmm) = match images_and_vmm(&a.guest) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    match ember_benches::devices::run_device_benches(&kernel, &rootfs, &vmm, a.quick) {
        Ok(rs) => {
            if a.json {
                for r in &rs {
                    println!("{}", serde_json::to_string(r).unwrap_or_default());
                }
            } else {
                print!("{}", ember_benches::devices::table(&rs));
            }
            ExitCode::SUCCESS
        }
        Err(e) => err(e),
    }
}

fn bench_boot(a: BenchBootArgs) -> ExitCode {
    let (kernel, rootfs, vmm) = match images_and_vmm(&a.guest) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    if a.n == 0 {
        return err("--n must be at least 1");
    }
    let bench = BootBench {
        kernel,
        rootfs,
        mem_mib: a.guest.mem_mib,
        vcpus: a.guest.vcpus,
        n: a.n,
        profile: a
            .guest
            .cpu_profile
            .unwrap_or_else(|| ember_vmm::HostKvm::detect().default_profile()),
        ember_vmm: vmm,
        firecracker: a.firecracker,
    };
    let json = a.json;
    let results = bench.run(|sys, i, s| {
        if !json {
            eprintln!(
                "  {sys:<12} boot {:>2}: marker {} ms, ready line {} ms",
                i + 1,
                s.marker_ms.map(|x| format!("{x:.1}")).unwrap_or("-".into()),
                s.ready_line_ms
                    .map(|x| format!("{x:.1}"))
                    .unwrap_or("-".into())
            );
        }
    });
    match results {
        Ok(rs) => {
            if json {
                for r in &rs {
                    println!("{}", serde_json::to_string(r).unwrap_or_default());
                }
            } else {
                print!("{}", ember_benches::boot::table(&rs));
            }
            ExitCode::SUCCESS
        }
        Err(e) => err(e),
    }
}

/// Runs one `ember bench` subcommand.
pub fn main(cmd: BenchCmd) -> ExitCode {
    match cmd {
        BenchCmd::Boot(a) => bench_boot(a),
        BenchCmd::Restore(a) => bench_restore(a),
        BenchCmd::Clones(a) => bench_clones(a),
        BenchCmd::Devices(a) => bench_devices(a),
        BenchCmd::Sandbox(a) => sandbox::main(a),
        BenchCmd::Api(a) => api::main(a),
        BenchCmd::Density(a) => density::main(a),
        BenchCmd::Pool(a) => pool::main(a),
        BenchCmd::Files(a) => files::main(a),
        BenchCmd::All(a) => all::main(a),
        BenchCmd::Compare(a) => all::compare_main(a),
    }
}
