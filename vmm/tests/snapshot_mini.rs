//! Snapshot and restore with a hand-assembled guest on real KVM, through the real `ember-vmm`
//! binary and its control socket: the guest keeps a counter in memory and writes it to the
//! boot-marker port; after restore in a new process the counter must continue.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ember_vmm::api::{call, AfterSnapshot, Request, SnapshotKind};

mod common;
use common::elf_with_code;

/// loop: inc qword [0x300000]; mov rax, [0x300000]; out 0x0ef0, al; delay; jmp loop
const COUNTER: &[u8] = &[
    0x48, 0xff, 0x04, 0x25, 0x00, 0x00, 0x30, 0x00, // inc qword [0x300000]
    0x48, 0x8b, 0x04, 0x25, 0x00, 0x00, 0x30, 0x00, // mov rax, [0x300000]
    0x66, 0xba, 0xf0, 0x0e, // mov dx, 0x0ef0
    0xee, // out dx, al
    0xb9, 0xa0, 0x86, 0x01, 0x00, // mov ecx, 100000
    0xff, 0xc9, // dec ecx
    0x75, 0xfc, // jnz dec
    0xeb, 0xe0, // jmp loop
];

fn vmm() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ember-vmm"))
}

fn markers(report: &Path) -> Vec<u64> {
    std::fs::read_to_string(report)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "boot_marker")
        .filter_map(|e| e["value"].as_u64())
        .collect()
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Killer(Child);
impl Drop for Killer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&std::ffi::OsStr]) -> Killer {
    Killer(
        Command::new(vmm())
            .args(args)
            .arg("--serial")
            .arg("none")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

/// Boots the counter guest in `dir` (64 MiB, control socket, report file) and waits for
/// `ticks` counter values; returns the VMM, its socket and its report.
fn boot_counter(dir: &Path, extra: &[&str], ticks: usize) -> (Killer, PathBuf, PathBuf) {
    let kernel = dir.join("counter.elf");
    std::fs::write(&kernel, elf_with_code(COUNTER)).unwrap();
    let sock = dir.join("api.sock");
    let report = dir.join("r1.jsonl");
    let mut args: Vec<&std::ffi::OsStr> = vec![
        "--kernel".as_ref(),
        kernel.as_os_str(),
        "--mem-mib".as_ref(),
        "64".as_ref(),
        "--api-sock".as_ref(),
        sock.as_os_str(),
        "--report".as_ref(),
        report.as_os_str(),
    ];
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    let vm = spawn(&args);
    wait_for("counter ticks", Duration::from_secs(60), || {
        markers(&report).len() >= ticks
    });
    (vm, sock, report)
}

#[test]
fn counter_continues_after_restore_in_a_new_process() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap");
    let (mut first, sock, r1) = boot_counter(dir.path(), &[], 3);

    // Pause, check the counter stands still, snapshot, and let the VMM exit.
    assert_eq!(call(&sock, &Request::Pause).unwrap()["ok"], true);
    let frozen = markers(&r1).len();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(markers(&r1).len(), frozen, "a paused guest must not run");
    let reply = call(
        &sock,
        &Request::Snapshot {
            dir: snap.clone(),
            kind: SnapshotKind::Full,
            after: AfterSnapshot::Exit,
        },
    )
    .unwrap();
    assert_eq!(reply["ok"], true, "{reply}");
    let status = first.0.wait().unwrap();
    assert!(status.success(), "VMM exits 0 after the snapshot: {status}");
    let before = markers(&r1);
    let last = *before.last().unwrap();
    assert!(snap.join("state").is_file() && snap.join("memory").is_file());

    // Restore in a new process: the counter continues from where it was.
    let r2 = dir.path().join("r2.jsonl");
    let _second = spawn(&[
        "--restore".as_ref(),
        snap.as_os_str(),
        "--report".as_ref(),
        r2.as_os_str(),
    ]);
    wait_for("ticks after restore", Duration::from_secs(60), || {
        markers(&r2).len() >= 2
    });
    let after = markers(&r2);
    assert_eq!(
        after[0],
        (last + 1) % 256,
        "before {before:?}, after {after:?}"
    );
    assert_eq!(after[1], (last + 2) % 256);
    // The snapshot's memory file is never written by the restored VM.
    let reread = std::fs::read(snap.join("memory")).unwrap();
    let counter = u64::from_le_bytes(reread[0x300000..0x300008].try_into().unwrap());
    assert_eq!(
        counter % 256,
        last,
        "memory file holds the snapshot-time counter"
    );
}

#[test]
fn two_clones_of_one_snapshot_run_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap");
    let (mut first, sock, _) = boot_counter(dir.path(), &[], 1);
    let reply = call(
        &sock,
        &Request::Snapshot {
            dir: snap.clone(),
            kind: SnapshotKind::Full,
            after: AfterSnapshot::Exit,
        },
    )
    .unwrap();
    assert_eq!(reply["ok"], true, "{reply}");
    assert!(first.0.wait().unwrap().success());
    let reports: Vec<PathBuf> = (0..2)
        .map(|i| dir.path().join(format!("c{i}.jsonl")))
        .collect();
    let _clones: Vec<Killer> = reports
        .iter()
        .map(|r| {
            spawn(&[
                "--restore".as_ref(),
                snap.as_os_str(),
                "--report".as_ref(),
                r.as_os_str(),
            ])
        })
        .collect();
    for r in &reports {
        wait_for("clone ticks", Duration::from_secs(60), || {
            markers(r).len() >= 2
        });
    }
    let a = markers(&reports[0]);
    let b = markers(&reports[1]);
    assert_eq!(a[0], b[0], "both clones continue from the same point");
}

