//! `ember`: boot, snapshot and restore microVMs, run sandboxes, and benchmark them.

mod cli;

use std::path::PathBuf;
use std::process::ExitCode;

use base64::Engine;
use clap::{Args, Parser, Subcommand};
use ember_benches::boot::BootBench;
use ember_sandbox::images;
use ember_vmm::launcher::{find_vmm_binary, launch, Console};
use ember_vmm::vm::{DiskConfig, DiskMode, VmConfig};
use ember_vmm::CpuProfile;

#[derive(Debug, Parser)]
#[command(
    name = "ember",
    version,
    about = "KVM microVMs for running untrusted code"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once per process; boxing the large variants would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run code in a fresh sandbox from a template, print what it produced, throw it away.
    Run(cli::run::RunArgs),
    /// Build, list and remove templates (warm snapshots sandboxes start from).
    #[command(subcommand)]
    Template(cli::template::TemplateCmd),
    /// Work with single VMs.
    #[command(subcommand)]
    Vm(VmCmd),
    /// Benchmarks (reported, with a peer measured in the same run where available).
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Serve the sandbox API over HTTP (the runtime of this host; see docs/api.md).
    Serve(cli::serve::ServeArgs),
    /// Manage sandboxes on a running `ember serve` (EMBER_URL, EMBER_TOKEN).
    Sandbox(cli::remote::SandboxArgs),
    /// Run code in a sandbox's context, streaming its output.
    Code(cli::remote::CodeArgs),
    /// Run a program in a sandbox (`ember exec ID -- cmd args`); exits with its status.
    Exec(cli::remote::ExecArgs),
    /// Copy a file into or out of a sandbox (`./f ID:/path` or `ID:/path ./f`).
    Cp(cli::remote::CpArgs),
    /// List or download a sandbox's artifacts.
    Artifacts(cli::remote::ArtifactsArgs),
    /// Show a sandbox's audit log.
    Logs(cli::remote::LogsArgs),
    /// Save a PNG of a browser sandbox's page (`ember screenshot ID out.png`).
    Screenshot(cli::browser::ScreenshotArgs),
    /// The local CA and certificate of the E2B TLS listener (`ember serve --tls-listen`).
    #[command(subcommand)]
    Tls(cli::tls::TlsCmd),
    /// Build (or locate in the cache) the default guest kernel and root filesystem.
    Images {
        /// Template whose root filesystem to build.
        #[arg(long, default_value = "default")]
        template: String,
    },
}

#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum VmCmd {
    /// Boot a guest, stream its console, exit when it reboots or powers off.
    Boot(BootArgs),
    /// Restore a VM from a snapshot directory (a new process; the guest continues).
    Restore(RestoreArgs),
    /// Snapshot a running VM through its control socket.
    Snapshot(SnapshotArgs),
    /// Pause a running VM's vCPUs.
    Pause(SockArgs),
    /// Resume a paused VM.
    Resume(SockArgs),
    /// Show a running VM's counters.
    Stats(SockArgs),
    /// Stop a running VM (its VMM exits 0).
    Shutdown(SockArgs),
    /// Merge a diff snapshot onto its parent into a new full snapshot.
    MergeSnapshot {
        /// The diff snapshot.
        #[arg(long)]
        diff: PathBuf,
        /// The new full snapshot directory (must not exist).
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Debug, Args)]
struct SockArgs {
    /// The VM's control socket (`ember vm boot --api-sock PATH`).
    #[arg(long)]
    api_sock: PathBuf,
}

#[derive(Debug, Args)]
struct SnapshotArgs {
    #[command(flatten)]
    sock: SockArgs,
    /// Directory to create (written atomically; must not exist yet).
    #[arg(long)]
    dir: PathBuf,
    /// full or diff.
    #[arg(long, default_value = "full")]
    kind: String,
    /// What the VM does afterwards: continue, pause or exit.
    #[arg(long, default_value = "continue")]
    then: String,
}

