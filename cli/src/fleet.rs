//! `ember node`, `ember gateway` and `ember cluster`: ember on many hosts (docs/cluster.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Subcommand};
use ember_fleet::node::NodeConfig;
use ember_fleet::{Db, Fleet};
use ember_server::e2b::E2bOptions;
use ember_server::{ServeOptions, Server};

use crate::fail;
use crate::serve::ServeArgs;

/// `ember node`.
#[derive(Debug, Args)]
pub struct NodeArgs {
    /// The node's id in the fleet (default: the host name).
    #[arg(long, env = "EMBER_NODE_ID")]
    pub node_id: Option<String>,
    /// The directory: a PostgreSQL URL (`postgres://user:password@host:port/db`).
    #[arg(long, env = "EMBER_DB", value_name = "URL")]
    pub db: String,
    /// Where the internal API listens (gateways send calls there; the node token guards it).
    #[arg(long, env = "EMBER_INTERNAL_LISTEN", value_name = "ADDR")]
    pub internal_listen: SocketAddr,
    /// Where gateways reach the internal API (default: --internal-listen).
    #[arg(long, value_name = "HOST:PORT")]
    pub advertise: Option<String>,
    /// The node token's file, shared by every node and gateway of the fleet (created, mode
    /// 0600, with a random token if absent: copy it to the others).
    #[arg(long, env = "EMBER_NODE_TOKEN_FILE", value_name = "FILE")]
    pub node_token_file: PathBuf,
    /// A label of the node (`key=value`, repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// The fleet's blob store, where templates and paused sandboxes go so that other nodes
    /// can restore them: `s3://BUCKET/PREFIX` (endpoint, region and credentials from
    /// AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or
    /// `file:///DIR`. Without it, templates are built on each node and a paused sandbox
    /// resumes only where it was paused.
    #[arg(long, env = "EMBER_BLOBS", value_name = "URL")]
    pub blobs: Option<String>,
    /// With --blobs: the templates this node publishes when it starts (repeatable; default:
    /// every named template it has that the store lacks).
    #[arg(long = "publish", value_name = "TEMPLATE", requires = "blobs")]
    pub publish: Vec<String>,
    /// Arm each VMM's watchdog with this timeout, seconds (0: off): the node feeds it while
    /// it reaches the directory or a gateway, and a VMM that hears nothing for this long
    /// (the node process froze) stops its own vCPUs. Keep it under 10 s, the silence after
    /// which the fleet declares a node lost.
    #[arg(
        long,
        env = "EMBER_VMM_WATCHDOG",
        value_name = "SECS",
        default_value_t = 0
    )]
    pub vmm_watchdog: u64,
    /// On SIGTERM, how long the drain may take before the node stops anyway, seconds
    /// (SIGTERM drains, with --blobs: every sandbox is paused, uploaded and continues on another node;
    /// SIGINT stops at once and leaves the VMs running for the next start to re-adopt).
    #[arg(long, value_name = "SECS", default_value_t = 280)]
    pub drain_timeout: u64,
    /// The node's own server (its runtime's HTTP API, for its operator).
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// `ember gateway`.
#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// Address to listen on (the native and E2B APIs for the whole fleet).
    #[arg(long, env = "EMBER_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// The clients' bearer token's file (created, mode 0600, if absent; gateways of one
    /// fleet share it, so that a client may talk to any of them).
    #[arg(long, value_name = "FILE")]
    pub token_file: PathBuf,
    /// The directory: a PostgreSQL URL.
    #[arg(long, env = "EMBER_DB", value_name = "URL")]
    pub db: String,
    /// The node token's file (the nodes' internal APIs take it).
    #[arg(long, env = "EMBER_NODE_TOKEN_FILE", value_name = "FILE")]
    pub node_token_file: PathBuf,
    /// The E2B sandbox domain (as for `ember serve --domain`).
    #[arg(long, env = "EMBER_E2B_DOMAIN", value_name = "DOMAIN")]
    pub domain: Option<String>,
    /// Largest file upload, MiB.
    #[arg(long, value_name = "MIB", default_value_t = 4096)]
    pub max_upload_mib: u64,
    /// After SIGINT/SIGTERM, how long open streams may go on, seconds.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    pub shutdown_grace: u64,
    /// Also serve HTTPS here (the E2B SDKs' `https://<port>-<id>.<domain>` and
    /// `https://api.<domain>`): needs --domain.
    #[arg(long, value_name = "ADDR", requires = "domain")]
    pub tls_listen: Option<SocketAddr>,
    /// The TLS certificates' directory (a local CA and `*.<domain>`, made on first use):
    /// give every gateway of a fleet the same one, so that clients trust one CA.
    #[arg(long, value_name = "DIR", requires = "tls_listen")]
    pub tls_dir: Option<PathBuf>,
    /// The fleet's blob store (as for `ember node --blobs`): artifacts of sandboxes whose
    /// node is gone are read from it.
    #[arg(long, env = "EMBER_BLOBS", value_name = "URL")]
    pub blobs: Option<String>,
}

