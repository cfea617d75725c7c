//! Seccomp filters, checked on real processes.
//!
//! - The `ember-vmm` binary with its filters on boots a hand-assembled guest (one and four
//!   vCPUs), serves every control request, writes a snapshot, restores it, records its
//!   working set and prefetches it on the prefetch thread, and rotates its capped console
//!   and log files. Its test hook (`EMBER_VMM_TEST_FORBIDDEN_SYSCALL`) kills it by `SIGSYS`
//!   in `kill` mode, on the main thread, on a vCPU thread, on the prefetch thread and on the
//!   log-writer thread, while `log` and `off` go on.
//! - Probes: this test binary re-runs itself with `EMBER_SECCOMP_PROBE=<kind>:<action>`; the
//!   child installs one filter on a fresh thread, does one thing, and either reports
//!   `PROBE-OK` or dies by `SIGSYS`. That checks each filter loads, that what the VMM needs is
//!   allowed (thread exit included) and that the argument filters refuse what they should.
//! - The numbers in `vmm/seccomp/*.json` match the constants their comments name.
//!
//! Tests that run the VMM skip (with a message) where /dev/kvm is missing; the probes need
//! neither KVM nor root.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ember_vmm::rotating_file::RotatingFile;
use ember_vmm::seccomp::{self, SeccompMode, ThreadKind, TEST_HOOK_ENV};

mod common;
use common::elf_with_code;

const PROBE_ENV: &str = "EMBER_SECCOMP_PROBE";
const PROBE_DIR_ENV: &str = "EMBER_SECCOMP_PROBE_DIR";
const PROBE_OK: &str = "PROBE-OK";

// ---------------------------------------------------------------------------------------
// The VMM binary with a tiny guest.

/// Writes boot-marker byte 7, prints "ok\n" on COM1, then resets through the i8042: port I/O
/// to the boot marker (report file write on the vCPU thread), the serial port (stdout write),
/// and the reset eventfd, then the whole exit path.
const MARKER_SERIAL_RESET: &[u8] = &[
    0x66, 0xba, 0xf0, 0x0e, // mov dx, 0x0ef0
    0xb0, 0x07, // mov al, 7
    0xee, // out dx, al
    0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
    0xb0, b'o', 0xee, // mov al, 'o'; out dx, al
    0xb0, b'k', 0xee, // mov al, 'k'; out dx, al
    0xb0, b'\n', 0xee, // mov al, '\n'; out dx, al
    0xb0, 0xfe, // mov al, 0xfe
    0xe6, 0x64, // out 0x64, al
    0xf4, // hlt
    0xeb, 0xfd, // jmp back to hlt
];

fn kvm_available() -> bool {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipping: /dev/kvm is not usable here ({e})");
            false
        }
    }
}

/// No core files from the processes we expect to die.
fn no_core_dumps(cmd: &mut Command) -> &mut Command {
    let no_core = || {
        let zero = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: setrlimit reads one local struct.
        unsafe { libc::setrlimit(libc::RLIMIT_CORE, &zero) };
        Ok(())
    };
    // SAFETY: the closure runs in the child between fork and exec and only calls setrlimit,
    // which is async-signal-safe.
    unsafe { cmd.pre_exec(no_core) }
}

struct Vmm {
    dir: tempfile::TempDir,
    kernel: PathBuf,
}

impl Vmm {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("mini.elf");
        std::fs::write(&kernel, elf_with_code(MARKER_SERIAL_RESET)).unwrap();
        Self { dir, kernel }
    }

    /// Runs `ember-vmm` on the mini guest. `mode` None: no `--seccomp` flag (the default).
    fn run(&self, mode: Option<&str>, hook: Option<&str>, extra: &[&str]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ember-vmm"));
        cmd.arg("--kernel")
            .arg(&self.kernel)
            .args(["--mem-mib", "64", "--serial", "stdout", "--report"])
            .arg(self.dir.path().join("report.jsonl"))
            .args(extra)
            .env_remove("EMBER_SECCOMP")
            .env_remove(TEST_HOOK_ENV);
        if let Some(m) = mode {
            cmd.args(["--seccomp", m]);
        }
        if let Some(h) = hook {
            cmd.env(TEST_HOOK_ENV, h);
        }
        no_core_dumps(&mut cmd).output().expect("spawn ember-vmm")
    }
}

