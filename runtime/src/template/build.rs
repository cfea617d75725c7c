//! Building a template: resolve the kernel and root filesystem, boot the image with a
//! copy-on-write overlay, run the warm-up and the services through the agent, let the guest
//! settle, take a full snapshot and record it under the template's key.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ember_agent::client::Client;
use ember_agent::protocol::{self, Call, EventKind};

use super::key::{cache_root, kernel_identity, link_name, lock_file, template_key};
use super::schema::{read_manifest, RootfsManifest, ServiceSpec, WarmupSpec};
use super::{check_name, io_err, Template, TemplateError, TemplateInfo, AGENT_PORT};
use crate::images;

/// Copies a sparse file (holes kept; a reflink where the file system can).
pub(super) fn copy_sparse(src: &Path, dest: &Path) -> Result<(), TemplateError> {
    let status = Command::new("cp")
        .args(["--sparse=always", "--reflink=auto"])
        .arg(src)
        .arg(dest)
        .status()
        .map_err(io_err("cannot run cp for", dest))?;
    if !status.success() {
        return Err(TemplateError::Io {
            what: "cannot copy a layer to",
            path: dest.to_path_buf(),
            source: std::io::Error::other(format!("cp {}: {status}", src.display())),
        });
    }
    Ok(())
}

/// Longest a template's guest may take to boot to the agent.
const BOOT_TIMEOUT: Duration = Duration::from_secs(600);

/// What a build reports as it goes.
#[derive(Debug, Clone)]
pub enum BuildEvent {
    /// A step started (human text).
    Step(String),
    /// Output of the warm-up code or the guest (already decoded).
    Output(String),
    /// The template was already built with these inputs.
    UpToDate,
}

/// How to build.
#[derive(Debug, Clone, Default)]
pub struct BuildOptions {
    /// Guest kernel (default: the repo's, built into the cache).
    pub kernel: Option<PathBuf>,
    /// Root filesystem image (default: the recipe's, built into the cache). Its
    /// `manifest.json` must sit beside it.
    pub rootfs: Option<PathBuf>,
    /// The VMM binary (default: [`ember_vmm::launcher::find_vmm_binary`]).
    pub vmm: Option<PathBuf>,
    /// A recipe file to build instead of `rootfs/templates/NAME.toml`.
    pub recipe: Option<PathBuf>,
    /// Build again even if the key is in the cache.
    pub rebuild: bool,
    /// Limit for the warm-up (default 30 minutes: a cold `import pandas, matplotlib` is
    /// minutes of guest time on kvm_pvm).
    pub warmup_timeout: Option<Duration>,
    /// A disk layer the template starts from (a Dockerfile's steps, [`super::steps`]), with
    /// what those steps set.
    pub layer: Option<Layer>,
}

/// The result of a Dockerfile's (or an E2B build's) steps: a disk layer over the root
/// image, and the environment, working directory and start command they set.
#[derive(Debug, Clone, Default)]
pub struct Layer {
    /// The copy-on-write overlay (ember's format) over the rootfs image, as the last step
    /// left it (None: no step wrote). Copied: the template's snapshot gets its own.
    pub overlay: Option<PathBuf>,
    /// The last step's cache key: it goes into the template's key.
    pub key: String,
    /// Environment on top of the image's.
    pub env: BTreeMap<String, String>,
    /// Working directory of the code contexts.
    pub workdir: Option<String>,
    /// Started as the service `start` before the snapshot.
    pub start: Option<ServiceSpec>,
    /// Code contexts (false: exec and files only, the rootfs's own warm-up is kept).
    pub code: bool,
}

