//! Jail configuration: the types the sandbox runtime builds, their parsing
//! from command-line values, validation, and [`JailConfig::to_args`].

use std::fmt;
use std::os::unix::fs::FileTypeExt;
use std::path::{Component, Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Path of the VMM binary inside the jail.
pub const JAIL_EXEC_PATH: &str = "/ember-vmm";
/// Default root under which cgroup hierarchies are mounted.
pub const DEFAULT_CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// Default parent cgroup (relative to each hierarchy) for jails.
pub const DEFAULT_CGROUP_PARENT: &str = "ember";
/// Longest accepted jail id.
pub const MAX_ID_LEN: usize = 64;

/// A user error in the jail configuration. The binary exits with
/// [`crate::EXIT_USAGE`] for these.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The id has a bad length or character.
    #[error("invalid id {id:?}: must be 1 to 64 characters from [A-Za-z0-9-]")]
    InvalidId {
        /// The id as given.
        id: String,
    },
    /// A path that must be absolute is not.
    #[error("{what} {path:?} is not an absolute path")]
    RelativePath {
        /// Which argument.
        what: &'static str,
        /// The path as given.
        path: PathBuf,
    },
    /// A path contains `..`.
    #[error("{what} {path:?} contains a `..` component")]
    DotDot {
        /// Which argument.
        what: &'static str,
        /// The path as given.
        path: PathBuf,
    },
    /// A path contains a character the command line cannot carry.
    #[error("{what} {path:?} contains {reason}")]
    BadPathChar {
        /// Which argument.
        what: &'static str,
        /// The path as given.
        path: PathBuf,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A path that must exist does not (or cannot be inspected).
    #[error("{what} {path:?} cannot be used: {source}")]
    Inaccessible {
        /// Which argument.
        what: &'static str,
        /// The path as given.
        path: PathBuf,
        /// Why `stat` failed.
        source: std::io::Error,
    },
    /// `--exec-link` with a binary the jailed uid could change.
    #[error(
        "VMM binary {path:?} cannot be linked into jails (--exec-link): it must be owned by \
         root, writable by nobody else and not set-id (mode {mode:o}, owner uid {uid})"
    )]
    SharedExecUnsafe {
        /// The path as given.
        path: PathBuf,
        /// Its mode bits.
        mode: u32,
        /// Its owner.
        uid: u32,
    },
    /// The VMM binary is not a regular file.
    #[error("VMM binary {path:?} is not a regular file")]
    NotRegularFile {
        /// The path as given.
        path: PathBuf,
    },
    /// A path exists but has the wrong type.
    #[error("{what} {path:?} is not a {expected}")]
    WrongFileType {
        /// Which argument.
        what: &'static str,
        /// The path as given.
        path: PathBuf,
        /// What it should have been.
        expected: &'static str,
    },
    /// `<chroot-base>/<id>` already exists.
    #[error(
        "jail directory {path:?} already exists (id in use, or not cleaned up: \
         run `ember-jailer cleanup`)"
    )]
    JailExists {
        /// The jail directory.
        path: PathBuf,
    },
    /// uid or gid 0 without `--allow-root`.
    #[error("refusing to run the VMM with {which} 0 (root); pass --allow-root to allow it")]
    RootRefused {
        /// `"uid"` or `"gid"`.
        which: &'static str,
    },
    /// A `--file`/`--bind` value could not be parsed.
    #[error("invalid {flag} value {spec:?}: {reason}")]
    BadSpec {
        /// The flag, e.g. `--file`.
        flag: &'static str,
        /// The value as given.
        spec: String,
        /// What is wrong.
        reason: String,
    },
    /// Two entries would land on the same path inside the jail.
    #[error("two entries would be placed at {dest:?} inside the jail")]
    DuplicateDest {
        /// The clashing destination.
        dest: PathBuf,
    },
    /// A destination inside the jail is reserved by the jailer.
    #[error("{dest:?} inside the jail is reserved by the jailer")]
    ReservedDest {
        /// The destination.
        dest: PathBuf,
    },
    /// A `--keep-fd` value is unusable.
    #[error("--keep-fd {fd}: {reason}")]
    BadKeepFd {
        /// The descriptor as given.
        fd: i32,
        /// What is wrong.
        reason: &'static str,
    },
    /// A cgroup limit is out of range.
    #[error("invalid {flag} {value:?}: {reason}")]
    BadLimit {
        /// The flag.
        flag: &'static str,
        /// The value as given.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// The cgroup parent is not a plain relative path.
    #[error("invalid --cgroup-parent {parent:?}: must be a relative path of plain names")]
    BadCgroupParent {
        /// The parent as given.
        parent: PathBuf,
    },
}

