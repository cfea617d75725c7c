//! Integration tests: real namespaces, real cgroups, real mounts. They need
//! root (they skip with a message otherwise). The "VMM" is `jail-probe`,
//! which reports what it sees from inside the jail.

use std::collections::HashMap;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ember_jailer::{detect_version, CgroupLimits, CgroupVersion, Cgroups};

const UID: u32 = 12345;
const GID: u32 = 23456;
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

fn can_run() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipping: this test needs root");
        return false;
    }
    // The jail always gets these device nodes.
    for dev in ["/dev/kvm", "/dev/net/tun", "/dev/urandom"] {
        if !Path::new(dev).exists() {
            eprintln!("skipping: the host has no {dev}");
            return false;
        }
    }
    true
}

/// A scratch chroot base plus the pieces every jail run needs.
struct Fixture {
    tmp: tempfile::TempDir,
    id: String,
    parent: String,
}

impl Fixture {
    fn new(name: &str) -> Self {
        let tmp = tempfile::Builder::new()
            .prefix("ember-jailer-test")
            .tempdir()
            .unwrap();
        let id = format!("{name}-{}", std::process::id());
        Self {
            parent: format!("ember-test-{id}"),
            id,
            tmp,
        }
    }

    fn base(&self) -> PathBuf {
        self.tmp.path().join("jails")
    }

    fn jail_dir(&self) -> PathBuf {
        self.base().join(&self.id)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    /// `ember-jailer` with id, probe, uid/gid, base, test cgroup parent and
    /// the probe's shared libraries.
    fn jailer(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ember-jailer"));
        c.args([
            "--id",
            &self.id,
            "--exec-file",
            env!("CARGO_BIN_EXE_jail-probe"),
        ]);
        c.args(["--uid", &UID.to_string(), "--gid", &GID.to_string()]);
        c.arg("--chroot-base").arg(self.base());
        c.args(["--cgroup-parent", &self.parent]);
        c.args(probe_lib_args());
        c
    }

    fn cleanup(&self) -> Output {
        Command::new(env!("CARGO_BIN_EXE_ember-jailer"))
            .args(["cleanup", "--id", &self.id, "--cgroup-parent", &self.parent])
            .arg("--chroot-base")
            .arg(self.base())
            .output()
            .unwrap()
    }

    /// Cleans up, then checks nothing of the jail is left: directory,
    /// cgroups, mounts. Removes the test's parent cgroups.
    fn cleanup_and_check(&self) {
        let out = self.cleanup();
        assert!(
            out.status.success(),
            "cleanup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!self.jail_dir().exists(), "jail dir left behind");
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            !info.contains(&self.jail_dir().display().to_string()),
            "mount left behind:\n{info}"
        );
        for leaf in cgroup_dirs(&self.parent, &self.id) {
            assert!(!leaf.exists(), "cgroup {leaf:?} left behind");
        }
        remove_parent_cgroups(&self.parent);
        // Idempotent.
        let again = self.cleanup();
        assert!(again.status.success());
    }
}

/// Every place a leaf cgroup of `id` could be.
fn cgroup_dirs(parent: &str, id: &str) -> Vec<PathBuf> {
    let root = Path::new(CGROUP_ROOT);
    match detect_version(root).unwrap() {
        CgroupVersion::V2 => vec![root.join(parent).join(id)],
        CgroupVersion::V1 => ["cpu", "cpuset", "memory", "pids"]
            .iter()
            .map(|c| root.join(c).join(parent).join(id))
            .collect(),
    }
}

fn remove_parent_cgroups(parent: &str) {
    let root = Path::new(CGROUP_ROOT);
    let _ = fs::remove_dir(root.join(parent));
    for c in ["cpu", "cpuset", "memory", "pids"] {
        let _ = fs::remove_dir(root.join(c).join(parent));
    }
}

/// `--file` arguments for the probe's ELF interpreter and libraries (none
/// when it is linked statically).
fn probe_lib_args() -> Vec<String> {
    let probe = Path::new(env!("CARGO_BIN_EXE_jail-probe"));
    let Some(interp) = ember_jailer::jailfs::elf_interpreter(probe).unwrap() else {
        return Vec::new();
    };
    let out = Command::new(&interp)
        .arg("--list")
        .arg(probe)
        .output()
        .unwrap();
    assert!(out.status.success(), "{interp:?} --list failed");
    let mut args = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let line = line.trim();
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line
                .split_whitespace()
                .next()
                .filter(|p| p.starts_with('/')),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            args.push("--file".to_string());
            args.push(format!("{p}:{p}"));
        }
    }
    args
}

