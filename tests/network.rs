//! Sandbox networking end to end: real sandboxes restored from the `default` template (which
//! has a network device), the runtime's namespaces, nftables rules and resolvers, and peers
//! that live in network namespaces this test creates.
//!
//! Topology (every address is the test's choice; nothing routes off the machine):
//!
//! ```text
//!  sandboxes ── (their namespaces) ── host-ns "emt-host-<pid>": the runtime runs here
//!                                        up0 198.51.100.1/24 (the "host's own address",
//!                                        a listener on :8081 counts connections)
//!                                         │ veth
//!                                      inet-ns "emt-inet-<pid>": the "internet"
//!                                        eth0 198.51.100.2/24 + .10 (allowed peer), .20
//!                                        (denied peer), .53 (DNS), 169.254.169.254 (a
//!                                        metadata look-alike that counts connections)
//! ```
//!
//! The runtime's uplink is `up0`, whose only neighbour is the test's "internet" namespace:
//! even a broken rule cannot send a packet off the machine.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_runtime::Runtime;
use ember_runtime::{CreateRequest, NetMode, NetworkPolicy};
use ember_tests::*;

const HOST_IP: &str = "198.51.100.1";
const INET_IP: &str = "198.51.100.2";
const PEER_OK: &str = "198.51.100.10";
const PEER_DENIED: &str = "198.51.100.20";
const DNS_IP: &str = "198.51.100.53";
const METADATA: &str = "169.254.169.254";

/// Fails (CI) or explains (elsewhere) when the host cannot run this test.
fn prerequisites(test: &str) -> bool {
    let missing = ember_tests::missing_tools(&[("nft", "--version"), ("ip", "-V")]);
    let root = ember_tests::is_root();
    if missing.is_empty() && root && std::path::Path::new("/dev/kvm").exists() {
        return true;
    }
    let why = format!(
        "network tests need root, /dev/kvm, and the nft and ip binaries (missing: {missing:?}, \
         root: {root})"
    );
    ember_tests::skip(test, &why);
    false
}

/// Counts connections accepted by a listener.
#[derive(Default)]
struct Hits(AtomicU64);

impl Hits {
    fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A TCP server that answers every connection with `banner` and counts them.
fn tcp_banner(l: TcpListener, banner: &'static str) -> Arc<Hits> {
    let hits = Arc::new(Hits::default());
    let h = hits.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            h.0.fetch_add(1, Ordering::SeqCst);
            let _ = s.write_all(banner.as_bytes());
        }
    });
    hits
}

/// A UDP server that echoes with a prefix.
fn udp_echo(u: UdpSocket) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        while let Ok((n, from)) = u.recv_from(&mut buf) {
            let mut out = b"ECHO:".to_vec();
            out.extend_from_slice(&buf[..n]);
            let _ = u.send_to(&out, from);
        }
    });
}

/// The test's two namespaces and its peers.
struct Topo {
    /// Kept for its lifetime: dropping it deletes the namespace.
    _inet: Netns,
    host: Netns,
    peer_ok: Arc<Hits>,
    peer_denied: Arc<Hits>,
    metadata: Arc<Hits>,
    host_own: Arc<Hits>,
    dns_seen: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Topo {
    fn create() -> Topo {
        // Unique per test: the tests of this file run in parallel threads of one process.
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let inet = Netns::create(&format!("emt-inet-{pid}-{n}"));
        let host = Netns::create(&format!("emt-host-{pid}-{n}"));
        host.ip(&[
            "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", &inet.name,
        ]);
        host.ip(&["addr", "add", &format!("{HOST_IP}/24"), "dev", "up0"]);
        host.ip(&["link", "set", "up0", "up"]);
        host.ip(&["route", "add", "default", "via", INET_IP]);
        for a in [INET_IP, PEER_OK, PEER_DENIED, DNS_IP] {
            inet.ip(&["addr", "add", &format!("{a}/24"), "dev", "eth0"]);
        }
        inet.ip(&["addr", "add", &format!("{METADATA}/32"), "dev", "lo"]);
        inet.ip(&["link", "set", "eth0", "up"]);
        // Replies to the NATed sandboxes go back to the host namespace.
        let bind = |ip: &'static str, port: u16| {
            inet.run(move || TcpListener::bind((ip, port)).expect("bind a peer"))
        };
        let peer_ok = tcp_banner(bind(PEER_OK, 8080), "PEER-OK");
        let peer_denied = tcp_banner(bind(PEER_DENIED, 8080), "PEER-DENIED");
        let metadata = tcp_banner(bind(METADATA, 80), "METADATA");
        udp_echo(inet.run(|| UdpSocket::bind((PEER_OK, 9999)).expect("bind udp")));
        let dns_seen = ember_tests::dns_server(
            inet.run(|| UdpSocket::bind((DNS_IP, 53)).expect("bind dns")),
            &[
                ("allowed.test", [198, 51, 100, 10]),
                ("denied.test", [198, 51, 100, 20]),
            ],
        );
        let host_own = tcp_banner(
            host.run(|| TcpListener::bind((HOST_IP, 8081)).expect("bind host")),
            "HOST",
        );
        Topo {
            _inet: inet,
            host,
            peer_ok,
            peer_denied,
            metadata,
            host_own,
            dns_seen,
        }
    }

