//! Building and running a VM: KVM set-up, memory, kernel, devices, vCPUs, and the event loop
//! on the calling thread.

use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};

use ember_devices::legacy::{BootMarker, SerialOut};
use ember_devices::virtio::block::{Block, BlockError};
pub use ember_devices::virtio::block::{BlockConfig as DiskConfig, BlockMode as DiskMode};
use ember_devices::virtio::block::{BlockConfig, BlockMode};
use event_manager::{EventOps, Events, MutEventSubscriber, SubscriberOps};
use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Cap, Kvm, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use ember_devices::GuestMemoryMmap;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::api::{AfterSnapshot, ApiQueue, ApiServer, Request};
use crate::boot::{self, BootError};
use crate::cpu::{CpuProfile, HostKvm};
use crate::device_manager::{DeviceError, DeviceManager, EventLoop, VirtioHandle};
use crate::memory::{self, MemoryError};
use crate::report::{Reporter, StartTime};
use crate::vcpu::{self, Vcpu, VcpuExitReason, VcpuHandle};
pub use ember_devices::virtio::net::NetConfig;
use ember_devices::virtio::net::{Net, NetError};
pub use ember_devices::virtio::vsock::VsockConfig;
use ember_devices::virtio::vsock::{Vsock, VsockError};

/// The kernel command line ember starts from (before the root device, CPU-profile masks,
/// device entries and user additions).
///
/// `rcupdate.rcu_cpu_stall_suppress=1`: a guest whose vCPU the host did not run for a while
/// (an overcommitted host: hundreds of idle sandboxes while a burst of creates runs) sees an
/// RCU "stall" that is only the host's scheduling, and prints a warning with a stack dump to
/// the serial console, each line an exit (and on kvm_pvm ~8 ms of emulated work). Measured
/// here with 750 idle sandboxes under load: every guest went from idle to printing stall
/// reports at once, which kept all their vCPUs runnable and the host at load 775.
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 pci=off quiet rcupdate.rcu_cpu_stall_suppress=1";

/// What to boot.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// Kernel image (ELF vmlinux or bzImage).
    pub kernel: PathBuf,
    /// Disks, in order: the first is `/dev/vda` (and the root device when `root` is set).
    #[serde(default)]
    pub disks: Vec<BlockConfig>,
    /// Mount the first disk as the root filesystem.
    #[serde(default = "yes")]
    pub root: bool,
    /// Guest memory in MiB.
    #[serde(default = "default_mem")]
    pub mem_mib: u64,
    /// Number of vCPUs.
    #[serde(default = "one")]
    pub vcpus: u8,
    /// Replaces [`DEFAULT_CMDLINE`].
    #[serde(default)]
    pub cmdline: Option<String>,
    /// Appended after everything ember adds.
    #[serde(default)]
    pub cmdline_extra: Vec<String>,
    /// CPU profile; detected from the host when absent.
    #[serde(default)]
    pub cpu_profile: Option<CpuProfile>,
    /// Network interfaces (TAP-backed virtio-net), `eth0` first.
    #[serde(default)]
    pub net: Vec<NetConfig>,
    /// The vsock device (host side: a Unix socket).
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    /// Log dirty pages (KVM dirty log + the device-write bitmap) so that diff snapshots can
    /// be taken. Costs a write-protection fault on the first guest write to each page after
    /// every snapshot.
    #[serde(default)]
    pub track_dirty_pages: bool,
}

fn yes() -> bool {
    true
}
fn one() -> u8 {
    1
}
fn default_mem() -> u64 {
    128
}

impl VmConfig {
    /// A config booting `kernel` with defaults.
    pub fn new(kernel: PathBuf) -> Self {
        Self {
            kernel,
            disks: Vec::new(),
            root: true,
            mem_mib: default_mem(),
            vcpus: 1,
            cmdline: None,
            cmdline_extra: Vec::new(),
            cpu_profile: None,
            net: Vec::new(),
            vsock: None,
            track_dirty_pages: false,
        }
    }
}

