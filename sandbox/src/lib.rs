//! ember's sandbox runtime (templates, sessions and the API server come in later issues) and
//! the pieces the `ember` CLI is made of.

pub mod images;
pub mod jail;
pub mod term;
