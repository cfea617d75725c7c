//! MCP, with the official MCP Python SDK (PyPI `mcp`, pinned in `tests/mcp/requirements.txt`,
//! installed by `scripts/mcp-sdk.sh` into `$EMBER_CACHE/mcp`, found through `EMBER_MCP_VENV`)
//! against a real `ember serve` (its own `$EMBER_HOME`, real jailed VMs from the shipped
//! templates): `tests/mcp/test_mcp.py` talks to the server's `/mcp` over streamable HTTP and
//! to `ember mcp` over stdio.
//!
//! Checked, over each transport: the tools listed with their schemas, `create_sandbox`,
//! `run_code` keeping a variable from one call to the next, an exception as a tool error,
//! `write_file` / `read_file` / `list_files`, `run_command` (stdout, stderr, a non-zero exit
//! as a tool error), a runtime error (no such sandbox) as a tool error, `kill_sandbox`. Over
//! HTTP: a request without the token or with a wrong one is refused (401), a matplotlib chart
//! comes back as PNG image content (template `python-data`), an artifact is listed and read.
//! Over stdio: `upload_file` (a local file, its SHA-256 checked in the guest; a missing one
//! is a tool error), and a sandbox created through `ember mcp` and left running is gone once
//! its stdin closes. Figures: the median `run_code` round trip over MCP (HTTP and stdio) and
//! through the native API (`ember code`, one process per call), ~10 rounds each.
//!
//! A missing SDK venv fails the test under `CI=true` (or with `EMBER_MCP_VENV` set) and skips
//! it otherwise (`ember_tests::skip`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ember_tests::{bin, hash16, template, Serve};

/// What the whole test may take (the script's own part: ~30 s on a kvm_pvm host).
const LIMIT: Duration = Duration::from_secs(90);

fn mcp_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("mcp")
}

/// The SDK's venv python, or why it is not usable.
fn find_python() -> Result<PathBuf, String> {
    let venv = std::env::var_os("EMBER_MCP_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            ember_runtime::paths::cache_dir().join("mcp").join(format!(
                "venv-{}",
                hash16(&mcp_dir().join("requirements.txt"))
            ))
        });
    let python = venv.join("bin/python");
    if python.is_file() && venv.join(".ok").is_file() {
        Ok(python)
    } else {
        Err(format!(
            "no MCP SDK venv at {} (EMBER_MCP_VENV); run `bash scripts/mcp-sdk.sh`",
            venv.display()
        ))
    }
}

#[test]
fn mcp_sdk_drives_ember_over_stdio_and_http() {
    const NAME: &str = "mcp_sdk_drives_ember_over_stdio_and_http";
    let python = match find_python() {
        Ok(p) => p,
        Err(why) => {
            assert!(
                std::env::var_os("EMBER_MCP_VENV").is_none(),
                "EMBER_MCP_VENV is set but unusable: {why}"
            );
            ember_tests::skip(NAME, &why);
            return;
        }
    };
    template("default");
    template("python-data");
    let home = tempfile::Builder::new()
        .prefix("ember-mcp-test-")
        .tempdir()
        .expect("temp home");
    let srv = Serve::start(home.path(), false);
    let t0 = Instant::now();
    let mut child = Command::new(&python)
        .arg(mcp_dir().join("test_mcp.py"))
        .env("EMBER_BIN", bin("ember"))
        .env("EMBER_URL", &srv.url)
        .env("EMBER_TOKEN", srv.token())
        .env("EMBER_HOME", home.path())
        .env("EMBER_VMM", bin("ember-vmm"))
        .env("MCP_TEMPLATE_PLOT", "python-data")
        .env("MCP_ROUNDS", "10")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the MCP script");
    // The pipes are drained on threads, the deadline kept here.
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for the script") {
            break Some(st);
        }
        if t0.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    let secs = t0.elapsed().as_secs_f64();
    println!("==== tests/mcp/test_mcp.py ({secs:.1} s)\n{stdout}");
    if !stderr.trim().is_empty() {
        println!("==== its stderr (ember mcp's log included)\n{stderr}");
    }
    let ok = status.is_some_and(|s| s.success());
    if !ok {
        println!("==== ember serve log (tail):\n{}", srv.log_tail(150));
    }
    assert!(status.is_some(), "the MCP script ran past {LIMIT:?}");
    assert!(ok, "the MCP script failed: {:?}", status);
    assert!(stdout.contains("all passed"), "{stdout}");
}