/// Cgroup limits for one jail. `None` means "leave the kernel default".
///
/// A cgroup is created only for the controllers that have a limit (cgroup
/// v1), or once if any limit is set (cgroup v2).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupLimits {
    /// CFS quota in microseconds per period (`cpu.cfs_quota_us` / `cpu.max`).
    pub cpu_quota_us: Option<u64>,
    /// CFS period in microseconds (`cpu.cfs_period_us` / `cpu.max`).
    pub cpu_period_us: Option<u64>,
    /// Memory limit in bytes (`memory.limit_in_bytes` / `memory.max`).
    pub memory_bytes: Option<u64>,
    /// Maximum number of tasks (`pids.max`).
    pub pids_max: Option<u64>,
    /// CPU list, e.g. `0-3,6` (`cpuset.cpus`).
    pub cpuset_cpus: Option<String>,
    /// Memory node list (`cpuset.mems`); defaults to the parent's.
    pub cpuset_mems: Option<String>,
}

impl CgroupLimits {
    /// True if no limit is set (then no cgroup is created).
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }

    /// Checks ranges and list syntax.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |flag: &'static str, value: String, reason: &str| ConfigError::BadLimit {
            flag,
            value,
            reason: reason.to_string(),
        };
        if let Some(q) = self.cpu_quota_us {
            if q < 1000 {
                return Err(bad(
                    "--cpu-quota-us",
                    q.to_string(),
                    "must be at least 1000",
                ));
            }
        }
        if let Some(p) = self.cpu_period_us {
            if !(1000..=1_000_000).contains(&p) {
                return Err(bad(
                    "--cpu-period-us",
                    p.to_string(),
                    "must be between 1000 and 1000000",
                ));
            }
        }
        if self.memory_bytes == Some(0) {
            return Err(bad("--memory-limit", "0".into(), "must be greater than 0"));
        }
        if self.pids_max == Some(0) {
            return Err(bad("--pids-max", "0".into(), "must be greater than 0"));
        }
        for (flag, list) in [
            ("--cpuset-cpus", &self.cpuset_cpus),
            ("--cpuset-mems", &self.cpuset_mems),
        ] {
            if let Some(list) = list {
                if !is_cpu_list(list) {
                    return Err(bad(
                        flag,
                        list.clone(),
                        "expected a list like 0-3,6 (numbers and ranges, comma-separated)",
                    ));
                }
            }
        }
        Ok(())
    }
}

/// True for kernel list syntax: `N` or `N-M`, comma-separated, with N <= M.
pub(crate) fn is_cpu_list(s: &str) -> bool {
    !s.is_empty()
        && s.split(',').all(|item| {
            let mut ends = item.splitn(2, '-');
            let lo = ends.next().and_then(parse_plain_u32);
            match (lo, ends.next()) {
                (Some(_), None) => true,
                (Some(lo), Some(hi)) => parse_plain_u32(hi).is_some_and(|hi| lo <= hi),
                _ => false,
            }
        })
}

fn parse_plain_u32(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// A resource limit, named as in `prlimit(1)` (`nofile`, `fsize`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[allow(missing_docs)]
pub enum RlimitResource {
    As,
    Core,
    Cpu,
    Data,
    Fsize,
    Locks,
    Memlock,
    Msgqueue,
    Nice,
    Nofile,
    Nproc,
    Rss,
    Rtprio,
    Rttime,
    Sigpending,
    Stack,
}

impl RlimitResource {
    /// Every resource, in name order.
    pub const ALL: [RlimitResource; 16] = [
        Self::As,
        Self::Core,
        Self::Cpu,
        Self::Data,
        Self::Fsize,
        Self::Locks,
        Self::Memlock,
        Self::Msgqueue,
        Self::Nice,
        Self::Nofile,
        Self::Nproc,
        Self::Rss,
        Self::Rtprio,
        Self::Rttime,
        Self::Sigpending,
        Self::Stack,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::As => "as",
            Self::Core => "core",
            Self::Cpu => "cpu",
            Self::Data => "data",
            Self::Fsize => "fsize",
            Self::Locks => "locks",
            Self::Memlock => "memlock",
            Self::Msgqueue => "msgqueue",
            Self::Nice => "nice",
            Self::Nofile => "nofile",
            Self::Nproc => "nproc",
            Self::Rss => "rss",
            Self::Rtprio => "rtprio",
            Self::Rttime => "rttime",
            Self::Sigpending => "sigpending",
            Self::Stack => "stack",
        }
    }

    /// The `RLIMIT_*` constant.
    pub(crate) fn raw(self) -> libc::c_int {
        let r = match self {
            Self::As => libc::RLIMIT_AS,
            Self::Core => libc::RLIMIT_CORE,
            Self::Cpu => libc::RLIMIT_CPU,
            Self::Data => libc::RLIMIT_DATA,
            Self::Fsize => libc::RLIMIT_FSIZE,
            Self::Locks => libc::RLIMIT_LOCKS,
            Self::Memlock => libc::RLIMIT_MEMLOCK,
            Self::Msgqueue => libc::RLIMIT_MSGQUEUE,
            Self::Nice => libc::RLIMIT_NICE,
            Self::Nofile => libc::RLIMIT_NOFILE,
            Self::Nproc => libc::RLIMIT_NPROC,
            Self::Rss => libc::RLIMIT_RSS,
            Self::Rtprio => libc::RLIMIT_RTPRIO,
            Self::Rttime => libc::RLIMIT_RTTIME,
            Self::Sigpending => libc::RLIMIT_SIGPENDING,
            Self::Stack => libc::RLIMIT_STACK,
        };
        #[allow(clippy::unnecessary_cast)] // the constant's type differs between libcs.
        let r = r as libc::c_int;
        r
    }
}