/// Errors building or running a VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// /dev/kvm missing or not accessible.
    #[error("cannot open /dev/kvm: {0} ({hint})", hint = kvm_hint(.0))]
    KvmOpen(kvm_ioctls::Error),
    /// A capability ember relies on is missing.
    #[error("this host's KVM lacks {0:?}, which ember needs")]
    MissingCap(Cap),
    /// A KVM ioctl failed.
    #[error("KVM {what} failed: {source}")]
    Kvm {
        /// The ioctl.
        what: &'static str,
        /// Why.
        source: kvm_ioctls::Error,
    },
    /// Bad vCPU count.
    #[error("{requested} vCPUs requested: must be between 1 and {max} on this host")]
    VcpuCount {
        /// Requested.
        requested: u8,
        /// Most allowed.
        max: usize,
    },
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// Kernel loading.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// MP table.
    #[error(transparent)]
    Mptable(#[from] crate::boot::mptable::MptableError),
    /// vCPU register set-up.
    #[error(transparent)]
    Regs(#[from] crate::boot::regs::RegsError),
    /// Devices.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A disk.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// A network interface.
    #[error(transparent)]
    Net(#[from] NetError),
    /// The vsock device.
    #[error(transparent)]
    Vsock(#[from] VsockError),
    /// Seccomp.
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
    /// Event loop.
    #[error("event loop: {0:?}")]
    EventLoop(event_manager::Error),
    /// Threads, eventfds, signals.
    #[error("{what}: {source}")]
    Os {
        /// What failed.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

fn kvm_hint(e: &kvm_ioctls::Error) -> &'static str {
    match e.errno() {
        libc::ENOENT => "no /dev/kvm: KVM is not available on this host (no kvm module loaded?)",
        libc::EACCES | libc::EPERM => {
            "permission denied: run as root or add the user to the group owning /dev/kvm"
        }
        _ => "is KVM usable on this host?",
    }
}

/// How the VM ended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VmExit {
    /// The guest rebooted through the i8042 (the normal "I'm done" path for ember guests).
    GuestReset,
    /// A `shutdown` request on the control socket.
    Shutdown,
    /// A snapshot was taken with `after: exit`.
    SnapshotTaken,
    /// A vCPU stopped; see the reason.
    Vcpu(VcpuExitReason),
}

impl VmExit {
    /// The VMM process exit code for this outcome: 0 for a guest reset or power-off.
    pub fn exit_code(&self) -> i32 {
        match self {
            VmExit::GuestReset | VmExit::Shutdown | VmExit::SnapshotTaken => 0,
            VmExit::Vcpu(VcpuExitReason::Reset { .. } | VcpuExitReason::PowerOff { .. }) => 0,
            VmExit::Vcpu(VcpuExitReason::InternalError { .. }) => 3,
            VmExit::Vcpu(_) => 4,
        }
    }
}

impl std::fmt::Display for VmExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VmExit::GuestReset => write!(f, "guest reset"),
            VmExit::Shutdown => write!(f, "shut down on request"),
            VmExit::SnapshotTaken => write!(f, "exited after writing a snapshot"),
            VmExit::Vcpu(r) => write!(f, "{r}"),
        }
    }
}

/// A built VM, ready to run.
pub struct Vm {
    /// The KVM VM.
    pub vm_fd: VmFd,
    /// Guest memory.
    pub memory: GuestMemoryMmap,
    /// Devices.
    pub devices: DeviceManager,
    /// The kernel command line the guest got.
    pub cmdline: String,
    /// The CPU profile in force.
    pub profile: CpuProfile,
    /// Host KVM kind.
    pub host: HostKvm,
    events: EventLoop,
    vcpus: Vec<Vcpu>,
    /// Number of vCPUs.
    pub vcpu_count: u8,
    exit: Arc<Mutex<Option<VmExit>>>,
    exit_tx: std::sync::mpsc::Sender<VcpuExitReason>,
    vcpu_exit_evt: EventFd,
    reporter: Reporter,
    api: Option<ApiQueue>,
    started: std::time::Instant,
    /// The configuration the VM was built from.
    pub config: VmConfig,
    /// KVM state capabilities (what a snapshot of this VM holds).
    pub caps: crate::vstate::StateCaps,
    /// The snapshot the next diff snapshot is relative to (the last one taken of this VM, or
    /// the one it was restored from).
    pub diff_parent: Option<std::path::PathBuf>,
    /// KVM's counters for this VM (exits, page faults, injections), for `stats` and the report.
    pub kvm_stats: Arc<crate::kvmstats::KvmStats>,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm")
            .field("cmdline", &self.cmdline)
            .field("profile", &self.profile)
            .field("vcpus", &self.vcpus.len())
            .finish_non_exhaustive()
    }
}

