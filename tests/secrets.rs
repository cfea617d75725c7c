//! Secrets and the egress proxy end to end: a real sandbox from the `default` template whose
//! code sends HTTPS and HTTP requests without any credential, and upstream servers (in a
//! network namespace this test creates) that record the headers they receive.
//!
//! Topology (every address is the test's choice; nothing routes off the machine):
//!
//! ```text
//!  sandbox ── its namespace ── host-ns "emts-host-<pid>": the runtime (and its proxy) run here
//!                                 up0 198.51.100.1/24
//!                                  │ veth
//!                               inet-ns "emts-inet-<pid>": the "internet"
//!                                 .30 api.test   (HTTPS :443 and HTTP :80, recording)
//!                                 .31 plain.test (HTTPS, no rules: must not be intercepted)
//!                                 .32 bad.test   (HTTPS with a certificate of an unknown CA)
//!                                 .53 DNS for the three names
//! ```
//!
//! The upstream servers are Python's `http.server` behind `ssl`, with certificates the test
//! makes with the `openssl` binary; the runtime's egress proxy trusts the test's CA only
//! (`NetOptions::edge_upstream_ca`). `requests` is not in the default template: the test
//! zips it (with urllib3, idna, certifi, charset_normalizer) from a host Python that has it
//! (moto's venv, `EMBER_MOTO_SERVER`) and unpacks it in the guest's /tmp. curl and Node are
//! not in the default template either; the exec path is covered with `python3 -c` and urllib
//! (OpenSSL's store through `SSL_CERT_FILE`).

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ember_runtime::{CreateRequest, NetMode, NetworkPolicy, Runtime};
use ember_tests::*;

const HOST_IP: &str = "198.51.100.1";
const INET_IP: &str = "198.51.100.2";
const API_IP: &str = "198.51.100.30";
const PLAIN_IP: &str = "198.51.100.31";
const BAD_IP: &str = "198.51.100.32";
const DNS_IP: &str = "198.51.100.53";
const SOCKS_IP: &str = "198.51.100.40";

fn prerequisites(test: &str) -> bool {
    let missing = ember_tests::missing_tools(&[
        ("nft", "--version"),
        ("ip", "-V"),
        ("openssl", "version"),
        ("python3", "--version"),
    ]);
    let root = ember_tests::is_root();
    if missing.is_empty() && root && Path::new("/dev/kvm").exists() {
        return true;
    }
    skip(
        test,
        &format!(
            "the secrets test needs root, /dev/kvm and the nft, ip, openssl and python3 \
             binaries (missing: {missing:?}, root: {root})"
        ),
    );
    false
}