#[derive(Debug, Args)]
struct RestoreArgs {
    /// The snapshot directory.
    #[arg(long)]
    snapshot: PathBuf,
    /// Serve a control socket for the restored VM.
    #[arg(long)]
    api_sock: Option<PathBuf>,
    /// Print one JSON object with the result at the end (the console goes to stderr).
    #[arg(long)]
    json: bool,
    /// Kill the VM if it runs longer than this many seconds.
    #[arg(long)]
    timeout: Option<u64>,
    #[command(flatten)]
    jail: JailArgs,
}

#[derive(Debug, Subcommand)]
enum BenchCmd {
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
    Sandbox(cli::bench_sandbox::BenchSandboxArgs),
    /// Runtime + HTTP server end to end: create → first result vs bare restore → ping,
    /// run_code round trip vs the library in-process, creates/s, host memory per idle sandbox.
    Api(cli::bench_api::BenchApiArgs),
    /// How many idle sandboxes the host holds: host memory, PSS and idle CPU per sandbox as N
    /// grows, every sandbox answering, and (with --until-failure) what stops it.
    Density(cli::bench_density::BenchDensityArgs),
    /// Warm pool of jailed VMMs: API create → vCPU in KVM_RUN with and without it, and
    /// creates/s (create → first run_code result) at 1/4/16/64 clients.
    Pool(cli::bench_pool::BenchPoolArgs),
    /// Every scenario (boot, restore, sandbox, rtt, parallel, density, pause) beside the peers
    /// that run here: tables, JSON lines of every sample, CDF plots and an HTML report.
    All(cli::bench_all::BenchAllArgs),
    /// Compare two `ember bench all` records (samples.jsonl) with a Mann–Whitney U test.
    Compare(cli::bench_all::BenchCompareArgs),
}

