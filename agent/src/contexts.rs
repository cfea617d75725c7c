//! Code contexts: `context_create`, `context_list`, `context_restart`, `context_remove`,
//! `run_code`, `interrupt` and `warmup` (see "Code contexts" in `agent/PROTOCOL.md`).
//!
//! A context is one long-lived process whose state survives between calls:
//! - **python**: `agent/python/ember_driver.py` (installed at `/usr/lib/ember/ember_driver.py`)
//!   running an IPython `InteractiveShell`. Its fd 1/2 are pipes the agent reads (so `print`,
//!   `!cmd` and C-level writes all arrive), fd 3 a control socket carrying framed JSON (the
//!   cell in; `result`, `display`, `exception`, `end` out). After a `warmup` the contexts are
//!   forked from a *zygote* driver that already imported IPython (a cold start costs over a
//!   minute in a kvm_pvm guest): the agent sends it a fork request with the new context's
//!   control socket and pipes (SCM_RIGHTS); it double-forks, so the context is re-parented
//!   to PID 1 and watched through its control socket (EOF = died).
//! - **javascript** and **typescript**: Node.js running `drivers/ember_driver.js` (TypeScript:
//!   each cell transpiled first, types erased); **r**: `Rscript` running `drivers/ember_driver.R`;
//!   **java**: the JDK's source launcher running `drivers/EmberJShell.java` (a jshell in the
//!   JVM). The driver scripts are embedded in the agent and written to `/run/ember/drivers` when
//!   first needed, so any image with the runtime installed can run the language. Those runtimes
//!   cannot fork a warm copy of themselves (no zygote): a template starts its warm *spares*
//!   before the snapshot instead, and a spare taken later is replaced in the background. Their
//!   requests come on fd 0 (the control socket) as field frames ([`proc::fields_frame`]), their
//!   events go out on fd 3, a pipe (in the python driver's framing and events).
//! - **bash**: `bash --noprofile --norc` running a small loop that waits for a byte on fd 3,
//!   sources the cell from a file and writes the status back on fd 3 (bash reads pipes one
//!   byte per syscall, so code never goes through one).
//!
//! `run_code` waits in one `poll` on the control socket, the two pipes, the context's pidfd
//! (when it is the agent's child) and the host connection (hang-up interrupts the code),
//! with the deadline as the timeout; each wake-up's events go out in one write. The pipes are
//! drained before a control message is relayed (the driver flushes before sending), so the
//! order of output and results is kept.

mod proc;
mod sys;

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use serde_json::json;
use thiserror::Error;

use crate::exec::Sink;
use crate::protocol::{
    ContextCreateRequest, ContextInfo, ContextRef, DisplayData, EndStatus, ErrorCode, ErrorInfo,
    EventKind, Exception, ResultData, RunCodeRequest, WarmupRequest, DEFAULT_OUTPUT_CAP, MAX_CHUNK,
};
use crate::reaper::Children;
use proc::{poll, wait_ready, BashFiles, DriverEvent, Proc};

/// How long a context gets to come back after SIGINT before it is killed. Generous: the
/// first traceback a restored python context formats loads and reads what it quotes, which
/// takes seconds where guest syscalls and first page touches are slow (kvm_pvm).
pub const KILL_AFTER: Duration = Duration::from_secs(10);

/// How often a bash cell that has not stopped gets SIGINT again (see `Contexts::pump`).
const BASH_SIGINT_AGAIN: Duration = Duration::from_millis(200);

/// Id of the python context used when `run_code` names none.
pub const DEFAULT_PYTHON: &str = "default";

/// Id of the bash context used when `run_code` names none and asks for bash.
pub const DEFAULT_BASH: &str = "default-bash";

/// Longest context id.
pub const MAX_ID_LEN: usize = 64;

/// Where the agent finds its interpreters; see [`ContextConfig::from_env`].
#[derive(Debug, Clone)]
pub struct ContextConfig {
    /// The python interpreter (`EMBER_PYTHON`, default `/usr/bin/python3`).
    pub python: String,
    /// The driver script (`EMBER_DRIVER`, default `/usr/lib/ember/ember_driver.py`).
    pub driver: String,
    /// The shell of bash contexts (`/bin/bash`).
    pub bash: String,
    /// Directory for the bash contexts' cell files (`EMBER_CTX_DIR`, default `/run/ember/ctx`).
    pub state_dir: PathBuf,
    /// How long a cold driver (no zygote) and the zygote get to import IPython.
    pub start_timeout: Duration,
    /// How long a fork from the zygote or a bash start may take. A forked context runs the
    /// template's warm-up code again before it answers (pandas, a plot: tens of seconds of
    /// guest work on kvm_pvm, minutes on a loaded host — a template build beside others once
    /// passed the 60 s this used to be).
    pub fork_timeout: Duration,
    /// Restore `SIGPIPE`'s default action in contexts (for agents that ignore it: tests).
    pub reset_sigpipe: bool,
    /// Where a context starts when its request names no directory (if it exists; default
    /// `/workspace`, the templates' work area, so relative paths match the file API's).
    pub default_cwd: Option<PathBuf>,
    /// Node.js, for javascript and typescript (`EMBER_NODE`, default `/usr/bin/node`).
    pub node: String,
    /// Directories one of which holds the `typescript` package (typescript contexts need it).
    pub typescript: Vec<PathBuf>,
    /// R's script front end (`EMBER_RSCRIPT`, default `/usr/bin/Rscript`).
    pub rscript: String,
    /// The JDK's `java` (`EMBER_JAVA`, default `/usr/bin/java`); a JDK, not a JRE: java
    /// contexts need `jdk.jshell` and the compiler, so `jshell` is looked for beside it.
    pub java: String,
    /// Where the embedded drivers are written (`/run/ember/drivers`).
    pub drivers_dir: PathBuf,
}

impl Default for ContextConfig {
    fn default() -> Self {
        Self {
            python: "/usr/bin/python3".into(),
            driver: "/usr/lib/ember/ember_driver.py".into(),
            bash: "/bin/bash".into(),
            state_dir: PathBuf::from("/run/ember/ctx"),
            start_timeout: Duration::from_secs(600),
            fork_timeout: Duration::from_secs(300),
            reset_sigpipe: false,
            default_cwd: Some(PathBuf::from("/workspace")),
            node: "/usr/bin/node".into(),
            typescript: vec![
                PathBuf::from("/usr/share/nodejs/typescript"),
                PathBuf::from("/usr/lib/node_modules/typescript"),
                PathBuf::from("/usr/local/lib/node_modules/typescript"),
            ],
            rscript: "/usr/bin/Rscript".into(),
            java: "/usr/bin/java".into(),
            drivers_dir: PathBuf::from("/run/ember/drivers"),
        }
    }
}

impl ContextConfig {
    /// The defaults, overridden by `EMBER_PYTHON`, `EMBER_DRIVER` and `EMBER_CTX_DIR` when set
    /// (reading the environment costs no syscall).
    pub fn from_env() -> Self {
        let mut config = Self::default();
        if let Ok(python) = std::env::var("EMBER_PYTHON") {
            config.python = python;
        }
        if let Ok(driver) = std::env::var("EMBER_DRIVER") {
            config.driver = driver;
        }
        if let Ok(dir) = std::env::var("EMBER_CTX_DIR") {
            config.state_dir = dir.into();
        }
        if let Ok(node) = std::env::var("EMBER_NODE") {
            config.node = node;
        }
        if let Ok(rscript) = std::env::var("EMBER_RSCRIPT") {
            config.rscript = rscript;
        }
        if let Ok(java) = std::env::var("EMBER_JAVA") {
            config.java = java;
        }
        config
    }
}

/// The context languages (in [`crate::protocol::LANGUAGES`]'s order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lang {
    Python,
    Bash,
    Javascript,
    Typescript,
    R,
    Java,
}

/// Where Debian installs Node.js modules (`node-typescript`: `/usr/share/nodejs/typescript`):
/// the `NODE_PATH` of javascript and typescript contexts unless one is set.
const NODE_PATH: &str = "/usr/share/nodejs:/usr/lib/nodejs:/usr/lib/x86_64-linux-gnu/nodejs";

/// The embedded drivers (see the module doc).
const JS_DRIVER: &str = include_str!("contexts/drivers/ember_driver.js");
const R_DRIVER: &str = include_str!("contexts/drivers/ember_driver.R");
const JAVA_DRIVER: &str = include_str!("contexts/drivers/EmberJShell.java");

impl Lang {
    const ALL: [Lang; 6] = [
        Lang::Python,
        Lang::Bash,
        Lang::Javascript,
        Lang::Typescript,
        Lang::R,
        Lang::Java,
    ];

    fn parse(name: Option<&str>) -> Result<Self, ErrorInfo> {
        let name = name.unwrap_or("");
        if name.is_empty() {
            return Ok(Lang::Python);
        }
        crate::protocol::canonical_language(name)
            .and_then(|canonical| Lang::ALL.into_iter().find(|l| l.name() == canonical))
            .ok_or_else(|| {
                ErrorInfo::new(
                    ErrorCode::BadRequest,
                    format!(
                        "unknown language {name:?} ({})",
                        crate::protocol::LANGUAGES.join(", ")
                    ),
                )
            })
    }

    fn name(self) -> &'static str {
        crate::protocol::LANGUAGES[self.index()]
    }

    fn index(self) -> usize {
        match self {
            Lang::Python => 0,
            Lang::Bash => 1,
            Lang::Javascript => 2,
            Lang::Typescript => 3,
            Lang::R => 4,
            Lang::Java => 5,
        }
    }

    /// The context a `run_code` of this language without a context id runs in.
    fn default_context(self) -> &'static str {
        crate::protocol::default_context(self.name())
    }

    /// A driver started from an embedded script, talking in field frames (see the module doc).
    fn embedded(self) -> bool {
        !matches!(self, Lang::Python | Lang::Bash)
    }
}

