//! ember's virtual machine monitor.
//!
//! One VM per process: [`builder::build_boot`] sets up KVM, guest memory, the kernel, devices
//! and vCPUs ([`builder::build_restore`] the same from a snapshot, [`persist`]); [`vm::Vm::run`]
//! starts the vCPU threads and runs the epoll event loop on the calling thread until the guest
//! resets or fails. The `ember-vmm` binary is a thin CLI over this; an orchestrator can embed
//! the same types.
//!
//! No two modules use each other, directly or through others (`scripts/check-imports.py`):
//! `builder` uses `vm` and `persist`, `vm` uses `persist`, and all three use `config` and
//! `error`.

pub mod api;
pub mod boot;
pub mod builder;
pub mod cli;
pub mod config;
pub mod console;
pub mod cpu;
pub mod device_manager;
pub mod error;
pub mod kvmstats;
pub mod launcher;
pub mod layer;
pub mod logging;
pub mod memory;
pub mod netns;
pub mod persist;
pub mod pooled;
pub mod report;
pub mod rotating_file;
pub mod seccomp;
pub mod vcpu;
pub mod vm;
pub mod vsock_host;
pub mod vstate;
pub mod watchdog;
pub mod workingset;

pub use config::VmConfig;
pub use cpu::{CpuProfile, HostKvm};
pub use error::VmError;
pub use vm::{Vm, VmExit};
