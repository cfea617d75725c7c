//! The fleet's directory in PostgreSQL: which nodes there are (registered, heartbeating, with
//! their capacity and templates) and which node holds which sandbox.
//!
//! Times are the database's (`now()`): a node's liveness is judged by one clock, never by
//! comparing two hosts' clocks. The schema is versioned (`ember_schema`) and migrated on
//! open under an advisory lock, so that gateways and nodes starting together apply each
//! step once.

use std::sync::Mutex;

use postgres::{Client, NoTls};
use serde::{Deserialize, Serialize};

use crate::FleetError;

/// The schema steps, in order; `ember_schema.version` counts those applied.
const MIGRATIONS: &[&str] = &[
    // 1: nodes and the sandbox → node routes.
    "CREATE TABLE nodes (
        id TEXT PRIMARY KEY,
        addr TEXT NOT NULL,
        version TEXT NOT NULL,
        host_kind TEXT NOT NULL,
        cpu_profile TEXT NOT NULL,
        max_running INTEGER NOT NULL,
        running INTEGER NOT NULL DEFAULT 0,
        labels JSONB NOT NULL DEFAULT '{}',
        templates JSONB NOT NULL DEFAULT '[]',
        epoch BIGINT NOT NULL DEFAULT 1,
        registered_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        heartbeat_at TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY,
        node TEXT NOT NULL REFERENCES nodes (id),
        created_at TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    CREATE INDEX sandboxes_node ON sandboxes (node);",
    // 2: quotas per API key. A route is made before its create runs (`pending`, with no node
    // yet), so that creates racing through several gateways count each other; `ended` is set
    // by a kill through a gateway or by the node's heartbeat when it no longer runs it.
    "ALTER TABLE sandboxes ALTER COLUMN node DROP NOT NULL;
    ALTER TABLE sandboxes ADD COLUMN key TEXT NOT NULL DEFAULT 'default';
    ALTER TABLE sandboxes ADD COLUMN pending BOOLEAN NOT NULL DEFAULT false;
    ALTER TABLE sandboxes ADD COLUMN ended BOOLEAN NOT NULL DEFAULT false;
    CREATE INDEX sandboxes_live ON sandboxes (key) WHERE NOT ended;
    CREATE TABLE quotas (
        key TEXT PRIMARY KEY,
        max_sandboxes INTEGER NOT NULL
    );",
    // 3: sandboxes that move. A node records each pause (`state`, `pause_gen` bumped) and,
    // once its snapshot is uploaded, the bundle (`blob`); a resume clears it. Only a paused
    // sandbox with a blob may continue on another node (`adopt`, a compare-and-set on its
    // node, blob and generation). `updated_at`: when it was created or moved, so that a
    // heartbeat listed just before cannot mark it ended. A node that stops says so (`status`).
    "ALTER TABLE sandboxes ADD COLUMN state TEXT NOT NULL DEFAULT 'running';
    ALTER TABLE sandboxes ADD COLUMN blob TEXT;
    ALTER TABLE sandboxes ADD COLUMN pause_gen BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN template TEXT;
    ALTER TABLE sandboxes ADD COLUMN updated_at TIMESTAMPTZ NOT NULL DEFAULT now();
    ALTER TABLE nodes ADD COLUMN status TEXT NOT NULL DEFAULT 'up';",
    // 4: named snapshots, fleet-wide: a name is reserved before the snapshot is taken (two
    // nodes cannot both make one), `info` is the runtime's record, `blob` its upload.
    "CREATE TABLE snapshots (
        name TEXT PRIMARY KEY,
        node TEXT,
        info JSONB,
        blob TEXT,
        created_at TIMESTAMPTZ NOT NULL DEFAULT now()
    );",
    // 5: what outlives a node: each sandbox's artifacts (the bundle of its last collection)
    // and every node's audit log (shipped each heartbeat; `seq` is the node's own).
    "ALTER TABLE sandboxes ADD COLUMN artifacts TEXT;
    CREATE TABLE audit (
        id BIGSERIAL PRIMARY KEY,
        node TEXT NOT NULL,
        seq BIGINT NOT NULL,
        sandbox TEXT,
        call TEXT NOT NULL,
        outcome TEXT NOT NULL,
        record JSONB NOT NULL,
        UNIQUE (node, seq)
    );
    CREATE INDEX audit_sandbox ON audit (sandbox, id);",
    // 6: every node's state history of its sandboxes (shipped each heartbeat, as the audit
    // log), and the nodes' memory: what they may commit and have committed.
    "CREATE TABLE transitions (
        node TEXT NOT NULL,
        seq BIGINT NOT NULL,
        sandbox TEXT NOT NULL,
        record JSONB NOT NULL,
        PRIMARY KEY (node, seq)
    );
    CREATE INDEX transitions_sandbox ON transitions (sandbox);
    ALTER TABLE nodes ADD COLUMN max_memory_mib BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE nodes ADD COLUMN memory_mib BIGINT NOT NULL DEFAULT 0;",
];