/// `RLIM_INFINITY`, spelled `unlimited` on the command line.
pub const RLIM_UNLIMITED: u64 = u64::MAX;

/// One `--rlimit NAME=SOFT[:HARD]` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    /// Which resource.
    pub resource: RlimitResource,
    /// Soft limit ([`RLIM_UNLIMITED`] for none).
    pub soft: u64,
    /// Hard limit ([`RLIM_UNLIMITED`] for none).
    pub hard: u64,
}

impl Rlimit {
    /// A limit with equal soft and hard values.
    pub fn new(resource: RlimitResource, value: u64) -> Self {
        Self {
            resource,
            soft: value,
            hard: value,
        }
    }
}

fn parse_rlim_value(s: &str) -> Option<u64> {
    match s {
        "unlimited" | "infinity" => Some(RLIM_UNLIMITED),
        _ => parse_plain_u64(s),
    }
}

fn parse_plain_u64(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn fmt_rlim_value(v: u64) -> String {
    if v == RLIM_UNLIMITED {
        "unlimited".to_string()
    } else {
        v.to_string()
    }
}

impl FromStr for Rlimit {
    type Err = ConfigError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let bad = |reason: String| ConfigError::BadSpec {
            flag: "--rlimit",
            spec: spec.to_string(),
            reason,
        };
        let (name, value) = spec
            .split_once('=')
            .ok_or_else(|| bad("expected NAME=VALUE or NAME=SOFT:HARD".into()))?;
        let resource = RlimitResource::ALL
            .into_iter()
            .find(|r| r.name() == name)
            .ok_or_else(|| {
                let names: Vec<_> = RlimitResource::ALL.iter().map(|r| r.name()).collect();
                bad(format!(
                    "unknown resource {name:?} (known: {})",
                    names.join(", ")
                ))
            })?;
        let (soft, hard) = match value.split_once(':') {
            Some((s, h)) => (s, h),
            None => (value, value),
        };
        let soft = parse_rlim_value(soft)
            .ok_or_else(|| bad(format!("{soft:?} is not a number or `unlimited`")))?;
        let hard = parse_rlim_value(hard)
            .ok_or_else(|| bad(format!("{hard:?} is not a number or `unlimited`")))?;
        if soft > hard {
            return Err(bad("soft limit is above the hard limit".into()));
        }
        Ok(Self {
            resource,
            soft,
            hard,
        })
    }
}

impl fmt::Display for Rlimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.soft == self.hard {
            write!(f, "{}={}", self.resource.name(), fmt_rlim_value(self.soft))
        } else {
            write!(
                f,
                "{}={}:{}",
                self.resource.name(),
                fmt_rlim_value(self.soft),
                fmt_rlim_value(self.hard)
            )
        }
    }
}

/// A host file or directory placed inside the jail (`--file SRC[:DEST][:ro|rw]`).
///
/// Files are hard-linked when the source is on the jail's filesystem and
/// copied otherwise; directories are recreated and filled the same way.
/// `writable` entries are chowned to the jail's uid/gid (for a hard link this
/// changes the owner of the shared host inode too).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSpec {
    /// Absolute host path.
    pub src: PathBuf,
    /// Absolute path inside the jail (defaults to `/<file name of src>`).
    pub dest: PathBuf,
    /// Chown to the jail's uid/gid so the VMM can write it.
    pub writable: bool,
}

/// A host path bind-mounted into the jail (`--bind SRC[:DEST][:ro|rw]`).
///
/// The mount is not recursive (submounts of `src` are not visible), always
/// `nosuid,nodev`, and read-only with `ro`. Ownership is left unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindSpec {
    /// Absolute host path.
    pub src: PathBuf,
    /// Absolute path inside the jail (defaults to `src`).
    pub dest: PathBuf,
    /// Mount read-only.
    pub read_only: bool,
}

/// Splits `SRC[:DEST][:ro|rw]`; returns (src, dest, mode).
fn split_spec<'a>(
    flag: &'static str,
    spec: &'a str,
) -> Result<(&'a str, Option<&'a str>, Option<&'a str>), ConfigError> {
    let bad = |reason: &str| ConfigError::BadSpec {
        flag,
        spec: spec.to_string(),
        reason: reason.to_string(),
    };
    let parts: Vec<&str> = spec.split(':').collect();
    let is_mode = |s: &str| s == "ro" || s == "rw";
    match *parts.as_slice() {
        [src] => Ok((src, None, None)),
        [src, m] if is_mode(m) => Ok((src, None, Some(m))),
        [src, dest] => Ok((src, Some(dest), None)),
        [src, dest, m] if is_mode(m) => Ok((src, Some(dest), Some(m))),
        [_, _, m] => Err(bad(&format!("unknown option {m:?} (expected ro or rw)"))),
        _ => Err(bad(
            "expected SRC[:DEST][:ro|rw] (paths cannot contain ':')",
        )),
    }
    .and_then(|(src, dest, mode)| {
        if src.is_empty() || dest.is_some_and(str::is_empty) {
            Err(bad("empty path"))
        } else {
            Ok((src, dest, mode))
        }
    })
}

