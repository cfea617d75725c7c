//! What the runtime holds on the host, counted: a VMM killed with SIGKILL is noticed at once
//! and everything it held is released; a crashed runtime's sandboxes are re-attached by the
//! next one; 200 create/kill cycles leave nothing behind. The tests here count host-wide
//! things, so they run one at a time.

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ember_agent::protocol::RunCodeRequest;
use ember_runtime::{CreateRequest, State};
use ember_tests::runtime_for_test as runtime;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Host resources a runtime's sandboxes hold.
#[derive(Debug, PartialEq, Eq, Clone)]
struct Held {
    fds: usize,
    mounts: usize,
    cgroups: usize,
    jails: usize,
    home_files: usize,
    vmms: usize,
    threads: usize,
}

fn count_dir(p: &Path) -> usize {
    std::fs::read_dir(p).map(|d| d.count()).unwrap_or(0)
}

fn count_subdirs(p: &Path) -> usize {
    std::fs::read_dir(p)
        .map(|d| d.flatten().filter(|e| e.path().is_dir()).count())
        .unwrap_or(0)
}

fn count_tree(p: &Path) -> usize {
    let mut n = 0;
    if let Ok(d) = std::fs::read_dir(p) {
        for e in d.flatten() {
            n += 1;
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                n += count_tree(&e.path());
            }
        }
    }
    n
}

/// VMM processes in this runtime's cgroups (other runtimes on the host do not count).
fn vmm_processes(rt: &ember_runtime::Runtime) -> usize {
    let parent = rt.config().cgroup_parent();
    let parent = format!("/{}/", parent.display());
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .map(|c| c.trim() == "ember-vmm")
                .unwrap_or(false)
                && std::fs::read_to_string(e.path().join("cgroup"))
                    .map(|c| c.contains(&parent))
                    .unwrap_or(false)
        })
        .count()
}

/// What the runtime holds, once the threads of earlier tests' runtimes have ended (their
/// timer and watcher threads notice within a second).
fn held(rt: &ember_runtime::Runtime) -> Held {
    std::thread::sleep(Duration::from_millis(1500));
    let cfg = rt.config();
    let home = &cfg.home;
    Held {
        fds: count_dir(Path::new("/proc/self/fd")),
        mounts: std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .count(),
        cgroups: ember_runtime::jailed::cgroup_parents(cfg)
            .iter()
            .map(|p| count_subdirs(p))
            .sum(),
        jails: count_dir(&cfg.jails_dir()),
        // The database and its WAL grow with records; count the rest.
        home_files: count_tree(&home.join("sandboxes")) + count_tree(&home.join("jails")),
        vmms: vmm_processes(rt),
        threads: count_dir(Path::new("/proc/self/task")),
    }
}

fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_vmm_killed_with_sigkill_is_noticed_at_once_and_released() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (_home, rt) = runtime();
    // One cycle first: lazily opened things are not leaks.
    let warm = rt.create(&CreateRequest::default()).unwrap().id;
    rt.kill(&warm).unwrap();
    let before = held(&rt);
    let id = rt.create(&CreateRequest::default()).unwrap().id;
    let during = held(&rt);
    assert_eq!(during.vmms, before.vmms + 1);
    assert_eq!(during.jails, before.jails + 1);
    assert!(during.cgroups > before.cgroups, "{during:?}");
    let pid = rt.get(&id).unwrap().pid.unwrap();
    // SAFETY: kill(2) on the VMM's pid with SIGKILL.
    assert_eq!(unsafe { libc_kill(pid as i32, 9) }, 0);
    let t0 = Instant::now();
    wait_for("failed state", Duration::from_secs(1), || {
        rt.get(&id).unwrap().state == State::Failed
    });
    eprintln!("SIGKILL → failed in {:?}", t0.elapsed());
    let info = rt.get(&id).unwrap();
    let reason = info.reason.unwrap();
    assert!(
        reason.contains("signal: 9") || reason.contains("SIGKILL"),
        "{reason}"
    );
    let after = held(&rt);
    assert_eq!(
        (
            after.vmms,
            after.jails,
            after.cgroups,
            after.home_files,
            after.mounts
        ),
        (
            before.vmms,
            before.jails,
            before.cgroups,
            before.home_files,
            before.mounts
        ),
        "before {before:?}, after {after:?}"
    );
    let e = rt
        .run_code(&id, &RunCodeRequest::new("1"), &mut |_| true)
        .unwrap_err();
    assert_eq!(e.code(), "wrong_state");
}

