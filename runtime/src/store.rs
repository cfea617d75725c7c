//! The durable store: one SQLite database (WAL) under `$EMBER_HOME` holding sandboxes, their
//! state history, the audit log, artifacts, named snapshots and the templates seen.
//!
//! The runtime is the only writer; every change of a sandbox is written before the call that
//! made it returns, so a crashed server finds on restart exactly what it had. The schema has
//! a version (`meta.schema`); a database from a newer ember is refused, not rewritten.
//! Behind this one type so that a shared store (PostgreSQL, when several hosts share a
//! gateway) can replace it later.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OptionalExtension};

use crate::types::{
    ArtifactInfo, AuditFilter, AuditRecord, OnTimeout, ProcessRecord, Resources, SandboxInfo,
    SnapshotInfo, State, Transition,
};

/// Version of the schema below.
pub const SCHEMA_VERSION: i64 = 2;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    template TEXT,
    snapshot TEXT,
    forked_from TEXT,
    source_dir TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    created_ms INTEGER NOT NULL,
    ends_ms INTEGER,
    max_until_ms INTEGER,
    ended_ms INTEGER,
    on_timeout TEXT NOT NULL,
    timeout_ms INTEGER NOT NULL,
    resources TEXT NOT NULL,
    metadata TEXT NOT NULL,
    env TEXT NOT NULL,
    outputs TEXT NOT NULL,
    uid INTEGER,
    jail_id TEXT,
    pid INTEGER,
    pause_dir TEXT,
    start_ms REAL,
    network TEXT
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS transitions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    reason TEXT
);
CREATE INDEX IF NOT EXISTS transitions_sandbox ON transitions(sandbox);
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms INTEGER NOT NULL,
    sandbox TEXT,
    call TEXT NOT NULL,
    args TEXT NOT NULL,
    duration_ms REAL NOT NULL,
    outcome TEXT NOT NULL,
    error TEXT,
    bytes_in INTEGER NOT NULL,
    bytes_out INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_sandbox ON audit(sandbox, seq);
CREATE TABLE IF NOT EXISTS artifacts (
    sandbox TEXT NOT NULL,
    path TEXT NOT NULL,
    size INTEGER NOT NULL,
    collected_ms INTEGER NOT NULL,
    PRIMARY KEY (sandbox, path)
);
CREATE TABLE IF NOT EXISTS snapshots (
    name TEXT PRIMARY KEY,
    sandbox TEXT NOT NULL,
    template TEXT,
    dir TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
-- Background processes as their callers started them (crate::processes). A table of its own
-- that older servers ignore: no schema version change.
CREATE TABLE IF NOT EXISTS processes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox TEXT NOT NULL,
    pid INTEGER NOT NULL,
    tag TEXT,
    config TEXT NOT NULL,
    UNIQUE (sandbox, pid)
);
-- Polling watchers on guest directories (crate::watches): what to watch, so that a restarted
-- server watches again. Also a table older servers ignore.
CREATE TABLE IF NOT EXISTS watchers (
    id TEXT PRIMARY KEY,
    sandbox TEXT NOT NULL,
    path TEXT NOT NULL,
    recursive INTEGER NOT NULL,
    created_ms INTEGER NOT NULL
);
";

/// A polling watcher as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatcherRow {
    /// Its id.
    pub id: String,
    /// The sandbox it watches in.
    pub sandbox: String,
    /// The guest directory.
    pub path: String,
    /// Whether it watches below the directory too.
    pub recursive: bool,
}

/// Store errors are SQLite's (plus a refused schema).
pub type StoreResult<T> = Result<T, rusqlite::Error>;

pub use crate::clock::{now_ms, rfc3339};

