//! Building a VM, two ways: [`build_boot`] for a cold boot (anonymous memory, kernel, devices,
//! vCPUs in their boot state) and [`build_restore`] for a restore (memory mapped from the
//! snapshot, devices and vCPUs from its state). Both end in the same [`Vm`] and share the KVM
//! set-up: opening /dev/kvm, the VM with its memory slots, irqchip and PIT (in the order that
//! is fast on kvm_pvm), the legacy devices, and creating vCPUs.
//!
//! Dependencies go one way: this module uses the running VM ([`crate::vm`]: [`Vm::assemble`]
//! takes the [`Parts`] built here) and snapshots ([`crate::persist`]: loading and checking
//! the state, mapping its memory); neither of them uses this module.

use std::path::Path;
use std::sync::{Arc, Mutex};

use ember_devices::bus::{lock, Bus};
use ember_devices::legacy::{BootMarker, EventTrigger, Serial, SerialOut};
use ember_devices::virtio::block::{Block, BlockError, BlockMode};
use ember_devices::virtio::net::Net;
use ember_devices::virtio::vsock::Vsock;
use ember_devices::virtio::Interrupt;
use ember_devices::GuestMemoryMmap;
use ember_snapshot::Persist;
use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::boot;
use crate::config::{VmConfig, DEFAULT_CMDLINE};
use crate::cpu::{CpuProfile, HostKvm};
use crate::device_manager::{DeviceError, DeviceManager, EventLoop, VirtioHandle};
use crate::error::VmError;
use crate::memory;
use crate::persist::{
    apply_overrides, cpuid_difference, load_state, map_layered_memory, map_memory,
    overlay_file_name, sparse_copy, DeviceState, RestoreOptions, SnapshotError,
};
use crate::report::{Reporter, StartTime};
use crate::vcpu::Vcpu;
use crate::vm::{MarkerStats, Parts, Vm};
use crate::vstate::{self, StateCaps};

/// Opens /dev/kvm and checks the capabilities ember uses.
pub fn open_kvm() -> Result<Kvm, VmError> {
    let kvm = Kvm::new().map_err(VmError::KvmOpen)?;
    for cap in [
        Cap::Irqchip,
        Cap::Ioeventfd,
        Cap::Irqfd,
        Cap::UserMemory,
        Cap::Pit2,
    ] {
        if !kvm.check_extension(cap) {
            return Err(VmError::MissingCap(cap));
        }
    }
    Ok(kvm)
}

/// Registers every region of `mem` as a KVM memory slot (with dirty logging when asked).
pub fn register_memory(vm: &VmFd, mem: &GuestMemoryMmap, log_dirty: bool) -> Result<(), VmError> {
    for (slot, region) in mem.iter().enumerate() {
        let r = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: if log_dirty {
                kvm_bindings::KVM_MEM_LOG_DIRTY_PAGES
            } else {
                0
            },
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: mem
                .get_host_address(region.start_addr())
                .map_err(|e| VmError::Os {
                    what: "guest memory has no host mapping",
                    source: std::io::Error::other(e.to_string()),
                })? as u64,
        };
        // SAFETY: the region is a live mapping owned by `mem`, which outlives the VM (the
        // `Vm` holds it and drops the VmFd first); the slot does not overlap another slot.
        unsafe { vm.set_user_memory_region(r) }.map_err(|source| VmError::Kvm {
            what: "KVM_SET_USER_MEMORY_REGION",
            source,
        })?;
    }
    Ok(())
}

/// Creates the in-kernel PIC/IOAPIC/LAPIC and the PIT. Call after the memory slots exist: on
/// kvm_pvm a memory slot added after the irqchip costs ~7 ms (pvm-notes.md).
pub fn create_irqchip_and_pit(vm: &VmFd) -> Result<(), VmError> {
    vm.create_irq_chip().map_err(|source| VmError::Kvm {
        what: "KVM_CREATE_IRQCHIP",
        source,
    })?;
    let pit = kvm_pit_config {
        flags: kvm_bindings::KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).map_err(|source| VmError::Kvm {
        what: "KVM_CREATE_PIT2",
        source,
    })
}