/// `ember cluster`.
#[derive(Debug, Subcommand)]
pub enum ClusterCmd {
    /// The nodes: liveness, capacity, templates, sandboxes per node.
    Status {
        /// The directory: a PostgreSQL URL.
        #[arg(long, env = "EMBER_DB", value_name = "URL")]
        db: String,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Sets (or, with 0, removes) an API key's quota of live sandboxes, fleet-wide.
    Quota {
        /// The directory: a PostgreSQL URL.
        #[arg(long, env = "EMBER_DB", value_name = "URL")]
        db: String,
        /// The API key (a gateway's clients are `default`).
        #[arg(long, default_value = ember_fleet::gateway::API_KEY)]
        key: String,
        /// Most live (running or paused) sandboxes; 0 removes the quota.
        #[arg(long, value_name = "N")]
        max_sandboxes: u32,
    },
    /// Drains a node: it takes no more creates and pauses its sandboxes; each, once uploaded
    /// to the blob store, continues on another node at its next call. The node's next start
    /// takes work again.
    Drain {
        /// The directory: a PostgreSQL URL.
        #[arg(long, env = "EMBER_DB", value_name = "URL")]
        db: String,
        /// Wait until every sandbox of the node can continue elsewhere.
        #[arg(long)]
        wait: bool,
        /// With --wait: give up after this long, seconds (exit status 1).
        #[arg(long, value_name = "SECS", default_value_t = 280)]
        timeout: u64,
        /// The node.
        node: String,
    },
}

fn labels(specs: &[String]) -> Result<serde_json::Value, String> {
    let mut m = serde_json::Map::new();
    for s in specs {
        let (k, v) = s
            .split_once('=')
            .ok_or_else(|| format!("--label {s:?}: expected KEY=VALUE"))?;
        if k.is_empty() {
            return Err(format!("--label {s:?}: the key is empty"));
        }
        m.insert(k.to_string(), serde_json::json!(v));
    }
    Ok(serde_json::Value::Object(m))
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "node".into())
}

