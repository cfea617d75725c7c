//! `ember volume`: volumes of a running `ember serve` — create, ls, get, rm — and their files
//! from outside: put, cat, ls-files, mkdir, mv, rm-file (docs/volumes.md).

use std::process::ExitCode;

use clap::{Args, Subcommand};
use ember_runtime::volumes::{VolumeEntry, VolumeInfo};
use ember_server::client::segment;
use serde_json::{json, Value};

use crate::remote::{fail_with, Conn};

/// `ember volume`.
#[derive(Debug, Args)]
pub struct VolumeArgs {
    #[command(flatten)]
    conn: Conn,
    #[command(subcommand)]
    cmd: VolumeCmd,
}

/// Volume commands.
#[derive(Debug, Subcommand)]
pub enum VolumeCmd {
    /// Create a volume.
    Create {
        /// Its name (`a-z 0-9 - _ .`).
        name: String,
        /// Most bytes its files may hold (default 1 GiB); suffixes K, M, G, T (powers of 1024).
        #[arg(long, value_name = "SIZE")]
        cap: Option<String>,
    },
    /// List volumes with their cap, usage and who mounts them.
    Ls {
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// One volume, as JSON.
    Get {
        /// Its name.
        name: String,
    },
    /// Delete a volume and its files (refused while mounted, unless --force).
    Rm {
        /// Its name.
        name: String,
        /// Delete even while sandboxes mount it.
        #[arg(long)]
        force: bool,
    },
    /// Write a file into a volume from a local file, or standard input with `-`.
    Put {
        /// The volume.
        name: String,
        /// Local file, or `-`.
        local: String,
        /// Path in the volume.
        path: String,
    },
    /// Write a volume's file to standard output.
    Cat {
        /// The volume.
        name: String,
        /// Path in the volume.
        path: String,
    },
    /// List a directory of a volume.
    LsFiles {
        /// The volume.
        name: String,
        /// Path in the volume (default the root).
        #[arg(default_value = "/")]
        path: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Make a directory (and its parents) in a volume.
    Mkdir {
        /// The volume.
        name: String,
        /// Path in the volume.
        path: String,
    },
    /// Rename a path of a volume.
    Mv {
        /// The volume.
        name: String,
        /// Current path.
        from: String,
        /// New path.
        to: String,
    },
    /// Remove a path of a volume.
    RmFile {
        /// The volume.
        name: String,
        /// Path in the volume.
        path: String,
        /// A directory with everything in it.
        #[arg(short, long)]
        recursive: bool,
    },
}

/// `SIZE` with an optional K/M/G/T suffix.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("--cap {s:?}: unknown suffix {c:?} (K, M, G or T)")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| format!("--cap {s:?}: not a size"))
}

fn usage(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("ember: error: {msg}");
    ExitCode::from(2)
}

fn print_json(v: &impl serde::Serialize) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

/// `ember volume …`.
pub fn main(a: VolumeArgs) -> ExitCode {
    let c = a.conn.client();
    let vol = |n: &str| format!("/v1/volumes/{}", segment(n));
    let r: Result<Value, _> = match a.cmd {
        VolumeCmd::Create { name, cap } => {
            let cap = match cap.as_deref().map(parse_size).transpose() {
                Ok(c) => c,
                Err(e) => return usage(e),
            };
            c.send(
                "POST",
                "/v1/volumes",
                &json!({"name": name, "cap_bytes": cap}),
            )
        }
        VolumeCmd::Ls { json } => match c.get::<Vec<VolumeInfo>>("/v1/volumes", &[]) {
            Ok(list) if json => {
                print_json(&list);
                return ExitCode::SUCCESS;
            }
            Ok(list) => {
                println!("{:<24}  {:>14}  {:>14}  MOUNTED BY", "NAME", "USED", "CAP");
                for v in list {
                    println!(
                        "{:<24}  {:>14}  {:>14}  {}",
                        v.name,
                        v.used_bytes,
                        v.cap_bytes,
                        v.mounted_by.join(",")
                    );
                }
                return ExitCode::SUCCESS;
            }
            Err(e) => return fail_with(&c, e, 1),
        },
        VolumeCmd::Get { name } => c.get(&vol(&name), &[]),
        VolumeCmd::Rm { name, force } => c.delete(&vol(&name), &[("force", force.to_string())]),
        VolumeCmd::Put { name, local, path } => {
            let r = if local == "-" {
                c.volume_upload(&name, &path, std::io::stdin().lock())
            } else {
                match std::fs::File::open(&local) {
                    Ok(f) => c.volume_upload(&name, &path, f),
                    Err(e) => return usage(format!("{local}: {e}")),
                }
            };
            r.map(|w| json!({"path": w.path, "bytes": w.bytes}))
        }
        VolumeCmd::Cat { name, path } => {
            let mut out = std::io::stdout().lock();
            match c.volume_download(&name, &path, &mut out) {
                Ok(_) => return ExitCode::SUCCESS,
                Err(e) => return fail_with(&c, e, 1),
            }
        }
        VolumeCmd::LsFiles { name, path, json } => {
            match c
                .get::<Vec<VolumeEntry>>(&format!("{}/files/list", vol(&name)), &[("path", path)])
            {
                Ok(list) if json => {
                    print_json(&list);
                    return ExitCode::SUCCESS;
                }
                Ok(list) => {
                    for e in list {
                        let slash = if e.kind == "dir" { "/" } else { "" };
                        println!("{:>12}  {}{slash}", e.size, e.path);
                    }
                    return ExitCode::SUCCESS;
                }
                Err(e) => return fail_with(&c, e, 1),
            }
        }
        VolumeCmd::Mkdir { name, path } => {
            let url = format!("{}/files/mkdir?path={}", vol(&name), segment(&path));
            c.send("POST", &url, &json!({}))
        }
        VolumeCmd::Mv { name, from, to } => c.send(
            "POST",
            &format!("{}/files/rename", vol(&name)),
            &json!({"from": from, "to": to}),
        ),
        VolumeCmd::RmFile {
            name,
            path,
            recursive,
        } => c.delete(
            &format!("{}/files", vol(&name)),
            &[("path", path), ("recursive", recursive.to_string())],
        ),
    };
    match r {
        Ok(v) if v.get("cap_bytes").is_some() => {
            print_json(&v);
            ExitCode::SUCCESS
        }
        Ok(v) if v.get("bytes").is_some() => {
            println!("{} bytes", v["bytes"]);
            ExitCode::SUCCESS
        }
        Ok(_) => {
            println!("ok");
            ExitCode::SUCCESS
        }
        Err(e) => fail_with(&c, e, 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("10").unwrap(), 10);
        assert_eq!(parse_size("2M").unwrap(), 2 << 20);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert!(parse_size("1X").is_err());
        assert!(parse_size("x").is_err());
    }
}