/// How a heartbeat's list is trusted: a sandbox created or moved this recently is not marked
/// ended for missing from it (the list may have been taken before it arrived).
const SETTLE_SECS: f64 = 5.0;

/// How long a reservation may wait for its create before it no longer counts (a gateway that
/// died mid-create leaves one behind).
const RESERVATION_TTL_SECS: f64 = 300.0;

/// A key for `pg_advisory_xact_lock` (ember's migrations).
const MIGRATION_LOCK: i64 = 0x656d_6265_7200_0001;
/// A key for `pg_try_advisory_xact_lock` (one sweep at a time, whichever gateway runs it).
const SWEEP_LOCK: i64 = 0x656d_6265_7200_0002;

/// What a node tells the fleet about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// Its id (unique in the fleet).
    pub id: String,
    /// Where gateways reach its internal API (`host:port`).
    pub addr: String,
    /// ember's version on it.
    pub version: String,
    /// `kvm_pvm` or `kvm`.
    pub host_kind: String,
    /// The CPU profile its snapshots are made with (a restore elsewhere needs the same).
    pub cpu_profile: String,
    /// Most sandboxes it runs at once.
    pub max_running: i32,
    /// Sandboxes running now (as of its last heartbeat).
    pub running: i32,
    /// Its labels.
    pub labels: serde_json::Value,
    /// The templates built on it.
    pub templates: Vec<String>,
    /// Guest memory it may commit, MiB (its `--max-memory-mib`).
    #[serde(default)]
    pub max_memory_mib: i64,
    /// Guest memory its running sandboxes have committed, MiB (as of its last heartbeat).
    #[serde(default)]
    pub memory_mib: i64,
}

/// A node as the directory shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// What it registered.
    #[serde(flatten)]
    pub node: NodeRecord,
    /// Its registration epoch (bumped on each registration).
    pub epoch: i64,
    /// Seconds since its last heartbeat, by the database's clock.
    pub heartbeat_age_secs: f64,
    /// Sandboxes routed to it that have not ended.
    pub sandboxes: i64,
    /// Sandboxes routed to it since shortly before its last heartbeat (which its `running`
    /// may not count yet): what placement adds to `running`, so that a burst of creates
    /// through several gateways spreads.
    pub placed_recently: i64,
    /// `up`, or `stopped` (it said so as it exited).
    pub status: String,
}

/// What a heartbeat learnt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    /// The directory knew the node (else it registers again).
    pub known: bool,
    /// The node is being drained: it pauses what runs (uploads follow) and takes no creates.
    pub draining: bool,
    /// Sandboxes the node listed that the directory gives to another node: they moved while
    /// the node was away, and the node must drop its copies.
    pub elsewhere: Vec<String>,
    /// Sandboxes the node listed that the directory has no record of at all (a create a
    /// dead gateway never recorded, or one made past the fleet): the node kills them.
    pub unknown: Vec<String>,
}

/// A sandbox as the directory knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRoute {
    /// Its node.
    pub node: Option<String>,
    /// `running` or `paused`, as its node last recorded.
    pub state: String,
    /// Its uploaded pause snapshot (a bundle), when paused and uploaded.
    pub blob: Option<String>,
    /// Ended.
    pub ended: bool,
    /// Its template.
    pub template: Option<String>,
}

/// A connection to the directory (one client, serialized: calls are short).
pub struct Db {
    /// Always `Some` but while being dropped (see `Drop`).
    client: Mutex<Option<Client>>,
    url: String,
}

impl Drop for Db {
    /// `postgres::Client`'s own drop blocks on a runtime of its own to say goodbye to the
    /// server, which panics on a tokio worker thread — where a gateway's state ends when its
    /// server stops. There the client goes to a thread of its own to be dropped.
    fn drop(&mut self) {
        let client = self
            .client
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(c) = client {
            if tokio::runtime::Handle::try_current().is_ok() {
                let _ = std::thread::Builder::new()
                    .name("ember-db-close".into())
                    .spawn(move || drop(c));
            } else {
                drop(c);
            }
        }
    }
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("url", &redact(&self.url))
            .finish_non_exhaustive()
    }
}

fn db_err(what: &str) -> impl FnOnce(postgres::Error) -> FleetError + '_ {
    move |e| FleetError::Db(format!("{what}: {e}"))
}

