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
    /// Template name: a recipe in rootfs/templates/NAME.toml (or, with --from-image, the
    /// name to build the image as).
    pub name: String,
    /// Build from an OCI/Docker image instead of a recipe: a registry reference
    /// (`registry.example/team/py:3.12`, `python@sha256:...`; credentials from
    /// ~/.docker/config.json or the containers auth.json), `docker-archive:PATH` (docker
    /// save), `oci-archive:PATH` or `oci:DIR` (an OCI layout). Layers are unpacked on the host
    /// with every path kept inside the tree, nothing from the image runs on the host, and the
    /// image must have Python >= 3.8 with IPython unless --no-code. See docs/images.md.
    #[arg(long, value_name = "REF", conflicts_with = "dockerfile")]
    pub from_image: Option<String>,
    /// Build from a Dockerfile: FROM (an image as --from-image takes, or `template:NAME`),
    /// RUN, COPY/ADD, ENV, ARG, WORKDIR, USER, SHELL, CMD/ENTRYPOINT. The steps run inside an
    /// ember VM, never on the host, each cached by its inputs. See docs/images.md.
    #[arg(long, value_name = "PATH")]
    pub dockerfile: Option<PathBuf>,
    /// With --dockerfile: the build context COPY reads from (default: the Dockerfile's
    /// directory); its .dockerignore is honoured.
    #[arg(long, value_name = "DIR", requires = "dockerfile")]
    pub context: Option<PathBuf>,
    /// With --dockerfile: a build argument (`NAME=VALUE`), for a declared ARG.
    #[arg(long, value_name = "NAME=VALUE", requires = "dockerfile")]
    pub build_arg: Vec<String>,
    /// With --dockerfile: the network namespace (an `ip netns` name) the build VM's NIC is
    /// put in, so RUN reaches what is there (a package mirror at 172.30.0.1 on that link, or
    /// whatever the namespace routes to). Default: RUN has no network.
    #[arg(long, value_name = "NETNS", requires = "dockerfile")]
    pub build_netns: Option<String>,
    /// With --dockerfile: free space of the root image the steps write to, MiB.
    #[arg(long, value_name = "MIB", requires = "dockerfile")]
    pub disk_mib: Option<u64>,
    /// With --from-image or --dockerfile: no code contexts (exec and files only), for images
    /// without Python or IPython.
    #[arg(long)]
    pub no_code: bool,
    /// With --from-image or --dockerfile: start the image's Entrypoint + Cmd as a service
    /// before the snapshot.
    #[arg(long)]
    pub start: bool,
    /// Build again even if a build with the same inputs exists.
    #[arg(long)]
    pub rebuild: bool,
    /// Guest kernel (default: the repo's, built into the cache).
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Root filesystem image with its manifest.json beside it (default: built from the recipe).
    #[arg(long, conflicts_with = "dockerfile")]
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
    if (a.no_code || a.start) && a.from_image.is_none() && a.dockerfile.is_none() {
        return fail("--no-code and --start go with --from-image or --dockerfile");
    }
    if a.dockerfile.is_some() {
        return dockerfile_build(a, t0);
    }
    // --from-image: a recipe of one `[image]` table, written beside nothing (local paths in the
    // reference are made absolute first: the recipe lives in a temporary directory).
    let recipe_dir = match &a.from_image {
        Some(reference) => match image_recipe(&a.name, reference, a.no_code, a.start) {
            Ok(d) => Some(d),
            Err(e) => return fail(e),
        },
        None => None,
    };
    let opts = BuildOptions {
        kernel: a.kernel.clone(),
        rootfs: a.rootfs.clone(),
        rebuild: a.rebuild,
        recipe: recipe_dir
            .as_ref()
            .map(|d| d.path().join(format!("{}.toml", a.name))),
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
        Ok(t) => report(&a, &t, up_to_date, t0),
        Err(e) => fail(e),
    }
}