impl FromStr for FileSpec {
    type Err = ConfigError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let (src, dest, mode) = split_spec("--file", spec)?;
        let src = PathBuf::from(src);
        let dest = match dest {
            Some(d) => PathBuf::from(d),
            None => default_dest(&src).ok_or_else(|| ConfigError::BadSpec {
                flag: "--file",
                spec: spec.to_string(),
                reason: "source has no file name to use as destination".into(),
            })?,
        };
        Ok(Self {
            src,
            dest,
            writable: mode == Some("rw"),
        })
    }
}

fn default_dest(src: &Path) -> Option<PathBuf> {
    src.file_name().map(|n| Path::new("/").join(n))
}

impl fmt::Display for FileSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = if self.writable { "rw" } else { "ro" };
        write!(f, "{}:{}:{mode}", self.src.display(), self.dest.display())
    }
}

impl FromStr for BindSpec {
    type Err = ConfigError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let (src, dest, mode) = split_spec("--bind", spec)?;
        Ok(Self {
            src: PathBuf::from(src),
            dest: PathBuf::from(dest.unwrap_or(src)),
            read_only: mode == Some("ro"),
        })
    }
}

impl fmt::Display for BindSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = if self.read_only { "ro" } else { "rw" };
        write!(f, "{}:{}:{mode}", self.src.display(), self.dest.display())
    }
}

/// One `--env KEY=VALUE`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvVar {
    /// Variable name (non-empty, no `=`).
    pub key: String,
    /// Value.
    pub value: String,
}

impl FromStr for EnvVar {
    type Err = ConfigError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        match spec.split_once('=') {
            Some((key, value)) if !key.is_empty() && !spec.contains('\0') => Ok(Self {
                key: key.to_string(),
                value: value.to_string(),
            }),
            _ => Err(ConfigError::BadSpec {
                flag: "--env",
                spec: spec.to_string(),
                reason: "expected KEY=VALUE with a non-empty KEY".into(),
            }),
        }
    }
}

impl fmt::Display for EnvVar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.key, self.value)
    }
}

/// Parses a byte count: plain digits or a binary suffix `K`, `M`, `G`, `T`
/// (optionally followed by `iB`/`B`), e.g. `512M` = 536870912.
pub fn parse_bytes(s: &str) -> Result<u64, ConfigError> {
    let bad = |reason: &str| ConfigError::BadLimit {
        flag: "--memory-limit",
        value: s.to_string(),
        reason: reason.to_string(),
    };
    let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, suffix) = s.split_at(digits_end);
    let num = parse_plain_u64(num).ok_or_else(|| bad("expected a number of bytes"))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad("unknown suffix (use K, M, G or T)")),
    };
    num.checked_mul(1u64 << shift)
        .ok_or_else(|| bad("value is too large"))
}

/// Everything the jailer needs to build one jail and start the VMM in it.
///
/// Build it, call [`JailConfig::validate`], and spawn `ember-jailer` with
/// [`JailConfig::to_args`]. The binary parses the same arguments back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JailConfig {
    /// Jail id: `[A-Za-z0-9-]{1,64}`; names the jail dir and the cgroup.
    pub id: String,
    /// Host path of the VMM binary; copied to `/ember-vmm` in the jail.
    pub exec_file: PathBuf,
    /// uid the VMM runs as.
    pub uid: u32,
    /// gid the VMM runs as.
    pub gid: u32,
    /// The jail is `<chroot_base>/<id>`, its root `<chroot_base>/<id>/root`.
    pub chroot_base: PathBuf,
    /// Network namespace to join, e.g. `/var/run/netns/NAME`.
    pub netns: Option<PathBuf>,
    /// Where cgroup hierarchies are mounted.
    pub cgroup_root: PathBuf,
    /// Parent cgroup, relative to each hierarchy (default `ember`).
    pub cgroup_parent: PathBuf,
    /// Cgroup limits.
    pub limits: CgroupLimits,
    /// Resource limits set before exec.
    pub rlimits: Vec<Rlimit>,
    /// Files and directories placed in the jail.
    pub files: Vec<FileSpec>,
    /// Bind mounts into the jail.
    pub binds: Vec<BindSpec>,
    /// Inherited descriptors (besides 0, 1, 2) passed on to the VMM.
    pub keep_fds: Vec<i32>,
    /// The VMM's whole environment.
    pub env: Vec<EnvVar>,
    /// Run the VMM as pid 1 of a new PID namespace; the jailer waits for it.
    pub new_pid_ns: bool,
    /// Also create `/dev/userfaultfd`.
    pub userfaultfd: bool,
    /// Mount a `/proc` (pid-only subset, other users' processes hidden).
    pub mount_proc: bool,
    /// Hard-link `exec_file` into the jail instead of copying it, so that the VMMs of all
    /// jails made from one file share its page cache (a copy costs each VMM the binary's
    /// text and read-only data, ~7 MiB for a debug build, as private memory). The file must
    /// be root-owned, writable by nobody else, not set-id, and on the jail's file system
    /// (else it is copied). Pass a private copy made for the purpose, not the installed
    /// binary: the jailed process then shares that inode.
    pub exec_link: bool,
    /// Allow uid or gid 0.
    pub allow_root: bool,
    /// Print how long each setup step took to stderr.
    pub print_timings: bool,
    /// Arguments for the VMM (after `--`).
    pub vmm_args: Vec<String>,
}

