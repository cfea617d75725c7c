//! The commands that talk to a running `ember serve`: `ember sandbox ...`, `ember code`,
//! `ember exec`, `ember cp`, `ember artifacts`, `ember logs`. Human output by default
//! (tables), `--json` for programs.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use base64::Engine;
use clap::{Args, Subcommand};
use ember_agent::protocol::EventKind;
use ember_runtime::{
    CreateRequest, ForkRequest, NetMode, NetworkPolicy, OnTimeout, SandboxInfo, SnapshotRequest,
};
use ember_server::client::{Client, ClientError, DEFAULT_URL};
use serde::Serialize;
use serde_json::Value;

use crate::render::Renderer;

/// Where the server is.
#[derive(Debug, Args, Clone)]
pub struct Conn {
    /// The server's URL.
    #[arg(long, env = "EMBER_URL", default_value = DEFAULT_URL, global = true)]
    pub url: String,
    /// The bearer token (default: the server's token file, `$EMBER_HOME/token`).
    #[arg(long, env = "EMBER_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<String>,
}

impl Conn {
    pub(crate) fn client(&self) -> Client {
        Client::from_env(Some(&self.url), self.token.clone())
    }
}

/// `ember sandbox`.
#[derive(Debug, Args)]
pub struct SandboxArgs {
    #[command(flatten)]
    conn: Conn,
    #[command(subcommand)]
    cmd: SandboxCmd,
}

