//! Runs `ember-agent` as PID 1 of a fresh PID and mount namespace on the host, end to end: mounts,
//! boot marker, the `ember.run` command, its status line, and the reboot (which, in a PID
//! namespace, the kernel turns into SIGHUP for the namespace's init instead of a host reboot).
//!
//! Needs root and util-linux's `unshare`; skipped (with a line on stderr) otherwise. The init sees
//! a tmpfs on `/dev` with a regular file as `/dev/port`, so the marker byte lands in that file and
//! never on a real I/O port, and the host's devtmpfs is never mounted or touched.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output};

use ember_agent::cmdline::run_arg;
use ember_agent::init::CMDLINE_OVERRIDE_ENV;
use ember_agent::marker::BOOT_MARKER_PORT;

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
