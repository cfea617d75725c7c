//! Bad input to `ember vm boot` gets a clear error and a non-zero exit, before any guest runs.

use std::process::Command;

use ember_tests::{bin, ember, kernel, rootfs};

fn stderr_of(args: &[&str]) -> (Option<i32>, String) {
    let out = ember(args);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn boot_args<'a>(k: &'a str, r: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "vm",
        "boot",
        "--kernel",
        k,
        "--rootfs",
        r,
        "--timeout",
        "120",
    ];
    v.extend_from_slice(extra);
    v
}

#[test]
fn not_a_kernel() {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("vmlinux");
    std::fs::write(&fake, b"this is not a kernel").unwrap();
    let r = rootfs();
    let (code, err) = stderr_of(&boot_args(fake.to_str().unwrap(), r.to_str().unwrap(), &[]));
    assert_ne!(code, Some(0));
    assert!(err.contains("is not a Linux kernel"), "{err}");
}

#[test]
fn missing_rootfs() {
    let k = kernel();
    let (code, err) = stderr_of(&boot_args(
        k.to_str().unwrap(),
        "/nonexistent/root.ext4",
        &[],
    ));
    assert_ne!(code, Some(0));
    assert!(err.contains("/nonexistent/root.ext4"), "{err}");
    assert!(err.contains("does not exist"), "{err}");
}

#[test]
fn memory_too_small_or_too_large() {
    let (k, r) = (kernel(), rootfs());
    let (k, r) = (k.to_str().unwrap(), r.to_str().unwrap());
    let (code, err) = stderr_of(&boot_args(k, r, &["--mem-mib", "4"]));
    assert_ne!(code, Some(0));
    assert!(err.contains("too small"), "{err}");
    let (code, err) = stderr_of(&boot_args(k, r, &["--mem-mib", "100000000"]));
    assert_ne!(code, Some(0));
    assert!(err.contains("exceeds this host"), "{err}");
}

#[test]
fn vcpu_count_out_of_range() {
    let (k, r) = (kernel(), rootfs());
    let (k, r) = (k.to_str().unwrap(), r.to_str().unwrap());
    for n in ["0", "200"] {
        let (code, err) = stderr_of(&boot_args(k, r, &["--vcpus", n]));
        assert_ne!(code, Some(0));
        assert!(err.contains("vCPUs requested"), "{n}: {err}");
    }
}

#[test]
fn no_dev_kvm() {
    // A private mount namespace whose /dev is an empty tmpfs: /dev/kvm does not exist there.
    let (k, r) = (kernel(), rootfs());
    let vmm = bin("ember-vmm");
    let script = format!(
        "mount -t tmpfs none /dev && exec {} --kernel {} --disk path={},mode=ro --serial none",
        vmm.display(),
        k.display(),
        r.display()
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .output()
        .expect("unshare (util-linux) runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("cannot open /dev/kvm"), "{err}");
    assert!(err.contains("no /dev/kvm"), "{err}");
}
