//! Networking of sandboxes: one network namespace per running VM, host-side enforcement.
//!
//! ```text
//!  guest eth0 172.30.0.2/30 ──virtio-net── tap0 172.30.0.1/30 ┐  namespace em-<tag>-<slot>-<jail>
//!                                   table inet ember (policy) │  (the VMM joins it through the jailer)
//!                                           veth0 <pool>.2/30 ┘
//!                                                  │ veth pair
//!  host:  vh<tag><slot> <pool>.1/30 ── table inet ember_<tag> ── uplink (NAT)
//! ```
//!
//! Every clone of a template keeps the guest's address and MAC from the snapshot: each lives
//! in its own namespace, so they never meet. The guest was configured once, when its template
//! was booted (`ember.net=`, [`guest_cmdline`]); nothing changes in it at restore. The host
//! side is allocated per sandbox from a pool (a /30 each), with NAT in the namespace and again
//! at the uplink. The namespace, its veth pair, TAP, rules and resolver exist while the VM
//! runs, and go with it: deleting the namespace removes the veth pair, the TAP and the table.
//! At start the runtime deletes every namespace of its own tag that no re-attached VM uses.
//!
//! The policy ([`NetworkPolicy`]) is enforced in the sandbox's namespace ([`nft::sandbox`])
//! and, coarsely, on the host ([`nft::host`]); names go through a resolver of ours bound to
//! the gateway address inside the namespace ([`dns`]), which feeds the nftables set of
//! allowed addresses when the policy lists domains.

pub mod dns;
pub mod edge;
pub mod nft;
pub mod policy;

use std::collections::BTreeSet;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use nft::DropStats;
pub use policy::{Cidr4, NetMode, NetworkPolicy};

/// The guest's address in every networked template.
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 2);
/// Its gateway and resolver: the TAP's address in the sandbox's namespace.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 1);
/// Prefix length of the guest link.
pub const LINK_PREFIX: u8 = 30;
/// The guest's MAC in every networked template (locally administered).
pub const GUEST_MAC: &str = "06:00:ac:1e:00:02";
/// Where network namespaces are mounted (`ip netns` convention).
pub const NETNS_DIR: &str = "/run/netns";

/// The kernel command line key that configures the guest (see `ember_agent::netcfg`).
pub fn guest_cmdline() -> String {
    format!("ember.net={GUEST_ADDR}/{LINK_PREFIX},{GATEWAY}")
}

/// Errors setting up or changing a sandbox's network.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A command (`ip`) failed.
    #[error("network set-up: {0}")]
    Command(#[from] ember_vmm::netns::ToolError),
    /// nftables.
    #[error("network set-up: {0}")]
    Nft(#[from] nft::NftError),
    /// A system call.
    #[error("network set-up: {what}: {source}")]
    Sys {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The pool has no free /30.
    #[error("the network address pool {0} is exhausted")]
    PoolExhausted(Cidr4),
    /// Egress without an uplink.
    #[error(
        "no uplink: this host has no default route; start the server with --uplink IFACE to \
         give sandboxes egress"
    )]
    NoUplink,
    /// Configuration.
    #[error("network configuration: {0}")]
    Config(String),
}

fn sys(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetError {
    let what = what.into();
    move |source| NetError::Sys { what, source }
}

/// The runtime's network settings.
#[derive(Debug, Clone)]
pub struct NetOptions {
    /// The interface egress leaves by (default: the one of the host's default route).
    pub uplink: Option<String>,
    /// Host-side veth addresses, a /30 per running sandbox.
    pub pool: Cidr4,
    /// Where the sandboxes' resolvers send allowed queries (default: the host's first
    /// `nameserver`).
    pub dns_upstream: Option<SocketAddr>,
    /// The CA bundle (PEM) the egress proxy verifies upstream servers with, instead of the
    /// system's (tests; a private PKI).
    pub edge_upstream_ca: Option<PathBuf>,
}

impl Default for NetOptions {
    fn default() -> Self {
        NetOptions {
            uplink: None,
            pool: Cidr4 {
                addr: Ipv4Addr::new(10, 199, 0, 0),
                len: 16,
            },
            dns_upstream: None,
            edge_upstream_ca: None,
        }
    }
}

/// Runs `f` on a fresh thread inside the network namespace at `path` (sockets it creates and
/// processes it starts belong to that namespace; the calling thread is untouched).
pub fn in_netns<T: Send>(path: &Path, f: impl FnOnce() -> T + Send) -> Result<T, NetError> {
    let file = File::open(path).map_err(sys(format!("opening {}", path.display())))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns(2) on a descriptor we own, for this thread only (network
            // namespaces are per thread); the thread ends when `f` returns.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(sys(format!("entering {}", path.display()))(
                    std::io::Error::last_os_error(),
                ));
            }
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| {
            Err(NetError::Config(format!(
                "a thread in {} panicked",
                path.display()
            )))
        })
    })
}

