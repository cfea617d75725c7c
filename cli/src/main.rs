//! `ember`: boot, snapshot and restore microVMs, run sandboxes, serve them, and benchmark them.
//! One file per subcommand group; this file only names the groups.

mod browser;
mod fleet;
mod mcp;
mod remote;
mod render;
mod run;
mod secret;
mod serve;
mod template;
mod term;
mod tls;
mod vm;
mod volume;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ember_runtime::images;

/// Prints `ember: error: MSG` and returns exit status 1.
pub(crate) fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("ember: error: {msg}");
    ExitCode::from(1)
}

#[derive(Debug, Parser)]
#[command(
    name = "ember",
    version,
    about = "KVM microVMs for running untrusted code"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once per process; boxing the large variants would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run code in a fresh sandbox from a template, print what it produced, throw it away.
    Run(run::RunArgs),
    /// Build, list and remove templates (warm snapshots sandboxes start from).
    #[command(subcommand)]
    Template(template::TemplateCmd),
    /// Work with single VMs.
    #[command(subcommand)]
    Vm(vm::VmCmd),
    /// Benchmarks (reported, with a peer measured in the same run where available).
    #[command(subcommand)]
    Bench(ember_bench_cli::BenchCmd),
    /// Serve the sandbox API over HTTP (the runtime of this host; see docs/api.md).
    Serve(serve::ServeArgs),
    /// Serve this host's runtime as a node of a fleet (docs/cluster.md): the server of
    /// `ember serve`, plus an internal API for the gateways and a heartbeat to the directory.
    Node(fleet::NodeArgs),
    /// Serve the native and E2B APIs for a whole fleet, forwarding each call to the node that
    /// holds its sandbox (stateless: run any number).
    Gateway(fleet::GatewayArgs),
    /// Look at a fleet: its nodes, their capacity, templates and sandboxes.
    #[command(subcommand)]
    Cluster(fleet::ClusterCmd),
    /// Manage sandboxes on a running `ember serve` (EMBER_URL, EMBER_TOKEN).
    Sandbox(remote::SandboxArgs),
    /// Run code in a sandbox's context, streaming its output.
    Code(remote::CodeArgs),
    /// Run a program in a sandbox (`ember exec ID -- cmd args`); exits with its status.
    Exec(remote::ExecArgs),
    /// Copy a file into or out of a sandbox (`./f ID:/path` or `ID:/path ./f`).
    Cp(remote::CpArgs),
    /// List or download a sandbox's artifacts.
    Artifacts(remote::ArtifactsArgs),
    /// Show a sandbox's audit log.
    Logs(remote::LogsArgs),
    /// Secrets that sandboxes' network rules put into requests at the edge (values go in,
    /// never come out; see docs/network.md).
    Secret(secret::SecretArgs),
    /// Volumes: named durable directories mounted into sandboxes (`--volume NAME:/path`), and
    /// their files from outside (docs/volumes.md).
    Volume(volume::VolumeArgs),
    /// Serve MCP on stdio for a local agent, forwarding to the server's /mcp (EMBER_URL,
    /// EMBER_TOKEN); kills the sandboxes it created when it exits. `ember mcp --help` shows
    /// an MCP client's configuration.
    Mcp(mcp::McpArgs),
    /// Save a PNG of a browser sandbox's page (`ember screenshot ID out.png`).
    Screenshot(browser::ScreenshotArgs),
    /// The local CA and certificate of the E2B TLS listener (`ember serve --tls-listen`).
    #[command(subcommand)]
    Tls(tls::TlsCmd),
    /// Build (or locate in the cache) the default guest kernel and root filesystem.
    Images {
        /// Template whose root filesystem to build.
        #[arg(long, default_value = "default")]
        template: String,
    },
}

fn main() -> ExitCode {
    match Cli::parse().cmd {
        Cmd::Run(a) => run::main(a),
        Cmd::Template(c) => template::main(c),
        Cmd::Serve(a) => serve::main(a),
        Cmd::Node(a) => fleet::node_main(a),
        Cmd::Gateway(a) => fleet::gateway_main(a),
        Cmd::Cluster(c) => fleet::cluster_main(c),
        Cmd::Sandbox(a) => remote::sandbox_main(a),
        Cmd::Code(a) => remote::code_main(a),
        Cmd::Exec(a) => remote::exec_main(a),
        Cmd::Cp(a) => remote::cp_main(a),
        Cmd::Artifacts(a) => remote::artifacts_main(a),
        Cmd::Logs(a) => remote::logs_main(a),
        Cmd::Secret(a) => secret::main(a),
        Cmd::Volume(a) => volume::main(a),
        Cmd::Mcp(a) => mcp::main(a),
        Cmd::Screenshot(a) => browser::screenshot_main(a),
        Cmd::Tls(c) => tls::main(c),
        Cmd::Vm(c) => vm::main(c),
        Cmd::Bench(c) => ember_bench_cli::main(c),
        Cmd::Images { template } => {
            match (
                images::default_kernel(),
                ember_runtime::template::default_rootfs(&template),
            ) {
                (Ok(k), Ok(r)) => {
                    println!("kernel: {}\nrootfs: {}", k.display(), r.display());
                    ExitCode::SUCCESS
                }
                (Err(e), _) | (_, Err(e)) => fail(e),
            }
        }
    }
}