/// One sandbox as stored: the public [`SandboxInfo`] plus what the runtime needs to find its
/// processes and files again. Serializable: a paused sandbox that moves to another host
/// carries its row (`Runtime::export_paused`, `Runtime::import_paused`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SandboxRow {
    /// Id.
    pub id: String,
    /// Template name.
    pub template: Option<String>,
    /// Named snapshot it started from.
    pub snapshot: Option<String>,
    /// Parent of a fork.
    pub forked_from: Option<String>,
    /// The snapshot directory it was restored from.
    pub source_dir: PathBuf,
    /// State.
    pub state: State,
    /// Reason for the state.
    pub reason: Option<String>,
    /// Created, ms.
    pub created_ms: i64,
    /// Timeout expiry, ms.
    pub ends_ms: Option<i64>,
    /// Max lifetime end, ms.
    pub max_until_ms: Option<i64>,
    /// When it reached a final state, ms.
    pub ended_ms: Option<i64>,
    /// What the timeout does.
    pub on_timeout: OnTimeout,
    /// The timeout length (re-armed by calls? no: set at create and by set_timeout).
    pub timeout_ms: i64,
    /// Resources.
    pub resources: Resources,
    /// Labels.
    pub metadata: BTreeMap<String, String>,
    /// Environment (secret values included, in memory only: see `secret_env`).
    pub env: BTreeMap<String, String>,
    /// Names of `env` entries whose values are secret (`crate::secret_env`): written as a
    /// marker, shown redacted.
    #[serde(default)]
    pub secret_env: BTreeSet<String>,
    /// Guest directory whose files are artifacts.
    pub outputs: String,
    /// Host uid of its jail.
    pub uid: Option<u32>,
    /// Current jail id.
    pub jail_id: Option<String>,
    /// VMM pid while running.
    pub pid: Option<u32>,
    /// Pause snapshot directory while paused.
    pub pause_dir: Option<PathBuf>,
    /// Last start (create/resume) time, ms.
    pub start_ms: Option<f64>,
    /// Network policy and exposed ports.
    pub network: crate::SandboxNetwork,
}

impl SandboxRow {
    /// The public view.
    pub fn info(&self) -> SandboxInfo {
        SandboxInfo {
            id: self.id.clone(),
            template: self.template.clone(),
            snapshot: self.snapshot.clone(),
            forked_from: self.forked_from.clone(),
            state: self.state,
            reason: self.reason.clone(),
            created_at: rfc3339(self.created_ms),
            ends_at: (!self.state.is_final())
                .then_some(self.ends_ms)
                .flatten()
                .map(rfc3339),
            max_until: self.max_until_ms.map(rfc3339),
            on_timeout: self.on_timeout,
            resources: self.resources.clone(),
            metadata: self.metadata.clone(),
            env: crate::secret_env::shown(&self.env, &self.secret_env),
            pid: self.pid,
            start_ms: self.start_ms,
            network: self.network.clone(),
        }
    }
}

/// The database.
#[derive(Debug)]
pub struct Store {
    conn: Connection,
}

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "null".into())
}

fn from_json<T: serde::de::DeserializeOwned + Default>(s: &str) -> T {
    serde_json::from_str(s).unwrap_or_default()
}

fn on_timeout_str(o: OnTimeout) -> &'static str {
    match o {
        OnTimeout::Kill => "kill",
        OnTimeout::Pause => "pause",
    }
}

const SANDBOX_COLS: &str = "id, template, snapshot, forked_from, source_dir, state, reason, \
    created_ms, ends_ms, max_until_ms, ended_ms, on_timeout, timeout_ms, resources, metadata, \
    env, outputs, uid, jail_id, pid, pause_dir, start_ms, network";

fn row_to_sandbox(r: &rusqlite::Row<'_>) -> rusqlite::Result<SandboxRow> {
    let state: String = r.get(5)?;
    let on_timeout: String = r.get(11)?;
    let resources: String = r.get(13)?;
    let metadata: String = r.get(14)?;
    let mut env: BTreeMap<String, String> = from_json(&r.get::<_, String>(15)?);
    let mut secret_env = BTreeSet::new();
    crate::secret_env::restore(&mut env, &mut secret_env);
    Ok(SandboxRow {
        id: r.get(0)?,
        template: r.get(1)?,
        snapshot: r.get(2)?,
        forked_from: r.get(3)?,
        source_dir: PathBuf::from(r.get::<_, String>(4)?),
        state: State::parse(&state).unwrap_or(State::Failed),
        reason: r.get(6)?,
        created_ms: r.get(7)?,
        ends_ms: r.get(8)?,
        max_until_ms: r.get(9)?,
        ended_ms: r.get(10)?,
        on_timeout: if on_timeout == "pause" {
            OnTimeout::Pause
        } else {
            OnTimeout::Kill
        },
        timeout_ms: r.get(12)?,
        resources: from_json(&resources),
        metadata: from_json(&metadata),
        env,
        secret_env,
        outputs: r.get(16)?,
        uid: r.get(17)?,
        jail_id: r.get(18)?,
        pid: r.get(19)?,
        pause_dir: r.get::<_, Option<String>>(20)?.map(PathBuf::from),
        start_ms: r.get(21)?,
        network: r
            .get::<_, Option<String>>(22)?
            .map(|s| from_json(&s))
            .unwrap_or_default(),
    })
}

