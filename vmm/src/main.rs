//! `ember-vmm`: one VM, one process. Configured by arguments or a JSON file; exits when the
//! guest resets (status 0) or fails (non-zero, with the reason on stderr and in the report).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use ember_devices::virtio::block::BlockConfig;
use ember_devices::virtio::net::NetConfig;
use ember_devices::virtio::vsock::VsockConfig;
use ember_vmm::cli::{parse_disk, parse_net, parse_vsock};
use ember_vmm::report::{Reporter, StartTime};
use ember_vmm::{CpuProfile, Vm, VmConfig};

/// Boots one microVM in this process.
#[derive(Debug, Parser)]
#[command(name = "ember-vmm", version, about, long_about = None)]
struct Args {
    /// JSON VM configuration (see `VmConfig`); command-line flags override its fields.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Kernel image: ELF vmlinux or bzImage.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// A disk: `PATH` or `path=PATH[,mode=ro|rw][,id=SERIAL]`. The first is the root device.
    #[arg(long = "disk", value_parser = parse_disk)]
    disks: Vec<BlockConfig>,
    /// A network interface: `tap=NAME[,mac=aa:bb:cc:dd:ee:ff]` (an existing TAP device).
    #[arg(long = "net", value_parser = parse_net)]
    nets: Vec<NetConfig>,
    /// The vsock device: `cid=N,uds=PATH` (host side is a Unix socket).
    #[arg(long, value_parser = parse_vsock)]
    vsock: Option<VsockConfig>,
    /// With --restore: a new host socket path for the vsock device.
    #[arg(long, requires = "restore")]
    vsock_uds: Option<PathBuf>,
    /// With --restore: new TAP names for the network interfaces, in order (repeatable).
    #[arg(long = "tap", requires = "restore")]
    taps: Vec<String>,
    /// With --restore: new paths for the disks, in order (repeatable; `-` keeps a disk's path).
    /// For overlay disks this is the clone's own overlay, a copy of the snapshot-time one.
    #[arg(long = "disk-path", requires = "restore")]
    disk_paths: Vec<String>,
    /// Track dirty pages so that diff snapshots can be taken (also with --restore).
    #[arg(long)]
    track_dirty_pages: bool,
    /// Merge the diff snapshot DIFF_DIR onto its parent into a new full snapshot OUT_DIR,
    /// then exit (runs no VM).
    #[arg(long, num_args = 2, value_names = ["DIFF_DIR", "OUT_DIR"], conflicts_with_all = ["restore", "kernel", "config"])]
    merge_snapshot: Vec<PathBuf>,
    /// Do not pass `root=/dev/vda` for the first disk.
    #[arg(long)]
    no_root: bool,
    /// Guest memory in MiB.
    #[arg(long)]
    mem_mib: Option<u64>,
    /// Number of vCPUs.
    #[arg(long)]
    vcpus: Option<u8>,
    /// Replace the base kernel command line.
    #[arg(long)]
    cmdline: Option<String>,
    /// Append to the kernel command line (repeatable).
    #[arg(long = "cmdline-append")]
    cmdline_append: Vec<String>,
    /// CPU profile: host, pvm or baseline (default: detected from the host's KVM).
    #[arg(long)]
    cpu_profile: Option<CpuProfile>,
    /// Where guest console output goes: `stdout`, `none` or `file:PATH`.
    #[arg(long, default_value = "stdout")]
    serial: String,
    /// Feed the guest's serial console from stdin (`stdin`) or not at all (`none`).
    #[arg(long, default_value = "none")]
    serial_input: String,
    /// Write JSON-lines events (boot marker, exit) to this file.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Seccomp filters: `kill` (a syscall outside the allow-lists kills the VMM), `log` (the
    /// kernel logs it instead) or `off`.
    #[arg(long, env = "EMBER_SECCOMP", default_value = "kill")]
    seccomp: ember_vmm::seccomp::SeccompMode,
    /// Print the effective configuration and kernel command line, then exit.
    #[arg(long)]
    dry_run: bool,
    /// Restore the VM saved in this snapshot directory instead of booting a kernel.
    #[arg(long, conflicts_with_all = ["config", "kernel", "disks", "mem_mib", "vcpus", "cmdline", "cmdline_append"])]
    restore: Option<PathBuf>,
    /// With --restore: prefetch the snapshot's recorded working set: off, sync or async.
    #[arg(long, default_value = "off")]
    prefetch: ember_vmm::workingset::Prefetch,
    /// Serve the control socket (pause, resume, snapshot, stats, shutdown) at this path.
    #[arg(long)]
    api_sock: Option<PathBuf>,
}

fn serial_out(spec: &str) -> Result<ember_devices::legacy::SerialOut, String> {
    match spec {
        "stdout" => Ok(Box::new(std::io::LineWriter::new(std::io::stdout()))),
        "none" => Ok(Box::new(std::io::sink())),
        s => match s.strip_prefix("file:") {
            Some(p) => std::fs::File::create(p)
                .map(|f| Box::new(f) as ember_devices::legacy::SerialOut)
                .map_err(|e| format!("cannot create serial output file {p}: {e}")),
            None => Err(format!(
                "--serial {s:?}: expected stdout, none or file:PATH"
            )),
        },
    }
}