fn report(stdout: &[u8]) -> HashMap<String, String> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn read(p: impl AsRef<Path>) -> String {
    fs::read_to_string(p.as_ref())
        .unwrap_or_else(|e| panic!("{:?}: {e}", p.as_ref()))
        .trim()
        .to_string()
}

#[test]
fn probe_sees_only_the_jail() {
    if !can_run() {
        return;
    }
    let f = Fixture::new("basic");
    // What the VM would get: a kernel, a rootfs layer it writes, a socket
    // directory, a read-only and a writable bind mount.
    fs::write(f.path("vmlinux"), b"kernel").unwrap();
    fs::write(f.path("rootfs.ext4"), b"rootfs").unwrap();
    fs::create_dir(f.path("sock")).unwrap();
    fs::create_dir(f.path("ro")).unwrap();
    fs::write(f.path("ro/keep"), b"host data").unwrap();
    fs::create_dir(f.path("rw")).unwrap();
    // Bind sources keep their host ownership: the caller makes them writable.
    std::os::unix::fs::chown(f.path("rw"), Some(UID), Some(GID)).unwrap();
    // A file on another filesystem must be copied, not linked.
    let shm = Path::new("/dev/shm").join(format!("ember-jailer-test-{}", f.id));
    let other_fs = fs::write(&shm, b"other fs").is_ok()
        && fs::metadata(&shm).unwrap().dev() != fs::metadata(f.tmp.path()).unwrap().dev();

    let mut cmd = f.jailer();
    cmd.arg("--file")
        .arg(format!("{}:/vmlinux", f.path("vmlinux").display()));
    cmd.arg("--file").arg(format!(
        "{}:/rootfs.ext4:rw",
        f.path("rootfs.ext4").display()
    ));
    cmd.arg("--file")
        .arg(format!("{}:/run/sock:rw", f.path("sock").display()));
    cmd.arg("--bind")
        .arg(format!("{}:/data:ro", f.path("ro").display()));
    cmd.arg("--bind")
        .arg(format!("{}:/scratch", f.path("rw").display()));
    if other_fs {
        cmd.arg("--file").arg(format!("{}:/copied", shm.display()));
    }
    cmd.args([
        "--env",
        "EMBER_A=1",
        "--env",
        "EMBER_B=x=y",
        "--userfaultfd",
    ]);
    cmd.args(["--rlimit", "nofile=64", "--rlimit", "fsize=1048576:2097152"]);
    cmd.args(["--keep-fd", "9"]);
    cmd.env("LEAK_ME", "host-secret");
    // fd 9 is passed on; fd 10 is inherited without being asked for.
    let keep = fs::File::open("/dev/null").unwrap();
    let leak = fs::File::open("/dev/null").unwrap();
    let (keep_fd, leak_fd) = {
        use std::os::fd::AsRawFd;
        (keep.as_raw_fd(), leak.as_raw_fd())
    };
    let dup_fds = move || {
        for (from, to) in [(keep_fd, 9), (leak_fd, 10)] {
            // SAFETY: dup2 on descriptors this process owns; async-signal-safe.
            if unsafe { libc::dup2(from, to) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    };
    // SAFETY: the closure only calls dup2, which is async-signal-safe.
    unsafe { cmd.pre_exec(dup_fds) };
    cmd.args([
        "--",
        "report",
        "read",
        "/vmlinux",
        "write",
        "/vmlinux",
        "write",
        "/rootfs.ext4",
    ]);
    cmd.args([
        "create",
        "/run/sock/api.sock",
        "create",
        "/data/x",
        "create",
        "/scratch/x",
    ]);
    cmd.args([
        "read",
        "/data/keep",
        "create",
        "/new-in-root",
        "read",
        "/copied",
    ]);
    let out = cmd.output().unwrap();
    let _ = fs::remove_file(&shm);
    let r = report(&out.stdout);
    assert!(
        out.status.success(),
        "stderr: {}\nstdout: {}",
        text(&out.stderr),
        text(&out.stdout)
    );

    assert_eq!(r["uid"], format!("{UID}/{UID}/{UID}"));
    assert_eq!(r["gid"], format!("{GID}/{GID}/{GID}"));
    assert_eq!(r["groups"], "0");
    assert_eq!(r["nnp"], "1");
    assert_eq!(r["setuid0"], format!("err:{}", libc::EPERM));
    let mut root: Vec<&str> = r["root"].split(',').collect();
    root.retain(|e| !["lib", "lib64", "usr"].contains(e));
    let mut want = vec![
        "data",
        "dev",
        "ember-vmm",
        "rootfs.ext4",
        "run",
        "scratch",
        "vmlinux",
    ];
    if other_fs {
        want.insert(0, "copied");
    }
    assert_eq!(root, want);
    // Host files are out of reach by absolute path.
    assert_eq!(r["hostfile"], format!("err:{}", libc::ENOENT));
    assert_eq!(r["hostroot"], format!("err:{}", libc::ENOENT));
    // Devices: the host's numbers, owned by the VMM's ids.
    assert_eq!(r["kvm"], "ok");
    assert_eq!(r["kvm_api"], "12,vm", "the jailed uid can create a VM");
    assert_eq!(r["urandom"], "ok");
    let mut want_devs = Vec::new();
    for (p, mode) in [
        ("/dev/kvm", "600"),
        ("/dev/net/tun", "600"),
        ("/dev/urandom", "666"),
        ("/dev/userfaultfd", "600"),
    ] {
        let rdev = fs::metadata(p).unwrap().rdev();
        want_devs.push(format!(
            "{p}:{mode}:{UID}:{GID}:{}:{}",
            libc::major(rdev),
            libc::minor(rdev)
        ));
    }
    assert_eq!(r["devices"], want_devs.join(";"));
    // Environment, descriptors, rlimits.
    assert_eq!(r["env"], "EMBER_A=1;EMBER_B=x=y");
    assert_eq!(r["fds"], "0,1,2,9");
    assert_eq!(r["nofile"], "64:64");
    assert_eq!(r["fsize"], "1048576:2097152");
    assert_eq!(
        r["cgroup"],
        format!("err:{}", libc::ENOENT),
        "no /proc unless asked"
    );
    // Files: read-only ones stay read-only, `rw` ones are writable.
    assert_eq!(r["read:/vmlinux"], "ok");
    assert_eq!(r["write:/vmlinux"], format!("err:{}", libc::EACCES));
    assert_eq!(r["write:/rootfs.ext4"], "ok");
    assert_eq!(r["create:/run/sock/api.sock"], "ok");
    assert_eq!(r["create:/data/x"], format!("err:{}", libc::EROFS));
    assert_eq!(r["create:/scratch/x"], "ok");
    assert_eq!(r["read:/data/keep"], "ok");
    assert_eq!(r["create:/new-in-root"], format!("err:{}", libc::EACCES));
    if other_fs {
        assert_eq!(r["read:/copied"], "ok");
    }

    // Host side: the kernel is a hard link, the rw rootfs chowned (same
    // inode, so the host file too), the binary a 0555 copy.
    let root_dir = f.jail_dir().join("root");
    let k = fs::metadata(root_dir.join("vmlinux")).unwrap();
    assert_eq!(k.ino(), fs::metadata(f.path("vmlinux")).unwrap().ino());
    let rootfs = fs::metadata(f.path("rootfs.ext4")).unwrap();
    assert_eq!((rootfs.uid(), rootfs.gid()), (UID, GID));
    assert_eq!(read(f.path("rootfs.ext4")), "rootfsx");
    let exe = fs::metadata(root_dir.join("ember-vmm")).unwrap();
    assert_eq!(exe.mode() & 0o7777, 0o555);
    assert_ne!(
        exe.ino(),
        fs::metadata(env!("CARGO_BIN_EXE_jail-probe"))
            .unwrap()
            .ino()
    );
    if other_fs {
        // A copy: its own inode on the jail's filesystem.
        let c = fs::metadata(root_dir.join("copied")).unwrap();
        assert_eq!(c.dev(), fs::metadata(&root_dir).unwrap().dev());
        assert_eq!(read(root_dir.join("copied")), "other fs");
    }
    assert!(
        f.path("rw/x").exists(),
        "writes through the rw bind reach the host"
    );
    // The bind mounts lived only in the jail's mount namespace.
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!info.contains(&f.jail_dir().display().to_string()));

    f.cleanup_and_check();
    // Clean-up never deletes through a bind mount.
    assert_eq!(read(f.path("ro/keep")), "host data");
}

#[test]
fn cgroup_limits_and_membership() {
    if !can_run() {
        return;
    }
    let root = Path::new(CGROUP_ROOT);
    let version = detect_version(root).unwrap();
    let f = Fixture::new("cgroups");
    let mut cmd = f.jailer();
    cmd.args(["--cpu-quota-us", "20000", "--cpu-period-us", "100000"]);
    cmd.args([
        "--memory-limit",
        "256M",
        "--pids-max",
        "16",
        "--cpuset-cpus",
        "0",
    ]);
    cmd.args(["--", "wait"]);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    // Without a PID namespace the jailer execs the VMM: same pid.
    assert_eq!(line.trim(), format!("waiting pid={}", child.id()), "{line}");
    let pid = child.id().to_string();

    let host_view = read(format!("/proc/{pid}/cgroup"));
    let rel = format!("/{}/{}", f.parent, f.id);
    match version {
        CgroupVersion::V1 => {
            let leaf = |c: &str| root.join(c).join(&f.parent).join(&f.id);
            assert_eq!(read(leaf("cpu").join("cpu.cfs_quota_us")), "20000");
            assert_eq!(read(leaf("cpu").join("cpu.cfs_period_us")), "100000");
            assert_eq!(
                read(leaf("memory").join("memory.limit_in_bytes")),
                "268435456"
            );
            assert_eq!(read(leaf("pids").join("pids.max")), "16");
            assert_eq!(read(leaf("cpuset").join("cpuset.cpus")), "0");
            // cpuset: the parent was initialised, the leaf's mems copied.
            let parent = root.join("cpuset").join(&f.parent);
            assert_eq!(
                read(parent.join("cpuset.cpus")),
                read(root.join("cpuset/cpuset.cpus"))
            );
            assert_eq!(
                read(leaf("cpuset").join("cpuset.mems")),
                read(parent.join("cpuset.mems"))
            );
            for c in ["cpu", "cpuset", "memory", "pids"] {
                assert_eq!(read(leaf(c).join("cgroup.procs")), pid, "{c}");
                assert!(
                    host_view
                        .lines()
                        .any(|l| l.contains(c) && l.ends_with(&rel)),
                    "{c} not in {host_view}"
                );
            }
        }
        CgroupVersion::V2 => {
            let leaf = root.join(&f.parent).join(&f.id);
            assert_eq!(read(leaf.join("cpu.max")), "20000 100000");
            assert_eq!(read(leaf.join("memory.max")), "268435456");
            assert_eq!(read(leaf.join("pids.max")), "16");
            assert_eq!(read(leaf.join("cgroup.procs")), pid);
            assert!(host_view.contains(&format!("0::{rel}")), "{host_view}");
        }
    }
    // The jailed process's root is the jail.
    let jail_root = fs::read_link(format!("/proc/{pid}/root")).unwrap();
    assert_eq!(
        jail_root,
        Path::new("/"),
        "pivot_root makes the jail `/` of its namespace"
    );
    let mounts = read(format!("/proc/{pid}/mountinfo"));
    assert_eq!(
        mounts.lines().count(),
        1,
        "only the jail root is mounted:\n{mounts}"
    );

    // While the VMM runs, clean-up refuses and removes nothing.
    let busy = f.cleanup();
    assert_eq!(busy.status.code(), Some(1));
    assert!(
        text(&busy.stderr).contains("is still in use"),
        "{}",
        text(&busy.stderr)
    );
    assert!(f.jail_dir().join("root/ember-vmm").exists());
    child.stdin.take().unwrap().write_all(b"\n").unwrap();
    let status = child.wait().unwrap();
    assert!(status.success());
    f.cleanup_and_check();
}

#[test]
fn pid_namespace_proc_and_fork_limit() {
    if !can_run() {
        return;
    }
    let f = Fixture::new("pidns");
    let mut cmd = f.jailer();
    cmd.args(["--new-pid-ns", "--mount-proc", "--pids-max", "4"]);
    cmd.args(["--", "report", "fork", "10"]);
    // A caller that ignores and blocks signals: the VMM must not inherit
    // that, and the jailer must still reap its child.
    let ignore = || {
        let mut set = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
        // SAFETY: plain signal-state calls on this (pre-exec) child with a
        // locally owned sigset.
        unsafe {
            libc::signal(libc::SIGCHLD, libc::SIG_IGN);
        }
        // SAFETY: as above.
        unsafe {
            libc::signal(libc::SIGINT, libc::SIG_IGN);
        }
        // SAFETY: `set` is initialised by sigemptyset before use.
        unsafe {
            libc::sigemptyset(set.as_mut_ptr());
        }
        // SAFETY: `set` is initialised.
        unsafe {
            libc::sigaddset(set.as_mut_ptr(), libc::SIGUSR1);
        }
        // SAFETY: `set` is initialised; the old mask is not needed.
        unsafe {
            libc::sigprocmask(libc::SIG_BLOCK, set.as_ptr(), std::ptr::null_mut());
        }
        Ok(())
    };
    // SAFETY: the closure only makes async-signal-safe signal calls.
    unsafe { cmd.pre_exec(ignore) };
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r = report(&out.stdout);
    assert_eq!(r["pid"], "1");
    // Nothing ignored but SIGPIPE, which the probe's own Rust runtime sets.
    let ignored = u64::from_str_radix(&r["sigign"], 16).unwrap();
    assert_eq!(ignored & !(1 << (libc::SIGPIPE - 1)), 0, "{}", r["sigign"]);
    assert_eq!(r["sigblk"], "0000000000000000");
    assert_eq!(r["capeff"], "0000000000000000");
    assert_eq!(r["nonewprivs"], "1");
    // Only pid entries in /proc.
    assert_eq!(r["proc"], "self,thread-self");
    let rel = format!("/{}/{}", f.parent, f.id);
    assert!(
        r["cgroup"]
            .split(';')
            .any(|l| (l.contains(":pids:") || l.starts_with("0::")) && l.ends_with(&rel)),
        "{}",
        r["cgroup"]
    );
    // pids.max = 4: the probe itself plus at most 3 children.
    let fork = &r["forked"];
    let forked: usize = fork.split_whitespace().next().unwrap().parse().unwrap();
    assert!(forked <= 3, "{fork}");
    assert!(fork.ends_with(&format!("err={}", libc::EAGAIN)), "{fork}");
    f.cleanup_and_check();
}

#[test]
fn oom_kill_is_reported() {
    if !can_run() {
        return;
    }
    let f = Fixture::new("oom");
    let out = f
        .jailer()
        .args(["--new-pid-ns", "--memory-limit", "32M"])
        .args(["--", "alloc", "8", "alloc", "256"])
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGKILL), "{stderr}");
    assert!(
        text(&out.stdout).contains("alloc=8"),
        "the small allocation fits"
    );
    assert!(
        stderr.contains(
            "ember-jailer: VMM was killed by the OOM killer (memory limit 33554432 bytes)"
        ),
        "{stderr}"
    );
    let c = f.cleanup();
    assert!(text(&c.stderr).contains("OOM kill"), "{}", text(&c.stderr));
    f.cleanup_and_check();
}

