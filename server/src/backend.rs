//! What the server calls: the runtime's blocking API as an object-safe trait, so the HTTP
//! layer can be tested without VMs (a fake implements it in the tests). [`Runtime`]
//! implements it by forwarding; templates come from the template cache.

use std::io::{Read, Write};
use std::path::PathBuf;

use ember_agent::protocol::{
    ContextInfo, DirEntry, EndStatus, EventKind, ExecRequest, FileStat, RunCodeRequest,
};

use super::types::TemplateSummary;
use ember_runtime::template::{BuildEvent, BuildOptions, Template};
use ember_runtime::{
    ArtifactInfo, AuditFilter, AuditRecord, CreateRequest, ExposedPort, ForkRequest, ListFilter,
    Metrics, NetworkInfo, NetworkPolicy, OnTimeout, SandboxInfo, SnapshotInfo, SnapshotRequest,
    Transition, Usage,
};
use ember_runtime::{RunEnd, Runtime, RuntimeError};

/// The calls behind the routes. Every method blocks; the server calls them from blocking
/// tasks. See [`Runtime`] for what each does.
pub trait Backend: Send + Sync + 'static {
    /// Largest upload accepted (the server answers 413 above it).
    fn max_upload_bytes(&self) -> u64;
    /// Built templates.
    fn templates(&self) -> Result<Vec<TemplateSummary>, RuntimeError>;
    /// Builds a template (or finds it built), reporting progress.
    fn build_template(
        &self,
        name: &str,
        rebuild: bool,
        progress: &mut dyn FnMut(BuildEvent),
    ) -> Result<TemplateSummary, RuntimeError>;

    fn create(&self, req: &CreateRequest) -> Result<SandboxInfo, RuntimeError>;
    fn list(&self, filter: &ListFilter) -> Result<Vec<SandboxInfo>, RuntimeError>;
    fn get(&self, id: &str) -> Result<SandboxInfo, RuntimeError>;
    fn kill(&self, id: &str) -> Result<SandboxInfo, RuntimeError>;
    fn pause(&self, id: &str) -> Result<SandboxInfo, RuntimeError>;
    fn resume(&self, id: &str) -> Result<SandboxInfo, RuntimeError>;
    fn set_timeout(
        &self,
        id: &str,
        secs: u64,
        on_timeout: Option<OnTimeout>,
    ) -> Result<SandboxInfo, RuntimeError>;
    fn snapshot(&self, id: &str, req: &SnapshotRequest) -> Result<SnapshotInfo, RuntimeError>;
    fn snapshots(&self) -> Result<Vec<SnapshotInfo>, RuntimeError>;
    fn delete_snapshot(&self, name: &str) -> Result<(), RuntimeError>;
    fn fork(&self, id: &str, req: &ForkRequest) -> Result<Vec<SandboxInfo>, RuntimeError>;
    fn history(&self, id: &str) -> Result<Vec<Transition>, RuntimeError>;
    fn audit(&self, filter: &AuditFilter) -> Result<Vec<AuditRecord>, RuntimeError>;
    fn metrics(&self) -> Metrics;

    fn context_create(
        &self,
        id: &str,
        language: &str,
        cwd: Option<&str>,
    ) -> Result<ContextInfo, RuntimeError>;
    fn context_list(&self, id: &str) -> Result<Vec<ContextInfo>, RuntimeError>;
    fn context_restart(&self, id: &str, context: &str) -> Result<(), RuntimeError>;
    fn context_remove(&self, id: &str, context: &str) -> Result<(), RuntimeError>;
    fn interrupt(&self, id: &str, context: &str) -> Result<(), RuntimeError>;
    fn process_signal(&self, id: &str, pid: i32, signal: i32) -> Result<(), RuntimeError>;
    fn run_code(
        &self,
        id: &str,
        req: &RunCodeRequest,
        on_event: &mut dyn FnMut(&EventKind) -> bool,
    ) -> Result<RunEnd, RuntimeError>;
    fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        on_event: &mut dyn FnMut(&EventKind) -> bool,
    ) -> Result<EndStatus, RuntimeError>;

    fn write_file(&self, id: &str, path: &str, data: &mut dyn Read) -> Result<u64, RuntimeError>;
    fn read_file(&self, id: &str, path: &str, out: &mut dyn Write) -> Result<u64, RuntimeError>;
    fn list_files(&self, id: &str, path: &str, depth: u32) -> Result<Vec<DirEntry>, RuntimeError>;
    fn stat(&self, id: &str, path: &str) -> Result<FileStat, RuntimeError>;
    fn mkdir(&self, id: &str, path: &str) -> Result<(), RuntimeError>;
    fn remove(&self, id: &str, path: &str, recursive: bool) -> Result<(), RuntimeError>;
    fn rename(&self, id: &str, from: &str, to: &str) -> Result<(), RuntimeError>;

    fn collect_artifacts(&self, id: &str) -> Result<Vec<ArtifactInfo>, RuntimeError>;

    /// Runs `f` on the sandbox's agent handle with a call slot held (resuming a paused
    /// sandbox first), audited as `call`. The E2B surface speaks to the agent through this;
    /// use [`with_sandbox`] for a typed result.
    fn with_sandbox_dyn(
        &self,
        id: &str,
        call: &'static str,
        args: serde_json::Value,
        f: &mut dyn FnMut(&ember_runtime::Sandbox) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let _ = (id, args, f);
        Err(RuntimeError::Internal(format!(
            "{call}: this backend has no sandbox handles"
        )))
    }
    /// What the running sandbox uses on the host now (CPU sample, memory, disk).
    fn usage(&self, id: &str) -> Result<Usage, RuntimeError> {
        Err(RuntimeError::Internal(format!(
            "usage of {id}: this backend does not measure sandboxes"
        )))
    }
    fn artifacts(&self, id: &str) -> Result<Vec<ArtifactInfo>, RuntimeError>;
    fn artifact_path(&self, id: &str, path: &str) -> Result<PathBuf, RuntimeError>;
    /// The sandbox's network (policy, ports, counters).
    fn network(&self, id: &str) -> Result<NetworkInfo, RuntimeError> {
        Err(no_network(id))
    }
    /// Changes its policy.
    fn set_network(&self, id: &str, policy: &NetworkPolicy) -> Result<NetworkInfo, RuntimeError> {
        let _ = policy;
        Err(no_network(id))
    }
    /// Exposes a guest port.
    fn expose(&self, id: &str, port: u16, public: bool) -> Result<NetworkInfo, RuntimeError> {
        let _ = (port, public);
        Err(no_network(id))
    }
    /// Closes an exposed port.
    fn unexpose(&self, id: &str, port: u16) -> Result<NetworkInfo, RuntimeError> {
        let _ = port;
        Err(no_network(id))
    }
    /// The exposed port `port`, if it is.
    fn exposed(&self, id: &str, port: u16) -> Result<Option<ExposedPort>, RuntimeError> {
        let _ = port;
        Err(no_network(id))
    }
    /// A connection to the guest's `port` (from the sandbox's namespace).
    fn connect_port(
        &self,
        id: &str,
        port: u16,
        require_exposed: bool,
    ) -> Result<std::net::TcpStream, RuntimeError> {
        let _ = (port, require_exposed);
        Err(no_network(id))
    }
}

