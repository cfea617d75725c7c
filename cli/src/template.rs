//! `ember template build|check|ls|rm`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Subcommand};
use ember_runtime::template::{recipe_path, BuildEvent, BuildOptions, Recipe, Template};

use crate::fail;

/// Template commands.
#[derive(Debug, Subcommand)]
pub enum TemplateCmd {
    /// Build a template (rootfs, boot, warm-up, snapshot); a no-op when nothing changed.
    Build(BuildArgs),
    /// Check a recipe against the template schema (every key, type and value); a misspelt key
    /// is named with its table path and the nearest valid name.
    Check {
        /// A template name (rootfs/templates/NAME.toml) or a path to a recipe (.toml).
        recipe: String,
        /// Print the checked recipe, normalised (defaults filled in), as JSON: what the rootfs
        /// build (rootfs/build.py) reads.
        #[arg(long)]
        json: bool,
    },
    /// List built templates.
    Ls {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Remove a built template (its snapshot; the rootfs image stays in the cache).
    Rm {
        /// Template name (or key).
        name: String,
    },
}

/// `ember template build`.
#[derive(Debug, Args)]
pub struct BuildArgs {
    /// Template name: a recipe in rootfs/templates/NAME.toml.
    pub name: String,
    /// Build again even if a build with the same inputs exists.
    #[arg(long)]
    pub rebuild: bool,
    /// Guest kernel (default: the repo's, built into the cache).
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Root filesystem image with its manifest.json beside it (default: built from the recipe).
    #[arg(long)]
    pub rootfs: Option<PathBuf>,
    /// Print the template's record as JSON at the end.
    #[arg(long)]
    pub json: bool,
}

/// Runs a template command.
pub fn main(cmd: TemplateCmd) -> ExitCode {
    match cmd {
        TemplateCmd::Build(a) => build(a),
        TemplateCmd::Check { recipe, json } => check(&recipe, json),
        TemplateCmd::Ls { json } => ls(json),
        TemplateCmd::Rm { name } => match Template::remove(&name) {
            Ok(t) => {
                println!("removed {} ({})", name, t.info.key);
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
    }
}

fn build(a: BuildArgs) -> ExitCode {
    let t0 = Instant::now();
    let opts = BuildOptions {
        kernel: a.kernel,
        rootfs: a.rootfs,
        rebuild: a.rebuild,
        ..Default::default()
    };
    let mut up_to_date = false;
    let mut progress = |ev: BuildEvent| match ev {
        BuildEvent::Step(s) => eprintln!("[{:7.1}s] {s}", t0.elapsed().as_secs_f64()),
        BuildEvent::Output(s) => {
            for line in s.lines() {
                eprintln!("          | {line}");
            }
        }
        BuildEvent::UpToDate => up_to_date = true,
    };
    match Template::build(&a.name, &opts, &mut progress) {
        Ok(t) => {
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"template": t.info, "dir": t.dir, "up_to_date": up_to_date})
                );
            } else if up_to_date {
                eprintln!(
                    "[{:7.1}s] {} is up to date ({})",
                    t0.elapsed().as_secs_f64(),
                    a.name,
                    &t.info.key[..12]
                );
                println!("{}", t.dir.display());
            } else {
                eprintln!(
                    "[{:7.1}s] built {} ({}): boot {:.1}s, warm-up {:.1}s, snapshot {:.1}s, {} MiB on disk",
                    t0.elapsed().as_secs_f64(),
                    a.name,
                    &t.info.key[..12],
                    ms(&t, "boot"),
                    ms(&t, "warmup"),
                    ms(&t, "snapshot"),
                    t.info.snapshot_bytes >> 20
                );
                println!("{}", t.dir.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

fn check(recipe: &str, json: bool) -> ExitCode {
    let file = match recipe_path(recipe) {
        Ok(f) => f,
        Err(e) => return fail(e),
    };
    match Recipe::load(&file) {
        Ok(r) if json => {
            println!("{}", r.builder_json(&file));
            ExitCode::SUCCESS
        }
        Ok(r) => {
            println!("{}: template {} is valid", file.display(), r.name());
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

fn ms(t: &Template, k: &str) -> f64 {
    t.info.timings_ms.get(k).copied().unwrap_or(0) as f64 / 1e3
}

fn ls(json: bool) -> ExitCode {
    let list = match Template::list() {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    if json {
        for (name, t) in &list {
            println!(
                "{}",
                serde_json::json!({"name": name, "key": t.info.key, "dir": t.dir, "info": t.info})
            );
        }
        return ExitCode::SUCCESS;
    }
    if list.is_empty() {
        eprintln!("no templates built (try `ember template build default`)");
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<16} {:<12} {:>5} {:>8} {:>9}  BUILT",
        "NAME", "KEY", "VCPUS", "MEMORY", "SNAPSHOT"
    );
    for (name, t) in &list {
        println!(
            "{:<16} {:<12} {:>5} {:>5}MiB {:>6}MiB  {}",
            name.as_deref().unwrap_or("-"),
            &t.info.key[..12],
            t.info.vm.vcpus,
            t.info.vm.memory_mib,
            t.info.snapshot_bytes >> 20,
            t.info.built_at
        );
    }
    ExitCode::SUCCESS
}
