//! Console lines of the init (`ember-init: ...`), one `write` syscall each.
//!
//! PID 1's stdout and stderr are `/dev/console`. Informational lines go to stdout and are dropped
//! when quiet; warnings and errors go to stderr always. Nothing here panics: a console that cannot
//! be written to is ignored (std's stdout/stderr treat a closed fd as a sink).

use std::fmt;
use std::io::{self, Write};

/// Prefix of every line the init prints.
pub const PREFIX: &str = "ember-init: ";

/// Where the init's own lines go.
#[derive(Debug, Clone, Copy, Default)]
pub struct Console {
    quiet: bool,
}

impl Console {
    /// A console that prints informational lines unless `quiet`.
    pub fn new(quiet: bool) -> Self {
        Self { quiet }
    }

    /// Whether informational lines are suppressed.
    pub fn quiet(&self) -> bool {
        self.quiet
    }

    /// Changes whether informational lines are suppressed.
    pub fn set_quiet(&mut self, quiet: bool) {
        self.quiet = quiet;
    }

    /// An informational line (stdout), dropped when quiet.
    pub fn info(&self, args: fmt::Arguments<'_>) {
        if !self.quiet {
            let _ = io::stdout().lock().write_all(line("", args).as_bytes());
        }
    }

    /// A result line (stdout) printed even when quiet, e.g. the command's exit status.
    pub fn result(&self, args: fmt::Arguments<'_>) {
        let _ = io::stdout().lock().write_all(line("", args).as_bytes());
    }

    /// A warning (stderr): something was skipped, the boot goes on.
    pub fn warn(&self, args: fmt::Arguments<'_>) {
        let _ = io::stderr().write_all(line("warning: ", args).as_bytes());
    }

    /// An error (stderr): something the user asked for will not happen.
    pub fn error(&self, args: fmt::Arguments<'_>) {
        let _ = io::stderr().write_all(line("error: ", args).as_bytes());
    }
}

/// Formats one whole line, so that it goes out in a single write.
pub fn line(kind: &str, args: fmt::Arguments<'_>) -> String {
    let mut s = String::with_capacity(80);
    s.push_str(PREFIX);
    s.push_str(kind);
    let _ = fmt::write(&mut s, args);
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_have_prefix_kind_and_newline() {
        assert_eq!(line("", format_args!("ready")), "ember-init: ready\n");
        assert_eq!(
            line("warning: ", format_args!("mount {} failed", "/sys")),
            "ember-init: warning: mount /sys failed\n"
        );
    }

    #[test]
    fn quiet_is_remembered() {
        let mut console = Console::new(false);
        assert!(!console.quiet());
        console.set_quiet(true);
        assert!(console.quiet());
        // Printing while quiet is a no-op and must not panic.
        console.info(format_args!("dropped"));
    }
}
