//! The sandbox protocol spoken over vsock (placeholder).
//!
//! A later issue adds it here: length-prefixed frames, a request id per call, streamed events, and
//! the calls `run_code`, `exec`, `files` and `ping` (see the design guide). The host side (`sandbox`
//! crate) depends on this module only, so it must stay free of guest-only code.