/// Creates the KVM VM over guest memory `mem` in the order that is fast on kvm_pvm: the VM,
/// its memory slots (logging dirty pages when asked), then the irqchip and PIT. `step` is
/// called after each of the three, with its name (the restore reports their times).
fn create_vm(
    kvm: &Kvm,
    mem: &GuestMemoryMmap,
    log_dirty: bool,
    step: &mut dyn FnMut(&'static str),
) -> Result<VmFd, VmError> {
    let vm_fd = kvm.create_vm().map_err(|source| VmError::Kvm {
        what: "KVM_CREATE_VM",
        source,
    })?;
    if let Err(e) = vm_fd.set_tss_address(0xfffb_d000) {
        tracing::debug!("KVM_SET_TSS_ADDR: {e} (not needed on this host)");
    }
    step("create_vm");
    register_memory(&vm_fd, mem, log_dirty)?;
    step("memory_slots");
    create_irqchip_and_pit(&vm_fd)?;
    step("irqchip_and_pit");
    Ok(vm_fd)
}

/// The CPUID entries this host's KVM supports.
fn supported_cpuid(kvm: &Kvm) -> Result<CpuId, VmError> {
    kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|source| VmError::Kvm {
            what: "KVM_GET_SUPPORTED_CPUID",
            source,
        })
}

/// The MSRs this host's KVM can save and restore.
fn msr_index_list(kvm: &Kvm) -> Result<Vec<u32>, VmError> {
    let msr_list = kvm.get_msr_index_list().map_err(|source| VmError::Kvm {
        what: "KVM_GET_MSR_INDEX_LIST",
        source,
    })?;
    Ok(msr_list.as_slice().to_vec())
}

/// Adds the i8042 (whose reset eventfd is returned) and the boot-marker device, after the
/// serial port each builder adds its own way. The marker's reports carry KVM's counters once
/// the VM is assembled (the returned [`MarkerStats`]).
fn add_reset_and_marker(
    devices: &mut DeviceManager,
    reporter: &Reporter,
    start: StartTime,
) -> Result<(EventFd, MarkerStats), DeviceError> {
    let reset_evt = devices.add_i8042()?;
    let marker_stats = MarkerStats::default();
    devices.add_boot_marker(BootMarker::new(marker_sink(
        reporter.clone(),
        start,
        marker_stats.clone(),
    )))?;
    Ok((reset_evt, marker_stats))
}

/// The boot-marker callback: logs the first marker and reports every write with its time
/// and KVM's counters so far (exits, emulated instructions, guest page faults: what a boot
/// costs, in counts that do not depend on the host's load).
pub fn marker_sink(
    reporter: Reporter,
    start: StartTime,
    stats: MarkerStats,
) -> ember_devices::legacy::MarkerSink {
    Box::new(move |e| {
        let ms = e.at.saturating_duration_since(start.instant).as_secs_f64() * 1e3;
        if e.first {
            tracing::info!("boot marker {} after {ms:.1} ms", e.value);
        }
        reporter.event(
            "boot_marker",
            serde_json::json!({
                "value": e.value,
                "first": e.first,
                "ms_since_start": ms,
                "mono_ns": start.mono_of(e.at),
                "kvm": stats.get().map(|s| s.to_json()),
            }),
        );
    })
}

/// Creates KVM vCPU `id`.
fn create_vcpu_fd(vm_fd: &VmFd, id: u8) -> Result<VcpuFd, VmError> {
    vm_fd
        .create_vcpu(u64::from(id))
        .map_err(|source| VmError::Kvm {
            what: "KVM_CREATE_VCPU",
            source,
        })
}

/// What all vCPUs of a VM share; makes each [`Vcpu`] from its KVM vCPU and CPUID table.
struct VcpuCommon {
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    profile: CpuProfile,
    msr_indices: Arc<Vec<u32>>,
    caps: StateCaps,
    reporter: Reporter,
}

impl VcpuCommon {
    fn vcpu(&self, id: u8, fd: VcpuFd, cpuid: CpuId) -> Vcpu {
        Vcpu {
            id,
            fd,
            pio: self.pio.clone(),
            mmio: self.mmio.clone(),
            profile: self.profile,
            cpuid,
            msr_indices: self.msr_indices.clone(),
            caps: self.caps,
            reporter: self.reporter.clone(),
        }
    }
}