impl Layer {
    /// Folds the layer into the manifest of the rootfs it lies on: its key into the rootfs
    /// key (and so into the template's), its environment, working directory, start command
    /// and (with `code`) the default code contexts.
    pub fn apply(&self, manifest: &mut RootfsManifest) {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(manifest.key.as_bytes());
        h.update(b"\0layer\0");
        h.update(self.key.as_bytes());
        manifest.key = super::key::hex(&h.finalize());
        if self.code {
            manifest.warmup.contexts = WarmupSpec::default().contexts;
            manifest.warmup.spare = WarmupSpec::default().spare;
        }
        manifest
            .env
            .extend(self.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        if let Some(wd) = &self.workdir {
            for c in &mut manifest.warmup.contexts {
                c.cwd = Some(wd.clone());
            }
        }
        if let Some(s) = &self.start {
            manifest.warmup.services.retain(|x| x.name != s.name);
            manifest.warmup.services.push(s.clone());
        }
    }
}

impl Template {
    /// Builds template `name` (or finds it built with the same inputs).
    pub fn build(
        name: &str,
        opts: &BuildOptions,
        progress: &mut dyn FnMut(BuildEvent),
    ) -> Result<Template, TemplateError> {
        check_name(name)?;
        let t0 = Instant::now();
        progress(BuildEvent::Step("guest kernel".into()));
        let kernel = match &opts.kernel {
            Some(k) => k.clone(),
            None => images::default_kernel()?,
        };
        // The recipe: `rootfs/templates/NAME.toml`, or a file given in the options.
        let recipe_ref = match &opts.recipe {
            Some(p) => p.to_string_lossy().into_owned(),
            None => name.to_owned(),
        };
        progress(BuildEvent::Step(format!(
            "root filesystem for {recipe_ref}"
        )));
        let rootfs = match &opts.rootfs {
            Some(r) => r.clone(),
            None => super::rootfs::default_rootfs_with(&recipe_ref, &mut |line| {
                progress(BuildEvent::Step(line))
            })?,
        };
        let mut manifest = read_manifest(&rootfs)?;
        if let Some(layer) = &opts.layer {
            layer.apply(&mut manifest);
        }
        let profile = ember_vmm::HostKvm::detect().default_profile();
        let key = template_key(&kernel_identity(&kernel)?, &manifest, &profile.to_string())?;
        let root = cache_root();
        let dir = root.join(&key);
        std::fs::create_dir_all(&root).map_err(io_err("cannot create", &root))?;
        // One build per key at a time (concurrent `ember run`s, parallel tests): the second
        // waits here and then finds the first one's result.
        let _lock = lock_file(&root.join(format!(".lock-{key}")))?;
        if dir.join("template.json").is_file() && !opts.rebuild {
            let t = Template::open_dir(&dir)?;
            link_name(&root, name, &key)?;
            progress(BuildEvent::UpToDate);
            return Ok(t);
        }
        // Under the lock no other build of this key runs: what an interrupted one left goes.
        if let Ok(entries) = std::fs::read_dir(&root) {
            let prefix = format!(".build-{key}-");
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(&prefix) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let work = root.join(format!(".build-{key}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).map_err(io_err("cannot create", &work))?;
        let result = build_into(
            name, opts, &kernel, &rootfs, &manifest, &key, &work, progress,
        );
        let info = match result {
            Ok(mut info) => {
                info.timings_ms
                    .insert("total".into(), t0.elapsed().as_millis() as u64);
                info
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&work);
                return Err(e);
            }
        };
        let record = work.join("template.json");
        let json = serde_json::to_vec_pretty(&info).map_err(|e| TemplateError::BadRecord {
            path: record.clone(),
            message: e.to_string(),
        })?;
        std::fs::write(&record, json).map_err(io_err("cannot write", &record))?;
        if dir.exists() {
            // --rebuild: replace the old build.
            let old = root.join(format!(".old-{key}-{}", std::process::id()));
            std::fs::rename(&dir, &old).map_err(io_err("cannot move aside", &dir))?;
            let _ = std::fs::remove_dir_all(&old);
        }
        std::fs::rename(&work, &dir).map_err(io_err("cannot rename into place", &dir))?;
        link_name(&root, name, &key)?;
        Template::open_dir(&dir)
    }
}

fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Allocated bytes of every file under `dir` (sparse files count what they use).
fn allocated_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in entries.flatten() {
        let Ok(md) = e.metadata() else { continue };
        if md.is_dir() {
            total += allocated_bytes(&e.path());
        } else {
            total += md.blocks() * 512;
        }
    }
    total
}

/// Longest wait for a template's guest to go idle after its warm-up.
const SETTLE_MAX: Duration = Duration::from_secs(60);

/// CPU time (user + system, clock ticks) of process `pid`, all threads.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Waits until the VMM `pid` (its vCPU threads, i.e. the guest) has used at most 2 clock
/// ticks in each of two consecutive half-seconds; false when `max` passed first.
fn wait_idle(pid: u32, max: Duration) -> bool {
    let start = Instant::now();
    let Some(mut last) = cpu_ticks(pid) else {
        return false;
    };
    let mut quiet = 0;
    while start.elapsed() < max {
        std::thread::sleep(Duration::from_millis(500));
        let Some(now) = cpu_ticks(pid) else {
            return false;
        };
        if now.saturating_sub(last) <= 2 {
            quiet += 1;
            if quiet >= 2 {
                return true;
            }
        } else {
            quiet = 0;
        }
        last = now;
    }
    false
}

/// Kills a child on drop (the build VM, if the build fails half-way).
pub(super) struct KillOnDrop(pub(super) Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The files a build VM's `ember-vmm` is started with.
pub(super) struct BuildVmFiles<'a> {
    pub(super) config: &'a Path,
    pub(super) api: &'a Path,
    pub(super) report: &'a Path,
    pub(super) console: &'a Path,
}

/// Starts a build VM's `ember-vmm` (`command`, its namespace already arranged) and waits for
/// the agent's boot marker; on failure the message ends with the guest console's last lines.
/// The VMM is killed when the returned guard drops.
pub(super) fn boot_build_vm(
    mut command: Command,
    files: BuildVmFiles<'_>,
    stderr: Stdio,
    timeout: Duration,
) -> Result<KillOnDrop, String> {
    let vmm = command.get_program().to_owned();
    let child = command
        .arg("--config")
        .arg(files.config)
        .arg("--api-sock")
        .arg(files.api)
        .arg("--report")
        .arg(files.report)
        .arg("--serial")
        .arg(format!("file:{}", files.console.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .map_err(|e| format!("could not be started ({}): {e}", Path::new(&vmm).display()))?;
    let mut guard = KillOnDrop(Some(child));
    let child = guard.0.as_mut().expect("child present");
    wait_marker(child, files.report, 2, timeout).map_err(|e| {
        let tail = std::fs::read_to_string(files.console).unwrap_or_default();
        let tail: Vec<&str> = tail.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        format!("{e}; guest console:\n{}", tail.join("\n"))
    })?;
    Ok(guard)
}

/// Waits until the VMM's report shows boot marker `value`, or fails when the VMM exits first.
pub(super) fn wait_marker(
    child: &mut Child,
    report: &Path,
    value: u64,
    timeout: Duration,
) -> Result<(), String> {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(report).unwrap_or_default();
        for line in text.lines() {
            let Ok(e) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if e["event"] == "boot_marker" && e["value"] == value {
                return Ok(());
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            let msg = text
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .find_map(|e| e["message"].as_str().map(str::to_owned))
                .unwrap_or_default();
            return Err(format!("exited ({status}) before the agent was up {msg}"));
        }
        if start.elapsed() > timeout {
            return Err(format!("guest did not reach the agent within {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[allow(clippy::too_many_arguments)]
fn build_into(
    name: &str,
    opts: &BuildOptions,
    kernel: &Path,
    rootfs: &Path,
    manifest: &RootfsManifest,
    key: &str,
    work: &Path,
    progress: &mut dyn FnMut(BuildEvent),
) -> Result<TemplateInfo, TemplateError> {
    let vmm_err = |what: String| TemplateError::Vmm {
        name: name.into(),
        what,
    };
    let vmm = match &opts.vmm {
        Some(v) => v.clone(),
        None => ember_vmm::launcher::find_vmm_binary().map_err(|e| vmm_err(e.to_string()))?,
    };
    let overlay = work.join("root.overlay");
    if let Some(layer) = opts.layer.as_ref().and_then(|l| l.overlay.as_ref()) {
        // The steps' layer is where the template starts; the snapshot takes its own copy.
        copy_sparse(layer, &overlay)?;
    }
    // Unix socket paths must fit in 108 bytes: keep the sockets in a short private directory.
    let sockets = tempfile::Builder::new()
        .prefix("ember-tb-")
        .tempdir()
        .map_err(io_err(
            "cannot create a socket directory in",
            &std::env::temp_dir(),
        ))?;
    let uds = sockets.path().join("vsock");
    let api = sockets.path().join("api.sock");
    let report = work.join("report.jsonl");
    let console = work.join("build.log");
    let mut config = ember_vmm::vm::VmConfig::new(kernel.to_path_buf());
    config.mem_mib = manifest.vm.memory_mib;
    config.vcpus = manifest.vm.vcpus;
    config.disks.push(ember_vmm::vm::DiskConfig {
        path: overlay.clone(),
        mode: ember_vmm::vm::DiskMode::Overlay {
            base: rootfs.to_path_buf(),
        },
        id: "rootfs".into(),
    });
    config.vsock = Some(ember_devices_vsock_config(&uds));
    config.cmdline_extra.push("ember.agent".into());
    // A networked template boots with eth0 on a TAP in a namespace of its own with no way out
    // (the guest configures itself from `ember.net=`); its clones get their own namespaces.
    let netns = if manifest.vm.network {
        config.net.push(ember_vmm::vm::NetConfig {
            tap: crate::netpolicy::nft::TAP.into(),
            mac: Some(crate::netpolicy::GUEST_MAC.into()),
        });
        config.cmdline_extra.push(crate::netpolicy::guest_cmdline());
        Some(
            ember_vmm::netns::IsolatedNetns::create(&[(
                crate::netpolicy::nft::TAP,
                Some(&format!(
                    "{}/{}",
                    crate::netpolicy::GATEWAY,
                    crate::netpolicy::LINK_PREFIX
                )),
            )])
            .map_err(|e| vmm_err(format!("cannot set up the build's network: {e}")))?,
        )
    } else {
        None
    };
    let cfg_path = work.join("vm.json");
    let json = serde_json::to_vec_pretty(&config).map_err(|e| vmm_err(e.to_string()))?;
    std::fs::write(&cfg_path, json).map_err(io_err("cannot write", &cfg_path))?;

    progress(BuildEvent::Step(format!(
        "booting {name} ({} vCPU, {} MiB)",
        manifest.vm.vcpus, manifest.vm.memory_mib
    )));
    let t_boot = Instant::now();
    let mut command = Command::new(&vmm);
    if let Some(ns) = &netns {
        ns.enter_on_exec(&mut command)
            .map_err(|e| vmm_err(format!("cannot enter the build's network namespace: {e}")))?;
    }
    let mut guard = boot_build_vm(
        command,
        BuildVmFiles {
            config: &cfg_path,
            api: &api,
            report: &report,
            console: &console,
        },
        Stdio::piped(),
        BOOT_TIMEOUT,
    )
    .map_err(vmm_err)?;
    let boot_ms = t_boot.elapsed().as_millis() as u64;
    progress(BuildEvent::Step(format!(
        "agent up after {:.1}s; warming up",
        boot_ms as f64 / 1e3
    )));

    // The connection stays open, idle, through the snapshot: the snapshot keeps it and every
    // sandbox takes it over (its host port names it).
    let (mut client, host_port) =
        crate::agent_link::connect(&uds, AGENT_PORT, Duration::from_secs(30))
            .map_err(|e| vmm_err(format!("agent connection failed: {e}")))?;
    let timeout = opts.warmup_timeout.unwrap_or(Duration::from_secs(30 * 60));
    let (warmup_ms, services_ms) = warm_up(
        &mut client,
        name,
        &manifest.warmup,
        &manifest.env,
        timeout,
        progress,
    )?;

    // Let the guest finish what the warm-up left it to do (deferred kernel work after the
    // burst of imports and forks) before the snapshot: otherwise every clone does it again
    // after its restore — measured on kvm_pvm as ~3 s of busy vCPU in each new sandbox, which
    // slowed its first cells tenfold.
    progress(BuildEvent::Step("letting the guest settle".into()));
    let t_settle = Instant::now();
    let pid = guard.0.as_ref().map(Child::id).unwrap_or(0);
    let settled = wait_idle(pid, SETTLE_MAX);
    let settle_ms = t_settle.elapsed().as_millis() as u64;
    if !settled {
        progress(BuildEvent::Step(format!(
            "the guest was still busy after {:.0}s; snapshotting anyway",
            SETTLE_MAX.as_secs_f64()
        )));
    }

    progress(BuildEvent::Step(format!(
        "warm-up done in {:.1}s; taking the snapshot",
        warmup_ms as f64 / 1e3
    )));
    let t_snap = Instant::now();
    let snap = work.join("snapshot");
    let reply = ember_vmm::api::call(
        &api,
        &ember_vmm::api::Request::Snapshot {
            dir: snap.clone(),
            kind: ember_vmm::api::SnapshotKind::Full,
            after: ember_vmm::api::AfterSnapshot::Exit,
        },
    )
    .map_err(vmm_err)?;
    if reply["ok"] != true {
        return Err(vmm_err(format!("refused the snapshot: {reply}")));
    }
    let mut child = guard.0.take().expect("child present");
    let status = child
        .wait()
        .map_err(|e| vmm_err(format!("could not be waited for: {e}")))?;
    if !status.success() {
        let mut err = String::new();
        if let Some(mut s) = child.stderr.take() {
            let _ = s.read_to_string(&mut err);
        }
        return Err(vmm_err(format!(
            "exited with {status} after the snapshot: {err}"
        )));
    }
    let snapshot_ms = t_snap.elapsed().as_millis() as u64;
    // The connection was idle (its last call answered in full) when the snapshot was taken.
    drop(client);
    crate::agent_link::record(
        &snap,
        crate::agent_link::KeptConnection {
            port: AGENT_PORT,
            host_port,
        },
    )
    .map_err(io_err("cannot write the kept-connection record in", &snap))?;
    // The build's own overlay is in the snapshot (copied); the live one is not needed.
    let _ = std::fs::remove_file(&overlay);
    drop(sockets);
    progress(BuildEvent::Step(format!(
        "snapshot taken in {:.1}s",
        snapshot_ms as f64 / 1e3
    )));
    Ok(TemplateInfo {
        name: name.into(),
        key: key.into(),
        kernel: kernel.to_path_buf(),
        rootfs: rootfs.to_path_buf(),
        rootfs_key: manifest.key.clone(),
        image_key: manifest.image_key.clone(),
        vm: manifest.vm,
        warmup: manifest.warmup.clone(),
        env: manifest.env.clone(),
        outputs: manifest.outputs.clone(),
        built_at: now_rfc3339(),
        timings_ms: BTreeMap::from([
            ("boot".into(), boot_ms),
            ("warmup".into(), warmup_ms),
            ("services".into(), services_ms),
            ("settle".into(), settle_ms),
            ("snapshot".into(), snapshot_ms),
        ]),
        snapshot_bytes: allocated_bytes(&snap),
    })
}

/// Runs a template's warm-up (code, contexts, spare) and starts its services through the
/// agent behind `client`: what a template build does before its snapshot, and what a
/// sandbox booted from a filesystem-only snapshot does before it answers. Returns the
/// warm-up's and the services' milliseconds.
pub(crate) fn warm_up<S: ember_agent::client::Transport>(
    client: &mut Client<S>,
    name: &str,
    warmup: &WarmupSpec,
    env: &BTreeMap<String, String>,
    timeout: Duration,
    progress: &mut dyn FnMut(BuildEvent),
) -> Result<(u64, u64), TemplateError> {
    let t_warm = Instant::now();
    let req = protocol::WarmupRequest {
        code: warmup.code.clone(),
        contexts: warmup
            .contexts
            .iter()
            .map(|c| protocol::ContextCreateRequest {
                language: c.language.clone(),
                cwd: c.cwd.clone(),
                env: merged_env(env, &c.env),
                id: Some(c.id.clone()),
            })
            .collect(),
        spare: warmup.spare.clone(),
        env: env.clone(),
    };
    let mut failure: Option<String> = None;
    // A template without code contexts (an image without Python: exec and files only) has
    // nothing to warm: the warm-up call would start a Python zygote.
    let nothing_to_warm =
        req.code.is_empty() && req.contexts.is_empty() && req.spare.values().all(|n| *n == 0);
    let status = if nothing_to_warm {
        progress(BuildEvent::Step("no code contexts: no warm-up".into()));
        protocol::EndStatus::Ok
    } else {
        client
            .call(&Call::Warmup(req), timeout, |ev| {
                match ev {
                    EventKind::Stdout { data } | EventKind::Stderr { data } => progress(
                        BuildEvent::Output(String::from_utf8_lossy(&data).into_owned()),
                    ),
                    EventKind::Exception(x) => {
                        failure = Some(format!(
                            "{}: {}\n{}",
                            x.name,
                            x.value,
                            x.traceback.join("\n")
                        ))
                    }
                    _ => {}
                }
                Ok(())
            })
            .map_err(|e| TemplateError::Warmup {
                name: name.into(),
                message: e.to_string(),
            })?
    };
    if let Some(message) = failure {
        return Err(TemplateError::Warmup {
            name: name.into(),
            message,
        });
    }
    if status != protocol::EndStatus::Ok {
        return Err(TemplateError::Warmup {
            name: name.into(),
            message: format!("the agent ended the warm-up with status {status:?}"),
        });
    }
    let warmup_ms = t_warm.elapsed().as_millis() as u64;
    let t_services = Instant::now();
    for svc in &warmup.services {
        progress(BuildEvent::Step(format!("starting service {}", svc.name)));
        start_service(client, env, svc, progress).map_err(|message| TemplateError::Warmup {
            name: name.into(),
            message: format!("service {}: {message}", svc.name),
        })?;
    }
    Ok((warmup_ms, t_services.elapsed().as_millis() as u64))
}

/// Runs one `exec` to its end: the exit code (None: killed by a signal or timed out) and
/// the output (stdout then stderr, lossy, at most a few KiB kept).
pub(super) fn exec_once<S: ember_agent::client::Transport>(
    client: &mut Client<S>,
    req: protocol::ExecRequest,
    timeout: Duration,
) -> Result<(Option<i32>, String), String> {
    let mut code = None;
    let mut out = String::new();
    client
        .call(&Call::Exec(req), timeout, |ev| {
            match ev {
                EventKind::Stdout { data } | EventKind::Stderr { data } if out.len() < 4096 => {
                    out.push_str(&String::from_utf8_lossy(&data));
                }
                EventKind::Exit(protocol::ExitStatus::Code(c)) => code = Some(c),
                _ => {}
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    Ok((code, out))
}

/// Starts `svc` in the background and waits until its `ready` command succeeds.
fn start_service<S: ember_agent::client::Transport>(
    client: &mut Client<S>,
    base_env: &BTreeMap<String, String>,
    svc: &ServiceSpec,
    progress: &mut dyn FnMut(BuildEvent),
) -> Result<(), String> {
    let user = match svc.user.as_str() {
        "root" => protocol::ExecUser::Root,
        "user" => protocol::ExecUser::User,
        other => return Err(format!("user must be root or user, not {other:?}")),
    };
    let start = protocol::ExecRequest {
        argv: svc.argv.clone(),
        env: merged_env(base_env, &svc.env),
        cwd: svc.cwd.clone(),
        background: true,
        user,
        ..Default::default()
    };
    exec_once(client, start, Duration::from_secs(60))
        .map_err(|e| format!("could not be started: {e}"))?;
    let Some(ready) = &svc.ready else {
        return Ok(());
    };
    let t0 = Instant::now();
    let limit = Duration::from_secs(svc.ready_timeout_s);
    loop {
        let check = protocol::ExecRequest {
            argv: ready.clone(),
            // A check that hangs (a busy guest) counts as not ready, and is tried again.
            timeout_ms: Some(120_000),
            ..Default::default()
        };
        let t_check = Instant::now();
        let result = exec_once(client, check, Duration::from_secs(180));
        let took = t_check.elapsed();
        let last = match result {
            Ok((Some(0), _)) => {
                progress(BuildEvent::Step(format!(
                    "service {} ready after {:.1}s",
                    svc.name,
                    t0.elapsed().as_secs_f64()
                )));
                return Ok(());
            }
            Ok((code, out)) => format!("exit {code:?}: {}", out.trim()),
            Err(e) => e,
        };
        if t0.elapsed() > limit {
            return Err(format!(
                "not ready after {}s (last check: {last})",
                svc.ready_timeout_s
            ));
        }
        std::thread::sleep(check_interval(took));
    }
}

/// The pause between two readiness checks, given how long the last one took. Each check is
/// an exec in the guest that competes with the service for its vCPU; under kvm_pvm one
/// costs seconds of guest time (measured: a `bash` check ~1-3 s while Chromium starts), so
/// checks every 2 s would take a large share of the guest away from the service. The pause
/// is four times the check's own time (the check uses at most a fifth of the guest), at
/// least 2 s, at most 30 s.
fn check_interval(last_check: Duration) -> Duration {
    (last_check * 4).clamp(Duration::from_secs(2), Duration::from_secs(30))
}

fn merged_env(
    base: &BTreeMap<String, String>,
    extra: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut env = base.clone();
    env.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

pub(super) fn ember_devices_vsock_config(uds: &Path) -> ember_vmm::vm::VsockConfig {
    ember_vmm::vm::VsockConfig {
        guest_cid: 3,
        uds_path: uds.to_path_buf(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_checks_leave_the_guest_mostly_to_the_service() {
        assert_eq!(
            check_interval(Duration::from_millis(5)),
            Duration::from_secs(2)
        );
        assert_eq!(
            check_interval(Duration::from_secs(3)),
            Duration::from_secs(12)
        );
        assert_eq!(
            check_interval(Duration::from_secs(100)),
            Duration::from_secs(30)
        );
    }

    #[test]
    fn a_layer_goes_into_the_manifest_and_the_key() {
        let mut m: RootfsManifest =
            serde_json::from_str(r#"{"key": "base", "env": {"PATH": "/bin", "A": "image"}}"#)
                .unwrap();
        m.warmup.contexts.clear();
        let layer = Layer {
            overlay: None,
            key: "steps".into(),
            env: BTreeMap::from([("A".to_string(), "layer".to_string())]),
            workdir: Some("/app".into()),
            start: None,
            code: true,
        };
        let mut with = m.clone();
        layer.apply(&mut with);
        assert_ne!(with.key, m.key, "the layer's key is in the rootfs key");
        assert_eq!(with.env["A"], "layer");
        assert_eq!(with.env["PATH"], "/bin");
        assert!(
            !with.warmup.contexts.is_empty(),
            "code: the default contexts"
        );
        assert!(with
            .warmup
            .contexts
            .iter()
            .all(|c| c.cwd.as_deref() == Some("/app")));
        let mut other = m.clone();
        Layer {
            key: "other".into(),
            ..layer.clone()
        }
        .apply(&mut other);
        assert_ne!(other.key, with.key);
    }

    #[test]
    fn dates_are_rfc3339() {
        let s = now_rfc3339();
        assert_eq!(s.len(), 20, "{s}");
        assert!(s.starts_with("20"), "{s}");
        assert!(s.ends_with('Z'));
    }
}
