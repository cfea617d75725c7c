//! What a sandbox may reach: the policy callers set (at create, and changed at run time) and
//! its validation. Enforcement is in [`super::nft`] (rules) and [`super::dns`] (names).

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
}
