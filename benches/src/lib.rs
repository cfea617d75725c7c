//! ember's benchmark harness.
//!
//! Figures are reported, never asserted: each benchmark prints a human table and JSON lines
//! (median, p95, N) and measures a peer in the same run where one is available, because
//! absolute times on one host say little about another; ratios and counts carry over.

pub mod boot;
pub mod clones;
pub mod compare;
pub mod devices;
pub mod plot;
pub mod qemu;
pub mod record;
pub mod report;
pub mod restore;
pub mod stats;
