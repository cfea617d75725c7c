//! `ember bench api`: the sandbox runtime and its HTTP server, end to end, as an SDK user
//! meets them.
//!
//! It starts the server of `ember serve` in-process on a free loopback port, over a runtime
//! whose `$EMBER_HOME` is a temporary directory (or, with `--url`, uses a running server),
//! and drives it with the blocking HTTP client ([`Client`]):
//!
//! 1. **create → first result**, per template: `POST /v1/sandboxes`, then
//!    `POST /v1/sandboxes/{id}/code` with `1+1` until its `result` line. Run by run beside it,
//!    without the runtime: the bare restore → agent ping of the same snapshot (spawn
//!    `ember-vmm --restore`, connect, `ping`: no jail, no store, no HTTP) and the library's
//!    unjailed [`Sandbox::create`] (spawn → synced). Goal: create → first result within 2× bare
//!    restore → ping.
//! 2. **`run_code` round trip** of `1` on a warm sandbox through the API, alternating call by
//!    call with the same call on the library [`Runtime::run_code`] in-process; their paired
//!    difference is the server's overhead per call (goal: under 1 ms).
//! 3. **creates per second** with 1, 4 and 16 concurrent clients, each creating and killing
//!    sandboxes in a loop.
//! 4. **host memory per idle sandbox**: K idle sandboxes, then the PSS and RSS of their VMM
//!    processes from `/proc/PID/smaps`, split into the guest-memory mapping (the snapshot's
//!    `memory` file, mapped private: clones share its page cache) and the rest (the VMM's own
//!    overhead).
//!
//! Every sandbox it creates is killed at the end, also after an error or a first Ctrl-C (a
//! second Ctrl-C exits at once); the temporary home is removed.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use ember_agent::protocol::{EndStatus, EventKind, RunCodeRequest};
use ember_benches::stats::{summarize, Summary};
use ember_runtime::template::{Template, TemplateError, AGENT_PORT};
use ember_runtime::{CreateRequest, SandboxInfo};
use ember_runtime::{Runtime, RuntimeConfig, RuntimeError, Sandbox, SandboxError, SandboxOptions};
use ember_server::client::{segment, Client, ClientError};
use ember_server::{load_or_create_token, Backend, ServeOptions, Server};
use serde_json::{json, Value};

use crate::fail;

/// `ember bench api`.
#[derive(Debug, Args)]
pub struct BenchApiArgs {
    /// Templates to measure (repeatable). The first one is also used for the creation rate
    /// and the idle memory.
    #[arg(short, long, default_values_t = vec!["default".to_string(), "python-data".to_string()])]
    pub template: Vec<String>,
    /// Runs of each latency measure.
    #[arg(short, long, default_value_t = 20)]
    pub n: usize,
    /// Warm-up runs, discarded.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Round trips (API and library pairs) on a warm sandbox, per template.
    #[arg(long, default_value_t = 50)]
    pub calls: usize,
    /// Concurrent clients of the creation rate (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 4, 16])]
    pub clients: Vec<usize>,
    /// Creates (each followed by its kill) at each concurrency level, split evenly across
    /// the clients (at least one each).
    #[arg(long, default_value_t = 32)]
    pub creates: usize,
    /// Idle sandboxes whose host memory is measured (0: skip).
    #[arg(long, default_value_t = 10)]
    pub idle: usize,
    /// Seconds the idle sandboxes sit before they are measured.
    #[arg(long, default_value_t = 5)]
    pub settle: u64,
    /// Use the server at this URL instead of one started in-process (no library comparison
    /// then; memory only when its VMMs are on this host).
    #[arg(long)]
    pub url: Option<String>,
    /// The bearer token of `--url` (default `EMBER_TOKEN`, or `$EMBER_HOME/token`).
    #[arg(long, requires = "url")]
    pub token: Option<String>,
    /// JSON lines only.
    #[arg(long)]
    pub json: bool,
}

/// What stopped the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchApiError {
    /// An API call failed.
    #[error("{what}: {source}")]
    Api {
        /// The call.
        what: String,
        /// Why.
        source: ClientError,
    },
    /// A call on the in-process runtime failed.
    #[error("{what}: {source}")]
    Runtime {
        /// The call.
        what: String,
        /// Why.
        source: RuntimeError,
    },
    /// A sandbox of the library (no runtime) failed.
    #[error("{what}: {source}")]
    Sandbox {
        /// What was done.
        what: String,
        /// Why.
        source: SandboxError,
    },
    /// A template could not be opened or built.
    #[error("template {name}: {source}")]
    Template {
        /// The template.
        name: String,
        /// Why.
        source: TemplateError,
    },
    /// A local file or process failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was done.
        what: &'static str,
        /// On what.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The in-process server could not start or failed.
    #[error("in-process server: {0}")]
    Server(String),
    /// An answer was not the one expected.
    #[error("{0}")]
    Unexpected(String),
    /// Ctrl-C.
    #[error("interrupted")]
    Interrupted,
}

pub(crate) type Result<T, E = BenchApiError> = std::result::Result<T, E>;

fn api_err(what: impl Into<String>) -> impl FnOnce(ClientError) -> BenchApiError {
    let what = what.into();
    move |source| BenchApiError::Api { what, source }
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> BenchApiError {
    let path = path.to_path_buf();
    move |source| BenchApiError::Io { what, path, source }
}

pub(crate) fn ms_since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
}

// ----- Ctrl-C -----

pub(crate) static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    if INTERRUPTED.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(130) };
    }
}