    fn host_path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.host.name)
    }
}

/// A runtime on a fresh home, opened from a thread that lives in the test's host namespace
/// (its threads and commands are there too).
fn runtime_in(topo: &Topo, home: &std::path::Path) -> Runtime {
    runtime_in_with(topo, home, true)
}

fn runtime_in_with(topo: &Topo, home: &std::path::Path, kill_on_drop: bool) -> Runtime {
    let mut cfg = runtime_config(home);
    cfg.kill_on_drop = kill_on_drop;
    cfg.network.uplink = Some("up0".into());
    cfg.network.dns_upstream = Some(SocketAddr::from(([198, 51, 100, 53], 53)));
    enter_netns(&topo.host_path());
    Runtime::open(cfg).unwrap_or_else(|e| panic!("runtime: {e}"))
}

fn create(rt: &Runtime, policy: NetworkPolicy) -> String {
    let req = CreateRequest {
        template: Some("default".into()),
        network: policy,
        ..Default::default()
    };
    rt.create(&req).unwrap_or_else(|e| panic!("create: {e}")).id
}

fn egress() -> NetworkPolicy {
    NetworkPolicy {
        mode: NetMode::Egress,
        ..Default::default()
    }
}

/// Runs Python in the sandbox and returns its stdout, trimmed.
fn py(rt: &Runtime, id: &str, code: &str) -> String {
    let (out, _) = ember_tests::run_code_text(rt, id, code);
    out.trim().to_string()
}

const HELPERS: &str = r#"
import socket
def tcp(host, port, timeout=15):
    try:
        s = socket.create_connection((host, port), timeout=timeout)
        s.settimeout(timeout)
        data = s.recv(64).decode()
        s.close()
        return "OK:" + data
    except Exception as e:
        return "ERR:" + type(e).__name__
def udp(host, port, timeout=10):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(timeout)
        s.sendto(b"ping", (host, port))
        data, _ = s.recvfrom(64)
        return "OK:" + data.decode()
    except Exception as e:
        return "ERR:" + type(e).__name__
def resolve(name):
    try:
        return "OK:" + ",".join(sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET)}))
    except Exception as e:
        return "ERR:" + type(e).__name__
"#;

fn tcp(rt: &Runtime, id: &str, host: &str, port: u16) -> String {
    py(rt, id, &format!("print(tcp({host:?}, {port}))"))
}

fn own_namespaces(tag_prefix: &str) -> BTreeSet<String> {
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(tag_prefix))
                .collect()
        })
        .unwrap_or_default()
}

fn host_links(topo: &Topo, prefix: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["-n", &topo.host.name, "-o", "link", "show"])
        .output()
        .expect("ip link");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_string())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

