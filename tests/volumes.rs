//! Volumes end to end (docs/volumes.md): real sandboxes from the `default` template mount
//! volumes (FUSE in the guest, the runtime's file server over vsock) and the content API reads
//! and writes them from outside.
//!
//! - a volume written by sandbox A (killed) is read by B and C at once, from outside, after a
//!   fork, after a pause and resume, and after the runtime restarts;
//! - a write cut off by SIGKILL of the VMM leaves the old content (never torn);
//! - a volume at its cap answers ENOSPC in the guest (and `volume_full` outside), and the
//!   sandbox and the volume go on working;
//! - paths that leave the volume are refused by the content API, symlinks included;
//! - a second, unprivileged local account cannot read a volume's files.
//!
//! The figures (throughput inside a sandbox and through the content API, the cost of a mount
//! at create) are printed as `FIGURE` lines.

use std::io::Cursor;
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use ember_agent::protocol::{EventKind, ExecRequest};
use ember_runtime::volumes::VolumeMount;
use ember_runtime::{CreateRequest, ForkRequest, Runtime, RuntimeError, SnapshotRequest};
use ember_tests::*;

fn prerequisites(test: &str) -> bool {
    let root = is_root();
    if root && std::path::Path::new("/dev/kvm").exists() {
        return true;
    }
    skip(
        test,
        &format!("the volumes test needs root and /dev/kvm (root: {root})"),
    );
    false
}

