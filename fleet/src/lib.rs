//! ember on many hosts (`docs/cluster.md`): every host runs `ember node` (its runtime, plus
//! an internal API that takes the runtime's calls), any number of stateless `ember gateway`s
//! serve the native and E2B APIs for the whole fleet and forward each call to the node that
//! holds its sandbox, and a PostgreSQL directory says which nodes are live and which node
//! holds which sandbox.
//!
//! - `blobs`: the blob store (S3 or a directory): bundles of content-addressed chunks.
//! - `transfer`: templates and paused sandboxes into and out of the blob store.
//! - `wire`: how a call (request, streams, reply or error) crosses from gateway to node.
//! - `host`: this host's kind and CPU profile (what a snapshot made here needs).
//! - `node`: the node's internal API and its registration and heartbeat.
//! - `client`: a node's internal API as a `Handler` (what the gateway sends through).
//! - `gateway`: `Fleet`, the gateway's backend: routing, placement, merged lists.
//! - `db`: the directory (nodes, routes), migrated on open.

pub mod blobs;
pub mod client;
pub mod db;
pub mod gateway;
pub mod host;
pub mod node;
pub mod transfer;
pub mod wire;

pub use client::NodeClient;
pub use db::Db;
pub use gateway::Fleet;

/// What goes wrong in the fleet's own parts (the runtime's errors stay the runtime's).
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The directory (PostgreSQL) refused or could not be reached.
    #[error("directory: {0}")]
    Db(String),
    /// What was asked for is neither on this node nor in the blob store.
    #[error("{0}")]
    Missing(String),
    /// The blob store, or what was read from it.
    #[error("blobs: {0}")]
    Blob(String),
    /// The host refused (a thread, a socket).
    #[error("{0}")]
    Io(String),
}

/// Constant-time comparison (the node token is a secret).
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