fn host_tables(topo: &Topo) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", &topo.host.name, "nft", "list", "tables"])
        .output()
        .expect("nft list tables");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn tag_of(home: &std::path::Path) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(home.as_os_str().as_encoded_bytes());
    d[..2].iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn policies_are_enforced_and_changeable_at_run_time() {
    if !prerequisites("policies_are_enforced_and_changeable_at_run_time") {
        return;
    }
    template("default");
    let topo = Topo::create();
    let home = tempfile::tempdir().unwrap();
    let tag = tag_of(home.path());
    let rt = runtime_in(&topo, home.path());
    let t0 = Instant::now();

    let none = create(&rt, NetworkPolicy::default());
    let open = create(&rt, egress());
    let named = create(
        &rt,
        NetworkPolicy {
            mode: NetMode::Egress,
            allow_domains: vec!["allowed.test".into()],
            ..Default::default()
        },
    );
    let listed = create(
        &rt,
        NetworkPolicy {
            mode: NetMode::Egress,
            deny_cidrs: vec![PEER_DENIED.into()],
            ..Default::default()
        },
    );
    let limited = create(
        &rt,
        NetworkPolicy {
            mode: NetMode::Egress,
            max_connections: Some(2),
            ..Default::default()
        },
    );
    eprintln!(
        "[network] 5 sandboxes in {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    for id in [&none, &open, &named, &listed, &limited] {
        py(&rt, id, HELPERS);
    }
    let mut failures: Vec<String> = Vec::new();
    let mut expect = |what: &str, got: String, want_prefix: &str| {
        // Printed with the verdict, so a failure names the check even when output is captured.
        eprintln!("[network] {what}: {got} (want {want_prefix}…)");
        if !got.starts_with(want_prefix) {
            failures.push(format!("{what}: got {got:?}, want {want_prefix}…"));
        }
    };

    // none: nothing, not even the host or the resolver.
    expect("none → peer", tcp(&rt, &none, PEER_OK, 8080), "ERR");
    expect("none → host", tcp(&rt, &none, HOST_IP, 8081), "ERR");
    expect(
        "none → resolver",
        py(&rt, &none, "print(resolve('allowed.test'))"),
        "ERR",
    );

    // egress: the internet, not the deny list.
    expect(
        "egress → peer (TCP)",
        tcp(&rt, &open, PEER_OK, 8080),
        "OK:PEER-OK",
    );
    expect(
        "egress → peer (UDP)",
        py(&rt, &open, &format!("print(udp({PEER_OK:?}, 9999))")),
        "OK:ECHO:ping",
    );
    expect("egress → metadata", tcp(&rt, &open, METADATA, 80), "ERR");
    expect("egress → host", tcp(&rt, &open, HOST_IP, 8081), "ERR");
    expect(
        "egress → resolver → allowed.test",
        py(&rt, &open, "print(resolve('allowed.test'))"),
        "OK:198.51.100.10",
    );
    // Another sandbox: its namespace's uplink address and its host-side address (the pool).
    expect(
        "egress → other sandbox (ns side)",
        tcp(&rt, &open, "10.199.0.2", 8000),
        "ERR",
    );
    expect(
        "egress → other sandbox (host side)",
        tcp(&rt, &open, "10.199.0.1", 8000),
        "ERR",
    );

    // deny_cidrs.
    expect(
        "listed → peer",
        tcp(&rt, &listed, PEER_OK, 8080),
        "OK:PEER-OK",
    );
    expect(
        "listed → denied peer",
        tcp(&rt, &listed, PEER_DENIED, 8080),
        "ERR",
    );

    // allow_domains: the allowed name resolves and connects; the denied one does not
    // resolve, and its address is unreachable directly.
    expect(
        "domains → resolve allowed.test",
        py(&rt, &named, "print(resolve('allowed.test'))"),
        "OK:198.51.100.10",
    );
    expect(
        "domains → allowed peer",
        tcp(&rt, &named, PEER_OK, 8080),
        "OK:PEER-OK",
    );
    expect(
        "domains → resolve denied.test",
        py(&rt, &named, "print(resolve('denied.test'))"),
        "ERR",
    );
    expect(
        "domains → denied peer by address",
        tcp(&rt, &named, PEER_DENIED, 8080),
        "ERR",
    );

    // max_connections: two held open, the third refused; one closes, a new one passes.
    let limited_check = |again: &str| {
        py(
            &rt,
            &limited,
            &format!(
                "{again}held = [socket.create_connection(({PEER_OK:?}, 8080), timeout=15) for _ in range(2)]\n\
                 third = tcp({PEER_OK:?}, 8080)\n\
                 held.pop().close()\n\
                 import time; time.sleep(2)\n\
                 print('two held, third', third, 'after a close', tcp({PEER_OK:?}, 8080))"
            ),
        )
    };
    let mut got = limited_check("");
    if !got.starts_with("two held, third ERR") {
        // Seen once, in CI on a slow kvm_pvm host with kernel 6.18: the third connection
        // passed. Suspected: the kernel's connection counting (nf_conncount, which `ct count`
        // uses) was reworked in late 2025 and fixed since for miscounts (upstream
        // "nf_conncount: increase the connection clean up limit to 64", "fix tracking of
        // connections from localhost"). Checked once more from closed connections; a rule
        // that never limits still fails.
        eprintln!("[network] limited → 3 concurrent connections: {got}; checking once more");
        got = limited_check("for s in held: s.close()\nimport time; time.sleep(2)\n");
    }
    expect(
        "limited → 3 concurrent connections",
        got,
        "two held, third ERR",
    );
    assert_eq!(
        topo.metadata.get(),
        0,
        "the metadata look-alike was reached"
    );
    assert_eq!(topo.host_own.get(), 0, "the host's own address was reached");
    assert_eq!(topo.peer_denied.get(), 0, "the denied peer was reached");
    assert!(
        topo.peer_ok.get() >= 3,
        "the allowed peer saw {}",
        topo.peer_ok.get()
    );
    let seen = topo.dns_seen.lock().unwrap().clone();
    assert!(
        !seen.iter().any(|n| n == "denied.test"),
        "a refused name reached the upstream resolver: {seen:?}"
    );

    // Counters and samples of refused connections.
    let info = rt.network(&named).unwrap();
    let stats = info.stats.expect("stats of a running sandbox");
    assert!(stats.drops.dropped >= 1, "{stats:?}");
    assert!(
        stats
            .drops
            .dropped_destinations
            .iter()
            .any(|d| d == PEER_DENIED),
        "{stats:?}"
    );
    assert!(
        stats.denied_names.iter().any(|n| n == "denied.test"),
        "{stats:?}"
    );
    assert!(
        stats.drops.resolved.iter().any(|a| a == PEER_OK),
        "{stats:?}"
    );

    // A policy changed at run time takes effect on the next connection, both ways.
    rt.set_network(&none, &egress()).unwrap();
    expect(
        "none → egress → peer",
        tcp(&rt, &none, PEER_OK, 8080),
        "OK:PEER-OK",
    );
    rt.set_network(&none, &NetworkPolicy::default()).unwrap();
    expect(
        "egress → none → peer",
        tcp(&rt, &none, PEER_OK, 8080),
        "ERR",
    );
    let bad = NetworkPolicy {
        mode: NetMode::Egress,
        allow_cidrs: vec!["10.0.0.1/8".into()],
        ..Default::default()
    };
    let e = rt.set_network(&none, &bad).unwrap_err().to_string();
    assert!(e.contains("10.0.0.0/8"), "{e}");

    // One sandbox's namespace: TAP, veth, rules; the host side: one table.
    let mine = own_namespaces(&format!("em-{tag}-"));
    assert_eq!(mine.len(), 5, "{mine:?}");
    assert_eq!(host_links(&topo, &format!("vh{tag}")).len(), 5);
    assert!(host_tables(&topo).contains(&format!("ember_{tag}")));
    let ns = mine.iter().next().unwrap();
    let rules = Command::new("ip")
        .args([
            "netns", "exec", ns, "nft", "-a", "list", "table", "inet", "ember",
        ])
        .output()
        .unwrap();
    let n_rules = String::from_utf8_lossy(&rules.stdout)
        .lines()
        .filter(|l| l.contains("# handle") && !l.contains("chain") && !l.contains("set "))
        .count();
    eprintln!("[network] nftables rules in one sandbox's namespace: {n_rules}");

    for id in [&none, &open, &named, &listed, &limited] {
        rt.kill(id).unwrap();
    }
    // The audit log has the refused connections.
    let audit = rt
        .audit(&ember_runtime::AuditFilter {
            sandbox: Some(named.clone()),
            ..Default::default()
        })
        .unwrap();
    assert!(
        audit.iter().any(|a| a.call == "network_refused"),
        "no network_refused audit record"
    );
    assert!(own_namespaces(&format!("em-{tag}-")).is_empty());
    assert!(host_links(&topo, &format!("vh{tag}")).is_empty());
    drop(rt);
    assert!(
        !host_tables(&topo).contains(&format!("ember_{tag}")),
        "the host table outlived the runtime"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A minimal WebSocket + HTTP server in the guest (stdlib only), in a thread of the
/// sandbox's IPython: `/ws` echoes frames, anything else answers `hello from the guest`.
const GUEST_SERVER: &str = r#"
import socket, threading, hashlib, base64
def _serve(conn):
    try:
        req = b""
        while b"\r\n\r\n" not in req:
            chunk = conn.recv(4096)
            if not chunk:
                return
            req += chunk
        head = req.split(b"\r\n\r\n")[0].decode()
        lines = head.split("\r\n")
        path = lines[0].split(" ")[1]
        hdrs = {l.split(":", 1)[0].strip().lower(): l.split(":", 1)[1].strip() for l in lines[1:] if ":" in l}
        if path == "/ws" and hdrs.get("upgrade", "").lower() == "websocket":
            key = hdrs["sec-websocket-key"]
            acc = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
            conn.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + acc + "\r\n\r\n").encode())
            while True:
                h = conn.recv(2)
                if len(h) < 2:
                    return
                op, ln = h[0] & 0x0f, h[1] & 0x7f
                if ln == 126:
                    ln = int.from_bytes(conn.recv(2), "big")
                mask = conn.recv(4)
                data = b""
                while len(data) < ln:
                    data += conn.recv(ln - len(data))
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
                if op == 8:
                    conn.sendall(b"\x88\x00")
                    return
                reply = b"echo:" + data
                conn.sendall(bytes([0x80 | op, len(reply)]) + reply)
        else:
            body = ("hello from the guest " + path).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    finally:
        conn.close()