fn run(cmd: &str, args: &[&str], stdin: Option<&str>) -> Result<String, NetError> {
    Ok(ember_vmm::netns::run_tool(
        cmd,
        args,
        stdin.map(str::as_bytes),
    )?)
}

fn write_sysctl(path: &str, value: &str) -> Result<(), NetError> {
    std::fs::write(path, value).map_err(sys(format!("writing {path}")))
}

/// Whether interface `name` exists in the calling thread's network namespace (`/sys/class/net`
/// shows the namespace sysfs was mounted in, which need not be this one).
pub fn link_exists(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: `c` is a NUL-terminated string that outlives the call, which only reads it.
    unsafe { libc::if_nametoindex(c.as_ptr()) != 0 }
}

/// The host's IPv4 addresses (in the calling thread's namespace).
fn host_addrs() -> Vec<Ipv4Addr> {
    let text = run("ip", &["-j", "-4", "addr", "show"], None).unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let mut out = Vec::new();
    for link in v.as_array().into_iter().flatten() {
        for a in link["addr_info"].as_array().into_iter().flatten() {
            if let Some(ip) = a["local"].as_str().and_then(|s| s.parse().ok()) {
                out.push(ip);
            }
        }
    }
    out
}

/// The interface of the default route.
fn default_route_dev() -> Option<String> {
    let text = run("ip", &["-j", "-4", "route", "show", "default"], None).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.as_array()?
        .iter()
        .find_map(|r| r["dev"].as_str().map(str::to_owned))
}

/// The first `nameserver` of `/etc/resolv.conf`.
fn host_resolver() -> Option<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some("nameserver"))
            .then(|| w.next()?.parse::<IpAddr>().ok())
            .flatten()
            .map(|ip| SocketAddr::new(ip, 53))
    })
}

/// A running sandbox's network: its namespace and what serves it.
#[derive(Debug)]
pub struct SandboxNet {
    /// Namespace name (`/run/netns/<name>`).
    pub name: String,
    /// Its path.
    pub path: PathBuf,
    /// Pool slot.
    pub slot: u32,
    /// The host-side veth.
    pub host_veth: String,
    state: Mutex<NetState>,
}

#[derive(Default)]
struct NetState {
    policy: NetworkPolicy,
    resolver: Option<(Arc<dns::Resolver>, tokio::sync::watch::Sender<bool>)>,
    /// Names the resolver refused (latest 32) and how many queries in all.
    denied_log: Option<DeniedLog>,
    /// The egress proxy, for a policy with rules.
    edge: Option<(Arc<edge::EdgeSandbox>, tokio::sync::watch::Sender<bool>)>,
}

/// Names the resolver refused (latest 32) and how many queries in all.
type DeniedLog = Arc<Mutex<(Vec<String>, u64)>>;

impl std::fmt::Debug for NetState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetState")
            .field("policy", &self.policy)
            .field("resolver", &self.resolver.is_some())
            .finish()
    }
}

impl SandboxNet {
    /// The policy in force.
    pub fn policy(&self) -> NetworkPolicy {
        self.state
            .lock()
            .map(|s| s.policy.clone())
            .unwrap_or_default()
    }

    /// Connects to the guest's TCP `port` from inside the namespace (the caller's side of an
    /// exposed port). The returned stream is non-blocking.
    pub fn connect(&self, port: u16, timeout: Duration) -> Result<std::net::TcpStream, NetError> {
        let addr = SocketAddr::from((GUEST_ADDR, port));
        let s = in_netns(&self.path, || {
            std::net::TcpStream::connect_timeout(&addr, timeout)
        })?
        .map_err(sys(format!("connecting to the sandbox's port {port}")))?;
        s.set_nonblocking(true)
            .map_err(sys("making a socket non-blocking"))?;
        Ok(s)
    }
}

