//! ember's sandbox runtime: templates (a recipe built into a warm snapshot), sandbox handles
//! (a VM restored from one, with `run_code`, contexts, `exec` and files) and the [`Runtime`]
//! that owns every sandbox of a host: ids, lifecycle, jails, network policy, durable state.
//!
//! The runtime: every sandbox on this host, by id, with its lifecycle.
//!
//! [`Runtime::open`] opens the durable store under `$EMBER_HOME`, re-attaches the VMMs a
//! previous server left running and reclaims whatever a crash left behind. `create` restores a
//! template (or a named snapshot) into a **jailed** VMM — own uid, cgroup, mount namespace —
//! and returns an id; every later call with that id reaches the same VM. Sandboxes are
//! paused (snapshot to disk, the VMM exits), resumed (explicitly, or by any call), killed,
//! snapshotted and forked; timeouts and max lifetimes are enforced by one timer thread, VMM
//! deaths are seen at once by one pidfd watcher thread. Every call is written to the audit
//! log; every state change to the state history.
//!
//! Concurrency: each sandbox has a slot (a mutex over its row and VM, and a condvar). Calls
//! count themselves in-flight; pause waits for them (up to a bound); a call that finds the
//! sandbox pausing or resuming waits, one that finds it paused resumes it.
//!
//! No HTTP here: the server (`ember-server`) and the CLI (`ember-cli`) are thin layers over these calls.

pub mod agent_link;
pub mod call;
mod cancel;
pub mod clock;
pub mod images;
pub mod jail;
pub mod netpolicy;
pub mod paths;
pub mod pool;
pub mod processes;
pub mod sandbox;
pub mod secret_env;
pub mod secrets;
pub mod store;
pub mod template;

pub mod config;
pub mod error;
pub mod gate;
pub mod jailed;
pub mod types;

mod calls;
mod lifecycle;
mod logtail;
mod network;
pub mod pooled;
mod secret_calls;
mod usage;
mod volume_calls;
pub mod volumes;
mod watches;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use config::RuntimeConfig;
pub use error::{ErrorClass, RuntimeError};
pub use lifecycle::{KeepAlive, LifecycleHooks, ResumeVerdict};
pub use logtail::{LogKind, LogTail, LOG_TAIL_MAX};
pub use network::{NetworkInfo, MAX_PORTS};
pub use types::*;
pub use watches::relative_name;

pub use sandbox::{Execution, RunEnd, Sandbox, SandboxError, SandboxOptions};
pub use template::{BuildEvent, BuildOptions, Template, TemplateError, TemplateInfo};

use crate::store::{SandboxRow, Store};
use jailed::{Binaries, Live, Watcher};

/// The runtime. Cheap to clone (shared); all methods block the calling thread (the server
/// calls them from blocking tasks).
#[derive(Debug, Clone)]
pub struct Runtime {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    cfg: RuntimeConfig,
    bins: Binaries,
    store: Mutex<Store>,
    slots: Mutex<HashMap<String, Arc<Slot>>>,
    /// Held across a capacity check and the reservation it allows.
    capacity: Mutex<()>,
    uids: Arc<Mutex<BTreeSet<u32>>>,
    metrics: Mutex<Metrics>,
    /// Calls handled through [`call::Handler`], by name.
    calls: Mutex<std::collections::BTreeMap<&'static str, CallStats>>,
    watcher: Mutex<Option<Arc<Watcher>>>,
    timer: Arc<(Mutex<bool>, Condvar)>,
    /// Sandboxes' network namespaces, rules and resolvers.
    net: Arc<crate::netpolicy::NetManager>,
    /// Warm jailed VMMs per template, waiting for their restore.
    pool: crate::pool::Pool<pooled::VmmFiller>,
    /// Admission of VM starts (at most `max_starting` at once).
    gate: gate::StartGate,
    /// The polling watchers whose watch runs in this process (their records are in the
    /// store).
    watches: Mutex<HashMap<String, Arc<watches::LiveWatcher>>>,
    /// What the embedder follows pauses and resumes with (`set_hooks`).
    hooks: Mutex<Option<Arc<dyn LifecycleHooks>>>,
    /// The secrets store (opened at first use; the egress proxy shares it).
    secrets: Arc<crate::secrets::Secrets>,
    /// Volumes and who mounts them (docs/volumes.md).
    volumes: Arc<crate::volumes::Volumes>,
}

