//! `ember`: boot, snapshot and restore microVMs, run sandboxes, and benchmark them.

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
#[command(name = "ember", version, about = "KVM microVMs for running untrusted code")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Work with single VMs.
    #[command(subcommand)]
    Vm(VmCmd),
    /// Benchmarks (reported, with a peer measured in the same run where available).
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Build (or locate in the cache) the default guest kernel and root filesystem.
    Images {
        /// Template whose root filesystem to build.
        #[arg(long, default_value = "default")]
        template: String,
    },
}

#[derive(Debug, Subcommand)]
enum VmCmd {
    /// Boot a guest, stream its console, exit when it reboots or powers off.
    Boot(BootArgs),
}

#[derive(Debug, Subcommand)]
enum BenchCmd {
    /// Cold boot: process spawn → boot marker.
    Boot(BenchBootArgs),
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
            return Err(format!("{what} {} does not exist or is not a file", p.display()));
        }
    }
    Ok((kernel, rootfs))
}

fn vm_boot(a: BootArgs) -> ExitCode {
    let (kernel, rootfs) = match resolve_images(&a.guest) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    let vmm = match find_vmm_binary() {
        Ok(b) => b,
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
    let console = if a.json {
        Console::Stderr
    } else {
        Console::Inherit
    };
    let vm = match launch(&vmm, &cfg, dir.path(), console, &[]) {
        Ok(v) => v,
        Err(e) => return err(e),
    };
    let out = match vm.wait(a.timeout.map(std::time::Duration::from_secs)) {
        Ok(o) => o,
        Err(e) => return err(e),
    };
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
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "boot_marker_ms": out.boot_marker_ms,
                "vmm_boot_marker_ms": vmm_marker_ms,
                "total_ms": out.total_ms,
                "exit_code": code,
                "exit_reason": exit.as_ref().map(|e| e["detail"].clone()),
                "exit_message": exit.as_ref().map(|e| e["message"].clone()),
                "error": out.event("error").map(|e| e["message"].clone()),
                "timed_out": out.timed_out,
                "cmdline": built["cmdline"],
                "cpu_profile": built["cpu_profile"],
                "host_kvm": built["host_kvm"],
                "kernel": kernel,
                "rootfs": rootfs,
            })
        );
    } else {
        match out.boot_marker_ms {
            Some(ms) => eprintln!("ember: boot marker after {ms:.1} ms (process spawn → marker)"),
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

fn bench_boot(a: BenchBootArgs) -> ExitCode {
    let (kernel, rootfs) = match resolve_images(&a.guest) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    let vmm = match find_vmm_binary() {
        Ok(b) => b,
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
        Cmd::Vm(VmCmd::Boot(a)) => vm_boot(a),
        Cmd::Bench(BenchCmd::Boot(a)) => bench_boot(a),
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