fn describe(o: &Output) -> String {
    format!(
        "status {:?} (signal {:?})\nstdout: {}\nstderr: {}",
        o.status.code(),
        o.status.signal(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn assert_booted(o: &Output) {
    assert!(o.status.success(), "{}", describe(o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "ok\n",
        "{}",
        describe(o)
    );
}

fn assert_sigsys(o: &Output) {
    assert_eq!(o.status.signal(), Some(libc::SIGSYS), "{}", describe(o));
}

#[test]
fn kill_mode_boots_the_mini_guest() {
    if !kvm_available() {
        return;
    }
    let vmm = Vmm::new();
    assert_booted(&vmm.run(Some("kill"), None, &[]));
}

#[test]
fn kill_mode_boots_the_mini_guest_with_four_vcpus() {
    // The three application processors wait for INIT/SIPI inside KVM_RUN and are kicked
    // out of it at exit: their threads run the pause-free part of the vCPU list.
    if !kvm_available() {
        return;
    }
    let vmm = Vmm::new();
    assert_booted(&vmm.run(Some("kill"), None, &["--vcpus", "4"]));
}

#[test]
fn the_hook_on_the_main_thread_dies_by_sigsys() {
    if !kvm_available() {
        return;
    }
    let vmm = Vmm::new();
    assert_sigsys(&vmm.run(Some("kill"), Some("1"), &[]));
    assert_sigsys(&vmm.run(Some("kill"), Some("main"), &[]));
}

#[test]
fn the_hook_on_a_vcpu_thread_dies_by_sigsys() {
    if !kvm_available() {
        return;
    }
    let vmm = Vmm::new();
    assert_sigsys(&vmm.run(Some("kill"), Some("vcpu"), &[]));
}

/// Console into a file capped at 2 bytes ("ok\n" rotates on the vCPU thread) and an info-level
/// log into a file capped at 40 bytes (each line rotates on the log-writer thread), all under
/// `kill` filters.
#[test]
fn kill_mode_rotates_the_console_and_log_files() {
    if !kvm_available() {
        return;
    }
    let vmm = Vmm::new();
    let d = vmm.dir.path();
    let run = |hook: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ember-vmm"));
        cmd.arg("--kernel")
            .arg(&vmm.kernel)
            .args(["--mem-mib", "64", "--seccomp", "kill", "--serial"])
            .arg(format!("file:{}", d.join("console").display()))
            .args(["--serial-max-bytes", "2", "--log-file"])
            .arg(d.join("vmm.log"))
            .args(["--log-max-bytes", "40"])
            .env("EMBER_LOG", "info")
            .env_remove("EMBER_SECCOMP")
            .env_remove(TEST_HOOK_ENV);
        if let Some(h) = hook {
            cmd.env(TEST_HOOK_ENV, h);
        }
        no_core_dumps(&mut cmd).output().expect("spawn ember-vmm")
    };
    let o = run(None);
    assert!(o.status.success(), "{}", describe(&o));
    let read = |name: &str| std::fs::read(d.join(name)).unwrap();
    assert_eq!(
        (read("console.1"), read("console")),
        (b"ok".to_vec(), b"\n".to_vec())
    );
    // The boot marker's info line went through the log thread, cut at the 40-byte cap.
    let (old, cur) = (read("vmm.log.1"), read("vmm.log"));
    assert!(old.len() <= 40 && cur.len() <= 40, "{old:?} {cur:?}");
    let tail = String::from_utf8_lossy(&[old, cur].concat()).into_owned();
    assert!(tail.ends_with(" ms\n"), "{tail:?}");
    // The log thread really is filtered.
    assert_sigsys(&run(Some("log")));
}

#[test]
fn filters_are_on_by_default() {
    if !kvm_available() {
        return;
    }
    let vmm = Vmm::new();
    assert_sigsys(&vmm.run(None, Some("1"), &[]));
}

#[test]
fn log_and_off_modes_survive_the_hook() {
    if !kvm_available() {
        return;
    }
    let vmm = Vmm::new();
    for mode in ["log", "off"] {
        for hook in ["main", "vcpu"] {
            let o = vmm.run(Some(mode), Some(hook), &[]);
            assert_booted(&o);
        }
    }
}

#[test]
fn a_bad_mode_is_a_usage_error() {
    let vmm = Vmm::new();
    let o = vmm.run(Some("trap"), None, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", describe(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("kill, log or off"),
        "{}",
        describe(&o)
    );
}

/// loop: inc qword [0x300000]; mov rax, [0x300000]; out 0x0ef0, al; delay; jmp loop
/// (a boot marker per tick, forever: a guest to pause, snapshot and restore).
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

/// A VMM child killed when dropped.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Running {
    fn start(args: &[&std::ffi::OsStr], hook: Option<&str>) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ember-vmm"));
        cmd.args(["--seccomp", "kill", "--serial", "none"])
            .args(args)
            .env_remove("EMBER_SECCOMP")
            .env_remove(TEST_HOOK_ENV)
            .stdout(std::process::Stdio::null());
        if let Some(h) = hook {
            cmd.env(TEST_HOOK_ENV, h);
        }
        Running(no_core_dumps(&mut cmd).spawn().expect("spawn ember-vmm"))
    }

    /// Waits up to 60 s for the process to end.
    fn wait(&mut self) -> std::process::ExitStatus {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                return s;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "ember-vmm did not exit"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

fn report_events(report: &Path, kind: &str) -> usize {
    std::fs::read_to_string(report)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == kind)
        .count()
}

fn wait_for_events(vmm: &mut Running, report: &Path, kind: &str, n: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while report_events(report, kind) < n {
        if let Some(s) = vmm.0.try_wait().unwrap() {
            panic!(
                "ember-vmm ended ({s:?}, signal {:?}) before {n} {kind} events",
                s.signal()
            );
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {n} {kind} events in {}",
            report.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// One control request, given in its wire format.
fn request(sock: &Path, req: serde_json::Value) -> serde_json::Value {
    let req: ember_vmm::api::Request = serde_json::from_value(req.clone())
        .unwrap_or_else(|e| panic!("{req} is not a control request: {e}"));
    let reply = ember_vmm::api::call(sock, &req).unwrap_or_else(|e| panic!("{req:?}: {e}"));
    assert_eq!(reply["ok"], true, "{req:?}: {reply}");
    reply
}

/// A VMM waiting for its restore (`--wait-restore`) runs under the `restore` filter from the
/// moment its socket is bound: the hook kills it there; without the hook it answers `ping`,
/// restores a snapshot under that filter (every thread then also under its own) and runs it.
#[test]
fn a_waiting_vmm_restores_under_the_restore_filter() {
    if !kvm_available() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no usable /dev/kvm on this CI host"
        );
        eprintln!("skipped: no usable /dev/kvm");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name);
    std::fs::write(p("counter.elf"), elf_with_code(COUNTER)).unwrap();
    let snap = p("snap");
    let mut vmm = Running::start(
        &[
            "--kernel".as_ref(),
            p("counter.elf").as_os_str(),
            "--mem-mib".as_ref(),
            "64".as_ref(),
            "--api-sock".as_ref(),
            p("a.sock").as_os_str(),
            "--report".as_ref(),
            p("r1.jsonl").as_os_str(),
        ],
        None,
    );
    wait_for_events(&mut vmm, &p("r1.jsonl"), "boot_marker", 2);
    request(
        &p("a.sock"),
        serde_json::json!({"op": "snapshot", "dir": snap, "kind": "full", "after": "exit"}),
    );
    assert!(vmm.wait().success());

    // The hook fires right after the restore filter is installed.
    let wait_args = |sock: &str, report: &str| -> Vec<std::ffi::OsString> {
        vec![
            "--wait-restore".into(),
            "--api-sock".into(),
            p(sock).into_os_string(),
            "--report".into(),
            p(report).into_os_string(),
        ]
    };
    let args = wait_args("h.sock", "h.jsonl");
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let mut hooked = Running::start(&args, Some("restore"));
    let s = hooked.wait();
    assert_eq!(s.signal(), Some(libc::SIGSYS), "{s:?}");

    let args = wait_args("w.sock", "w.jsonl");
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let mut vmm = Running::start(&args, None);
    let t = std::time::Duration::from_secs(30);
    let deadline = std::time::Instant::now() + t;
    let ping = loop {
        match ember_vmm::pooled::call(&p("w.sock"), &ember_vmm::pooled::WaitRequest::Ping, t) {
            Ok(r) => break r,
            Err(e) => {
                assert!(std::time::Instant::now() < deadline, "{e}");
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    };
    assert_eq!(ping["waiting"], true);
    let restore = ember_vmm::pooled::WaitRequest::Restore(ember_vmm::pooled::RestoreRequest {
        dir: snap.clone(),
        ..Default::default()
    });
    let reply = ember_vmm::pooled::call(&p("w.sock"), &restore, t).unwrap();
    assert_eq!(reply["ok"], true, "{reply}");
    // It runs the guest, and the same socket now takes the running VM's requests.
    let ticks = report_events(&p("w.jsonl"), "boot_marker");
    wait_for_events(&mut vmm, &p("w.jsonl"), "boot_marker", ticks + 2);
    request(&p("w.sock"), serde_json::json!({"op": "stats"}));
    request(&p("w.sock"), serde_json::json!({"op": "shutdown"}));
    let s = vmm.wait();
    assert!(s.success(), "{s:?} (signal {:?})", s.signal());
}

#[test]
fn control_requests_snapshots_and_restores_run_under_the_filters() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name);
    std::fs::write(p("counter.elf"), elf_with_code(COUNTER)).unwrap();
    let snap = p("snaps/one");

    // Boot; every control request; a snapshot while running on; shutdown.
    let mut vmm = Running::start(
        &[
            "--kernel".as_ref(),
            p("counter.elf").as_os_str(),
            "--mem-mib".as_ref(),
            "64".as_ref(),
            "--api-sock".as_ref(),
            p("a.sock").as_os_str(),
            "--report".as_ref(),
            p("r1.jsonl").as_os_str(),
        ],
        None,
    );
    wait_for_events(&mut vmm, &p("r1.jsonl"), "boot_marker", 2);
    request(&p("a.sock"), serde_json::json!({"op": "stats"}));
    request(&p("a.sock"), serde_json::json!({"op": "pause"}));
    request(&p("a.sock"), serde_json::json!({"op": "stats"}));
    request(&p("a.sock"), serde_json::json!({"op": "resume"}));
    // Let the guest run again before the snapshot pauses it: a pause right after a resume can
    // still see the previous park (`paused` set, state already taken) and fail with "vCPU
    // state was already taken", which is about the pause protocol, not about seccomp.
    let ticks = report_events(&p("r1.jsonl"), "boot_marker");
    wait_for_events(&mut vmm, &p("r1.jsonl"), "boot_marker", ticks + 2);
    // The watchdog: the event loop waits with a timeout, wakes at the deadline and pauses the
    // vCPUs; a keep-alive (here the disarming one) resumes them.
    request(
        &p("a.sock"),
        serde_json::json!({"op": "watchdog", "timeout_ms": 100}),
    );
    wait_for_events(&mut vmm, &p("r1.jsonl"), "watchdog_expired", 1);
    let stats = request(&p("a.sock"), serde_json::json!({"op": "stats"}));
    assert_eq!(stats["stats"]["paused"], true, "{stats}");
    assert_eq!(
        stats["stats"]["watchdog"]["paused_by_watchdog"], true,
        "{stats}"
    );
    let reply = request(
        &p("a.sock"),
        serde_json::json!({"op": "watchdog", "timeout_ms": 0}),
    );
    assert_eq!(reply["paused_by_watchdog"], true, "{reply}");
    let ticks = report_events(&p("r1.jsonl"), "boot_marker");
    wait_for_events(&mut vmm, &p("r1.jsonl"), "boot_marker", ticks + 2);
    request(
        &p("a.sock"),
        serde_json::json!({"op": "snapshot", "dir": snap, "kind": "full"}),
    );
    let ticks = report_events(&p("r1.jsonl"), "boot_marker");
    wait_for_events(&mut vmm, &p("r1.jsonl"), "boot_marker", ticks + 2);
    // A refused request (the directory exists) takes the error paths.
    let bad: ember_vmm::api::Request =
        serde_json::from_value(serde_json::json!({"op": "snapshot", "dir": snap})).unwrap();
    let reply = ember_vmm::api::call(&p("a.sock"), &bad).unwrap();
    assert_eq!(reply["ok"], false, "{reply}");
    request(&p("a.sock"), serde_json::json!({"op": "shutdown"}));
    let s = vmm.wait();
    assert!(s.success(), "{s:?} (signal {:?})", s.signal());

    // Restore and record the working set.
    let mut vmm = Running::start(
        &[
            "--restore".as_ref(),
            snap.as_os_str(),
            "--prefetch".as_ref(),
            "off".as_ref(),
            "--api-sock".as_ref(),
            p("b.sock").as_os_str(),
            "--report".as_ref(),
            p("r2.jsonl").as_os_str(),
        ],
        None,
    );
    wait_for_events(&mut vmm, &p("r2.jsonl"), "boot_marker", 2);
    request(
        &p("b.sock"),
        serde_json::json!({"op": "record_working_set", "dir": snap}),
    );
    request(&p("b.sock"), serde_json::json!({"op": "shutdown"}));
    let s = vmm.wait();
    assert!(s.success(), "{s:?} (signal {:?})", s.signal());

    // Restore with the working set prefetched on its own thread, under its own filter.
    let mut vmm = Running::start(
        &[
            "--restore".as_ref(),
            snap.as_os_str(),
            "--prefetch".as_ref(),
            "async".as_ref(),
            "--api-sock".as_ref(),
            p("c.sock").as_os_str(),
            "--report".as_ref(),
            p("r3.jsonl").as_os_str(),
        ],
        None,
    );
    wait_for_events(&mut vmm, &p("r3.jsonl"), "prefetch_done", 1);
    wait_for_events(&mut vmm, &p("r3.jsonl"), "boot_marker", 2);
    request(&p("c.sock"), serde_json::json!({"op": "shutdown"}));
    let s = vmm.wait();
    assert!(s.success(), "{s:?} (signal {:?})", s.signal());

    // The prefetch thread really is filtered.
    let mut vmm = Running::start(
        &[
            "--restore".as_ref(),
            snap.as_os_str(),
            "--prefetch".as_ref(),
            "async".as_ref(),
            "--report".as_ref(),
            p("r4.jsonl").as_os_str(),
        ],
        Some("prefetch"),
    );
    let s = vmm.wait();
    assert_eq!(s.signal(), Some(libc::SIGSYS), "{s:?}");
}

// ---------------------------------------------------------------------------------------
// Probes: one filter, one action, in a child process.

fn kind_named(name: &str) -> ThreadKind {
    ThreadKind::ALL
        .into_iter()
        .find(|k| k.name() == name)
        .unwrap_or_else(|| panic!("no thread kind {name:?}"))
}

/// The child side: runs when `EMBER_SECCOMP_PROBE` is set, passes trivially otherwise.
#[test]
fn probe_child() {
    let Ok(spec) = std::env::var(PROBE_ENV) else {
        return;
    };
    let (kind, action) = spec.split_once(':').expect("kind:action");
    let kind = kind_named(kind);
    let dir = PathBuf::from(std::env::var_os(PROBE_DIR_ENV).expect("probe dir"));
    // Anything the action needs opened must be opened before the filter.
    let dev_null = std::fs::File::open("/dev/null").unwrap();
    // Like the VMM's control socket, a listener is bound during set-up.
    let listener = (action == "control_socket")
        .then(|| std::os::unix::net::UnixListener::bind(dir.join("s.sock")).unwrap());
    // Like the console and log files, a capped file is created during set-up.
    let rotating = matches!(action, "rotate_files" | "rename_plain")
        .then(|| RotatingFile::create(&dir.join("console"), 8).unwrap());
    // The signals the tgkill probes send are ignored (rt_sigaction is a set-up syscall).
    // SAFETY: SIG_IGN for a signal this child process does not otherwise use.
    unsafe { libc::signal(libc::SIGRTMIN(), libc::SIG_IGN) };
    // SAFETY: as above.
    unsafe { libc::signal(libc::SIGUSR1, libc::SIG_IGN) };
    let action = action.to_string();
    // A fresh thread, so the test harness's own threads stay unfiltered; its exit path runs
    // under the filter, as a VMM thread's does.
    let dir2 = dir.clone();
    let t = std::thread::spawn(move || {
        seccomp::install(kind, SeccompMode::Kill).expect("install");
        run_action(&action, &dir2, &dev_null, listener, rotating);
    });
    t.join().expect("probe thread");
    if spec.ends_with(":rotate_files") {
        // Back on the unfiltered thread: the rotations happened.
        let cur = std::fs::read(dir.join("console")).unwrap();
        let old = std::fs::read(dir.join("console.1")).unwrap();
        assert_eq!(
            (old.as_slice(), cur.as_slice()),
            (&b"01234567"[..], &b"89"[..])
        );
    }
    println!("{PROBE_OK}");
}

fn run_action(
    action: &str,
    dir: &Path,
    dev_null: &std::fs::File,
    listener: Option<std::os::unix::net::UnixListener>,
    rotating: Option<RotatingFile>,
) {
    use std::os::unix::io::AsRawFd;
    let fd = dev_null.as_raw_fd();
    // SAFETY (for every block below): each call passes valid arguments (owned descriptors,
    // null or freshly mapped addresses, NUL-terminated strings); the probe only looks at
    // whether the kernel lets the syscall through.
    match action {
        "nothing" => {}
        "openat" => {
            let _ = std::fs::File::open("/dev/null");
        }
        "execve" => {
            let path = c"/bin/true";
            let argv = [path.as_ptr(), std::ptr::null()];
            let envp = [std::ptr::null()];
            // SAFETY: see above.
            unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
        }
        "socket_unix" => {
            // SAFETY: see above.
            let s =
                unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
            assert!(s >= 0, "socket(AF_UNIX) failed");
            // SAFETY: `s` is a descriptor we own.
            unsafe { libc::close(s) };
        }
        "socket_inet" => {
            // SAFETY: see above.
            unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        }
        "mmap_anon" => {
            // SAFETY: see above.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            // SAFETY: `p` is the 4 KiB mapping made above.
            unsafe { libc::munmap(p, 4096) };
        }
        "madvise_populate" => {
            // SAFETY: see above.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    8192,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            // MADV_POPULATE_READ (EINVAL before Linux 5.14), then MADV_WILLNEED.
            // SAFETY: `p` is the 8 KiB mapping made above; madvise does not change its contents.
            unsafe { libc::madvise(p, 8192, 22) };
            // SAFETY: as above.
            unsafe { libc::madvise(p, 8192, libc::MADV_WILLNEED) };
            // SAFETY: `p` is the 8 KiB mapping made above, unused from here on.
            unsafe { libc::munmap(p, 8192) };
        }
        "mmap_exec" => {
            // SAFETY: see above.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_EXEC,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
        }
        "mmap_file" => {
            // SAFETY: see above.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE,
                    fd,
                    0,
                )
            };
        }
        "mprotect_exec" => {
            // SAFETY: see above.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            // SAFETY: `p` is the 4 KiB mapping made above.
            unsafe { libc::mprotect(p, 4096, libc::PROT_READ | libc::PROT_EXEC) };
        }
        "ioctl_kvm_run" => {
            // Allowed on vCPU threads whatever the descriptor: /dev/null answers ENOTTY.
            // SAFETY: see above.
            let r = unsafe { libc::ioctl(fd, 0xae80 as _, 0) };
            assert_eq!(r, -1);
        }
        "ioctl_kvm_create_vm" => {
            // SAFETY: see above.
            unsafe { libc::ioctl(fd, 0xae01 as _, 0) };
        }
        "ioctl_tiocsti" => {
            // SAFETY: see above.
            unsafe { libc::ioctl(fd, libc::TIOCSTI as _, c"x".as_ptr()) };
        }
        // The kick signal (ignored, see probe_child), sent to ourselves.
        "tgkill_kick" => tgkill_self(libc::SIGRTMIN()),
        // SIGUSR1 is ignored (see probe_child) in case the filter lets it through.
        "tgkill_sigusr1" => tgkill_self(libc::SIGUSR1),
        "snapshot_files" => {
            // What writing a snapshot directory does: mkdir -p, create, write, punch a hole,
            // truncate, fsync files and directories, rename into place, list, stat, read back,
            // remove; plus the stats request's /proc/self/statm.
            let tmp = dir.join("parent/.snap.tmp");
            std::fs::create_dir_all(&tmp).unwrap();
            let f = tmp.join("memory");
            let file = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .open(&f)
                .unwrap();
            file.set_len(1 << 20).unwrap();
            use std::os::unix::fs::FileExt;
            file.write_all_at(&[1u8; 4096], 8192).unwrap();
            // SAFETY: see above.
            let r = unsafe {
                libc::fallocate(
                    file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    0,
                    4096,
                )
            };
            assert!(
                r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP)
            );
            file.sync_all().unwrap();
            file.sync_data().unwrap();
            let mut back = [0u8; 16];
            file.read_at(&mut back, 8192).ok();
            drop(file);
            std::fs::write(tmp.join("state"), b"state").unwrap();
            std::fs::File::open(&tmp).unwrap().sync_all().unwrap();
            let done = dir.join("parent/snap");
            std::fs::rename(&tmp, &done).unwrap();
            assert_eq!(std::fs::read_dir(&done).unwrap().count(), 2);
            assert_eq!(
                std::fs::metadata(done.join("memory")).unwrap().len(),
                1 << 20
            );
            assert_eq!(std::fs::read(done.join("state")).unwrap(), b"state");
            std::fs::remove_file(done.join("state")).unwrap();
            std::fs::remove_dir_all(dir.join("parent")).unwrap();
            let _ = std::fs::read_to_string("/proc/self/statm");
        }
        "control_socket" => {
            // The control socket's server side (accept on a listener bound before the filter,
            // clone, write timeout, non-blocking mode, read, reply) and the client side a vsock
            // back end needs (AF_UNIX socket, connect, shutdown).
            use std::io::{Read, Write};
            use std::os::unix::net::UnixStream;
            let listener = listener.expect("the control_socket probe binds a listener first");
            let path = dir.join("s.sock");
            let mut c = UnixStream::connect(&path).unwrap();
            let (mut s, _) = listener.accept().unwrap();
            let w = s.try_clone().unwrap();
            w.set_write_timeout(Some(std::time::Duration::from_secs(1)))
                .unwrap();
            s.set_nonblocking(true).unwrap();
            c.write_all(b"ping\n").unwrap();
            let mut b = [0u8; 5];
            s.set_nonblocking(false).unwrap();
            s.read_exact(&mut b).unwrap();
            (&w).write_all(b"pong\n").unwrap();
            c.read_exact(&mut b).unwrap();
            c.shutdown(std::net::Shutdown::Both).unwrap();
        }
        "rotate_files" => {
            // The console as the UART writes it, byte by byte, into a file capped at 8 bytes:
            // ftruncate and renameat2(RENAME_EXCHANGE) at each rotation; dropped at the end.
            use std::io::Write;
            let mut f = rotating.expect("the rotate_files probe creates the file first");
            for b in b"abcdefgh0123456789" {
                f.write_all(&[*b]).unwrap();
                f.flush().unwrap();
            }
            assert_eq!(f.rotations(), 2);
        }
        "rename_plain" => {
            // A plain rename of the same files (renameat2 without RENAME_EXCHANGE).
            let _f = rotating;
            let (from, to) = (c"console", c"console.2");
            // SAFETY: see above.
            unsafe {
                libc::syscall(
                    libc::SYS_renameat2,
                    libc::AT_FDCWD,
                    from.as_ptr(),
                    libc::AT_FDCWD,
                    to.as_ptr(),
                    0,
                )
            };
        }
        other => panic!("unknown probe action {other:?}"),
    }
}

