//! Build steps (a Dockerfile's, or an E2B template build's) run inside an ember VM, each
//! cached by its inputs (docs/images.md, "Dockerfiles").
//!
//! The base — an OCI image (its `[image]` root image, built with a fixed free-space size) or
//! another template's root image — is booted in a VM with a copy-on-write **layer**: ember's
//! overlay file over the read-only root image, the same kind every sandbox writes to. `RUN`
//! steps run through the agent's `exec` (as the step's user, with its environment and
//! working directory), `COPY` writes the context's files through the agent's file API, and
//! `WORKDIR` makes its directory. After each step that writes, the guest flushes its file
//! systems (`sync`) and the layer is copied (sparse) into the step cache,
//! `$EMBER_CACHE/steps/<key>/layer.overlay`, where `<key>` hashes the parent step's key, the
//! instruction, the state it runs in (environment, working directory, user, shell, ARGs)
//! and the content of the files it copies. A build finds the longest cached prefix of its
//! steps and boots only for the rest, from the cached layer: an edit near the end reruns only
//! the steps after it. `ENV`, `USER`, `CMD`, `ENTRYPOINT`, `SHELL` and `ARG` change only the
//! state (and so the keys of the steps after them).
//!
//! The layer is guest-written data and the host never reads it as a file system: it is
//! served back to guests as a block device by the VMM, and nothing else. The template is
//! then built as any other ([`super::build`], with [`Layer`]): its VM boots on the root image
//! with a copy of the last layer, warms up and is snapshotted, so its snapshot (and the disk
//! layer in it) is the same kind of content-addressed object as every template's.
//!
//! Host side, a step reads only the build context: sources are resolved inside it (no `..`,
//! no symbolic links followed, `.dockerignore` honoured) and nothing is written on the host
//! but the step cache and the template.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command as Process, Stdio};
use std::time::{Duration, Instant};

use ember_agent::client::{Client, FileWriteOptions};
use ember_agent::protocol::{ExecRequest, ExecUser, ExitStatus};
use sha2::{Digest, Sha256};

use super::build::{
    boot_build_vm, copy_sparse, BuildEvent, BuildOptions, BuildVmFiles, KillOnDrop, Layer,
};
use super::dockerfile::{resolve_dest, Command, DockerIgnore, From, Step};
use super::schema::{read_manifest, RootfsManifest, ServiceSpec};
use super::{Template, TemplateError, AGENT_PORT};
use crate::{images, paths};

/// Free space of the root image builds run on (`[vm] disk_mib` of the base's recipe), MiB:
/// the image's content plus this much. Sparse: only what is written costs disk.
pub const DEFAULT_DISK_MIB: u64 = 4096;

/// Longest one step may run.
const STEP_TIMEOUT: Duration = Duration::from_secs(3600);

/// Longest the build VM may take to boot to its agent.
const BOOT_TIMEOUT: Duration = Duration::from_secs(600);

/// Bump when what a cached layer means changes.
const STEP_SCHEMA: &str = "ember-steps-1";

/// What to build: a base, steps and where `COPY` finds its files.
#[derive(Debug, Clone)]
pub struct StepsSpec {
    /// The base.
    pub from: From,
    /// The steps with their line numbers (a Dockerfile's, or 1.. for an E2B build).
    pub steps: Vec<(usize, Step)>,
    /// `ARG`s for `RUN`: `(first step index, name, value)`.
    pub run_args: Vec<(usize, String, String)>,
    /// The build context (`COPY` sources); None: `COPY` is refused.
    pub context: Option<PathBuf>,
    /// The context's `.dockerignore`.
    pub ignore: DockerIgnore,
    /// An existing network namespace (`ip netns` name) the build VM's NIC goes into, so that
    /// `RUN` reaches what is there (a package mirror); None: no network during the build.
    pub netns: Option<String>,
    /// Free space of the base's root image, MiB (an image base only).
    pub disk_mib: u64,
    /// Code contexts in the template (Python ≥ 3.8 with IPython checked after the steps).
    pub code: bool,
    /// With `code`: an image without Python and IPython makes a template with exec and
    /// files only (E2B builds), instead of an error.
    pub code_optional: bool,
    /// Start `ENTRYPOINT` + `CMD` as a service before the snapshot.
    pub start: bool,
    /// With `start`: the readiness check.
    pub start_ready: Option<Vec<String>>,
    /// Run every step again (and rebuild the template).
    pub rebuild: bool,
    /// Guest kernel (default: the repo's).
    pub kernel: Option<PathBuf>,
    /// The VMM binary.
    pub vmm: Option<PathBuf>,
}

impl StepsSpec {
    /// A spec with the defaults: no context, no network, code contexts.
    pub fn new(from: From, steps: Vec<(usize, Step)>) -> StepsSpec {
        StepsSpec {
            from,
            steps,
            run_args: Vec::new(),
            context: None,
            ignore: DockerIgnore::default(),
            netns: None,
            disk_mib: DEFAULT_DISK_MIB,
            code: true,
            code_optional: false,
            start: false,
            start_ready: None,
            rebuild: false,
            kernel: None,
            vmm: None,
        }
    }
}