impl Store {
    /// Opens (creating) the database at `path`.
    pub fn open(path: &Path) -> StoreResult<Store> {
        // Created mode 0600: SQLite gives its WAL and shared-memory files the same mode.
        if !path.exists() {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(|e| {
                    rusqlite::Error::InvalidParameterName(format!(
                        "cannot create {}: {e}",
                        path.display()
                    ))
                })?;
        }
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(SCHEMA)?;
        let version: Option<String> = conn
            .query_row("SELECT value FROM meta WHERE key = 'schema'", [], |r| {
                r.get(0)
            })
            .optional()?;
        match version.and_then(|v| v.parse::<i64>().ok()) {
            None => {
                conn.execute(
                    "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema', ?1)",
                    params![SCHEMA_VERSION.to_string()],
                )?;
            }
            Some(v) if v > SCHEMA_VERSION => {
                return Err(rusqlite::Error::InvalidParameterName(format!(
                    "{} has schema version {v}, newer than this ember's {SCHEMA_VERSION}",
                    path.display()
                )));
            }
            Some(1) => {
                // Version 2 added the network column.
                conn.execute_batch(
                    "ALTER TABLE sandboxes ADD COLUMN network TEXT; \
                     UPDATE meta SET value = '2' WHERE key = 'schema';",
                )?;
            }
            Some(_) => {}
        }
        Ok(Store { conn })
    }

    /// Inserts a new sandbox and its first transition.
    pub fn insert_sandbox(&self, s: &SandboxRow) -> StoreResult<()> {
        self.conn.execute(
            &format!(
                "INSERT INTO sandboxes ({SANDBOX_COLS}) VALUES \
                 (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, \
                 ?18, ?19, ?20, ?21, ?22, ?23)"
            ),
            params![
                s.id,
                s.template,
                s.snapshot,
                s.forked_from,
                s.source_dir.to_string_lossy(),
                s.state.as_str(),
                s.reason,
                s.created_ms,
                s.ends_ms,
                s.max_until_ms,
                s.ended_ms,
                on_timeout_str(s.on_timeout),
                s.timeout_ms,
                json(&s.resources),
                json(&s.metadata),
                json(&crate::secret_env::at_rest(&s.env, &s.secret_env)),
                s.outputs,
                s.uid,
                s.jail_id,
                s.pid,
                s.pause_dir
                    .as_ref()
                    .map(|p| p.to_string_lossy().into_owned()),
                s.start_ms,
                json(&s.network),
            ],
        )?;
        self.add_transition(&s.id, None, s.state, s.reason.as_deref())
    }

    /// Writes every mutable field of `s` (the row must exist).
    pub fn update_sandbox(&self, s: &SandboxRow) -> StoreResult<()> {
        self.conn.execute(
            "UPDATE sandboxes SET state = ?2, reason = ?3, ends_ms = ?4, max_until_ms = ?5, \
             ended_ms = ?6, timeout_ms = ?7, uid = ?8, jail_id = ?9, pid = ?10, \
             pause_dir = ?11, start_ms = ?12, on_timeout = ?13, network = ?14 WHERE id = ?1",
            params![
                s.id,
                s.state.as_str(),
                s.reason,
                s.ends_ms,
                s.max_until_ms,
                s.ended_ms,
                s.timeout_ms,
                s.uid,
                s.jail_id,
                s.pid,
                s.pause_dir
                    .as_ref()
                    .map(|p| p.to_string_lossy().into_owned()),
                s.start_ms,
                on_timeout_str(s.on_timeout),
                json(&s.network),
            ],
        )?;
        Ok(())
    }

    /// Records a state change.
    pub fn add_transition(
        &self,
        id: &str,
        from: Option<State>,
        to: State,
        reason: Option<&str>,
    ) -> StoreResult<()> {
        self.conn.execute(
            "INSERT INTO transitions (sandbox, at_ms, from_state, to_state, reason) \
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![id, now_ms(), from.map(State::as_str), to.as_str(), reason],
        )?;
        Ok(())
    }