/// What [`NetManager::stats`] reports.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct NetStats {
    /// Rule counters and samples.
    #[serde(flatten)]
    pub drops: DropStats,
    /// Names the resolver refused (latest 32).
    pub denied_names: Vec<String>,
    /// Queries the resolver refused in all.
    pub denied_queries: u64,
    /// The egress proxy's counters (a policy with rules).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edge: Option<edge::EdgeStats>,
}

/// Sets up, changes and tears down sandboxes' networks for one runtime home.
pub struct NetManager {
    tag: String,
    opts: NetOptions,
    host: Mutex<Option<HostState>>,
    slots: Mutex<BTreeSet<u32>>,
    /// The resolvers' runtime (an Option so that Drop can shut it down without blocking:
    /// the manager may be dropped inside another runtime, e.g. `ember serve`'s).
    rt: Option<tokio::runtime::Runtime>,
    /// The secrets the egress proxy resolves placeholders from.
    secrets: Option<Arc<crate::secrets::Secrets>>,
    /// The egress proxy's CA and upstream trust (made with the first sandbox with rules).
    edge: Mutex<Option<Arc<edge::EdgeShared>>>,
    home: PathBuf,
}

impl std::fmt::Debug for NetManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetManager")
            .field("tag", &self.tag)
            .finish()
    }
}

#[derive(Debug, Clone)]
struct HostState {
    uplink: Option<String>,
    addrs: Vec<Ipv4Addr>,
    upstream: Option<SocketAddr>,
}

impl NetManager {
    /// A manager for the runtime at `home` (nothing is touched until the first sandbox).
    pub fn new(home: &Path, opts: NetOptions) -> Result<NetManager, NetError> {
        use sha2::Digest;
        if opts.pool.len > 28 {
            return Err(NetError::Config(format!(
                "the address pool {} is too small (at most /28)",
                opts.pool
            )));
        }
        let digest = sha2::Sha256::digest(home.as_os_str().as_encoded_bytes());
        let tag: String = digest[..2].iter().map(|b| format!("{b:02x}")).collect();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ember-net")
            .enable_all()
            .build()
            .map_err(sys("starting the resolver runtime"))?;
        Ok(NetManager {
            tag,
            opts,
            host: Mutex::new(None),
            slots: Mutex::new(BTreeSet::new()),
            rt: Some(rt),
            secrets: None,
            edge: Mutex::new(None),
            home: home.to_path_buf(),
        })
    }

    /// The same manager, its egress proxies resolving placeholders from `secrets`.
    pub fn with_secrets(mut self, secrets: Arc<crate::secrets::Secrets>) -> NetManager {
        self.secrets = Some(secrets);
        self
    }

    /// The egress proxy's shared state (its CA made or loaded at the first call).
    pub fn edge_shared(&self) -> Result<Arc<edge::EdgeShared>, NetError> {
        let mut e = self.edge.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = &*e {
            return Ok(e.clone());
        }
        let shared = edge::EdgeShared::new(
            &self.home.join("edge-ca"),
            self.opts.edge_upstream_ca.as_deref(),
            self.secrets.clone(),
        )
        .map_err(|e| NetError::Config(format!("egress proxy: {e}")))?;
        let shared = Arc::new(shared);
        *e = Some(shared.clone());
        Ok(shared)
    }

