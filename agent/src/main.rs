//! The `ember-agent` binary: the guest's init when it is PID 1, a small CLI otherwise.
//!
//! `no_main`: the C `main` below replaces Rust's start-up code, which would spend several slow
//! guest syscalls (checking fds 0-2, signal setup, a stack guard that reads /proc/self/maps) that
//! PID 1 does not need. `std` still works, and `std::env::args` too (glibc hands argv to std).
#![cfg_attr(not(test), no_main)]

#[cfg(not(test))]
#[no_mangle]
extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    // As PID 1 this never returns; anywhere else it returns at once.
    let Err(_not_pid1) = ember_agent::init::run();
    ember_agent::cli::main()
}
