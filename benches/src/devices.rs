//! Device benchmarks: virtio-vsock, virtio-net and virtio-blk measured from inside one booted
//! guest, each beside the same measurement made directly on the host in the same run.
//!
//! | measure | guest side | host side (`host_value`) |
//! |---|---|---|
//! | `vsock_rtt_median`, `vsock_rtt_p95` | 64-byte ping-pong, host ↔ guest echo over vsock | the same over a Unix socket pair between two host threads |
//! | `vsock_host_to_guest`, `vsock_guest_to_host` | one stream, MiB/s | a Unix socket pair between two host threads |
//! | `net_guest_to_peer`, `net_peer_to_guest` | TCP between the guest and a peer in a network namespace behind the TAP | TCP over a veth pair between two namespaces |
//! | `blk_seq_read`, `blk_seq_write` | `O_DIRECT` 1 MiB requests on a raw rw disk, MiB/s | the same offsets on the same image file, buffered `pread`/`pwrite` as the VMM does them |
//! | `blk_rand_read_4k`, `blk_rand_write_4k` | `O_DIRECT` 4 KiB requests at random aligned offsets, IOPS | the same |
//!
//! `ratio` is `value / host_value`: the fraction of the host's throughput the guest gets, or
//! how many times the host's latency a guest round trip takes. On kvm_pvm the guest kernel is
//! emulated, so guest figures there measure that emulation far more than the devices.
//!
//! The guest work is a small Python helper started once through the agent's `exec`; it serves
//! requests on a vsock control port, one JSON line each.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::stats::summarize;

const MIB: usize = 1 << 20;
const AGENT_PORT: u32 = 1024;
const HELPER_PORT: u32 = 7000;
const BOOT_TIMEOUT: Duration = Duration::from_secs(600);
const IO_TIMEOUT: Duration = Duration::from_secs(900);
const HOST_IP: &str = "10.78.0.1";
const GUEST_IP: &str = "10.78.0.2";

/// One measured figure, with the host-side equivalent where there is one.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DeviceResult {
    /// Always "ember" (the system under test).
    pub system: String,
    /// What was measured (see the module table).
    pub measure: String,
    /// The guest's figure.
    pub value: f64,
    /// Its unit: "ms", "MiB/s" or "IOPS".
    pub unit: String,
    /// The same measurement on the host, same unit.
    pub host_value: Option<f64>,
    /// `value / host_value`.
    pub ratio: Option<f64>,
    /// Samples (round trips, requests) or bytes moved (MiB) behind the figure.
    pub n: usize,
}

impl DeviceResult {
    fn new(measure: &str, value: f64, unit: &str, host_value: Option<f64>, n: usize) -> Self {
        Self {
            system: "ember".into(),
            measure: measure.into(),
            value,
            unit: unit.into(),
            host_value,
            ratio: host_value.filter(|h| *h > 0.0).map(|h| value / h),
            n,
        }
    }
}

/// How much each benchmark moves.
#[derive(Debug, Clone, Copy)]
struct Plan {
    rtt_n: usize,
    vsock_bytes: usize,
    net_up: usize,
    net_down: usize,
    blk_seq: usize,
    blk_rand_ops: usize,
    disk_bytes: usize,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                rtt_n: 50,
                vsock_bytes: 8 * MIB,
                net_up: 8 * MIB,
                net_down: 4 * MIB,
                blk_seq: 16 * MIB,
                blk_rand_ops: 200,
                disk_bytes: 64 * MIB,
            }
        } else {
            Self {
                rtt_n: 300,
                vsock_bytes: 64 * MIB,
                net_up: 64 * MIB,
                net_down: 16 * MIB,
                blk_seq: 64 * MIB,
                blk_rand_ops: 1000,
                disk_bytes: 256 * MIB,
            }
        }
    }
}

/// The guest helper: a threaded server on vsock port argv[1]; requests are JSON lines, each
/// answered by optional `{"ready": true}` lines and a final line with `"done": true`.
const GUEST_HELPER: &str = r#"
import fcntl, json, mmap, os, random, socket, struct, sys, threading, time, traceback
V = socket.AF_VSOCK
CHUNK = 1 << 20

