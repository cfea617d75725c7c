//! The per-sandbox allow-list DNS resolver (issue 12, network policy `egress` + `allow_domains`).
//!
//! A networked sandbox's guest uses its gateway address as its resolver. The lead side binds a UDP
//! socket (and optionally a TCP listener) to `gateway:53` inside the sandbox's network namespace and
//! hands them to [`Resolver::serve_udp`] / [`Resolver::serve_tcp`]. For every query:
//!
//! - a message that is not exactly one well-formed standard query (QR=0, opcode QUERY, one
//!   question, empty answer/authority sections) is counted as `malformed` and either dropped (too
//!   short to carry an ID, or a response) or answered FORMERR/NOTIMP;
//! - a name that [`DomainRules`] does not allow gets NXDOMAIN with the question echoed, and the
//!   `denied` callback is called;
//! - an allowed name is forwarded unchanged (same ID, same EDNS) to the upstream resolver over UDP
//!   from a fresh ephemeral socket (2 s timeout, one retry), falling back to TCP when the reply is
//!   truncated. The A/AAAA records of the answer section that belong to the question name or to
//!   the CNAME chain starting at it are handed to the `allow` callback (which adds them to the
//!   sandbox's nftables set with the record TTL) *before* the reply is relayed, unchanged, to the
//!   guest. If `allow` fails the guest gets SERVFAIL instead, so the guest never learns an address
//!   it would not be able to reach.
//!
//! Only A and AAAA answers open the firewall: addresses in SVCB/HTTPS `ipv4hint`/`ipv6hint`
//! parameters, in the additional section (glue) or anywhere else are *not* added, so a client that
//! wants to connect must resolve A/AAAA (which it does for allowed names anyway).
//!
//! ## Why hand-parsed rather than `hickory-proto`
//! The resolver never re-serialises what upstream sends: it relays the upstream bytes as they are.
//! All it needs is the 12-byte header, one question, the answer section's owner names, types,
//! classes, TTLs and A/AAAA/CNAME rdata, and the additional section of a query (for the EDNS UDP
//! size). That is a few hundred lines with every bound explicit (names at most 255 wire octets,
//! compression pointers must point strictly backwards, CNAME chains at most
//! [`MAX_CNAME_CHAIN`] long), against a large dependency whose full message model (and its
//! allocation and error behaviour on hostile input) we would have to audit anyway. Names from the
//! wire are matched label by label: a label containing a byte outside `[A-Za-z0-9_-]` (a literal
//! `.` inside a label, for instance) never matches a rule, so `"allowed\.test"` cannot pass for
//! `allowed.test`.
//!
//! ## Bounds
//! At most [`MAX_IN_FLIGHT`] queries are being handled at once per resolver (UDP and TCP together;
//! excess UDP queries are dropped, a TCP connection whose query finds no room is closed, both
//! counted as `dropped`); UDP queries larger than [`MAX_UDP_MESSAGE`] are dropped as malformed; at
//! most [`MAX_TCP_CONNECTIONS`] DNS-over-TCP connections are open at once (excess connections are
//! closed at once and counted as `dropped`), each closed after [`TCP_IDLE_TIMEOUT`] without a
//! complete query; the `allow` callback is given [`ALLOW_TIMEOUT`].
//!
//! ## Shutting down
//! Both `serve_*` futures return when their `shutdown` future resolves (or the socket fails
//! fatally, which is logged); queries still being handled at that moment are aborted. The caller
//! typically passes a `oneshot::Receiver` wrapped in an `async` block, or a cancellation token.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{timeout, timeout_at, Instant};

/// Queries handled at once per resolver (UDP and TCP together); excess ones are dropped.
pub const MAX_IN_FLIGHT: usize = 64;
/// The largest DNS message accepted from, or relayed to, a guest over UDP.
pub const MAX_UDP_MESSAGE: usize = 4096;
/// DNS-over-TCP connections open at once per resolver; excess connections are closed.
pub const MAX_TCP_CONNECTIONS: usize = 16;
/// A DNS-over-TCP connection is closed after this long without a complete query.
pub const TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Time given to one upstream attempt (UDP attempts are retried once; TCP is tried once).
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Time given to the `allow` callback before the guest gets SERVFAIL.
pub const ALLOW_TIMEOUT: Duration = Duration::from_secs(5);
/// CNAME records followed from the question name when collecting addresses.
pub const MAX_CNAME_CHAIN: usize = 16;

/// The most characters a domain name has in text form (without the trailing dot).
const MAX_NAME_TEXT: usize = 253;
/// The most characters of one label.
const MAX_LABEL: usize = 63;
/// The most octets of a name in wire form, the terminating zero included.
const MAX_NAME_WIRE: usize = 255;
/// A UDP reply without EDNS is at most this large (RFC 1035 4.2.1).
const CLASSIC_UDP_SIZE: usize = 512;

const HEADER_LEN: usize = 12;
const TYPE_A: u16 = 1;
const TYPE_CNAME: u16 = 5;
const TYPE_AAAA: u16 = 28;
const TYPE_OPT: u16 = 41;
const CLASS_IN: u16 = 1;

const FLAG_QR: u16 = 0x8000;
const MASK_OPCODE: u16 = 0x7800;
const FLAG_TC: u16 = 0x0200;
const FLAG_RD: u16 = 0x0100;
const FLAG_RA: u16 = 0x0080;
const MASK_RCODE: u16 = 0x000f;

const RCODE_NOERROR: u16 = 0;
const RCODE_FORMERR: u16 = 1;
const RCODE_SERVFAIL: u16 = 2;
const RCODE_NXDOMAIN: u16 = 3;
const RCODE_NOTIMP: u16 = 4;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// An `allow_domains` pattern is not a valid name or wildcard.
    #[error("invalid allow_domains pattern {pattern:?}: {reason}")]
    InvalidPattern {
        /// The pattern as given.
        pattern: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Called with the addresses of an allowed answer (each with its record's TTL in seconds, as
/// upstream gave it) before the answer is sent to the guest; the answer is only sent if it returns
/// `Ok` (else the guest gets SERVFAIL). Not called when an answer carries no A/AAAA address.
pub type AllowFn =
    Arc<dyn Fn(Vec<(IpAddr, u32)>) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// Called with the question name (as [`DeniedFn`] gets it) and the addresses of an allowed
/// answer, after [`AllowFn`] and before the answer is sent (the egress proxy's interception
/// set is fed this way); an `Err` turns the answer into SERVFAIL.
pub type AnswerFn =
    Arc<dyn Fn(String, Vec<(IpAddr, u32)>) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// Called for each refused query with the query name (lower case, dotted, no trailing dot; bytes
/// outside `[a-z0-9_-]` escaped as `\.` or `\DDD`) and the query type. Rate-limit inside if needed.
pub type DeniedFn = Arc<dyn Fn(&str, u16) + Send + Sync>;

/// The names a sandbox may resolve: exact names (`example.com`) and wildcards (`*.example.com`,
/// which matches subdomains at any depth but not `example.com` itself). Matching is
/// case-insensitive and ignores one trailing dot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DomainRules {
    /// Exact names, lower case, no trailing dot.
    exact: HashSet<String>,
    /// The apexes of the wildcards (`example.com` for `*.example.com`).
    wildcard: HashSet<String>,
    /// Every valid name (egress without a domain list; added by the runtime's wiring).
    any: bool,
}

impl DomainRules {
    /// Validates and compiles `patterns`: labels of 1 to 63 characters of `[a-z0-9_-]` (any case),
    /// at most 253 characters in all, `*.` only as the first label, no empty labels. The error
    /// names the first bad pattern.
    pub fn new(patterns: &[String]) -> Result<DomainRules, DnsError> {
        let mut rules = DomainRules::default();
        for pattern in patterns {
            let bad = |reason| DnsError::InvalidPattern {
                pattern: pattern.clone(),
                reason,
            };
            let lower = pattern.to_ascii_lowercase();
            let name = lower.strip_suffix('.').unwrap_or(&lower);
            if name.len() > MAX_NAME_TEXT {
                return Err(bad("longer than 253 characters"));
            }
            match name.strip_prefix("*.") {
                Some(apex) => {
                    check_name(apex).map_err(bad)?;
                    rules.wildcard.insert(apex.to_owned());
                }
                None => {
                    check_name(name).map_err(bad)?;
                    rules.exact.insert(name.to_owned());
                }
            }
        }
        Ok(rules)
    }

    /// Rules that allow every valid name (the resolver of a sandbox whose egress is not
    /// limited to names).
    pub fn any() -> DomainRules {
        DomainRules {
            any: true,
            ..DomainRules::default()
        }
    }

    /// Whether no name at all is allowed.
    pub fn is_empty(&self) -> bool {
        !self.any && self.exact.is_empty() && self.wildcard.is_empty()
    }

    /// Whether `name` (text form, any case, with or without the trailing dot) may be resolved.
    /// A name that is not a valid host name (empty labels, other characters) is never allowed.
    pub fn allows(&self, name: &str) -> bool {
        let lower = name.to_ascii_lowercase();
        let name = lower.strip_suffix('.').unwrap_or(&lower);
        check_name(name).is_ok() && self.matches_normalised(name)
    }

    /// `name` is lower case, without the trailing dot and valid per [`check_name`].
    fn matches_normalised(&self, name: &str) -> bool {
        self.any
            || self.exact.contains(name)
            || name
                .match_indices('.')
                .any(|(dot, _)| self.wildcard.contains(&name[dot + 1..]))
    }

    /// Whether the wire-form name `wire` (uncompressed, as [`read_name`] returns it) is allowed.
    fn allows_wire(&self, wire: &[u8]) -> bool {
        rule_text(wire).is_some_and(|name| self.matches_normalised(&name))
    }
}

/// Checks a lower-case name without trailing dot: labels of 1..=63 characters of `[a-z0-9_-]`,
/// at most 253 characters in all.
fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("empty name");
    }
    if name.len() > MAX_NAME_TEXT {
        return Err("longer than 253 characters");
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err("empty label");
        }
        if label.len() > MAX_LABEL {
            return Err("label longer than 63 characters");
        }
        if label == "*" {
            return Err("\"*.\" is only allowed as the first label");
        }
        if !label.bytes().all(is_name_byte) {
            return Err("labels may only contain a-z, 0-9, '-' and '_'");
        }
    }
    Ok(())
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_'
}

