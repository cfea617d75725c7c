//! Runs `ember-agent` as PID 1 of a fresh PID and mount namespace on the host, end to end: mounts,
//! boot marker, the `ember.run` command, its status line, and the reboot (which, in a PID
//! namespace, the kernel turns into SIGHUP for the namespace's init instead of a host reboot);
//! and with `ember.agent`, the server (on a Unix socket instead of vsock), its exec calls, and
//! PID 1's reaping. `sync` is not sent: it would set the host's clock.
//!
//! Needs root and util-linux's `unshare`; skipped (with a line on stderr) otherwise. The init sees
//! a tmpfs on `/dev` with a regular file as `/dev/port`, so the marker byte lands in that file and
//! never on a real I/O port, and the host's devtmpfs is never mounted or touched.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ember_agent::client::Client;
use ember_agent::cmdline::run_arg;
use ember_agent::init::{AGENT_UNIX_LISTEN_ENV, CMDLINE_OVERRIDE_ENV};
use ember_agent::marker::BOOT_MARKER_PORT;
use ember_agent::protocol::{ExecRequest, ExitStatus};

/// Prepares the namespace, then execs the init as PID 1.
const SETUP: &str = "mount -t tmpfs ember-test-dev /dev && touch /dev/port && exec \"$1\"";

fn can_run() -> bool {
    // SAFETY: geteuid has no preconditions and no memory effects.
    let root = unsafe { libc::geteuid() } == 0;
    let unshare = Command::new("unshare")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !(root && unshare) {
        eprintln!("skipped: needs root and unshare (root={root}, unshare={unshare})");
    }
    root && unshare
}

fn boot(cmdline: &str) -> Output {
    Command::new("unshare")
        .args(["--pid", "--fork", "--mount", "--propagation", "private"])
        .args(["sh", "-c", SETUP, "sh", env!("CARGO_BIN_EXE_ember-agent")])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env(CMDLINE_OVERRIDE_ENV, cmdline)
        .output()
        .expect("running unshare")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn runs_the_command_writes_the_marker_and_reboots() {
    if !can_run() {
        return;
    }
    let command = format!(
        "echo \"hello $HOME $TERM\"; od -An -tu1 -j {BOOT_MARKER_PORT} -N1 /dev/port; \
         test -L /dev/fd && test -d /dev/shm && grep -q ' /tmp tmpfs ' /proc/mounts && echo mounts-ok; \
         exit 3"
    );
    let out = boot(&format!(
        "console=ttyS0 {} ember.colour=blue",
        run_arg(&command)
    ));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGHUP),
        "{stdout}\n{stderr}"
    );
    assert_eq!(
        stdout,
        "ember-init: ready\nhello /root linux\n   1\nmounts-ok\n\
         ember-init: command exited with status 3\n",
        "stderr: {stderr}"
    );
    assert!(
        stderr.contains("ember-init: warning: unknown key \"ember.colour\" ignored\n"),
        "{stderr}"
    );
}

#[test]
fn quiet_keeps_only_the_status_line() {
    if !can_run() {
        return;
    }
    let out = boot(&format!("{} ember.quiet", run_arg("kill -9 $$")));
    assert_eq!(
        text(&out.stdout),
        "ember-init: command killed by signal 9\n"
    );
}

#[test]
fn without_a_command_it_says_so_and_reboots() {
    if !can_run() {
        return;
    }
    let out = boot("console=ttyS0 ro");
    assert_eq!(out.status.signal(), Some(libc::SIGHUP));
    assert_eq!(
        text(&out.stdout),
        "ember-init: ready\nember-init: no command given; rebooting\n"
    );
}

#[test]
fn a_bad_command_line_is_reported_and_still_reboots() {
    if !can_run() {
        return;
    }
    let out = boot("ember.run=%%%");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGHUP), "{stderr}");
    assert!(
        stderr.contains("ember-init: error: bad kernel command line: ember.run: value \"%%%\""),
        "{stderr}"
    );
    assert!(
        stderr.contains("ember-init: error: not running anything; rebooting"),
        "{stderr}"
    );
}