/// KVM's counters for the boot-marker reports: set once the vCPUs exist (the marker device
/// is built before them).
pub type MarkerStats = Arc<std::sync::OnceLock<Arc<crate::kvmstats::KvmStats>>>;

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

/// The pieces a VM is assembled from, by cold boot or by restore.
#[allow(missing_debug_implementations)]
pub struct Parts {
    /// The KVM VM.
    pub vm_fd: VmFd,
    /// Guest memory.
    pub memory: GuestMemoryMmap,
    /// Devices.
    pub devices: DeviceManager,
    /// Kernel command line.
    pub cmdline: String,
    /// CPU profile.
    pub profile: CpuProfile,
    /// Host kind.
    pub host: HostKvm,
    /// Event loop with the devices registered.
    pub events: EventLoop,
    /// vCPUs, ready to run.
    pub vcpus: Vec<Vcpu>,
    /// The i8042 reset eventfd.
    pub reset_evt: EventFd,
    /// Event reporting.
    pub reporter: Reporter,
    /// Process start.
    pub start: StartTime,
    /// The configuration.
    pub config: VmConfig,
    /// KVM state capabilities.
    pub caps: crate::vstate::StateCaps,
    /// Filled with KVM's counters once the VM is assembled (for the boot-marker sink).
    pub marker_stats: MarkerStats,
}

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

/// Watches the reset and vCPU-exit eventfds and records how the VM ended.
struct ExitWatcher {
    reset_evt: EventFd,
    vcpu_exit_evt: EventFd,
    exit: Arc<Mutex<Option<VmExit>>>,
    rx: Mutex<Receiver<VcpuExitReason>>,
}

impl MutEventSubscriber for ExitWatcher {
    fn init(&mut self, ops: &mut EventOps) {
        for (fd, data) in [(&self.reset_evt, 0u32), (&self.vcpu_exit_evt, 1)] {
            if let Err(e) = ops.add(Events::with_data(fd, data, EventSet::IN)) {
                tracing::error!("cannot watch exit events: {e:?}");
            }
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let mut exit = self.exit.lock().unwrap_or_else(|p| p.into_inner());
        if events.data() == 0 {
            let _ = self.reset_evt.read();
            exit.get_or_insert(VmExit::GuestReset);
        } else {
            let _ = self.vcpu_exit_evt.read();
            let rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
            if let Ok(r) = rx.try_recv() {
                exit.get_or_insert(VmExit::Vcpu(r));
            }
        }
    }
}

impl Vm {
    /// Builds a VM for cold boot: memory, kernel, devices, vCPUs in their boot state.
    pub fn build(
        config: &VmConfig,
        serial_out: SerialOut,
        reporter: Reporter,
        start: StartTime,
    ) -> Result<Self, VmError> {
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
        let vm_fd = kvm.create_vm().map_err(|source| VmError::Kvm {
            what: "KVM_CREATE_VM",
            source,
        })?;
        if let Err(e) = vm_fd.set_tss_address(0xfffb_d000) {
            tracing::debug!("KVM_SET_TSS_ADDR: {e} (not needed on this host)");
        }
        register_memory(&vm_fd, &mem, config.track_dirty_pages)?;
        create_irqchip_and_pit(&vm_fd)?;

        let kernel = boot::load_kernel(&mem, &config.kernel)?;
        boot::mptable::setup(&mem, config.vcpus)?;
        boot::regs::write_boot_tables(&mem)?;

        let mut events = EventLoop::new().map_err(VmError::EventLoop)?;
        let mut devices = DeviceManager::new();
        devices.add_serial(&vm_fd, serial_out)?;
        let reset_evt = devices.add_i8042()?;
        let marker_stats = MarkerStats::default();
        devices.add_boot_marker(BootMarker::new(marker_sink(
            reporter.clone(),
            start,
            marker_stats.clone(),
        )))?;
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
        let supported_cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|source| VmError::Kvm {
                what: "KVM_GET_SUPPORTED_CPUID",
                source,
            })?;
        let msr_list = kvm.get_msr_index_list().map_err(|source| VmError::Kvm {
            what: "KVM_GET_MSR_INDEX_LIST",
            source,
        })?;
        let supported_msrs = msr_list.as_slice().to_vec();
        let msr_indices = Arc::new(crate::vstate::order_msrs(supported_msrs.clone()));
        let caps = crate::vstate::StateCaps::probe(&vm_fd);
        let mut vcpus = Vec::with_capacity(usize::from(config.vcpus));
        for id in 0..config.vcpus {
            let fd = vm_fd
                .create_vcpu(u64::from(id))
                .map_err(|source| VmError::Kvm {
                    what: "KVM_CREATE_VCPU",
                    source,
                })?;
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
            vcpus.push(Vcpu {
                id,
                fd,
                pio: pio.clone(),
                mmio: mmio.clone(),
                profile,
                cpuid,
                msr_indices: msr_indices.clone(),
                caps,
                reporter: reporter.clone(),
            });
        }

