//! What one `run_code` produced, collected ([`Execution`]), and how it ended ([`RunEnd`]).

pub use ember_agent::client::RunEnd;
use ember_agent::protocol::{self, EventKind};

/// Everything one `run_code` produced, collected.
#[derive(Debug, Clone, Default)]
pub struct Execution {
    /// stdout, as received.
    pub stdout: Vec<u8>,
    /// stderr, as received.
    pub stderr: Vec<u8>,
    /// The value of the last expression (MIME bundle), if any.
    pub result: Option<serde_json::Map<String, serde_json::Value>>,
    /// `display` bundles, in order.
    pub displays: Vec<serde_json::Map<String, serde_json::Value>>,
    /// The exception the code raised, if any.
    pub exception: Option<protocol::Exception>,
    /// Whether output was cut at the cap.
    pub truncated: bool,
    /// How it ended.
    pub end: Option<RunEnd>,
}

impl Execution {
    /// Adds one event.
    pub fn push(&mut self, ev: &EventKind) {
        match ev {
            EventKind::Stdout { data } => self.stdout.extend_from_slice(data),
            EventKind::Stderr { data } => self.stderr.extend_from_slice(data),
            EventKind::Result(r) => self.result = Some(r.data.clone()),
            EventKind::Display(d) => self.displays.push(d.data.clone()),
            EventKind::Exception(x) => self.exception = Some(x.clone()),
            EventKind::Truncated { .. } => self.truncated = true,
            _ => {}
        }
    }

    /// stdout as text.
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// The result's `text/plain`, if any.
    pub fn text(&self) -> Option<&str> {
        self.result.as_ref()?.get("text/plain")?.as_str()
    }

    /// Every bundle (result and displays) that has `mime`.
    pub fn all_with(&self, mime: &str) -> Vec<&serde_json::Value> {
        self.result
            .iter()
            .chain(self.displays.iter())
            .filter_map(|b| b.get(mime))
            .collect()
    }
}