fn sh(cmd: &str, dir: &Path) {
    let out = Command::new("bash")
        .args(["-euc", cmd])
        .current_dir(dir)
        .output()
        .expect("bash");
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The test's PKI: a CA the proxy trusts, leaves for api.test and plain.test from it, and a
/// leaf for bad.test from a CA nobody trusts. Returns plain.test's DER fingerprint.
fn make_certs(dir: &Path) -> String {
    let ca = |name: &str, cn: &str| {
        format!(
            "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
             -keyout {name}.key -out {name}.pem -subj '/CN={cn}' -days 2 \
             -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign"
        )
    };
    let leaf = |name: &str, host: &str, ca: &str| {
        format!(
            "openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
             -keyout {name}.key -out {name}.csr -subj '/CN={host}' && \
             printf 'subjectAltName=DNS:{host}\\nbasicConstraints=CA:FALSE\\n\
             extendedKeyUsage=serverAuth\\n' > {name}.ext && \
             openssl x509 -req -in {name}.csr -CA {ca}.pem -CAkey {ca}.key -CAcreateserial \
             -out {name}.pem -days 2 -extfile {name}.ext"
        )
    };
    sh(&ca("ca", "ember test upstream CA"), dir);
    sh(&ca("rogue", "rogue CA"), dir);
    sh(&leaf("api", "api.test", "ca"), dir);
    sh(&leaf("plain", "plain.test", "ca"), dir);
    sh(&leaf("bad", "bad.test", "rogue"), dir);
    let out = Command::new("bash")
        .args([
            "-euc",
            "openssl x509 -in plain.pem -outform DER | sha256sum | cut -d' ' -f1",
        ])
        .current_dir(dir)
        .output()
        .expect("fingerprint");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

const UPSTREAM: &str = r#"
import http.server, json, socketserver, ssl, sys, threading
d, log = sys.argv[1], sys.argv[2]
lock = threading.Lock()
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        rec = {"server": self.server.label, "path": self.path,
               "headers": {k.lower(): v for k, v in self.headers.items()}}
        with lock, open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")
        body = ("recorded by " + self.server.label).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
def serve(addr, port, label, cert=None):
    s = S((addr, port), H)
    s.label = label
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(f"{d}/{cert}.pem", f"{d}/{cert}.key")
        s.socket = ctx.wrap_socket(s.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=s.serve_forever, daemon=True).start()
serve("198.51.100.30", 443, "api-tls", "api")
serve("198.51.100.30", 80, "api-http")
serve("198.51.100.31", 443, "plain-tls", "plain")
serve("198.51.100.32", 443, "bad-tls", "bad")
def socks(addr, port):
    # A SOCKS5 proxy (no authentication, CONNECT by IPv4) that records each CONNECT.
    import socket
    l = socket.create_server((addr, port))
    def pipe(a, b):
        try:
            while (d := a.recv(65536)):
                b.sendall(d)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    def one(c):
        try:
            c.recv(3)
            c.sendall(b"\x05\x00")
            req = c.recv(10)
            ip = socket.inet_ntoa(req[4:8])
            port = int.from_bytes(req[8:10], "big")
            with lock, open(log, "a") as f:
                f.write(json.dumps({"server": "socks", "path": f"{ip}:{port}"}) + "\n")
            u = socket.create_connection((ip, port), timeout=10)
            c.sendall(b"\x05\x00\x00\x01" + bytes(4) + bytes(2))
            threading.Thread(target=pipe, args=(c, u), daemon=True).start()
            pipe(u, c)
        except OSError:
            c.close()
    def loop():
        while True:
            c, _ = l.accept()
            threading.Thread(target=one, args=(c,), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()
socks("198.51.100.40", 1080)
print("ready", flush=True)
threading.Event().wait()
"#;

/// The upstream servers' process, killed on drop.
struct Upstream(Child);

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_upstream(ns: &str, dir: &Path, log: &Path) -> Upstream {
    std::fs::write(dir.join("upstream.py"), UPSTREAM).unwrap();
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "python3"])
        .arg(dir.join("upstream.py"))
        .arg(dir)
        .arg(log)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the upstream servers");
    let mut line = String::new();
    let stdout = child.stdout.take().expect("stdout");
    BufReader::new(stdout).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready", "the upstream servers did not start");
    Upstream(child)
}

/// The upstream's records so far.
fn records(log: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A value nobody wrote down: read from the kernel's random source, never in this binary.
fn random_value(prefix: &str) -> String {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .expect("urandom");
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{prefix}-{hex}")
}

/// Whether any file under `dir` holds `needle` (streamed in chunks, sparse files included).
fn files_containing(dir: &Path, needles: &[&str]) -> Vec<String> {
    let mut hits = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(p);
            } else if ft.is_file() {
                for n in needles {
                    if file_contains(&p, n.as_bytes()) {
                        hits.push(format!("{} holds {n}", p.display()));
                    }
                }
            }
        }
    }
    hits
}

fn file_contains(path: &Path, needle: &[u8]) -> bool {
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let mut buf = vec![0u8; 8 << 20];
    let keep = needle.len() - 1;
    let mut have = 0;
    loop {
        let n = match f.read(&mut buf[have..]) {
            Ok(0) | Err(_) => return false,
            Ok(n) => n,
        };
        let end = have + n;
        if buf[..end].windows(needle.len()).any(|w| w == needle) {
            return true;
        }
        let tail = end.saturating_sub(keep);
        buf.copy_within(tail..end, 0);
        have = end - tail;
    }
}

fn run_py(rt: &Runtime, id: &str, code: &str) -> String {
    ember_tests::run_code_text(rt, id, code)
        .0
        .trim()
        .to_string()
}

