//! The `ember.*` keys of the kernel command line (`/proc/cmdline`).
//!
//! | key | value | meaning |
//! |---|---|---|
//! | `ember.run=<b64>` | standard base64 of a shell command, padding optional | run it as `/bin/sh -c <cmd>`, then reboot |
//! | `ember.quiet` | none, or `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off` | suppress informational lines |
//! | `ember.agent` | none, or a vsock port (decimal) | serve the sandbox protocol on that port (default [`DEFAULT_PORT`]) instead of rebooting; after `ember.run`'s command if both are given |
//! | `ember.net` | `ADDR/PREFIX,GATEWAY` (IPv4) | bring up `lo` and `eth0` with that address, a default route and the gateway as resolver ([`crate::netcfg`]) |
//!
//! Any other `ember.*` key is ignored with a warning; keys outside the `ember.` namespace belong to
//! the kernel and are skipped silently. A key given twice keeps the last value (as the kernel does),
//! with a warning. Splitting follows the kernel's own rules (`next_arg()` in `lib/cmdline.c`):
//! arguments are separated by whitespace, double quotes group (`key="a b"` and `"key=a b"`), and the
//! quotes are not part of the value. Everything after `--` is init's argument list; `ember.*` keys
//! there count too.

use std::fmt;

use thiserror::Error;

use crate::base64::{self, Base64Error};
pub use crate::protocol::DEFAULT_PORT;

/// Prefix of every key this crate owns.
pub const PREFIX: &str = "ember.";
/// Key carrying the base64-encoded shell command.
pub const RUN_KEY: &str = "ember.run";
/// Key that silences informational lines.
pub const QUIET_KEY: &str = "ember.quiet";
/// Key that makes PID 1 serve the sandbox protocol on a vsock port.
pub const AGENT_KEY: &str = "ember.agent";
/// Key that configures the guest's network interface.
pub const NET_KEY: &str = "ember.net";

/// What the guest was told to do at boot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BootConfig {
    /// The decoded shell command (UTF-8, no NUL).
    pub run: Option<String>,
    /// Suppress informational console lines.
    pub quiet: bool,
    /// Serve the sandbox protocol on this vsock port (after the command, if any).
    pub agent: Option<u32>,
    /// Configure `eth0` (before the command and the agent).
    pub net: Option<crate::netcfg::NetSpec>,
    /// Things that were ignored; the boot goes on.
    pub warnings: Vec<CmdlineWarning>,
}

/// A command line the agent must not act on.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CmdlineError {
    /// A key that needs a value was given without one (or with an empty one).
    #[error("{key} needs a value ({key}=<base64 of a shell command>)")]
    MissingValue {
        /// The key.
        key: &'static str,
    },
    /// The value of a base64 key did not decode.
    #[error("{key}: value {value:?} is not valid base64: {source}")]
    BadBase64 {
        /// The key.
        key: &'static str,
        /// The raw value (shortened if long).
        value: String,
        /// What was wrong with it.
        #[source]
        source: Base64Error,
    },
    /// The decoded command is not UTF-8: most likely the value was never base64-encoded (plain
    /// words such as `echo` happen to be valid base64 and decode to binary noise).
    #[error("{key}: the decoded command is not UTF-8 (was the value base64-encoded?): {value:?}")]
    NotUtf8 {
        /// The key.
        key: &'static str,
        /// The raw value (shortened if long).
        value: String,
    },
    /// A port that is not a decimal number below 4294967295 (`VMADDR_PORT_ANY`).
    #[error("{key}={value:?}: not a vsock port (a decimal number below 4294967295)")]
    BadPort {
        /// The key.
        key: &'static str,
        /// The value as given (shortened if long).
        value: String,
    },
    /// `ember.net` is not `ADDR/PREFIX,GATEWAY`.
    #[error("{key}={value:?}: {reason} (expected ADDR/PREFIX,GATEWAY, e.g. 10.0.0.2/30,10.0.0.1)")]
    BadNet {
        /// The key.
        key: &'static str,
        /// The value as given (shortened if long).
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// The decoded command contains a NUL byte, which no `execve` argument can carry.
    #[error("{key}: the decoded command contains a NUL byte at offset {offset}")]
    NulInCommand {
        /// The key.
        key: &'static str,
        /// Offset of the first NUL in the decoded command.
        offset: usize,
    },
}

