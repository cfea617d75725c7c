//! Creating a sandbox: its source (a template or a named snapshot, or a fork's parent), the
//! checks of the request, the capacity reservation, and the start of its VM (from a warm pool
//! or a fresh jailed VMM) — which a resume goes through too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use ember_jailer::CgroupLimits;

use super::{check_name, SnapshotMeta};
use crate::jailed::{self, Live, StartSpec};
use crate::netpolicy::NetMode;
use crate::store::{now_ms, SandboxRow};
use crate::template::Template;
use crate::types::*;
use crate::{lock, Runtime, RuntimeError, Slot, SlotState};

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
    /// Volumes the source's guest had mounted (a named snapshot's).
    volumes: Vec<crate::volumes::VolumeMount>,
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
                    volumes: meta.volumes,
                })
            }
            (t, None) => {
                let name = t.as_deref().unwrap_or("default");
                let t = match Template::open(name) {
                    Ok(t) => t,
                    Err(
                        e @ (crate::TemplateError::NotBuilt { .. }
                        | crate::TemplateError::BadName(_)),
                    ) => {
                        // A named template that is none may be a named snapshot: templates
                        // and snapshots share one name space for callers that do not tell
                        // them apart (E2B's API, where snapshot ids go where template ids go).
                        if t.is_some()
                            && check_name(name).is_ok()
                            && self.store().snapshot(name)?.is_some()
                        {
                            return self.source(&CreateRequest {
                                template: None,
                                snapshot: Some(name.to_string()),
                                ..Default::default()
                            });
                        }
                        return Err(match e {
                            crate::TemplateError::NotBuilt { .. } => {
                                RuntimeError::NoSuchImage(format!(
                                    "template {name:?} is not built (build it with `ember \
                                     template build {name}`)"
                                ))
                            }
                            other => other.into(),
                        });
                    }
                    Err(e) => return Err(e.into()),
                };
                Ok(Source {
                    dir: t.snapshot_dir(),
                    template: Some(t.info.name.clone()),
                    snapshot: None,
                    env: t.info.env.clone(),
                    outputs: t.info.outputs.clone(),
                    vcpus: t.info.vm.vcpus,
                    memory_mib: t.info.vm.memory_mib,
                    disk_mib: t.info.vm.disk_mib.unwrap_or(0),
                    volumes: Vec::new(),
                })
            }
        }
    }

    pub(super) fn limits(&self, r: &Resources) -> CgroupLimits {
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

    pub(super) fn create_inner(
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
                volumes: Vec::new(),
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
            // A rule naming a secret that does not exist is a mistake to report now, not a
            // 502 at the first request.
            let names = req.network.rule_secrets();
            if !names.is_empty() {
                let have = self.list_secrets()?;
                if let Some(missing) = names.iter().find(|n| !have.iter().any(|s| &s.name == *n)) {
                    return Err(RuntimeError::Invalid(format!(
                        "network: rules use secret {missing:?}, which does not exist (create it \
                         first: POST /v1/secrets, `ember secret create`)"
                    )));
                }
            }
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
        let mut secret_env = crate::secret_env::secret_names(&env, &req.secret_env);
        if let Some((p, _)) = fork {
            secret_env.extend(p.secret_env.iter().cloned());
        }
        // Rules: TLS clients in the guest trust the egress proxy's CA (network.rs).
        let edge_ca = fork.is_none() && !req.network.rules.is_empty();
        if edge_ca {
            for k in crate::netpolicy::edge::GUEST_CA_ENV {
                env.insert(
                    k.to_string(),
                    crate::netpolicy::edge::GUEST_CA_BUNDLE.to_string(),
                );
            }
        }
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
            secret_env,
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
                all_ports: match fork {
                    Some((p, _)) => p.network.all_ports,
                    None => req.expose_all_ports,
                },
            },
        };
        let slot = Slot::new(row.clone(), None);
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
        // Volumes (volume_calls.rs): recorded before the VM starts, mounted once it answers.
        // A named snapshot's own mounts come with it (the same volumes, not copies).
        let mut mounts = src.volumes.clone();
        mounts.extend(req.volume_mounts.iter().cloned());
        if let Err(e) = self.volumes_register(&id, &mounts, fork.map(|(p, _)| p.id.as_str())) {
            lock(&self.inner.slots).remove(&id);
            let mut st = lock(&slot.st);
            self.transition(&slot, &mut st, State::Failed, Some(e.to_string()));
            return Err(e);
        }
        // A filesystem-only snapshot has no memory to restore: its sandboxes boot.
        let boot = fork.is_none() && crate::paths::is_fs_only(&restore_dir);
        self.start_vm(&slot, &restore_dir, "created", boot)?;
        if fork.is_none() {
            // A restored guest has its snapshot's mounts already; a booted one has none.
            let new = if boot { &mounts } else { &req.volume_mounts };
            if let Err(e) = self.volumes_mount_in_guest(&id, new) {
                let _ = self.kill(&id);
                return Err(e);
            }
        }
        if edge_ca {
            if let Err(e) = self.install_edge_ca(&id) {
                let _ = self.kill(&id);
                return Err(e);
            }
        }
        self.wake_timer();
        let info = lock(&slot.st).row.info();
        Ok(info)
    }

    /// Starts the slot's VM from `dir` (state Creating or Resuming) and moves it to Running,
    /// or to Failed (create) / back to Paused (resume) with the reason. A create takes a warm
    /// VMM from the template's pool when one is ready (and fits its limits), else spawns one.
    /// With `boot` (a filesystem-only snapshot, or a resume that ignores the memory), the VM
    /// boots on the disk layer in `dir` instead (`boot.rs`): not through the start gate, whose
    /// wait is sized for restores, nor from the pool.
    pub(super) fn start_vm(
        &self,
        slot: &Arc<Slot>,
        dir: &Path,
        what: &str,
        boot: bool,
    ) -> Result<(), RuntimeError> {
        let cfg = &self.inner.cfg;
        let (row, from) = {
            let st = lock(&slot.st);
            (st.row.clone(), st.row.state)
        };
        if boot {
            let started = self.start_booted(dir, &row);
            return self.started(slot, &row, from, started, what);
        }
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
        let queued_ms = admitted.waited.as_secs_f64() * 1e3;
        drop(admitted);
        let started = started.map(|(uid, mut live)| {
            live.pooled = pooled;
            live.sandbox.set_queued_ms(queued_ms);
            (uid, live)
        });
        self.started(slot, &row, from, started, what)
    }

    /// Moves the slot to Running with the VM `started`, or on its failure to Failed (create)
    /// or back to Paused (resume).
    fn started(
        &self,
        slot: &Arc<Slot>,
        row: &SandboxRow,
        from: State,
        started: Result<(u32, Live), (RuntimeError, Option<u32>)>,
        what: &str,
    ) -> Result<(), RuntimeError> {
        let (uid, jail_id, started) = match started {
            Ok((uid, live)) => (Some(uid), live.jail.id.clone(), Ok(live)),
            Err((e, uid)) => (uid, String::new(), Err(e)),
        };
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
                self.volumes_started(&row.id, &live);
                st.vm = Some(Arc::new(live));
                st.expected_exit = false;
                if from == State::Creating {
                    // The timeout counts from when the sandbox can take calls: a create that
                    // boots a disk (minutes on kvm_pvm) must not use it up. The max lifetime
                    // still counts from the request.
                    st.row.ends_ms = Some(now_ms() + st.row.timeout_ms);
                }
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

    /// [`jailed::start`]; the VM's network namespace is torn down when that fails.
    pub(super) fn start_jailed(&self, spec: &StartSpec<'_>) -> Result<Live, RuntimeError> {
        jailed::start(&self.inner.cfg, &self.inner.bins, spec).inspect_err(|_| {
            if let Some(n) = &spec.net {
                self.inner.net.teardown(n);
            }
        })
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
                    net,
                    kept,
                    boot: None,
                };
                self.start_jailed(&spec)
            })
            .map(|live| (uid, live))
            .map_err(|e| (e, Some(uid)))
    }

    /// The slot's VM from a warm pool member: the sandbox's network policy replaces the
    /// member's `none`, then the member restores.
    fn start_pooled(
        &self,
        w: crate::pooled::WarmVmm,
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
        w.claim(
            &self.inner.cfg,
            &row.id,
            &state,
            t0,
            self.inner.cfg.connect_timeout,
            kept,
        )
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
            "path": match (vm.pooled, vm.sandbox.link()) {
                (true, Some(crate::agent_link::Link::Primed { .. })) => "pool-primed",
                (true, _) => "pool",
                (false, _) => "fresh",
            },
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
}
