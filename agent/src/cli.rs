//! The command-line interface when `ember-agent` is not PID 1 (tests, debugging on a host).

use std::ffi::OsString;
use std::io::{self, Write};

use crate::cmdline::{self, BootConfig};
use crate::marker::BOOT_MARKER_PORT;

/// Usage text for `--help`.
pub fn usage() -> String {
    format!(
        "\
ember-agent {version}: the guest agent of ember.

As PID 1 (the guest's /sbin/init) it ignores its arguments: it mounts /proc, /sys, /dev, /tmp and
/run, reads /proc/cmdline, writes the boot marker (one byte to I/O port {port:#06x}: 1 = init
ready, 2 = agent listening), runs the boot command, and then either serves the sandbox protocol
over vsock or reboots. Run by hand it offers:

usage: ember-agent --help | --version
       ember-agent parse-cmdline [CMDLINE]   parse CMDLINE (default: /proc/cmdline) as init would
       ember-agent encode-run COMMAND        print the ember.run=... argument that runs COMMAND
       ember-agent volume-mount PORT NAME:PATH[:ro]...
                                             mount host volumes (FUSE over vsock to host PORT)
                                             and leave a daemon serving them (docs/volumes.md)

Kernel command-line keys:
  {run}=<base64>   run `/bin/sh -c <decoded>` (standard base64, padding optional), then reboot
  {quiet}[=<bool>] suppress informational lines (warnings and the command's status still print)
  {agent}[=<port>] after the command (if any), serve the sandbox protocol on this vsock port
                   (default {default_port}) instead of rebooting; see agent/PROTOCOL.md
",
        version = env!("CARGO_PKG_VERSION"),
        port = BOOT_MARKER_PORT,
        run = cmdline::RUN_KEY,
        quiet = cmdline::QUIET_KEY,
        agent = cmdline::AGENT_KEY,
        default_port = cmdline::DEFAULT_PORT,
    )
}

/// Exit status for a command line the CLI does not understand.
pub const EXIT_USAGE: i32 = 2;

/// Entry point of the CLI: runs it on the process's own arguments and stdio.
pub fn main() -> i32 {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let code = run(&args, &mut io::stdout().lock(), &mut io::stderr().lock());
    // With `no_main`, nothing flushes stdout at exit.
    let _ = io::stdout().flush();
    code
}

/// Runs the CLI on `args` (without the program name), writing to `out` and `err`.
pub fn run(args: &[OsString], out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let args: Vec<String> = match args.iter().map(|a| a.clone().into_string()).collect() {
        Ok(args) => args,
        Err(bad) => {
            let _ = writeln!(err, "error: argument {bad:?} is not UTF-8");
            return EXIT_USAGE;
        }
    };
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        [] => {
            let _ = write!(err, "{}", usage());
            let _ = writeln!(
                err,
                "error: a subcommand is needed (this process is not PID 1)"
            );
            EXIT_USAGE
        }
        ["-h" | "--help" | "help"] => {
            let _ = write!(out, "{}", usage());
            0
        }
        ["-V" | "--version"] => {
            let _ = writeln!(out, "ember-agent {}", env!("CARGO_PKG_VERSION"));
            0
        }
        ["parse-cmdline"] => match crate::init::read_cmdline(crate::init::PROC_CMDLINE) {
            Ok(line) => parse_cmdline(&line, out, err),
            Err(e) => {
                let _ = writeln!(err, "error: reading /proc/cmdline failed: {e}");
                1
            }
        },
        ["parse-cmdline", line] => parse_cmdline(line, out, err),
        ["volume-mount", port, specs @ ..] if !specs.is_empty() => {
            let Ok(port) = port.parse::<u32>() else {
                let _ = writeln!(err, "error: volume-mount: PORT {port:?} is not a number");
                return EXIT_USAGE;
            };
            let mut parsed = Vec::new();
            for s in specs {
                match crate::volume_fuse::parse_spec(s) {
                    Ok(m) => parsed.push(m),
                    Err(e) => {
                        let _ = writeln!(err, "error: volume-mount: {e}");
                        return EXIT_USAGE;
                    }
                }
            }
            crate::volume_fuse::mount_command(port, &parsed, err)
        }
        ["encode-run", command] => {
            let _ = writeln!(out, "{}", cmdline::run_arg(command));
            0
        }
        _ => {
            let _ = writeln!(
                err,
                "error: unknown arguments {args:?}; see `ember-agent --help`"
            );
            EXIT_USAGE
        }
    }
}

/// Prints what the init would make of `line`: 0 if it would act on it, 1 if it is refused.
fn parse_cmdline(line: &str, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    match cmdline::parse(line) {
        Ok(config) => {
            let _ = out.write_all(describe(&config).as_bytes());
            0
        }
        Err(e) => {
            let _ = writeln!(err, "error: {e}");
            1
        }
    }
}

/// One `name: value` line per setting, then one `warning: ...` line per warning.
pub fn describe(config: &BootConfig) -> String {
    let mut s = String::new();
    match &config.run {
        Some(command) => s.push_str(&format!("run: {command:?}\n")),
        None => s.push_str("run: (none)\n"),
    }
    s.push_str(&format!("quiet: {}\n", config.quiet));
    match config.agent {
        Some(port) => s.push_str(&format!("agent: vsock port {port}\n")),
        None => s.push_str("agent: (off)\n"),
    }
    for warning in &config.warnings {
        s.push_str(&format!("warning: {warning}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> (i32, String, String) {
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = run(&args, &mut out, &mut err);
        (
            code,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    #[test]
    fn help_goes_to_stdout() {
        let (code, out, err) = cli(&["--help"]);
        assert_eq!(code, 0);
        assert!(out.contains("usage: ember-agent"), "{out}");
        assert!(out.contains("0x0ef0") && out.contains("ember.run"), "{out}");
        assert!(err.is_empty());
    }

    #[test]
    fn no_arguments_is_a_usage_error() {
        let (code, out, err) = cli(&[]);
        assert_eq!(code, EXIT_USAGE);
        assert!(out.is_empty());
        assert!(err.contains("not PID 1"), "{err}");
    }

    #[test]
    fn parse_cmdline_prints_what_it_found() {
        let (code, out, _) = cli(&[
            "parse-cmdline",
            "console=ttyS0 ember.run=ZWNobyBoaQ ember.quiet ember.colour=blue",
        ]);
        assert_eq!(code, 0);
        assert_eq!(
            out,
            "run: \"echo hi\"\nquiet: true\nagent: (off)\n\
             warning: unknown key \"ember.colour\" ignored\n"
        );
    }

    #[test]
    fn parse_cmdline_shows_the_agent_port() {
        let (code, out, _) = cli(&["parse-cmdline", "ember.agent"]);
        assert_eq!(code, 0);
        assert_eq!(out, "run: (none)\nquiet: false\nagent: vsock port 1024\n");
        let (code, _, err) = cli(&["parse-cmdline", "ember.agent=x"]);
        assert_eq!(code, 1);
        assert!(err.contains("not a vsock port"), "{err}");
    }

    #[test]
    fn parse_cmdline_reports_bad_base64() {
        let (code, out, err) = cli(&["parse-cmdline", "ember.run=not-base64!"]);
        assert_eq!(code, 1);
        assert!(out.is_empty());
        assert!(
            err.starts_with("error: ember.run: value \"not-base64!\" is not valid base64"),
            "{err}"
        );
    }

    #[test]
    fn encode_run_round_trips_through_parse() {
        let (code, out, _) = cli(&["encode-run", "python3 -c 'print(1 + 1)'"]);
        assert_eq!(code, 0);
        let (code, out, _) = cli(&["parse-cmdline", out.trim_end()]);
        assert_eq!(code, 0);
        assert!(
            out.starts_with("run: \"python3 -c 'print(1 + 1)'\"\n"),
            "{out}"
        );
    }

    #[test]
    fn unknown_arguments_are_refused() {
        let (code, _, err) = cli(&["serve", "--now"]);
        assert_eq!(code, EXIT_USAGE);
        assert!(err.contains("unknown arguments"), "{err}");
    }
}
