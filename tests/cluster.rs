//! ember on many hosts, for real (docs/cluster.md): hosts are network namespaces this test
//! makes, joined by a bridge in a namespace of their own; a real PostgreSQL (Debian's, started
//! by the test in a temporary directory) in one, three `ember node`s (each with its own
//! `$EMBER_HOME`, uid range and address pool) and two `ember gateway`s in others. The test
//! plays the engine: it starts, restarts and stops the processes. The test's own namespace
//! reaches the bridge through one veth pair; no namespace has a default route, so no packet
//! of the test can leave the machine.
//!
//! Scenarios (bounded: ~1–2 min here):
//! - every node registers and heartbeats (`ember cluster status`);
//! - creates through both gateways spread over the three nodes, and every sandbox is reachable
//!   through the other gateway with its interpreter state (a variable set through one gateway
//!   is read through the other);
//! - a file goes in through one gateway and out through the other, intact;
//! - a guest port exposed through one gateway serves HTTP through the other (the port
//!   proxy's connection tunnels through the sandbox's node), and over HTTPS by E2B's host
//!   route (`<port>-<id>.<domain>`) through gateway 1's TLS listener;
//! - a gateway restarted (stateless: routes are in the directory) serves the same sandboxes;
//! - the E2B Python SDK, unchanged: create, `run_code`, `files`, `commands` through gateway 1,
//!   then `Sandbox.connect` and the same sandbox's state through gateway 2;
//! - kill through one gateway, gone through the other;
//! - a quota of 5 live sandboxes holds across gateways: ten creates racing through both let
//!   exactly 5 in, and a kill frees a place at once.
//!
//! - the blob store is a real S3 server (moto's, in a namespace of its own): node n1 publishes
//!   the templates; n2 and n3 have caches of their own (empty: nothing travels between nodes
//!   but through S3) and pull a template on their first create of it;
//! - a sandbox paused on its node, uploaded, then that node stopped: the next call through the
//!   other gateway continues it on another node with its interpreter state; the node, back,
//!   drops its stale copy.
//!
//! - with a node down, a sandbox's artifacts (from S3) and audit log (from PostgreSQL) are
//!   read through a gateway;
//! - a fork's children spread over the nodes, each with its parent's state;
//! - a drain: every sandbox of the drained node continues on another, state intact.
//!
//! - a named snapshot, fleet-wide by name, uploaded; creates from it on several nodes;
//!
//! - the directory away for 10 s: calls to existing sandboxes go on, creates fail fast with
//!   503, nothing is declared lost, creates come back after it returns;
//! - a host that dies (node and VMMs killed) is declared lost within ~10 s by the
//!   database's clock; its running sandbox answers "lost with its node"; its paused,
//!   uploaded one continues elsewhere; back, it registers with a new epoch.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ember_tests::{bin, template};

const NAME: &str = "a_fleet_of_three_nodes_serves_through_either_gateway";
/// The fabric's subnet (one /24, on a bridge in its own namespace).
const NET: &str = "10.231.0";
const PG_PORT: u16 = 5432;
const INTERNAL_PORT: u16 = 7100;
const API_PORT: u16 = 7070;
const S3_PORT: u16 = 5000;
const TLS_PORT: u16 = 7443;
/// The E2B sandbox domain of gateway 1.
const DOMAIN: &str = "fleet.test";
/// The blob store's bucket and prefix.
const BLOBS: &str = "s3://ember/fleet";

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ip(args: &[&str]) {
    run(Command::new("ip").args(args));
}

fn in_ns(ns: &str, args: &[&str]) {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).args(args);
    run(&mut c);
}

/// PostgreSQL's programs (Debian puts them under /usr/lib/postgresql/<version>/bin).
fn pg_bin() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|d| d.join("initdb").is_file() && d.join("pg_ctl").is_file())
        .collect();
    dirs.sort();
    dirs.pop()
}

/// A process of the cluster, with its log.
struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// The namespaces, links, database and processes; all removed on drop.
struct Cluster {
    prefix: String,
    dir: tempfile::TempDir,
    pg_dir: PathBuf,
    pg_bin: PathBuf,
    namespaces: Vec<String>,
    root_link: String,
    procs: Vec<Proc>,
}

impl Cluster {
    fn ns(&self, host: &str) -> String {
        format!("{}{host}", self.prefix)
    }

    fn db_url(&self) -> String {
        format!("postgres://ember@{NET}.2:{PG_PORT}/ember")
    }

    /// Makes the fabric and host `host` at `{NET}.{octet}`.
    fn add_host(&mut self, host: &str, octet: u8) {
        let ns = self.ns(host);
        ip(&["netns", "add", &ns]);
        self.namespaces.push(ns.clone());
        let (inside, outside) = (
            format!("{}{host}i", self.prefix),
            format!("{}{host}o", self.prefix),
        );
        ip(&[
            "link", "add", &inside, "type", "veth", "peer", "name", &outside,
        ]);
        ip(&["link", "set", &inside, "netns", &ns]);
        ip(&["link", "set", &outside, "netns", &self.ns("fab")]);
        in_ns(
            &self.ns("fab"),
            &["ip", "link", "set", &outside, "master", "br0", "up"],
        );
        in_ns(
            &ns,
            &[
                "ip",
                "addr",
                "add",
                &format!("{NET}.{octet}/24"),
                "dev",
                &inside,
            ],
        );
        in_ns(&ns, &["ip", "link", "set", &inside, "up"]);
        in_ns(&ns, &["ip", "link", "set", "lo", "up"]);
    }

