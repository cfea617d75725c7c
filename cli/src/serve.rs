//! `ember serve`: the sandbox server (native HTTP API over the runtime).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use ember_runtime::{Runtime, RuntimeConfig};
use ember_server::e2b::{tls, E2bOptions};
use ember_server::{ExtraListener, ServeOptions, Server};

use crate::fail;

/// `ember serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on (plain HTTP). Anything but loopback exposes the API to the
    /// network: the token still guards it, but in clear text; see `--tls-listen`.
    #[arg(long, env = "EMBER_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// The bearer token's file (default `$EMBER_HOME/token`; created, mode 0600, if absent).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Most sandboxes with a VMM at once.
    #[arg(long)]
    pub max_running: Option<usize>,
    /// Most guest memory committed by running sandboxes, MiB (default 4× host RAM).
    #[arg(long)]
    pub max_memory_mib: Option<u64>,
    /// Timeout of a sandbox when create gives none, seconds (default 300).
    #[arg(long, value_name = "SECS")]
    pub default_timeout: Option<u64>,
    /// Longest timeout and lifetime accepted, seconds (default 86400).
    #[arg(long, value_name = "SECS")]
    pub max_lifetime: Option<u64>,
    /// Largest file upload, MiB (default 4096).
    #[arg(long, value_name = "MIB")]
    pub max_upload_mib: Option<u64>,
    /// Highest CPU quota a create may ask for, percent of one CPU (default: no cap).
    #[arg(long)]
    pub max_cpu_percent: Option<u32>,
    /// Give each jail its own copy of the VMM binary instead of a link to one shared copy
    /// (no page shared between VMMs but the template's memory; costs each idle sandbox the
    /// binary's size in private memory).
    #[arg(long)]
    pub private_vmm_copies: bool,
    /// Warm pool: jailed VMMs kept waiting per template, so that a create pays only for the
    /// restore (0: off). The pool grows with the create rate up to --pool-max.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub pool: usize,
    /// Keep warm VMMs restored with their vCPUs held, as before pool members were primed: a
    /// create then starts the guest, makes its agent connection and pays for its first cell's
    /// page mappings itself. By default a member's guest runs, is connected and has run one
    /// silent cell before it is handed out (docs/performance.md, "Primed pool members").
    #[arg(long)]
    pub pool_unprimed: bool,
    /// Most warm VMMs per template, whatever the create rate.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub pool_max: usize,
    /// Templates whose pool is filled at start (repeatable; others get one at their first
    /// create).
    #[arg(long = "pool-template", value_name = "NAME", default_values_t = vec!["default".to_string()])]
    pub pool_templates: Vec<String>,
    /// Most VM starts (restore → agent answered) at once; further creates and resumes wait
    /// in line, so that a burst does not starve every starting guest of CPU (0: no limit;
    /// default: twice the host's CPUs).
    #[arg(long, value_name = "N")]
    pub max_starting: Option<usize>,
    /// After SIGINT/SIGTERM, how long open streams may go on, seconds.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    pub shutdown_grace: u64,
    /// The E2B sandbox domain: requests for `Host: <port>-<id>.<DOMAIN>` go to that sandbox,
    /// `Host: api.<DOMAIN>` to the E2B control plane, and API responses name it (the SDKs'
    /// `E2B_DOMAIN`). May carry a port (`e2b.localhost:3443`). Default on a loopback
    /// listener: `localhost:<port>`; elsewhere none (sandbox traffic is then routed by the
    /// `E2b-Sandbox-Id` header only).
    #[arg(long, env = "EMBER_E2B_DOMAIN", value_name = "DOMAIN")]
    pub domain: Option<String>,
    /// An E2B template name and the ember template (or snapshot) it means, e.g.
    /// `code-interpreter-v1=python-data` (repeatable; overrides the defaults
    /// `code-interpreter-v1=code-interpreter`, `base=default`).
    #[arg(long = "e2b-alias", value_name = "NAME=TEMPLATE")]
    pub e2b_alias: Vec<String>,
    /// Give E2B sandboxes created with `allow_internet_access: true` (the SDKs' default)
    /// policy `egress`; without it they get ember's default, `none` (`network.allowOut` /
    /// `denyOut` lists are honoured either way).
    #[arg(long)]
    pub e2b_allow_internet: bool,
    /// Also serve (the same API) over TLS on this address, with a certificate for
    /// `*.<DOMAIN>` signed by a local CA kept in `$EMBER_HOME/tls` (made on first use; point
    /// clients' `SSL_CERT_FILE` at its bundle). Needs `--domain`.
    #[arg(long, value_name = "ADDR")]
    pub tls_listen: Option<SocketAddr>,
    /// The interface sandboxes with `egress` leave by, NATed (default: the interface of the
    /// host's default route).
    #[arg(long, env = "EMBER_UPLINK", value_name = "IFACE")]
    pub uplink: Option<String>,
    /// Host-side addresses of sandboxes' veth pairs, a /30 each.
    #[arg(long, value_name = "CIDR", default_value = "10.199.0.0/16")]
    pub net_pool: String,
    /// Where sandboxes' resolvers send the queries they allow (default: the host's first
    /// nameserver).
    #[arg(long, env = "EMBER_DNS_UPSTREAM", value_name = "IP[:PORT]")]
    pub dns_upstream: Option<String>,
    /// The CA bundle (PEM) the egress proxy verifies upstream servers with, instead of the
    /// system's (a private PKI; tests).
    #[arg(long, env = "EMBER_EDGE_UPSTREAM_CA", value_name = "PEM")]
    pub edge_upstream_ca: Option<std::path::PathBuf>,
    /// First host uid of the jailed VMMs (each running sandbox gets its own uid above it;
    /// default 200000). Two runtimes on one host need ranges that do not overlap.
    #[arg(long, value_name = "UID")]
    pub uid_base: Option<u32>,
}