fn step_err(line: usize, message: impl Into<String>) -> TemplateError {
    TemplateError::Step {
        line,
        message: message.into(),
    }
}

fn hex(b: &[u8]) -> String {
    super::key::hex(b)
}

/// The cache of step layers: `$EMBER_CACHE/steps`.
pub fn steps_dir() -> PathBuf {
    paths::cache_dir().join("steps")
}

/// The state steps run in.
#[derive(Debug, Clone, serde::Serialize)]
struct State {
    env: BTreeMap<String, String>,
    workdir: String,
    user: String,
    shell: Vec<String>,
    args: BTreeMap<String, String>,
    cmd: Option<Vec<String>>,
    entrypoint: Option<Vec<String>>,
    /// ENTRYPOINT was written in shell form (CMD is then ignored, as in Docker).
    entrypoint_shell: bool,
}

/// One file or directory a `COPY` writes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CopyItem {
    host: PathBuf,
    /// Relative to the step's destination directory (empty: the destination itself).
    rel: String,
    dir: bool,
    mode: u32,
}

/// The agent account for a Dockerfile `USER`.
fn exec_user(user: &str, line: usize) -> Result<ExecUser, TemplateError> {
    let (u, g) = user.split_once(':').unwrap_or((user, ""));
    let user_of = |x: &str| match x {
        "root" | "0" => Some(ExecUser::Root),
        "user" | "1000" => Some(ExecUser::User),
        _ => None,
    };
    match (user_of(u), g) {
        (Some(x), "") => Ok(x),
        (Some(x), g) if user_of(g) == Some(x) => Ok(x),
        _ => Err(step_err(
            line,
            format!(
                "USER {user}: ember runs steps and sandboxes as `root` (0) or `user` (1000), the \
                 agent's two accounts; other users are not supported"
            ),
        )),
    }
}

/// What `COPY` sources name in `context`: every file and directory (directories' contents
/// are copied into the destination, as in Docker), `.dockerignore`d paths left out. A path
/// that leaves the context or goes through a symbolic link is refused.
fn copy_items(
    context: &Path,
    ignore: &DockerIgnore,
    sources: &[String],
    line: usize,
) -> Result<Vec<(String, Vec<CopyItem>)>, TemplateError> {
    let canon = context
        .canonicalize()
        .map_err(super::io_err("cannot resolve the build context", context))?;
    let mut out = Vec::new();
    for src in sources {
        // Every component is checked as it is walked: none may be a symbolic link.
        let mut host = canon.clone();
        for comp in src.split('/').filter(|c| !c.is_empty()) {
            host.push(comp);
            let md = std::fs::symlink_metadata(&host).map_err(|_| {
                step_err(
                    line,
                    format!(
                        "COPY source {src:?} is not in the build context {}",
                        canon.display()
                    ),
                )
            })?;
            if md.file_type().is_symlink() {
                return Err(step_err(
                    line,
                    format!(
                        "COPY source {src:?}: {} is a symbolic link; ember copies no links \
                         (they could lead out of the context)",
                        host.display()
                    ),
                ));
            }
        }
        if !src.is_empty() && ignore.excluded(src) {
            return Err(step_err(
                line,
                format!("COPY source {src:?} is excluded by .dockerignore"),
            ));
        }
        let md = std::fs::symlink_metadata(&host).map_err(|_| {
            step_err(
                line,
                format!("COPY source {src:?} is not in the build context"),
            )
        })?;
        let mut items = Vec::new();
        if md.is_dir() {
            walk(&host, src, "", ignore, &mut items, line)?;
        } else if md.is_file() {
            items.push(CopyItem {
                host: host.clone(),
                rel: String::new(),
                dir: false,
                mode: md.mode() & 0o7777,
            });
        } else {
            return Err(step_err(
                line,
                format!("COPY source {src:?} is not a regular file or a directory"),
            ));
        }
        out.push((src.clone(), items));
    }
    Ok(out)
}

fn walk(
    dir: &Path,
    ctx_rel: &str,
    rel: &str,
    ignore: &DockerIgnore,
    items: &mut Vec<CopyItem>,
    line: usize,
) -> Result<(), TemplateError> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(super::io_err("cannot read the context directory", dir))?
        .flatten()
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name().to_string_lossy().into_owned();
        let crel = if ctx_rel.is_empty() {
            name.clone()
        } else {
            format!("{ctx_rel}/{name}")
        };
        if ignore.excluded(&crel) {
            continue;
        }
        let r = if rel.is_empty() {
            name.clone()
        } else {
            format!("{rel}/{name}")
        };
        let md =
            std::fs::symlink_metadata(e.path()).map_err(super::io_err("cannot stat", &e.path()))?;
        if md.file_type().is_symlink() {
            return Err(step_err(
                line,
                format!(
                    "COPY: {crel} in the build context is a symbolic link; ember copies no \
                     links (exclude it in .dockerignore)"
                ),
            ));
        }
        if md.is_dir() {
            items.push(CopyItem {
                host: e.path(),
                rel: r.clone(),
                dir: true,
                mode: md.mode() & 0o7777,
            });
            walk(&e.path(), &crel, &r, ignore, items, line)?;
        } else if md.is_file() {
            items.push(CopyItem {
                host: e.path(),
                rel: r,
                dir: false,
                mode: md.mode() & 0o7777,
            });
        }
        // Sockets, fifos and devices in a context are skipped, as Docker does.
    }
    Ok(())
}

