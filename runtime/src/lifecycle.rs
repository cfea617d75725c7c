//! Lifecycle: create, pause, resume, kill, timeouts, snapshot, fork, VMM deaths, and the
//! reclaim of what a crashed server left.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ember_jailer::jail::Timings;
use ember_jailer::CgroupLimits;

use super::jailed::{self, Live, StartSpec};
use super::types::*;
use super::{lock, Runtime, RuntimeError, Slot, SlotState};
use crate::netpolicy::NetMode;
use crate::store::{now_ms, rfc3339, SandboxRow};
use crate::template::Template;

/// What a sandbox is restored from.
struct Source {
    dir: PathBuf,
    template: Option<String>,
    snapshot: Option<String>,
    env: BTreeMap<String, String>,
    outputs: String,
    vcpus: u8,
    memory_mib: u64,
    disk_mib: u64,
}

fn check_name(name: &str) -> Result<(), RuntimeError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::Invalid(format!(
            "invalid name {name:?}: 1 to 64 letters, digits, '-', '_' or '.', not starting with '.'"
        )))
    }
}

fn secs(d: Duration) -> i64 {
    d.as_millis() as i64
}

impl Runtime {
    fn source(&self, req: &CreateRequest) -> Result<Source, RuntimeError> {
        match (&req.template, &req.snapshot) {
            (Some(_), Some(_)) => Err(RuntimeError::Invalid(
                "give either a template or a snapshot, not both".into(),
            )),
            (_, Some(name)) => {
                check_name(name)?;
                let (info, dir) = self
                    .store()
                    .snapshot(name)?
                    .ok_or_else(|| RuntimeError::NoSuchSnapshot(format!("no snapshot {name:?}")))?;
                let meta: SnapshotMeta = std::fs::read(dir.join("ember-snapshot.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok())
                    .ok_or_else(|| {
                        RuntimeError::Internal(format!(
                            "snapshot {name}: {} is missing or unreadable",
                            dir.join("ember-snapshot.json").display()
                        ))
                    })?;
                Ok(Source {
                    dir,
                    template: info.template,
                    snapshot: Some(name.clone()),
                    env: meta.env,
                    outputs: meta.outputs,
                    vcpus: meta.resources.vcpus,
                    memory_mib: meta.resources.memory_mib,
                    disk_mib: meta.resources.disk_mib,
                })
            }
            (t, None) => {
                let name = t.as_deref().unwrap_or("default");
                let t = Template::open(name).map_err(|e| match e {
                    crate::TemplateError::NotBuilt { .. } => RuntimeError::NoSuchImage(format!(
                        "template {name:?} is not built (build it with `ember template build \
                         {name}`)"
                    )),
                    other => other.into(),
                })?;
                Ok(Source {
                    dir: t.snapshot_dir(),
                    template: Some(t.info.name.clone()),
                    snapshot: None,
                    env: t.info.env.clone(),
                    outputs: t.info.outputs.clone(),
                    vcpus: t.info.vm.vcpus,
                    memory_mib: t.info.vm.memory_mib,
                    disk_mib: t.info.vm.disk_mib.unwrap_or(0),
                })
            }
        }
    }

    fn limits(&self, r: &Resources) -> CgroupLimits {
        CgroupLimits {
            memory_bytes: Some(r.memory_limit_mib << 20),
            cpu_quota_us: r.cpu_percent.map(|p| u64::from(p) * 1000),
            cpu_period_us: r.cpu_percent.map(|_| 100_000),
            pids_max: Some(r.pids_max),
            ..Default::default()
        }
    }

    /// Creates a sandbox from a template or named snapshot; returns when its guest answers.
    pub fn create(&self, req: &CreateRequest) -> Result<SandboxInfo, RuntimeError> {
        let at = now_ms();
        let t0 = Instant::now();
        let args = serde_json::json!({
            "template": req.template, "snapshot": req.snapshot,
            "timeout_secs": req.timeout_secs, "on_timeout": req.on_timeout,
            "metadata": req.metadata, "env_keys": req.env.keys().collect::<Vec<_>>(),
        });
        let mono0 = ember_vmm::report::monotonic_ns();
        let result = self.create_inner(req, None);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut args = args;
        if let Ok(info) = &result {
            if let Some(start) = self.start_info(&info.id, mono0) {
                args["vmm"] = start;
            }
        }
        {
            let mut m = lock(&self.inner.metrics);
            match &result {
                Ok(_) => {
                    m.creates += 1;
                    m.create_ms.observe(ms);
                }
                Err(_) => m.create_failures += 1,
            }
        }
        let id = result.as_ref().ok().map(|i| i.id.clone());
        self.record(at, id.as_deref(), "create", &args, ms, &result, (0, 0));
        result
    }

    fn create_inner(
        &self,
        req: &CreateRequest,
        fork: Option<(&SandboxRow, &Path)>,
    ) -> Result<SandboxInfo, RuntimeError> {
        let cfg = &self.inner.cfg;
        // A fork continues its parent: same source, environment, outputs and shape.
        let src = match fork {
            Some((p, _)) => Source {
                dir: p.source_dir.clone(),
                template: p.template.clone(),
                snapshot: p.snapshot.clone(),
                env: p.env.clone(),
                outputs: p.outputs.clone(),
                vcpus: p.resources.vcpus,
                memory_mib: p.resources.memory_mib,
                disk_mib: p.resources.disk_mib,
            },
            None => self.source(req)?,
        };
        if let Some(v) = req.vcpus.filter(|v| *v != src.vcpus) {
            return Err(RuntimeError::Invalid(format!(
                "vcpus {v}: a restored VM keeps its snapshot's {} (build a template with `[vm] \
                 vcpus = {v}`)",
                src.vcpus
            )));
        }
        if let Some(m) = req.memory_mib.filter(|m| *m != src.memory_mib) {
            return Err(RuntimeError::Invalid(format!(
                "memory_mib {m}: a restored VM keeps its snapshot's {} MiB (build a template with \
                 `[vm] memory_mib = {m}`)",
                src.memory_mib
            )));
        }
        let max_ms = secs(cfg.max_lifetime);
        let timeout_ms = req
            .timeout_secs
            .map(|s| s as i64 * 1000)
            .unwrap_or(secs(cfg.default_timeout));
        if timeout_ms <= 0 || timeout_ms > max_ms {
            return Err(RuntimeError::Invalid(format!(
                "timeout_secs must be 1 to {}",
                max_ms / 1000
            )));
        }
        let lifetime_ms = req
            .max_lifetime_secs
            .map(|s| s as i64 * 1000)
            .unwrap_or(max_ms);
        if lifetime_ms <= 0 || lifetime_ms > max_ms {
            return Err(RuntimeError::Invalid(format!(
                "max_lifetime_secs must be 1 to {}",
                max_ms / 1000
            )));
        }
        if let (Some(p), Some(cap)) = (req.cpu_percent, cfg.max_cpu_percent) {
            if p > cap {
                return Err(RuntimeError::Invalid(format!(
                    "cpu_percent {p} is over the server's cap of {cap}"
                )));
            }
        }
        if req.cpu_percent == Some(0) {
            return Err(RuntimeError::Invalid(
                "cpu_percent must be at least 1".into(),
            ));
        }
        let pids_max = req.pids_max.unwrap_or(cfg.pids_max);
        if pids_max == 0 || pids_max > cfg.pids_max {
            return Err(RuntimeError::Invalid(format!(
                "pids_max must be 1 to {}",
                cfg.pids_max
            )));
        }
        for k in req.env.keys().chain(req.metadata.keys()) {
            if k.is_empty() || k.len() > 256 || k.contains(['=', '\0']) {
                return Err(RuntimeError::Invalid(format!(
                    "invalid env or metadata key {k:?}"
                )));
            }
        }
        if fork.is_none() {
            req.network
                .validate()
                .map_err(|e| RuntimeError::Invalid(format!("network: {e}")))?;
        }
        let resources = Resources {
            vcpus: src.vcpus,
            memory_mib: src.memory_mib,
            disk_mib: src.disk_mib,
            memory_limit_mib: src.memory_mib + cfg.vmm_overhead_mib,
            cpu_percent: req.cpu_percent.or(cfg.max_cpu_percent),
            pids_max,
        };
        let mut env = src.env.clone();
        env.extend(req.env.clone());
        let id = crate::paths::random_id();
        let now = now_ms();
        let row = SandboxRow {
            id: id.clone(),
            template: src.template.clone(),
            snapshot: src.snapshot.clone(),
            forked_from: fork.map(|(p, _)| p.id.clone()),
            source_dir: src.dir.clone(),
            state: State::Creating,
            reason: None,
            created_ms: now,
            ends_ms: Some(now + timeout_ms),
            max_until_ms: Some(now + lifetime_ms),
            ended_ms: None,
            on_timeout: req.on_timeout,
            timeout_ms,
            resources,
            metadata: req.metadata.clone(),
            env,
            outputs: src.outputs.clone(),
            uid: None,
            jail_id: None,
            pid: None,
            pause_dir: None,
            start_ms: None,
            network: SandboxNetwork {
                policy: match fork {
                    Some((p, _)) => p.network.policy.clone(),
                    None => req.network.clone(),
                },
                ports: Vec::new(),
            },
        };
        let slot = Arc::new(Slot {
            id: id.clone(),
            st: Mutex::new(SlotState {
                row: row.clone(),
                vm: None,
                inflight: 0,
                expected_exit: false,
                retiring: None,
                expiring: false,
                paused_ms: None,
            }),
            cv: Condvar::new(),
        });
        // Capacity is checked and the slot reserved under one lock: concurrent creates
        // cannot both take the last place.
        {
            let _gate = lock(&self.inner.capacity);
            let (n, mem) = self.committed();
            let mut slots = lock(&self.inner.slots);
            if n >= cfg.max_running {
                return Err(RuntimeError::Capacity(format!(
                    "{n} sandboxes are running, the server's cap is {}",
                    cfg.max_running
                )));
            }
            if mem + row.resources.memory_mib > cfg.max_committed_memory_mib {
                return Err(RuntimeError::Capacity(format!(
                    "{mem} MiB of guest memory committed; {} more would exceed the server's cap \
                     of {} MiB",
                    row.resources.memory_mib, cfg.max_committed_memory_mib
                )));
            }
            slots.insert(id.clone(), slot.clone());
        }
        if let Err(e) = self.store().insert_sandbox(&row) {
            lock(&self.inner.slots).remove(&id);
            return Err(e.into());
        }
        if let (None, Some(t), None) = (fork, &src.template, &src.snapshot) {
            // A template in use gets a warm pool (no-op when the pool is off).
            self.inner.pool.register(t, &src.dir);
        }
        let restore_dir = fork.map(|(_, d)| d.to_path_buf()).unwrap_or(src.dir);
        self.start_vm(&slot, &restore_dir, "created")?;
        self.wake_timer();
        let info = lock(&slot.st).row.info();
        Ok(info)
    }

    /// Starts the slot's VM from `dir` (state Creating or Resuming) and moves it to Running,
    /// or to Failed (create) / back to Paused (resume) with the reason. A create takes a warm
    /// VMM from the template's pool when one is ready (and fits its limits), else spawns one.
    fn start_vm(&self, slot: &Arc<Slot>, dir: &Path, what: &str) -> Result<(), RuntimeError> {
        let cfg = &self.inner.cfg;
        let (row, from) = {
            let st = lock(&slot.st);
            (st.row.clone(), st.row.state)
        };
        // Starts wait in line when too many guests are starting at once (runtime/gate.rs).
        let Some(admitted) = self.inner.gate.admit(cfg.connect_timeout) else {
            let e = RuntimeError::Capacity(format!(
                "{} VM starts under way for {:?}; none finished (raise `max_starting`, or the \
                 host is overloaded)",
                self.inner.gate.busy(),
                cfg.connect_timeout
            ));
            return self.start_failed(slot, lock(&slot.st), from, None, e);
        };
        let t0 = Instant::now();
        let limits = self.limits(&row.resources);
        // The idle agent connection the snapshot kept (template build, pause, fork, named
        // snapshot): the sandbox's first connection takes it over.
        let kept = crate::agent_link::recorded(dir);
        // A policy other than `none` needs the template's network device.
        let none = row.network.policy.mode == NetMode::None;
        let warm = (from == State::Creating)
            .then(|| {
                self.inner
                    .pool
                    .claim(dir, |w| w.limits == limits && (none || w.net.is_some()))
            })
            .flatten();
        let pooled = warm.is_some();
        let started = match warm {
            Some(w) => self.start_pooled(w, &row, t0, kept),
            None => self.start_fresh(dir, &row, kept),
        };
        let (uid, jail_id, started) = match started {
            Ok((uid, live)) => (Some(uid), live.jail.id.clone(), Ok(live)),
            Err((e, uid)) => (uid, String::new(), Err(e)),
        };
        let queued_ms = admitted.waited.as_secs_f64() * 1e3;
        drop(admitted);
        let started = started.map(|mut live| {
            live.pooled = pooled;
            live.sandbox.set_queued_ms(queued_ms);
            live
        });
        let mut st = lock(&slot.st);
        match started {
            Ok(mut live) => {
                live.sandbox
                    .set_template(row.template.clone(), row.env.clone());
                let pid = live.sandbox.pid();
                let ms = live.sandbox.timings().synced_ms;
                let watcher = lock(&self.inner.watcher).clone();
                if let Some(w) = watcher {
                    if let Err(e) = w.watch(&row.id, &jail_id, &live.sandbox) {
                        tracing::error!("{e}");
                    }
                }
                st.row.uid = uid;
                st.row.jail_id = Some(jail_id);
                st.row.pid = pid;
                st.row.start_ms = Some(ms);
                st.vm = Some(Arc::new(live));
                st.expected_exit = false;
                self.transition(slot, &mut st, State::Running, Some(what.to_string()));
                Ok(())
            }
            Err(e) => self.start_failed(slot, st, from, uid, e),
        }
    }

    /// A start that failed: the slot goes back to Paused (resume) or to Failed (create).
    fn start_failed(
        &self,
        slot: &Arc<Slot>,
        mut st: MutexGuard<'_, SlotState>,
        from: State,
        uid: Option<u32>,
        e: RuntimeError,
    ) -> Result<(), RuntimeError> {
        self.free_uid(uid);
        st.row.uid = None;
        st.row.jail_id = None;
        if from == State::Resuming {
            self.transition(
                slot,
                &mut st,
                State::Paused,
                Some(format!("resume failed: {e}")),
            );
        } else {
            self.transition(slot, &mut st, State::Failed, Some(e.to_string()));
            drop(st);
            lock(&self.inner.slots).remove(&slot.id);
            let _ = std::fs::remove_dir_all(self.inner.cfg.sandbox_dir(&slot.id));
        }
        Err(e)
    }

    /// A fresh jailed VMM for the slot: uid, namespace, jail, spawn (the path without a pool).
    fn start_fresh(
        &self,
        dir: &Path,
        row: &SandboxRow,
        kept: Option<crate::agent_link::KeptConnection>,
    ) -> Result<(u32, Live), (RuntimeError, Option<u32>)> {
        let uid = self.alloc_uid().map_err(|e| (e, None))?;
        let jail_id = format!("{}-{}", row.id, &crate::paths::random_id()[..6]);
        // A template's snapshot (taken on the host) holds host paths; the snapshots the
        // runtime writes carry them in `ember-disks.json`.
        jailed::snapshot_disks(dir)
            .and_then(|disks| {
                let net = self.setup_net(dir, &jail_id, uid, &row.network.policy)?;
                let spec = StartSpec {
                    id: &row.id,
                    jail_id: &jail_id,
                    uid,
                    snapshot: dir,
                    disks: &disks,
                    limits: self.limits(&row.resources),
                    net: net.clone(),
                    kept,
                };
                jailed::start(&self.inner.cfg, &self.inner.bins, &spec).inspect_err(|_| {
                    if let Some(n) = &net {
                        self.inner.net.teardown(n);
                    }
                })
            })
            .map(|live| (uid, live))
            .map_err(|e| (e, Some(uid)))
    }

    /// The slot's VM from a warm pool member: the sandbox's network policy replaces the
    /// member's `none`, then the member restores.
    fn start_pooled(
        &self,
        w: super::pooled::WarmVmm,
        row: &SandboxRow,
        t0: Instant,
        kept: Option<crate::agent_link::KeptConnection>,
    ) -> Result<(u32, Live), (RuntimeError, Option<u32>)> {
        let uid = w.uid;
        if let Some(net) = &w.net {
            if row.network.policy.mode != NetMode::None {
                if let Err(e) = self.inner.net.update(net, &row.network.policy) {
                    let net = net.clone();
                    // Back to the pool's filler for release: simplest is to claim-and-fail.
                    let err = match e {
                        crate::netpolicy::NetError::NoUplink
                        | crate::netpolicy::NetError::Config(_) => {
                            RuntimeError::Invalid(e.to_string())
                        }
                        e => RuntimeError::Internal(e.to_string()),
                    };
                    let _ = net;
                    // Its uid and namespace go with it.
                    self.inner.pool.discard(w);
                    return Err((err, None));
                }
            }
        }
        let state = self.inner.cfg.sandbox_dir(&row.id);
        w.claim(&row.id, &state, t0, self.inner.cfg.connect_timeout, kept)
            .map(|live| (uid, live))
            .map_err(|(e, uid, net)| {
                if let Some(n) = &net {
                    self.inner.net.teardown(n);
                }
                (e, Some(uid))
            })
    }

    /// How a sandbox's VMM started (pool or fresh) and, from its report, how long after
    /// `mono0` (the create request) its first vCPU entered KVM_RUN.
    fn start_info(&self, id: &str, mono0: u64) -> Option<serde_json::Value> {
        let slot = lock(&self.inner.slots).get(id).cloned()?;
        let vm = lock(&slot.st).vm.clone()?;
        let report = std::fs::read_to_string(vm.host_path("/work/report.jsonl")).ok()?;
        let mut first_run = None;
        let mut restore_ms = None;
        // When the VMM began the restore: its process start (fresh) or the restore
        // request (pool).
        let mut began = None;
        let mut vcpus_started = None;
        let mut steps = serde_json::Value::Null;
        for line in report.lines() {
            let Ok(ev) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            match ev["event"].as_str() {
                Some("vcpu_first_run") if first_run.is_none() => first_run = ev["mono_ns"].as_u64(),
                Some("built") => restore_ms = ev["ms_since_start"].as_f64(),
                // A pooled VMM restored ahead: its critical path begins at `start`.
                Some("start") | Some("restore_request") | Some("start_request") => {
                    began = ev["mono_ns"].as_u64()
                }
                Some("vcpus_started") => vcpus_started = ev["mono_ns"].as_u64(),
                Some("restore_steps") => steps = ev["ms"].clone(),
                _ => {}
            }
        }
        let to_first_run_ms = first_run.map(|ns| ns.saturating_sub(mono0) as f64 / 1e6);
        Some(serde_json::json!({
            "path": if vm.pooled { "pool" } else { "fresh" },
            "to_first_run_ms": to_first_run_ms,
            "first_run_mono_ns": first_run,
            "vmm_began_mono_ns": began,
            "vcpus_started_mono_ns": vcpus_started,
            "restore_steps_ms": steps,
            "restore_ms": restore_ms,
            "synced_ms": vm.sandbox.timings().synced_ms,
            "queued_ms": vm.sandbox.timings().queued_ms,
            // How the first agent connection was made: `attached` (the snapshot's kept
            // connection), `connected` (none recorded) or `fallback` (with the reason).
            "agent": vm.sandbox.link(),
        }))
    }

    /// Called by the watcher when a VMM exited.
    pub(super) fn vmm_exited(&self, id: &str, jail_id: &str) {
        let Some(slot) = lock(&self.inner.slots).get(id).cloned() else {
            return;
        };
        let mut st = lock(&slot.st);
        let ours = st.vm.as_ref().is_some_and(|v| v.jail.id == jail_id);
        // A pausing sandbox's VMM exits when its snapshot is written (before `stop_vm` can
        // mark the exit expected); a failed snapshot is handled by the pause itself.
        if !ours || st.expected_exit || st.row.state == State::Pausing {
            return;
        }
        let Some(vm) = st.vm.take() else { return };
        let status = vm.sandbox.exit_status().unwrap_or_else(|| "exited".into());
        let ooms = jailed::oom_kills(&vm.jail);
        let _ = vm.sandbox.kill();
        let released = jailed::release_jail(&vm.jail);
        if let Some(net) = &vm.net {
            self.inner.net.teardown(net);
        }
        let mut reason = format!("the VMM died unexpectedly ({status})");
        if ooms > 0 {
            reason.push_str(&format!(
                "; its cgroup recorded {ooms} OOM kill(s) (memory limit {} MiB)",
                st.row.resources.memory_limit_mib
            ));
        }
        if let Err(e) = released {
            reason.push_str(&format!("; {e}"));
        }
        tracing::warn!("sandbox {id}: {reason}");
        self.free_uid(st.row.uid.take());
        st.row.jail_id = None;
        // Everything is released before the state says so.
        let _ = std::fs::remove_dir_all(self.inner.cfg.sandbox_dir(id));
        lock(&self.inner.metrics).vmm_failures += 1;
        self.transition(&slot, &mut st, State::Failed, Some(reason));
        drop(st);
        lock(&self.inner.slots).remove(id);
    }

    /// Stops the slot's VMM on purpose and releases its jail (state unchanged).
    fn stop_vm(&self, st: &mut SlotState) {
        st.expected_exit = true;
        if let Some(vm) = st.vm.take() {
            self.release_vm(&st.row.id, &vm);
        }
        self.free_uid(st.row.uid.take());
        st.row.jail_id = None;
        st.row.pid = None;
    }

    /// [`Self::stop_vm`] for a VMM whose work is done (a pause snapshot is on disk): the slot
    /// lets go of it at once and a thread kills it and releases its jail, network and uid, off
    /// the caller's path (the kernel's teardown of a VM and of a network namespace take tens
    /// of milliseconds). [`Self::settle`], which every later operation on the slot goes
    /// through, waits for that thread first.
    fn retire_vm(&self, st: &mut SlotState) {
        st.expected_exit = true;
        let uid = st.row.uid.take();
        st.row.jail_id = None;
        st.row.pid = None;
        let Some(vm) = st.vm.take() else {
            self.free_uid(uid);
            return;
        };
        let (rt, id, theirs) = (self.clone(), st.row.id.clone(), Arc::clone(&vm));
        let spawned = std::thread::Builder::new()
            .name("ember-retire".into())
            .spawn(move || {
                rt.release_vm(&id, &theirs);
                rt.free_uid(uid);
            });
        match spawned {
            Ok(handle) => st.retiring = Some(handle),
            Err(e) => {
                tracing::warn!("sandbox {}: stopping its VM inline: {e}", st.row.id);
                self.release_vm(&st.row.id, &vm);
                self.free_uid(uid);
            }
        }
    }

    /// Kills a VMM the slot no longer holds and releases its jail and network.
    fn release_vm(&self, id: &str, vm: &Live) {
        let mut phases = Timings::new();
        let _ = vm.sandbox.kill();
        phases.mark("kill");
        if let Err(e) = jailed::release_jail(&vm.jail) {
            tracing::error!("sandbox {id}: {e}");
        }
        phases.mark("jail");
        if let Some(net) = &vm.net {
            self.audit_net_drops(id, net);
            self.inner.net.teardown(net);
        }
        phases.mark("network");
        tracing::debug!("sandbox {id}: VM stopped: {}", phases.summary());
    }

    /// Waits while the sandbox is in a transient state.
    fn settle<'a>(
        &self,
        slot: &'a Slot,
        mut st: std::sync::MutexGuard<'a, SlotState>,
    ) -> std::sync::MutexGuard<'a, SlotState> {
        // A VMM retired by a pause is gone, with its jail and network, before anything else
        // happens to the sandbox (the thread never takes a slot lock).
        if let Some(retiring) = st.retiring.take() {
            if retiring.join().is_err() {
                tracing::error!("sandbox {}: stopping its VM panicked", st.row.id);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(600);
        while matches!(
            st.row.state,
            State::Creating | State::Pausing | State::Resuming
        ) && Instant::now() < deadline
        {
            st = slot
                .cv
                .wait_timeout(st, Duration::from_secs(1))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st
    }

    /// Waits (up to 30 s) for calls in flight to finish.
    fn drain<'a>(
        &self,
        slot: &'a Slot,
        mut st: std::sync::MutexGuard<'a, SlotState>,
    ) -> std::sync::MutexGuard<'a, SlotState> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while st.inflight > 0 && Instant::now() < deadline {
            st = slot
                .cv
                .wait_timeout(st, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st
    }

    /// Kills a sandbox (its artifacts are copied out first).
    pub fn kill(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        self.timed(Some(id), "kill", serde_json::json!({}), || {
            self.stop(id, "killed by request")
        })
    }

    pub(super) fn stop(&self, id: &str, reason: &str) -> Result<SandboxInfo, RuntimeError> {
        let slot = match self.slot(id) {
            Ok(s) => s,
            Err(RuntimeError::Conflict { .. }) => return self.get(id),
            Err(e) => return Err(e),
        };
        let st = lock(&slot.st);
        let mut st = self.settle(&slot, st);
        if st.row.state.is_final() {
            return Ok(st.row.info());
        }
        if let Some(vm) = st.vm.clone() {
            let row = st.row.clone();
            drop(st);
            if let Err(e) = self.collect_from(&row, &vm) {
                tracing::warn!("sandbox {id}: artifacts not collected: {e}");
            }
            st = lock(&slot.st);
        }
        self.stop_vm(&mut st);
        if let Some(dir) = st.row.pause_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
        self.transition(&slot, &mut st, State::Stopped, Some(reason.to_string()));
        let info = st.row.info();
        drop(st);
        lock(&self.inner.slots).remove(id);
        let _ = std::fs::remove_dir_all(self.inner.cfg.sandbox_dir(id));
        Ok(info)
    }

    /// Pauses a sandbox: its artifacts are copied out, its VM is snapshotted to
    /// `$EMBER_HOME/sandboxes/<id>/pause`, its VMM exits (memory freed). Calls in flight are
    /// waited for (30 s at most); calls that arrive meanwhile wait, then resume it.
    pub fn pause(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        self.timed(Some(id), "pause", serde_json::json!({}), || {
            self.pause_inner(id, "paused by request")
        })
    }

    pub(super) fn pause_inner(&self, id: &str, reason: &str) -> Result<SandboxInfo, RuntimeError> {
        let slot = self.slot(id)?;
        let st = lock(&slot.st);
        let mut st = self.settle(&slot, st);
        match st.row.state {
            State::Running => {}
            State::Paused => return Ok(st.row.info()),
            s => {
                return Err(RuntimeError::conflict(
                    id,
                    s,
                    "only a running sandbox can pause",
                ))
            }
        }
        // Where a pause's time goes, for the log line at the end.
        let mut phases = Timings::new();
        self.transition(&slot, &mut st, State::Pausing, Some(reason.to_string()));
        let st = self.drain(&slot, st);
        phases.mark("drain");
        let Some(vm) = st.vm.clone() else {
            return Err(RuntimeError::Internal(format!("sandbox {id} has no VM")));
        };
        let row = st.row.clone();
        drop(st);
        if let Err(e) = self.collect_from(&row, &vm) {
            tracing::warn!("sandbox {id}: artifacts not collected: {e}");
        }
        phases.mark("artifacts");
        let dest = self.inner.cfg.sandbox_dir(id).join("pause");
        let snap = self.pause_snapshot(&vm, &row, &dest);
        phases.mark("snapshot");
        let mut st = lock(&slot.st);
        match snap {
            Ok(()) => {
                self.retire_vm(&mut st);
                phases.mark("stop");
                st.row.pause_dir = Some(dest);
                self.transition(&slot, &mut st, State::Paused, Some(reason.to_string()));
                phases.mark("record");
                tracing::info!("sandbox {id}: paused: {}", phases.summary());
                Ok(st.row.info())
            }
            Err(e) => {
                // The VM may still run (the snapshot failed before it exited): keep it.
                let alive = st
                    .vm
                    .as_ref()
                    .is_some_and(|v| v.sandbox.exit_status().is_none());
                if alive {
                    self.transition(
                        &slot,
                        &mut st,
                        State::Running,
                        Some(format!("pause failed: {e}")),
                    );
                } else {
                    self.stop_vm(&mut st);
                    self.transition(
                        &slot,
                        &mut st,
                        State::Failed,
                        Some(format!("pause failed: {e}")),
                    );
                    drop(st);
                    lock(&self.inner.slots).remove(id);
                }
                Err(e)
            }
        }
    }

    /// Writes a pause snapshot into `dest`: a layer (only the pages the VM changed since it
    /// was restored, over a hard link to the memory file it was restored from, so a template
    /// rebuild cannot break it), or a full snapshot when a layer cannot be made (the base is
    /// on another filesystem, or gone). Leaves the VMM paused or exited for `stop_vm`.
    fn pause_snapshot(&self, vm: &Live, row: &SandboxRow, dest: &Path) -> Result<(), RuntimeError> {
        use ember_vmm::api::{AfterSnapshot, SnapshotKind};
        let layered = self
            .snapshot_to(vm, row, dest, SnapshotKind::Layer, AfterSnapshot::Pause)
            .and_then(|()| self.link_pause_base(vm, row, dest));
        match layered {
            Ok(()) => Ok(()),
            Err(e) => {
                tracing::info!(
                    "sandbox {}: no layered pause ({e}); taking a full snapshot",
                    row.id
                );
                self.snapshot_to(vm, row, dest, SnapshotKind::Full, AfterSnapshot::Exit)
            }
        }
    }

    /// Hard-links the base memory file of the layered snapshot in `dest` into it. The VMM
    /// names the base as it sees it in its jail: found on the host through the jail's bind
    /// mounts, or as the base a resume kept in the sandbox's directory (the pause snapshot it
    /// came from is gone by then). The link must be the file the layer was taken over.
    fn link_pause_base(
        &self,
        vm: &Live,
        row: &SandboxRow,
        dest: &Path,
    ) -> Result<(), RuntimeError> {
        let layer = ember_snapshot::read_layer(dest)
            .map_err(|e| RuntimeError::Internal(e.to_string()))?
            .ok_or_else(|| {
                RuntimeError::Internal(format!("{} is not a layered snapshot", dest.display()))
            })?;
        let kept = self
            .inner
            .cfg
            .sandbox_dir(&row.id)
            .join(ember_snapshot::BASE_MEMORY_FILE);
        let mut candidates: Vec<PathBuf> = vm
            .jail
            .binds
            .iter()
            .filter_map(|b| {
                let rest = layer.base_path.strip_prefix(&b.dest).ok()?;
                Some(b.src.join(rest))
            })
            .collect();
        candidates.push(kept.clone());
        let mut why = Vec::new();
        for c in &candidates {
            match ember_snapshot::link_base(dest, &layer, c) {
                Ok(_) => {
                    // The previous pause's base, if any, is now linked here.
                    let _ = std::fs::remove_file(&kept);
                    return Ok(());
                }
                Err(e) => why.push(e.to_string()),
            }
        }
        Err(RuntimeError::Internal(format!(
            "sandbox {}: cannot keep the base memory file {} of its pause: {}",
            row.id,
            layer.base_path.display(),
            why.join("; ")
        )))
    }

    /// Snapshots the VM into the host directory `dest` (through its jail's /work), with
    /// the host paths of its disks recorded.
    fn snapshot_to(
        &self,
        vm: &Live,
        row: &SandboxRow,
        dest: &Path,
        kind: ember_vmm::api::SnapshotKind,
        after: ember_vmm::api::AfterSnapshot,
    ) -> Result<(), RuntimeError> {
        let name = format!("snap-{}", &crate::paths::random_id()[..8]);
        let in_jail = PathBuf::from("/work").join(&name);
        let host = vm.host_path(&format!("/work/{name}"));
        // One idle agent connection is held out of the pool through the snapshot, so that the
        // snapshot keeps it with nothing in flight; restores of it take it over. Without one
        // (the agent does not answer) the snapshot is taken all the same and its restores
        // connect anew.
        let held = match vm.sandbox.hold_connection() {
            Ok(h) => Some(h),
            Err(e) => {
                tracing::info!(
                    "sandbox {}: snapshot without a kept agent connection: {e}",
                    row.id
                );
                None
            }
        };
        let reply = ember_vmm::api::call(
            vm.sandbox.api_socket(),
            &ember_vmm::api::Request::Snapshot {
                dir: in_jail,
                kind,
                after,
            },
        )
        .map_err(|m| RuntimeError::Internal(format!("sandbox {}: snapshot: {m}", row.id)))?;
        if reply["ok"] != true {
            let _ = std::fs::remove_dir_all(&host);
            return Err(RuntimeError::Internal(format!(
                "sandbox {}: snapshot refused: {reply}",
                row.id
            )));
        }
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(RuntimeError::io("cannot create", parent))?;
        }
        let _ = std::fs::remove_dir_all(dest);
        if std::fs::rename(&host, dest).is_err() {
            copy_dir(&host, dest)?;
            let _ = std::fs::remove_dir_all(&host);
        }
        jailed::write_disks(dest, &vm.disks)?;
        if let Some(h) = held {
            crate::agent_link::record(dest, h.kept()).map_err(RuntimeError::io(
                "cannot write the kept-connection record in",
                dest,
            ))?;
        }
        let meta = SnapshotMeta {
            env: row.env.clone(),
            outputs: row.outputs.clone(),
            resources: row.resources.clone(),
        };
        let f = dest.join("ember-snapshot.json");
        std::fs::write(&f, serde_json::to_vec(&meta).unwrap_or_default())
            .map_err(RuntimeError::io("cannot write", &f))?;
        Ok(())
    }

    /// Resumes a paused sandbox (a no-op for a running one).
    pub fn resume(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        self.timed(Some(id), "resume", serde_json::json!({}), || {
            self.resume_inner(id)
        })
    }

    fn resume_inner(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        let slot = self.slot(id)?;
        let gate = lock(&self.inner.capacity);
        let (n, mem) = self.committed();
        let st = lock(&slot.st);
        let mut st = self.settle(&slot, st);
        match st.row.state {
            State::Paused => {}
            State::Running => return Ok(st.row.info()),
            s => {
                return Err(RuntimeError::conflict(
                    id,
                    s,
                    "only a paused sandbox can resume",
                ))
            }
        }
        let Some(dir) = st.row.pause_dir.clone() else {
            return Err(RuntimeError::Internal(format!(
                "sandbox {id} is paused without a snapshot"
            )));
        };
        {
            let cfg = &self.inner.cfg;
            if n >= cfg.max_running
                || mem + st.row.resources.memory_mib > cfg.max_committed_memory_mib
            {
                return Err(RuntimeError::Capacity(format!(
                    "cannot resume {id}: {n} sandboxes running with {mem} MiB committed (caps {} \
                     and {} MiB)",
                    cfg.max_running, cfg.max_committed_memory_mib
                )));
            }
        }
        // A resumed sandbox gets a fresh timeout.
        st.row.ends_ms = Some(now_ms() + st.row.timeout_ms);
        self.transition(&slot, &mut st, State::Resuming, None);
        drop(st);
        drop(gate);
        self.start_vm(&slot, &dir, "resumed")?;
        let mut st = lock(&slot.st);
        st.row.pause_dir = None;
        let _ = self.store().update_sandbox(&st.row);
        let info = st.row.info();
        drop(st);
        // The restored VM has mapped what it needs; the snapshot can go. A layered one's
        // base is kept in the sandbox's directory: the next pause links it again.
        let base = dir.join(ember_snapshot::BASE_MEMORY_FILE);
        if base.exists() {
            let kept = self
                .inner
                .cfg
                .sandbox_dir(id)
                .join(ember_snapshot::BASE_MEMORY_FILE);
            if let Err(e) = std::fs::rename(&base, &kept) {
                tracing::warn!("sandbox {id}: cannot keep {}: {e}", base.display());
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        self.wake_timer();
        Ok(info)
    }

    /// Sets a sandbox's timeout to `secs` from now (and what expiry does, when given).
    pub fn set_timeout(
        &self,
        id: &str,
        secs: u64,
        on_timeout: Option<OnTimeout>,
    ) -> Result<SandboxInfo, RuntimeError> {
        let max = self.inner.cfg.max_lifetime.as_secs();
        if secs == 0 || secs > max {
            return Err(RuntimeError::Invalid(format!(
                "timeout must be 1 to {max} seconds"
            )));
        }
        let slot = self.slot(id)?;
        let mut st = lock(&slot.st);
        st.row.timeout_ms = secs as i64 * 1000;
        st.row.ends_ms = Some(now_ms() + st.row.timeout_ms);
        if let Some(o) = on_timeout {
            st.row.on_timeout = o;
        }
        self.store().update_sandbox(&st.row)?;
        let info = st.row.info();
        drop(st);
        self.record(
            now_ms(),
            Some(id),
            "set_timeout",
            &serde_json::json!({ "timeout_secs": secs }),
            0.0,
            &Ok::<(), RuntimeError>(()),
            (0, 0),
        );
        self.wake_timer();
        Ok(info)
    }

    /// Takes a durable named snapshot (memory and disk) of a running sandbox, which keeps
    /// running. `create` accepts the name as `snapshot`.
    pub fn snapshot(&self, id: &str, req: &SnapshotRequest) -> Result<SnapshotInfo, RuntimeError> {
        let name = req
            .name
            .clone()
            .unwrap_or_else(|| format!("{id}-{}", now_ms()));
        check_name(&name)?;
        if self.store().snapshot(&name)?.is_some() {
            return Err(RuntimeError::Invalid(format!(
                "a snapshot named {name:?} exists"
            )));
        }
        let dest = self.inner.cfg.snapshots_dir().join(&name);
        self.audited(
            id,
            "snapshot",
            serde_json::json!({ "name": name }),
            |vm, _| {
                let row = self.row(id)?;
                self.snapshot_to(
                    vm,
                    &row,
                    &dest,
                    ember_vmm::api::SnapshotKind::Full,
                    ember_vmm::api::AfterSnapshot::Continue,
                )?;
                let info = SnapshotInfo {
                    name: name.clone(),
                    sandbox: id.to_string(),
                    template: row.template.clone(),
                    created_at: rfc3339(now_ms()),
                    bytes: dir_bytes(&dest),
                };
                self.store().put_snapshot(&info, &dest, now_ms())?;
                Ok(info)
            },
        )
    }

    /// Named snapshots.
    pub fn snapshots(&self) -> Result<Vec<SnapshotInfo>, RuntimeError> {
        Ok(self.store().snapshots()?)
    }

    /// Deletes a named snapshot (sandboxes restored from it are not affected).
    pub fn delete_snapshot(&self, name: &str) -> Result<(), RuntimeError> {
        check_name(name)?;
        let Some((_, dir)) = self.store().snapshot(name)? else {
            return Err(RuntimeError::NoSuchSnapshot(format!(
                "no snapshot {name:?}"
            )));
        };
        self.store().delete_snapshot(name)?;
        let _ = std::fs::remove_dir_all(dir);
        Ok(())
    }

    fn row(&self, id: &str) -> Result<SandboxRow, RuntimeError> {
        Ok(lock(&self.slot(id)?.st).row.clone())
    }

    /// Forks a running sandbox into `count` new ones that continue from its current state
    /// (each with its own overlay, clock, entropy and vsock). The parent pauses only for the
    /// snapshot and keeps running.
    pub fn fork(&self, id: &str, req: &ForkRequest) -> Result<Vec<SandboxInfo>, RuntimeError> {
        if req.count == 0 || req.count > 64 {
            return Err(RuntimeError::Invalid("count must be 1 to 64".into()));
        }
        let dir = self
            .inner
            .cfg
            .home
            .join("forks")
            .join(crate::paths::random_id());
        let parent = self.audited(
            id,
            "fork",
            serde_json::json!({ "count": req.count }),
            |vm, _| {
                let row = self.row(id)?;
                self.snapshot_to(
                    vm,
                    &row,
                    &dir,
                    ember_vmm::api::SnapshotKind::Full,
                    ember_vmm::api::AfterSnapshot::Continue,
                )?;
                Ok(row)
            },
        )?;
        let create = CreateRequest {
            template: parent.template.clone(),
            timeout_secs: Some(
                req.timeout_secs
                    .unwrap_or((parent.timeout_ms / 1000).max(1) as u64),
            ),
            on_timeout: parent.on_timeout,
            cpu_percent: parent.resources.cpu_percent,
            pids_max: Some(parent.resources.pids_max),
            env: BTreeMap::new(),
            metadata: req.metadata.clone().unwrap_or(parent.metadata.clone()),
            ..Default::default()
        };
        let results: Vec<Result<SandboxInfo, RuntimeError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..req.count)
                .map(|_| {
                    let create = &create;
                    let dir = &dir;
                    let parent = &parent;
                    s.spawn(move || {
                        let at = now_ms();
                        let t0 = Instant::now();
                        let r = self.create_fork(create, parent, dir);
                        let child = r.as_ref().ok().map(|i| i.id.clone());
                        self.record(
                            at,
                            child.as_deref(),
                            "create",
                            &serde_json::json!({ "forked_from": parent.id }),
                            t0.elapsed().as_secs_f64() * 1e3,
                            &r,
                            (0, 0),
                        );
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(RuntimeError::Internal("fork thread panicked".into()))
                    })
                })
                .collect()
        });
        // Every clone has mapped the snapshot: it can go.
        let _ = std::fs::remove_dir_all(&dir);
        let mut out = Vec::new();
        for r in results {
            match r {
                Ok(i) => out.push(i),
                Err(e) => {
                    for i in &out {
                        let _ = self.stop(&i.id, "fork failed");
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    fn create_fork(
        &self,
        req: &CreateRequest,
        parent: &SandboxRow,
        dir: &Path,
    ) -> Result<SandboxInfo, RuntimeError> {
        self.create_inner(req, Some((parent, dir)))
    }

    /// Starts the timer thread: timeouts, max lifetimes, paused retention, record retention.
    pub(super) fn start_timer(&self) -> Result<(), RuntimeError> {
        let weak = Arc::downgrade(&self.inner);
        let timer = self.inner.timer.clone();
        std::thread::Builder::new()
            .name("ember-timer".into())
            .spawn(move || {
                let mut last_purge = Instant::now() - Duration::from_secs(3600);
                loop {
                    // The runtime is held only for the pass, never while waiting: when its
                    // last user drops it, it goes (and kills its sandboxes if so configured)
                    // at once, not at the next tick — nor never, if the process exits first.
                    let next = {
                        let Some(inner) = weak.upgrade() else { return };
                        let rt = Runtime { inner };
                        let next = rt.tick();
                        if last_purge.elapsed() > Duration::from_secs(600) {
                            last_purge = Instant::now();
                            rt.purge_expired_records();
                        }
                        next
                    };
                    let (m, cv) = &*timer;
                    let mut woken = lock(m);
                    if !*woken {
                        woken = cv
                            .wait_timeout(woken, next.min(Duration::from_secs(1)))
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                    *woken = false;
                }
            })
            .map_err(|e| RuntimeError::Internal(format!("cannot start the timer: {e}")))?;
        Ok(())
    }

    /// One pass of the timer: starts the due actions on their own threads; returns how long
    /// until the next deadline.
    fn tick(&self) -> Duration {
        let now = now_ms();
        let mut next = i64::MAX;
        let slots: Vec<Arc<Slot>> = lock(&self.inner.slots).values().cloned().collect();
        let retention = self.inner.cfg.paused_retention.as_millis() as i64;
        for slot in slots {
            let mut st = lock(&slot.st);
            if st.expiring {
                continue;
            }
            let action = match st.row.state {
                State::Running => {
                    let lifetime = st.row.max_until_ms.unwrap_or(i64::MAX);
                    let ends = st.row.ends_ms.unwrap_or(i64::MAX);
                    if lifetime <= now {
                        Some((OnTimeout::Kill, "max lifetime reached"))
                    } else if ends <= now {
                        Some((st.row.on_timeout, "timeout"))
                    } else {
                        next = next.min(ends.min(lifetime));
                        None
                    }
                }
                State::Paused => {
                    let paused_at = st.paused_ms.unwrap_or(now);
                    let expiry = paused_at + retention;
                    let lifetime = st.row.max_until_ms.unwrap_or(i64::MAX);
                    if expiry <= now {
                        Some((OnTimeout::Kill, "paused retention ended"))
                    } else if lifetime <= now {
                        Some((OnTimeout::Kill, "max lifetime reached"))
                    } else {
                        None
                    }
                }
                _ => None,
            };
            if let Some((what, why)) = action {
                st.expiring = true;
                drop(st);
                let rt = self.clone();
                let slot = slot.clone();
                let _ = std::thread::Builder::new()
                    .name("ember-expire".into())
                    .spawn(move || {
                        let at = now_ms();
                        let t0 = Instant::now();
                        let r = match what {
                            OnTimeout::Kill => rt.stop(&slot.id, why).map(drop),
                            OnTimeout::Pause => rt.pause_inner(&slot.id, why).map(drop),
                        };
                        rt.record(
                            at,
                            Some(&slot.id),
                            match what {
                                OnTimeout::Kill => "timeout_kill",
                                OnTimeout::Pause => "timeout_pause",
                            },
                            &serde_json::json!({ "reason": why }),
                            t0.elapsed().as_secs_f64() * 1e3,
                            &r,
                            (0, 0),
                        );
                        if let Err(e) = r {
                            tracing::error!("sandbox {}: {why}: {e}", slot.id);
                        }
                        lock(&slot.st).expiring = false;
                    });
            }
        }
        if next == i64::MAX {
            Duration::from_secs(1)
        } else {
            Duration::from_millis((next - now).clamp(10, 1000) as u64)
        }
    }

    /// Deletes records and artifacts of sandboxes that ended longer ago than the record
    /// retention.
    fn purge_expired_records(&self) {
        let before = now_ms() - self.inner.cfg.record_retention.as_millis() as i64;
        let ids = match self.store().ended_before(before) {
            Ok(ids) => ids,
            Err(e) => {
                tracing::error!("cannot list expired records: {e}");
                return;
            }
        };
        for id in ids {
            let _ = std::fs::remove_dir_all(self.inner.cfg.artifacts_dir(&id));
            if let Err(e) = self.store().purge_sandbox(&id) {
                tracing::error!("cannot purge sandbox {id}: {e}");
            }
        }
    }

    /// At open: re-attach VMMs that still run, put sandboxes caught mid-transition into a
    /// state that is true, and remove jails, cgroups and directories nothing refers to.
    pub(super) fn reclaim(&self) -> Result<(), RuntimeError> {
        let cfg = &self.inner.cfg;
        let bins = &self.inner.bins;
        let rows = self.store().sandboxes(true)?;
        let mut keep_jails = std::collections::HashSet::new();
        for mut row in rows {
            let id = row.id.clone();
            let slot = Arc::new(Slot {
                id: id.clone(),
                st: Mutex::new(SlotState {
                    row: row.clone(),
                    vm: None,
                    inflight: 0,
                    expected_exit: false,
                    retiring: None,
                    expiring: false,
                    paused_ms: None,
                }),
                cv: Condvar::new(),
            });
            let adopted = match (row.state, &row.jail_id, row.pid) {
                (State::Running | State::Pausing, Some(j), Some(pid)) => {
                    jailed::adopt(cfg, bins, &id, j, pid, &row.source_dir).ok()
                }
                _ => None,
            };
            let mut st = lock(&slot.st);
            match (row.state, adopted) {
                (State::Running | State::Pausing, Some(mut live)) => {
                    let jail_id = live.jail.id.clone();
                    keep_jails.insert(jail_id.clone());
                    match self.inner.net.adopt(&jail_id, &row.network.policy) {
                        Ok(net) => live.net = net,
                        Err(e) => tracing::error!("sandbox {id}: its network: {e}"),
                    }
                    if let Some(w) = lock(&self.inner.watcher).clone() {
                        let _ = w.watch(&id, &jail_id, &live.sandbox);
                    }
                    live.sandbox
                        .set_template(row.template.clone(), row.env.clone());
                    st.vm = Some(Arc::new(live));
                    if let Some(u) = row.uid {
                        lock(&self.inner.uids).insert(u);
                    }
                    if row.state == State::Pausing {
                        self.transition(
                            &slot,
                            &mut st,
                            State::Running,
                            Some(
                                "re-attached after a server restart (its pause was cut off)".into(),
                            ),
                        );
                    } else {
                        let _ = self.store().add_transition(
                            &id,
                            Some(State::Running),
                            State::Running,
                            Some("re-attached after a server restart"),
                        );
                    }
                }
                (State::Paused, _) if row.pause_dir.as_ref().is_some_and(|d| d.is_dir()) => {
                    st.paused_ms = self
                        .store()
                        .transitions(&id)
                        .ok()
                        .and_then(|h| h.last().map(|t| t.at.clone()))
                        .and_then(|t| humantime::parse_rfc3339(&t).ok())
                        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                        .map(|d| d.as_millis() as i64);
                }
                (State::Resuming, _) if row.pause_dir.as_ref().is_some_and(|d| d.is_dir()) => {
                    if let Some(j) = &row.jail_id {
                        jailed::kill_cgroup(cfg, j);
                    }
                    row.jail_id = None;
                    row.pid = None;
                    st.row = row.clone();
                    self.transition(
                        &slot,
                        &mut st,
                        State::Paused,
                        Some("the server restarted during its resume".into()),
                    );
                }
                (state, _) => {
                    if let Some(j) = &row.jail_id {
                        jailed::kill_cgroup(cfg, j);
                    }
                    st.row.pid = None;
                    st.row.jail_id = None;
                    self.transition(
                        &slot,
                        &mut st,
                        State::Failed,
                        Some(format!(
                            "found {} when the server restarted, but its VMM was gone",
                            state.as_str()
                        )),
                    );
                    drop(st);
                    let _ = std::fs::remove_dir_all(cfg.sandbox_dir(&id));
                    continue;
                }
            }
            drop(st);
            lock(&self.inner.slots).insert(id, slot);
        }
        // Jails (and their cgroups) nothing refers to.
        let mut orphans = std::collections::BTreeSet::new();
        if let Ok(entries) = std::fs::read_dir(cfg.jails_dir()) {
            for e in entries.flatten() {
                orphans.insert(e.file_name().to_string_lossy().into_owned());
            }
        }
        orphans.extend(jailed::cgroup_jail_ids(cfg));
        for j in orphans.difference(&keep_jails.iter().cloned().collect()) {
            if ember_jailer::config::validate_id(j).is_err() {
                continue;
            }
            tracing::warn!("reclaiming orphaned jail {j}");
            jailed::kill_cgroup(cfg, j);
            let jail = jailed::jail_config_for(cfg, bins, j);
            if let Err(e) = jailed::release_jail(&jail) {
                tracing::error!("{e}");
            }
        }
        // Network namespaces no re-attached VM uses (their veths, TAPs and rules go with them).
        let keep_ns: std::collections::BTreeSet<String> = lock(&self.inner.slots)
            .values()
            .filter_map(|s| {
                lock(&s.st)
                    .vm
                    .as_ref()
                    .and_then(|v| v.net.as_ref())
                    .map(|n| n.name.clone())
            })
            .collect();
        let reclaimed = self.inner.net.reclaim(&keep_ns);
        if reclaimed > 0 {
            tracing::warn!("reclaimed {reclaimed} orphaned sandbox network namespace(s)");
        }
        // State directories of sandboxes that no longer live.
        let live: std::collections::HashSet<String> =
            lock(&self.inner.slots).keys().cloned().collect();
        if let Ok(entries) = std::fs::read_dir(cfg.home.join("sandboxes")) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !live.contains(&name) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let _ = std::fs::remove_dir_all(cfg.home.join("forks"));
        Ok(())
    }
}

/// What the runtime records beside a snapshot it wrote.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct SnapshotMeta {
    env: BTreeMap<String, String>,
    outputs: String,
    resources: Resources,
}

fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .map(|es| {
            es.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}

/// Copies a snapshot directory (files only, sparse holes kept where the filesystem allows).
fn copy_dir(src: &Path, dest: &Path) -> Result<(), RuntimeError> {
    std::fs::create_dir_all(dest).map_err(RuntimeError::io("cannot create", dest))?;
    let entries = std::fs::read_dir(src).map_err(RuntimeError::io("cannot read", src))?;
    for e in entries.flatten() {
        let to = dest.join(e.file_name());
        let status = std::process::Command::new("cp")
            .arg("--sparse=always")
            .arg(e.path())
            .arg(&to)
            .status()
            .map_err(RuntimeError::io("cannot run cp for", &to))?;
        if !status.success() {
            return Err(RuntimeError::Internal(format!(
                "cp {} {}: {status}",
                e.path().display(),
                to.display()
            )));
        }
    }
    Ok(())
}