    /// Starts, updates or stops the egress proxy of `net` for `policy` (its resolver runs).
    fn apply_edge(
        &self,
        net: &SandboxNet,
        st: &mut NetState,
        policy: &NetworkPolicy,
        h: &HostState,
    ) -> Result<(), NetError> {
        if policy.rules.is_empty() && policy.egress_proxy.is_none() {
            if let Some((_, stop)) = st.edge.take() {
                let _ = stop.send(true);
            }
            if let Some((r, _)) = &st.resolver {
                r.set_answer_hook(None);
            }
            return Ok(());
        }
        if let Some((sb, _)) = &st.edge {
            sb.set_policy(policy.clone());
            return Ok(());
        }
        let Some((resolver, _)) = &st.resolver else {
            return Err(NetError::Config(
                "rules need the sandbox's resolver, and this host has no upstream resolver \
                 (--dns-upstream)"
                    .into(),
            ));
        };
        let shared = self.edge_shared()?;
        let mut extra_deny: Vec<Cidr4> = h
            .addrs
            .iter()
            .map(|a| Cidr4 { addr: *a, len: 32 })
            .collect();
        extra_deny.push(self.opts.pool);
        let sb = Arc::new(edge::EdgeSandbox::new(
            &net.name,
            policy.clone(),
            resolver.clone(),
            extra_deny,
        ));
        let hook_sb = sb.clone();
        let path = net.path.clone();
        let hook: dns::AnswerFn = Arc::new(move |name: String, addrs: Vec<(IpAddr, u32)>| {
            let (sb, path) = (hook_sb.clone(), path.clone());
            Box::pin(async move {
                if !sb.is_rule_host(&name) {
                    return Ok(());
                }
                let v4: Vec<(Ipv4Addr, u32)> = addrs
                    .into_iter()
                    .filter_map(|(ip, ttl)| match ip {
                        IpAddr::V4(ip) => Some((ip, ttl.clamp(30, 86_400) + 30)),
                        IpAddr::V6(_) => None,
                    })
                    .collect();
                if v4.is_empty() {
                    return Ok(());
                }
                let rules = nft::set_elements("edge4", &v4);
                tokio::task::spawn_blocking(move || {
                    in_netns(&path, || nft::apply(&rules))
                        .map_err(|e| e.to_string())?
                        .map_err(|e| e.to_string())
                })
                .await
                .map_err(|e| e.to_string())?
            })
        });
        let (tls_l, http_l, relay_l) = in_netns(&net.path, || -> std::io::Result<_> {
            let t = std::net::TcpListener::bind((GATEWAY, edge::TLS_PORT))?;
            t.set_nonblocking(true)?;
            let p = std::net::TcpListener::bind((GATEWAY, edge::HTTP_PORT))?;
            p.set_nonblocking(true)?;
            let r = std::net::TcpListener::bind((GATEWAY, edge::SOCKS_RELAY_PORT))?;
            r.set_nonblocking(true)?;
            Ok((t, p, r))
        })?
        .map_err(sys("binding the egress proxy's listeners"))?;
        let Some(rt) = &self.rt else {
            return Err(NetError::Config(
                "the network manager is shutting down".into(),
            ));
        };
        let (stop, rx) = tokio::sync::watch::channel(false);
        {
            let _g = rt.enter();
            let tls_l =
                tokio::net::TcpListener::from_std(tls_l).map_err(sys("egress proxy socket"))?;
            let http_l =
                tokio::net::TcpListener::from_std(http_l).map_err(sys("egress proxy socket"))?;
            rt.spawn(edge::serve(
                shared.clone(),
                sb.clone(),
                tls_l,
                edge::Scheme::Https,
                rx.clone(),
            ));
            let relay_l =
                tokio::net::TcpListener::from_std(relay_l).map_err(sys("egress proxy socket"))?;
            rt.spawn(edge::serve(
                shared,
                sb.clone(),
                http_l,
                edge::Scheme::Http,
                rx.clone(),
            ));
            rt.spawn(edge::serve_socks_relay(sb.clone(), relay_l, rx));
        }
        resolver.set_answer_hook(Some(hook));
        st.edge = Some((sb, stop));
        Ok(())
    }

    /// The tag in this runtime's names (namespaces `em-<tag>-…`, veths `vh<tag>…`, table
    /// `ember_<tag>`).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The host-side table's name.
    pub fn host_table(&self) -> String {
        format!("ember_{}", self.tag)
    }

    fn ns_prefix(&self) -> String {
        format!("em-{}-", self.tag)
    }

    /// Sets up the host side once: the table, forwarding.
    fn host(&self) -> Result<HostState, NetError> {
        let mut h = self.host.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = &*h {
            return Ok(h.clone());
        }
        let uplink = self.opts.uplink.clone().or_else(default_route_dev);
        let table = self.host_table();
        let prefix = format!("vh{}", self.tag);
        let rules = nft::host(&nft::HostSide {
            table: &table,
            veth_prefix: &prefix,
            uplink: uplink.as_deref().unwrap_or(""),
            pool: self.opts.pool,
        });
        nft::apply(&rules)?;
        let state = HostState {
            uplink,
            addrs: host_addrs(),
            upstream: self.opts.dns_upstream.or_else(host_resolver),
        };
        *h = Some(state.clone());
        Ok(state)
    }

