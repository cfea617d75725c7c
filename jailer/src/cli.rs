//! The `ember-jailer` command line, parsed into [`JailConfig`] or
//! [`CleanupConfig`]. [`JailConfig::to_args`] produces what this parses.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::cleanup::CleanupConfig;
use crate::config::{
    parse_bytes, BindSpec, CgroupLimits, EnvVar, FileSpec, JailConfig, Rlimit,
    DEFAULT_CGROUP_PARENT, DEFAULT_CGROUP_ROOT,
};

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Build a jail and start the VMM in it.
    Run(Box<JailConfig>),
    /// Remove a jail and its cgroups.
    Cleanup(CleanupConfig),
}

#[derive(Debug, Parser)]
#[command(
    name = "ember-jailer",
    version,
    about = "Build a jail (chroot, namespaces, cgroups, rlimits, dropped privileges) and exec \
             ember-vmm in it",
    long_about = None,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "Exit status: the VMM's own status once it runs; 2 for usage errors, 1 for \
                  setup failures. With --new-pid-ns a VMM killed by a signal makes the jailer \
                  die by the same signal."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Sub>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Sub {
    /// Remove a jail directory (unmounting leftovers first) and its cgroups.
    /// Idempotent.
    Cleanup(CleanupArgs),
}

#[derive(Debug, Args)]
struct CleanupArgs {
    /// Jail id.
    #[arg(long)]
    id: String,
    /// Chroot base the jail was built under.
    #[arg(long, value_name = "DIR")]
    chroot_base: PathBuf,
    /// Where cgroup hierarchies are mounted.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_CGROUP_ROOT)]
    cgroup_root: PathBuf,
    /// Parent cgroup the jail's cgroups were made under.
    #[arg(long, value_name = "PATH", default_value = DEFAULT_CGROUP_PARENT)]
    cgroup_parent: PathBuf,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Jail id, [A-Za-z0-9-]{1,64}: names <chroot-base>/<id> and the cgroup.
    #[arg(long, required = true)]
    id: Option<String>,
    /// The VMM binary (copied into the jail as /ember-vmm).
    #[arg(long, value_name = "PATH", required = true)]
    exec_file: Option<PathBuf>,
    /// uid the VMM runs as.
    #[arg(long, required = true)]
    uid: Option<u32>,
    /// gid the VMM runs as.
    #[arg(long, required = true)]
    gid: Option<u32>,
    /// Directory holding jails; the jail root is <DIR>/<id>/root.
    #[arg(long, value_name = "DIR", required = true)]
    chroot_base: Option<PathBuf>,
    /// Network namespace to join, e.g. /var/run/netns/NAME.
    #[arg(long, value_name = "PATH")]
    netns: Option<PathBuf>,
    /// Where cgroup hierarchies are mounted (v1 or v2, detected).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_CGROUP_ROOT)]
    cgroup_root: PathBuf,
    /// Parent cgroup for jails, relative to each hierarchy.
    #[arg(long, value_name = "PATH", default_value = DEFAULT_CGROUP_PARENT)]
    cgroup_parent: PathBuf,
    /// CFS quota per period, microseconds (cpu.cfs_quota_us / cpu.max).
    #[arg(long, value_name = "US")]
    cpu_quota_us: Option<u64>,
    /// CFS period, microseconds (cpu.cfs_period_us / cpu.max).
    #[arg(long, value_name = "US")]
    cpu_period_us: Option<u64>,
    /// Memory limit in bytes; K/M/G/T suffixes are binary (memory.limit_in_bytes / memory.max).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    memory_limit: Option<u64>,
    /// Maximum number of tasks (pids.max).
    #[arg(long, value_name = "N")]
    pids_max: Option<u64>,
    /// CPUs the VMM may run on, e.g. 0-1,3 (cpuset.cpus).
    #[arg(long, value_name = "LIST")]
    cpuset_cpus: Option<String>,
    /// Memory nodes (cpuset.mems); default: the parent's.
    #[arg(long, value_name = "LIST")]
    cpuset_mems: Option<String>,
    /// Resource limit NAME=N or NAME=SOFT:HARD (N may be `unlimited`), e.g.
    /// nofile=1024, fsize=0. Names: as core cpu data fsize locks memlock
    /// msgqueue nice nofile nproc rss rtprio rttime sigpending stack.
    #[arg(long, value_name = "NAME=N")]
    rlimit: Vec<Rlimit>,
    /// Place a host file or directory in the jail: hard link if on the same
    /// filesystem, else copy. DEST defaults to /<name>; `rw` chowns it to
    /// uid:gid.
    #[arg(long, value_name = "SRC[:DEST][:ro|rw]")]
    file: Vec<FileSpec>,
    /// Bind-mount a host path into the jail (non-recursive, nosuid, nodev;
    /// read-only with `ro`). DEST defaults to SRC.
    #[arg(long, value_name = "SRC[:DEST][:ro|rw]")]
    bind: Vec<BindSpec>,
    /// Keep this inherited descriptor open for the VMM (0, 1, 2 always are).
    #[arg(long, value_name = "FD")]
    keep_fd: Vec<i32>,
    /// Set a variable in the VMM's otherwise empty environment.
    #[arg(long, value_name = "KEY=VALUE")]
    env: Vec<EnvVar>,
    /// Run the VMM as pid 1 of a new PID namespace; the jailer waits for it,
    /// forwards signals, and exits as it did.
    #[arg(long)]
    new_pid_ns: bool,
    /// Also create /dev/userfaultfd in the jail.
    #[arg(long)]
    userfaultfd: bool,
    /// Mount /proc in the jail (pid entries only, other users hidden).
    #[arg(long)]
    mount_proc: bool,
    /// Hard-link the VMM binary into the jail instead of copying it (jails then share its
    /// pages; it must be root-owned and writable by nobody else; copied when on another
    /// file system).
    #[arg(long)]
    exec_link: bool,
    /// Allow uid or gid 0 for the VMM.
    #[arg(long)]
    allow_root: bool,
    /// Print per-step setup times to stderr.
    #[arg(long)]
    print_timings: bool,
    /// Arguments passed to the VMM.
    #[arg(last = true, value_name = "VMM_ARGS")]
    vmm_args: Vec<String>,
}

