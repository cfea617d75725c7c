//! The runtime's side of sandbox networking: a namespace per running VM (set up before its
//! VMM starts, torn down after it exits), policy changes at run time, exposed ports, and the
//! audit records of refused connections. The mechanics are in [`crate::netpolicy`].

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::types::{ExposedPort, NetMode, NetworkPolicy, SandboxNetwork, State};
use super::{lock, Runtime, RuntimeError};
use crate::netpolicy::{NetError, NetStats, SandboxNet};

/// Most exposed ports per sandbox.
pub const MAX_PORTS: usize = 32;

/// A sandbox's network as `GET /sandboxes/{id}/network` shows it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct NetworkInfo {
    /// Policy and exposed ports.
    #[serde(flatten)]
    pub network: SandboxNetwork,
    /// Whether the sandbox has a network device (templates built with `[vm] network`).
    pub has_device: bool,
    /// Counters while it runs.
    pub stats: Option<NetStats>,
}

impl Runtime {
    /// The namespace for a VM restored from `dir`, if its snapshot has a network device.
    pub(super) fn setup_net(
        &self,
        dir: &Path,
        jail_id: &str,
        uid: u32,
        policy: &NetworkPolicy,
    ) -> Result<Option<Arc<SandboxNet>>, RuntimeError> {
        let has = crate::jail::snapshot_has_net(dir)
            .map_err(|e| RuntimeError::Internal(e.to_string()))?;
        self.setup_net_with(has, jail_id, uid, policy)
    }

    /// [`Runtime::setup_net`] for a VM that has (`has`) or lacks a network device.
    pub(super) fn setup_net_with(
        &self,
        has: bool,
        jail_id: &str,
        uid: u32,
        policy: &NetworkPolicy,
    ) -> Result<Option<Arc<SandboxNet>>, RuntimeError> {
        if !has {
            if policy.mode != NetMode::None {
                return Err(RuntimeError::Invalid(format!(
                    "network mode {:?} needs a template with a network device; this one has \
                     none (rebuild it: templates get one unless their recipe says `[vm] network \
                     = false`)",
                    policy.mode,
                )));
            }
            return Ok(None);
        }
        self.inner
            .net
            .setup(jail_id, uid, policy)
            .map(Some)
            .map_err(|e| match e {
                // The caller asked for something this host cannot give.
                NetError::NoUplink | NetError::Config(_) => RuntimeError::Invalid(e.to_string()),
                NetError::PoolExhausted(_) => RuntimeError::Capacity(e.to_string()),
                e => RuntimeError::Internal(e.to_string()),
            })
    }

    /// Writes the CA bundle of the egress proxy (the host's system roots and the proxy's CA)
    /// into sandbox `id` at [`crate::netpolicy::edge::GUEST_CA_BUNDLE`], where the variables
    /// set at create point TLS clients.
    pub(super) fn install_edge_ca(&self, id: &str) -> Result<(), RuntimeError> {
        let shared = self
            .inner
            .net
            .edge_shared()
            .map_err(|e| RuntimeError::Internal(e.to_string()))?;
        let mut bundle = crate::netpolicy::edge::system_bundle()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default();
        if !bundle.is_empty() && !bundle.ends_with('\n') {
            bundle.push('\n');
        }
        bundle.push_str(&shared.ca.cert_pem);
        self.write_file(
            id,
            crate::netpolicy::edge::GUEST_CA_BUNDLE,
            &mut bundle.as_bytes(),
        )?;
        Ok(())
    }

    /// Writes an audit record of the connections a sandbox had refused (before its
    /// namespace goes).
    pub(super) fn audit_net_drops(&self, id: &str, net: &SandboxNet) {
        let Ok(stats) = self.inner.net.stats(net) else {
            return;
        };
        let edge_failed = stats
            .edge
            .as_ref()
            .map_or(0, |e| e.failed + e.refused_connections);
        if stats.drops.dropped == 0 && stats.denied_queries == 0 && edge_failed == 0 {
            return;
        }
        let mut args = serde_json::json!({
            "dropped": stats.drops.dropped,
            "sample": stats.drops.dropped_destinations.iter().take(16).collect::<Vec<_>>(),
            "denied_queries": stats.denied_queries,
            "denied_names": stats.denied_names.iter().take(16).collect::<Vec<_>>(),
        });
        if let Some(e) = &stats.edge {
            // Which host and why: never a secret's value (none is in a reason).
            args["edge_failed"] = serde_json::json!(e.failed);
            args["edge_refused_connections"] = serde_json::json!(e.refused_connections);
            args["edge_failures"] = serde_json::json!(e.failures);
        }
        self.record(
            crate::store::now_ms(),
            Some(id),
            "network_refused",
            &args,
            0.0,
            &Ok::<(), RuntimeError>(()),
            (0, 0),
        );
    }

    /// A sandbox's network policy, exposed ports and (while it runs) counters.
    pub fn network(&self, id: &str) -> Result<NetworkInfo, RuntimeError> {
        let slot = self.slot(id)?;
        let st = lock(&slot.st);
        let net = st.vm.as_ref().and_then(|v| v.net.clone());
        let network = st.row.network.clone();
        let running = st.row.state == State::Running;
        drop(st);
        let stats = match (&net, running) {
            (Some(n), true) => self.inner.net.stats(n).ok(),
            _ => None,
        };
        Ok(NetworkInfo {
            network,
            has_device: net.is_some() || !running,
            stats,
        })
    }

