//! The secrets store: named values that sandboxes use without ever holding them.
//!
//! A secret's value is written once (create, rotate) and never returned by any API after
//! that: only the host-side egress proxy ([`crate::netpolicy::edge`]) reads it, at request
//! time, to put it in a header of a request leaving a sandbox. Listing returns names and
//! metadata only.
//!
//! At rest the values live in `$EMBER_HOME/secrets.db` (SQLite, mode 0600), each sealed with
//! ChaCha20-Poly1305 under a 256-bit key that is **not** in the database: the env var
//! `EMBER_SECRETS_KEY` (64 hex digits) when set, else `$EMBER_HOME/secrets.key` (hex, mode
//! 0600, created at first use). Each value has its own random nonce, and the secret's name is
//! the associated data, so a sealed value copied onto another name does not open. A store
//! opened with another key refuses to work ([`SecretError::WrongKey`]) rather than hand out
//! garbage.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use rusqlite::{params, OptionalExtension};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The environment variable that holds the key (64 hex digits), overriding the key file.
pub const KEY_ENV: &str = "EMBER_SECRETS_KEY";
/// The key file under `$EMBER_HOME`.
pub const KEY_FILE: &str = "secrets.key";
/// The database under `$EMBER_HOME`.
pub const DB_FILE: &str = "secrets.db";
/// Longest value accepted (bytes).
pub const MAX_VALUE_BYTES: usize = 16 * 1024;
/// Longest name.
pub const MAX_NAME: usize = 64;
/// Most secrets per server.
pub const MAX_SECRETS: usize = 1024;

/// Errors of the secrets store. None of them carries a value.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// No secret of that name.
    #[error("no secret {0:?}")]
    NotFound(String),
    /// Create of a name that exists.
    #[error("secret {0:?} exists already (rotate it to change its value)")]
    Exists(String),
    /// A bad name, value or description.
    #[error("{0}")]
    Invalid(String),
    /// The key (file or env var) is malformed or unreadable.
    #[error("secrets key {source_name}: {message}")]
    Key {
        /// Where the key came from.
        source_name: String,
        /// What is wrong.
        message: String,
    },
    /// A value does not open with the key in use.
    #[error(
        "secret {0:?} does not decrypt with the key in use (was {KEY_ENV} or secrets.key \
         changed?)"
    )]
    WrongKey(String),
    /// A file operation.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The database.
    #[error("secrets database: {0}")]
    Db(#[from] rusqlite::Error),
    /// The system random source.
    #[error("the system random source failed")]
    Random,
}

/// A secret as listing shows it: never its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SecretInfo {
    /// Its name (`[A-Za-z0-9_.-]`, at most 64).
    pub name: String,
    /// The caller's note.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// 1 at create, +1 at each rotation.
    pub version: u64,
    /// Created (ms since the epoch).
    pub created_ms: u64,
    /// Last created or rotated (ms since the epoch).
    pub updated_ms: u64,
}

/// A secret's value in transit (a create or rotate call): its `Debug` never shows it, so a
/// request logged with `{:?}` does not leak it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(transparent)]
pub struct SecretValue(pub String);

impl std::fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretValue(<redacted>)")
    }
}

/// Checks a secret's name.
pub fn check_name(name: &str) -> Result<(), SecretError> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(SecretError::Invalid(format!(
            "secret name {name:?}: 1 to {MAX_NAME} characters"
        )));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err(SecretError::Invalid(format!(
            "secret name {name:?}: only letters, digits, '_', '-' and '.'"
        )));
    }
    Ok(())
}