fn exec_out(rt: &Runtime, id: &str, argv: &[&str]) -> String {
    use ember_agent::protocol::{EventKind, ExecRequest};
    let req = ExecRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let mut out = String::new();
    let mut err = String::new();
    rt.exec(id, &req, &mut |ev| {
        match ev {
            EventKind::Stdout { data } => out.push_str(&String::from_utf8_lossy(data)),
            EventKind::Stderr { data } => err.push_str(&String::from_utf8_lossy(data)),
            _ => {}
        }
        true
    })
    .unwrap_or_else(|e| panic!("exec {argv:?}: {e}"));
    format!(
        "{}{}",
        out.trim(),
        if err.is_empty() {
            String::new()
        } else {
            format!(" STDERR:{err}")
        }
    )
}

const GUEST_HELPERS: &str = r#"
import glob, sys, zipfile
if "/tmp/site" not in sys.path:
    for w in glob.glob("/tmp/wheels/*.zip"):
        zipfile.ZipFile(w).extractall("/tmp/site")
    sys.path.insert(0, "/tmp/site")
import requests
def get(url, **kw):
    try:
        r = requests.get(url, timeout=20, **kw)
        return f"{r.status_code}|{r.headers.get('x-ember-edge-error', '')}|{r.text.strip()}"
    except Exception as e:
        return "ERR|" + type(e).__name__ + "|" + str(e)[:300]
print("helpers ready", requests.__version__)
"#;

