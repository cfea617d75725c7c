//! nftables rules, rendered as `nft -j` JSON and applied with the `nft` binary (Debian's
//! `nftables` package) in one transaction each.
//!
//! Two tables:
//! - **in each sandbox's namespace**, `inet ember`: what the sandbox may reach ([`sandbox`]).
//!   The guest cannot touch it (it only has its virtio-net device); a policy change
//!   re-renders it atomically (chains flushed and refilled, static sets replaced, in one
//!   transaction; the set of resolved addresses survives).
//! - **on the host side**, `inet ember_<tag>` (one per runtime home): sandboxes' veths
//!   forward only to the uplink, never to each other, never to the host's own addresses, and
//!   are masqueraded there ([`host`]). Defence in depth: a mistake in one table is caught by
//!   the other.

use std::net::Ipv4Addr;

use serde_json::{json, Value};

use super::policy::{Cidr4, NetMode, NetworkPolicy, DEFAULT_DENY};

/// The sandbox-side table.
pub const TABLE: &str = "ember";
/// The TAP the VMM uses, in the sandbox's namespace.
pub const TAP: &str = "tap0";
/// The sandbox namespace's end of its veth pair.
pub const VETH: &str = "veth0";

/// What the sandbox's rules need to know besides the policy.
#[derive(Debug, Clone)]
pub struct SandboxSide {
    /// The guest's gateway (the TAP's address; the resolver listens there).
    pub gateway: Ipv4Addr,
    /// The host's own addresses (denied like the deny list).
    pub host_addrs: Vec<Ipv4Addr>,
    /// The address pool of the host-side veths (other sandboxes live there).
    pub pool: Cidr4,
}

fn m(left: Value, right: Value) -> Value {
    json!({"match": {"op": "==", "left": left, "right": right}})
}

fn ne(left: Value, right: Value) -> Value {
    json!({"match": {"op": "!=", "left": left, "right": right}})
}

fn meta(key: &str) -> Value {
    json!({"meta": {"key": key}})
}

fn daddr() -> Value {
    json!({"payload": {"protocol": "ip", "field": "daddr"}})
}

fn ct_established() -> Value {
    json!({"match": {"op": "in", "left": {"ct": {"key": "state"}},
                     "right": ["established", "related"]}})
}

fn prefix(c: &Cidr4) -> Value {
    if c.len == 32 {
        json!(c.addr.to_string())
    } else {
        json!({"prefix": {"addr": c.addr.to_string(), "len": c.len}})
    }
}

/// Drops prefixes contained in another one of the list (interval sets refuse overlaps).
pub fn normalize(mut list: Vec<Cidr4>) -> Vec<Cidr4> {
    list.sort_by_key(|c| (c.len, u32::from(c.addr)));
    let mut out: Vec<Cidr4> = Vec::new();
    for c in list {
        if !out.iter().any(|o| o.contains(c.addr) && o.len <= c.len) {
            out.push(c);
        }
    }
    out.sort_by_key(|c| u32::from(c.addr));
    out
}

struct Table<'a> {
    family: &'a str,
    name: &'a str,
    cmds: Vec<Value>,
}

impl Table<'_> {
    fn t(&self) -> Value {
        json!({"family": self.family, "name": self.name})
    }
    fn add(&mut self, what: &str, mut obj: Value) {
        obj["family"] = json!(self.family);
        obj["table"] = json!(self.name);
        self.cmds.push(json!({"add": {what: obj}}));
    }
    fn flush(&mut self, what: &str, name: &str) {
        self.cmds.push(json!({"flush": {what: {
            "family": self.family, "table": self.name, "name": name}}}));
    }
    fn chain(&mut self, name: &str, hook: Option<(&str, &str, i32, &str)>) {
        let mut c = json!({"name": name});
        if let Some((ty, hook, prio, policy)) = hook {
            c["type"] = json!(ty);
            c["hook"] = json!(hook);
            c["prio"] = json!(prio);
            c["policy"] = json!(policy);
        }
        self.add("chain", c);
    }
    fn rule(&mut self, chain: &str, expr: Vec<Value>) {
        self.add("rule", json!({"chain": chain, "expr": expr}));
    }
    fn elements(&mut self, set: &str, elems: Vec<Value>) {
        if !elems.is_empty() {
            self.add("element", json!({"name": set, "elem": elems}));
        }
    }
    fn done(self) -> Value {
        json!({"nftables": self.cmds})
    }
}