/// tgkill(2) to the calling thread.
fn tgkill_self(sig: libc::c_int) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    // SAFETY: a signal to our own thread; no memory is passed.
    unsafe { libc::syscall(libc::SYS_tgkill, std::process::id(), tid, sig) };
}

/// Runs one probe in a child process.
fn probe(kind: &str, action: &str) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "probe_child", "--nocapture", "--test-threads=1"])
        .env(PROBE_ENV, format!("{kind}:{action}"))
        .env(PROBE_DIR_ENV, dir.path());
    let o = no_core_dumps(&mut cmd).output().expect("spawn probe");
    drop(dir);
    o
}

fn assert_allowed(kind: &str, action: &str) {
    let o = probe(kind, action);
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains(PROBE_OK),
        "{kind} filter should allow {action}: {}",
        describe(&o)
    );
}

fn assert_refused(kind: &str, action: &str) {
    let o = probe(kind, action);
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGSYS),
        "{kind} filter should refuse {action}: {}",
        describe(&o)
    );
}

#[test]
fn every_filter_loads_and_lets_its_thread_exit() {
    for kind in ThreadKind::ALL {
        assert_allowed(kind.name(), "nothing");
    }
}

#[test]
fn vcpu_filter_allows_kvm_run_and_memory_but_refuses_the_rest() {
    assert_allowed("vcpu", "ioctl_kvm_run");
    assert_allowed("vcpu", "mmap_anon");
    for action in [
        "openat",
        "execve",
        "socket_unix",
        "socket_inet",
        "mmap_exec",
        "mmap_file",
        "mprotect_exec",
        "ioctl_kvm_create_vm",
        "ioctl_tiocsti",
        "tgkill_kick",
    ] {
        assert_refused("vcpu", action);
    }
}