/// Starting a context's process failed.
#[derive(Debug, Error)]
pub enum ContextError {
    /// The process could not be started.
    #[error("starting {what} failed: {source}")]
    Spawn {
        /// What.
        what: &'static str,
        /// Why.
        #[source]
        source: sys::SpawnError,
    },
    /// A pipe, socket or file could not be made.
    #[error("{what} failed: {source}")]
    Io {
        /// What.
        what: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The process started but did not become ready.
    #[error("the {what} did not start: {reason}")]
    NotReady {
        /// What.
        what: &'static str,
        /// Why.
        reason: String,
    },
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> ContextError {
    move |source| ContextError::Io { what, source }
}

impl From<ContextError> for ErrorInfo {
    fn from(e: ContextError) -> Self {
        ErrorInfo::new(ErrorCode::ContextFailed, e.to_string())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One context.
#[derive(Debug)]
struct Context {
    id: String,
    lang: Lang,
    cwd: Option<String>,
    env: BTreeMap<String, String>,
    /// Held while code runs (a second `run_code` waits).
    slot: Mutex<Slot>,
    /// The process's pid, for `interrupt` and `context_list` while the slot is held.
    pid: AtomicI32,
    busy: AtomicBool,
    /// Set by `interrupt` during a run.
    interrupted: AtomicBool,
    /// Whether the current run got its SIGINT (from a time limit, a host that left, or
    /// `interrupt`): one per run. Node.js and the JVM handle a signal on their own schedule
    /// (the event loop, the signal dispatcher thread), so a second SIGINT for the same run
    /// could land in the next cell and interrupt it.
    sigint_sent: AtomicBool,
    /// Set when the agent killed the process during a run (interrupt that did not work,
    /// restart, remove).
    killed: AtomicBool,
    /// Counts runs, so that a late `interrupt` does not hit the next one.
    runs: AtomicU64,
}

#[derive(Debug, Default)]
struct Slot {
    proc: Option<Proc>,
    /// Why the last process ended, until the next call restarts it.
    dead: Option<String>,
    /// Bash cells run so far (python counts its own).
    count: u64,
}

impl Context {
    fn info(&self, cwd: &str, busy: Option<bool>) -> ContextInfo {
        ContextInfo {
            id: self.id.clone(),
            language: self.lang.name().into(),
            cwd: cwd.to_owned(),
            pid: self.pid.load(Ordering::Relaxed),
            busy,
        }
    }
}

#[derive(Debug, Default)]
struct Spares {
    /// Per language ([`Lang::index`]): the spares ready, and how many to keep.
    pools: [Vec<Proc>; Lang::ALL.len()],
    want: [usize; Lang::ALL.len()],
    refilling: bool,
}

impl Spares {
    fn pool(&mut self, lang: Lang) -> (&mut Vec<Proc>, usize) {
        (&mut self.pools[lang.index()], self.want[lang.index()])
    }

    fn short(&self) -> bool {
        self.pools
            .iter()
            .zip(self.want)
            .any(|(pool, want)| pool.len() < want)
    }
}

/// The agent's code contexts.
#[derive(Debug)]
pub struct Contexts {
    config: ContextConfig,
    children: Children,
    table: Mutex<BTreeMap<String, Arc<Context>>>,
    zygote: Mutex<Option<Proc>>,
    spares: Mutex<Spares>,
    /// Variables every context gets (the process defaults, then `warmup`'s `env`).
    base_env: Mutex<BTreeMap<String, String>>,
    devnull: OnceLock<Option<OwnedFd>>,
    /// Held while an embedded driver is written (see `driver_file`).
    drivers_written: Mutex<()>,
    next_dir: AtomicU64,
    /// Counts `sync` calls: a context whose process was last seeded in an older generation
    /// reseeds its language's RNGs before its next cell (clones of one snapshot would
    /// otherwise share Python's `random` and NumPy's global RNG state).
    sync_gen: AtomicU64,
}

/// The variables of `env` that `base` lacks or has with another value.
fn new_vars(
    base: &BTreeMap<String, String>,
    env: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    env.iter()
        .filter(|(k, v)| base.get(*k) != Some(*v))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// A sink that drops everything (setup cells of spares).
struct Discard;

impl Sink for Discard {
    fn event(&mut self, _: EventKind) {}
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn peer_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn bash_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// `'text'` for bash.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

fn check_env(lang: Lang, env: &BTreeMap<String, String>) -> Result<(), ErrorInfo> {
    for (key, value) in env {
        let bad = match lang {
            Lang::Bash => !bash_name(key),
            // Sent as a field name (`env.KEY`) to the embedded drivers.
            _ if lang.embedded() => key.is_empty() || key.contains(['=', '\0', ' ', '\n']),
            _ => key.is_empty() || key.contains('=') || key.contains('\0'),
        } || value.contains('\0');
        if bad {
            return Err(ErrorInfo::new(
                ErrorCode::BadRequest,
                format!(
                    "environment variable {key:?} is not valid for {}",
                    lang.name()
                ),
            ));
        }
    }
    Ok(())
}

/// How a cell's run ended, before it is reported.
enum Outcome {
    /// Python's `end` (status, count) or bash's status line (code).
    Python(String, Option<u64>),
    Bash(i32),
    /// The process died (control socket EOF or exit).
    Died,
    /// The agent killed it KILL_AFTER a SIGINT that did not bring it back.
    Killed,
}

/// State of one run.
struct Run<'a> {
    sink: &'a mut dyn Sink,
    cap: u64,
    sent: u64,
    truncated: bool,
    host_gone: bool,
    timed_out: bool,
    sigint_at: Option<Instant>,
    /// When SIGINT was last sent (bash cells get it again until they end: see `pump`).
    sigint_last: Option<Instant>,
    forward_results: bool,
}

impl Run<'_> {
    fn output(&mut self, stdout: bool, data: &[u8]) {
        if self.truncated {
            return;
        }
        let room = usize::try_from(self.cap.saturating_sub(self.sent)).unwrap_or(usize::MAX);
        let take = data.len().min(room);
        for chunk in data[..take].chunks(MAX_CHUNK) {
            let data = chunk.to_vec();
            self.sink.event(if stdout {
                EventKind::Stdout { data }
            } else {
                EventKind::Stderr { data }
            });
        }
        self.sent += take as u64;
        if take < data.len() {
            self.truncate();
        }
    }

    fn truncate(&mut self) {
        if !self.truncated {
            self.truncated = true;
            self.sink.event(EventKind::Truncated { limit: self.cap });
        }
    }

    fn sigint(&mut self, pid: libc::pid_t) {
        if self.sigint_at.is_none() {
            sys::signal_group(pid, libc::SIGINT);
            self.sigint_at = Some(Instant::now());
            self.sigint_last = self.sigint_at;
        }
    }

    /// [`Run::sigint`], unless the run's context got one already (from `interrupt`): then
    /// only the kill timer starts.
    fn sigint_once(&mut self, pid: libc::pid_t, ctx: Option<&Context>) {
        if ctx.is_some_and(|c| c.sigint_sent.swap(true, Ordering::AcqRel)) {
            if self.sigint_at.is_none() {
                self.sigint_at = Some(Instant::now());
                self.sigint_last = self.sigint_at;
            }
            return;
        }
        self.sigint(pid);
    }

    /// SIGINT again (a bash cell that has not ended since the last one).
    fn sigint_again(&mut self, pid: libc::pid_t) {
        sys::signal_group(pid, libc::SIGINT);
        self.sigint_last = Some(Instant::now());
    }
}

impl Contexts {
    /// No contexts yet; python ones start cold until a `warmup` starts the zygote.
    /// Records a `sync` (the host's clock and fresh entropy, sent first after every restore):
    /// each python context reseeds `random` (and NumPy's global RNG, when imported) before its
    /// next cell. Costs one `getrandom` in the driver, once per context and restore.
    pub fn note_sync(&self) {
        self.sync_gen.fetch_add(1, Ordering::AcqRel);
    }

    pub fn new(config: ContextConfig, children: Children) -> Self {
        let base_env = crate::process::COMMAND_ENV
            .iter()
            .filter_map(|var| {
                let (key, value) = var.to_str().ok()?.split_once('=')?;
                Some((key.to_owned(), value.to_owned()))
            })
            .collect();
        Self {
            config,
            children,
            table: Mutex::default(),
            zygote: Mutex::default(),
            spares: Mutex::default(),
            base_env: Mutex::new(base_env),
            devnull: OnceLock::new(),
            drivers_written: Mutex::new(()),
            next_dir: AtomicU64::new(1),
            sync_gen: AtomicU64::new(0),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ContextConfig {
        &self.config
    }

    fn devnull(&self) -> Result<i32, ContextError> {
        self.devnull
            .get_or_init(|| sys::open_devnull().ok())
            .as_ref()
            .map(AsRawFd::as_raw_fd)
            .ok_or_else(|| ContextError::Io {
                what: "opening /dev/null",
                source: io::Error::from_raw_os_error(libc::ENOENT),
            })
    }

    fn env_for(&self, lang: Lang, extra: &BTreeMap<String, String>) -> Vec<(String, String)> {
        let mut env = lock(&self.base_env).clone();
        if lang == Lang::Python {
            env.insert(
                "MPLBACKEND".into(),
                "module://matplotlib_inline.backend_inline".into(),
            );
        }
        if matches!(lang, Lang::Javascript | Lang::Typescript) && !env.contains_key("NODE_PATH") {
            // Debian's packaged modules (`typescript` among them), for `require` in cells.
            env.insert("NODE_PATH".into(), NODE_PATH.into());
        }
        env.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        env.into_iter().collect()
    }

    // ---- starting processes ----

    /// A cold driver: `python3 ember_driver.py [--zygote]`, ready.
    fn start_cold_python(
        &self,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
        zygote: bool,
    ) -> Result<Proc, ContextError> {
        let what = if zygote {
            "python zygote"
        } else {
            "python driver"
        };
        let (ctl, ctl_child) = sys::socket_pair().map_err(io_err("creating a socket pair"))?;
        let (out, out_w) = sys::pipe().map_err(io_err("creating a pipe"))?;
        let (err, err_w) = sys::pipe().map_err(io_err("creating a pipe"))?;
        let mut argv = vec![self.config.python.clone(), self.config.driver.clone()];
        if zygote {
            argv.push("--zygote".into());
        }
        let started = sys::spawn(
            &argv,
            &self.env_for(Lang::Python, env),
            cwd,
            [
                self.devnull()?,
                out_w.as_raw_fd(),
                err_w.as_raw_fd(),
                ctl_child.as_raw_fd(),
            ],
            self.config.reset_sigpipe,
            &self.children,
        )
        .map_err(|source| ContextError::Spawn { what, source })?;
        drop((ctl_child, out_w, err_w));
        let mut proc = Proc::new(
            started.pid,
            Some(started.pidfd),
            ctl,
            [out, err],
            self.children.clone(),
        );
        let (_, cwd) = wait_ready(&mut proc, self.config.start_timeout)
            .map_err(|reason| ContextError::NotReady { what, reason })?;
        proc.cwd = cwd;
        Ok(proc)
    }

    /// A python context forked from the zygote.
    fn fork_python(
        &self,
        zygote: &Proc,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
    ) -> Result<Proc, ContextError> {
        let (ctl, ctl_child) = sys::socket_pair().map_err(io_err("creating a socket pair"))?;
        let (out, out_w) = sys::pipe().map_err(io_err("creating a pipe"))?;
        let (err, err_w) = sys::pipe().map_err(io_err("creating a pipe"))?;
        // Before the first `sync` (at template build time) a forked context also reruns the
        // warm-up code, so that its copy-on-write faults are paid before the snapshot.
        let rewarm = self.sync_gen.load(Ordering::Acquire) == 0;
        let msg = json!({"op": "fork", "cwd": cwd, "env": env, "rewarm": rewarm});
        let mut frame = Vec::new();
        crate::protocol::encode_frame(&msg, &mut frame, crate::protocol::MAX_FRAME).map_err(
            |e| ContextError::NotReady {
                what: "fork request",
                reason: e.to_string(),
            },
        )?;
        sys::send_with_fds(
            &zygote.ctl,
            &frame,
            [ctl_child.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()],
        )
        .map_err(io_err("sending a fork request to the zygote"))?;
        drop((ctl_child, out_w, err_w));
        let mut proc = Proc::new(0, None, ctl, [out, err], self.children.clone());
        let (pid, cwd) = wait_ready(&mut proc, self.config.fork_timeout).map_err(|reason| {
            ContextError::NotReady {
                what: "forked python context",
                reason,
            }
        })?;
        proc.pid = pid;
        proc.cwd = cwd;
        Ok(proc)
    }

    fn start_python(
        &self,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
    ) -> Result<Proc, ContextError> {
        let mut zygote = lock(&self.zygote);
        if let Some(z) = zygote.as_ref() {
            match self.fork_python(z, cwd, env) {
                Ok(proc) => return Ok(proc),
                Err(e @ ContextError::NotReady { .. }) if cwd.is_some() => {
                    // Most likely the directory; the zygote is fine.
                    return Err(e);
                }
                Err(_) => {
                    // The zygote is gone or broken: start cold from now on.
                    *zygote = None;
                }
            }
        }
        drop(zygote);
        self.start_cold_python(cwd, env, false)
    }

    fn start_bash(
        &self,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
    ) -> Result<Proc, ContextError> {
        let n = self.next_dir.fetch_add(1, Ordering::Relaxed);
        let dir = self
            .config
            .state_dir
            .join(format!("{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(io_err("creating the context directory"))?;
        let cell = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("cell"))
            .map_err(io_err("creating the cell file"))?;
        let files = BashFiles { dir, cell };
        let dir_q = shell_quote(&files.dir.to_string_lossy());
        // One 1-byte read per cell on fd 3 ("\n", or "e\n" when an env restore follows), the
        // status back on fd 3. SIGINT: the trap leaves the cell (`return` from the sourced
        // file), so that a pure-bash loop stops too and bash itself survives.
        let script = format!(
            "trap 'return 130 2>/dev/null' INT\n\
             while :; do\n\
             read -r -u 3 __ember_op\n\
             case $? in 0) ;; 1) exit 0 ;; *) continue ;; esac\n\
             . {dir_q}/cell\n\
             __ember_st=$?\n\
             [ \"$__ember_op\" = e ] && {{ trap '' INT; . {dir_q}/restore; trap 'return 130 2>/dev/null' INT; }}\n\
             printf '%d\\n' \"$__ember_st\" >&3\n\
             done\n"
        );
        let (ctl, ctl_child) = sys::socket_pair().map_err(io_err("creating a socket pair"))?;
        let (out, out_w) = sys::pipe().map_err(io_err("creating a pipe"))?;
        let (err, err_w) = sys::pipe().map_err(io_err("creating a pipe"))?;
        let argv = [
            self.config.bash.clone(),
            "--noprofile".into(),
            "--norc".into(),
            "-c".into(),
            script,
        ];
        let started = sys::spawn(
            &argv,
            &self.env_for(Lang::Bash, env),
            cwd,
            [
                self.devnull()?,
                out_w.as_raw_fd(),
                err_w.as_raw_fd(),
                ctl_child.as_raw_fd(),
            ],
            self.config.reset_sigpipe,
            &self.children,
        )
        .map_err(|source| ContextError::Spawn {
            what: "bash",
            source,
        })?;
        drop((ctl_child, out_w, err_w));
        let mut proc = Proc::new(
            started.pid,
            Some(started.pidfd),
            ctl,
            [out, err],
            self.children.clone(),
        );
        proc.bash = Some(files);
        proc.cwd = match cwd {
            Some(cwd) => cwd.to_owned(),
            None => std::env::current_dir()
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_else(|_| "/".into()),
        };
        Ok(proc)
    }

    /// Writes an embedded driver to the drivers directory (once per agent: the directory is on
    /// a tmpfs, and a snapshot keeps it); returns its path.
    fn driver_file(&self, lang: Lang) -> Result<PathBuf, ContextError> {
        let (name, text) = match lang {
            Lang::R => ("ember_driver.R", R_DRIVER),
            Lang::Java => ("EmberJShell.java", JAVA_DRIVER),
            _ => ("ember_driver.js", JS_DRIVER),
        };
        let path = self.config.drivers_dir.join(name);
        let _written = lock(&self.drivers_written);
        if std::fs::read(&path).ok().as_deref() != Some(text.as_bytes()) {
            std::fs::create_dir_all(&self.config.drivers_dir)
                .map_err(io_err("creating the drivers directory"))?;
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, text).map_err(io_err("writing a driver"))?;
            std::fs::rename(&tmp, &path).map_err(io_err("writing a driver"))?;
        }
        Ok(path)
    }

    /// Whether this guest has `lang`'s runtime (a few `stat`s; asked only when no spare of it
    /// is ready).
    fn available(&self, lang: Lang) -> bool {
        let exists = |p: &str| std::path::Path::new(p).exists();
        match lang {
            Lang::Python => exists(&self.config.python) && exists(&self.config.driver),
            Lang::Bash => exists(&self.config.bash),
            Lang::Javascript => exists(&self.config.node),
            Lang::Typescript => {
                exists(&self.config.node) && self.config.typescript.iter().any(|d| d.is_dir())
            }
            Lang::R => exists(&self.config.rscript),
            Lang::Java => {
                let jshell = std::path::Path::new(&self.config.java).with_file_name("jshell");
                exists(&self.config.java) && jshell.exists()
            }
        }
    }

    /// Refuses a language this guest lacks, naming those it has.
    fn check_available(&self, lang: Lang) -> Result<(), ErrorInfo> {
        if self.available(lang) {
            return Ok(());
        }
        let have: Vec<&str> = Lang::ALL
            .into_iter()
            .filter(|&l| self.available(l))
            .map(Lang::name)
            .collect();
        Err(ErrorInfo::new(
            ErrorCode::BadRequest,
            format!(
                "language {:?} is not available in this sandbox (its template has: {})",
                lang.name(),
                have.join(", ")
            ),
        ))
    }

    /// A javascript, typescript, R or java driver, started cold and ready (it warms itself up
    /// before it says so).
    fn start_embedded(
        &self,
        lang: Lang,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
    ) -> Result<Proc, ContextError> {
        let what = match lang {
            Lang::Javascript => "javascript driver",
            Lang::Typescript => "typescript driver",
            Lang::R => "R driver",
            _ => "java driver",
        };
        let script = self.driver_file(lang)?.to_string_lossy().into_owned();
        let argv: Vec<String> = match lang {
            // internal/repl/await: Node's own rewrite of cells with a top-level await.
            Lang::Javascript => vec![
                self.config.node.clone(),
                "--expose-internals".into(),
                script,
            ],
            Lang::Typescript => vec![
                self.config.node.clone(),
                "--expose-internals".into(),
                script,
                "--ts".into(),
            ],
            Lang::R => vec![self.config.rscript.clone(), "--vanilla".into(), script],
            // C1 only and the serial collector: less start-up and warm-up work for one vCPU;
            // jshell compiles each snippet with javac, in this JVM.
            // No timer of the JVM's own while it waits for a cell: its performance-counter
            // sampling (every 50 ms), guaranteed safepoints (every second) and monitor
            // deflation checks (every 250 ms; the 60 s backstop stays) kept an idle spare's
            // vCPU ~15 % busy on kvm_pvm, and a template's guest from ever settling. The
            // packages opened are those whose generators the driver reseeds after a restore.
            _ => vec![
                self.config.java.clone(),
                "-XX:+UseSerialGC".into(),
                "-XX:TieredStopAtLevel=1".into(),
                "-Xss4m".into(),
                "-XX:-UsePerfData".into(),
                "-XX:+UnlockDiagnosticVMOptions".into(),
                "-XX:GuaranteedSafepointInterval=0".into(),
                "-XX:AsyncDeflationInterval=0".into(),
                "--add-opens=java.base/java.lang=ALL-UNNAMED".into(),
                "--add-opens=java.base/java.util=ALL-UNNAMED".into(),
                "--add-opens=java.base/java.util.concurrent=ALL-UNNAMED".into(),
                script,
            ],
        };
        let (ctl, ctl_child) = sys::socket_pair().map_err(io_err("creating a socket pair"))?;
        let (events, events_w) = sys::pipe().map_err(io_err("creating a pipe"))?;
        let (out, out_w) = sys::pipe().map_err(io_err("creating a pipe"))?;
        let (err, err_w) = sys::pipe().map_err(io_err("creating a pipe"))?;
        let started = sys::spawn(
            &argv,
            &self.env_for(lang, env),
            cwd,
            [
                ctl_child.as_raw_fd(),
                out_w.as_raw_fd(),
                err_w.as_raw_fd(),
                events_w.as_raw_fd(),
            ],
            self.config.reset_sigpipe,
            &self.children,
        )
        .map_err(|source| ContextError::Spawn { what, source })?;
        drop((ctl_child, out_w, err_w, events_w));
        let mut proc = Proc::new(
            started.pid,
            Some(started.pidfd),
            ctl,
            [out, err],
            self.children.clone(),
        );
        proc.events = Some(events);
        let (_, cwd) = wait_ready(&mut proc, self.config.start_timeout)
            .map_err(|reason| ContextError::NotReady { what, reason })?;
        proc.cwd = cwd;
        Ok(proc)
    }

    fn start(
        &self,
        lang: Lang,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
    ) -> Result<Proc, ContextError> {
        let default_cwd = self.default_cwd();
        let cwd = cwd.or(default_cwd.as_deref());
        match lang {
            Lang::Python => self.start_python(cwd, env),
            Lang::Bash => self.start_bash(cwd, env),
            _ => self.start_embedded(lang, cwd, env),
        }
    }

    /// Where contexts start when the request names no directory: the configured default
    /// (`/workspace`) when it exists, else the agent's own.
    fn default_cwd(&self) -> Option<String> {
        let dir = self.config.default_cwd.as_ref()?;
        dir.is_dir().then(|| dir.to_string_lossy().into_owned())
    }

    /// A spare of `lang` set up for `cwd`/`env`, if one is ready. Variables a spare already
    /// has with the same value (the template's, which the runtime sends with every create) cost
    /// it no setup round trip.
    fn take_spare(
        &self,
        lang: Lang,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
    ) -> Option<Proc> {
        let env = new_vars(&lock(&self.base_env), env);
        let env = &env;
        let mut proc = lock(&self.spares).pool(lang).0.pop()?;
        if cwd.is_none() && env.is_empty() {
            return Some(proc);
        }
        let ok = match lang {
            Lang::Python | Lang::Javascript | Lang::Typescript | Lang::R | Lang::Java => {
                let sent = if lang.embedded() {
                    let env_names: Vec<String> = env.keys().map(|k| format!("env.{k}")).collect();
                    let mut fields = vec![("op", "setup"), ("cwd", cwd.unwrap_or(""))];
                    fields.extend(
                        env_names
                            .iter()
                            .map(String::as_str)
                            .zip(env.values().map(String::as_str)),
                    );
                    proc.send_fields(&fields)
                } else {
                    proc.send_json(&json!({"op": "setup", "cwd": cwd, "env": env}))
                };
                sent.is_ok()
                    && match wait_ready(&mut proc, self.config.fork_timeout) {
                        Ok((_, cwd)) => {
                            proc.cwd = cwd;
                            true
                        }
                        Err(_) => false,
                    }
            }
            Lang::Bash => {
                let mut code = String::new();
                if let Some(cwd) = cwd {
                    code.push_str(&format!("cd -- {} || return 1\n", shell_quote(cwd)));
                }
                for (k, v) in env {
                    code.push_str(&format!("export {k}={}\n", shell_quote(v)));
                }
                let ok = matches!(
                    self.run_in(
                        &mut proc,
                        Lang::Bash,
                        &code,
                        &BTreeMap::new(),
                        false,
                        &mut Run {
                            sink: &mut Discard,
                            cap: 0,
                            sent: 0,
                            truncated: true,
                            host_gone: false,
                            timed_out: false,
                            sigint_at: None,
                            sigint_last: None,
                            forward_results: false,
                        },
                        Some(Instant::now() + self.config.fork_timeout),
                        None,
                    ),
                    Outcome::Bash(0)
                );
                if ok {
                    if let Some(cwd) = cwd {
                        proc.cwd = cwd.to_owned();
                    }
                }
                ok
            }
        };
        ok.then_some(proc)
    }

    /// Tops the spare pools up in a background thread (one at a time).
    fn refill_spares(self: &Arc<Self>) {
        {
            let mut spares = lock(&self.spares);
            if !spares.short() || spares.refilling {
                return;
            }
            spares.refilling = true;
        }
        let this = self.clone();
        let spawned = std::thread::Builder::new().spawn(move || {
            // A start that failed is tried again by the next refill.
            let _ = this.fill_spares();
            lock(&this.spares).refilling = false;
        });
        if spawned.is_err() {
            lock(&self.spares).refilling = false;
        }
    }

    /// Starts spares until the pools are full (or a start fails); returns the first failure.
    /// A spare started in a sandbox (after the first `sync`) runs at the lowest CPU priority
    /// until it is handed out: a runtime's cold start is long where guest syscalls are slow
    /// (kvm_pvm), and the sandbox's own code must not wait behind it.
    fn fill_spares(&self) -> Result<(), (Lang, ContextError)> {
        let background = self.sync_gen.load(Ordering::Acquire) > 0;
        let mut first_error = None;
        for lang in Lang::ALL {
            loop {
                let (have, want) = {
                    let mut spares = lock(&self.spares);
                    let (pool, want) = spares.pool(lang);
                    (pool.len(), want)
                };
                if have >= want {
                    break;
                }
                if background {
                    sys::set_nice(0, 19);
                }
                let started = self.start(lang, None, &BTreeMap::new());
                if background {
                    sys::set_nice(0, 0);
                }
                match started {
                    Ok(mut proc) => {
                        proc.niced = background;
                        lock(&self.spares).pool(lang).0.push(proc);
                    }
                    Err(e) => {
                        first_error.get_or_insert((lang, e));
                        break;
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    // ---- the table ----

    fn get(&self, id: &str) -> Option<Arc<Context>> {
        lock(&self.table).get(id).cloned()
    }

    /// Creates a context (from a spare when one fits) and adds it to the table.
    fn create(
        self: &Arc<Self>,
        req: &ContextCreateRequest,
        replace: bool,
    ) -> Result<(Arc<Context>, String), ErrorInfo> {
        let lang = Lang::parse(Some(&req.language))?;
        check_env(lang, &req.env)?;
        let id = match &req.id {
            Some(id) if !valid_id(id) => {
                return Err(ErrorInfo::new(
                    ErrorCode::BadRequest,
                    format!(
                        "context id {id:?}: use 1 to {MAX_ID_LEN} letters, digits, '.', '_', '-'"
                    ),
                ))
            }
            Some(id) => id.clone(),
            None => sys::random_hex(),
        };
        if !replace && lock(&self.table).contains_key(&id) {
            return Err(ErrorInfo::new(
                ErrorCode::Exists,
                format!("a context {id:?} exists"),
            ));
        }
        let cwd = req.cwd.as_deref().filter(|c| !c.is_empty());
        let proc = match self.take_spare(lang, cwd, &req.env) {
            Some(mut proc) => {
                // Spares started in a sandbox wait at the lowest priority (see fill_spares).
                if proc.niced {
                    sys::set_nice_all(proc.pid, 0);
                    proc.niced = false;
                }
                self.refill_spares();
                proc
            }
            None => {
                self.check_available(lang)?;
                self.start(lang, cwd, &req.env)?
            }
        };
        let started_cwd = proc.cwd.clone();
        let ctx = Arc::new(Context {
            id: id.clone(),
            lang,
            cwd: cwd.map(str::to_owned),
            env: req.env.clone(),
            pid: AtomicI32::new(proc.pid),
            slot: Mutex::new(Slot {
                proc: Some(proc),
                ..Slot::default()
            }),
            busy: AtomicBool::new(false),
            interrupted: AtomicBool::new(false),
            sigint_sent: AtomicBool::new(false),
            killed: AtomicBool::new(false),
            runs: AtomicU64::new(0),
        });
        let old = {
            let mut table = lock(&self.table);
            if !replace && table.contains_key(&id) {
                return Err(ErrorInfo::new(
                    ErrorCode::Exists,
                    format!("a context {id:?} exists"),
                ));
            }
            table.insert(id, ctx.clone())
        };
        if let Some(old) = old {
            Self::kill_context(&old);
        }
        Ok((ctx, started_cwd))
    }

    /// Kills a context's process (a run in progress sees it die) and drops it.
    fn kill_context(ctx: &Context) {
        if ctx.busy.load(Ordering::Acquire) {
            ctx.killed.store(true, Ordering::Release);
            sys::signal_group(ctx.pid.load(Ordering::Relaxed), libc::SIGKILL);
        }
        let mut slot = lock(&ctx.slot);
        slot.proc = None;
        slot.dead = Some("removed".into());
    }

    // ---- calls ----

    /// `context_create`.
    pub fn context_create(self: &Arc<Self>, req: &ContextCreateRequest, sink: &mut dyn Sink) {
        match self.create(req, false) {
            Ok((ctx, cwd)) => {
                sink.event(EventKind::Context(ctx.info(&cwd, None)));
                sink.event(EventKind::end(EndStatus::Ok));
            }
            Err(info) => sink.event(EventKind::Error(info)),
        }
    }

    /// `context_list`.
    pub fn context_list(&self, sink: &mut dyn Sink) {
        let contexts: Vec<Arc<Context>> = lock(&self.table).values().cloned().collect();
        let infos = contexts
            .iter()
            .map(|ctx| {
                let busy = ctx.busy.load(Ordering::Acquire);
                let cwd = if busy {
                    None
                } else {
                    ctx.slot
                        .try_lock()
                        .ok()
                        .and_then(|slot| slot.proc.as_ref().map(|p| p.cwd.clone()))
                };
                let cwd = cwd.or_else(|| ctx.cwd.clone()).unwrap_or_default();
                ctx.info(&cwd, Some(busy))
            })
            .collect();
        sink.event(EventKind::Contexts { contexts: infos });
        sink.event(EventKind::end(EndStatus::Ok));
    }

    /// `context_restart`.
    pub fn context_restart(&self, req: &ContextRef, sink: &mut dyn Sink) {
        let Some(ctx) = self.get(&req.context) else {
            sink.event(no_such_context(&req.context));
            return;
        };
        if ctx.busy.load(Ordering::Acquire) {
            ctx.killed.store(true, Ordering::Release);
            sys::signal_group(ctx.pid.load(Ordering::Relaxed), libc::SIGKILL);
        }
        let mut slot = lock(&ctx.slot);
        slot.proc = None;
        match self.start(ctx.lang, ctx.cwd.as_deref(), &ctx.env) {
            Ok(proc) => {
                let cwd = proc.cwd.clone();
                ctx.pid.store(proc.pid, Ordering::Relaxed);
                *slot = Slot {
                    proc: Some(proc),
                    ..Slot::default()
                };
                sink.event(EventKind::Context(ctx.info(&cwd, None)));
                sink.event(EventKind::end(EndStatus::Ok));
            }
            Err(e) => {
                slot.dead = Some(e.to_string());
                sink.event(EventKind::Error(e.into()));
            }
        }
    }

    /// `context_remove`.
    pub fn context_remove(&self, req: &ContextRef, sink: &mut dyn Sink) {
        let Some(ctx) = lock(&self.table).remove(&req.context) else {
            sink.event(no_such_context(&req.context));
            return;
        };
        Self::kill_context(&ctx);
        sink.event(EventKind::end(EndStatus::Ok));
    }

    /// `interrupt`: SIGINT to the running code; if the context does not come back within
    /// [`KILL_AFTER`], it is killed (the run reports it; the next call restarts it).
    pub fn interrupt(&self, req: &ContextRef, sink: &mut dyn Sink) {
        let Some(ctx) = self.get(&req.context) else {
            sink.event(no_such_context(&req.context));
            return;
        };
        if ctx.busy.load(Ordering::Acquire) {
            let run = ctx.runs.load(Ordering::Acquire);
            let pid = ctx.pid.load(Ordering::Relaxed);
            ctx.interrupted.store(true, Ordering::Release);
            if !ctx.sigint_sent.swap(true, Ordering::AcqRel) {
                sys::signal_group(pid, libc::SIGINT);
            }
            let deadline = Instant::now() + KILL_AFTER;
            let still_running =
                || ctx.busy.load(Ordering::Acquire) && ctx.runs.load(Ordering::Acquire) == run;
            while still_running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if still_running() {
                ctx.killed.store(true, Ordering::Release);
                sys::signal_group(pid, libc::SIGKILL);
            }
        }
        sink.event(EventKind::end(EndStatus::Ok));
    }

    /// `run_code`. Returns an error only when the connection is unusable (the host hung up).
    pub fn run_code(self: &Arc<Self>, req: &RunCodeRequest, sink: &mut dyn Sink) -> io::Result<()> {
        let ctx = match &req.context {
            Some(id) => match self.get(id) {
                Some(ctx) => ctx,
                None => {
                    sink.event(no_such_context(id));
                    return Ok(());
                }
            },
            None => {
                let lang = match Lang::parse(req.language.as_deref()) {
                    Ok(lang) => lang,
                    Err(info) => {
                        sink.event(EventKind::Error(info));
                        return Ok(());
                    }
                };
                let id = lang.default_context();
                match self.get(id) {
                    Some(ctx) => ctx,
                    None => {
                        let create = ContextCreateRequest {
                            language: lang.name().into(),
                            id: Some(id.into()),
                            ..ContextCreateRequest::default()
                        };
                        match self.create(&create, false) {
                            Ok((ctx, _)) => ctx,
                            // Created meanwhile by another call.
                            Err(info) if info.code == ErrorCode::Exists => match self.get(id) {
                                Some(ctx) => ctx,
                                None => {
                                    sink.event(EventKind::Error(info));
                                    return Ok(());
                                }
                            },
                            Err(info) => {
                                sink.event(EventKind::Error(info));
                                return Ok(());
                            }
                        }
                    }
                }
            }
        };
        if let Err(info) = check_env(ctx.lang, &req.env) {
            sink.event(EventKind::Error(info));
            return Ok(());
        }
        if req.code.contains('\0') && ctx.lang == Lang::Bash {
            sink.event(EventKind::Error(ErrorInfo::new(
                ErrorCode::BadRequest,
                "bash code contains a NUL byte",
            )));
            return Ok(());
        }

        let mut slot = lock(&ctx.slot);
        if slot.proc.is_none() {
            let reason = slot
                .dead
                .take()
                .unwrap_or_else(|| "the context had no process".into());
            match self.start(ctx.lang, ctx.cwd.as_deref(), &ctx.env) {
                Ok(proc) => {
                    ctx.pid.store(proc.pid, Ordering::Relaxed);
                    slot.proc = Some(proc);
                    slot.count = 0;
                    sink.event(EventKind::ContextRestarted { reason });
                }
                Err(e) => {
                    slot.dead = Some(reason);
                    sink.event(EventKind::Error(e.into()));
                    return Ok(());
                }
            }
        }
        ctx.runs.fetch_add(1, Ordering::AcqRel);
        ctx.interrupted.store(false, Ordering::Release);
        ctx.sigint_sent.store(false, Ordering::Release);
        ctx.killed.store(false, Ordering::Release);
        ctx.busy.store(true, Ordering::Release);
        let started = Instant::now();
        let deadline = req
            .timeout_ms
            .and_then(|ms| started.checked_add(Duration::from_millis(ms)));
        let mut run = Run {
            sink,
            cap: req.output_cap.unwrap_or(DEFAULT_OUTPUT_CAP),
            sent: 0,
            truncated: false,
            host_gone: false,
            timed_out: false,
            sigint_at: None,
            sigint_last: None,
            forward_results: true,
        };
        let outcome = match slot.proc.as_mut() {
            Some(p) => self.run_in(
                p,
                ctx.lang,
                &req.code,
                &req.env,
                req.silent,
                &mut run,
                deadline,
                Some(&ctx),
            ),
            None => Outcome::Died,
        };
        ctx.busy.store(false, Ordering::Release);
        let interrupted = ctx.interrupted.load(Ordering::Acquire) || run.host_gone;
        let killed = ctx.killed.load(Ordering::Acquire);
        let stopped = if run.timed_out {
            EndStatus::TimedOut
        } else {
            EndStatus::Interrupted
        };
        let keyboard = || {
            EventKind::Exception(Exception {
                name: "KeyboardInterrupt".into(),
                value: String::new(),
                traceback: Vec::new(),
            })
        };
        let (status, execution_count) = match outcome {
            Outcome::Python(status, n) => (
                match status.as_str() {
                    _ if run.timed_out => EndStatus::TimedOut,
                    "interrupted" => EndStatus::Interrupted,
                    "error" => EndStatus::Error,
                    _ => EndStatus::Ok,
                },
                n,
            ),
            Outcome::Bash(code) => {
                slot.count += 1;
                let n = Some(slot.count);
                if run.timed_out || (interrupted && code != 0) {
                    run.sink.event(keyboard());
                    (stopped, n)
                } else if code != 0 {
                    run.sink.event(EventKind::Exception(Exception {
                        name: "ExitStatus".into(),
                        value: format!("exit status {code}"),
                        traceback: Vec::new(),
                    }));
                    (EndStatus::Error, n)
                } else {
                    (EndStatus::Ok, n)
                }
            }
            Outcome::Killed => {
                slot.proc = None;
                slot.dead = Some(format!(
                    "the context was killed: it did not stop within {KILL_AFTER:?} of SIGINT"
                ));
                run.sink.event(EventKind::Exception(Exception {
                    name: "ContextKilled".into(),
                    value: format!("the code did not stop within {KILL_AFTER:?} of SIGINT; the context was killed and restarts on the next call"),
                    traceback: Vec::new(),
                }));
                (stopped, None)
            }
            Outcome::Died if killed && (interrupted || run.timed_out) => {
                slot.proc = None;
                slot.dead = Some("the context was killed after an interrupt".into());
                run.sink.event(EventKind::Exception(Exception {
                    name: "ContextKilled".into(),
                    value: format!("the code did not stop within {KILL_AFTER:?} of SIGINT; the context was killed and restarts on the next call"),
                    traceback: Vec::new(),
                }));
                (stopped, None)
            }
            Outcome::Died => {
                let status = slot
                    .proc
                    .as_mut()
                    .and_then(|p| p.reap_within(Duration::from_millis(500)));
                let value = match status {
                    Some(status) => status.to_string(),
                    None => "exited".into(),
                };
                slot.proc = None;
                slot.dead = Some(format!("the previous process {value}"));
                run.sink.event(EventKind::Exception(Exception {
                    name: "ContextDied".into(),
                    value,
                    traceback: Vec::new(),
                }));
                (EndStatus::ContextDied, None)
            }
        };
        let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        run.sink.event(EventKind::End {
            status,
            execution_count,
            duration_ms: Some(duration_ms),
        });
        if run.host_gone {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the host closed the connection during run_code",
            ));
        }
        Ok(())
    }

    /// Runs one cell in `proc` and pumps its output until it ends.
    #[allow(clippy::too_many_arguments)]
    fn run_in(
        &self,
        proc: &mut Proc,
        lang: Lang,
        code: &str,
        env: &BTreeMap<String, String>,
        silent: bool,
        run: &mut Run<'_>,
        deadline: Option<Instant>,
        ctx: Option<&Context>,
    ) -> Outcome {
        let sent = match lang {
            Lang::Python => {
                let gen = self.sync_gen.load(Ordering::Acquire);
                let reseed = proc.seeded_gen != gen;
                proc.seeded_gen = gen;
                let mut msg = json!({"op": "run", "code": code, "env": env, "reseed": reseed});
                if silent {
                    msg["silent"] = json!(true);
                }
                proc.send_json(&msg)
            }
            Lang::Javascript | Lang::Typescript | Lang::R | Lang::Java => {
                let gen = self.sync_gen.load(Ordering::Acquire);
                let reseed = proc.seeded_gen != gen;
                proc.seeded_gen = gen;
                let env_names: Vec<String> = env.keys().map(|k| format!("env.{k}")).collect();
                let mut fields = vec![
                    ("op", "run"),
                    ("code", code),
                    ("reseed", if reseed { "1" } else { "0" }),
                ];
                fields.extend(
                    env_names
                        .iter()
                        .map(String::as_str)
                        .zip(env.values().map(String::as_str)),
                );
                proc.send_fields(&fields)
            }
            Lang::Bash => {
                let mut cell = String::with_capacity(code.len() + 64);
                let mut restore = String::new();
                for (i, (k, v)) in env.iter().enumerate() {
                    cell.push_str(&format!(
                        "if [ -n \"${{{k}+x}}\" ]; then __ember_s{i}=1 __ember_v{i}=${k}; else __ember_s{i}=; fi; export {k}={}\n",
                        shell_quote(v)
                    ));
                    restore.push_str(&format!(
                        "if [ -n \"$__ember_s{i}\" ]; then {k}=$__ember_v{i}; else unset {k}; fi; unset __ember_s{i} __ember_v{i}\n"
                    ));
                }
                cell.push_str(code);
                cell.push('\n');
                let written = proc.write_cell(cell.as_bytes()).and_then(|()| {
                    if restore.is_empty() {
                        return Ok(());
                    }
                    let dir = proc.bash.as_ref().map(|b| b.dir.join("restore"));
                    match dir {
                        Some(path) => std::fs::write(path, restore),
                        None => Ok(()),
                    }
                });
                written.and_then(|()| {
                    sys::send_all(&proc.ctl, if env.is_empty() { b"\n" } else { b"e\n" })
                })
            }
        };
        if sent.is_err() {
            return Outcome::Died;
        }
        self.pump(proc, lang, run, deadline, ctx)
    }

    fn pump(
        &self,
        proc: &mut Proc,
        lang: Lang,
        run: &mut Run<'_>,
        deadline: Option<Instant>,
        ctx: Option<&Context>,
    ) -> Outcome {
        let mut buf = vec![0u8; MAX_CHUNK];
        let mut deadline = deadline;
        loop {
            let kill_at = run.sigint_at.map(|t| t + KILL_AFTER);
            // bash: a SIGINT that lands while bash is still in its `read` of the cell request
            // (a loaded host) is spent on that read, and the cell then runs until KILL_AFTER.
            // So a bash cell gets SIGINT again every BASH_SIGINT_AGAIN until it ends; one that
            // lands after the cell is harmless (the loop's `read` is retried, and the env
            // restore runs with SIGINT ignored).
            let again_at = match lang {
                Lang::Bash => run.sigint_last.map(|t| t + BASH_SIGINT_AGAIN),
                _ => None,
            };
            let wake = [deadline, kill_at, again_at].into_iter().flatten().min();
            let [ctl, out, err, pidfd] = proc.poll_fds();
            let peer = if run.host_gone {
                -1
            } else {
                run.sink.peer_fd().unwrap_or(-1)
            };
            let revents = match poll(
                &[
                    (ctl, libc::POLLIN),
                    (out, libc::POLLIN),
                    (err, libc::POLLIN),
                    (pidfd, libc::POLLIN),
                    (peer, libc::POLLRDHUP),
                ],
                wake,
            ) {
                Ok(r) => r,
                Err(_) => {
                    proc.kill();
                    return Outcome::Killed;
                }
            };
            let Some(revents) = revents else {
                let now = Instant::now();
                if kill_at.is_some_and(|k| now >= k) {
                    proc.kill();
                    self.drain(proc, run, &mut buf);
                    return Outcome::Killed;
                }
                if deadline.is_some_and(|d| now >= d) {
                    run.timed_out = true;
                    deadline = None;
                    run.sigint_once(proc.pid, ctx);
                } else if again_at.is_some_and(|a| now >= a) {
                    run.sigint_again(proc.pid);
                }
                continue;
            };
            for (i, &ready) in revents[1..3].iter().enumerate() {
                if ready != 0 {
                    proc.drain_pipe(i, &mut buf, |data| run.output(i == 0, data));
                }
            }
            if revents[4] & (libc::POLLHUP | libc::POLLERR | libc::POLLRDHUP) != 0 {
                run.host_gone = true;
                if let Some(ctx) = ctx {
                    ctx.interrupted.store(true, Ordering::Release);
                }
                run.sigint_once(proc.pid, ctx);
            }
            let mut outcome = None;
            if revents[0] != 0 {
                match lang {
                    Lang::Bash => match proc.read_status_lines() {
                        Ok(Some(codes)) => {
                            if let Some(&code) = codes.last() {
                                outcome = Some(Outcome::Bash(code));
                            }
                        }
                        Ok(None) | Err(_) => outcome = Some(Outcome::Died),
                    },
                    _ => match proc.read_driver() {
                        Ok(Some(events)) => {
                            for event in events {
                                // A display waits in the driver for an ack: output before it
                                // is in the pipes (drained first), none after it exists yet,
                                // so the two keep their order both ways.
                                let display = matches!(event, DriverEvent::Display { .. });
                                if display {
                                    for i in 0..2 {
                                        proc.drain_pipe(i, &mut buf, |data| {
                                            run.output(i == 0, data)
                                        });
                                    }
                                }
                                if let Some(o) = self.relay(run, event) {
                                    outcome = Some(o);
                                }
                                if display {
                                    // A driver that died meanwhile is seen at its EOF.
                                    let _ = if lang.embedded() {
                                        proc.send_fields(&[("op", "ack")])
                                    } else {
                                        proc.send_json(&json!({"op": "ack"}))
                                    };
                                }
                            }
                        }
                        Ok(None) | Err(_) => outcome = Some(Outcome::Died),
                    },
                }
            }
            if outcome.is_none() && revents[3] != 0 {
                outcome = Some(Outcome::Died);
            }
            if matches!(outcome, Some(Outcome::Died)) {
                self.drain(proc, run, &mut buf);
            } else if matches!(outcome, Some(Outcome::Bash(_))) {
                // bash wrote the status after the cell's commands ended: their output is in
                // the pipes already.
                for i in 0..2 {
                    proc.drain_pipe(i, &mut buf, |data| run.output(i == 0, data));
                }
            }
            if !run.host_gone && run.sink.flush().is_err() {
                run.host_gone = true;
                if let Some(ctx) = ctx {
                    ctx.interrupted.store(true, Ordering::Release);
                }
                run.sigint_once(proc.pid, ctx);
            }
            if let Some(outcome) = outcome {
                return outcome;
            }
        }
    }

    /// What is left in the pipes of a process that died (bounded in time: a background job
    /// may keep them open).
    fn drain(&self, proc: &mut Proc, run: &mut Run<'_>, buf: &mut [u8]) {
        let until = Instant::now() + crate::exec::DRAIN_LIMIT;
        while proc.pipes.iter().any(Option::is_some) && Instant::now() < until {
            let [_, out, err, _] = proc.poll_fds();
            let Ok(Some(revents)) = poll(&[(out, libc::POLLIN), (err, libc::POLLIN)], Some(until))
            else {
                return;
            };
            for (i, &ready) in revents.iter().enumerate() {
                if ready != 0 {
                    proc.drain_pipe(i, buf, |data| run.output(i == 0, data));
                }
            }
        }
    }

    /// Turns a driver message into events; returns the outcome at `end`.
    fn relay(&self, run: &mut Run<'_>, event: DriverEvent) -> Option<Outcome> {
        match event {
            DriverEvent::Result {
                data,
                execution_count,
            } if run.forward_results => {
                run.sink.event(EventKind::Result(ResultData {
                    data,
                    execution_count,
                }));
            }
            DriverEvent::Display { data, metadata } if run.forward_results => {
                if run.truncated {
                    return None;
                }
                let size = serde_json::to_vec(&data).map_or(0, |v| v.len()) as u64;
                if run.sent + size > run.cap {
                    run.truncate();
                    return None;
                }
                run.sent += size;
                run.sink.event(EventKind::Display(DisplayData {
                    data,
                    metadata: metadata.filter(|m| !m.is_empty()),
                }));
            }
            DriverEvent::Exception(exception) => run.sink.event(EventKind::Exception(exception)),
            DriverEvent::End {
                status,
                execution_count,
            } => return Some(Outcome::Python(status, execution_count)),
            _ => {}
        }
        None
    }

    /// `warmup`: start the zygote, run the warm-up code in it, create the listed contexts and
    /// the spares.
    pub fn warmup(self: &Arc<Self>, req: &WarmupRequest, sink: &mut dyn Sink) -> io::Result<()> {
        let mut want = [0usize; Lang::ALL.len()];
        for (name, n) in &req.spare {
            match Lang::parse(Some(name)) {
                Ok(lang) => want[lang.index()] = *n as usize,
                Err(info) => {
                    sink.event(EventKind::Error(info));
                    return Ok(());
                }
            }
        }
        for c in &req.contexts {
            if let Err(info) = Lang::parse(Some(&c.language)).and_then(|l| check_env(l, &c.env)) {
                sink.event(EventKind::Error(info));
                return Ok(());
            }
        }
        if let Err(info) = check_env(Lang::Python, &req.env) {
            sink.event(EventKind::Error(info));
            return Ok(());
        }
        // A new warm-up replaces the zygote and the spares.
        *lock(&self.zygote) = None;
        {
            let mut spares = lock(&self.spares);
            for pool in &mut spares.pools {
                pool.clear();
            }
        }
        lock(&self.base_env).extend(req.env.iter().map(|(k, v)| (k.clone(), v.clone())));

        let default_cwd = self.default_cwd();
        let mut zygote =
            match self.start_cold_python(default_cwd.as_deref(), &BTreeMap::new(), true) {
                Ok(z) => z,
                Err(e) => {
                    sink.event(EventKind::Error(e.into()));
                    return Ok(());
                }
            };
        let mut status = EndStatus::Ok;
        if !req.code.is_empty() {
            let mut run = Run {
                sink: &mut *sink,
                cap: u64::MAX,
                sent: 0,
                truncated: false,
                host_gone: false,
                timed_out: false,
                sigint_at: None,
                sigint_last: None,
                forward_results: false,
            };
            let outcome = self.run_in(
                &mut zygote,
                Lang::Python,
                &req.code,
                &BTreeMap::new(),
                false,
                &mut run,
                Some(Instant::now() + self.config.start_timeout),
                None,
            );
            if run.host_gone {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "the host closed the connection during warmup",
                ));
            }
            match outcome {
                Outcome::Python(s, _) if s == "ok" => {}
                Outcome::Python(..) => status = EndStatus::Error,
                _ => {
                    let reason = zygote
                        .reap_within(Duration::from_millis(500))
                        .map_or_else(|| "died".to_owned(), |s| s.to_string());
                    sink.event(EventKind::Error(ErrorInfo::new(
                        ErrorCode::ContextFailed,
                        format!("the zygote {reason} during the warm-up code"),
                    )));
                    return Ok(());
                }
            }
        }
        *lock(&self.zygote) = Some(zygote);

        for c in &req.contexts {
            if let Err(info) = self.create(c, true) {
                sink.event(EventKind::Error(info));
                return Ok(());
            }
        }
        lock(&self.spares).want = want;
        if let Err((lang, e)) = self.fill_spares() {
            sink.event(EventKind::Error(ErrorInfo::new(
                ErrorCode::ContextFailed,
                format!("a {} spare did not start: {e}", lang.name()),
            )));
            return Ok(());
        }
        // A template's snapshot follows the warm-up: write dirty pages out now, so that every
        // clone does not start by flushing the same pages to its own disk.
        // SAFETY: sync(2) takes no arguments and cannot fail.
        unsafe { libc::sync() };
        sink.event(EventKind::end(status));
        Ok(())
    }

    /// Python and bash spares ready now.
    pub fn spare_counts(&self) -> (usize, usize) {
        let spares = lock(&self.spares);
        (
            spares.pools[Lang::Python.index()].len(),
            spares.pools[Lang::Bash.index()].len(),
        )
    }

    /// Whether a zygote is running.
    pub fn has_zygote(&self) -> bool {
        lock(&self.zygote).is_some()
    }
}

fn no_such_context(id: &str) -> EventKind {
    EventKind::Error(ErrorInfo::new(
        ErrorCode::NoSuchContext,
        format!("no context {id:?}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Client, ClientError, RunEnd};
    use crate::exec::ExecEnv;
    use crate::protocol::{ContextCreateRequest, WarmupRequest};
    use crate::server::Server;
    use crate::system::System;
    use std::os::unix::net::UnixStream;
    use std::path::Path;

    const PYTHON: &str = "/usr/bin/python3";
    const NODE: &str = "/usr/bin/node";

    /// Whether Node.js is here (a test prerequisite: the E2B JS SDK's tests need it too).
    fn node_ready() -> bool {
        let ok = Path::new(NODE).exists();
        if !ok {
            let why = format!("{NODE} is missing: apt-get install -y nodejs");
            assert!(std::env::var("CI").as_deref() != Ok("true"), "{why}");
            eprintln!("skipping: {why}");
        }
        ok
    }

    #[test]
    fn a_spare_is_set_up_only_for_variables_it_lacks() {
        let m = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let base = m(&[("MPLCONFIGDIR", "/etc/ember/matplotlib"), ("HOME", "/root")]);
        assert!(new_vars(&base, &m(&[("MPLCONFIGDIR", "/etc/ember/matplotlib")])).is_empty());
        assert_eq!(
            new_vars(&base, &m(&[("HOME", "/home/user"), ("A", "1")])),
            m(&[("HOME", "/home/user"), ("A", "1")])
        );
        assert!(new_vars(&base, &BTreeMap::new()).is_empty());
    }

    #[test]
    fn javascript_keeps_state_awaits_and_reports_results_displays_and_errors() {
        if !node_ready() {
            return;
        }
        let agent = Agent::new();
        let mut c = agent.connect();
        let js = |code: &str| RunCodeRequest {
            language: Some("js".into()),
            ..RunCodeRequest::new(code)
        };
        let cell = run(
            &mut c,
            js("const a = 20; function f(x) { return x * 2 }; class K {}"),
        );
        assert_eq!(cell.status(), EndStatus::Ok, "{:?}", cell.events);
        let cell = run(&mut c, js("console.log('hi'); f(a) + 2"));
        assert_eq!(cell.stdout(), "hi\n");
        assert_eq!(cell.text(), Some("42"));
        let cell = run(
            &mut c,
            js("const v = await Promise.resolve({ k: [1, 2] }); v"),
        );
        assert_eq!(cell.text(), Some("{ k: [ 1, 2 ] }"), "{:?}", cell.events);
        let cell = run(
            &mut c,
            js("display.html('<b>x</b>'); console.log('after'); new K()"),
        );
        assert_eq!(cell.displays()[0].data["text/html"], "<b>x</b>");
        assert_eq!(cell.stdout(), "after\n");
        assert_eq!(cell.text(), Some("K {}"));
        let cell = run(&mut c, js("Promise.reject(new RangeError('nope'))"));
        assert_eq!(cell.status(), EndStatus::Error);
        let e = cell.exception().unwrap();
        assert_eq!((e.name.as_str(), e.value.as_str()), ("RangeError", "nope"));
        let cell = run(
            &mut c,
            RunCodeRequest {
                timeout_ms: Some(500),
                ..js("while (true) {}")
            },
        );
        assert_eq!(cell.status(), EndStatus::TimedOut, "{:?}", cell.events);
        assert_eq!(run(&mut c, js("a + 1")).text(), Some("21"));
        // Another context is another process.
        c.context_create(
            &ContextCreateRequest {
                language: "javascript".into(),
                id: Some("js2".into()),
                ..ContextCreateRequest::default()
            },
            Duration::from_secs(60),
        )
        .unwrap();
        let cell = run(&mut c, in_ctx("js2", "typeof a"));
        assert_eq!(cell.text(), Some("'undefined'"));
        // A language this guest lacks: refused with those it has.
        let err = c
            .context_create(
                &ContextCreateRequest {
                    language: "R".into(),
                    ..ContextCreateRequest::default()
                },
                Duration::from_secs(60),
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"r\" is not available") && err.contains("python, bash, javascript"),
            "{err}"
        );
        assert!(!err.contains("java\"") && !err.ends_with("java)"), "{err}");
    }

    /// Whether a JDK is here (the Java driver runs in the JDK's source launcher).
    fn java_ready() -> bool {
        let ok = std::process::Command::new("/usr/bin/javac")
            .arg("-version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            let why = "a JDK is missing: apt-get install -y openjdk-17-jdk-headless";
            assert!(std::env::var("CI").as_deref() != Ok("true"), "{why}");
            eprintln!("skipping: {why}");
        }
        ok
    }

    #[test]
    fn a_java_interrupt_while_jshell_compiles_stops_the_snippet_once_it_runs() {
        if !java_ready() {
            return;
        }
        let agent = Agent::with_java("/usr/bin/java");
        let mut c = agent.connect();
        let java = |code: &str| RunCodeRequest {
            language: Some("java".into()),
            ..RunCodeRequest::new(code)
        };
        let cell = run(&mut c, java("int kept = 41;"));
        assert_eq!(cell.status(), EndStatus::Ok, "{:?}", cell.events);
        // One snippet that takes jshell long to compile (thousands of statements), then spins:
        // the time limit's SIGINT lands during the compile, when `JShell::stop` has no
        // execution to stop yet.
        let mut code = String::from("{ long x = 0;\n");
        for i in 0..3000 {
            code += &format!("x += {i};\n");
        }
        code += "while (x != -1) { x++; Thread.onSpinWait(); } }";
        let t = Instant::now();
        let cell = run(
            &mut c,
            RunCodeRequest {
                timeout_ms: Some(200),
                ..java(&code)
            },
        );
        let took = t.elapsed();
        assert_eq!(cell.status(), EndStatus::TimedOut, "{:?}", cell.events);
        assert_eq!(cell.exception().unwrap().name, "KeyboardInterrupt");
        // Stopped by the interrupt, not by the kill KILL_AFTER it (which loses the state).
        assert!(took < KILL_AFTER, "the cell ended after {took:?}");
        assert_eq!(run(&mut c, java("kept + 1")).text(), Some("42"));
    }

    /// Whether Debian's python3 with IPython is here. Missing: a failure on CI, a skip with a
    /// reason elsewhere.
    fn python_ready() -> bool {
        let ok = std::process::Command::new(PYTHON)
            .args(["-c", "import IPython, matplotlib_inline"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            let why = format!(
                "{PYTHON} with IPython is missing: apt-get install -y python3-ipython \
                 python3-matplotlib python3-matplotlib-inline python3-pandas"
            );
            assert!(std::env::var("CI").as_deref() != Ok("true"), "{why}");
            eprintln!("skipping: {why}");
        }
        ok
    }

    #[derive(Debug)]
    struct NoSystem;

    impl System for NoSystem {
        fn uptime_ms(&self) -> u64 {
            1
        }
        fn boot_id(&self) -> Option<String> {
            None
        }
        fn wall_clock_ns(&self) -> i128 {
            0
        }
        fn set_wall_clock(&self, _: u64) -> io::Result<()> {
            Ok(())
        }
        fn add_entropy(&self, _: &[u8]) -> io::Result<()> {
            Ok(())
        }
    }

    struct Agent {
        server: Arc<Server>,
        _dir: tempfile::TempDir,
    }

    impl Agent {
        fn new() -> Self {
            Self::with_java("/nonexistent/java")
        }

        /// An agent whose java contexts use `java` (the others' lack it).
        fn with_java(java: &str) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let driver = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/ember_driver.py");
            let config = ContextConfig {
                python: PYTHON.into(),
                driver: driver.to_string_lossy().into_owned(),
                state_dir: dir.path().join("ctx"),
                start_timeout: Duration::from_secs(120),
                reset_sigpipe: true,
                node: NODE.into(),
                rscript: "/nonexistent/Rscript".into(),
                java: java.into(),
                drivers_dir: dir.path().join("drivers"),
                ..ContextConfig::default()
            };
            let server = Server::new(
                Box::new(NoSystem),
                Children::Direct,
                ExecEnv::new(None, true),
            )
            .with_context_config(config);
            Self {
                server: Arc::new(server),
                _dir: dir,
            }
        }

        fn connect(&self) -> Client<UnixStream> {
            let (host, guest) = UnixStream::pair().unwrap();
            let server = self.server.clone();
            std::thread::spawn(move || server.serve_connection(guest));
            Client::new(host)
        }
    }

    #[derive(Debug, Default)]
    struct Cell {
        events: Vec<(Instant, EventKind)>,
        end: Option<RunEnd>,
    }

    impl Cell {
        fn stdout(&self) -> String {
            self.bytes(true)
        }
        fn stderr(&self) -> String {
            self.bytes(false)
        }
        fn bytes(&self, out: bool) -> String {
            let mut all = Vec::new();
            for (_, e) in &self.events {
                match e {
                    EventKind::Stdout { data } if out => all.extend_from_slice(data),
                    EventKind::Stderr { data } if !out => all.extend_from_slice(data),
                    _ => {}
                }
            }
            String::from_utf8_lossy(&all).into_owned()
        }
        fn result(&self) -> Option<&serde_json::Map<String, serde_json::Value>> {
            self.events.iter().find_map(|(_, e)| match e {
                EventKind::Result(r) => Some(&r.data),
                _ => None,
            })
        }
        fn text(&self) -> Option<&str> {
            self.result()?.get("text/plain")?.as_str()
        }
        fn exception(&self) -> Option<&Exception> {
            self.events.iter().find_map(|(_, e)| match e {
                EventKind::Exception(x) => Some(x),
                _ => None,
            })
        }
        fn displays(&self) -> Vec<&DisplayData> {
            self.events
                .iter()
                .filter_map(|(_, e)| match e {
                    EventKind::Display(d) => Some(d),
                    _ => None,
                })
                .collect()
        }
        fn status(&self) -> EndStatus {
            self.end.map_or(EndStatus::Unknown, |e| e.status)
        }
    }

    fn run(client: &mut Client<UnixStream>, req: RunCodeRequest) -> Cell {
        let mut cell = Cell::default();
        let end = client
            .run_code(&req, Duration::from_secs(120), |e| {
                cell.events.push((Instant::now(), e));
                Ok(())
            })
            .unwrap();
        cell.end = Some(end);
        cell
    }

    fn py(client: &mut Client<UnixStream>, code: &str) -> Cell {
        run(client, RunCodeRequest::new(code))
    }

    fn in_ctx(context: &str, code: &str) -> RunCodeRequest {
        RunCodeRequest {
            context: Some(context.into()),
            ..RunCodeRequest::new(code)
        }
    }

    #[test]
    fn python_keeps_state_and_reports_results_displays_and_exceptions() {
        if !python_ready() {
            return;
        }
        let agent = Agent::new();
        let mut c = agent.connect();
        let cell = py(&mut c, "x = 40\nprint('hi')");
        assert_eq!(cell.status(), EndStatus::Ok, "{cell:?}");
        assert_eq!(cell.stdout(), "hi\n");
        assert_eq!(cell.end.unwrap().execution_count, Some(1));
        assert!(cell.end.unwrap().duration_ms.is_some());
        assert!(cell.result().is_none());

        let cell = py(&mut c, "x + 2");
        assert_eq!(cell.text(), Some("42"), "{cell:?}");
        assert_eq!(cell.end.unwrap().execution_count, Some(2));

        let cell = py(
            &mut c,
            "from IPython.display import display, HTML\ndisplay(HTML('<b>x</b>'))\nprint('after')",
        );
        let displays = cell.displays();
        assert_eq!(displays.len(), 1, "{cell:?}");
        assert_eq!(displays[0].data["text/html"], "<b>x</b>");
        // The display came before the print that followed it.
        let display_at = cell
            .events
            .iter()
            .position(|(_, e)| matches!(e, EventKind::Display(_)))
            .unwrap();
        let stdout_at = cell
            .events
            .iter()
            .position(|(_, e)| matches!(e, EventKind::Stdout { .. }))
            .unwrap();
        assert!(display_at < stdout_at, "{cell:?}");

        let cell = py(&mut c, "def f():\n    return 1 / 0\nf()");
        assert_eq!(cell.status(), EndStatus::Error);
        let x = cell.exception().unwrap();
        assert_eq!(x.name, "ZeroDivisionError");
        assert_eq!(x.value, "division by zero");
        assert!(x.traceback.join("").contains("return 1 / 0"), "{x:?}");

        // Magics and shell escapes; per-call env is set for the call only.
        let cell = py(&mut c, "!echo bang\n%cd /tmp");
        assert!(cell.stdout().contains("bang\n"), "{cell:?}");
        let mut req = RunCodeRequest::new("import os; os.environ['EMBER_T'] + os.getcwd()");
        req.env.insert("EMBER_T".into(), "v".into());
        assert_eq!(run(&mut c, req).text(), Some("'v/tmp'"));
        let cell = py(&mut c, "'EMBER_T' in os.environ");
        assert_eq!(cell.text(), Some("False"));
        let cell = py(&mut c, "def broken(:");
        assert_eq!(cell.exception().unwrap().name, "SyntaxError");
        assert_eq!(cell.status(), EndStatus::Error);
    }

    #[test]
    fn pandas_tables_and_figures_come_as_mime_bundles() {
        if !python_ready() {
            return;
        }
        let agent = Agent::new();
        let mut c = agent.connect();
        let cell = py(
            &mut c,
            "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2, 3], 'b': [4, 5, 7]})\ndf.describe()",
        );
        let result = cell.result().expect("a result");
        assert!(
            result["text/html"].as_str().unwrap().contains("<table"),
            "{result:?}"
        );
        assert!(result["text/plain"].as_str().unwrap().contains("mean"));

        let cell = py(&mut c, "df.plot()");
        assert_eq!(cell.status(), EndStatus::Ok, "{cell:?}");
        let displays = cell.displays();
        assert_eq!(displays.len(), 1, "{cell:?}");
        let png = displays[0].data["image/png"].as_str().unwrap();
        let png = crate::base64::decode(png.as_bytes()).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // The figure was closed: the next cell shows nothing.
        let cell = py(&mut c, "1");
        assert!(cell.displays().is_empty());
    }

    #[test]
    fn timeouts_interrupt_and_keep_the_context() {
        if !python_ready() {
            return;
        }
        let agent = Agent::new();
        let mut c = agent.connect();
        py(&mut c, "before = 1");
        let t = Instant::now();
        let mut req = RunCodeRequest::new("while True: pass");
        req.timeout_ms = Some(2000);
        let cell = run(&mut c, req);
        assert_eq!(cell.status(), EndStatus::TimedOut, "{cell:?}");
        assert_eq!(cell.exception().unwrap().name, "KeyboardInterrupt");
        assert!(t.elapsed() >= Duration::from_secs(2));
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
        assert_eq!(py(&mut c, "before + 1").text(), Some("2"));
    }

    #[test]
    fn a_dead_context_is_reported_and_restarted() {
        if !python_ready() {
            return;
        }
        let agent = Agent::new();
        let mut c = agent.connect();
        py(&mut c, "gone = 1");
        let cell = py(&mut c, "import os; print('bye', flush=True); os._exit(3)");
        assert_eq!(cell.status(), EndStatus::ContextDied, "{cell:?}");
        assert_eq!(cell.stdout(), "bye\n");
        let x = cell.exception().unwrap();
        assert_eq!(x.name, "ContextDied");
        assert_eq!(x.value, "exited with status 3");
        let cell = py(&mut c, "'gone' in globals()");
        assert!(
            matches!(
                cell.events.first(),
                Some((_, EventKind::ContextRestarted { .. }))
            ),
            "{cell:?}"
        );
        assert_eq!(cell.text(), Some("False"));
        assert_eq!(cell.end.unwrap().execution_count, Some(1));
    }

    #[test]
    fn output_streams_before_the_end_and_is_capped() {
        if !python_ready() {
            return;
        }
        let agent = Agent::new();
        let mut c = agent.connect();
        let cell = py(
            &mut c,
            "import time\nfor i in range(3):\n    print(i)\n    time.sleep(0.5)",
        );
        assert_eq!(cell.stdout(), "0\n1\n2\n");
        let first = cell.events.first().unwrap().0;
        let last = cell.events.last().unwrap().0;
        assert!(
            last - first >= Duration::from_millis(900),
            "{:?}",
            last - first
        );

        let mut req =
            RunCodeRequest::new("import sys\nprint('x' * 100000)\nsys.stderr.write('e' * 10)");
        req.output_cap = Some(1000);
        let cell = run(&mut c, req);
        assert_eq!(cell.stdout().len() + cell.stderr().len(), 1000, "{cell:?}");
        let truncated = cell
            .events
            .iter()
            .filter(|(_, e)| matches!(e, EventKind::Truncated { limit: 1000 }))
            .count();
        assert_eq!(truncated, 1);
        assert_eq!(cell.status(), EndStatus::Ok);
    }

    #[test]
    fn bash_keeps_cwd_and_variables_and_stops_loops() {
        let agent = Agent::new();
        let mut c = agent.connect();
        let bash = |code: &str| RunCodeRequest {
            language: Some("bash".into()),
            ..RunCodeRequest::new(code)
        };
        let cell = run(&mut c, bash("cd /tmp; X=41; f() { echo \"f$1\"; }"));
        assert_eq!(cell.status(), EndStatus::Ok, "{cell:?}");
        let cell = run(&mut c, bash("pwd; echo $((X + 1)); f 2; echo err >&2"));
        assert_eq!(cell.stdout(), "/tmp\n42\nf2\n");
        assert_eq!(cell.stderr(), "err\n");
        assert_eq!(cell.end.unwrap().execution_count, Some(2));

        let cell = run(&mut c, bash("false"));
        assert_eq!(cell.status(), EndStatus::Error);
        assert_eq!(cell.exception().unwrap().value, "exit status 1");

        let mut env = bash("echo $EMBER_V");
        env.env.insert("EMBER_V".into(), "it's".into());
        assert_eq!(run(&mut c, env).stdout(), "it's\n");
        assert_eq!(
            run(&mut c, bash("echo \"[${EMBER_V-unset}]\"")).stdout(),
            "[unset]\n"
        );

        for code in ["while true; do :; done", "sleep 30; echo no"] {
            let mut req = bash(code);
            req.timeout_ms = Some(500);
            let t = Instant::now();
            let cell = run(&mut c, req);
            assert_eq!(cell.status(), EndStatus::TimedOut, "{code}: {cell:?}");
            assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
            assert_eq!(cell.stdout(), "");
        }
        assert_eq!(run(&mut c, bash("echo $X")).stdout(), "41\n");

        let cell = run(&mut c, bash("exit 4"));
        assert_eq!(cell.status(), EndStatus::ContextDied);
        assert_eq!(cell.exception().unwrap().value, "exited with status 4");
        let cell = run(&mut c, bash("echo \"[$X]\""));
        assert!(matches!(
            cell.events.first(),
            Some((_, EventKind::ContextRestarted { .. }))
        ));
        assert_eq!(cell.stdout(), "[]\n");
    }

    #[test]
    fn unknown_contexts_and_ids_are_errors_and_the_connection_goes_on() {
        let agent = Agent::new();
        let mut c = agent.connect();
        let err = c
            .run_code(&in_ctx("nope", "1"), Duration::from_secs(5), |_| Ok(()))
            .unwrap_err();
        assert!(err.is_remote(ErrorCode::NoSuchContext), "{err}");
        assert!(c
            .interrupt("nope")
            .unwrap_err()
            .is_remote(ErrorCode::NoSuchContext));
        assert!(c
            .context_remove("nope")
            .unwrap_err()
            .is_remote(ErrorCode::NoSuchContext));
        let bad = ContextCreateRequest {
            id: Some("a/b".into()),
            ..ContextCreateRequest::default()
        };
        let err = c.context_create(&bad, Duration::from_secs(5)).unwrap_err();
        assert!(err.is_remote(ErrorCode::BadRequest), "{err}");
        let bad = ContextCreateRequest {
            language: "cobol".into(),
            ..ContextCreateRequest::default()
        };
        let err = c.context_create(&bad, Duration::from_secs(5)).unwrap_err();
        assert!(err.is_remote(ErrorCode::BadRequest), "{err}");

        let sh = ContextCreateRequest {
            language: "bash".into(),
            id: Some("sh".into()),
            cwd: Some("/".into()),
            ..ContextCreateRequest::default()
        };
        let info = c.context_create(&sh, Duration::from_secs(5)).unwrap();
        assert_eq!(
            (info.id.as_str(), info.language.as_str(), info.cwd.as_str()),
            ("sh", "bash", "/")
        );
        let err = c.context_create(&sh, Duration::from_secs(5)).unwrap_err();
        assert!(err.is_remote(ErrorCode::Exists), "{err}");
        let list = c.context_list().unwrap();
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].busy, Some(false));
        let restarted = c.context_restart("sh", Duration::from_secs(5)).unwrap();
        assert_ne!(restarted.pid, info.pid);
        c.context_remove("sh").unwrap();
        assert!(c.context_list().unwrap().is_empty());
        c.ping().unwrap();
    }

    #[test]
    fn interrupt_from_another_connection() {
        if !python_ready() {
            return;
        }
        let agent = Agent::new();
        let mut c = agent.connect();
        let info = c
            .context_create(
                &ContextCreateRequest {
                    id: Some("i".into()),
                    ..ContextCreateRequest::default()
                },
                Duration::from_secs(120),
            )
            .unwrap();
        assert!(info.pid > 0);
        let mut other = agent.connect();
        let runner = std::thread::spawn(move || {
            let cell = run(&mut c, in_ctx("i", "import time\ntime.sleep(30)"));
            (cell, c)
        });
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(other.context_list().unwrap()[0].busy, Some(true));
        other.interrupt("i").unwrap();
        let (cell, mut c) = runner.join().unwrap();
        assert_eq!(cell.status(), EndStatus::Interrupted, "{cell:?}");
        assert_eq!(cell.exception().unwrap().name, "KeyboardInterrupt");
        assert_eq!(run(&mut c, in_ctx("i", "2")).text(), Some("2"));
        // Idle: nothing happens.
        other.interrupt("i").unwrap();
        assert_eq!(run(&mut c, in_ctx("i", "3")).text(), Some("3"));
    }

    #[test]
    fn warmup_forks_contexts_from_the_zygote_and_hands_out_spares() {
        if !python_ready() {
            return;
        }
        let agent = Agent::new();
        let mut c = agent.connect();
        let req = WarmupRequest {
            code: "import json\nWARM = 7\nprint('warming')".into(),
            contexts: vec![ContextCreateRequest {
                id: Some("default".into()),
                ..ContextCreateRequest::default()
            }],
            spare: [("python".to_string(), 1), ("bash".to_string(), 1)].into(),
            env: BTreeMap::new(),
        };
        let mut out = Vec::new();
        let status = c
            .warmup(&req, Duration::from_secs(120), |e| {
                if let EventKind::Stdout { data } = e {
                    out.extend(data);
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(status, EndStatus::Ok);
        assert_eq!(out, b"warming\n");
        let contexts = agent.server.contexts();
        assert!(contexts.has_zygote());
        assert_eq!(contexts.spare_counts(), (1, 1));

        // The default context was forked: it has the warm-up's namespace, counts from 1.
        let cell = py(&mut c, "WARM + 1");
        assert_eq!(cell.text(), Some("8"), "{cell:?}");
        assert_eq!(cell.end.unwrap().execution_count, Some(1));

        // A spare is handed out at once, with its cwd applied.
        let t = Instant::now();
        let info = c
            .context_create(
                &ContextCreateRequest {
                    cwd: Some("/tmp".into()),
                    ..ContextCreateRequest::default()
                },
                Duration::from_secs(60),
            )
            .unwrap();
        let took = t.elapsed();
        assert_eq!(info.cwd, "/tmp");
        assert!(took < Duration::from_secs(2), "{took:?}");
        let cell = run(&mut c, in_ctx(&info.id, "import os; os.getcwd(), WARM"));
        assert_eq!(cell.text(), Some("('/tmp', 7)"));
        // The spare pool refills in the background (from the zygote).
        let deadline = Instant::now() + Duration::from_secs(30);
        while contexts.spare_counts().0 < 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(contexts.spare_counts().0, 1);
        let bash = c
            .context_create(
                &ContextCreateRequest {
                    language: "bash".into(),
                    ..ContextCreateRequest::default()
                },
                Duration::from_secs(60),
            )
            .unwrap();
        let cell = run(&mut c, in_ctx(&bash.id, "echo ok"));
        assert_eq!(cell.stdout(), "ok\n");

        // A forked context that dies is detected by EOF (it is not our child here).
        let cell = run(&mut c, in_ctx(&info.id, "import os; os._exit(0)"));
        assert_eq!(cell.status(), EndStatus::ContextDied, "{cell:?}");
        let cell = run(&mut c, in_ctx(&info.id, "os.getcwd()"));
        assert!(matches!(
            cell.events.first(),
            Some((_, EventKind::ContextRestarted { .. }))
        ));
        assert_eq!(cell.exception().map(|x| x.name.as_str()), Some("NameError"));
        let cell = run(&mut c, in_ctx(&info.id, "import os; os.getcwd()"));
        assert_eq!(cell.text(), Some("'/tmp'"));
        let _ = ClientError::Closed;
    }
}
