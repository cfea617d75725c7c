//! CPU state a guest process must keep: its vector registers across task switches.
//!
//! On kvm_pvm, guest user mode runs with the host's AVX/AVX-512 state enabled while the guest
//! kernel (booted with `noxsave`) switches only the FXSAVE part between tasks; a switch taken
//! on the way out of a page fault used to hand a process another process's upper ymm halves
//! and zmm registers (guest-kernel patch 0009 fixes it). The check runs on every host: on
//! hardware KVM it guards the same property for the host CPU profile.

use std::process::Command;

use ember_tests::boot_json;

/// Builds `tests/guest/vector_state.c` as a static binary and returns it padded to whole
/// 512-byte sectors (it is attached as a raw disk) with its real length.
fn build_vector_state(dir: &std::path::Path) -> (std::path::PathBuf, u64) {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("guest/vector_state.c");
    let bin = dir.join("vector_state");
    let out = Command::new("gcc")
        .args(["-O2", "-static", "-Wall", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("cannot run gcc (install build-essential): {e}"));
    assert!(
        out.status.success(),
        "gcc failed on {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let len = std::fs::metadata(&bin).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&bin).unwrap();
    f.set_len(len.div_ceil(512) * 512).unwrap();
    (bin, len)
}

#[test]
fn vector_registers_survive_task_switches_at_page_faults() {
    let dir = tempfile::tempdir().unwrap();
    let (image, len) = build_vector_state(dir.path());
    const PROCS: u32 = 3;
    // Three processes on one vCPU, each faulting in fresh pages with registers loaded: the
    // scheduler switches between them on the way out of those faults.
    let script = format!(
        "head -c {len} /dev/vdb > /tmp/vs && chmod +x /tmp/vs && \
         for i in $(seq {PROCS}); do (/tmp/vs 12 $i; echo VS-EXIT-$i $?) & done; wait"
    );
    let disk = format!("path={},mode=ro", image.display());
    let (j, console, out) = boot_json(&["--disk", &disk, "--run", &script]);
    assert!(
        out.status.success(),
        "exit {:?}\n{console}\n{j}",
        out.status
    );
    for i in 1..=PROCS {
        assert!(
            console.contains(&format!("VS-EXIT-{i} 0")),
            "process {i} saw its vector registers or a memcpy change:\n{console}"
        );
        // Every process really ran its checks (the memcpy one at least once).
        let copies = console
            .lines()
            .find_map(|l| l.strip_prefix(&format!("vector_state {i}: memcpy copies ")))
            .and_then(|r| r.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no memcpy line from process {i}:\n{console}"));
        assert!(copies > 0, "{console}");
    }
    // On this host family the wide registers are what is at stake: say whether they were
    // exercised (they are whenever the host CPU has AVX).
    let ymm = console.contains("ymm1 checks");
    eprintln!(
        "vector_state: ymm {}, zmm {}",
        if ymm { "checked" } else { "not usable" },
        if console.contains("zmm16 checks") {
            "checked"
        } else {
            "not usable"
        }
    );
    if std::arch::is_x86_feature_detected!("avx") && ember_tests::on_pvm() && !ymm {
        // Where this was first measured, kvm_pvm ran guest user mode with the host's AVX
        // visible (CPUID, XGETBV) whatever the VMM set. Some kvm_pvm hosts do not (seen
        // 2026-12-01: the guest's own CPUID shows no OSXSAVE/AVX in user mode): there glibc
        // cannot pick AVX code either, so the exposure this test guards against cannot occur,
        // and what can be checked (xmm0-7, glibc's memcpy) was.
        eprintln!(
            "vector_state: this kvm_pvm host hides AVX from guest user mode; only xmm0-7 and \
             memcpy were checked"
        );
    }
}
