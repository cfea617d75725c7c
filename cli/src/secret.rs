//! `ember secret`: the secrets store of a running `ember serve` (create, ls, rotate, rm).
//! A value is read from standard input (or an environment variable), never from the command
//! line, where other users could read it in `/proc/<pid>/cmdline`.

use std::io::Read;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use ember_runtime::secrets::SecretInfo;
use ember_server::client::segment;
use serde_json::{json, Value};

use crate::remote::{fail_with, Conn};

/// `ember secret`.
#[derive(Debug, Args)]
pub struct SecretArgs {
    #[command(flatten)]
    conn: Conn,
    #[command(subcommand)]
    cmd: SecretCmd,
}

/// Where a value comes from.
#[derive(Debug, Args)]
pub struct ValueArgs {
    /// Take the value from this environment variable instead of standard input.
    #[arg(long, value_name = "VAR")]
    from_env: Option<String>,
}

/// Secrets commands.
#[derive(Debug, Subcommand)]
pub enum SecretCmd {
    /// Create a secret; its value is read from standard input (one trailing newline dropped).
    Create {
        /// Its name (`[A-Za-z0-9_.-]`).
        name: String,
        /// A note, shown by `ls`.
        #[arg(long)]
        description: Option<String>,
        #[command(flatten)]
        value: ValueArgs,
    },
    /// List secrets: names and metadata (values are never shown).
    Ls {
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Replace a secret's value (read like `create`'s).
    Rotate {
        /// Its name.
        name: String,
        #[command(flatten)]
        value: ValueArgs,
    },
    /// Delete a secret.
    Rm {
        /// Its name.
        name: String,
    },
}

fn read_value(v: &ValueArgs) -> Result<String, String> {
    let mut s = match &v.from_env {
        Some(var) => {
            std::env::var(var).map_err(|_| format!("--from-env {var}: the variable is not set"))?
        }
        None => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .map_err(|e| format!("reading the value from standard input: {e}"))?;
            s
        }
    };
    if s.ends_with('\n') {
        s.pop();
        if s.ends_with('\r') {
            s.pop();
        }
    }
    if s.is_empty() {
        return Err("the value is empty (give it on standard input or with --from-env)".into());
    }
    Ok(s)
}

fn usage(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("ember: error: {msg}");
    ExitCode::from(2)
}

fn ms_text(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

/// `ember secret …`.
pub fn main(a: SecretArgs) -> ExitCode {
    let c = a.conn.client();
    let r: Result<Value, _> = match a.cmd {
        SecretCmd::Create {
            name,
            description,
            value,
        } => {
            let value = match read_value(&value) {
                Ok(v) => v,
                Err(e) => return usage(e),
            };
            c.send(
                "POST",
                "/v1/secrets",
                &json!({"name": name, "value": value, "description": description}),
            )
        }
        SecretCmd::Rotate { name, value } => {
            let value = match read_value(&value) {
                Ok(v) => v,
                Err(e) => return usage(e),
            };
            c.send(
                "PUT",
                &format!("/v1/secrets/{}", segment(&name)),
                &json!({ "value": value }),
            )
        }
        SecretCmd::Rm { name } => c.delete(&format!("/v1/secrets/{}", segment(&name)), &[]),
        SecretCmd::Ls { json } => match c.get::<Vec<SecretInfo>>("/v1/secrets", &[]) {
            Ok(list) if json => {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&list).unwrap_or_default()
                );
                return ExitCode::SUCCESS;
            }
            Ok(list) => {
                println!(
                    "{:<24}  {:>7}  {:<20}  DESCRIPTION",
                    "NAME", "VERSION", "UPDATED"
                );
                for s in list {
                    println!(
                        "{:<24}  {:>7}  {:<20}  {}",
                        s.name,
                        s.version,
                        ms_text(s.updated_ms),
                        s.description.unwrap_or_default()
                    );
                }
                return ExitCode::SUCCESS;
            }
            Err(e) => return fail_with(&c, e, 1),
        },
    };
    match r {
        Ok(v) => {
            if let Some(name) = v.get("name").and_then(Value::as_str) {
                let version = v.get("version").and_then(Value::as_u64).unwrap_or(0);
                println!("{name} (version {version})");
            } else {
                println!("ok");
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail_with(&c, e, 1),
    }
}