fn no_network(id: &str) -> RuntimeError {
    RuntimeError::Internal(format!("sandbox {id}: this backend has no networking"))
}

impl Backend for Runtime {
    fn max_upload_bytes(&self) -> u64 {
        self.config().max_upload_bytes
    }

    fn templates(&self) -> Result<Vec<TemplateSummary>, RuntimeError> {
        Ok(Template::list()?
            .into_iter()
            .map(|(name, t)| TemplateSummary::of(name, &t))
            .collect())
    }

    fn build_template(
        &self,
        name: &str,
        rebuild: bool,
        progress: &mut dyn FnMut(BuildEvent),
    ) -> Result<TemplateSummary, RuntimeError> {
        let opts = BuildOptions {
            rebuild,
            ..Default::default()
        };
        let t = Template::build(name, &opts, progress)?;
        Ok(TemplateSummary::of(Some(name.to_string()), &t))
    }

    fn create(&self, req: &CreateRequest) -> Result<SandboxInfo, RuntimeError> {
        Runtime::create(self, req)
    }
    fn list(&self, filter: &ListFilter) -> Result<Vec<SandboxInfo>, RuntimeError> {
        Runtime::list(self, filter)
    }
    fn get(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        Runtime::get(self, id)
    }
    fn kill(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        Runtime::kill(self, id)
    }
    fn pause(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        Runtime::pause(self, id)
    }
    fn resume(&self, id: &str) -> Result<SandboxInfo, RuntimeError> {
        Runtime::resume(self, id)
    }
    fn set_timeout(
        &self,
        id: &str,
        secs: u64,
        on_timeout: Option<OnTimeout>,
    ) -> Result<SandboxInfo, RuntimeError> {
        Runtime::set_timeout(self, id, secs, on_timeout)
    }
    fn snapshot(&self, id: &str, req: &SnapshotRequest) -> Result<SnapshotInfo, RuntimeError> {
        Runtime::snapshot(self, id, req)
    }
    fn snapshots(&self) -> Result<Vec<SnapshotInfo>, RuntimeError> {
        Runtime::snapshots(self)
    }
    fn delete_snapshot(&self, name: &str) -> Result<(), RuntimeError> {
        Runtime::delete_snapshot(self, name)
    }
    fn fork(&self, id: &str, req: &ForkRequest) -> Result<Vec<SandboxInfo>, RuntimeError> {
        Runtime::fork(self, id, req)
    }
    fn history(&self, id: &str) -> Result<Vec<Transition>, RuntimeError> {
        Runtime::history(self, id)
    }
    fn audit(&self, filter: &AuditFilter) -> Result<Vec<AuditRecord>, RuntimeError> {
        Runtime::audit(self, filter)
    }
    fn metrics(&self) -> Metrics {
        Runtime::metrics(self)
    }
    fn context_create(
        &self,
        id: &str,
        language: &str,
        cwd: Option<&str>,
    ) -> Result<ContextInfo, RuntimeError> {
        Runtime::context_create(self, id, language, cwd)
    }
    fn context_list(&self, id: &str) -> Result<Vec<ContextInfo>, RuntimeError> {
        Runtime::context_list(self, id)
    }
    fn context_restart(&self, id: &str, context: &str) -> Result<(), RuntimeError> {
        Runtime::context_restart(self, id, context)
    }
    fn context_remove(&self, id: &str, context: &str) -> Result<(), RuntimeError> {
        Runtime::context_remove(self, id, context)
    }
    fn interrupt(&self, id: &str, context: &str) -> Result<(), RuntimeError> {
        Runtime::interrupt(self, id, context)
    }
    fn process_signal(&self, id: &str, pid: i32, signal: i32) -> Result<(), RuntimeError> {
        Runtime::process_signal(self, id, pid, signal)
    }
    fn run_code(
        &self,
        id: &str,
        req: &RunCodeRequest,
        on_event: &mut dyn FnMut(&EventKind) -> bool,
    ) -> Result<RunEnd, RuntimeError> {
        Runtime::run_code(self, id, req, on_event)
    }
    fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        on_event: &mut dyn FnMut(&EventKind) -> bool,
    ) -> Result<EndStatus, RuntimeError> {
        Runtime::exec(self, id, req, on_event)
    }
    fn write_file(&self, id: &str, path: &str, data: &mut dyn Read) -> Result<u64, RuntimeError> {
        Runtime::write_file(self, id, path, data)
    }
    fn read_file(&self, id: &str, path: &str, out: &mut dyn Write) -> Result<u64, RuntimeError> {
        Runtime::read_file(self, id, path, out)
    }
    fn list_files(&self, id: &str, path: &str, depth: u32) -> Result<Vec<DirEntry>, RuntimeError> {
        Runtime::list_files(self, id, path, depth)
    }
    fn stat(&self, id: &str, path: &str) -> Result<FileStat, RuntimeError> {
        Runtime::stat(self, id, path)
    }
    fn mkdir(&self, id: &str, path: &str) -> Result<(), RuntimeError> {
        Runtime::mkdir(self, id, path)
    }
    fn remove(&self, id: &str, path: &str, recursive: bool) -> Result<(), RuntimeError> {
        Runtime::remove(self, id, path, recursive)
    }
    fn rename(&self, id: &str, from: &str, to: &str) -> Result<(), RuntimeError> {
        Runtime::rename(self, id, from, to)
    }
    fn collect_artifacts(&self, id: &str) -> Result<Vec<ArtifactInfo>, RuntimeError> {
        Runtime::collect_artifacts(self, id)
    }
    fn artifacts(&self, id: &str) -> Result<Vec<ArtifactInfo>, RuntimeError> {
        Runtime::artifacts(self, id)
    }
    fn artifact_path(&self, id: &str, path: &str) -> Result<PathBuf, RuntimeError> {
        Runtime::artifact_path(self, id, path)
    }
    fn usage(&self, id: &str) -> Result<Usage, RuntimeError> {
        Runtime::usage(self, id)
    }
    fn network(&self, id: &str) -> Result<NetworkInfo, RuntimeError> {
        Runtime::network(self, id)
    }
    fn set_network(&self, id: &str, policy: &NetworkPolicy) -> Result<NetworkInfo, RuntimeError> {
        Runtime::set_network(self, id, policy)
    }
    fn expose(&self, id: &str, port: u16, public: bool) -> Result<NetworkInfo, RuntimeError> {
        Runtime::expose(self, id, port, public)
    }
    fn unexpose(&self, id: &str, port: u16) -> Result<NetworkInfo, RuntimeError> {
        Runtime::unexpose(self, id, port)
    }
    fn exposed(&self, id: &str, port: u16) -> Result<Option<ExposedPort>, RuntimeError> {
        Runtime::exposed(self, id, port)
    }
    fn connect_port(
        &self,
        id: &str,
        port: u16,
        require_exposed: bool,
    ) -> Result<std::net::TcpStream, RuntimeError> {
        Runtime::connect_port(self, id, port, require_exposed)
    }
    fn with_sandbox_dyn(
        &self,
        id: &str,
        call: &'static str,
        args: serde_json::Value,
        f: &mut dyn FnMut(&ember_runtime::Sandbox) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        Runtime::with_sandbox(self, id, call, args, |sb| f(sb))
    }
}

/// [`Backend::with_sandbox_dyn`] with a typed result.
pub fn with_sandbox<T>(
    b: &dyn Backend,
    id: &str,
    call: &'static str,
    args: serde_json::Value,
    f: impl FnOnce(&ember_runtime::Sandbox) -> Result<T, RuntimeError>,
) -> Result<T, RuntimeError> {
    let mut f = Some(f);
    let mut out = None;
    b.with_sandbox_dyn(id, call, args, &mut |sb| {
        if let Some(f) = f.take() {
            out = Some(f(sb)?);
        }
        Ok(())
    })?;
    out.ok_or_else(|| RuntimeError::Internal(format!("{call}: the call did not run")))
}
