//! What the server calls: the runtime's call surface ([`Handler`]: one typed request, one
//! typed reply) plus the two things that are not calls — the upload limit and a connection to
//! a guest port (the data plane of the port and CDP proxies). [`Runtime`] implements it; the
//! tests implement it with a fake, and the fleet's gateway will with a node client.

use ember_runtime::call::{call_dyn, Call, Handler, Io};
use ember_runtime::{Runtime, RuntimeError};

/// The runtime as the server sees it. Every method blocks; the server calls them from
/// blocking tasks.
pub trait Backend: Handler + 'static {
    /// Largest upload accepted (the server answers 413 above it).
    fn max_upload_bytes(&self) -> u64;

    /// What the server may hold at once, for the dashboard (`None`s: not known here).
    fn capacity(&self) -> crate::ui::Capacity {
        crate::ui::Capacity {
            max_running: None,
            max_memory_mib: None,
        }
    }

    /// A connection to the guest's `port` (from the sandbox's namespace).
    fn connect_port(
        &self,
        id: &str,
        port: u16,
        require_exposed: bool,
    ) -> Result<std::net::TcpStream, RuntimeError> {
        let _ = (port, require_exposed);
        Err(no_network(id))
    }
}

fn no_network(id: &str) -> RuntimeError {
    RuntimeError::Internal(format!("sandbox {id}: this backend has no networking"))
}

impl dyn Backend {
    /// Sends one call and takes its typed reply.
    pub fn call<C: Call>(&self, call: C, io: Io<'_>) -> Result<C::Reply, RuntimeError> {
        call_dyn(self, call, io)
    }
}

impl Backend for Runtime {
    fn max_upload_bytes(&self) -> u64 {
        self.config().max_upload_bytes
    }
    fn capacity(&self) -> crate::ui::Capacity {
        crate::ui::Capacity {
            max_running: Some(self.config().max_running as u64),
            max_memory_mib: Some(self.config().max_committed_memory_mib),
        }
    }
    fn connect_port(
        &self,
        id: &str,
        port: u16,
        require_exposed: bool,
    ) -> Result<std::net::TcpStream, RuntimeError> {
        Runtime::connect_port(self, id, port, require_exposed)
    }
}