impl JailConfig {
    /// A configuration with defaults for everything optional.
    pub fn new(
        id: impl Into<String>,
        exec_file: impl Into<PathBuf>,
        uid: u32,
        gid: u32,
        chroot_base: impl Into<PathBuf>,
    ) -> Self {
        Self {
            id: id.into(),
            exec_file: exec_file.into(),
            uid,
            gid,
            chroot_base: chroot_base.into(),
            netns: None,
            cgroup_root: PathBuf::from(DEFAULT_CGROUP_ROOT),
            cgroup_parent: PathBuf::from(DEFAULT_CGROUP_PARENT),
            limits: CgroupLimits::default(),
            rlimits: Vec::new(),
            files: Vec::new(),
            binds: Vec::new(),
            keep_fds: Vec::new(),
            env: Vec::new(),
            new_pid_ns: false,
            userfaultfd: false,
            mount_proc: false,
            exec_link: false,
            allow_root: false,
            print_timings: false,
            vmm_args: Vec::new(),
        }
    }

    /// `<chroot_base>/<id>`: removed as a whole by clean-up.
    pub fn jail_dir(&self) -> PathBuf {
        self.chroot_base.join(&self.id)
    }

    /// `<chroot_base>/<id>/root`: the VMM's `/`.
    pub fn root_dir(&self) -> PathBuf {
        self.jail_dir().join("root")
    }

    /// Host path of `path_in_jail` (an absolute path inside the jail), e.g.
    /// where the host finds the VMM's control socket.
    pub fn host_path(&self, path_in_jail: &Path) -> PathBuf {
        let rel = path_in_jail.strip_prefix("/").unwrap_or(path_in_jail);
        self.root_dir().join(rel)
    }

