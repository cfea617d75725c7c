//! The runtime's first agent connection after a restore is the idle connection the snapshot
//! kept (real KVM, real jails): a create from a template, a fork, a fork of that fork, a
//! pause/resume of a clone (a layered snapshot restored a second time) and a create from a
//! named snapshot all take it over with `ATTACH` — the VMM's counters show no transport reset
//! and no reset at restore —, keep the guest's state, and keep working when other
//! connections are opened beside it; a template whose snapshot records no kept connection
//! (built before they existed) and a record that names a connection the VMM does not hold
//! both end in a new connection with the reason said, never a hang.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ember_agent::protocol::{EndStatus, EventKind, ExecRequest};
use ember_runtime::agent_link::{self, KeptConnection};
use ember_runtime::{CreateRequest, ForkRequest, SnapshotRequest};
use ember_runtime::{Runtime, Sandbox, SandboxOptions};
use ember_tests::{bin, runtime_for_test as runtime, template};

fn code(rt: &Runtime, id: &str, src: &str) -> Option<String> {
    let (status, _, text) = ember_tests::run_code(rt, id, src);
    assert_eq!(status, EndStatus::Ok, "{src:?} in {id}");
    text
}

/// How the sandbox's first agent connection was made (`attached`, `connected`, `fallback`).
fn link(rt: &Runtime, id: &str) -> serde_json::Value {
    rt.with_sandbox(id, "link", serde_json::json!({}), |sb| {
        Ok(serde_json::to_value(sb.link()).unwrap())
    })
    .unwrap()
}

/// The VMM's vsock counters.
fn vsock(rt: &Runtime, id: &str) -> serde_json::Value {
    rt.vmm_stats(id).unwrap()["vsock"].clone()
}

/// Asserts that `id` runs on the snapshot's kept connection: taken over with ATTACH, no
/// transport reset, no connection reset at restore or by a CONNECT.
fn assert_attached(rt: &Runtime, id: &str, what: &str) {
    let l = link(rt, id);
    assert_eq!(l["link"], "attached", "{what}: {l}");
    let v = vsock(rt, id);
    assert_eq!(v["preserved_attached"], 1, "{what}: {v}");
    assert_eq!(v["transport_resets"], 0, "{what}: {v}");
    assert_eq!(v["restore_resets"], 0, "{what}: {v}");
    assert_eq!(v["preserved_dropped"], 0, "{what}: {v}");
}

#[test]
fn creates_forks_and_resumes_take_over_the_kept_connection() {
    let (_home, rt) = runtime();
    let t = template("default");
    assert!(
        agent_link::recorded(&t.snapshot_dir()).is_some(),
        "the template's snapshot records no kept agent connection"
    );
    let id = rt.create(&CreateRequest::default()).unwrap().id;
    assert_attached(&rt, &id, "created");
    // The create's audit record says so too.
    let args = ember_tests::create_record_args(&rt, &id);
    assert_eq!(args["vmm"]["agent"]["link"], "attached", "{args}");
    assert_eq!(code(&rt, &id, "x = 41; x + 1").as_deref(), Some("42"));

    // A second connection beside the attached one (a long run_code holds the first): the
    // CONNECT it makes must not reset the attached connection, which keeps working after.
    std::thread::scope(|s| {
        let slow = s.spawn(|| code(&rt, &id, "import time; time.sleep(2); x"));
        std::thread::sleep(Duration::from_millis(300));
        let mut exit = None;
        let end = rt
            .exec(&id, &ExecRequest::new(["/bin/echo", "beside"]), &mut |ev| {
                if let EventKind::Exit(s) = ev {
                    exit = Some(*s);
                }
                true
            })
            .unwrap();
        assert_eq!(end, EndStatus::Ok);
        assert_eq!(exit, Some(ember_agent::protocol::ExitStatus::Code(0)));
        assert_eq!(slow.join().unwrap().as_deref(), Some("41"));
    });
    for _ in 0..3 {
        assert_eq!(code(&rt, &id, "x").as_deref(), Some("41"));
    }
    let v = vsock(&rt, &id);
    assert_eq!(
        v["conns_closed"], 0,
        "a connection was closed or reset: {v}"
    );

    // A fork: the clone takes over the parent's idle connection the snapshot kept.
    let clone = rt
        .fork(
            &id,
            &ForkRequest {
                count: 1,
                timeout_secs: None,
                metadata: None,
            },
        )
        .unwrap()
        .remove(0)
        .id;
    assert_attached(&rt, &clone, "fork");
    assert_eq!(code(&rt, &clone, "x").as_deref(), Some("41"));
    assert_eq!(code(&rt, &clone, "x = 7; x").as_deref(), Some("7"));
    // The parent is undisturbed.
    assert_eq!(code(&rt, &id, "x").as_deref(), Some("41"));

    // A second restore of the clone: pause (a layered snapshot of a restored VM) and resume.
    rt.pause(&clone).unwrap();
    rt.resume(&clone).unwrap();
    assert_attached(&rt, &clone, "resumed clone");
    assert_eq!(code(&rt, &clone, "x").as_deref(), Some("7"));
    // And a fork of the clone (its connection was itself attached after a restore).
    let grandchild = rt
        .fork(
            &clone,
            &ForkRequest {
                count: 1,
                timeout_secs: None,
                metadata: None,
            },
        )
        .unwrap()
        .remove(0)
        .id;
    assert_attached(&rt, &grandchild, "fork of a resumed clone");
    assert_eq!(code(&rt, &grandchild, "x * 6").as_deref(), Some("42"));

    // A named snapshot, restored by a create.
    rt.snapshot(
        &grandchild,
        &SnapshotRequest {
            name: Some("kept-conn".into()),
            ..Default::default()
        },
    )
    .unwrap();
    let from_snap = rt
        .create(&CreateRequest {
            snapshot: Some("kept-conn".into()),
            ..Default::default()
        })
        .unwrap()
        .id;
    assert_attached(&rt, &from_snap, "create from a named snapshot");
    assert_eq!(code(&rt, &from_snap, "x").as_deref(), Some("7"));
    for s in [&from_snap, &grandchild, &clone, &id] {
        rt.kill(s).unwrap();
    }
}