    /// The handle of namespace `name` in pool slot `slot`.
    fn sandbox_net(&self, name: String, slot: u32) -> Arc<SandboxNet> {
        Arc::new(SandboxNet {
            path: Path::new(NETNS_DIR).join(&name),
            host_veth: format!("vh{}{slot:x}", self.tag),
            name,
            slot,
            state: Mutex::new(NetState::default()),
        })
    }

    /// Checks `policy` and readies the host side for it (the host table; forwarding and an
    /// uplink for egress).
    fn prepare(&self, policy: &NetworkPolicy) -> Result<HostState, NetError> {
        policy.validate().map_err(NetError::Config)?;
        let h = self.host()?;
        if policy.mode == NetMode::Egress {
            if h.uplink.is_none() {
                return Err(NetError::NoUplink);
            }
            self.ensure_forwarding()?;
        }
        Ok(h)
    }

    /// Turns on IPv4 forwarding on the host side, the first time a sandbox gets egress
    /// (a host whose sandboxes all have policy `none` is left as it was).
    fn ensure_forwarding(&self) -> Result<(), NetError> {
        let cur = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap_or_default();
        if cur.trim() != "1" {
            write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")?;
            tracing::info!("enabled net.ipv4.ip_forward for sandbox egress");
        }
        Ok(())
    }

    fn alloc_slot(&self) -> Result<u32, NetError> {
        let n = 1u32 << (32 - self.opts.pool.len as u32 - 2);
        let mut used = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let slot = (0..n)
            .find(|s| !used.contains(s))
            .ok_or(NetError::PoolExhausted(self.opts.pool))?;
        used.insert(slot);
        Ok(slot)
    }

