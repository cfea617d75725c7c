//! `ember-jailer`: see `ember-jailer --help` and jailer/README.md.

use ember_jailer::cli::{self, Command};
use ember_jailer::{VmmExit, EXIT_USAGE};

fn main() {
    let code = match cli::parse(std::env::args_os()) {
        Err(e) => {
            use clap::error::ErrorKind;
            match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    let _ = e.print();
                    0
                }
                _ => {
                    // clap's message starts with "error: ".
                    eprint!("ember-jailer: {}", e.render());
                    EXIT_USAGE
                }
            }
        }
        Ok(Command::Run(cfg)) => match ember_jailer::run(&cfg) {
            Ok(exit) => propagate(exit),
            Err(e) => {
                eprintln!("ember-jailer: error: {e}");
                e.exit_code()
            }
        },
        Ok(Command::Cleanup(cfg)) => match ember_jailer::cleanup(&cfg) {
            Ok(report) => {
                if let Some(n) = report.oom_kills.filter(|&n| n > 0) {
                    eprintln!(
                        "ember-jailer: note: jail {} recorded {n} OOM kill(s) in its memory cgroup",
                        cfg.id
                    );
                }
                0
            }
            Err(e) => {
                eprintln!("ember-jailer: error: {e}");
                e.exit_code()
            }
        },
    };
    std::process::exit(code);
}

/// Exits the way the VMM did: same status, or death by the same signal.
fn propagate(exit: VmmExit) -> i32 {
    match exit {
        VmmExit::Exited(code) => code,
        VmmExit::Signaled {
            signal,
            oom_killed,
            memory_limit,
        } => {
            if oom_killed {
                let limit = memory_limit.map_or_else(|| "unknown".to_string(), |m| m.to_string());
                eprintln!(
                    "ember-jailer: VMM was killed by the OOM killer (memory limit {limit} bytes)"
                );
            }
            let rl = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: setrlimit with a valid struct; no core dump of the jailer.
            unsafe { libc::setrlimit(libc::RLIMIT_CORE, &rl) };
            // SAFETY: restoring the default action and unblocking `signal`
            // only changes this process's signal state.
            unsafe { libc::signal(signal, libc::SIG_DFL) };
            // SAFETY: all-zero is a valid sigset_t; it is initialised below.
            let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
            // SAFETY: `set` is a valid sigset_t.
            unsafe { libc::sigemptyset(&mut set) };
            // SAFETY: `set` is a valid, initialised sigset_t.
            unsafe { libc::sigaddset(&mut set, signal) };
            // SAFETY: `set` is valid; a null old-set pointer is allowed.
            unsafe { libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
            // SAFETY: raising a signal at ourselves; if it does not end the
            // process we fall through to the shell convention below.
            unsafe { libc::raise(signal) };
            128 + signal
        }
    }
}