/// The sandbox namespace's table for `policy`: created (`initial`), or re-rendered after a
/// policy change (chains and static sets; resolved addresses in `dns4`, the counters and the
/// samples are kept).
pub fn sandbox(policy: &NetworkPolicy, side: &SandboxSide, initial: bool) -> Value {
    let mut t = Table {
        family: "inet",
        name: TABLE,
        cmds: Vec::new(),
    };
    // Created once: adding a set that the packet path has made dynamic (`update @dropped4`)
    // again fails with "File exists".
    if initial {
        t.cmds.push(json!({"add": {"table": t.t()}}));
        t.add("counter", json!({"name": "dropped"}));
        t.add("counter", json!({"name": "accepted"}));
        t.add(
            "set",
            json!({"name": "dns4", "type": "ipv4_addr", "flags": ["timeout"]}),
        );
        t.add(
            "set",
            json!({"name": "dropped4", "type": "ipv4_addr", "flags": ["timeout"],
                   "timeout": 600, "size": 256}),
        );
        t.chain("input", Some(("filter", "input", 0, "drop")));
        t.chain("forward", Some(("filter", "forward", 0, "drop")));
        t.chain("postrouting", Some(("nat", "postrouting", 100, "accept")));
        t.chain("denied", None);
        t.chain("admit", None);
    }
    // The egress proxy's interception (added on every render: namespaces made before it
    // existed get it at their next policy change; adding what exists is a no-op).
    t.add(
        "set",
        json!({"name": "edge4", "type": "ipv4_addr", "flags": ["timeout"]}),
    );
    t.chain("prerouting", Some(("nat", "prerouting", -100, "accept")));
    for c in [
        "input",
        "forward",
        "postrouting",
        "denied",
        "admit",
        "prerouting",
    ] {
        t.flush("chain", c);
    }
    // The static sets are replaced rather than flushed and refilled: the kernel refuses an
    // interval that was deleted and added again in one transaction ("File exists"). Their
    // rules were flushed above, so nothing refers to them at the delete.
    for name in ["allow4", "deny4"] {
        let set = json!({"name": name, "type": "ipv4_addr", "flags": ["interval"]});
        t.add("set", set.clone());
        t.cmds.push(json!({"delete": {"set": {
            "family": "inet", "table": TABLE, "name": name}}}));
        t.add("set", set);
    }

    let allow = normalize(NetworkPolicy::cidrs(&policy.allow_cidrs));
    let mut deny: Vec<Cidr4> = DEFAULT_DENY
        .iter()
        .filter_map(|d| Cidr4::parse(d).ok())
        .collect();
    deny.extend(NetworkPolicy::cidrs(&policy.deny_cidrs));
    deny.extend(side.host_addrs.iter().map(|a| Cidr4 { addr: *a, len: 32 }));
    deny.push(side.pool);
    let deny = normalize(deny);
    t.elements("allow4", allow.iter().map(prefix).collect());
    t.elements("deny4", deny.iter().map(prefix).collect());

    // Refused: counted, sampled (destination, kept 10 minutes), and refused loudly so that
    // the guest's connect fails at once instead of timing out.
    t.rule("denied", vec![json!({"counter": "dropped"})]);
    t.rule(
        "denied",
        vec![
            m(meta("nfproto"), json!("ipv4")),
            json!({"set": {"op": "update", "elem": daddr(), "set": "@dropped4"}}),
        ],
    );
    t.rule(
        "denied",
        vec![
            m(meta("l4proto"), json!("tcp")),
            json!({"reject": {"type": "tcp reset"}}),
        ],
    );
    t.rule(
        "denied",
        vec![json!({"reject": {"type": "icmpx", "expr": "admin-prohibited"}})],
    );

    // New connections that passed the policy: the limits, then accepted.
    if let Some(n) = policy.max_connections {
        t.rule(
            "admit",
            vec![
                json!({"ct count": {"val": n, "inv": true}}),
                json!({"goto": {"target": "denied"}}),
            ],
        );
    }
    t.rule(
        "admit",
        vec![json!({"counter": "accepted"}), json!({"accept": null})],
    );

    let tap = || meta("iifname");
    // Input: replies, loopback, and the resolver (egress only). Anything else the guest
    // sends to the namespace itself is refused and counted; the uplink side only gets replies.
    t.rule("input", vec![ct_established(), json!({"accept": null})]);
    t.rule(
        "input",
        vec![m(meta("iifname"), json!("lo")), json!({"accept": null})],
    );
    if policy.mode == NetMode::Egress {
        for proto in ["udp", "tcp"] {
            t.rule(
                "input",
                vec![
                    m(tap(), json!(TAP)),
                    m(daddr(), json!(side.gateway.to_string())),
                    m(
                        json!({"payload": {"protocol": proto, "field": "dport"}}),
                        json!(53),
                    ),
                    json!({"accept": null}),
                ],
            );
        }
    }
    if policy.mode == NetMode::Egress && !policy.rules.is_empty() {
        // The guest's HTTP(S) to addresses of rule hosts goes to the egress proxy, which
        // listens on the gateway address (super::edge).
        for (from, to) in [(443, super::edge::TLS_PORT), (80, super::edge::HTTP_PORT)] {
            t.rule(
                "prerouting",
                vec![
                    m(tap(), json!(TAP)),
                    m(daddr(), json!("@edge4")),
                    m(
                        json!({"payload": {"protocol": "tcp", "field": "dport"}}),
                        json!(from),
                    ),
                    json!({"dnat": {"family": "ip", "addr": side.gateway.to_string(),
                                     "port": to}}),
                ],
            );
            t.rule(
                "input",
                vec![
                    m(tap(), json!(TAP)),
                    m(daddr(), json!(side.gateway.to_string())),
                    m(
                        json!({"payload": {"protocol": "tcp", "field": "dport"}}),
                        json!(to),
                    ),
                    json!({"accept": null}),
                ],
            );
        }
    }
    if policy.mode == NetMode::Egress && policy.egress_proxy.is_some() {
        // Every other TCP connection the forward chain would admit goes to the SOCKS5 relay
        // instead (the same order: allow4, deny4, then dns4 when names are listed); what it
        // would refuse is not redirected, and the forward chain refuses it as before.
        let tcp_new = || {
            vec![
                m(tap(), json!(TAP)),
                m(meta("l4proto"), json!("tcp")),
                ne(daddr(), json!(side.gateway.to_string())),
            ]
        };
        let relay = || {
            json!({"dnat": {"family": "ip", "addr": side.gateway.to_string(),
                             "port": super::edge::SOCKS_RELAY_PORT}})
        };
        let mut r = tcp_new();
        r.push(m(daddr(), json!("@allow4")));
        r.push(relay());
        t.rule("prerouting", r);
        let mut r = tcp_new();
        r.push(m(daddr(), json!("@deny4")));
        r.push(json!({"return": null}));
        t.rule("prerouting", r);
        let mut r = tcp_new();
        if !policy.allow_domains.is_empty() {
            r.push(m(daddr(), json!("@dns4")));
        }
        r.push(relay());
        t.rule("prerouting", r);
        t.rule(
            "input",
            vec![
                m(tap(), json!(TAP)),
                m(daddr(), json!(side.gateway.to_string())),
                m(
                    json!({"payload": {"protocol": "tcp", "field": "dport"}}),
                    json!(super::edge::SOCKS_RELAY_PORT),
                ),
                json!({"accept": null}),
            ],
        );
    }
    t.rule(
        "input",
        vec![m(tap(), json!(TAP)), json!({"jump": {"target": "denied"}})],
    );

    // Forward.
    if let Some(kib) = policy.bandwidth_kib {
        for dir in ["iifname", "oifname"] {
            t.rule(
                "forward",
                vec![
                    m(meta(dir), json!(TAP)),
                    json!({"limit": {"rate": kib, "rate_unit": "kbytes", "per": "second",
                                     "inv": true}}),
                    json!({"drop": null}),
                ],
            );
        }
    }
    t.rule("forward", vec![ct_established(), json!({"accept": null})]);
    t.rule(
        "forward",
        vec![ne(tap(), json!(TAP)), json!({"drop": null})],
    );
    let to_denied = || json!({"goto": {"target": "denied"}});
    t.rule(
        "forward",
        vec![m(meta("nfproto"), json!("ipv6")), to_denied()],
    );
    if policy.mode == NetMode::None {
        t.rule("forward", vec![to_denied()]);
    } else {
        t.rule(
            "forward",
            vec![ne(meta("oifname"), json!(VETH)), to_denied()],
        );
        t.rule(
            "forward",
            vec![
                m(daddr(), json!("@allow4")),
                json!({"goto": {"target": "admit"}}),
            ],
        );
        t.rule("forward", vec![m(daddr(), json!("@deny4")), to_denied()]);
        if !policy.allow_domains.is_empty() {
            t.rule(
                "forward",
                vec![
                    m(daddr(), json!("@dns4")),
                    json!({"goto": {"target": "admit"}}),
                ],
            );
            t.rule("forward", vec![to_denied()]);
        }
        t.rule("forward", vec![json!({"goto": {"target": "admit"}})]);
    }
    t.rule(
        "postrouting",
        vec![m(meta("oifname"), json!(VETH)), json!({"masquerade": null})],
    );
    t.done()
}

