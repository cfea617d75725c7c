//! The runtime's public data: what a caller sends (`*Request`) and gets back (`*Info`,
//! records). All of it is plain serde data, shared by the library, the HTTP API (which derives
//! its OpenAPI schemas from these types) and the CLI.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Where a sandbox is in its life. Every change is recorded ([`Transition`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Its VMM is being started (restore, sync).
    Creating,
    /// Its VM runs; calls reach it.
    Running,
    /// It is being snapshotted to disk; calls wait.
    Pausing,
    /// Its VM is a snapshot on disk; no process. A call resumes it.
    Paused,
    /// It is being restored from its pause snapshot; calls wait.
    Resuming,
    /// Ended (killed, timed out, or deleted after pause retention). Final.
    Stopped,
    /// Its VMM died or could not be started; `reason` says why. Final.
    Failed,
}

impl State {
    /// The name used in the store and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Creating => "creating",
            State::Running => "running",
            State::Pausing => "pausing",
            State::Paused => "paused",
            State::Resuming => "resuming",
            State::Stopped => "stopped",
            State::Failed => "failed",
        }
    }

    /// Parses [`State::as_str`].
    pub fn parse(s: &str) -> Option<State> {
        Some(match s {
            "creating" => State::Creating,
            "running" => State::Running,
            "pausing" => State::Pausing,
            "paused" => State::Paused,
            "resuming" => State::Resuming,
            "stopped" => State::Stopped,
            "failed" => State::Failed,
            _ => return None,
        })
    }

    /// Stopped or failed: nothing more happens to it.
    pub fn is_final(self) -> bool {
        matches!(self, State::Stopped | State::Failed)
    }

    /// Every state, in lifecycle order.
    pub const ALL: [State; 7] = [
        State::Creating,
        State::Running,
        State::Pausing,
        State::Paused,
        State::Resuming,
        State::Stopped,
        State::Failed,
    ];
}

/// What happens when a sandbox's timeout expires.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// Copy its artifacts out, then stop it.
    #[default]
    Kill,
    /// Copy its artifacts out, then pause it (kept for the paused-retention period).
    Pause,
}

pub use crate::netpolicy::{NetMode, NetworkPolicy};

/// A `network` field: a policy object, or just its mode (`"none"`, `"egress"`).
fn policy_or_mode<'de, D: serde::Deserializer<'de>>(d: D) -> Result<NetworkPolicy, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Form {
        Mode(NetMode),
        Policy(NetworkPolicy),
    }
    match Form::deserialize(d) {
        Ok(Form::Mode(mode)) => Ok(NetworkPolicy {
            mode,
            ..Default::default()
        }),
        Ok(Form::Policy(p)) => Ok(p),
        Err(_) => Err(serde::de::Error::custom(
            "network must be \"none\", \"egress\" or a policy object {mode, allow_cidrs, \
             deny_cidrs, allow_domains, bandwidth_kib, max_connections}",
        )),
    }
}

/// A guest TCP port reachable from outside the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExposedPort {
    /// The guest port.
    pub port: u16,
    /// Reachable without a token (anyone who can reach the server).
    #[serde(default)]
    pub public: bool,
}

/// Every guest port of a sandbox reachable through the server, as E2B's surface does
/// (`allowPublicTraffic`): ember's native default is none until exposed one by one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct AllPorts {
    /// Reachable without the sandbox's traffic token (anyone who can reach the server).
    #[serde(default)]
    pub public: bool,
}

/// A sandbox's network: the policy in force and its exposed ports.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SandboxNetwork {
    /// The policy.
    #[serde(default)]
    pub policy: NetworkPolicy,
    /// Exposed ports.
    #[serde(default)]
    pub ports: Vec<ExposedPort>,
    /// Every port exposed (E2B's rule), besides those listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all_ports: Option<AllPorts>,
}

