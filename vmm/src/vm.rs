//! The running VM: [`Vm`], assembled by a builder ([`crate::builder`]) from its [`Parts`]; its
//! vCPU threads and the event loop on the calling thread ([`Vm::run`]), and the control
//! socket's requests (pause, resume, stats, working set, snapshot, shutdown, watchdog — the
//! loop wakes at the watchdog's deadline and pauses the vCPUs there, [`crate::watchdog`]).
//!
//! Dependencies go one way: the builders use this module, never the other way round; a
//! snapshot request is written by [`crate::persist`] from borrowed parts of the paused VM
//! (`persist` does not use this module). The configuration types ([`crate::config`]) and
//! [`VmError`] ([`crate::error`]) are re-exported here, where other crates find them.

use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use event_manager::{EventOps, Events, MutEventSubscriber, SubscriberOps};
use kvm_ioctls::VmFd;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use ember_devices::GuestMemoryMmap;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::api::{AfterSnapshot, ApiQueue, ApiServer, Request};
pub use crate::config::{DiskConfig, DiskMode, NetConfig, VmConfig, VsockConfig, DEFAULT_CMDLINE};
use crate::cpu::{CpuProfile, HostKvm};
use crate::device_manager::{DeviceManager, EventLoop};
pub use crate::error::VmError;
use crate::persist::SnapshotSource;
use crate::report::{Reporter, StartTime};
use crate::vcpu::{self, Vcpu, VcpuExitReason, VcpuHandle};
use crate::watchdog::Watchdog;

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
            watchdog: Watchdog::default(),
        };
        let exit = loop {
            // Blocks until an event, or until the watchdog's deadline when one is pending.
            let wait_ms = control.watchdog.wait_ms(Instant::now());
            self.events
                .run_with_timeout(wait_ms)
                .map_err(VmError::EventLoop)?;
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
            // After this iteration's requests: a keep-alive that came with the deadline wins.
            if control.watchdog.poll_expired(Instant::now()) {
                self.watchdog_expired(&handles, &mut control);
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
    /// The opt-in watchdog (`watchdog` requests).
    watchdog: Watchdog,
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
            Request::Pause => {
                // Deliberately paused now, even if the watchdog had paused it already.
                control.watchdog.deliberately_paused();
                match pause_all(handles, control) {
                    Ok(()) => json!({ "ok": true }),
                    Err(e) => json!({ "ok": false, "error": e }),
                }
            }
            Request::Resume => {
                resume_all(handles, control);
                control.watchdog.deliberately_resumed(Instant::now());
                json!({ "ok": true })
            }
            Request::Watchdog { timeout_ms } => {
                match control.watchdog.keep_alive(timeout_ms, Instant::now()) {
                    Ok(resume) => {
                        if resume {
                            resume_all(handles, control);
                            tracing::info!("watchdog: keep-alive received, vCPUs resumed");
                            self.reporter.event(
                                "watchdog_resumed",
                                json!({ "mono_ns": crate::report::monotonic_ns() }),
                            );
                        }
                        json!({ "ok": true, "paused_by_watchdog": resume })
                    }
                    Err(e) => json!({ "ok": false, "error": e.to_string() }),
                }
            }
            Request::Stats => json!({ "ok": true, "stats": self.stats(control) }),
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
                // A snapshot takes the VM over from the watchdog: whatever state it leaves the
                // VM in is deliberate.
                control.watchdog.deliberately_paused();
                let was_paused = control.paused.is_some();
                if let Err(e) = pause_all(handles, control) {
                    return json!({ "ok": false, "error": e });
                }
                let t = std::time::Instant::now();
                let states = control.paused.as_deref().unwrap_or_default();
                let result =
                    crate::persist::write_snapshot(&self.snapshot_source(), states, &dir, kind);
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

    /// A watchdog deadline expired (once per deadline, so this logs once per expiry): pauses
    /// the vCPUs unless the VM is already paused, which is then left as it is.
    fn watchdog_expired(&mut self, handles: &[VcpuHandle], control: &mut Control) {
        // Only an armed watchdog expires.
        let timeout_ms = control.watchdog.armed_ms().unwrap_or_default();
        let expiries = control.watchdog.expiries();
        let (outcome, error) = if control.paused.is_some() {
            tracing::warn!(
                "watchdog: no keep-alive within {timeout_ms} ms (expiry {expiries}); \
                 the VM was already paused and stays so"
            );
            ("already_paused", None)
        } else {
            match pause_all(handles, control) {
                Ok(()) => {
                    control.watchdog.paused_vm();
                    tracing::warn!(
                        "watchdog: no keep-alive within {timeout_ms} ms (expiry {expiries}); \
                         vCPUs paused until the next keep-alive"
                    );
                    ("paused", None)
                }
                Err(e) => {
                    if control.watchdog.pause_failed(Instant::now()) {
                        tracing::error!(
                            "watchdog: no keep-alive within {timeout_ms} ms, and pausing the \
                             vCPUs failed (retried every period, logged once): {e}"
                        );
                    }
                    ("pause_failed", Some(e))
                }
            }
        };
        self.reporter.event(
            "watchdog_expired",
            serde_json::json!({
                "timeout_ms": timeout_ms,
                "expiries": expiries,
                "outcome": outcome,
                "error": error,
                "mono_ns": crate::report::monotonic_ns(),
            }),
        );
    }

    fn stats(&self, control: &Control) -> serde_json::Value {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
        let mut f = statm
            .split_whitespace()
            .map(|x| x.parse::<u64>().unwrap_or(0));
        let (size, rss) = (f.next().unwrap_or(0), f.next().unwrap_or(0));
        serde_json::json!({
            "paused": control.paused.is_some(),
            "watchdog": control.watchdog.to_json(),
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

    /// What a snapshot of this VM is written from (its vCPUs must be paused).
    fn snapshot_source(&self) -> SnapshotSource<'_> {
        SnapshotSource {
            vm_fd: &self.vm_fd,
            memory: &self.memory,
            devices: &self.devices,
            config: &self.config,
            cmdline: &self.cmdline,
            profile: self.profile,
            host: self.host,
            caps: self.caps,
            vcpu_count: self.vcpu_count,
            diff_parent: self.diff_parent.as_deref(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