impl Db {
    /// Connects to `url` (`postgres://user@host:port/db`) and applies the migrations it
    /// lacks.
    pub fn open(url: &str) -> Result<Db, FleetError> {
        let mut client = connect(url)
            .map_err(|e| FleetError::Db(format!("cannot connect to {}: {e}", redact(url))))?;
        migrate(&mut client)?;
        Ok(Db {
            client: Mutex::new(Some(client)),
            url: url.to_string(),
        })
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut Client) -> Result<T, FleetError>,
    ) -> Result<T, FleetError> {
        let mut guard = self.client.lock().unwrap_or_else(|p| p.into_inner());
        let reconnect = guard.as_ref().is_none_or(Client::is_closed);
        if reconnect {
            *guard = Some(connect(&self.url).map_err(|e| {
                FleetError::Db(format!("cannot reconnect to {}: {e}", redact(&self.url)))
            })?);
        }
        match guard.as_mut() {
            Some(c) => f(c),
            None => Err(FleetError::Db(
                "the directory's connection is closed".into(),
            )),
        }
    }

    /// Registers (or re-registers) a node; answers its new epoch.
    pub fn register(&self, n: &NodeRecord) -> Result<i64, FleetError> {
        self.with(|c| {
            let row = c
                .query_one(
                    "INSERT INTO nodes (id, addr, version, host_kind, cpu_profile, max_running,
                                        running, labels, templates, max_memory_mib, memory_mib)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
                     ON CONFLICT (id) DO UPDATE SET
                        max_memory_mib = EXCLUDED.max_memory_mib,
                        memory_mib = EXCLUDED.memory_mib,
                        addr = EXCLUDED.addr, version = EXCLUDED.version,
                        host_kind = EXCLUDED.host_kind, cpu_profile = EXCLUDED.cpu_profile,
                        max_running = EXCLUDED.max_running, running = EXCLUDED.running,
                        labels = EXCLUDED.labels, templates = EXCLUDED.templates,
                        epoch = nodes.epoch + 1, registered_at = now(), heartbeat_at = now(),
                        status = 'up'
                     RETURNING epoch",
                    &[
                        &n.id,
                        &n.addr,
                        &n.version,
                        &n.host_kind,
                        &n.cpu_profile,
                        &n.max_running,
                        &n.running,
                        &n.labels,
                        &serde_json::json!(n.templates),
                        &n.max_memory_mib,
                        &n.memory_mib,
                    ],
                )
                .map_err(db_err("registering the node"))?;
            Ok(row.get(0))
        })
    }

    /// A node's heartbeat: it is alive, runs `running` sandboxes, holds `templates`, and of
    /// the sandboxes routed to it only `live` exist any more (the others are marked ended:
    /// they count against no quota). False when the node is not registered (any more).
    pub fn heartbeat(
        &self,
        id: &str,
        running: i32,
        memory_mib: i64,
        templates: &[String],
        live: &[String],
    ) -> Result<Heartbeat, FleetError> {
        self.with(|c| {
            let mut tx = c.transaction().map_err(db_err("heartbeat"))?;
            let status: Option<String> = tx
                .query_opt(
                    "UPDATE nodes SET heartbeat_at = now(), running = $2, templates = $3,
                        memory_mib = $4
                     WHERE id = $1 RETURNING status",
                    &[&id, &running, &serde_json::json!(templates), &memory_mib],
                )
                .map_err(db_err("heartbeat"))?
                .map(|r| r.get(0));
            tx.execute(
                "UPDATE sandboxes SET ended = true
                 WHERE node = $1 AND NOT ended AND NOT pending AND NOT (id = ANY($2))
                   AND updated_at < now() - make_interval(secs => $3)",
                &[&id, &live, &SETTLE_SECS],
            )
            .map_err(db_err("heartbeat: ended sandboxes"))?;
            // Moved to another node while this one was away, or declared lost with it: this
            // node's copies must go (a sandbox never answers from two VMs).
            let elsewhere = tx
                .query(
                    "SELECT id FROM sandboxes
                     WHERE id = ANY($2) AND NOT pending
                       AND ((node IS DISTINCT FROM $1
                             AND updated_at < now() - make_interval(secs => $3))
                            OR (node = $1 AND state = 'lost'))",
                    &[&id, &live, &SETTLE_SECS],
                )
                .map_err(db_err("heartbeat: moved sandboxes"))?
                .iter()
                .map(|r| r.get(0))
                .collect();
            // Not in the directory at all (their creates were never recorded).
            let unknown = tx
                .query(
                    "SELECT x FROM unnest($1::text[]) AS x
                     WHERE NOT EXISTS (SELECT 1 FROM sandboxes s WHERE s.id = x)",
                    &[&live],
                )
                .map_err(db_err("heartbeat: unknown sandboxes"))?
                .iter()
                .map(|r| r.get(0))
                .collect();
            tx.commit().map_err(db_err("heartbeat: commit"))?;
            Ok(Heartbeat {
                // A node declared lost registers again (a new epoch) once it has dropped what
                // went with it.
                known: status.as_deref().is_some_and(|s| s != "lost"),
                draining: status.as_deref() == Some("draining"),
                elsewhere,
                unknown,
            })
        })
    }

    /// Every node, live or not, by id.
    pub fn nodes(&self) -> Result<Vec<NodeStatus>, FleetError> {
        self.with(|c| {
            let rows = c
                .query(
                    "SELECT n.id, n.addr, n.version, n.host_kind, n.cpu_profile, n.max_running,
                            n.running, n.labels, n.templates, n.epoch,
                            EXTRACT(EPOCH FROM (now() - n.heartbeat_at))::float8,
                            (SELECT count(*) FROM sandboxes s WHERE s.node = n.id AND NOT s.ended),
                            (SELECT count(*) FROM sandboxes s WHERE s.node = n.id
                               AND s.created_at > n.heartbeat_at - interval '2 seconds'),
                            n.status, n.max_memory_mib, n.memory_mib
                     FROM nodes n ORDER BY n.id",
                    &[],
                )
                .map_err(db_err("listing nodes"))?;
            rows.iter()
                .map(|r| {
                    let templates: serde_json::Value = r.get(8);
                    Ok(NodeStatus {
                        node: NodeRecord {
                            id: r.get(0),
                            addr: r.get(1),
                            version: r.get(2),
                            host_kind: r.get(3),
                            cpu_profile: r.get(4),
                            max_running: r.get(5),
                            running: r.get(6),
                            labels: r.get(7),
                            templates: serde_json::from_value(templates).unwrap_or_default(),
                            max_memory_mib: r.get(14),
                            memory_mib: r.get(15),
                        },
                        epoch: r.get(9),
                        heartbeat_age_secs: r.get(10),
                        sandboxes: r.get(11),
                        placed_recently: r.get(12),
                        status: r.get(13),
                    })
                })
                .collect()
        })
    }

    /// Records that `node` holds `sandbox` (a fork's child: no quota check).
    pub fn put_route(&self, sandbox: &str, node: &str) -> Result<(), FleetError> {
        self.with(|c| {
            c.execute(
                "INSERT INTO sandboxes (id, node) VALUES ($1, $2)
                 ON CONFLICT (id) DO UPDATE SET node = EXCLUDED.node, ended = false,
                    updated_at = now()",
                &[&sandbox, &node],
            )
            .map_err(db_err("recording a sandbox's node"))?;
            Ok(())
        })
    }

    /// Reserves a place for one more sandbox of API key `key`: `Ok(Err(why))` when its quota
    /// is reached. Gateways racing serialize on the key (an advisory lock), so N creates
    /// against a quota of N − k leave exactly N − k in.
    pub fn reserve(&self, key: &str) -> Result<Result<String, String>, FleetError> {
        let resv = format!("pending-{:016x}{:016x}", rand_u64(), rand_u64());
        self.with(|c| {
            let mut tx = c.transaction().map_err(db_err("quota"))?;
            tx.execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&key])
                .map_err(db_err("quota: lock"))?;
            let quota: Option<i32> = tx
                .query_opt("SELECT max_sandboxes FROM quotas WHERE key = $1", &[&key])
                .map_err(db_err("quota: read"))?
                .map(|r| r.get(0));
            if let Some(max) = quota {
                let live: i64 = tx
                    .query_one(
                        "SELECT count(*) FROM sandboxes WHERE key = $1 AND NOT ended
                         AND (NOT pending
                              OR created_at > now() - make_interval(secs => $2))",
                        &[&key, &RESERVATION_TTL_SECS],
                    )
                    .map_err(db_err("quota: count"))?
                    .get(0);
                if live >= i64::from(max) {
                    return Ok(Err(format!(
                        "quota: API key {key:?} has {live} live sandboxes, its quota is {max}"
                    )));
                }
            }
            tx.execute(
                "INSERT INTO sandboxes (id, node, key, pending) VALUES ($1, NULL, $2, true)",
                &[&resv, &key],
            )
            .map_err(db_err("quota: reserve"))?;
            tx.commit().map_err(db_err("quota: commit"))?;
            Ok(Ok(resv))
        })
    }

    /// Turns reservation `resv` into the route of sandbox `id` on `node`.
    pub fn confirm(&self, resv: &str, id: &str, node: &str) -> Result<(), FleetError> {
        self.with(|c| {
            let n = c
                .execute(
                    "UPDATE sandboxes SET id = $2, node = $3, pending = false,
                        created_at = now(), updated_at = now()
                     WHERE id = $1",
                    &[&resv, &id, &node],
                )
                .map_err(db_err("recording a created sandbox"))?;
            // The sweep took the reservation of a create that took long: the route is
            // recorded all the same.
            if n == 0 {
                c.execute(
                    "INSERT INTO sandboxes (id, node) VALUES ($1, $2)
                     ON CONFLICT (id) DO UPDATE SET node = EXCLUDED.node",
                    &[&id, &node],
                )
                .map_err(db_err("recording a created sandbox"))?;
            }
            Ok(())
        })
    }

    /// One sweep of the fleet (any gateway may run it; an advisory lock makes sweeps one at
    /// a time): with `declare`, nodes silent for `lost_after` seconds, by the database's
    /// clock, and not in `spare` (those the sweeping gateway's own probe reached), are
    /// declared lost (their epoch bumped); what they ran, and what they paused without an upload, is
    /// marked ended and lost (their paused, uploaded sandboxes stay: another node may take
    /// them); reservations older than `stale_after` seconds (a gateway that died mid-create)
    /// are removed. Returns the nodes declared lost and how many sandboxes went with them.
    pub fn sweep(
        &self,
        lost_after: f64,
        stale_after: f64,
        declare: bool,
        spare: &[String],
    ) -> Result<(Vec<String>, u64), FleetError> {
        self.with(|c| {
            let mut tx = c.transaction().map_err(db_err("sweep"))?;
            let got: bool = tx
                .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&SWEEP_LOCK])
                .map_err(db_err("sweep: lock"))?
                .get(0);
            if !got {
                return Ok((Vec::new(), 0));
            }
            let lost: Vec<String> = if declare {
                tx.query(
                    "UPDATE nodes SET status = 'lost', epoch = epoch + 1
                     WHERE status IN ('up', 'draining')
                       AND heartbeat_at < now() - make_interval(secs => $1)
                       AND NOT (id = ANY($2))
                     RETURNING id",
                    &[&lost_after, &spare],
                )
                .map_err(db_err("sweep: nodes"))?
                .iter()
                .map(|r| r.get(0))
                .collect()
            } else {
                Vec::new()
            };
            let mut gone = 0;
            if !lost.is_empty() {
                gone = tx
                    .execute(
                        "UPDATE sandboxes SET ended = true, state = 'lost'
                         WHERE node = ANY($1) AND NOT ended AND NOT pending
                           AND (state = 'running' OR blob IS NULL)",
                        &[&lost],
                    )
                    .map_err(db_err("sweep: sandboxes"))?;
            }
            tx.execute(
                "DELETE FROM sandboxes WHERE pending
                 AND created_at < now() - make_interval(secs => $1)",
                &[&stale_after],
            )
            .map_err(db_err("sweep: reservations"))?;
            tx.commit().map_err(db_err("sweep: commit"))?;
            Ok((lost, gone))
        })
    }

    /// Gives back reservation `resv` (its create failed).
    pub fn release(&self, resv: &str) -> Result<(), FleetError> {
        self.with(|c| {
            c.execute("DELETE FROM sandboxes WHERE id = $1 AND pending", &[&resv])
                .map_err(db_err("releasing a reservation"))?;
            Ok(())
        })
    }

    /// Marks `sandbox` ended (killed through a gateway).
    pub fn mark_ended(&self, sandbox: &str) -> Result<(), FleetError> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET ended = true WHERE id = $1",
                &[&sandbox],
            )
            .map_err(db_err("marking a sandbox ended"))?;
            Ok(())
        })
    }

    /// Sets API key `key`'s quota of live sandboxes (`None`: no quota).
    pub fn set_quota(&self, key: &str, max_sandboxes: Option<i32>) -> Result<(), FleetError> {
        self.with(|c| {
            match max_sandboxes {
                Some(n) => c.execute(
                    "INSERT INTO quotas (key, max_sandboxes) VALUES ($1, $2)
                     ON CONFLICT (key) DO UPDATE SET max_sandboxes = EXCLUDED.max_sandboxes",
                    &[&key, &n],
                ),
                None => c.execute("DELETE FROM quotas WHERE key = $1", &[&key]),
            }
            .map_err(db_err("setting a quota"))?;
            Ok(())
        })
    }

    /// The node that holds `sandbox`, if the directory knows it.
    pub fn route(&self, sandbox: &str) -> Result<Option<String>, FleetError> {
        self.with(|c| {
            let row = c
                .query_opt("SELECT node FROM sandboxes WHERE id = $1", &[&sandbox])
                .map_err(db_err("finding a sandbox's node"))?;
            Ok(row.map(|r| r.get(0)))
        })
    }

    /// Statements a test or a figure may count: the server's total so far.
    /// Records that `node` paused `sandbox` (its earlier upload, if any, no longer
    /// counts); the new pause generation, or `None` when the directory does not give the
    /// sandbox to `node` (made through the node's own API, or moved).
    pub fn set_paused(&self, sandbox: &str, node: &str) -> Result<Option<i64>, FleetError> {
        self.with(|c| {
            let row = c
                .query_opt(
                    "UPDATE sandboxes SET state = 'paused', blob = NULL,
                        pause_gen = pause_gen + 1
                     WHERE id = $1 AND node = $2 AND NOT ended RETURNING pause_gen",
                    &[&sandbox, &node],
                )
                .map_err(db_err("recording a pause"))?;
            Ok(row.map(|r| r.get(0)))
        })
    }

    /// Records the uploaded snapshot of pause `gen` (false when the sandbox resumed, moved or
    /// paused again since).
    pub fn set_uploaded(
        &self,
        sandbox: &str,
        node: &str,
        gen: i64,
        blob: &str,
    ) -> Result<bool, FleetError> {
        self.with(|c| {
            let n = c
                .execute(
                    "UPDATE sandboxes SET blob = $4
                     WHERE id = $1 AND node = $2 AND pause_gen = $3 AND state = 'paused'
                       AND NOT ended",
                    &[&sandbox, &node, &gen, &blob],
                )
                .map_err(db_err("recording an upload"))?;
            Ok(n == 1)
        })
    }

    /// A paused sandbox of `node` that has no uploaded snapshot: its pause generation.
    pub fn pending_upload(&self, sandbox: &str, node: &str) -> Result<Option<i64>, FleetError> {
        self.with(|c| {
            let row = c
                .query_opt(
                    "SELECT pause_gen FROM sandboxes
                     WHERE id = $1 AND node = $2 AND state = 'paused' AND blob IS NULL
                       AND NOT ended",
                    &[&sandbox, &node],
                )
                .map_err(db_err("reading a pause"))?;
            Ok(row.map(|r| r.get(0)))
        })
    }

    /// Records that `node` resumes `sandbox`: `Ok(None)` when it may (the directory gives it
    /// to `node`, or does not know it), `Ok(Some(other))` when the directory gives it to
    /// another node.
    pub fn claim_resume(&self, sandbox: &str, node: &str) -> Result<Option<String>, FleetError> {
        self.with(|c| {
            let n = c
                .execute(
                    "UPDATE sandboxes SET state = 'running', blob = NULL,
                        pause_gen = pause_gen + 1
                     WHERE id = $1 AND node = $2",
                    &[&sandbox, &node],
                )
                .map_err(db_err("recording a resume"))?;
            if n == 1 {
                return Ok(None);
            }
            let row = c
                .query_opt(
                    "SELECT node FROM sandboxes WHERE id = $1 AND NOT pending",
                    &[&sandbox],
                )
                .map_err(db_err("recording a resume"))?;
            Ok(row.and_then(|r| r.get::<_, Option<String>>(0)))
        })
    }

    /// What the directory knows of a sandbox.
    pub fn sandbox(&self, sandbox: &str) -> Result<Option<SandboxRoute>, FleetError> {
        self.with(|c| {
            let row = c
                .query_opt(
                    "SELECT node, state, blob, ended, template FROM sandboxes
                     WHERE id = $1 AND NOT pending",
                    &[&sandbox],
                )
                .map_err(db_err("reading a sandbox"))?;
            Ok(row.map(|r| SandboxRoute {
                node: r.get(0),
                state: r.get(1),
                blob: r.get(2),
                ended: r.get(3),
                template: r.get(4),
            }))
        })
    }

    /// Gives paused `sandbox` (on `from`, uploaded as `blob`) to `to`: a compare-and-set, so
    /// that of gateways racing to move it one wins; false when it changed meanwhile.
    pub fn adopt(
        &self,
        sandbox: &str,
        from: &str,
        blob: &str,
        to: &str,
    ) -> Result<bool, FleetError> {
        self.with(|c| {
            let n = c
                .execute(
                    "UPDATE sandboxes SET node = $4, updated_at = now()
                     WHERE id = $1 AND node = $2 AND blob = $3 AND state = 'paused'
                       AND NOT ended",
                    &[&sandbox, &from, &blob, &to],
                )
                .map_err(db_err("moving a sandbox"))?;
            Ok(n == 1)
        })
    }

    /// Marks `node` draining (placement skips it; it pauses its sandboxes so that they
    /// continue elsewhere). False when it is not registered.
    pub fn set_draining(&self, node: &str) -> Result<bool, FleetError> {
        self.with(|c| {
            let n = c
                .execute(
                    "UPDATE nodes SET status = 'draining' WHERE id = $1",
                    &[&node],
                )
                .map_err(db_err("draining the node"))?;
            Ok(n == 1)
        })
    }

    /// The sandboxes of `node` that cannot move yet: running, or paused without an upload.
    pub fn unmovable(&self, node: &str) -> Result<i64, FleetError> {
        self.with(|c| {
            let row = c
                .query_one(
                    "SELECT count(*) FROM sandboxes
                     WHERE node = $1 AND NOT ended AND NOT pending
                       AND (state = 'running' OR blob IS NULL)",
                    &[&node],
                )
                .map_err(db_err("counting the node's sandboxes"))?;
            Ok(row.get(0))
        })
    }

    /// Reserves snapshot name `name` for a snapshot taken on `node`; false when it is taken.
    pub fn reserve_snapshot(&self, name: &str, node: &str) -> Result<bool, FleetError> {
        self.with(|c| {
            let n = c
                .execute(
                    "INSERT INTO snapshots (name, node) VALUES ($1, $2)
                     ON CONFLICT (name) DO NOTHING",
                    &[&name, &node],
                )
                .map_err(db_err("reserving a snapshot name"))?;
            Ok(n == 1)
        })
    }

    /// Records snapshot `name` of `node`: its record (`info`) and, once uploaded, its bundle.
    pub fn set_snapshot(
        &self,
        name: &str,
        node: &str,
        info: &serde_json::Value,
        blob: Option<&str>,
    ) -> Result<(), FleetError> {
        self.with(|c| {
            c.execute(
                "INSERT INTO snapshots (name, node, info, blob) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (name) DO UPDATE SET info = EXCLUDED.info,
                    blob = COALESCE(EXCLUDED.blob, snapshots.blob)
                 WHERE snapshots.node = EXCLUDED.node",
                &[&name, &node, &info, &blob],
            )
            .map_err(db_err("recording a snapshot"))?;
            Ok(())
        })
    }

    /// Snapshot `name`: (its node, its record, its bundle).
    #[allow(clippy::type_complexity)]
    pub fn snapshot(
        &self,
        name: &str,
    ) -> Result<Option<(Option<String>, Option<serde_json::Value>, Option<String>)>, FleetError>
    {
        self.with(|c| {
            let row = c
                .query_opt(
                    "SELECT node, info, blob FROM snapshots WHERE name = $1",
                    &[&name],
                )
                .map_err(db_err("reading a snapshot"))?;
            Ok(row.map(|r| (r.get(0), r.get(1), r.get(2))))
        })
    }

    /// Every named snapshot's record (those whose take finished).
    pub fn snapshots(&self) -> Result<Vec<serde_json::Value>, FleetError> {
        self.with(|c| {
            let rows = c
                .query(
                    "SELECT info FROM snapshots WHERE info IS NOT NULL ORDER BY created_at",
                    &[],
                )
                .map_err(db_err("listing snapshots"))?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        })
    }

    /// Forgets snapshot `name` (false when there was none).
    pub fn delete_snapshot(&self, name: &str) -> Result<bool, FleetError> {
        self.with(|c| {
            let n = c
                .execute("DELETE FROM snapshots WHERE name = $1", &[&name])
                .map_err(db_err("deleting a snapshot"))?;
            Ok(n == 1)
        })
    }

    /// Records the bundle of sandbox `id`'s artifacts (its last collection).
    pub fn set_artifacts(&self, id: &str, blob: &str) -> Result<(), FleetError> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET artifacts = $2 WHERE id = $1",
                &[&id, &blob],
            )
            .map_err(db_err("recording artifacts"))?;
            Ok(())
        })
    }

    /// The bundle of sandbox `id`'s artifacts, if any were uploaded.
    pub fn artifacts(&self, id: &str) -> Result<Option<String>, FleetError> {
        self.with(|c| {
            let row = c
                .query_opt("SELECT artifacts FROM sandboxes WHERE id = $1", &[&id])
                .map_err(db_err("reading artifacts"))?;
            Ok(row.and_then(|r| r.get(0)))
        })
    }

    /// The highest audit sequence number of `node` shipped so far (0: none).
    pub fn last_audit_seq(&self, node: &str) -> Result<i64, FleetError> {
        self.with(|c| {
            let row = c
                .query_one(
                    "SELECT COALESCE(max(seq), 0)::bigint FROM audit WHERE node = $1",
                    &[&node],
                )
                .map_err(db_err("reading the audit log"))?;
            Ok(row.get(0))
        })
    }

    /// Ships `node`'s audit records (those already there are skipped).
    pub fn put_audit(
        &self,
        node: &str,
        records: &[ember_runtime::AuditRecord],
    ) -> Result<(), FleetError> {
        self.with(|c| {
            let mut tx = c.transaction().map_err(db_err("shipping the audit log"))?;
            for r in records {
                let json = serde_json::to_value(r).unwrap_or_default();
                tx.execute(
                    "INSERT INTO audit (node, seq, sandbox, call, outcome, record)
                     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (node, seq) DO NOTHING",
                    &[&node, &r.seq, &r.sandbox, &r.call, &r.outcome, &json],
                )
                .map_err(db_err("shipping the audit log"))?;
            }
            tx.commit().map_err(db_err("shipping the audit log"))?;
            Ok(())
        })
    }

    /// The highest state-change sequence number of `node` shipped so far (0: none).
    pub fn last_transition_seq(&self, node: &str) -> Result<i64, FleetError> {
        self.with(|c| {
            let row = c
                .query_one(
                    "SELECT COALESCE(max(seq), 0)::bigint FROM transitions WHERE node = $1",
                    &[&node],
                )
                .map_err(db_err("reading the state history"))?;
            Ok(row.get(0))
        })
    }

    /// Ships `node`'s state changes (those already there are skipped).
    pub fn put_transitions(
        &self,
        node: &str,
        changes: &[(i64, String, ember_runtime::Transition)],
    ) -> Result<(), FleetError> {
        self.with(|c| {
            let mut tx = c
                .transaction()
                .map_err(db_err("shipping the state history"))?;
            for (seq, sandbox, t) in changes {
                let json = serde_json::to_value(t).unwrap_or_default();
                tx.execute(
                    "INSERT INTO transitions (node, seq, sandbox, record) VALUES ($1, $2, $3, $4)
                     ON CONFLICT (node, seq) DO NOTHING",
                    &[&node, seq, sandbox, &json],
                )
                .map_err(db_err("shipping the state history"))?;
            }
            tx.commit().map_err(db_err("shipping the state history"))?;
            Ok(())
        })
    }

    /// Sandbox `id`'s shipped state history (on every node but `except`), oldest first.
    pub fn history(
        &self,
        id: &str,
        except: Option<&str>,
    ) -> Result<Vec<ember_runtime::Transition>, FleetError> {
        self.with(|c| {
            let rows = c
                .query(
                    "SELECT record FROM transitions
                     WHERE sandbox = $1 AND ($2::text IS NULL OR node <> $2)
                     ORDER BY record->>'at', node, seq",
                    &[&id, &except],
                )
                .map_err(db_err("reading the state history"))?;
            Ok(rows
                .iter()
                .filter_map(|r| serde_json::from_value(r.get(0)).ok())
                .collect())
        })
    }

    /// The shipped audit records of the nodes in `nodes` that match `f` (oldest first).
    pub fn audit(
        &self,
        nodes: &[String],
        f: &ember_runtime::AuditFilter,
    ) -> Result<Vec<ember_runtime::AuditRecord>, FleetError> {
        let limit = f.limit.unwrap_or(1000).clamp(1, 100_000) as i64;
        self.with(|c| {
            let rows = c
                .query(
                    "SELECT record FROM (
                        SELECT id, record FROM audit
                        WHERE node = ANY($1) AND ($2::text IS NULL OR sandbox = $2)
                          AND ($3::text IS NULL OR call = $3)
                          AND ($4::text IS NULL OR outcome = $4)
                        ORDER BY id DESC LIMIT $5) r ORDER BY id",
                    &[&nodes, &f.sandbox, &f.call, &f.outcome, &limit],
                )
                .map_err(db_err("reading the audit log"))?;
            Ok(rows
                .iter()
                .filter_map(|r| serde_json::from_value(r.get(0)).ok())
                .collect())
        })
    }

    /// Records that `node` stopped (gateways stop sending it calls at once).
    pub fn set_stopped(&self, node: &str) -> Result<(), FleetError> {
        self.with(|c| {
            c.execute(
                "UPDATE nodes SET status = 'stopped' WHERE id = $1",
                &[&node],
            )
            .map_err(db_err("recording the node's stop"))?;
            Ok(())
        })
    }

    pub fn statements(&self) -> Result<i64, FleetError> {
        self.with(|c| {
            let row = c
                .query_one(
                    "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database
                     WHERE datname = current_database()",
                    &[],
                )
                .map_err(db_err("reading statistics"))?;
            Ok(row.get(0))
        })
    }
}