/// Runs `cmd` with `sh -c` in sandbox `id`: (exit code, stdout, stderr).
fn sh(rt: &Runtime, id: &str, cmd: &str) -> (i32, String, String) {
    let mut out = Vec::new();
    let mut err = Vec::new();
    let mut code = -1;
    let mut req = ExecRequest::new(["/bin/sh", "-c", cmd]);
    // A hang guard: a busy 2-core host (two test lanes) has taken 100 s for three 4 MiB copies.
    req.timeout_ms = Some(300_000);
    rt.exec(id, &req, &mut |ev| {
        match ev {
            EventKind::Stdout { data } => out.extend_from_slice(data),
            EventKind::Stderr { data } => err.extend_from_slice(data),
            EventKind::Exit(ember_agent::protocol::ExitStatus::Code(c)) => code = *c,
            EventKind::Exit(ember_agent::protocol::ExitStatus::Signal(s)) => code = 128 + s,
            _ => {}
        }
        true
    })
    .unwrap_or_else(|e| panic!("exec {cmd:?} in {id}: {e}"));
    (
        code,
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

fn sh_ok(rt: &Runtime, id: &str, cmd: &str) -> String {
    let (code, out, err) = sh(rt, id, cmd);
    assert_eq!(code, 0, "{cmd:?} in {id}: stdout {out:?} stderr {err:?}");
    out
}

fn with_volumes(mounts: &[&str]) -> CreateRequest {
    CreateRequest {
        volume_mounts: mounts
            .iter()
            .map(|m| VolumeMount::parse(m).expect("mount spec"))
            .collect(),
        ..Default::default()
    }
}

fn read_outside(rt: &Runtime, vol: &str, path: &str) -> Vec<u8> {
    let mut out = Vec::new();
    rt.volume_read_file(vol, path, &mut out)
        .unwrap_or_else(|e| panic!("content API read {vol}:{path}: {e}"));
    out
}

/// Bytes of the test's blob: 4 MiB (the guest is slow on kvm_pvm hosts, ~1 MiB/s for any file
/// copy), or `EMBER_TEST_VOLUME_MIB` MiB for the figures.
fn blob_len() -> usize {
    std::env::var("EMBER_TEST_VOLUME_MIB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|m| (1..=256).contains(m))
        .unwrap_or(4)
        << 20
}

fn mib_per_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / d.as_secs_f64()
}

/// dd's own figure (`… copied, 0.5 s, 33.5 MB/s`) from its stderr.
fn dd_rate(stderr: &str) -> String {
    stderr
        .lines()
        .find(|l| l.contains("copied"))
        .and_then(|l| l.rsplit(", ").next())
        .unwrap_or("?")
        .trim()
        .to_string()
}

#[test]
fn a_volume_outlives_its_writer_and_is_shared_by_readers_forks_and_restarts() {
    if !prerequisites("a_volume_outlives_its_writer_and_is_shared_by_readers_forks_and_restarts") {
        return;
    }
    let (home, rt) = runtime_for_test();
    let t0 = Instant::now();
    let blob_bytes = blob_len();
    rt.create_volume("shared", Some(1 << 30)).unwrap();

    // The cost of a mount at create: the same create with and without one.
    let t = Instant::now();
    let plain = rt.create(&CreateRequest::default()).unwrap();
    let plain_ms = t.elapsed().as_secs_f64() * 1e3;
    rt.kill(&plain.id).unwrap();
    let t = Instant::now();
    let a = rt.create(&with_volumes(&["shared:/mnt/shared"])).unwrap();
    let mounted_ms = t.elapsed().as_secs_f64() * 1e3;
    eprintln!(
        "FIGURE create without a volume {plain_ms:.0} ms, with one mount {mounted_ms:.0} ms \
         (mount cost ~{:.0} ms)",
        mounted_ms - plain_ms
    );

    // Data from outside (content API), then A copies it within the volume and writes its own.
    let src: Vec<u8> = (0..blob_bytes as u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let sum_a = format!("{}\n", sha256_hex(&src));
    let t = Instant::now();
    rt.volume_write_file("shared", "/src.bin", &mut Cursor::new(&src))
        .unwrap();
    eprintln!(
        "FIGURE content API write {} MiB: {:.0} MiB/s",
        blob_bytes >> 20,
        mib_per_s(blob_bytes, t.elapsed())
    );
    let (code, out, err) = sh(
        &rt,
        &a.id,
        "set -e; echo hello from A > /mnt/shared/a.txt; mkdir -p /mnt/shared/d/e; \
         dd if=/mnt/shared/src.bin of=/dev/null bs=1M 2>&1 | tail -1 >&2; \
         dd if=/mnt/shared/src.bin of=/mnt/shared/d/e/blob bs=1M conv=fsync 2>&1 | tail -1 >&2; \
         dd if=/mnt/shared/src.bin of=/tmp/copy bs=1M conv=fsync 2>&1 | tail -1 >&2; \
         ls /mnt/shared; stat -c %s /mnt/shared/d/e/blob",
    );
    assert_eq!(code, 0, "{out} {err}");
    let rates: Vec<&str> = err.lines().collect();
    eprintln!(
        "FIGURE guest, {} MiB dd bs=1M: read from a volume {}; volume to volume {}; volume to \
         its own disk {}",
        blob_bytes >> 20,
        dd_rate(rates.first().copied().unwrap_or("")),
        dd_rate(rates.get(1).copied().unwrap_or("")),
        dd_rate(rates.get(2).copied().unwrap_or("")),
    );
    assert!(
        out.contains("a.txt") && out.contains(&blob_bytes.to_string()),
        "{out}"
    );
    rt.kill(&a.id).unwrap();

    // B and C mount it (C read-only) and read at once.
    let b = rt.create(&with_volumes(&["shared:/data"])).unwrap();
    let c = rt.create(&with_volumes(&["shared:/data:ro"])).unwrap();
    let got: Vec<(String, String)> = std::thread::scope(|s| {
        let hs: Vec<_> = [&b.id, &c.id]
            .into_iter()
            .map(|id| {
                let rt = &rt;
                s.spawn(move || {
                    let (code, out, err) = sh(
                        rt,
                        id,
                        "cat /data/a.txt && sha256sum /data/d/e/blob | cut -d' ' -f1",
                    );
                    assert_eq!(code, 0, "{id}: {err}");
                    (out, err)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (out, _) in &got {
        assert!(out.starts_with("hello from A\n"), "{out}");
        assert!(out.ends_with(&sum_a), "{out} vs {sum_a}");
    }
    // The read-only mount refuses writes.
    let (code, _, err) = sh(&rt, &c.id, "echo x > /data/nope");
    assert_ne!(code, 0);
    assert!(err.contains("Read-only"), "{err}");

    // From outside, through the content API.
    assert_eq!(read_outside(&rt, "shared", "/a.txt"), b"hello from A\n");
    let t = Instant::now();
    let blob = read_outside(&rt, "shared", "/d/e/blob");
    eprintln!(
        "FIGURE content API read {} MiB: {:.0} MiB/s",
        blob_bytes >> 20,
        mib_per_s(blob.len(), t.elapsed())
    );
    assert_eq!(sha256_hex(&blob), sum_a.trim());
    rt.volume_write_file("shared", "/api/blob", &mut Cursor::new(&blob))
        .unwrap();
    // What the API wrote, B sees (after the attribute cache's second).
    std::thread::sleep(Duration::from_millis(1100));
    let sum_b = sh_ok(&rt, &b.id, "sha256sum /data/api/blob | cut -d' ' -f1");
    assert_eq!(sum_b, sum_a);
    let info = rt.volume("shared").unwrap();
    assert_eq!(info.used_bytes, 3 * blob_bytes as u64 + 13, "{info:?}");
    assert_eq!(info.mounted_by.len(), 2, "{info:?}");
    // Delete is refused while mounted.
    let e = rt.delete_volume("shared", false).unwrap_err();
    assert_eq!(e.code(), "volume_in_use", "{e}");

    // A fork mounts the same volume: its write is seen outside and by its parent.
    let kids = rt
        .fork(
            &b.id,
            &ForkRequest {
                count: 1,
                timeout_secs: None,
                metadata: None,
            },
        )
        .unwrap();
    sh_ok(&rt, &kids[0].id, "echo from the fork > /data/fork.txt");
    assert_eq!(read_outside(&rt, "shared", "fork.txt"), b"from the fork\n");
    assert_eq!(sh_ok(&rt, &b.id, "cat /data/fork.txt"), "from the fork\n");
    // A named snapshot carries its mounts: a sandbox created from it has the same volume.
    rt.snapshot(
        &b.id,
        &SnapshotRequest {
            name: Some("with-volume".into()),
            ..Default::default()
        },
    )
    .unwrap();
    let from_snap = rt
        .create(&CreateRequest {
            snapshot: Some("with-volume".into()),
            ..Default::default()
        })
        .unwrap();
    sh_ok(
        &rt,
        &from_snap.id,
        "echo from the snapshot > /data/snap.txt",
    );
    assert_eq!(
        read_outside(&rt, "shared", "snap.txt"),
        b"from the snapshot\n"
    );
    rt.kill(&from_snap.id).unwrap();
    rt.delete_snapshot("with-volume").unwrap();
    // Pause and resume: the mount comes back.
    rt.pause(&b.id).unwrap();
    rt.resume(&b.id).unwrap();
    sh_ok(&rt, &b.id, "echo after resume > /data/resumed.txt");
    assert_eq!(
        read_outside(&rt, "shared", "resumed.txt"),
        b"after resume\n"
    );

    // A server restart (the runtime reopened on the same home) loses nothing.
    drop(rt);
    let rt = reopen_runtime(home.path());
    assert_eq!(read_outside(&rt, "shared", "/a.txt"), b"hello from A\n");
    assert_eq!(
        rt.volume("shared").unwrap().used_bytes,
        info.used_bytes + 14 + 18 + 13
    );
    rt.delete_volume("shared", true).unwrap();
    assert!(matches!(rt.volume("shared"), Err(RuntimeError::Volume(_))));
    eprintln!(
        "volumes: shared test took {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn a_write_cut_off_by_a_vmm_kill_leaves_the_old_content() {
    if !prerequisites("a_write_cut_off_by_a_vmm_kill_leaves_the_old_content") {
        return;
    }
    let (_home, rt) = runtime_for_test();
    rt.create_volume("crash", Some(64 << 20)).unwrap();
    let old = b"the old content\n".repeat(1000);
    rt.volume_write_file("crash", "f.bin", &mut Cursor::new(&old))
        .unwrap();
    let a = rt.create(&with_volumes(&["crash:/v"])).unwrap();
    // A writer that rewrites the file in place, 8 MiB, and holds it open.
    let mut req = ExecRequest::new([
        "/bin/sh",
        "-c",
        "exec python3 -c \"import os,time\nf=open('/v/f.bin','r+b')\nfor i in range(8):\n    \
         f.write(b'N'*(1<<20)); f.flush()\nopen('/tmp/written','w').close()\ntime.sleep(600)\"",
    ]);
    req.background = true;
    rt.exec(&a.id, &req, &mut |_| true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    while sh(&rt, &a.id, "test -e /tmp/written").0 != 0 {
        assert!(
            Instant::now() < deadline,
            "the writer never finished writing"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Mid-write (written, not closed): SIGKILL the VMM.
    let pid = rt.get(&a.id).unwrap().pid.expect("VMM pid") as i32;
    // SAFETY: kill(2) of the VMM's pid, which this test's runtime started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while rt.get(&a.id).map(|i| !i.state.is_final()).unwrap_or(false) {
        assert!(
            Instant::now() < deadline,
            "the runtime did not notice the VMM died"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(read_outside(&rt, "crash", "f.bin"), old, "the file is torn");
    assert_eq!(rt.volume("crash").unwrap().used_bytes, old.len() as u64);
    // The next sandbox sees the old content, and writes through.
    let b = rt.create(&with_volumes(&["crash:/v"])).unwrap();
    assert_eq!(
        sh_ok(&rt, &b.id, "head -c 16 /v/f.bin"),
        "the old content\n"
    );
    sh_ok(&rt, &b.id, "printf new > /v/f.bin");
    assert_eq!(read_outside(&rt, "crash", "f.bin"), b"new");
}

#[test]
fn a_volume_at_its_cap_refuses_with_enospc_and_nothing_else_breaks() {
    if !prerequisites("a_volume_at_its_cap_refuses_with_enospc_and_nothing_else_breaks") {
        return;
    }
    let (_home, rt) = runtime_for_test();
    rt.create_volume("small", Some(1 << 20)).unwrap();
    let a = rt.create(&with_volumes(&["small:/v"])).unwrap();
    let (code, _, err) = sh(&rt, &a.id, "dd if=/dev/zero of=/v/big bs=64k count=32");
    assert_ne!(code, 0, "a 2 MiB write into a 1 MiB volume succeeded");
    assert!(err.contains("No space left on device"), "{err}");
    let used = rt.volume("small").unwrap().used_bytes;
    assert!(used <= 1 << 20, "{used}");
    // The sandbox works; removing the file frees the space.
    sh_ok(&rt, &a.id, "rm /v/big && echo fits > /v/ok && df -k /v >&2");
    assert_eq!(read_outside(&rt, "small", "ok"), b"fits\n");
    assert_eq!(rt.volume("small").unwrap().used_bytes, 5);
    // The content API answers volume_full (HTTP 507) and leaves the volume as it was.
    let e = rt
        .volume_write_file("small", "big", &mut Cursor::new(vec![0u8; 2 << 20]))
        .unwrap_err();
    assert_eq!(e.code(), "volume_full", "{e}");
    assert_eq!(rt.volume("small").unwrap().used_bytes, 5);
    assert!(rt.volume_stat("small", "big").is_err());
    assert_eq!(sh_ok(&rt, &a.id, "cat /v/ok"), "fits\n");
}

#[test]
fn the_content_api_refuses_paths_that_leave_the_volume() {
    if !prerequisites("the_content_api_refuses_paths_that_leave_the_volume") {
        return;
    }
    let (home, rt) = runtime_for_test();
    rt.create_volume("box", None).unwrap();
    rt.volume_write_file("box", "/in/side.txt", &mut Cursor::new(b"in"))
        .unwrap();
    // A symlink someone planted on the host is not followed.
    std::os::unix::fs::symlink("/etc", home.path().join("volumes/box/data/link")).unwrap();
    for bad in [
        "../../../etc/passwd",
        "/in/../../etc/passwd",
        "link/passwd",
        "/link/x",
        "in/\0x",
    ] {
        let mut out = Vec::new();
        let e = rt.volume_read_file("box", bad, &mut out).unwrap_err();
        assert!(
            matches!(e.code(), "invalid_request" | "volume_path_not_found"),
            "{bad}: {e}"
        );
        assert!(out.is_empty());
        assert!(
            rt.volume_write_file("box", bad, &mut Cursor::new(b"x"))
                .is_err(),
            "{bad}"
        );
        assert!(rt.volume_mkdir("box", bad).is_err(), "{bad}");
        assert!(
            rt.volume_rename("box", "in/side.txt", bad).is_err(),
            "{bad}"
        );
    }
    assert!(std::path::Path::new("/etc/passwd").exists());
    assert!(!home.path().join("volumes/x").exists());
    let names: Vec<String> = rt
        .volume_list_files("box", "/")
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["in"]);
    // A bad volume name is refused as such.
    let e = rt.create_volume("../x", None).unwrap_err();
    assert_eq!(e.code(), "invalid_request");
}

#[test]
fn a_second_local_user_cannot_read_volumes() {
    if !prerequisites("a_second_local_user_cannot_read_volumes") {
        return;
    }
    let (home, rt) = runtime_for_test();
    rt.create_volume("private", None).unwrap();
    rt.volume_write_file("private", "secret.txt", &mut Cursor::new(b"mine"))
        .unwrap();
    // Even with $EMBER_HOME itself open to all, the volumes directory is the server's alone.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mode = std::fs::metadata(home.path().join("volumes"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "volumes directory mode {mode:o}");
    let file = home.path().join("volumes/private/data/secret.txt");
    for cmd in [
        format!("cat {}", file.display()),
        format!("ls {}", home.path().join("volumes").display()),
    ] {
        let out = std::process::Command::new("/bin/sh")
            .args(["-c", &cmd])
            .uid(65534)
            .gid(65534)
            .output()
            .expect("run as nobody");
        assert!(
            !out.status.success(),
            "{cmd} as nobody succeeded: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
            "{cmd}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_http_surfaces_cli_and_e2b_sdk_reach_volumes() {
    if !prerequisites("the_http_surfaces_cli_and_e2b_sdk_reach_volumes") {
        return;
    }
    let Some(venv) = std::env::var_os("EMBER_E2B_VENV").map(std::path::PathBuf::from) else {
        skip(
            "the_http_surfaces_cli_and_e2b_sdk_reach_volumes",
            "no E2B Python SDK venv (EMBER_E2B_VENV; run `bash scripts/e2b-sdks.sh`)",
        );
        return;
    };
    template("default");
    let home = tempfile::Builder::new()
        .prefix("ember-vol-serve-")
        .tempdir()
        .unwrap();
    let srv = Serve::start(home.path(), false);
    let token = srv.token();
    let cli = |args: &[&str], stdin: &[u8]| ember_client(&srv.url, &token, args, stdin);
    let ok = |o: std::process::Output| {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    // The CLI: create, put, cat, ls-files, mkdir, mv, ls, rm (refused while mounted).
    ok(cli(&["volume", "create", "clivol", "--cap", "1M"], b""));
    ok(cli(
        &["volume", "put", "clivol", "-", "/a/b.txt"],
        b"via cli\n",
    ));
    assert_eq!(
        ok(cli(&["volume", "cat", "clivol", "a/b.txt"], b"")),
        "via cli\n"
    );
    ok(cli(&["volume", "mkdir", "clivol", "/dir/sub"], b""));
    ok(cli(
        &["volume", "mv", "clivol", "/a/b.txt", "/dir/b.txt"],
        b"",
    ));
    let files = ok(cli(&["volume", "ls-files", "clivol", "/dir"], b""));
    assert!(
        files.contains("/dir/b.txt") && files.contains("/dir/sub/"),
        "{files}"
    );
    let sb = ok(cli(
        &["sandbox", "create", "--volume", "clivol:/mnt/c:ro"],
        b"",
    ));
    let sb = sb.trim();
    let out = ok(cli(&["exec", sb, "--", "cat", "/mnt/c/dir/b.txt"], b""));
    assert!(out.contains("via cli"), "{out}");
    let refused = cli(&["volume", "rm", "clivol"], b"");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("mounted"));
    let listed = ok(cli(&["volume", "ls"], b""));
    assert!(listed.contains("clivol") && listed.contains(sb), "{listed}");
    // Native HTTP: past the cap is 507, a path that leaves the volume 400, no token 401.
    let auth = format!("Bearer {token}");
    // The status of a PUT of `body` to `path` of clivol.
    let put = |path: &str, body: &[u8]| -> u16 {
        match ureq::put(&format!("{}/v1/volumes/clivol/files", srv.url))
            .query("path", path)
            .set("Authorization", &auth)
            .send_bytes(body)
        {
            Ok(r) => r.status(),
            Err(ureq::Error::Status(s, _)) => s,
            Err(e) => panic!("PUT {path}: {e}"),
        }
    };
    assert_eq!(put("/big", &vec![0u8; 2 << 20]), 507);
    assert_eq!(put("/../../x", b"x"), 400);
    let anon = ureq::get(&format!("{}/v1/volumes", srv.url)).call();
    assert!(matches!(anon, Err(ureq::Error::Status(401, _))), "{anon:?}");
    ok(cli(&["sandbox", "kill", sb], b""));
    ok(cli(&["volume", "rm", "clivol"], b""));

    // The E2B SDK's Volume class, and volume_mounts at create.
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("e2b/test_volumes.py");
    let out = std::process::Command::new(venv.join("bin/python"))
        .arg(&script)
        .env("E2B_API_KEY", &token)
        .env("E2B_API_URL", &srv.url)
        .env("E2B_SANDBOX_URL", &srv.url)
        .env("E2B_VOLUME_API_URL", &srv.url)
        .output()
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the SDK script failed:\n{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        srv.log_tail(60)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(v["from_guest"], "from-guest\n", "{v}");
    assert_eq!(v["in_b"], "from-sdk", "{v}");
    assert_eq!(
        v["listed"],
        serde_json::json!(["guest.txt", "made", "sdk"]),
        "{v}"
    );
    assert_eq!(v["after"], serde_json::json!(["guest.txt", "sdk"]), "{v}");
    assert_eq!(v["info_name"], "e2b-vol", "{v}");
    assert_eq!(v["destroyed"], true, "{v}");
}
