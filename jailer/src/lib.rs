//! ember-jailer: builds the jail one `ember-vmm` process runs in.
//!
//! The jail is `<chroot-base>/<id>/root`: a fresh directory holding a copy of
//! the VMM binary (`/ember-vmm`), the files the VM needs, bind mounts, and
//! only the device nodes the VMM uses. The VMM runs there after
//! `pivot_root` in its own mount namespace (optionally also a new PID
//! namespace and a given network namespace), inside per-jail cgroups (v1 or
//! v2), with rlimits, as an unprivileged uid/gid with `no_new_privs`.
//!
//! The sandbox runtime uses the configuration types only: build a
//! [`JailConfig`], call [`JailConfig::validate`], spawn `ember-jailer` with
//! [`JailConfig::to_args`], and afterwards `ember-jailer` with
//! [`CleanupConfig::to_args`] (or call [`cleanup()`] directly).
//!
//! ```
//! use ember_jailer::{CgroupLimits, JailConfig};
//! let mut cfg = JailConfig::new("vm-1", "/usr/local/bin/ember-vmm", 10_000, 10_000, "/srv/ember/jail");
//! cfg.limits = CgroupLimits { memory_bytes: Some(512 << 20), pids_max: Some(64), ..Default::default() };
//! cfg.files.push("/var/lib/ember/vmlinux:/vmlinux".parse().unwrap());
//! cfg.vmm_args = vec!["--kernel".into(), "/vmlinux".into()];
//! let args = cfg.to_args();
//! assert_eq!(&args[..2], ["--id", "vm-1"]);
//! ```

pub mod cgroup;
pub mod cleanup;
pub mod cli;
pub mod config;
pub mod jail;
pub mod jailfs;
pub mod mount;
pub mod process;
mod sys;

pub use cgroup::{detect_version, CgroupError, CgroupVersion, Cgroups};
pub use cleanup::{cleanup, CleanupConfig, CleanupError, CleanupReport};
pub use config::{
    BindSpec, CgroupLimits, ConfigError, EnvVar, FileSpec, JailConfig, Rlimit, RlimitResource,
    JAIL_EXEC_PATH,
};
pub use jail::{run, JailError, Timings, VmmExit};

/// Exit status for usage errors (bad arguments).
pub const EXIT_USAGE: i32 = 2;
/// Exit status for setup failures.
pub const EXIT_SETUP: i32 = 1;