/// Arguments of [`crate::Runtime::create`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRequest {
    /// The template to start from (its latest build). Default `default` unless `snapshot`
    /// is given.
    #[serde(default)]
    pub template: Option<String>,
    /// A named snapshot (taken with `snapshot`) to start from instead of a template.
    #[serde(default)]
    pub snapshot: Option<String>,
    /// Idle-or-not timeout in seconds from when the sandbox is ready (default: the server's,
    /// 300). Extend it with `set_timeout`.
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    /// What the timeout does.
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// Hard limit on the sandbox's whole life in seconds, whatever its timeout says
    /// (default: the server's cap).
    #[serde(default)]
    pub max_lifetime_secs: Option<u64>,
    /// vCPUs. A restored VM keeps the snapshot's count: only that number is accepted.
    #[serde(default)]
    pub vcpus: Option<u8>,
    /// Guest memory in MiB. A restored VM keeps the snapshot's size: only that is accepted.
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// Host CPU quota for the VMM's cgroup, in percent of one CPU (default: unlimited up to
    /// the server's cap).
    #[serde(default)]
    pub cpu_percent: Option<u32>,
    /// Most processes/threads of the VMM's cgroup (default: the server's).
    #[serde(default)]
    pub pids_max: Option<u64>,
    /// Environment variables for code and programs run in the sandbox (on top of the
    /// template's).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Expose every guest port through the server from the start (E2B's rule; the E2B
    /// surface sets it from `allowPublicTraffic`). Default: none, ports are exposed one by one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expose_all_ports: Option<AllPorts>,
    /// Names of `env` entries whose values are secret: never stored, logged or answered
    /// (`get` shows `[redacted]`); they live in the server's memory while the sandbox runs.
    /// Names that look like credentials (`*_KEY`, `*_TOKEN`, `*_SECRET`, `*PASSWORD*`) are
    /// secret without being listed.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub secret_env: BTreeSet<String>,
    /// The caller's labels, returned by `get` and usable as `list` filters.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Network policy: `"none"` (default), `"egress"`, or a policy object.
    #[serde(default, deserialize_with = "policy_or_mode")]
    #[schema(value_type = NetworkPolicy)]
    pub network: NetworkPolicy,
    /// In a fleet: run only on a node with all these labels (`ember node --label KEY=VALUE`).
    /// One host (`ember serve`) has no labels to match and ignores them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_labels: BTreeMap<String, String>,
    /// Volumes to mount into the guest (docs/volumes.md). A fork keeps its parent's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<crate::volumes::VolumeMount>,
}

/// The resource envelope of a sandbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Resources {
    /// vCPUs.
    pub vcpus: u8,
    /// Guest memory, MiB.
    pub memory_mib: u64,
    /// Disk size, MiB (the copy-on-write overlay can hold at most this).
    pub disk_mib: u64,
    /// Host memory limit of the VMM's cgroup (guest memory + VMM overhead), MiB.
    pub memory_limit_mib: u64,
    /// CPU quota, percent of one CPU (None: no quota).
    pub cpu_percent: Option<u32>,
    /// Process/thread limit of the VMM's cgroup.
    pub pids_max: u64,
}

/// What the runtime knows of one sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SandboxInfo {
    /// Its id (16 hex digits, random).
    pub id: String,
    /// The template it started from.
    pub template: Option<String>,
    /// The named snapshot it started from, if any.
    pub snapshot: Option<String>,
    /// The sandbox it was forked from, if any.
    pub forked_from: Option<String>,
    /// Current state.
    pub state: State,
    /// Why it is in that state (failed: what happened; stopped: who stopped it).
    pub reason: Option<String>,
    /// Creation time, RFC 3339.
    pub created_at: String,
    /// When its timeout expires, RFC 3339 (None once final).
    pub ends_at: Option<String>,
    /// When its max lifetime ends, RFC 3339.
    pub max_until: Option<String>,
    /// What the timeout does.
    pub on_timeout: OnTimeout,
    /// Its resources.
    pub resources: Resources,
    /// The caller's labels.
    pub metadata: BTreeMap<String, String>,
    /// Its environment on top of the template's.
    pub env: BTreeMap<String, String>,
    /// The VMM's host pid while running.
    pub pid: Option<u32>,
    /// Milliseconds the last create/resume took (spawn → guest synced).
    pub start_ms: Option<f64>,
    /// Network policy and exposed ports.
    #[serde(default)]
    pub network: SandboxNetwork,
}

/// One recorded state change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Transition {
    /// When, RFC 3339 with milliseconds.
    pub at: String,
    /// From (None for the first).
    pub from: Option<State>,
    /// To.
    pub to: State,
    /// Why.
    pub reason: Option<String>,
}

/// One audited call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AuditRecord {
    /// Sequence number (increasing).
    pub seq: i64,
    /// When the call started, RFC 3339 with milliseconds.
    pub at: String,
    /// The sandbox (None for calls on no sandbox).
    pub sandbox: Option<String>,
    /// The call: `create`, `run_code`, `exec`, `file_write`, `kill`, …
    pub call: String,
    /// A summary of the arguments: code size and hash, argv, paths (never file contents).
    #[schema(value_type = Object)]
    pub args: serde_json::Value,
    /// How long it took.
    pub duration_ms: f64,
    /// `ok`, or the error's code.
    pub outcome: String,
    /// The error message, if it failed.
    pub error: Option<String>,
    /// Bytes sent into the sandbox.
    pub bytes_in: u64,
    /// Bytes that came out.
    pub bytes_out: u64,
}

