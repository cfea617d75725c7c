//! `ember bench all --quick` end to end: every scenario writes well-formed JSON lines with
//! samples, every plot is a PNG with something drawn on it, the HTML report loads in headless
//! Chromium without errors and with every plot decoded, a missing peer is a skip line, and
//! `ember bench compare` of a record with itself flags nothing; and Ctrl-C in the middle of a
//! run exits 130 with what was measured written out.
//!
//! One `--quick` run serves all the checks (a few minutes on kvm_pvm). Chromium (Debian
//! `chromium`) is required under `CI=true`; elsewhere its absence is reported and that check
//! alone is left out.

use std::path::{Path, PathBuf};
use std::process::Command;

use ember_tests::bin;
use serde_json::Value;

const SCENARIOS: &[&str] = &[
    "boot", "restore", "sandbox", "ready", "rtt", "files", "parallel", "density", "pause",
];

/// Decodes a PNG; true when it has more than a background: at least two colours and at
/// least 0.5% of its pixels differ from the most common one.
fn png_has_content(path: &Path) -> bool {
    let f = std::fs::File::open(path).expect("open png");
    let mut dec = png::Decoder::new(f);
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = dec.read_info().expect("png header");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("png frame");
    let px = info.color_type.samples();
    let data = &buf[..info.buffer_size()];
    let mut counts = std::collections::HashMap::new();
    for p in data.chunks(px) {
        *counts.entry(p.to_vec()).or_insert(0usize) += 1;
    }
    let total = data.len() / px;
    let most = counts.values().copied().max().unwrap_or(0);
    assert!(total > 10_000, "{}: only {total} pixels", path.display());
    counts.len() >= 2 && (total - most) * 200 >= total
}

/// Chromium's binary, if installed.
fn chromium() -> Option<PathBuf> {
    [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
}

/// Loads `html` in headless Chromium; returns (dumped DOM, stderr).
fn chromium_load(chrome: &Path, html: &Path) -> (String, String) {
    let profile = tempfile::tempdir().expect("profile dir");
    let out = Command::new(chrome)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("--dump-dom")
        .arg(format!("file://{}", html.display()))
        .output()
        .expect("run chromium");
    let dom = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "chromium failed ({}): {err}",
        out.status
    );
    (dom, err)
}