    /// Changes a sandbox's policy. A running sandbox gets it at once (its next connection;
    /// established ones continue); a paused one when it resumes.
    pub fn set_network(
        &self,
        id: &str,
        policy: &NetworkPolicy,
    ) -> Result<NetworkInfo, RuntimeError> {
        policy
            .validate()
            .map_err(|e| RuntimeError::Invalid(format!("network: {e}")))?;
        self.timed(
            Some(id),
            "set_network",
            serde_json::to_value(policy).unwrap_or_default(),
            || {
                let slot = self.slot(id)?;
                let mut st = lock(&slot.st);
                if st.row.state.is_final() {
                    return Err(RuntimeError::conflict(
                        id,
                        st.row.state,
                        "it has ended".to_string(),
                    ));
                }
                if let Some(vm) = st.vm.clone() {
                    match &vm.net {
                        Some(net) => {
                            self.audit_net_drops(id, net);
                            self.inner
                                .net
                                .update(net, policy)
                                .map_err(|e| RuntimeError::Invalid(e.to_string()))?;
                        }
                        None if policy.mode != NetMode::None => {
                            return Err(RuntimeError::Invalid(format!(
                                "sandbox {id} has no network device (its template was built \
                                 without one)"
                            )))
                        }
                        None => {}
                    }
                }
                st.row.network.policy = policy.clone();
                if let Err(e) = self.store().update_sandbox(&st.row) {
                    tracing::error!("sandbox {id}: cannot record its network policy: {e}");
                }
                drop(st);
                self.network(id)
            },
        )
    }

    /// Makes guest TCP `port` reachable through the server (`public`: without a token).
    pub fn expose(&self, id: &str, port: u16, public: bool) -> Result<NetworkInfo, RuntimeError> {
        if port == 0 {
            return Err(RuntimeError::Invalid("port must be 1 to 65535".into()));
        }
        self.timed(
            Some(id),
            "expose",
            serde_json::json!({"port": port, "public": public}),
            || {
                let slot = self.slot(id)?;
                let mut st = lock(&slot.st);
                let ports = &mut st.row.network.ports;
                ports.retain(|p| p.port != port);
                if ports.len() >= MAX_PORTS {
                    return Err(RuntimeError::Invalid(format!(
                        "at most {MAX_PORTS} exposed ports per sandbox"
                    )));
                }
                ports.push(ExposedPort { port, public });
                ports.sort_by_key(|p| p.port);
                if let Err(e) = self.store().update_sandbox(&st.row) {
                    tracing::error!("sandbox {id}: cannot record its ports: {e}");
                }
                drop(st);
                self.network(id)
            },
        )
    }

    /// Closes an exposed port.
    pub fn unexpose(&self, id: &str, port: u16) -> Result<NetworkInfo, RuntimeError> {
        self.timed(
            Some(id),
            "unexpose",
            serde_json::json!({ "port": port }),
            || {
                let slot = self.slot(id)?;
                let mut st = lock(&slot.st);
                let before = st.row.network.ports.len();
                st.row.network.ports.retain(|p| p.port != port);
                if st.row.network.ports.len() == before {
                    return Err(RuntimeError::NotFound(format!("{id} port {port}")));
                }
                if let Err(e) = self.store().update_sandbox(&st.row) {
                    tracing::error!("sandbox {id}: cannot record its ports: {e}");
                }
                drop(st);
                self.network(id)
            },
        )
    }

    /// The exposed port `port` of `id`, if it is exposed (listed, or every port is).
    pub fn exposed(&self, id: &str, port: u16) -> Result<Option<ExposedPort>, RuntimeError> {
        let slot = self.slot(id)?;
        let st = lock(&slot.st);
        let net = &st.row.network;
        Ok(net
            .ports
            .iter()
            .find(|p| p.port == port)
            .cloned()
            .or(net.all_ports.map(|a| ExposedPort {
                port,
                public: a.public,
            })))
    }

    /// Opens a TCP connection to the guest's `port` from inside the sandbox's namespace
    /// (resuming a paused sandbox). `require_exposed`: refuse ports not exposed.
    pub fn connect_port(
        &self,
        id: &str,
        port: u16,
        require_exposed: bool,
    ) -> Result<std::net::TcpStream, RuntimeError> {
        if require_exposed && self.exposed(id, port)?.is_none() {
            return Err(RuntimeError::NotFound(format!(
                "port {port} of sandbox {id} is not exposed (expose it first)"
            )));
        }
        let (vm, _guard) = self.acquire(id)?;
        let Some(net) = vm.net.clone() else {
            return Err(RuntimeError::Invalid(format!(
                "sandbox {id} has no network device (its template was built without one)"
            )));
        };
        net.connect(port, Duration::from_secs(5))
            .map_err(|e| RuntimeError::Unreachable(format!("sandbox {id}: {e}")))
    }
}