/// Adds resolved addresses to the sandbox's `dns4` set, each for `ttl` seconds from now —
/// also an address already there: adding an existing element leaves its old expiry, so a
/// client that resolved the name again (and caches the new answer) would be refused once the
/// first answer's time ran out (seen with Chromium, which re-resolves after a minute). One
/// transaction: add (so that the delete finds every element), delete, add again with the
/// new timeouts; no moment without the element.
pub fn dns_elements(addrs: &[(Ipv4Addr, u32)]) -> Value {
    set_elements("dns4", addrs)
}

/// [`dns_elements`] for the sandbox table's set `set_name` (`dns4`, `edge4`).
pub fn set_elements(set_name: &str, addrs: &[(Ipv4Addr, u32)]) -> Value {
    let mut longest: std::collections::BTreeMap<Ipv4Addr, u32> = Default::default();
    for (ip, ttl) in addrs {
        let t = longest.entry(*ip).or_insert(*ttl);
        *t = (*t).max(*ttl);
    }
    let elems: Vec<Value> = longest
        .iter()
        .map(|(ip, ttl)| json!({"elem": {"val": ip.to_string(), "timeout": ttl}}))
        .collect();
    let names: Vec<Value> = longest.keys().map(|ip| json!(ip.to_string())).collect();
    let set = |elem: Vec<Value>| json!({"family": "inet", "table": TABLE, "name": set_name, "elem": elem});
    json!({"nftables": [
        {"add": {"element": set(elems.clone())}},
        {"delete": {"element": set(names)}},
        {"add": {"element": set(elems)}},
    ]})
}