fn check_value(name: &str, value: &str) -> Result<(), SecretError> {
    if value.is_empty() || value.len() > MAX_VALUE_BYTES {
        return Err(SecretError::Invalid(format!(
            "secret {name:?}: the value must be 1 to {MAX_VALUE_BYTES} bytes"
        )));
    }
    // Values go into HTTP headers: no control characters (CR/LF would split the header).
    if value.chars().any(|c| c.is_control()) {
        return Err(SecretError::Invalid(format!(
            "secret {name:?}: the value has a control character (values are used in HTTP \
             headers)"
        )));
    }
    Ok(())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn parse_hex_key(text: &str, source_name: &str) -> Result<[u8; 32], SecretError> {
    let t = text.trim();
    let bad = |message: &str| SecretError::Key {
        source_name: source_name.to_string(),
        message: message.to_string(),
    };
    if t.len() != 64 {
        return Err(bad("must be 64 hex digits (32 bytes)"));
    }
    let mut key = [0u8; 32];
    for (i, k) in key.iter_mut().enumerate() {
        *k = u8::from_str_radix(&t[2 * i..2 * i + 2], 16)
            .map_err(|_| bad("must be 64 hex digits (32 bytes)"))?;
    }
    Ok(key)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads the key: `EMBER_SECRETS_KEY`, else `home/secrets.key` (created, mode 0600, when
/// absent). A key file readable by others is refused.
fn load_key(home: &Path) -> Result<[u8; 32], SecretError> {
    if let Ok(v) = std::env::var(KEY_ENV) {
        return parse_hex_key(&v, KEY_ENV);
    }
    let path = home.join(KEY_FILE);
    let io = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| SecretError::Io { what, path, source }
    };
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
    {
        Ok(mut f) => {
            let mut key = [0u8; 32];
            SystemRandom::new()
                .fill(&mut key)
                .map_err(|_| SecretError::Random)?;
            f.write_all(format!("{}\n", hex(&key)).as_bytes())
                .and_then(|_| f.sync_all())
                .map_err(io("cannot write", &path))?;
            tracing::info!("created the secrets key {}", path.display());
            Ok(key)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = std::fs::metadata(&path).map_err(io("cannot stat", &path))?;
            if meta.permissions().mode() & 0o077 != 0 {
                return Err(SecretError::Key {
                    source_name: path.display().to_string(),
                    message: format!(
                        "mode {:o} lets others read it; chmod 600 it",
                        meta.permissions().mode() & 0o777
                    ),
                });
            }
            let text = std::fs::read_to_string(&path).map_err(io("cannot read", &path))?;
            parse_hex_key(&text, &path.display().to_string())
        }
        Err(e) => Err(io("cannot create", &path)(e)),
    }
}

/// The store. Cheap to share behind an `Arc`; every method takes its lock briefly.
pub struct SecretStore {
    db: Mutex<rusqlite::Connection>,
    key: LessSafeKey,
    rng: SystemRandom,
}

impl std::fmt::Debug for SecretStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretStore").finish_non_exhaustive()
    }
}

