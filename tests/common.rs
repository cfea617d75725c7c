//! Shared helpers for the end-to-end tests: where the binaries and guest images are.
//!
//! The binaries come from the same target directory as the test (run `cargo build --workspace
//! --bins` first; `.ci/run` does). The guest kernel and rootfs come from `$EMBER_TEST_KERNEL`
//! / `$EMBER_TEST_ROOTFS`, or else from the repo's build scripts (cached). A missing image is
//! a test failure, never a skip.

use std::path::PathBuf;
use std::process::{Command, Output};

/// A binary built from this workspace (`ember`, `ember-vmm`, ...).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let p = exe.ancestors().nth(2).expect("target dir").join(name);
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build --workspace --bins` before the tests",
        p.display()
    );
    p
}

/// The guest kernel under test.
pub fn kernel() -> PathBuf {
    std::env::var_os("EMBER_TEST_KERNEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| ember_sandbox::images::default_kernel().expect("default kernel"))
}

/// The guest root filesystem under test.
pub fn rootfs() -> PathBuf {
    std::env::var_os("EMBER_TEST_ROOTFS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            ember_sandbox::images::default_rootfs("default").expect("default rootfs")
        })
}

/// Runs `ember` with `args` (plus `EMBER_VMM` pointing at this build's VMM).
pub fn ember(args: &[&str]) -> Output {
    Command::new(bin("ember"))
        .args(args)
        .env("EMBER_VMM", bin("ember-vmm"))
        .output()
        .expect("run ember")
}

/// `ember vm boot --json` with the test images and extra `args`; returns the parsed JSON
/// result and the console (stderr).
pub fn boot_json(args: &[&str]) -> (serde_json::Value, String, Output) {
    let k = kernel();
    let r = rootfs();
    let mut all = vec![
        "vm",
        "boot",
        "--json",
        "--timeout",
        "300",
        "--kernel",
        k.to_str().expect("utf-8 path"),
        "--rootfs",
        r.to_str().expect("utf-8 path"),
    ];
    all.extend_from_slice(args);
    let out = ember(&all);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!("ember vm boot --json printed no JSON ({e}): stdout {stdout:?}\nstderr:\n{stderr}")
    });
    (json, stderr, out)
}

/// True when /dev/kvm is kvm_pvm.
pub fn on_pvm() -> bool {
    ember_vmm::HostKvm::detect() == ember_vmm::HostKvm::Pvm
}

/// A running `ember-vmm` child that is killed when dropped.
#[derive(Debug)]
pub struct RunningVmm {
    /// The process.
    pub child: std::process::Child,
    /// Its report file.
    pub report: PathBuf,
}

impl Drop for RunningVmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl RunningVmm {
    /// Starts `ember-vmm` with `args` plus a report file in `dir` (named `name.jsonl`); the
    /// console goes to `dir/name.console`.
    pub fn start(dir: &std::path::Path, name: &str, args: &[std::ffi::OsString]) -> Self {
        let report = dir.join(format!("{name}.jsonl"));
        let console = dir.join(format!("{name}.console"));
        let child = Command::new(bin("ember-vmm"))
            .args(args)
            .arg("--report")
            .arg(&report)
            .arg("--serial")
            .arg(format!("file:{}", console.display()))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("spawn ember-vmm");
        Self { child, report }
    }

    /// Report events so far.
    pub fn events(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.report)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Waits until the guest writes boot marker `value` (or the VMM exits, or time runs out).
    pub fn wait_marker(&mut self, value: u64, timeout: std::time::Duration) {
        let t = std::time::Instant::now();
        loop {
            if self
                .events()
                .iter()
                .any(|e| e["event"] == "boot_marker" && e["value"] == value)
            {
                return;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!(
                    "VMM exited ({st}) before marker {value}: {:?}",
                    self.events()
                );
            }
            assert!(t.elapsed() < timeout, "no marker {value} after {timeout:?}");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// `--cmdline-append` value running the agent (and nothing else).
pub const AGENT_CMDLINE: &str = "ember.agent";