def listener(fam, port):
    s = socket.socket(fam, socket.SOCK_STREAM)
    if fam == socket.AF_INET:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
    else:
        s.bind((socket.VMADDR_CID_ANY, port))
    s.listen(16)
    return s

def sink(c, n=None):
    buf = memoryview(bytearray(CHUNK))
    got = 0
    t = None
    while n is None or got < n:
        k = c.recv_into(buf)
        if not k:
            break
        if t is None:
            t = time.monotonic()
        got += k
    return got, time.monotonic() - (t or time.monotonic())

def source(c, n):
    buf = memoryview(random.Random(n).randbytes(CHUNK))
    t = time.monotonic()
    while n > 0:
        k = min(n, CHUNK)
        c.sendall(buf[:k])
        n -= k
    return time.monotonic() - t

def netcfg(m, out):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    name = m["ifname"].encode()
    def req(ip):
        return struct.pack("16sH2s4s8s", name, socket.AF_INET, b"", socket.inet_aton(ip), b"")
    fcntl.ioctl(s, 0x8916, req(m["addr"]))
    fcntl.ioctl(s, 0x891C, req(m["mask"]))
    fl = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH22s", name, 0, b""))[:18])[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH22s", name, fl | 1, b""))
    for k, v in m.get("sysctl", {}).items():
        with open("/proc/sys/" + k.replace(".", "/"), "w") as f:
            f.write(v)
    return {}

def echo(m, out):
    s = listener(V, m["port"])
    out({"ready": True})
    c, _ = s.accept()
    buf = memoryview(bytearray(65536))
    while True:
        k = c.recv_into(buf)
        if not k:
            break
        c.sendall(buf[:k])
    return {}

def vsock_sink(m, out):
    s = listener(V, m["port"])
    out({"ready": True})
    c, _ = s.accept()
    n, secs = sink(c)
    return {"bytes": n, "secs": secs}

def vsock_source(m, out):
    c = socket.socket(V, socket.SOCK_STREAM)
    c.connect((2, m["port"]))
    secs = source(c, m["bytes"])
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
    return {"secs": secs}

def tcp_source(m, out):
    c = socket.create_connection((m["dst"], m["port"]))
    secs = source(c, m["bytes"])
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
    return {"secs": secs}

def tcp_sink(m, out):
    s = listener(socket.AF_INET, m["port"])
    out({"ready": True})
    c, _ = s.accept()
    n, secs = sink(c)
    return {"bytes": n, "secs": secs}