    /// One sandbox.
    pub fn sandbox(&self, id: &str) -> StoreResult<Option<SandboxRow>> {
        self.conn
            .query_row(
                &format!("SELECT {SANDBOX_COLS} FROM sandboxes WHERE id = ?1"),
                params![id],
                row_to_sandbox,
            )
            .optional()
    }

    /// Sandboxes, newest first; `live_only` leaves out stopped and failed ones.
    pub fn sandboxes(&self, live_only: bool) -> StoreResult<Vec<SandboxRow>> {
        let sql = if live_only {
            format!(
                "SELECT {SANDBOX_COLS} FROM sandboxes WHERE state NOT IN ('stopped', 'failed') \
                 ORDER BY created_ms DESC"
            )
        } else {
            format!("SELECT {SANDBOX_COLS} FROM sandboxes ORDER BY created_ms DESC")
        };
        let mut st = self.conn.prepare_cached(&sql)?;
        let rows = st.query_map([], row_to_sandbox)?;
        rows.collect()
    }

    /// Counts of sandboxes by state.
    pub fn count_by_state(&self) -> StoreResult<BTreeMap<String, u64>> {
        let mut st = self
            .conn
            .prepare_cached("SELECT state, COUNT(*) FROM sandboxes GROUP BY state")?;
        let rows = st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
        let mut out = BTreeMap::new();
        for r in rows {
            let (k, v) = r?;
            out.insert(k, v as u64);
        }
        Ok(out)
    }

    /// The state history of a sandbox, oldest first.
    pub fn transitions(&self, id: &str) -> StoreResult<Vec<Transition>> {
        let mut st = self.conn.prepare_cached(
            "SELECT at_ms, from_state, to_state, reason FROM transitions WHERE sandbox = ?1 \
             ORDER BY seq",
        )?;
        let rows = st.query_map(params![id], |r| {
            let from: Option<String> = r.get(1)?;
            let to: String = r.get(2)?;
            Ok(Transition {
                at: rfc3339(r.get(0)?),
                from: from.as_deref().and_then(State::parse),
                to: State::parse(&to).unwrap_or(State::Failed),
                reason: r.get(3)?,
            })
        })?;
        rows.collect()
    }

    /// Every sandbox's state changes after sequence number `after` (at most `limit`, oldest
    /// first): `(seq, sandbox, change)`.
    pub fn transitions_after(
        &self,
        after: i64,
        limit: i64,
    ) -> StoreResult<Vec<(i64, String, Transition)>> {
        let mut st = self.conn.prepare_cached(
            "SELECT seq, sandbox, at_ms, from_state, to_state, reason FROM transitions \
             WHERE seq > ?1 ORDER BY seq LIMIT ?2",
        )?;
        let rows = st.query_map(params![after, limit], |r| {
            let from: Option<String> = r.get(3)?;
            let to: String = r.get(4)?;
            Ok((
                r.get(0)?,
                r.get(1)?,
                Transition {
                    at: rfc3339(r.get(2)?),
                    from: from.as_deref().and_then(State::parse),
                    to: State::parse(&to).unwrap_or(State::Failed),
                    reason: r.get(5)?,
                },
            ))
        })?;
        rows.collect()
    }

