//! Boots tiny hand-assembled guests on real KVM: no Linux needed, so these run in milliseconds
//! and exercise the VMM core (memory, long-mode entry, port-I/O dispatch, boot marker, i8042
//! reset, exit reporting) and its input checks.

use std::path::{Path, PathBuf};

use ember_devices::virtio::block::{BlockConfig, BlockMode};
use ember_vmm::builder::build_boot;
use ember_vmm::report::{Reporter, StartTime};
use ember_vmm::vm::VmExit;
use ember_vmm::{Vm, VmConfig, VmError};

mod common;
use common::elf_with_code;

/// Writes marker byte 7, prints "ok\n" on COM1, then resets through the i8042.
const MARKER_SERIAL_RESET: &[u8] = &[
    0x66, 0xba, 0xf0, 0x0e, // mov dx, 0x0ef0
    0xb0, 0x07, // mov al, 7
    0xee, // out dx, al
    0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
    0xb0, b'o', 0xee, // mov al, 'o'; out dx, al
    0xb0, b'k', 0xee, // mov al, 'k'; out dx, al
    0xb0, b'\n', 0xee, // mov al, '\n'; out dx, al
    0xb0, 0xfe, // mov al, 0xfe
    0xe6, 0x64, // out 0x64, al
    0xf4, // hlt
    0xeb, 0xfd, // jmp back to hlt
];

struct Guest {
    dir: tempfile::TempDir,
    kernel: PathBuf,
}

fn guest(code: &[u8]) -> Guest {
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("mini.elf");
    std::fs::write(&kernel, elf_with_code(code)).unwrap();
    Guest { dir, kernel }
}

fn config(kernel: &Path) -> VmConfig {
    let mut c = VmConfig::new(kernel.to_path_buf());
    c.mem_mib = 64;
    c
}

#[derive(Clone, Default)]
struct Capture(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
impl std::io::Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn boot(cfg: &VmConfig, report: &Path) -> (Result<VmExit, VmError>, String) {
    let out = Capture::default();
    let reporter = Reporter::to_file(report).unwrap();
    let r = build_boot(cfg, Box::new(out.clone()), reporter, StartTime::now()).and_then(Vm::run);
    let s = String::from_utf8_lossy(&out.0.lock().unwrap()).into_owned();
    (r, s)
}

fn events(report: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(report)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn mini_guest_marks_prints_and_resets() {
    let g = guest(MARKER_SERIAL_RESET);
    let report = g.dir.path().join("report.jsonl");
    let (r, console) = boot(&config(&g.kernel), &report);
    assert_eq!(r.unwrap(), VmExit::GuestReset);
    assert_eq!(console, "ok\n");
    let ev = events(&report);
    let marker = ev
        .iter()
        .find(|e| e["event"] == "boot_marker")
        .expect("marker event");
    assert_eq!(marker["value"], 7);
    assert_eq!(marker["first"], true);
    assert!(marker["ms_since_start"].as_f64().unwrap() > 0.0);
    let exit = ev
        .iter()
        .find(|e| e["event"] == "exit")
        .expect("exit event");
    assert_eq!(exit["code"], 0);
}

#[test]
fn smp_mini_guest_boots_with_four_vcpus() {
    // Only the boot vCPU runs code; the others wait for INIT/SIPI. The VM must still build
    // (CPUID per vCPU, MP table) and exit cleanly.
    let g = guest(MARKER_SERIAL_RESET);
    let mut c = config(&g.kernel);
    c.vcpus = 4;
    let (r, _) = boot(&c, &g.dir.path().join("r.jsonl"));
    assert_eq!(r.unwrap(), VmExit::GuestReset);
}

#[test]
fn a_file_that_is_not_a_kernel_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let k = dir.path().join("notes.txt");
    std::fs::write(&k, "hello").unwrap();
    let (r, _) = boot(&config(&k), &dir.path().join("r"));
    let e = r.unwrap_err();
    assert!(e.to_string().contains("not a Linux kernel"), "{e}");
}

#[test]
fn missing_rootfs_is_refused_before_boot() {
    let g = guest(MARKER_SERIAL_RESET);
    let mut c = config(&g.kernel);
    c.disks.push(BlockConfig {
        path: "/nonexistent/rootfs.ext4".into(),
        mode: BlockMode::ReadOnly,
        id: String::new(),
    });
    let (r, _) = boot(&c, &g.dir.path().join("r"));
    let e = r.unwrap_err().to_string();
    assert!(e.contains("/nonexistent/rootfs.ext4"), "{e}");
}

#[test]
fn bad_memory_sizes_are_refused() {
    let g = guest(MARKER_SERIAL_RESET);
    for (mib, needle) in [(1u64, "too small"), (1 << 30, "exceeds this host")] {
        let mut c = config(&g.kernel);
        c.mem_mib = mib;
        let (r, _) = boot(&c, &g.dir.path().join("r"));
        let e = r.unwrap_err().to_string();
        assert!(e.contains(needle), "{mib} MiB: {e}");
    }
}

#[test]
fn bad_vcpu_counts_are_refused() {
    let g = guest(MARKER_SERIAL_RESET);
    for n in [0u8, 200] {
        let mut c = config(&g.kernel);
        c.vcpus = n;
        let (r, _) = boot(&c, &g.dir.path().join("r"));
        let e = r.unwrap_err().to_string();
        assert!(e.contains("vCPUs requested"), "{n}: {e}");
    }
}