#[test]
fn pid_namespace_propagates_status_and_forwards_signals() {
    if !can_run() {
        return;
    }
    let f = Fixture::new("status");
    let out = f
        .jailer()
        .args(["--new-pid-ns", "--", "exit", "7"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    f.cleanup_and_check();

    let f = Fixture::new("signal");
    let mut child = f
        .jailer()
        .args(["--new-pid-ns", "--", "wait"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "waiting pid=1");
    // Keep the probe's stdin open: EOF would also end its wait.
    let stdin = child.stdin.take();
    // SAFETY: signalling the jailer we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    drop(stdin);
    assert_eq!(status.code(), Some(42), "SIGTERM reaches the VMM's handler");
    f.cleanup_and_check();
}

#[test]
fn bad_arguments_are_usage_errors() {
    if !can_run() {
        return;
    }
    let f = Fixture::new("badargs");
    fs::create_dir_all(f.base().join("taken")).unwrap();
    let probe = env!("CARGO_BIN_EXE_jail-probe");
    let base = f.base().display().to_string();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_ember-jailer"))
            .args(args)
            .output()
            .unwrap()
    };
    let std_args = |id: &str, exec: &str, uid: &str, gid: &str, base: &str| -> Vec<String> {
        [
            "--id",
            id,
            "--exec-file",
            exec,
            "--uid",
            uid,
            "--gid",
            gid,
            "--chroot-base",
            base,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            std_args("a", "target/jail-probe", "1", "1", &base),
            "VMM binary \"target/jail-probe\" is not an absolute path",
        ),
        (
            std_args("a", probe, "1", "1", &format!("{base}/../x")),
            "contains a `..` component",
        ),
        (
            std_args("a", "/nonexistent/ember-vmm", "1", "1", &base),
            "VMM binary \"/nonexistent/ember-vmm\" cannot be used",
        ),
        (
            std_args("a", "/tmp", "1", "1", &base),
            "is not a regular file",
        ),
        (std_args("taken", probe, "1", "1", &base), "already exists"),
        (
            std_args("a", probe, "0", "1", &base),
            "uid 0 (root); pass --allow-root",
        ),
        (
            std_args("a", probe, "1", "0", &base),
            "gid 0 (root); pass --allow-root",
        ),
        (
            std_args("a_b", probe, "1", "1", &base),
            "invalid id \"a_b\"",
        ),
        (
            std_args("a", probe, "1", "1", "jails"),
            "chroot base \"jails\" is not an absolute path",
        ),
        (
            [
                std_args("a", probe, "1", "1", &base),
                vec!["--file".into(), "/nonexistent/k:/k".into()],
            ]
            .concat(),
            "--file source \"/nonexistent/k\" cannot be used",
        ),
        (
            [
                std_args("a", probe, "1", "1", &base),
                vec!["--file".into(), "/etc/hostname:/../k".into()],
            ]
            .concat(),
            "contains a `..` component",
        ),
        (
            [
                std_args("a", probe, "1", "1", &base),
                vec!["--rlimit".into(), "nofile=many".into()],
            ]
            .concat(),
            "invalid --rlimit value",
        ),
        (
            [
                std_args("a", probe, "1", "1", &base),
                vec!["--keep-fd".into(), "77".into()],
            ]
            .concat(),
            "--keep-fd 77: not an open file descriptor",
        ),
        (
            [
                std_args("a", probe, "1", "1", &base),
                vec!["--netns".into(), "/var/run/netns/none-such".into()],
            ]
            .concat(),
            "network namespace \"/var/run/netns/none-such\" cannot be used",
        ),
        (
            [
                std_args("a", probe, "1", "1", &base),
                vec!["--cpuset-cpus".into(), "0-".into()],
            ]
            .concat(),
            "invalid --cpuset-cpus",
        ),
        (
            vec!["--id".into(), "a".into()],
            "the following required arguments were not provided",
        ),
        (
            [
                std_args("a", probe, "1", "1", &base),
                vec!["--bogus".into()],
            ]
            .concat(),
            "unexpected argument '--bogus'",
        ),
    ];
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("ember-jailer: error: "),
            "{args:?}: {stderr}"
        );
        assert!(stderr.contains(want), "{args:?}: want {want:?} in {stderr}");
    }
    // Nothing was created for any of them.
    let left: Vec<_> = fs::read_dir(f.base())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left, [std::ffi::OsString::from("taken")]);
    // Clean-up validates too.
    let out = run(&["cleanup", "--id", "../x", "--chroot-base", &base]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("invalid id"));
}

