//! `ember serve` end to end: the real server binary on loopback with its own `$EMBER_HOME`,
//! real jailed VMs from the shipped templates, a real SQLite store; driven over HTTP with the
//! crate's client and raw requests.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ember_runtime::{CreateRequest, State};
use ember_server::client::Client;
use ember_tests::{bin, decode_png, template};
use serde_json::{json, Value};

/// A running `ember serve`.
struct Server {
    child: Child,
    url: String,
    home: PathBuf,
    args: Vec<String>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Server {
    fn start(home: &Path, args: &[&str]) -> Server {
        let port = free_port();
        let mut s = Server {
            child: Command::new("true").spawn().unwrap(),
            url: format!("http://127.0.0.1:{port}"),
            home: home.to_path_buf(),
            args: args.iter().map(|a| a.to_string()).collect(),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.home.join("serve.log"))
            .unwrap();
        let listen = self.url.trim_start_matches("http://").to_string();
        self.child = Command::new(bin("ember"))
            .args(["serve", "--listen", &listen])
            .args(&self.args)
            .env("EMBER_HOME", &self.home)
            .env("EMBER_VMM", bin("ember-vmm"))
            .env("EMBER_JAILER", bin("ember-jailer"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start ember serve");
        let t0 = Instant::now();
        loop {
            if ureq::get(&format!("{}/healthz", self.url)).call().is_ok() {
                return;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("ember serve exited ({st}): {}", self.log());
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "server not up");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.home.join("serve.log")).unwrap_or_default()
    }

    fn token(&self) -> String {
        std::fs::read_to_string(self.home.join("token"))
            .unwrap()
            .trim()
            .to_string()
    }

    fn client(&self) -> Client {
        Client::new(&self.url, Some(self.token()))
    }

    fn req(&self, method: &str, path: &str) -> ureq::Request {
        ureq::request(method, &format!("{}{path}", self.url))
            .set("authorization", &format!("Bearer {}", self.token()))
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops the server and kills what it left running (the runtime leaves sandboxes
    /// running on purpose when the server stops).
    fn shutdown(&mut self) {
        if let Ok(list) = self.client().list(true, None, &Default::default()) {
            for s in list.iter().filter(|s| !s.state.is_final()) {
                let _ = self.client().kill(&s.id);
            }
        }
        // SAFETY: kill(2) with the server's pid and SIGTERM.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn home() -> tempfile::TempDir {
    template("default");
    tempfile::Builder::new()
        .prefix("ember-serve-test-")
        .tempdir()
        .unwrap()
}

/// Runs code through the API; returns (end line, every event).
fn code(c: &Client, id: &str, src: &str) -> (Value, Vec<Value>) {
    let mut events = Vec::new();
    let end = c
        .stream(
            &format!("/v1/sandboxes/{id}/code"),
            &json!({ "code": src }),
            &mut |v| {
                events.push(v.clone());
                true
            },
        )
        .unwrap_or_else(|e| panic!("code {src:?}: {e}"))
        .expect("an end line");
    assert_eq!(end["type"], "end", "{end} {events:?}");
    (end, events)
}

fn result_text(events: &[Value]) -> Option<String> {
    events
        .iter()
        .find(|e| e["type"] == "result")
        .and_then(|e| e["data"]["text/plain"].as_str())
        .map(str::to_owned)
}

/// The reference workflow through the HTTP API: a workbook goes in, `df` stays between calls,
/// the chart is written to the outputs directory and is kept as an artifact after the
/// sandbox is killed.
#[test]
fn excel_workflow_over_http_keeps_the_chart_as_an_artifact() {
    template("python-data");
    let home = home();
    let srv = Server::start(home.path(), &[]);
    let c = srv.client();
    let sb = c
        .create(&CreateRequest {
            template: Some("python-data".into()),
            metadata: [("task".to_string(), "excel".to_string())].into(),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(sb.state, State::Running);
    // The workbook: made in the guest, downloaded, uploaded under another name.
    let (end, _) = code(
        &c,
        &sb.id,
        "import openpyxl\nwb = openpyxl.Workbook(); ws = wb.active\n\
         ws.append(['month', 'sales'])\n\
         for i in range(1, 13): ws.append([i, 100 + 7 * i * i % 31])\n\
         wb.save('/tmp/made.xlsx')",
    );
    assert_eq!(end["status"], "ok");
    let mut xlsx = Vec::new();
    c.download(&sb.id, "/tmp/made.xlsx", &mut xlsx).unwrap();
    assert!(xlsx.starts_with(b"PK"), "not a zip/xlsx");
    c.upload(
        &sb.id,
        "/workspace/data.xlsx",
        &xlsx[..],
        Some(xlsx.len() as u64),
    )
    .unwrap();
    let (_, ev) = code(
        &c,
        &sb.id,
        "import pandas as pd\ndf = pd.read_excel('/workspace/data.xlsx')\nlen(df)",
    );
    assert_eq!(result_text(&ev).as_deref(), Some("12"));
    let (_, ev) = code(&c, &sb.id, "df.describe()");
    let html = ev
        .iter()
        .find(|e| e["type"] == "result")
        .and_then(|e| e["data"]["text/html"].as_str())
        .expect("an HTML table");
    assert!(html.contains("<table") && html.contains("sales"), "{html}");
    let (_, ev) = code(
        &c,
        &sb.id,
        "ax = df.plot(x='month', y='sales')\nax.figure.savefig('/workspace/outputs/chart.png')",
    );
    assert!(
        ev.iter().any(|e| e["type"] == "display"),
        "the figure is also displayed inline: {ev:?}"
    );
    let killed = c.kill(&sb.id).unwrap();
    assert_eq!(killed.state, State::Stopped);
    let arts = c.artifacts(&sb.id).unwrap();
    assert!(arts.iter().any(|a| a.path == "chart.png"), "{arts:?}");
    let mut png = Vec::new();
    c.download_artifact(&sb.id, "chart.png", &mut png).unwrap();
    let (w, h, colours) = decode_png(&png);
    assert!(w > 100 && h > 100 && colours > 2, "{w}x{h} {colours}");
    // The audit trail outlives the sandbox too.
    let audit: Vec<Value> = c
        .get(&format!("/v1/sandboxes/{}/audit", sb.id), &[])
        .unwrap();
    let calls: Vec<&str> = audit.iter().filter_map(|a| a["call"].as_str()).collect();
    for want in ["create", "run_code", "file_read", "file_write", "kill"] {
        assert!(calls.contains(&want), "{want} missing from {calls:?}");
    }
}

#[test]
fn bad_requests_get_the_documented_errors_and_the_openapi_lists_every_route() {
    let home = home();
    let srv = Server::start(home.path(), &["--max-upload-mib", "1"]);
    let status_code = |r: Result<ureq::Response, ureq::Error>| -> (u16, Value) {
        match r {
            Ok(resp) => (resp.status(), resp.into_json().unwrap_or(Value::Null)),
            Err(ureq::Error::Status(s, resp)) => (s, resp.into_json().unwrap_or(Value::Null)),
            Err(e) => panic!("transport: {e}"),
        }
    };
    let code_of = |v: &Value| v["error"]["code"].as_str().unwrap_or("").to_string();
    // No token, a wrong token.
    let (s, v) = status_code(ureq::get(&format!("{}/v1/sandboxes", srv.url)).call());
    assert_eq!((s, code_of(&v).as_str()), (401, "unauthorized"), "{v}");
    let (s, _) = status_code(
        ureq::get(&format!("{}/v1/sandboxes", srv.url))
            .set("authorization", "Bearer nope")
            .call(),
    );
    assert_eq!(s, 401);
    // Unknown sandbox.
    let (s, v) = status_code(srv.req("GET", "/v1/sandboxes/0123456789abcdef").call());
    assert_eq!((s, code_of(&v).as_str()), (404, "sandbox_not_found"), "{v}");
    // Malformed JSON, wrong types, unknown fields.
    for body in [
        "{not json",
        r#"{"timeout_secs": "soon"}"#,
        r#"{"templat": "default"}"#,
    ] {
        let (s, v) = status_code(
            srv.req("POST", "/v1/sandboxes")
                .set("content-type", "application/json")
                .send_string(body),
        );
        assert_eq!(
            (s, code_of(&v).as_str()),
            (400, "invalid_request"),
            "{body}: {v}"
        );
    }
    // Unknown template.
    let (s, v) = status_code(
        srv.req("POST", "/v1/sandboxes")
            .send_json(json!({ "template": "no-such-thing" })),
    );
    assert_eq!(
        (s, code_of(&v).as_str()),
        (404, "template_not_found"),
        "{v}"
    );
    // An upload over the limit, to a real sandbox.
    let c = srv.client();
    let sb = c.create(&CreateRequest::default()).unwrap();
    // The client announces 2 MiB and waits for `100 Continue`: the server refuses at once.
    {
        use std::io::Write;
        let token = srv.token();
        let addr = srv.url.trim_start_matches("http://").to_string();
        let mut tcp = std::net::TcpStream::connect(&addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            tcp,
            "PUT /v1/sandboxes/{}/files?path=/tmp/big HTTP/1.1\r\nHost: {addr}\r\n\
             Authorization: Bearer {token}\r\nContent-Length: {}\r\n\
             Expect: 100-continue\r\nConnection: close\r\n\r\n",
            sb.id,
            2u64 << 20
        )
        .unwrap();
        let mut resp = String::new();
        let _ = tcp.read_to_string(&mut resp);
        assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
        assert!(resp.contains("body_too_large"), "{resp}");
    }
    // A path outside the artifact store.
    let (s, _) = status_code(
        srv.req(
            "GET",
            &format!("/v1/sandboxes/{}/artifacts/..%2F..%2Fember.db", sb.id),
        )
        .call(),
    );
    assert!(s == 400 || s == 404, "{s}");
    // The guest's own errors are 422 with the agent's code.
    let (s, v) = status_code(
        srv.req(
            "GET",
            &format!("/v1/sandboxes/{}/files/stat?path=/no/such/file", sb.id),
        )
        .call(),
    );
    assert_eq!((s, code_of(&v).as_str()), (422, "guest_not_found"), "{v}");
    c.kill(&sb.id).unwrap();
    // A call on a killed sandbox: 409.
    let (s, v) = status_code(
        srv.req("POST", &format!("/v1/sandboxes/{}/pause", sb.id))
            .call(),
    );
    assert_eq!((s, code_of(&v).as_str()), (409, "wrong_state"), "{v}");

    // The OpenAPI document: version 3, every route the server answers is in it.
    let doc: Value = ureq::get(&format!("{}/openapi.json", srv.url))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let paths = doc["paths"].as_object().unwrap();
    for p in [
        "/v1/sandboxes",
        "/v1/sandboxes/{id}",
        "/v1/sandboxes/{id}/code",
        "/v1/sandboxes/{id}/exec",
        "/v1/sandboxes/{id}/files",
        "/v1/sandboxes/{id}/pause",
        "/v1/sandboxes/{id}/resume",
        "/v1/sandboxes/{id}/fork",
        "/v1/sandboxes/{id}/snapshot",
        "/v1/sandboxes/{id}/artifacts",
        "/v1/audit",
        "/v1/templates",
        "/healthz",
        "/metrics",
    ] {
        assert!(paths.contains_key(p), "{p} missing from the OpenAPI paths");
    }
    // Every $ref resolves.
    let text = doc.to_string();
    for r in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
        let name = r.split('"').next().unwrap();
        assert!(
            doc["components"]["schemas"].get(name).is_some(),
            "dangling $ref {name}"
        );
    }
    // Metrics in the Prometheus text format.
    let mut m = String::new();
    srv.req("GET", "/metrics")
        .call()
        .unwrap()
        .into_reader()
        .read_to_string(&mut m)
        .unwrap();
    assert!(m.contains("ember_creates_total 1"), "{m}");
    assert!(m.contains("ember_sandboxes{state=\"stopped\"} 1"), "{m}");
    assert!(m.contains("ember_create_duration_ms_bucket"), "{m}");
}

/// A client that hangs up mid-stream stops the work in the guest.
#[test]
fn a_client_that_goes_away_cancels_the_code() {
    let home = home();
    let srv = Server::start(home.path(), &[]);
    let c = srv.client();
    let sb = c.create(&CreateRequest::default()).unwrap();
    let t0 = Instant::now();
    // Hang up as soon as the code has started printing.
    c.stream(
        &format!("/v1/sandboxes/{}/code", sb.id),
        &json!({ "code": "import time\nprint('started', flush=True)\ntime.sleep(600)\nprint('not reached')" }),
        &mut |v| v["type"] != "stdout",
    )
    .unwrap();
    // The context is free again: the next cell runs at once, not after the sleep.
    let (end, ev) = code(&c, &sb.id, "'free'");
    assert_eq!(end["status"], "ok");
    assert_eq!(result_text(&ev).as_deref(), Some("'free'"));
    assert!(t0.elapsed() < Duration::from_secs(120));
    // The audit log says the call was cancelled (written when the abandoned call ends).
    let t1 = Instant::now();
    loop {
        let audit: Vec<Value> = c
            .get(&format!("/v1/sandboxes/{}/audit", sb.id), &[])
            .unwrap();
        if audit
            .iter()
            .any(|a| a["call"] == "run_code" && a["outcome"] == "cancelled")
        {
            break;
        }
        assert!(t1.elapsed() < Duration::from_secs(30), "{audit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `kill -9` of the server: a new one re-attaches the running sandboxes (their state
/// intact) and pause/resume still works on them.
#[test]
fn a_server_killed_with_sigkill_is_replaced_and_reattaches_its_sandboxes() {
    let home = home();
    let mut srv = Server::start(home.path(), &[]);
    let c = srv.client();
    let a = c.create(&CreateRequest::default()).unwrap();
    let b = c.create(&CreateRequest::default()).unwrap();
    code(&c, &a.id, "state = 'alpha'");
    code(&c, &b.id, "state = 'beta'");
    c.action::<Value>(&b.id, "pause").unwrap();
    srv.kill9();
    srv.spawn();
    let c = srv.client();
    assert_eq!(c.sandbox(&a.id).unwrap().state, State::Running);
    assert_eq!(c.sandbox(&b.id).unwrap().state, State::Paused);
    let (_, ev) = code(&c, &a.id, "state");
    assert_eq!(result_text(&ev).as_deref(), Some("'alpha'"));
    let (_, ev) = code(&c, &b.id, "state");
    assert_eq!(result_text(&ev).as_deref(), Some("'beta'"));
    c.action::<Value>(&a.id, "pause").unwrap();
    c.action::<Value>(&a.id, "resume").unwrap();
    let (_, ev) = code(&c, &a.id, "state");
    assert_eq!(result_text(&ev).as_deref(), Some("'alpha'"));
    // A graceful stop (SIGTERM) leaves the sandboxes running too.
    // SAFETY: kill(2) with the server's pid and SIGTERM.
    unsafe { libc::kill(srv.child.id() as i32, libc::SIGTERM) };
    let st = srv.child.wait().unwrap();
    assert!(st.success(), "ember serve exited {st}: {}", srv.log());
    srv.spawn();
    let c = srv.client();
    assert_eq!(c.sandbox(&a.id).unwrap().state, State::Running);
    let (_, ev) = code(&c, &a.id, "state");
    assert_eq!(result_text(&ev).as_deref(), Some("'alpha'"));
    let history = c.history(&a.id).unwrap();
    assert!(
        history
            .iter()
            .any(|t| t.reason.as_deref() == Some("re-attached after a server restart")),
        "{history:?}"
    );
}

/// Data at rest: the state directory is the server's alone (repaired at start when it was
/// not), and secret environment values — named in `secret_env`, or with a credential-like
/// name — reach the guest but nothing written on the host: not the database or its WAL, not
/// the server's log, not an answer.
#[test]
fn secret_environment_values_reach_the_guest_and_nothing_at_rest() {
    use std::os::unix::fs::PermissionsExt;
    let home = home();
    std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut srv = Server::start(home.path(), &[]);
    let c = srv.client();
    let key = format!("sk-ember-{}", ember_runtime::paths::random_id());
    let dsn = format!("pg://u:{}@db", ember_runtime::paths::random_id());
    let mut req = CreateRequest::default();
    req.env.insert("OPENAI_API_KEY".into(), key.clone());
    req.env.insert("DSN".into(), dsn.clone());
    req.env.insert("PLAIN".into(), "visible".into());
    req.secret_env.insert("DSN".into());
    let s = c.create(&req).unwrap();
    for info in [s.clone(), c.sandbox(&s.id).unwrap()] {
        assert_eq!(info.env["OPENAI_API_KEY"], "[redacted]", "{info:?}");
        assert_eq!(info.env["DSN"], "[redacted]");
        assert_eq!(info.env["PLAIN"], "visible");
    }
    let probe = "import os, subprocess\n\
                 ' '.join([os.environ['OPENAI_API_KEY'], os.environ['DSN'], \
                 subprocess.run(['printenv', 'OPENAI_API_KEY'], capture_output=True, text=True).stdout.strip()])";
    let expect = format!("'{key} {dsn} {key}'");
    let (_, ev) = code(&c, &s.id, probe);
    assert_eq!(result_text(&ev).as_deref(), Some(expect.as_str()), "{ev:?}");
    // A pause and resume keep them (in the server's memory and the guest's).
    c.action::<Value>(&s.id, "pause").unwrap();
    c.action::<Value>(&s.id, "resume").unwrap();
    let (_, ev) = code(&c, &s.id, probe);
    assert_eq!(result_text(&ev).as_deref(), Some(expect.as_str()), "{ev:?}");
    let listed = srv
        .req("GET", "/v1/sandboxes")
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(!listed.contains(&key) && !listed.contains(&dsn), "{listed}");
    c.kill(&s.id).unwrap();
    // A call on the killed sandbox is refused at once (it used to wait forever on the
    // runtime's own lock while looking up the environment, and the whole server with it).
    let (tx, rx) = std::sync::mpsc::channel();
    let (url, token, id) = (srv.url.clone(), srv.token(), s.id.clone());
    std::thread::spawn(move || {
        let c = Client::new(&url, Some(token));
        let r = c.stream(
            &format!("/v1/sandboxes/{id}/code"),
            &json!({ "code": "1" }),
            &mut |_| true,
        );
        let _ = tx.send(
            r.map(|end| end.map(|v| v.to_string()))
                .map_err(|e| e.to_string()),
        );
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Err(e)) => assert!(e.contains(&s.id) || e.contains("stopped"), "{e}"),
        Ok(Ok(end)) => panic!("code on a killed sandbox ended {end:?}"),
        Err(_) => {
            // A deadlocked server would also hang this test's clean-up: stop it first.
            srv.kill9();
            panic!("code on a killed sandbox did not answer in 30 s");
        }
    }
    assert!(c.list(true, None, &Default::default()).is_ok());
    srv.shutdown();
    for secret in [&key, &dsn] {
        let out = Command::new("grep")
            .args(["-r", "-l", "-a", "-F", "-e", secret])
            .arg(home.path())
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(1),
            "a secret value found at rest in: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The repair was made and said; another account can read none of it.
    let mode = std::fs::metadata(home.path()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
    assert!(srv.log().contains("was mode 755, now 700"), "{}", srv.log());
    let db = home.path().join("ember.db");
    assert_eq!(
        std::fs::metadata(&db).unwrap().permissions().mode() & 0o777,
        0o600
    );
    for target in [db, home.path().join("artifacts"), home.path().join("token")] {
        let out = Command::new("runuser")
            .args(["-u", "nobody", "--", "ls", "-l"])
            .arg(&target)
            .output()
            .unwrap();
        assert!(
            !out.status.success(),
            "nobody can read {}: {}",
            target.display(),
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// E2B's surface on a server started with no `--domain`: the answers name this server as the
/// sandbox domain (`localhost:<port>`), a request for `<port>-<id>.localhost:<port>` reaches
/// that sandbox's port by E2B's rule (every port, public unless `allowPublicTraffic` is false,
/// then with the traffic token), and a create over capacity says so in `error_code` as E2B's
/// API does.
#[test]
fn e2b_answers_name_this_server_ports_follow_e2bs_rule_and_capacity_has_its_error_code() {
    let home = home();
    let srv = Server::start(home.path(), &["--max-running", "2"]);
    let port = srv.url.rsplit(':').next().unwrap().to_string();
    // (status, body) of an E2B create.
    let e2b = |body: &str| -> (u16, Value) {
        let r = ureq::post(&format!("{}/sandboxes", srv.url))
            .set("x-api-key", &srv.token())
            .set("content-type", "application/json")
            .send_string(body);
        match r {
            Ok(r) => (r.status(), r.into_json().unwrap()),
            Err(ureq::Error::Status(s, r)) => (s, r.into_json().unwrap()),
            Err(e) => panic!("E2B create: {e}"),
        }
    };
    // GET / of guest port 8123 through the E2B Host route: (status, body).
    let get = |id: &str, token: Option<&str>| -> (u16, String) {
        let mut r =
            ureq::get(&format!("{}/", srv.url)).set("host", &format!("8123-{id}.localhost:{port}"));
        if let Some(t) = token {
            r = r.set("e2b-traffic-access-token", t);
        }
        match r.call() {
            Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(s, r)) => (s, r.into_string().unwrap_or_default()),
            Err(e) => panic!("GET port 8123 of {id}: {e}"),
        }
    };
    let c = srv.client();
    let serve_8123 = |id: &str| {
        c.stream(
            &format!("/v1/sandboxes/{id}/exec"),
            &json!({"argv": ["python3", "-m", "http.server", "8123", "--directory", "/etc"],
                    "background": true}),
            &mut |_| true,
        )
        .unwrap();
    };
    let (status, public) = e2b(r#"{"templateID":"base"}"#);
    assert_eq!(status, 201, "{public}");
    let a = public["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(public["domain"], format!("localhost:{port}"), "{public}");
    // get_host(49983) → 49983-<id>.localhost:<port>: envd's health through the Host route.
    let r = ureq::get(&format!("{}/health", srv.url))
        .set("host", &format!("49983-{a}.localhost:{port}"))
        .call()
        .unwrap();
    assert_eq!(r.status(), 204);
    let (status, private) = e2b(r#"{"templateID":"base","network":{"allowPublicTraffic":false}}"#);
    assert_eq!(status, 201, "{private}");
    let b = private["sandboxID"].as_str().unwrap().to_string();
    let token = private["trafficAccessToken"].as_str().unwrap().to_string();
    serve_8123(&a);
    serve_8123(&b);
    // The guest's server takes a few seconds to start on kvm_pvm.
    let t0 = Instant::now();
    loop {
        let (s, body) = get(&a, None);
        if s == 200 {
            assert!(body.contains("passwd"), "{body}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "port 8123 of {a}: {s} {body}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let (s, body) = get(&b, None);
    assert_eq!(s, 401, "a private sandbox's port without the token: {body}");
    loop {
        let (s, body) = get(&b, Some(&token));
        if s == 200 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "port 8123 of {b}: {s} {body}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let (s, _) = get(&b, Some("not-the-token"));
    assert_eq!(s, 401);
    // The rule is the sandbox's (its network says so); the native API's default, nothing
    // exposed until asked, is `CreateRequest::default()`'s.
    assert_eq!(
        c.sandbox(&a).unwrap().network.all_ports,
        Some(ember_runtime::AllPorts { public: true })
    );
    assert_eq!(CreateRequest::default().expose_all_ports, None);
    let (status, v) = e2b(r#"{"templateID":"base"}"#);
    assert_eq!(status, 429, "a third sandbox over --max-running 2: {v}");
    assert_eq!(v["error_code"], "sandbox_capacity_unavailable", "{v}");
    assert_eq!(v["code"], 429);
}