    fn new(pg_bin: PathBuf) -> Cluster {
        let prefix = format!("ec{}", std::process::id() % 100_000);
        let dir = tempfile::Builder::new()
            .prefix("ember-cluster-")
            .tempdir()
            .expect("temp dir");
        let pg_dir = dir.path().join("pg");
        let mut c = Cluster {
            root_link: format!("{prefix}r"),
            prefix,
            pg_dir,
            pg_bin,
            dir,
            namespaces: Vec::new(),
            procs: Vec::new(),
        };
        let fab = c.ns("fab");
        ip(&["netns", "add", &fab]);
        c.namespaces.push(fab.clone());
        in_ns(&fab, &["ip", "link", "add", "br0", "type", "bridge"]);
        in_ns(&fab, &["ip", "link", "set", "br0", "up"]);
        // The test's own way in: a veth whose far end is on the bridge. Only the /24's
        // connected route is added here; nothing routes beyond the fabric.
        let far = format!("{}rf", c.prefix);
        ip(&[
            "link",
            "add",
            &c.root_link,
            "type",
            "veth",
            "peer",
            "name",
            &far,
        ]);
        ip(&["link", "set", &far, "netns", &fab]);
        in_ns(&fab, &["ip", "link", "set", &far, "master", "br0", "up"]);
        ip(&["addr", "add", &format!("{NET}.254/24"), "dev", &c.root_link]);
        ip(&["link", "set", &c.root_link, "up"]);
        c
    }