/// The agent as PID 1 of a namespace, serving on a Unix socket (there is no vsock transport on
/// a test host). Killed, with its namespace, when dropped.
struct Agent {
    child: std::process::Child,
    socket: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Like [`SETUP`], plus the device nodes the server opens.
const AGENT_SETUP: &str = "mount -t tmpfs ember-test-dev /dev && touch /dev/port \
     && mknod -m 666 /dev/null c 1 3 && exec \"$1\"";

/// A scratch directory outside every path the init mounts over.
fn agent_dir() -> tempfile::TempDir {
    let target = env!("CARGO_TARGET_TMPDIR");
    let hidden = ["/tmp", "/run", "/dev", "/proc", "/sys"]
        .iter()
        .any(|p| std::path::Path::new(target).starts_with(p));
    if hidden {
        tempfile::tempdir_in("/var/tmp").unwrap()
    } else {
        tempfile::tempdir_in(target).unwrap()
    }
}

fn boot_agent(cmdline: &str) -> Agent {
    // Not under /tmp or /run: the init mounts its own tmpfs there (and a checkout may itself
    // live under /tmp, as CI's does).
    let dir = agent_dir();
    let socket = dir.path().join("agent.sock");
    let child = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--kill-child",
            "--mount",
            "--propagation",
            "private",
        ])
        .args([
            "sh",
            "-c",
            AGENT_SETUP,
            "sh",
            env!("CARGO_BIN_EXE_ember-agent"),
        ])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env(CMDLINE_OVERRIDE_ENV, cmdline)
        .env(AGENT_UNIX_LISTEN_ENV, &socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running unshare");
    Agent {
        child,
        socket,
        _dir: dir,
    }
}

impl Agent {
    fn connect(&self) -> Client<UnixStream> {
        // Generous: CI machines may be busy, and this only bounds a failure.
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(stream) = UnixStream::connect(&self.socket) {
                return Client::new(stream);
            }
            assert!(Instant::now() < deadline, "the agent never listened");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kills the agent and returns what it printed.
    fn stop(mut self) -> (String, String) {
        let _ = self.child.kill();
        let (mut out, mut err) = (String::new(), String::new());
        if let Some(mut s) = self.child.stdout.take() {
            let _ = s.read_to_string(&mut out);
        }
        if let Some(mut s) = self.child.stderr.take() {
            let _ = s.read_to_string(&mut err);
        }
        (out, err)
    }
}

fn sh(script: &str) -> ExecRequest {
    let mut req = ExecRequest::new(["/bin/sh", "-c", script]);
    req.timeout_ms = Some(10_000);
    req
}

/// Processes in the namespace that are zombies (state `Z` in /proc/PID/stat).
fn zombies(client: &mut Client<UnixStream>) -> Vec<String> {
    let out = client.exec(&sh("cat /proc/[0-9]*/stat")).unwrap();
    text(&out.stdout)
        .lines()
        .filter(|line| {
            line.rfind(") ")
                .and_then(|i| line[i + 2..].chars().next())
                .is_some_and(|state| state == 'Z')
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn agent_runs_the_command_then_serves_and_reaps_as_pid1() {
    if !can_run() {
        return;
    }
    let agent = boot_agent(&format!("ember.agent {}", run_arg("echo from-run")));
    let mut client = agent.connect();

    let pong = client.ping().unwrap();
    assert_eq!(pong.protocol, ember_agent::protocol::PROTOCOL_VERSION);
    assert_eq!(pong.boot_id.map(|id| id.len()), Some(36));

    // The command's status comes from the PID 1 reaper's registry.
    let out = client.exec(&sh("echo hi; echo err >&2; exit 7")).unwrap();
    assert_eq!(
        (out.stdout, out.stderr),
        (b"hi\n".to_vec(), b"err\n".to_vec())
    );
    assert_eq!(out.status, ExitStatus::Code(7));

    // Marker 2 was the last byte written to the port.
    let out = client
        .exec(&sh(&format!(
            "od -An -tu1 -j {BOOT_MARKER_PORT} -N1 /dev/port"
        )))
        .unwrap();
    assert_eq!(text(&out.stdout).trim(), "2");

    // An orphan is re-parented to PID 1 and reaped when it exits.
    let out = client.exec(&sh("sleep 0.3 & echo $!")).unwrap();
    let orphan = text(&out.stdout).trim().to_owned();
    let out = client
        .exec(&sh(&format!("cut -d' ' -f4 /proc/{orphan}/stat")))
        .unwrap();
    assert_eq!(
        text(&out.stdout).trim(),
        "1",
        "the orphan's parent is PID 1"
    );
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(zombies(&mut client), Vec::<String>::new());

    // A timed-out command is killed, and a second connection works alongside the first.
    let mut second = agent.connect();
    let mut req = sh("sleep 30");
    req.timeout_ms = Some(200);
    let out = second.exec(&req).unwrap();
    assert!(out.timed_out);
    assert_eq!(out.status, ExitStatus::Signal(libc::SIGKILL));
    client.ping().unwrap();

    let (stdout, stderr) = agent.stop();
    let socket_line = stdout
        .lines()
        .find(|l| l.starts_with("ember-init: agent listening on unix socket "));
    assert!(
        stdout
            .starts_with("ember-init: ready\nfrom-run\nember-init: command exited with status 0\n")
            && socket_line.is_some(),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert!(!stderr.contains("ember-init: error"), "{stderr}");
}

#[test]
fn a_bad_agent_port_is_refused_and_the_guest_reboots() {
    if !can_run() {
        return;
    }
    let out = boot("ember.agent=vsock");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGHUP), "{stderr}");
    assert!(stderr.contains("not a vsock port"), "{stderr}");
}