def _loop(srv):
    while True:
        c, _ = srv.accept()
        threading.Thread(target=_serve, args=(c,), daemon=True).start()
_srv = socket.socket()
_srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
_srv.bind(("0.0.0.0", 8000))
_srv.listen(16)
threading.Thread(target=_loop, args=(_srv,), daemon=True).start()
print("serving")
"#;

fn http_get(addr: SocketAddr, path: &str, headers: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    // Longer than the proxy's own time limits (each answered with a status that says so).
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn ws_echo(addr: SocketAddr, path: &str, headers: &str, msg: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    // Longer than the proxy's 30 s response-head timeout: a slow guest is then a 504 that
    // says so, not a bare close.
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n"
    )
    .unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b).unwrap_or(0) == 0 {
            return format!("closed after {:?}", String::from_utf8_lossy(&head));
        }
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    if !head.starts_with("HTTP/1.1 101") {
        return head;
    }
    let mask = [1u8, 2, 3, 4];
    let mut frame = vec![0x81, 0x80 | msg.len() as u8];
    frame.extend_from_slice(&mask);
    frame.extend(msg.bytes().enumerate().map(|(i, c)| c ^ mask[i % 4]));
    s.write_all(&frame).unwrap();
    let mut h = [0u8; 2];
    s.read_exact(&mut h).unwrap();
    let mut data = vec![0u8; (h[1] & 0x7f) as usize];
    s.read_exact(&mut data).unwrap();
    let _ = s.write_all(&[0x88, 0x80, 0, 0, 0, 0]);
    String::from_utf8_lossy(&data).into_owned()
}