/// Something on the command line that was ignored.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CmdlineWarning {
    /// An `ember.*` key this version does not know.
    #[error("unknown key {key:?} ignored")]
    UnknownKey {
        /// The key as given.
        key: String,
    },
    /// A key given more than once.
    #[error("{key} given more than once; the last one counts")]
    Repeated {
        /// The key.
        key: &'static str,
    },
    /// A flag whose value is not a boolean.
    #[error("{key}={value:?} is not a boolean (1/0, true/false, yes/no, on/off); ignored")]
    NotABoolean {
        /// The key.
        key: &'static str,
        /// The value as given.
        value: String,
    },
}

/// One argument of the command line: a key and, if there was an `=`, its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arg<'a> {
    /// Text before the first `=` (quotes removed).
    pub key: &'a str,
    /// Text after the first `=` (quotes removed), if there was one.
    pub value: Option<&'a str>,
}

impl fmt::Display for Arg<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.value {
            Some(value) => write!(f, "{}={}", self.key, value),
            None => f.write_str(self.key),
        }
    }
}

/// Splits a command line into arguments the way the kernel's `next_arg()` does.
pub fn split(cmdline: &str) -> Splitter<'_> {
    Splitter { rest: cmdline }
}

/// Iterator returned by [`split`].
#[derive(Debug, Clone)]
pub struct Splitter<'a> {
    rest: &'a str,
}

impl<'a> Iterator for Splitter<'a> {
    type Item = Arg<'a>;

    fn next(&mut self) -> Option<Arg<'a>> {
        let args = self
            .rest
            .trim_start_matches(|c: char| c.is_ascii_whitespace());
        if args.is_empty() {
            self.rest = args;
            return None;
        }
        let quoted = args.starts_with('"');
        let body = if quoted { &args[1..] } else { args };

        let mut in_quote = quoted;
        let mut equals = None;
        let mut end = body.len();
        for (i, c) in body.char_indices() {
            if c.is_ascii_whitespace() && !in_quote {
                end = i;
                break;
            }
            if equals.is_none() && c == '=' {
                equals = Some(i);
            }
            if c == '"' {
                in_quote = !in_quote;
            }
        }
        self.rest = &body[end..];
        let mut arg = &body[..end];
        // A leading quote around the whole argument ("key=a b") closes at its end.
        if quoted {
            arg = arg.strip_suffix('"').unwrap_or(arg);
        }
        let (key, value) = match equals {
            Some(i) if i < arg.len() => {
                let value = &arg[i + 1..];
                // Quotes around the value are not part of it.
                let value = match value.strip_prefix('"') {
                    Some(inner) => inner.strip_suffix('"').unwrap_or(inner),
                    None => value,
                };
                (&arg[..i], Some(value))
            }
            _ => (arg, None),
        };
        Some(Arg { key, value })
    }
}

