//! `ember` subcommands, one file per group (the older `vm`/`bench` groups still live in
//! `main.rs`).

pub mod bench_all;
pub mod bench_api;
pub mod bench_density;
pub mod bench_pool;
pub mod bench_sandbox;
pub mod browser;
pub mod remote;
pub mod render;
pub mod run;
pub mod serve;
pub mod template;
pub mod tls;

use std::process::ExitCode;

/// Prints `ember: error: MSG` and returns exit status 1.
pub fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("ember: error: {msg}");
    ExitCode::from(1)
}