/// The E2B domain of a server given none: on a loopback listener, `localhost:<port>`, so
/// that the SDKs' `get_host(port)` names this server (`<port>-<id>.localhost:<port>`, which
/// the SDKs, browsers and curl resolve to loopback) rather than `e2b.app`. Elsewhere none:
/// a name for every sandbox needs DNS that only the operator can provide (`--domain`).
fn default_domain(listen: std::net::SocketAddr) -> Option<String> {
    listen
        .ip()
        .is_loopback()
        .then(|| format!("localhost:{}", listen.port()))
}

/// The E2B settings of the flags.
fn e2b_options(a: &ServeArgs) -> Result<E2bOptions, String> {
    let mut o = E2bOptions {
        domain: a.domain.clone().filter(|d| !d.trim().is_empty()),
        allow_internet: a.e2b_allow_internet,
        ..E2bOptions::default()
    };
    for spec in &a.e2b_alias {
        match spec.split_once('=') {
            Some((name, template)) if !name.trim().is_empty() && !template.trim().is_empty() => {
                o.aliases
                    .insert(name.trim().to_string(), template.trim().to_string());
            }
            _ => return Err(format!("--e2b-alias {spec:?}: expected NAME=TEMPLATE")),
        }
    }
    Ok(o)
}

pub(crate) fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

/// The TLS listener on `addr` with the certificates in `dir` (`$EMBER_HOME/tls` for
/// `ember serve`) for `domain`, made there on first use.
pub(crate) fn tls_listener(
    dir: &std::path::Path,
    domain: &str,
    addr: SocketAddr,
    rt: &tokio::runtime::Runtime,
) -> Result<ExtraListener, String> {
    let files = tls::load_or_create(dir, domain)
        .map_err(|e| format!("TLS certificates in {}: {e}", dir.display()))?;
    let config = tls::server_config(&files).map_err(|e| format!("TLS: {e}"))?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(addr))
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let host = tls::cert_domain(domain).unwrap_or_else(|_| domain.to_string());
    eprintln!(
        "ember: serving TLS on https://{addr} for *.{host} (CA certificate {}; `ember tls \
         init --domain {domain}` prints the SDKs' environment)",
        files.ca_cert.display()
    );
    Ok(Box::new(move |app, stop| {
        Box::pin(tls::serve_tls(listener, config, app, stop))
    }))
}

/// Raises the soft open-file limit to the hard one: the server holds a few descriptors per
/// sandbox, and 1,024 (a common soft default) caps it at a few hundred sandboxes.
fn raise_open_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 && lim.rlim_cur < lim.rlim_max
    {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit reads the struct we pass; raising the soft limit up to the hard
        // limit is always allowed.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    }
}

/// Runs `ember serve`.
pub fn main(a: ServeArgs) -> ExitCode {
    run(a, None)
}

/// What `ember node` starts beside the server, once the runtime is open: its internal API
/// and its heartbeat (`Err`: why the node cannot start); `Some`: what stops the server instead
/// of SIGINT/SIGTERM.
pub type NodeStart = Box<
    dyn FnOnce(
        &tokio::runtime::Runtime,
        &Runtime,
    ) -> Result<Option<ember_server::StopSignal>, String>,
>;