    fn free_slot(&self, slot: u32) {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&slot);
    }

    fn slot_addrs(&self, slot: u32) -> (Ipv4Addr, Ipv4Addr) {
        let base = u32::from(self.opts.pool.addr) + slot * 4;
        (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
    }

    fn side(&self, h: &HostState) -> nft::SandboxSide {
        nft::SandboxSide {
            gateway: GATEWAY,
            host_addrs: h.addrs.clone(),
            pool: self.opts.pool,
        }
    }

    /// Creates the namespace of a VM that will run in jail `jail_id` as `uid`, with its TAP,
    /// veth pair, rules and (for egress) resolver.
    pub fn setup(
        &self,
        jail_id: &str,
        uid: u32,
        policy: &NetworkPolicy,
    ) -> Result<Arc<SandboxNet>, NetError> {
        let h = self.prepare(policy)?;
        let slot = self.alloc_slot()?;
        let name = format!("{}{slot}-{jail_id}", self.ns_prefix());
        let net = self.sandbox_net(name, slot);
        match self.build(&net, uid, policy, &h) {
            Ok(()) => Ok(net),
            Err(e) => {
                self.teardown(&net);
                Err(e)
            }
        }
    }

    fn build(
        &self,
        net: &SandboxNet,
        uid: u32,
        policy: &NetworkPolicy,
        h: &HostState,
    ) -> Result<(), NetError> {
        let (host_ip, ns_ip) = self.slot_addrs(net.slot);
        run("ip", &["netns", "add", &net.name], None)?;
        run(
            "ip",
            &["-batch", "-"],
            Some(&format!(
                "link add {hv} type veth peer name {veth} netns {ns}\n\
                 addr add {host_ip}/30 dev {hv}\n\
                 link set {hv} up\n",
                hv = net.host_veth,
                veth = nft::VETH,
                ns = net.name,
            )),
        )?;
        let side = self.side(h);
        let rules = nft::sandbox(policy, &side, true);
        in_netns(&net.path, || -> Result<(), NetError> {
            run(
                "ip",
                &["-batch", "-"],
                Some(&format!(
                    "link set lo up\n\
                     tuntap add dev {tap} mode tap user {uid} group {uid}\n\
                     addr add {GATEWAY}/{LINK_PREFIX} dev {tap}\n\
                     link set {tap} up\n\
                     addr add {ns_ip}/30 dev {veth}\n\
                     link set {veth} up\n{route}",
                    tap = nft::TAP,
                    veth = nft::VETH,
                    route = if policy.mode == NetMode::Egress {
                        format!("route add default via {host_ip}\n")
                    } else {
                        String::new()
                    },
                )),
            )?;
            write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")?;
            nft::apply(&rules)?;
            Ok(())
        })??;
        self.apply_policy(net, policy, h, false)
    }

    /// Route, resolver and (with `rerender`) rules for `policy`.
    fn apply_policy(
        &self,
        net: &SandboxNet,
        policy: &NetworkPolicy,
        h: &HostState,
        rerender: bool,
    ) -> Result<(), NetError> {
        let (host_ip, _) = self.slot_addrs(net.slot);
        let egress = policy.mode == NetMode::Egress;
        let rules = nft::sandbox(policy, &self.side(h), false);
        // At set-up the rules and the route are in place already.
        in_netns(&net.path, || -> Result<_, NetError> {
            if !rerender {
                return Ok(());
            }
            nft::apply(&rules)?;
            if egress {
                run(
                    "ip",
                    &["route", "replace", "default", "via", &host_ip.to_string()],
                    None,
                )?;
            } else {
                let _ = run("ip", &["route", "del", "default"], None);
            }
            Ok(())
        })??;
        let mut st = net.state.lock().unwrap_or_else(|p| p.into_inner());
        st.policy = policy.clone();
        if !egress {
            if let Some((_, stop)) = st.edge.take() {
                let _ = stop.send(true);
            }
            if let Some((_, stop)) = st.resolver.take() {
                let _ = stop.send(true);
            }
            return Ok(());
        }
        let rules = dns::DomainRules::new(&policy.allow_domains)
            .map_err(|e| NetError::Config(format!("allow_domains: {e}")))?;
        let rules = if policy.allow_domains.is_empty() {
            dns::DomainRules::any()
        } else {
            rules
        };
        if let Some((r, _)) = &st.resolver {
            r.set_rules(rules);
            return self.apply_edge(net, &mut st, policy, h);
        }
        let Some(upstream) = h.upstream else {
            if !policy.rules.is_empty() || policy.egress_proxy.is_some() {
                return Err(NetError::Config(
                    "rules need the sandbox's resolver, and this host has no upstream \
                     resolver (no nameserver in /etc/resolv.conf and no --dns-upstream)"
                        .into(),
                ));
            }
            tracing::warn!(
                "sandbox network {}: no upstream resolver (no nameserver in /etc/resolv.conf \
                 and no --dns-upstream); names will not resolve",
                net.name
            );
            return Ok(());
        };
        let gw = SocketAddr::from((GATEWAY, 53));
        let (udp, tcp) = in_netns(&net.path, || -> std::io::Result<_> {
            let u = std::net::UdpSocket::bind(gw)?;
            u.set_nonblocking(true)?;
            let t = std::net::TcpListener::bind(gw)?;
            t.set_nonblocking(true)?;
            Ok((u, t))
        })?
        .map_err(sys(format!("binding the resolver on {gw}")))?;
        let path = net.path.clone();
        let restricted = !policy.allow_domains.is_empty();
        let allow: dns::AllowFn = Arc::new(move |addrs: Vec<(IpAddr, u32)>| {
            let path = path.clone();
            Box::pin(async move {
                let v4: Vec<(Ipv4Addr, u32)> = addrs
                    .into_iter()
                    .filter_map(|(ip, ttl)| match ip {
                        IpAddr::V4(ip) => Some((ip, ttl.clamp(30, 86_400) + 30)),
                        IpAddr::V6(_) => None,
                    })
                    .collect();
                if v4.is_empty() {
                    return Ok(());
                }
                let rules = nft::dns_elements(&v4);
                tokio::task::spawn_blocking(move || {
                    in_netns(&path, || nft::apply(&rules))
                        .map_err(|e| e.to_string())?
                        .map_err(|e| e.to_string())
                })
                .await
                .map_err(|e| e.to_string())?
            })
        });
        let allow: dns::AllowFn = if restricted {
            allow
        } else {
            Arc::new(|_| Box::pin(async { Ok(()) }))
        };
        let denied_log: DeniedLog = Arc::new(Mutex::new((Vec::new(), 0)));
        let sink = denied_log.clone();
        let name = net.name.clone();
        let limiter = Arc::new(Mutex::new(crate::netpolicy::RateLog::default()));
        let denied: dns::DeniedFn = Arc::new(move |qname: &str, _qtype: u16| {
            let mut s = sink.lock().unwrap_or_else(|p| p.into_inner());
            s.1 += 1;
            if !s.0.iter().any(|n| n == qname) {
                if s.0.len() >= 32 {
                    s.0.remove(0);
                }
                s.0.push(qname.to_string());
            }
            let mut l = limiter.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(suppressed) = l.allow() {
                tracing::info!(
                    "sandbox network {name}: refused to resolve {qname:?}{}",
                    if suppressed > 0 {
                        format!(" ({suppressed} similar lines suppressed)")
                    } else {
                        String::new()
                    }
                );
            }
        });
        let resolver = dns::Resolver::new(rules, upstream, allow, denied);
        let (stop, rx) = tokio::sync::watch::channel(false);
        {
            let Some(rt) = &self.rt else {
                return Err(NetError::Config(
                    "the network manager is shutting down".into(),
                ));
            };
            let _g = rt.enter();
            let udp = tokio::net::UdpSocket::from_std(udp).map_err(sys("resolver socket"))?;
            let tcp = tokio::net::TcpListener::from_std(tcp).map_err(sys("resolver socket"))?;
            let (r1, r2) = (resolver.clone(), resolver.clone());
            let (mut rx1, mut rx2) = (rx.clone(), rx);
            rt.spawn(r1.serve_udp(udp, async move {
                let _ = rx1.wait_for(|v| *v).await;
            }));
            rt.spawn(r2.serve_tcp(tcp, async move {
                let _ = rx2.wait_for(|v| *v).await;
            }));
        }
        st.denied_log = Some(denied_log);
        st.resolver = Some((resolver, stop));
        self.apply_edge(net, &mut st, policy, h)
    }

    /// Changes a running sandbox's policy (takes effect on its next connection).
    pub fn update(&self, net: &SandboxNet, policy: &NetworkPolicy) -> Result<(), NetError> {
        let h = self.prepare(policy)?;
        self.apply_policy(net, policy, &h, true)
    }

    /// Counters, samples and refused names.
    pub fn stats(&self, net: &SandboxNet) -> Result<NetStats, NetError> {
        let text = in_netns(&net.path, || {
            nft::run(&["-j", "list", "table", "inet", nft::TABLE], None)
        })??;
        let st = net.state.lock().unwrap_or_else(|p| p.into_inner());
        let (names, total) = st
            .denied_log
            .as_ref()
            .map(|l| l.lock().map(|l| l.clone()).unwrap_or_default())
            .unwrap_or_default();
        Ok(NetStats {
            drops: nft::parse_stats(&text),
            denied_names: names,
            denied_queries: total,
            edge: st.edge.as_ref().map(|(sb, _)| sb.stats()),
        })
    }

    /// Removes everything of `net` (stops its resolver, deletes the namespace — and with it
    /// the veth pair, the TAP and the rules — and frees its slot). Safe to call twice.
    pub fn teardown(&self, net: &SandboxNet) {
        if let Ok(mut st) = net.state.lock() {
            if let Some((_, stop)) = st.edge.take() {
                let _ = stop.send(true);
            }
            if let Some((_, stop)) = st.resolver.take() {
                let _ = stop.send(true);
            }
        }
        if net.path.exists() {
            if let Err(e) = run("ip", &["netns", "del", &net.name], None) {
                tracing::error!("{e}");
            }
        }
        // The host end goes with the namespace's, but the kernel dismantles a namespace
        // asynchronously: remove it now so that nothing of the sandbox outlives this call.
        if link_exists(&net.host_veth) {
            let _ = run("ip", &["link", "del", &net.host_veth], None);
        }
        self.free_slot(net.slot);
    }

    /// The namespace of jail `jail_id`, if one exists (a VM re-attached after a restart);
    /// its policy is applied again (the resolver lived in the old server).
    pub fn adopt(
        &self,
        jail_id: &str,
        policy: &NetworkPolicy,
    ) -> Result<Option<Arc<SandboxNet>>, NetError> {
        let suffix = format!("-{jail_id}");
        let Some(name) = self
            .own_namespaces()
            .into_iter()
            .find(|n| n.ends_with(&suffix))
        else {
            return Ok(None);
        };
        let slot: u32 = name[self.ns_prefix().len()..]
            .split('-')
            .next()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| NetError::Config(format!("namespace {name}: no slot in its name")))?;
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(slot);
        let net = self.sandbox_net(name, slot);
        self.update(&net, policy)?;
        Ok(Some(net))
    }

    /// Namespaces of this runtime's tag.
    pub fn own_namespaces(&self) -> Vec<String> {
        let prefix = self.ns_prefix();
        let mut out: Vec<String> = std::fs::read_dir(NETNS_DIR)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
    }

    /// Deletes every namespace of this runtime that is not in `keep` (left by a crash).
    pub fn reclaim(&self, keep: &BTreeSet<String>) -> usize {
        let mut n = 0;
        for name in self.own_namespaces() {
            if keep.contains(&name) {
                continue;
            }
            match run("ip", &["netns", "del", &name], None) {
                Ok(_) => n += 1,
                Err(e) => tracing::error!("reclaiming {name}: {e}"),
            }
        }
        n
    }

    /// Removes the host-side table (when no sandbox of this runtime runs any more).
    pub fn remove_host_table(&self) {
        let mut h = self.host.lock().unwrap_or_else(|p| p.into_inner());
        if h.take().is_some() || self.table_exists() {
            if let Err(e) = nft::apply(&nft::delete_table(&self.host_table())) {
                tracing::error!("removing table {}: {e}", self.host_table());
            }
        }
    }

    fn table_exists(&self) -> bool {
        nft::run(&["list", "table", "inet", &self.host_table()], None).is_ok()
    }

    /// Number of namespaces in use.
    pub fn in_use(&self) -> usize {
        self.slots.lock().map(|s| s.len()).unwrap_or(0)
    }
}

