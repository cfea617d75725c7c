//! vCPU threads: each runs `KVM_RUN` in a loop and dispatches port-I/O and MMIO exits to the
//! buses. Anything that ends the VM (reset, internal error, failed entry) is reported to the
//! event loop through a channel plus an eventfd.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ember_devices::bus::Bus;
use kvm_bindings::kvm_run;
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use crate::cpu::CpuProfile;
use crate::vstate::{save_vcpu, StateCaps, VcpuState};

/// Why a vCPU stopped running the guest.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum VcpuExitReason {
    /// The guest reset the machine (triple fault or a KVM system-event reset).
    Reset {
        /// The vCPU that saw it.
        vcpu: u8,
    },
    /// The guest powered off (KVM system event).
    PowerOff {
        /// The vCPU that saw it.
        vcpu: u8,
    },
    /// KVM could not run a guest instruction (on kvm_pvm: an instruction its emulator lacks).
    InternalError {
        /// The vCPU.
        vcpu: u8,
        /// Guest instruction pointer at the failure.
        rip: u64,
        /// KVM's sub-error code.
        suberror: u32,
        /// The CPU profile the guest ran with.
        cpu_profile: CpuProfile,
    },
    /// The hardware refused to enter the guest.
    FailEntry {
        /// The vCPU.
        vcpu: u8,
        /// Hardware reason code.
        hardware_reason: u64,
    },
    /// Something else went wrong running the vCPU.
    Error {
        /// The vCPU.
        vcpu: u8,
        /// What happened.
        message: String,
    },
}

impl std::fmt::Display for VcpuExitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Reset { .. } => write!(f, "guest reset"),
            Self::PowerOff { .. } => write!(f, "guest powered off"),
            Self::InternalError {
                vcpu,
                rip,
                suberror,
                cpu_profile,
            } => write!(
                f,
                "KVM_EXIT_INTERNAL_ERROR on vCPU {vcpu} at guest rip {rip:#x} (suberror \
                 {suberror}) with CPU profile '{cpu_profile}': the host's KVM cannot run an \
                 instruction the guest used; map the rip with `addr2line -e vmlinux {rip:#x}` \
                 and hide that CPU feature (try --cpu-profile pvm on kvm_pvm hosts)"
            ),
            Self::FailEntry {
                vcpu,
                hardware_reason,
            } => write!(
                f,
                "KVM could not enter the guest on vCPU {vcpu} (hardware reason {hardware_reason:#x})"
            ),
            Self::Error { vcpu, message } => write!(f, "vCPU {vcpu}: {message}"),
        }
    }
}

/// Shared control block between a vCPU thread and the event loop.
#[derive(Debug, Default)]
pub struct VcpuControl {
    stop: AtomicBool,
    pause: AtomicBool,
    parked: Mutex<Parked>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct Parked {
    paused: bool,
    saved: Option<Result<VcpuState, String>>,
    /// Bumped by every resume: a parked vCPU leaves its wait when this changes, even if a new
    /// pause request has already been made (it then parks again, with fresh state).
    epoch: u64,
}

thread_local! {
    /// This thread's `kvm_run` page, for the kick signal handler.
    static KVM_RUN_PTR: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let run = KVM_RUN_PTR.with(|p| p.get());
    if !run.is_null() {
        // SAFETY: the pointer is this thread's own mmap'ed `kvm_run`, which stays mapped while
        // the vCPU thread runs (it is cleared before the VcpuFd is dropped). Writing a u8
        // field is async-signal-safe; KVM reads it on the next KVM_RUN.
        unsafe { (*run).immediate_exit = 1 };
    }
}

/// The signal used to kick vCPUs.
pub fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

/// Installs the kick handler (once per process).
pub fn install_kick_handler() -> Result<(), vmm_sys_util::errno::Error> {
    register_signal_handler(kick_signal(), kick_handler)
}

/// A running vCPU thread.
#[derive(Debug)]
pub struct VcpuHandle {
    /// The thread.
    pub thread: JoinHandle<()>,
    control: Arc<VcpuControl>,
}

/// How long a vCPU may take to park before pausing is declared failed.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(2);

impl VcpuHandle {
    fn kick(&self) {
        use std::os::unix::thread::JoinHandleExt;
        // SAFETY: the pthread id belongs to a thread we spawned and have not joined, and the
        // kick signal has a handler installed, so delivering it cannot kill the process.
        unsafe { libc::pthread_kill(self.thread.as_pthread_t(), kick_signal()) };
    }