#[test]
fn vcpu_filter_allows_rotating_the_console_file_but_no_plain_rename() {
    assert_allowed("vcpu", "rotate_files");
    assert_refused("vcpu", "rename_plain");
}

#[test]
fn log_filter_allows_writing_and_rotating_its_file_and_nothing_else() {
    assert_allowed("log", "rotate_files");
    assert_allowed("log", "mmap_anon");
    for action in [
        "rename_plain",
        "openat",
        "execve",
        "socket_unix",
        "mmap_exec",
        "mprotect_exec",
        "ioctl_kvm_run",
        "tgkill_kick",
    ] {
        assert_refused("log", action);
    }
}

#[test]
fn main_filter_allows_snapshots_sockets_and_kicks_but_refuses_the_rest() {
    for action in [
        "snapshot_files",
        "control_socket",
        "socket_unix",
        "mmap_anon",
        "tgkill_kick",
    ] {
        assert_allowed("main", action);
    }
    for action in [
        "execve",
        "socket_inet",
        "mmap_exec",
        "mmap_file",
        "mprotect_exec",
        "ioctl_kvm_run",
        "ioctl_kvm_create_vm",
        "ioctl_tiocsti",
        "tgkill_sigusr1",
    ] {
        assert_refused("main", action);
    }
}

