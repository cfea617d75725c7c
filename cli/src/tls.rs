//! `ember tls`: the local CA and the `*.<domain>` certificate of the E2B TLS listener
//! (`ember serve --tls-listen ADDR --domain D`), and the environment the E2B SDKs need to
//! trust it.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use ember_server::e2b::tls;

use crate::fail;

/// `ember tls ...`.
#[derive(Debug, Subcommand)]
pub enum TlsCmd {
    /// Create (or show) the local CA and the certificate for `*.<domain>` and `<domain>`, write
    /// a CA bundle for SSL_CERT_FILE, and print the environment the E2B SDKs need.
    ///
    /// The output is shell: `eval "$(ember tls init --domain e2b.localhost:3443)"` sets the
    /// variables. The CA is made once and kept; the certificate is re-issued when the domain
    /// changes or it nears expiry. `ember serve --tls-listen` uses the same files.
    Init(InitArgs),
}

/// `ember tls init`.
#[derive(Debug, Args)]
pub struct InitArgs {
    /// The sandbox domain, as the SDKs' E2B_DOMAIN: a name of two labels or more, optionally
    /// with the listener's port (`e2b.localhost:3443`). The SDKs then reach
    /// `https://api.<domain>` and `https://<port>-<sandbox id>.<domain>`.
    #[arg(long)]
    pub domain: String,
    /// Where the CA, certificate and bundle live (default `$EMBER_HOME/tls`).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// Runs `ember tls`.
pub fn main(cmd: TlsCmd) -> ExitCode {
    match cmd {
        TlsCmd::Init(a) => init(a),
    }
}

fn init(a: InitArgs) -> ExitCode {
    let dir = a
        .dir
        .unwrap_or_else(|| ember_runtime::paths::home_dir().join("tls"));
    let host = match tls::cert_domain(&a.domain) {
        Ok(h) => h,
        Err(e) => return fail(e),
    };
    let ca_existed = dir.join("ca.pem").exists();
    let files = match tls::load_or_create(&dir, &a.domain) {
        Ok(f) => f,
        Err(e) => return fail(e),
    };
    let system = std::path::Path::new(tls::SYSTEM_CA_BUNDLE);
    let (bundle, found) = match tls::write_bundle(&dir, system) {
        Ok(b) => b,
        Err(e) => return fail(e),
    };
    let mut no_proxy = vec![
        "127.0.0.1".to_string(),
        "localhost".into(),
        ".localhost".into(),
    ];
    if !host.ends_with(".localhost") {
        no_proxy.push(format!(".{host}"));
        no_proxy.push(host.clone());
    }
    let home = ember_runtime::paths::home_dir();
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# ember local CA: {} ({})",
        files.ca_cert.display(),
        if ca_existed { "existing" } else { "created" }
    );
    let _ = writeln!(
        out,
        "# certificate for *.{host} and {host}: {} (key {})",
        files.cert.display(),
        files.key.display()
    );
    if !found {
        let _ = writeln!(
            out,
            "# warning: {} not found: the bundle holds only ember's CA",
            system.display()
        );
    }
    let _ = writeln!(
        out,
        "# CA bundle (system CAs + ember's): {}",
        bundle.display()
    );
    let _ = writeln!(
        out,
        "# Environment for the E2B SDKs (serve with `ember serve --tls-listen ADDR --domain {}`):",
        a.domain
    );
    let _ = writeln!(
        out,
        "export SSL_CERT_FILE={}",
        shell_quote(&bundle.display().to_string())
    );
    let _ = writeln!(out, "export E2B_DOMAIN={}", shell_quote(&a.domain));
    let _ = writeln!(out, "export NO_PROXY={}", no_proxy.join(","));
    let _ = writeln!(out, "unset E2B_API_URL E2B_SANDBOX_URL");
    let _ = writeln!(
        out,
        "# and E2B_API_KEY=<the server's token> (in {})",
        home.join("token").display()
    );
    // A reader that stops early (`| head`) is not an error.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), out.as_bytes());
    ExitCode::SUCCESS
}

/// `s` single-quoted for a POSIX shell when it holds anything but safe characters.
fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-:,+=@".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}
