//! The official E2B SDKs, unchanged, against a real `ember serve` (its own `$EMBER_HOME`, real
//! jailed VMs from the shipped templates): the Python SDK over the header route and over the
//! TLS/Host route, the JavaScript SDK over the header route.
//!
//! The scripts are `tests/e2b/test_sdk.py` and `tests/e2b/test_sdk.mjs`; the SDKs are pinned in
//! `tests/e2b/requirements.txt` (e2b 2.63.0, e2b-code-interpreter 2.11.5) and
//! `tests/e2b/package-lock.json` (e2b 2.51.0, @e2b/code-interpreter 2.8.0) and installed by
//! `scripts/e2b-sdks.sh` into `$EMBER_CACHE/e2b`. This test finds them through
//! `EMBER_E2B_VENV` / `EMBER_E2B_NODE_MODULES` (set by `scripts/test.sh`) or else at the paths that
//! script uses. Missing SDKs fail the test under `CI=true` or when those variables are set, and
//! skip it otherwise (`ember_tests::skip`: printed, and counted and listed by `scripts/test.sh`).
//!
//! Routes:
//! - header route: `E2B_API_URL=E2B_SANDBOX_URL=http://127.0.0.1:PORT`; sandbox requests carry
//!   `E2b-Sandbox-Id` / `E2b-Sandbox-Port`.
//! - TLS/Host route: `ember serve --tls-listen 127.0.0.1:PORT2 --domain e2b.localhost:PORT2`,
//!   `E2B_DOMAIN=e2b.localhost:PORT2`, `SSL_CERT_FILE` = the bundle `ember tls init` writes; the
//!   SDK reaches `https://api.e2b.localhost:PORT2` and `https://<port>-<id>.e2b.localhost:PORT2`
//!   (HTTP/2 for the API and envd RPC, HTTP/1.1 for the code interpreter and downloads).
//!
//! SDK calls exercised, Python (`e2b_code_interpreter.Sandbox`, synchronous):
//! - `Sandbox.create(envs=, metadata=, timeout=)` (default template `code-interpreter-v1`),
//!   `Sandbox.create(snapshot_id)`
//! - `run_code(code)`, `run_code(code, envs=)`, `run_code(code, language="bash")`: `.text`,
//!   `.logs.stdout/.stderr`, `.results[].png`, `.error.name/.value/.traceback`; code runs in
//!   `/home/user` and reads a relative file written by `files.write`
//! - `create_code_context(cwd=)`, `run_code(code, context=)`, `list_code_contexts()`,
//!   `restart_code_context`, `remove_code_context` (then `NotFoundException`)
//! - `get_metrics()`; `pty.create(PtySize, user=)`, `pty.send_stdin`, `handle.wait(on_pty=)`
//! - `commands.run(cmd)` (`stdout`, `stderr`, `exit_code`), `commands.run(cmd, envs=, cwd=)`,
//!   a non-zero exit → `CommandExitException(exit_code, stderr)`,
//!   `commands.run(cmd, background=True)` → `.pid`, `commands.list()`,
//!   `commands.connect(pid)`, `commands.kill(pid)` (True, then False), `handle.wait()`,
//!   `commands.run(cmd, background=True, stdin=True)`, `commands.send_stdin(pid, str|bytes)`,
//!   `commands.close_stdin(pid)`
//! - `files.write(path, str|bytes|file-like)` (multipart and octet-stream), relative paths,
//!   `files.read(path)` / `format="bytes"`, `files.list`, `files.exists`, `files.make_dir`
//!   (True, then False), `files.rename`, `files.remove`, a missing file →
//!   `FileNotFoundException`, `files.watch_dir` + `get_new_events()` + `stop()`,
//!   64 MiB `write` / `read` with the same SHA-256 (rates printed)
//! - `set_timeout`, `get_info()` (`sandbox_id`, `metadata`, `state`, `end_at`),
//!   `Sandbox.get_info(id)`, `Sandbox.list(query=SandboxQuery(metadata=…)).next_items()`,
//!   `Sandbox.connect(id)` (running, and resuming a paused sandbox), `pause()`,
//!   `Sandbox.pause(id)` of a paused sandbox → False, `fork(count=3)`, `create_snapshot()`,
//!   `kill()`, `Sandbox.kill(id)` (killed or unknown → False), `is_running()`
//!
//! SDK calls exercised, JavaScript (`@e2b/code-interpreter` `Sandbox`, `e2b`
//! `CommandExitError`): `Sandbox.create({envs, metadata, timeoutMs})`, `Sandbox.create(snapshotId)`,
//! `runCode` (`.text`, `.results[].png`, `.error.name`), `commands.run` (incl. `{envs, cwd}`,
//! `{background: true}`, a failing one → `CommandExitError`), `commands.connect(pid)`,
//! `commands.kill(pid)`, `files.write` (string, Blob), `files.read` (text, bytes),
//! `files.exists`, `files.makeDir`, `files.list`, `pause()`, `Sandbox.connect(id)` (resume),
//! `Sandbox.list({query: {metadata}}).nextItems()`, `fork({count: 2})`, `createSnapshot()`,
//! `kill()`, `isRunning()`, `Sandbox.kill(unknown id)`.
//!
//! Template builds, Python (`tests/e2b/test_template.py`): `Template(file_context_path=)`
//! `.from_template("base").set_envs().copy(dir).set_workdir().run_cmd().set_user()`,
//! `Template().from_dockerfile(text)`, `Template.build(t, name, on_build_logs=)` (uploads by
//! hash, the build trigger, polled status with logs), `Template.exists`, `Template.get_tags`,
//! then `Sandbox.create(name)` with `commands.run` and `run_code`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ember_tests::{bin, hash16, template, Serve};

