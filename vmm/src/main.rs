//! `ember-vmm`: one VM, one process. Configured by arguments or a JSON file; exits when the
//! guest resets (status 0) or fails (non-zero, with the reason on stderr and in the report).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use ember_devices::virtio::block::BlockConfig;
use ember_devices::virtio::net::NetConfig;
use ember_devices::virtio::vsock::VsockConfig;
use ember_vmm::builder::{build_boot, build_restore};
use ember_vmm::cli::{parse_disk, parse_net, parse_size, parse_vsock};
use ember_vmm::report::{Reporter, StartTime};
use ember_vmm::rotating_file::RotatingFile;
use ember_vmm::{CpuProfile, VmConfig};

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
    /// With --restore: drop the vsock connections the snapshot kept and send the guest a
    /// transport reset (as restores of older snapshots do) instead of keeping idle ones for
    /// `ATTACH <port>` on the vsock socket.
    #[arg(long, requires = "restore")]
    vsock_transport_reset: bool,
    /// With --restore: new TAP names for the network interfaces, in order (repeatable).
    #[arg(long = "tap", requires = "restore")]
    taps: Vec<String>,
    /// With --restore: new paths for the disks, in order (repeatable; `-` keeps a disk's path).
    /// For overlay disks this is the clone's own overlay, a copy of the snapshot-time one.
    #[arg(long = "disk-path", requires = "restore", value_name = "PATH")]
    disk_paths: Vec<String>,
    /// With --restore: new base images for the overlay disks, in disk order like --disk-path
    /// (repeatable; `-` keeps a disk's base). Use it where the base lives at another path than
    /// when the snapshot was taken (e.g. inside a jail); it must be the same image (size and
    /// content fingerprint are checked). A path for a disk that is not an overlay is an error.
    #[arg(long = "disk-base", requires = "restore", value_name = "PATH")]
    disk_bases: Vec<String>,
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
    /// Where guest console output goes: `stdout`, `none` or `file:PATH`. A file is capped
    /// (--serial-max-bytes): when full it is renamed to PATH.1 (replacing the previous one) and
    /// a new PATH is started, so it takes at most twice the cap on disk.
    #[arg(long, default_value = "stdout")]
    serial: String,
    /// Size cap of the `--serial file:PATH` file: bytes, or with a K, M or G suffix (KiB, MiB,
    /// GiB) [default: 4M].
    #[arg(long, value_parser = parse_size, value_name = "N")]
    serial_max_bytes: Option<u64>,
    /// Write the VMM's log to this file instead of stderr (capped and rotated like the
    /// console file, written by a thread of its own; the level comes from EMBER_LOG).
    #[arg(long, value_name = "PATH")]
    log_file: Option<PathBuf>,
    /// Size cap of the --log-file file: bytes, or with a K, M or G suffix [default: 4M].
    #[arg(long, value_parser = parse_size, value_name = "N", requires = "log_file")]
    log_max_bytes: Option<u64>,
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
    /// Build no VM: bind --api-sock, install the `restore` seccomp filter and wait for a
    /// `{"op":"restore","dir":…}` request naming the snapshot and the clone's overrides (a
    /// warm-pool VMM, see `ember_vmm::pooled`), then run it like --restore.
    #[arg(long, requires = "api_sock", conflicts_with_all = ["restore", "config", "kernel", "disks", "nets", "vsock", "merge_snapshot", "dry_run", "mem_mib", "vcpus", "cmdline", "cmdline_append"])]
    wait_restore: bool,
}

fn serial_out(
    spec: &str,
    max_bytes: Option<u64>,
) -> Result<ember_devices::legacy::SerialOut, String> {
    let file = spec.strip_prefix("file:");
    if file.is_none() && max_bytes.is_some() {
        return Err(format!(
            "--serial-max-bytes only applies to --serial file:PATH, not --serial {spec}"
        ));
    }
    match (spec, file) {
        ("stdout", _) => Ok(Box::new(std::io::LineWriter::new(std::io::stdout()))),
        ("none", _) => Ok(Box::new(std::io::sink())),
        (_, Some(p)) => {
            let max = max_bytes.unwrap_or(ember_vmm::rotating_file::DEFAULT_MAX_BYTES);
            RotatingFile::create(std::path::Path::new(p), max)
                .map(|f| Box::new(f) as ember_devices::legacy::SerialOut)
                .map_err(|e| format!("serial output file: {e}"))
        }
        (s, None) => Err(format!(
            "--serial {s:?}: expected stdout, none or file:PATH"
        )),
    }
}

