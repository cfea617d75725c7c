//! `run_code` in javascript, typescript, r and java (issue 31), end to end: one `ember serve`
//! (the E2B SDKs' `code-interpreter-v1` = ember's `code-interpreter` template, its default), one
//! sandbox of that template for the native API's checks, and the E2B Python and JS SDKs' `languages`
//! checks (`tests/e2b/test_sdk.py`, `tests/e2b/test_sdk.mjs`) against the same server, in
//! parallel (each SDK makes its own sandbox). Per language: state across three cells, a rich
//! result (a JS object as text, an R data.frame as HTML, an R plot as a PNG that decodes and is
//! not blank), stdout streamed before the end, an error with its name, a timeout that
//! interrupts and keeps the state, two contexts isolated from each other; an unknown language
//! is refused with the list, and a language a template lacks with the list it has. Figures
//! (context_create, first and second cell after a restore) are printed.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

use ember_tests::{decode_png, hash16, template, Serve};

/// The native API of one server.
struct Api {
    url: String,
    token: String,
}

/// One `/code` call's lines, each with when it arrived.
#[derive(Debug)]
struct Cell {
    lines: Vec<(Duration, Value)>,
}

impl Cell {
    fn of(&self, kind: &str) -> impl Iterator<Item = &(Duration, Value)> {
        let kind = kind.to_string();
        self.lines.iter().filter(move |(_, v)| v["type"] == kind)
    }
    fn stdout(&self) -> String {
        let bytes: Vec<u8> = self
            .of("stdout")
            .flat_map(|(_, v)| {
                base64::engine::general_purpose::STANDARD
                    .decode(v["data"].as_str().unwrap_or(""))
                    .unwrap_or_default()
            })
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
    fn stderr(&self) -> String {
        let bytes: Vec<u8> = self
            .of("stderr")
            .flat_map(|(_, v)| {
                base64::engine::general_purpose::STANDARD
                    .decode(v["data"].as_str().unwrap_or(""))
                    .unwrap_or_default()
            })
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
    fn result(&self) -> Option<&Value> {
        self.of("result").map(|(_, v)| &v["data"]).next()
    }
    fn text(&self) -> Option<&str> {
        self.result()?["text/plain"].as_str()
    }
    fn exception(&self) -> Option<&Value> {
        self.of("exception").map(|(_, v)| v).next()
    }
    fn status(&self) -> &str {
        self.lines
            .last()
            .and_then(|(_, v)| v["status"].as_str())
            .unwrap_or("none")
    }
    fn end_at(&self) -> Duration {
        self.lines.last().map(|(t, _)| *t).unwrap_or_default()
    }
    fn pngs(&self) -> Vec<Vec<u8>> {
        self.lines
            .iter()
            .filter(|(_, v)| v["type"] == "display" || v["type"] == "result")
            .filter_map(|(_, v)| v["data"]["image/png"].as_str())
            .map(|b| {
                base64::engine::general_purpose::STANDARD
                    .decode(b.trim())
                    .expect("base64 PNG")
            })
            .collect()
    }
}

impl Api {
    fn req(&self, method: &str, path: &str) -> ureq::Request {
        ureq::request(method, &format!("{}{path}", self.url))
            .set("authorization", &format!("Bearer {}", self.token))
            .timeout(Duration::from_secs(600))
    }

    /// A JSON call that must succeed.
    fn call(&self, method: &str, path: &str, body: Value) -> Value {
        match self.req(method, path).send_json(body) {
            Ok(r) => r.into_json().expect("a JSON answer"),
            Err(ureq::Error::Status(code, r)) => panic!(
                "{method} {path}: HTTP {code}: {}",
                r.into_string().unwrap_or_default()
            ),
            Err(e) => panic!("{method} {path}: {e}"),
        }
    }

    /// A JSON call that must fail: (status, body).
    fn refused(&self, method: &str, path: &str, body: Value) -> (u16, String) {
        match self.req(method, path).send_json(body) {
            Ok(r) => panic!(
                "{method} {path} succeeded: {}",
                r.into_string().unwrap_or_default()
            ),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
            Err(e) => panic!("{method} {path}: {e}"),
        }
    }

    /// Runs a cell (`body` has the code and the context or language).
    fn code(&self, id: &str, body: Value) -> Cell {
        let t0 = Instant::now();
        let resp = match self
            .req("POST", &format!("/v1/sandboxes/{id}/code"))
            .send_json(body.clone())
        {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) => panic!(
                "code {body}: HTTP {code}: {}",
                r.into_string().unwrap_or_default()
            ),
            Err(e) => panic!("code {body}: {e}"),
        };
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(resp.into_reader()).lines() {
            let line = line.expect("an NDJSON line");
            if line.trim().is_empty() {
                continue;
            }
            let v: Value = serde_json::from_str(&line).expect("JSON line");
            lines.push((t0.elapsed(), v));
        }
        Cell { lines }
    }

    fn run(&self, id: &str, language: &str, code: &str) -> Cell {
        self.code(id, json!({"code": code, "language": language}))
    }

    fn run_in(&self, id: &str, context: &str, code: &str) -> Cell {
        self.code(id, json!({"code": code, "context": context}))
    }
}

/// What one language's native checks run.
struct Lang {
    name: &'static str,
    /// Three cells; the third prints `sum 42` and has a result.
    state: [&'static str; 3],
    /// The third cell's result text, when it is checked as text.
    text: Option<&'static str>,
    /// Prints `first`, then sleeps 1.5 s.
    stream: &'static str,
    /// A failing cell and its error's name.
    error: (&'static str, &'static str),
    /// A cell that never ends. It makes a syscall per iteration: on kvm_pvm a process that
    /// spins in user mode alone starves the whole guest, the agent's wake-up included
    /// (tests/interpreter.rs `busy_loop`), so no time limit could stop it there.
    spin: &'static str,
    /// A cell that reads the state, and its result text.
    probe: (&'static str, &'static str),
    /// In a new context: a cell that must not see the state (its text, or None: an error).
    absent: (&'static str, Option<&'static str>),
}

const LANGS: [Lang; 4] = [
    Lang {
        name: "javascript",
        state: [
            "const base = 40",
            "function add(x) { return base + x }; class Box { constructor(v) { this.v = v } }",
            "console.log('sum', add(2)); new Box(add(2))",
        ],
        text: Some("Box { v: 42 }"),
        stream: "console.log('first'); await new Promise(r => setTimeout(r, 1500)); 'later'",
        error: ("null.x", "TypeError"),
        spin: "while (true) require('fs').fstatSync(1)",
        probe: ("add(1)", "41"),
        absent: ("typeof base", Some("'undefined'")),
    },
    Lang {
        name: "typescript",
        state: [
            "const base: number = 40",
            "interface P { v: number }\nfunction add(x: number): number { return base + x }",
            "const p: P = { v: add(2) }; console.log('sum', p.v); p",
        ],
        text: Some("{ v: 42 }"),
        stream: "console.log('first'); await new Promise<void>(r => setTimeout(r, 1500)); 'later'",
        error: ("let x: = 1", "SyntaxError"),
        spin: "while (true) require('fs').fstatSync(1)",
        probe: ("add(1)", "41"),
        absent: ("typeof base", Some("'undefined'")),
    },
    Lang {
        name: "r",
        state: [
            "base <- 40",
            "add <- function(x) base + x",
            "cat('sum', add(2), '\\n'); data.frame(a = 1:3, b = c('u', 'v', 'w'))",
        ],
        text: None,
        stream: "cat('first\\n'); Sys.sleep(1.5); 'later'",
        error: ("stop('bad')", "simpleError"),
        spin: "repeat Sys.getpid()",
        probe: ("add(1)", "[1] 41"),
        absent: ("exists('base')", Some("[1] FALSE")),
    },
    Lang {
        name: "java",
        state: [
            "int base = 40;",
            "int add(int x) { return base + x; }",
            "System.out.println(\"sum \" + add(2)); add(2)",
        ],
        text: Some("42"),
        stream: "System.out.println(\"first\"); Thread.sleep(1500); \"later\"",
        error: (
            "Integer.parseInt(\"zz\")",
            "java.lang.NumberFormatException",
        ),
        spin: "while (true) { new java.io.File(\"/\").exists(); }",
        probe: ("add(1)", "41"),
        absent: ("base", None),
    },
];

/// One language through the native API; returns its figures line.
fn native_checks(api: &Api, id: &str, l: &Lang) -> String {
    let n = l.name;
    // A new context of the language (a warm spare), then its first and second cells: what a
    // sandbox restored from the template waits for.
    let t = Instant::now();
    let ctx = api.call(
        "POST",
        &format!("/v1/sandboxes/{id}/contexts"),
        json!({"language": n}),
    );
    let create_ms = t.elapsed().as_millis();
    let ctx = ctx["id"].as_str().expect("a context id").to_string();
    let first = api.run_in(id, &ctx, l.state[0]);
    assert_eq!(first.status(), "ok", "{n}: {first:?}");
    // Nothing of the driver's own (its reseeding after the restore, say) reaches the cell's
    // output.
    assert_eq!(first.stderr(), "", "{n}: {first:?}");
    let second = api.run_in(id, &ctx, l.state[1]);
    assert_eq!(second.status(), "ok", "{n}: {second:?}");
    let third = api.run_in(id, &ctx, l.state[2]);
    assert_eq!(third.status(), "ok", "{n}: {third:?}");
    assert_eq!(third.stdout().trim(), "sum 42", "{n}: {third:?}");
    if let Some(text) = l.text {
        assert_eq!(third.text(), Some(text), "{n}: {third:?}");
    }
    if n == "r" {
        let html = third.result().and_then(|r| r["text/html"].as_str());
        assert!(
            html.is_some_and(|h| h.contains("<table") && h.contains("<td>u</td>")),
            "r: a data.frame is an HTML table too: {third:?}"
        );
        assert!(third.text().is_some_and(|t| t.contains("a b")), "{third:?}");
    }

    // Stdout arrives while the cell still runs.
    let s = api.run_in(id, &ctx, l.stream);
    assert_eq!(s.status(), "ok", "{n}: {s:?}");
    let first_out = s.of("stdout").next().map(|(t, _)| *t).expect("stdout");
    assert!(
        s.end_at() - first_out > Duration::from_millis(800),
        "{n}: stdout at {first_out:?}, end at {:?}: not streamed",
        s.end_at()
    );

    let t = Instant::now();
    let e = api.run_in(id, &ctx, l.error.0);
    let short_cell = t.elapsed();
    assert_eq!(e.status(), "error", "{n}: {e:?}");
    let x = e.exception().expect("an exception line");
    assert_eq!(x["name"], l.error.1, "{n}: {x}");
    assert!(
        x["traceback"].as_array().is_some_and(|t| !t.is_empty()),
        "{n}: a traceback: {x}"
    );

    // The limit: 2 s. For Java it often lands while jshell still compiles the snippet
    // (seconds on kvm_pvm), before there is an execution to stop: the driver repeats the stop
    // until the cell ends. Known bug (javascript, typescript; docs/e2b.md): a SIGINT that lands
    // before the Node.js driver has taken the cell up (a loaded guest) is lost, and the cell
    // runs until the agent's kill. Their limit leaves room for that: three times what the
    // short error cell took, when longer than 2 s.
    let limit_ms = if matches!(n, "javascript" | "typescript") {
        (3 * short_cell.as_millis() as u64).max(2000)
    } else {
        2000
    };
    eprintln!("{n}: a short error cell took {short_cell:?}");
    let t = Instant::now();
    let spin = api.code(
        id,
        json!({"code": l.spin, "context": ctx, "timeout_ms": limit_ms}),
    );
    // `timed_out` is the guest's own report (the runtime's limit, 30 s later, would end the
    // stream with an error line instead). On a loaded kvm_pvm host a busy JVM can delay the
    // agent by tens of seconds (seen: 31 s), so the time is printed, not bounded.
    assert_eq!(spin.status(), "timed_out", "{n}: {spin:?}");
    eprintln!(
        "{n}: a {limit_ms} ms time limit stopped the cell after {:?}",
        t.elapsed()
    );
    let p = api.run_in(id, &ctx, l.probe.0);
    assert_eq!(
        p.text(),
        Some(l.probe.1),
        "{n}: state kept after a timeout: {p:?}"
    );

    // The language's default context (run_code with `language`) is another process.
    let d = api.run(id, n, l.absent.0);
    match l.absent.1 {
        Some(text) => assert_eq!(d.text(), Some(text), "{n}: {d:?}"),
        None => assert_eq!(d.status(), "error", "{n}: {d:?}"),
    }
    format!(
        "{n}: context_create {create_ms} ms, first cell {} ms, second cell {} ms",
        first.end_at().as_millis(),
        second.end_at().as_millis()
    )
}

/// Two sandboxes restored from one snapshot draw different numbers from Java's shared
/// generators: the driver reseeds them after a restore (ThreadLocalRandom's seed source, for
/// one, is in the snapshot: each cell runs on a new thread seeded from it).
fn java_clones_differ(api: &Api, a: &str, b: &str) {
    let code = "Math.random() + \" \" + new java.util.Random().nextLong() + \" \" + \
                java.util.concurrent.ThreadLocalRandom.current().nextLong() + \" \" + \
                new java.util.SplittableRandom().nextLong()";
    let draw = |id: &str| -> Vec<String> {
        let c = api.run(id, "java", code);
        assert_eq!(c.status(), "ok", "{c:?}");
        c.text()
            .expect("a result")
            .trim_matches('"')
            .split(' ')
            .map(str::to_owned)
            .collect()
    };
    let (x, y) = (draw(a), draw(b));
    assert_eq!(x.len(), 4, "{x:?}");
    for (i, what) in [
        "Math.random",
        "new Random",
        "ThreadLocalRandom",
        "new SplittableRandom",
    ]
    .iter()
    .enumerate()
    {
        assert_ne!(x[i], y[i], "{what}: two clones drew the same: {x:?} {y:?}");
    }
}

fn r_plots(api: &Api, id: &str) {
    for (what, code) in [
        ("base plot", "plot(1:10, (1:10)^2, main = 'squares')"),
        (
            "ggplot2",
            "library(ggplot2)\nggplot(data.frame(x = 1:5, y = c(2, 4, 1, 5, 3)), aes(x, y)) + geom_line()",
        ),
    ] {
        let c = api.run(id, "r", code);
        assert_eq!(c.status(), "ok", "{what}: {c:?}");
        let pngs = c.pngs();
        assert_eq!(pngs.len(), 1, "{what}: one PNG: {c:?}");
        let (w, h, colours) = decode_png(&pngs[0]);
        assert!(w >= 300 && h >= 200, "{what}: {w}x{h}");
        assert!(colours >= 3, "{what}: not blank: {colours} colours");
    }
    let w = api.run(id, "r", "warning('careful'); 1");
    assert_eq!(w.status(), "ok", "{w:?}");
    assert!(w.stderr().contains("careful"), "a warning on stderr: {w:?}");
}

fn e2b_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("e2b")
}

/// The SDK scripts' `languages` check, as (label, command), with the directory the JS
/// script runs from (removed when dropped), or why they cannot run.
type SdkRuns = (Vec<(&'static str, Command)>, tempfile::TempDir);

fn sdk_runs() -> Result<SdkRuns, String> {
    let cache = ember_runtime::paths::cache_dir().join("e2b");
    let venv = std::env::var_os("EMBER_E2B_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            cache.join(format!(
                "venv-{}",
                hash16(&e2b_dir().join("requirements.txt"))
            ))
        });
    let nm = std::env::var_os("EMBER_E2B_NODE_MODULES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            cache
                .join(format!(
                    "node-{}",
                    hash16(&e2b_dir().join("package-lock.json"))
                ))
                .join("node_modules")
        });
    let python = venv.join("bin/python");
    if !(python.is_file() && venv.join(".ok").is_file()) {
        return Err(format!(
            "no Python SDK venv at {} (EMBER_E2B_VENV)",
            venv.display()
        ));
    }
    if !nm.join("@e2b/code-interpreter/package.json").is_file() {
        return Err(format!(
            "no JS SDK at {} (EMBER_E2B_NODE_MODULES)",
            nm.display()
        ));
    }
    let mut py = Command::new(python);
    py.arg(e2b_dir().join("test_sdk.py"))
        .args(["--only", "languages"]);
    // ESM resolves packages beside the script: a copy of it next to a link to them.
    let tmp = tempfile::Builder::new()
        .prefix("ember-languages-js-")
        .tempdir()
        .expect("temp dir");
    let dir = tmp.path();
    std::fs::copy(e2b_dir().join("test_sdk.mjs"), dir.join("test_sdk.mjs")).expect("copy");
    std::os::unix::fs::symlink(&nm, dir.join("node_modules")).expect("link node_modules");
    let mut js = Command::new("node");
    js.arg(dir.join("test_sdk.mjs"))
        .args(["--only", "languages"]);
    Ok((vec![("python SDK", py), ("JS SDK", js)], tmp))
}