/// One sandbox with a VMM or a pause snapshot.
#[derive(Debug)]
struct Slot {
    id: String,
    st: Mutex<SlotState>,
    cv: Condvar,
}

#[derive(Debug)]
struct SlotState {
    row: SandboxRow,
    vm: Option<Arc<Live>>,
    inflight: usize,
    /// Set while the runtime itself stops the VMM (pause, kill, timeout): the watcher then
    /// does not call the exit a failure.
    expected_exit: bool,
    /// A timeout action is under way.
    expiring: bool,
    /// When it was paused (ms), for the paused retention.
    paused_ms: Option<i64>,
    /// The thread stopping a VMM a pause let go of (see `retire_vm`).
    retiring: Option<std::thread::JoinHandle<()>>,
    /// The cancels of its open long calls (attaches, watches): fired before a pause or a
    /// kill, so that no stream holds either up.
    streams: Vec<std::sync::Weak<call::Cancel>>,
}

impl SlotState {
    /// Ends the sandbox's open long calls (their callers see them end).
    fn cancel_streams(&mut self) {
        for c in self.streams.drain(..) {
            if let Some(c) = c.upgrade() {
                c.fire();
            }
        }
    }
}

impl Slot {
    /// A slot for `row`, with no VM yet (`paused_ms`: when it was paused, if it is).
    fn new(row: SandboxRow, paused_ms: Option<i64>) -> Arc<Slot> {
        Arc::new(Slot {
            id: row.id.clone(),
            st: Mutex::new(SlotState {
                row,
                vm: None,
                inflight: 0,
                expected_exit: false,
                retiring: None,
                expiring: false,
                paused_ms,
                streams: Vec::new(),
            }),
            cv: Condvar::new(),
        })
    }
}