#[derive(Debug, Args)]
struct BenchDevicesArgs {
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
struct BenchClonesArgs {
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
struct BenchRestoreArgs {
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
struct GuestArgs {
    /// Kernel image (ELF vmlinux or bzImage); default: the cached default kernel.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Root filesystem image; default: the cached image of --template.
    #[arg(long)]
    rootfs: Option<PathBuf>,
    /// Template whose root filesystem is used when --rootfs is not given.
    #[arg(long, default_value = "default")]
    template: String,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    mem_mib: u64,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// CPU profile: host, pvm or baseline (default: detected).
    #[arg(long)]
    cpu_profile: Option<CpuProfile>,
}

#[derive(Debug, Args)]
struct BootArgs {
    #[command(flatten)]
    guest: GuestArgs,
    /// Extra kernel command line (appended).
    #[arg(long)]
    cmdline: Option<String>,
    /// Shell command for the guest init to run before rebooting.
    #[arg(long)]
    run: Option<String>,
    /// Attach the root filesystem read-write (default: read-only).
    #[arg(long)]
    rw: bool,
    /// Show the guest kernel's boot messages (drops `quiet`).
    #[arg(long)]
    verbose_guest: bool,
    /// Print one JSON object with the result at the end (the console goes to stderr).
    #[arg(long)]
    json: bool,
    /// Kill the VM if it runs longer than this many seconds.
    #[arg(long)]
    timeout: Option<u64>,
    /// Serve the VM's control socket here (for `ember vm snapshot/pause/resume`).
    #[arg(long)]
    api_sock: Option<PathBuf>,
    /// Track dirty pages so that `ember vm snapshot --kind diff` works.
    #[arg(long)]
    track_dirty_pages: bool,
    /// An extra disk: `path=..,mode=ro|rw|overlay[,base=..][,id=..]` (repeatable; the rootfs is
    /// /dev/vda, these follow as vdb, vdc, …).
    #[arg(long = "disk")]
    disks: Vec<String>,
    /// A network interface on an existing TAP: `tap=NAME[,mac=..]` (repeatable).
    #[arg(long = "net")]
    nets: Vec<String>,
    /// A vsock device: `cid=N,uds=PATH`.
    #[arg(long)]
    vsock: Option<String>,
    /// Interactive console: your keyboard goes to the guest's serial port; Ctrl-] detaches
    /// (the VM keeps running; stop it with `ember vm shutdown --api-sock`).
    #[arg(long, conflicts_with = "json")]
    console: bool,
    /// Also write the guest's console output to this file (instead of the terminal).
    #[arg(long, conflicts_with = "console")]
    serial_file: Option<PathBuf>,
    #[command(flatten)]
    jail: JailArgs,
}

#[derive(Debug, Args, Clone)]
struct JailArgs {
    /// Run the VMM inside ember-jailer: own root, namespaces, cgroups, unprivileged uid.
    #[arg(long)]
    jail: bool,
    /// uid the jailed VMM runs as.
    #[arg(long, default_value_t = 10000, requires = "jail")]
    jail_uid: u32,
    /// gid the jailed VMM runs as.
    #[arg(long, default_value_t = 10000, requires = "jail")]
    jail_gid: u32,
    /// Where jails are built.
    #[arg(long, default_value = "/srv/ember/jail", requires = "jail")]
    jail_base: PathBuf,
    /// Memory limit of the jail's cgroup, in MiB.
    #[arg(long, requires = "jail")]
    jail_memory_mib: Option<u64>,
    /// CPU quota of the jail's cgroup, in µs per 100 ms period.
    #[arg(long, requires = "jail")]
    jail_cpu_quota_us: Option<u64>,
    /// Most processes/threads in the jail's cgroup.
    #[arg(long, requires = "jail")]
    jail_pids_max: Option<u64>,
    /// Run the VMM as pid 1 of its own PID namespace.
    #[arg(long, requires = "jail")]
    jail_pid_ns: bool,
}

impl JailArgs {
    fn options(&self) -> Result<Option<ember_sandbox::jail::JailOptions>, String> {
        if !self.jail {
            eprintln!(
                "ember: warning: the VMM runs UNJAILED (no chroot, namespaces, cgroups or \
                 privilege drop); use --jail outside development"
            );
            return Ok(None);
        }
        let jailer = match std::env::var_os("EMBER_JAILER") {
            Some(p) => PathBuf::from(p),
            None => find_vmm_binary()
                .map_err(|e| e.to_string())?
                .with_file_name("ember-jailer"),
        };
        if !jailer.is_file() {
            return Err(format!(
                "cannot find ember-jailer at {} (set EMBER_JAILER)",
                jailer.display()
            ));
        }
        let limits = ember_jailer::CgroupLimits {
            memory_bytes: self.jail_memory_mib.map(|m| m << 20),
            cpu_quota_us: self.jail_cpu_quota_us,
            cpu_period_us: self.jail_cpu_quota_us.map(|_| 100_000),
            pids_max: self.jail_pids_max,
            ..Default::default()
        };
        Ok(Some(ember_sandbox::jail::JailOptions {
            jailer,
            uid: self.jail_uid,
            gid: self.jail_gid,
            chroot_base: self.jail_base.clone(),
            limits,
            new_pid_ns: self.jail_pid_ns,
            // `ember vm` jails one VMM: a private copy of the binary.
            exec_link: false,
        }))
    }
}

/// Launches a VMM directly or through the jailer; returns the outcome and the jail to clean.
/// How to run one VMM process.
struct RunOpts<'a> {
    console: Console,
    api_sock: Option<&'a std::path::Path>,
    extra: &'a [String],
    timeout: Option<u64>,
}

fn run_vm(
    jail: &JailArgs,
    vmm: &std::path::Path,
    what: VmStart<'_>,
    dir: &std::path::Path,
    run: RunOpts<'_>,
) -> Result<ember_vmm::launcher::VmOutcome, String> {
    let RunOpts {
        console,
        api_sock,
        extra,
        timeout,
    } = run;
    let opts = jail.options()?;
    let timeout = timeout.map(std::time::Duration::from_secs);
    let Some(opts) = opts else {
        let mut extra = extra.to_vec();
        if let Some(p) = api_sock {
            extra.push("--api-sock".into());
            extra.push(p.display().to_string());
        }
        let vm = match what {
            VmStart::Boot(cfg) => launch(vmm, cfg, dir, console, &extra),
            VmStart::Restore(snap) => {
                ember_vmm::launcher::launch_restore(vmm, snap, dir, console, &extra)
            }
        }
        .map_err(|e| e.to_string())?;
        return wait_console(vm, api_sock, timeout);
    };
    let id = ember_sandbox::jail::new_id();
    let mut extra = extra.to_vec();
    if api_sock.is_some() {
        extra.push("--api-sock".into());
        extra.push("/work/api.sock".into());
    }
    let work = dir.join("work");
    std::fs::create_dir_all(&work).map_err(|e| format!("cannot create {}: {e}", work.display()))?;
    let launch = match what {
        VmStart::Boot(cfg) => ember_sandbox::jail::boot(&opts, &id, vmm, cfg, &work, &extra),
        VmStart::Restore(snap) => ember_sandbox::jail::snapshot_disks(snap).and_then(|disks| {
            ember_sandbox::jail::restore(&opts, &id, vmm, snap, &disks, &work, &extra)
        }),
    }
    .map_err(|e| e.to_string())?;
    if let Some(p) = api_sock {
        let _ = std::fs::remove_file(p);
        std::os::unix::fs::symlink(&launch.api_sock_host, p)
            .map_err(|e| format!("cannot link the control socket at {}: {e}", p.display()))?;
    }
    eprintln!(
        "ember: jailed as {id} (uid {}, {})",
        opts.uid,
        launch.config.jail_dir().display()
    );
    let vm = ember_vmm::launcher::launch_args(
        &opts.jailer,
        &launch.args,
        &launch.report_host,
        &launch.report_in_jail,
        console,
    )
    .map_err(|e| e.to_string());
    let out = vm.and_then(|vm| wait_console(vm, api_sock, timeout));
    if let Err(e) = ember_sandbox::jail::cleanup(&launch.config) {
        eprintln!("ember: warning: jail clean-up: {e}");
    }
    out
}

enum VmStart<'a> {
    Boot(&'a VmConfig),
    Restore(&'a std::path::Path),
}

fn wait_console(
    mut vm: ember_vmm::launcher::LaunchedVm,
    api_sock: Option<&std::path::Path>,
    timeout: Option<std::time::Duration>,
) -> Result<ember_vmm::launcher::VmOutcome, String> {
    if let Some(stdin) = vm.child.stdin.take() {
        let pid = vm.child.id();
        let sock = api_sock.map(|p| p.to_path_buf());
        std::thread::spawn(move || forward_console(stdin, pid, sock));
    }
    vm.wait(timeout).map_err(|e| e.to_string())
}

#[derive(Debug, Args)]
struct BenchBootArgs {
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

/// The guest images and the `ember-vmm` binary every VM command needs.
fn images_and_vmm(g: &GuestArgs) -> Result<(PathBuf, PathBuf, PathBuf), String> {
    let (kernel, rootfs) = resolve_images(g)?;
    let vmm = find_vmm_binary().map_err(|e| e.to_string())?;
    Ok((kernel, rootfs, vmm))
}

fn resolve_images(g: &GuestArgs) -> Result<(PathBuf, PathBuf), String> {
    let kernel = match &g.kernel {
        Some(k) => k.clone(),
        None => images::default_kernel().map_err(|e| e.to_string())?,
    };
    let rootfs = match &g.rootfs {
        Some(r) => r.clone(),
        None => images::default_rootfs(&g.template).map_err(|e| e.to_string())?,
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

fn vm_boot(a: BootArgs) -> ExitCode {
    let (kernel, rootfs, vmm) = match images_and_vmm(&a.guest) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    let mut cfg = VmConfig::new(kernel.clone());
    cfg.disks.push(DiskConfig {
        path: rootfs.clone(),
        mode: if a.rw {
            DiskMode::ReadWrite
        } else {
            DiskMode::ReadOnly
        },
        id: "rootfs".into(),
    });
    cfg.mem_mib = a.guest.mem_mib;
    cfg.vcpus = a.guest.vcpus;
    cfg.track_dirty_pages = a.track_dirty_pages;
    for d in &a.disks {
        match ember_vmm::cli::parse_disk(d) {
            Ok(d) => cfg.disks.push(d),
            Err(e) => return err(format!("--disk {d:?}: {e}")),
        }
    }
    for n in &a.nets {
        match ember_vmm::cli::parse_net(n) {
            Ok(n) => cfg.net.push(n),
            Err(e) => return err(format!("--net {n:?}: {e}")),
        }
    }
    if let Some(v) = &a.vsock {
        match ember_vmm::cli::parse_vsock(v) {
            Ok(v) => cfg.vsock = Some(v),
            Err(e) => return err(format!("--vsock {v:?}: {e}")),
        }
    }
    cfg.cpu_profile = a.guest.cpu_profile;
    if a.verbose_guest {
        cfg.cmdline = Some(ember_vmm::vm::DEFAULT_CMDLINE.replace(" quiet", ""));
    }
    if let Some(c) = &a.cmdline {
        cfg.cmdline_extra.push(c.clone());
    }
    if let Some(r) = &a.run {
        let b64 = base64::engine::general_purpose::STANDARD.encode(r.as_bytes());
        cfg.cmdline_extra.push(format!("ember.run={b64}"));
    }
    let dir = match tempfile::Builder::new().prefix("ember-vm-").tempdir() {
        Ok(d) => d,
        Err(e) => return err(format!("cannot create a work directory: {e}")),
    };
    let console = if a.console {
        Console::Interactive
    } else if a.json {
        Console::Stderr
    } else {
        Console::Inherit
    };
    let mut extra: Vec<String> = Vec::new();
    if let Some(f) = &a.serial_file {
        extra.push("--serial".into());
        extra.push(format!("file:{}", f.display()));
    }
    let out = match run_vm(
        &a.jail,
        &vmm,
        VmStart::Boot(&cfg),
        dir.path(),
        RunOpts {
            console,
            api_sock: a.api_sock.as_deref(),
            extra: &extra,
            timeout: a.timeout,
        },
    ) {
        Ok(o) => o,
        Err(e) => return err(e),
    };
    report_outcome(
        &out,
        a.json,
        serde_json::json!({ "kernel": kernel, "rootfs": rootfs }),
    )
}

/// Copies our stdin to the VMM's, in raw mode, until Ctrl-] (detach) or EOF.
fn forward_console(mut to_vm: std::process::ChildStdin, pid: u32, sock: Option<PathBuf>) {
    use std::io::{Read, Write};
    let mut term = ember_sandbox::term::RawTerminal::enter();
    eprint!("ember: console attached; Ctrl-] detaches\r\n");
    let mut buf = [0u8; 1024];
    let mut stdin = std::io::stdin();
    loop {
        let n = match stdin.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let (data, detach) = ember_sandbox::term::split_detach(&buf[..n]);
        if to_vm.write_all(data).is_err() {
            return;
        }
        if detach {
            term.restore();
            match sock {
                Some(s) => eprintln!(
                    "\nember: detached; the VM keeps running (pid {pid}); stop it with \
                     `ember vm shutdown --api-sock {}`",
                    s.display()
                ),
                None => eprintln!(
                    "\nember: detached; the VM keeps running (pid {pid}); stop it with `kill {pid}`"
                ),
            }
            std::process::exit(0);
        }
    }
}

fn report_outcome(
    out: &ember_vmm::launcher::VmOutcome,
    json: bool,
    extra: serde_json::Value,
) -> ExitCode {
    let code = if out.timed_out {
        124
    } else {
        out.status.code().unwrap_or(128)
    };
    let exit = out.event("exit").cloned();
    let built = out.event("built").cloned().unwrap_or_default();
    let vmm_marker_ms = out
        .event("boot_marker")
        .and_then(|e| e["ms_since_start"].as_f64());
    // KVM's vCPU counters at the first marker: what the boot cost the guest, in counts that
    // do not depend on the host's load (emulated instructions, exits, guest page faults).
    let marker_kvm = out
        .event("boot_marker")
        .map(|e| e["kvm"]["vcpu"].clone())
        .filter(|v| v.is_object());
    if json {
        let mut obj = serde_json::json!({
                "boot_marker_ms": out.boot_marker_ms,
                "vmm_boot_marker_ms": vmm_marker_ms,
                "boot_marker_kvm": marker_kvm,
                "total_ms": out.total_ms,
                "exit_code": code,
                "exit_reason": exit.as_ref().map(|e| e["detail"].clone()),
                "exit_message": exit.as_ref().map(|e| e["message"].clone()),
                "error": out.event("error").map(|e| e["message"].clone()),
                "timed_out": out.timed_out,
                "cmdline": built["cmdline"],
                "cpu_profile": built["cpu_profile"],
                "host_kvm": built["host_kvm"],
                "restored": built["restored"],
                "vcpu_first_run_ms": out.ms_to("vcpu_first_run"),
                "vmm_uid": out.event("start").map(|e| e["uid"].clone()),
        });
        if let (Some(o), Some(e)) = (obj.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        println!("{obj}");
    } else {
        match out.boot_marker_ms {
            Some(ms) => {
                eprintln!("ember: boot marker after {ms:.1} ms (process spawn → marker)");
                if let Some(k) = &marker_kvm {
                    let n = |key: &str| k[key].as_u64().unwrap_or(0);
                    eprintln!(
                        "ember: up to the marker: {} exits, {} emulated instructions, {} guest \
                         page faults (KVM counters)",
                        n("exits"),
                        n("insn_emulation"),
                        n("pf_guest")
                    );
                }
            }
            None => eprintln!("ember: the guest never wrote its boot marker"),
        }
        match &exit {
            Some(e) => eprintln!("ember: VM exited: {}", e["message"].as_str().unwrap_or("?")),
            None if out.timed_out => eprintln!("ember: VM killed after the --timeout"),
            None => eprintln!("ember: ember-vmm exited with {}", out.status),
        }
    }
    ExitCode::from(code.clamp(0, 255) as u8)
}

fn vm_restore(a: RestoreArgs) -> ExitCode {
    let vmm = match find_vmm_binary() {
        Ok(b) => b,
        Err(e) => return err(e),
    };
    // A networked snapshot's VMM opens its TAP by name: run it (and the jailer) in an
    // isolated namespace holding that TAP, owned by the jail's uid when jailed.
    let taps = match ember_vmm::netns::snapshot_taps(&a.snapshot) {
        Ok(t) => t,
        Err(e) => return err(e),
    };
    let _netns = if taps.is_empty() {
        None
    } else {
        let list: Vec<(&str, Option<&str>)> = taps.iter().map(|t| (t.as_str(), None)).collect();
        let owner = a.jail.jail.then_some(a.jail.jail_uid);
        match ember_vmm::netns::IsolatedNetns::create_owned(&list, owner) {
            Ok(ns) => match ns.enter() {
                Ok(()) => Some(ns),
                Err(e) => return err(e),
            },
            Err(e) => return err(e),
        }
    };
    let dir = match tempfile::Builder::new().prefix("ember-vm-").tempdir() {
        Ok(d) => d,
        Err(e) => return err(format!("cannot create a work directory: {e}")),
    };
    let console = if a.json {
        Console::Stderr
    } else {
        Console::Inherit
    };
    match run_vm(
        &a.jail,
        &vmm,
        VmStart::Restore(&a.snapshot),
        dir.path(),
        RunOpts {
            console,
            api_sock: a.api_sock.as_deref(),
            extra: &[],
            timeout: a.timeout,
        },
    ) {
        Ok(out) => report_outcome(&out, a.json, serde_json::json!({ "snapshot": a.snapshot })),
        Err(e) => err(e),
    }
}

fn vm_control(sock: &std::path::Path, req: ember_vmm::api::Request) -> ExitCode {
    match ember_vmm::api::call(sock, &req) {
        Ok(reply) => {
            println!("{reply}");
            if reply["ok"] == true {
                ExitCode::SUCCESS
            } else {
                eprintln!(
                    "ember: error: {}",
                    reply["error"].as_str().unwrap_or("request failed")
                );
                ExitCode::from(1)
            }
        }
        Err(e) => err(e),
    }
}

fn vm_snapshot(a: SnapshotArgs) -> ExitCode {
    use ember_vmm::api::{AfterSnapshot, Request, SnapshotKind};
    let kind = match a.kind.as_str() {
        "full" => SnapshotKind::Full,
        "diff" => SnapshotKind::Diff,
        other => return err(format!("--kind {other:?}: expected full or diff")),
    };
    let after = match a.then.as_str() {
        "continue" => AfterSnapshot::Continue,
        "pause" => AfterSnapshot::Pause,
        "exit" => AfterSnapshot::Exit,
        other => {
            return err(format!(
                "--then {other:?}: expected continue, pause or exit"
            ))
        }
    };
    let dir = if a.dir.is_absolute() {
        a.dir
    } else {
        std::env::current_dir().unwrap_or_default().join(a.dir)
    };
    vm_control(&a.sock.api_sock, Request::Snapshot { dir, kind, after })
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run(a) => cli::run::main(a),
        Cmd::Template(c) => cli::template::main(c),
        Cmd::Serve(a) => cli::serve::main(a),
        Cmd::Sandbox(a) => cli::remote::sandbox_main(a),
        Cmd::Code(a) => cli::remote::code_main(a),
        Cmd::Exec(a) => cli::remote::exec_main(a),
        Cmd::Cp(a) => cli::remote::cp_main(a),
        Cmd::Artifacts(a) => cli::remote::artifacts_main(a),
        Cmd::Logs(a) => cli::remote::logs_main(a),
        Cmd::Screenshot(a) => cli::browser::screenshot_main(a),
        Cmd::Tls(c) => cli::tls::main(c),
        Cmd::Vm(VmCmd::Boot(a)) => vm_boot(a),
        Cmd::Vm(VmCmd::Restore(a)) => vm_restore(a),
        Cmd::Vm(VmCmd::Snapshot(a)) => vm_snapshot(a),
        Cmd::Vm(VmCmd::Pause(a)) => vm_control(&a.api_sock, ember_vmm::api::Request::Pause),
        Cmd::Vm(VmCmd::Resume(a)) => vm_control(&a.api_sock, ember_vmm::api::Request::Resume),
        Cmd::Vm(VmCmd::Stats(a)) => vm_control(&a.api_sock, ember_vmm::api::Request::Stats),
        Cmd::Vm(VmCmd::Shutdown(a)) => vm_control(&a.api_sock, ember_vmm::api::Request::Shutdown),
        Cmd::Vm(VmCmd::MergeSnapshot { diff, out }) => {
            match ember_vmm::snapshot::merge_snapshot(&diff, &out) {
                Ok(info) => {
                    println!(
                        "{}",
                        serde_json::json!({ "ok": true, "out": out, "info": info })
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => err(e),
            }
        }
        Cmd::Bench(BenchCmd::Boot(a)) => bench_boot(a),
        Cmd::Bench(BenchCmd::Restore(a)) => bench_restore(a),
        Cmd::Bench(BenchCmd::Clones(a)) => bench_clones(a),
        Cmd::Bench(BenchCmd::Devices(a)) => bench_devices(a),
        Cmd::Bench(BenchCmd::Sandbox(a)) => cli::bench_sandbox::main(a),
        Cmd::Bench(BenchCmd::Api(a)) => cli::bench_api::main(a),
        Cmd::Bench(BenchCmd::Density(a)) => cli::bench_density::main(a),
        Cmd::Bench(BenchCmd::Pool(a)) => cli::bench_pool::main(a),
        Cmd::Bench(BenchCmd::All(a)) => cli::bench_all::main(a),
        Cmd::Bench(BenchCmd::Compare(a)) => cli::bench_all::compare_main(a),
        Cmd::Images { template } => {
            let k = images::default_kernel();
            let r = images::default_rootfs(&template);
            match (k, r) {
                (Ok(k), Ok(r)) => {
                    println!("kernel: {}\nrootfs: {}", k.display(), r.display());
                    ExitCode::SUCCESS
                }
                (Err(e), _) | (_, Err(e)) => err(e),
            }
        }
    }
}
