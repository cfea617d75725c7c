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
//! plot (a PNG), `echo hi`, downloads a collected artifact, pauses and resumes, kills and signs
//! out; it checks 401 without the session and 403 for actions without the CSRF token. This
//! file then checks that each page's screenshot is not blank (distinct pixel colours), and
//! prints the script's figures (page weight, first paint of the overview, list update).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ember_tests::{bin, decode_png, template};

/// What the script may take.
const LIMIT: Duration = Duration::from_secs(90);
/// The pages screenshotted; each must show more distinct colours than [`MIN_COLOURS`].
const PAGES: [&str; 5] = ["signin", "overview", "sandboxes", "sandbox", "templates"];
const MIN_COLOURS: usize = 16;

struct Server {
    child: Child,
    home: PathBuf,
    url: String,
}

impl Server {
    fn start(home: &Path) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let log = std::fs::File::create(home.join("serve.log")).expect("serve.log");
        let child = Command::new(bin("ember"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .env("EMBER_HOME", home)
            .env("EMBER_VMM", bin("ember-vmm"))
            .env("EMBER_JAILER", bin("ember-jailer"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start ember serve");
        let mut s = Server {
            child,
            home: home.to_path_buf(),
            url: format!("http://127.0.0.1:{port}"),
        };
        let t0 = Instant::now();
        while ureq::get(&format!("{}/healthz", s.url)).call().is_err() {
            if let Ok(Some(st)) = s.child.try_wait() {
                panic!("ember serve exited ({st}):\n{}", s.log_tail(100));
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "ember serve not up after 60 s:\n{}",
                s.log_tail(100)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    fn token(&self) -> String {
        std::fs::read_to_string(self.home.join("token"))
            .expect("the server's token")
            .trim()
            .to_string()
    }

    fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(self.home.join("serve.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The script kills its sandbox; this catches what a failed run left.
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

fn hash16(file: &Path) -> String {
    use sha2::Digest;
    let data = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let h = sha2::Sha256::digest(&data);
    h.iter().map(|b| format!("{b:02x}")).collect::<String>()[..16].to_string()
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
    let srv = Server::start(home.path());
    let t0 = Instant::now();
    let mut child = Command::new(&python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("ui/test_ui.py"))
        .env("UI_URL", &srv.url)
        .env("EMBER_TOKEN", srv.token())
        .env("HOST_CHROMIUM", &chromium)
        .env("UI_SHOTS", &shots)
        .env("UI_TEMPLATE", "python-data")
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