#[test]
fn setup_failure_exits_1_and_rolls_back() {
    if !can_run() {
        return;
    }
    let f = Fixture::new("rollback");
    // A cgroup root where nothing is mounted.
    fs::create_dir(f.path("cg")).unwrap();
    let out = f
        .jailer()
        .arg("--cgroup-root")
        .arg(f.path("cg"))
        .args(["--pids-max", "5", "--", "report"])
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("ember-jailer: error: cgroup v1 controller `pids` is not mounted at"),
        "{stderr}"
    );
    assert!(!f.jail_dir().exists(), "jail dir rolled back");

    // A dynamically linked binary without its loader in the jail.
    let out = Command::new(env!("CARGO_BIN_EXE_ember-jailer"))
        .args([
            "--id",
            &f.id,
            "--exec-file",
            env!("CARGO_BIN_EXE_jail-probe"),
        ])
        .args(["--uid", "1", "--gid", "1", "--chroot-base"])
        .arg(f.base())
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    if ember_jailer::jailfs::elf_interpreter(Path::new(env!("CARGO_BIN_EXE_jail-probe")))
        .unwrap()
        .is_some()
    {
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("is dynamically linked"), "{stderr}");
        assert!(!f.jail_dir().exists(), "jail dir rolled back");
    }

    // A setup failure inside the PID-namespace child is reported by the
    // jailer, and rolled back too: a bind source that vanishes after
    // validation is hard to stage, so use a missing network namespace file
    // that passes validation but is no namespace.
    fs::write(f.path("not-a-netns"), b"").unwrap();
    let out = f
        .jailer()
        .arg("--netns")
        .arg(f.path("not-a-netns"))
        .args(["--new-pid-ns", "--pids-max", "5", "--", "report"])
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot join network namespace"), "{stderr}");
    assert!(out.stdout.is_empty());
    assert!(!f.jail_dir().exists(), "jail dir rolled back");
    for leaf in cgroup_dirs(&f.parent, &f.id) {
        assert!(!leaf.exists(), "cgroup {leaf:?} rolled back");
    }
    remove_parent_cgroups(&f.parent);
}