impl SecretStore {
    /// Opens (creating) the store under `home`.
    pub fn open(home: &Path) -> Result<SecretStore, SecretError> {
        let key = load_key(home)?;
        let path = home.join(DB_FILE);
        // Created 0600 before SQLite opens it (SQLite would create it with the umask's mode).
        if !path.exists() {
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(&path)
                .map_err(|source| SecretError::Io {
                    what: "cannot create",
                    path: path.clone(),
                    source,
                })?;
        }
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
        let db = rusqlite::Connection::open(&path)?;
        db.busy_timeout(std::time::Duration::from_secs(5))?;
        db.execute_batch(
            "CREATE TABLE IF NOT EXISTS secrets (
                 name TEXT PRIMARY KEY,
                 description TEXT,
                 version INTEGER NOT NULL,
                 created_ms INTEGER NOT NULL,
                 updated_ms INTEGER NOT NULL,
                 nonce BLOB NOT NULL,
                 sealed BLOB NOT NULL
             );",
        )?;
        let unbound = UnboundKey::new(&CHACHA20_POLY1305, &key).map_err(|_| SecretError::Key {
            source_name: "key".into(),
            message: "unusable".into(),
        })?;
        Ok(SecretStore {
            db: Mutex::new(db),
            key: LessSafeKey::new(unbound),
            rng: SystemRandom::new(),
        })
    }

    fn db(&self) -> std::sync::MutexGuard<'_, rusqlite::Connection> {
        self.db.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn seal(&self, name: &str, value: &str) -> Result<([u8; NONCE_LEN], Vec<u8>), SecretError> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).map_err(|_| SecretError::Random)?;
        let mut buf = value.as_bytes().to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(name.as_bytes()),
                &mut buf,
            )
            .map_err(|_| SecretError::Invalid(format!("secret {name:?}: cannot seal")))?;
        Ok((nonce, buf))
    }

    /// Creates `name` with `value`.
    pub fn create(
        &self,
        name: &str,
        value: &str,
        description: Option<&str>,
    ) -> Result<SecretInfo, SecretError> {
        check_name(name)?;
        check_value(name, value)?;
        if description.is_some_and(|d| d.len() > 1024) {
            return Err(SecretError::Invalid(format!(
                "secret {name:?}: the description is longer than 1024 bytes"
            )));
        }
        let (nonce, sealed) = self.seal(name, value)?;
        let now = now_ms();
        let db = self.db();
        let n: i64 = db.query_row("SELECT COUNT(*) FROM secrets", [], |r| r.get(0))?;
        if n as usize >= MAX_SECRETS {
            return Err(SecretError::Invalid(format!(
                "at most {MAX_SECRETS} secrets per server"
            )));
        }
        let r = db.execute(
            "INSERT INTO secrets (name, description, version, created_ms, updated_ms, nonce, sealed)
             VALUES (?1, ?2, 1, ?3, ?3, ?4, ?5)",
            params![name, description, now as i64, &nonce[..], sealed],
        );
        match r {
            Ok(_) => {}
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::ConstraintViolation =>
            {
                return Err(SecretError::Exists(name.to_string()));
            }
            Err(e) => return Err(e.into()),
        }
        Ok(SecretInfo {
            name: name.to_string(),
            description: description.map(str::to_owned),
            version: 1,
            created_ms: now,
            updated_ms: now,
        })
    }

    /// Replaces `name`'s value (the next request that uses it gets the new one).
    pub fn rotate(&self, name: &str, value: &str) -> Result<SecretInfo, SecretError> {
        check_name(name)?;
        check_value(name, value)?;
        let (nonce, sealed) = self.seal(name, value)?;
        let now = now_ms();
        let n = self.db().execute(
            "UPDATE secrets SET nonce = ?2, sealed = ?3, version = version + 1, updated_ms = ?4
             WHERE name = ?1",
            params![name, &nonce[..], sealed, now as i64],
        )?;
        if n == 0 {
            return Err(SecretError::NotFound(name.to_string()));
        }
        self.info(name)
    }

    /// Deletes `name`.
    pub fn delete(&self, name: &str) -> Result<(), SecretError> {
        let n = self
            .db()
            .execute("DELETE FROM secrets WHERE name = ?1", params![name])?;
        if n == 0 {
            return Err(SecretError::NotFound(name.to_string()));
        }
        Ok(())
    }

    /// One secret's metadata.
    pub fn info(&self, name: &str) -> Result<SecretInfo, SecretError> {
        self.db()
            .query_row(
                "SELECT name, description, version, created_ms, updated_ms FROM secrets
                 WHERE name = ?1",
                params![name],
                row_info,
            )
            .optional()?
            .ok_or_else(|| SecretError::NotFound(name.to_string()))
    }

    /// Every secret's metadata, by name.
    pub fn list(&self) -> Result<Vec<SecretInfo>, SecretError> {
        let db = self.db();
        let mut st = db.prepare(
            "SELECT name, description, version, created_ms, updated_ms FROM secrets
             ORDER BY name",
        )?;
        let rows = st.query_map([], row_info)?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }

    /// The value of `name`: for the egress proxy only (no API returns it).
    pub(crate) fn reveal(&self, name: &str) -> Result<String, SecretError> {
        let row: Option<(Vec<u8>, Vec<u8>)> = self
            .db()
            .query_row(
                "SELECT nonce, sealed FROM secrets WHERE name = ?1",
                params![name],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        let (nonce, mut sealed) = row.ok_or_else(|| SecretError::NotFound(name.to_string()))?;
        let nonce = Nonce::try_assume_unique_for_key(&nonce)
            .map_err(|_| SecretError::WrongKey(name.to_string()))?;
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(name.as_bytes()), &mut sealed)
            .map_err(|_| SecretError::WrongKey(name.to_string()))?;
        String::from_utf8(plain.to_vec()).map_err(|_| SecretError::WrongKey(name.to_string()))
    }
}

/// The store of one runtime home, opened at first use (creating the key then).
#[derive(Debug)]
pub struct Secrets {
    home: PathBuf,
    store: Mutex<Option<std::sync::Arc<SecretStore>>>,
}

impl Secrets {
    /// The store under `home`, not opened yet.
    pub fn new(home: &Path) -> Secrets {
        Secrets {
            home: home.to_path_buf(),
            store: Mutex::new(None),
        }
    }

    /// The store, opened now if it was not.
    pub fn store(&self) -> Result<std::sync::Arc<SecretStore>, SecretError> {
        let mut s = self.store.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = &*s {
            return Ok(s.clone());
        }
        let opened = std::sync::Arc::new(SecretStore::open(&self.home)?);
        *s = Some(opened.clone());
        Ok(opened)
    }

    /// The value of `name` (for the egress proxy only).
    pub(crate) fn reveal(&self, name: &str) -> Result<String, SecretError> {
        self.store()?.reveal(name)
    }
}

fn row_info(r: &rusqlite::Row<'_>) -> rusqlite::Result<SecretInfo> {
    Ok(SecretInfo {
        name: r.get(0)?,
        description: r.get(1)?,
        version: r.get::<_, i64>(2)? as u64,
        created_ms: r.get::<_, i64>(3)? as u64,
        updated_ms: r.get::<_, i64>(4)? as u64,
    })
}

