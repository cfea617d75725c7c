//! The runtime's secret calls: create, list, rotate, delete. Each is audited with the
//! secret's name only; no call returns a value (see [`crate::secrets`]).

use super::{Runtime, RuntimeError};
use crate::secrets::SecretInfo;

impl Runtime {
    /// Creates secret `name` with `value`.
    pub fn create_secret(
        &self,
        name: &str,
        value: &str,
        description: Option<&str>,
    ) -> Result<SecretInfo, RuntimeError> {
        self.timed(
            None,
            "create_secret",
            serde_json::json!({ "name": name }),
            || {
                Ok(self
                    .inner
                    .secrets
                    .store()?
                    .create(name, value, description)?)
            },
        )
    }

    /// Every secret's name and metadata (never a value).
    pub fn list_secrets(&self) -> Result<Vec<SecretInfo>, RuntimeError> {
        Ok(self.inner.secrets.store()?.list()?)
    }

    /// One secret's metadata.
    pub fn secret_info(&self, name: &str) -> Result<SecretInfo, RuntimeError> {
        Ok(self.inner.secrets.store()?.info(name)?)
    }

    /// Replaces secret `name`'s value; the next request that uses it gets the new one.
    pub fn rotate_secret(&self, name: &str, value: &str) -> Result<SecretInfo, RuntimeError> {
        self.timed(
            None,
            "rotate_secret",
            serde_json::json!({ "name": name }),
            || Ok(self.inner.secrets.store()?.rotate(name, value)?),
        )
    }

    /// Deletes secret `name`. Sandboxes whose rules use it get a 502 for those requests from
    /// then on (never the request without the credential).
    pub fn delete_secret(&self, name: &str) -> Result<(), RuntimeError> {
        self.timed(
            None,
            "delete_secret",
            serde_json::json!({ "name": name }),
            || Ok(self.inner.secrets.store()?.delete(name)?),
        )
    }
}