    /// The command line for `ember-jailer` (without the program name).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        let mut push = |k: &str, v: String| {
            a.push(k.to_string());
            a.push(v);
        };
        push("--id", self.id.clone());
        push("--exec-file", path_arg(&self.exec_file));
        push("--uid", self.uid.to_string());
        push("--gid", self.gid.to_string());
        push("--chroot-base", path_arg(&self.chroot_base));
        if let Some(n) = &self.netns {
            push("--netns", path_arg(n));
        }
        if self.cgroup_root != Path::new(DEFAULT_CGROUP_ROOT) {
            push("--cgroup-root", path_arg(&self.cgroup_root));
        }
        if self.cgroup_parent != Path::new(DEFAULT_CGROUP_PARENT) {
            push("--cgroup-parent", path_arg(&self.cgroup_parent));
        }
        let l = &self.limits;
        if let Some(v) = l.cpu_quota_us {
            push("--cpu-quota-us", v.to_string());
        }
        if let Some(v) = l.cpu_period_us {
            push("--cpu-period-us", v.to_string());
        }
        if let Some(v) = l.memory_bytes {
            push("--memory-limit", v.to_string());
        }
        if let Some(v) = l.pids_max {
            push("--pids-max", v.to_string());
        }
        if let Some(v) = &l.cpuset_cpus {
            push("--cpuset-cpus", v.clone());
        }
        if let Some(v) = &l.cpuset_mems {
            push("--cpuset-mems", v.clone());
        }
        for r in &self.rlimits {
            push("--rlimit", r.to_string());
        }
        for f in &self.files {
            push("--file", f.to_string());
        }
        for b in &self.binds {
            push("--bind", b.to_string());
        }
        for fd in &self.keep_fds {
            push("--keep-fd", fd.to_string());
        }
        for e in &self.env {
            push("--env", e.to_string());
        }
        for (flag, on) in [
            ("--new-pid-ns", self.new_pid_ns),
            ("--userfaultfd", self.userfaultfd),
            ("--mount-proc", self.mount_proc),
            ("--exec-link", self.exec_link),
            ("--allow-root", self.allow_root),
            ("--print-timings", self.print_timings),
        ] {
            if on {
                a.push(flag.to_string());
            }
        }
        if !self.vmm_args.is_empty() {
            a.push("--".to_string());
            a.extend(self.vmm_args.iter().cloned());
        }
        a
    }

    /// Checks everything that does not touch the host: syntax, ranges, path
    /// shapes, uid/gid policy, clashing destinations.
    pub fn validate_syntax(&self) -> Result<(), ConfigError> {
        validate_id(&self.id)?;
        check_abs_path("VMM binary", &self.exec_file)?;
        check_abs_path("chroot base", &self.chroot_base)?;
        if let Some(n) = &self.netns {
            check_abs_path("network namespace", n)?;
        }
        check_abs_path("cgroup root", &self.cgroup_root)?;
        validate_cgroup_parent(&self.cgroup_parent)?;
        if !self.allow_root {
            if self.uid == 0 {
                return Err(ConfigError::RootRefused { which: "uid" });
            }
            if self.gid == 0 {
                return Err(ConfigError::RootRefused { which: "gid" });
            }
        }
        self.limits.validate()?;
        let mut dests: Vec<PathBuf> = Vec::new();
        let reserved = [
            Path::new("/"),
            Path::new(JAIL_EXEC_PATH),
            Path::new("/dev"),
            Path::new("/proc"),
            Path::new(crate::mount::OLD_ROOT),
        ];
        let mut check_dest = |dest: &Path| -> Result<(), ConfigError> {
            check_abs_path("destination in the jail", dest)?;
            let dest = normalize(dest);
            if reserved.iter().any(|r| dest == *r) || dest.starts_with("/dev") {
                return Err(ConfigError::ReservedDest { dest });
            }
            if self.mount_proc && dest.starts_with("/proc") {
                return Err(ConfigError::ReservedDest { dest });
            }
            if dests.contains(&dest) {
                return Err(ConfigError::DuplicateDest { dest });
            }
            dests.push(dest);
            Ok(())
        };
        for f in &self.files {
            check_abs_path("--file source", &f.src)?;
            check_spec_path("--file source", &f.src)?;
            check_spec_path("--file destination", &f.dest)?;
            check_dest(&f.dest)?;
        }
        for b in &self.binds {
            check_abs_path("--bind source", &b.src)?;
            check_spec_path("--bind source", &b.src)?;
            check_spec_path("--bind destination", &b.dest)?;
            check_dest(&b.dest)?;
        }
        for &fd in &self.keep_fds {
            if fd < 3 {
                return Err(ConfigError::BadKeepFd {
                    fd,
                    reason: "0, 1 and 2 are always kept; pass descriptors from 3 up",
                });
            }
        }
        for e in &self.env {
            if e.key.is_empty() || e.key.contains('=') || e.key.contains('\0') {
                return Err(ConfigError::BadSpec {
                    flag: "--env",
                    spec: e.to_string(),
                    reason: "KEY must be non-empty without '=' or NUL".into(),
                });
            }
            if e.value.contains('\0') {
                return Err(ConfigError::BadSpec {
                    flag: "--env",
                    spec: e.to_string(),
                    reason: "VALUE contains a NUL byte".into(),
                });
            }
        }
        Ok(())
    }

    /// [`validate_syntax`](Self::validate_syntax), then checks against the
    /// host: the binary is a regular file, the jail does not exist yet, the
    /// sources, network namespace and kept descriptors exist.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_syntax()?;
        let meta =
            std::fs::metadata(&self.exec_file).map_err(|source| ConfigError::Inaccessible {
                what: "VMM binary",
                path: self.exec_file.clone(),
                source,
            })?;
        if !meta.is_file() {
            return Err(ConfigError::NotRegularFile {
                path: self.exec_file.clone(),
            });
        }
        if self.exec_link {
            use std::os::unix::fs::MetadataExt;
            if meta.uid() != 0 || meta.mode() & 0o6022 != 0 {
                return Err(ConfigError::SharedExecUnsafe {
                    path: self.exec_file.clone(),
                    mode: meta.mode() & 0o7777,
                    uid: meta.uid(),
                });
            }
        }
        match std::fs::metadata(&self.chroot_base) {
            Ok(m) if !m.is_dir() => {
                return Err(ConfigError::WrongFileType {
                    what: "chroot base",
                    path: self.chroot_base.clone(),
                    expected: "directory",
                })
            }
            _ => {}
        }
        let jail = self.jail_dir();
        if std::fs::symlink_metadata(&jail).is_ok() {
            return Err(ConfigError::JailExists { path: jail });
        }
        if let Some(n) = &self.netns {
            std::fs::metadata(n).map_err(|source| ConfigError::Inaccessible {
                what: "network namespace",
                path: n.clone(),
                source,
            })?;
        }
        for (what, src) in self
            .files
            .iter()
            .map(|f| ("--file source", &f.src))
            .chain(self.binds.iter().map(|b| ("--bind source", &b.src)))
        {
            let m = std::fs::metadata(src).map_err(|source| ConfigError::Inaccessible {
                what,
                path: src.clone(),
                source,
            })?;
            let ft = m.file_type();
            if what == "--file source" && !(ft.is_file() || ft.is_dir()) {
                return Err(ConfigError::WrongFileType {
                    what,
                    path: src.clone(),
                    expected: "regular file or directory",
                });
            }
            if ft.is_block_device() || ft.is_char_device() {
                return Err(ConfigError::WrongFileType {
                    what,
                    path: src.clone(),
                    expected: "file or directory (device nodes are not passed in)",
                });
            }
        }
        for &fd in &self.keep_fds {
            if !crate::sys::fd_is_open(fd) {
                return Err(ConfigError::BadKeepFd {
                    fd,
                    reason: "not an open file descriptor",
                });
            }
        }
        Ok(())
    }
}

fn path_arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Checks `[A-Za-z0-9-]{1,64}`.
pub fn validate_id(id: &str) -> Result<(), ConfigError> {
    let ok = (1..=MAX_ID_LEN).contains(&id.len())
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ConfigError::InvalidId { id: id.to_string() })
    }
}