        Self::assemble(Parts {
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
            caps,
            marker_stats,
        })
    }

    /// Finishes a VM from its parts: exit plumbing and bookkeeping.
    pub fn assemble(p: Parts) -> Result<Self, VmError> {
        let Parts {
            vm_fd,
            memory,
            devices,
            cmdline,
            profile,
            host,
            mut events,
            vcpus,
            reset_evt,
            reporter,
            start,
            config,
            caps,
            marker_stats,
        } = p;
        let (tx, rx) = channel();
        let vcpu_exit_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(|source| VmError::Os {
            what: "eventfd",
            source,
        })?;
        let exit = Arc::new(Mutex::new(None));
        let watcher = ExitWatcher {
            reset_evt,
            vcpu_exit_evt: vcpu_exit_evt.try_clone().map_err(|source| VmError::Os {
                what: "eventfd clone",
                source,
            })?,
            exit: exit.clone(),
            rx: Mutex::new(rx),
        };
        events.add_subscriber(Arc::new(Mutex::new(watcher)));
        let kvm_stats = Arc::new(crate::kvmstats::KvmStats::open(
            &vm_fd,
            vcpus.iter().map(|v| &v.fd),
        ));
        let _ = marker_stats.set(kvm_stats.clone());
        Ok(Self {
            vm_fd,
            memory,
            devices,
            cmdline,
            profile,
            host,
            events,
            vcpu_count: vcpus.len() as u8,
            vcpus,
            exit,
            exit_tx: tx,
            vcpu_exit_evt,
            reporter,
            api: None,
            started: start.instant,
            config,
            caps,
            diff_parent: None,
            kvm_stats,
        })
    }

    /// Forwards bytes read from `fd` (e.g. stdin) to the guest's serial console.
    pub fn attach_console_input(&mut self, fd: std::os::unix::io::RawFd) -> Result<(), VmError> {
        let (Some(serial), Some(drained)) = (&self.devices.serial, &self.devices.serial_drained)
        else {
            return Err(VmError::Os {
                what: "console input",
                source: std::io::Error::other("the VM has no serial port"),
            });
        };
        let drained = drained.try_clone().map_err(|source| VmError::Os {
            what: "eventfd clone",
            source,
        })?;
        let input =
            crate::console::SerialInput::new(serial.clone(), fd, drained).map_err(|source| {
                VmError::Os {
                    what: "console input",
                    source,
                }
            })?;
        self.events.add_subscriber(Arc::new(Mutex::new(input)));
        Ok(())
    }

