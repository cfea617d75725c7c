//! The runtime end to end: sandboxes with ids restored into real jails (own uid, cgroup,
//! mount namespace) from the shipped templates, their lifecycle (pause/resume, timeouts,
//! fork, named snapshots), artifacts and the audit log in a real SQLite store, and a hostile
//! sandbox contained while another keeps answering.

use std::time::{Duration, Instant};

use ember_agent::protocol::{EndStatus, ExecRequest, RunCodeRequest};
use ember_runtime::{AuditFilter, CreateRequest, ForkRequest, OnTimeout, SnapshotRequest, State};
use ember_tests::runtime_for_test as runtime;

fn code(rt: &ember_runtime::Runtime, id: &str, src: &str) -> (EndStatus, String, Option<String>) {
    ember_tests::run_code(rt, id, src)
}

fn create(rt: &ember_runtime::Runtime, req: CreateRequest) -> String {
    rt.create(&req)
        .unwrap_or_else(|e| panic!("create {req:?}: {e}"))
        .id
}

fn wait_state(rt: &ember_runtime::Runtime, id: &str, want: State, within: Duration) {
    let t0 = Instant::now();
    loop {
        let s = rt.get(id).unwrap().state;
        if s == want {
            return;
        }
        assert!(
            t0.elapsed() < within,
            "sandbox {id} is {s:?}, not {want:?}, after {within:?}: {:?}",
            rt.history(id)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn state_survives_calls_and_a_pause_and_resume() {
    let (_home, rt) = runtime();
    let id = create(&rt, CreateRequest::default());
    let info = rt.get(&id).unwrap();
    assert_eq!(info.state, State::Running);
    assert_eq!(info.template.as_deref(), Some("default"));
    let pid = info.pid.expect("a VMM pid");
    // The VMM runs jailed: its own uid, in the runtime's cgroup.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(!uid_line.contains("\t0\t"), "VMM runs as root: {uid_line}");
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(cg.contains("ember-rt-"), "{cg}");

    assert_eq!(code(&rt, &id, "x = 41").0, EndStatus::Ok);
    assert_eq!(code(&rt, &id, "x + 1").2.as_deref(), Some("42"));

    let paused = rt.pause(&id).unwrap();
    assert_eq!(paused.state, State::Paused);
    assert!(paused.pid.is_none());
    // The pause answers once the snapshot is on disk; the VMM is stopped right after, off the
    // caller's path.
    let gone = || {
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/status"))
                .map(|s| s.contains("State:\tZ"))
                .unwrap_or(true)
    };
    let t0 = std::time::Instant::now();
    while !gone() && t0.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(gone(), "the VMM still runs 5 s after pause");
    // A call on a paused sandbox resumes it; its state is intact.
    assert_eq!(code(&rt, &id, "x + 2").2.as_deref(), Some("43"));
    assert_eq!(rt.get(&id).unwrap().state, State::Running);
    // Explicit pause and resume too.
    rt.pause(&id).unwrap();
    rt.resume(&id).unwrap();
    assert_eq!(code(&rt, &id, "x + 3").2.as_deref(), Some("44"));

    let states: Vec<State> = rt.history(&id).unwrap().iter().map(|t| t.to).collect();
    assert_eq!(
        &states[..6],
        [
            State::Creating,
            State::Running,
            State::Pausing,
            State::Paused,
            State::Resuming,
            State::Running
        ],
        "{states:?}"
    );
    let killed = rt.kill(&id).unwrap();
    assert_eq!(killed.state, State::Stopped);
    // A call on a stopped sandbox is a clear conflict, not a hang.
    let e = rt
        .run_code(&id, &RunCodeRequest::new("1"), &mut |_| true)
        .unwrap_err();
    assert_eq!(e.code(), "wrong_state", "{e}");
    let e = rt.get("0000000000000000").unwrap_err();
    assert_eq!(e.code(), "sandbox_not_found");
}

#[test]
fn timeout_kills_and_keeps_artifacts_and_audit() {
    let (home, rt) = runtime();
    let id = create(&rt, CreateRequest::default());
    let (st, _, _) = code(
        &rt,
        &id,
        "import os\nos.makedirs('/workspace/outputs/sub', exist_ok=True)\n\
         open('/workspace/outputs/result.txt', 'w').write('forty-two')\n\
         open('/workspace/outputs/sub/b.csv', 'w').write('a,b\\n1,2\\n')",
    );
    assert_eq!(st, EndStatus::Ok);
    // The timeout, shortened now that the work is done (a loaded machine may take seconds
    // for the cell itself).
    rt.set_timeout(&id, 1, None).unwrap();
    wait_state(&rt, &id, State::Stopped, Duration::from_secs(60));
    let info = rt.get(&id).unwrap();
    assert_eq!(info.reason.as_deref(), Some("timeout"), "{info:?}");
    let arts = rt.artifacts(&id).unwrap();
    let names: Vec<&str> = arts.iter().map(|a| a.path.as_str()).collect();
    assert!(
        names.contains(&"result.txt") && names.contains(&"sub/b.csv"),
        "{names:?}"
    );
    let p = rt.artifact_path(&id, "result.txt").unwrap();
    assert_eq!(std::fs::read_to_string(p).unwrap(), "forty-two");
    assert!(rt.artifact_path(&id, "../ember.db").is_err());
    // The expiry's own record is written when its kill returns, just after the state changed.
    let t0 = Instant::now();
    let audit = loop {
        let audit = rt
            .audit(&AuditFilter {
                sandbox: Some(id.clone()),
                ..Default::default()
            })
            .unwrap();
        if audit.iter().any(|a| a.call == "timeout_kill") || t0.elapsed() > Duration::from_secs(10)
        {
            break audit;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let calls: Vec<&str> = audit.iter().map(|a| a.call.as_str()).collect();
    assert!(
        calls.contains(&"create") && calls.contains(&"run_code") && calls.contains(&"timeout_kill"),
        "{calls:?}"
    );
    let rc = audit.iter().find(|a| a.call == "run_code").unwrap();
    assert!(rc.args["code_bytes"].as_u64().unwrap() > 10);
    assert!(
        !rc.args.to_string().contains("forty-two"),
        "code leaked into the audit log"
    );
    // Records survive the runtime (a server restart).
    drop(rt);
    let rt = ember_tests::reopen_runtime(home.path());
    assert_eq!(rt.get(&id).unwrap().state, State::Stopped);
    assert_eq!(rt.artifacts(&id).unwrap().len(), arts.len());
}

#[test]
fn timeout_can_pause_instead() {
    let (_home, rt) = runtime();
    let id = create(
        &rt,
        CreateRequest {
            on_timeout: OnTimeout::Pause,
            ..Default::default()
        },
    );
    code(&rt, &id, "kept = 'yes'");
    rt.set_timeout(&id, 1, None).unwrap();
    wait_state(&rt, &id, State::Paused, Duration::from_secs(60));
    assert_eq!(rt.get(&id).unwrap().reason.as_deref(), Some("timeout"));
    rt.set_timeout(&id, 600, None).unwrap();
    assert_eq!(code(&rt, &id, "kept").2.as_deref(), Some("'yes'"));
    rt.kill(&id).unwrap();
}

#[test]
fn fork_and_named_snapshots_continue_from_the_state() {
    let (_home, rt) = runtime();
    let id = create(&rt, CreateRequest::default());
    code(&rt, &id, "import random\nbranch = 'root'\nn = 5");
    let t0 = Instant::now();
    let kids = rt
        .fork(
            &id,
            &ForkRequest {
                count: 3,
                timeout_secs: None,
                metadata: None,
            },
        )
        .unwrap();
    eprintln!("fork into 3: {:?}", t0.elapsed());
    assert_eq!(kids.len(), 3);
    // The parent keeps running with its state.
    assert_eq!(rt.get(&id).unwrap().state, State::Running);
    let mut draws = Vec::new();
    for (i, k) in kids.iter().enumerate() {
        assert_eq!(k.forked_from.as_deref(), Some(id.as_str()));
        assert_eq!(code(&rt, &k.id, "n").2.as_deref(), Some("5"));
        code(&rt, &k.id, &format!("branch = 'kid{i}'"));
        draws.push(code(&rt, &k.id, "random.random()").2.unwrap());
    }
    draws.sort();
    draws.dedup();
    assert_eq!(draws.len(), 3, "forks drew the same random numbers");
    assert_eq!(code(&rt, &id, "branch").2.as_deref(), Some("'root'"));
    assert_eq!(
        code(&rt, &kids[1].id, "branch").2.as_deref(),
        Some("'kid1'")
    );

    let snap = rt
        .snapshot(
            &id,
            &SnapshotRequest {
                name: Some("after-setup".into()),
                ..Default::default()
            },
        )
        .unwrap();
    assert!(snap.bytes > 0);
    rt.kill(&id).unwrap();
    // The snapshot outlives its sandbox.
    let again = create(
        &rt,
        CreateRequest {
            snapshot: Some("after-setup".into()),
            ..Default::default()
        },
    );
    assert_eq!(code(&rt, &again, "n * 2").2.as_deref(), Some("10"));
    assert!(rt
        .snapshot(
            &again,
            &SnapshotRequest {
                name: Some("after-setup".into()),
                ..Default::default()
            }
        )
        .is_err());
    for k in kids {
        rt.kill(&k.id).unwrap();
    }
    rt.kill(&again).unwrap();
    rt.delete_snapshot("after-setup").unwrap();
}

#[test]
fn a_filesystem_only_snapshot_boots_with_the_files_and_without_the_state() {
    let (_home, rt) = runtime();
    let id = create(&rt, CreateRequest::default());
    code(&rt, &id, "kept_in_memory = 7");
    code(
        &rt,
        &id,
        "open('/home/user/notes.txt', 'w').write('written before the snapshot')",
    );
    let t0 = Instant::now();
    let snap = rt
        .snapshot(
            &id,
            &SnapshotRequest {
                name: Some("disk-only".into()),
                memory: Some(false),
            },
        )
        .unwrap();
    eprintln!(
        "filesystem-only snapshot: {:?}, {} bytes",
        t0.elapsed(),
        snap.bytes
    );
    assert!(!snap.memory);
    let listed = rt.snapshots().unwrap();
    let listed = listed.iter().find(|s| s.name == "disk-only").unwrap();
    assert!(!listed.memory, "{listed:?}");
    // The sandbox it was taken of keeps running with its state.
    assert_eq!(code(&rt, &id, "kept_in_memory").2.as_deref(), Some("7"));
    rt.kill(&id).unwrap();

    let t0 = Instant::now();
    let booted = create(
        &rt,
        CreateRequest {
            snapshot: Some("disk-only".into()),
            ..Default::default()
        },
    );
    let ready_ms = ember_runtime::clock::now_ms();
    eprintln!("create by booting the disk: {:?}", t0.elapsed());
    let info = rt.get(&booted).unwrap();
    assert_eq!(info.state, State::Running);
    // The timeout counts from when the sandbox became ready, not from the request: a boot
    // that takes longer than the timeout (minutes on a loaded kvm_pvm host) does not use it
    // up. Ready: at most a few seconds before the create returned. (RFC 3339 strings of one
    // format compare as their times.)
    let timeout_ms = rt.config().default_timeout.as_millis() as i64;
    let earliest = ember_runtime::clock::rfc3339(ready_ms - 5_000 + timeout_ms);
    let ends_at = info.ends_at.clone().unwrap_or_default();
    assert!(
        ends_at >= earliest,
        "ends_at {ends_at}, not before {earliest}"
    );
    assert_eq!(info.template.as_deref(), Some("default"));
    // The files are there; the interpreter is new, warm and answers.
    let (st, _, text) = code(&rt, &booted, "open('/home/user/notes.txt').read()");
    assert_eq!(st, EndStatus::Ok);
    assert_eq!(text.as_deref(), Some("'written before the snapshot'"));
    assert_eq!(code(&rt, &booted, "kept_in_memory").0, EndStatus::Error);
    assert_eq!(code(&rt, &booted, "6 * 7").2.as_deref(), Some("42"));
    // It is a sandbox like any other: it pauses and resumes from its memory.
    code(&rt, &booted, "after_boot = 1");
    rt.pause(&booted).unwrap();
    rt.resume(&booted).unwrap();
    assert_eq!(code(&rt, &booted, "after_boot + 1").2.as_deref(), Some("2"));
    rt.kill(&booted).unwrap();
    rt.delete_snapshot("disk-only").unwrap();
}

#[test]
fn thirty_two_concurrent_sandboxes_all_answer() {
    let (_home, rt) = runtime();
    let t0 = Instant::now();
    let ids: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..32)
            .map(|i| {
                let rt = &rt;
                s.spawn(move || {
                    let id = create(rt, CreateRequest::default());
                    let (st, _, text) = code(rt, &id, &format!("{i} * 3"));
                    assert_eq!(st, EndStatus::Ok);
                    assert_eq!(text, Some((i * 3).to_string()));
                    id
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    eprintln!("32 concurrent creates + run_code: {:?}", t0.elapsed());
    let mut uniq = ids.clone();
    uniq.sort();
    uniq.dedup();
    assert_eq!(uniq.len(), 32);
    let running = rt
        .list(&Default::default())
        .unwrap()
        .into_iter()
        .filter(|i| i.state == State::Running)
        .count();
    assert_eq!(running, 32);
    // Every VMM runs the runtime's one shared copy of the binary (hard-linked into each jail,
    // so that idle VMMs share its pages): root-owned, read-only, not the build's own file.
    use std::os::unix::fs::MetadataExt;
    let exes: Vec<std::fs::Metadata> = ids
        .iter()
        .map(|id| {
            let pid = rt.get(id).unwrap().pid.unwrap();
            std::fs::metadata(format!("/proc/{pid}/exe")).unwrap()
        })
        .collect();
    let first = &exes[0];
    assert!(
        exes.iter()
            .all(|m| (m.dev(), m.ino()) == (first.dev(), first.ino())),
        "the VMMs run different copies of the binary"
    );
    assert_eq!((first.uid(), first.mode() & 0o7777), (0, 0o555));
    let build = std::fs::metadata(ember_tests::bin("ember-vmm")).unwrap();
    assert_ne!((build.dev(), build.ino()), (first.dev(), first.ino()));
    let shared: Vec<_> = std::fs::read_dir(rt.config().home.join("bin"))
        .unwrap()
        .flatten()
        .filter(|e| e.metadata().is_ok_and(|m| m.ino() == first.ino()))
        .collect();
    assert_eq!(shared.len(), 1, "the shared copy is in $EMBER_HOME/bin");
    for id in &ids {
        rt.kill(id).unwrap();
    }
}

#[test]
fn capacity_is_refused_clearly() {
    let (home, _rt) = runtime();
    drop(_rt);
    let mut cfg = ember_tests::runtime_config(home.path());
    cfg.max_running = 1;
    let rt = ember_runtime::Runtime::open(cfg).unwrap();
    let a = create(&rt, CreateRequest::default());
    let e = rt.create(&CreateRequest::default()).unwrap_err();
    assert_eq!(e.code(), "capacity", "{e}");
    assert!(e.to_string().contains("cap"), "{e}");
    let e = rt
        .create(&CreateRequest {
            template: Some("no-such-template".into()),
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(e.code(), "template_not_found", "{e}");
    let e = rt
        .create(&CreateRequest {
            vcpus: Some(8),
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(e.code(), "invalid_request", "{e}");
    rt.kill(&a).unwrap();
}

/// A fork bomb, a memory hog and a disk filler in one sandbox: its neighbour keeps answering,
/// the hog stays inside its limits, and the host disk holds at most the sandbox's disk size.
#[test]
fn a_hostile_sandbox_is_contained() {
    let (_home, rt) = runtime();
    let bad = create(
        &rt,
        CreateRequest {
            cpu_percent: Some(50),
            ..Default::default()
        },
    );
    let good = create(&rt, CreateRequest::default());
    let bg = |argv: &[&str]| {
        let req = ExecRequest {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            background: true,
            ..Default::default()
        };
        rt.exec(&bad, &req, &mut |_| true).unwrap();
    };
    // Disk filler: writes until the guest's disk is full.
    bg(&[
        "sh",
        "-c",
        "dd if=/dev/zero of=/workspace/fill bs=1M 2>/dev/null; sync",
    ]);
    // Memory hog: grows until the guest's OOM killer stops it.
    bg(&[
        "python3",
        "-c",
        "x = []\nwhile True: x.append(bytearray(16 << 20))",
    ]);
    // Fork bomb.
    bg(&["bash", "-c", "f() { f | f & }; f"]);
    let t0 = Instant::now();
    let mut answers = 0;
    while t0.elapsed() < Duration::from_secs(30) {
        let (st, _, text) = code(&rt, &good, "6 * 7");
        assert_eq!((st, text.as_deref()), (EndStatus::Ok, Some("42")));
        answers += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!("neighbour answered {answers} times during the attack");
    assert!(answers >= 5);
    let info = rt.get(&bad).unwrap();
    // Still running or failed by its own limits: never the host's problem.
    eprintln!("hostile sandbox: {:?} {:?}", info.state, info.reason);
    let limit = info.resources.memory_limit_mib;
    if let Some(pid) = info.pid {
        let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        // cgroup v1 ("N:memory:/path") or v2 ("0::/path").
        let peak = match cg.lines().find_map(|l| l.split_once(":memory:")) {
            Some((_, rel)) => std::fs::read_to_string(format!(
                "/sys/fs/cgroup/memory{rel}/memory.max_usage_in_bytes"
            )),
            None => {
                let rel = cg.lines().find_map(|l| l.strip_prefix("0::")).unwrap();
                std::fs::read_to_string(format!("/sys/fs/cgroup{rel}/memory.peak"))
            }
        }
        .unwrap();
        let peak: u64 = peak.trim().parse().unwrap();
        eprintln!(
            "hostile sandbox: cgroup memory peak {} MiB, limit {limit} MiB",
            peak >> 20
        );
        assert!(
            peak <= limit << 20,
            "cgroup memory {peak} over the limit {limit} MiB"
        );
        // The overlay holds at most the disk.
        let jail_overlay = std::fs::read_dir(format!("/proc/{pid}/root/work"))
            .unwrap()
            .flatten()
            .find(|e| e.file_name().to_string_lossy().ends_with(".overlay"))
            .map(|e| e.metadata().unwrap());
        if let Some(m) = jail_overlay {
            use std::os::unix::fs::MetadataExt;
            let used = m.blocks() * 512;
            let disk = info.resources.disk_mib << 20;
            assert!(
                used <= disk + (disk / 8),
                "overlay uses {used} bytes for a {disk}-byte disk"
            );
        }
    }
    rt.kill(&bad).unwrap();
    assert_eq!(code(&rt, &good, "1 + 1").2.as_deref(), Some("2"));
    rt.kill(&good).unwrap();
}

/// A fence stops every running VM's vCPUs under the runtime's feet (its records still say
/// running) and thaws them; keep-alives arm and feed each VMM's watchdog, which stops a VM
/// whose keep-alives stop and lets it run at the next one, but not one stopped on purpose.
#[test]
fn a_fence_freezes_and_thaws_and_keep_alives_feed_the_watchdogs() {
    let (_home, rt) = runtime();
    let id = create(&rt, CreateRequest::default());
    assert_eq!(code(&rt, &id, "w = 3").0, EndStatus::Ok);
    let watchdog = |rt: &ember_runtime::Runtime| rt.vmm_stats(&id).unwrap()["watchdog"].clone();
    let paused = |rt: &ember_runtime::Runtime| rt.vmm_stats(&id).unwrap()["paused"] == true;
    assert_eq!(
        rt.running_vmms()
            .into_iter()
            .map(|(i, _)| i)
            .collect::<Vec<_>>(),
        vec![id.clone()]
    );
    let mut keep = ember_runtime::KeepAlive::new(Duration::from_millis(800));
    assert_eq!(keep.beat(&rt), 1);
    assert_eq!(watchdog(&rt)["armed_ms"], 800);
    // No keep-alive: the VMM stops its vCPUs.
    let t0 = std::time::Instant::now();
    while watchdog(&rt)["paused_by_watchdog"] != true {
        assert!(t0.elapsed() < Duration::from_secs(5), "{}", watchdog(&rt));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(paused(&rt));
    assert_eq!(rt.get(&id).unwrap().state, State::Running);
    // The next keep-alive lets it run again.
    assert_eq!(keep.beat(&rt), 1);
    assert!(!paused(&rt));
    assert_eq!(code(&rt, &id, "w + 1").2.as_deref(), Some("4"));
    // A fence: stopped on purpose, which a keep-alive does not undo; thawed, it runs.
    assert_eq!(rt.freeze_vms(), vec![id.clone()]);
    assert!(paused(&rt));
    keep.beat(&rt);
    assert!(paused(&rt), "a keep-alive undid a fence");
    assert_eq!(watchdog(&rt)["paused_by_watchdog"], false);
    rt.thaw_vms(std::slice::from_ref(&id));
    assert!(!paused(&rt));
    assert_eq!(code(&rt, &id, "w + 2").2.as_deref(), Some("5"));
    rt.kill(&id).unwrap();
    assert!(rt.running_vmms().is_empty());
}
