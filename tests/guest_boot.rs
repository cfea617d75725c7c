//! Real Linux guests on real KVM. A boot costs seconds on kvm_pvm, so each test checks
//! several things about one boot.

use ember_tests::{boot_json, on_pvm};

#[test]
fn default_guest_boots_runs_its_command_and_keeps_the_root_read_only() {
    let script = "echo EMBER-CONSOLE-OK; \
        grep MemTotal /proc/meminfo; \
        if touch /ember-rw-probe 2>/dev/null; then echo ROOT-WRITABLE; else echo ROOT-READONLY; fi; \
        if mount -o remount,rw / 2>/dev/null; then echo REMOUNT-RW-OK; else echo REMOUNT-RW-FAILED; fi; \
        if dd if=/dev/zero of=/dev/vda bs=512 count=1 conv=fsync 2>/dev/null; then echo RAW-WRITE-OK; else echo RAW-WRITE-FAILED; fi";
    let (j, console, out) = boot_json(&["--run", script]);
    assert!(
        out.status.success(),
        "exit {:?}\n{console}\n{j}",
        out.status
    );
    // The boot marker was seen and timed.
    let marker = j["boot_marker_ms"]
        .as_f64()
        .unwrap_or_else(|| panic!("no marker: {j}"));
    assert!(marker > 0.0);
    // Our init ran, printed to the serial console, ran the command, rebooted → exit 0.
    assert!(console.contains("ember-init: ready"), "{console}");
    assert!(console.contains("EMBER-CONSOLE-OK"), "{console}");
    assert!(
        console.contains("ember-init: command exited with status 0"),
        "{console}"
    );
    assert_eq!(j["exit_code"], 0);
    assert_eq!(j["exit_reason"]["kind"], "guest_reset", "{j}");
    // Read-only root: no file writes, no remount, no raw writes to the device.
    assert!(console.contains("ROOT-READONLY"), "{console}");
    assert!(console.contains("REMOUNT-RW-FAILED"), "{console}");
    assert!(console.contains("RAW-WRITE-FAILED"), "{console}");
    // Kernel command line carries the profile's masks on kvm_pvm.
    let cmdline = j["cmdline"].as_str().unwrap_or_default();
    if on_pvm() {
        assert_eq!(j["cpu_profile"], "pvm");
        assert!(
            cmdline.contains("clearcpuid=141,151,308,297,580"),
            "{cmdline}"
        );
        assert!(cmdline.contains("noxsave"), "{cmdline}");
        // Guest-kernel patch 0009 on: task switches at user page faults go through an IPI.
        assert!(cmdline.contains("ember_fault_resched_ipi"), "{cmdline}");
    }
    assert!(
        cmdline.contains("virtio_mmio.device=4K@0xd0000000:5"),
        "{cmdline}"
    );
}

fn meminfo_kib(console: &str) -> u64 {
    console
        .lines()
        .find_map(|l| l.trim().strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no MemTotal line in:\n{console}"))
}

fn cpu_count(console: &str) -> u64 {
    console
        .lines()
        .find_map(|l| l.trim().strip_prefix("CPUS="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no CPUS= line in:\n{console}"))
}

#[test]
fn guest_sees_the_memory_and_vcpus_it_was_given() {
    let script = "grep MemTotal /proc/meminfo; echo CPUS=$(grep -c ^processor /proc/cpuinfo)";
    let (j, console, out) = boot_json(&["--mem-mib", "512", "--vcpus", "2", "--run", script]);
    assert!(
        out.status.success(),
        "exit {:?}\n{console}\n{j}",
        out.status
    );
    let kib = meminfo_kib(&console);
    // MemTotal excludes what the kernel reserves for itself; expect 85-100% of 512 MiB.
    assert!(
        (512 * 1024 * 85 / 100..=512 * 1024).contains(&kib),
        "MemTotal {kib} kB for a 512 MiB guest"
    );
    assert_eq!(cpu_count(&console), 2, "{console}");
}

#[test]
fn host_cpu_profile_on_kvm_pvm_fails_with_a_clear_internal_error() {
    let (j, console, out) = boot_json(&["--cpu-profile", "host", "--run", "echo BOOTED"]);
    if on_pvm() {
        // The host profile exposes XSAVE & co.; kvm_pvm's emulator cannot run `xrstor`, so
        // the guest must stop with a named internal error, not hang.
        assert_eq!(out.status.code(), Some(3), "{console}\n{j}");
        let msg = j["exit_message"].as_str().unwrap_or_default();
        assert!(msg.contains("KVM_EXIT_INTERNAL_ERROR"), "{msg}");
        assert!(msg.contains("'host'"), "{msg}");
        assert!(msg.contains("rip 0x"), "{msg}");
        assert_eq!(j["exit_reason"]["reason"], "internal_error", "{j}");
    } else {
        assert!(
            out.status.success(),
            "host profile must boot on hardware KVM: {console}"
        );
        assert!(console.contains("BOOTED"));
    }
}

#[test]
fn serial_console_input_reaches_the_guest() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let (k, r) = (ember_tests::kernel(), ember_tests::rootfs());
    let script = "read line; echo \"GOT:[$line]\"";
    let b64 = {
        // Same encoding the CLI uses for --run.
        let out = Command::new("base64")
            .arg("-w0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn();
        let mut child = out.expect("base64");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        String::from_utf8(child.wait_with_output().unwrap().stdout).unwrap()
    };
    let mut vmm = Command::new(ember_tests::bin("ember-vmm"))
        .arg("--kernel")
        .arg(&k)
        .arg("--disk")
        .arg(format!("path={},mode=ro", r.display()))
        .arg("--cmdline-append")
        .arg(format!("ember.run={b64}"))
        .args(["--serial-input", "stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Typed before the guest even booted: it must wait in the VMM, not be lost.
    vmm.stdin
        .take()
        .unwrap()
        .write_all(b"hello ember\n")
        .unwrap();
    let out = vmm.wait_with_output().unwrap();
    let console = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{console}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(console.contains("GOT:[hello ember]"), "{console}");
}

#[test]
fn a_jailed_vm_boots_as_an_unprivileged_user_and_leaves_nothing_behind() {
    let base = tempfile::tempdir().unwrap();
    let (j, console, out) = boot_json(&[
        "--jail",
        "--jail-uid",
        "10123",
        "--jail-gid",
        "10123",
        "--jail-base",
        base.path().to_str().unwrap(),
        "--jail-pids-max",
        "64",
        "--run",
        "echo JAILED-GUEST-OK",
    ]);
    assert!(out.status.success(), "{console}\n{j}");
    assert!(console.contains("JAILED-GUEST-OK"), "{console}");
    assert_eq!(j["vmm_uid"], 10123, "the VMM ran as the jail's uid: {j}");
    assert!(j["boot_marker_ms"].as_f64().is_some());
    // Clean-up removed the jail and its cgroup.
    let left: Vec<_> = std::fs::read_dir(base.path()).unwrap().collect();
    assert!(left.is_empty(), "jail dirs left behind: {left:?}");
    let jail_id = console
        .lines()
        .find_map(|l| l.strip_prefix("ember: jailed as "))
        .and_then(|l| l.split_whitespace().next())
        .expect("jail id line")
        .to_string();
    for ctrl in ["pids", "memory", "cpu"] {
        let p = std::path::Path::new("/sys/fs/cgroup")
            .join(ctrl)
            .join("ember")
            .join(&jail_id);
        assert!(!p.exists(), "{} left behind", p.display());
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&jail_id), "a mount of the jail is left");
}