    /// Reports `guest_first_data` (time and KVM's counters so far) when the guest first sends
    /// data over vsock: after a restore, the agent's first answer; the counters then cover
    /// restore → first answer, since the vCPUs were created by the restore.
    pub fn report_first_guest_data(&self) {
        let Some(vsock) = self.devices.vsock() else {
            return;
        };
        let (stats, reporter) = (self.kvm_stats.clone(), self.reporter.clone());
        vsock
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .on_first_guest_data(Box::new(move || {
                reporter.event(
                    "guest_first_data",
                    serde_json::json!({
                        "mono_ns": crate::report::monotonic_ns(),
                        "kvm": stats.to_json(),
                    }),
                );
            }));
    }

    /// Serves the control socket at `path` on the event loop.
    pub fn serve_api(&mut self, path: &std::path::Path) -> Result<(), crate::api::ApiError> {
        let queue = ApiQueue::default();
        let server = ApiServer::bind(path, queue.clone())?;
        self.events.add_subscriber(Arc::new(Mutex::new(server)));
        self.api = Some(queue);
        Ok(())
    }

    /// Serves the control socket on `listener`, already bound (by a VMM that waited for its
    /// restore request on it, [`crate::pooled`]).
    pub fn serve_api_listener(
        &mut self,
        listener: std::os::unix::net::UnixListener,
    ) -> std::io::Result<()> {
        let queue = ApiQueue::default();
        let server = ApiServer::from_listener(listener, queue.clone())?;
        self.events.add_subscriber(Arc::new(Mutex::new(server)));
        self.api = Some(queue);
        Ok(())
    }

    /// Starts the vCPUs and runs the event loop on this thread until the VM ends.
    pub fn run(mut self) -> Result<VmExit, VmError> {
        vcpu::install_kick_handler().map_err(|e| VmError::Os {
            what: "installing the vCPU kick signal handler",
            source: std::io::Error::from_raw_os_error(e.errno()),
        })?;
        let mut handles: Vec<VcpuHandle> = Vec::with_capacity(self.vcpus.len());
        for v in self.vcpus.drain(..) {
            let evt = self
                .vcpu_exit_evt
                .try_clone()
                .map_err(|source| VmError::Os {
                    what: "eventfd clone",
                    source,
                })?;
            handles.push(
                v.start(self.exit_tx.clone(), evt)
                    .map_err(|source| VmError::Os {
                        what: "spawning a vCPU thread",
                        source,
                    })?,
            );
        }
        // After the vCPU threads exist (a thread inherits its creator's filters) and before the
        // event loop handles anything the guest controls.
        crate::seccomp::install_configured(crate::seccomp::ThreadKind::Main)?;
        self.reporter.event(
            "vcpus_started",
            serde_json::json!({ "mono_ns": crate::report::monotonic_ns() }),
        );
        let mut control = Control {
            paused: None,
            exit: None,
        };
        let exit = loop {
            self.events.run().map_err(VmError::EventLoop)?;
            if let Some(e) = self.exit.lock().unwrap_or_else(|p| p.into_inner()).take() {
                break e;
            }
            if let Some(api) = self.api.clone() {
                while let Some((conn, req)) = api.pop() {
                    let reply = match req {
                        Ok(r) => self.handle_request(r, &handles, &mut control),
                        Err(e) => serde_json::json!({ "ok": false, "error": e }),
                    };
                    api.respond(conn, &reply);
                }
            }
            if let Some(e) = control.exit.take() {
                break e;
            }
        };
        for h in &handles {
            h.stop();
        }
        for h in handles {
            let _ = h.thread.join();
        }
        self.reporter.event(
            "exit",
            serde_json::json!({
                "code": exit.exit_code(),
                "message": exit.to_string(),
                "detail": exit,
                "mono_ns": crate::report::monotonic_ns(),
            }),
        );
        Ok(exit)
    }
}

/// Run-time control state of a running VM.
struct Control {
    /// vCPU states captured when the VM was paused (None: running).
    paused: Option<Vec<crate::vstate::VcpuState>>,
    /// Set when a request ends the VM.
    exit: Option<VmExit>,
}