/// Builds a VM for cold boot: memory, kernel, devices, vCPUs in their boot state.
pub fn build_boot(
    config: &VmConfig,
    serial_out: SerialOut,
    reporter: Reporter,
    start: StartTime,
) -> Result<Vm, VmError> {
    let host = HostKvm::detect();
    let profile = config.cpu_profile.unwrap_or_else(|| host.default_profile());
    let kvm = open_kvm()?;
    let max = kvm
        .get_max_vcpus()
        .min(usize::from(boot::mptable::MAX_VCPUS));
    if config.vcpus == 0 || usize::from(config.vcpus) > max {
        return Err(VmError::VcpuCount {
            requested: config.vcpus,
            max,
        });
    }
    memory::validate_size(config.mem_mib)?;
    // Open the disks before anything expensive, so a bad path fails fast.
    let disks = config
        .disks
        .iter()
        .map(|d| Block::new(d.clone()))
        .collect::<Result<Vec<_>, _>>()?;

    let mem = memory::create_anonymous(config.mem_mib)?;
    let vm_fd = create_vm(&kvm, &mem, config.track_dirty_pages, &mut |_| {})?;

    let kernel = boot::load_kernel(&mem, &config.kernel)?;
    boot::mptable::setup(&mem, config.vcpus)?;
    boot::regs::write_boot_tables(&mem)?;

    let mut events = EventLoop::new().map_err(VmError::EventLoop)?;
    let mut devices = DeviceManager::new();
    devices.add_serial(&vm_fd, serial_out)?;
    let (reset_evt, marker_stats) = add_reset_and_marker(&mut devices, &reporter, start)?;
    for disk in disks {
        let d = Arc::new(Mutex::new(disk));
        devices.add_virtio(&vm_fd, &mem, &mut events, d.clone(), VirtioHandle::Block(d))?;
    }
    for n in &config.net {
        let d = Arc::new(Mutex::new(Net::new(n.clone())?));
        devices.add_virtio(&vm_fd, &mem, &mut events, d.clone(), VirtioHandle::Net(d))?;
    }
    if let Some(v) = &config.vsock {
        let d = Arc::new(Mutex::new(Vsock::new(v.clone())?));
        devices.add_virtio(&vm_fd, &mem, &mut events, d.clone(), VirtioHandle::Vsock(d))?;
    }

    let cmdline = assemble_cmdline(config, profile, &devices.cmdline_entries());
    let c = boot::build_cmdline(&cmdline)?;
    boot::write_boot_params(&mem, &kernel, &c, config.mem_mib << 20)?;

    let pio = Arc::new(devices.pio.clone());
    let mmio = Arc::new(devices.mmio.clone());
    let supported_cpuid = supported_cpuid(&kvm)?;
    let supported_msrs = msr_index_list(&kvm)?;
    let common = VcpuCommon {
        pio,
        mmio,
        profile,
        msr_indices: Arc::new(vstate::order_msrs(supported_msrs.clone())),
        caps: StateCaps::probe(&vm_fd),
        reporter: reporter.clone(),
    };
    let mut vcpus = Vec::with_capacity(usize::from(config.vcpus));
    for id in 0..config.vcpus {
        let fd = create_vcpu_fd(&vm_fd, id)?;
        let mut cpuid = supported_cpuid.clone();
        profile.apply(&mut cpuid, id, config.vcpus);
        fd.set_cpuid2(&cpuid).map_err(|source| VmError::Kvm {
            what: "KVM_SET_CPUID2",
            source,
        })?;
        boot::regs::setup_common(&fd, id, &supported_msrs)?;
        if id == 0 {
            boot::regs::setup_boot_vcpu(&fd, id, kernel.entry.0)?;
        }
        vcpus.push(common.vcpu(id, fd, cpuid));
    }

    Vm::assemble(Parts {
        vm_fd,
        memory: mem,
        devices,
        cmdline,
        profile,
        host,
        events,
        vcpus,
        reset_evt,
        reporter,
        start,
        config: config.clone(),
        caps: common.caps,
        marker_stats,
    })
}

