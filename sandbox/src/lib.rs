//! ember's sandbox runtime: templates (a recipe built into a warm snapshot), sandbox handles
//! (a VM restored from one, with `run_code`, contexts, `exec` and files), the [`Runtime`]
//! that owns every sandbox of a host (ids, lifecycle, jails, durable state), the HTTP server
//! and the pieces the `ember` CLI is made of.

pub mod agent_link;
pub mod api;
pub mod client;
pub mod images;
pub mod jail;
pub mod netpolicy;
pub mod paths;
pub mod pool;
pub mod runtime;
pub mod sandbox;
pub mod store;
pub mod template;
pub mod term;

pub use runtime::{Runtime, RuntimeConfig, RuntimeError};
pub use sandbox::{Execution, RunEnd, Sandbox, SandboxError, SandboxOptions};
pub use template::{BuildEvent, BuildOptions, Template, TemplateError, TemplateInfo};
