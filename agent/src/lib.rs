//! ember-agent: the guest side of ember.
//!
//! Today the binary is the guest's PID 1 ([`init`]): it mounts the early file systems, reads its
//! orders from the kernel command line ([`cmdline`]), reports the boot marker to the VMM
//! ([`marker`]), runs the boot command ([`process`]) and reboots. Later it also serves the sandbox
//! protocol over vsock ([`protocol`]); the host uses that module of this library and nothing else.
//!
//! Run by hand (not as PID 1) the binary is a small CLI for tests: see [`cli`].

pub mod base64;
pub mod cli;
pub mod cmdline;
pub mod console;
pub mod init;
pub mod marker;
pub mod process;
pub mod protocol;