impl Vm {
    fn handle_request(
        &mut self,
        req: Request,
        handles: &[VcpuHandle],
        control: &mut Control,
    ) -> serde_json::Value {
        use serde_json::json;
        match req {
            Request::Pause => match pause_all(handles, control) {
                Ok(()) => json!({ "ok": true }),
                Err(e) => json!({ "ok": false, "error": e }),
            },
            Request::Resume => {
                resume_all(handles, control);
                json!({ "ok": true })
            }
            Request::Stats => json!({ "ok": true, "stats": self.stats(control.paused.is_some()) }),
            Request::RecordWorkingSet { dir } => {
                let r = crate::workingset::record(&self.memory).and_then(|set| {
                    crate::workingset::save(&dir, &set)?;
                    Ok(set.count())
                });
                match r {
                    Ok(pages) => json!({ "ok": true, "pages": pages }),
                    Err(e) => json!({ "ok": false, "error": e.to_string() }),
                }
            }
            Request::Shutdown => {
                control.exit = Some(VmExit::Shutdown);
                json!({ "ok": true })
            }
            Request::Snapshot { dir, kind, after } => {
                let was_paused = control.paused.is_some();
                if let Err(e) = pause_all(handles, control) {
                    return json!({ "ok": false, "error": e });
                }
                let t = std::time::Instant::now();
                let states = control.paused.as_deref().unwrap_or_default();
                let result = crate::snapshot::write_snapshot(self, states, &dir, kind);
                if result.is_ok() && self.config.track_dirty_pages {
                    self.diff_parent = Some(dir.clone());
                }
                let ms = t.elapsed().as_secs_f64() * 1e3;
                match after {
                    AfterSnapshot::Exit if result.is_ok() => {
                        control.exit = Some(VmExit::SnapshotTaken)
                    }
                    AfterSnapshot::Pause => {}
                    _ if !was_paused => resume_all(handles, control),
                    _ => {}
                }
                match result {
                    Ok(info) => json!({ "ok": true, "dir": dir, "ms": ms, "info": info }),
                    Err(e) => json!({ "ok": false, "error": e.to_string() }),
                }
            }
        }
    }

    fn stats(&self, paused: bool) -> serde_json::Value {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
        let mut f = statm
            .split_whitespace()
            .map(|x| x.parse::<u64>().unwrap_or(0));
        let (size, rss) = (f.next().unwrap_or(0), f.next().unwrap_or(0));
        serde_json::json!({
            "paused": paused,
            "uptime_ms": self.started.elapsed().as_secs_f64() * 1e3,
            "mem_mib": self.config_mem_mib(),
            "vcpus": self.vcpu_count,
            "vmm_vsz_kib": size * 4,
            "vmm_rss_kib": rss * 4,
            "cpu_profile": self.profile,
            "kvm": self.kvm_stats.to_json(),
            "vsock": self.devices.vsock_metrics(),
        })
    }

    fn config_mem_mib(&self) -> u64 {
        self.memory.iter().map(|r| r.len()).sum::<u64>() >> 20
    }
}

fn pause_all(handles: &[VcpuHandle], control: &mut Control) -> Result<(), String> {
    if control.paused.is_some() {
        return Ok(());
    }
    let mut states = Vec::with_capacity(handles.len());
    for h in handles {
        match h.pause() {
            Ok(s) => states.push(s),
            Err(e) => {
                for h in handles {
                    h.resume();
                }
                return Err(format!("pause failed: {e}"));
            }
        }
    }
    control.paused = Some(states);
    Ok(())
}

fn resume_all(handles: &[VcpuHandle], control: &mut Control) {
    if control.paused.take().is_some() {
        for h in handles {
            h.resume();
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

    #[test]
    fn config_json_defaults_and_unknown_fields() {
        let c: VmConfig = serde_json::from_str(r#"{"kernel": "/k"}"#).unwrap();
        assert_eq!((c.mem_mib, c.vcpus, c.root), (128, 1, true));
        assert!(serde_json::from_str::<VmConfig>(r#"{"kernel": "/k", "mem": 1}"#).is_err());
    }

    #[test]
    fn exit_codes() {
        assert_eq!(VmExit::GuestReset.exit_code(), 0);
        let ie = VmExit::Vcpu(VcpuExitReason::InternalError {
            vcpu: 0,
            rip: 1,
            suberror: 1,
            cpu_profile: CpuProfile::Host,
        });
        assert_eq!(ie.exit_code(), 3);
    }
}
