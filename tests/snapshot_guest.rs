//! Snapshots of a real Linux guest running the ember agent, restored as clones: vsock, the
//! agent protocol, clone safety (fresh entropy), copy-on-write disks and memory.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ember_agent::client::Client;
use ember_agent::protocol::ExecRequest;
use ember_tests::{kernel, rootfs, RunningVmm, AGENT_CMDLINE};
use ember_vmm::api::{call, AfterSnapshot, Request, SnapshotKind};

const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
const AGENT_PORT: u32 = 1024;

fn os(v: &[&str]) -> Vec<OsString> {
    v.iter().map(OsString::from).collect()
}

fn sh(client: &mut Client<std::os::unix::net::UnixStream>, script: &str) -> String {
    let out = client
        .exec(&ExecRequest::new(["/bin/sh", "-c", script]))
        .unwrap_or_else(|e| panic!("exec {script:?}: {e}"));
    assert!(
        out.status.success(),
        "{script:?}: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn connect(uds: &Path) -> Client<std::os::unix::net::UnixStream> {
    let mut last = None;
    for _ in 0..50 {
        match Client::connect_uds(uds, AGENT_PORT, Duration::from_secs(60)) {
            Ok(mut c) => {
                // Twenty guests share two host cores here: allow slow calls.
                let mut l = c.limits();
                l.timeout = Duration::from_secs(300);
                c.set_limits(l);
                return c;
            }
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("cannot reach the agent through {}: {last:?}", uds.display());
}

/// A 16 MiB zero base image for a scratch disk.
fn base_image(dir: &Path) -> PathBuf {
    let p = dir.join("scratch-base.img");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(16 << 20).unwrap();
    p
}

fn sha(path: &Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string()
}

/// The clone numbers NN of every `clone-NN-data` tag in `data` (one pass).
fn clone_tags(data: &[u8]) -> Vec<usize> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(p) = data[at..].iter().position(|&b| b == b'c') {
        let s = at + p;
        if data[s..].starts_with(b"clone-")
            && data.len() >= s + 13
            && &data[s + 8..s + 13] == b"-data"
        {
            if let Ok(n) = std::str::from_utf8(&data[s + 6..s + 8])
                .unwrap_or("x")
                .parse()
            {
                if !found.contains(&n) {
                    found.push(n);
                }
            }
        }
        at = s + 1;
    }
    found.sort_unstable();
    found
}

/// Boots the template VM: root read-only, a scratch overlay disk, vsock, the agent.
fn boot_template(dir: &Path) -> (RunningVmm, PathBuf, PathBuf) {
    let base = base_image(dir);
    let overlay = dir.join("template.overlay");
    let uds = dir.join("template.vsock");
    let api = dir.join("template.api");
    let (k, r) = (kernel(), rootfs());
    let mut args = os(&["--kernel"]);
    args.push(k.into());
    args.push("--disk".into());
    args.push(format!("path={},mode=ro,id=rootfs", r.display()).into());
    args.push("--disk".into());
    args.push(
        format!(
            "path={},mode=overlay,base={},id=scratch",
            overlay.display(),
            base.display()
        )
        .into(),
    );
    args.push("--vsock".into());
    args.push(format!("cid=3,uds={}", uds.display()).into());
    args.push("--api-sock".into());
    args.push(api.clone().into());
    args.extend(os(&["--cmdline-append", AGENT_CMDLINE]));
    let mut vm = RunningVmm::start(dir, "template", &args);
    vm.wait_marker(2, BOOT_TIMEOUT);
    (vm, uds, api)
}

/// Checks clone `i` through its vsock socket `uds`: it syncs (the host's clock and fresh
/// entropy, what clones do first), has the template's memory and disk, writes its own tag to
/// its disk and reads it back, and has the host's time. Returns the 32 random bytes (hex) it
/// read after the sync, for the caller to compare with the other clones'.
fn check_clone(i: usize, uds: &Path) -> String {
    let mut c = connect(uds);
    // Clone safety: the host's clock and fresh entropy first.
    c.sync_now().expect("sync");
    // One exec per clone (each guest syscall is expensive on kvm_pvm): inherited memory
    // and disk, a clone-specific write read back, random bytes, the wall clock.
    let mine = format!("clone-{i:02}-data");
    let now_ns = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i128
    };
    let host_before = now_ns();
    let out = sh(
        &mut c,
        &format!(
            "cat /tmp/state; dd if=/dev/vdb bs=13 count=1 2>/dev/null; echo; \
             printf {mine} | dd of=/dev/vdb bs=512 seek=8 conv=fsync 2>/dev/null; \
             dd if=/dev/vdb bs=512 skip=8 count=1 2>/dev/null | head -c {n}; echo; \
             head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; date +%s%N",
            n = mine.len()
        ),
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 5, "clone {i}: {out:?}");
    assert_eq!(lines[0], "template-memory", "clone {i}");
    assert_eq!(lines[1], "template-disk", "clone {i}");
    assert_eq!(lines[2], mine, "clone {i}");
    assert_eq!(lines[3].len(), 64, "clone {i}: {out:?}");
    let host_after = now_ns();
    // The guest read its clock while the host waited for the answer: after the sync it agrees
    // with the host's within 50 ms.
    let guest_now: i128 = lines[4].trim().parse().unwrap();
    let slack = 50_000_000;
    assert!(
        guest_now >= host_before - slack && guest_now <= host_after + slack,
        "clone {i}: guest clock {guest_now} ns, host {host_before}..{host_after} ns \
         (off by {} ms)",
        if guest_now < host_before {
            (host_before - guest_now) / 1_000_000
        } else {
            (guest_now - host_after) / 1_000_000
        }
    );
    lines[3].to_string()
}

#[test]
fn clones_continue_the_template_share_its_disk_and_get_their_own_entropy() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = d.join("scratch-base.img");
    let (mut template, uds, api) = boot_template(d);
    let base_hash = sha(&base);

    // State the clones must inherit: memory (a file in tmpfs) and disk (the overlay).
    let mut c = connect(&uds);
    assert!(c.ping().is_ok());
    sh(&mut c, "echo template-memory > /tmp/state; printf template-disk | dd of=/dev/vdb bs=512 seek=0 conv=fsync 2>/dev/null");
    drop(c);

    let snap = d.join("snap");
    let reply = call(
        &api,
        &Request::Snapshot {
            dir: snap.clone(),
            kind: SnapshotKind::Full,
            after: AfterSnapshot::Exit,
        },
    )
    .unwrap();
    assert_eq!(reply["ok"], true, "{reply}");
    assert!(template.child.wait().unwrap().success());

    // CLONES clones at once, each with its own vsock socket and its own copy of the overlay.
    // Six: enough to see clones apart (entropy, overlays) on both host cores; 20 took ~10 min
    // of CI on a slow kvm_pvm host, and many-sandbox counts are runtime.rs's and network.rs's.
    const CLONES: usize = 6;
    let mut clones = Vec::new();
    for i in 0..CLONES {
        let overlay = d.join(format!("clone{i}.overlay"));
        if i % 2 == 0 {
            // Prepared by the caller from the snapshot's copy...
            std::fs::copy(snap.join("disk1.overlay"), &overlay).unwrap();
        } // ...or created by the restore itself.
        let cuds = d.join(format!("clone{i}.vsock"));
        let mut args = os(&["--restore"]);
        args.push(snap.clone().into());
        args.push("--vsock-uds".into());
        args.push(cuds.clone().into());
        args.extend(os(&["--disk-path", "-", "--disk-path"]));
        args.push(overlay.into());
        clones.push((RunningVmm::start(d, &format!("clone{i}"), &args), cuds));
    }
    // The clones are checked on a few threads at once. A check is seconds of emulated
    // guest-kernel work on one host core (kvm_pvm), so one clone after another left the other
    // core idle: 20 clones took ~125 s that way.
    let socks: Vec<&Path> = clones.iter().map(|(_, cuds)| cuds.as_path()).collect();
    let next = AtomicUsize::new(0);
    let t = std::time::Instant::now();
    let workers = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8);
    let randoms: Vec<(usize, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(cuds) = socks.get(i) else {
                            return done;
                        };
                        done.push((i, check_clone(i, cuds)));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    eprintln!(
        "{CLONES} clones checked on {workers} threads in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(randoms.len(), CLONES);
    let mut seen = std::collections::HashMap::new();
    for (i, random) in &randoms {
        if let Some(j) = seen.insert(random, i) {
            panic!("clones {j} and {i} got the same random bytes");
        }
    }
    // Every clone is still running: they all ran at once.
    for (i, (vm, _)) in clones.iter_mut().enumerate() {
        assert!(vm.child.try_wait().unwrap().is_none(), "clone {i} exited");
    }
    // Each clone's writes stayed in its own overlay; the shared base never changed.
    for i in 0..CLONES {
        let data = std::fs::read(d.join(format!("clone{i}.overlay"))).unwrap();
        let found = clone_tags(&data);
        assert_eq!(
            found,
            vec![i],
            "overlay {i} holds the data of clones {found:?}"
        );
    }
    assert_eq!(sha(&base), base_hash, "the base image was modified");
    // The snapshot's memory file is untouched by the running clones.
    let mem = std::fs::read(snap.join("memory")).unwrap();
    assert!(
        clone_tags(&mem).is_empty(),
        "a clone's write reached the snapshot's memory file"
    );
}
