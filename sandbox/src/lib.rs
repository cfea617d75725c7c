//! ember's sandbox runtime: templates (a recipe built into a warm snapshot) and sandbox
//! handles (a VM restored from one, with `run_code`, contexts, `exec` and files), plus the
//! pieces the `ember` CLI is made of. The runtime with ids, lifecycle and the HTTP server
//! builds on [`Sandbox`] and [`Template`].

pub mod images;
pub mod jail;
pub mod paths;
pub mod sandbox;
pub mod template;
pub mod term;

pub use sandbox::{Execution, RunEnd, Sandbox, SandboxError, SandboxOptions};
pub use template::{BuildEvent, BuildOptions, Template, TemplateError, TemplateInfo};