impl Drop for NetManager {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// A log line limiter: at most 5 lines a minute; the next allowed line says how many were
/// dropped in between.
#[derive(Debug, Default)]
pub struct RateLog {
    window: Option<std::time::Instant>,
    lines: u32,
    suppressed: u64,
}

impl RateLog {
    /// `Some(suppressed before this one)` when a line may be written now.
    pub fn allow(&mut self) -> Option<u64> {
        let now = std::time::Instant::now();
        if self
            .window
            .is_none_or(|w| now.duration_since(w) > Duration::from_secs(60))
        {
            self.window = Some(now);
            self.lines = 0;
        }
        if self.lines < 5 {
            self.lines += 1;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_command_line_parses_in_the_agent() {
        let line = guest_cmdline();
        let value = line.strip_prefix("ember.net=").unwrap();
        let spec: ember_agent::netcfg::NetSpec = value.parse().unwrap();
        assert_eq!(spec.addr, GUEST_ADDR);
        assert_eq!(spec.gateway, GATEWAY);
    }

    #[test]
    fn log_lines_are_rate_limited_with_a_count() {
        let mut l = RateLog::default();
        for _ in 0..5 {
            assert_eq!(l.allow(), Some(0));
        }
        assert_eq!(l.allow(), None);
        assert_eq!(l.allow(), None);
        l.window = Some(std::time::Instant::now() - Duration::from_secs(61));
        assert_eq!(l.allow(), Some(2));
    }

    #[test]
    fn slots_map_to_disjoint_30s() {
        let m = NetManager::new(Path::new("/tmp/x"), NetOptions::default()).unwrap();
        assert_eq!(m.tag().len(), 4);
        let (h0, n0) = m.slot_addrs(0);
        let (h1, _) = m.slot_addrs(1);
        assert_eq!(h0.to_string(), "10.199.0.1");
        assert_eq!(n0.to_string(), "10.199.0.2");
        assert_eq!(h1.to_string(), "10.199.0.5");
        let a = m.alloc_slot().unwrap();
        let b = m.alloc_slot().unwrap();
        assert_ne!(a, b);
        m.free_slot(a);
        assert_eq!(m.alloc_slot().unwrap(), a);
        // Host-side names fit IFNAMSIZ.
        assert!(format!("vh{}{:x}", m.tag(), (1u32 << 14) - 1).len() <= 15);
    }
}