/// `--dockerfile`: the steps in a build VM, then the template.
fn dockerfile_build(a: BuildArgs, t0: Instant) -> ExitCode {
    use ember_runtime::template::{dockerfile, DockerIgnore, StepsSpec};
    let path = a.dockerfile.clone().unwrap_or_default();
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => return fail(format!("cannot read {}: {e}", path.display())),
    };
    let mut build_args = std::collections::BTreeMap::new();
    for kv in &a.build_arg {
        match kv.split_once('=') {
            Some((k, v)) => build_args.insert(k.to_string(), v.to_string()),
            None => return fail(format!("--build-arg {kv:?} is not NAME=VALUE")),
        };
    }
    let parsed = match dockerfile::parse(&text, &build_args) {
        Ok(d) => d,
        Err(e) => return fail(format!("{}: {e}", path.display())),
    };
    let context = a.context.clone().unwrap_or_else(|| {
        path.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map(|p| p.to_path_buf())
            .unwrap_or_else(|| PathBuf::from("."))
    });
    let ignore = match std::fs::read_to_string(context.join(".dockerignore")) {
        Ok(t) => DockerIgnore::parse(&t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => DockerIgnore::default(),
        Err(e) => {
            return fail(format!(
                "cannot read {}/.dockerignore: {e}",
                context.display()
            ))
        }
    };
    for n in &parsed.notes {
        eprintln!("[{:7.1}s] note: {n}", t0.elapsed().as_secs_f64());
    }
    let mut spec = StepsSpec::new(parsed.from, parsed.steps);
    spec.run_args = parsed.run_args;
    spec.context = Some(context);
    spec.ignore = ignore;
    spec.netns = a.build_netns.clone();
    if let Some(m) = a.disk_mib {
        spec.disk_mib = m;
    }
    spec.code = !a.no_code;
    spec.start = a.start;
    spec.rebuild = a.rebuild;
    spec.kernel = a.kernel.clone();
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
    match ember_runtime::template::build_from_steps(&a.name, &spec, &mut progress) {
        Ok(t) => report(&a, &t, up_to_date, t0),
        Err(e) => fail(e),
    }
}

/// Prints a finished build.
fn report(a: &BuildArgs, t: &Template, up_to_date: bool, t0: Instant) -> ExitCode {
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
            ms(t, "boot"),
            ms(t, "warmup"),
            ms(t, "snapshot"),
            t.info.snapshot_bytes >> 20
        );
        println!("{}", t.dir.display());
    }
    ExitCode::SUCCESS
}

/// A temporary directory holding `NAME.toml`: an `[image]` recipe for `reference`.
fn image_recipe(
    name: &str,
    reference: &str,
    no_code: bool,
    start: bool,
) -> Result<tempfile::TempDir, String> {
    let absolute = |prefix: &str| -> Option<String> {
        let rest = reference.strip_prefix(prefix)?;
        let p = std::path::Path::new(rest);
        let p = if p.is_absolute() {
            p.to_path_buf()
        } else {
            std::env::current_dir().ok()?.join(p)
        };
        Some(format!("{prefix}{}", p.display()))
    };
    let reference = ["docker-archive:", "oci-archive:", "oci:"]
        .into_iter()
        .find_map(absolute)
        .unwrap_or_else(|| reference.to_string());
    let quote = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let mut text = format!(
        "name = {}\n\n[image]\nref = {}\n",
        quote(name),
        quote(&reference)
    );
    if start {
        text.push_str("start = true\n");
    }
    if no_code {
        text.push_str("\n[warmup]\ncontexts = []\nspare = { python = 0, bash = 0 }\n");
    }
    let dir = tempfile::Builder::new()
        .prefix("ember-image-recipe-")
        .tempdir()
        .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
    let file = dir.path().join(format!("{name}.toml"));
    std::fs::write(&file, text).map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    Ok(dir)
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