// ---------------------------------------------------------------------------------------
// The JSON files: every named number is right.

mod ioctls {
    use kvm_bindings::*;
    use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};
    const KVMIO: std::os::raw::c_uint = 0xAE;
    ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
    ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
    ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
    ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
    ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
    ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
    ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
    ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
    ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
    ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
    ioctl_iowr_nr!(KVM_GET_IRQCHIP, KVMIO, 0x62, kvm_irqchip);
    ioctl_ior_nr!(KVM_GET_PIT2, KVMIO, 0x9f, kvm_pit_state2);
    ioctl_ior_nr!(KVM_GET_CLOCK, KVMIO, 0x7c, kvm_clock_data);
    ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);
    // The restore (`restore.json`).
    ioctl_io_nr!(KVM_CREATE_VM, KVMIO, 0x01);
    ioctl_io_nr!(KVM_CHECK_EXTENSION, KVMIO, 0x03);
    ioctl_io_nr!(KVM_GET_VCPU_MMAP_SIZE, KVMIO, 0x04);
    ioctl_iowr_nr!(KVM_GET_MSR_INDEX_LIST, KVMIO, 0x02, kvm_msr_list);
    ioctl_iowr_nr!(KVM_GET_SUPPORTED_CPUID, KVMIO, 0x05, kvm_cpuid2);
    ioctl_iow_nr!(
        KVM_SET_USER_MEMORY_REGION,
        KVMIO,
        0x46,
        kvm_userspace_memory_region
    );
    ioctl_iow_nr!(KVM_IRQFD, KVMIO, 0x76, kvm_irqfd);
    ioctl_iow_nr!(KVM_SET_CLOCK, KVMIO, 0x7b, kvm_clock_data);
    ioctl_iow_nr!(KVM_CREATE_PIT2, KVMIO, 0x77, kvm_pit_config);
    ioctl_iow_nr!(KVM_IOEVENTFD, KVMIO, 0x79, kvm_ioeventfd);
    ioctl_iow_nr!(KVM_SET_PIT2, KVMIO, 0xa0, kvm_pit_state2);
    ioctl_ior_nr!(KVM_SET_IRQCHIP, KVMIO, 0x63, kvm_irqchip);
    ioctl_io_nr!(KVM_CREATE_VCPU, KVMIO, 0x41);
    ioctl_io_nr!(KVM_GET_STATS_FD, KVMIO, 0xce);
    ioctl_io_nr!(KVM_SET_TSS_ADDR, KVMIO, 0x47);
    ioctl_io_nr!(KVM_CREATE_IRQCHIP, KVMIO, 0x60);
    ioctl_iow_nr!(KVM_SET_MP_STATE, KVMIO, 0x99, kvm_mp_state);
    ioctl_iow_nr!(KVM_SET_MSRS, KVMIO, 0x89, kvm_msrs);
    ioctl_iow_nr!(KVM_SET_CPUID2, KVMIO, 0x90, kvm_cpuid2);
    ioctl_iow_nr!(KVM_SET_VCPU_EVENTS, KVMIO, 0xa0, kvm_vcpu_events);
    ioctl_iow_nr!(KVM_SET_DEBUGREGS, KVMIO, 0xa2, kvm_debugregs);
    ioctl_iow_nr!(KVM_SET_REGS, KVMIO, 0x82, kvm_regs);
    ioctl_iow_nr!(KVM_SET_SREGS, KVMIO, 0x84, kvm_sregs);
    ioctl_iow_nr!(KVM_SET_XCRS, KVMIO, 0xa7, kvm_xcrs);
    ioctl_iow_nr!(KVM_SET_LAPIC, KVMIO, 0x8f, kvm_lapic_state);
    ioctl_iow_nr!(KVM_SET_XSAVE, KVMIO, 0xa5, kvm_xsave);
    ioctl_iow_nr!(KVM_SET_FPU, KVMIO, 0x8d, kvm_fpu);
    const TUNIO: std::os::raw::c_uint = b'T' as _;
    ioctl_iow_nr!(TUNSETIFF, TUNIO, 202, std::os::raw::c_int);
    ioctl_ior_nr!(TUNGETIFF, TUNIO, 210, std::os::raw::c_uint);
    ioctl_iow_nr!(TUNSETVNETHDRSZ, TUNIO, 216, std::os::raw::c_int);
    ioctl_iow_nr!(TUNSETVNETLE, TUNIO, 220, std::os::raw::c_int);
}