/// Parses the `ember.*` keys of a kernel command line.
///
/// Warnings (unknown keys, repeats) are collected in [`BootConfig::warnings`]; an `ember.run` that
/// cannot be acted on is an error, so that a typo never silently boots into "no command".
pub fn parse(cmdline: &str) -> Result<BootConfig, CmdlineError> {
    let mut config = BootConfig::default();
    let mut run_value: Option<Option<&str>> = None;
    let mut seen_quiet = false;
    let mut agent_value: Option<Option<&str>> = None;
    let mut net_value: Option<Option<&str>> = None;

    for arg in split(cmdline) {
        if !arg.key.starts_with(PREFIX) {
            continue;
        }
        match arg.key {
            RUN_KEY => {
                if run_value.is_some() {
                    config
                        .warnings
                        .push(CmdlineWarning::Repeated { key: RUN_KEY });
                }
                run_value = Some(arg.value);
            }
            QUIET_KEY => {
                if seen_quiet {
                    config
                        .warnings
                        .push(CmdlineWarning::Repeated { key: QUIET_KEY });
                }
                seen_quiet = true;
                match arg.value.map(parse_bool) {
                    None => config.quiet = true,
                    Some(Some(value)) => config.quiet = value,
                    Some(None) => config.warnings.push(CmdlineWarning::NotABoolean {
                        key: QUIET_KEY,
                        value: arg.value.unwrap_or_default().to_owned(),
                    }),
                }
            }
            AGENT_KEY => {
                if agent_value.is_some() {
                    config
                        .warnings
                        .push(CmdlineWarning::Repeated { key: AGENT_KEY });
                }
                agent_value = Some(arg.value);
            }
            NET_KEY => {
                if net_value.is_some() {
                    config
                        .warnings
                        .push(CmdlineWarning::Repeated { key: NET_KEY });
                }
                net_value = Some(arg.value);
            }
            other => config.warnings.push(CmdlineWarning::UnknownKey {
                key: other.to_owned(),
            }),
        }
    }

    if let Some(value) = run_value {
        config.run = Some(decode_command(RUN_KEY, value)?);
    }
    if let Some(value) = agent_value {
        config.agent = Some(parse_port(AGENT_KEY, value)?);
    }
    if let Some(value) = net_value {
        let value = value.unwrap_or_default();
        let spec = value.parse().map_err(|reason| CmdlineError::BadNet {
            key: NET_KEY,
            value: shorten(value),
            reason,
        })?;
        config.net = Some(spec);
    }
    Ok(config)
}

/// No value: the default port. Otherwise digits only, and not `VMADDR_PORT_ANY`.
fn parse_port(key: &'static str, value: Option<&str>) -> Result<u32, CmdlineError> {
    let Some(value) = value else {
        return Ok(DEFAULT_PORT);
    };
    let port = (!value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()))
        .then(|| value.parse::<u32>().ok())
        .flatten()
        .filter(|&port| port != u32::MAX);
    port.ok_or_else(|| CmdlineError::BadPort {
        key,
        value: shorten(value),
    })
}

fn decode_command(key: &'static str, value: Option<&str>) -> Result<String, CmdlineError> {
    let value = match value {
        Some(v) if !v.is_empty() => v,
        _ => return Err(CmdlineError::MissingValue { key }),
    };
    let command = base64::decode(value.as_bytes()).map_err(|source| CmdlineError::BadBase64 {
        key,
        value: shorten(value),
        source,
    })?;
    if let Some(offset) = command.iter().position(|&b| b == 0) {
        return Err(CmdlineError::NulInCommand { key, offset });
    }
    String::from_utf8(command).map_err(|_| CmdlineError::NotUtf8 {
        key,
        value: shorten(value),
    })
}

fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "true" | "yes" | "on" | "y" => Some(true),
        "0" | "false" | "no" | "off" | "n" => Some(false),
        _ => None,
    }
}

/// Keeps error messages on one console line.
fn shorten(value: &str) -> String {
    const MAX: usize = 60;
    match value.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}...", &value[..i]),
        None => value.to_owned(),
    }
}

