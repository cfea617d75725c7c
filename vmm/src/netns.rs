//! An isolated network namespace for a VM started outside the sandbox runtime (a template
//! build, `ember run`, a benchmark): the TAP its snapshot names and nothing else — no uplink,
//! no route out. Host-side orchestration, like [`crate::launcher`]; the VMM process itself
//! only joins it (between fork and exec) and opens the TAP by name.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Where network namespaces are mounted (`ip netns` convention).
pub const NETNS_DIR: &str = "/run/netns";

/// Errors creating the namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// An `ip` command failed.
    #[error("{0} (is iproute2 installed, and are we root?)")]
    Tool(ToolError),
    /// The namespace could not be opened.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The namespace's path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// A host tool (`ip`, `nft`) that failed.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// It could not be started (missing?) or waited for.
    #[error("cannot run `{cmd}`: {source}")]
    Spawn {
        /// The command line.
        cmd: String,
        /// Why.
        source: std::io::Error,
    },
    /// It exited unsuccessfully.
    #[error("`{cmd}` failed: {stderr}")]
    Failed {
        /// The command line (and its input, one line).
        cmd: String,
        /// The first lines of its error output.
        stderr: String,
    },
}

/// Runs `cmd args` (with `stdin` on its standard input) in the calling thread's namespaces
/// and returns its standard output.
pub fn run_tool(cmd: &str, args: &[&str], stdin: Option<&[u8]>) -> Result<String, ToolError> {
    use std::io::Write;
    let shown = || format!("{cmd} {}", args.join(" "));
    let spawn = |source| ToolError::Spawn {
        cmd: shown(),
        source,
    };
    let mut child = Command::new(cmd)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn)?;
    if let (Some(bytes), Some(mut w)) = (stdin, child.stdin.take()) {
        w.write_all(bytes).map_err(spawn)?;
    }
    let out = child.wait_with_output().map_err(spawn)?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let input = stdin
            .map(|s| format!(" <<< {}", String::from_utf8_lossy(s).replace('\n', "; ")))
            .filter(|s| s.len() < 400)
            .unwrap_or_default();
        return Err(ToolError::Failed {
            cmd: format!("{}{input}", shown()),
            stderr: err.lines().take(6).collect::<Vec<_>>().join("; "),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ip(args: &[&str], stdin: Option<&str>) -> Result<(), NetnsError> {
    run_tool("ip", args, stdin.map(str::as_bytes))
        .map(drop)
        .map_err(NetnsError::Tool)
}

/// A throwaway namespace holding TAPs and nothing else. Deleted on drop.
#[derive(Debug)]
pub struct IsolatedNetns {
    name: String,
    path: PathBuf,
}

impl IsolatedNetns {
    /// Creates `em-iso-<random>` with `lo` up and, for each `(tap, cidr)`, a TAP with that
    /// address (or none) and up.
    pub fn create(taps: &[(&str, Option<&str>)]) -> Result<IsolatedNetns, NetnsError> {
        Self::create_owned(taps, None)
    }

    /// [`IsolatedNetns::create`] with TAPs owned by `owner` (uid and gid), so that a VMM
    /// that dropped privileges in a jail can open them.
    pub fn create_owned(
        taps: &[(&str, Option<&str>)],
        owner: Option<u32>,
    ) -> Result<IsolatedNetns, NetnsError> {
        reclaim_orphans();
        let mut b = [0u8; 4];
        // SAFETY: the buffer is valid for 4 writable bytes; a short read only weakens the
        // name's randomness (the pid is in it too).
        let _ = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
        let name = format!(
            "em-iso-{}-{:02x}{:02x}{:02x}{:02x}",
            std::process::id(),
            b[0],
            b[1],
            b[2],
            b[3]
        );
        ip(&["netns", "add", &name], None)?;
        let ns = IsolatedNetns {
            path: Path::new(NETNS_DIR).join(&name),
            name,
        };
        let mut batch = String::from("link set lo up\n");
        for (tap, cidr) in taps {
            match owner {
                Some(u) => batch.push_str(&format!(
                    "tuntap add dev {tap} mode tap user {u} group {u}\n"
                )),
                None => batch.push_str(&format!("tuntap add dev {tap} mode tap\n")),
            }
            if let Some(c) = cidr {
                batch.push_str(&format!("addr add {c} dev {tap}\n"));
            }
            batch.push_str(&format!("link set {tap} up\n"));
        }
        ip(&["-n", &ns.name, "-batch", "-"], Some(&batch))?;
        Ok(ns)
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its path under [`NETNS_DIR`].
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves the calling thread into the namespace (processes it starts afterwards are
    /// there too). For a CLI's main thread, before it starts anything.
    pub fn enter(&self) -> Result<(), NetnsError> {
        let file = File::open(&self.path).map_err(|source| NetnsError::Open {
            path: self.path.clone(),
            source,
        })?;
        // SAFETY: setns(2) on a descriptor `file` holds open for the call; it changes only
        // the calling thread's network namespace.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(NetnsError::Open {
                path: self.path.clone(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Makes `command` start inside the namespace.
    pub fn enter_on_exec(&self, command: &mut Command) -> Result<(), NetnsError> {
        use std::os::unix::process::CommandExt;
        let file = File::open(&self.path).map_err(|source| NetnsError::Open {
            path: self.path.clone(),
            source,
        })?;
        let fd = file.as_raw_fd();
        let enter = move || {
            let _keep = &file;
            // SAFETY: setns(2) on a descriptor that `file` (owned by this closure, which the
            // command keeps until it is dropped) holds open; it changes only the calling
            // (child) process's network namespace.
            if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        };
        // SAFETY: the closure runs in the child between fork and exec and makes one system
        // call, which is async-signal-safe; it allocates nothing and takes no lock.
        unsafe {
            command.pre_exec(enter);
        }
        Ok(())
    }
}

/// Deletes the isolated namespaces of processes that no longer run (a `kill -9` of
/// `ember run` leaves its namespace behind; the next one cleans up).
pub fn reclaim_orphans() -> usize {
    let Ok(entries) = std::fs::read_dir(NETNS_DIR) else {
        return 0;
    };
    let mut n = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("em-iso-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists()
            && ip(&["netns", "del", &name], None).is_ok()
        {
            n += 1;
        }
    }
    n
}

impl Drop for IsolatedNetns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name], None);
    }
}

/// The TAP names a snapshot's VM configuration uses (empty: no network device).
pub fn snapshot_taps(snapshot: &Path) -> Result<Vec<String>, crate::persist::SnapshotError> {
    let state = crate::persist::load_state(snapshot, &crate::persist::RestoreOptions::default())?;
    Ok(state.config.net.iter().map(|n| n.tap.clone()).collect())
}

/// An isolated namespace with the TAPs of `snapshot`, or None when it has no network device.
pub fn for_snapshot(snapshot: &Path) -> Result<Option<IsolatedNetns>, String> {
    let taps = snapshot_taps(snapshot).map_err(|e| e.to_string())?;
    if taps.is_empty() {
        return Ok(None);
    }
    let list: Vec<(&str, Option<&str>)> = taps.iter().map(|t| (t.as_str(), None)).collect();
    IsolatedNetns::create(&list)
        .map(Some)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_isolated_namespace_holds_its_taps_and_goes_on_drop() {
        if !Path::new("/dev/net/tun").exists() || unsafe_free_uid() != 0 {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "needs root and /dev/net/tun"
            );
            eprintln!("SKIPPED: needs root and /dev/net/tun");
            return;
        }
        let ns = IsolatedNetns::create(&[("tap0", Some("172.30.0.1/30")), ("tap1", None)])
            .expect("create");
        let path = ns.path().to_path_buf();
        assert!(path.exists());
        let out = Command::new("ip")
            .args(["-n", ns.name(), "-o", "link", "show"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("tap0") && text.contains("tap1"), "{text}");
        assert_eq!(text.lines().count(), 3, "lo and the two TAPs only: {text}");
        let mut cmd = Command::new("cat");
        cmd.arg("/proc/self/net/dev");
        ns.enter_on_exec(&mut cmd).unwrap();
        let devs = String::from_utf8_lossy(&cmd.output().unwrap().stdout).into_owned();
        assert!(
            devs.contains("tap0"),
            "the child is not in the namespace: {devs}"
        );
        drop(ns);
        assert!(!path.exists());
        // One left behind by a process that is gone is reclaimed; a live one's is not.
        let stale = format!("em-iso-{}-deadbeef", u32::MAX - 1);
        ip(&["netns", "add", &stale], None).unwrap();
        let live = IsolatedNetns::create(&[]).unwrap();
        assert!(
            !Path::new(NETNS_DIR).join(&stale).exists(),
            "stale namespace kept"
        );
        assert!(live.path().exists());
    }

    fn unsafe_free_uid() -> u32 {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Uid:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(u32::MAX)
    }
}