/// Hard links (or copies) the files of `src` into `dest`, leaving out `skip`.
fn link_dir(src: &Path, dest: &Path, skip: &str) {
    std::fs::create_dir_all(dest).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_name() == skip || !e.file_type().unwrap().is_file() {
            continue;
        }
        let to = dest.join(e.file_name());
        if std::fs::hard_link(e.path(), &to).is_err() {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
}

#[test]
fn snapshots_without_a_usable_record_connect_anew() {
    let (_home, rt) = runtime();
    let t = template("default");
    let scratch = tempfile::tempdir_in(t.dir.parent().unwrap()).unwrap();
    // A template as builds before kept connections left it: no record.
    let old: PathBuf = scratch.path().join("old");
    std::fs::create_dir_all(&old).unwrap();
    std::fs::copy(t.dir.join("template.json"), old.join("template.json")).unwrap();
    link_dir(
        &t.snapshot_dir(),
        &old.join("snapshot"),
        agent_link::RECORD_FILE,
    );
    let id = rt
        .create(&CreateRequest {
            template: Some(old.to_string_lossy().into_owned()),
            ..Default::default()
        })
        .unwrap()
        .id;
    let l = link(&rt, &id);
    assert_eq!(l["link"], "connected", "{l}");
    // The CONNECT reset the connection the snapshot kept (nobody was going to attach).
    let v = vsock(&rt, &id);
    assert_eq!(v["preserved_attached"], 0, "{v}");
    assert_eq!(v["preserved_dropped"], 1, "{v}");
    assert_eq!(code(&rt, &id, "40 + 2").as_deref(), Some("42"));
    rt.kill(&id).unwrap();

    // A record naming a connection the VMM does not hold: a new connection, the reason said.
    let stale = scratch.path().join("stale");
    link_dir(&t.snapshot_dir(), &stale, agent_link::RECORD_FILE);
    let real = agent_link::recorded(&t.snapshot_dir()).unwrap();
    agent_link::record(
        &stale,
        KeptConnection {
            port: real.port,
            host_port: real.host_port.wrapping_add(1),
        },
    )
    .unwrap();
    let opts = SandboxOptions {
        vmm: Some(bin("ember-vmm")),
        connect_timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let sb = Sandbox::restore(&stale, &opts).unwrap();
    match sb.link() {
        Some(agent_link::Link::Fallback { reason, .. }) => {
            assert!(reason.contains("kept no connection"), "{reason}")
        }
        other => panic!("expected a fallback, got {other:?}"),
    }
    assert_eq!(sb.run("6 * 7").unwrap().text(), Some("42"));
    sb.kill().unwrap();
}