/// A first SIGINT sets [`INTERRUPTED`] (the bench stops at its next step and cleans up); a
/// second one exits at once.
pub(crate) fn catch_sigint() {
    let handler: extern "C" fn(libc::c_int) = on_sigint;
    // SAFETY: the handler only swaps an atomic and calls _exit, both async-signal-safe.
    unsafe { libc::signal(libc::SIGINT, handler as libc::sighandler_t) };
}

pub(crate) fn check_interrupt() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        Err(BenchApiError::Interrupted)
    } else {
        Ok(())
    }
}

pub(crate) fn sleep_interruptibly(d: Duration) -> Result<()> {
    let t0 = Instant::now();
    while t0.elapsed() < d {
        check_interrupt()?;
        std::thread::sleep(Duration::from_millis(50).min(d.saturating_sub(t0.elapsed())));
    }
    Ok(())
}

// ----- the server -----

/// The server started in-process: its runtime, its thread and its temporary home.
#[derive(Debug)]
pub(crate) struct Local {
    pub(crate) rt: Option<Runtime>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
    pub(crate) home: Option<tempfile::TempDir>,
}

impl Local {
    /// Opens a runtime on a temporary home and serves it on a free loopback port; returns
    /// the server's address and token.
    pub(crate) fn start() -> Result<(Local, SocketAddr, String)> {
        Self::start_with(ember_runtime::pool::PoolSettings::default())
    }

    /// [`Local::start`] with a warm pool of `pool` (`ember bench pool`).
    pub(crate) fn start_with(
        pool: ember_runtime::pool::PoolSettings,
    ) -> Result<(Local, SocketAddr, String)> {
        Self::start_tuned(move |cfg| cfg.pool = pool)
    }

    /// [`Local::start`] with the runtime's settings adjusted by `adjust` first.
    pub(crate) fn start_tuned(
        adjust: impl FnOnce(&mut RuntimeConfig),
    ) -> Result<(Local, SocketAddr, String)> {
        let tmp = std::env::temp_dir();
        let home = tempfile::Builder::new()
            .prefix("ember-bench-api-")
            .tempdir_in(&tmp)
            .map_err(io_err("cannot create a temporary home in", &tmp))?;
        let mut cfg = RuntimeConfig::new(home.path());
        // Whatever is left when the runtime goes away is killed.
        cfg.kill_on_drop = true;
        adjust(&mut cfg);
        let token_file = home.path().join("token");
        let mut local = Local {
            rt: None,
            stop: None,
            thread: None,
            home: Some(home),
        };
        let rt = Runtime::open(cfg).map_err(|source| BenchApiError::Runtime {
            what: "cannot open the runtime".into(),
            source,
        })?;
        local.rt = Some(rt.clone());
        let token =
            load_or_create_token(&token_file).map_err(|e| BenchApiError::Server(e.to_string()))?;
        let opts = ServeOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            token_file,
            shutdown_grace: Duration::from_secs(2),
            ..Default::default()
        };
        let backend: Arc<dyn Backend> = Arc::new(rt);
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        local.stop = Some(stop_tx);
        let thread = std::thread::Builder::new()
            .name("bench-api-server".into())
            .spawn(move || {
                let tokio = tokio::runtime::Builder::new_multi_thread()
                    .enable_all()
                    .thread_name("ember-serve")
                    .build()
                    .map_err(|e| format!("cannot start the async runtime: {e}"))?;
                let r = tokio.block_on(async move {
                    let server = match Server::bind(opts).await {
                        Ok(s) => s,
                        Err(e) => return Err(e.to_string()),
                    };
                    let _ = addr_tx.send(server.local_addr());
                    server
                        .run_until(backend, async {
                            let _ = stop_rx.await;
                        })
                        .await
                        .map_err(|e| e.to_string())
                });
                tokio.shutdown_timeout(Duration::from_secs(5));
                r
            })
            .map_err(|e| BenchApiError::Server(format!("cannot start its thread: {e}")))?;
        local.thread = Some(thread);
        match addr_rx.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => Ok((local, addr, token)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                // The thread ended without binding: its error says why.
                let why = match local.thread.take().map(|t| t.join()) {
                    Some(Ok(Err(e))) => e,
                    _ => "the server thread ended without serving".into(),
                };
                Err(BenchApiError::Server(why))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                Err(BenchApiError::Server("not listening after 30 s".into()))
            }
        }
    }

    /// Stops the server, drops the runtime (killing what is left) and removes the home.
    pub(crate) fn shut_down(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            match t.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => problems.push(format!("the server stopped with an error: {e}")),
                Err(_) => problems.push("the server thread panicked".into()),
            }
        }
        // The last handle: the runtime kills its remaining sandboxes and removes its cgroups.
        self.rt = None;
        if let Some(home) = self.home.take() {
            let path = home.path().to_path_buf();
            if let Err(e) = home.close() {
                problems.push(format!(
                    "cannot remove the temporary home {}: {e}",
                    path.display()
                ));
            }
        }
        problems
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        for p in self.shut_down() {
            eprintln!("ember: warning: {p}");
        }
    }
}

/// Ids of the sandboxes this bench created and has not killed yet.
#[derive(Debug, Default)]
pub(crate) struct Tracker(Mutex<BTreeSet<String>>);

