//! The default guest images: the kernel and root filesystem built by the repo's scripts into
//! the content-addressed cache (`$EMBER_CACHE`, default `/var/cache/ember`). Building is
//! idempotent: a cache hit costs a hash of the inputs.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Errors locating or building images.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The repo (with its build scripts) is not where we looked.
    #[error(
        "cannot find ember's source tree (looked for {0}); set EMBER_SRC to the repo checkout \
         or pass --kernel and --rootfs"
    )]
    NoSource(PathBuf),
    /// A build script failed.
    #[error("{script} failed ({status}); its output is above")]
    Build {
        /// The script.
        script: PathBuf,
        /// Its exit status.
        status: std::process::ExitStatus,
    },
    /// The script printed no usable path.
    #[error("{script} printed no artifact path (last line {line:?})")]
    NoPath {
        /// The script.
        script: PathBuf,
        /// What it printed last.
        line: String,
    },
    /// The template recipe is not valid (or could not be read). Boxed: it is large, and rare.
    #[error(transparent)]
    Recipe(Box<dyn std::error::Error + Send + Sync>),
    /// The checked recipe could not be handed to the rootfs build.
    #[error("cannot write the checked recipe to {path}: {source}")]
    RecipeHandOff {
        /// The file it was being written to.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The image could not be pulled or unpacked (or was refused).
    #[error(transparent)]
    Oci(#[from] ember_oci::OciError),
    /// The image lacks what the template asks of it (the message names the fix).
    #[error("{0}")]
    Feature(String),
    /// Running it failed.
    #[error("cannot run {script}: {source}")]
    Run {
        /// The script.
        script: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// The repo checkout: `$EMBER_SRC`, else where this binary was built from.
pub fn source_root() -> Result<PathBuf, ImageError> {
    let root = std::env::var_os("EMBER_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    if root.join("guest-kernel/build.sh").is_file() {
        Ok(root)
    } else {
        Err(ImageError::NoSource(root))
    }
}

pub fn run_script(script: &Path, args: &[&str]) -> Result<PathBuf, ImageError> {
    let out = Command::new("bash")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|source| ImageError::Run {
            script: script.to_path_buf(),
            source,
        })?;
    if !out.status.success() {
        return Err(ImageError::Build {
            script: script.to_path_buf(),
            status: out.status,
        });
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or("").trim().to_string();
    let p = PathBuf::from(&line);
    if line.is_empty() || !p.exists() {
        return Err(ImageError::NoPath {
            script: script.to_path_buf(),
            line,
        });
    }
    Ok(p)
}

/// The default guest kernel (`vmlinux`), built if the cache lacks it.
pub fn default_kernel() -> Result<PathBuf, ImageError> {
    let script = source_root()?.join("guest-kernel/build.sh");
    Ok(run_script(&script, &[])?.join("vmlinux"))
}
