//! ember-agent: the guest side of ember, and the protocol the host speaks to it.
//!
//! The binary is the guest's PID 1 ([`init`]): it mounts the early file systems, reads its
//! orders from the kernel command line ([`cmdline`]), reports boot milestones to the VMM
//! ([`marker`]), runs the boot command ([`process`]) and then either reboots or, with
//! `ember.agent`, serves the sandbox protocol over vsock ([`server`], [`vsock`], [`exec`],
//! [`reaper`], [`system`]).
//!
//! The host uses [`protocol`] (wire types and framing) and [`client`] (a blocking client with
//! the VMM's vsock handshake); both are plain library code with no guest-only behaviour.
//!
//! Run by hand (not as PID 1) the binary is a small CLI for tests: see [`cli`].

pub mod base64;
pub mod cli;
pub mod client;
pub mod cmdline;
pub mod console;
pub mod contexts;
pub mod exec;
pub mod files;
pub mod init;
pub mod marker;
pub mod netcfg;
pub mod process;
pub mod procs;
pub mod protocol;
pub mod reaper;
pub mod server;
pub mod system;
pub mod volume_fuse;
pub mod volume_wire;
pub mod vsock;