/// The checks run again over the TLS/Host route (a subset: the route, not the features, is
/// what differs).
const TLS_CHECKS: &str = "create,run_code_state,run_code_error,commands_run,files_basic,\
files_watch_dir,set_timeout_get_info,list_with_metadata,connect,pause_resume,kill";

/// The checks of the JS SDK's run (a subset: the Python SDK covers the features over the same
/// routes; the JS SDK's own encoding of each call family is what differs).
const JS_CHECKS: &str = "create,run_code_state,run_code_error,commands_run,files,pause_resume,\
list_with_metadata,fork,snapshot,kill";

/// Where the SDKs are, or why they are not usable.
struct Sdks {
    python: Result<PathBuf, String>,
    node_modules: Result<PathBuf, String>,
}

/// The E2B domain the server's TLS listener answers for.
fn domain(srv: &Serve) -> String {
    format!("e2b.localhost:{}", srv.tls_port.expect("a TLS listener"))
}

fn e2b_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("e2b")
}

fn find_sdks() -> Sdks {
    let cache = ember_runtime::paths::cache_dir().join("e2b");
    let venv = std::env::var_os("EMBER_E2B_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            cache.join(format!(
                "venv-{}",
                hash16(&e2b_dir().join("requirements.txt"))
            ))
        });
    let python = venv.join("bin/python");
    let python = if python.is_file() && venv.join(".ok").is_file() {
        Ok(python)
    } else {
        Err(format!(
            "no Python SDK venv at {} (EMBER_E2B_VENV)",
            venv.display()
        ))
    };
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
    let node_ok = Command::new("node")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    let node_modules = if !node_ok {
        Err("`node` is not runnable".to_string())
    } else if nm.join("e2b/package.json").is_file()
        && nm.join("@e2b/code-interpreter/package.json").is_file()
    {
        Ok(nm)
    } else {
        Err(format!(
            "no JS SDK at {} (EMBER_E2B_NODE_MODULES)",
            nm.display()
        ))
    };
    Sdks {
        python,
        node_modules,
    }
}

/// What one script run produced.
struct Run {
    label: String,
    ok: bool,
    output: String,
}