/// What the host-side table needs.
#[derive(Debug, Clone)]
pub struct HostSide<'a> {
    /// Table name (`ember_<tag>`).
    pub table: &'a str,
    /// Host-side veth names start with this (`vh<tag>`).
    pub veth_prefix: &'a str,
    /// The uplink interface.
    pub uplink: &'a str,
    /// The veth address pool.
    pub pool: Cidr4,
}

/// The host-side table (idempotent).
pub fn host(h: &HostSide<'_>) -> Value {
    let mut t = Table {
        family: "inet",
        name: h.table,
        cmds: Vec::new(),
    };
    t.cmds.push(json!({"add": {"table": t.t()}}));
    t.add("counter", json!({"name": "dropped"}));
    t.chain("forward", Some(("filter", "forward", 0, "accept")));
    t.chain("input", Some(("filter", "input", 0, "accept")));
    t.chain("postrouting", Some(("nat", "postrouting", 100, "accept")));
    for c in ["forward", "input", "postrouting"] {
        t.flush("chain", c);
    }
    let ours = json!(format!("{}*", h.veth_prefix));
    let drop = || vec![json!({"counter": "dropped"}), json!({"drop": null})];
    // From a sandbox: only out of the uplink (none: a host without one forwards nothing of
    // theirs; egress policies are refused before they get here).
    let mut r = vec![m(meta("iifname"), ours.clone())];
    if !h.uplink.is_empty() {
        r.push(ne(meta("oifname"), json!(h.uplink)));
    }
    r.extend(drop());
    t.rule("forward", r);
    // To a sandbox: only replies.
    t.rule(
        "forward",
        vec![
            m(meta("oifname"), ours.clone()),
            ct_established(),
            json!({"accept": null}),
        ],
    );
    let mut r = vec![m(meta("oifname"), ours.clone())];
    r.extend(drop());
    t.rule("forward", r);
    // The host itself is never reachable from a sandbox.
    let mut r = vec![m(meta("iifname"), ours)];
    r.extend(drop());
    t.rule("input", r);
    if !h.uplink.is_empty() {
        t.rule(
            "postrouting",
            vec![
                json!({"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                                 "right": prefix(&h.pool)}}),
                m(meta("oifname"), json!(h.uplink)),
                json!({"masquerade": null}),
            ],
        );
    }
    t.done()
}

/// Deletes a table if it exists.
pub fn delete_table(name: &str) -> Value {
    json!({"nftables": [
        {"add": {"table": {"family": "inet", "name": name}}},
        {"delete": {"table": {"family": "inet", "name": name}}},
    ]})
}

/// Errors running `nft`.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// The binary is missing or could not run.
    #[error("cannot run nft (install Debian's `nftables` package): {0}")]
    Spawn(std::io::Error),
    /// nft refused the ruleset.
    #[error("nft refused the rules: {0}")]
    Refused(String),
}

/// Applies a JSON ruleset in the calling thread's network namespace.
pub fn apply(ruleset: &Value) -> Result<(), NftError> {
    run(&["-j", "-f", "-"], Some(ruleset)).map(drop)
}

/// Runs `nft ARGS` (JSON on stdin if given) in the calling thread's network namespace and
/// returns its stdout.
pub fn run(args: &[&str], stdin: Option<&Value>) -> Result<String, NftError> {
    use ember_vmm::netns::{run_tool, ToolError};
    let input = stdin.map(|v| serde_json::to_vec(v).unwrap_or_default());
    run_tool("nft", args, input.as_deref()).map_err(|e| match e {
        ToolError::Spawn { source, .. } => NftError::Spawn(source),
        ToolError::Failed { stderr, .. } => NftError::Refused(stderr),
    })
}

/// Counters and samples read back from a sandbox's table.
#[derive(
    Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema,
)]
pub struct DropStats {
    /// Connection attempts refused.
    pub dropped: u64,
    /// Connections admitted.
    pub accepted: u64,
    /// Destinations refused in the last 10 minutes (at most 256).
    pub dropped_destinations: Vec<String>,
    /// Addresses currently allowed through resolved names.
    pub resolved: Vec<String>,
}

