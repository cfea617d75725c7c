//! `ember vm`: boot, restore, snapshot and control single VMs, directly or jailed.

use std::path::PathBuf;

use base64::Engine;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use ember_bench_cli::{images_and_vmm, GuestArgs};
use ember_vmm::launcher::{find_vmm_binary, launch, Console};
use ember_vmm::vm::{DiskConfig, DiskMode, VmConfig};

use crate::fail as err;

// Parsed once per process; boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum VmCmd {
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
pub struct SockArgs {
    /// The VM's control socket (`ember vm boot --api-sock PATH`).
    #[arg(long)]
    api_sock: PathBuf,
}

#[derive(Debug, Args)]
pub struct SnapshotArgs {
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
pub struct RestoreArgs {
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

#[derive(Debug, Args)]
pub struct BootArgs {
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
    fn options(&self) -> Result<Option<ember_runtime::jail::JailOptions>, String> {
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
        Ok(Some(ember_runtime::jail::JailOptions {
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
    let id = ember_runtime::jail::new_id();
    let mut extra = extra.to_vec();
    if api_sock.is_some() {
        extra.push("--api-sock".into());
        extra.push("/work/api.sock".into());
    }
    let work = dir.join("work");
    std::fs::create_dir_all(&work).map_err(|e| format!("cannot create {}: {e}", work.display()))?;
    let launch = match what {
        VmStart::Boot(cfg) => ember_runtime::jail::boot(&opts, &id, vmm, cfg, &work, &extra),
        VmStart::Restore(snap) => ember_runtime::jail::snapshot_disks(snap).and_then(|disks| {
            ember_runtime::jail::restore(&opts, &id, vmm, snap, &disks, &work, &extra)
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
    if let Err(e) = ember_runtime::jail::cleanup(&launch.config) {
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
    let mut term = crate::term::RawTerminal::enter();
    eprint!("ember: console attached; Ctrl-] detaches\r\n");
    let mut buf = [0u8; 1024];
    let mut stdin = std::io::stdin();
    loop {
        let n = match stdin.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let (data, detach) = crate::term::split_detach(&buf[..n]);
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

/// Runs one `ember vm` subcommand.
pub fn main(cmd: VmCmd) -> ExitCode {
    match cmd {
        VmCmd::Boot(a) => vm_boot(a),
        VmCmd::Restore(a) => vm_restore(a),
        VmCmd::Snapshot(a) => vm_snapshot(a),
        VmCmd::Pause(a) => vm_control(&a.api_sock, ember_vmm::api::Request::Pause),
        VmCmd::Resume(a) => vm_control(&a.api_sock, ember_vmm::api::Request::Resume),
        VmCmd::Stats(a) => vm_control(&a.api_sock, ember_vmm::api::Request::Stats),
        VmCmd::Shutdown(a) => vm_control(&a.api_sock, ember_vmm::api::Request::Shutdown),
        VmCmd::MergeSnapshot { diff, out } => {
            match ember_vmm::persist::merge_snapshot(&diff, &out) {
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
    }
}
