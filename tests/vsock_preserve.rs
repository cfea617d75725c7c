//! vsock connections kept across snapshot and restore, in real guests: a snapshot taken while
//! the host holds an idle agent connection keeps it; a clone's host client takes it over with
//! `ATTACH <port>` (no transport reset, no `accept` in the guest) and it answers, also after a
//! second restore of a clone; a restore with `--vsock-transport-reset` behaves as restores did
//! before (the connection is gone and `ATTACH` connects anew); and a guest that answers a kept
//! connection with garbage, or drops it, cannot hurt the VMM.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ember_agent::client::Client;
use ember_agent::protocol::ExecRequest;
use ember_tests::{kernel, rootfs, vsock_connect, RunningVmm, AGENT_CMDLINE};
use ember_vmm::api::{call, AfterSnapshot, Request, SnapshotKind};
use ember_vmm::vsock_host::attach;

const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
const AGENT_PORT: u32 = 1024;
/// A guest program (started by the test) listens here.
const HOLD_PORT: u32 = 5000;
const T: Duration = Duration::from_secs(120);

fn os(v: &[&str]) -> Vec<OsString> {
    v.iter().map(OsString::from).collect()
}

fn client(stream: UnixStream) -> Client<UnixStream> {
    let mut c = Client::new(stream);
    let mut l = c.limits();
    l.timeout = T;
    c.set_limits(l);
    c
}

