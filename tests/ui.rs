//! The web dashboard (`/ui`) end to end: a real `ember serve` (its own `$EMBER_HOME`, real
//! jailed VMs of the `python-data` template) driven by `tests/ui/test_ui.py` — Playwright for
//! Python in the host's headless Chromium. The Playwright venv is the one
//! `scripts/browser-clients.sh` installs for tests/browser.rs (`EMBER_BROWSER_VENV`, or that
//! script's path); the browser is Debian's (`/usr/lib/chromium/chromium`), never a downloaded
//! one. Missing either fails the test under `CI=true` and skips it otherwise
//! (`ember_tests::skip`).
//!
//! The script signs in through the form, sees a sandbox created through the API appear in the
//! list without a reload, runs a pandas cell (an HTML table), hostile HTML (no script runs), a
//! plot (a PNG), `echo hi`, downloads a collected artifact, sees the resource chart fill, a
//! line written to the guest's serial console in the log tail, builds the cached `default`
//! template (its log streamed) and an unknown recipe (its error), pages through 1,000 ended
//! sandboxes this file puts in the store first (50 rows at a time), filters by metadata,
//! pauses and resumes, forks and snapshots, reads the overview's create rate and latency,
//! kills and signs out; it checks 401 without the session and 403 for actions without the CSRF token. This
//! file then checks that each page's screenshot is not blank (distinct pixel colours), and
//! prints the script's figures (page weight, first paint of the overview, list update).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ember_tests::{decode_png, hash16, template, Serve};

/// What the script may take: ~45–90 s alone here, several times that beside another suite's
/// guests on a slower host (scripts/test.sh runs two lanes); past this it is hung.
const LIMIT: Duration = Duration::from_secs(900);
/// The pages screenshotted; each must show more distinct colours than [`MIN_COLOURS`].
const PAGES: [&str; 5] = ["signin", "overview", "sandboxes", "sandbox", "templates"];
const MIN_COLOURS: usize = 16;

/// Ended sandboxes put in the store for the list's paging check, of template [`SEEDED_TEMPLATE`].
const SEEDED: usize = 1000;
const SEEDED_TEMPLATE: &str = "seeded-for-paging";

/// `n` stopped sandboxes of [`SEEDED_TEMPLATE`] in `home`'s store (as the runtime writes them:
/// a row and its transitions).
fn seed_ended_sandboxes(home: &Path, n: usize) {
    use ember_runtime::clock::now_ms;
    use ember_runtime::store::{SandboxRow, Store};
    use ember_runtime::{OnTimeout, Resources, State};
    let store = Store::open(&home.join("ember.db")).expect("the test home's store");
    let now = now_ms();
    for i in 0..n {
        let row = SandboxRow {
            id: format!("5eed{i:012x}"),
            template: Some(SEEDED_TEMPLATE.into()),
            snapshot: None,
            forked_from: None,
            source_dir: "/nonexistent".into(),
            state: State::Stopped,
            reason: Some("seeded by tests/ui.rs".into()),
            created_ms: now - (n - i) as i64 * 1000,
            ends_ms: None,
            max_until_ms: None,
            ended_ms: Some(now),
            on_timeout: OnTimeout::Kill,
            timeout_ms: 60_000,
            resources: Resources {
                vcpus: 1,
                memory_mib: 256,
                ..Default::default()
            },
            metadata: Default::default(),
            env: Default::default(),
            secret_env: Default::default(),
            outputs: "/workspace/outputs".into(),
            uid: None,
            jail_id: None,
            pid: None,
            pause_dir: None,
            start_ms: None,
            network: Default::default(),
        };
        store.insert_sandbox(&row).expect("insert a seeded sandbox");
    }
}

/// Playwright's python and the host's Chromium, or what is missing.
fn prerequisites() -> Result<(PathBuf, PathBuf), String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let venv = std::env::var_os("EMBER_BROWSER_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            ember_runtime::paths::cache_dir()
                .join("browser")
                .join(format!(
                    "venv-{}",
                    hash16(&dir.join("browser/requirements.txt"))
                ))
        });
    let chromium = ["/usr/lib/chromium/chromium", "/usr/bin/chromium"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file());
    let mut missing = Vec::new();
    if !Path::new("/dev/kvm").exists() {
        missing.push("/dev/kvm".to_string());
    }
    let python = venv.join("bin/python");
    if !(python.is_file() && venv.join(".ok").is_file()) {
        missing.push(format!(
            "Playwright's venv at {} (EMBER_BROWSER_VENV; run `bash scripts/browser-clients.sh`)",
            venv.display()
        ));
    }
    if chromium.is_none() {
        missing.push("the host's Chromium (apt-get install chromium)".to_string());
    }
    match (missing.is_empty(), chromium) {
        (true, Some(c)) => Ok((python, c)),
        _ => Err(format!("the dashboard test needs: {}", missing.join(", "))),
    }
}

#[test]
fn dashboard_signs_in_lists_runs_cells_and_commands_and_guards_actions() {
    const NAME: &str = "dashboard_signs_in_lists_runs_cells_and_commands_and_guards_actions";
    let (python, chromium) = match prerequisites() {
        Ok(p) => p,
        Err(why) => {
            ember_tests::skip(NAME, &why);
            return;
        }
    };
    template("default"); // the build the templates page asks for: found in the cache
    template("python-data");
    let home = tempfile::Builder::new()
        .prefix("ember-ui-test-")
        .tempdir()
        .expect("temp home");
    // EMBER_UI_SHOTS keeps the screenshots (for a look); else they go with the temp home.
    let shots = std::env::var_os("EMBER_UI_SHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.path().join("shots"));
    std::fs::create_dir_all(&shots).expect("shots dir");
    // The list at scale: rows of ended sandboxes put in the store before the server opens
    // it (no VM behind them), which the script pages through.
    seed_ended_sandboxes(home.path(), SEEDED);
    let srv = Serve::start(home.path(), false);
    let t0 = Instant::now();
    let mut child = Command::new(&python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("ui/test_ui.py"))
        .env("UI_URL", &srv.url)
        .env("EMBER_TOKEN", srv.token())
        .env("HOST_CHROMIUM", &chromium)
        .env("UI_SHOTS", &shots)
        .env("UI_TEMPLATE", "python-data")
        .env("UI_SEEDED", SEEDED.to_string())
        .env("UI_SEEDED_TEMPLATE", SEEDED_TEMPLATE)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the dashboard script");
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
    println!("==== tests/ui/test_ui.py ({secs:.1} s)\n{stdout}");
    if !stderr.trim().is_empty() {
        println!("==== its stderr\n{stderr}");
    }
    let ok = status.is_some_and(|s| s.success());
    if !ok {
        println!("==== ember serve log (tail):\n{}", srv.log_tail(150));
    }
    assert!(status.is_some(), "the dashboard script ran past {LIMIT:?}");
    assert!(ok, "the dashboard script failed: {status:?}");
    assert!(stdout.contains("all passed"), "{stdout}");
    for page in PAGES {
        let file = shots.join(format!("{page}.png"));
        let png = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let (w, h, colours) = decode_png(&png);
        println!("screenshot {page}: {w}x{h}, {colours} distinct colours");
        assert!(
            colours > MIN_COLOURS,
            "the {page} page looks blank: {colours} distinct colours in {}",
            file.display()
        );
    }
}
