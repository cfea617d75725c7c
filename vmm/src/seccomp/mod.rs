//! Seccomp filters for `ember-vmm`'s threads: one allow-list per kind of thread, written in
//! `vmm/seccomp/<kind>.json` (seccompiler's JSON format, a `comment` on every rule saying why
//! the syscall is needed), compiled to BPF by `vmm/build.rs` and embedded in the binary.
//!
//! A thread installs its filter itself, after its set-up and before it handles anything the
//! guest controls:
//! - **vCPU threads** ([`ThreadKind::Vcpu`]) first thing in the thread, before the first
//!   `KVM_RUN`;
//! - **the main thread** ([`ThreadKind::Main`], the event loop with the devices' back ends and
//!   the control socket) in `Vm::run` once the vCPU threads are spawned and before the event
//!   loop first runs. Installing it after the spawns keeps the vCPU threads out of it (a thread
//!   inherits the filters of the thread that created it), so each vCPU thread is bound by the
//!   vCPU list alone;
//! - **the prefetch thread** of a restore ([`ThreadKind::Prefetch`]) first thing in the thread;
//! - **the log writer** ([`ThreadKind::Log`], with `--log-file`: writes queued log lines into
//!   the capped log file, see [`crate::logging`]) first thing in the thread. It is started
//!   before the VM is built, so it inherits no other filter.
//! - **a VMM waiting for its restore** (`--wait-restore`, [`ThreadKind::Restore`], see
//!   [`crate::pooled`]) on its main thread once the control socket is bound, before the first
//!   request is read. Every thread of the VM it then restores inherits it under its own
//!   filter, so it allows what restoring needs (opening and mapping the snapshot, creating
//!   the VM, vCPUs, devices and their threads) and everything the other lists allow; each
//!   thread is then bound by its own list as usual.
//!
//! A syscall outside the list kills the whole process (`SECCOMP_RET_KILL_PROCESS`, the VMM
//! dies by `SIGSYS`) in [`SeccompMode::Kill`]. [`SeccompMode::Log`] lets it through and has
//! the kernel log it (`SECCOMP_RET_LOG`: an `audit: type=1326 ... syscall=N` line in `dmesg`
//! naming the thread's `comm`, e.g. `vcpu0`); use it to find what a new feature needs.
//! [`SeccompMode::Off`] installs nothing.
//!
//! The library default is [`SeccompMode::Off`], so that tests and orchestrators that run a
//! `Vm` inside their own process are not filtered; the `ember-vmm` binary calls [`set_mode`]
//! with its `--seccomp` flag (default `kill`).
//!
//! # Test hook
//! With `EMBER_VMM_TEST_FORBIDDEN_SYSCALL=1` (or `main`) in the environment when [`set_mode`]
//! runs, [`install_configured`] makes a syscall that no list allows right after installing the
//! main thread's filter; with `vcpu`, `prefetch`, `log` or `restore`, right after that thread's. The tests
//! use it to check that the filters are really in force (the VMM dies by `SIGSYS` in `kill`
//! mode and goes on in `log` and `off` modes). The syscall is `personality(0xffffffff)`, which only
//! reads the execution domain, so the variable is harmless in production: without a filter
//! nothing happens, with one the VMM is killed, which is what setting it asks for.
//!
//! # Adding a thread kind
//! Write `vmm/seccomp/<kind>.json` (one filter named `<kind>`, `kill_process` on mismatch),
//! add `<kind>` to `KINDS` in `vmm/build.rs` and a variant to [`ThreadKind`] with its programs
//! in [`ThreadKind::bpf`].

use std::sync::atomic::{AtomicU8, Ordering};

use seccompiler::{sock_filter, BpfProgram};

/// Environment variable arming the test hook (see the module docs).
pub const TEST_HOOK_ENV: &str = "EMBER_VMM_TEST_FORBIDDEN_SYSCALL";

/// The kinds of thread `ember-vmm` runs, each with its own allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ThreadKind {
    /// The main thread once the VM runs: event loop, device back ends, control socket,
    /// snapshots, exit.
    Main,
    /// A vCPU thread: `KVM_RUN`, port-I/O and MMIO dispatch, state save on pause.
    Vcpu,
    /// The helper thread of a restore that prefetches the snapshot's working set
    /// (`--prefetch async`): `madvise(MADV_POPULATE_READ)` on guest memory, one report line.
    Prefetch,
    /// The thread that writes the VMM's log into its file (`--log-file`): `write`, and
    /// `ftruncate` + `renameat2(RENAME_EXCHANGE)` to rotate it.
    Log,
    /// The main thread of a VMM waiting for its restore request (`--wait-restore`): the
    /// restore itself, and (inherited) what every thread of the restored VM does.
    Restore,
}

impl ThreadKind {
    /// Every kind.
    pub const ALL: [ThreadKind; 5] = [
        ThreadKind::Main,
        ThreadKind::Vcpu,
        ThreadKind::Prefetch,
        ThreadKind::Log,
        ThreadKind::Restore,
    ];