/// The value of a constant named in a rule's comment. (The casts are needed where libc's
/// types differ between targets.)
#[allow(clippy::unnecessary_cast)]
fn constant(name: &str) -> Option<u64> {
    use ioctls::*;
    let v: u64 = match name {
        "KVM_RUN" => KVM_RUN(),
        "KVM_GET_REGS" => KVM_GET_REGS(),
        "KVM_GET_SREGS" => KVM_GET_SREGS(),
        "KVM_GET_MSRS" => KVM_GET_MSRS(),
        "KVM_GET_LAPIC" => KVM_GET_LAPIC(),
        "KVM_GET_MP_STATE" => KVM_GET_MP_STATE(),
        "KVM_GET_VCPU_EVENTS" => KVM_GET_VCPU_EVENTS(),
        "KVM_GET_DEBUGREGS" => KVM_GET_DEBUGREGS(),
        "KVM_GET_XSAVE" => KVM_GET_XSAVE(),
        "KVM_GET_XCRS" => KVM_GET_XCRS(),
        "KVM_GET_IRQCHIP" => KVM_GET_IRQCHIP(),
        "KVM_GET_PIT2" => KVM_GET_PIT2(),
        "KVM_GET_CLOCK" => KVM_GET_CLOCK(),
        "KVM_GET_DIRTY_LOG" => KVM_GET_DIRTY_LOG(),
        "KVM_CREATE_VM" => KVM_CREATE_VM(),
        "KVM_CHECK_EXTENSION" => KVM_CHECK_EXTENSION(),
        "KVM_GET_VCPU_MMAP_SIZE" => KVM_GET_VCPU_MMAP_SIZE(),
        "KVM_GET_MSR_INDEX_LIST" => KVM_GET_MSR_INDEX_LIST(),
        "KVM_GET_SUPPORTED_CPUID" => KVM_GET_SUPPORTED_CPUID(),
        "KVM_SET_USER_MEMORY_REGION" => KVM_SET_USER_MEMORY_REGION(),
        "KVM_IRQFD" => KVM_IRQFD(),
        "KVM_SET_CLOCK" => KVM_SET_CLOCK(),
        "KVM_CREATE_PIT2" => KVM_CREATE_PIT2(),
        "KVM_IOEVENTFD" => KVM_IOEVENTFD(),
        "KVM_SET_PIT2" => KVM_SET_PIT2(),
        "KVM_SET_IRQCHIP" => KVM_SET_IRQCHIP(),
        "KVM_CREATE_VCPU" => KVM_CREATE_VCPU(),
        "KVM_GET_STATS_FD" => KVM_GET_STATS_FD(),
        "KVM_SET_TSS_ADDR" => KVM_SET_TSS_ADDR(),
        "KVM_CREATE_IRQCHIP" => KVM_CREATE_IRQCHIP(),
        "KVM_SET_MP_STATE" => KVM_SET_MP_STATE(),
        "KVM_SET_MSRS" => KVM_SET_MSRS(),
        "KVM_SET_CPUID2" => KVM_SET_CPUID2(),
        "KVM_SET_VCPU_EVENTS" => KVM_SET_VCPU_EVENTS(),
        "KVM_SET_DEBUGREGS" => KVM_SET_DEBUGREGS(),
        "KVM_SET_REGS" => KVM_SET_REGS(),
        "KVM_SET_SREGS" => KVM_SET_SREGS(),
        "KVM_SET_XCRS" => KVM_SET_XCRS(),
        "KVM_SET_LAPIC" => KVM_SET_LAPIC(),
        "KVM_SET_XSAVE" => KVM_SET_XSAVE(),
        "KVM_SET_FPU" => KVM_SET_FPU(),
        "TUNSETIFF" => TUNSETIFF(),
        "TUNGETIFF" => TUNGETIFF(),
        "TUNSETVNETHDRSZ" => TUNSETVNETHDRSZ(),
        "TUNSETVNETLE" => TUNSETVNETLE(),
        "SIOCGIFINDEX" => libc::SIOCGIFINDEX as u64,
        "PR_SET_NAME" => libc::PR_SET_NAME as u64,
        "PR_SET_NO_NEW_PRIVS" => libc::PR_SET_NO_NEW_PRIVS as u64,
        "SECCOMP_SET_MODE_FILTER" => libc::SECCOMP_SET_MODE_FILTER as u64,
        "SO_RCVTIMEO_OLD" => 20,
        "SO_RCVTIMEO_NEW" => 66,
        "FIONBIO" => libc::FIONBIO as u64,
        "TUNSETOFFLOAD" => libc::TUNSETOFFLOAD as u64,
        "F_GETFD" => libc::F_GETFD as u64,
        "F_SETFD" => libc::F_SETFD as u64,
        "F_GETFL" => libc::F_GETFL as u64,
        "F_SETFL" => libc::F_SETFL as u64,
        "F_DUPFD_CLOEXEC" => libc::F_DUPFD_CLOEXEC as u64,
        "AF_UNIX" => libc::AF_UNIX as u64,
        "NULL" => 0,
        "SOL_SOCKET" => libc::SOL_SOCKET as u64,
        "SO_SNDTIMEO_OLD" => 21,
        "SO_SNDTIMEO_NEW" => 67,
        "SIGABRT" => libc::SIGABRT as u64,
        "SIGRTMIN (glibc)" => 34,
        "SIGRTMIN (musl)" => 35,
        "PROT_EXEC" => libc::PROT_EXEC as u64,
        "MAP_ANONYMOUS" => libc::MAP_ANONYMOUS as u64,
        "MADV_DONTNEED" => libc::MADV_DONTNEED as u64,
        "MADV_FREE" => libc::MADV_FREE as u64,
        "MADV_WILLNEED" => libc::MADV_WILLNEED as u64,
        "MADV_POPULATE_READ" => 22,
        "FALLOC_FL_KEEP_SIZE" => libc::FALLOC_FL_KEEP_SIZE as u64,
        "FALLOC_FL_PUNCH_HOLE" => libc::FALLOC_FL_PUNCH_HOLE as u64,
        "RENAME_EXCHANGE" => libc::RENAME_EXCHANGE as u64,
        _ => return None,
    };
    Some(v)
}