    /// Asks the vCPU to stop and kicks it out of `KVM_RUN`.
    pub fn stop(&self) {
        self.control.stop.store(true, Ordering::SeqCst);
        self.kick();
        self.control.cv.notify_all();
    }

    /// Stops the vCPU at an instruction boundary (pending port/MMIO reads completed) and
    /// returns its saved state. The vCPU stays parked until [`VcpuHandle::resume`].
    pub fn pause(&self) -> Result<VcpuState, String> {
        self.control.pause.store(true, Ordering::SeqCst);
        self.kick();
        let deadline = Instant::now() + PAUSE_TIMEOUT;
        let mut parked = lock(&self.control.parked);
        while !parked.paused {
            let now = Instant::now();
            if now >= deadline {
                return Err("vCPU did not pause within 2 s".into());
            }
            // Re-kick now and then: harmless if the first one already landed.
            let wait = (deadline - now).min(Duration::from_millis(20));
            parked = self
                .control
                .cv
                .wait_timeout(parked, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if !parked.paused {
                self.kick();
            }
        }
        parked
            .saved
            .take()
            .unwrap_or_else(|| Err("vCPU state was already taken".into()))
    }

    /// Lets a paused vCPU run again.
    pub fn resume(&self) {
        // Clear the parked state under the lock, so a pause right after this resume waits for
        // a fresh park instead of seeing the old one (whose state was already taken).
        let mut parked = lock(&self.control.parked);
        self.control.pause.store(false, Ordering::SeqCst);
        parked.paused = false;
        parked.saved = None;
        parked.epoch = parked.epoch.wrapping_add(1);
        drop(parked);
        self.control.cv.notify_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Everything a vCPU thread needs.
pub struct Vcpu {
    /// vCPU index (and APIC id).
    pub id: u8,
    /// The KVM vCPU.
    pub fd: VcpuFd,
    /// Port-I/O bus.
    pub pio: Arc<Bus>,
    /// MMIO bus.
    pub mmio: Arc<Bus>,
    /// The profile in force (for error messages).
    pub profile: CpuProfile,
    /// The CPUID table the vCPU was given (saved with its state).
    pub cpuid: kvm_bindings::CpuId,
    /// MSRs to save, TSC first.
    pub msr_indices: Arc<Vec<u32>>,
    /// Optional state KVM supports here.
    pub caps: StateCaps,
    /// Where the first `KVM_RUN` is reported.
    pub reporter: crate::report::Reporter,
}

impl std::fmt::Debug for Vcpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vcpu")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Vcpu {
    /// Starts the vCPU on its own thread; its exit reason goes to `exits`, then `exit_evt` is
    /// written so the event loop wakes up.
    pub fn start(
        self,
        exits: Sender<VcpuExitReason>,
        exit_evt: EventFd,
    ) -> std::io::Result<VcpuHandle> {
        let control = Arc::new(VcpuControl::default());
        let c2 = control.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{}", self.id))
            .spawn(move || {
                let reason = self.run_loop(&c2);
                if let Some(r) = reason {
                    let _ = exits.send(r);
                    let _ = exit_evt.write(1);
                }
            })?;
        Ok(VcpuHandle { thread, control })
    }

    fn run_loop(mut self, control: &VcpuControl) -> Option<VcpuExitReason> {
        if let Err(e) = crate::seccomp::install_configured(crate::seccomp::ThreadKind::Vcpu) {
            return Some(VcpuExitReason::Error {
                vcpu: self.id,
                message: e.to_string(),
            });
        }
        let run_ptr: *mut kvm_run = self.fd.get_kvm_run();
        KVM_RUN_PTR.with(|p| p.set(run_ptr));
        self.reporter.event(
            "vcpu_first_run",
            serde_json::json!({ "vcpu": self.id, "mono_ns": crate::report::monotonic_ns() }),
        );
        let reason = loop {
            if control.stop.load(Ordering::SeqCst) {
                break None;
            }
            if control.pause.load(Ordering::SeqCst) {
                self.park(control);
                continue;
            }
            if let Some(r) = self.run_once() {
                break Some(r);
            }
        };
        KVM_RUN_PTR.with(|p| p.set(std::ptr::null_mut()));
        reason
    }

    /// Saves state and waits while paused.
    fn park(&mut self, control: &VcpuControl) {
        // A port or MMIO read we just served is only copied into the guest's registers by the
        // next KVM_RUN: run once with immediate_exit so KVM completes it and returns at once.
        self.fd.set_kvm_immediate_exit(1);
        let _ = self.fd.run();
        self.fd.set_kvm_immediate_exit(0);
        let saved = save_vcpu(&self.fd, self.id, &self.cpuid, &self.msr_indices, self.caps)
            .map_err(|e| e.to_string());
        let mut parked = lock(&control.parked);
        parked.saved = Some(saved);
        parked.paused = true;
        let epoch = parked.epoch;
        control.cv.notify_all();
        // Until a resume (the epoch changes) or a stop. If a new pause request is already
        // waiting, the run loop parks again right away with fresh state.
        while parked.epoch == epoch && !control.stop.load(Ordering::SeqCst) {
            parked = control.cv.wait(parked).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// One `KVM_RUN`; `Some` when the vCPU must stop.
    fn run_once(&mut self) -> Option<VcpuExitReason> {
        let id = self.id;
        match self.fd.run() {
            Ok(exit) => match exit {
                VcpuExit::IoIn(port, data) => {
                    if !self.pio.read(u64::from(port), data) {
                        data.fill(0xff);
                    }
                    None
                }
                VcpuExit::IoOut(port, data) => {
                    self.pio.write(u64::from(port), data);
                    None
                }
                VcpuExit::MmioRead(addr, data) => {
                    if !self.mmio.read(addr, data) {
                        data.fill(0xff);
                    }
                    None
                }
                VcpuExit::MmioWrite(addr, data) => {
                    self.mmio.write(addr, data);
                    None
                }
                VcpuExit::Hlt => {
                    // Only reached without an in-kernel LAPIC; ours always has one.
                    Some(VcpuExitReason::Error {
                        vcpu: id,
                        message: "guest halted with HLT exits enabled".into(),
                    })
                }
                VcpuExit::Shutdown => Some(VcpuExitReason::Reset { vcpu: id }),
                VcpuExit::SystemEvent(kind, _) => match kind {
                    kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => {
                        Some(VcpuExitReason::PowerOff { vcpu: id })
                    }
                    kvm_bindings::KVM_SYSTEM_EVENT_RESET => {
                        Some(VcpuExitReason::Reset { vcpu: id })
                    }
                    other => Some(VcpuExitReason::Error {
                        vcpu: id,
                        message: format!("unexpected KVM system event {other}"),
                    }),
                },
                VcpuExit::InternalError => {
                    let run = self.fd.get_kvm_run();
                    // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, so KVM filled the
                    // `internal` member of the exit union.
                    let suberror = unsafe { run.__bindgen_anon_1.internal.suberror };
                    let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                    Some(VcpuExitReason::InternalError {
                        vcpu: id,
                        rip,
                        suberror,
                        cpu_profile: self.profile,
                    })
                }
                VcpuExit::FailEntry(hardware_reason, _) => Some(VcpuExitReason::FailEntry {
                    vcpu: id,
                    hardware_reason,
                }),
                VcpuExit::Intr | VcpuExit::IrqWindowOpen => None,
                other => Some(VcpuExitReason::Error {
                    vcpu: id,
                    message: format!("unhandled KVM exit {other:?}"),
                }),
            },
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                self.fd.set_kvm_immediate_exit(0);
                None
            }
            Err(e) => Some(VcpuExitReason::Error {
                vcpu: id,
                message: format!("KVM_RUN failed: {e}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_error_message_names_rip_and_profile() {
        let r = VcpuExitReason::InternalError {
            vcpu: 0,
            rip: 0xffff_ffff_8100_0000,
            suberror: 1,
            cpu_profile: CpuProfile::Host,
        };
        let s = r.to_string();
        assert!(s.contains("0xffffffff81000000"), "{s}");
        assert!(s.contains("'host'"), "{s}");
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["reason"], "internal_error");
    }
}