#[test]
fn bad_snapshots_are_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap");
    let (mut first, sock, _) = boot_counter(dir.path(), &[], 1);
    let reply = call(
        &sock,
        &Request::Snapshot {
            dir: snap.clone(),
            kind: SnapshotKind::Full,
            after: AfterSnapshot::Exit,
        },
    )
    .unwrap();
    assert_eq!(reply["ok"], true, "{reply}");
    assert!(first.0.wait().unwrap().success());
    let state = std::fs::read(snap.join("state")).unwrap();

    let restore_err = |d: &Path| -> String {
        let out = Command::new(vmm())
            .arg("--restore")
            .arg(d)
            .args(["--serial", "none"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "must fail cleanly");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let variant = |name: &str, state_bytes: &[u8], memory_len: Option<u64>| -> PathBuf {
        let d = dir.path().join(name);
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("state"), state_bytes).unwrap();
        let m = std::fs::File::create(d.join("memory")).unwrap();
        m.set_len(memory_len.unwrap_or(64 << 20)).unwrap();
        d
    };
    // Truncated.
    let e = restore_err(&variant("trunc", &state[..state.len() / 2], None));
    assert!(e.contains("truncated"), "{e}");
    // A flipped byte in the body.
    let mut flipped = state.clone();
    flipped[state.len() / 2] ^= 0x10;
    let e = restore_err(&variant("flip", &flipped, None));
    assert!(e.contains("checksum"), "{e}");
    // Wrong magic.
    let mut magic = state.clone();
    magic[..8].copy_from_slice(b"NOTEMBER");
    let e = restore_err(&variant("magic", &magic, None));
    assert!(e.to_lowercase().contains("magic"), "{e}");
    // Newer format version.
    let mut newer = state.clone();
    newer[8..12].copy_from_slice(&99u32.to_le_bytes());
    let e = restore_err(&variant("newer", &newer, None));
    assert!(e.contains("version"), "{e}");
    // Memory file of the wrong size.
    let e = restore_err(&variant("memsize", &state, Some(1 << 20)));
    assert!(e.contains("memory"), "{e}");
    // A different CPU profile than the one the snapshot was taken with.
    let other = if ember_vmm::HostKvm::detect() == ember_vmm::HostKvm::Pvm {
        "host"
    } else {
        "baseline"
    };
    let out = Command::new(vmm())
        .arg("--restore")
        .arg(&snap)
        .args(["--serial", "none", "--cpu-profile", other])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{e}");
    assert!(e.contains("CPU profile"), "{e}");
    // Not a directory at all.
    let e = restore_err(&dir.path().join("nope"));
    assert!(e.contains("not a directory"), "{e}");
}

#[test]
fn diff_snapshot_holds_only_new_writes_and_merges_onto_its_parent() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let (full, diff, merged) = (
        dir.path().join("full"),
        dir.path().join("diff"),
        dir.path().join("merged"),
    );
    let (mut vm, sock, r1) = boot_counter(dir.path(), &["--track-dirty-pages"], 1);
    // A diff before any full snapshot has nothing to be relative to.
    let reply = call(
        &sock,
        &Request::Snapshot {
            dir: diff.clone(),
            kind: SnapshotKind::Diff,
            after: AfterSnapshot::Continue,
        },
    )
    .unwrap();
    assert_eq!(reply["ok"], false);
    assert!(
        reply["error"]
            .as_str()
            .unwrap()
            .contains("full snapshot first"),
        "{reply}"
    );
    let reply = call(
        &sock,
        &Request::Snapshot {
            dir: full.clone(),
            kind: SnapshotKind::Full,
            after: AfterSnapshot::Continue,
        },
    )
    .unwrap();
    assert_eq!(reply["ok"], true, "{reply}");
    let n = markers(&r1).len();
    wait_for(
        "ticks after the full snapshot",
        Duration::from_secs(60),
        || markers(&r1).len() >= n + 2,
    );
    let reply = call(
        &sock,
        &Request::Snapshot {
            dir: diff.clone(),
            kind: SnapshotKind::Diff,
            after: AfterSnapshot::Exit,
        },
    )
    .unwrap();
    assert_eq!(reply["ok"], true, "{reply}");
    assert!(vm.0.wait().unwrap().success());
    let last = *markers(&r1).last().unwrap();

    // The diff holds a handful of pages (the counter, the stack), not the guest's memory.
    let written = reply["info"]["memory_bytes_written"].as_u64().unwrap();
    assert!(
        written > 0 && written <= 64 * 4096,
        "diff wrote {written} bytes"
    );
    let blocks = std::fs::metadata(diff.join("memory")).unwrap().blocks() * 512;
    assert!(
        blocks <= 1 << 20,
        "diff memory file allocates {blocks} bytes"
    );

    // A diff cannot be restored on its own...
    let out = Command::new(vmm())
        .arg("--restore")
        .arg(&diff)
        .args(["--serial", "none"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{e}");
    assert!(e.contains("diff snapshot") && e.contains("merge"), "{e}");
    // ...but merged onto its parent it restores where the diff was taken.
    let out = Command::new(vmm())
        .arg("--merge-snapshot")
        .arg(&diff)
        .arg(&merged)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r2 = dir.path().join("r2.jsonl");
    let _clone = spawn(&[
        "--restore".as_ref(),
        merged.as_os_str(),
        "--report".as_ref(),
        r2.as_os_str(),
    ]);
    wait_for(
        "ticks after restoring the merge",
        Duration::from_secs(60),
        || !markers(&r2).is_empty(),
    );
    assert_eq!(markers(&r2)[0], (last + 1) % 256);
    // Parent and diff are untouched by the merge.
    let full_counter = std::fs::read(full.join("memory")).unwrap()[0x300000];
    assert_ne!(
        u64::from(full_counter),
        last,
        "the parent kept its own (older) counter"
    );
}