#[test]
fn exposed_ports_serve_http_and_websockets_to_the_caller_only() {
    if !prerequisites("exposed_ports_serve_http_and_websockets_to_the_caller_only") {
        return;
    }
    template("default");
    let topo = Topo::create();
    enter_netns(&topo.host_path());

    // `ember serve` on the host namespace's loopback (it inherits this thread's namespace).
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let shome = tempfile::tempdir().unwrap();
    let log = std::fs::File::create(shome.path().join("serve.log")).unwrap();
    /// Stops the server however the test ends (SIGTERM first: the server then removes its
    /// host table), so that a failed assertion leaves no `ember serve` behind.
    struct StopServer(std::process::Child);
    impl Drop for StopServer {
        fn drop(&mut self) {
            let _ = Command::new("kill").arg(self.0.id().to_string()).status();
            let t = Instant::now();
            while matches!(self.0.try_wait(), Ok(None)) && t.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut server = Command::new(bin("ember"))
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--uplink",
            "up0",
        ])
        .args(["--dns-upstream", DNS_IP])
        .env("EMBER_HOME", shome.path())
        .env("EMBER_VMM", bin("ember-vmm"))
        .env("EMBER_JAILER", bin("ember-jailer"))
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .map(StopServer)
        .expect("ember serve");
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let url = format!("http://{addr}");
    let t0 = Instant::now();
    while ureq::get(&format!("{url}/healthz")).call().is_err() {
        if let Ok(Some(st)) = server.0.try_wait() {
            panic!(
                "ember serve exited ({st}): {}",
                std::fs::read_to_string(shome.path().join("serve.log")).unwrap_or_default()
            );
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "ember serve did not come up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let token = std::fs::read_to_string(shome.path().join("token"))
        .unwrap()
        .trim()
        .to_string();
    let api = |method: &str, path: &str| {
        ureq::request(method, &format!("{url}{path}"))
            .set("authorization", &format!("Bearer {token}"))
    };
    let mk = |network: serde_json::Value| -> String {
        let v: serde_json::Value = api("POST", "/v1/sandboxes")
            .send_json(serde_json::json!({"template": "default", "network": network}))
            .unwrap()
            .into_json()
            .unwrap();
        v["id"].as_str().unwrap().to_string()
    };
    let code = |id: &str, src: &str| -> String {
        let body = api("POST", &format!("/v1/sandboxes/{id}/code"))
            .send_json(serde_json::json!({ "code": src }))
            .unwrap()
            .into_string()
            .unwrap();
        body.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["type"] == "stdout")
            .filter_map(|v| {
                use base64::Engine;
                let b = base64::engine::general_purpose::STANDARD
                    .decode(v["data"].as_str()?)
                    .ok()?;
                Some(String::from_utf8_lossy(&b).into_owned())
            })
            .collect::<String>()
            .trim()
            .to_string()
    };
    // Policy none: the web app needs no egress to be served.
    let a = mk(serde_json::json!("none"));
    let b = mk(serde_json::json!("egress"));
    assert_eq!(code(&a, GUEST_SERVER), "serving");
    code(&b, HELPERS);
    let expose = |id: &str, port: u16, public: bool| {
        api("POST", &format!("/v1/sandboxes/{id}/ports"))
            .send_json(serde_json::json!({"port": port, "public": public}))
            .unwrap();
    };
    let base = format!("/v1/sandboxes/{a}/ports/8000");
    let auth = format!("Authorization: Bearer {token}\r\n");
    // Not exposed yet.
    let r = http_get(addr, &format!("{base}/x"), &auth);
    assert!(r.starts_with("HTTP/1.1 404"), "{r}");
    expose(&a, 8000, false);
    // Private: no token, no answer.
    let r = http_get(addr, &format!("{base}/x"), "");
    assert!(r.starts_with("HTTP/1.1 401"), "{r}");
    let r = http_get(addr, &format!("{base}/hello?q=1"), &auth);
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.contains("hello from the guest /hello?q=1"), "{r}");
    // The sandbox's own token works too (and is not passed on).
    let net: serde_json::Value = api("GET", &format!("/v1/sandboxes/{a}/network"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(net["ports"][0]["port"], 8000, "{net}");
    let own = net["access_token"].as_str().unwrap().to_string();
    let r = http_get(
        addr,
        &format!("{base}/t"),
        &format!("X-Access-Token: {own}\r\n"),
    );
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    let t_ws = Instant::now();
    let echoed = ws_echo(addr, &format!("{base}/ws"), &auth, "hi there");
    eprintln!(
        "[network] WebSocket echo through the proxy: {:.0} ms",
        t_ws.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(
        echoed,
        "echo:hi there",
        "after {:?}; the server's log:\n{}",
        t_ws.elapsed(),
        std::fs::read_to_string(shome.path().join("serve.log")).unwrap_or_default()
    );
    // Public: no token needed.
    expose(&a, 8000, true);
    let r = http_get(addr, &format!("{base}/pub"), "");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    // A port nothing listens on.
    expose(&a, 8001, true);
    let r = http_get(addr, &format!("/v1/sandboxes/{a}/ports/8001/"), "");
    assert!(r.starts_with("HTTP/1.1 502"), "{r}");

    // Another sandbox cannot reach it: the guests share one address, each in its own
    // namespace, and nothing routes between namespaces.
    for target in ["10.199.0.2", "10.199.0.1", "172.30.0.1"] {
        let from_b = code(&b, &format!("print(tcp({target:?}, 8000))"));
        assert!(from_b.starts_with("ERR"), "{target}: {from_b}");
    }
    for id in [&a, &b] {
        api("DELETE", &format!("/v1/sandboxes/{id}"))
            .call()
            .unwrap();
    }
    let r = http_get(addr, &format!("{base}/gone"), &auth);
    assert!(
        r.starts_with("HTTP/1.1 409") || r.starts_with("HTTP/1.1 404"),
        "{r}"
    );
    drop(server);
}

#[test]
fn fifty_networked_sandboxes_leave_nothing_and_a_restart_reclaims_a_crash() {
    if !prerequisites("fifty_networked_sandboxes_leave_nothing_and_a_restart_reclaims_a_crash") {
        return;
    }
    template("default");
    let topo = Topo::create();
    let home = tempfile::tempdir().unwrap();
    let tag = tag_of(home.path());
    let rt = runtime_in(&topo, home.path());
    let mut setup_ms = Vec::new();
    for round in 0..5 {
        let mut ids = Vec::new();
        for i in 0..10 {
            let t = Instant::now();
            let p = if i % 2 == 0 {
                egress()
            } else {
                NetworkPolicy::default()
            };
            ids.push(create(&rt, p));
            setup_ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        assert_eq!(
            own_namespaces(&format!("em-{tag}-")).len(),
            10,
            "round {round}"
        );
        for id in ids {
            rt.kill(&id).unwrap();
        }
        assert!(
            own_namespaces(&format!("em-{tag}-")).is_empty(),
            "round {round}"
        );
        assert!(
            host_links(&topo, &format!("vh{tag}")).is_empty(),
            "round {round}"
        );
    }
    setup_ms.sort_by(f64::total_cmp);
    eprintln!(
        "[network] 50 creates: median {:.0} ms, p95 {:.0} ms",
        setup_ms[25], setup_ms[47]
    );

    // A server that stops with networked sandboxes running, one of whose VMMs then dies
    // while no server watches: the restart re-attaches the live one (its policy works
    // again) and reclaims the dead one's namespace.
    drop(rt);
    let rt2 = runtime_in_with(&topo, home.path(), false);
    let live = create(&rt2, egress());
    let dead = create(&rt2, egress());
    py(&rt2, &live, HELPERS);
    let dead_pid = rt2.get(&dead).unwrap().pid.expect("pid");
    drop(rt2);
    let _ = Command::new("kill")
        .args(["-9", &dead_pid.to_string()])
        .status();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(own_namespaces(&format!("em-{tag}-")).len(), 2);
    let rt = runtime_in(&topo, home.path());
    assert_eq!(
        own_namespaces(&format!("em-{tag}-")).len(),
        1,
        "the dead VM's namespace was not reclaimed"
    );
    py(&rt, &live, HELPERS);
    let got = tcp(&rt, &live, PEER_OK, 8080);
    assert!(got.starts_with("OK:PEER-OK"), "{got}");
    let named = py(&rt, &live, "print(resolve('allowed.test'))");
    assert!(named.starts_with("OK:198.51.100.10"), "{named}");
    rt.kill(&live).unwrap();
    drop(rt);
    assert!(own_namespaces(&format!("em-{tag}-")).is_empty());
    assert!(host_links(&topo, &format!("vh{tag}")).is_empty());
    assert!(!host_tables(&topo).contains(&format!("ember_{tag}")));
}

/// The plumbing and the rules without a VM: a namespace per sandbox with its TAP (owned by
/// the jail's uid), veth pair and table; every policy renders into rules nft accepts; a
/// policy change re-renders atomically; teardown leaves nothing.
#[test]
fn namespaces_and_rules_without_a_vm() {
    if !prerequisites("namespaces_and_rules_without_a_vm") {
        return;
    }
    use ember_runtime::netpolicy::{NetManager, NetOptions};
    let topo = Topo::create();
    enter_netns(&topo.host_path());
    let home = tempfile::tempdir().unwrap();
    let tag = tag_of(home.path());
    let m = NetManager::new(
        home.path(),
        NetOptions {
            uplink: Some("up0".into()),
            dns_upstream: Some(SocketAddr::from(([198, 51, 100, 53], 53))),
            ..Default::default()
        },
    )
    .unwrap();
    let full = NetworkPolicy {
        mode: NetMode::Egress,
        allow_cidrs: vec!["192.168.7.0/24".into()],
        deny_cidrs: vec![PEER_DENIED.into(), "10.2.0.0/16".into()],
        allow_domains: vec!["allowed.test".into(), "*.example.com".into()],
        bandwidth_kib: Some(512),
        max_connections: Some(16),
        rules: Default::default(),
        egress_proxy: None,
    };
    // The cost a networked sandbox adds to create and kill (reported, not asserted).
    let mut ms = Vec::new();
    for i in 0..20 {
        let t = Instant::now();
        let n = m.setup(&format!("jail-t{i}"), 4000 + i, &full).unwrap();
        let up = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        m.teardown(&n);
        ms.push((up, t.elapsed().as_secs_f64() * 1e3));
    }
    let mut up: Vec<f64> = ms.iter().map(|m| m.0).collect();
    let mut down: Vec<f64> = ms.iter().map(|m| m.1).collect();
    up.sort_by(f64::total_cmp);
    down.sort_by(f64::total_cmp);
    eprintln!(
        "[network] namespace set-up (egress, domains, limits): median {:.1} ms, p95 {:.1} ms; \
         teardown: median {:.1} ms, p95 {:.1} ms",
        up[10], up[18], down[10], down[18]
    );
    let a = m
        .setup("jail-a", 4242, &full)
        .unwrap_or_else(|e| panic!("{e}"));
    let b = m.setup("jail-b", 4243, &NetworkPolicy::default()).unwrap();
    assert_ne!(a.slot, b.slot);
    let ns_cmd = |net: &str, args: &[&str]| -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", net])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let tap = ns_cmd(&a.name, &["ip", "-d", "link", "show", "tap0"]);
    assert!(tap.contains("user 4242"), "{tap}");
    let rules = ns_cmd(&a.name, &["nft", "list", "table", "inet", "ember"]);
    for needle in [
        "169.254.0.0/16",
        "198.51.100.20",
        "192.168.7.0/24",
        "@dns4",
        "ct count",
    ] {
        assert!(rules.contains(needle), "{needle} missing:\n{rules}");
    }
    let routes = ns_cmd(&a.name, &["ip", "route"]);
    assert!(routes.contains("default via 10.199."), "{routes}");
    let routes_b = ns_cmd(&b.name, &["ip", "route"]);
    assert!(
        !routes_b.contains("default"),
        "mode none has a route out: {routes_b}"
    );
    // A resolver answers on the gateway of a with egress.
    let q = ns_cmd(&a.name, &["ss", "-lun"]);
    assert!(q.contains("172.30.0.1:53"), "{q}");
    // Change b to egress and a to none: re-rendered, routes follow.
    m.update(&b, &full).unwrap();
    m.update(&a, &NetworkPolicy::default()).unwrap();
    assert!(ns_cmd(&b.name, &["ip", "route"]).contains("default via"));
    assert!(!ns_cmd(&a.name, &["ip", "route"]).contains("default"));
    let rules = ns_cmd(&a.name, &["nft", "list", "table", "inet", "ember"]);
    assert!(
        !rules.contains("dport 53"),
        "none still serves DNS:\n{rules}"
    );
    assert!(host_tables(&topo).contains(&format!("ember_{tag}")));
    let stats = m.stats(&a).unwrap();
    assert_eq!(stats.drops.dropped, 0);
    m.teardown(&a);
    m.teardown(&b);
    m.teardown(&b);
    assert!(own_namespaces(&format!("em-{tag}-")).is_empty());
    assert!(host_links(&topo, &format!("vh{tag}")).is_empty());
    // Reclaim: a namespace left behind by a "crash" is deleted, a kept one is not.
    let c = m.setup("jail-c", 4244, &NetworkPolicy::default()).unwrap();
    let d = m.setup("jail-d", 4245, &NetworkPolicy::default()).unwrap();
    let keep: BTreeSet<String> = [d.name.clone()].into();
    assert_eq!(m.reclaim(&keep), 1);
    assert!(!c.path.exists());
    assert!(d.path.exists());
    m.teardown(&d);
    m.remove_host_table();
    assert!(!host_tables(&topo).contains(&format!("ember_{tag}")));
}