/// Which audit records to return.
#[derive(
    Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema, utoipa::IntoParams,
)]
pub struct AuditFilter {
    /// Only this sandbox's.
    #[serde(default)]
    pub sandbox: Option<String>,
    /// Only this call type.
    #[serde(default)]
    pub call: Option<String>,
    /// Only `ok` or only a given error code.
    #[serde(default)]
    pub outcome: Option<String>,
    /// Only records with a sequence number above this (for paging/tailing).
    #[serde(default)]
    pub after: Option<i64>,
    /// At most this many (default 1000, newest last).
    #[serde(default)]
    pub limit: Option<usize>,
}

/// Which sandboxes `list` returns.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ListFilter {
    /// Only in this state.
    #[serde(default)]
    pub state: Option<State>,
    /// Include stopped and failed ones (default: only live ones).
    #[serde(default)]
    pub all: bool,
    /// Only those whose metadata has all of these key/values.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// A file copied out of a sandbox's outputs directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ArtifactInfo {
    /// Path relative to the outputs directory.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// When it was copied out, RFC 3339.
    pub collected_at: String,
}

/// A durable named snapshot of a sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SnapshotInfo {
    /// Its name (create accepts it as `snapshot`).
    pub name: String,
    /// The sandbox it was taken of.
    pub sandbox: String,
    /// The template that sandbox came from.
    pub template: Option<String>,
    /// When, RFC 3339.
    pub created_at: String,
    /// Bytes on disk (allocated).
    pub bytes: u64,
    /// Whether it holds the memory (restored) or the disk alone (booted).
    #[serde(default = "yes")]
    pub memory: bool,
}

fn yes() -> bool {
    true
}

/// Arguments of `snapshot`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    /// The name (letters, digits, `-`, `_`, `.`; unique). Default: `<sandbox>-<time>`.
    #[serde(default)]
    pub name: Option<String>,
    /// Keep the memory (default `true`): sandboxes created from the snapshot restore in
    /// milliseconds where it left off. `false` keeps the disk alone (after a `sync` in the
    /// guest): sandboxes created from it boot the template's current kernel on that disk and
    /// run its warm-up, with the files and without the processes or interpreter state.
    #[serde(default)]
    pub memory: Option<bool>,
}

/// Arguments of `fork`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// How many new sandboxes (1 to 64).
    pub count: u32,
    /// Their timeout in seconds (default: the parent's setting).
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    /// Labels for the new sandboxes (default: the parent's).
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

/// What a running sandbox uses on the host now ([`crate::Runtime::usage`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    /// When it was measured, ms since the Unix epoch.
    pub at_ms: i64,
    /// vCPUs of the guest.
    pub vcpus: u8,
    /// CPU time the VMM used during the sample, percent of all its vCPUs (0 to 100).
    pub cpu_used_pct: f64,
    /// Host memory charged to the VMM's cgroup (its resident set when there is no
    /// memory cgroup), bytes.
    pub mem_used_bytes: u64,
    /// Of that, page cache, bytes.
    pub mem_cache_bytes: u64,
    /// Guest memory, bytes.
    pub mem_total_bytes: u64,
    /// Bytes allocated by the sandbox's copy-on-write disk layer.
    pub disk_used_bytes: u64,
    /// Disk size, bytes.
    pub disk_total_bytes: u64,
}

/// Counters of the runtime for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Metrics {
    /// Sandboxes by state (live states from memory, final ones from the store).
    pub by_state: BTreeMap<String, u64>,
    /// Creates that succeeded.
    pub creates: u64,
    /// Creates that failed.
    pub create_failures: u64,
    /// VMMs that died unexpectedly.
    pub vmm_failures: u64,
    /// Create latency histogram: (upper bound ms, count) cumulative buckets, plus sum and count.
    pub create_ms: Histogram,
    /// Per-call latency histograms by call type.
    pub call_ms: BTreeMap<String, Histogram>,
    /// Guest memory committed by live (non-paused) sandboxes, MiB.
    pub committed_memory_mib: u64,
}

/// A latency histogram with fixed bucket bounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Histogram {
    /// Upper bounds of the buckets, ms.
    pub bounds: Vec<f64>,
    /// Counts per bucket (not cumulative); one more than `bounds` (the +Inf bucket).
    pub counts: Vec<u64>,
    /// Sum of observations, ms.
    pub sum: f64,
    /// Observations.
    pub count: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        let bounds = vec![
            1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0,
            30000.0,
        ];
        let counts = vec![0; bounds.len() + 1];
        Histogram {
            bounds,
            counts,
            sum: 0.0,
            count: 0,
        }
    }
}

