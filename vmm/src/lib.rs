//! ember's virtual machine monitor.
//!
//! One VM per process: [`vm::Vm::build`] sets up KVM, guest memory, the kernel, devices and
//! vCPUs; [`vm::Vm::run`] starts the vCPU threads and runs the epoll event loop on the calling
//! thread until the guest resets or fails. The `ember-vmm` binary is a thin CLI over this; an
//! orchestrator can embed the same types.

pub mod api;
pub mod boot;
pub mod cli;
pub mod console;
pub mod cpu;
pub mod device_manager;
pub mod kvmstats;
pub mod launcher;
pub mod layer;
pub mod logging;
pub mod memory;
pub mod netns;
pub mod pooled;
pub mod report;
pub mod rotating_file;
pub mod seccomp;
pub mod snapshot;
pub mod vcpu;
pub mod vm;
pub mod vsock_host;
pub mod vstate;
pub mod workingset;

pub use cpu::{CpuProfile, HostKvm};
pub use vm::{Vm, VmConfig, VmError, VmExit};