/// Per-disk overrides: `-` keeps the snapshot's value.
fn keep_or_path(values: &[String]) -> Vec<Option<PathBuf>> {
    values
        .iter()
        .map(|p| (p != "-").then(|| PathBuf::from(p)))
        .collect()
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

/// `--wait-restore`: waits on the control socket for the restore request, then runs the VM.
fn wait_and_restore(
    args: &Args,
    out: ember_devices::legacy::SerialOut,
    reporter: Reporter,
) -> ExitCode {
    use ember_vmm::pooled::{self, WaitRequest};
    let fail = |msg: String| {
        reporter.event("error", serde_json::json!({ "message": msg }));
        eprintln!("ember-vmm: error: {msg}");
        ExitCode::from(1)
    };
    let Some(sock) = &args.api_sock else {
        return fail("--wait-restore needs --api-sock".into());
    };
    let listener = match pooled::bind(sock) {
        Ok(l) => l,
        Err(e) => return fail(e.to_string()),
    };
    if let Err(e) = ember_vmm::seccomp::install_configured(ember_vmm::seccomp::ThreadKind::Restore)
    {
        return fail(e.to_string());
    }
    reporter.event(
        "waiting",
        serde_json::json!({ "mono_ns": ember_vmm::report::monotonic_ns() }),
    );
    let pending = match pooled::next_request(&listener, false) {
        Ok(p) => p,
        Err(e) => return fail(e.to_string()),
    };
    // Timings from here on are those of the restore, not of the wait.
    let start = StartTime::now();
    let req = match &pending.request {
        WaitRequest::Restore(r) => r.clone(),
        WaitRequest::Start => {
            pending.reply(
                &serde_json::json!({ "ok": false, "error": "nothing to start: restore first" }),
            );
            return fail("start requested before any restore".into());
        }
        WaitRequest::Shutdown | WaitRequest::Ping => {
            pending.reply(&serde_json::json!({ "ok": true }));
            return ExitCode::SUCCESS;
        }
    };
    reporter.event(
        "restore_request",
        serde_json::json!({ "mono_ns": start.mono_ns, "dir": req.dir, "hold": req.hold }),
    );
    let mut opts = req.options();
    opts.cpu_profile = args.cpu_profile;
    opts.track_dirty_pages |= args.track_dirty_pages;
    let mut vm = match build_restore(&req.dir, &opts, out, reporter.clone(), start) {
        Ok(vm) => vm,
        Err(e) => {
            let msg = e.to_string();
            pending.reply(&serde_json::json!({ "ok": false, "error": msg }));
            return fail(msg);
        }
    };
    let ms = start.instant.elapsed().as_secs_f64() * 1e3;
    reporter.event(
        "built",
        serde_json::json!({
            "ms_since_start": ms,
            "cmdline": vm.cmdline,
            "cpu_profile": vm.profile,
            "host_kvm": vm.host,
            "restored": true,
            "pooled": true,
        }),
    );
    // A held VM waits for `start` (or `shutdown`) before its vCPUs run.
    let pending = if req.hold {
        pending.reply(&serde_json::json!({ "ok": true, "ms": ms, "held": true }));
        loop {
            let p = match pooled::next_request(&listener, true) {
                Ok(p) => p,
                Err(e) => return fail(e.to_string()),
            };
            match p.request {
                WaitRequest::Start => {
                    reporter.event(
                        "start_request",
                        serde_json::json!({ "mono_ns": ember_vmm::report::monotonic_ns() }),
                    );
                    break p;
                }
                WaitRequest::Shutdown => {
                    p.reply(&serde_json::json!({ "ok": true }));
                    return ExitCode::SUCCESS;
                }
                _ => p.reply(&serde_json::json!({
                    "ok": false, "error": "a VM is restored and held: start or shutdown it",
                })),
            }
        }
    } else {
        pending
    };
    if let Err(e) = vm.serve_api_listener(listener) {
        let msg = format!("control socket: {e}");
        pending.reply(&serde_json::json!({ "ok": false, "error": msg }));
        return fail(msg);
    }
    pending.reply(&serde_json::json!({ "ok": true, "ms": ms }));
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

fn main() -> ExitCode {
    let start = StartTime::now();
    let args = Args::parse();
    ember_vmm::seccomp::set_mode(args.seccomp);
    let fail = |msg: String| {
        eprintln!("ember-vmm: error: {msg}");
        ExitCode::from(1)
    };
    // Declared before everything that logs, so dropped after it: writes out queued lines.
    let _log = match ember_vmm::logging::init(&ember_vmm::logging::target(
        args.log_file.as_deref(),
        args.log_max_bytes,
    )) {
        Ok(guard) => guard,
        Err(e) => return fail(e.to_string()),
    };
    if let [diff, out] = args.merge_snapshot.as_slice() {
        return match ember_vmm::persist::merge_snapshot(diff, out) {
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
    // clap's `requires = "restore"` is satisfied by --kernel (which conflicts with --restore),
    // so the restore-only overrides are checked here: given without --restore they would be
    // silently ignored.
    if args.restore.is_none() {
        let given = [
            ("--vsock-uds", args.vsock_uds.is_some()),
            ("--vsock-transport-reset", args.vsock_transport_reset),
            ("--tap", !args.taps.is_empty()),
            ("--disk-path", !args.disk_paths.is_empty()),
            ("--disk-base", !args.disk_bases.is_empty()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
            return fail(format!("{flag} only applies with --restore"));
        }
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
    let out = match serial_out(&args.serial, args.serial_max_bytes) {
        Ok(o) => o,
        Err(e) => return fail(e),
    };
    if args.wait_restore {
        return wait_and_restore(&args, out, reporter);
    }
    let built = match &args.restore {
        Some(dir) => {
            let opts = ember_vmm::persist::RestoreOptions {
                cpu_profile: args.cpu_profile,
                track_dirty_pages: args.track_dirty_pages,
                prefetch: args.prefetch,
                vsock_uds: args.vsock_uds.clone(),
                vsock_transport_reset: args.vsock_transport_reset,
                net_taps: args.taps.clone(),
                disk_paths: keep_or_path(&args.disk_paths),
                disk_bases: keep_or_path(&args.disk_bases),
            };
            build_restore(dir, &opts, out, reporter.clone(), start).map_err(|e| e.to_string())
        }
        None => config(&args).and_then(|cfg| {
            build_boot(&cfg, out, reporter.clone(), start).map_err(|e| e.to_string())
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