/// Parses a full command line (program name first).
pub fn parse<I, T>(args: I) -> Result<Command, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = Cli::try_parse_from(args)?;
    if let Some(Sub::Cleanup(c)) = cli.command {
        return Ok(Command::Cleanup(CleanupConfig {
            id: c.id,
            chroot_base: c.chroot_base,
            cgroup_root: c.cgroup_root,
            cgroup_parent: c.cgroup_parent,
        }));
    }
    let r = cli.run;
    let missing = |name: &str| {
        clap::Error::raw(
            clap::error::ErrorKind::MissingRequiredArgument,
            format!("the argument '--{name}' is required\n"),
        )
    };
    Ok(Command::Run(Box::new(JailConfig {
        id: r.id.ok_or_else(|| missing("id"))?,
        exec_file: r.exec_file.ok_or_else(|| missing("exec-file"))?,
        uid: r.uid.ok_or_else(|| missing("uid"))?,
        gid: r.gid.ok_or_else(|| missing("gid"))?,
        chroot_base: r.chroot_base.ok_or_else(|| missing("chroot-base"))?,
        netns: r.netns,
        cgroup_root: r.cgroup_root,
        cgroup_parent: r.cgroup_parent,
        limits: CgroupLimits {
            cpu_quota_us: r.cpu_quota_us,
            cpu_period_us: r.cpu_period_us,
            memory_bytes: r.memory_limit,
            pids_max: r.pids_max,
            cpuset_cpus: r.cpuset_cpus,
            cpuset_mems: r.cpuset_mems,
        },
        rlimits: r.rlimit,
        files: r.file,
        binds: r.bind,
        keep_fds: r.keep_fd,
        env: r.env,
        new_pid_ns: r.new_pid_ns,
        userfaultfd: r.userfaultfd,
        mount_proc: r.mount_proc,
        exec_link: r.exec_link,
        allow_root: r.allow_root,
        print_timings: r.print_timings,
        vmm_args: r.vmm_args,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{RlimitResource, RLIM_UNLIMITED};

    fn full() -> JailConfig {
        let mut c = JailConfig::new("vm-7", "/opt/ember-vmm", 123, 456, "/srv/jail");
        c.netns = Some("/var/run/netns/sb7".into());
        c.cgroup_root = "/mnt/cg".into();
        c.cgroup_parent = "ember/tenant".into();
        c.limits = CgroupLimits {
            cpu_quota_us: Some(50_000),
            cpu_period_us: Some(100_000),
            memory_bytes: Some(256 << 20),
            pids_max: Some(64),
            cpuset_cpus: Some("0-1".into()),
            cpuset_mems: Some("0".into()),
        };
        c.rlimits = vec![
            Rlimit::new(RlimitResource::Nofile, 1024),
            Rlimit {
                resource: RlimitResource::Fsize,
                soft: 10,
                hard: RLIM_UNLIMITED,
            },
        ];
        c.files = vec![
            "/img/vmlinux".parse().unwrap(),
            "/img/layer:/disk:rw".parse().unwrap(),
        ];
        c.binds = vec!["/lib:ro".parse().unwrap()];
        c.keep_fds = vec![5, 9];
        c.env = vec!["RUST_LOG=info".parse().unwrap()];
        c.new_pid_ns = true;
        c.userfaultfd = true;
        c.mount_proc = true;
        c.allow_root = true;
        c.print_timings = true;
        c.vmm_args = vec!["--restore".into(), "/snap".into(), "--".into(), "-x".into()];
        c
    }

    fn parse_args(args: Vec<String>) -> Command {
        parse(std::iter::once("ember-jailer".to_string()).chain(args)).unwrap()
    }

    #[test]
    fn to_args_round_trips() {
        for cfg in [full(), JailConfig::new("a", "/b", 1, 2, "/c")] {
            match parse_args(cfg.to_args()) {
                Command::Run(got) => assert_eq!(*got, cfg),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn cleanup_round_trips() {
        let mut c = CleanupConfig::new("vm-7", "/srv/jail");
        c.cgroup_root = "/mnt/cg".into();
        assert_eq!(parse_args(c.to_args()), Command::Cleanup(c));
    }

    #[test]
    fn memory_suffixes() {
        let mut a = JailConfig::new("a", "/b", 1, 2, "/c").to_args();
        a.extend(["--memory-limit".into(), "64M".into()]);
        let Command::Run(c) = parse_args(a) else {
            panic!()
        };
        assert_eq!(c.limits.memory_bytes, Some(64 << 20));
    }

    #[test]
    fn errors() {
        let p = |args: &[&str]| parse(std::iter::once("ember-jailer").chain(args.iter().copied()));
        // Missing required arguments.
        assert!(p(&["--id", "a"]).is_err());
        // A bad --file value is reported with the flag.
        let e = p(&[
            "--id",
            "a",
            "--exec-file",
            "/b",
            "--uid",
            "1",
            "--gid",
            "1",
            "--chroot-base",
            "/c",
            "--file",
            "/a:/b:zz",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("--file"), "{e}");
        let e = p(&[
            "--id",
            "a",
            "--exec-file",
            "/b",
            "--uid",
            "1",
            "--gid",
            "1",
            "--chroot-base",
            "/c",
            "--rlimit",
            "nofiles=1",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("unknown resource"), "{e}");
        // Run flags do not mix with the cleanup subcommand.
        assert!(p(&["cleanup", "--id", "a"]).is_err());
        assert!(p(&["--help"]).is_err()); // help is an "error" that prints help
    }
}
