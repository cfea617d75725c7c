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
];

/// A key for `pg_advisory_xact_lock` (ember's migrations).
const MIGRATION_LOCK: i64 = 0x656d_6265_7200_0001;

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
    /// Sandboxes routed to it.
    pub sandboxes: i64,
    /// Sandboxes routed to it since shortly before its last heartbeat (which its `running`
    /// may not count yet): what placement adds to `running`, so that a burst of creates
    /// through several gateways spreads.
    pub placed_recently: i64,
}

/// A connection to the directory (one client, serialized: calls are short).
pub struct Db {
    client: Mutex<Client>,
    url: String,
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
        let mut client = Client::connect(url, NoTls)
            .map_err(|e| FleetError::Db(format!("cannot connect to {}: {e}", redact(url))))?;
        migrate(&mut client)?;
        Ok(Db {
            client: Mutex::new(client),
            url: url.to_string(),
        })
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut Client) -> Result<T, FleetError>,
    ) -> Result<T, FleetError> {
        let mut c = self.client.lock().unwrap_or_else(|p| p.into_inner());
        if c.is_closed() {
            *c = Client::connect(&self.url, NoTls).map_err(|e| {
                FleetError::Db(format!("cannot reconnect to {}: {e}", redact(&self.url)))
            })?;
        }
        f(&mut c)
    }

    /// Registers (or re-registers) a node; answers its new epoch.
    pub fn register(&self, n: &NodeRecord) -> Result<i64, FleetError> {
        self.with(|c| {
            let row = c
                .query_one(
                    "INSERT INTO nodes (id, addr, version, host_kind, cpu_profile, max_running,
                                        running, labels, templates)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
                     ON CONFLICT (id) DO UPDATE SET
                        addr = EXCLUDED.addr, version = EXCLUDED.version,
                        host_kind = EXCLUDED.host_kind, cpu_profile = EXCLUDED.cpu_profile,
                        max_running = EXCLUDED.max_running, running = EXCLUDED.running,
                        labels = EXCLUDED.labels, templates = EXCLUDED.templates,
                        epoch = nodes.epoch + 1, registered_at = now(), heartbeat_at = now()
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
                    ],
                )
                .map_err(db_err("registering the node"))?;
            Ok(row.get(0))
        })
    }

    /// A node's heartbeat: it is alive, runs `running` sandboxes and holds `templates`.
    /// False when the node is not registered (any more).
    pub fn heartbeat(
        &self,
        id: &str,
        running: i32,
        templates: &[String],
    ) -> Result<bool, FleetError> {
        self.with(|c| {
            let n = c
                .execute(
                    "UPDATE nodes SET heartbeat_at = now(), running = $2, templates = $3
                     WHERE id = $1",
                    &[&id, &running, &serde_json::json!(templates)],
                )
                .map_err(db_err("heartbeat"))?;
            Ok(n == 1)
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
                            (SELECT count(*) FROM sandboxes s WHERE s.node = n.id),
                            (SELECT count(*) FROM sandboxes s WHERE s.node = n.id
                               AND s.created_at > n.heartbeat_at - interval '2 seconds')
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
                        },
                        epoch: r.get(9),
                        heartbeat_age_secs: r.get(10),
                        sandboxes: r.get(11),
                        placed_recently: r.get(12),
                    })
                })
                .collect()
        })
    }

    /// Records that `node` holds `sandbox`.
    pub fn put_route(&self, sandbox: &str, node: &str) -> Result<(), FleetError> {
        self.with(|c| {
            c.execute(
                "INSERT INTO sandboxes (id, node) VALUES ($1, $2)
                 ON CONFLICT (id) DO UPDATE SET node = EXCLUDED.node",
                &[&sandbox, &node],
            )
            .map_err(db_err("recording a sandbox's node"))?;
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