/// How long a connection to the directory may take (unless the URL says): a database that
/// is away fails a call in seconds, not after the system's TCP timeout.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

fn connect(url: &str) -> Result<Client, postgres::Error> {
    let mut cfg: postgres::Config = url.parse()?;
    if cfg.get_connect_timeout().is_none() {
        cfg.connect_timeout(CONNECT_TIMEOUT);
    }
    // A connection whose peer went silent (a partition, a dead host) fails in seconds, not
    // after TCP's minutes: unacknowledged data for 4 s, or 2 s idle and 2 unanswered probes.
    if cfg.get_tcp_user_timeout().is_none() {
        cfg.tcp_user_timeout(std::time::Duration::from_secs(4));
    }
    cfg.keepalives(true)
        .keepalives_idle(std::time::Duration::from_secs(2))
        .keepalives_interval(std::time::Duration::from_secs(1))
        .keepalives_retries(2);
    cfg.connect(NoTls)
}

fn migrate(c: &mut Client) -> Result<(), FleetError> {
    // `IF NOT EXISTS` on a table that exists is a NOTICE: not worth a log line.
    c.batch_execute("SET client_min_messages = warning")
        .map_err(db_err("migrating: session"))?;
    let mut tx = c.transaction().map_err(db_err("migrating"))?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .map_err(db_err("migrating: lock"))?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS ember_schema (version INTEGER NOT NULL)")
        .map_err(db_err("migrating: schema table"))?;
    let version: i32 = match tx
        .query_opt("SELECT version FROM ember_schema", &[])
        .map_err(db_err("migrating: version"))?
    {
        Some(r) => r.get(0),
        None => {
            tx.execute("INSERT INTO ember_schema (version) VALUES (0)", &[])
                .map_err(db_err("migrating: version row"))?;
            0
        }
    };
    let known = MIGRATIONS.len() as i32;
    if version > known {
        return Err(FleetError::Db(format!(
            "the database's schema is version {version}, newer than this ember's {known}: \
             upgrade ember"
        )));
    }
    for (i, step) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        tx.batch_execute(step)
            .map_err(|e| FleetError::Db(format!("migration {}: {e}", i + 1)))?;
    }
    tx.execute("UPDATE ember_schema SET version = $1", &[&known])
        .map_err(db_err("migrating: version update"))?;
    tx.commit().map_err(db_err("migrating: commit"))?;
    Ok(())
}

fn rand_u64() -> u64 {
    use std::io::Read;
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        return t ^ u64::from(std::process::id()).rotate_left(32);
    }
    u64::from_le_bytes(b)
}

/// `url` without its password.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_left_out_of_messages() {
        assert_eq!(
            redact("postgres://ember:s3cret@10.0.0.2:5432/ember"),
            "postgres://ember:***@10.0.0.2:5432/ember"
        );
        assert_eq!(
            redact("postgres://ember@10.0.0.2/ember"),
            "postgres://ember@10.0.0.2/ember"
        );
        assert_eq!(redact("host=/tmp user=x"), "host=/tmp user=x");
    }
}