/// Formats an `ember.run=` argument for a shell command (for hosts and tests).
pub fn run_arg(command: &str) -> String {
    format!("{RUN_KEY}={}", base64::encode(command.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cmdline: &str) -> Vec<(String, Option<String>)> {
        split(cmdline)
            .map(|a| (a.key.to_owned(), a.value.map(str::to_owned)))
            .collect()
    }

    fn kv(key: &str, value: Option<&str>) -> (String, Option<String>) {
        (key.to_owned(), value.map(str::to_owned))
    }

    #[test]
    fn splits_like_the_kernel() {
        assert_eq!(
            args("  console=ttyS0 reboot=k  ro\tquiet\n"),
            vec![
                kv("console", Some("ttyS0")),
                kv("reboot", Some("k")),
                kv("ro", None),
                kv("quiet", None),
            ]
        );
        assert!(args("").is_empty());
        assert!(args(" \n ").is_empty());
    }

    #[test]
    fn splits_quoted_values() {
        assert_eq!(
            args(r#"a="x y" "b=p q" c= d=e=f"#),
            vec![
                kv("a", Some("x y")),
                kv("b", Some("p q")),
                kv("c", Some("")),
                kv("d", Some("e=f")),
            ]
        );
        // An unterminated quote runs to the end, as in the kernel.
        assert_eq!(args(r#"a="x y"#), vec![kv("a", Some("x y"))]);
    }

    #[test]
    fn parses_the_network_key() {
        let config = parse("ember.agent ember.net=10.0.2.2/30,10.0.2.1").unwrap();
        let net = config.net.unwrap();
        assert_eq!(net.addr.to_string(), "10.0.2.2");
        assert_eq!(net.gateway.to_string(), "10.0.2.1");
        assert!(parse("").unwrap().net.is_none());
        for bad in [
            "ember.net",
            "ember.net=",
            "ember.net=10.0.2.2/30",
            "ember.net=x/30,y",
        ] {
            let e = parse(bad).unwrap_err();
            assert!(matches!(e, CmdlineError::BadNet { .. }), "{bad}: {e}");
            assert!(e.to_string().contains("ADDR/PREFIX,GATEWAY"), "{e}");
        }
    }

    #[test]
    fn parses_run_and_quiet() {
        let line = format!("console=ttyS0 {} ember.quiet --", run_arg("echo hi"));
        let config = parse(&line).unwrap();
        assert_eq!(config.run.as_deref(), Some("echo hi"));
        assert!(config.quiet);
        assert!(config.warnings.is_empty());
    }

    #[test]
    fn no_keys_means_defaults() {
        let config = parse("console=ttyS0 root=/dev/vda ro quiet\n").unwrap();
        assert_eq!(config, BootConfig::default());
    }

    #[test]
    fn run_value_may_be_quoted_and_unpadded() {
        // "ls -l" is bHMgLWw= ; without padding: bHMgLWw
        let config = parse(r#"ember.run="bHMgLWw""#).unwrap();
        assert_eq!(config.run.as_deref(), Some("ls -l"));
        let config = parse(r#""ember.run=bHMgLWw=""#).unwrap();
        assert_eq!(config.run.as_deref(), Some("ls -l"));
    }

    #[test]
    fn command_with_newlines_and_quotes_survives() {
        let cmd = "python3 -c 'print(\"a b\")'\necho \"done\" > /tmp/x";
        let config = parse(&format!("ro {} ", run_arg(cmd))).unwrap();
        assert_eq!(config.run.as_deref(), Some(cmd));
    }

    #[test]
    fn missing_value_is_an_error() {
        for line in [
            "ember.run",
            "ember.run=",
            "ro ember.run= quiet",
            r#"ember.run="""#,
        ] {
            assert_eq!(
                parse(line),
                Err(CmdlineError::MissingValue { key: RUN_KEY }),
                "{line}"
            );
        }
        let msg = parse("ember.run").unwrap_err().to_string();
        assert!(msg.contains("ember.run needs a value"), "{msg}");
    }

    #[test]
    fn bad_base64_is_a_clear_error() {
        assert_eq!(
            parse("ember.run=ZWNo*G8"),
            Err(CmdlineError::BadBase64 {
                key: RUN_KEY,
                value: "ZWNo*G8".into(),
                source: Base64Error::InvalidByte {
                    offset: 4,
                    found: '*'
                },
            })
        );
        let msg = parse("ro ember.run=ZWNo*G8 quiet").unwrap_err().to_string();
        assert_eq!(
            msg,
            "ember.run: value \"ZWNo*G8\" is not valid base64: invalid base64 character '*' \
             at offset 4 (standard alphabet A-Z a-z 0-9 + / expected)"
        );
        // A truncated value.
        assert!(matches!(
            parse(&"ember.run=ZWNobyBoaQ=="[..15]),
            Err(CmdlineError::BadBase64 {
                source: Base64Error::InvalidLength { len: 5 },
                ..
            })
        ));
    }

    #[test]
    fn nul_in_command_is_an_error() {
        let line = format!("ember.run={}", base64::encode(b"echo\0hi"));
        assert_eq!(
            parse(&line),
            Err(CmdlineError::NulInCommand {
                key: RUN_KEY,
                offset: 4
            })
        );
    }

    #[test]
    fn unencoded_command_is_caught() {
        // "echo" is valid base64 but decodes to bytes that are not UTF-8.
        let err = parse("ember.run=echo hi").unwrap_err();
        assert_eq!(
            err,
            CmdlineError::NotUtf8 {
                key: RUN_KEY,
                value: "echo".into()
            }
        );
        assert!(
            err.to_string().contains("was the value base64-encoded?"),
            "{err}"
        );
    }

    #[test]
    fn unknown_keys_warn_but_do_not_fail() {
        let config = parse("ember.foo=1 ember.bar emberx=2 ember.quiet=0").unwrap();
        assert!(!config.quiet);
        assert_eq!(
            config.warnings,
            vec![
                CmdlineWarning::UnknownKey {
                    key: "ember.foo".into()
                },
                CmdlineWarning::UnknownKey {
                    key: "ember.bar".into()
                },
            ]
        );
        assert_eq!(
            config.warnings[0].to_string(),
            "unknown key \"ember.foo\" ignored"
        );
    }

    #[test]
    fn quiet_values() {
        assert!(parse("ember.quiet").unwrap().quiet);
        assert!(parse("ember.quiet=1").unwrap().quiet);
        assert!(parse("ember.quiet=yes").unwrap().quiet);
        assert!(!parse("ember.quiet=off").unwrap().quiet);
        let config = parse("ember.quiet=maybe").unwrap();
        assert!(!config.quiet);
        assert!(matches!(
            config.warnings.as_slice(),
            [CmdlineWarning::NotABoolean { .. }]
        ));
    }

    #[test]
    fn repeated_run_keeps_the_last_and_warns() {
        let line = format!("{} {}", run_arg("true"), run_arg("false"));
        let config = parse(&line).unwrap();
        assert_eq!(config.run.as_deref(), Some("false"));
        assert_eq!(
            config.warnings,
            vec![CmdlineWarning::Repeated { key: RUN_KEY }]
        );
    }

    #[test]
    fn agent_port() {
        assert_eq!(parse("ember.agent").unwrap().agent, Some(DEFAULT_PORT));
        assert_eq!(parse("ro ember.agent=52 quiet").unwrap().agent, Some(52));
        assert_eq!(
            parse("ember.agent=4294967294").unwrap().agent,
            Some(u32::MAX - 1)
        );
        assert_eq!(parse("console=ttyS0").unwrap().agent, None);
        for bad in [
            "",
            "x",
            "-1",
            "+5",
            "4294967295",
            "4294967296",
            "0x10",
            "1 2",
        ] {
            let line = format!("ember.agent=\"{bad}\"");
            assert_eq!(
                parse(&line),
                Err(CmdlineError::BadPort {
                    key: AGENT_KEY,
                    value: bad.into()
                }),
                "{line}"
            );
        }
        let msg = parse("ember.agent=vsock").unwrap_err().to_string();
        assert_eq!(
            msg,
            "ember.agent=\"vsock\": not a vsock port (a decimal number below 4294967295)"
        );
        let config = parse(&format!("ember.agent=1 ember.agent {}", run_arg("true"))).unwrap();
        assert_eq!(config.agent, Some(DEFAULT_PORT));
        assert_eq!(config.run.as_deref(), Some("true"));
        assert_eq!(
            config.warnings,
            vec![CmdlineWarning::Repeated { key: AGENT_KEY }]
        );
    }

    #[test]
    fn long_bad_values_are_shortened_in_errors() {
        let value = "!".repeat(500);
        let msg = parse(&format!("ember.run={value}"))
            .unwrap_err()
            .to_string();
        assert!(msg.len() < 250, "{msg}");
    }
}