/// The hash of what a `COPY` writes: each item's path, kind, mode and content.
fn hash_items(groups: &[(String, Vec<CopyItem>)]) -> Result<String, TemplateError> {
    let mut h = Sha256::new();
    for (src, items) in groups {
        h.update(src.as_bytes());
        h.update(b"\0");
        for it in items {
            h.update(it.rel.as_bytes());
            h.update(if it.dir { b"\0d" } else { b"\0f" });
            h.update(it.mode.to_le_bytes());
            if !it.dir {
                h.update(super::key::sha256_file(&it.host)?.as_bytes());
            }
        }
    }
    Ok(hex(&h.finalize()))
}

/// A step's cache key.
fn step_key(parent: &str, line_step: &Step, state: &State, files: &str) -> String {
    let doc = serde_json::json!({
        "schema": STEP_SCHEMA,
        "parent": parent,
        "step": format!("{line_step:?}"),
        "env": state.env,
        "workdir": state.workdir,
        "user": state.user,
        "shell": state.shell,
        "args": state.args,
        "files": files,
    });
    hex(&Sha256::digest(doc.to_string().as_bytes()))
}

/// A text for the progress line of a step.
fn describe(step: &Step) -> String {
    let s = match step {
        Step::Run(Command::Shell(s)) => format!("RUN {s}"),
        Step::Run(Command::Exec(v)) => format!("RUN {v:?}"),
        Step::Copy { sources, dest, .. } => format!("COPY {} {dest}", sources.join(" ")),
        Step::Workdir(d) => format!("WORKDIR {d}"),
        Step::Env(pairs) => format!(
            "ENV {}",
            pairs
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        ),
        Step::User(u) => format!("USER {u}"),
        Step::Shell(sh) => format!("SHELL {sh:?}"),
        Step::Cmd(Command::Shell(s)) => format!("CMD {s}"),
        Step::Cmd(Command::Exec(v)) => format!("CMD {v:?}"),
        Step::Entrypoint(Command::Shell(s)) => format!("ENTRYPOINT {s}"),
        Step::Entrypoint(Command::Exec(v)) => format!("ENTRYPOINT {v:?}"),
    };
    let mut s = s.replace('\n', " ");
    if s.len() > 120 {
        let mut cut = 117;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

/// The base's root image and its identity for step keys.
fn base_rootfs(
    spec: &StepsSpec,
    progress: &mut dyn FnMut(BuildEvent),
) -> Result<(PathBuf, String), TemplateError> {
    match &spec.from {
        From::Template(t) => {
            let t = Template::open(t)?;
            let m = read_manifest(&t.info.rootfs)?;
            Ok((t.info.rootfs.clone(), format!("template-rootfs:{}", m.key)))
        }
        From::Image(reference) => {
            let dir = tempfile::Builder::new()
                .prefix("ember-steps-recipe-")
                .tempdir()
                .map_err(super::io_err(
                    "cannot create a directory in",
                    &std::env::temp_dir(),
                ))?;
            let quote = |s: &str| serde_json::to_string(s).unwrap_or_default();
            // No code contexts in the base: the steps may be what installs Python; the
            // template's contexts are checked after them.
            let text = format!(
                "name = \"image-base\"\n\n[image]\nref = {}\n\n[vm]\ndisk_mib = {}\n\n[warmup]\n\
                 contexts = []\nspare = {{ python = 0, bash = 0 }}\n",
                quote(&absolute_reference(reference)),
                spec.disk_mib
            );
            let file = dir.path().join("image-base.toml");
            std::fs::write(&file, text).map_err(super::io_err("cannot write", &file))?;
            let rootfs = super::rootfs::default_rootfs_with(&file.to_string_lossy(), &mut |l| {
                progress(BuildEvent::Step(l))
            })?;
            let m = read_manifest(&rootfs)?;
            let id = if m.image_key.is_empty() {
                m.key
            } else {
                m.image_key
            };
            Ok((rootfs, format!("image-rootfs:{id}")))
        }
    }
}

/// Local image paths (`oci:DIR`, `docker-archive:PATH`, `oci-archive:PATH`) made absolute.
pub fn absolute_reference(reference: &str) -> String {
    for prefix in ["docker-archive:", "oci-archive:", "oci:"] {
        if let Some(rest) = reference.strip_prefix(prefix) {
            let p = Path::new(rest);
            if p.is_relative() {
                if let Ok(cwd) = std::env::current_dir() {
                    return format!("{prefix}{}", cwd.join(p).display());
                }
            }
        }
    }
    reference.to_string()
}

/// A TAP made in an existing network namespace for the build VM; removed on drop.
struct BuildTap {
    netns: String,
    tap: String,
}

impl BuildTap {
    fn create(netns: &str) -> Result<BuildTap, TemplateError> {
        // Unique per build (several builds may run in one server): "emb" + 12 hex digits fits
        // IFNAMSIZ.
        let tap = format!("emb{}", &paths::random_id()[..12]);
        let addr = format!(
            "{}/{}",
            crate::netpolicy::GATEWAY,
            crate::netpolicy::LINK_PREFIX
        );
        let batch = format!(
            "tuntap add dev {tap} mode tap\naddr add {addr} dev {tap}\nlink set {tap} up\n"
        );
        ember_vmm::netns::run_tool("ip", &["-n", netns, "-batch", "-"], Some(batch.as_bytes()))
            .map_err(|e| TemplateError::Vmm {
                name: "build".into(),
                what: format!("cannot make the build's NIC in network namespace {netns}: {e}"),
            })?;
        Ok(BuildTap {
            netns: netns.into(),
            tap,
        })
    }

    /// Makes `command` start in the namespace.
    fn enter_on_exec(&self, command: &mut Process) -> Result<(), TemplateError> {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let path = Path::new(crate::netpolicy::NETNS_DIR).join(&self.netns);
        let file = std::fs::File::open(&path).map_err(super::io_err("cannot open", &path))?;
        let fd = file.as_raw_fd();
        let enter = move || {
            let _keep = &file;
            // SAFETY: setns(2) on a descriptor that `file` (owned by this closure, which the
            // command keeps until it is dropped) holds open; it changes only the calling
            // (child) process's network namespace.
            if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        };
        // SAFETY: the closure runs in the child between fork and exec and makes one system
        // call, which is async-signal-safe; it allocates nothing and takes no lock.
        unsafe {
            command.pre_exec(enter);
        }
        Ok(())
    }
}

impl Drop for BuildTap {
    fn drop(&mut self) {
        let _ =
            ember_vmm::netns::run_tool("ip", &["-n", &self.netns, "link", "del", &self.tap], None);
    }
}

/// The VM the steps run in.
struct StepVm {
    _guard: KillOnDrop,
    client: Client<UnixStream>,
    overlay: PathBuf,
    _sockets: tempfile::TempDir,
    _tap: Option<BuildTap>,
}

#[allow(clippy::too_many_arguments)]
fn boot_vm(
    kernel: &Path,
    rootfs: &Path,
    manifest: &RootfsManifest,
    layer: Option<&Path>,
    spec: &StepsSpec,
    work: &Path,
    progress: &mut dyn FnMut(BuildEvent),
) -> Result<StepVm, TemplateError> {
    let vmm_err = |what: String| TemplateError::Vmm {
        name: "build".into(),
        what,
    };
    let vmm = match &spec.vmm {
        Some(v) => v.clone(),
        None => ember_vmm::launcher::find_vmm_binary().map_err(|e| vmm_err(e.to_string()))?,
    };
    let overlay = work.join("layer.overlay");
    let _ = std::fs::remove_file(&overlay);
    if let Some(l) = layer {
        copy_sparse(l, &overlay)?;
    }
    let sockets = tempfile::Builder::new()
        .prefix("ember-steps-")
        .tempdir()
        .map_err(super::io_err(
            "cannot create a socket directory in",
            &std::env::temp_dir(),
        ))?;
    let uds = sockets.path().join("vsock");
    let api = sockets.path().join("api.sock");
    let report = work.join("report.jsonl");
    let _ = std::fs::remove_file(&report);
    let console = work.join("console.log");
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
    config.vsock = Some(super::build::ember_devices_vsock_config(&uds));
    config.cmdline_extra.push("ember.agent".into());
    let tap = match &spec.netns {
        Some(ns) => {
            let t = BuildTap::create(ns)?;
            config.net.push(ember_vmm::vm::NetConfig {
                tap: t.tap.clone(),
                mac: Some(crate::netpolicy::GUEST_MAC.into()),
            });
            config.cmdline_extra.push(crate::netpolicy::guest_cmdline());
            Some(t)
        }
        None => None,
    };
    let cfg_path = work.join("vm.json");
    let json = serde_json::to_vec_pretty(&config).map_err(|e| vmm_err(e.to_string()))?;
    std::fs::write(&cfg_path, json).map_err(super::io_err("cannot write", &cfg_path))?;
    progress(BuildEvent::Step(format!(
        "booting the build VM ({} vCPU, {} MiB{})",
        config.vcpus,
        config.mem_mib,
        match &spec.netns {
            Some(ns) => format!(", network namespace {ns}"),
            None => ", no network".into(),
        }
    )));
    let t0 = Instant::now();
    let mut command = Process::new(&vmm);
    if let Some(t) = &tap {
        t.enter_on_exec(&mut command)?;
    }
    let guard = boot_build_vm(
        command,
        BuildVmFiles {
            config: &cfg_path,
            api: &api,
            report: &report,
            console: &console,
        },
        Stdio::null(),
        BOOT_TIMEOUT,
    )
    .map_err(vmm_err)?;
    let (client, _) = crate::agent_link::connect(&uds, AGENT_PORT, Duration::from_secs(30))
        .map_err(|e| vmm_err(format!("agent connection failed: {e}")))?;
    progress(BuildEvent::Step(format!(
        "build VM up in {:.1}s",
        t0.elapsed().as_secs_f64()
    )));
    Ok(StepVm {
        _guard: guard,
        client,
        overlay,
        _sockets: sockets,
        _tap: tap,
    })
}

impl StepVm {
    /// Runs `argv`; its output goes to `progress`. The exit status.
    fn run(
        &mut self,
        argv: Vec<String>,
        state: &State,
        user: ExecUser,
        progress: &mut dyn FnMut(BuildEvent),
    ) -> Result<ExitStatus, String> {
        let mut env = state.args.clone();
        env.extend(state.env.clone());
        let req = ExecRequest {
            argv,
            env,
            cwd: Some(state.workdir.clone()),
            user,
            timeout_ms: Some(STEP_TIMEOUT.as_millis() as u64),
            ..Default::default()
        };
        let mut pending = String::new();
        let end = self
            .client
            .exec_streaming(&req, |_, data| {
                pending.push_str(&String::from_utf8_lossy(data));
                if let Some(cut) = pending.rfind('\n') {
                    let lines: String = pending.drain(..=cut).collect();
                    progress(BuildEvent::Output(lines));
                }
                Ok(())
            })
            .map_err(|e| e.to_string())?;
        if !pending.is_empty() {
            progress(BuildEvent::Output(pending));
        }
        if end.timed_out {
            return Err(format!("timed out after {}s", STEP_TIMEOUT.as_secs()));
        }
        Ok(end.status)
    }

    /// Flushes the guest's file systems to the layer and copies the layer to `dest`.
    fn save_layer(&mut self, dest: &Path, line: usize) -> Result<(), TemplateError> {
        let req = ExecRequest {
            argv: vec!["sync".into()],
            timeout_ms: Some(120_000),
            ..Default::default()
        };
        match self.client.exec(&req) {
            Ok(out) if out.status.success() => {}
            Ok(out) => {
                return Err(step_err(
                    line,
                    format!(
                        "`sync` in the build VM ended with {:?}: {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim()
                    ),
                ))
            }
            Err(e) => {
                return Err(step_err(
                    line,
                    format!(
                        "`sync` in the build VM failed (the image needs a `sync` program): {e}"
                    ),
                ))
            }
        }
        copy_sparse(&self.overlay, dest)
    }
}

/// The outcome of [`run_steps`]: the base root image and the layer over it.
#[derive(Debug, Clone)]
pub struct StepsResult {
    /// The root image the layer lies on.
    pub rootfs: PathBuf,
    /// The layer and what the steps set.
    pub layer: Layer,
    /// Steps run, and steps found in the cache.
    pub ran: usize,
    /// Steps found in the cache.
    pub cached: usize,
}

/// Runs the steps (those not cached) in a build VM; see the module's documentation.
pub fn run_steps(
    spec: &StepsSpec,
    progress: &mut dyn FnMut(BuildEvent),
) -> Result<StepsResult, TemplateError> {
    let kernel = match &spec.kernel {
        Some(k) => k.clone(),
        None => images::default_kernel()?,
    };
    let (rootfs, base_id) = base_rootfs(spec, progress)?;
    let manifest = read_manifest(&rootfs)?;
    let cache = steps_dir();
    std::fs::create_dir_all(&cache).map_err(super::io_err("cannot create", &cache))?;
    let work = tempfile::Builder::new()
        .prefix(".work-")
        .tempdir_in(&cache)
        .map_err(super::io_err("cannot create a directory in", &cache))?;

    let mut state = State {
        env: manifest.env.clone(),
        workdir: "/".into(),
        user: "root".into(),
        shell: vec!["/bin/sh".into(), "-c".into()],
        args: BTreeMap::new(),
        cmd: None,
        entrypoint: None,
        entrypoint_shell: false,
    };
    let mut parent = hex(&Sha256::digest(
        format!("{STEP_SCHEMA}\0{base_id}").as_bytes(),
    ));
    let mut layer: Option<PathBuf> = None;
    let mut vm: Option<StepVm> = None;
    let (mut ran, mut cached) = (0, 0);
    let total = spec.steps.len();
    for (i, (line, step)) in spec.steps.iter().enumerate() {
        for (at, k, v) in &spec.run_args {
            if *at == i {
                state.args.insert(k.clone(), v.clone());
            }
        }
        let label = format!("step {}/{total} (line {line}): {}", i + 1, describe(step));
        match step {
            Step::Env(pairs) => {
                for (k, v) in pairs {
                    state.env.insert(k.clone(), v.clone());
                }
                progress(BuildEvent::Step(label));
                continue;
            }
            Step::User(u) => {
                exec_user(u, *line)?;
                state.user = u.clone();
                progress(BuildEvent::Step(label));
                continue;
            }
            Step::Shell(sh) => {
                state.shell = sh.clone();
                continue;
            }
            Step::Cmd(c) => {
                state.cmd = Some(c.argv(&state.shell));
                continue;
            }
            Step::Entrypoint(c) => {
                state.entrypoint_shell = matches!(c, Command::Shell(_));
                state.entrypoint = Some(c.argv(&state.shell));
                continue;
            }
            Step::Run(_) | Step::Copy { .. } | Step::Workdir(_) => {}
        }
        // A step that writes: its files, its key, the cache.
        let groups = match step {
            Step::Copy { sources, .. } => {
                let ctx = spec
                    .context
                    .as_deref()
                    .ok_or_else(|| step_err(*line, "COPY needs a build context (--context DIR)"))?;
                copy_items(ctx, &spec.ignore, sources, *line)?
            }
            _ => Vec::new(),
        };
        let files = hash_items(&groups)?;
        let key = step_key(&parent, step, &state, &files);
        let dir = cache.join(&key);
        let layer_file = dir.join("layer.overlay");
        if let Step::Workdir(d) = step {
            state.workdir = resolve_dest(d, &state.workdir);
        }
        if layer_file.is_file() && !spec.rebuild && vm.is_none() {
            progress(BuildEvent::Step(format!("{label}: cached")));
            cached += 1;
            parent = key;
            layer = Some(layer_file);
            continue;
        }
        progress(BuildEvent::Step(label));
        let t0 = Instant::now();
        if vm.is_none() {
            vm = Some(boot_vm(
                &kernel,
                &rootfs,
                &manifest,
                layer.as_deref(),
                spec,
                work.path(),
                progress,
            )?);
        }
        let v = vm.as_mut().expect("booted");
        match step {
            Step::Run(cmd) => {
                let user = exec_user(&state.user, *line)?;
                let status = v
                    .run(cmd.argv(&state.shell), &state, user, progress)
                    .map_err(|e| step_err(*line, format!("{}: {e}", describe(step))))?;
                if !status.success() {
                    return Err(step_err(
                        *line,
                        format!("{} ended with {status:?}", describe(step)),
                    ));
                }
            }
            Step::Workdir(_) => {
                v.client
                    .file_mkdir(&state.workdir)
                    .map_err(|e| step_err(*line, format!("WORKDIR {}: {e}", state.workdir)))?;
            }
            Step::Copy { dest, chmod, .. } => {
                copy_in(v, &groups, dest, *chmod, &state.workdir, *line, progress)?;
            }
            _ => unreachable!("only steps that write get here"),
        }
        // Into the cache: a fresh directory renamed into place.
        let tmp = cache.join(format!(".new-{key}-{}", paths::random_id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(super::io_err("cannot create", &tmp))?;
        v.save_layer(&tmp.join("layer.overlay"), *line)?;
        let meta = serde_json::json!({
            "parent": parent,
            "step": describe(step),
            "line": line,
            "seconds": (t0.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        });
        let mf = tmp.join("step.json");
        std::fs::write(&mf, meta.to_string()).map_err(super::io_err("cannot write", &mf))?;
        if dir.join("layer.overlay").is_file() {
            // Another build made the same step meanwhile (or --rebuild): the same inputs, so
            // the one there is kept (a build may be booting from it).
            let _ = std::fs::remove_dir_all(&tmp);
        } else {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::rename(&tmp, &dir).map_err(super::io_err("cannot rename into place", &dir))?;
        }
        progress(BuildEvent::Step(format!(
            "step {}/{total} done in {:.1}s",
            i + 1,
            t0.elapsed().as_secs_f64()
        )));
        ran += 1;
        parent = key;
        layer = Some(dir.join("layer.overlay"));
    }
    // What the template asks of the image, checked once per final layer (the answer is
    // kept beside it).
    let mut code = spec.code;
    if spec.code {
        let marker = |what: &str| {
            layer
                .as_ref()
                .and_then(|l| l.parent())
                .map(|d| d.join(what))
        };
        let (yes, no) = (marker("python-ok"), marker("python-missing"));
        let known = if yes.as_ref().is_some_and(|c| c.is_file()) {
            Some(true)
        } else if no.as_ref().is_some_and(|c| c.is_file()) {
            Some(false)
        } else {
            None
        };
        let ok = match known {
            Some(k) => k,
            None => {
                if vm.is_none() {
                    vm = Some(boot_vm(
                        &kernel,
                        &rootfs,
                        &manifest,
                        layer.as_deref(),
                        spec,
                        work.path(),
                        progress,
                    )?);
                }
                let v = vm.as_mut().expect("booted");
                progress(BuildEvent::Step(
                    "checking for Python >= 3.8 with IPython (run_code)".into(),
                ));
                // Found, not imported: importing IPython costs minutes of guest time on kvm_pvm,
                // and the template's warm-up imports it anyway.
                let check = "import sys, importlib.util as u; \
                             sys.exit(0 if sys.version_info >= (3, 8) and u.find_spec('IPython') \
                             else 3)";
                let ok = v
                    .run(
                        vec!["python3".into(), "-c".into(), check.into()],
                        &state,
                        ExecUser::Root,
                        &mut |_| {},
                    )
                    .map(|s| s.success())
                    .unwrap_or(false);
                if let Some(m) = if ok { yes } else { no } {
                    let _ = std::fs::write(m, b"checked\n");
                }
                ok
            }
        };
        if !ok && spec.code_optional {
            progress(BuildEvent::Step(
                "no Python >= 3.8 with IPython after the steps: the template has exec and \
                 files, and no code contexts"
                    .into(),
            ));
            code = false;
        } else if !ok {
            return Err(TemplateError::Feature(
                "run_code needs Python >= 3.8 with IPython in the image, and after the steps \
                     `python3 -c 'import IPython'` fails: add `RUN pip install ipython` (or \
                     your distribution's package), or build without code contexts (--no-code): \
                     exec and files work on any image"
                    .into(),
            ));
        }
    }
    drop(vm);
    let user = exec_user(&state.user, 0)?;
    let start = if spec.start {
        let mut argv = state.entrypoint.clone().unwrap_or_default();
        if !state.entrypoint_shell {
            argv.extend(state.cmd.clone().unwrap_or_default());
        }
        if argv.is_empty() {
            return Err(TemplateError::Feature(
                "a start command was asked for and the build sets no CMD or ENTRYPOINT".into(),
            ));
        }
        Some(ServiceSpec {
            name: "start".into(),
            argv,
            user: if user == ExecUser::Root {
                "root"
            } else {
                "user"
            }
            .into(),
            env: BTreeMap::new(),
            cwd: Some(state.workdir.clone()),
            ready: spec.start_ready.clone(),
            ready_timeout_s: 300,
        })
    } else {
        None
    };
    Ok(StepsResult {
        rootfs,
        layer: Layer {
            overlay: layer,
            key: parent,
            env: state.env,
            workdir: (state.workdir != "/").then_some(state.workdir),
            start,
            code,
        },
        ran,
        cached,
    })
}

/// Writes a `COPY`'s files into the guest.
fn copy_in(
    vm: &mut StepVm,
    groups: &[(String, Vec<CopyItem>)],
    dest: &str,
    chmod: Option<u32>,
    workdir: &str,
    line: usize,
    progress: &mut dyn FnMut(BuildEvent),
) -> Result<(), TemplateError> {
    let base = resolve_dest(dest, workdir);
    let (mut files, mut bytes) = (0u64, 0u64);
    for (src, items) in groups {
        // A single file to a destination not ending in '/' (and not an existing directory)
        // is that file; otherwise items go under the destination directory.
        let single_file = items.len() == 1 && !items[0].dir && items[0].rel.is_empty();
        let into_dir = dest.ends_with('/')
            || dest == "."
            || vm
                .client
                .file_stat(&base)
                .map(|s| s.kind == ember_agent::protocol::FileType::Dir)
                .unwrap_or(false);
        if !single_file || into_dir {
            vm.client
                .file_mkdir(&base)
                .map_err(|e| step_err(line, format!("COPY: mkdir {base}: {e}")))?;
        }
        for it in items {
            let guest = if single_file && !into_dir {
                base.clone()
            } else if single_file {
                let name = Path::new(src)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                format!("{}/{name}", base.trim_end_matches('/'))
            } else {
                format!("{}/{}", base.trim_end_matches('/'), it.rel)
            };
            if it.dir {
                vm.client
                    .file_mkdir(&guest)
                    .map_err(|e| step_err(line, format!("COPY: mkdir {guest}: {e}")))?;
                continue;
            }
            let mut f =
                std::fs::File::open(&it.host).map_err(super::io_err("cannot open", &it.host))?;
            let opts = FileWriteOptions {
                mode: Some(chmod.unwrap_or(it.mode)),
                append: false,
                create_dirs: Some(true),
            };
            let n = vm
                .client
                .file_write(&guest, opts, &mut f, STEP_TIMEOUT)
                .map_err(|e| step_err(line, format!("COPY {src} -> {guest}: {e}")))?;
            files += 1;
            bytes += n;
        }
    }
    progress(BuildEvent::Output(format!(
        "copied {files} files, {bytes} bytes\n"
    )));
    Ok(())
}

/// Builds template `name` from steps: runs them ([`run_steps`]), then builds the template
/// on the base root image with the last layer ([`Template::build`]).
pub fn build_from_steps(
    name: &str,
    spec: &StepsSpec,
    progress: &mut dyn FnMut(BuildEvent),
) -> Result<Template, TemplateError> {
    super::check_name(name)?;
    let r = run_steps(spec, progress)?;
    progress(BuildEvent::Step(format!(
        "steps: {} run, {} cached; building the template",
        r.ran, r.cached
    )));
    let opts = BuildOptions {
        kernel: spec.kernel.clone(),
        rootfs: Some(r.rootfs),
        vmm: spec.vmm.clone(),
        rebuild: spec.rebuild,
        layer: Some(r.layer),
        ..Default::default()
    };
    Template::build(name, &opts, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_the_agents_two_accounts() {
        assert_eq!(exec_user("root", 1).unwrap(), ExecUser::Root);
        assert_eq!(exec_user("0:0", 1).unwrap(), ExecUser::Root);
        assert_eq!(exec_user("user", 1).unwrap(), ExecUser::User);
        assert_eq!(exec_user("1000:1000", 1).unwrap(), ExecUser::User);
        let e = exec_user("nobody", 7).unwrap_err().to_string();
        assert!(e.contains("line 7") && e.contains("nobody"), "{e}");
        assert!(exec_user("user:root", 1).is_err());
    }

    #[test]
    fn copy_sources_stay_in_the_context_and_honour_dockerignore() {
        let d = tempfile::tempdir().unwrap();
        let ctx = d.path().join("ctx");
        std::fs::create_dir_all(ctx.join("app/sub")).unwrap();
        std::fs::create_dir_all(ctx.join("app/.git")).unwrap();
        std::fs::write(ctx.join("app/a.py"), "a").unwrap();
        std::fs::write(ctx.join("app/sub/b.py"), "b").unwrap();
        std::fs::write(ctx.join("app/x.pyc"), "x").unwrap();
        std::fs::write(ctx.join("app/.git/HEAD"), "h").unwrap();
        std::fs::write(d.path().join("secret"), "s").unwrap();
        std::os::unix::fs::symlink("../secret", ctx.join("link")).unwrap();
        std::os::unix::fs::symlink("..", ctx.join("up")).unwrap();
        let ig = DockerIgnore::parse("**/*.pyc\napp/.git\n");
        let g = copy_items(&ctx, &ig, &["app".into()], 3).unwrap();
        let rels: Vec<(&str, bool)> = g[0].1.iter().map(|i| (i.rel.as_str(), i.dir)).collect();
        assert_eq!(
            rels,
            vec![("a.py", false), ("sub", true), ("sub/b.py", false)]
        );
        for (src, want) in [
            ("link", "symbolic link"),
            ("up/secret", "symbolic link"),
            ("nope", "not in the build context"),
            ("app/x.pyc", "excluded by .dockerignore"),
        ] {
            let e = copy_items(&ctx, &ig, &[src.into()], 3)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want) && e.contains("line 3"), "{src}: {e}");
        }
        // A symbolic link inside a copied directory is refused too.
        std::os::unix::fs::symlink("/etc/passwd", ctx.join("app/sub/pw")).unwrap();
        let e = copy_items(&ctx, &ig, &["app".into()], 3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("symbolic link"), "{e}");
    }

    #[test]
    fn step_keys_follow_content_state_and_parent() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("f"), "1").unwrap();
        let ig = DockerIgnore::default();
        let h1 = hash_items(&copy_items(d.path(), &ig, &["f".into()], 1).unwrap()).unwrap();
        std::fs::write(d.path().join("f"), "2").unwrap();
        let h2 = hash_items(&copy_items(d.path(), &ig, &["f".into()], 1).unwrap()).unwrap();
        assert_ne!(h1, h2, "the content is in the key");
        let state = State {
            env: BTreeMap::new(),
            workdir: "/".into(),
            user: "root".into(),
            shell: vec!["/bin/sh".into(), "-c".into()],
            args: BTreeMap::new(),
            cmd: None,
            entrypoint: None,
            entrypoint_shell: false,
        };
        let run = Step::Run(Command::Shell("true".into()));
        let k = step_key("p", &run, &state, "");
        assert_eq!(k, step_key("p", &run, &state, ""));
        assert_ne!(k, step_key("q", &run, &state, ""));
        let mut s2 = state.clone();
        s2.env.insert("A".into(), "1".into());
        assert_ne!(k, step_key("p", &run, &s2, ""));
        assert_ne!(
            k,
            step_key("p", &Step::Run(Command::Shell("false".into())), &state, "")
        );
        // CMD does not change what a RUN writes: not in the key.
        let mut s3 = state.clone();
        s3.cmd = Some(vec!["x".into()]);
        assert_eq!(k, step_key("p", &run, &s3, ""));
    }

    #[test]
    fn steps_are_described_as_written() {
        assert_eq!(
            describe(&Step::Env(vec![("A".into(), "1".into())])),
            "ENV A=1"
        );
        assert_eq!(describe(&Step::User("user".into())), "USER user");
        let long = describe(&Step::Run(Command::Shell("x".repeat(300))));
        assert!(long.len() <= 120 && long.ends_with("..."), "{long}");
    }

    #[test]
    fn local_references_become_absolute() {
        let r = absolute_reference("oci:rel/layout");
        assert!(r.starts_with("oci:/") && r.ends_with("/rel/layout"), "{r}");
        assert_eq!(absolute_reference("oci:/abs"), "oci:/abs");
        assert_eq!(absolute_reference("python:3.12"), "python:3.12");
    }
}