#[test]
fn this_libc_kicks_with_a_listed_sigrtmin() {
    let s = libc::SIGRTMIN() as u64;
    assert!(
        s == 34 || s == 35,
        "SIGRTMIN is {s}: add it to the tgkill rules"
    );
    assert_eq!(ember_vmm::vcpu::kick_signal(), libc::SIGRTMIN());
}

#[test]
fn prefetch_filter_allows_populating_memory_and_nothing_else() {
    assert_allowed("prefetch", "madvise_populate");
    assert_allowed("prefetch", "mmap_anon");
    for action in [
        "openat",
        "execve",
        "socket_unix",
        "mmap_exec",
        "mprotect_exec",
        "ioctl_kvm_run",
        "tgkill_kick",
    ] {
        assert_refused("prefetch", action);
    }
}

#[test]
fn restore_filter_allows_building_a_vm_and_refuses_the_rest() {
    for action in [
        "ioctl_kvm_create_vm",
        "mmap_file",
        "mmap_anon",
        "socket_unix",
        "openat",
    ] {
        assert_allowed("restore", action);
    }
    for action in [
        "execve",
        "socket_inet",
        "mmap_exec",
        "mprotect_exec",
        "ioctl_tiocsti",
    ] {
        assert_refused("restore", action);
    }
}