#[test]
fn a_restarted_runtime_reattaches_running_sandboxes_and_reclaims_the_rest() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (home, rt) = runtime();
    let mut cfg = ember_tests::runtime_config(home.path());
    let keep = rt.create(&CreateRequest::default()).unwrap().id;
    let paused = rt.create(&CreateRequest::default()).unwrap().id;
    let mut x = String::new();
    rt.run_code(&keep, &RunCodeRequest::new("v = 'kept'"), &mut |_| true)
        .unwrap();
    rt.run_code(&paused, &RunCodeRequest::new("w = 7"), &mut |_| true)
        .unwrap();
    rt.pause(&paused).unwrap();
    // An orphan: a jail and cgroup no record refers to (what a crash mid-create leaves).
    let orphan = rt.create(&CreateRequest::default()).unwrap();
    let orphan_pid = orphan.pid.unwrap();
    // "Crash": forget the runtime without killing anything, then make the orphan unknown.
    cfg.kill_on_drop = false;
    std::mem::forget(rt);
    {
        let db = rusqlite_free_delete(home.path(), &orphan.id);
        assert!(db, "could not remove the orphan's record");
    }
    let rt = ember_runtime::Runtime::open(cfg).unwrap();
    assert_eq!(rt.get(&keep).unwrap().state, State::Running);
    let end = rt
        .run_code(&keep, &RunCodeRequest::new("print(v)"), &mut |ev| {
            if let ember_agent::protocol::EventKind::Stdout { data } = ev {
                x.push_str(&String::from_utf8_lossy(data));
            }
            true
        })
        .unwrap();
    assert_eq!(end.status, ember_agent::protocol::EndStatus::Ok);
    assert_eq!(x.trim(), "kept");
    assert_eq!(rt.get(&paused).unwrap().state, State::Paused);
    // The orphan's VMM was killed and its jail removed.
    wait_for("orphan killed", Duration::from_secs(5), || {
        !Path::new(&format!("/proc/{orphan_pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{orphan_pid}/status"))
                .map(|s| s.contains("State:\tZ"))
                .unwrap_or(true)
    });
    let jails: Vec<String> = std::fs::read_dir(rt.config().jails_dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        jails.iter().all(|j| !j.starts_with(&orphan.id)),
        "orphan jail left: {jails:?}"
    );
    // A re-attached sandbox still dies cleanly, and its death is still seen.
    let pid = rt.get(&keep).unwrap().pid.unwrap();
    // SAFETY: kill(2) on the VMM's pid with SIGKILL.
    unsafe { libc_kill(pid as i32, 9) };
    wait_for("re-attached death seen", Duration::from_secs(1), || {
        rt.get(&keep).unwrap().state == State::Failed
    });
    rt.kill(&paused).unwrap();
}

#[test]
fn two_hundred_create_kill_cycles_leave_nothing_behind() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (_home, rt) = runtime();
    // One cycle first: lazily opened things (pools, statements) are not leaks.
    let id = rt.create(&CreateRequest::default()).unwrap().id;
    rt.kill(&id).unwrap();
    let before = held(&rt);
    let t0 = Instant::now();
    let n = std::env::var("EMBER_TEST_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    for _ in 0..n {
        let id = rt.create(&CreateRequest::default()).unwrap().id;
        rt.kill(&id).unwrap();
    }
    eprintln!("{n} create/kill cycles: {:?}", t0.elapsed());
    let after = held(&rt);
    assert_eq!(before, after, "held before {before:?}, after {after:?}");
}

use libc::kill as libc_kill;

/// Deletes a sandbox's row with the sqlite3 CLI-free route: the runtime's own store type.
fn rusqlite_free_delete(home: &Path, id: &str) -> bool {
    match ember_runtime::store::Store::open(&home.join("ember.db")) {
        Ok(s) => s.purge_sandbox(id).is_ok(),
        Err(_) => false,
    }
}