fn sh(c: &mut Client<UnixStream>, script: &str) -> String {
    let out = c
        .exec(&ExecRequest::new(["/bin/sh", "-c", script]))
        .unwrap_or_else(|e| panic!("exec {script:?}: {e}"));
    assert!(out.status.success(), "{script:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stats(api: &Path) -> serde_json::Value {
    let r = call(api, &Request::Stats).unwrap();
    assert_eq!(r["ok"], true, "{r}");
    r["stats"].clone()
}

fn snapshot(vm: &mut RunningVmm, api: &Path, dir: &Path) {
    let r = call(
        api,
        &Request::Snapshot {
            dir: dir.to_path_buf(),
            kind: SnapshotKind::Full,
            after: AfterSnapshot::Exit,
        },
    )
    .unwrap();
    assert_eq!(r["ok"], true, "{r}");
    assert!(vm.child.wait().unwrap().success());
}

fn restore(d: &Path, snap: &Path, name: &str, extra: &[&str]) -> (RunningVmm, PathBuf, PathBuf) {
    let uds = d.join(format!("{name}.vsock"));
    let api = d.join(format!("{name}.api"));
    let mut args = os(&["--restore"]);
    args.push(snap.into());
    args.push("--vsock-uds".into());
    args.push(uds.clone().into());
    args.push("--api-sock".into());
    args.push(api.clone().into());
    args.extend(os(extra));
    let vm = RunningVmm::start(d, name, &args);
    let t = Instant::now();
    while !(uds.exists() && api.exists()) {
        assert!(t.elapsed() < T, "{name}: no sockets");
        std::thread::sleep(Duration::from_millis(20));
    }
    (vm, uds, api)
}

/// Retries `f` until it succeeds (a guest program may not be listening yet).
fn retry<V>(what: &str, mut f: impl FnMut() -> std::io::Result<V>) -> V {
    let t = Instant::now();
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if t.elapsed() > T => panic!("{what}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// The template: the agent, plus a guest program that accepts one connection on `HOLD_PORT`,
/// waits for one byte on it, then answers with 256 KiB of garbage and closes it — or, killed
/// first, leaves the kernel to close it. Snapshotted while the host holds an idle agent
/// connection and the program's connection.
fn template(d: &Path) -> PathBuf {
    let uds = d.join("template.vsock");
    let api = d.join("template.api");
    let mut args = os(&["--kernel"]);
    args.push(kernel().into());
    args.push("--disk".into());
    args.push(format!("path={},mode=ro,id=rootfs", rootfs().display()).into());
    args.push("--vsock".into());
    args.push(format!("cid=3,uds={}", uds.display()).into());
    args.push("--api-sock".into());
    args.push(api.clone().into());
    args.extend(os(&["--cmdline-append", AGENT_CMDLINE]));
    let mut vm = RunningVmm::start(d, "template", &args);
    vm.wait_marker(2, BOOT_TIMEOUT);
    let mut c = client(retry("agent", || {
        vsock_connect(&uds, AGENT_PORT, T).inspect(|s| s.set_read_timeout(None).unwrap())
    }));
    let prog = format!(
        "import socket\n\
         s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\n\
         s.bind((socket.VMADDR_CID_ANY, {HOLD_PORT}))\n\
         s.listen(1)\n\
         import os\n\
         open('/tmp/holder-ready', 'w').write(str(os.getpid()))\n\
         c, _ = s.accept()\n\
         c.recv(1)\n\
         c.sendall(b'\\xff' * 262144)\n\
         c.close()\n"
    );
    // In a session of its own (the agent kills an exec's session when it ends), output to a
    // file (so the call ends at once).
    let mut req = ExecRequest::new([
        "/bin/sh",
        "-c",
        "setsid -f python3 -c \"$PROG\" </dev/null >/tmp/holder.log 2>&1",
    ]);
    req.env.insert("PROG".into(), prog);
    let out = c.exec(&req).expect("start the holder");
    assert!(out.status.success(), "{out:?}");
    let t = Instant::now();
    while sh(&mut c, "test -s /tmp/holder-ready && echo yes || true") != "yes\n" {
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "the holder never listened: {}",
            sh(&mut c, "cat /tmp/holder.log")
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let hold = retry("holder", || vsock_connect(&uds, HOLD_PORT, T));
    // Both connections are idle (the agent waits in `read`, the program in `recv`).
    assert!(c.ping().is_ok());
    snapshot(&mut vm, &api, &d.join("snap"));
    drop((c, hold));
    d.join("snap")
}

#[test]
fn kept_connections_answer_after_restore_and_after_a_second_restore() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let snap = template(d);

    // Clone 1: ATTACH takes over the agent connection: no transport reset, no new guest socket.
    let (mut vm1, uds1, api1) = restore(d, &snap, "clone1", &[]);
    let s = stats(&api1);
    assert_eq!(s["vsock"]["preserved_restored"], 2, "{s}");
    let mut a = client(attach(&uds1, AGENT_PORT, T).unwrap());
    let pong = a.ping().expect("ping on the kept connection");
    assert!(pong.uptime_ms > 0);
    a.sync_now().expect("sync on the kept connection");
    let s = stats(&api1);
    assert_eq!(s["vsock"]["preserved_attached"], 1, "{s}");
    assert_eq!(s["vsock"]["transport_resets"], 0, "{s}");
    // The ordinary path still works beside it.
    let mut b = client(vsock_connect(&uds1, AGENT_PORT, T).unwrap());
    assert!(b.ping().is_ok());
    assert_eq!(
        sh(&mut b, "echo clone1 > /tmp/who; cat /tmp/who"),
        "clone1\n"
    );
    // The VMM reported the guest's first answer with KVM's counters.
    let first = vm1
        .events()
        .into_iter()
        .find(|e| e["event"] == "guest_first_data")
        .expect("guest_first_data event");
    assert!(first["mono_ns"].as_u64().is_some(), "{first}");
    if !s["kvm"].is_null() {
        assert!(
            first["kvm"]["vcpu"]["exits"].as_u64().unwrap() > 0,
            "{first}"
        );
        assert!(s["kvm"]["vcpu"]["exits"].as_u64().unwrap() > 0, "{s}");
    } else {
        ember_tests::skip(
            "kept_connections_answer_after_restore_and_after_a_second_restore (in part: the \
             KVM counters)",
            "this kernel has no KVM_GET_STATS_FD: no KVM counters",
        );
    }

    // Snapshot the clone while both its connections are idle and attached; restore that.
    snapshot(&mut vm1, &api1, &d.join("snap2"));
    drop((a, b));
    let (_vm2, uds2, api2) = restore(d, &d.join("snap2"), "clone2", &[]);
    let mut a2 = client(attach(&uds2, AGENT_PORT, T).unwrap());
    assert!(a2.ping().is_ok(), "second restore: first kept connection");
    let mut b2 = client(attach(&uds2, AGENT_PORT, T).unwrap());
    assert_eq!(sh(&mut b2, "cat /tmp/who"), "clone1\n");
    assert!(a2.ping().is_ok());
    let s = stats(&api2);
    assert_eq!(s["vsock"]["preserved_attached"], 2, "{s}");
    assert_eq!(s["vsock"]["transport_resets"], 0, "{s}");
    // None left: a third ATTACH is an ordinary new connection.
    let mut c2 = client(attach(&uds2, AGENT_PORT, T).unwrap());
    assert!(c2.ping().is_ok());
    assert_eq!(stats(&api2)["vsock"]["preserved_attached"], 2);
}

#[test]
fn transport_reset_restores_and_hostile_guests_on_kept_connections() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let snap = template(d);

    // As before connections were kept: a transport reset, nothing to attach to.
    let (_vm0, uds0, api0) = restore(d, &snap, "reset", &["--vsock-transport-reset"]);
    let mut c = retry("agent after a transport reset", || {
        let mut c = client(attach(&uds0, AGENT_PORT, T)?);
        c.ping().map_err(std::io::Error::other)?;
        Ok(c)
    });
    assert!(c.ping().is_ok());
    let s = stats(&api0);
    assert_eq!(s["vsock"]["transport_resets"], 1, "{s}");
    assert_eq!(s["vsock"]["preserved_attached"], 0, "{s}");

    // A client that does not know about ATTACH: its plain CONNECT resets the kept agent
    // connection (the guest's worker blocked on it is freed) and gets a new one.
    let (_vm3, uds3, api3) = restore(d, &snap, "plain", &[]);
    let mut p = client(retry("plain connect", || {
        vsock_connect(&uds3, AGENT_PORT, T)
    }));
    assert!(p.ping().is_ok());
    let s = stats(&api3);
    assert_eq!(s["vsock"]["preserved_dropped"], 1, "{s}");
    assert_eq!(s["vsock"]["transport_resets"], 0, "{s}");
    let mut q = client(attach(&uds3, AGENT_PORT, T).unwrap());
    assert!(q.ping().is_ok());
    assert_eq!(stats(&api3)["vsock"]["preserved_attached"], 0);

    // The guest answers a kept connection with garbage and closes it: the host client reads
    // it to the end, and the VMM and the agent carry on.
    let (mut vm1, uds1, api1) = restore(d, &snap, "garbage", &[]);
    let mut h = attach(&uds1, HOLD_PORT, T).unwrap();
    h.set_read_timeout(Some(T)).unwrap();
    h.write_all(b"x").unwrap();
    let mut got = Vec::new();
    h.read_to_end(&mut got).unwrap();
    assert_eq!(got.len(), 262_144);
    assert!(got.iter().all(|&b| b == 0xff));
    let mut a = client(attach(&uds1, AGENT_PORT, T).unwrap());
    assert!(a.ping().is_ok());
    assert!(vm1.child.try_wait().unwrap().is_none(), "the VMM exited");
    assert_eq!(stats(&api1)["vsock"]["preserved_attached"], 2);

    // The guest kills the program holding a kept connection before anyone attached, then
    // after: the host client sees the end of the stream; the VMM carries on.
    let (mut vm2, uds2, api2) = restore(d, &snap, "killed", &[]);
    let mut a = client(attach(&uds2, AGENT_PORT, T).unwrap());
    assert!(a.ping().is_ok());
    // Counted from here: a connection the guest closed earlier (a slow guest may still be
    // settling its restore) is not the kept one.
    let closed = |api: &Path| stats(api)["vsock"]["conns_closed"].as_u64().unwrap();
    let before = closed(&api2);
    sh(&mut a, "kill -9 $(cat /tmp/holder-ready)");
    // The kernel's RST (or SHUTDOWN) for the dead socket has reached the device: nothing is
    // left to attach to, so ATTACH is an ordinary CONNECT, which nobody accepts.
    let t = Instant::now();
    while closed(&api2) == before {
        assert!(t.elapsed() < T, "the kept connection never closed");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The dying program's listening socket goes a moment after its connection (the kernel
    // releases an exiting task's files last-opened first), so a CONNECT in between can still
    // land in its backlog and is then reset. What must hold: no ATTACH takes over the dead
    // connection, and soon nobody accepts.
    let t = Instant::now();
    while let Ok(mut late) = attach(&uds2, HOLD_PORT, Duration::from_secs(30)) {
        late.set_read_timeout(Some(T)).unwrap();
        let mut got = Vec::new();
        let _ = late.read_to_end(&mut got);
        assert!(got.is_empty(), "a late connection got {} bytes", got.len());
        assert!(
            t.elapsed() < T,
            "the dead program's port still accepts: {}",
            stats(&api2)["vsock"]
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(
        stats(&api2)["vsock"]["preserved_attached"],
        1,
        "the dead connection was attached"
    );
    assert!(a.ping().is_ok());
    assert!(vm2.child.try_wait().unwrap().is_none(), "the VMM exited");
}