#[test]
fn every_language_through_the_native_api_and_the_e2b_sdks() {
    let t_build = Instant::now();
    template("code-interpreter");
    template("default");
    eprintln!(
        "templates ready in {:.1} s",
        t_build.elapsed().as_secs_f64()
    );
    let sdks = sdk_runs();
    if let Err(why) = &sdks {
        ember_tests::skip(
            "every_language_through_the_native_api_and_the_e2b_sdks (the E2B SDK half)",
            why,
        );
    }
    let home = tempfile::Builder::new()
        .prefix("ember-languages-")
        .tempdir()
        .expect("temp home");
    let srv = Serve::start(home.path(), false);
    let api = Api {
        url: srv.url.clone(),
        token: srv.token(),
    };

    // The SDKs run beside the native checks (each in its own sandbox).
    let (sdks, _js_dir) = match sdks {
        Ok((runs, dir)) => (runs, Some(dir)),
        Err(_) => (Vec::new(), None),
    };
    let sdk_threads: Vec<_> = sdks
        .into_iter()
        .map(|(label, mut cmd)| {
            cmd.env("E2B_API_KEY", &api.token)
                .env("E2B_API_URL", &api.url)
                .env("E2B_SANDBOX_URL", &api.url)
                .env("NO_PROXY", "127.0.0.1,localhost")
                .env("no_proxy", "127.0.0.1,localhost")
                .env("PYTHONUNBUFFERED", "1");
            std::thread::spawn(move || {
                let out = cmd.output().unwrap_or_else(|e| panic!("{label}: {e}"));
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                (label, out.status.success(), text)
            })
        })
        .collect();

    let t = Instant::now();
    let sb = api.call(
        "POST",
        "/v1/sandboxes",
        json!({"template": "code-interpreter", "timeout_secs": 900}),
    );
    let id = sb["id"].as_str().expect("a sandbox id").to_string();
    let mut figures = vec![format!(
        "sandbox from code-interpreter in {} ms",
        t.elapsed().as_millis()
    )];
    for l in &LANGS {
        figures.push(native_checks(&api, &id, l));
    }
    r_plots(&api, &id);

    let clone = api.call(
        "POST",
        "/v1/sandboxes",
        json!({"template": "code-interpreter", "timeout_secs": 300}),
    );
    let clone = clone["id"].as_str().expect("a sandbox id").to_string();
    java_clones_differ(&api, &id, &clone);
    api.req("DELETE", &format!("/v1/sandboxes/{clone}"))
        .call()
        .expect("kill the clone");

    let (code, body) = api.refused(
        "POST",
        &format!("/v1/sandboxes/{id}/contexts"),
        json!({"language": "cobol"}),
    );
    assert_eq!(code, 400, "{body}");
    assert!(
        body.contains("javascript") && body.contains("java"),
        "{body}"
    );
    // A template without the language: refused with the languages it has.
    let small = api.call("POST", "/v1/sandboxes", json!({"template": "default"}));
    let small = small["id"].as_str().expect("a sandbox id");
    let (code, body) = api.refused(
        "POST",
        &format!("/v1/sandboxes/{small}/contexts"),
        json!({"language": "r"}),
    );
    assert_eq!(code, 422, "the guest's refusal: {body}");
    assert!(
        body.contains("python, bash") && !body.contains("java"),
        "the languages the template has: {body}"
    );

    let mut failed = Vec::new();
    for h in sdk_threads {
        let (label, ok, out) = h.join().expect("SDK thread");
        eprintln!("==== {label}:\n{out}");
        if !ok {
            failed.push(label);
        }
    }
    for f in &figures {
        println!("figures: {f}");
    }
    assert!(
        failed.is_empty(),
        "E2B SDK checks failed: {failed:?}\n{}",
        srv.log_tail(100)
    );
}
