//! `ember run`: one shot, in-process (no server): restore a template into a sandbox, upload
//! files, run each code argument as a cell in the same context, download files, kill.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use ember_agent::protocol::{EndStatus, RunCodeRequest};
use ember_runtime::{Sandbox, SandboxOptions};

use crate::fail;
use crate::render::Renderer;

/// The template `ember run` restores: the one named, else `default` for python and bash and
/// `code-interpreter` (every language) for the others.
fn template_for(a: &RunArgs) -> &str {
    match (
        &a.template,
        ember_agent::protocol::canonical_language(&a.language),
    ) {
        (Some(t), _) => t,
        (None, Some("python" | "bash")) => "default",
        (None, _) => "code-interpreter",
    }
}

/// `ember run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Template to restore (built first if it is not); default: `default` for python and
    /// bash, `code-interpreter` for the other languages.
    #[arg(short, long)]
    pub template: Option<String>,
    /// Code to run; each argument is one cell, run in order in the same context (state is
    /// kept between them). `-` reads a cell from stdin.
    #[arg(required = true)]
    pub code: Vec<String>,
    /// Language of the context: python, bash, javascript (js), typescript (ts), r or java
    /// (the template must have it).
    #[arg(short, long, default_value = "python")]
    pub language: String,
    /// Upload a file before the first cell: `LOCAL[:GUEST]` (default guest path
    /// /workspace/<file name>; repeatable).
    #[arg(long = "put", value_name = "LOCAL[:GUEST]")]
    pub put: Vec<String>,
    /// Download a file after the last cell: `GUEST[:LOCAL]` (default: the out dir;
    /// repeatable).
    #[arg(long = "get", value_name = "GUEST[:LOCAL]")]
    pub get: Vec<String>,
    /// Directory for rich output (images, HTML) and downloads.
    #[arg(long, default_value = "ember-out")]
    pub out_dir: PathBuf,
    /// Time limit per cell, in seconds (the cell is interrupted; later cells still run).
    #[arg(long)]
    pub timeout: Option<u64>,
    /// Print the raw events as JSON lines (`{"cell": N, "event": {...}}`).
    #[arg(long)]
    pub json: bool,
    /// Print timings (create, each cell) on stderr.
    #[arg(long)]
    pub timings: bool,
}

/// Runs `ember run`.
pub fn main(a: RunArgs) -> ExitCode {
    let template = match ember_bench_cli::open_or_build(template_for(&a), false) {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let t0 = Instant::now();
    let opts = SandboxOptions {
        die_with_parent: true,
        ..Default::default()
    };
    let sandbox = match Sandbox::create(&template, &opts) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    if a.timings {
        eprintln!(
            "ember: sandbox {} from {} ready in {:.1} ms",
            sandbox.id(),
            template.name(),
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
    for spec in &a.put {
        let (local, guest) = match spec.split_once(':') {
            Some((l, g)) => (PathBuf::from(l), g.to_string()),
            None => {
                let l = PathBuf::from(spec);
                let name = l
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                (l, format!("/workspace/{name}"))
            }
        };
        if let Err(e) = sandbox.upload(&local, &guest) {
            return fail(e);
        }
    }
    let mut render = Renderer::new(&a.out_dir, a.json);
    let mut failed = false;
    for (i, code) in a.code.iter().enumerate() {
        let code = if code == "-" {
            let mut s = String::new();
            if let Err(e) = std::io::stdin().read_to_string(&mut s) {
                return fail(format!("cannot read code from stdin: {e}"));
            }
            s
        } else {
            code.clone()
        };
        render.start_cell(i + 1);
        let req = RunCodeRequest {
            code,
            language: Some(a.language.clone()),
            timeout_ms: a.timeout.map(|s| s * 1000),
            ..Default::default()
        };
        let t = Instant::now();
        match sandbox.run_code(&req, |ev| render.event(ev)) {
            Ok(end) => {
                if end.status != EndStatus::Ok {
                    failed = true;
                }
                if a.timings {
                    eprintln!(
                        "ember: cell {} took {:.1} ms ({:?})",
                        i + 1,
                        t.elapsed().as_secs_f64() * 1e3,
                        end.status
                    );
                }
            }
            Err(e) => return fail(e),
        }
    }
    for spec in &a.get {
        let (guest, local) = match spec.split_once(':') {
            Some((g, l)) => (g.to_string(), PathBuf::from(l)),
            None => {
                let name = spec.rsplit('/').next().unwrap_or("download");
                (spec.clone(), a.out_dir.join(name))
            }
        };
        if let Some(parent) = local.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        match sandbox.download(&guest, &local) {
            Ok(n) => eprintln!("ember: {guest} → {} ({n} bytes)", local.display()),
            Err(e) => return fail(e),
        }
    }
    let _ = sandbox.kill();
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
