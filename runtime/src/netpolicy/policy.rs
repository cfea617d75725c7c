//! What a sandbox may reach: the policy callers set (at create, and changed at run time) and
//! its validation. Enforcement is in [`super::nft`] (rules) and [`super::dns`] (names).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Destinations no sandbox reaches unless an `allow_cidrs` entry names them: link-local
/// (the cloud metadata service 169.254.169.254 among them), loopback, "this network",
/// RFC 1918, shared address space (100.64.0.0/10), IETF protocol assignments, the
/// documentation ranges are *not* here (tests use them as "the internet"), benchmarking
/// (198.18.0.0/15), multicast and reserved space. The host's own addresses are added at run
/// time; IPv6 is blocked as a whole (the guests have IPv4 only), fc00::/7 and fe80::/10
/// included.
pub const DEFAULT_DENY: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// How much of the network a sandbox has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NetMode {
    /// No route out: nothing is reachable, the host included. Exposed ports still work
    /// (inbound from the caller through `ember serve`).
    #[default]
    None,
    /// NAT to the uplink, with the always-on deny list and the policy's own lists.
    Egress,
}

/// A sandbox's network policy.
///
/// For a new connection from the guest, in this order: a destination in `allow_cidrs` is
/// allowed (this is the only way past the always-on deny list); one in `deny_cidrs` or the
/// deny list is dropped; with `allow_domains` set, only addresses that the sandbox's resolver
/// returned for an allowed name (for the record's TTL) pass; otherwise the rest of the
/// internet does.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkPolicy {
    /// `none` (default) or `egress`.
    #[serde(default)]
    pub mode: NetMode,
    /// IPv4 CIDRs (or addresses) always reachable, even inside the deny list.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_cidrs: Vec<String>,
    /// IPv4 CIDRs never reachable (on top of the deny list).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny_cidrs: Vec<String>,
    /// Names the sandbox may resolve and reach (`example.com`, `*.example.com` for any
    /// subdomain). When set, nothing else is reachable but `allow_cidrs`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_domains: Vec<String>,
    /// Bandwidth cap in KiB/s, each direction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_kib: Option<u64>,
    /// Most concurrent connections out of the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
    /// Per-host request rules, applied by the host-side egress proxy to HTTP and HTTPS
    /// requests to these exact host names (see docs/network.md): headers added or replaced,
    /// with `${secrets.NAME}` placeholders resolved from the secrets store at request time.
    /// Needs mode `egress`; with `allow_domains` set, each host must be allowed there too.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rules: BTreeMap<String, Vec<HostRule>>,
    /// A SOCKS5 proxy (no authentication) that every TCP connection the policy admits is
    /// tunnelled through, from the host side (E2B's `egress_proxy`); the egress proxy's own
    /// upstream connections too. Needs mode `egress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy: Option<EgressProxy>,
}

/// A SOCKS5 proxy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EgressProxy {
    /// `IPv4:PORT`. The address is checked against the deny list like any destination
    /// (`allow_cidrs` to reach a private one).
    pub address: String,
}

impl EgressProxy {
    /// The parsed address.
    pub fn socket_addr(&self) -> Result<std::net::SocketAddrV4, String> {
        self.address
            .parse()
            .map_err(|_| format!("egress_proxy: address {:?} is not IPv4:PORT", self.address))
    }
}

/// One rule of a host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HostRule {
    /// What is changed in each request.
    #[serde(default)]
    pub transform: Transform,
}

/// A request transform.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Transform {
    /// Headers set on the request (replacing any the guest sent), values with
    /// `${secrets.NAME}` placeholders.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

/// Most hosts with rules.
pub const MAX_RULE_HOSTS: usize = 32;
/// Most headers a host's rules set.
pub const MAX_RULE_HEADERS: usize = 16;

impl NetworkPolicy {
    /// The headers the rules of `host` set (lower-case host, no trailing dot), in rule order.
    pub fn rule_headers(&self, host: &str) -> Option<Vec<(String, String)>> {
        let rules = self.rules.get(host)?;
        Some(
            rules
                .iter()
                .flat_map(|r| r.transform.headers.iter())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        )
    }

    /// Every secret name the rules refer to.
    pub fn rule_secrets(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .rules
            .values()
            .flatten()
            .flat_map(|r| r.transform.headers.values())
            .filter_map(|v| crate::secrets::placeholders(v).ok())
            .flatten()
            .collect();
        out.sort();
        out.dedup();
        out
    }