/// The lower-case dotted form of a wire name if every label is made of `[A-Za-z0-9_-]` and the
/// name is not the root; `None` otherwise (such a name never matches a rule).
fn rule_text(wire: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(wire.len());
    for label in labels(wire) {
        if !label.iter().all(|b| is_name_byte(b.to_ascii_lowercase())) {
            return None;
        }
        if !out.is_empty() {
            out.push('.');
        }
        out.extend(label.iter().map(|b| char::from(b.to_ascii_lowercase())));
    }
    (!out.is_empty()).then_some(out)
}

/// A printable form of a wire name for logs and the `denied` callback.
fn display_name(wire: &[u8]) -> String {
    let mut out = String::with_capacity(wire.len());
    for label in labels(wire) {
        if !out.is_empty() {
            out.push('.');
        }
        for &b in label {
            let b = b.to_ascii_lowercase();
            match b {
                _ if is_name_byte(b) => out.push(char::from(b)),
                b'.' | b'\\' => {
                    out.push('\\');
                    out.push(char::from(b));
                }
                _ => out.push_str(&format!("\\{b:03}")),
            }
        }
    }
    if out.is_empty() {
        out.push('.');
    }
    out
}

/// The labels of an uncompressed wire-form name (as [`read_name`] produces: well formed).
fn labels(wire: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut pos = 0;
    std::iter::from_fn(move || {
        let len = usize::from(*wire.get(pos)?);
        if len == 0 {
            return None;
        }
        let label = wire.get(pos + 1..pos + 1 + len)?;
        pos += 1 + len;
        Some(label)
    })
}

/// A message that does not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed DNS message")]
struct Malformed;

/// The fixed header of a message.
#[derive(Debug, Clone, Copy)]
struct Header {
    id: u16,
    flags: u16,
    qd: u16,
    an: u16,
    ns: u16,
    ar: u16,
}

fn read_u16(msg: &[u8], pos: usize) -> Result<u16, Malformed> {
    match msg.get(pos..pos + 2) {
        Some(&[hi, lo]) => Ok(u16::from_be_bytes([hi, lo])),
        _ => Err(Malformed),
    }
}

fn read_u32(msg: &[u8], pos: usize) -> Result<u32, Malformed> {
    Ok((u32::from(read_u16(msg, pos)?) << 16) | u32::from(read_u16(msg, pos + 2)?))
}

fn read_header(msg: &[u8]) -> Result<Header, Malformed> {
    Ok(Header {
        id: read_u16(msg, 0)?,
        flags: read_u16(msg, 2)?,
        qd: read_u16(msg, 4)?,
        an: read_u16(msg, 6)?,
        ns: read_u16(msg, 8)?,
        ar: read_u16(msg, 10)?,
    })
}

/// Reads the (possibly compressed) name at `start`: returns it uncompressed in wire form (case
/// preserved, terminating zero included) and the offset just past it in `msg`. Compression
/// pointers must point strictly before the start of the name piece that contains them, which
/// rules out loops; the result is at most 255 octets.
fn read_name(msg: &[u8], start: usize) -> Result<(Vec<u8>, usize), Malformed> {
    let mut out = Vec::with_capacity(32);
    let mut pos = start;
    let mut piece_start = start;
    let mut end = None;
    loop {
        let len = usize::from(*msg.get(pos).ok_or(Malformed)?);
        match len & 0xc0 {
            0x00 if len == 0 => {
                out.push(0);
                return Ok((out, end.unwrap_or(pos + 1)));
            }
            0x00 => {
                let label = msg.get(pos + 1..pos + 1 + len).ok_or(Malformed)?;
                if out.len() + 1 + len + 1 > MAX_NAME_WIRE {
                    return Err(Malformed);
                }
                out.push(len as u8);
                out.extend_from_slice(label);
                pos += 1 + len;
            }
            0xc0 => {
                let low = usize::from(*msg.get(pos + 1).ok_or(Malformed)?);
                let target = ((len & 0x3f) << 8) | low;
                if target >= piece_start {
                    return Err(Malformed);
                }
                end.get_or_insert(pos + 2);
                piece_start = target;
                pos = target;
            }
            // 0x40 and 0x80: extended label types (RFC 6891 retired them); not accepted.
            _ => return Err(Malformed),
        }
    }
}

/// The question of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Question {
    /// Uncompressed wire form, case as sent.
    name: Vec<u8>,
    qtype: u16,
    qclass: u16,
}

impl Question {
    /// Whether `other` asks the same thing (names compared case-insensitively).
    fn same_as(&self, other: &Question) -> bool {
        self.qtype == other.qtype
            && self.qclass == other.qclass
            && self.name.eq_ignore_ascii_case(&other.name)
    }
}

fn read_question(msg: &[u8], pos: usize) -> Result<(Question, usize), Malformed> {
    let (name, pos) = read_name(msg, pos)?;
    let qtype = read_u16(msg, pos)?;
    let qclass = read_u16(msg, pos + 2)?;
    Ok((
        Question {
            name,
            qtype,
            qclass,
        },
        pos + 4,
    ))
}

/// One resource record; `rdata` is its range in the message.
#[derive(Debug, Clone)]
struct Record {
    name: Vec<u8>,
    rtype: u16,
    class: u16,
    ttl: u32,
    rdata: Range<usize>,
}

fn read_record(msg: &[u8], pos: usize) -> Result<(Record, usize), Malformed> {
    let (name, pos) = read_name(msg, pos)?;
    let rtype = read_u16(msg, pos)?;
    let class = read_u16(msg, pos + 2)?;
    let ttl = read_u32(msg, pos + 4)?;
    let rdlen = usize::from(read_u16(msg, pos + 8)?);
    let rdata = pos + 10..pos + 10 + rdlen;
    if rdata.end > msg.len() {
        return Err(Malformed);
    }
    let end = rdata.end;
    Ok((
        Record {
            name,
            rtype,
            class,
            ttl,
            rdata,
        },
        end,
    ))
}

fn write_question(out: &mut Vec<u8>, q: &Question) {
    out.extend_from_slice(&q.name);
    out.extend_from_slice(&q.qtype.to_be_bytes());
    out.extend_from_slice(&q.qclass.to_be_bytes());
}

/// A reply of our own to a query with header `query`: same ID, opcode and RD, RA set, `rcode`,
/// the question echoed when there is one, no records.
fn error_reply(query: &Header, question: Option<&Question>, rcode: u16) -> Vec<u8> {
    let flags = FLAG_QR | (query.flags & (MASK_OPCODE | FLAG_RD)) | FLAG_RA | rcode;
    let mut out = Vec::with_capacity(HEADER_LEN + question.map_or(0, |q| q.name.len() + 4));
    out.extend_from_slice(&query.id.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&u16::from(question.is_some()).to_be_bytes());
    out.extend_from_slice(&[0; 6]);
    if let Some(q) = question {
        write_question(&mut out, q);
    }
    out
}