#[test]
fn bench_all_quick_writes_samples_plots_and_a_report() {
    let started = std::time::Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let out_dir = dir.path().join("run");
    let out = Command::new(bin("ember"))
        .args(["bench", "all", "--quick", "--out"])
        .arg(&out_dir)
        .env("EMBER_VMM", bin("ember-vmm"))
        .output()
        .expect("run ember bench all");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "ember bench all --quick failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    eprintln!(
        "ember bench all --quick took {:.0} s\n{stdout}",
        started.elapsed().as_secs_f64()
    );

    // JSON lines: every line an object with a type; the environment first; samples of every
    // scenario, finite.
    let text = std::fs::read_to_string(out_dir.join("samples.jsonl")).expect("samples.jsonl");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect();
    assert_eq!(lines[0]["type"], "env", "{}", lines[0]);
    for key in [
        "host_kernel",
        "kvm",
        "cpu_model",
        "cpu_profile",
        "git_revision",
    ] {
        assert!(
            lines[0][key].as_str().is_some_and(|s| !s.is_empty()),
            "env without {key}: {}",
            lines[0]
        );
    }
    for sc in SCENARIOS {
        let samples: Vec<&Value> = lines
            .iter()
            .filter(|l| l["type"] == "sample" && l["scenario"] == *sc)
            .collect();
        assert!(!samples.is_empty(), "no samples of {sc}:\n{text}");
        for s in samples {
            assert!(s["value"].as_f64().is_some_and(f64::is_finite), "{s}");
            for k in ["system", "measure", "unit"] {
                assert!(s[k].as_str().is_some_and(|v| !v.is_empty()), "{s}");
            }
        }
    }
    // No Firecracker given: a skip line in the record and in the table, not a failure.
    assert!(
        lines.iter().any(|l| l["type"] == "skip"
            && l["scenario"] == "boot"
            && l["system"] == "firecracker"),
        "{text}"
    );
    assert!(stdout.contains("firecracker skipped"), "{stdout}");
    // QEMU either measured or said why not.
    assert!(
        lines
            .iter()
            .any(|l| l["scenario"] == "boot" && l["system"] == "qemu"),
        "neither a QEMU sample nor a QEMU skip line:\n{text}"
    );

    // Plots: an SVG and a non-blank PNG per chart.
    let plots: Vec<PathBuf> = std::fs::read_dir(out_dir.join("plots"))
        .expect("plots dir")
        .map(|e| e.expect("entry").path())
        .collect();
    let pngs: Vec<&PathBuf> = plots
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "png"))
        .collect();
    assert!(pngs.len() >= SCENARIOS.len(), "{plots:?}");
    for p in &pngs {
        assert!(png_has_content(p), "{} is blank", p.display());
        assert!(p.with_extension("svg").is_file(), "{}", p.display());
    }

    // `compare` of a record with itself: no difference flagged.
    let cmp = Command::new(bin("ember"))
        .args(["bench", "compare"])
        .arg(out_dir.join("samples.jsonl"))
        .arg(out_dir.join("samples.jsonl"))
        .output()
        .expect("run ember bench compare");
    let cmp_out = String::from_utf8_lossy(&cmp.stdout);
    assert!(cmp.status.success(), "{cmp_out}");
    assert!(cmp_out.contains("\n0 of "), "{cmp_out}");
    assert!(!cmp_out.contains("CHANGED"), "{cmp_out}");

    // The HTML report in headless Chromium.
    let html = out_dir.join("report.html");
    let Some(chrome) = chromium() else {
        let msg = "chromium is not installed (Debian: apt-get install chromium): the HTML \
                   report was not loaded in a browser";
        ember_tests::skip(
            "bench_all_quick_writes_samples_plots_and_a_report (in part: the HTML report in \
             Chromium)",
            msg,
        );
        return;
    };
    let (dom, err) = chromium_load(&chrome, &html);
    for sc in SCENARIOS {
        assert!(
            dom.contains(&format!("<h2 id=\"{sc}\">")),
            "no {sc} section"
        );
    }
    assert!(
        dom.contains("data-images=\"ok "),
        "plots did not all decode: {err}"
    );
    let console_errors: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("CONSOLE") || l.contains("Uncaught"))
        .collect();
    assert!(
        console_errors.is_empty(),
        "console errors: {console_errors:?}"
    );
    eprintln!("total {:.0} s", started.elapsed().as_secs_f64());
}

#[test]
fn ctrl_c_stops_cleanly_and_keeps_what_was_measured() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_dir = dir.path().join("run");
    let mut child = Command::new(bin("ember"))
        .args(["bench", "all", "--quick", "--only", "rtt", "--out"])
        .arg(&out_dir)
        .env("EMBER_VMM", bin("ember-vmm"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run ember bench all");
    // Wait for the first sample, then Ctrl-C (SIGINT to ember alone: it must stop its own
    // sandboxes).
    let samples = out_dir.join("samples.jsonl");
    let t0 = std::time::Instant::now();
    loop {
        let text = std::fs::read_to_string(&samples).unwrap_or_default();
        if text.contains("\"type\":\"sample\"") {
            break;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("ember bench all exited ({st}) before its first sample");
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(300),
            "no sample within 300 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // SAFETY: kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(rc, 0);
    let out = child.wait_with_output().expect("wait for ember");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    let text = std::fs::read_to_string(&samples).expect("samples.jsonl");
    assert!(text.contains("\"type\":\"sample\""), "{text}");
    assert!(text.contains("interrupted (Ctrl-C)"), "{text}");
    let html = std::fs::read_to_string(out_dir.join("report.html")).expect("report.html");
    assert!(
        html.contains("<h2 id=\"rtt\">"),
        "the report lacks what was measured"
    );
    assert!(html.trim_end().ends_with("</html>"));
}