def blk(m, out):
    bs, kind = m["bs"], m["kind"]
    write = kind.endswith("write")
    fd = os.open(m["dev"], (os.O_RDWR if write else os.O_RDONLY) | os.O_DIRECT)
    buf = mmap.mmap(-1, bs)
    buf.write(random.Random(bs).randbytes(bs))
    size = m["size"]
    if kind.startswith("seq"):
        offs = [i * bs for i in range(m["bytes"] // bs)]
    else:
        r = random.Random(7)
        offs = [r.randrange(size // bs) * bs for _ in range(m["ops"])]
    op = os.pwritev if write else os.preadv
    t = time.monotonic()
    for o in offs:
        if op(fd, [buf], o) != bs:
            raise OSError("short %s at %d" % (kind, o))
    if write:
        os.fsync(fd)
    secs = time.monotonic() - t
    os.close(fd)
    return {"secs": secs, "ops": len(offs), "offsets": offs if m.get("want_offsets") else None}

OPS = {f.__name__: f for f in (netcfg, echo, vsock_sink, vsock_source, tcp_source, tcp_sink, blk)}

def serve(c):
    f = c.makefile("rwb", buffering=0)
    def out(d):
        f.write(json.dumps(d).encode() + b"\n")
    for line in f:
        m = json.loads(line)
        if m["op"] == "quit":
            out({"done": True, "ok": True})
            os._exit(0)
        try:
            r = OPS[m["op"]](m, out)
            r.update(done=True, ok=True)
        except Exception:
            r = {"done": True, "ok": False, "error": traceback.format_exc()}
        out(r)

ctl = listener(V, int(sys.argv[1]))
while True:
    c, _ = ctl.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// A network namespace of the benchmark's own, deleted (with its interfaces) on drop.
#[derive(Debug)]
struct Netns {
    name: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(err("run ip"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    fn create(name: &str) -> Result<Self, String> {
        let _ = ip(&["netns", "del", name]);
        ip(&["netns", "add", name])?;
        let ns = Self { name: name.into() };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    fn ip(&self, args: &[&str]) -> Result<(), String> {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Runs `f` on a thread inside the namespace.
    fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, String> + Send + 'static,
    ) -> Result<T, String> {
        let path = PathBuf::from("/run/netns").join(&self.name);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).map_err(err("open the namespace"))?;
            // SAFETY: setns takes a descriptor `ns` keeps open for the call and a flag; it only
            // changes the calling thread's network namespace.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            if rc != 0 {
                return Err(format!("setns: {}", std::io::Error::last_os_error()));
            }
            f()
        })
        .join()
        .map_err(|_| "a thread in the namespace panicked".to_string())?
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// The VMM process, killed on drop.
struct Vmm {
    child: Child,
    report: PathBuf,
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Vmm {
    fn wait_agent(&mut self) -> Result<(), String> {
        let t = Instant::now();
        loop {
            let text = std::fs::read_to_string(&self.report).unwrap_or_default();
            if text
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .any(|e| e["event"] == "boot_marker" && e["value"] == 2)
            {
                return Ok(());
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                return Err(format!(
                    "ember-vmm exited ({st}) before the agent was up: {text}"
                ));
            }
            if t.elapsed() > BOOT_TIMEOUT {
                return Err(format!("no agent after {BOOT_TIMEOUT:?}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn vsock_connect(uds: &Path, port: u32) -> Result<UnixStream, String> {
    let mut s = UnixStream::connect(uds).map_err(err("connect to the vsock socket"))?;
    s.set_read_timeout(Some(IO_TIMEOUT))
        .map_err(err("timeout"))?;
    s.set_write_timeout(Some(IO_TIMEOUT))
        .map_err(err("timeout"))?;
    s.write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(err("CONNECT"))?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.last() != Some(&b'\n') {
        if s.read(&mut b).map_err(err("CONNECT reply"))? == 0 || line.len() > 64 {
            return Err(format!("guest port {port}: no OK"));
        }
        line.push(b[0]);
    }
    if !line.starts_with(b"OK ") {
        return Err(format!(
            "guest port {port}: {:?}",
            String::from_utf8_lossy(&line)
        ));
    }
    Ok(s)
}

fn b64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for v in s.bytes().filter_map(val) {
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

/// Runs `argv` in the guest through the agent (`exec`); returns (exit event, stdout, stderr).
fn agent_exec(uds: &Path, argv: &[&str]) -> Result<(Value, String, String), String> {
    let mut s = vsock_connect(uds, AGENT_PORT)?;
    let body = json!({"id": 1, "call": {"type": "exec", "argv": argv, "timeout_ms": 7_200_000}})
        .to_string();
    let len = u32::try_from(body.len()).map_err(err("request size"))?;
    s.write_all(&len.to_le_bytes()).map_err(err("agent"))?;
    s.write_all(body.as_bytes()).map_err(err("agent"))?;
    let (mut out, mut errs, mut exit) = (Vec::new(), Vec::new(), Value::Null);
    loop {
        let mut h = [0u8; 4];
        s.read_exact(&mut h).map_err(err("agent frame"))?;
        let mut b = vec![0u8; u32::from_le_bytes(h) as usize];
        s.read_exact(&mut b).map_err(err("agent frame"))?;
        let v: Value = serde_json::from_slice(&b).map_err(err("agent frame"))?;
        let e = &v["event"];
        match e["type"].as_str() {
            Some("stdout") => out.extend(b64_decode(e["data"].as_str().unwrap_or(""))),
            Some("stderr") => errs.extend(b64_decode(e["data"].as_str().unwrap_or(""))),
            Some("exit") => exit = e.clone(),
            Some("end") | Some("error") => break,
            _ => {}
        }
    }
    Ok((
        exit,
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&errs).into_owned(),
    ))
}

/// The helper's control port.
struct Helper {
    uds: PathBuf,
}

struct Pending {
    r: BufReader<UnixStream>,
}

impl Pending {
    fn finish(mut self) -> Result<Value, String> {
        let mut line = String::new();
        self.r
            .read_line(&mut line)
            .map_err(err("guest helper answer"))?;
        let v: Value = serde_json::from_str(&line).map_err(err("guest helper answer"))?;
        if v["ok"] != true {
            return Err(format!("guest helper: {v}"));
        }
        Ok(v)
    }
}

impl Helper {
    fn wait(uds: &Path) -> Result<Self, String> {
        let t = Instant::now();
        while let Err(e) = vsock_connect(uds, HELPER_PORT) {
            if t.elapsed() > BOOT_TIMEOUT {
                return Err(format!("the guest helper never listened: {e}"));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        Ok(Self {
            uds: uds.to_path_buf(),
        })
    }

    fn send(&self, req: &Value) -> Result<BufReader<UnixStream>, String> {
        let mut s = vsock_connect(&self.uds, HELPER_PORT)?;
        s.write_all(format!("{req}\n").as_bytes())
            .map_err(err("guest helper request"))?;
        Ok(BufReader::new(s))
    }

    fn start(&self, req: Value) -> Result<Pending, String> {
        let mut r = self.send(&req)?;
        let mut line = String::new();
        r.read_line(&mut line).map_err(err("guest helper"))?;
        if !line.contains("\"ready\"") {
            return Err(format!("guest helper, {}: {line}", req["op"]));
        }
        Ok(Pending { r })
    }

    fn call(&self, req: Value) -> Result<Value, String> {
        Pending {
            r: self.send(&req)?,
        }
        .finish()
    }
}

fn mib_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / MIB as f64 / secs.max(1e-9)
}

fn write_n(w: &mut impl Write, n: usize) -> Result<(), String> {
    let buf = vec![0x5au8; MIB];
    let mut left = n;
    while left > 0 {
        let k = left.min(MIB);
        w.write_all(&buf[..k]).map_err(err("write"))?;
        left -= k;
    }
    Ok(())
}

fn read_all(r: &mut impl Read) -> Result<usize, String> {
    let mut buf = vec![0u8; MIB];
    let mut n = 0;
    loop {
        match r.read(&mut buf) {
            Ok(0) => return Ok(n),
            Ok(k) => n += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("read: {e}")),
        }
    }
}

/// 64-byte round trips on `s` (an echo peer on the other end); milliseconds each.
fn ping_pong(s: &mut UnixStream, n: usize) -> Result<Vec<f64>, String> {
    let msg = [0xa5u8; 64];
    let mut back = [0u8; 64];
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        s.write_all(&msg).map_err(err("ping"))?;
        s.read_exact(&mut back).map_err(err("pong"))?;
        v.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(v)
}

/// Host-side vsock equivalents: a Unix socket pair between two threads.
fn host_uds_rtt(n: usize) -> Result<Vec<f64>, String> {
    let (mut a, mut b) = UnixStream::pair().map_err(err("socketpair"))?;
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 65536];
        while let Ok(k) = b.read(&mut buf) {
            if k == 0 || b.write_all(&buf[..k]).is_err() {
                break;
            }
        }
    });
    let v = ping_pong(&mut a, n);
    drop(a);
    let _ = echo.join();
    v
}

fn host_uds_throughput(n: usize) -> Result<f64, String> {
    let (mut a, mut b) = UnixStream::pair().map_err(err("socketpair"))?;
    let t = Instant::now();
    let w = std::thread::spawn(move || {
        let r = write_n(&mut a, n);
        drop(a);
        r
    });
    let got = read_all(&mut b)?;
    w.join().map_err(|_| "writer panicked".to_string())??;
    if got != n {
        return Err(format!("host socket pair moved {got} of {n} bytes"));
    }
    Ok(mib_s(n, t.elapsed().as_secs_f64()))
}

/// TCP over a veth pair between two namespaces of our own; MiB/s.
fn host_veth_throughput(n: usize) -> Result<f64, String> {
    let tag = std::process::id();
    let a = Netns::create(&format!("ember-bva-{tag}"))?;
    let b = Netns::create(&format!("ember-bvb-{tag}"))?;
    let (va, vb) = (format!("ebva{tag}"), format!("ebvb{tag}"));
    let (va, vb) = (&va[..va.len().min(15)], &vb[..vb.len().min(15)]);
    a.ip(&[
        "link", "add", va, "type", "veth", "peer", "name", vb, "netns", &b.name,
    ])?;
    a.ip(&["addr", "add", "10.79.0.1/24", "dev", va])?;
    a.ip(&["link", "set", va, "up"])?;
    b.ip(&["addr", "add", "10.79.0.2/24", "dev", vb])?;
    b.ip(&["link", "set", vb, "up"])?;
    let l = b.run(|| TcpListener::bind("10.79.0.2:9300").map_err(err("bind")))?;
    let reader = std::thread::spawn(move || -> Result<usize, String> {
        let (mut s, _) = l.accept().map_err(err("accept"))?;
        read_all(&mut s)
    });
    let mut s = a.run(|| TcpStream::connect("10.79.0.2:9300").map_err(err("connect")))?;
    let t = Instant::now();
    write_n(&mut s, n)?;
    s.shutdown(Shutdown::Write).map_err(err("shutdown"))?;
    let got = reader.join().map_err(|_| "reader panicked".to_string())??;
    let secs = t.elapsed().as_secs_f64();
    if got != n {
        return Err(format!("veth moved {got} of {n} bytes"));
    }
    Ok(mib_s(n, secs))
}

/// The guest's block pattern on the host: the same offsets on the same file, buffered like
/// the VMM's own requests (so reads come from the host's page cache, as the VMM's do).
/// Returns seconds.
fn host_blk(file: &Path, kind: &str, bs: usize, offsets: &[u64]) -> Result<f64, String> {
    let write = kind.ends_with("write");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(file)
        .map_err(err("open the disk image"))?;
    let mut buf = vec![0x3cu8; bs];
    let t = Instant::now();
    for &o in offsets {
        if write {
            f.write_all_at(&buf, o).map_err(err("pwrite"))?;
        } else {
            f.read_exact_at(&mut buf, o).map_err(err("pread"))?;
        }
    }
    if write {
        f.sync_data().map_err(err("fdatasync"))?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Boots one guest (1 vCPU, 256 MiB; root read-only, a raw rw scratch disk, a TAP in a
/// namespace of its own, vsock) and measures everything in the module table. `quick` moves
/// less data (about a minute and a half of guest work instead of five here).
pub fn run_device_benches(
    kernel: &Path,
    rootfs: &Path,
    ember_vmm: &Path,
    quick: bool,
) -> Result<Vec<DeviceResult>, String> {
    let plan = Plan::new(quick);
    let dir = tempfile::tempdir().map_err(err("temp dir"))?;
    let d = dir.path();
    let disk = d.join("scratch.img");
    {
        // Real blocks, so that reads are not of holes.
        let f = std::fs::File::create(&disk).map_err(err("create the scratch disk"))?;
        let chunk: Vec<u8> = (0..MIB).map(|i| (i * 131 % 251) as u8).collect();
        for i in 0..plan.disk_bytes / MIB {
            f.write_all_at(&chunk, (i * MIB) as u64)
                .map_err(err("fill the scratch disk"))?;
        }
        f.sync_all().map_err(err("sync the scratch disk"))?;
    }
    let ns = Netns::create(&format!("ember-b-{}", std::process::id()))?;
    ns.ip(&["tuntap", "add", "dev", "tap0", "mode", "tap"])?;
    ns.ip(&["addr", "add", &format!("{HOST_IP}/24"), "dev", "tap0"])?;
    ns.ip(&["link", "set", "tap0", "up"])?;
    let _ = Command::new("ip")
        .args(["netns", "exec", &ns.name, "sysctl", "-qw"])
        .arg("net.ipv4.tcp_min_tso_segs=44")
        .output();

    let uds = d.join("vsock");
    let report = d.join("report.jsonl");
    let mut vmm = Vmm {
        child: Command::new("ip")
            .args(["netns", "exec", &ns.name])
            .arg(ember_vmm)
            .arg("--kernel")
            .arg(kernel)
            .arg("--mem-mib")
            .arg("256")
            .arg("--disk")
            .arg(format!("path={},mode=ro,id=rootfs", rootfs.display()))
            .arg("--disk")
            .arg(format!("path={},mode=rw,id=scratch", disk.display()))
            .arg("--net")
            .arg("tap=tap0")
            .arg("--vsock")
            .arg(format!("cid=3,uds={}", uds.display()))
            .args(["--cmdline-append", "ember.agent", "--serial"])
            .arg(format!("file:{}", d.join("console").display()))
            .arg("--report")
            .arg(&report)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(err("spawn ember-vmm"))?,
        report,
    };
    vmm.wait_agent()?;
    let helper_thread = {
        let uds = uds.clone();
        std::thread::spawn(move || {
            agent_exec(
                &uds,
                &[
                    "/usr/bin/python3",
                    "-I",
                    "-S",
                    "-c",
                    GUEST_HELPER,
                    &HELPER_PORT.to_string(),
                ],
            )
        })
    };
    let helper = Helper::wait(&uds)?;
    let results = measure(&helper, &ns, &uds, &disk, plan);
    let _ = helper.send(&json!({"op": "quit"}));
    drop(vmm);
    let helper_out = helper_thread.join();
    match (results, helper_out) {
        (Ok(r), _) => Ok(r),
        (Err(e), Ok(Ok((exit, _, stderr)))) => {
            Err(format!("{e}\nguest helper exit {exit}: {stderr}"))
        }
        (Err(e), _) => Err(e),
    }
}

fn measure(
    helper: &Helper,
    ns: &Netns,
    uds: &Path,
    disk: &Path,
    plan: Plan,
) -> Result<Vec<DeviceResult>, String> {
    let mut out = Vec::new();

    // vsock round trips.
    let p = helper.start(json!({"op": "echo", "port": 7100}))?;
    let mut s = vsock_connect(uds, 7100)?;
    ping_pong(&mut s, 5)?;
    let guest = ping_pong(&mut s, plan.rtt_n)?;
    drop(s);
    p.finish()?;
    let host = host_uds_rtt(plan.rtt_n)?;
    let (g, h) = (
        summarize(&guest).ok_or("no round trips")?,
        summarize(&host).ok_or("no round trips")?,
    );
    out.push(DeviceResult::new(
        "vsock_rtt_median",
        g.median_ms,
        "ms",
        Some(h.median_ms),
        g.n,
    ));
    out.push(DeviceResult::new(
        "vsock_rtt_p95",
        g.p95_ms,
        "ms",
        Some(h.p95_ms),
        g.n,
    ));

    // vsock streams.
    let n = plan.vsock_bytes;
    let host_uds = host_uds_throughput(n)?;
    let p = helper.start(json!({"op": "vsock_sink", "port": 7101}))?;
    let mut s = vsock_connect(uds, 7101)?;
    let t = Instant::now();
    write_n(&mut s, n)?;
    s.shutdown(Shutdown::Write).map_err(err("shutdown"))?;
    let r = p.finish()?;
    let secs = t.elapsed().as_secs_f64();
    if r["bytes"] != n {
        return Err(format!("vsock host → guest: the guest got {}", r["bytes"]));
    }
    out.push(DeviceResult::new(
        "vsock_host_to_guest",
        mib_s(n, secs),
        "MiB/s",
        Some(host_uds),
        n / MIB,
    ));
    let path = {
        let mut p = uds.as_os_str().to_owned();
        p.push("_7201");
        PathBuf::from(p)
    };
    let l = UnixListener::bind(&path).map_err(err("bind the host port"))?;
    let reader = std::thread::spawn(move || -> Result<(usize, f64), String> {
        let (mut s, _) = l.accept().map_err(err("accept"))?;
        let t = Instant::now();
        let got = read_all(&mut s)?;
        Ok((got, t.elapsed().as_secs_f64()))
    });
    helper.call(json!({"op": "vsock_source", "port": 7201, "bytes": n}))?;
    let (got, secs) = reader.join().map_err(|_| "reader panicked".to_string())??;
    let _ = std::fs::remove_file(&path);
    if got != n {
        return Err(format!("vsock guest → host: the host got {got}"));
    }
    out.push(DeviceResult::new(
        "vsock_guest_to_host",
        mib_s(n, secs),
        "MiB/s",
        Some(host_uds),
        n / MIB,
    ));

    // TCP through the TAP.
    helper.call(json!({
        "op": "netcfg", "ifname": "eth0", "addr": GUEST_IP, "mask": "255.255.255.0",
        "sysctl": {
            "net.ipv4.tcp_min_tso_segs": "44",
            "net.ipv4.tcp_wmem": "4096 1048576 8388608",
            "net.ipv4.tcp_rmem": "4096 1048576 8388608",
        },
    }))?;
    let host_net = host_veth_throughput(plan.net_up.max(64 * MIB))?;
    let l = ns.run(|| TcpListener::bind((HOST_IP, 9000)).map_err(err("bind")))?;
    let reader = std::thread::spawn(move || -> Result<(usize, f64), String> {
        let (mut s, _) = l.accept().map_err(err("accept"))?;
        let t = Instant::now();
        let got = read_all(&mut s)?;
        Ok((got, t.elapsed().as_secs_f64()))
    });
    helper.call(json!({"op": "tcp_source", "dst": HOST_IP, "port": 9000, "bytes": plan.net_up}))?;
    let (got, secs) = reader.join().map_err(|_| "reader panicked".to_string())??;
    if got != plan.net_up {
        return Err(format!("TCP guest → peer: the peer got {got}"));
    }
    out.push(DeviceResult::new(
        "net_guest_to_peer",
        mib_s(got, secs),
        "MiB/s",
        Some(host_net),
        got / MIB,
    ));
    let p = helper.start(json!({"op": "tcp_sink", "port": 9001}))?;
    let mut s = ns.run(|| {
        let addr = format!("{GUEST_IP}:9001").parse().map_err(err("address"))?;
        TcpStream::connect_timeout(&addr, Duration::from_secs(30)).map_err(err("connect"))
    })?;
    let t = Instant::now();
    write_n(&mut s, plan.net_down)?;
    s.shutdown(Shutdown::Write).map_err(err("shutdown"))?;
    let r = p.finish()?;
    let secs = t.elapsed().as_secs_f64();
    if r["bytes"] != plan.net_down {
        return Err(format!("TCP peer → guest: the guest got {}", r["bytes"]));
    }
    out.push(DeviceResult::new(
        "net_peer_to_guest",
        mib_s(plan.net_down, secs),
        "MiB/s",
        Some(host_net),
        plan.net_down / MIB,
    ));

    // Block: the guest's own timing of its requests; the host repeats the same offsets.
    let size = plan.disk_bytes;
    for (kind, bs, measure) in [
        ("seqwrite", MIB, "blk_seq_write"),
        ("seqread", MIB, "blk_seq_read"),
        ("randwrite", 4096, "blk_rand_write_4k"),
        ("randread", 4096, "blk_rand_read_4k"),
    ] {
        let r = helper.call(json!({
            "op": "blk", "dev": "/dev/vdb", "kind": kind, "bs": bs, "size": size,
            "bytes": plan.blk_seq, "ops": plan.blk_rand_ops, "want_offsets": true,
        }))?;
        let secs = r["secs"].as_f64().ok_or("blk: no time")?;
        let offsets: Vec<u64> = r["offsets"]
            .as_array()
            .ok_or("blk: no offsets")?
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        let host_secs = host_blk(disk, kind, bs, &offsets)?;
        let ops = offsets.len();
        let (v, h, unit, n) = if bs == MIB {
            (
                mib_s(ops * bs, secs),
                mib_s(ops * bs, host_secs),
                "MiB/s",
                ops * bs / MIB,
            )
        } else {
            (ops as f64 / secs, ops as f64 / host_secs, "IOPS", ops)
        };
        out.push(DeviceResult::new(measure, v, unit, Some(h), n));
    }
    Ok(out)
}

/// A human table of `results`.
pub fn table(results: &[DeviceResult]) -> String {
    let mut s = format!(
        "{:<22} {:>12} {:<6} {:>12} {:>9} {:>6}\n",
        "measure", "guest", "unit", "host", "ratio", "n"
    );
    for r in results {
        let host = r.host_value.map_or("-".into(), |h| format!("{h:.3}"));
        let ratio = r.ratio.map_or("-".into(), |x| format!("{x:.4}"));
        s.push_str(&format!(
            "{:<22} {:>12.3} {:<6} {:>12} {:>9} {:>6}\n",
            r.measure, r.value, r.unit, host, ratio, r.n
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_and_table() {
        assert_eq!(b64_decode("aGkK"), b"hi\n");
        assert_eq!(b64_decode("aGVsbG8="), b"hello");
        assert_eq!(b64_decode(""), b"");
        let r = DeviceResult::new("vsock_rtt_median", 2.0, "ms", Some(0.5), 10);
        assert_eq!(r.ratio, Some(4.0));
        let t = table(&[r.clone(), DeviceResult::new("x", 1.0, "IOPS", None, 1)]);
        assert!(t.contains("vsock_rtt_median") && t.contains("4.0000"));
        let j = serde_json::to_value(&r).unwrap();
        for k in [
            "system",
            "measure",
            "value",
            "unit",
            "host_value",
            "ratio",
            "n",
        ] {
            assert!(j.get(k).is_some(), "{k}");
        }
    }
}

/// A live run for development: `EMBER_TEST_KERNEL=… EMBER_TEST_ROOTFS=… [EMBER_VMM=…]
/// [EMBER_BENCH_FULL=1] cargo test -p ember-benches --lib devices::live -- --ignored --nocapture`
/// (root, /dev/kvm, `ip`; `EMBER_VMM` defaults to this target directory's `ember-vmm`).
#[cfg(test)]
mod live {
    use super::*;

    #[test]
    #[ignore = "boots a real guest: needs root, /dev/kvm and the guest images"]
    fn devices_live() {
        let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
        let kernel = var("EMBER_TEST_KERNEL").expect("EMBER_TEST_KERNEL");
        let rootfs = var("EMBER_TEST_ROOTFS").expect("EMBER_TEST_ROOTFS");
        let vmm = var("EMBER_VMM").unwrap_or_else(|| {
            let exe = std::env::current_exe().unwrap();
            exe.ancestors().nth(2).unwrap().join("ember-vmm")
        });
        let quick = std::env::var_os("EMBER_BENCH_FULL").is_none_or(|v| v != "1");
        let t = Instant::now();
        let r = run_device_benches(&kernel, &rootfs, &vmm, quick).unwrap();
        print!("{}", table(&r));
        for x in &r {
            println!("{}", serde_json::to_string(x).unwrap());
        }
        println!(
            "({} mode, {:.1} s)",
            if quick { "quick" } else { "full" },
            t.elapsed().as_secs_f64()
        );
    }
}