    /// Appends an audit record; returns its sequence number.
    #[allow(clippy::too_many_arguments)]
    pub fn audit(
        &self,
        at_ms: i64,
        sandbox: Option<&str>,
        call: &str,
        args: &serde_json::Value,
        duration_ms: f64,
        outcome: &str,
        error: Option<&str>,
        bytes_in: u64,
        bytes_out: u64,
    ) -> StoreResult<i64> {
        self.conn.execute(
            "INSERT INTO audit (at_ms, sandbox, call, args, duration_ms, outcome, error, \
             bytes_in, bytes_out) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            params![
                at_ms,
                sandbox,
                call,
                args.to_string(),
                duration_ms,
                outcome,
                error,
                bytes_in as i64,
                bytes_out as i64
            ],
        )?;
        Ok(self.conn.last_insert_rowid())
    }

    /// Audit records matching `f`, oldest first (the newest `limit` of them).
    pub fn audit_records(&self, f: &AuditFilter) -> StoreResult<Vec<AuditRecord>> {
        let limit = f.limit.unwrap_or(1000).clamp(1, 100_000) as i64;
        let mut st = self.conn.prepare_cached(
            "SELECT seq, at_ms, sandbox, call, args, duration_ms, outcome, error, bytes_in, \
             bytes_out FROM audit WHERE (?1 IS NULL OR sandbox = ?1) AND (?2 IS NULL OR call = ?2) \
             AND (?3 IS NULL OR outcome = ?3) AND seq > ?4 ORDER BY seq DESC LIMIT ?5",
        )?;
        let rows = st.query_map(
            params![f.sandbox, f.call, f.outcome, f.after.unwrap_or(0), limit],
            |r| {
                let args: String = r.get(4)?;
                Ok(AuditRecord {
                    seq: r.get(0)?,
                    at: rfc3339(r.get(1)?),
                    sandbox: r.get(2)?,
                    call: r.get(3)?,
                    args: serde_json::from_str(&args).unwrap_or(serde_json::Value::Null),
                    duration_ms: r.get(5)?,
                    outcome: r.get(6)?,
                    error: r.get(7)?,
                    bytes_in: r.get::<_, i64>(8)? as u64,
                    bytes_out: r.get::<_, i64>(9)? as u64,
                })
            },
        )?;
        let mut out: Vec<AuditRecord> = rows.collect::<StoreResult<_>>()?;
        out.reverse();
        Ok(out)
    }

    /// Records (or updates) an artifact.
    pub fn put_artifact(&self, sandbox: &str, path: &str, size: u64) -> StoreResult<()> {
        self.conn.execute(
            "INSERT OR REPLACE INTO artifacts (sandbox, path, size, collected_ms) \
             VALUES (?1, ?2, ?3, ?4)",
            params![sandbox, path, size as i64, now_ms()],
        )?;
        Ok(())
    }

    /// A sandbox's artifacts, by path.
    pub fn artifacts(&self, sandbox: &str) -> StoreResult<Vec<ArtifactInfo>> {
        let mut st = self.conn.prepare_cached(
            "SELECT path, size, collected_ms FROM artifacts WHERE sandbox = ?1 ORDER BY path",
        )?;
        let rows = st.query_map(params![sandbox], |r| {
            Ok(ArtifactInfo {
                path: r.get(0)?,
                size: r.get::<_, i64>(1)? as u64,
                collected_at: rfc3339(r.get(2)?),
            })
        })?;
        rows.collect()
    }

    /// Records a named snapshot.
    pub fn put_snapshot(&self, s: &SnapshotInfo, dir: &Path, created_ms: i64) -> StoreResult<()> {
        self.conn.execute(
            "INSERT INTO snapshots (name, sandbox, template, dir, created_ms, bytes) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                s.name,
                s.sandbox,
                s.template,
                dir.to_string_lossy(),
                created_ms,
                s.bytes as i64
            ],
        )?;
        Ok(())
    }

    /// A named snapshot and its directory.
    pub fn snapshot(&self, name: &str) -> StoreResult<Option<(SnapshotInfo, PathBuf)>> {
        self.conn
            .query_row(
                "SELECT name, sandbox, template, dir, created_ms, bytes FROM snapshots \
                 WHERE name = ?1",
                params![name],
                snapshot_row,
            )
            .optional()
    }

    /// All named snapshots.
    pub fn snapshots(&self) -> StoreResult<Vec<SnapshotInfo>> {
        let mut st = self.conn.prepare_cached(
            "SELECT name, sandbox, template, dir, created_ms, bytes FROM snapshots \
             ORDER BY created_ms",
        )?;
        let rows = st.query_map([], |r| snapshot_row(r).map(|(info, _)| info))?;
        rows.collect()
    }

    /// Removes a named snapshot's record.
    pub fn delete_snapshot(&self, name: &str) -> StoreResult<bool> {
        Ok(self
            .conn
            .execute("DELETE FROM snapshots WHERE name = ?1", params![name])?
            > 0)
    }

    /// Ids of final sandboxes that ended before `before_ms` (their records and artifacts are
    /// past retention).
    pub fn ended_before(&self, before_ms: i64) -> StoreResult<Vec<String>> {
        let mut st = self.conn.prepare_cached(
            "SELECT id FROM sandboxes WHERE state IN ('stopped', 'failed') AND ended_ms < ?1",
        )?;
        let rows = st.query_map(params![before_ms], |r| r.get(0))?;
        rows.collect()
    }

    /// Records (or replaces) a background process of `sandbox`; past `cap` processes in all,
    /// the oldest records go.
    pub fn put_process(&self, sandbox: &str, p: &ProcessRecord, cap: usize) -> StoreResult<()> {
        let config = p.config.to_string();
        self.conn.execute(
            "INSERT OR REPLACE INTO processes (sandbox, pid, tag, config) VALUES (?1, ?2, ?3, ?4)",
            params![sandbox, p.pid, p.tag, config],
        )?;
        self.conn.execute(
            "DELETE FROM processes WHERE seq NOT IN \
             (SELECT seq FROM processes ORDER BY seq DESC LIMIT ?1)",
            params![cap as i64],
        )?;
        Ok(())
    }

    /// The background processes recorded for `sandbox`, oldest first.
    pub fn processes(&self, sandbox: &str) -> StoreResult<Vec<ProcessRecord>> {
        let mut st = self
            .conn
            .prepare("SELECT pid, tag, config FROM processes WHERE sandbox = ?1 ORDER BY seq")?;
        let rows = st.query_map(params![sandbox], |r| {
            let config: String = r.get(2)?;
            Ok(ProcessRecord {
                pid: r.get(0)?,
                tag: r.get(1)?,
                config: serde_json::from_str(&config).unwrap_or(serde_json::Value::Null),
            })
        })?;
        rows.collect()
    }

    /// Forgets process `pid` of `sandbox`, or all of its processes.
    pub fn forget_processes(&self, sandbox: &str, pid: Option<u32>) -> StoreResult<()> {
        match pid {
            Some(pid) => self.conn.execute(
                "DELETE FROM processes WHERE sandbox = ?1 AND pid = ?2",
                params![sandbox, pid],
            )?,
            None => self
                .conn
                .execute("DELETE FROM processes WHERE sandbox = ?1", params![sandbox])?,
        };
        Ok(())
    }

    /// Records a polling watcher.
    pub fn put_watcher(&self, w: &WatcherRow) -> StoreResult<()> {
        self.conn.execute(
            "INSERT OR REPLACE INTO watchers (id, sandbox, path, recursive, created_ms) \
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![w.id, w.sandbox, w.path, w.recursive, now_ms()],
        )?;
        Ok(())
    }

    /// The polling watchers of `sandbox` (all of them with `None`), oldest first.
    pub fn watchers(&self, sandbox: Option<&str>) -> StoreResult<Vec<WatcherRow>> {
        let mut st = self.conn.prepare(
            "SELECT id, sandbox, path, recursive FROM watchers \
             WHERE ?1 IS NULL OR sandbox = ?1 ORDER BY created_ms, id",
        )?;
        let rows = st.query_map(params![sandbox], |r| {
            Ok(WatcherRow {
                id: r.get(0)?,
                sandbox: r.get(1)?,
                path: r.get(2)?,
                recursive: r.get(3)?,
            })
        })?;
        rows.collect()
    }

    /// Forgets polling watcher `id`, or (no id) every watcher of `sandbox`.
    pub fn forget_watchers(&self, sandbox: &str, id: Option<&str>) -> StoreResult<usize> {
        match id {
            Some(id) => self.conn.execute(
                "DELETE FROM watchers WHERE sandbox = ?1 AND id = ?2",
                params![sandbox, id],
            ),
            None => self
                .conn
                .execute("DELETE FROM watchers WHERE sandbox = ?1", params![sandbox]),
        }
    }

    /// Deletes every record of a sandbox (after retention).
    pub fn purge_sandbox(&self, id: &str) -> StoreResult<()> {
        for table in ["transitions", "artifacts", "processes", "watchers"] {
            self.conn.execute(
                &format!("DELETE FROM {table} WHERE sandbox = ?1"),
                params![id],
            )?;
        }
        self.conn
            .execute("DELETE FROM audit WHERE sandbox = ?1", params![id])?;
        self.conn
            .execute("DELETE FROM sandboxes WHERE id = ?1", params![id])?;
        Ok(())
    }
}