/// Zips requests and its dependencies from a host Python that has them: the venv of moto's
/// server (`EMBER_MOTO_SERVER`, which CI installs; moto depends on requests), else `python3`.
fn requests_bundle(out: &Path) {
    let python = std::env::var_os("EMBER_MOTO_SERVER")
        .map(|m| PathBuf::from(m).with_file_name("python"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("python3"));
    let code = "import importlib, os, sys, zipfile\n\
                z = zipfile.ZipFile(sys.argv[1], 'w', zipfile.ZIP_DEFLATED)\n\
                for m in ['requests', 'urllib3', 'idna', 'certifi', 'charset_normalizer']:\n\
                \x20   d = os.path.dirname(importlib.import_module(m).__file__)\n\
                \x20   for root, _, fs in os.walk(d):\n\
                \x20       if '__pycache__' in root: continue\n\
                \x20       for f in fs:\n\
                \x20           p = os.path.join(root, f)\n\
                \x20           z.write(p, os.path.relpath(p, os.path.dirname(d)))\n\
                z.close()\n";
    let o = Command::new(&python)
        .args(["-c", code])
        .arg(out)
        .output()
        .expect("python");
    assert!(
        o.status.success(),
        "no host Python with requests ({}; run scripts/s3-server.sh, whose venv has it): {}",
        python.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

/// The test's namespaces, PKI and upstream servers.
struct Topo {
    inet: Netns,
    host: Netns,
    pki: tempfile::TempDir,
    log: PathBuf,
    plain_fp: String,
    _upstream: Upstream,
}

impl Topo {
    /// Namespaces `emts-<tag>-{inet,host}-<pid>` with the peers of the module's diagram.
    fn create(tag: &str) -> Topo {
        let pid = std::process::id();
        let inet = Netns::create(&format!("emts-{tag}-inet-{pid}"));
        let host = Netns::create(&format!("emts-{tag}-host-{pid}"));
        host.ip(&[
            "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", &inet.name,
        ]);
        host.ip(&["addr", "add", &format!("{HOST_IP}/24"), "dev", "up0"]);
        host.ip(&["link", "set", "up0", "up"]);
        host.ip(&["route", "add", "default", "via", INET_IP]);
        for a in [INET_IP, API_IP, PLAIN_IP, BAD_IP, DNS_IP, SOCKS_IP] {
            inet.ip(&["addr", "add", &format!("{a}/24"), "dev", "eth0"]);
        }
        inet.ip(&["link", "set", "eth0", "up"]);
        ember_tests::dns_server(
            inet.run(|| UdpSocket::bind((DNS_IP, 53)).expect("bind dns")),
            &[
                ("api.test", [198, 51, 100, 30]),
                ("plain.test", [198, 51, 100, 31]),
                ("bad.test", [198, 51, 100, 32]),
            ],
        );
        let pki = tempfile::tempdir().unwrap();
        let plain_fp = make_certs(pki.path());
        let log = pki.path().join("upstream.jsonl");
        let upstream = start_upstream(&inet.name, pki.path(), &log);
        Topo {
            inet,
            host,
            pki,
            log,
            plain_fp,
            _upstream: upstream,
        }
    }
}

#[test]
fn credentials_are_added_at_the_edge_and_never_enter_the_sandbox() {
    let test = "credentials_are_added_at_the_edge_and_never_enter_the_sandbox";
    if !prerequisites(test) {
        return;
    }
    let t_all = Instant::now();
    template("default");
    let topo = Topo::create("a");
    let (inet, host, pki, log, plain_fp) =
        (&topo.inet, &topo.host, &topo.pki, &topo.log, &topo.plain_fp);
    let _ = inet;
    let home = tempfile::Builder::new()
        .prefix("ember-secrets-test-")
        .tempdir()
        .unwrap();
    let mut cfg = runtime_config(home.path());
    cfg.network.uplink = Some("up0".into());
    cfg.network.dns_upstream = Some(SocketAddr::from(([198, 51, 100, 53], 53)));
    cfg.network.edge_upstream_ca = Some(pki.path().join("ca.pem"));
    enter_netns(&PathBuf::from("/run/netns").join(&host.name));
    let rt = Runtime::open(cfg).unwrap_or_else(|e| panic!("runtime: {e}"));

    let v1 = random_value("sk-ember-one");
    let v2 = random_value("sk-ember-two");
    rt.create_secret("apikey", &v1, Some("the test's key"))
        .unwrap();
    let listed = serde_json::to_string(&rt.list_secrets().unwrap()).unwrap();
    assert!(
        listed.contains("apikey") && !listed.contains(&v1),
        "{listed}"
    );

    let policy: NetworkPolicy = serde_json::from_value(serde_json::json!({
        "mode": "egress",
        "rules": {
            "api.test": [{"transform": {"headers": {"Authorization": "Bearer ${secrets.apikey}"}}}],
            "bad.test": [{"transform": {"headers": {"X-Api-Key": "${secrets.apikey}"}}}],
            "nx.test": [{"transform": {"headers": {"X-Api-Key": "${secrets.apikey}"}}}],
        }
    }))
    .unwrap();
    assert_eq!(policy.mode, NetMode::Egress);
    // A rule that names a secret that does not exist is refused at create.
    let mut missing = policy.clone();
    missing.rules.get_mut("api.test").unwrap()[0]
        .transform
        .headers
        .insert("X-Other".into(), "${secrets.nope}".into());
    let e = rt
        .create(&CreateRequest {
            template: Some("default".into()),
            network: missing,
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"nope\"") && e.contains("does not exist"),
        "{e}"
    );
    let t0 = Instant::now();
    let id = rt
        .create(&CreateRequest {
            template: Some("default".into()),
            network: policy,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("create: {e}"))
        .id;
    eprintln!(
        "figure: create of a sandbox with rules (CA bundle written): {:.0} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    // The rules are shown with placeholders, never values.
    let shown = serde_json::to_string(&rt.get(&id).unwrap()).unwrap();
    assert!(!shown.contains(&v1), "{shown}");
    let net = serde_json::to_string(&rt.network(&id).unwrap()).unwrap();
    assert!(
        net.contains("${secrets.apikey}") && !net.contains(&v1),
        "{net}"
    );

    // requests (not in the default template): its packages from a host Python that has them,
    // zipped and unpacked in the guest's /tmp.
    let bundle = pki.path().join("requests.zip");
    requests_bundle(&bundle);
    let mut f = std::fs::File::open(&bundle).unwrap();
    rt.write_file(&id, "/tmp/wheels/requests.zip", &mut f)
        .unwrap_or_else(|e| panic!("upload the requests bundle: {e}"));
    let ready = run_py(&rt, &id, GUEST_HELPERS);
    assert!(ready.starts_with("helpers ready"), "{ready}");

    // 1. HTTPS through requests: the code sends no credential (or a forged one), the upstream
    //    receives the secret.
    let t1 = Instant::now();
    let out = run_py(
        &rt,
        &id,
        "print(get('https://api.test/v1/models'))\n\
         print(get('https://api.test/v1/forged', headers={'Authorization': 'Bearer forged'}))\n\
         print(get('http://api.test/plain-http'))",
    );
    eprintln!(
        "figure: three proxied requests from the guest: {:.0} ms",
        t1.elapsed().as_secs_f64() * 1e3
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert_eq!(lines[0], "200||recorded by api-tls", "{out}");
    assert_eq!(lines[1], "200||recorded by api-tls", "{out}");
    assert_eq!(lines[2], "200||recorded by api-http", "{out}");
    let recs = records(log);
    let want = format!("Bearer {v1}");
    for path in ["/v1/models", "/v1/forged", "/plain-http"] {
        let r = recs
            .iter()
            .find(|r| r["path"] == path)
            .unwrap_or_else(|| panic!("no upstream record of {path}: {recs:?}"));
        assert_eq!(r["headers"]["authorization"], want.as_str(), "{path}");
        assert_eq!(r["headers"]["host"], "api.test", "{path}");
    }

    // 2. exec: OpenSSL's store through SSL_CERT_FILE (python3 -c, urllib).
    let out = exec_out(
        &rt,
        &id,
        &[
            "python3",
            "-c",
            "import urllib.request as u; r = u.urlopen('https://api.test/exec', timeout=20); \
             print(r.status, r.read().decode())",
        ],
    );
    assert_eq!(out, "200 recorded by api-tls", "{out}");
    assert!(
        records(log)
            .iter()
            .any(|r| r["path"] == "/exec" && r["headers"]["authorization"] == want.as_str()),
        "exec's request lacks the credential"
    );

    // 3. A host without rules is not intercepted: its own certificate reaches the guest.
    //    A rule host's address with another TLS name is refused (no credential, no bypass).
    //    A bad upstream certificate is a 502 with the reason.
    let before = records(log).len();
    let out = run_py(
        &rt,
        &id,
        "import hashlib, socket, ssl\n\
         c = ssl.create_default_context(); c.check_hostname = False; c.verify_mode = ssl.CERT_NONE\n\
         s = c.wrap_socket(socket.create_connection(('plain.test', 443), timeout=15), server_hostname='plain.test')\n\
         print(hashlib.sha256(s.getpeercert(True)).hexdigest()); s.close()\n\
         try:\n\
         \x20   s = ssl.create_default_context().wrap_socket(socket.create_connection(('api.test', 443), timeout=15), server_hostname='plain.test')\n\
         \x20   print('connected'); s.close()\n\
         except Exception as e:\n\
         \x20   print('refused', type(e).__name__)\n\
         print(get('https://bad.test/x'))\n\
         print(get('http://172.30.0.1:15080/x', headers={'Host': 'nx.test'}))",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    // A rule host that does not resolve (asked of the proxy directly: the guest's own lookup
    // fails first otherwise).
    assert!(lines[3].starts_with("502|cannot resolve"), "{out}");
    assert_eq!(lines[0], *plain_fp, "plain.test was intercepted: {out}");
    assert!(lines[1].starts_with("refused"), "{out}");
    assert!(
        lines[2].starts_with("502|upstream TLS") && lines[2].contains("certificate"),
        "{out}"
    );
    assert_eq!(
        records(log).len(),
        before,
        "an upstream got a request it should not have"
    );

    // 3b. egress_proxy: what the policy admits goes through the SOCKS5 proxy, the egress
    //     proxy's own upstream connections included; then back to direct.
    let mut with_socks = rt.network(&id).unwrap().network.policy;
    with_socks.egress_proxy = Some(ember_runtime::netpolicy::policy::EgressProxy {
        address: format!("{SOCKS_IP}:1080"),
    });
    rt.set_network(&id, &with_socks)
        .unwrap_or_else(|e| panic!("set_network with egress_proxy: {e}"));
    let out = run_py(
        &rt,
        &id,
        "import hashlib, socket, ssl\n\
         c = ssl.create_default_context(); c.check_hostname = False; c.verify_mode = ssl.CERT_NONE\n\
         s = c.wrap_socket(socket.create_connection(('plain.test', 443), timeout=15), server_hostname='plain.test')\n\
         print(hashlib.sha256(s.getpeercert(True)).hexdigest()); s.close()\n\
         print(get('https://api.test/via-socks'))",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert_eq!(lines[0], *plain_fp, "{out}");
    assert_eq!(lines[1], "200||recorded by api-tls", "{out}");
    let recs = records(log);
    for dst in [format!("{PLAIN_IP}:443"), format!("{API_IP}:443")] {
        assert!(
            recs.iter()
                .any(|r| r["server"] == "socks" && r["path"] == dst.as_str()),
            "no CONNECT {dst} at the SOCKS5 proxy: {recs:?}"
        );
    }
    assert!(recs
        .iter()
        .any(|r| r["path"] == "/via-socks" && r["headers"]["authorization"] == want.as_str()));
    with_socks.egress_proxy = None;
    rt.set_network(&id, &with_socks).unwrap();

    // 4. Rotation applies to the next request; a deleted secret is a 502, never a request
    //    without the credential.
    rt.rotate_secret("apikey", &v2).unwrap();
    let out = run_py(&rt, &id, "print(get('https://api.test/rotated'))");
    assert_eq!(out, "200||recorded by api-tls");
    let recs = records(log);
    let r = recs.iter().find(|r| r["path"] == "/rotated").unwrap();
    assert_eq!(
        r["headers"]["authorization"],
        format!("Bearer {v2}").as_str()
    );
    rt.delete_secret("apikey").unwrap();
    let n = records(log).len();
    let out = run_py(&rt, &id, "print(get('https://api.test/deleted'))");
    assert!(
        out.starts_with("502|header Authorization: no secret \"apikey\""),
        "{out}"
    );
    assert_eq!(
        records(log).len(),
        n,
        "a request went out without its credential"
    );
    let stats = rt.network(&id).unwrap().stats.expect("stats");
    let edge = stats.edge.expect("edge stats");
    eprintln!("edge stats: {edge:?}");
    assert!(
        edge.failed == 3
            && edge.refused_connections == 1
            && edge.forwarded == 6
            && edge.relayed >= 1
    );

    // 5. The pause snapshot (guest memory) and everything else under $EMBER_HOME hold
    //    neither value.
    let t5 = Instant::now();
    rt.pause(&id).unwrap_or_else(|e| panic!("pause: {e}"));
    let hits = files_containing(home.path(), &[&v1, &v2]);
    assert!(hits.is_empty(), "{hits:?}");
    eprintln!(
        "figure: pause and scan of $EMBER_HOME (memory file included): {:.0} ms",
        t5.elapsed().as_secs_f64() * 1e3
    );
    // The audit log names the secret and the failures, not the value (checked above).
    let audit = serde_json::to_string(
        &rt.audit(&ember_runtime::AuditFilter {
            sandbox: Some(id.clone()),
            ..Default::default()
        })
        .unwrap(),
    )
    .unwrap();
    assert!(audit.contains("edge_failures"), "{audit}");

    // 6. The guest's environment, /proc and files (resumed): no value. The needles are put
    //    together in the guest only now, after the memory was checked.
    let (a1, b1) = v1.split_at(8);
    let (a2, b2) = v2.split_at(8);
    let out = run_py(
        &rt,
        &id,
        &format!(
            "import os\n\
             needles = [{a1:?} + {b1:?}, {a2:?} + {b2:?}]\n\
             hits = []\n\
             for k, v in os.environ.items():\n\
             \x20   if any(n in v for n in needles): hits.append('env ' + k)\n\
             for p in os.listdir('/proc'):\n\
             \x20   if not p.isdigit() or int(p) == os.getpid(): continue\n\
             \x20   for f in ('environ', 'cmdline'):\n\
             \x20       try:\n\
             \x20           b = open(f'/proc/{{p}}/{{f}}', 'rb').read()\n\
             \x20       except OSError: continue\n\
             \x20       if any(n.encode() in b for n in needles): hits.append(f'/proc/{{p}}/{{f}}')\n\
             for top in ('/etc', '/tmp', '/root', '/home', '/var', '/run', '/opt', '/srv'):\n\
             \x20   for d, _, fs in os.walk(top):\n\
             \x20       for f in fs:\n\
             \x20           p = os.path.join(d, f)\n\
             \x20           try:\n\
             \x20               if os.path.getsize(p) > 64 << 20: continue\n\
             \x20               b = open(p, 'rb').read()\n\
             \x20           except OSError: continue\n\
             \x20           if any(n.encode() in b for n in needles): hits.append(p)\n\
             print('hits', hits)"
        ),
    );
    assert_eq!(out, "hits []", "{out}");
    let _ = rt.kill(&id);
    drop(rt);
    eprintln!(
        "figure: the whole secrets test: {:.1} s",
        t_all.elapsed().as_secs_f64()
    );
}

/// `ember serve` in the test's host namespace, killed on drop.
struct Serve {
    child: Child,
    url: String,
    home: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        // SIGTERM first: the server then removes its host table. Its sandboxes were killed by
        // the script (a leftover one goes with its timeout).
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let t = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_e2b_sdk_creates_a_sandbox_with_rules_and_a_secret() {
    let test = "the_e2b_sdk_creates_a_sandbox_with_rules_and_a_secret";
    if !prerequisites(test) {
        return;
    }
    let Some(venv) = std::env::var_os("EMBER_E2B_VENV").map(PathBuf::from) else {
        skip(
            test,
            "no E2B Python SDK venv (EMBER_E2B_VENV; run `bash scripts/e2b-sdks.sh`)",
        );
        return;
    };
    template("default");
    let topo = Topo::create("b");
    // This thread (and so the server and the SDK's Python) in the test's host namespace
    // (not `ip netns exec`, which mounts another /sys and hides the cgroup controllers).
    enter_netns(&PathBuf::from("/run/netns").join(&topo.host.name));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let home = tempfile::Builder::new()
        .prefix("ember-secrets-e2b-")
        .tempdir()
        .unwrap();
    let log_file = std::fs::File::create(home.path().join("serve.log")).unwrap();
    let child = Command::new(bin("ember"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--uplink", "up0", "--dns-upstream", DNS_IP])
        .arg("--edge-upstream-ca")
        .arg(topo.pki.path().join("ca.pem"))
        // Another range than the in-process runtime of the other test of this file.
        .args(["--uid-base", "260000"])
        .env("EMBER_HOME", home.path())
        .env("EMBER_VMM", bin("ember-vmm"))
        .env("EMBER_JAILER", bin("ember-jailer"))
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .expect("start ember serve");
    let srv = Serve {
        child,
        url: format!("http://127.0.0.1:{port}"),
        home,
    };
    let token_path = srv.home.path().join("token");
    let t0 = Instant::now();
    let ready = (|| {
        while t0.elapsed() < Duration::from_secs(60) {
            if ureq::get(&format!("{}/healthz", srv.url)).call().is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        false
    })();
    let serve_log =
        || std::fs::read_to_string(srv.home.path().join("serve.log")).unwrap_or_default();
    assert!(ready, "ember serve did not start: {}", serve_log());
    eprintln!("ember serve ready in {:.1} s", t0.elapsed().as_secs_f64());
    let token = std::fs::read_to_string(&token_path).expect("token");
    let token = token.trim().to_string();

    // The native routes and the CLI: a value goes in, never comes out.
    let native = random_value("sk-ember-native");
    let auth = format!("Bearer {token}");
    let created: serde_json::Value = ureq::post(&format!("{}/v1/secrets", srv.url))
        .set("Authorization", &auth)
        .send_json(serde_json::json!({"name": "native", "value": native, "description": "d"}))
        .unwrap_or_else(|e| panic!("POST /v1/secrets: {e}"))
        .into_json()
        .unwrap();
    assert_eq!(created["version"], 1, "{created}");
    let dup = ureq::post(&format!("{}/v1/secrets", srv.url))
        .set("Authorization", &auth)
        .send_json(serde_json::json!({"name": "native", "value": "x"}));
    assert!(matches!(dup, Err(ureq::Error::Status(409, _))), "{dup:?}");
    let rotated: serde_json::Value = ureq::put(&format!("{}/v1/secrets/native", srv.url))
        .set("Authorization", &auth)
        .send_json(serde_json::json!({"value": format!("{native}-2")}))
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(rotated["version"], 2, "{rotated}");
    let cli = |args: &[&str], stdin: &str| {
        let o = ember_tests::ember_client(&srv.url, &token, args, stdin.as_bytes());
        assert!(
            o.status.success(),
            "ember {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let cli_value = random_value("sk-ember-cli");
    assert_eq!(
        cli(&["secret", "create", "from-cli"], &format!("{cli_value}\n")).trim(),
        "from-cli (version 1)"
    );
    let listed = cli(&["secret", "ls", "--json"], "");
    let listed_http = ureq::get(&format!("{}/v1/secrets", srv.url))
        .set("Authorization", &auth)
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    for text in [&listed, &listed_http] {
        assert!(
            text.contains("\"native\"") && text.contains("\"from-cli\""),
            "{text}"
        );
        assert!(
            !text.contains(&native) && !text.contains(&cli_value),
            "{text}"
        );
    }
    cli(&["secret", "rm", "from-cli"], "");
    let gone = ureq::delete(&format!("{}/v1/secrets/native", srv.url))
        .set("Authorization", &auth)
        .call();
    assert!(gone.is_ok(), "{gone:?}");
    let gone = ureq::delete(&format!("{}/v1/secrets/native", srv.url))
        .set("Authorization", &auth)
        .call();
    assert!(matches!(gone, Err(ureq::Error::Status(404, _))), "{gone:?}");

    let value = random_value("sk-ember-e2b");
    let value2 = random_value("sk-ember-e2b-rotated");
    let script = repo_root().join("tests/e2b/test_secrets.py");
    let out = Command::new(venv.join("bin/python"))
        .arg(&script)
        .env("E2B_API_KEY", &token)
        .env("E2B_API_URL", &srv.url)
        .env("E2B_SANDBOX_URL", &srv.url)
        .env("EMBER_TEST_SECRET", &value)
        .env("EMBER_TEST_SECRET2", &value2)
        .output()
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the SDK script failed:\n{stdout}\n{stderr}\nserver log:\n{}",
        serve_log()
    );
    for v in [&value, &value2] {
        assert!(!stdout.contains(v.as_str()) && !stderr.contains(v.as_str()));
    }
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(v["version"], 1, "{v}");
    assert_eq!(v["rotated_version"], 2, "{v}");
    assert_eq!(v["info_name"], "openai-key", "{v}");
    assert_eq!(v["out_rotated"], "200", "{v}");
    assert_eq!(v["destroyed"], true, "{v}");
    assert_eq!(v["out"], "200 recorded by api-tls", "{v}");
    assert_eq!(
        v["network"]["rules"]["api.test"][0]["transform"]["headers"]["Authorization"],
        "Bearer ${e2b.secrets.openai-key}",
        "{v}"
    );
    assert_eq!(
        v["network"]["allowOut"],
        serde_json::json!(["api.test"]),
        "{v}"
    );
    assert_eq!(v["listed"], serde_json::json!(["openai-key"]), "{v}");
    assert_eq!(v["after_delete"], serde_json::json!([]), "{v}");
    let recs = records(&topo.log);
    let r = recs
        .iter()
        .find(|r| r["path"] == "/e2b-sdk")
        .unwrap_or_else(|| panic!("no upstream record: {recs:?}"));
    assert_eq!(
        r["headers"]["authorization"],
        format!("Bearer {value}").as_str()
    );
    let r = recs
        .iter()
        .find(|r| r["path"] == "/e2b-rotated")
        .unwrap_or_else(|| panic!("no upstream record: {recs:?}"));
    assert_eq!(
        r["headers"]["authorization"],
        format!("Bearer {value2}").as_str()
    );
    let hits = files_containing(srv.home.path(), &[&value, &value2, &native, &cli_value]);
    assert!(hits.is_empty(), "{hits:?}");
}