/// Restores the VM saved in `dir`; it starts running at [`Vm::run`].
pub fn build_restore(
    dir: &Path,
    opts: &RestoreOptions,
    serial_out: SerialOut,
    reporter: Reporter,
    start: StartTime,
) -> Result<Vm, SnapshotError> {
    let mut steps = Steps::new(start);
    let mut state = load_state(dir, opts)?;
    apply_overrides(dir, &mut state.config, opts)?;
    steps.mark("read_and_check_state");
    let build = |e: VmError| SnapshotError::Build {
        dir: dir.to_path_buf(),
        source: Box::new(e),
    };
    let kvm = open_kvm().map_err(build)?;
    steps.mark("open_kvm");
    let mem = match (&state.memory_diff, ember_snapshot::read_layer(dir)?) {
        (Some(d), Some(layer)) => {
            map_layered_memory(dir, &layer, &d.pages, &state.memory, &reporter)?
        }
        _ => map_memory(dir, &state.memory)?,
    };
    steps.mark("map_memory");
    prefetch(dir, &mem, opts.prefetch, &reporter);
    let vm_fd =
        create_vm(&kvm, &mem, opts.track_dirty_pages, &mut |s| steps.mark(s)).map_err(build)?;
    vstate::restore_vm(&vm_fd, &state.kvm)?;
    steps.mark("vm_state");

    // The CPU must present what the snapshot's guest saw.
    let mut expected = supported_cpuid(&kvm).map_err(build)?;
    state
        .cpu_profile
        .apply(&mut expected, 0, state.config.vcpus);
    if let Some(diff) = cpuid_difference(expected.as_slice(), &state.vcpus[0].cpuid) {
        return Err(SnapshotError::Incompatible {
            dir: dir.to_path_buf(),
            reason: format!(
                "this host's CPU (profile '{}') differs from the one the snapshot was taken on ({diff})",
                state.cpu_profile
            ),
        });
    }

    let events = EventLoop::new().map_err(|e| build(VmError::EventLoop(e)))?;
    let mut devices = DeviceManager::new();
    let irq = EventTrigger::new().map_err(|source| {
        build(VmError::Os {
            what: "eventfd",
            source,
        })
    })?;
    let drained = devices
        .new_drained_event()
        .map_err(|e| build(VmError::Device(e)))?;
    let serial =
        Serial::from_snapshot(&state.serial, irq, serial_out, Some(drained)).map_err(|source| {
            build(VmError::Os {
                what: "serial state",
                source,
            })
        })?;
    devices
        .add_serial_device(&vm_fd, serial)
        .map_err(|e| build(VmError::Device(e)))?;
    let (reset_evt, marker_stats) = add_reset_and_marker(&mut devices, &reporter, start)
        .map_err(|e| build(VmError::Device(e)))?;

    steps.mark("cpuid_check_and_legacy_devices");
    let mut events = events;
    let mut config = state.config;
    config.track_dirty_pages = opts.track_dirty_pages;
    let (mut disk_i, mut net_i) = (0usize, 0usize);
    for v in state.virtio {
        let irq_evt = EventTrigger::new().map_err(|source| {
            build(VmError::Os {
                what: "eventfd",
                source,
            })
        })?;
        let interrupt = Arc::new(Interrupt::new(irq_evt));
        interrupt.restore_status(v.transport.interrupt_status);
        let live = v.transport.status & ember_devices::virtio::mmio::status::DRIVER_OK != 0;
        let args = live.then(|| (mem.clone(), interrupt.clone()));
        let restore = Some((&v.transport, v.transport_queues.as_slice()));
        let dev_err = |e: String| SnapshotError::Incompatible {
            dir: dir.to_path_buf(),
            reason: format!("virtio device at {:#x}: {e}", v.base),
        };
        // Format-1 vsock state reads as the current one without connections.
        let device = match v.device {
            DeviceState::Vsock(old) => DeviceState::VsockV2(old.into()),
            other => other,
        };
        match device {
            DeviceState::Block(s) => {
                let mut cfg = config
                    .disks
                    .get(disk_i)
                    .cloned()
                    .unwrap_or(s.config.clone());
                if matches!(cfg.mode, BlockMode::Overlay { .. }) {
                    let given = opts.disk_paths.get(disk_i).cloned().flatten();
                    let Some(own) = given else {
                        return Err(dev_err(format!(
                            "disk {disk_i} is a copy-on-write overlay: give this clone its own \
                             overlay file (--disk-path; a missing file is created from the \
                             snapshot's copy)"
                        )));
                    };
                    if !own.exists() {
                        sparse_copy(&dir.join(overlay_file_name(disk_i)), &own)?;
                    }
                    cfg.path = own;
                }
                let new_base = opts.disk_bases.get(disk_i).is_some_and(Option::is_some);
                let d = Block::restore((cfg, args), &s).map_err(|e| {
                    let hint = match (&e, new_base) {
                        (BlockError::BaseMismatch { .. }, true) => {
                            " (the base given with --disk-base is not the snapshot's image)"
                        }
                        _ => "",
                    };
                    dev_err(format!("disk {disk_i}: {e}{hint}"))
                })?;
                let d = Arc::new(std::sync::Mutex::new(d));
                disk_i += 1;
                devices
                    .attach_virtio(
                        &vm_fd,
                        &mem,
                        &mut events,
                        d.clone(),
                        VirtioHandle::Block(d),
                        v.base,
                        v.irq,
                        interrupt,
                        restore,
                    )
                    .map_err(|e| build(VmError::Device(e)))?;
            }
            DeviceState::Net(s) => {
                let cfg = config
                    .net
                    .get(net_i)
                    .cloned()
                    .ok_or_else(|| dev_err("no network configuration for it".into()))?;
                net_i += 1;
                let d = Arc::new(std::sync::Mutex::new(
                    Net::restore((cfg, args), &s).map_err(|e| dev_err(e.to_string()))?,
                ));
                devices
                    .attach_virtio(
                        &vm_fd,
                        &mem,
                        &mut events,
                        d.clone(),
                        VirtioHandle::Net(d),
                        v.base,
                        v.irq,
                        interrupt,
                        restore,
                    )
                    .map_err(|e| build(VmError::Device(e)))?;
            }
            DeviceState::Vsock(_) => {
                return Err(dev_err("format-1 vsock state was not converted".into()));
            }
            DeviceState::VsockV2(mut s) => {
                let cfg = config
                    .vsock
                    .clone()
                    .ok_or_else(|| dev_err("no vsock configuration for it".into()))?;
                if opts.vsock_transport_reset {
                    s.connections = None;
                }
                let d = Arc::new(std::sync::Mutex::new(
                    Vsock::restore((cfg, args), &s).map_err(|e| dev_err(e.to_string()))?,
                ));
                devices
                    .attach_virtio(
                        &vm_fd,
                        &mem,
                        &mut events,
                        d.clone(),
                        VirtioHandle::Vsock(d),
                        v.base,
                        v.irq,
                        interrupt,
                        restore,
                    )
                    .map_err(|e| build(VmError::Device(e)))?;
            }
        }
    }

    steps.mark("virtio_devices");
    let msr_indices = Arc::new(vstate::order_msrs(msr_index_list(&kvm).map_err(build)?));
    let common = VcpuCommon {
        pio: Arc::new(devices.pio.clone()),
        mmio: Arc::new(devices.mmio.clone()),
        profile: state.cpu_profile,
        msr_indices,
        caps: state.caps,
        reporter: reporter.clone(),
    };
    let mut vcpus = Vec::with_capacity(state.vcpus.len());
    for vs in &state.vcpus {
        let fd = create_vcpu_fd(&vm_fd, vs.id).map_err(build)?;
        vstate::restore_vcpu(&fd, vs)?;
        let cpuid = CpuId::from_entries(&vs.cpuid)
            .map_err(|_| vstate::StateError::TooMany(vs.cpuid.len()))?;
        vcpus.push(common.vcpu(vs.id, fd, cpuid));
    }
    // Interrupts raised while the devices were restored (vsock's transport reset, causes
    // pending at snapshot time) reached the interrupt controller before the vCPUs' LAPIC
    // state was restored, which overwrote them: raise them again now. A spurious
    // interrupt is harmless (the driver reads InterruptStatus).
    for slot in &devices.virtio {
        let t = lock(&slot.transport);
        if t.interrupt().status() != 0 {
            let _ = t.interrupt().eventfd().write(1);
        }
    }
    steps.mark("vcpus");
    steps.report(&reporter);
    let mut vm = Vm::assemble(Parts {
        vm_fd,
        memory: mem,
        devices,
        cmdline: state.cmdline,
        profile: state.cpu_profile,
        host: state.host,
        events,
        vcpus,
        reset_evt,
        reporter,
        start,
        config,
        caps: state.caps,
        marker_stats,
    })
    .map_err(build)?;
    vm.report_first_guest_data();
    if vm.config.track_dirty_pages {
        vm.diff_parent = Some(dir.to_path_buf());
    }
    Ok(vm)
}

