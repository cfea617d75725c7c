//! QEMU `-M microvm` as a boot peer: the same vmlinux (QEMU loads an ELF kernel through its
//! PVH entry note; the bzImage would spend minutes decompressing in kvm_pvm's emulated ring 0),
//! the same rootfs (virtio-mmio block, read-only), memory, vCPU count and command-line masks,
//! timed from spawn to the console line `ember-init: ready` like the other systems. `acpi=off`
//! makes QEMU describe its virtio-mmio devices on the kernel command line (the guest kernel has
//! no ACPI). On kvm_pvm the guest CPU also loses CMPXCHG16B (`-cpu host,-cx16`), the one
//! feature of the `pvm` profile that the VMM sets through CPUID rather than the command line.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::boot::READY_LINE;

/// The QEMU binary named `qemu-system-x86_64` on `PATH`, if any.
pub fn find() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("qemu-system-x86_64"))
        .find(|p| p.is_file())
}

/// `qemu-system-x86_64 --version`'s first line.
pub fn version(bin: &Path) -> Result<String, String> {
    let out = Command::new(bin)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .next()
        .map(str::to_owned)
        .filter(|_| out.status.success())
        .ok_or_else(|| format!("{} --version failed ({})", bin.display(), out.status))
}

/// One QEMU boot's inputs.
#[derive(Debug, Clone)]
pub struct QemuBoot {
    /// The binary.
    pub bin: PathBuf,
    /// Kernel image.
    pub kernel: PathBuf,
    /// Root filesystem (read-only).
    pub rootfs: PathBuf,
    /// Guest memory, MiB.
    pub mem_mib: u64,
    /// vCPUs.
    pub vcpus: u8,
    /// Extra kernel command line (the CPU profile's masks).
    pub cmdline_extra: String,
    /// The `-cpu` model (`host`, or `host,-cx16` for the pvm profile).
    pub cpu: String,
    /// Give up after this long.
    pub timeout: Duration,
}

impl QemuBoot {
    /// The command line.
    pub fn args(&self) -> Vec<String> {
        let mut append = String::from("console=ttyS0 reboot=k panic=1 quiet ro root=/dev/vda");
        if !self.cmdline_extra.is_empty() {
            append.push(' ');
            append.push_str(&self.cmdline_extra);
        }
        vec![
            "-M".into(),
            "microvm,x-option-roms=off,rtc=off,isa-serial=on,acpi=off".into(),
            "-accel".into(),
            "kvm".into(),
            "-cpu".into(),
            self.cpu.clone(),
            "-m".into(),
            format!("{}M", self.mem_mib),
            "-smp".into(),
            self.vcpus.to_string(),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-nographic".into(),
            "-no-reboot".into(),
            "-serial".into(),
            "stdio".into(),
            "-kernel".into(),
            self.kernel.display().to_string(),
            "-append".into(),
            append,
            "-drive".into(),
            format!(
                "id=root,file={},format=raw,if=none,readonly=on",
                self.rootfs.display()
            ),
            "-device".into(),
            "virtio-blk-device,drive=root".into(),
        ]
    }

    /// One boot: spawn → `ember-init: ready` on the console, ms. The error says why QEMU
    /// did not get there (its last stderr lines).
    pub fn once(&self) -> Result<f64, String> {
        let start = Instant::now();
        let mut child = Command::new(&self.bin)
            .args(self.args())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.bin.display()))?;
        let (tx, rx) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(out).split(b'\n') {
                    let Ok(line) = line else { break };
                    if String::from_utf8_lossy(&line).contains(READY_LINE) {
                        let _ = tx.send(start.elapsed().as_secs_f64() * 1e3);
                    }
                }
            });
        }
        let mut err = child.stderr.take();
        let ready = rx.recv_timeout(self.timeout);
        let _ = child.kill();
        let status = child.wait();
        match ready {
            Ok(ms) => Ok(ms),
            Err(_) => {
                let mut text = String::new();
                if let Some(e) = err.as_mut() {
                    let _ = e.read_to_string(&mut text);
                }
                let tail: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
                let tail = tail[tail.len().saturating_sub(2)..].join(" / ");
                let how = if start.elapsed() >= self.timeout {
                    format!("no '{READY_LINE}' within {} s", self.timeout.as_secs())
                } else {
                    match status {
                        Ok(s) => format!("exited ({s}) before '{READY_LINE}'"),
                        Err(e) => format!("exited before '{READY_LINE}' ({e})"),
                    }
                };
                Err(if tail.is_empty() {
                    how
                } else {
                    format!("{how}: {tail}")
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_carries_the_same_guest() {
        let q = QemuBoot {
            bin: "qemu".into(),
            kernel: "/k/bzImage".into(),
            rootfs: "/r/rootfs.ext4".into(),
            mem_mib: 256,
            vcpus: 1,
            cmdline_extra: "noxsave".into(),
            cpu: "host,-cx16".into(),
            timeout: Duration::from_secs(1),
        };
        let a = q.args().join(" ");
        assert!(a.contains("-M microvm"), "{a}");
        assert!(a.contains("-m 256M"), "{a}");
        assert!(a.contains("acpi=off"), "{a}");
        assert!(a.contains("-cpu host,-cx16"), "{a}");
        assert!(a.contains("root=/dev/vda noxsave"), "{a}");
        assert!(
            a.contains("file=/r/rootfs.ext4,format=raw,if=none,readonly=on"),
            "{a}"
        );
    }

    #[test]
    fn a_missing_binary_is_an_error_not_a_panic() {
        let q = QemuBoot {
            bin: "/nonexistent/qemu".into(),
            kernel: "/k".into(),
            rootfs: "/r".into(),
            mem_mib: 64,
            vcpus: 1,
            cmdline_extra: String::new(),
            cpu: "host".into(),
            timeout: Duration::from_secs(1),
        };
        assert!(q.once().unwrap_err().contains("cannot start"));
        assert!(version(Path::new("/nonexistent/qemu")).is_err());
    }
}
