//! The namespace cluster the fleet's tests run (`tests/cluster.rs`, `tests/cluster_faults.rs`):
//! hosts are network namespaces joined by a bridge in a namespace of their own; a real
//! PostgreSQL (Debian's, started in a temporary directory), moto's S3 server, `ember node`s
//! (each with its own `$EMBER_HOME`, uid range and address pool) and `ember gateway`s. The
//! test plays the engine: it starts, restarts, stops, freezes and kills the processes, and
//! cuts hosts' links. The test's own namespace reaches the bridge through one veth pair; no
//! namespace has a default route, so no packet of a test can leave the machine.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ember_tests::{bin, template};

/// The fabric's subnet (one /24, on a bridge in its own namespace).
pub const NET: &str = "10.231.0";
pub const PG_PORT: u16 = 5432;
pub const INTERNAL_PORT: u16 = 7100;
pub const API_PORT: u16 = 7070;
pub const S3_PORT: u16 = 5000;
pub const TLS_PORT: u16 = 7443;
/// The E2B sandbox domain of gateway 1.
pub const DOMAIN: &str = "fleet.test";
/// The blob store's bucket and prefix.
pub const BLOBS: &str = "s3://ember/fleet";

pub fn run(cmd: &mut Command) -> String {
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

pub fn ip(args: &[&str]) {
    run(Command::new("ip").args(args));
}

pub fn in_ns(ns: &str, args: &[&str]) {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).args(args);
    run(&mut c);
}

/// PostgreSQL's programs (Debian puts them under /usr/lib/postgresql/<version>/bin).
pub fn pg_bin() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|d| d.join("initdb").is_file() && d.join("pg_ctl").is_file())
        .collect();
    dirs.sort();
    dirs.pop()
}

/// A process of the cluster, with its log.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// The namespaces, links, database and processes; all removed on drop.
pub struct Cluster {
    pub prefix: String,
    pub dir: tempfile::TempDir,
    pub pg_dir: PathBuf,
    pub pg_bin: PathBuf,
    pub namespaces: Vec<String>,
    pub root_link: String,
    pub procs: Vec<Proc>,
    /// More arguments for every `ember node`.
    pub node_args: Vec<String>,
}

impl Cluster {
    pub fn ns(&self, host: &str) -> String {
        format!("{}{host}", self.prefix)
    }

    pub fn db_url(&self) -> String {
        format!("postgres://ember@{NET}.2:{PG_PORT}/ember")
    }

