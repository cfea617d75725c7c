//! The runtime's server-wide settings: where things live and the caps every sandbox is held
//! to.

use std::path::PathBuf;
use std::time::Duration;

/// Server-wide settings of a [`super::Runtime`].
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// `$EMBER_HOME`: the database, sandboxes' state, jails, artifacts, snapshots.
    pub home: PathBuf,
    /// The `ember-vmm` binary (default: beside the running executable, or `$EMBER_VMM`).
    pub vmm: Option<PathBuf>,
    /// The `ember-jailer` binary (default: beside `ember-vmm`, or `$EMBER_JAILER`).
    pub jailer: Option<PathBuf>,
    /// First host uid (and gid) of jailed VMMs; each live sandbox gets its own above it.
    pub uid_base: u32,
    /// How many uids there are to hand out (caps live sandboxes too).
    pub uid_count: u32,
    /// Most sandboxes with a VMM (creating, running, pausing, resuming) at once.
    pub max_running: usize,
    /// Most guest memory (MiB) committed by sandboxes with a VMM. Restored guests share the
    /// template's pages until they write them, so this may exceed host RAM; the default is
    /// 4× the host's RAM.
    pub max_committed_memory_mib: u64,
    /// Timeout of a sandbox when create does not say (5 min).
    pub default_timeout: Duration,
    /// Longest timeout and max lifetime accepted (24 h).
    pub max_lifetime: Duration,
    /// How long a paused sandbox is kept before it is deleted (7 days).
    pub paused_retention: Duration,
    /// How long records (audit, history) and artifacts of ended sandboxes are kept (30 days).
    pub record_retention: Duration,
    /// Host memory the VMM itself may use on top of guest memory (cgroup limit), MiB.
    pub vmm_overhead_mib: u64,
    /// Highest CPU quota a create may ask for, percent of one CPU (None: no cap; then a
    /// create without a quota gets none).
    pub max_cpu_percent: Option<u32>,
    /// Process/thread limit of each VMM's cgroup (a create may ask for less).
    pub pids_max: u64,
    /// Largest total size of one sandbox's artifacts.
    pub artifact_max_bytes: u64,
    /// Largest single artifact.
    pub artifact_max_file_bytes: u64,
    /// Most artifact files per sandbox.
    pub artifact_max_files: usize,
    /// Largest upload into a sandbox.
    pub max_upload_bytes: u64,
    /// Time limit of a run_code/exec call that gives none.
    pub default_call_timeout: Duration,
    /// Cap on the output a run_code returns (bytes of stdout+stderr); more is cut with a
    /// `truncated` event.
    pub default_output_cap: u64,
    /// Size cap of each sandbox's console and VMM log files (each rotates once: at most
    /// twice this on disk).
    pub log_max_bytes: u64,
    /// How long a restored guest may take to answer.
    pub connect_timeout: Duration,
    /// Most VM starts (restore → agent answered) under way at once; more wait in line
    /// (see [`super::gate`]). 0: no limit.
    pub max_starting: usize,
    /// Kill running sandboxes when the runtime is dropped (one-shot tools); a server leaves
    /// them running so that a restart re-attaches them.
    pub kill_on_drop: bool,
    /// Jails get a hard link to one root-owned copy of the VMM binary per runtime
    /// (`$EMBER_HOME/bin/`) rather than a copy each, so that idle VMMs share its pages
    /// (a copy costs each one the binary's text as private memory). The shared copy is
    /// never the installed binary. Off: a copy per jail, no page shared between VMMs but
    /// the template's memory.
    pub share_vmm_binary: bool,
    /// Sandbox networking (uplink, address pool, upstream resolver).
    pub network: crate::netpolicy::NetOptions,
    /// The warm pool of jailed VMMs waiting for their restore (`ember serve --pool N`):
    /// `size` per template (0, the default, turns it off; see [`crate::pool`]).
    pub pool: crate::pool::PoolSettings,
    /// Templates whose pool is filled from the start (others get one at their first create).
    pub pool_templates: Vec<String>,
}

fn host_ram_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb / 1024)
        .unwrap_or(4096)
}

impl RuntimeConfig {
    /// Defaults for `home`.
    pub fn new(home: impl Into<PathBuf>) -> Self {
        RuntimeConfig {
            home: home.into(),
            vmm: None,
            jailer: None,
            uid_base: 200_000,
            uid_count: 10_000,
            max_running: 1000,
            max_committed_memory_mib: host_ram_mib() * 4,
            default_timeout: Duration::from_secs(300),
            max_lifetime: Duration::from_secs(24 * 3600),
            paused_retention: Duration::from_secs(7 * 24 * 3600),
            record_retention: Duration::from_secs(30 * 24 * 3600),
            vmm_overhead_mib: 64,
            max_cpu_percent: None,
            pids_max: 64,
            artifact_max_bytes: 256 << 20,
            artifact_max_file_bytes: 100 << 20,
            artifact_max_files: 1000,
            max_upload_bytes: 4 << 30,
            default_call_timeout: Duration::from_secs(3600),
            default_output_cap: 16 << 20,
            log_max_bytes: 1 << 20,
            connect_timeout: Duration::from_secs(120),
            max_starting: super::gate::default_limit(),
            kill_on_drop: false,
            share_vmm_binary: true,
            network: crate::netpolicy::NetOptions::default(),
            pool: crate::pool::PoolSettings::default(),
            pool_templates: vec!["default".to_string()],
        }
    }

    /// Defaults for `$EMBER_HOME`.
    pub fn from_env() -> Self {
        RuntimeConfig::new(crate::paths::home_dir())
    }

    /// The SQLite database.
    pub fn db_path(&self) -> PathBuf {
        self.home.join("ember.db")
    }

    /// Per-sandbox host state: `<home>/sandboxes/<id>`.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.home.join("sandboxes").join(id)
    }

    /// Where jails are built: `<home>/jails`.
    pub fn jails_dir(&self) -> PathBuf {
        self.home.join("jails")
    }

    /// A sandbox's artifacts: `<home>/artifacts/<id>`.
    pub fn artifacts_dir(&self, id: &str) -> PathBuf {
        self.home.join("artifacts").join(id)
    }

    /// Named snapshots: `<home>/snapshots`.
    pub fn snapshots_dir(&self) -> PathBuf {
        self.home.join("snapshots")
    }

    /// Cgroup parent (relative to the cgroup root) of the runtime's jails:
    /// `ember-rt-<hash of home>`, so that two runtimes on one host (tests, or a second
    /// `$EMBER_HOME`) never take each other's jails for orphans.
    pub fn cgroup_parent(&self) -> PathBuf {
        use sha2::Digest;
        let h = sha2::Sha256::digest(self.home.as_os_str().as_encoded_bytes());
        let hex: String = h.iter().take(4).map(|b| format!("{b:02x}")).collect();
        PathBuf::from(format!("ember-rt-{hex}"))
    }
}