/// A truncated version of the upstream `reply` (header flags and RCODE kept, TC set, only the
/// question), for a guest whose UDP size the full reply exceeds: it retries over TCP.
fn truncated_reply(reply: &Header, question: &Question) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + question.name.len() + 4);
    out.extend_from_slice(&reply.id.to_be_bytes());
    out.extend_from_slice(&(reply.flags | FLAG_TC).to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&[0; 6]);
    write_question(&mut out, question);
    out
}

/// Whether `reply` is upstream's answer to the query with ID `id` and question `q`. A reply
/// without a question is accepted only as an error (some servers drop it for FORMERR/NOTIMP).
fn reply_matches(reply: &[u8], id: u16, q: &Question) -> bool {
    let Ok(h) = read_header(reply) else {
        return false;
    };
    if h.id != id || h.flags & FLAG_QR == 0 || h.flags & MASK_OPCODE != 0 {
        return false;
    }
    match h.qd {
        0 => h.flags & MASK_RCODE != RCODE_NOERROR,
        1 => read_question(reply, HEADER_LEN).is_ok_and(|(rq, _)| rq.same_as(q)),
        _ => false,
    }
}

/// The A/AAAA addresses (with TTLs) of `reply`'s answer section owned by the question name or by
/// a name the CNAME chain from it reaches (at most [`MAX_CNAME_CHAIN`] links).
fn collect_addresses(reply: &[u8], q: &Question) -> Result<Vec<(IpAddr, u32)>, Malformed> {
    let h = read_header(reply)?;
    let mut pos = HEADER_LEN;
    for _ in 0..h.qd {
        pos = read_question(reply, pos)?.1;
    }
    let mut records = Vec::with_capacity(usize::from(h.an));
    for _ in 0..h.an {
        let (mut rec, next) = read_record(reply, pos)?;
        rec.name.make_ascii_lowercase();
        records.push(rec);
        pos = next;
    }
    let in_class = |r: &&Record| r.class == CLASS_IN;

    let mut names = vec![q.name.to_ascii_lowercase()];
    while names.len() <= MAX_CNAME_CHAIN {
        let mut grew = false;
        for rec in records.iter().filter(in_class) {
            if rec.rtype != TYPE_CNAME || !names.contains(&rec.name) {
                continue;
            }
            let (mut target, end) = read_name(reply, rec.rdata.start)?;
            if end != rec.rdata.end {
                return Err(Malformed);
            }
            target.make_ascii_lowercase();
            if !names.contains(&target) && names.len() <= MAX_CNAME_CHAIN {
                names.push(target);
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }

    let mut addrs = Vec::new();
    for rec in records.iter().filter(in_class) {
        if !names.contains(&rec.name) {
            continue;
        }
        let rdata = &reply[rec.rdata.clone()];
        let ip = match rec.rtype {
            TYPE_A => IpAddr::from(<[u8; 4]>::try_from(rdata).map_err(|_| Malformed)?),
            TYPE_AAAA => IpAddr::from(<[u8; 16]>::try_from(rdata).map_err(|_| Malformed)?),
            _ => continue,
        };
        addrs.push((ip, rec.ttl));
    }
    Ok(addrs)
}

/// Why an upstream exchange failed.
#[derive(Debug, thiserror::Error)]
enum UpstreamError {
    #[error("upstream i/o: {0}")]
    Io(#[from] io::Error),
    #[error("upstream did not answer in time")]
    Timeout,
    #[error("upstream reply does not match the query")]
    Mismatch,
}

/// What a resolver has done since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResolverStats {
    /// Messages received from guests (UDP datagrams and TCP messages), whatever became of them.
    pub queries: u64,
    /// Upstream replies relayed to a guest for allowed names (whatever their RCODE).
    pub answered: u64,
    /// Queries for names that are not allowed (answered NXDOMAIN).
    pub refused: u64,
    /// Allowed queries upstream did not answer usably (answered SERVFAIL).
    pub upstream_errors: u64,
    /// Messages that were not one well-formed standard query (dropped, FORMERR or NOTIMP).
    pub malformed: u64,
    /// Queries dropped (and TCP connections closed) because the in-flight or connection limit
    /// was reached.
    pub dropped: u64,
    /// Allowed answers withheld because the `allow` callback failed or timed out (SERVFAIL).
    pub allow_failures: u64,
}

#[derive(Debug, Default)]
struct Counters {
    queries: AtomicU64,
    answered: AtomicU64,
    refused: AtomicU64,
    upstream_errors: AtomicU64,
    malformed: AtomicU64,
    dropped: AtomicU64,
    allow_failures: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The transport a query came over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Udp,
    Tcp,
}

/// One sandbox's allow-list resolver. Create it with [`Resolver::new`], then run
/// [`Resolver::serve_udp`] (and optionally [`Resolver::serve_tcp`]) on sockets bound in the
/// sandbox's namespace; the rules can be replaced at any time with [`Resolver::set_rules`].
pub struct Resolver {
    rules: RwLock<DomainRules>,
    upstream: SocketAddr,
    allow: AllowFn,
    denied: DeniedFn,
    upstream_timeout: Duration,
    in_flight: Arc<Semaphore>,
    tcp_connections: Arc<Semaphore>,
    counters: Counters,
    /// Set once a fatal socket error was logged, so it is logged once.
    failed: AtomicBool,
    /// See [`AnswerFn`].
    answers: RwLock<Option<AnswerFn>>,
}

impl fmt::Debug for Resolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Resolver")
            .field("upstream", &self.upstream)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Resolver {
    /// A resolver allowing `rules`, forwarding allowed queries to `upstream` (a resolver reachable
    /// from the namespace the serving task runs in), calling `allow` with the addresses of each
    /// allowed answer and `denied` for each refused query.
    pub fn new(
        rules: DomainRules,
        upstream: SocketAddr,
        allow: AllowFn,
        denied: DeniedFn,
    ) -> Arc<Resolver> {
        Self::with_upstream_timeout(rules, upstream, allow, denied, UPSTREAM_TIMEOUT)
    }

    fn with_upstream_timeout(
        rules: DomainRules,
        upstream: SocketAddr,
        allow: AllowFn,
        denied: DeniedFn,
        upstream_timeout: Duration,
    ) -> Arc<Resolver> {
        Arc::new(Resolver {
            rules: RwLock::new(rules),
            upstream,
            allow,
            denied,
            upstream_timeout,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            tcp_connections: Arc::new(Semaphore::new(MAX_TCP_CONNECTIONS)),
            counters: Counters::default(),
            failed: AtomicBool::new(false),
            answers: RwLock::new(None),
        })
    }

    /// Replaces the rules; queries received from now on are judged by `rules`. Addresses already
    /// handed to `allow` are not withdrawn here (they expire with their TTL in the nftables set).
    pub fn set_rules(&self, rules: DomainRules) {
        *self.rules.write().unwrap_or_else(|e| e.into_inner()) = rules;
    }

    /// Sets (or clears) the hook that sees each allowed answer with its name.
    pub fn set_answer_hook(&self, hook: Option<AnswerFn>) {
        *self.answers.write().unwrap_or_else(|e| e.into_inner()) = hook;
    }

    /// Asks upstream for the IPv4 addresses of `name` (the egress proxy's own look-up: it
    /// never trusts the address a guest connected to). Not subject to the rules, not counted.
    pub async fn lookup_v4(&self, name: &str) -> Result<Vec<Ipv4Addr>, String> {
        check_name(name).map_err(|e| format!("{name:?}: {e}"))?;
        let mut wire = Vec::with_capacity(name.len() + 2);
        for label in name.trim_end_matches('.').split('.') {
            wire.push(label.len() as u8);
            wire.extend_from_slice(label.as_bytes());
        }
        wire.push(0);
        let question = Question {
            name: wire,
            qtype: TYPE_A,
            qclass: CLASS_IN,
        };
        let id = (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
            & 0xffff) as u16;
        let mut query = Vec::with_capacity(HEADER_LEN + question.name.len() + 4);
        query.extend_from_slice(&id.to_be_bytes());
        query.extend_from_slice(&FLAG_RD.to_be_bytes());
        query.extend_from_slice(&1u16.to_be_bytes());
        query.extend_from_slice(&[0; 6]);
        write_question(&mut query, &question);
        let reply = self
            .ask_upstream(&query, id, &question)
            .await
            .map_err(|e| format!("resolving {name}: {e}"))?;
        let rcode = read_u16(&reply, 2).map_err(|e| format!("resolving {name}: {e}"))? & MASK_RCODE;
        if rcode != RCODE_NOERROR {
            return Err(format!("resolving {name}: rcode {rcode}"));
        }
        let addrs =
            collect_addresses(&reply, &question).map_err(|e| format!("resolving {name}: {e}"))?;
        let v4: Vec<Ipv4Addr> = addrs
            .into_iter()
            .filter_map(|(ip, _)| match ip {
                IpAddr::V4(ip) => Some(ip),
                IpAddr::V6(_) => None,
            })
            .collect();
        if v4.is_empty() {
            return Err(format!("{name} has no IPv4 address"));
        }
        Ok(v4)
    }

    /// The counters so far.
    pub fn stats(&self) -> ResolverStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ResolverStats {
            queries: get(&c.queries),
            answered: get(&c.answered),
            refused: get(&c.refused),
            upstream_errors: get(&c.upstream_errors),
            malformed: get(&c.malformed),
            dropped: get(&c.dropped),
            allow_failures: get(&c.allow_failures),
        }
    }

    /// Serves DNS over UDP on `sock` until `shutdown` resolves or the socket fails fatally (logged
    /// with `tracing`). Queries still being handled when it returns are aborted.
    pub async fn serve_udp(self: Arc<Self>, sock: UdpSocket, shutdown: impl Future<Output = ()>) {
        let sock = Arc::new(sock);
        let mut tasks = JoinSet::new();
        let mut buf = vec![0u8; MAX_UDP_MESSAGE + 1];
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                received = sock.recv_from(&mut buf) => {
                    let (len, peer) = match received {
                        Ok(got) => got,
                        Err(e) if transient(&e) => continue,
                        Err(e) => {
                            self.log_fatal("UDP socket", &e);
                            break;
                        }
                    };
                    bump(&self.counters.queries);
                    if len > MAX_UDP_MESSAGE {
                        bump(&self.counters.malformed);
                        continue;
                    }
                    let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
                        bump(&self.counters.dropped);
                        continue;
                    };
                    let query = buf[..len].to_vec();
                    let (this, sock) = (self.clone(), sock.clone());
                    tasks.spawn(async move {
                        let reply = this.handle(&query, Transport::Udp).await;
                        drop(permit);
                        if let Some(reply) = reply {
                            if let Err(e) = sock.send_to(&reply, peer).await {
                                tracing::debug!(error = %e, %peer, "dns: reply not sent");
                            }
                        }
                    });
                }
            }
        }
    }

    /// Serves DNS over TCP (RFC 1035 4.2.2: each message preceded by its 2-byte length) on
    /// `listener` until `shutdown` resolves or the listener fails fatally (logged). Connections
    /// still open when it returns are closed.
    pub async fn serve_tcp(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                accepted = listener.accept() => {
                    let stream = match accepted {
                        Ok((stream, _)) => stream,
                        Err(e) if transient(&e) => continue,
                        Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) => {
                            tracing::warn!(error = %e, "dns: cannot accept a TCP connection now");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                        Err(e) => {
                            self.log_fatal("TCP listener", &e);
                            break;
                        }
                    };
                    let Ok(permit) = self.tcp_connections.clone().try_acquire_owned() else {
                        bump(&self.counters.dropped);
                        continue;
                    };
                    connections.spawn(self.clone().serve_connection(stream, permit));
                }
            }
        }
    }

    fn log_fatal(&self, what: &str, e: &io::Error) {
        if !self.failed.swap(true, Ordering::Relaxed) {
            tracing::warn!(error = %e, "dns: {what} failed; the resolver stops serving it");
        }
    }

    /// One DNS-over-TCP connection: queries are answered one after the other.
    async fn serve_connection(self: Arc<Self>, mut stream: TcpStream, _slot: OwnedSemaphorePermit) {
        let mut query = Vec::new();
        loop {
            let mut len = [0u8; 2];
            if !matches!(
                timeout(TCP_IDLE_TIMEOUT, stream.read_exact(&mut len)).await,
                Ok(Ok(_))
            ) {
                return;
            }
            query.resize(usize::from(u16::from_be_bytes(len)), 0);
            if !matches!(
                timeout(TCP_IDLE_TIMEOUT, stream.read_exact(&mut query)).await,
                Ok(Ok(_))
            ) {
                return;
            }
            bump(&self.counters.queries);
            let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
                bump(&self.counters.dropped);
                return;
            };
            let reply = self.handle(&query, Transport::Tcp).await;
            drop(permit);
            let Some(reply) = reply else { continue };
            let Ok(reply_len) = u16::try_from(reply.len()) else {
                return;
            };
            let mut framed = Vec::with_capacity(2 + reply.len());
            framed.extend_from_slice(&reply_len.to_be_bytes());
            framed.extend_from_slice(&reply);
            if !matches!(
                timeout(TCP_IDLE_TIMEOUT, stream.write_all(&framed)).await,
                Ok(Ok(()))
            ) {
                return;
            }
        }
    }

    /// Handles one query; the reply to send, if any.
    async fn handle(&self, msg: &[u8], transport: Transport) -> Option<Vec<u8>> {
        let malformed = |reply: Option<Vec<u8>>| {
            bump(&self.counters.malformed);
            reply
        };
        let Ok(header) = read_header(msg) else {
            return malformed(None);
        };
        if header.flags & FLAG_QR != 0 {
            // A response: never answer one (no reflection loops).
            return malformed(None);
        }
        if header.flags & MASK_OPCODE != 0 {
            return malformed(Some(error_reply(&header, None, RCODE_NOTIMP)));
        }
        if header.qd != 1 || header.an != 0 || header.ns != 0 {
            return malformed(Some(error_reply(&header, None, RCODE_FORMERR)));
        }
        let Ok((question, mut pos)) = read_question(msg, HEADER_LEN) else {
            return malformed(Some(error_reply(&header, None, RCODE_FORMERR)));
        };
        let mut udp_size = CLASSIC_UDP_SIZE;
        for _ in 0..header.ar {
            let Ok((rec, next)) = read_record(msg, pos) else {
                return malformed(Some(error_reply(&header, Some(&question), RCODE_FORMERR)));
            };
            if rec.rtype == TYPE_OPT {
                udp_size = usize::from(rec.class).clamp(CLASSIC_UDP_SIZE, MAX_UDP_MESSAGE);
            }
            pos = next;
        }
        if pos != msg.len() {
            return malformed(Some(error_reply(&header, Some(&question), RCODE_FORMERR)));
        }

        let allowed = self
            .rules
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .allows_wire(&question.name);
        if !allowed {
            bump(&self.counters.refused);
            (self.denied)(&display_name(&question.name), question.qtype);
            return Some(error_reply(&header, Some(&question), RCODE_NXDOMAIN));
        }

        let servfail = || Some(error_reply(&header, Some(&question), RCODE_SERVFAIL));
        let reply = match self.ask_upstream(msg, header.id, &question).await {
            Ok(reply) => reply,
            Err(e) => {
                tracing::debug!(error = %e, name = %display_name(&question.name), "dns: upstream failed");
                bump(&self.counters.upstream_errors);
                return servfail();
            }
        };
        let (Ok(addrs), Ok(reply_header)) =
            (collect_addresses(&reply, &question), read_header(&reply))
        else {
            tracing::debug!(name = %display_name(&question.name), "dns: malformed upstream reply");
            bump(&self.counters.upstream_errors);
            return servfail();
        };
        if !addrs.is_empty() {
            let failure = match timeout(ALLOW_TIMEOUT, (self.allow)(addrs.clone())).await {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(_) => Some("timed out".to_owned()),
            };
            if let Some(e) = failure {
                tracing::warn!(error = %e, name = %display_name(&question.name), "dns: allowing the answer's addresses failed");
                bump(&self.counters.allow_failures);
                return servfail();
            }
            let hook = self
                .answers
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            if let Some(hook) = hook {
                let name = display_name(&question.name);
                let failure = match timeout(ALLOW_TIMEOUT, hook(name, addrs)).await {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(e),
                    Err(_) => Some("timed out".to_owned()),
                };
                if let Some(e) = failure {
                    tracing::warn!(error = %e, name = %display_name(&question.name), "dns: the answer hook failed");
                    bump(&self.counters.allow_failures);
                    return servfail();
                }
            }
        }
        bump(&self.counters.answered);
        if transport == Transport::Udp && reply.len() > udp_size {
            return Some(truncated_reply(&reply_header, &question));
        }
        Some(reply)
    }

    /// Forwards `query` upstream over UDP (one retry), then over TCP if the reply is truncated.
    async fn ask_upstream(
        &self,
        query: &[u8],
        id: u16,
        question: &Question,
    ) -> Result<Vec<u8>, UpstreamError> {
        let mut last = UpstreamError::Timeout;
        for _attempt in 0..2 {
            match self.exchange_udp(query, id, question).await {
                Ok(reply) if read_u16(&reply, 2).is_ok_and(|f| f & FLAG_TC != 0) => {
                    return self.exchange_tcp(query, id, question).await;
                }
                Ok(reply) => return Ok(reply),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// One UDP attempt from a fresh ephemeral socket; replies that do not match are ignored.
    async fn exchange_udp(
        &self,
        query: &[u8],
        id: u16,
        question: &Question,
    ) -> Result<Vec<u8>, UpstreamError> {
        let deadline = Instant::now() + self.upstream_timeout;
        let local: SocketAddr = match self.upstream {
            SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let sock = UdpSocket::bind(local).await?;
        sock.connect(self.upstream).await?;
        sock.send(query).await?;
        let mut buf = vec![0u8; usize::from(u16::MAX)];
        loop {
            let len = timeout_at(deadline, sock.recv(&mut buf))
                .await
                .map_err(|_| UpstreamError::Timeout)??;
            if reply_matches(&buf[..len], id, question) {
                buf.truncate(len);
                return Ok(buf);
            }
        }
    }

    /// One DNS-over-TCP attempt.
    async fn exchange_tcp(
        &self,
        query: &[u8],
        id: u16,
        question: &Question,
    ) -> Result<Vec<u8>, UpstreamError> {
        let exchange = async {
            let mut stream = TcpStream::connect(self.upstream).await?;
            let len = u16::try_from(query.len()).map_err(|_| UpstreamError::Mismatch)?;
            let mut framed = Vec::with_capacity(2 + query.len());
            framed.extend_from_slice(&len.to_be_bytes());
            framed.extend_from_slice(query);
            stream.write_all(&framed).await?;
            let mut len = [0u8; 2];
            stream.read_exact(&mut len).await?;
            let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
            stream.read_exact(&mut reply).await?;
            if reply_matches(&reply, id, question) {
                Ok(reply)
            } else {
                Err(UpstreamError::Mismatch)
            }
        };
        timeout(self.upstream_timeout, exchange)
            .await
            .map_err(|_| UpstreamError::Timeout)?
    }
}

/// Socket errors after which serving goes on.
fn transient(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused
            | ConnectionReset
            | ConnectionAborted
            | Interrupted
            | WouldBlock
            | TimedOut
            | HostUnreachable
            | NetworkUnreachable
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;
    use tokio::sync::oneshot;

    const TYPE_MX: u16 = 15;

    fn strings(patterns: &[&str]) -> Vec<String> {
        patterns.iter().map(|p| p.to_string()).collect()
    }

    fn rules(patterns: &[&str]) -> DomainRules {
        DomainRules::new(&strings(patterns)).expect("valid patterns")
    }

    fn encode_name(name: &str) -> Vec<u8> {
        let mut out = Vec::new();
        for label in name.split('.').filter(|l| !l.is_empty()) {
            out.push(label.len() as u8);
            out.extend_from_slice(label.as_bytes());
        }
        out.push(0);
        out
    }

    fn header(id: u16, flags: u16, counts: [u16; 4]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
        for c in counts {
            out.extend_from_slice(&c.to_be_bytes());
        }
        out
    }

    /// A standard query with RD; with an EDNS OPT record advertising `edns` if given.
    fn query(id: u16, name: &str, qtype: u16, edns: Option<u16>) -> Vec<u8> {
        let mut out = header(id, FLAG_RD, [1, 0, 0, u16::from(edns.is_some())]);
        out.extend_from_slice(&encode_name(name));
        out.extend_from_slice(&qtype.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        if let Some(size) = edns {
            out.push(0);
            out.extend_from_slice(&TYPE_OPT.to_be_bytes());
            out.extend_from_slice(&size.to_be_bytes());
            out.extend_from_slice(&[0; 6]);
        }
        out
    }

    fn id_of(msg: &[u8]) -> u16 {
        u16::from_be_bytes([msg[0], msg[1]])
    }

    fn flags_of(msg: &[u8]) -> u16 {
        u16::from_be_bytes([msg[2], msg[3]])
    }

    fn rcode_of(msg: &[u8]) -> u16 {
        flags_of(msg) & MASK_RCODE
    }

    fn answers_of(msg: &[u8]) -> Vec<Record> {
        let h = read_header(msg).unwrap();
        let mut pos = HEADER_LEN;
        for _ in 0..h.qd {
            pos = read_question(msg, pos).unwrap().1;
        }
        (0..h.an)
            .map(|_| {
                let (rec, next) = read_record(msg, pos).unwrap();
                pos = next;
                rec
            })
            .collect()
    }

    fn rr(out: &mut Vec<u8>, owner: &[u8], rtype: u16, ttl: u32, rdata: &[u8]) {
        out.extend_from_slice(owner);
        out.extend_from_slice(&rtype.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&ttl.to_be_bytes());
        out.extend_from_slice(&(rdata.len() as u16).to_be_bytes());
        out.extend_from_slice(rdata);
    }

    fn pointer(offset: usize) -> [u8; 2] {
        [0xc0 | (offset >> 8) as u8, offset as u8]
    }

    /// The fake upstream's answer to `msg`, or `None` to stay silent.
    fn fake_answer(msg: &[u8], over_tcp: bool) -> Option<Vec<u8>> {
        let (q, qend) = read_question(msg, HEADER_LEN).ok()?;
        let name = rule_text(&q.name)?;
        let id = id_of(msg);
        let question = &msg[HEADER_LEN..qend];
        let reply = |flags: u16, an: u16, body: &[u8]| {
            let mut out = header(id, FLAG_QR | FLAG_RD | FLAG_RA | flags, [1, an, 0, 0]);
            out.extend_from_slice(question);
            out.extend_from_slice(body);
            out
        };
        match (name.as_str(), q.qtype) {
            ("allowed.test", TYPE_A) => {
                // allowed.test CNAME mid.other.test CNAME final.elsewhere.test, two A records,
                // and an unrelated A record that must not be allowed. Compressed throughout.
                let base = HEADER_LEN + question.len();
                let mut body = Vec::new();
                let mid_rdata = base + body.len() + 12;
                rr(
                    &mut body,
                    &pointer(HEADER_LEN),
                    TYPE_CNAME,
                    100,
                    &encode_name("mid.other.test"),
                );
                let final_rdata = base + body.len() + 12;
                rr(
                    &mut body,
                    &pointer(mid_rdata),
                    TYPE_CNAME,
                    100,
                    &encode_name("final.elsewhere.test"),
                );
                rr(
                    &mut body,
                    &pointer(final_rdata),
                    TYPE_A,
                    300,
                    &[192, 0, 2, 1],
                );
                rr(
                    &mut body,
                    &pointer(final_rdata),
                    TYPE_A,
                    60,
                    &[192, 0, 2, 2],
                );
                rr(
                    &mut body,
                    &encode_name("unrelated.test"),
                    TYPE_A,
                    999,
                    &[198, 51, 100, 9],
                );
                Some(reply(0, 5, &body))
            }
            ("allowed.test", TYPE_AAAA) => {
                let mut body = Vec::new();
                let ip: Ipv6Addr = "2001:db8::1".parse().unwrap();
                rr(
                    &mut body,
                    &pointer(HEADER_LEN),
                    TYPE_AAAA,
                    120,
                    &ip.octets(),
                );
                Some(reply(0, 1, &body))
            }
            ("allowed.test", TYPE_MX) => {
                let mut body = Vec::new();
                let mut rdata = 10u16.to_be_bytes().to_vec();
                rdata.extend_from_slice(&encode_name("mx.allowed.test"));
                rr(&mut body, &pointer(HEADER_LEN), TYPE_MX, 120, &rdata);
                Some(reply(0, 1, &body))
            }
            ("a.b.example.com" | "other.test", TYPE_A) => {
                let mut body = Vec::new();
                rr(
                    &mut body,
                    &pointer(HEADER_LEN),
                    TYPE_A,
                    50,
                    &[192, 0, 2, 10],
                );
                Some(reply(0, 1, &body))
            }
            ("big.test", TYPE_A) if !over_tcp => Some(reply(FLAG_TC, 0, &[])),
            ("big.test", TYPE_A) => {
                let mut body = Vec::new();
                for i in 0..40 {
                    rr(&mut body, &pointer(HEADER_LEN), TYPE_A, 30, &[10, 0, 0, i]);
                }
                Some(reply(0, 40, &body))
            }
            ("slow.test", _) => None,
            _ => Some(reply(RCODE_NXDOMAIN, 0, &[])),
        }
    }

    /// A fake upstream resolver on 127.0.0.1 (UDP and TCP on the same port); counts the
    /// messages it gets per name.
    struct Upstream {
        addr: SocketAddr,
        hits: Arc<Mutex<HashMap<String, usize>>>,
    }

    impl Upstream {
        fn hits(&self, name: &str) -> usize {
            self.hits.lock().unwrap().get(name).copied().unwrap_or(0)
        }
    }

    fn count_hit(hits: &Mutex<HashMap<String, usize>>, msg: &[u8], transport: &str) {
        if let Ok((q, _)) = read_question(msg, HEADER_LEN) {
            let key = format!("{}/{transport}", display_name(&q.name));
            *hits.lock().unwrap().entry(key).or_default() += 1;
        }
    }

    async fn fake_upstream() -> Upstream {
        let (udp, tcp) = loop {
            let udp = UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let addr = udp.local_addr().unwrap();
            if let Ok(tcp) = TcpListener::bind(addr).await {
                break (udp, tcp);
            }
        };
        let addr = udp.local_addr().unwrap();
        let hits = Arc::new(Mutex::new(HashMap::new()));
        let udp_hits = hits.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65535];
            loop {
                let Ok((len, peer)) = udp.recv_from(&mut buf).await else {
                    return;
                };
                count_hit(&udp_hits, &buf[..len], "udp");
                if let Some(reply) = fake_answer(&buf[..len], false) {
                    let _ = udp.send_to(&reply, peer).await;
                }
            }
        });
        let tcp_hits = hits.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = tcp.accept().await else {
                    return;
                };
                let hits = tcp_hits.clone();
                tokio::spawn(async move {
                    let mut len = [0u8; 2];
                    stream.read_exact(&mut len).await.unwrap();
                    let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
                    stream.read_exact(&mut msg).await.unwrap();
                    count_hit(&hits, &msg, "tcp");
                    if let Some(reply) = fake_answer(&msg, true) {
                        let mut framed = (reply.len() as u16).to_be_bytes().to_vec();
                        framed.extend_from_slice(&reply);
                        stream.write_all(&framed).await.unwrap();
                    }
                });
            }
        });
        Upstream { addr, hits }
    }

    /// A resolver serving UDP and TCP on 127.0.0.1 in front of a fake upstream.
    struct Harness {
        resolver: Arc<Resolver>,
        udp: SocketAddr,
        tcp: SocketAddr,
        upstream: Upstream,
        allowed: Arc<Mutex<Vec<(IpAddr, u32)>>>,
        denied: Arc<Mutex<Vec<(String, u16)>>>,
        allow_fails: Arc<AtomicBool>,
        _stop: (oneshot::Sender<()>, oneshot::Sender<()>),
    }

    async fn harness(patterns: &[&str]) -> Harness {
        let upstream = fake_upstream().await;
        let allowed = Arc::new(Mutex::new(Vec::new()));
        let denied = Arc::new(Mutex::new(Vec::new()));
        let allow_fails = Arc::new(AtomicBool::new(false));
        let allow: AllowFn = {
            let (allowed, allow_fails) = (allowed.clone(), allow_fails.clone());
            Arc::new(move |addrs| {
                let (allowed, allow_fails) = (allowed.clone(), allow_fails.clone());
                Box::pin(async move {
                    // Slow on purpose: the reply must still wait for us.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    if allow_fails.load(Ordering::SeqCst) {
                        return Err("nft failed".to_owned());
                    }
                    allowed.lock().unwrap().extend(addrs);
                    Ok(())
                })
            })
        };
        let denied_fn: DeniedFn = {
            let denied = denied.clone();
            Arc::new(move |name, qtype| denied.lock().unwrap().push((name.to_owned(), qtype)))
        };
        let resolver = Resolver::with_upstream_timeout(
            rules(patterns),
            upstream.addr,
            allow,
            denied_fn,
            Duration::from_millis(300),
        );
        let udp_sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let tcp_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (udp, tcp) = (
            udp_sock.local_addr().unwrap(),
            tcp_listener.local_addr().unwrap(),
        );
        let (stop_udp, udp_stopped) = oneshot::channel::<()>();
        let (stop_tcp, tcp_stopped) = oneshot::channel::<()>();
        tokio::spawn(resolver.clone().serve_udp(udp_sock, async {
            let _ = udp_stopped.await;
        }));
        tokio::spawn(resolver.clone().serve_tcp(tcp_listener, async {
            let _ = tcp_stopped.await;
        }));
        Harness {
            resolver,
            udp,
            tcp,
            upstream,
            allowed,
            denied,
            allow_fails,
            _stop: (stop_udp, stop_tcp),
        }
    }

    impl Harness {
        fn allowed(&self) -> Vec<(IpAddr, u32)> {
            self.allowed.lock().unwrap().clone()
        }

        fn denied(&self) -> Vec<(String, u16)> {
            self.denied.lock().unwrap().clone()
        }

        /// Sends `msg` over UDP; the reply, if one comes within `wait`.
        async fn udp_raw(&self, msg: &[u8], wait: Duration) -> Option<Vec<u8>> {
            let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
            sock.send_to(msg, self.udp).await.unwrap();
            let mut buf = vec![0u8; 65535];
            let len = timeout(wait, sock.recv(&mut buf)).await.ok()?.unwrap();
            buf.truncate(len);
            Some(buf)
        }

        async fn udp(&self, msg: &[u8]) -> Vec<u8> {
            self.udp_raw(msg, Duration::from_secs(5))
                .await
                .expect("a reply over UDP")
        }

        async fn tcp(&self, stream: &mut TcpStream, msg: &[u8]) -> Vec<u8> {
            let mut framed = (msg.len() as u16).to_be_bytes().to_vec();
            framed.extend_from_slice(msg);
            stream.write_all(&framed).await.unwrap();
            let mut len = [0u8; 2];
            timeout(Duration::from_secs(5), stream.read_exact(&mut len))
                .await
                .expect("a reply over TCP")
                .unwrap();
            let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
            stream.read_exact(&mut reply).await.unwrap();
            reply
        }
    }

    fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    }

    #[test]
    fn rules_validation() {
        for good in [
            "example.com",
            "Example.COM.",
            "*.example.com",
            "a-b_c.d1",
            "com",
            &format!("{}.com", "a".repeat(63)),
        ] {
            DomainRules::new(&strings(&[good])).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        let long = vec!["abcdefghi"; 26].join("."); // 259 characters
        for bad in [
            "",
            ".",
            "*",
            "*.",
            "a..b",
            ".example.com",
            "example.com..",
            "a.*.com",
            "*.*.com",
            "**.com",
            "ex ample.com",
            "exa$mple.com",
            "bücher.de",
            &format!("{}.com", "a".repeat(64)),
            &long,
        ] {
            let err = DomainRules::new(&strings(&["ok.test", bad])).unwrap_err();
            let DnsError::InvalidPattern { pattern, .. } = &err;
            assert_eq!(pattern, bad);
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
        assert!(DomainRules::new(&[]).unwrap().is_empty());
    }

    #[test]
    fn rules_matching() {
        let r = rules(&["example.org", "*.example.com", "*.Deep.Test."]);
        assert!(r.allows("example.org"));
        assert!(r.allows("EXAMPLE.org."));
        assert!(!r.allows("www.example.org"));
        assert!(!r.allows("example.org.evil"));
        assert!(r.allows("a.example.com"));
        assert!(r.allows("a.b.example.com"));
        assert!(r.allows("A.B.Example.Com."));
        assert!(!r.allows("example.com"));
        assert!(!r.allows("badexample.com"));
        assert!(!r.allows("a.badexample.com"));
        assert!(!r.allows("example.com.evil"));
        assert!(r.allows("x.y.z.deep.test"));
        assert!(!r.allows("deep.test"));
        assert!(!r.allows(""));
        assert!(!r.allows("."));
        assert!(!r.allows("a..example.com"));
        assert!(!r.allows("a b.example.com"));

        let any = DomainRules::any();
        assert!(!any.is_empty());
        assert!(any.allows("anything.example"));
        assert!(any.allows_wire(&encode_name("Any.Thing")));
        assert!(!any.allows("a..b"));
        assert!(!any.allows_wire(&[0]));
        assert!(!any.allows_wire(b"\x03a.b\x00"));
    }

    #[test]
    fn wire_names_with_odd_labels_never_match() {
        let r = rules(&["allowed.test", "*.example.com"]);
        // One label "allowed.test" (a dot inside the label), not two labels.
        let mut wire = vec![12];
        wire.extend_from_slice(b"allowed.test");
        wire.push(0);
        assert!(!r.allows_wire(&wire));
        assert_eq!(display_name(&wire), "allowed\\.test");
        let mut wire = vec![9];
        wire.extend_from_slice(b"x.example");
        wire.extend_from_slice(&encode_name("com"));
        assert!(!r.allows_wire(&wire));
        assert!(r.allows_wire(&encode_name("ALLOWED.test")));
        assert!(!r.allows_wire(&[0]));
        assert_eq!(display_name(&[0]), ".");
    }

    #[test]
    fn name_parsing_bounds() {
        // A pointer to itself, a pointer forwards, a pointer loop through a label.
        for msg in [
            &[0xc0, 0x00][..],
            &[0xc0, 0x05, 0, 0, 0, 0][..],
            &[0x01, b'a', 0xc0, 0x00][..],
            &[0x40][..],
            &[0x05, b'a'][..],
        ] {
            assert_eq!(read_name(msg, 0), Err(Malformed), "{msg:?}");
        }
        // A backwards pointer is fine; the end offset is just past the pointer.
        let msg = [0x01, b'a', 0x00, 0x01, b'b', 0xc0, 0x00];
        let (name, end) = read_name(&msg, 3).unwrap();
        assert_eq!(name, [1, b'b', 1, b'a', 0]);
        assert_eq!(end, 7);
        // More than 255 octets once decompressed.
        let mut msg = Vec::new();
        for _ in 0..5 {
            msg.push(63);
            msg.extend_from_slice(&[b'x'; 63]);
        }
        msg.push(0);
        assert_eq!(read_name(&msg, 0), Err(Malformed));
    }

    #[tokio::test]
    async fn allowed_name_resolves_through_the_cname_chain() {
        let h = harness(&["allowed.test"]).await;
        let reply = h.udp(&query(0x1234, "allowed.test", TYPE_A, None)).await;
        // `allow` finished before the reply was sent.
        assert_eq!(
            h.allowed(),
            [(v4(192, 0, 2, 1), 300), (v4(192, 0, 2, 2), 60)]
        );
        assert_eq!(id_of(&reply), 0x1234);
        assert_eq!(rcode_of(&reply), RCODE_NOERROR);
        // Relayed unchanged: all five records, the unrelated one included.
        assert_eq!(answers_of(&reply).len(), 5);
        assert_eq!(
            reply,
            fake_answer(&query(0x1234, "allowed.test", TYPE_A, None), false).unwrap()
        );

        h.allowed.lock().unwrap().clear();
        let reply = h.udp(&query(7, "ALLOWED.Test.", TYPE_AAAA, None)).await;
        assert_eq!(rcode_of(&reply), RCODE_NOERROR);
        assert_eq!(h.allowed(), [("2001:db8::1".parse().unwrap(), 120)]);

        // Other types are forwarded; no address, no call to `allow`.
        h.allowed.lock().unwrap().clear();
        let reply = h.udp(&query(8, "allowed.test", TYPE_MX, None)).await;
        assert_eq!(rcode_of(&reply), RCODE_NOERROR);
        assert_eq!(answers_of(&reply).len(), 1);
        assert!(h.allowed().is_empty());

        let stats = h.resolver.stats();
        assert_eq!((stats.queries, stats.answered, stats.refused), (3, 3, 0));
        assert!(h.denied().is_empty());
    }

    #[tokio::test]
    async fn wildcard_semantics_over_the_wire() {
        let h = harness(&["*.example.com"]).await;
        let reply = h.udp(&query(1, "a.b.example.com", TYPE_A, None)).await;
        assert_eq!(rcode_of(&reply), RCODE_NOERROR);
        assert_eq!(h.allowed(), [(v4(192, 0, 2, 10), 50)]);
        for name in ["example.com", "badexample.com"] {
            let reply = h.udp(&query(2, name, TYPE_A, None)).await;
            assert_eq!(rcode_of(&reply), RCODE_NXDOMAIN, "{name}");
        }
        assert_eq!(
            h.denied(),
            [
                ("example.com".to_owned(), TYPE_A),
                ("badexample.com".to_owned(), TYPE_A)
            ]
        );
        assert_eq!(h.upstream.hits("example.com/udp"), 0);
    }

    #[tokio::test]
    async fn denied_name_gets_nxdomain_with_the_question() {
        let h = harness(&["allowed.test"]).await;
        let q = query(0xbeef, "Evil.Test", TYPE_AAAA, None);
        let reply = h.udp(&q).await;
        assert_eq!(id_of(&reply), 0xbeef);
        let flags = flags_of(&reply);
        assert_eq!(flags & MASK_RCODE, RCODE_NXDOMAIN);
        assert_ne!(flags & FLAG_QR, 0);
        assert_ne!(flags & FLAG_RD, 0);
        let rh = read_header(&reply).unwrap();
        assert_eq!((rh.qd, rh.an, rh.ns, rh.ar), (1, 0, 0, 0));
        // The question is echoed as asked (case preserved).
        assert_eq!(&reply[HEADER_LEN..], &q[HEADER_LEN..]);
        assert_eq!(h.denied(), [("evil.test".to_owned(), TYPE_AAAA)]);
        assert_eq!(h.resolver.stats().refused, 1);
        assert_eq!(h.upstream.hits("evil.test/udp"), 0);

        // A label with a dot inside is not the allowed two-label name.
        let mut q = header(9, FLAG_RD, [1, 0, 0, 0]);
        q.push(12);
        q.extend_from_slice(b"allowed.test");
        q.extend_from_slice(&[0, 0, 1, 0, 1]);
        assert_eq!(rcode_of(&h.udp(&q).await), RCODE_NXDOMAIN);
    }

    #[tokio::test]
    async fn allow_failure_gives_servfail() {
        let h = harness(&["allowed.test"]).await;
        h.allow_fails.store(true, Ordering::SeqCst);
        let reply = h.udp(&query(5, "allowed.test", TYPE_A, None)).await;
        assert_eq!(id_of(&reply), 5);
        assert_eq!(rcode_of(&reply), RCODE_SERVFAIL);
        assert_eq!(read_header(&reply).unwrap().an, 0);
        let stats = h.resolver.stats();
        assert_eq!((stats.allow_failures, stats.answered), (1, 0));
    }

    #[tokio::test]
    async fn malformed_messages_are_counted_and_never_crash() {
        let h = harness(&["allowed.test"]).await;
        let quick = Duration::from_millis(200);
        // No reply at all: empty, too short for a header, a response.
        let mut response = query(1, "allowed.test", TYPE_A, None);
        response[2] |= 0x80;
        for msg in [&[][..], &[1, 2, 3][..], &response[..]] {
            assert_eq!(h.udp_raw(msg, quick).await, None, "{msg:?}");
        }
        // FORMERR: wrong counts, a compression loop, a truncated question, trailing bytes, a
        // broken additional section.
        let mut two_questions = query(2, "allowed.test", TYPE_A, None);
        two_questions[5] = 2;
        let mut an_set = query(2, "allowed.test", TYPE_A, None);
        an_set[7] = 1;
        let mut no_question = header(2, FLAG_RD, [0, 0, 0, 0]);
        no_question.extend_from_slice(&[0; 4]);
        let mut self_loop = header(2, FLAG_RD, [1, 0, 0, 0]);
        self_loop.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1]);
        let mut label_loop = header(2, FLAG_RD, [1, 0, 0, 0]);
        label_loop.extend_from_slice(&[1, b'a', 0xc0, 0x0c, 0, 1, 0, 1]);
        let full = query(2, "allowed.test", TYPE_A, None);
        let cut = full[..full.len() - 3].to_vec();
        let mut trailing = full.clone();
        trailing.push(0);
        let mut bad_additional = full.clone();
        bad_additional[11] = 1;
        bad_additional.extend_from_slice(&[0, 0, 41]);
        for msg in [
            two_questions,
            an_set,
            no_question,
            self_loop,
            label_loop,
            cut,
            trailing,
            bad_additional,
        ] {
            let reply = h.udp_raw(&msg, quick).await.expect("FORMERR");
            assert_eq!(rcode_of(&reply), RCODE_FORMERR, "{msg:?}");
            assert_eq!(id_of(&reply), 2);
        }
        // NOTIMP: opcode STATUS.
        let mut status = query(3, "allowed.test", TYPE_A, None);
        status[2] |= 2 << 3;
        let reply = h.udp_raw(&status, quick).await.expect("NOTIMP");
        assert_eq!(rcode_of(&reply), RCODE_NOTIMP);
        // Oversized datagram: dropped.
        let mut huge = query(4, "allowed.test", TYPE_A, None);
        huge.resize(MAX_UDP_MESSAGE + 100, 0);
        assert_eq!(h.udp_raw(&huge, quick).await, None);

        let stats = h.resolver.stats();
        assert_eq!(stats.malformed, 13);
        assert_eq!(stats.queries, 13);
        assert_eq!(h.upstream.hits("allowed.test/udp"), 0);
        // Still serving.
        let reply = h.udp(&query(6, "allowed.test", TYPE_A, None)).await;
        assert_eq!(rcode_of(&reply), RCODE_NOERROR);
    }

    #[tokio::test]
    async fn set_rules_applies_to_the_next_query() {
        let h = harness(&["allowed.test"]).await;
        assert_eq!(
            rcode_of(&h.udp(&query(1, "other.test", TYPE_A, None)).await),
            RCODE_NXDOMAIN
        );
        h.resolver.set_rules(rules(&["other.test"]));
        assert_eq!(
            rcode_of(&h.udp(&query(2, "other.test", TYPE_A, None)).await),
            RCODE_NOERROR
        );
        assert_eq!(
            rcode_of(&h.udp(&query(3, "allowed.test", TYPE_A, None)).await),
            RCODE_NXDOMAIN
        );
        assert_eq!(h.allowed(), [(v4(192, 0, 2, 10), 50)]);
    }

    #[tokio::test]
    async fn truncated_upstream_reply_falls_back_to_tcp() {
        let h = harness(&["big.test"]).await;
        // The guest advertises 4096 bytes over EDNS: it gets the whole TCP answer over UDP.
        let reply = h.udp(&query(11, "big.test", TYPE_A, Some(4096))).await;
        assert_eq!(id_of(&reply), 11);
        assert_eq!(flags_of(&reply) & FLAG_TC, 0);
        assert_eq!(answers_of(&reply).len(), 40);
        assert_eq!(h.allowed().len(), 40);
        assert!(h.allowed().contains(&(v4(10, 0, 0, 39), 30)));
        assert_eq!(h.upstream.hits("big.test/udp"), 1);
        assert_eq!(h.upstream.hits("big.test/tcp"), 1);
        // Without EDNS the guest is limited to 512 bytes: it gets TC and only the question.
        let reply = h.udp(&query(12, "big.test", TYPE_A, None)).await;
        assert_ne!(flags_of(&reply) & FLAG_TC, 0);
        assert_eq!(rcode_of(&reply), RCODE_NOERROR);
        assert_eq!(read_header(&reply).unwrap().an, 0);
        // ... and over TCP it gets everything.
        let mut stream = TcpStream::connect(h.tcp).await.unwrap();
        let reply = h
            .tcp(&mut stream, &query(13, "big.test", TYPE_A, None))
            .await;
        assert_eq!(answers_of(&reply).len(), 40);
    }

    #[tokio::test]
    async fn dns_over_tcp() {
        let h = harness(&["allowed.test"]).await;
        let mut stream = TcpStream::connect(h.tcp).await.unwrap();
        let reply = h
            .tcp(&mut stream, &query(21, "allowed.test", TYPE_A, None))
            .await;
        assert_eq!(id_of(&reply), 21);
        assert_eq!(rcode_of(&reply), RCODE_NOERROR);
        assert_eq!(h.allowed().len(), 2);
        // Several queries on one connection.
        let reply = h
            .tcp(&mut stream, &query(22, "denied.test", TYPE_A, None))
            .await;
        assert_eq!((id_of(&reply), rcode_of(&reply)), (22, RCODE_NXDOMAIN));
        let mut two_questions = query(23, "allowed.test", TYPE_A, None);
        two_questions[5] = 2;
        let reply = h.tcp(&mut stream, &two_questions).await;
        assert_eq!(rcode_of(&reply), RCODE_FORMERR);
        let reply = h
            .tcp(&mut stream, &query(24, "allowed.test", TYPE_AAAA, None))
            .await;
        assert_eq!(rcode_of(&reply), RCODE_NOERROR);
        let stats = h.resolver.stats();
        assert_eq!(
            (
                stats.queries,
                stats.answered,
                stats.refused,
                stats.malformed
            ),
            (4, 2, 1, 1)
        );
    }

    #[tokio::test]
    async fn upstream_timeout_gives_servfail_after_one_retry() {
        let h = harness(&["slow.test"]).await;
        let reply = h.udp(&query(31, "slow.test", TYPE_A, None)).await;
        assert_eq!(id_of(&reply), 31);
        assert_eq!(rcode_of(&reply), RCODE_SERVFAIL);
        assert_eq!(h.upstream.hits("slow.test/udp"), 2);
        assert_eq!(h.resolver.stats().upstream_errors, 1);
        assert!(h.allowed().is_empty());
    }

    #[tokio::test]
    async fn upstream_unreachable_gives_servfail() {
        // Nothing listens on the port of a socket we just closed.
        let dead = UdpSocket::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        let resolver = Resolver::with_upstream_timeout(
            rules(&["allowed.test"]),
            dead,
            Arc::new(|_| Box::pin(async { Ok(()) })),
            Arc::new(|_, _| {}),
            Duration::from_millis(300),
        );
        let q = query(41, "allowed.test", TYPE_A, None);
        let reply = resolver.handle(&q, Transport::Udp).await.unwrap();
        assert_eq!(rcode_of(&reply), RCODE_SERVFAIL);
        assert_eq!(resolver.stats().upstream_errors, 1);
    }

    #[tokio::test]
    async fn shutdown_stops_serving() {
        let resolver = Resolver::new(
            DomainRules::default(),
            "127.0.0.1:9".parse().unwrap(),
            Arc::new(|_| Box::pin(async { Ok(()) })),
            Arc::new(|_, _| {}),
        );
        let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let udp = tokio::spawn(resolver.clone().serve_udp(sock, async {
            let _ = stopped.await;
        }));
        stop.send(()).unwrap();
        timeout(Duration::from_secs(2), udp).await.unwrap().unwrap();
        timeout(
            Duration::from_secs(2),
            resolver.clone().serve_tcp(listener, std::future::ready(())),
        )
        .await
        .unwrap();
        assert!(format!("{resolver:?}").contains("127.0.0.1:9"));
    }

    #[test]
    fn collect_addresses_bounds_the_cname_chain() {
        // q0 -> q1 -> ... -> q20, each with an A record: only the first MAX_CNAME_CHAIN links.
        let q = Question {
            name: encode_name("q0.test"),
            qtype: TYPE_A,
            qclass: CLASS_IN,
        };
        let mut msg = header(1, FLAG_QR, [1, 41, 0, 0]);
        write_question(&mut msg, &q);
        for i in 0..20 {
            let owner = encode_name(&format!("q{i}.test"));
            rr(
                &mut msg,
                &owner,
                TYPE_CNAME,
                5,
                &encode_name(&format!("q{}.test", i + 1)),
            );
        }
        for i in 0..21 {
            rr(
                &mut msg,
                &encode_name(&format!("q{i}.test")),
                TYPE_A,
                5,
                &[10, 0, 0, i],
            );
        }
        let addrs = collect_addresses(&msg, &q).unwrap();
        assert_eq!(addrs.len(), MAX_CNAME_CHAIN + 1);
        // A bad A record length is a malformed reply.
        let mut msg = header(1, FLAG_QR, [1, 1, 0, 0]);
        write_question(&mut msg, &q);
        rr(&mut msg, &q.name, TYPE_A, 5, &[10, 0, 0]);
        assert_eq!(collect_addresses(&msg, &q), Err(Malformed));
    }
}