/// A `snapshots` row (name, sandbox, template, dir, created_ms, bytes). Whether it holds
/// memory is told by its directory (a filesystem-only one has a marker file and no memory).
fn snapshot_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(SnapshotInfo, PathBuf)> {
    let dir = PathBuf::from(r.get::<_, String>(3)?);
    Ok((
        SnapshotInfo {
            name: r.get(0)?,
            sandbox: r.get(1)?,
            template: r.get(2)?,
            created_at: rfc3339(r.get(4)?),
            bytes: r.get::<_, i64>(5)? as u64,
            memory: !crate::paths::is_fs_only(&dir),
        },
        dir,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str) -> SandboxRow {
        SandboxRow {
            id: id.into(),
            template: Some("default".into()),
            snapshot: None,
            forked_from: None,
            source_dir: "/snap".into(),
            state: State::Creating,
            reason: None,
            created_ms: now_ms(),
            ends_ms: Some(now_ms() + 1000),
            max_until_ms: None,
            ended_ms: None,
            on_timeout: OnTimeout::Pause,
            timeout_ms: 1000,
            resources: Resources {
                vcpus: 1,
                memory_mib: 512,
                ..Default::default()
            },
            metadata: [("k".to_string(), "v".to_string())].into(),
            env: BTreeMap::new(),
            secret_env: BTreeSet::new(),
            outputs: "/workspace/outputs".into(),
            uid: Some(200_001),
            jail_id: Some("j".into()),
            pid: None,
            pause_dir: None,
            start_ms: None,
            network: Default::default(),
        }
    }

    #[test]
    fn sandboxes_history_audit_and_artifacts_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("ember.db");
        {
            let s = Store::open(&db).unwrap();
            let mut r = row("a1");
            s.insert_sandbox(&r).unwrap();
            r.state = State::Running;
            r.pid = Some(42);
            s.update_sandbox(&r).unwrap();
            s.add_transition("a1", Some(State::Creating), State::Running, None)
                .unwrap();
            s.audit(
                now_ms(),
                Some("a1"),
                "run_code",
                &serde_json::json!({"code_bytes": 3}),
                1.5,
                "ok",
                None,
                3,
                10,
            )
            .unwrap();
            s.audit(
                now_ms(),
                None,
                "create",
                &serde_json::json!({}),
                1.0,
                "capacity",
                Some("full"),
                0,
                0,
            )
            .unwrap();
            s.put_artifact("a1", "chart.png", 1234).unwrap();
        }
        let s = Store::open(&db).unwrap();
        let r = s.sandbox("a1").unwrap().unwrap();
        assert_eq!(r.state, State::Running);
        assert_eq!(r.pid, Some(42));
        assert_eq!(r.on_timeout, OnTimeout::Pause);
        assert_eq!(r.metadata["k"], "v");
        assert_eq!(r.resources.memory_mib, 512);
        let h = s.transitions("a1").unwrap();
        assert_eq!(h.len(), 2);
        assert_eq!(h[1].from, Some(State::Creating));
        let all = s.audit_records(&AuditFilter::default()).unwrap();
        assert_eq!(all.len(), 2);
        assert!(all[0].seq < all[1].seq);
        let mine = s
            .audit_records(&AuditFilter {
                sandbox: Some("a1".into()),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(mine.len(), 1);
        assert_eq!(mine[0].args["code_bytes"], 3);
        let failed = s
            .audit_records(&AuditFilter {
                outcome: Some("capacity".into()),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(failed[0].error.as_deref(), Some("full"));
        assert_eq!(s.artifacts("a1").unwrap()[0].size, 1234);
        assert_eq!(s.sandboxes(true).unwrap().len(), 1);
        assert_eq!(s.count_by_state().unwrap()["running"], 1);
        s.purge_sandbox("a1").unwrap();
        assert!(s.sandbox("a1").unwrap().is_none());
        assert!(s.transitions("a1").unwrap().is_empty());
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("ember.db");
        Store::open(&db).unwrap();
        let c = Connection::open(&db).unwrap();
        c.execute("UPDATE meta SET value = '99' WHERE key = 'schema'", [])
            .unwrap();
        let e = Store::open(&db).unwrap_err().to_string();
        assert!(e.contains("newer"), "{e}");
    }
}