/// Per-step timings of a restore, reported as one `restore_steps` event.
struct Steps {
    last: std::time::Instant,
    steps: Vec<(&'static str, f64)>,
}

impl Steps {
    fn new(start: StartTime) -> Self {
        let mut s = Self {
            last: std::time::Instant::now(),
            steps: Vec::with_capacity(12),
        };
        // Process start (main) to the beginning of the restore: argument parsing, logging.
        s.steps.push((
            "process_setup",
            s.last
                .saturating_duration_since(start.instant)
                .as_secs_f64()
                * 1e3,
        ));
        s
    }

    fn mark(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.steps.push((
            name,
            now.saturating_duration_since(self.last).as_secs_f64() * 1e3,
        ));
        self.last = now;
    }

    fn report(&self, reporter: &Reporter) {
        let steps: serde_json::Map<String, serde_json::Value> = self
            .steps
            .iter()
            .map(|(k, v)| ((*k).to_string(), serde_json::json!(v)))
            .collect();
        reporter.event("restore_steps", serde_json::json!({ "ms": steps }));
    }
}

/// Populates the snapshot's recorded working set, now or on a helper thread.
fn prefetch(
    dir: &Path,
    mem: &GuestMemoryMmap,
    mode: crate::workingset::Prefetch,
    reporter: &Reporter,
) {
    use crate::workingset::{self as ws, Prefetch};
    if mode == Prefetch::Off {
        return;
    }
    let set = match ws::load(dir) {
        Ok(Some(s)) => s,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!("ignoring the working set of {}: {e}", dir.display());
            return;
        }
    };
    let ranges = ws::ranges(mem, &set);
    let reporter = reporter.clone();
    let work = move || {
        let t = std::time::Instant::now();
        let bytes = ws::populate(&ranges);
        reporter.event(
            "prefetch_done",
            serde_json::json!({
                "bytes": bytes,
                "ms": t.elapsed().as_secs_f64() * 1e3,
                "mono_ns": crate::report::monotonic_ns(),
            }),
        );
    };
    if mode == Prefetch::Sync {
        work();
    } else {
        // The thread holds a clone of the memory so the mapping outlives it.
        let keep = mem.clone();
        let spawned = std::thread::Builder::new()
            .name("prefetch".into())
            .spawn(move || {
                if let Err(e) =
                    crate::seccomp::install_configured(crate::seccomp::ThreadKind::Prefetch)
                {
                    tracing::warn!("not prefetching: {e}");
                    return;
                }
                work();
                drop(keep);
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start the prefetch thread: {e}");
        }
    }
}

/// The full kernel command line: base, root device, profile masks, virtio devices, extras.
/// Device entries go before the user's additions so that a `--` in them (init arguments)
/// cannot swallow them.
pub fn assemble_cmdline(config: &VmConfig, profile: CpuProfile, devices: &[String]) -> String {
    let mut parts: Vec<String> = vec![config
        .cmdline
        .clone()
        .unwrap_or_else(|| DEFAULT_CMDLINE.to_string())];
    if config.root {
        if let Some(d) = config.disks.first() {
            parts.push("root=/dev/vda".into());
            parts.push(
                if d.mode == BlockMode::ReadOnly {
                    "ro"
                } else {
                    "rw"
                }
                .into(),
            );
        }
    }
    let masks = profile.cmdline();
    if !masks.is_empty() {
        parts.push(masks.into());
    }
    parts.extend(devices.iter().cloned());
    parts.extend(config.cmdline_extra.iter().cloned());
    parts.retain(|p| !p.trim().is_empty());
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_devices::virtio::block::BlockConfig;

    #[test]
    fn cmdline_order_and_root() {
        let mut c = VmConfig::new("/k".into());
        c.disks.push(BlockConfig {
            path: "/r".into(),
            mode: BlockMode::ReadOnly,
            id: "root".into(),
        });
        c.cmdline_extra.push("ember.run=ZWNobw".into());
        let s = assemble_cmdline(
            &c,
            CpuProfile::Pvm,
            &["virtio_mmio.device=4K@0xd0000000:5".into()],
        );
        assert!(s.starts_with(DEFAULT_CMDLINE));
        let root = s.find("root=/dev/vda ro").unwrap();
        let masks = s.find("clearcpuid=").unwrap();
        let dev = s.find("virtio_mmio.device").unwrap();
        let extra = s.find("ember.run").unwrap();
        assert!(root < masks && masks < dev && dev < extra, "{s}");
        let host = assemble_cmdline(&c, CpuProfile::Host, &[]);
        assert!(!host.contains("clearcpuid"));
        c.root = false;
        c.cmdline = Some("console=ttyS0".into());
        assert_eq!(
            assemble_cmdline(&c, CpuProfile::Host, &[]),
            "console=ttyS0 ember.run=ZWNobw"
        );
    }
}