    /// The name of its filter (and of its JSON file under `vmm/seccomp/`).
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Main => "main",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Prefetch => "prefetch",
            ThreadKind::Log => "log",
            ThreadKind::Restore => "restore",
        }
    }

    /// The compiled BPF for `mode` (`None` for [`SeccompMode::Off`]): raw `sock_filter`s.
    fn bpf(self, mode: SeccompMode) -> Option<&'static [u8]> {
        macro_rules! bpf {
            ($name:literal) => {
                include_bytes!(concat!(env!("OUT_DIR"), "/seccomp-", $name, ".bpf"))
            };
        }
        Some(match (self, mode) {
            (_, SeccompMode::Off) => return None,
            (ThreadKind::Main, SeccompMode::Kill) => bpf!("main-kill"),
            (ThreadKind::Main, SeccompMode::Log) => bpf!("main-log"),
            (ThreadKind::Vcpu, SeccompMode::Kill) => bpf!("vcpu-kill"),
            (ThreadKind::Vcpu, SeccompMode::Log) => bpf!("vcpu-log"),
            (ThreadKind::Prefetch, SeccompMode::Kill) => bpf!("prefetch-kill"),
            (ThreadKind::Prefetch, SeccompMode::Log) => bpf!("prefetch-log"),
            (ThreadKind::Log, SeccompMode::Kill) => bpf!("log-kill"),
            (ThreadKind::Log, SeccompMode::Log) => bpf!("log-log"),
            (ThreadKind::Restore, SeccompMode::Kill) => bpf!("restore-kill"),
            (ThreadKind::Restore, SeccompMode::Log) => bpf!("restore-log"),
        })
    }
}

impl std::fmt::Display for ThreadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a filter does with a syscall outside its allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SeccompMode {
    /// Kill the process (`SECCOMP_RET_KILL_PROCESS`; the VMM dies by `SIGSYS`).
    Kill,
    /// Allow the syscall and have the kernel log it (`SECCOMP_RET_LOG`).
    Log,
    /// No filter.
    #[default]
    Off,
}

impl std::str::FromStr for SeccompMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "kill" => Ok(SeccompMode::Kill),
            "log" => Ok(SeccompMode::Log),
            "off" => Ok(SeccompMode::Off),
            other => Err(format!("seccomp mode {other:?}: expected kill, log or off")),
        }
    }
}

impl std::fmt::Display for SeccompMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SeccompMode::Kill => "kill",
            SeccompMode::Log => "log",
            SeccompMode::Off => "off",
        })
    }
}

/// Errors installing a filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// The embedded program is not a whole number of BPF instructions (a build problem).
    #[error("the embedded {kind} seccomp filter ({mode}) is corrupt: {len} bytes")]
    Corrupt {
        /// The thread kind.
        kind: ThreadKind,
        /// The mode.
        mode: SeccompMode,
        /// Its size.
        len: usize,
    },
    /// `prctl(PR_SET_NO_NEW_PRIVS)` or `seccomp(SECCOMP_SET_MODE_FILTER)` failed.
    #[error("cannot install the {kind} seccomp filter ({mode} mode): {source}")]
    Install {
        /// The thread kind.
        kind: ThreadKind,
        /// The mode.
        mode: SeccompMode,
        /// Why.
        source: seccompiler::Error,
    },
}

/// The BPF program for a thread kind in `mode` (`None` for [`SeccompMode::Off`]).
pub fn program(kind: ThreadKind, mode: SeccompMode) -> Result<Option<BpfProgram>, SeccompError> {
    let Some(raw) = kind.bpf(mode) else {
        return Ok(None);
    };
    if raw.is_empty() || !raw.chunks_exact(8).remainder().is_empty() {
        return Err(SeccompError::Corrupt {
            kind,
            mode,
            len: raw.len(),
        });
    }
    Ok(Some(
        raw.chunks_exact(8)
            .map(|c| sock_filter {
                code: u16::from_le_bytes([c[0], c[1]]),
                jt: c[2],
                jf: c[3],
                k: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            })
            .collect(),
    ))
}

/// Installs the filter for `kind` on the calling thread (nothing for [`SeccompMode::Off`]).
/// It also sets `PR_SET_NO_NEW_PRIVS` on the thread. Filters cannot be removed: every thread
/// this one creates afterwards inherits it.
pub fn install(kind: ThreadKind, mode: SeccompMode) -> Result<(), SeccompError> {
    let Some(prog) = program(kind, mode)? else {
        return Ok(());
    };
    seccompiler::apply_filter(&prog).map_err(|source| SeccompError::Install { kind, mode, source })
}

const MODE_OFF: u8 = 0;
const MODE_KILL: u8 = 1;
const MODE_LOG: u8 = 2;
const HOOK_NONE: u8 = 0;

/// The process-wide mode used by [`install_configured`].
static MODE: AtomicU8 = AtomicU8::new(MODE_OFF);
/// Which thread kind the test hook fires on (`HOOK_NONE` or `kind as u8 + 1`).
static HOOK: AtomicU8 = AtomicU8::new(HOOK_NONE);

