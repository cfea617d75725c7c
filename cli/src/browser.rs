//! `ember screenshot`: a PNG of a browser sandbox's page (`GET /v1/sandboxes/{id}/screenshot`;
//! docs/browser.md).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use crate::remote::{fail_with, Conn};

/// `ember screenshot ID OUT.png`.
#[derive(Debug, Args)]
pub struct ScreenshotArgs {
    #[command(flatten)]
    conn: Conn,
    /// Sandbox id (of a `browser` template sandbox).
    pub id: String,
    /// Where to write the PNG (`-`: standard output).
    pub out: PathBuf,
    /// The page target to capture (an id from `GET /v1/sandboxes/ID/cdp/json/list`; default:
    /// the first page).
    #[arg(long)]
    pub target: Option<String>,
    /// The whole page, not just the viewport.
    #[arg(long)]
    pub full_page: bool,
}

/// Runs `ember screenshot`.
pub fn screenshot_main(a: ScreenshotArgs) -> ExitCode {
    let c = a.conn.client();
    let mut png = Vec::new();
    if let Err(e) = c.screenshot(&a.id, a.target.as_deref(), a.full_page, &mut png) {
        return fail_with(&c, e, 1);
    }
    let written = if a.out.as_os_str() == "-" {
        std::io::stdout().write_all(&png)
    } else {
        // Written beside the target and renamed, so a failure never leaves half a PNG.
        let tmp = a.out.with_extension("png.part");
        std::fs::write(&tmp, &png).and_then(|()| std::fs::rename(&tmp, &a.out))
    };
    match written {
        Ok(()) => {
            if a.out.as_os_str() != "-" {
                eprintln!("{}: {} bytes", a.out.display(), png.len());
            }
            ExitCode::SUCCESS
        }
        Err(e) => crate::fail(format!("cannot write {}: {e}", a.out.display())),
    }
}