    /// Makes the fabric and host `host` at `{NET}.{octet}`.
    pub fn add_host(&mut self, host: &str, octet: u8) {
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

    pub fn new(pg_bin: PathBuf) -> Cluster {
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
            node_args: Vec::new(),
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
    pub fn start_postgres(&mut self) {
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
    pub fn pg_ctl(&self, action: &str) {
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
    pub fn start_s3(&mut self, moto: &Path) {
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
    pub fn sql(&self, q: &str) -> String {
        run(Command::new(self.pg_bin.join("psql"))
            .args(["-h", &format!("{NET}.2"), "-p", &PG_PORT.to_string()])
            .args(["-U", "ember", "-d", "ember", "-Atc", q]))
        .trim()
        .to_string()
    }

    /// Waits (up to 60 s) until `q` (a boolean query) answers true; `what` names it.
    pub fn wait_sql(&self, q: &str, what: &str) {
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
    pub fn log_of(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Waits (up to `secs`) for a line of `name`'s log that contains `needle`; returns it.
    pub fn wait_log(&self, name: &str, needle: &str, secs: u64) -> String {
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

    pub fn spawn(&mut self, name: &str, host: &str, args: &[String], home: Option<&Path>) {
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

    pub fn start_node(&mut self, i: u8) {
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
            "--label".to_string(),
            format!("host={name}"),
        ]);
        if i == 1 {
            for t in ["default", "python-data"] {
                args.extend(["--publish".to_string(), t.to_string()]);
            }
        }
        args.extend(self.node_args.iter().cloned());
        self.spawn(&name, &name, &args, Some(&home));
    }

    pub fn gateway_args(&self, i: u8) -> Vec<String> {
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

    pub fn start_gateway(&mut self, i: u8, new_host: bool) {
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

    /// Stops process `name`: SIGINT (a node leaves its VMs running for its next start to
    /// re-adopt; SIGTERM would drain it), killed after 15 s.
    /// A stop must be clean: the process's log may not show a panic.
    pub fn stop(&mut self, name: &str) {
        self.signal_and_wait(name, libc::SIGINT, Duration::from_secs(15));
        let log = self.log_of(name);
        assert!(!log.contains("panicked"), "{name} panicked:\n{log}");
    }

    /// Sends `sig` to process `name` and waits up to `wait` for it to exit (then kills it);
    /// answers how long it took to exit, if it did.
    pub fn signal_and_wait(&mut self, name: &str, sig: i32, wait: Duration) -> Option<Duration> {
        let i = self.procs.iter().position(|p| p.name == name)?;
        let mut p = self.procs.remove(i);
        // `nsenter` execs the program: the pid is ember's.
        // SAFETY: kill has no memory effects; the pid is our child's (not yet reaped).
        unsafe { libc::kill(p.child.id() as i32, sig) };
        let t0 = Instant::now();
        let mut exited = None;
        while t0.elapsed() < wait {
            if p.child.try_wait().ok().flatten().is_some() {
                exited = Some(t0.elapsed());
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = p.child.kill();
        let _ = p.child.wait();
        exited
    }

    /// Sends `sig` to process `name` (SIGSTOP, SIGCONT, SIGKILL...), leaving it in the list.
    pub fn signal(&self, name: &str, sig: i32) {
        let p = self
            .procs
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no process {name}"));
        // SAFETY: kill has no memory effects; the pid is our child's (not yet reaped).
        unsafe { libc::kill(p.child.id() as i32, sig) };
    }

    /// Whether process `name` has exited (a zombie not yet reaped counts).
    pub fn exited(&self, name: &str) -> bool {
        let Some(p) = self.procs.iter().find(|p| p.name == name) else {
            return true;
        };
        match std::fs::read_to_string(format!("/proc/{}/stat", p.child.id())) {
            // The state follows the command's closing parenthesis.
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
            Err(_) => true,
        }
    }

    /// SIGKILLs process `name` alone (a node's VMMs live on) and reaps it.
    pub fn kill_proc(&mut self, name: &str) {
        if let Some(k) = self.procs.iter().position(|p| p.name == name) {
            let mut p = self.procs.remove(k);
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }

    /// Host `host`'s link to the fabric up or down (a partition).
    pub fn link(&self, host: &str, up: bool) {
        let dev = format!("{}{host}i", self.prefix);
        in_ns(
            &self.ns(host),
            &["ip", "link", "set", &dev, if up { "up" } else { "down" }],
        );
    }

    /// The VMM processes of node `i` (its jails' uids).
    pub fn vmm_pids(&self, i: u8) -> Vec<i32> {
        let base = 400_000 + u32::from(i) * 10_000;
        let ps = run(Command::new("ps").args(["-eo", "pid=,uid="]));
        ps.lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let pid = f.next()?.parse::<i32>().ok()?;
                let uid = f.next()?.parse::<u32>().ok()?;
                (base..base + 10_000).contains(&uid).then_some(pid)
            })
            .collect()
    }

    /// Node `id`'s epoch in the directory.
    pub fn epoch(&self, id: &str) -> i64 {
        self.sql(&format!("SELECT epoch FROM nodes WHERE id = '{id}'"))
            .parse()
            .unwrap_or(-1)
    }

    /// The node a sandbox is routed to.
    pub fn node_of(&self, id: &str) -> String {
        self.sql(&format!("SELECT node FROM sandboxes WHERE id = '{id}'"))
    }

    /// Waits until `f` holds, up to `secs`; `what` names it. Answers how long it took.
    pub fn wait_until(&self, secs: u64, what: &str, mut f: impl FnMut() -> bool) -> Duration {
        let t0 = Instant::now();
        while !f() {
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "{what} (after {secs} s):\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        t0.elapsed()
    }

    /// A host's death: node `i`'s process and every VMM it started (its jails' uids) are
    /// killed with SIGKILL at once.
    pub fn kill_host(&mut self, i: u8) {
        self.kill_proc(&format!("n{i}"));
        self.kill_vmms(i);
    }

    /// SIGKILLs every VMM node `i` started (its jails' uids).
    pub fn kill_vmms(&self, i: u8) {
        for pid in self.vmm_pids(i) {
            // SAFETY: kill has no memory effects; the pid is a VMM of this test's node.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }

    pub fn logs(&self) -> String {
        self.procs
            .iter()
            .map(|p| format!("--- {} ---\n{}", p.name, p.log_tail(30)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Waits until `url` answers 200 (a process's health endpoint).
    pub fn wait_up(&mut self, name: &str, url: &str) {
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

    pub fn gw_url(&self, i: u8) -> String {
        format!("http://{NET}.{}:{API_PORT}", 20 + i)
    }

    pub fn token(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("gw-token"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// `ember ARGS` against gateway `gw`; (success, stdout, stderr).
    pub fn ember(&self, gw: u8, args: &[&str]) -> (bool, String, String) {
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

    pub fn ember_ok(&self, gw: u8, args: &[&str]) -> String {
        let (ok, out, err) = self.ember(gw, args);
        assert!(
            ok,
            "ember {args:?} through gateway {gw}: {err}\n{out}\n{}",
            self.logs()
        );
        out
    }

    pub fn status(&self) -> Vec<serde_json::Value> {
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
        // A failed test keeps every process's whole log.
        if std::thread::panicking() {
            let keep = std::env::temp_dir().join(format!("{}-logs", self.prefix));
            let _ = std::fs::create_dir_all(&keep);
            for e in std::fs::read_dir(self.dir.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                if e.path().extension().is_some_and(|x| x == "log") {
                    let _ = std::fs::copy(e.path(), keep.join(e.file_name()));
                }
            }
            eprintln!("the cluster's logs are kept in {}", keep.display());
        }
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
        for n in &names {
            // A process a test froze stops too.
            self.signal(n, libc::SIGCONT);
        }
        for n in names {
            self.stop(&n);
        }
        // What a failed test left running (VMMs of frozen, killed or partitioned nodes).
        for i in 1..=9 {
            self.kill_vmms(i);
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

pub fn e2b_python() -> Result<PathBuf, String> {
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

pub fn rand_u128() -> u128 {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .expect("/dev/urandom");
    u128::from_le_bytes(b)
}

/// A fleet for test `name`: PostgreSQL, the S3 server, nodes n1 (which publishes the
/// templates) to n3 with `node_args` more, gateways gw1 and gw2, every one up. `None` (the
/// test skipped, which fails under `CI=true`) when this machine cannot run it.
pub fn start_fleet(name: &str, node_args: &[&str]) -> Option<Cluster> {
    let Some(pg) = pg_bin() else {
        ember_tests::skip(
            name,
            "no PostgreSQL under /usr/lib/postgresql (Debian's postgresql)",
        );
        return None;
    };
    if !Path::new("/dev/kvm").exists() {
        ember_tests::skip(name, "no /dev/kvm");
        return None;
    }
    let Some(moto) = std::env::var_os("EMBER_MOTO_SERVER").map(PathBuf::from) else {
        ember_tests::skip(
            name,
            "EMBER_MOTO_SERVER is not set (scripts/s3-server.sh, run by scripts/test.sh)",
        );
        return None;
    };
    template("default");
    template("python-data");
    let mut c = Cluster::new(pg);
    c.node_args = node_args.iter().map(|a| a.to_string()).collect();
    c.start_postgres();
    // Both tokens exist before anything starts (no two processes race to create them).
    for f in ["node-token", "gw-token"] {
        let path = c.dir.path().join(f);
        std::fs::write(&path, format!("{:032x}\n", rand_u128())).unwrap();
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o600);
        std::fs::set_permissions(&path, mode).unwrap();
    }
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
        c.wait_node(i);
    }
    for i in 1..=2 {
        c.start_gateway(i, true);
    }
    for i in 1..=2u8 {
        let url = format!("{}/healthz", c.gw_url(i));
        c.wait_up(&format!("gw{i}"), &url);
    }
    Some(c)
}

impl Cluster {
    /// Waits until node `i`'s internal API answers its health check.
    pub fn wait_node(&mut self, i: u8) {
        let url = format!("http://{NET}.{}:{INTERNAL_PORT}/internal/v1/health", 10 + i);
        self.wait_up(&format!("n{i}"), &url);
    }
}