/// Runs `ember node`.
pub fn node_main(a: NodeArgs) -> ExitCode {
    let labels = match labels(&a.labels) {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    let token = match ember_server::load_or_create_token(&a.node_token_file) {
        Ok(t) => t,
        Err(e) => return fail(format!("--node-token-file: {e}")),
    };
    let db = match Db::open(&a.db) {
        Ok(db) => Arc::new(db),
        Err(e) => return fail(e),
    };
    let cfg = NodeConfig {
        id: a.node_id.clone().unwrap_or_else(host_name),
        advertise: a
            .advertise
            .clone()
            .unwrap_or_else(|| a.internal_listen.to_string()),
        labels,
    };
    let blobs = match a.blobs.as_deref().map(ember_fleet::blobs::Blobs::open) {
        None => None,
        Some(Ok(b)) => Some(Arc::new(b)),
        Some(Err(e)) => return fail(e),
    };
    let hooks = match ember_fleet::transfer::NodeHooks::start(db.clone(), &cfg.id, blobs.clone()) {
        Ok(h) => h,
        Err(e) => return fail(e),
    };
    let (stop_db, stop_id) = (db.clone(), cfg.id.clone());
    let publish = a.publish.clone();
    let internal = a.internal_listen;
    let live = Arc::new(ember_fleet::node::Liveness::default());
    let watchdog = (a.vmm_watchdog > 0).then(|| Duration::from_secs(a.vmm_watchdog));
    let drain_timeout = Duration::from_secs(a.drain_timeout);
    let start: crate::serve::NodeStart = Box::new(move |tokio, rt| {
        rt.set_hooks(hooks.clone());
        let mover = blobs.clone().map(|b| {
            Arc::new(ember_fleet::node::Mover {
                rt: rt.clone(),
                blobs: b,
                db: db.clone(),
                node: cfg.id.clone(),
                hooks: hooks.clone(),
            })
        });
        let listener = tokio
            .block_on(tokio::net::TcpListener::bind(internal))
            .map_err(|e| format!("--internal-listen {internal}: {e}"))?;
        let handler = ember_fleet::node::NodeRuntime {
            rt: rt.clone(),
            blobs: blobs.clone(),
            db: db.clone(),
            hooks: hooks.clone(),
            live: live.clone(),
        };
        let app = ember_fleet::node::router(
            &cfg.id,
            Arc::new(handler),
            token,
            mover,
            Some(rt.clone()),
            live.clone(),
        );
        // Frames are small and written one by one: no Nagle delay between them.
        let listener = axum::serve::ListenerExt::tap_io(listener, |s| {
            if let Err(e) = s.set_nodelay(true) {
                tracing::debug!("TCP_NODELAY on an internal connection: {e}");
            }
        });
        tokio.spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!("the internal API stopped: {e}");
            }
        });
        let stop = Arc::new(AtomicBool::new(false));
        let epoch = ember_fleet::node::start_heartbeat(
            db.clone(),
            cfg.clone(),
            rt.clone(),
            stop.clone(),
            Some(hooks.clone()),
            live.clone(),
        )
        .map_err(|e| e.to_string())?;
        ember_fleet::node::start_fence(rt.clone(), live.clone(), watchdog, stop)
            .map_err(|e| e.to_string())?;
        // Its templates go to the blob store, and pauses a previous run left un-uploaded.
        if let Some(b) = blobs.clone() {
            let (rt, hooks) = (rt.clone(), hooks.clone());
            let spawned = std::thread::Builder::new()
                .name("ember-publish".into())
                .spawn(move || {
                    ember_fleet::transfer::publish_all(&b, &publish);
                    hooks.resume_uploads(&rt);
                });
            if let Err(e) = spawned {
                tracing::warn!("templates not published: {e}");
            }
        }
        eprintln!(
            "ember: node {} registered (epoch {epoch}); internal API on {internal}, advertised \
             as {}",
            cfg.id, cfg.advertise
        );
        // SIGTERM (an engine stopping the node, an upgrade) drains first; SIGINT does not.
        let (node, timeout, can_move) = (cfg.id.clone(), drain_timeout, blobs.is_some());
        let stop: ember_server::StopSignal = Box::pin(async move {
            match node_signal().await {
                NodeSignal::Interrupt => {}
                // Without a blob store nothing can move: stop as on SIGINT.
                NodeSignal::Terminate if !can_move => {
                    tracing::warn!(
                        "SIGTERM: no blob store (--blobs), so no drain: the VMs are left \
                         running for the next start"
                    );
                }
                NodeSignal::Terminate => {
                    tracing::info!("SIGTERM: draining before stopping");
                    let drained = tokio::task::spawn_blocking(move || {
                        ember_fleet::node::drain(&db, &node, timeout, |n| {
                            tracing::info!("drain: {n} sandbox(es) still to pause and upload")
                        })
                    })
                    .await;
                    match drained {
                        Ok(Ok(t)) => tracing::info!(
                            "drained in {:.1} s: every sandbox can continue on another node",
                            t.as_secs_f64()
                        ),
                        Ok(Err(e)) => tracing::error!("the drain did not finish: {e}"),
                        Err(e) => tracing::error!("the drain failed: {e}"),
                    }
                }
            }
        });
        Ok(Some(stop))
    });
    let code = crate::serve::run(a.serve, Some(start));
    // Gateways stop sending it calls at once (rather than after the heartbeat's silence).
    if let Err(e) = stop_db.set_stopped(&stop_id) {
        tracing::warn!("the directory was not told this node stopped: {e}");
    }
    code
}

enum NodeSignal {
    Interrupt,
    Terminate,
}

/// Waits for SIGINT or SIGTERM.
async fn node_signal() -> NodeSignal {
    tokio::select! {
        _ = tokio::signal::ctrl_c() => NodeSignal::Interrupt,
        _ = ember_server::terminate_signal() => NodeSignal::Terminate,
    }
}