/// Runs the server over this host's runtime (`ember serve`; `ember node` with `node`).
pub fn run(a: ServeArgs, node: Option<NodeStart>) -> ExitCode {
    init_logging();
    let mut cfg = RuntimeConfig::from_env();
    if let Some(n) = a.max_running {
        cfg.max_running = n;
    }
    if let Some(m) = a.max_memory_mib {
        cfg.max_committed_memory_mib = m;
    }
    if let Some(s) = a.default_timeout {
        cfg.default_timeout = Duration::from_secs(s);
    }
    if let Some(s) = a.max_lifetime {
        cfg.max_lifetime = Duration::from_secs(s);
    }
    if let Some(m) = a.max_upload_mib {
        cfg.max_upload_bytes = m << 20;
    }
    if a.max_cpu_percent.is_some() {
        cfg.max_cpu_percent = a.max_cpu_percent;
    }
    if let Some(u) = a.uid_base {
        cfg.uid_base = u;
    }
    cfg.kill_on_drop = false;
    cfg.share_vmm_binary = !a.private_vmm_copies;
    raise_open_file_limit();
    if let Some(n) = a.max_starting {
        cfg.max_starting = n;
    }
    cfg.pool.size = a.pool;
    cfg.pool.max = a.pool_max.max(a.pool);
    cfg.pool.prime = !a.pool_unprimed;
    cfg.pool_templates = a.pool_templates.clone();
    cfg.network.uplink = a.uplink.clone();
    match ember_runtime::netpolicy::Cidr4::parse(&a.net_pool) {
        Ok(p) => cfg.network.pool = p,
        Err(e) => return fail(format!("--net-pool: {e}")),
    }
    cfg.network.edge_upstream_ca = a.edge_upstream_ca.clone();
    if let Some(d) = &a.dns_upstream {
        let parsed = d.parse::<SocketAddr>().or_else(|_| {
            d.parse::<std::net::IpAddr>()
                .map(|ip| SocketAddr::new(ip, 53))
        });
        match parsed {
            Ok(s) => cfg.network.dns_upstream = Some(s),
            Err(_) => return fail(format!("--dns-upstream {d:?}: expected IP or IP:PORT")),
        }
    }
    if let Some(u) = &a.uplink {
        if !ember_runtime::netpolicy::link_exists(u) {
            return fail(format!("--uplink {u}: no such interface"));
        }
    }
    if cfg.default_timeout > cfg.max_lifetime {
        return fail("--default-timeout is longer than --max-lifetime");
    }
    let e2b = match e2b_options(&a) {
        Ok(o) => o,
        Err(e) => return fail(e),
    };
    if a.tls_listen.is_some() && e2b.domain.is_none() {
        return fail("--tls-listen needs --domain (the certificate is for *.<domain>)");
    }
    let mut e2b = e2b;
    if e2b.domain.is_none() {
        e2b.domain = default_domain(a.listen);
    }
    let opts = ServeOptions {
        listen: a.listen,
        token_file: a
            .token_file
            .clone()
            .unwrap_or_else(|| cfg.home.join("token")),
        shutdown_grace: Duration::from_secs(a.shutdown_grace),
        e2b: e2b.clone(),
    };
    if !a.listen.ip().is_loopback() {
        tracing::warn!(
            "listening on {}: the API is reachable from the network, guarded only by the \
             bearer token and without TLS",
            a.listen
        );
    }
    let home = cfg.home.clone();
    let tokio = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("ember-serve")
        .build()
    {
        Ok(t) => t,
        Err(e) => return fail(format!("cannot start the async runtime: {e}")),
    };
    // Bind first: a busy port fails before the runtime touches any sandbox.
    let token_file = opts.token_file.clone();
    let mut server = match tokio.block_on(Server::bind(opts)) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    if let (Some(addr), Some(domain)) = (a.tls_listen, e2b.domain.as_deref()) {
        match tls_listener(&home.join("tls"), domain, addr, &tokio) {
            Ok(l) => server = server.also_serve(format!("TLS listener on {addr}"), l),
            Err(e) => return fail(e),
        }
    }
    let rt = match Runtime::open(cfg) {
        Ok(rt) => rt,
        Err(e) => {
            return fail(format!(
                "cannot open the runtime in {}: {e}",
                home.display()
            ))
        }
    };
    let mut stop = None;
    if let Some(start) = node {
        match start(&tokio, &rt) {
            Ok(s) => stop = s,
            Err(e) => return fail(e),
        }
    }
    let addr = server.local_addr();
    eprintln!(
        "ember: serving on http://{addr} (state in {}; bearer token in {})",
        home.display(),
        token_file.display()
    );
    eprintln!(
        "ember: try `EMBER_URL=http://{addr} ember sandbox create`; Ctrl-C stops the server \
         and leaves the sandboxes running"
    );
    // Our own reference outlives the server's, so the runtime is dropped here, off the
    // async runtime (its drop joins threads).
    let backend = Arc::new(rt);
    let result = match stop {
        Some(stop) => tokio.block_on(server.run_until(backend.clone(), stop)),
        None => tokio.block_on(server.run(backend.clone())),
    };
    // Blocking calls still running (a guest that does not answer) must not keep the
    // process alive: their sandboxes are re-attached at the next start.
    tokio.shutdown_timeout(Duration::from_secs(5));
    drop(backend);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_server_names_itself_as_the_e2b_domain() {
        let d = |s: &str| default_domain(s.parse().unwrap());
        assert_eq!(d("127.0.0.1:3000").as_deref(), Some("localhost:3000"));
        assert_eq!(d("[::1]:7070").as_deref(), Some("localhost:7070"));
        assert_eq!(d("0.0.0.0:7070"), None);
        assert_eq!(d("10.1.2.3:7070"), None);
    }
}