/// Sandbox lifecycle commands.
#[derive(Debug, Subcommand)]
pub enum SandboxCmd {
    /// Create a sandbox; prints its id.
    Create(CreateArgs),
    /// List sandboxes (live ones unless --all).
    Ls {
        /// Include stopped and failed ones.
        #[arg(long)]
        all: bool,
        /// Only in this state (creating, running, pausing, paused, resuming, stopped, failed).
        #[arg(long)]
        state: Option<String>,
        /// Only those with this label (`k=v`, repeatable).
        #[arg(long = "meta", value_name = "K=V")]
        meta: Vec<String>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Show one sandbox.
    Get(IdArgs),
    /// Pause a sandbox (snapshot to disk; any call resumes it).
    Pause(IdArgs),
    /// Resume a paused sandbox.
    Resume {
        /// Sandbox id.
        id: String,
        /// Boot from its disk alone, ignoring the memory of its pause (its processes and
        /// interpreter state are lost, its files kept; a cold boot takes tens of seconds).
        #[arg(long)]
        reboot: bool,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Kill a sandbox.
    Kill(IdArgs),
    /// Set a sandbox's timeout to SECS from now.
    Timeout {
        /// Sandbox id.
        id: String,
        /// Seconds from now.
        secs: u64,
        /// What the timeout does: kill or pause.
        #[arg(long)]
        on_timeout: Option<String>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Take a durable named snapshot (`sandbox create --snapshot NAME` starts from it).
    Snapshot {
        /// Sandbox id.
        id: String,
        /// Its name (default `<id>-<time>`).
        #[arg(long)]
        name: Option<String>,
        /// Keep the disk alone, not the memory: sandboxes created from it boot the template's
        /// kernel on that disk (its files, none of its processes or interpreter state).
        #[arg(long)]
        no_memory: bool,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Fork a running sandbox into new ones continuing from its state; prints their ids.
    Fork {
        /// Sandbox id.
        id: String,
        /// How many.
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Their timeout, seconds (default: the parent's).
        #[arg(long)]
        timeout: Option<u64>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Show a sandbox's state history.
    History(IdArgs),
    /// Show a sandbox's network (policy, exposed ports, refused connections), or change its
    /// policy with any of the policy flags (takes effect on its next connection).
    Network {
        /// Sandbox id.
        id: String,
        #[command(flatten)]
        policy: PolicyArgs,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Make a guest TCP port reachable at `<server>/v1/sandboxes/ID/ports/PORT/`.
    Expose {
        /// Sandbox id.
        id: String,
        /// The guest port.
        port: u16,
        /// Reachable without a token.
        #[arg(long)]
        public: bool,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Close an exposed port.
    Unexpose {
        /// Sandbox id.
        id: String,
        /// The guest port.
        port: u16,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
}

/// A network policy on the command line.
#[derive(Debug, Args, Default)]
pub struct PolicyArgs {
    /// `none` (nothing reachable) or `egress` (NAT out, with the always-on deny list).
    #[arg(long, value_name = "MODE")]
    pub network: Option<String>,
    /// Always reachable, even inside the deny list (IPv4 CIDR or address; repeatable).
    #[arg(long = "allow-cidr", value_name = "CIDR")]
    pub allow_cidrs: Vec<String>,
    /// Never reachable (repeatable).
    #[arg(long = "deny-cidr", value_name = "CIDR")]
    pub deny_cidrs: Vec<String>,
    /// Only these names (and their addresses) are reachable: `example.com`, `*.example.com`
    /// (repeatable).
    #[arg(long = "allow-domain", value_name = "NAME")]
    pub allow_domains: Vec<String>,
    /// Bandwidth cap, KiB/s each way.
    #[arg(long, value_name = "KIB")]
    pub bandwidth_kib: Option<u64>,
    /// Most concurrent outgoing connections.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<u32>,
    /// A header the egress proxy sets on HTTP(S) requests to HOST:
    /// `HOST:HEADER=VALUE`, the value with `${secrets.NAME}` placeholders (repeatable).
    #[arg(long = "rule", value_name = "HOST:HEADER=VALUE")]
    pub rules: Vec<String>,
}

impl PolicyArgs {
    /// The policy, if any flag was given. Lists imply `egress`.
    pub fn policy(&self) -> Result<Option<NetworkPolicy>, String> {
        let lists = !self.allow_cidrs.is_empty()
            || !self.deny_cidrs.is_empty()
            || !self.allow_domains.is_empty()
            || self.bandwidth_kib.is_some()
            || self.max_connections.is_some()
            || !self.rules.is_empty();
        let mode = match self.network.as_deref() {
            None if !lists => return Ok(None),
            None | Some("egress") => NetMode::Egress,
            Some("none") => NetMode::None,
            Some(other) => return Err(format!("--network {other:?}: expected none or egress")),
        };
        let p = NetworkPolicy {
            mode,
            allow_cidrs: self.allow_cidrs.clone(),
            deny_cidrs: self.deny_cidrs.clone(),
            allow_domains: self.allow_domains.clone(),
            bandwidth_kib: self.bandwidth_kib,
            max_connections: self.max_connections,
            rules: Default::default(),
            egress_proxy: None,
        };
        let mut p = p;
        for r in &self.rules {
            let (host, rest) = r
                .split_once(':')
                .ok_or_else(|| format!("--rule {r:?}: expected HOST:HEADER=VALUE"))?;
            let (header, value) = rest
                .split_once('=')
                .ok_or_else(|| format!("--rule {r:?}: expected HOST:HEADER=VALUE"))?;
            let rules = p.rules.entry(host.to_ascii_lowercase()).or_default();
            if rules.is_empty() {
                rules.push(Default::default());
            }
            rules[0]
                .transform
                .headers
                .insert(header.to_string(), value.to_string());
        }
        p.validate()?;
        Ok(Some(p))
    }
}

/// One sandbox id.
#[derive(Debug, Args)]
pub struct IdArgs {
    /// Sandbox id.
    pub id: String,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// `ember sandbox create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Template (default: the server's, `default`).
    #[arg(short, long)]
    pub template: Option<String>,
    /// Start from this named snapshot instead of a template.
    #[arg(long, conflicts_with = "template")]
    pub snapshot: Option<String>,
    /// Timeout, seconds from now (default: the server's).
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// What the timeout does: kill or pause.
    #[arg(long)]
    pub on_timeout: Option<String>,
    /// A label (`k=v`, repeatable).
    #[arg(long = "meta", value_name = "K=V")]
    pub meta: Vec<String>,
    /// An environment variable for code and programs (`k=v`, repeatable).
    #[arg(long = "env", value_name = "K=V")]
    pub env: Vec<String>,
    /// A secret environment variable (`k=v`, repeatable): visible to code and programs, never
    /// stored, logged or shown (names like `*_KEY`, `*_TOKEN`, `*_SECRET`, `*PASSWORD*` are
    /// secret even when given with `--env`).
    #[arg(long = "secret-env", value_name = "K=V")]
    pub secret_env: Vec<String>,
    /// In a fleet: only on a node with this label (`k=v`, repeatable; see `ember node
    /// --label`).
    #[arg(long = "node-label", value_name = "K=V")]
    pub node_label: Vec<String>,
    /// Network policy.
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Mount a volume (`NAME:/path[:ro]`, repeatable; see `ember volume`).
    #[arg(long = "volume", value_name = "NAME:/PATH[:ro]")]
    pub volume: Vec<String>,
    /// Print the sandbox as JSON instead of its id.
    #[arg(long)]
    pub json: bool,
}

/// `ember code`.
#[derive(Debug, Args)]
pub struct CodeArgs {
    #[command(flatten)]
    conn: Conn,
    /// Sandbox id.
    pub id: String,
    /// The code; none or `-` reads it from stdin.
    pub code: Option<String>,
    /// The context to run in (default: the language's, `default`, `default-bash`,
    /// `default-javascript`, ...).
    #[arg(short, long)]
    pub context: Option<String>,
    /// Language when no context is named: python, bash, javascript (js), typescript (ts), r or
    /// java (the sandbox's template must have it).
    #[arg(short, long)]
    pub language: Option<String>,
    /// Time limit, seconds (then the code is interrupted).
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// An environment variable for this run (`k=v`, repeatable).
    #[arg(long = "env", value_name = "K=V")]
    pub env: Vec<String>,
    /// Save images, HTML and other rich output to this directory (default: only describe
    /// them, e.g. `[image/png 12345 bytes]`).
    #[arg(long, value_name = "DIR")]
    pub save_images: Option<PathBuf>,
    /// Print the server's NDJSON lines as they come.
    #[arg(long)]
    pub json: bool,
}

/// `ember exec`.
#[derive(Debug, Args)]
pub struct ExecArgs {
    #[command(flatten)]
    conn: Conn,
    /// Sandbox id.
    pub id: String,
    /// Working directory in the guest.
    #[arg(long)]
    pub cwd: Option<String>,
    /// An environment variable (`k=v`, repeatable).
    #[arg(long = "env", value_name = "K=V")]
    pub env: Vec<String>,
    /// Time limit, seconds (then the program is killed; exit status 124).
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Run as the unprivileged `user` instead of root.
    #[arg(long)]
    pub user: bool,
    /// Send this process's stdin to the program (read fully first).
    #[arg(short = 'i', long)]
    pub stdin: bool,
    /// Print the server's NDJSON lines as they come.
    #[arg(long)]
    pub json: bool,
    /// The program and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub argv: Vec<String>,
}

/// `ember cp`.
#[derive(Debug, Args)]
pub struct CpArgs {
    #[command(flatten)]
    conn: Conn,
    /// `./local` or `ID:/guest/path` (`-` is stdin).
    pub src: String,
    /// `ID:/guest/path` or `./local` (`-` is stdout; a directory keeps the file's name).
    pub dst: String,
}

/// `ember artifacts`.
#[derive(Debug, Args)]
pub struct ArtifactsArgs {
    #[command(flatten)]
    conn: Conn,
    /// Sandbox id.
    pub id: String,
    /// Copy the sandbox's outputs directory out first.
    #[arg(long)]
    pub collect: bool,
    /// Download this artifact (its path as listed).
    #[arg(long, value_name = "PATH")]
    pub get: Option<String>,
    /// Where --get writes (default: the artifact's file name here; `-` is stdout).
    #[arg(short, long, value_name = "FILE", requires = "get")]
    pub output: Option<PathBuf>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// `ember logs`.
#[derive(Debug, Args)]
pub struct LogsArgs {
    #[command(flatten)]
    conn: Conn,
    /// Sandbox id.
    pub id: String,
    /// Only this call (run_code, exec, file_write, …).
    #[arg(long)]
    pub call: Option<String>,
    /// Only records after this sequence number.
    #[arg(long)]
    pub after: Option<i64>,
    /// At most this many (the newest).
    #[arg(long)]
    pub limit: Option<usize>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// Prints a client error (with a hint for the usual causes); exit status `code`.
pub(crate) fn fail_with(client: &Client, e: ClientError, code: u8) -> ExitCode {
    eprintln!("ember: error: {e}");
    if let ClientError::Api { status: 401, .. } = e {
        if client.has_token() {
            eprintln!("ember: the server refused the token (EMBER_TOKEN or $EMBER_HOME/token)");
        } else {
            eprintln!(
                "ember: no token: set EMBER_TOKEN, or make the server's $EMBER_HOME/token \
                 readable"
            );
        }
    }
    ExitCode::from(code)
}

fn fail(client: &Client, e: ClientError) -> ExitCode {
    fail_with(client, e, 1)
}

fn usage(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("ember: error: {msg}");
    ExitCode::from(2)
}

fn pairs(items: &[String], what: &str) -> Result<BTreeMap<String, String>, String> {
    items
        .iter()
        .map(|s| match s.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(format!("{what} {s:?}: expected KEY=VALUE")),
        })
        .collect()
}

fn on_timeout(s: Option<&str>) -> Result<Option<OnTimeout>, String> {
    match s {
        None => Ok(None),
        Some("kill") => Ok(Some(OnTimeout::Kill)),
        Some("pause") => Ok(Some(OnTimeout::Pause)),
        Some(o) => Err(format!("--on-timeout {o:?}: expected kill or pause")),
    }
}

fn print_json(v: &impl Serialize) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("ember: cannot print JSON: {e}"),
    }
}

/// Left-aligned columns separated by two spaces.
fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(c.chars().count());
            }
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let n = cells.len();
        for (i, c) in cells.into_iter().enumerate() {
            out.push_str(c);
            if i + 1 < n {
                let pad = w[i].saturating_sub(c.chars().count()) + 2;
                out.push_str(&" ".repeat(pad));
            }
        }
        out.push('\n');
    };
    line(headers.to_vec(), &mut out);
    for r in rows {
        line(r.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

/// An RFC 3339 time without its fraction and zone (`2026-01-01 12:00:00`).
fn short_time(t: &str) -> String {
    let t = t.replacen('T', " ", 1);
    t.split(['.', 'Z', '+']).next().unwrap_or(&t).to_string()
}

fn sandbox_rows(list: &[SandboxInfo]) -> String {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|s| {
            vec![
                s.id.clone(),
                s.state.as_str().to_string(),
                s.template
                    .clone()
                    .or_else(|| s.snapshot.as_ref().map(|n| format!("snapshot:{n}")))
                    .unwrap_or_else(|| "-".into()),
                short_time(&s.created_at),
                s.ends_at.as_deref().map(short_time).unwrap_or("-".into()),
                s.metadata
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(","),
            ]
        })
        .collect();
    table(
        &["ID", "STATE", "TEMPLATE", "CREATED", "ENDS", "METADATA"],
        &rows,
    )
}

fn show(s: &SandboxInfo) {
    let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
    println!("id:          {}", s.id);
    println!(
        "state:       {}{}",
        s.state.as_str(),
        s.reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    );
    println!("template:    {}", opt(&s.template));
    if s.snapshot.is_some() {
        println!("snapshot:    {}", opt(&s.snapshot));
    }
    if s.forked_from.is_some() {
        println!("forked from: {}", opt(&s.forked_from));
    }
    println!("created:     {}", short_time(&s.created_at));
    println!(
        "ends:        {} (then {})",
        s.ends_at.as_deref().map(short_time).unwrap_or("-".into()),
        match s.on_timeout {
            OnTimeout::Kill => "kill",
            OnTimeout::Pause => "pause",
        }
    );
    println!(
        "resources:   {} vCPU, {} MiB memory, {} MiB disk{}",
        s.resources.vcpus,
        s.resources.memory_mib,
        s.resources.disk_mib,
        s.resources
            .cpu_percent
            .map(|p| format!(", {p}% CPU"))
            .unwrap_or_default()
    );
    if let Some(ms) = s.start_ms {
        println!("started in:  {ms:.1} ms");
    }
    for (k, v) in &s.metadata {
        println!("meta:        {k}={v}");
    }
}

/// Runs `ember sandbox ...`.
pub fn sandbox_main(a: SandboxArgs) -> ExitCode {
    let c = a.conn.client();
    match a.cmd {
        SandboxCmd::Create(x) => create(&c, x),
        SandboxCmd::Ls {
            all,
            state,
            meta,
            json,
        } => {
            let meta = match pairs(&meta, "--meta") {
                Ok(m) => m,
                Err(e) => return usage(e),
            };
            match c.list(all, state.as_deref(), &meta) {
                Ok(list) if json => {
                    print_json(&list);
                    ExitCode::SUCCESS
                }
                Ok(list) => {
                    print!("{}", sandbox_rows(&list));
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&c, e),
            }
        }
        SandboxCmd::Get(x) => one(&c, x.json, c.sandbox(&x.id), true),
        SandboxCmd::Network { id, policy, json } => {
            let path = format!(
                "/v1/sandboxes/{}/network",
                ember_server::client::segment(&id)
            );
            let r: Result<Value, _> = match policy.policy() {
                Ok(Some(p)) => c.send("PUT", &path, &p),
                Ok(None) => c.get(&path, &[]),
                Err(e) => return usage(e),
            };
            show_network(&c, r, json)
        }
        SandboxCmd::Expose {
            id,
            port,
            public,
            json,
        } => {
            let path = format!("/v1/sandboxes/{}/ports", ember_server::client::segment(&id));
            let r = c.send(
                "POST",
                &path,
                &serde_json::json!({"port": port, "public": public}),
            );
            if r.is_ok() && !json {
                eprintln!(
                    "ember: {}/v1/sandboxes/{id}/ports/{port}/ ({})",
                    c.url().trim_end_matches('/'),
                    if public {
                        "public"
                    } else {
                        "send X-Access-Token or the server's token"
                    }
                );
            }
            show_network(&c, r, json)
        }
        SandboxCmd::Unexpose { id, port, json } => {
            let path = format!(
                "/v1/sandboxes/{}/ports/{port}",
                ember_server::client::segment(&id)
            );
            show_network(&c, c.delete(&path, &[]), json)
        }
        SandboxCmd::Pause(x) => one(&c, x.json, c.action(&x.id, "pause"), false),
        SandboxCmd::Resume { id, reboot, json } => {
            let body = serde_json::json!({ "reboot": reboot });
            one(&c, json, c.action_with(&id, "resume", &body), false)
        }
        SandboxCmd::Kill(x) => one(&c, x.json, c.kill(&x.id), false),
        SandboxCmd::Timeout {
            id,
            secs,
            on_timeout: o,
            json,
        } => match on_timeout(o.as_deref()) {
            Ok(o) => one(&c, json, c.set_timeout(&id, secs, o), false),
            Err(e) => usage(e),
        },
        SandboxCmd::Snapshot {
            id,
            name,
            no_memory,
            json,
        } => {
            let req = SnapshotRequest {
                name,
                memory: no_memory.then_some(false),
            };
            match c.snapshot(&id, &req) {
                Ok(s) if json => {
                    print_json(&s);
                    ExitCode::SUCCESS
                }
                Ok(s) => {
                    println!("{}", s.name);
                    eprintln!("ember: snapshot {} of {id}: {} MiB", s.name, s.bytes >> 20);
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&c, e),
            }
        }
        SandboxCmd::Fork {
            id,
            count,
            timeout,
            json,
        } => {
            let req = ForkRequest {
                count,
                timeout_secs: timeout,
                metadata: None,
            };
            match c.fork(&id, &req) {
                Ok(list) if json => {
                    print_json(&list);
                    ExitCode::SUCCESS
                }
                Ok(list) => {
                    for s in list {
                        println!("{}", s.id);
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&c, e),
            }
        }
        SandboxCmd::History(x) => match c.history(&x.id) {
            Ok(h) if x.json => {
                print_json(&h);
                ExitCode::SUCCESS
            }
            Ok(h) => {
                let rows: Vec<Vec<String>> = h
                    .iter()
                    .map(|t| {
                        vec![
                            short_time(&t.at),
                            t.from.map(|s| s.as_str()).unwrap_or("-").to_string(),
                            t.to.as_str().to_string(),
                            t.reason.clone().unwrap_or_default(),
                        ]
                    })
                    .collect();
                print!("{}", table(&["AT", "FROM", "TO", "REASON"], &rows));
                ExitCode::SUCCESS
            }
            Err(e) => fail(&c, e),
        },
    }
}

/// Prints one sandbox: in full (`get`), or `ID STATE`.
fn show_network(c: &Client, r: Result<Value, ClientError>, json: bool) -> ExitCode {
    let v = match r {
        Ok(v) => v,
        Err(e) => return fail(c, e),
    };
    if json {
        print_json(&v);
        return ExitCode::SUCCESS;
    }
    let p = &v["policy"];
    println!("mode: {}", p["mode"].as_str().unwrap_or("none"));
    for (k, label) in [
        ("allow_cidrs", "allow cidrs"),
        ("deny_cidrs", "deny cidrs"),
        ("allow_domains", "allow domains"),
    ] {
        if let Some(list) = p[k].as_array().filter(|l| !l.is_empty()) {
            let items: Vec<&str> = list.iter().filter_map(Value::as_str).collect();
            println!("{label}: {}", items.join(", "));
        }
    }
    if let Some(b) = p["bandwidth_kib"].as_u64() {
        println!("bandwidth: {b} KiB/s");
    }
    if let Some(n) = p["max_connections"].as_u64() {
        println!("max connections: {n}");
    }
    for port in v["ports"].as_array().into_iter().flatten() {
        println!(
            "port {}: {}{}",
            port["port"],
            v["ports_url"].as_str().unwrap_or(""),
            if port["public"] == true {
                " (public)"
            } else {
                ""
            }
        );
    }
    let s = &v["stats"];
    if s.is_object() {
        println!(
            "connections: {} admitted, {} refused",
            s["accepted"], s["dropped"]
        );
        let sample = |k: &str| -> Vec<String> {
            s[k].as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        let d = sample("dropped_destinations");
        if !d.is_empty() {
            println!("refused destinations: {}", d.join(", "));
        }
        let n = sample("denied_names");
        if !n.is_empty() {
            println!("refused names: {}", n.join(", "));
        }
    }
    ExitCode::SUCCESS
}

fn one(c: &Client, json: bool, r: Result<SandboxInfo, ClientError>, full: bool) -> ExitCode {
    match r {
        Ok(s) if json => {
            print_json(&s);
            ExitCode::SUCCESS
        }
        Ok(s) if full => {
            show(&s);
            ExitCode::SUCCESS
        }
        Ok(s) => {
            println!("{} {}", s.id, s.state.as_str());
            ExitCode::SUCCESS
        }
        Err(e) => fail(c, e),
    }
}

fn create(c: &Client, a: CreateArgs) -> ExitCode {
    let (metadata, mut env, secret, on_timeout) = match (
        pairs(&a.meta, "--meta"),
        pairs(&a.env, "--env"),
        pairs(&a.secret_env, "--secret-env"),
        on_timeout(a.on_timeout.as_deref()),
    ) {
        (Ok(m), Ok(e), Ok(s), Ok(o)) => (m, e, s, o),
        (Err(e), ..) | (_, Err(e), ..) | (_, _, Err(e), _) | (.., Err(e)) => return usage(e),
    };
    let secret_env = secret.keys().cloned().collect();
    env.extend(secret);
    let network = match a.policy.policy() {
        Ok(p) => p.unwrap_or_default(),
        Err(e) => return usage(e),
    };
    let node_labels = match pairs(&a.node_label, "--node-label") {
        Ok(l) => l,
        Err(e) => return usage(e),
    };
    let mut volume_mounts = Vec::new();
    for v in &a.volume {
        match ember_runtime::volumes::VolumeMount::parse(v) {
            Ok(m) => volume_mounts.push(m),
            Err(e) => return usage(e),
        }
    }
    let req = CreateRequest {
        network,
        node_labels,
        volume_mounts,
        template: a.template,
        snapshot: a.snapshot,
        timeout_secs: a.timeout,
        on_timeout: on_timeout.unwrap_or_default(),
        env,
        secret_env,
        metadata,
        ..Default::default()
    };
    match c.create(&req) {
        Ok(s) if a.json => {
            print_json(&s);
            ExitCode::SUCCESS
        }
        Ok(s) => {
            println!("{}", s.id);
            ExitCode::SUCCESS
        }
        Err(e) => fail(c, e),
    }
}

/// Prints a stream's final `error` line; true if there was one.
fn stream_error(last: &Option<Value>) -> bool {
    match last {
        Some(v) if v["type"] == "error" => {
            eprintln!(
                "ember: error: {} ({})",
                v["error"]["message"].as_str().unwrap_or("the call failed"),
                v["error"]["code"].as_str().unwrap_or("error")
            );
            true
        }
        Some(_) => false,
        None => {
            eprintln!("ember: error: the server's stream ended before the call did");
            true
        }
    }
}

/// Runs `ember code`: exit status 0 when the code ran without an exception, 1 otherwise.
pub fn code_main(a: CodeArgs) -> ExitCode {
    let c = a.conn.client();
    let code = match a.code.as_deref() {
        None | Some("-") => {
            let mut s = String::new();
            if let Err(e) = std::io::stdin().read_to_string(&mut s) {
                return usage(format!("cannot read code from stdin: {e}"));
            }
            s
        }
        Some(s) => s.to_string(),
    };
    let env = match pairs(&a.env, "--env") {
        Ok(e) => e,
        Err(e) => return usage(e),
    };
    let body = serde_json::json!({
        "code": code,
        "context": a.context,
        "language": a.language,
        "timeout_ms": a.timeout.map(|s| s.saturating_mul(1000)),
        "env": env,
    });
    let mut render = match &a.save_images {
        Some(dir) => Renderer::new(dir, false),
        None => Renderer::describing(false),
    };
    render.start_cell(1);
    let json = a.json;
    let path = format!(
        "/v1/sandboxes/{}/code",
        ember_server::client::segment(&a.id)
    );
    let r = c.stream(&path, &body, &mut |v| {
        if json {
            println!("{v}");
            let _ = std::io::stdout().flush();
            return true;
        }
        if matches!(v["type"].as_str(), Some("end" | "error")) {
            return true;
        }
        match serde_json::from_value::<EventKind>(v.clone()) {
            Ok(ev) => render.event(&ev),
            Err(e) => eprintln!("ember: cannot read an event ({e}): {v}"),
        }
        true
    });
    let last = match r {
        Ok(l) => l,
        Err(e) => return fail(&c, e),
    };
    if json {
        return match &last {
            Some(v) if v["type"] == "end" && v["status"] == "ok" => ExitCode::SUCCESS,
            _ => ExitCode::from(1),
        };
    }
    if stream_error(&last) {
        return ExitCode::from(1);
    }
    let end = last.unwrap_or_default();
    if let Ok(ev) = serde_json::from_value::<EventKind>(end.clone()) {
        render.event(&ev);
    }
    if end["status"] == "ok" {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Runs `ember exec`: exits with the program's status (128+N for signal N, 124 on timeout,
/// 125 when the call itself failed).
pub fn exec_main(a: ExecArgs) -> ExitCode {
    let c = a.conn.client();
    let env = match pairs(&a.env, "--env") {
        Ok(e) => e,
        Err(e) => return usage(e),
    };
    let stdin = if a.stdin {
        let mut b = Vec::new();
        if let Err(e) = std::io::stdin().read_to_end(&mut b) {
            return usage(format!("cannot read stdin: {e}"));
        }
        Some(base64::engine::general_purpose::STANDARD.encode(b))
    } else {
        None
    };
    let body = serde_json::json!({
        "argv": a.argv,
        "cwd": a.cwd,
        "env": env,
        "timeout_ms": a.timeout.map(|s| s.saturating_mul(1000)),
        "user": if a.user { "user" } else { "root" },
        "stdin": stdin,
    });
    let json = a.json;
    let path = format!(
        "/v1/sandboxes/{}/exec",
        ember_server::client::segment(&a.id)
    );
    let r = c.stream(&path, &body, &mut |v| {
        if json {
            println!("{v}");
            let _ = std::io::stdout().flush();
            return true;
        }
        if let Ok(ev) = serde_json::from_value::<EventKind>(v.clone()) {
            match ev {
                EventKind::Stdout { data } => {
                    let mut o = std::io::stdout().lock();
                    let _ = o.write_all(&data);
                    let _ = o.flush();
                }
                EventKind::Stderr { data } => {
                    let _ = std::io::stderr().write_all(&data);
                }
                _ => {}
            }
        }
        true
    });
    let last = match r {
        Ok(l) => l,
        Err(e) => return fail_with(&c, e, 125),
    };
    if !json && stream_error(&last) {
        return ExitCode::from(125);
    }
    let end = last.unwrap_or_default();
    if end["type"] != "end" {
        return ExitCode::from(125);
    }
    if end["status"] == "timed_out" {
        if !json {
            eprintln!("ember: the program was killed at its time limit");
        }
        return ExitCode::from(124);
    }
    let exit = &end["exit"];
    let code = match (exit["code"].as_i64(), exit["signal"].as_i64()) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        (None, None) => 0,
    };
    ExitCode::from(code.clamp(0, 255) as u8)
}

/// `ID:/path` → (id, path); anything else is local.
fn remote_spec(s: &str) -> Option<(&str, &str)> {
    let (id, path) = s.split_once(':')?;
    (!id.is_empty() && !id.contains('/') && !path.is_empty()).then_some((id, path))
}

fn base_name(p: &str) -> &str {
    p.trim_end_matches('/').rsplit('/').next().unwrap_or(p)
}

/// Runs `ember cp`.
pub fn cp_main(a: CpArgs) -> ExitCode {
    let c = a.conn.client();
    match (remote_spec(&a.src), remote_spec(&a.dst)) {
        (None, Some((id, guest))) => upload(&c, &a.src, id, guest),
        (Some((id, guest)), None) => download(&c, id, guest, &a.dst),
        (Some(_), Some(_)) => {
            usage("copying between sandboxes is not supported: one side must be local")
        }
        (None, None) => usage("one side must be a sandbox path: ID:/guest/path"),
    }
}

fn upload(c: &Client, local: &str, id: &str, guest: &str) -> ExitCode {
    let (r, shown) = if local == "-" {
        let guest = guest.to_string();
        (
            c.upload(id, &guest, std::io::stdin().lock(), None),
            "stdin".to_string(),
        )
    } else {
        let path = Path::new(local);
        let f = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) => return usage(format!("cannot open {local}: {e}")),
        };
        let meta = match f.metadata() {
            Ok(m) => m,
            Err(e) => return usage(format!("cannot stat {local}: {e}")),
        };
        if meta.is_dir() {
            return usage(format!(
                "{local} is a directory: copy files one by one, or a tar archive"
            ));
        }
        let guest = if guest.ends_with('/') {
            format!("{guest}{}", base_name(local))
        } else {
            guest.to_string()
        };
        (c.upload(id, &guest, f, Some(meta.len())), local.to_string())
    };
    match r {
        Ok(w) => {
            eprintln!("ember: {shown} → {id}:{} ({} bytes)", w.path, w.bytes);
            ExitCode::SUCCESS
        }
        Err(e) => fail(c, e),
    }
}

/// Streams into `local` through a temporary file beside it, renamed when complete (a
/// failed download leaves nothing that looks whole).
fn save_to(
    local: &Path,
    fetch: impl FnOnce(&mut dyn Write) -> Result<u64, ClientError>,
) -> Result<u64, String> {
    let name = local
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "download".into());
    let tmp = local.with_file_name(format!(".{name}.ember-partial"));
    let mut f =
        std::fs::File::create(&tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let r = fetch(&mut f).map_err(|e| e.to_string()).and_then(|n| {
        f.sync_all()
            .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, local)
            .map_err(|e| format!("cannot rename into {}: {e}", local.display()))?;
        Ok(n)
    });
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

fn local_target(local: &str, name: &str) -> PathBuf {
    let p = PathBuf::from(local);
    if local.ends_with('/') || p.is_dir() {
        p.join(name)
    } else {
        p
    }
}

fn download(c: &Client, id: &str, guest: &str, local: &str) -> ExitCode {
    if local == "-" {
        let mut out = std::io::stdout().lock();
        return match c.download(id, guest, &mut out) {
            Ok(_) => ExitCode::SUCCESS,
            Err(e) => fail(c, e),
        };
    }
    let target = local_target(local, base_name(guest));
    match save_to(&target, |w| c.download(id, guest, w)) {
        Ok(n) => {
            eprintln!("ember: {id}:{guest} → {} ({n} bytes)", target.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ember: error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Runs `ember artifacts`.
pub fn artifacts_main(a: ArtifactsArgs) -> ExitCode {
    let c = a.conn.client();
    if let Some(path) = &a.get {
        let out = a
            .output
            .clone()
            .unwrap_or_else(|| PathBuf::from(base_name(path)));
        if out.as_os_str() == "-" {
            let mut o = std::io::stdout().lock();
            return match c.download_artifact(&a.id, path, &mut o) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => fail(&c, e),
            };
        }
        let target = local_target(&out.to_string_lossy(), base_name(path));
        return match save_to(&target, |w| c.download_artifact(&a.id, path, w)) {
            Ok(n) => {
                eprintln!("ember: {path} → {} ({n} bytes)", target.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("ember: error: {e}");
                ExitCode::from(1)
            }
        };
    }
    let r = if a.collect {
        c.collect_artifacts(&a.id)
    } else {
        c.artifacts(&a.id)
    };
    match r {
        Ok(list) if a.json => {
            print_json(&list);
            ExitCode::SUCCESS
        }
        Ok(list) if list.is_empty() => {
            eprintln!(
                "no artifacts (files the code writes under the outputs directory, \
                 /workspace/outputs by default, are copied out at pause, kill and timeout, \
                 or with --collect)"
            );
            ExitCode::SUCCESS
        }
        Ok(list) => {
            let rows: Vec<Vec<String>> = list
                .iter()
                .map(|x| {
                    vec![
                        x.path.clone(),
                        x.size.to_string(),
                        short_time(&x.collected_at),
                    ]
                })
                .collect();
            print!("{}", table(&["PATH", "BYTES", "COLLECTED"], &rows));
            ExitCode::SUCCESS
        }
        Err(e) => fail(&c, e),
    }
}

/// Runs `ember logs`: the sandbox's audit log.
pub fn logs_main(a: LogsArgs) -> ExitCode {
    let c = a.conn.client();
    let mut q = Vec::new();
    if let Some(call) = &a.call {
        q.push(("call", call.clone()));
    }
    if let Some(after) = a.after {
        q.push(("after", after.to_string()));
    }
    if let Some(limit) = a.limit {
        q.push(("limit", limit.to_string()));
    }
    match c.audit(&a.id, &q) {
        Ok(list) if a.json => {
            print_json(&list);
            ExitCode::SUCCESS
        }
        Ok(list) => {
            let rows: Vec<Vec<String>> = list
                .iter()
                .map(|r| {
                    vec![
                        r.seq.to_string(),
                        short_time(&r.at),
                        r.call.clone(),
                        r.outcome.clone(),
                        format!("{:.1}", r.duration_ms),
                        r.bytes_in.to_string(),
                        r.bytes_out.to_string(),
                        summary(&r.args, r.error.as_deref()),
                    ]
                })
                .collect();
            print!(
                "{}",
                table(
                    &["SEQ", "AT", "CALL", "OUTCOME", "MS", "IN", "OUT", "DETAIL"],
                    &rows
                )
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(&c, e),
    }
}

/// One line about an audit record: its error, or its arguments.
fn summary(args: &Value, error: Option<&str>) -> String {
    let s = match error {
        Some(e) => e.to_string(),
        None => match args.as_object() {
            Some(m) => m
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| {
                    format!(
                        "{k}={}",
                        v.as_str().map(str::to_string).unwrap_or(v.to_string())
                    )
                })
                .collect::<Vec<_>>()
                .join(" "),
            None => String::new(),
        },
    };
    let mut out: String = s.chars().take(80).collect();
    if s.chars().count() > 80 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_paths_are_id_colon_path() {
        assert_eq!(remote_spec("abc:/x/y"), Some(("abc", "/x/y")));
        assert_eq!(remote_spec("./a:b"), None);
        assert_eq!(remote_spec("file.txt"), None);
        assert_eq!(remote_spec(":/x"), None);
        assert_eq!(local_target("out/", "f.txt"), PathBuf::from("out/f.txt"));
        assert_eq!(base_name("/a/b/c.png"), "c.png");
    }

    #[test]
    fn tables_align_and_times_shorten() {
        let t = table(&["A", "BB"], &[vec!["xxx".into(), "y".into()]]);
        assert_eq!(t, "A    BB\nxxx  y\n");
        assert_eq!(
            short_time("2026-01-02T03:04:05.678Z"),
            "2026-01-02 03:04:05"
        );
        assert_eq!(
            pairs(&["a=b=c".into()], "--env").unwrap()["a"],
            "b=c".to_string()
        );
        assert!(pairs(&["=x".into()], "--env").is_err());
    }
}