    fn validate_rules(&self) -> Result<(), String> {
        if let Some(p) = &self.egress_proxy {
            let a = p.socket_addr()?;
            if self.mode != NetMode::Egress {
                return Err("egress_proxy needs mode \"egress\"".into());
            }
            if a.port() == 0 {
                return Err("egress_proxy: port 0".into());
            }
        }
        if self.rules.is_empty() {
            return Ok(());
        }
        if self.mode != NetMode::Egress {
            return Err("rules need mode \"egress\"".into());
        }
        if self.rules.len() > MAX_RULE_HOSTS {
            return Err(format!("rules: at most {MAX_RULE_HOSTS} hosts"));
        }
        let allowed = super::dns::DomainRules::new(&self.allow_domains)
            .map_err(|e| format!("allow_domains: {e}"))?;
        for (host, rules) in &self.rules {
            if host.contains('*') || host.ends_with('.') || host != &host.to_ascii_lowercase() {
                return Err(format!(
                    "rules: host {host:?} must be an exact lower-case name (no wildcard, no \
                     trailing dot)"
                ));
            }
            super::dns::DomainRules::new(std::slice::from_ref(host))
                .map_err(|e| format!("rules: host {host:?}: {e}"))?;
            if host.parse::<Ipv4Addr>().is_ok() {
                return Err(format!(
                    "rules: host {host:?} is an address; rules name hosts (the proxy \
                     intercepts by name)"
                ));
            }
            if !self.allow_domains.is_empty() && !allowed.allows(host) {
                return Err(format!(
                    "rules: host {host:?} is not allowed by allow_domains (a rule host must be \
                     allowed too)"
                ));
            }
            let n: usize = rules.iter().map(|r| r.transform.headers.len()).sum();
            if n > MAX_RULE_HEADERS {
                return Err(format!(
                    "rules: host {host:?}: at most {MAX_RULE_HEADERS} headers"
                ));
            }
            for (name, value) in rules.iter().flat_map(|r| r.transform.headers.iter()) {
                let token = !name.is_empty()
                    && name.len() <= 128
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
                if !token {
                    return Err(format!(
                        "rules: host {host:?}: {name:?} is not a header name"
                    ));
                }
                if ["host", "content-length", "transfer-encoding", "connection"]
                    .contains(&name.to_ascii_lowercase().as_str())
                {
                    return Err(format!(
                        "rules: host {host:?}: header {name:?} cannot be set by a rule"
                    ));
                }
                if value.len() > 8192 || value.chars().any(|c| c.is_control()) {
                    return Err(format!(
                        "rules: host {host:?}: header {name:?}: the value is too long or has \
                         a control character"
                    ));
                }
                crate::secrets::placeholders(value)
                    .map_err(|e| format!("rules: host {host:?}: header {name:?}: {e}"))?;
            }
        }
        Ok(())
    }
}

/// An IPv4 prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr4 {
    /// Network address (host bits cleared).
    pub addr: Ipv4Addr,
    /// Prefix length.
    pub len: u8,
}

impl Cidr4 {
    /// Parses `a.b.c.d/len` or a bare address (/32). Host bits must be clear.
    pub fn parse(s: &str) -> Result<Cidr4, String> {
        let (a, l) = s.split_once('/').unwrap_or((s, "32"));
        if a.contains(':') {
            return Err(format!(
                "{s:?}: IPv6 is blocked as a whole (sandboxes have IPv4 only)"
            ));
        }
        let addr: Ipv4Addr = a
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not an IPv4 address or CIDR"))?;
        let len: u8 = l
            .trim()
            .parse()
            .ok()
            .filter(|l| *l <= 32)
            .ok_or_else(|| format!("{s:?}: prefix length must be 0 to 32"))?;
        let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
        if u32::from(addr) & !mask != 0 {
            return Err(format!(
                "{s:?} has host bits set (did you mean {}/{len}?)",
                Ipv4Addr::from(u32::from(addr) & mask)
            ));
        }
        Ok(Cidr4 { addr, len })
    }

    /// Whether `ip` is inside.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        let mask = if self.len == 0 {
            0
        } else {
            u32::MAX << (32 - self.len)
        };
        u32::from(ip) & mask == u32::from(self.addr)
    }
}

impl std::fmt::Display for Cidr4 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// Most entries in each list.
pub const MAX_LIST: usize = 256;