/// Absolute and without `..`.
pub(crate) fn check_abs_path(what: &'static str, path: &Path) -> Result<(), ConfigError> {
    if !path.is_absolute() {
        return Err(ConfigError::RelativePath {
            what,
            path: path.to_path_buf(),
        });
    }
    if path.components().any(|c| c == Component::ParentDir) {
        return Err(ConfigError::DotDot {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(())
}

/// Paths in `--file`/`--bind` values cannot carry `:` (the separator).
fn check_spec_path(what: &'static str, path: &Path) -> Result<(), ConfigError> {
    if path.to_string_lossy().contains(':') {
        return Err(ConfigError::BadPathChar {
            what,
            path: path.to_path_buf(),
            reason: "':' (the separator of SRC:DEST:MODE)",
        });
    }
    Ok(())
}

pub(crate) fn validate_cgroup_parent(parent: &Path) -> Result<(), ConfigError> {
    let ok = !parent.as_os_str().is_empty()
        && parent
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::BadCgroupParent {
            parent: parent.to_path_buf(),
        })
    }
}

/// Drops `.` components and trailing slashes of an absolute path.
pub(crate) fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        if let Component::Normal(n) = c {
            out.push(n);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> JailConfig {
        JailConfig::new("vm-1", "/usr/bin/ember-vmm", 1000, 1000, "/srv/jail")
    }

    #[test]
    fn ids() {
        for ok in ["a", "vm-1", "ABC-def-09", &"x".repeat(64)] {
            validate_id(ok).unwrap();
        }
        for bad in ["", "a_b", "a/b", "..", "a.b", "é", &"x".repeat(65), "a b"] {
            assert!(
                matches!(validate_id(bad), Err(ConfigError::InvalidId { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn paths_must_be_absolute_without_dotdot() {
        let mut c = base();
        c.exec_file = "ember-vmm".into();
        assert!(matches!(
            c.validate_syntax(),
            Err(ConfigError::RelativePath { .. })
        ));
        let mut c = base();
        c.chroot_base = "/srv/../etc".into();
        let e = c.validate_syntax().unwrap_err();
        assert!(matches!(e, ConfigError::DotDot { .. }));
        assert!(e.to_string().contains("chroot base"), "{e}");
        let mut c = base();
        c.netns = Some("run/netns/x".into());
        assert!(matches!(
            c.validate_syntax(),
            Err(ConfigError::RelativePath { .. })
        ));
    }

    #[test]
    fn root_needs_allow_root() {
        let mut c = base();
        c.uid = 0;
        let e = c.validate_syntax().unwrap_err();
        assert!(e.to_string().contains("--allow-root"));
        c.uid = 5;
        c.gid = 0;
        assert!(matches!(
            c.validate_syntax(),
            Err(ConfigError::RootRefused { which: "gid" })
        ));
        c.allow_root = true;
        c.validate_syntax().unwrap();
    }

    #[test]
    fn rlimit_parse_and_display() {
        let r: Rlimit = "nofile=1024".parse().unwrap();
        assert_eq!(r, Rlimit::new(RlimitResource::Nofile, 1024));
        assert_eq!(r.to_string(), "nofile=1024");
        let r: Rlimit = "fsize=10:unlimited".parse().unwrap();
        assert_eq!((r.soft, r.hard), (10, RLIM_UNLIMITED));
        assert_eq!(r.to_string(), "fsize=10:unlimited");
        assert_eq!(r.to_string().parse::<Rlimit>().unwrap(), r);
        for bad in [
            "nofile",
            "bogus=1",
            "nofile=x",
            "nofile=10:5",
            "nofile=-1",
            "nofile=",
        ] {
            assert!(bad.parse::<Rlimit>().is_err(), "{bad}");
        }
        let e = "bogus=1".parse::<Rlimit>().unwrap_err().to_string();
        assert!(
            e.contains("unknown resource") && e.contains("nofile"),
            "{e}"
        );
        for r in RlimitResource::ALL {
            let s = format!("{}=7", r.name());
            assert_eq!(s.parse::<Rlimit>().unwrap().resource, r);
        }
    }

    #[test]
    fn file_spec_forms() {
        let f: FileSpec = "/img/vmlinux".parse().unwrap();
        assert_eq!(f.dest, Path::new("/vmlinux"));
        assert!(!f.writable);
        let f: FileSpec = "/img/rootfs.ext4:/rootfs.ext4:rw".parse().unwrap();
        assert!(f.writable);
        let f: FileSpec = "/img/layer:rw".parse().unwrap();
        assert_eq!(f.dest, Path::new("/layer"));
        assert!(f.writable);
        let f: FileSpec = "/img/k:/boot/k".parse().unwrap();
        assert_eq!(f.to_string(), "/img/k:/boot/k:ro");
        assert_eq!(f.to_string().parse::<FileSpec>().unwrap(), f);
        for bad in ["/a:/b:xx", "/a:/b:ro:x", ":/b", "/a::ro", "/"] {
            assert!(bad.parse::<FileSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn bind_spec_forms() {
        let b: BindSpec = "/var/lib/snap".parse().unwrap();
        assert_eq!(b.dest, Path::new("/var/lib/snap"));
        assert!(!b.read_only);
        let b: BindSpec = "/lib:ro".parse().unwrap();
        assert!(b.read_only);
        assert_eq!(b.dest, Path::new("/lib"));
        let b: BindSpec = "/x:/y:ro".parse().unwrap();
        assert_eq!(b.to_string().parse::<BindSpec>().unwrap(), b);
    }

    #[test]
    fn dests_are_checked() {
        let mut c = base();
        c.files.push("/a/vmlinux".parse().unwrap());
        c.binds.push("/b/vmlinux:/vmlinux/".parse().unwrap());
        assert!(matches!(
            c.validate_syntax(),
            Err(ConfigError::DuplicateDest { .. })
        ));
        let mut c = base();
        c.files.push("/a/x:/ember-vmm".parse().unwrap());
        assert!(matches!(
            c.validate_syntax(),
            Err(ConfigError::ReservedDest { .. })
        ));
        let mut c = base();
        c.binds.push("/dev/sda:/dev/sda".parse().unwrap());
        assert!(matches!(
            c.validate_syntax(),
            Err(ConfigError::ReservedDest { .. })
        ));
        let mut c = base();
        c.files.push("/a/x:/../etc/x".parse().unwrap());
        assert!(matches!(
            c.validate_syntax(),
            Err(ConfigError::DotDot { .. })
        ));
        let mut c = base();
        c.files.push("/a/x:rel/x".parse().unwrap());
        assert!(matches!(
            c.validate_syntax(),
            Err(ConfigError::RelativePath { .. })
        ));
    }

    #[test]
    fn bytes() {
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("64M").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("1k").unwrap(), 1024);
        for bad in ["", "M", "-1", "12Q", "99999999999999999999", "16777216T"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn limits() {
        let mut l = CgroupLimits::default();
        assert!(l.is_empty());
        l.cpuset_cpus = Some("0-1,3".into());
        l.validate().unwrap();
        for bad in ["", "1-", "-1", "3-1", "a", "0,,1", "0 1"] {
            l.cpuset_cpus = Some(bad.into());
            assert!(l.validate().is_err(), "{bad}");
        }
        let l = CgroupLimits {
            cpu_quota_us: Some(10),
            ..Default::default()
        };
        assert!(l.validate().is_err());
        let l = CgroupLimits {
            pids_max: Some(0),
            ..Default::default()
        };
        assert!(l.validate().is_err());
    }

    #[test]
    fn cgroup_parent() {
        validate_cgroup_parent(Path::new("ember")).unwrap();
        validate_cgroup_parent(Path::new("ember/tenant-a")).unwrap();
        for bad in ["", "/ember", "../x", "a/../b", "./a"] {
            assert!(validate_cgroup_parent(Path::new(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn keep_fd_and_env() {
        let mut c = base();
        c.keep_fds.push(2);
        assert!(matches!(
            c.validate_syntax(),
            Err(ConfigError::BadKeepFd { .. })
        ));
        assert!("=x".parse::<EnvVar>().is_err());
        assert!("X".parse::<EnvVar>().is_err());
        let e: EnvVar = "A=b=c".parse().unwrap();
        assert_eq!((e.key.as_str(), e.value.as_str()), ("A", "b=c"));
    }

    #[test]
    fn paths() {
        let c = base();
        assert_eq!(c.jail_dir(), Path::new("/srv/jail/vm-1"));
        assert_eq!(c.root_dir(), Path::new("/srv/jail/vm-1/root"));
        assert_eq!(
            c.host_path(Path::new("/run/api.sock")),
            Path::new("/srv/jail/vm-1/root/run/api.sock")
        );
        assert_eq!(normalize(Path::new("/a/./b/")), Path::new("/a/b"));
    }

    #[test]
    fn host_validation() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = base();
        c.chroot_base = dir.path().to_path_buf();
        c.exec_file = dir.path().join("missing");
        let e = c.validate().unwrap_err();
        assert!(matches!(e, ConfigError::Inaccessible { .. }), "{e}");
        assert!(e.to_string().contains("VMM binary"), "{e}");
        c.exec_file = dir.path().to_path_buf();
        assert!(matches!(
            c.validate(),
            Err(ConfigError::NotRegularFile { .. })
        ));
        let exe = dir.path().join("vmm");
        std::fs::write(&exe, b"x").unwrap();
        c.exec_file = exe;
        c.validate().unwrap();
        std::fs::create_dir(c.jail_dir()).unwrap();
        assert!(matches!(c.validate(), Err(ConfigError::JailExists { .. })));
        std::fs::remove_dir(c.jail_dir()).unwrap();
        c.keep_fds.push(100_000);
        assert!(matches!(c.validate(), Err(ConfigError::BadKeepFd { .. })));
    }

    #[test]
    fn serde_round_trip() {
        let mut c = base();
        c.limits.memory_bytes = Some(1 << 30);
        c.rlimits.push(Rlimit::new(RlimitResource::Nofile, 64));
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<JailConfig>(&json).unwrap(), c);
    }
}