/// Sets the mode for every thread the VMM starts from now on ([`install_configured`]), and
/// reads [`TEST_HOOK_ENV`]. The `ember-vmm` binary calls this with its `--seccomp` flag before
/// building the VM; a process that never calls it runs unfiltered.
pub fn set_mode(mode: SeccompMode) {
    MODE.store(
        match mode {
            SeccompMode::Off => MODE_OFF,
            SeccompMode::Kill => MODE_KILL,
            SeccompMode::Log => MODE_LOG,
        },
        Ordering::SeqCst,
    );
    let hook = match std::env::var(TEST_HOOK_ENV).as_deref() {
        Ok("1") | Ok("main") => hook_code(ThreadKind::Main),
        Ok("vcpu") => hook_code(ThreadKind::Vcpu),
        Ok("prefetch") => hook_code(ThreadKind::Prefetch),
        Ok("log") => hook_code(ThreadKind::Log),
        Ok("restore") => hook_code(ThreadKind::Restore),
        _ => HOOK_NONE,
    };
    HOOK.store(hook, Ordering::SeqCst);
}

fn hook_code(kind: ThreadKind) -> u8 {
    match kind {
        ThreadKind::Main => 1,
        ThreadKind::Vcpu => 2,
        ThreadKind::Prefetch => 3,
        ThreadKind::Log => 4,
        ThreadKind::Restore => 5,
    }
}

/// The mode [`set_mode`] set ([`SeccompMode::Off`] if it was never called).
pub fn mode() -> SeccompMode {
    match MODE.load(Ordering::SeqCst) {
        MODE_KILL => SeccompMode::Kill,
        MODE_LOG => SeccompMode::Log,
        _ => SeccompMode::Off,
    }
}

/// Installs the filter for `kind` on the calling thread in the mode [`set_mode`] chose, then
/// fires the test hook if it is armed for `kind`. This is what the VMM's threads call.
pub fn install_configured(kind: ThreadKind) -> Result<(), SeccompError> {
    let mode = mode();
    if kind == ThreadKind::Main && mode == SeccompMode::Log {
        tracing::warn!(
            "seccomp in log mode: syscalls outside the allow-lists are logged by the kernel, not refused"
        );
    }
    install(kind, mode)?;
    if HOOK.load(Ordering::SeqCst) == hook_code(kind) {
        forbidden_syscall();
    }
    Ok(())
}

/// Makes a syscall that no allow-list contains: `personality(0xffffffff)`, which only reads
/// the calling process's execution domain. Under a `kill` filter the process dies by `SIGSYS`.
pub fn forbidden_syscall() {
    // SAFETY: personality(0xffffffff) is a pure query: it changes nothing and touches no
    // memory of ours.
    unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffff_u64) };
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
    const SECCOMP_RET_LOG: u32 = 0x7ffc_0000;
    const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
    const BPF_RET_K: u16 = 0x06;

    fn returns(p: &BpfProgram) -> Vec<u32> {
        p.iter()
            .filter(|i| i.code == BPF_RET_K)
            .map(|i| i.k)
            .collect()
    }

    #[test]
    fn every_kind_has_a_kill_and_a_log_program() {
        for kind in ThreadKind::ALL {
            let kill = program(kind, SeccompMode::Kill).unwrap().unwrap();
            let log = program(kind, SeccompMode::Log).unwrap().unwrap();
            assert!(program(kind, SeccompMode::Off).unwrap().is_none());
            assert_eq!(kill.len(), log.len(), "{kind}");
            let (rk, rl) = (returns(&kill), returns(&log));
            assert!(
                rk.contains(&SECCOMP_RET_KILL_PROCESS) && rk.contains(&SECCOMP_RET_ALLOW),
                "{kind}"
            );
            assert!(!rk.contains(&SECCOMP_RET_LOG), "{kind}");
            assert!(
                rl.contains(&SECCOMP_RET_LOG) && rl.contains(&SECCOMP_RET_ALLOW),
                "{kind}"
            );
            // The log variant kills only for a foreign architecture (seccompiler's check at
            // the very start of every program); every other mismatch is logged.
            let kills: Vec<usize> = log
                .iter()
                .enumerate()
                .filter(|(_, i)| i.code == BPF_RET_K && i.k == SECCOMP_RET_KILL_PROCESS)
                .map(|(n, _)| n)
                .collect();
            assert!(kills.len() == 1 && kills[0] < 4, "{kind}: {kills:?}");
        }
    }

    #[test]
    fn modes_parse_and_print() {
        for m in [SeccompMode::Kill, SeccompMode::Log, SeccompMode::Off] {
            assert_eq!(m.to_string().parse::<SeccompMode>().unwrap(), m);
        }
        assert!("trap"
            .parse::<SeccompMode>()
            .unwrap_err()
            .contains("kill, log or off"));
        assert_eq!(SeccompMode::default(), SeccompMode::Off);
        assert_eq!(serde_json::to_string(&SeccompMode::Log).unwrap(), "\"log\"");
    }

    #[test]
    fn library_default_is_off() {
        // Nothing in this test binary calls set_mode.
        assert_eq!(mode(), SeccompMode::Off);
    }
}