    /// Initialises and starts PostgreSQL in host `pg` ({NET}.2), as the `postgres` account,
    /// with a database `ember` that the fabric may reach without a password.
    fn start_postgres(&mut self) {
        self.add_host("pg", 2);
        std::fs::create_dir_all(&self.pg_dir).unwrap();
        // The temporary directory is root's (0700): let the postgres account through.
        run(Command::new("chmod").arg("755").arg(self.dir.path()));
        run(Command::new("chown")
            .arg("postgres:postgres")
            .arg(&self.pg_dir));
        let data = self.pg_dir.join("data");
        run(Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.pg_bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "ember", "--auth=trust", "-E", "UTF8"]));
        let hba = data.join("pg_hba.conf");
        let mut text = std::fs::read_to_string(&hba).unwrap();
        text.push_str(&format!("host all all {NET}.0/24 trust\n"));
        std::fs::write(&hba, text).unwrap();
        self.pg_ctl("start");
        run(Command::new(self.pg_bin.join("psql"))
            .args(["-h", &format!("{NET}.2"), "-p", &PG_PORT.to_string()])
            .args([
                "-U",
                "ember",
                "-d",
                "postgres",
                "-qc",
                "CREATE DATABASE ember",
            ]));
    }

    /// `pg_ctl start` (in host `pg`, listening on {NET}.2) or `pg_ctl stop` (fast: open
    /// connections are cut, as when the database goes away).
    fn pg_ctl(&self, action: &str) {
        let opts = format!(
            "-c listen_addresses={NET}.2 -c port={PG_PORT} -c unix_socket_directories={}",
            self.pg_dir.display()
        );
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns",
            "exec",
            &self.ns("pg"),
            "runuser",
            "-u",
            "postgres",
            "--",
        ])
        .arg(self.pg_bin.join("pg_ctl"))
        .arg("-D")
        .arg(self.pg_dir.join("data"));
        match action {
            "start" => cmd
                .args(["-o", &opts, "-l"])
                .arg(self.pg_dir.join("log"))
                .args(["-w", "-t", "60", "start"]),
            _ => cmd.args(["-m", "fast", "-w", "stop"]),
        };
        run(&mut cmd);
    }

    /// Starts moto's S3 server in host `s3` ({NET}.3) and makes the bucket.
    fn start_s3(&mut self, moto: &Path) {
        self.add_host("s3", 3);
        let log = self.dir.path().join("s3.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.ns("s3")))
            .arg("--")
            .arg(moto)
            .args(["-H", &format!("{NET}.3"), "-p", &S3_PORT.to_string()])
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", moto.display()));
        self.procs.push(Proc {
            name: "s3".into(),
            child,
            log,
        });
        let url = format!("http://{NET}.3:{S3_PORT}/ember");
        let t0 = Instant::now();
        while ureq::put(&url)
            .timeout(Duration::from_secs(2))
            .call()
            .is_err()
        {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the S3 server did not start:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `psql -Atc SQL` on the directory.
    fn sql(&self, q: &str) -> String {
        run(Command::new(self.pg_bin.join("psql"))
            .args(["-h", &format!("{NET}.2"), "-p", &PG_PORT.to_string()])
            .args(["-U", "ember", "-d", "ember", "-Atc", q]))
        .trim()
        .to_string()
    }

    /// Waits (up to 60 s) until `q` (a boolean query) answers true; `what` names it.
    fn wait_sql(&self, q: &str, what: &str) {
        let t0 = Instant::now();
        while self.sql(q) != "t" {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{what} (60 s):\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The log of process `name`.
    fn log_of(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Waits (up to `secs`) for a line of `name`'s log that contains `needle`; returns it.
    fn wait_log(&self, name: &str, needle: &str, secs: u64) -> String {
        let t0 = Instant::now();
        loop {
            if let Some(l) = self.log_of(name).lines().find(|l| l.contains(needle)) {
                return l.to_string();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "{name} never logged {needle:?} in {secs} s:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn spawn(&mut self, name: &str, host: &str, args: &[String], home: Option<&Path>) {
        let log = self.dir.path().join(format!("{name}.log"));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        // Into the host's network namespace only: `ip netns exec` would also remount /sys,
        // hiding the cgroup hierarchies the jailer needs.
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", self.ns(host)))
            .arg("--")
            .arg(bin("ember"))
            .args(args)
            .env("EMBER_VMM", bin("ember-vmm"))
            .env("EMBER_JAILER", bin("ember-jailer"))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        if let Some(h) = home {
            cmd.env("EMBER_HOME", h);
            // Nodes other than n1 have a template cache of their own (n1 uses the test's,
            // where the templates are built).
            if !h.ends_with("n1") {
                cmd.env("EMBER_CACHE", h.join("cache"));
            }
        }
        cmd.env("AWS_ENDPOINT_URL", format!("http://{NET}.3:{S3_PORT}"))
            .env("AWS_ACCESS_KEY_ID", "ember-test")
            .env("AWS_SECRET_ACCESS_KEY", "ember-test")
            .env("AWS_REGION", "us-east-1");
        let child = cmd.spawn().unwrap_or_else(|e| panic!("start {name}: {e}"));
        self.procs.push(Proc {
            name: name.to_string(),
            child,
            log,
        });
    }

    fn start_node(&mut self, i: u8) {
        let name = format!("n{i}");
        if !self.namespaces.contains(&self.ns(&name)) {
            self.add_host(&name, 10 + i);
        }
        let home = self.dir.path().join(&name);
        std::fs::create_dir_all(&home).unwrap();
        let args: Vec<String> = vec![
            "node".into(),
            "--node-id".into(),
            name.clone(),
            "--db".into(),
            self.db_url(),
            "--internal-listen".into(),
            format!("{NET}.{}:{INTERNAL_PORT}", 10 + i),
            "--node-token-file".into(),
            self.dir.path().join("node-token").display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{API_PORT}"),
            "--uid-base".into(),
            (400_000 + u32::from(i) * 10_000).to_string(),
            "--net-pool".into(),
            format!("10.24{i}.0.0/16"),
            "--max-running".into(),
            "20".into(),
            "--blobs".into(),
            BLOBS.into(),
        ];
        let mut args = args;
        args.extend([
            "--label".to_string(),
            format!("zone={}", if i == 3 { "b" } else { "a" }),
        ]);
        if i == 1 {
            for t in ["default", "python-data"] {
                args.extend(["--publish".to_string(), t.to_string()]);
            }
        }
        self.spawn(&name, &name, &args, Some(&home));
    }

    fn gateway_args(&self, i: u8) -> Vec<String> {
        vec![
            "gateway".into(),
            "--listen".into(),
            format!("{NET}.{}:{API_PORT}", 20 + i),
            "--db".into(),
            self.db_url(),
            "--node-token-file".into(),
            self.dir.path().join("node-token").display().to_string(),
            "--token-file".into(),
            self.dir.path().join("gw-token").display().to_string(),
            "--blobs".into(),
            BLOBS.into(),
        ]
    }

    fn start_gateway(&mut self, i: u8, new_host: bool) {
        let name = format!("gw{i}");
        if new_host {
            self.add_host(&name, 20 + i);
        }
        let mut args = self.gateway_args(i);
        if i == 1 {
            // Gateway 1 also serves HTTPS for the E2B domain (its certificates in a directory
            // every gateway of a fleet would share).
            args.extend([
                "--domain".to_string(),
                DOMAIN.to_string(),
                "--tls-listen".to_string(),
                format!("{NET}.21:{TLS_PORT}"),
                "--tls-dir".to_string(),
                self.dir.path().join("tls").display().to_string(),
            ]);
        }
        self.spawn(&name, &name, &args, None);
    }

    fn stop(&mut self, name: &str) {
        if let Some(i) = self.procs.iter().position(|p| p.name == name) {
            let mut p = self.procs.remove(i);
            // `nsenter` execs the program: the pid is ember's.
            // SAFETY: kill has no memory effects; the pid is our child's (not yet reaped).
            unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
            let t0 = Instant::now();
            while p.child.try_wait().ok().flatten().is_none()
                && t0.elapsed() < Duration::from_secs(15)
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }

    /// A host's death: node `i`'s process and every VMM it started (its jails' uids) are
    /// killed with SIGKILL at once.
    fn kill_host(&mut self, i: u8) {
        let name = format!("n{i}");
        if let Some(k) = self.procs.iter().position(|p| p.name == name) {
            let mut p = self.procs.remove(k);
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
        let base = 400_000 + u32::from(i) * 10_000;
        let ps = run(Command::new("ps").args(["-eo", "pid=,uid="]));
        for l in ps.lines() {
            let mut f = l.split_whitespace();
            let (Some(pid), Some(uid)) = (f.next(), f.next()) else {
                continue;
            };
            let (Ok(pid), Ok(uid)) = (pid.parse::<i32>(), uid.parse::<u32>()) else {
                continue;
            };
            if (base..base + 10_000).contains(&uid) {
                // SAFETY: kill has no memory effects; the pid is a VMM of this test's node.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }

    fn logs(&self) -> String {
        self.procs
            .iter()
            .map(|p| format!("--- {} ---\n{}", p.name, p.log_tail(30)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Waits until `url` answers 200 (a process's health endpoint).
    fn wait_up(&mut self, name: &str, url: &str) {
        let t0 = Instant::now();
        loop {
            if ureq::get(url)
                .timeout(Duration::from_secs(2))
                .call()
                .is_ok()
            {
                return;
            }
            if let Some(p) = self.procs.iter_mut().find(|p| p.name == name) {
                if let Ok(Some(st)) = p.child.try_wait() {
                    panic!("{name} exited ({st}):\n{}", p.log_tail(50));
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{name} not up at {url} after 60 s:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn gw_url(&self, i: u8) -> String {
        format!("http://{NET}.{}:{API_PORT}", 20 + i)
    }

    fn token(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("gw-token"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// `ember ARGS` against gateway `gw`; (success, stdout, stderr).
    fn ember(&self, gw: u8, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(bin("ember"))
            .args(args)
            .env("EMBER_URL", self.gw_url(gw))
            .env("EMBER_TOKEN", self.token())
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn ember_ok(&self, gw: u8, args: &[&str]) -> String {
        let (ok, out, err) = self.ember(gw, args);
        assert!(
            ok,
            "ember {args:?} through gateway {gw}: {err}\n{out}\n{}",
            self.logs()
        );
        out
    }

    fn status(&self) -> Vec<serde_json::Value> {
        let out = run(Command::new(bin("ember")).args([
            "cluster",
            "status",
            "--db",
            &self.db_url(),
            "--json",
        ]));
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("cluster status --json: {e}: {out}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Sandboxes first (nodes leave their VMs running when they stop, by design).
        if self.procs.iter().any(|p| p.name.starts_with("gw")) {
            let gw = if self.procs.iter().any(|p| p.name == "gw1") {
                1
            } else {
                2
            };
            let (_, list, _) = self.ember(gw, &["sandbox", "ls"]);
            for id in list
                .lines()
                .skip(1)
                .filter_map(|l| l.split_whitespace().next())
            {
                let _ = self.ember(gw, &["sandbox", "kill", id]);
            }
        }
        let names: Vec<String> = self.procs.iter().map(|p| p.name.clone()).collect();
        for n in names {
            self.stop(&n);
        }
        if self.pg_dir.join("data/postmaster.pid").exists() {
            let _ = Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(self.pg_bin.join("pg_ctl"))
                .arg("-D")
                .arg(self.pg_dir.join("data"))
                .args(["-m", "immediate", "stop"])
                .output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.root_link])
            .output();
        for ns in self.namespaces.drain(..).rev() {
            let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        }
    }
}

fn e2b_python() -> Result<PathBuf, String> {
    let venv = std::env::var_os("EMBER_E2B_VENV")
        .map(PathBuf::from)
        .ok_or("EMBER_E2B_VENV is not set (scripts/test.sh sets it)")?;
    let py = venv.join("bin/python");
    if py.is_file() {
        Ok(py)
    } else {
        Err(format!("no Python SDK at {}", py.display()))
    }
}

#[test]
fn a_fleet_of_three_nodes_serves_through_either_gateway() {
    let Some(pg) = pg_bin() else {
        ember_tests::skip(
            NAME,
            "no PostgreSQL under /usr/lib/postgresql (Debian's postgresql)",
        );
        return;
    };
    if !Path::new("/dev/kvm").exists() {
        ember_tests::skip(NAME, "no /dev/kvm");
        return;
    }
    template("default");
    template("python-data");
    let t0 = Instant::now();
    let mut c = Cluster::new(pg);
    c.start_postgres();
    // Both tokens exist before anything starts (no two processes race to create them).
    for f in ["node-token", "gw-token"] {
        let path = c.dir.path().join(f);
        std::fs::write(&path, format!("{:032x}\n", rand_u128())).unwrap();
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o600);
        std::fs::set_permissions(&path, mode).unwrap();
    }
    let moto = match std::env::var_os("EMBER_MOTO_SERVER") {
        Some(m) => PathBuf::from(m),
        None => {
            ember_tests::skip(
                NAME,
                "EMBER_MOTO_SERVER is not set (scripts/s3-server.sh, run by scripts/test.sh)",
            );
            return;
        }
    };
    c.start_s3(&moto);
    // n1 publishes the templates into S3 before the others start.
    c.start_node(1);
    let t_pub = Instant::now();
    for t in ["default", "python-data"] {
        let line = c.wait_log("n1", &format!("template {t}: published"), 300);
        eprintln!("{}", line.split("INFO").last().unwrap_or(&line).trim());
    }
    eprintln!(
        "templates published in {:.1} s",
        t_pub.elapsed().as_secs_f64()
    );
    for i in 2..=3 {
        c.start_node(i);
    }
    for i in 1..=3u8 {
        let url = format!("http://{NET}.{}:{INTERNAL_PORT}/internal/v1/health", 10 + i);
        c.wait_up(&format!("n{i}"), &url);
    }
    for i in 1..=2 {
        c.start_gateway(i, true);
    }
    for i in 1..=2u8 {
        let url = format!("{}/healthz", c.gw_url(i));
        c.wait_up(&format!("gw{i}"), &url);
    }
    eprintln!("cluster up in {:.1} s", t0.elapsed().as_secs_f64());

    // Every node registered and heartbeats.
    let nodes = c.status();
    assert_eq!(nodes.len(), 3, "{nodes:?}");
    let holds =
        |n: &serde_json::Value, t: &str| n["templates"].as_array().unwrap().iter().any(|x| x == t);
    for n in &nodes {
        assert!(n["heartbeat_age_secs"].as_f64().unwrap() < 5.0, "{n}");
        // Only n1 has built templates; the others pull them.
        assert_eq!(holds(n, "default"), n["id"] == "n1", "{n}");
    }

    // Creates through both gateways spread over the nodes.
    let mut ids = Vec::new();
    let mut create_ms = Vec::new();
    for k in 0..30u8 {
        let gw = 1 + k % 2;
        let t = Instant::now();
        let id = c.ember_ok(gw, &["sandbox", "create"]).trim().to_string();
        create_ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(id.len(), 16, "{id}");
        ids.push((id, gw));
    }
    create_ms.sort_by(f64::total_cmp);
    eprintln!(
        "create through a gateway (ember CLI, end to end): median {:.0} ms, max {:.0} ms",
        create_ms[create_ms.len() / 2],
        create_ms[create_ms.len() - 1]
    );
    let per_node: Vec<i64> = c
        .status()
        .iter()
        .map(|n| n["sandboxes"].as_i64().unwrap())
        .collect();
    assert_eq!(per_node.iter().sum::<i64>(), 30, "{per_node:?}");
    assert!(
        per_node.iter().all(|n| *n >= 1),
        "creates did not spread: {per_node:?}"
    );
    // n2 and n3 pulled the template from S3 into their own caches, under the same key.
    let key = std::fs::read_link(ember_runtime::paths::templates_dir().join("names/default"))
        .unwrap()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    for i in 2..=3 {
        let line = c.wait_log(&format!("n{i}"), "template default: pulled", 5);
        eprintln!(
            "n{i}: {}",
            line.split("INFO").last().unwrap_or(&line).trim()
        );
        let cache = c.dir.path().join(format!("n{i}/cache"));
        let record = cache.join(format!("templates/{key}/template.json"));
        let info: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
        let image = PathBuf::from(info["rootfs"].as_str().unwrap());
        assert!(
            image.starts_with(&cache),
            "n{i}'s template uses {}",
            image.display()
        );
        assert!(image.is_file());
    }
    // The next heartbeats say so.
    let t_hb = Instant::now();
    while !c.status().iter().all(|n| holds(n, "default")) {
        assert!(t_hb.elapsed() < Duration::from_secs(5), "{:?}", c.status());
        std::thread::sleep(Duration::from_millis(200));
    }

    // State set through one gateway is read through the other.
    for (k, (id, gw)) in ids.iter().enumerate() {
        c.ember_ok(*gw, &["code", id, &format!("x = {k} * 7")]);
        let other = 3 - gw;
        let out = c.ember_ok(other, &["code", id, "print(x)"]);
        assert_eq!(
            out.trim(),
            (k * 7).to_string(),
            "sandbox {id} through gateway {other}"
        );
    }

    // A file in through one gateway, out through the other.
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
    let src = c.dir.path().join("in.bin");
    let dst = c.dir.path().join("out.bin");
    std::fs::write(&src, &data).unwrap();
    let id0 = ids[0].0.clone();
    c.ember_ok(
        1,
        &["cp", src.to_str().unwrap(), &format!("{id0}:/tmp/in.bin")],
    );
    c.ember_ok(
        2,
        &["cp", &format!("{id0}:/tmp/in.bin"), dst.to_str().unwrap()],
    );
    assert_eq!(
        std::fs::read(&dst).unwrap(),
        data,
        "the file changed on its way"
    );

    // A guest port through a gateway: the port proxy's connection is a tunnel through the
    // sandbox's node (an upgrade on its internal API).
    let web = ids[2].0.clone();
    c.ember_ok(
        1,
        &[
            "code",
            &web,
            "import subprocess, pathlib\n\
             pathlib.Path('/tmp/www').mkdir(exist_ok=True)\n\
             pathlib.Path('/tmp/www/hello.txt').write_text('hello through the fleet')\n\
             subprocess.Popen(['python3', '-m', 'http.server', '8000', '--directory', \
             '/tmp/www'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)",
        ],
    );
    c.ember_ok(2, &["sandbox", "expose", &web, "8000"]);
    let page = format!("{}/v1/sandboxes/{web}/ports/8000/hello.txt", c.gw_url(2));
    let t_web = Instant::now();
    let body = loop {
        let r = ureq::get(&page)
            .set("authorization", &format!("Bearer {}", c.token()))
            .timeout(Duration::from_secs(10))
            .call();
        match r {
            Ok(r) => break r.into_string().unwrap(),
            Err(e) => {
                assert!(
                    t_web.elapsed() < Duration::from_secs(30),
                    "{page}: {e}\n{}",
                    c.logs()
                );
                std::thread::sleep(Duration::from_millis(300));
            }
        }
    };
    assert_eq!(body, "hello through the fleet");
    // The same page through gateway 1's HTTPS listener, by E2B's host route, with the
    // sandbox's own access token (as the E2B SDKs send it).
    let net: serde_json::Value = ureq::get(&format!("{}/v1/sandboxes/{web}/network", c.gw_url(1)))
        .set("authorization", &format!("Bearer {}", c.token()))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    let own = net["access_token"].as_str().unwrap().to_string();
    let host = format!("8000-{web}.{DOMAIN}");
    let out = Command::new("curl")
        .args(["-sS", "--fail", "--max-time", "20", "--resolve"])
        .arg(format!("{host}:{TLS_PORT}:{NET}.21"))
        .arg("--cacert")
        .arg(c.dir.path().join("tls/ca.pem"))
        .arg("-H")
        .arg(format!("X-Access-Token: {own}"))
        .arg("-H")
        .arg(format!("E2B-Traffic-Access-Token: {own}"))
        .arg(format!("https://{host}:{TLS_PORT}/hello.txt"))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "hello through the fleet",
        "https://{host}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = ureq::get(&page).call();
    assert!(
        matches!(r, Err(ureq::Error::Status(401, _))),
        "a private port without a token: {r:?}"
    );

    // Placement by label: only n3 is in zone b; a label no node has is refused by name.
    let zb = c
        .ember_ok(2, &["sandbox", "create", "--node-label", "zone=b"])
        .trim()
        .to_string();
    assert_eq!(
        c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{zb}'")),
        "n3"
    );
    c.ember_ok(1, &["sandbox", "kill", &zb]);
    let (ok, _, err) = c.ember(1, &["sandbox", "create", "--node-label", "zone=nowhere"]);
    assert!(!ok && err.contains("zone=nowhere"), "{err}");

    // A gateway restarted serves the same sandboxes (it keeps nothing).
    c.stop("gw1");
    c.start_gateway(1, false);
    let url = format!("{}/healthz", c.gw_url(1));
    c.wait_up("gw1", &url);
    let out = c.ember_ok(1, &["code", &id0, "print(x)"]);
    assert_eq!(out.trim(), "0");

    // The E2B Python SDK, unchanged, through gateway 1 then gateway 2.
    match e2b_python() {
        Ok(py) => {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/e2b_two_gateways.py");
            let out = Command::new(py)
                .arg(&script)
                .arg(c.gw_url(1))
                .arg(c.gw_url(2))
                .env("E2B_API_KEY", c.token())
                .stdin(Stdio::null())
                .output()
                .unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                out.status.success() && text.contains("ok"),
                "{text}\n{}",
                c.logs()
            );
            eprintln!("{}", text.trim());
        }
        Err(why) => ember_tests::skip(&format!("{NAME} (in part: the E2B SDK)"), &why),
    }

    // Paused on its node, uploaded, the node stopped: the next call through the other
    // gateway continues the sandbox on another node, state intact.
    let (mv, _) = ids[3].clone();
    let from = c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{mv}'"));
    c.ember_ok(1, &["sandbox", "pause", &mv]);
    c.wait_sql(
        &format!("SELECT blob IS NOT NULL FROM sandboxes WHERE id = '{mv}'"),
        &format!("the pause of {mv} was not uploaded"),
    );
    let line = c.wait_log(&from, &format!("sandbox {mv}: pause uploaded"), 5);
    eprintln!(
        "{from}: {}",
        line.split("INFO").last().unwrap_or(&line).trim()
    );
    // Another sandbox of that node makes an artifact (collected, uploaded) and leaves an
    // audit trail: both stay readable through a gateway while the node is down.
    let (art, _) = ids
        .iter()
        .find(|(id, _)| {
            *id != mv && c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{id}'")) == from
        })
        .expect("another sandbox on the node")
        .clone();
    c.ember_ok(
        1,
        &[
            "code",
            &art,
            "open('/workspace/outputs/fleet.txt', 'w').write('made before its node went away')",
        ],
    );
    c.ember_ok(1, &["artifacts", &art, "--collect"]);
    c.wait_sql(
        &format!("SELECT artifacts IS NOT NULL FROM sandboxes WHERE id = '{art}'"),
        &format!("the artifacts of {art} were not uploaded"),
    );
    // The next heartbeat ships the audit records.
    std::thread::sleep(Duration::from_millis(1500));
    c.stop(&from);
    // The node said it stopped (gateways read liveness at most a second old).
    let stopped = c
        .status()
        .iter()
        .any(|n| n["id"] == from.as_str() && n["status"] == "stopped");
    assert!(stopped, "{from} did not record its stop: {:?}", c.status());
    std::thread::sleep(Duration::from_millis(1100));
    let t_mv = Instant::now();
    let out = c.ember_ok(2, &["code", &mv, "print(x)"]);
    let moved_ms = t_mv.elapsed().as_secs_f64() * 1e3;
    assert_eq!(out.trim(), "21", "sandbox {mv} lost its state on the way");
    let to = c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{mv}'"));
    assert_ne!(to, from, "{mv} did not move");
    let line = c.wait_log("gw2", &format!("sandbox {mv}: moved"), 5);
    eprintln!(
        "cross-node resume {from} -> {to}: {moved_ms:.0} ms to the first result ({})",
        line.split("INFO").last().unwrap_or(&line).trim()
    );
    let listed = c.ember_ok(2, &["artifacts", &art]);
    assert!(
        listed.contains("fleet.txt"),
        "artifacts of {art} with its node down: {listed}"
    );
    let got = c.dir.path().join("fleet.txt");
    c.ember_ok(
        2,
        &[
            "artifacts",
            &art,
            "--get",
            "fleet.txt",
            "-o",
            got.to_str().unwrap(),
        ],
    );
    assert_eq!(
        std::fs::read_to_string(&got).unwrap(),
        "made before its node went away"
    );
    let logs = c.ember_ok(1, &["logs", &art]);
    assert!(
        logs.contains("run_code") && logs.contains("collect_artifacts"),
        "audit of {art} with its node down: {logs}"
    );

    // Its history spans both nodes: the pause on the first, the move to the second.
    let hist = c.ember_ok(1, &["sandbox", "history", &mv]);
    assert!(
        hist.contains("paused by request") && hist.contains(&format!("continued from node {from}")),
        "history of {mv}: {hist}"
    );

    // The node comes back: its other sandboxes are re-adopted, its copy of the moved one
    // dropped.
    let n: u8 = from[1..].parse().unwrap();
    c.start_node(n);
    c.wait_up(
        &from,
        &format!("http://{NET}.{}:{INTERNAL_PORT}/internal/v1/health", 10 + n),
    );
    let stale = c.dir.path().join(format!("{from}/sandboxes/{mv}"));
    let t_back = Instant::now();
    while stale.exists() {
        assert!(
            t_back.elapsed() < Duration::from_secs(20),
            "{from} kept its copy of {mv}:\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for (k, (id, _)) in ids.iter().enumerate() {
        let out = c.ember_ok(1, &["code", id, "print(x)"]);
        assert_eq!(
            out.trim(),
            (k * 7).to_string(),
            "sandbox {id} after {from} came back"
        );
    }

    // A drain: the node that holds the moved sandbox pauses and uploads everything it runs,
    // and each sandbox continues on another node, state intact; restarted, it is up again.
    let on_it: Vec<(usize, String)> = ids
        .iter()
        .enumerate()
        .filter(|(_, (id, _))| {
            c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{id}'")) == to
        })
        .map(|(k, (id, _))| (k, id.clone()))
        .collect();
    assert!(!on_it.is_empty());
    let t_drain = Instant::now();
    run(Command::new(bin("ember")).args(["cluster", "drain", "--db", &c.db_url(), "--wait", &to]));
    eprintln!(
        "drain of {to} ({} sandboxes): {:.1} s",
        on_it.len(),
        t_drain.elapsed().as_secs_f64()
    );
    for (k, id) in &on_it {
        let t = Instant::now();
        let out = c.ember_ok(1, &["code", id, "print(x)"]);
        assert_eq!(
            out.trim(),
            (k * 7).to_string(),
            "sandbox {id} after the drain"
        );
        let now_on = c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{id}'"));
        assert_ne!(now_on, to, "{id} stayed on the drained node");
        eprintln!(
            "  {id}: continued on {now_on}, first call {:.0} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    let n: u8 = to[1..].parse().unwrap();
    c.stop(&to);
    c.start_node(n);
    c.wait_up(
        &to,
        &format!("http://{NET}.{}:{INTERNAL_PORT}/internal/v1/health", 10 + n),
    );
    assert!(c
        .status()
        .iter()
        .any(|x| x["id"] == to.as_str() && x["status"] == "up"));

    // A fork: the children spread over the nodes (each moved the way a paused sandbox
    // moves), every one with its parent's state.
    let (parent, _) = ids[0].clone();
    let parent_node = c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{parent}'"));
    let t_fork = Instant::now();
    let out = c.ember_ok(1, &["sandbox", "fork", &parent, "--count", "3"]);
    let fork_ms = t_fork.elapsed().as_secs_f64() * 1e3;
    let children: Vec<String> = out.split_whitespace().map(str::to_string).collect();
    assert_eq!(children.len(), 3, "{out}");
    let mut child_nodes = std::collections::BTreeSet::new();
    for ch in &children {
        let out = c.ember_ok(2, &["code", ch, "print(x)"]);
        assert_eq!(out.trim(), "0", "fork child {ch}");
        child_nodes.insert(c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{ch}'")));
    }
    assert!(
        child_nodes.len() >= 2 && child_nodes.iter().any(|n| *n != parent_node),
        "the children of {parent} (on {parent_node}) did not spread: {child_nodes:?}"
    );
    eprintln!(
        "fork of a sandbox on {parent_node} into 3: {fork_ms:.0} ms, children on {child_nodes:?}"
    );
    for ch in &children {
        c.ember_ok(1, &["sandbox", "kill", ch]);
    }

    // A named snapshot: its name is the fleet's (a second of that name is refused), it is
    // uploaded, and creates from it land on other nodes too (the drained node, empty now, is
    // the least busy: it pulls the snapshot), each with the state it was taken with.
    let (src, _) = ids[5].clone();
    c.ember_ok(1, &["sandbox", "snapshot", &src, "--name", "fleet-snap"]);
    let (ok, _, err) = c.ember(
        2,
        &["sandbox", "snapshot", &ids[6].0, "--name", "fleet-snap"],
    );
    assert!(
        !ok && err.contains("exists"),
        "a second snapshot of that name: {err}"
    );
    c.wait_sql(
        "SELECT blob IS NOT NULL FROM snapshots WHERE name = 'fleet-snap'",
        "snapshot fleet-snap not uploaded",
    );
    let mut from_snap = Vec::new();
    let mut snap_nodes = std::collections::BTreeSet::new();
    for k in 0..4u8 {
        let id = c
            .ember_ok(
                1 + k % 2,
                &["sandbox", "create", "--snapshot", "fleet-snap"],
            )
            .trim()
            .to_string();
        let out = c.ember_ok(2 - k % 2, &["code", &id, "print(x)"]);
        assert_eq!(out.trim(), "35", "sandbox {id} from snapshot fleet-snap");
        snap_nodes.insert(c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{id}'")));
        from_snap.push(id);
    }
    let origin = c.sql("SELECT node FROM snapshots WHERE name = 'fleet-snap'");
    assert!(
        snap_nodes.iter().any(|n| *n != origin),
        "creates from the snapshot (taken on {origin}) stayed there: {snap_nodes:?}"
    );
    let other = snap_nodes.iter().find(|n| **n != origin).unwrap().clone();
    let line = c.wait_log(&other, "snapshot fleet-snap: pulled", 5);
    eprintln!(
        "4 creates from snapshot fleet-snap (taken on {origin}) landed on {snap_nodes:?}; {other}: {}",
        line.split("INFO").last().unwrap_or(&line).trim()
    );
    for id in &from_snap {
        c.ember_ok(2, &["sandbox", "kill", id]);
    }

    // Killed through one gateway, gone through the other.
    let (id1, _) = ids[1].clone();
    c.ember_ok(2, &["sandbox", "kill", &id1]);
    let (ok, _, err) = c.ember(1, &["code", &id1, "print(1)"]);
    assert!(!ok, "a killed sandbox still ran code");
    assert!(err.contains(&id1), "{err}");

    // A quota holds across gateways: two gateways racing ten creates against a quota of 5
    // let exactly 5 in; a kill frees a place at once.
    for (id, _) in &ids[2..] {
        c.ember_ok(1, &["sandbox", "kill", id]);
    }
    c.ember_ok(1, &["sandbox", "kill", &id0]);
    run(Command::new(bin("ember")).args([
        "cluster",
        "quota",
        "--db",
        &c.db_url(),
        "--max-sandboxes",
        "5",
    ]));
    let racers: Vec<_> = (0..10u8)
        .map(|k| {
            let mut cmd = Command::new(bin("ember"));
            cmd.args(["sandbox", "create"])
                .env("EMBER_URL", c.gw_url(1 + k % 2))
                .env("EMBER_TOKEN", c.token())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    for r in racers {
        let out = r.wait_with_output().unwrap();
        if out.status.success() {
            admitted.push(String::from_utf8_lossy(&out.stdout).trim().to_string());
        } else {
            refused.push(String::from_utf8_lossy(&out.stderr).into_owned());
        }
    }
    assert_eq!(
        admitted.len(),
        5,
        "admitted {admitted:?}, refused {refused:?}\n{}",
        c.logs()
    );
    for why in &refused {
        assert!(why.contains("quota"), "{why}");
    }
    let (ok, _, err) = c.ember(2, &["sandbox", "create"]);
    assert!(!ok && err.contains("quota"), "a sixth create: {err}");
    c.ember_ok(2, &["sandbox", "kill", &admitted[0]]);
    let sixth = c.ember_ok(1, &["sandbox", "create"]);
    assert_eq!(sixth.trim().len(), 16, "{sixth}");

    // The directory goes away for 10 s: calls to existing sandboxes go on (the gateways'
    // route caches; the nodes need no database to serve them), a create fails fast with a
    // 503 naming the directory, and nothing is declared lost; creates work again soon after
    // its return.
    run(Command::new(bin("ember")).args([
        "cluster",
        "quota",
        "--db",
        &c.db_url(),
        "--max-sandboxes",
        "0",
    ]));
    let alive: Vec<String> = admitted[1..]
        .iter()
        .cloned()
        .chain([sixth.trim().to_string()])
        .collect();
    for id in &alive {
        for gw in 1..=2 {
            c.ember_ok(gw, &["code", id, "print(1)"]);
        }
    }
    c.pg_ctl("stop");
    let t_out = Instant::now();
    let (mut ok_calls, mut failed_calls) = (0u32, Vec::new());
    while t_out.elapsed() < Duration::from_secs(10) {
        for (k, id) in alive.iter().enumerate() {
            let gw = 1 + (k % 2) as u8;
            let (ok, out, err) = c.ember(gw, &["code", id, "print(6 * 7)"]);
            if ok && out.trim() == "42" {
                ok_calls += 1;
            } else {
                failed_calls.push(err);
            }
        }
    }
    let t = Instant::now();
    let (ok, _, err) = c.ember(1, &["sandbox", "create"]);
    let refused_ms = t.elapsed().as_secs_f64() * 1e3;
    assert!(
        !ok && err.contains("HTTP 503") && err.contains("directory"),
        "a create with the directory away: {err}"
    );
    let total = ok_calls as usize + failed_calls.len();
    assert!(
        failed_calls.len() * 100 <= total,
        "with the directory away, {} of {total} calls failed: {:?}",
        failed_calls.len(),
        failed_calls.first()
    );
    c.pg_ctl("start");
    let t_back = Instant::now();
    let created = loop {
        let (ok, out, _) = c.ember(2, &["sandbox", "create"]);
        if ok {
            break out.trim().to_string();
        }
        assert!(
            t_back.elapsed() < Duration::from_secs(10),
            "creates did not come back:\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let back_ms = t_back.elapsed().as_secs_f64() * 1e3;
    eprintln!(
        "the directory away for 10 s: {ok_calls} of {total} calls to existing sandboxes \
         succeeded; a create was refused in {refused_ms:.0} ms (503); creates back {back_ms:.0} \
         ms after its return"
    );
    // Past the sweep's grace (it waits until it has reached the directory for longer than a
    // node's silence may last): no node was declared lost for the outage.
    std::thread::sleep(Duration::from_secs(14));
    for n in c.status() {
        assert_eq!(n["status"], "up", "after the directory's outage: {n}");
    }
    c.ember_ok(1, &["sandbox", "kill", &created]);

    // A host dies (its node and VMMs killed at once): it is declared lost by the database's
    // clock; its running sandbox is lost with it, with an error that says so (not a hang);
    // its paused, uploaded sandbox continues on another node; back, it registers again.
    let on_n3 = |c: &Cluster, code: &str| {
        let id = c
            .ember_ok(1, &["sandbox", "create", "--node-label", "zone=b"])
            .trim()
            .to_string();
        c.ember_ok(1, &["code", &id, code]);
        id
    };
    let running = on_n3(&c, "r = 1");
    let paused = on_n3(&c, "p = 2");
    c.ember_ok(2, &["sandbox", "pause", &paused]);
    c.wait_sql(
        &format!("SELECT blob IS NOT NULL FROM sandboxes WHERE id = '{paused}'"),
        &format!("the pause of {paused} was not uploaded"),
    );
    let epoch = |c: &Cluster| c.sql("SELECT epoch FROM nodes WHERE id = 'n3'");
    let before = epoch(&c);
    c.kill_host(3);
    let t_dead = Instant::now();
    while c.sql("SELECT status FROM nodes WHERE id = 'n3'") != "lost" {
        assert!(
            t_dead.elapsed() < Duration::from_secs(30),
            "n3 not declared lost:\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let detect = t_dead.elapsed().as_secs_f64();
    let t = Instant::now();
    let (ok, _, err) = c.ember(2, &["code", &running, "print(r)"]);
    assert!(!ok && err.contains("lost with its node n3"), "{err}");
    eprintln!(
        "a dead host: declared lost after {detect:.1} s; a call to its running sandbox \
         answered in {:.0} ms: {}",
        t.elapsed().as_secs_f64() * 1e3,
        err.trim()
    );
    let out = c.ember_ok(2, &["code", &paused, "print(p)"]);
    assert_eq!(out.trim(), "2", "{paused} after its host died");
    c.start_node(3);
    c.wait_up(
        "n3",
        &format!("http://{NET}.13:{INTERNAL_PORT}/internal/v1/health"),
    );
    let t_up = Instant::now();
    while c.sql("SELECT status FROM nodes WHERE id = 'n3'") != "up" {
        assert!(
            t_up.elapsed() < Duration::from_secs(10),
            "n3 did not come back"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_ne!(epoch(&c), before, "n3 came back with the same epoch");
    eprintln!(
        "cluster scenario done in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

fn rand_u128() -> u128 {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .expect("/dev/urandom");
    u128::from_le_bytes(b)
}
