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
    let p = exe
        .ancestors()
        .nth(2)
        .expect("target dir")
        .join(name);
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
        .unwrap_or_else(|| ember_sandbox::images::default_rootfs("default").expect("default rootfs"))
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