/// Runs `ember gateway`.
pub fn gateway_main(a: GatewayArgs) -> ExitCode {
    crate::serve::init_logging();
    let node_token = match ember_server::load_or_create_token(&a.node_token_file) {
        Ok(t) => t,
        Err(e) => return fail(format!("--node-token-file: {e}")),
    };
    let db = match Db::open(&a.db) {
        Ok(db) => Arc::new(db),
        Err(e) => return fail(e),
    };
    let mut fleet = Fleet::new(db, node_token, a.max_upload_mib << 20);
    if let Some(url) = &a.blobs {
        match ember_fleet::blobs::Blobs::open(url) {
            Ok(b) => fleet = fleet.with_blobs(Arc::new(b)),
            Err(e) => return fail(e),
        }
    }
    let fleet = Arc::new(fleet);
    if let Err(e) = fleet.start_sweeper() {
        return fail(e);
    }
    let opts = ServeOptions {
        listen: a.listen,
        token_file: a.token_file.clone(),
        shutdown_grace: Duration::from_secs(a.shutdown_grace),
        e2b: E2bOptions {
            domain: a.domain.clone().filter(|d| !d.trim().is_empty()),
            ..E2bOptions::default()
        },
    };
    let tokio = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("ember-gateway")
        .build()
    {
        Ok(t) => t,
        Err(e) => return fail(format!("cannot start the async runtime: {e}")),
    };
    let mut server = match tokio.block_on(Server::bind(opts)) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    if let (Some(addr), Some(domain)) = (a.tls_listen, a.domain.as_deref()) {
        let dir = a
            .tls_dir
            .clone()
            .unwrap_or_else(|| ember_runtime::paths::home_dir().join("tls"));
        match crate::serve::tls_listener(&dir, domain, addr, &tokio) {
            Ok(l) => server = server.also_serve(format!("TLS listener on {addr}"), l),
            Err(e) => return fail(e),
        }
    }
    eprintln!(
        "ember: gateway serving on http://{} (bearer token in {})",
        server.local_addr(),
        a.token_file.display()
    );
    // Our own reference outlives the server's: the fleet (its directory connection and blob
    // store, each with a runtime of its own) is dropped here, off the async runtime, where
    // their blocking drops may run.
    let result = tokio.block_on(server.run(fleet.clone()));
    tokio.shutdown_timeout(Duration::from_secs(5));
    drop(fleet);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

/// Runs `ember cluster …`.
pub fn cluster_main(c: ClusterCmd) -> ExitCode {
    match c {
        ClusterCmd::Status { db, json } => {
            let db = match Db::open(&db) {
                Ok(db) => db,
                Err(e) => return fail(e),
            };
            let nodes = match db.nodes() {
                Ok(n) => n,
                Err(e) => return fail(e),
            };
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&nodes).unwrap_or_default()
                );
                return ExitCode::SUCCESS;
            }
            println!(
                "{:<16} {:<22} {:<8} {:>9} {:>8} {:>13} {:>9}  templates",
                "node", "address", "live", "heartbeat", "running", "memory MiB", "sandboxes"
            );
            for n in &nodes {
                let live = n.heartbeat_age_secs <= ember_fleet::gateway::LIVE_WITHIN.as_secs_f64();
                println!(
                    "{:<16} {:<22} {:<8} {:>8.1}s {:>4}/{:<3} {:>6}/{:<6} {:>9}  {}",
                    n.node.id,
                    n.node.addr,
                    match n.status.as_str() {
                        "stopped" => "STOPPED",
                        "draining" => "DRAINING",
                        "lost" => "LOST",
                        _ if live => "yes",
                        _ => "LOST",
                    },
                    n.heartbeat_age_secs,
                    n.node.running,
                    n.node.max_running,
                    n.node.memory_mib,
                    n.node.max_memory_mib,
                    n.sandboxes,
                    n.node.templates.join(",")
                );
            }
            if nodes.is_empty() {
                println!("(no node has registered)");
            }
            ExitCode::SUCCESS
        }
        ClusterCmd::Drain {
            db,
            wait,
            timeout,
            node,
        } => {
            let db = match Db::open(&db) {
                Ok(db) => db,
                Err(e) => return fail(e),
            };
            if !wait {
                return match db.set_draining(&node) {
                    Ok(true) => {
                        eprintln!("ember: node {node} is draining");
                        ExitCode::SUCCESS
                    }
                    Ok(false) => fail(format!("node {node} is not registered")),
                    Err(e) => fail(e),
                };
            }
            eprintln!("ember: draining node {node}");
            let r = ember_fleet::node::drain(&db, &node, Duration::from_secs(timeout), |n| {
                eprintln!("ember: node {node}: {n} sandbox(es) still to pause and upload")
            });
            match r {
                Ok(took) => {
                    eprintln!(
                        "ember: node {node} drained in {:.1} s: every sandbox can continue on another node",
                        took.as_secs_f64()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        ClusterCmd::Quota {
            db,
            key,
            max_sandboxes,
        } => {
            let db = match Db::open(&db) {
                Ok(db) => db,
                Err(e) => return fail(e),
            };
            let n = match max_sandboxes {
                0 => None,
                n => match i32::try_from(n) {
                    Ok(n) => Some(n),
                    Err(_) => return fail(format!("--max-sandboxes {n}: too many")),
                },
            };
            match db.set_quota(&key, n) {
                Ok(()) => {
                    match n {
                        Some(n) => println!("API key {key:?}: at most {n} live sandboxes"),
                        None => println!("API key {key:?}: no quota"),
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
    }
}