impl Tracker {
    pub(crate) fn ids(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The server under test and how to reach it.
#[derive(Debug)]
pub(crate) struct Target {
    pub(crate) client: Client,
    /// The in-process runtime (for the library comparison), when the server is ours.
    pub(crate) local: Option<Local>,
    pub(crate) tracker: Tracker,
}

impl Target {
    /// A server of our own ([`Local::start_with`] `pool`) as a target, with its runtime.
    pub(crate) fn start_local(
        pool: ember_runtime::pool::PoolSettings,
    ) -> Result<(Target, Runtime)> {
        let (local, addr, token) = Local::start_with(pool)?;
        let rt = local
            .rt
            .clone()
            .ok_or_else(|| BenchApiError::Server("started without a runtime".into()))?;
        let target = Target {
            client: Client::new(&format!("http://{addr}"), Some(token)),
            local: Some(local),
            tracker: Tracker::default(),
        };
        Ok((target, rt))
    }

    fn runtime(&self) -> Option<&Runtime> {
        self.local.as_ref().and_then(|l| l.rt.as_ref())
    }

    /// Creates a sandbox of `template` through the API.
    pub(crate) fn create(&self, template: &str) -> Result<SandboxInfo> {
        check_interrupt()?;
        let req = CreateRequest {
            template: Some(template.to_string()),
            // Longer than the whole bench; the end kills them anyway.
            timeout_secs: Some(1800),
            metadata: [("created_by".to_string(), "ember bench api".to_string())].into(),
            ..Default::default()
        };
        let info = self
            .client
            .create(&req)
            .map_err(api_err(format!("create a sandbox of {template}")))?;
        self.tracker.ids().insert(info.id.clone());
        Ok(info)
    }

    /// Kills a sandbox through the API.
    pub(crate) fn kill(&self, id: &str) -> Result<()> {
        self.client
            .kill(id)
            .map_err(api_err(format!("kill sandbox {id}")))?;
        self.tracker.ids().remove(id);
        Ok(())
    }

    /// Kills every sandbox still tracked; returns what failed.
    pub(crate) fn kill_all(&self) -> Vec<String> {
        let ids: Vec<String> = self.tracker.ids().iter().cloned().collect();
        ids.iter()
            .filter_map(|id| self.kill(id).err().map(|e| e.to_string()))
            .collect()
    }
}

// ----- the measures -----

/// Kills a child process when dropped.
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawn `ember-vmm --restore` of the template's snapshot → agent `ping` answered, ms.
pub(crate) fn bare_restore_ping(t: &Template, vmm: &Path) -> Result<f64> {
    let tmp = std::env::temp_dir();
    let dir = tempfile::Builder::new()
        .prefix("ember-bench-bare-")
        .tempdir_in(&tmp)
        .map_err(io_err("cannot create a directory in", &tmp))?;
    let uds = dir.path().join("vsock");
    // A networked template's TAP, in an isolated namespace made before the clock starts.
    let netns = ember_vmm::netns::for_snapshot(&t.snapshot_dir())
        .map_err(|m| BenchApiError::Unexpected(format!("bare restore: {m}")))?;
    let mut command = Command::new(vmm);
    if let Some(ns) = &netns {
        ns.enter_on_exec(&mut command)
            .map_err(|e| BenchApiError::Unexpected(format!("bare restore: {e}")))?;
    }
    let t0 = Instant::now();
    let mut child = Reaper(
        command
            .arg("--restore")
            .arg(t.snapshot_dir())
            .arg("--vsock-uds")
            .arg(&uds)
            .arg("--disk-path")
            .arg(dir.path().join("root.overlay"))
            .args(["--serial", "none"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(io_err("cannot start", vmm))?,
    );
    let limit = Duration::from_secs(60);
    let failed = |m: String| BenchApiError::Unexpected(format!("bare restore: {m}"));
    while !uds.exists() {
        if let Ok(Some(st)) = child.0.try_wait() {
            return Err(failed(format!("the VMM exited ({st})")));
        }
        if t0.elapsed() > limit {
            return Err(failed("no vsock socket after 60 s".into()));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    // Refused until the VMM's listen() follows the bind() that made the file.
    let mut c = loop {
        match ember_agent::client::Client::connect_uds(&uds, AGENT_PORT, limit) {
            Ok(c) => break c,
            Err(ember_agent::client::ClientError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::ConnectionRefused
                    && t0.elapsed() < limit =>
            {
                std::thread::sleep(Duration::from_micros(200));
            }
            Err(e) => return Err(failed(e.to_string())),
        }
    };
    c.ping().map_err(|e| failed(e.to_string()))?;
    Ok(ms_since(t0))
}

/// The library's unjailed [`Sandbox::create`]: spawn → guest synced, ms.
fn library_restore(t: &Template, vmm: &Path) -> Result<f64> {
    let tmp = std::env::temp_dir();
    let dir = tempfile::Builder::new()
        .prefix("ember-bench-lib-")
        .tempdir_in(&tmp)
        .map_err(io_err("cannot create a directory in", &tmp))?;
    let opts = SandboxOptions {
        workdir: Some(dir.path().join("sandbox")),
        vmm: Some(vmm.to_path_buf()),
        die_with_parent: true,
        ..Default::default()
    };
    let sb = Sandbox::create(t, &opts).map_err(|source| BenchApiError::Sandbox {
        what: format!("restore {} without the runtime", t.info.name),
        source,
    })?;
    let synced = sb.timings().synced_ms;
    let _ = sb.kill();
    Ok(synced)
}

fn code_path(id: &str) -> String {
    format!("/v1/sandboxes/{}/code", segment(id))
}

/// `POST /code` with `code`; returns (ms until the `result` line, its `text/plain`).
/// Checks that the call ended `ok`.
pub(crate) fn api_run(c: &Client, id: &str, code: &str, t0: Instant) -> Result<(f64, String)> {
    let mut result = None;
    let last = c
        .stream(&code_path(id), &json!({ "code": code }), &mut |v| {
            if v["type"] == "result" && result.is_none() {
                let text = v["data"]["text/plain"].as_str().unwrap_or("").to_string();
                result = Some((ms_since(t0), text));
            }
            true
        })
        .map_err(api_err(format!("run_code {code:?} in {id}")))?;
    match (&last, result) {
        (Some(v), Some(r)) if v["type"] == "end" && v["status"] == "ok" => Ok(r),
        (_, r) => Err(BenchApiError::Unexpected(format!(
            "run_code {code:?} in {id}: result {:?}, last line {}",
            r.map(|r| r.1),
            last.unwrap_or(Value::Null)
        ))),
    }
}

/// One API sandbox: (create answered, runtime's jailed spawn → synced, create → first `1+1`
/// result), ms. The sandbox is killed before returning.
pub(crate) fn api_first_result(target: &Target, template: &str) -> Result<[f64; 3]> {
    let t0 = Instant::now();
    let info = target.create(template)?;
    let created = ms_since(t0);
    let run = api_run(&target.client, &info.id, "1+1", t0);
    let killed = target.kill(&info.id);
    let (first, text) = run?;
    killed?;
    if text != "2" {
        return Err(BenchApiError::Unexpected(format!("1+1 gave {text:?}")));
    }
    Ok([created, info.start_ms.unwrap_or(f64::NAN), first])
}

/// `run_code("1")` on the library runtime in-process, ms.
fn library_run(rt: &Runtime, id: &str) -> Result<f64> {
    let req = RunCodeRequest {
        code: "1".into(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut text = None;
    let end = rt
        .run_code(id, &req, &mut |ev| {
            if let EventKind::Result(r) = ev {
                text = r
                    .data
                    .get("text/plain")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
            }
            true
        })
        .map_err(|source| BenchApiError::Runtime {
            what: format!("run_code in {id}"),
            source,
        })?;
    let ms = ms_since(t0);
    if end.status != EndStatus::Ok || text.as_deref() != Some("1") {
        return Err(BenchApiError::Unexpected(format!(
            "library run_code \"1\": ended {:?} with result {text:?}",
            end.status
        )));
    }
    Ok(ms)
}

/// Memory of one VMM process, KiB, from `/proc/PID/smaps`.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct VmmMemory {
    rss: u64,
    pub(crate) pss: u64,
    private: u64,
    guest_rss: u64,
    guest_pss: u64,
    guest_private: u64,
    /// Mappings recognised as guest memory.
    guest_maps: usize,
}

/// Whether a mapping's path is a snapshot's guest memory (`/snapshot/memory` in the jail,
/// `<snapshot dir>/memory` outside).
fn is_guest_memory(path: &str) -> bool {
    Path::new(path).file_name().is_some_and(|n| n == "memory")
}

pub(crate) fn vmm_memory(pid: u32) -> Result<VmmMemory> {
    let path = PathBuf::from(format!("/proc/{pid}/smaps"));
    let text = std::fs::read_to_string(&path).map_err(io_err("cannot read", &path))?;
    let mut m = VmmMemory::default();
    let mut in_guest = false;
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let key = fields.next().unwrap_or("");
        if !key.ends_with(':') {
            // A mapping header: "start-end perms offset dev inode [path]".
            let mapped: Vec<&str> = line.split_whitespace().skip(5).collect();
            in_guest = is_guest_memory(&mapped.join(" "));
            m.guest_maps += usize::from(in_guest);
            continue;
        }
        let kib: u64 = fields.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        let (total, guest) = match key {
            "Rss:" => (&mut m.rss, &mut m.guest_rss),
            "Pss:" => (&mut m.pss, &mut m.guest_pss),
            "Private_Clean:" | "Private_Dirty:" => (&mut m.private, &mut m.guest_private),
            _ => continue,
        };
        *total += kib;
        if in_guest {
            *guest += kib;
        }
    }
    Ok(m)
}

impl VmmMemory {
    /// PSS of the guest-memory mapping, KiB.
    pub(crate) fn guest_pss_kib(&self) -> u64 {
        self.guest_pss
    }
}

/// Idle-memory figures.
#[derive(Debug)]
struct IdleMemory {
    template: String,
    guest_mib: u64,
    per: Vec<VmmMemory>,
}

/// Creates `k` idle sandboxes, lets them sit `settle`, reads their VMMs' memory, kills them.
fn idle_memory(
    target: &Target,
    template: &str,
    k: usize,
    settle: Duration,
    quiet: bool,
) -> Result<IdleMemory> {
    let mut infos = Vec::with_capacity(k);
    let r = (|| -> Result<IdleMemory> {
        for i in 0..k {
            infos.push(target.create(template)?);
            if !quiet {
                eprint!("\ridle memory: {}/{k} sandboxes created   ", i + 1);
            }
        }
        if !quiet {
            eprintln!("\nidle memory: waiting {} s", settle.as_secs_f64());
        }
        sleep_interruptibly(settle)?;
        let mut per = Vec::with_capacity(k);
        for info in &infos {
            let pid = target
                .client
                .sandbox(&info.id)
                .map_err(api_err(format!("get sandbox {}", info.id)))?
                .pid
                .ok_or_else(|| {
                    BenchApiError::Unexpected(format!("sandbox {} has no VMM pid", info.id))
                })?;
            per.push(vmm_memory(pid)?);
        }
        Ok(IdleMemory {
            template: template.to_string(),
            guest_mib: infos.first().map_or(0, |i| i.resources.memory_mib),
            per,
        })
    })();
    for info in &infos {
        let _ = target.kill(&info.id);
    }
    r
}

/// One concurrency level of the creation rate.
#[derive(Debug)]
pub(crate) struct Rate {
    clients: usize,
    pub(crate) creates: usize,
    pub(crate) wall_s: f64,
    /// Every create's latency, ms.
    pub(crate) create_samples: Vec<f64>,
    create: Option<Summary>,
    kill: Option<Summary>,
}

/// `clients` threads, each creating and killing `per_client` sandboxes in a loop.
pub(crate) fn create_rate(
    target: &Target,
    template: &str,
    clients: usize,
    per_client: usize,
) -> Result<Rate> {
    let t0 = Instant::now();
    let results: Vec<Result<Vec<(f64, f64)>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                s.spawn(|| -> Result<Vec<(f64, f64)>> {
                    let mut out = Vec::with_capacity(per_client);
                    for _ in 0..per_client {
                        let t = Instant::now();
                        let info = target.create(template)?;
                        let created = ms_since(t);
                        let t = Instant::now();
                        target.kill(&info.id)?;
                        out.push((created, ms_since(t)));
                    }
                    Ok(out)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(BenchApiError::Unexpected("a client thread panicked".into()))
                })
            })
            .collect()
    });
    let wall_s = t0.elapsed().as_secs_f64();
    let mut samples = Vec::new();
    for r in results {
        samples.extend(r?);
    }
    let create: Vec<f64> = samples.iter().map(|s| s.0).collect();
    let kill: Vec<f64> = samples.iter().map(|s| s.1).collect();
    Ok(Rate {
        clients,
        creates: samples.len(),
        wall_s,
        create_samples: create.clone(),
        create: summarize(&create),
        kill: summarize(&kill),
    })
}

/// A call that returns how long it took, ms.
type Timed<'a> = &'a mut dyn FnMut() -> Result<f64>;

fn as_dyn<F: FnMut() -> Result<f64>>(f: &mut Option<F>) -> Option<Timed<'_>> {
    f.as_mut().map(|f| f as Timed<'_>)
}

/// `api` and `direct` in pairs, `direct` first every other pair (so that neither always
/// follows the other), the first `warmup` pairs discarded: (api ms, direct ms, api − direct
/// per pair). Without `direct`, only the first is filled.
fn paired(
    calls: usize,
    warmup: usize,
    mut api: impl FnMut() -> Result<f64>,
    mut direct: Option<Timed<'_>>,
) -> Result<[Vec<f64>; 3]> {
    let mut out = [Vec::new(), Vec::new(), Vec::new()];
    for i in 0..warmup + calls {
        check_interrupt()?;
        let (x, d) = if i % 2 == 0 {
            let x = api()?;
            (x, direct.as_mut().map(|f| f()).transpose()?)
        } else {
            let d = direct.as_mut().map(|f| f()).transpose()?;
            (api()?, d)
        };
        if i >= warmup {
            out[0].push(x);
            if let Some(d) = d {
                out[1].push(d);
                out[2].push(x - d);
            }
        }
    }
    Ok(out)
}

/// `calls` timed `run_code`s (`call`, after `warmup`), each less the runtime's own duration
/// of the same call (from its audit record, read through `c`): through the API, the time the
/// server and the HTTP exchange add around the runtime call; on the library, the runtime's
/// bookkeeping outside its measured window (the audit write). Free of the guest's variance.
fn minus_runtime(
    c: &Client,
    id: &str,
    calls: usize,
    warmup: usize,
    call: Timed<'_>,
) -> Result<Vec<f64>> {
    let audit = |after: i64, limit: usize| {
        c.audit(
            id,
            &[
                ("call", "run_code".to_string()),
                ("after", after.to_string()),
                ("limit", limit.to_string()),
            ],
        )
        .map_err(api_err(format!("audit records of {id}")))
    };
    let before = audit(0, 1)?.last().map_or(0, |r| r.seq);
    let mut wall = Vec::with_capacity(warmup + calls);
    for _ in 0..warmup + calls {
        check_interrupt()?;
        wall.push(call()?);
    }
    let records = audit(before, wall.len())?;
    if records.len() != wall.len() {
        return Err(BenchApiError::Unexpected(format!(
            "{} run_code calls on {id} but {} audit records",
            wall.len(),
            records.len()
        )));
    }
    Ok(wall
        .iter()
        .zip(&records)
        .skip(warmup)
        .map(|(w, a)| w - a.duration_ms)
        .collect())
}

// ----- the run -----

/// One latency figure.
#[derive(Debug)]
struct Row {
    template: String,
    measure: &'static str,
    summary: Summary,
}

const BARE: &str = "bare restore → ping";
const LIBRARY: &str = "library restore → synced (no jail)";
const JAILED: &str = "runtime jailed spawn → synced";
const CREATED: &str = "API create answered";
const FIRST: &str = "API create → first result (1+1)";
const RTT_API: &str = "run_code `1` via API";
const RTT_LIB: &str = "run_code `1` via library Runtime";
const OVERHEAD: &str = "run_code: API − library (paired)";
const AROUND: &str = "run_code: API − runtime time (same)";
const AROUND_LIB: &str = "run_code: library − runtime time";
const GET_API: &str = "GET sandbox via API";
const GET_LIB: &str = "Runtime::get in-process";
const GET_OVERHEAD: &str = "GET: API − library (paired)";

/// Everything measured.
#[derive(Debug, Default)]
struct Report {
    server: String,
    rows: Vec<Row>,
    rates: Vec<Rate>,
    rate_template: String,
    idle: Option<IdleMemory>,
    notes: Vec<String>,
}

impl Report {
    fn push(&mut self, template: &str, measure: &'static str, samples: &[f64]) {
        if let Some(summary) = summarize(samples) {
            self.rows.push(Row {
                template: template.to_string(),
                measure,
                summary,
            });
        }
    }

    fn median(&self, template: &str, measure: &str) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| r.template == template && r.measure == measure)
            .map(|r| r.summary.median_ms)
    }
}

fn progress(quiet: bool, msg: std::fmt::Arguments<'_>) {
    if !quiet {
        eprint!("\r{msg}   ");
    }
}

fn run(a: &BenchApiArgs, target: &Target, report: &mut Report) -> Result<()> {
    let quiet = a.json;
    let vmm = ember_vmm::launcher::find_vmm_binary().map_err(|e| e.to_string());
    for name in &a.template {
        // The bare baseline restores the template's snapshot on this host.
        let template = if target.local.is_some() {
            crate::open_or_build(name, quiet).map(Some)
        } else {
            Template::open(name).map(Some).or_else(|e| {
                report
                    .notes
                    .push(format!("{name}: no bare baseline (no local template: {e})"));
                Ok(None)
            })
        }
        .map_err(|source| BenchApiError::Template {
            name: name.clone(),
            source,
        })?;
        let bare = match (&template, &vmm) {
            (Some(t), Ok(v)) => Some((t, v)),
            (Some(_), Err(e)) => {
                report
                    .notes
                    .push(format!("{name}: no bare baseline (no ember-vmm: {e})"));
                None
            }
            (None, _) => None,
        };
        // 1. create → first result, beside the bare restores, run by run.
        let (mut ping, mut lib, mut jailed, mut created, mut first) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let runs = a.warmup + a.n;
        for i in 0..runs {
            check_interrupt()?;
            let keep = i >= a.warmup;
            if let Some((t, v)) = bare {
                let p = bare_restore_ping(t, v)?;
                let l = library_restore(t, v)?;
                if keep {
                    ping.push(p);
                    lib.push(l);
                }
            }
            let [c, j, f] = api_first_result(target, name)?;
            if keep {
                created.push(c);
                jailed.push(j);
                first.push(f);
            }
            progress(
                quiet,
                format_args!("{name}: create → first result {}/{runs}", i + 1),
            );
        }
        if !quiet {
            eprintln!();
        }
        report.push(name, BARE, &ping);
        report.push(name, LIBRARY, &lib);
        report.push(name, JAILED, &jailed);
        report.push(name, CREATED, &created);
        report.push(name, FIRST, &first);
        // 2. round trips on one warm sandbox, API and library alternating: `run_code`, and
        // a call that does not reach the guest.
        let info = target.create(name)?;
        let id = info.id.as_str();
        let rt = target.runtime();
        if !quiet {
            let how = match rt {
                Some(_) => "API and library alternating",
                None => "API only",
            };
            eprintln!("{name}: round trips ({how}), {} each", a.calls);
        }
        // The first call opens the sandbox's agent connections; then the usual warm-up.
        let warmup = a.warmup + 1;
        let mut api_code = || -> Result<f64> {
            let t0 = Instant::now();
            let (_, text) = api_run(&target.client, id, "1", t0)?;
            let ms = ms_since(t0);
            if text != "1" {
                return Err(BenchApiError::Unexpected(format!("`1` gave {text:?}")));
            }
            Ok(ms)
        };
        let mut lib_code = rt.map(|rt| move || library_run(rt, id));
        let [api, lib, diff] = paired(a.calls, warmup, &mut api_code, as_dyn(&mut lib_code))?;
        report.push(name, RTT_API, &api);
        report.push(name, RTT_LIB, &lib);
        report.push(name, OVERHEAD, &diff);
        let around = minus_runtime(&target.client, id, a.calls, warmup, &mut api_code)?;
        report.push(name, AROUND, &around);
        if let Some(f) = lib_code.as_mut() {
            let around = minus_runtime(&target.client, id, a.calls, warmup, f)?;
            report.push(name, AROUND_LIB, &around);
        }
        let api_get = || -> Result<f64> {
            let t0 = Instant::now();
            target
                .client
                .sandbox(id)
                .map_err(api_err(format!("get sandbox {id}")))?;
            Ok(ms_since(t0))
        };
        let mut lib_get = rt.map(|rt| {
            move || -> Result<f64> {
                let t0 = Instant::now();
                rt.get(id).map_err(|source| BenchApiError::Runtime {
                    what: format!("get sandbox {id}"),
                    source,
                })?;
                Ok(ms_since(t0))
            }
        });
        let [api, lib, diff] = paired(a.calls, warmup, api_get, as_dyn(&mut lib_get))?;
        report.push(name, GET_API, &api);
        report.push(name, GET_LIB, &lib);
        report.push(name, GET_OVERHEAD, &diff);
        target.kill(id)?;
    }
    // 3. creates per second.
    let rate_template = a
        .template
        .first()
        .cloned()
        .unwrap_or_else(|| "default".into());
    report.rate_template = rate_template.clone();
    for &clients in &a.clients {
        let clients = clients.max(1);
        let per_client = a.creates.div_ceil(clients).max(1);
        if !quiet {
            eprintln!(
                "creation rate: {clients} client(s) × {per_client} create+kill of {rate_template}"
            );
        }
        report
            .rates
            .push(create_rate(target, &rate_template, clients, per_client)?);
    }
    // 4. memory per idle sandbox.
    if a.idle > 0 {
        match idle_memory(
            target,
            &rate_template,
            a.idle,
            Duration::from_secs(a.settle),
            quiet,
        ) {
            Ok(m) => {
                if m.per.iter().any(|p| p.guest_maps == 0) {
                    report.notes.push(
                        "idle memory: no guest-memory mapping (…/memory) found in some VMM's \
                         smaps; their VMM overhead is their total PSS"
                            .into(),
                    );
                }
                report.idle = Some(m);
            }
            Err(e @ BenchApiError::Io { .. }) if target.local.is_none() => report.notes.push(
                format!("idle memory: unavailable (is the server on this host?): {e}"),
            ),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

// ----- output -----

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Summary of MiB values as JSON (median, p95, n, ...).
fn mib_summary(v: &[f64]) -> Value {
    match summarize(v) {
        Some(s) => json!({
            "n": s.n, "median_mib": s.median_ms, "p95_mib": s.p95_ms,
            "min_mib": s.min_ms, "max_mib": s.max_ms,
            "mean_mib": v.iter().sum::<f64>() / v.len() as f64,
        }),
        None => Value::Null,
    }
}

/// The idle-memory columns: (JSON name, label, per-sandbox MiB values).
fn idle_columns(m: &IdleMemory) -> Vec<(&'static str, &'static str, Vec<f64>)> {
    let col = |f: fn(&VmmMemory) -> u64| m.per.iter().map(|p| mib(f(p))).collect::<Vec<f64>>();
    vec![
        ("pss", "PSS (whole VMM process)", col(|p| p.pss)),
        ("rss", "RSS (whole VMM process)", col(|p| p.rss)),
        ("private", "private (clean + dirty)", col(|p| p.private)),
        (
            "guest_pss",
            "guest-memory mapping PSS",
            col(|p| p.guest_pss),
        ),
        (
            "guest_rss",
            "guest-memory mapping RSS",
            col(|p| p.guest_rss),
        ),
        (
            "guest_private",
            "guest-memory mapping private (CoW copies)",
            col(|p| p.guest_private),
        ),
        (
            "vmm_pss",
            "VMM overhead PSS (outside guest memory)",
            col(|p| p.pss.saturating_sub(p.guest_pss)),
        ),
        (
            "vmm_rss",
            "VMM overhead RSS (outside guest memory)",
            col(|p| p.rss.saturating_sub(p.guest_rss)),
        ),
    ]
}

/// The server's overhead per `run_code`: what the API adds around the runtime call, less
/// what the library call adds around it too (the audit write), when measured.
fn server_overhead(r: &Report, template: &str) -> Option<f64> {
    let api = r.median(template, AROUND)?;
    Some(api - r.median(template, AROUND_LIB).unwrap_or(0.0))
}

fn json_lines(r: &Report) -> Vec<Value> {
    let mut out = vec![json!({"bench": "api", "server": r.server})];
    for row in &r.rows {
        out.push(json!({
            "bench": "api", "template": row.template, "measure": row.measure,
            "summary": row.summary,
        }));
    }
    let mut templates: Vec<&str> = r.rows.iter().map(|x| x.template.as_str()).collect();
    templates.dedup();
    for t in templates {
        if let (Some(f), Some(p)) = (r.median(t, FIRST), r.median(t, BARE)) {
            out.push(json!({
                "bench": "api", "template": t,
                "measure": "create → first result / bare restore → ping (medians)",
                "ratio": f / p, "goal": 2.0, "met": f / p <= 2.0,
            }));
        }
        if let Some(o) = server_overhead(r, t) {
            out.push(json!({
                "bench": "api", "template": t,
                "measure": "server overhead per run_code (medians: API − runtime time, less \
                            library − runtime time)",
                "ms": o, "goal_ms": 1.0, "met": o < 1.0,
                "api_minus_runtime_ms": r.median(t, AROUND),
                "library_minus_runtime_ms": r.median(t, AROUND_LIB),
                "paired_api_minus_library_ms": r.median(t, OVERHEAD),
            }));
        }
    }
    for rate in &r.rates {
        out.push(json!({
            "bench": "api", "template": r.rate_template, "measure": "create rate",
            "clients": rate.clients, "creates": rate.creates, "wall_s": rate.wall_s,
            "creates_per_s": rate.creates as f64 / rate.wall_s,
            "create": rate.create, "kill": rate.kill,
        }));
    }
    if let Some(m) = &r.idle {
        let mut per = serde_json::Map::new();
        for (name, _, v) in idle_columns(m) {
            per.insert(name.to_string(), mib_summary(&v));
        }
        out.push(json!({
            "bench": "api", "template": m.template, "measure": "idle sandbox memory",
            "sandboxes": m.per.len(), "guest_mib": m.guest_mib,
            "total_pss_mib": mib(m.per.iter().map(|p| p.pss).sum()),
            "total_rss_mib": mib(m.per.iter().map(|p| p.rss).sum()),
            "guest_mapping_found": m.per.iter().all(|p| p.guest_maps > 0),
            "per_sandbox": per,
        }));
    }
    for n in &r.notes {
        out.push(json!({"bench": "api", "note": n}));
    }
    out
}

fn print_table(r: &Report, settle: u64) {
    println!("\nserver: {}", r.server);
    println!(
        "\n{:<12} {:<36} {:>4} {:>10} {:>10} {:>8}",
        "template", "measure", "n", "median ms", "p95 ms", "vs ping"
    );
    for row in &r.rows {
        let ratio = match (row.measure, r.median(&row.template, BARE)) {
            (BARE | LIBRARY | JAILED | CREATED | FIRST, Some(p)) => {
                format!("{:.2}×", row.summary.median_ms / p)
            }
            _ => "-".into(),
        };
        println!(
            "{:<12} {:<36} {:>4} {:>10.2} {:>10.2} {:>8}",
            row.template,
            row.measure,
            row.summary.n,
            row.summary.median_ms,
            row.summary.p95_ms,
            ratio
        );
    }
    let mut templates: Vec<&str> = r.rows.iter().map(|x| x.template.as_str()).collect();
    templates.dedup();
    for t in templates {
        if let (Some(f), Some(p)) = (r.median(t, FIRST), r.median(t, BARE)) {
            let ratio = f / p;
            println!(
                "{t}: create → first result = {ratio:.2}× bare restore → ping (goal ≤ 2×: {})",
                if ratio <= 2.0 { "met" } else { "NOT met" }
            );
        }
        if let Some(o) = server_overhead(r, t) {
            let api = r.median(t, AROUND).unwrap_or(f64::NAN);
            let how = match r.median(t, AROUND_LIB) {
                Some(lib) => format!(
                    "medians of the API round trip less the runtime's own time of the same \
                     call, {api:.3} ms, and of the library call less it, {lib:.3} ms"
                ),
                None => format!(
                    "median of the API round trip less the runtime's own time of the same \
                     call, {api:.3} ms, with the runtime's audit write (no library comparison \
                     against a server not in-process)"
                ),
            };
            println!(
                "{t}: server overhead per run_code = {o:.3} ms (goal < 1 ms: {}): {how}",
                if o < 1.0 { "met" } else { "NOT met" },
            );
        }
        if let Some(o) = r.median(t, OVERHEAD) {
            println!(
                "{t}: API − library run_code, paired: {o:.3} ms median (within the guest's \
                 call-to-call variance)"
            );
        }
    }
    if !r.rates.is_empty() {
        println!(
            "\ncreation rate ({}; each client: create, then kill, in a loop)",
            r.rate_template
        );
        println!(
            "{:>7} {:>7} {:>8} {:>9} {:>16} {:>13} {:>14}",
            "clients",
            "creates",
            "wall s",
            "creates/s",
            "create median ms",
            "create p95 ms",
            "kill median ms"
        );
        for rate in &r.rates {
            let f = |s: &Option<Summary>, p95: bool| {
                s.map_or(f64::NAN, |s| if p95 { s.p95_ms } else { s.median_ms })
            };
            println!(
                "{:>7} {:>7} {:>8.2} {:>9.2} {:>16.1} {:>13.1} {:>14.1}",
                rate.clients,
                rate.creates,
                rate.wall_s,
                rate.creates as f64 / rate.wall_s,
                f(&rate.create, false),
                f(&rate.create, true),
                f(&rate.kill, false)
            );
        }
    }
    if let Some(m) = &r.idle {
        let k = m.per.len();
        println!(
            "\nhost memory of {k} idle sandboxes ({}, {} MiB guest each, after {settle} s), MiB",
            m.template, m.guest_mib
        );
        println!(
            "{:<44} {:>9} {:>9} {:>9} {:>9}",
            "per sandbox", "mean", "median", "p95", "sum"
        );
        for (_, label, v) in idle_columns(m) {
            let sum: f64 = v.iter().sum();
            let s = summarize(&v);
            println!(
                "{:<44} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
                label,
                sum / v.len().max(1) as f64,
                s.map_or(f64::NAN, |s| s.median_ms),
                s.map_or(f64::NAN, |s| s.p95_ms),
                sum
            );
        }
    }
    for n in &r.notes {
        println!("note: {n}");
    }
}

/// Runs the benchmark.
pub fn main(a: BenchApiArgs) -> ExitCode {
    if a.n == 0 {
        return fail("-n must be at least 1");
    }
    catch_sigint();
    let (client, local, server) = match &a.url {
        Some(url) => {
            let c = Client::from_env(Some(url.as_str()), a.token.clone());
            let server = format!("{} (existing server)", c.url());
            (c, None, server)
        }
        None => match Local::start() {
            Ok((local, addr, token)) => {
                let server = format!(
                    "in-process at http://{addr}, runtime home {}",
                    local
                        .home
                        .as_ref()
                        .map_or_else(String::new, |h| h.path().display().to_string())
                );
                (
                    Client::new(&format!("http://{addr}"), Some(token)),
                    Some(local),
                    server,
                )
            }
            Err(e) => return fail(e),
        },
    };
    if !a.json {
        eprintln!("ember bench api: {server}");
    }
    let mut target = Target {
        client,
        local,
        tracker: Tracker::default(),
    };
    let mut report = Report {
        server,
        ..Default::default()
    };
    let result = run(&a, &target, &mut report);
    if !a.json && !target.tracker.ids().is_empty() {
        eprintln!(
            "\nkilling the {} sandbox(es) left",
            target.tracker.ids().len()
        );
    }
    let mut problems = target.kill_all();
    if let Some(mut local) = target.local.take() {
        problems.extend(local.shut_down());
    }
    for p in &problems {
        eprintln!("ember: warning: cleaning up: {p}");
    }
    match result {
        Err(_) if INTERRUPTED.load(Ordering::SeqCst) => {
            return fail("interrupted (Ctrl-C); the sandboxes it created were killed")
        }
        Err(e) => return fail(e),
        Ok(()) => {}
    }
    for line in json_lines(&report) {
        println!("{line}");
    }
    if !a.json {
        print_table(&report, a.settle);
    }
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
