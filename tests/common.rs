//! Shared helpers for the end-to-end tests: where the binaries and guest images are.
//!
//! The binaries come from the same target directory as the test (run `cargo build --workspace
//! --bins` first; `.ci/run` does). The guest kernel and rootfs come from `$EMBER_TEST_KERNEL`
//! / `$EMBER_TEST_ROOTFS`, or else from the repo's build scripts (cached). A missing image is
//! a test failure, never a skip. A missing host prerequisite (root, a tool, a client library)
//! is reported through [`skip`]: a failure under `CI=true`, a counted and listed skip elsewhere.

use std::path::PathBuf;
use std::process::{Command, Output};

/// A binary built from this workspace (`ember`, `ember-vmm`, ...).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let p = exe.ancestors().nth(2).expect("target dir").join(name);
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build --workspace --bins` before the tests",
        p.display()
    );
    p
}

/// The guest kernel under test.
pub fn kernel() -> PathBuf {
    std::env::var_os("EMBER_TEST_KERNEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| ember_runtime::images::default_kernel().expect("default kernel"))
}

/// The guest root filesystem under test.
pub fn rootfs() -> PathBuf {
    std::env::var_os("EMBER_TEST_ROOTFS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            ember_runtime::template::default_rootfs("default").expect("default rootfs")
        })
}

/// Runs `ember` with `args` (plus `EMBER_VMM` pointing at this build's VMM).
pub fn ember(args: &[&str]) -> Output {
    Command::new(bin("ember"))
        .args(args)
        .env("EMBER_VMM", bin("ember-vmm"))
        .output()
        .expect("run ember")
}

/// `ember vm boot --json` with the test images and extra `args`; returns the parsed JSON
/// result and the console (stderr).
/// Runs the `ember` CLI as a client of the server at `url` (with its `token`), `stdin` fed
/// to it; its output.
pub fn ember_client(url: &str, token: &str, args: &[&str], stdin: &[u8]) -> Output {
    use std::io::Write;
    let mut c = Command::new(bin("ember"))
        .args(args)
        .env("EMBER_URL", url)
        .env("EMBER_TOKEN", token)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run ember");
    c.stdin
        .take()
        .expect("stdin")
        .write_all(stdin)
        .expect("write stdin");
    c.wait_with_output().expect("wait for ember")
}

pub fn boot_json(args: &[&str]) -> (serde_json::Value, String, Output) {
    let k = kernel();
    let r = rootfs();
    let mut all = vec![
        "vm",
        "boot",
        "--json",
        "--timeout",
        "300",
        "--kernel",
        k.to_str().expect("utf-8 path"),
        "--rootfs",
        r.to_str().expect("utf-8 path"),
    ];
    all.extend_from_slice(args);
    let out = ember(&all);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!("ember vm boot --json printed no JSON ({e}): stdout {stdout:?}\nstderr:\n{stderr}")
    });
    (json, stderr, out)
}

/// Skips (the rest of) test `test` for want of a prerequisite `why`, visibly: under `CI=true` a
/// skip is a failure (this panics); elsewhere it prints `SKIPPED: <test>: <why>` to stderr and
/// appends `<test>: <why>` as one line to the file `$EMBER_SKIP_LOG` names, if set
/// (`scripts/test.sh` sets it, then counts and lists the skips in its summary). The caller
/// returns (or leaves out the part) after it. A part of a test left out is named
/// `<test> (in part: <what>)`.
pub fn skip(test: &str, why: &str) {
    let line = format!(
        "{test}: {}",
        why.split_whitespace().collect::<Vec<_>>().join(" ")
    );
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "a skip under CI=true is a failure: {line}"
    );
    eprintln!("SKIPPED: {line}");
    if let Some(log) = std::env::var_os("EMBER_SKIP_LOG") {
        use std::io::Write;
        // One write of the whole line to a file opened for appending: lines of tests running
        // at the same time do not interleave.
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
        if let Err(e) = written {
            panic!(
                "cannot record the skip in EMBER_SKIP_LOG={}: {e}",
                std::path::Path::new(&log).display()
            );
        }
    }
}

/// True when /dev/kvm is kvm_pvm.
pub fn on_pvm() -> bool {
    ember_vmm::HostKvm::detect() == ember_vmm::HostKvm::Pvm
}

/// A running `ember-vmm` child that is killed when dropped.
#[derive(Debug)]
pub struct RunningVmm {
    /// The process.
    pub child: std::process::Child,
    /// Its report file.
    pub report: PathBuf,
}

impl Drop for RunningVmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl RunningVmm {
    /// Starts `ember-vmm` with `args` plus a report file in `dir` (named `name.jsonl`); the
    /// console goes to `dir/name.console`.
    pub fn start(dir: &std::path::Path, name: &str, args: &[std::ffi::OsString]) -> Self {
        let report = dir.join(format!("{name}.jsonl"));
        let console = dir.join(format!("{name}.console"));
        let child = Command::new(bin("ember-vmm"))
            .args(args)
            .arg("--report")
            .arg(&report)
            .arg("--serial")
            .arg(format!("file:{}", console.display()))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("spawn ember-vmm");
        Self { child, report }
    }

    /// Report events so far.
    pub fn events(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.report)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Waits until the guest writes boot marker `value` (or the VMM exits, or time runs out).
    pub fn wait_marker(&mut self, value: u64, timeout: std::time::Duration) {
        let t = std::time::Instant::now();
        loop {
            if self
                .events()
                .iter()
                .any(|e| e["event"] == "boot_marker" && e["value"] == value)
            {
                return;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!(
                    "VMM exited ({st}) before marker {value}: {:?}",
                    self.events()
                );
            }
            assert!(t.elapsed() < timeout, "no marker {value} after {timeout:?}");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// `--cmdline-append` value running the agent (and nothing else).
pub const AGENT_CMDLINE: &str = "ember.agent";

// ---- Helpers for device tests: network namespaces, vsock through the VMM's Unix socket,
// ---- SHA-256 through the host's `sha256sum`.

/// A network namespace created for a test, deleted (with every interface in it) on drop.
#[derive(Debug)]
pub struct Netns {
    /// Its name (`ip netns` name, file under `/run/netns`).
    pub name: String,
}

impl Netns {
    /// Creates namespace `name` (deleting a stale one of that name first) with `lo` up.
    pub fn create(name: &str) -> Self {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        run_ip(&["netns", "add", name]);
        let ns = Self {
            name: name.to_string(),
        };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// Runs `ip -n <ns> args...`; panics with ip's message when it fails.
    pub fn ip(&self, args: &[&str]) {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        run_ip(&all);
    }

    /// Creates a persistent TAP `tap` in the namespace with address `cidr` (e.g.
    /// `10.77.0.1/24`), up.
    pub fn add_tap(&self, tap: &str, cidr: &str) {
        self.ip(&["tuntap", "add", "dev", tap, "mode", "tap"]);
        self.ip(&["addr", "add", cidr, "dev", tap]);
        self.ip(&["link", "set", tap, "up"]);
    }

    /// Runs `f` on a new thread that has joined this namespace: sockets it creates live in
    /// the namespace (and may then be used from any thread).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = PathBuf::from("/run/netns").join(&self.name);
        std::thread::spawn(move || {
            enter_netns(&path);
            f()
        })
        .join()
        .expect("thread in the network namespace panicked")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

fn run_ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Moves the calling thread into the network namespace at `path` (`setns(CLONE_NEWNET)`).
pub fn enter_netns(path: &std::path::Path) {
    use std::os::fd::AsRawFd;
    extern "C" {
        fn setns(fd: i32, nstype: i32) -> i32;
    }
    const CLONE_NEWNET: i32 = 0x4000_0000;
    let f = std::fs::File::open(path)
        .unwrap_or_else(|e| panic!("open network namespace {}: {e}", path.display()));
    // SAFETY: setns takes a descriptor `f` keeps open for the call and a flag; it affects only
    // the calling thread's network namespace and touches no memory of ours.
    let rc = unsafe { setns(f.as_raw_fd(), CLONE_NEWNET) };
    assert_eq!(
        rc,
        0,
        "setns {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

impl RunningVmm {
    /// Like [`RunningVmm::start`], with `ember-vmm` running inside network namespace `netns`
    /// (through `ip netns exec`, which execs it: the child is the VMM itself), so that it
    /// attaches to TAP devices there.
    pub fn start_in_netns(
        dir: &std::path::Path,
        name: &str,
        netns: &str,
        args: &[std::ffi::OsString],
    ) -> Self {
        let report = dir.join(format!("{name}.jsonl"));
        let console = dir.join(format!("{name}.console"));
        let child = Command::new("ip")
            .args(["netns", "exec", netns])
            .arg(bin("ember-vmm"))
            .args(args)
            .arg("--report")
            .arg(&report)
            .arg("--serial")
            .arg(format!("file:{}", console.display()))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("spawn ip netns exec ember-vmm");
        Self { child, report }
    }
}

/// Connects to guest vsock `port` through the VMM's Unix socket `uds` (`CONNECT <port>\n`,
/// `OK <n>\n`), with `timeout` on the handshake and on later reads and writes.
pub fn vsock_connect(
    uds: &std::path::Path,
    port: u32,
    timeout: std::time::Duration,
) -> std::io::Result<std::os::unix::net::UnixStream> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(uds)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(format!("CONNECT {port}\n").as_bytes())?;
    // Byte by byte: the guest's data may follow the line at once.
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.last() != Some(&b'\n') {
        if s.read(&mut b)? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                format!("the VMM closed the connection to guest port {port} without OK"),
            ));
        }
        line.push(b[0]);
        if line.len() > 64 {
            return Err(std::io::Error::other(format!("bad reply {line:?}")));
        }
    }
    if !line.starts_with(b"OK ") {
        return Err(std::io::Error::other(format!(
            "CONNECT {port}: {:?}",
            String::from_utf8_lossy(&line)
        )));
    }
    Ok(s)
}

/// SHA-256 computed by the host's `sha256sum`, fed incrementally.
#[derive(Debug)]
pub struct Sha256Pipe {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
}

impl Default for Sha256Pipe {
    fn default() -> Self {
        Self::new()
    }
}

impl Sha256Pipe {
    /// Starts `sha256sum`.
    pub fn new() -> Self {
        let mut child = Command::new("sha256sum")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn sha256sum");
        let stdin = child.stdin.take();
        Self { child, stdin }
    }

    /// Hashes `data` next.
    pub fn update(&mut self, data: &[u8]) {
        use std::io::Write;
        self.stdin
            .as_mut()
            .expect("sha256sum stdin")
            .write_all(data)
            .expect("write to sha256sum");
    }

    /// The hex digest of everything hashed.
    pub fn finish(mut self) -> String {
        use std::io::Read;
        drop(self.stdin.take());
        let mut out = String::new();
        if let Some(mut o) = self.child.stdout.take() {
            o.read_to_string(&mut out).expect("read sha256sum output");
        }
        out.split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string()
    }
}

impl Drop for Sha256Pipe {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// SHA-256 (hex) of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    let mut p = Sha256Pipe::new();
    p.update(data);
    p.finish()
}

/// Template `name`, built (once, then cached in `$EMBER_CACHE/templates`) with the test kernel
/// and this build's VMM. Build progress goes to stderr.
pub fn template(name: &str) -> ember_runtime::Template {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static BUILT: OnceLock<Mutex<HashMap<String, ember_runtime::Template>>> = OnceLock::new();
    let built = BUILT.get_or_init(|| Mutex::new(HashMap::new()));
    let mut built = built.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(t) = built.get(name) {
        return t.clone();
    }
    let opts = ember_runtime::BuildOptions {
        kernel: Some(kernel()),
        vmm: Some(bin("ember-vmm")),
        ..Default::default()
    };
    let t0 = std::time::Instant::now();
    let t = ember_runtime::Template::build(name, &opts, &mut |ev| {
        eprintln!(
            "[template {name} {:6.1}s] {ev:?}",
            t0.elapsed().as_secs_f64()
        )
    })
    .unwrap_or_else(|e| panic!("template {name}: {e}"));
    built.insert(name.into(), t.clone());
    t
}

/// A new sandbox from template `name`, with this build's VMM.
pub fn sandbox(name: &str) -> ember_runtime::Sandbox {
    let t = template(name);
    let opts = ember_runtime::SandboxOptions {
        vmm: Some(bin("ember-vmm")),
        ..Default::default()
    };
    ember_runtime::Sandbox::create(&t, &opts).unwrap_or_else(|e| panic!("sandbox from {name}: {e}"))
}

/// Runs `code` in the default context of `sb`, asserting the call itself worked.
pub fn run(sb: &ember_runtime::Sandbox, code: &str) -> ember_runtime::Execution {
    sb.run(code)
        .unwrap_or_else(|e| panic!("run_code {code:?}: {e}"))
}

/// Decodes `png` fully; returns (width, height, number of distinct pixel values).
pub fn decode_png(png: &[u8]) -> (u32, u32, usize) {
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG (magic)");
    let decoder = png::Decoder::new(std::io::Cursor::new(png));
    let mut reader = decoder.read_info().expect("PNG header");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("PNG data decodes");
    let bpp = info.line_size / info.width as usize;
    let distinct: std::collections::HashSet<&[u8]> =
        buf[..info.buffer_size()].chunks(bpp.max(1)).collect();
    (info.width, info.height, distinct.len())
}

/// Runtime settings for a test: `home` as `$EMBER_HOME`, this build's VMM and jailer, and
/// sandboxes killed when the runtime is dropped (a failing test leaves no VM behind).
pub fn runtime_config(home: &std::path::Path) -> ember_runtime::RuntimeConfig {
    let mut cfg = ember_runtime::RuntimeConfig::new(home);
    cfg.vmm = Some(bin("ember-vmm"));
    cfg.jailer = Some(bin("ember-jailer"));
    cfg.kill_on_drop = true;
    // `EMBER_TEST_POOL=N` runs every runtime test through a warm pool of N VMMs per template.
    if let Some(n) = std::env::var("EMBER_TEST_POOL")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        cfg.pool.size = n;
    }
    cfg
}

/// A runtime on a fresh `$EMBER_HOME` (the templates it restores are built first, once).
pub fn runtime_for_test() -> (tempfile::TempDir, ember_runtime::Runtime) {
    template("default");
    let home = tempfile::Builder::new()
        .prefix("ember-rt-test-")
        .tempdir_in(std::env::temp_dir())
        .expect("temp home");
    let rt = ember_runtime::Runtime::open(runtime_config(home.path()))
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    (home, rt)
}

/// The runtime on an existing home again (a restarted server).
pub fn reopen_runtime(home: &std::path::Path) -> ember_runtime::Runtime {
    ember_runtime::Runtime::open(runtime_config(home)).unwrap_or_else(|e| panic!("runtime: {e}"))
}

/// The `args` of sandbox `id`'s create record in `rt`'s audit log (panics when there is
/// none): `args["vmm"]` says how its VMM started (`path` pool|fresh, `queued_ms`, the
/// restore breakdown).
pub fn create_record_args(rt: &ember_runtime::Runtime, id: &str) -> serde_json::Value {
    let recs = rt
        .audit(&ember_runtime::AuditFilter {
            sandbox: Some(id.to_string()),
            call: Some("create".into()),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("audit of {id}: {e}"));
    recs.into_iter()
        .next()
        .unwrap_or_else(|| panic!("no create record for {id}"))
        .args
}

/// Runs `src` in sandbox `id` of `rt`: how it ended, its stdout and its result's
/// `text/plain` (panics when the call itself fails).
pub fn run_code(
    rt: &ember_runtime::Runtime,
    id: &str,
    src: &str,
) -> (ember_agent::protocol::EndStatus, String, Option<String>) {
    use ember_agent::protocol::{EventKind, RunCodeRequest};
    let mut out = String::new();
    let mut text = None;
    let req = RunCodeRequest {
        code: src.into(),
        ..Default::default()
    };
    let end = rt
        .run_code(id, &req, &mut |ev| {
            match ev {
                EventKind::Stdout { data } => out.push_str(&String::from_utf8_lossy(data)),
                EventKind::Result(r) => {
                    text = r
                        .data
                        .get("text/plain")
                        .and_then(|v| v.as_str())
                        .map(str::to_owned)
                }
                _ => {}
            }
            true
        })
        .unwrap_or_else(|e| panic!("run_code {src:?} in {id}: {e}"));
    (end.status, out, text)
}

/// A running `ember serve` on its own `$EMBER_HOME` (this build's VMM and jailer), its output
/// in `<home>/serve.log`: the server the HTTP-level suites (`e2b`, `mcp`, `ui`) drive. With
/// a TLS port, it also listens there with `--domain e2b.localhost:<port>` (the E2B SDKs'
/// sandbox URLs). Dropping it kills the sandboxes a failed run left, then stops it.
#[derive(Debug)]
pub struct Serve {
    /// The `ember serve` process.
    pub child: std::process::Child,
    /// Its `$EMBER_HOME`.
    pub home: std::path::PathBuf,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// The TLS listener's port, when it has one.
    pub tls_port: Option<u16>,
    /// Extra `ember serve` arguments (kept for a restart).
    pub args: Vec<String>,
}

/// A port free on loopback now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

impl Serve {
    /// Starts it on a free port (and a free TLS port when `tls`) and waits until it answers.
    pub fn start(home: &std::path::Path, tls: bool) -> Serve {
        Serve::start_with(home, tls, &[])
    }

    /// [`Serve::start`] with extra `ember serve` arguments (`--e2b-alias ...`).
    pub fn start_with(home: &std::path::Path, tls: bool, args: &[&str]) -> Serve {
        let port = free_port();
        let tls_port = tls.then(free_port);
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let mut s = Serve {
            child: Serve::spawn(home, port, tls_port, &args),
            home: home.to_path_buf(),
            url: format!("http://127.0.0.1:{port}"),
            tls_port,
            args,
        };
        s.wait_ready();
        s
    }

    fn spawn(
        home: &std::path::Path,
        port: u16,
        tls_port: Option<u16>,
        args: &[String],
    ) -> std::process::Child {
        use std::process::Stdio;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(home.join("serve.log"))
            .expect("serve.log");
        let mut cmd = Command::new(bin("ember"));
        cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}")]);
        if let Some(t) = tls_port {
            cmd.args(["--tls-listen", &format!("127.0.0.1:{t}")])
                .args(["--domain", &format!("e2b.localhost:{t}")]);
        }
        cmd.args(args);
        cmd.env("EMBER_HOME", home)
            .env("EMBER_VMM", bin("ember-vmm"))
            .env("EMBER_JAILER", bin("ember-jailer"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("serve.log"))
            .stderr(log)
            .spawn()
            .expect("start ember serve")
    }

    /// Waits (at most 60 s) until `/healthz` answers and the TLS port takes connections.
    pub fn wait_ready(&mut self) {
        let t0 = std::time::Instant::now();
        loop {
            let plain = ureq::get(&format!("{}/healthz", self.url)).call().is_ok();
            let tls = self
                .tls_port
                .is_none_or(|p| std::net::TcpStream::connect(("127.0.0.1", p)).is_ok());
            if plain && tls {
                return;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("ember serve exited ({st}):\n{}", self.log_tail(100));
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(60),
                "ember serve not up after 60 s (plain {plain}, TLS {tls}):\n{}",
                self.log_tail(100)
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Stops it gracefully (SIGTERM: its sandboxes keep running; it must exit 0) and starts
    /// it again on the same home and ports.
    pub fn restart(&mut self) {
        // SAFETY: kill(2) with the server's pid and SIGTERM; no memory is involved.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let st = self.child.wait().expect("wait for ember serve");
        assert!(
            st.success(),
            "ember serve stopped with {st}:\n{}",
            self.log_tail(50)
        );
        let port: u16 = self
            .url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("the server's port");
        self.child = Serve::spawn(&self.home, port, self.tls_port, &self.args);
        self.wait_ready();
    }

    /// Its bearer token.
    pub fn token(&self) -> String {
        std::fs::read_to_string(self.home.join("token"))
            .expect("the server's token")
            .trim()
            .to_string()
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(self.home.join("serve.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        // The scripts kill what they made; this catches what a failed run left.
        let c = ember_server::client::Client::new(&self.url, Some(self.token()));
        if let Ok(list) = c.list(true, None, &Default::default()) {
            for s in list.iter().filter(|s| !s.state.is_final()) {
                let _ = c.kill(&s.id);
            }
        }
        // SAFETY: kill(2) with the server's pid and SIGTERM; no memory is involved.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// The first 16 hex digits of `file`'s SHA-256 (the key of a venv built from it).
pub fn hash16(file: &std::path::Path) -> String {
    use sha2::Digest;
    let data = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let h = sha2::Sha256::digest(&data);
    h.iter().map(|b| format!("{b:02x}")).collect::<String>()[..16].to_string()
}

/// A tiny authoritative DNS server on `u` (a socket a test bound in a namespace it made):
/// A records for `records` (name → IPv4), NXDOMAIN for any other name, one thread until the
/// socket fails. Returns the names asked, in order.
pub fn dns_server(
    u: std::net::UdpSocket,
    records: &[(&str, [u8; 4])],
) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    let records: Vec<(String, [u8; 4])> = records
        .iter()
        .map(|(n, ip)| (n.to_ascii_lowercase(), *ip))
        .collect();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let asked = seen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((n, from)) = u.recv_from(&mut buf) {
            let q = &buf[..n];
            if n < 12 {
                continue;
            }
            // The question name.
            let mut i = 12;
            let mut labels = Vec::new();
            while i < n && q[i] != 0 {
                let l = q[i] as usize;
                labels.push(String::from_utf8_lossy(&q[i + 1..(i + 1 + l).min(n)]).to_string());
                i += 1 + l;
            }
            let qend = i + 5; // zero byte + qtype + qclass
            if qend > n {
                continue;
            }
            let name = labels.join(".").to_ascii_lowercase();
            let qtype = u16::from_be_bytes([q[i + 1], q[i + 2]]);
            if let Ok(mut a) = asked.lock() {
                a.push(name.clone());
            }
            let ip = records.iter().find(|(r, _)| *r == name).map(|(_, ip)| *ip);
            let mut r = q[..qend].to_vec();
            r[2] = 0x84 | (q[2] & 0x01); // QR, AA, RD copied
            r[3] = if ip.is_some() { 0x00 } else { 0x03 };
            r[6..12].copy_from_slice(&[0, 0, 0, 0, 0, 0]);
            if let (Some(ip), 1) = (ip, qtype) {
                r[7] = 1; // one answer
                r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
                r.extend_from_slice(&ip);
            }
            let _ = u.send_to(&r, from);
        }
    });
    seen
}

/// Runs `code` in sandbox `id`'s default context through the runtime; (stdout, stderr).
/// Panics when the call fails or the code raised.
pub fn run_code_text(rt: &ember_runtime::Runtime, id: &str, code: &str) -> (String, String) {
    use ember_agent::protocol::{EventKind, RunCodeRequest};
    let req = RunCodeRequest {
        code: code.into(),
        ..Default::default()
    };
    let mut out = String::new();
    let mut err = String::new();
    rt.run_code(id, &req, &mut |ev| {
        match ev {
            EventKind::Stdout { data } => out.push_str(&String::from_utf8_lossy(data)),
            EventKind::Stderr { data } => err.push_str(&String::from_utf8_lossy(data)),
            EventKind::Exception(x) => err.push_str(&format!("{}: {}", x.name, x.value)),
            _ => {}
        }
        true
    })
    .unwrap_or_else(|e| panic!("run_code in {id}: {e}"));
    assert!(err.is_empty(), "code in {id} failed: {err}\n{code}");
    (out, err)
}

/// Whether this process runs as root (the network, browser and secrets suites need it).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// The programs of `tools` (name, an argument that makes it print its version) that are
/// missing or fail here.
pub fn missing_tools(tools: &[(&'static str, &str)]) -> Vec<&'static str> {
    tools
        .iter()
        .filter(|(b, v)| {
            std::process::Command::new(b)
                .arg(v)
                .output()
                .map(|o| !o.status.success())
                .unwrap_or(true)
        })
        .map(|(b, _)| *b)
        .collect()
}