/// Counts a call in flight; decrements on drop.
struct InFlight {
    slot: Arc<Slot>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut st) = self.slot.st.lock() {
            st.inflight = st.inflight.saturating_sub(1);
        }
        self.slot.cv.notify_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind; keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Runtime {
    /// Opens the runtime on `cfg.home`: the store, then re-attaches or reclaims what a
    /// previous server left (see `lifecycle::reclaim`), then starts the watcher and timer
    /// threads.
    pub fn open(cfg: RuntimeConfig) -> Result<Runtime, RuntimeError> {
        for d in [
            cfg.home.clone(),
            cfg.home.join("sandboxes"),
            cfg.jails_dir(),
            cfg.home.join("artifacts"),
            cfg.snapshots_dir(),
        ] {
            std::fs::create_dir_all(&d).map_err(RuntimeError::io("cannot create", &d))?;
        }
        let bins = Binaries::find(&cfg)?;
        let store = Store::open(&cfg.db_path())?;
        // State at rest is the server's alone (docs/architecture.md "Data at rest").
        let db = cfg.db_path();
        let mut files: Vec<std::path::PathBuf> = ["", "-wal", "-shm"]
            .iter()
            .map(|s| format!("{}{s}", db.display()).into())
            .collect();
        files.push(cfg.home.join("token"));
        for f in [
            "secrets.db",
            "secrets.db-wal",
            "secrets.db-shm",
            "secrets.key",
        ] {
            files.push(cfg.home.join(f));
        }
        match paths::secure_state(&cfg.home, &files) {
            Ok(fixed) => {
                for f in fixed {
                    tracing::warn!("state readable by other accounts, repaired: {f}");
                }
            }
            Err(e) => tracing::warn!("cannot check the modes of {}: {e}", cfg.home.display()),
        }
        let secrets = Arc::new(crate::secrets::Secrets::new(&cfg.home));
        let volumes = Arc::new(
            crate::volumes::Volumes::new(&cfg.home)
                .map_err(RuntimeError::io("cannot open the volumes under", &cfg.home))?,
        );
        let net = Arc::new(
            crate::netpolicy::NetManager::new(&cfg.home, cfg.network.clone())
                .map_err(|e| RuntimeError::Internal(e.to_string()))?
                .with_secrets(secrets.clone()),
        );
        // Members a previous server left are reclaimed with the other orphaned jails.
        let pool_dir = pooled::VmmFiller::pool_dir(&cfg);
        let _ = std::fs::remove_dir_all(&pool_dir);
        let uids = Arc::new(Mutex::new(BTreeSet::new()));
        let pool = crate::pool::Pool::new(
            pooled::VmmFiller {
                cfg: cfg.clone(),
                bins: bins.clone(),
                uids: uids.clone(),
                net: net.clone(),
            },
            cfg.pool,
        );
        let start_gate = gate::StartGate::new(cfg.max_starting);
        let rt = Runtime {
            inner: Arc::new(Inner {
                cfg,
                bins,
                store: Mutex::new(store),
                slots: Mutex::new(HashMap::new()),
                capacity: Mutex::new(()),
                uids,
                metrics: Mutex::new(Metrics::default()),
                calls: Mutex::new(Default::default()),
                watcher: Mutex::new(None),
                watches: Mutex::new(HashMap::new()),
                hooks: Mutex::new(None),
                timer: Arc::new((Mutex::new(false), Condvar::new())),
                net,
                pool,
                gate: start_gate,
                secrets,
                volumes,
            }),
        };
        let weak = Arc::downgrade(&rt.inner);
        let watcher = Watcher::start(move |id, jail| {
            if let Some(inner) = weak.upgrade() {
                Runtime { inner }.vmm_exited(&id, &jail);
            }
        })?;
        *lock(&rt.inner.watcher) = Some(watcher);
        rt.reclaim()?;
        rt.rearm_watchers();
        rt.start_timer()?;
        if rt.inner.pool.enabled() {
            for name in &rt.inner.cfg.pool_templates {
                match crate::template::Template::open(name) {
                    Ok(t) => rt.inner.pool.register(&t.info.name, &t.snapshot_dir()),
                    Err(e) => tracing::warn!("no warm pool for template {name}: {e}"),
                }
            }
        }
        Ok(rt)
    }

    /// The warm pools' counters (empty when the pool is off).
    pub fn pool_stats(&self) -> Vec<crate::pool::PoolStats> {
        self.inner.pool.stats()
    }

    /// Waits until every registered template's pool has `n` ready VMMs (false on timeout).
    pub fn pool_wait_ready(&self, n: usize, timeout: Duration) -> bool {
        self.inner.pool.wait_ready(n, timeout)
    }

    /// The settings.
    pub fn config(&self) -> &RuntimeConfig {
        &self.inner.cfg
    }

    fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.inner.store)
    }

    fn slot(&self, id: &str) -> Result<Arc<Slot>, RuntimeError> {
        if let Some(s) = lock(&self.inner.slots).get(id) {
            return Ok(s.clone());
        }
        match self.store().sandbox(id)? {
            Some(row) => Err(RuntimeError::conflict(
                id,
                row.state,
                row.reason.unwrap_or_else(|| "it has ended".into()),
            )),
            None => Err(RuntimeError::NotFound(id.to_string())),
        }
    }

    /// Writes `st.row` with a state change (and its history entry) and wakes waiters.
    fn transition(&self, slot: &Slot, st: &mut SlotState, to: State, reason: Option<String>) {
        let from = st.row.state;
        st.row.state = to;
        st.paused_ms = (to == State::Paused).then(crate::store::now_ms);
        st.row.reason = reason.clone();
        if to.is_final() {
            st.row.ended_ms = Some(crate::store::now_ms());
            st.row.pid = None;
        }
        let store = self.store();
        if let Err(e) = store
            .update_sandbox(&st.row)
            .and_then(|_| store.add_transition(&slot.id, Some(from), to, reason.as_deref()))
        {
            tracing::error!("sandbox {}: cannot record {from:?} -> {to:?}: {e}", slot.id);
        }
        drop(store);
        slot.cv.notify_all();
    }

    /// Waits until the sandbox can take a call (resuming it if paused) and counts the call
    /// in flight.
    fn acquire(&self, id: &str) -> Result<(Arc<Live>, InFlight), RuntimeError> {
        let slot = self.slot(id)?;
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut st = lock(&slot.st);
        loop {
            match st.row.state {
                State::Running => {
                    let Some(vm) = st.vm.clone() else {
                        return Err(RuntimeError::Internal(format!(
                            "sandbox {id} is running without a VM"
                        )));
                    };
                    st.inflight += 1;
                    drop(st);
                    return Ok((vm, InFlight { slot }));
                }
                State::Paused => {
                    drop(st);
                    self.resume(id)?;
                    st = lock(&slot.st);
                }
                State::Creating | State::Pausing | State::Resuming => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(RuntimeError::Timeout {
                            id: id.into(),
                            message: format!("still {} after 600 s", st.row.state.as_str()),
                        });
                    }
                    st = slot
                        .cv
                        .wait_timeout(st, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                s @ (State::Stopped | State::Failed) => {
                    return Err(RuntimeError::conflict(
                        id,
                        s,
                        st.row
                            .reason
                            .clone()
                            .unwrap_or_else(|| "it has ended".into()),
                    ))
                }
            }
        }
    }

    /// Runs `f` on the sandbox's VM, audited: the call, a summary of its arguments, how long
    /// it took, its outcome and the bytes that went in and out.
    fn audited<T>(
        &self,
        id: &str,
        call: &'static str,
        args: serde_json::Value,
        f: impl FnOnce(&Live, &mut (u64, u64)) -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        let at = crate::store::now_ms();
        let t0 = Instant::now();
        let mut bytes = (0u64, 0u64);
        let result = match self.acquire(id) {
            Ok((vm, _guard)) => f(&vm, &mut bytes).map_err(|e| self.explain(id, e)),
            Err(e) => Err(e),
        };
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        self.record(at, Some(id), call, &args, ms, &result, bytes);
        result
    }

    /// [`Self::audited`] for a long call that `cancel` stops: the runtime fires it before it
    /// pauses or kills the sandbox.
    fn audited_stream<T>(
        &self,
        id: &str,
        call: &'static str,
        args: serde_json::Value,
        cancel: &Arc<call::Cancel>,
        f: impl FnOnce(&Live, &mut (u64, u64)) -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        if let Ok(slot) = self.slot(id) {
            let mut st = lock(&slot.st);
            st.streams.retain(|c| c.strong_count() > 0);
            st.streams.push(Arc::downgrade(cancel));
        }
        self.audited(id, call, args, f)
    }

    /// A transport error on a sandbox that meanwhile stopped or failed says so.
    fn explain(&self, id: &str, e: RuntimeError) -> RuntimeError {
        if !matches!(e, RuntimeError::Sandbox(_)) {
            return e;
        }
        // Give the watcher a moment to record a death that caused the error.
        for _ in 0..20 {
            if let Ok(Some(row)) = self.store().sandbox(id) {
                if row.state != State::Running {
                    return RuntimeError::conflict(
                        id,
                        row.state,
                        format!(
                            "the call was cut off: {}",
                            row.reason.unwrap_or_else(|| row.state.as_str().into())
                        ),
                    );
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        e
    }

    /// Runs `f` (a call that does not go through a VM, or manages one) and audits it.
    fn timed<T>(
        &self,
        id: Option<&str>,
        call: &str,
        args: serde_json::Value,
        f: impl FnOnce() -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        let at = crate::store::now_ms();
        let t0 = Instant::now();
        let r = f();
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        self.record(at, id, call, &args, ms, &r, (0, 0));
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn record<T>(
        &self,
        at: i64,
        id: Option<&str>,
        call: &str,
        args: &serde_json::Value,
        ms: f64,
        result: &Result<T, RuntimeError>,
        bytes: (u64, u64),
    ) {
        let (outcome, error) = match result {
            Ok(_) => ("ok", None),
            Err(e) => (e.code(), Some(e.to_string())),
        };
        if let Err(e) = self.store().audit(
            at,
            id,
            call,
            args,
            ms,
            outcome,
            error.as_deref(),
            bytes.0,
            bytes.1,
        ) {
            tracing::error!("cannot write the audit record of {call}: {e}");
        }
        lock(&self.inner.metrics)
            .call_ms
            .entry(call.to_string())
            .or_default()
            .observe(ms);
    }

    /// One sandbox.
    pub fn get(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        if let Some(slot) = lock(&self.inner.slots).get(id).cloned() {
            return Ok(lock(&slot.st).row.info());
        }
        self.store()
            .sandbox(id)?
            .map(|r| r.info())
            .ok_or_else(|| RuntimeError::NotFound(id.to_string()))
    }

    /// Sandboxes matching `filter`, newest first.
    pub fn list(&self, filter: &ListFilter) -> Result<Vec<SandboxInfo>, RuntimeError> {
        let live_only = !filter.all && !filter.state.is_some_and(State::is_final);
        let rows = self.store().sandboxes(live_only)?;
        let slots = lock(&self.inner.slots).clone();
        Ok(rows
            .into_iter()
            .map(|r| match slots.get(&r.id) {
                Some(s) => lock(&s.st).row.info(),
                None => r.info(),
            })
            .filter(|i| filter.state.is_none_or(|s| i.state == s))
            .filter(|i| {
                filter
                    .metadata
                    .iter()
                    .all(|(k, v)| i.metadata.get(k) == Some(v))
            })
            .collect())
    }

    /// The state history of a sandbox.
    pub fn history(&self, id: &str) -> Result<Vec<Transition>, RuntimeError> {
        self.get(id)?;
        Ok(self.store().transitions(id)?)
    }

    /// Every sandbox's state changes after sequence number `after`, oldest first, at most
    /// `limit`: `(seq, sandbox, change)` (what a fleet's node ships to its directory).
    pub fn transitions_after(
        &self,
        after: i64,
        limit: usize,
    ) -> Result<Vec<(i64, String, Transition)>, RuntimeError> {
        Ok(self
            .store()
            .transitions_after(after, limit.min(100_000) as i64)?)
    }

    /// Audit records.
    pub fn audit(&self, filter: &AuditFilter) -> Result<Vec<AuditRecord>, RuntimeError> {
        Ok(self.store().audit_records(filter)?)
    }

    /// Calls handled through the call surface so far, by name: count, failures, total time.
    pub fn call_counts(&self) -> std::collections::BTreeMap<&'static str, CallStats> {
        lock(&self.inner.calls).clone()
    }

    fn count_call(&self, name: &'static str, ms: f64, ok: bool) {
        let mut calls = lock(&self.inner.calls);
        let c = calls.entry(name).or_default();
        c.count += 1;
        c.failed += u64::from(!ok);
        c.total_ms += ms;
    }

    /// Counters for `/metrics`.
    pub fn metrics(&self) -> Metrics {
        let mut m = lock(&self.inner.metrics).clone();
        let mut by_state: std::collections::BTreeMap<String, u64> = State::ALL
            .iter()
            .map(|s| (s.as_str().to_string(), 0))
            .collect();
        if let Ok(counts) = self.store().count_by_state() {
            by_state.extend(counts);
        }
        m.by_state = by_state;
        m.committed_memory_mib = self.committed().1;
        m
    }

    /// (sandboxes with a VMM, their guest memory in MiB).
    /// Locks each slot in turn (never while holding the map lock), so a caller may hold one
    /// slot's lock only if it is not counted (paused or final).
    fn committed(&self) -> (usize, u64) {
        let slots: Vec<Arc<Slot>> = lock(&self.inner.slots).values().cloned().collect();
        let mut n = 0;
        let mut mem = 0;
        for s in &slots {
            let st = lock(&s.st);
            if !matches!(st.row.state, State::Paused) && !st.row.state.is_final() {
                n += 1;
                mem += st.row.resources.memory_mib;
            }
        }
        (n, mem)
    }

    fn alloc_uid(&self) -> Result<u32, RuntimeError> {
        pooled::alloc_uid(&self.inner.cfg, &self.inner.uids)
            .ok_or_else(|| RuntimeError::Capacity("no free jail uid".into()))
    }

    fn free_uid(&self, uid: Option<u32>) {
        if let Some(u) = uid {
            lock(&self.inner.uids).remove(&u);
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Warm VMMs belong to no sandbox: they always go.
        self.pool.drain();
        if !self.cfg.kill_on_drop {
            // The VMMs live on (a stopped server); the next runtime re-attaches them.
            for slot in lock(&self.slots).values() {
                if let Some(vm) = &lock(&slot.st).vm {
                    vm.sandbox.detach();
                }
            }
            // Only empty parents go (a running sandbox's cgroup keeps its parent busy).
            jailed::remove_cgroup_parents(&self.cfg);
            if self.net.in_use() == 0 {
                self.net.remove_host_table();
            }
            return;
        }
        let slots: Vec<Arc<Slot>> = lock(&self.slots).values().cloned().collect();
        for slot in slots {
            let mut st = lock(&slot.st);
            st.expected_exit = true;
            if let Some(vm) = st.vm.take() {
                let _ = vm.sandbox.kill();
                let _ = jailed::release_jail(&vm.jail);
                if let Some(net) = &vm.net {
                    self.net.teardown(net);
                }
            }
        }
        jailed::remove_cgroup_parents(&self.cfg);
        self.net.remove_host_table();
    }
}