/// A waiting VMM's filter stays under every thread of the VM it restores: it must allow all
/// that their own lists allow (a rule of theirs is in it as is, or its syscall is allowed
/// unconditionally).
#[test]
fn restore_filter_covers_every_thread_of_the_restored_vm() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("seccomp");
    let rules = |kind: &str| -> Vec<serde_json::Value> {
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{kind}.json"))).unwrap(),
        )
        .unwrap();
        json[kind]["filter"].as_array().unwrap().clone()
    };
    let restore = rules("restore");
    let allowed = |syscall: &str, args: &serde_json::Value| {
        restore.iter().any(|r| {
            r["syscall"] == syscall
                && (r.get("args").is_none() || (args.is_array() && r["args"] == *args))
        })
    };
    for kind in ["main", "vcpu", "prefetch"] {
        for rule in rules(kind) {
            let syscall = rule["syscall"].as_str().unwrap();
            let args = rule.get("args").cloned().unwrap_or(serde_json::Value::Null);
            assert!(
                allowed(syscall, &args),
                "restore.json does not allow {kind}.json's {rule}"
            );
        }
    }
}

#[test]
fn json_numbers_match_the_constants_their_comments_name() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("seccomp");
    let mut checked = 0;
    for kind in ThreadKind::ALL {
        let path = dir.join(format!("{}.json", kind.name()));
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let rules = json[kind.name()]["filter"].as_array().unwrap();
        for rule in rules {
            let syscall = rule["syscall"].as_str().unwrap();
            assert!(
                rule["comment"].as_str().is_some_and(|c| !c.is_empty()),
                "{}: {syscall} has no comment saying why it is allowed",
                path.display()
            );
            for cond in rule["args"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
            {
                let comment = cond["comment"].as_str().unwrap_or_else(|| {
                    panic!(
                        "{}: a condition on {syscall} names no constant",
                        path.display()
                    )
                });
                let val = cond["val"].as_u64().unwrap();
                let (negated, expr) = match comment.strip_prefix("no ") {
                    Some(rest) => (true, rest),
                    None => (false, comment),
                };
                let expected = constant(expr).unwrap_or_else(|| {
                    expr.split(" | ")
                        .map(|n| {
                            constant(n).unwrap_or_else(|| {
                                panic!(
                                    "{}: unknown constant {n:?} on {syscall}: add it to constant()",
                                    path.display()
                                )
                            })
                        })
                        .fold(0, |a, b| a | b)
                });
                let mask = cond["op"].get("masked_eq").and_then(|m| m.as_u64());
                if negated {
                    assert_eq!(
                        (mask, val),
                        (Some(expected), 0),
                        "{}: {syscall} {comment}",
                        path.display()
                    );
                } else {
                    assert_eq!(val, expected, "{}: {syscall} {comment}", path.display());
                    if let Some(m) = mask {
                        assert_eq!(m, expected, "{}: {syscall} {comment}", path.display());
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 20, "only {checked} conditions checked");
}