/// Runs `cmd` with the SDK environment `envs` (every proxy and E2B variable of ours removed
/// first) for at most `limit`; stdout and stderr together.
fn run_script(label: &str, mut cmd: Command, envs: &[(&str, String)], limit: Duration) -> Run {
    for (k, _) in std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v)))
        .filter(|(k, _)| k.starts_with("E2B_") || k.to_ascii_lowercase().ends_with("_proxy"))
    {
        cmd.env_remove(k);
    }
    cmd.env("NO_PROXY", "127.0.0.1,localhost,.localhost")
        .env("no_proxy", "127.0.0.1,localhost,.localhost")
        .env("PYTHONUNBUFFERED", "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{label}: cannot start {cmd:?}: {e}"));
    // Lines as they come, into one transcript and to the test's stderr (seen with
    // --nocapture).
    let out = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let readers: Vec<_> = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    .map(|r| {
        let out = out.clone();
        let label = label.to_string();
        std::thread::spawn(move || {
            let mut r = std::io::BufReader::new(r);
            let mut line = Vec::new();
            loop {
                line.clear();
                match std::io::BufRead::read_until(&mut r, b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        let l = String::from_utf8_lossy(&line);
                        eprint!("[{label}] {l}");
                        out.lock().unwrap_or_else(|p| p.into_inner()).push_str(&l);
                    }
                }
            }
        })
    })
    .collect();
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for the script") {
            break Some(st);
        }
        if t0.elapsed() > limit {
            // SIGTERM first: the scripts kill their sandboxes on it.
            // SAFETY: kill(2) with the script's pid and SIGTERM; no memory is involved.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(30) {
                if child.try_wait().ok().flatten().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    for r in readers {
        let _ = r.join();
    }
    let mut output = std::mem::take(&mut *out.lock().unwrap_or_else(|p| p.into_inner()));
    let ok = match status {
        Some(st) => {
            if !st.success() {
                output.push_str(&format!("\n[{label}: exited with {st}]\n"));
            }
            st.success()
        }
        None => {
            output.push_str(&format!("\n[{label}: killed after {limit:?}]\n"));
            false
        }
    };
    Run {
        label: label.to_string(),
        ok,
        output,
    }
}