/// Parses `nft -j list table inet ember`.
pub fn parse_stats(text: &str) -> DropStats {
    let mut s = DropStats::default();
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        return s;
    };
    let items = v["nftables"].as_array().cloned().unwrap_or_default();
    let elem_str = |e: &Value| -> Option<String> {
        e.as_str()
            .map(str::to_owned)
            .or_else(|| e["elem"]["val"].as_str().map(str::to_owned))
    };
    for it in items {
        if let Some(c) = it.get("counter") {
            let n = c["packets"].as_u64().unwrap_or(0);
            match c["name"].as_str() {
                Some("dropped") => s.dropped = n,
                Some("accepted") => s.accepted = n,
                _ => {}
            }
        }
        if let Some(set) = it.get("set") {
            let elems: Vec<String> = set["elem"]
                .as_array()
                .map(|a| a.iter().filter_map(elem_str).collect())
                .unwrap_or_default();
            match set["name"].as_str() {
                Some("dropped4") => s.dropped_destinations = elems,
                Some("dns4") => s.resolved = elems,
                _ => {}
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side() -> SandboxSide {
        SandboxSide {
            gateway: "172.30.0.1".parse().unwrap(),
            host_addrs: vec!["192.0.2.7".parse().unwrap(), "10.1.1.1".parse().unwrap()],
            pool: Cidr4::parse("203.0.113.0/24").unwrap(),
        }
    }

    #[test]
    fn a_host_without_an_uplink_forwards_nothing_of_the_sandboxes_and_never_names_one() {
        let pool = Cidr4::parse("10.199.0.0/16").unwrap();
        let with = host(&HostSide {
            table: "ember_t",
            veth_prefix: "vht",
            uplink: "eth0",
            pool,
        })
        .to_string();
        assert!(
            with.contains("\"eth0\"") && with.contains("masquerade"),
            "{with}"
        );
        let without = host(&HostSide {
            table: "ember_t",
            veth_prefix: "vht",
            uplink: "",
            pool,
        })
        .to_string();
        // nft refuses an empty interface name: none is written, and nothing is NATed.
        assert!(!without.contains("\"\""), "{without}");
        assert!(!without.contains("masquerade"), "{without}");
        assert!(without.contains("\"drop\""), "{without}");
    }

    #[test]
    fn nested_prefixes_are_merged() {
        let l = normalize(vec![
            Cidr4::parse("10.1.0.0/16").unwrap(),
            Cidr4::parse("10.0.0.0/8").unwrap(),
            Cidr4::parse("10.1.1.1").unwrap(),
            Cidr4::parse("8.8.8.8").unwrap(),
        ]);
        let s: Vec<String> = l.iter().map(ToString::to_string).collect();
        assert_eq!(s, ["8.8.8.8/32", "10.0.0.0/8"]);
    }

    #[test]
    fn none_forwards_nothing_and_serves_no_dns() {
        let v = sandbox(&NetworkPolicy::default(), &side(), true).to_string();
        assert!(!v.contains("\"dport\""), "a resolver rule in mode none");
        assert!(v.contains("\"policy\":\"drop\""));
        // Every forward path ends in `denied` except replies.
        assert!(!v.contains("\"target\":\"admit\"}}]"));
    }

    #[test]
    fn rules_dnat_only_their_hosts_addresses_to_the_proxy() {
        let plain = NetworkPolicy {
            mode: NetMode::Egress,
            ..Default::default()
        };
        let text = sandbox(&plain, &side(), true).to_string();
        assert!(
            text.contains("\"edge4\"") && !text.contains("dnat"),
            "{text}"
        );
        let mut p = plain.clone();
        p.rules
            .insert("api.example.com".into(), vec![Default::default()]);
        let text = sandbox(&p, &side(), false).to_string();
        for needle in ["\"@edge4\"", "\"dnat\"", "15443", "15080"] {
            assert!(text.contains(needle), "{needle} missing: {text}");
        }
        assert!(!text.contains("15081"), "{text}");
        p.egress_proxy = Some(super::super::policy::EgressProxy {
            address: "192.0.2.9:1080".into(),
        });
        let text = sandbox(&p, &side(), false).to_string();
        assert!(
            text.contains("15081") && text.contains("\"return\""),
            "{text}"
        );
        let e = set_elements("edge4", &[("192.0.2.1".parse().unwrap(), 60)]);
        assert_eq!(e["nftables"][0]["add"]["element"]["name"], "edge4");
    }

    #[test]
    fn egress_renders_lists_limits_and_domains() {
        let p = NetworkPolicy {
            mode: NetMode::Egress,
            allow_cidrs: vec!["192.168.7.0/24".into()],
            deny_cidrs: vec!["198.51.100.7".into(), "10.2.0.0/16".into()],
            allow_domains: vec!["example.com".into()],
            bandwidth_kib: Some(512),
            max_connections: Some(20),
            rules: Default::default(),
            egress_proxy: None,
        };
        let v = sandbox(&p, &side(), true);
        let again = sandbox(&p, &side(), false).to_string();
        assert!(!again.contains("dropped4\",\"size"), "{again}");
        let text = v.to_string();
        for needle in [
            "\"192.168.7.0\"",
            "\"198.51.100.7\"",
            "\"192.0.2.7\"",
            "\"169.254.0.0\"",
            "\"203.0.113.0\"",
            "\"@dns4\"",
            "\"ct count\"",
            "\"rate\":512",
            "\"dport\"",
        ] {
            assert!(text.contains(needle), "{needle} missing from {text}");
        }
        // 10.2.0.0/16 and the host's 10.1.1.1 are inside 10.0.0.0/8: merged away.
        assert!(!text.contains("\"10.2.0.0\""));
        assert!(!text.contains("\"10.1.1.1\""));
        let n = v["nftables"].as_array().unwrap().len();
        assert!(n < 60, "{n} commands");
    }

    #[test]
    fn stats_parse_from_nft_output() {
        let text = r#"{"nftables":[{"metainfo":{}},
          {"counter":{"family":"inet","name":"dropped","table":"ember","packets":3,"bytes":180}},
          {"counter":{"family":"inet","name":"accepted","table":"ember","packets":5,"bytes":1}},
          {"set":{"name":"dropped4","elem":[{"elem":{"val":"169.254.169.254","timeout":600,"expires":590}}]}},
          {"set":{"name":"dns4","elem":["1.2.3.4"]}}]}"#;
        let s = parse_stats(text);
        assert_eq!(s.dropped, 3);
        assert_eq!(s.accepted, 5);
        assert_eq!(s.dropped_destinations, ["169.254.169.254"]);
        assert_eq!(s.resolved, ["1.2.3.4"]);
        assert_eq!(parse_stats("garbage"), DropStats::default());
    }

    #[test]
    fn dns_elements_restart_the_timeout_of_addresses_already_allowed() {
        let a: Ipv4Addr = "1.2.3.4".parse().unwrap();
        let b: Ipv4Addr = "5.6.7.8".parse().unwrap();
        let v = dns_elements(&[(a, 90), (b, 60), (a, 120)]);
        let cmds = v["nftables"].as_array().unwrap();
        let verbs: Vec<&str> = cmds
            .iter()
            .map(|c| c.as_object().unwrap().keys().next().unwrap().as_str())
            .collect();
        assert_eq!(verbs, ["add", "delete", "add"]);
        // Each address once, with its longest timeout.
        let added = &cmds[2]["add"]["element"]["elem"];
        assert_eq!(
            added,
            &json!([
                {"elem": {"val": "1.2.3.4", "timeout": 120}},
                {"elem": {"val": "5.6.7.8", "timeout": 60}}
            ])
        );
        assert_eq!(cmds[0]["add"]["element"]["elem"], *added);
        assert_eq!(
            cmds[1]["delete"]["element"]["elem"],
            json!(["1.2.3.4", "5.6.7.8"])
        );
        assert_eq!(cmds[1]["delete"]["element"]["name"], "dns4");
    }
}