#[test]
fn joins_network_namespace() {
    if !can_run() {
        return;
    }
    let f = Fixture::new("netns");
    // A process in a fresh network namespace, pinned by a bind mount as
    // `ip netns add` would do.
    let mut holder = Command::new("sleep");
    holder.arg("60");
    let new_netns = || {
        // SAFETY: unshare takes flags only.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    // SAFETY: the closure only calls unshare, a plain system call.
    unsafe { holder.pre_exec(new_netns) };
    let mut holder = holder.spawn().unwrap();
    let ns_file = f.path("netns");
    fs::write(&ns_file, b"").unwrap();
    let src = format!("/proc/{}/ns/net", holder.id());
    mount_bind(Path::new(&src), &ns_file);
    let _ = holder.kill();
    let _ = holder.wait();
    let ino = fs::metadata(&ns_file).unwrap().ino();
    assert_ne!(ino, fs::metadata("/proc/self/ns/net").unwrap().ino());

    let out = f
        .jailer()
        .arg("--netns")
        .arg(&ns_file)
        .args(["--new-pid-ns", "--mount-proc", "--", "report"])
        .output()
        .unwrap();
    // SAFETY: unmounting the namespace file this test mounted.
    unsafe {
        let c = std::ffi::CString::new(ns_file.display().to_string()).unwrap();
        libc::umount2(c.as_ptr(), libc::MNT_DETACH);
    }
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(report(&out.stdout)["netns"], format!("net:[{ino}]"));
    f.cleanup_and_check();
}

fn mount_bind(src: &Path, target: &Path) {
    let s = std::ffi::CString::new(src.display().to_string()).unwrap();
    let t = std::ffi::CString::new(target.display().to_string()).unwrap();
    // SAFETY: valid NUL-terminated strings; null fstype/data are allowed
    // for a bind mount.
    let r = unsafe {
        libc::mount(
            s.as_ptr(),
            t.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    assert_eq!(
        r,
        0,
        "bind {src:?} on {target:?}: {}",
        std::io::Error::last_os_error()
    );
}

#[test]
fn cleanup_unmounts_leftovers_and_is_idempotent() {
    if !can_run() {
        return;
    }
    let f = Fixture::new("leftover");
    // A jail left behind with a bind mount still attached in the host's
    // namespace, and a leftover cgroup.
    let data = f.jail_dir().join("root/data");
    fs::create_dir_all(&data).unwrap();
    fs::create_dir(f.path("precious")).unwrap();
    fs::write(f.path("precious/file"), b"keep me").unwrap();
    mount_bind(&f.path("precious"), &data);
    let limits = CgroupLimits {
        pids_max: Some(3),
        ..Default::default()
    };
    let cg = Cgroups::create(Path::new(CGROUP_ROOT), Path::new(&f.parent), &f.id, &limits).unwrap();
    assert!(cg.leaves()[0].path.exists());

    let out = f.cleanup();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!cg.leaves()[0].path.exists());
    assert_eq!(
        read(f.path("precious/file")),
        "keep me",
        "never delete through a mount"
    );
    f.cleanup_and_check();

    // A jail id that never existed is fine too.
    let never = Fixture::new("never");
    assert!(never.cleanup().status.success());
}

#[test]
fn cgroup_v2_in_a_scratch_hierarchy() {
    if !can_run() {
        return;
    }
    let f = Fixture::new("v2");
    let mnt = f.path("cg2");
    fs::create_dir(&mnt).unwrap();
    let src = std::ffi::CString::new("none").unwrap();
    let target = std::ffi::CString::new(mnt.display().to_string()).unwrap();
    let fstype = std::ffi::CString::new("cgroup2").unwrap();
    // SAFETY: valid NUL-terminated strings; no mount data.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if r != 0 {
        eprintln!(
            "skipping: cannot mount cgroup2: {}",
            std::io::Error::last_os_error()
        );
        return;
    }
    struct Unmount(std::ffi::CString);
    impl Drop for Unmount {
        fn drop(&mut self) {
            // SAFETY: unmounting the scratch hierarchy this test mounted.
            unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
        }
    }
    let _unmount = Unmount(target);
    assert_eq!(detect_version(&mnt).unwrap(), CgroupVersion::V2);
    let available = read(mnt.join("cgroup.controllers"));
    let parent = Path::new(&f.parent);

    // Group creation and membership work whatever controllers exist.
    let cg = Cgroups::create(&mnt, parent, &f.id, &CgroupLimits::default()).unwrap();
    let leaf = mnt.join(parent).join(&f.id);
    assert_eq!(cg.leaves()[0].path, leaf);
    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    cg.join(sleeper.id()).unwrap();
    assert_eq!(read(leaf.join("cgroup.procs")), sleeper.id().to_string());
    let host_view = read(format!("/proc/{}/cgroup", sleeper.id()));
    assert!(
        host_view.contains(&format!("0::/{}/{}", f.parent, f.id)),
        "{host_view}"
    );
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    assert_eq!(cg.remove().unwrap(), vec![leaf.clone()]);

    // Limits: written where the controllers are available (a v2 host),
    // a clear error naming the controller where they are not (hybrid host).
    let limits = CgroupLimits {
        memory_bytes: Some(64 << 20),
        pids_max: Some(9),
        cpu_quota_us: Some(30_000),
        ..Default::default()
    };
    let has = |c: &str| available.split_whitespace().any(|a| a == c);
    match Cgroups::create(&mnt, parent, &f.id, &limits) {
        Ok(cg) => {
            assert!(has("memory") && has("pids") && has("cpu"));
            assert_eq!(read(leaf.join("memory.max")), "67108864");
            assert_eq!(read(leaf.join("pids.max")), "9");
            assert_eq!(read(leaf.join("cpu.max")), "30000 100000");
            cg.remove().unwrap();
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("cgroup v2 controller"), "{msg}");
            assert!(!(has("memory") && has("pids") && has("cpu")), "{msg}");
            assert!(!leaf.exists(), "nothing left on failure");
            eprintln!("v2 limits not testable on this host: {msg}");
        }
    }
    // The binary detects v2 from --cgroup-root and fails or succeeds the same way.
    let out = f
        .jailer()
        .arg("--cgroup-root")
        .arg(&mnt)
        .args(["--pids-max", "9", "--", "report"])
        .output()
        .unwrap();
    if has("pids") {
        assert!(out.status.success(), "{}", text(&out.stderr));
    } else {
        assert_eq!(out.status.code(), Some(1));
        assert!(text(&out.stderr).contains("cgroup v2 controller `pids` is not available"));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_ember-jailer"))
        .args(["cleanup", "--id", &f.id, "--cgroup-parent", &f.parent])
        .arg("--chroot-base")
        .arg(f.base())
        .arg("--cgroup-root")
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!leaf.exists());
    fs::remove_dir(mnt.join(parent)).unwrap();
}

#[test]
fn setup_timings() {
    if !can_run() {
        return;
    }
    // Times a full jail (4 v1 controllers or one v2 group) a few times.
    let mut totals = Vec::new();
    for i in 0..3 {
        let f = Fixture::new(&format!("timing{i}"));
        let start = Instant::now();
        let out = f
            .jailer()
            .args([
                "--print-timings",
                "--memory-limit",
                "128M",
                "--pids-max",
                "32",
            ])
            .args(["--cpu-quota-us", "50000", "--cpuset-cpus", "0"])
            .args(["--", "exit", "0"])
            .output()
            .unwrap();
        let wall = start.elapsed();
        let stderr = text(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let line = stderr
            .lines()
            .find(|l| l.starts_with("ember-jailer: timings: "))
            .unwrap_or_else(|| panic!("no timings in {stderr}"));
        eprintln!("run {i}: wall {wall:?} (spawn to exit); {line}");
        totals.push(wall);
        f.cleanup_and_check();
    }
    assert!(totals.iter().all(|t| *t < Duration::from_secs(10)));
}