/// A check's verdict lines (`ok`, `FAIL`, `skip`, the summary) from a script's output.
fn verdicts(output: &str) -> String {
    output
        .lines()
        .filter(|l| {
            l.starts_with("ok ")
                || l.starts_with("FAIL ")
                || l.starts_with("skip ")
                || l.contains(" passed, ")
                || l.starts_with("   ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn e2b_sdks_work_unchanged_against_ember_serve() {
    let sdks = find_sdks();
    // Under CI, or when the locations were given explicitly, missing SDKs are a failure.
    let required = std::env::var("CI").is_ok_and(|v| v == "true")
        || std::env::var_os("EMBER_E2B_VENV").is_some()
        || std::env::var_os("EMBER_E2B_NODE_MODULES").is_some();
    let missing: Vec<&String> = [&sdks.python, &sdks.node_modules]
        .into_iter()
        .filter_map(|r| r.as_ref().err())
        .collect();
    if !missing.is_empty() {
        let why = missing
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("; ")
            + "; run `bash scripts/e2b-sdks.sh` (it prints EMBER_E2B_VENV and \
               EMBER_E2B_NODE_MODULES)";
        assert!(
            !required,
            "the E2B SDKs are missing (CI=true or EMBER_E2B_* set): {why}"
        );
        if sdks.python.is_err() && sdks.node_modules.is_err() {
            ember_tests::skip("e2b_sdks_work_unchanged_against_ember_serve", &why);
            return;
        }
        ember_tests::skip(
            "e2b_sdks_work_unchanged_against_ember_serve (in part: the SDK that is missing)",
            &why,
        );
    }
    template("python-data");
    // The filesystem-snapshot check reboots a sandbox of `base` (= `default`).
    template("default");
    let home = tempfile::Builder::new()
        .prefix("ember-e2b-test-")
        .tempdir()
        .expect("temp home");
    // The SDKs' default template on python-data (the code-interpreter template, the server's
    // default for it, is tested by tests/languages.rs: its languages are not what is tested
    // here, and its larger memory would slow the pause, fork and snapshot checks).
    let srv = Serve::start_with(
        home.path(),
        true,
        &["--e2b-alias", "code-interpreter-v1=python-data"],
    );
    let token = srv.token();

    // The CA bundle for SSL_CERT_FILE, from the same files the server's TLS listener uses.
    let init = Command::new(bin("ember"))
        .args(["tls", "init", "--domain", &domain(&srv)])
        .env("EMBER_HOME", home.path())
        .output()
        .expect("run ember tls init");
    let init_out = String::from_utf8_lossy(&init.stdout).into_owned();
    assert!(
        init.status.success(),
        "ember tls init: {}{}",
        init_out,
        String::from_utf8_lossy(&init.stderr)
    );
    assert!(
        init_out.contains("(existing)"),
        "the server made no CA in $EMBER_HOME/tls: {init_out}"
    );
    let bundle = home.path().join("tls/bundle.pem");
    assert!(
        init_out.contains(&format!("export SSL_CERT_FILE={}", bundle.display())),
        "{init_out}"
    );

    let header_env = vec![
        ("E2B_API_KEY", token.clone()),
        ("E2B_API_URL", srv.url.clone()),
        ("E2B_SANDBOX_URL", srv.url.clone()),
    ];
    let tls_env = vec![
        ("E2B_API_KEY", token.clone()),
        ("E2B_DOMAIN", domain(&srv)),
        ("SSL_CERT_FILE", bundle.display().to_string()),
    ];
    let mut runs = Vec::new();
    let script = e2b_dir().join("test_sdk.py");
    if let Ok(python) = &sdks.python {
        let mut cmd = Command::new(python);
        cmd.arg(&script);
        runs.push(run_script(
            "python, header route",
            cmd,
            &header_env,
            Duration::from_secs(1800),
        ));
        let mut cmd = Command::new(python);
        cmd.arg(&script).args(["--only", TLS_CHECKS]);
        runs.push(run_script(
            "python, TLS/Host route",
            cmd,
            &tls_env,
            Duration::from_secs(1800),
        ));
    }
    if let Ok(nm) = &sdks.node_modules {
        // ESM resolves packages beside the script: a copy of it next to a link to them.
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::copy(
            e2b_dir().join("test_sdk.mjs"),
            dir.path().join("test_sdk.mjs"),
        )
        .expect("copy test_sdk.mjs");
        std::os::unix::fs::symlink(nm, dir.path().join("node_modules")).expect("link node_modules");
        let mut cmd = Command::new("node");
        cmd.arg(dir.path().join("test_sdk.mjs"))
            .args(["--only", JS_CHECKS]);
        runs.push(run_script(
            "node, header route",
            cmd,
            &header_env,
            Duration::from_secs(1200),
        ));
    }

    let mut report = String::new();
    for r in &runs {
        report.push_str(&format!(
            "== {} ({}):\n{}\n",
            r.label,
            if r.ok { "passed" } else { "FAILED" },
            verdicts(&r.output)
        ));
    }
    println!("{report}");
    let failed: Vec<&Run> = runs.iter().filter(|r| !r.ok).collect();
    if !failed.is_empty() {
        for r in &failed {
            println!("==== full output of {}:\n{}", r.label, r.output);
        }
        println!("==== ember serve log (tail):\n{}", srv.log_tail(200));
        panic!(
            "E2B SDK checks failed: {}\n{report}",
            failed
                .iter()
                .map(|r| r.label.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

/// A background process started through the E2B Python SDK (with a tag, through envd's
/// `process.Start`) keeps its tag and command across a graceful restart of `ember serve`, and
/// the SDK re-attaches to it afterwards; a polling watcher created before the restart reports
/// a file written after it. Processes' records and watchers are the runtime's (in its
/// store), not the E2B adapter's.
#[test]
fn e2b_process_tag_attach_and_watcher_survive_a_server_restart() {
    const NAME: &str = "e2b_process_tag_attach_and_watcher_survive_a_server_restart";
    let sdks = find_sdks();
    let python = match &sdks.python {
        Ok(p) => p.clone(),
        Err(why) => {
            ember_tests::skip(NAME, why);
            return;
        }
    };
    template("default");
    let home = tempfile::Builder::new()
        .prefix("ember-e2b-restart-")
        .tempdir()
        .expect("temp home");
    let mut srv = Serve::start(home.path(), true);
    let env = vec![
        ("E2B_API_KEY", srv.token()),
        ("E2B_API_URL", srv.url.clone()),
        ("E2B_SANDBOX_URL", srv.url.clone()),
    ];
    let script = e2b_dir().join("test_restart.py");
    let mut cmd = Command::new(&python);
    cmd.arg(&script).arg("start");
    let run = run_script("restart: start", cmd, &env, Duration::from_secs(600));
    assert!(run.ok, "{}\n{}", run.output, srv.log_tail(100));
    let line = run
        .output
        .lines()
        .find(|l| l.starts_with("sandbox "))
        .unwrap_or_else(|| panic!("no `sandbox ID pid PID watcher W` line:\n{}", run.output));
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words.len(), 6, "{line}");
    let (id, pid, watcher) = (
        words[1].to_string(),
        words[3].to_string(),
        words[5].to_string(),
    );

    srv.restart();

    let mut cmd = Command::new(&python);
    cmd.arg(&script).args(["after", &id, &pid, &watcher]);
    let run = run_script("restart: after", cmd, &env, Duration::from_secs(600));
    assert!(run.ok, "{}\n{}", run.output, srv.log_tail(100));
    assert!(run.output.contains("ok re-attached"), "{}", run.output);
}

/// E2B's template build API (`POST /v3/templates`, file uploads by hash, the build trigger,
/// polled status with logs, aliases, tags) through the unchanged Python SDK
/// (`tests/e2b/test_template.py`): a `Template()` builder and a `from_dockerfile`, both from
/// E2B's `base` (ember's `default`), each then used by `Sandbox.create(name)` to run code and
/// commands that see what the steps did. The steps run in build VMs and are cached by their
/// inputs, so a second run finds both templates built.
#[test]
fn e2b_template_build_api_makes_templates_sandboxes_use_at_once() {
    let test = "e2b_template_build_api_makes_templates_sandboxes_use_at_once";
    let sdks = find_sdks();
    let python = match &sdks.python {
        Ok(p) => p.clone(),
        Err(why) => {
            ember_tests::skip(
                test,
                &format!("{why}; run `bash scripts/e2b-sdks.sh` (it prints EMBER_E2B_VENV)"),
            );
            return;
        }
    };
    if !ember_tests::is_root() {
        ember_tests::skip(test, "needs root (KVM, the template cache)");
        return;
    }
    let t0 = Instant::now();
    template("default");
    let home = tempfile::Builder::new()
        .prefix("ember-e2b-template-")
        .tempdir()
        .expect("temp home");
    let srv = Serve::start(home.path(), false);
    let out = Command::new(&python)
        .arg(e2b_dir().join("test_template.py"))
        .env("E2B_API_KEY", srv.token())
        .env("E2B_API_URL", &srv.url)
        .env("E2B_SANDBOX_URL", &srv.url)
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_DEBUG")
        .stdin(Stdio::null())
        .output()
        .expect("run test_template.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the SDK script failed:\n{stdout}\n{stderr}\nserver log:\n{}",
        srv.log_tail(80)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
    eprintln!("{v:#}");
    let sdk = &v["e2b-sdk-tpl"];
    assert_eq!(
        sdk["stdout"],
        "hello from the context\nbuilt-by-run\nbuilt.txt\nhello.txt\nfrom-sdk\nuser\n",
        "the Template() builder's steps, as its sandbox sees them (skip.log is .dockerignored): {v}"
    );
    assert_eq!(sdk["code"], "from-sdk built-by-run", "{v}");
    assert!(sdk["error"].is_null(), "{v}");
    let df = &v["e2b-df-tpl"];
    assert_eq!(
        df["stdout"], "hello from the context\nfrom-run\nfrom-dockerfile\n",
        "{v}"
    );
    assert_eq!(df["code"], "42", "{v}");
    assert_eq!(v["exists"], serde_json::json!([true, false]), "{v}");
    assert_eq!(v["tags"], serde_json::json!(["v1"]), "{v}");
    eprintln!(
        "{test}: builder build {}s, Dockerfile build {}s, create -> first result {} ms / {} ms; \
         {:.1}s in all",
        v["builder_seconds"],
        v["dockerfile_seconds"],
        sdk["create_to_result_ms"],
        df["create_to_result_ms"],
        t0.elapsed().as_secs_f64()
    );
}