fn config(args: &Args) -> Result<VmConfig, String> {
    let mut c = match &args.config {
        Some(p) => {
            let s = std::fs::read_to_string(p)
                .map_err(|e| format!("cannot read config {}: {e}", p.display()))?;
            serde_json::from_str::<VmConfig>(&s)
                .map_err(|e| format!("config {}: {e}", p.display()))?
        }
        None => {
            let kernel = args
                .kernel
                .clone()
                .ok_or("no kernel given: pass --kernel PATH or --config FILE")?;
            VmConfig::new(kernel)
        }
    };
    if let Some(k) = &args.kernel {
        c.kernel = k.clone();
    }
    if !args.disks.is_empty() {
        c.disks = args.disks.clone();
    }
    if args.no_root {
        c.root = false;
    }
    if !args.nets.is_empty() {
        c.net = args.nets.clone();
    }
    if let Some(v) = &args.vsock {
        c.vsock = Some(v.clone());
    }
    if args.track_dirty_pages {
        c.track_dirty_pages = true;
    }
    if let Some(m) = args.mem_mib {
        c.mem_mib = m;
    }
    if let Some(v) = args.vcpus {
        c.vcpus = v;
    }
    if let Some(cl) = &args.cmdline {
        c.cmdline = Some(cl.clone());
    }
    c.cmdline_extra.extend(args.cmdline_append.iter().cloned());
    if let Some(p) = args.cpu_profile {
        c.cpu_profile = Some(p);
    }
    Ok(c)
}

fn main() -> ExitCode {
    let start = StartTime::now();
    let args = Args::parse();
    ember_vmm::seccomp::set_mode(args.seccomp);
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("EMBER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let fail = |msg: String| {
        eprintln!("ember-vmm: error: {msg}");
        ExitCode::from(1)
    };
    if let [diff, out] = args.merge_snapshot.as_slice() {
        return match ember_vmm::snapshot::merge_snapshot(diff, out) {
            Ok(info) => {
                println!(
                    "{}",
                    serde_json::json!({ "ok": true, "out": out, "info": info })
                );
                ExitCode::SUCCESS
            }
            Err(e) => fail(e.to_string()),
        };
    }
    let reporter = match &args.report {
        Some(p) => match Reporter::to_file(p) {
            Ok(r) => r,
            Err(e) => return fail(format!("cannot create report {}: {e}", p.display())),
        },
        None => Reporter::default(),
    };
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    reporter.event(
        "start",
        serde_json::json!({ "mono_ns": start.mono_ns, "pid": std::process::id(), "uid": uid }),
    );
    let out = match serial_out(&args.serial) {
        Ok(o) => o,
        Err(e) => return fail(e),
    };
    let built = match &args.restore {
        Some(dir) => {
            let opts = ember_vmm::snapshot::RestoreOptions {
                cpu_profile: args.cpu_profile,
                track_dirty_pages: args.track_dirty_pages,
                prefetch: args.prefetch,
                vsock_uds: args.vsock_uds.clone(),
                net_taps: args.taps.clone(),
                disk_paths: args
                    .disk_paths
                    .iter()
                    .map(|p| (p != "-").then(|| PathBuf::from(p)))
                    .collect(),
            };
            Vm::restore(dir, &opts, out, reporter.clone(), start).map_err(|e| e.to_string())
        }
        None => config(&args).and_then(|cfg| {
            Vm::build(&cfg, out, reporter.clone(), start).map_err(|e| e.to_string())
        }),
    };
    let mut vm = match built {
        Ok(vm) => vm,
        Err(e) => {
            reporter.event("error", serde_json::json!({ "message": e }));
            return fail(e);
        }
    };
    match args.serial_input.as_str() {
        "none" => {}
        "stdin" => {
            if let Err(e) = vm.attach_console_input(0) {
                return fail(e.to_string());
            }
        }
        other => return fail(format!("--serial-input {other:?}: expected stdin or none")),
    }
    if let Some(sock) = &args.api_sock {
        if let Err(e) = vm.serve_api(sock) {
            reporter.event("error", serde_json::json!({ "message": e.to_string() }));
            return fail(e.to_string());
        }
    }
    reporter.event(
        "built",
        serde_json::json!({
            "ms_since_start": start.instant.elapsed().as_secs_f64() * 1e3,
            "cmdline": vm.cmdline,
            "cpu_profile": vm.profile,
            "host_kvm": vm.host,
            "restored": args.restore.is_some(),
        }),
    );
    if args.dry_run {
        println!(
            "{}",
            serde_json::json!({ "config": vm.config, "cmdline": vm.cmdline, "cpu_profile": vm.profile })
        );
        return ExitCode::SUCCESS;
    }
    match vm.run() {
        Ok(exit) => {
            let code = exit.exit_code();
            let _ = std::io::stdout().flush();
            if code != 0 {
                eprintln!("ember-vmm: {exit}");
            }
            ExitCode::from(code as u8)
        }
        Err(e) => fail(e.to_string()),
    }
}