impl Histogram {
    /// Adds one observation.
    pub fn observe(&mut self, ms: f64) {
        let i = self
            .bounds
            .iter()
            .position(|b| ms <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += ms;
        self.count += 1;
    }
}

/// A background process as its caller started it (`crate::processes`): its pid, the tag it
/// was given and the caller's own description of it (E2B's process config), kept by the
/// runtime so that a server restart loses neither.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessRecord {
    /// The guest pid.
    pub pid: u32,
    /// The caller's tag, if it gave one.
    pub tag: Option<String>,
    /// The caller's description (opaque to the runtime).
    pub config: serde_json::Value,
}

/// How an attached background program's stream ended (`ProcessAttach`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessEnd {
    /// How the call ended (`ok`; `timed_out` when the program's own deadline passed).
    pub status: ember_agent::protocol::EndStatus,
    /// How the program ended, when the stream saw it end.
    pub exit: Option<ember_agent::protocol::ExitStatus>,
}

/// One change a polling watcher saw (`WatcherEvents`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsChange {
    /// The absolute guest path that changed.
    pub path: String,
    /// The same, relative to the watched directory.
    pub name: String,
    /// What happened to it.
    pub op: ember_agent::protocol::FsOp,
}

/// One call's counters on the call surface (`Runtime::call_counts`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CallStats {
    /// Calls handled.
    pub count: u64,
    /// Of which failed.
    pub failed: u64,
    /// Time spent in them, milliseconds.
    pub total_ms: f64,
}

/// The VM shape of a template.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VmShapeInfo {
    /// vCPUs.
    pub vcpus: u8,
    /// Guest memory, MiB.
    pub memory_mib: u64,
    /// Root disk size, MiB, when the recipe gives one.
    pub disk_mib: Option<u64>,
}

/// A built template.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateSummary {
    /// The name it is known by (None: an older build no name points at any more).
    pub name: Option<String>,
    /// The hash of everything that went into it.
    pub key: String,
    /// When it was built, RFC 3339.
    pub built_at: String,
    /// The VM shape every sandbox of it has.
    pub vm: VmShapeInfo,
    /// Bytes of its snapshot on disk.
    pub snapshot_bytes: u64,
    /// The guest directory whose files become artifacts.
    pub outputs: String,
}

impl TemplateSummary {
    /// The summary of a built template.
    pub fn of(name: Option<String>, t: &crate::Template) -> Self {
        TemplateSummary {
            name,
            key: t.info.key.clone(),
            built_at: t.info.built_at.clone(),
            vm: VmShapeInfo {
                vcpus: t.info.vm.vcpus,
                memory_mib: t.info.vm.memory_mib,
                disk_mib: t.info.vm.disk_mib,
            },
            snapshot_bytes: t.info.snapshot_bytes,
            outputs: t.info.outputs.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip_through_their_names() {
        for s in State::ALL {
            assert_eq!(State::parse(s.as_str()), Some(s));
            assert_eq!(
                serde_json::to_value(s).unwrap(),
                serde_json::json!(s.as_str())
            );
        }
        assert_eq!(State::parse("bogus"), None);
        assert!(State::Failed.is_final() && !State::Paused.is_final());
    }

    #[test]
    fn create_request_rejects_unknown_fields_and_defaults_the_rest() {
        let r: CreateRequest = serde_json::from_str(r#"{"template":"default"}"#).unwrap();
        assert_eq!(r.on_timeout, OnTimeout::Kill);
        assert_eq!(r.network.mode, NetMode::None);
        assert!(serde_json::from_str::<CreateRequest>(r#"{"templat":"x"}"#).is_err());
        assert!(serde_json::from_str::<CreateRequest>(r#"{"timeout_secs":"x"}"#).is_err());
        assert!(serde_json::from_str::<CreateRequest>(r#"{"network":"host"}"#).is_err());
        let r: CreateRequest = serde_json::from_str(r#"{"network":"egress"}"#).unwrap();
        assert_eq!(r.network.mode, NetMode::Egress);
        let r: CreateRequest = serde_json::from_str(
            r#"{"network":{"mode":"egress","allow_domains":["*.example.com"]}}"#,
        )
        .unwrap();
        assert_eq!(r.network.allow_domains, ["*.example.com"]);
        assert!(serde_json::from_str::<CreateRequest>(r#"{"network":{"mode":"x"}}"#).is_err());
    }

    #[test]
    fn histogram_buckets_observations() {
        let mut h = Histogram::default();
        h.observe(0.5);
        h.observe(3.0);
        h.observe(1e9);
        assert_eq!(h.count, 3);
        assert_eq!(h.counts[0], 1);
        assert_eq!(h.counts[2], 1);
        assert_eq!(*h.counts.last().unwrap(), 1);
    }
}