/// A placeholder in a header value: `${secrets.NAME}` (native) or `${e2b.secrets.NAME}`
/// (E2B's spelling). Returns the secret names a template refers to, in order, or an error
/// naming the bad placeholder.
pub fn placeholders(template: &str) -> Result<Vec<String>, SecretError> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(i) = rest.find("${") {
        let after = &rest[i + 2..];
        let Some(end) = after.find('}') else {
            return Err(SecretError::Invalid(format!(
                "{template:?}: a \"${{\" without its \"}}\""
            )));
        };
        let inner = &after[..end];
        let name = inner
            .strip_prefix("secrets.")
            .or_else(|| inner.strip_prefix("e2b.secrets."))
            .ok_or_else(|| {
                SecretError::Invalid(format!(
                    "{template:?}: placeholder ${{{inner}}} is not ${{secrets.NAME}}"
                ))
            })?;
        check_name(name)?;
        out.push(name.to_string());
        rest = &after[end + 1..];
    }
    Ok(out)
}

/// `template` with each placeholder replaced by `lookup(name)`; the first failing lookup is
/// the error (never a partly resolved value).
pub fn resolve(
    template: &str,
    lookup: &dyn Fn(&str) -> Result<String, SecretError>,
) -> Result<String, SecretError> {
    placeholders(template)?;
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let end = after.find('}').unwrap_or(after.len());
        let inner = &after[..end];
        let name = inner
            .strip_prefix("secrets.")
            .or_else(|| inner.strip_prefix("e2b.secrets."))
            .unwrap_or(inner);
        out.push_str(&lookup(name)?);
        rest = after.get(end + 1..).unwrap_or("");
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, SecretStore) {
        let d = tempfile::tempdir().unwrap();
        let s = SecretStore::open(d.path()).unwrap();
        (d, s)
    }

    #[test]
    fn values_are_sealed_at_rest_and_never_listed() {
        let (d, s) = store();
        let value = "sk-live-VERY-SECRET-0123456789";
        let info = s.create("openai", value, Some("the key")).unwrap();
        assert_eq!(info.version, 1);
        assert_eq!(s.reveal("openai").unwrap(), value);
        let listed = serde_json::to_string(&s.list().unwrap()).unwrap();
        assert!(listed.contains("openai") && !listed.contains(value));
        drop(s);
        for f in std::fs::read_dir(d.path()).unwrap() {
            let p = f.unwrap().path();
            let bytes = std::fs::read(&p).unwrap();
            assert!(
                !bytes.windows(value.len()).any(|w| w == value.as_bytes()),
                "{} holds the value in clear",
                p.display()
            );
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", p.display());
        }
    }

    #[test]
    fn rotate_delete_and_errors_name_the_secret() {
        let (_d, s) = store();
        s.create("a", "one", None).unwrap();
        assert!(matches!(
            s.create("a", "two", None),
            Err(SecretError::Exists(_))
        ));
        let i = s.rotate("a", "two").unwrap();
        assert_eq!(i.version, 2);
        assert_eq!(s.reveal("a").unwrap(), "two");
        s.delete("a").unwrap();
        assert!(matches!(s.reveal("a"), Err(SecretError::NotFound(_))));
        assert!(matches!(s.rotate("a", "x"), Err(SecretError::NotFound(_))));
        assert!(s.create("bad name", "x", None).is_err());
        assert!(s.create("x", "a\r\nInjected: 1", None).is_err());
        assert!(s.create("x", "", None).is_err());
    }

    #[test]
    fn another_key_does_not_open_the_store() {
        let (d, s) = store();
        s.create("k", "value", None).unwrap();
        drop(s);
        std::fs::write(d.path().join(KEY_FILE), format!("{}\n", "ab".repeat(32))).unwrap();
        let s = SecretStore::open(d.path()).unwrap();
        assert!(matches!(s.reveal("k"), Err(SecretError::WrongKey(_))));
        // A world-readable key file is refused.
        std::fs::set_permissions(
            d.path().join(KEY_FILE),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let e = SecretStore::open(d.path()).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
    }

    #[test]
    fn placeholders_resolve_wholly_or_not_at_all() {
        assert_eq!(
            placeholders("Bearer ${secrets.openai} ${e2b.secrets.b}").unwrap(),
            ["openai", "b"]
        );
        assert!(placeholders("${env.HOME}").is_err());
        assert!(placeholders("${secrets.open").is_err());
        let lookup = |n: &str| -> Result<String, SecretError> {
            match n {
                "a" => Ok("AAA".into()),
                _ => Err(SecretError::NotFound(n.into())),
            }
        };
        assert_eq!(
            resolve("Bearer ${secrets.a}!", &lookup).unwrap(),
            "Bearer AAA!"
        );
        assert_eq!(resolve("plain", &lookup).unwrap(), "plain");
        assert!(matches!(
            resolve("${secrets.a}${secrets.gone}", &lookup),
            Err(SecretError::NotFound(n)) if n == "gone"
        ));
    }
}