impl NetworkPolicy {
    /// Checks every field; the error names the bad entry.
    pub fn validate(&self) -> Result<(), String> {
        for (what, list) in [
            ("allow_cidrs", &self.allow_cidrs),
            ("deny_cidrs", &self.deny_cidrs),
        ] {
            if list.len() > MAX_LIST {
                return Err(format!("{what}: at most {MAX_LIST} entries"));
            }
            for c in list {
                Cidr4::parse(c).map_err(|e| format!("{what}: {e}"))?;
            }
        }
        if self.allow_domains.len() > MAX_LIST {
            return Err(format!("allow_domains: at most {MAX_LIST} entries"));
        }
        super::dns::DomainRules::new(&self.allow_domains)
            .map_err(|e| format!("allow_domains: {e}"))?;
        if self.bandwidth_kib == Some(0) {
            return Err("bandwidth_kib must be at least 1".into());
        }
        if self.max_connections == Some(0) {
            return Err("max_connections must be at least 1".into());
        }
        self.validate_rules()?;
        if self.mode == NetMode::None
            && (!self.allow_cidrs.is_empty() || !self.allow_domains.is_empty())
        {
            return Err(
                "allow_cidrs and allow_domains need mode \"egress\" (mode \"none\" reaches \
                 nothing)"
                    .into(),
            );
        }
        Ok(())
    }

    /// The parsed CIDR lists (call [`NetworkPolicy::validate`] first; bad entries are
    /// skipped here).
    pub fn cidrs(list: &[String]) -> Vec<Cidr4> {
        list.iter().filter_map(|c| Cidr4::parse(c).ok()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_strictly() {
        let c = Cidr4::parse("10.1.0.0/16").unwrap();
        assert!(c.contains("10.1.2.3".parse().unwrap()));
        assert!(!c.contains("10.2.0.1".parse().unwrap()));
        assert_eq!(Cidr4::parse("1.2.3.4").unwrap().len, 32);
        assert!(Cidr4::parse("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
        for bad in [
            "10.1.0.1/16",
            "10.0.0.0/33",
            "x",
            "fd00::/8",
            "1.2.3/24",
            "",
        ] {
            assert!(Cidr4::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Cidr4::parse("10.1.0.1/16")
            .unwrap_err()
            .contains("10.1.0.0/16"));
        for d in DEFAULT_DENY {
            Cidr4::parse(d).unwrap();
        }
    }

    #[test]
    fn policies_validate_and_name_the_bad_entry() {
        let ok = NetworkPolicy {
            mode: NetMode::Egress,
            allow_cidrs: vec!["192.168.5.0/24".into()],
            allow_domains: vec!["*.example.com".into()],
            ..Default::default()
        };
        ok.validate().unwrap();
        let mut bad = ok.clone();
        bad.deny_cidrs = vec!["300.0.0.0/8".into()];
        assert!(bad.validate().unwrap_err().contains("deny_cidrs"));
        let mut bad = ok.clone();
        bad.mode = NetMode::None;
        assert!(bad.validate().unwrap_err().contains("egress"));
        let mut bad = ok.clone();
        bad.max_connections = Some(0);
        assert!(bad.validate().is_err());
        // The wire form: unknown fields are refused, the mode defaults to none.
        let p: NetworkPolicy = serde_json::from_str("{}").unwrap();
        assert_eq!(p.mode, NetMode::None);
        assert!(serde_json::from_str::<NetworkPolicy>(r#"{"mode":"host"}"#).is_err());
        assert!(serde_json::from_str::<NetworkPolicy>(r#"{"allow":[]}"#).is_err());
    }

    #[test]
    fn rules_validate_and_name_the_bad_entry() {
        let p: NetworkPolicy = serde_json::from_str(
            r#"{"mode":"egress","allow_domains":["api.example.com"],
                "rules":{"api.example.com":[{"transform":{"headers":
                    {"Authorization":"Bearer ${secrets.openai}"}}}]}}"#,
        )
        .unwrap();
        p.validate().unwrap();
        assert_eq!(p.rule_secrets(), ["openai"]);
        assert_eq!(
            p.rule_headers("api.example.com").unwrap(),
            [(
                "Authorization".to_string(),
                "Bearer ${secrets.openai}".to_string()
            )]
        );
        let bad = |edit: &dyn Fn(&mut NetworkPolicy), want: &str| {
            let mut q = p.clone();
            edit(&mut q);
            let e = q.validate().unwrap_err();
            assert!(e.contains(want), "{e} lacks {want}");
        };
        bad(&|q| q.mode = NetMode::None, "egress");
        bad(
            &|q| q.allow_domains = vec!["other.com".into()],
            "allow_domains",
        );
        bad(
            &|q| {
                let r = q.rules.remove("api.example.com").unwrap();
                q.rules.insert("*.example.com".into(), r);
            },
            "exact",
        );
        bad(
            &|q| {
                q.rules.get_mut("api.example.com").unwrap()[0]
                    .transform
                    .headers
                    .insert("X-Key".into(), "${env.HOME}".into());
            },
            "X-Key",
        );
        bad(
            &|q| {
                q.rules.get_mut("api.example.com").unwrap()[0]
                    .transform
                    .headers
                    .insert("Bad Name".into(), "x".into());
            },
            "header name",
        );
    }
}
