//! The OCI image spec's documents as far as ember reads them (index, manifest, config), the
//! Docker equivalents, and digests (`sha256:` only).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::OciError;

/// Media types ember understands.
pub mod media {
    /// OCI index.
    pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
    /// OCI manifest.
    pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
    /// Docker manifest list.
    pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
    /// Docker manifest (schema 2).
    pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
    /// Uncompressed OCI layer.
    pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
}

/// The largest manifest, index or config accepted (bytes).
pub const MAX_DOCUMENT: u64 = 4 << 20;

/// A content digest: `sha256:` and 64 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

impl Digest {
    /// Parses `sha256:<64 hex>`; other algorithms are refused by name.
    pub fn parse(text: &str) -> Result<Digest, String> {
        let Some(hex) = text.strip_prefix("sha256:") else {
            return Err(format!(
                "digest {text:?} is not sha256:<hex> (only sha256 is supported)"
            ));
        };
        if hex.len() != 64
            || !hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(format!(
                "digest {text:?} does not have 64 lowercase hex digits"
            ));
        }
        Ok(Digest(text.to_string()))
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest::from_hasher(Sha256::new_with_prefix(bytes))
    }

    /// The digest a finished hasher holds.
    pub fn from_hasher(h: Sha256) -> Digest {
        Digest(format!("sha256:{}", hex(&h.finalize())))
    }

    /// The hex part.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    /// Err([`OciError::DigestMismatch`]) unless `bytes` hash to this digest.
    pub fn verify(&self, what: &str, bytes: &[u8]) -> Result<(), OciError> {
        let actual = Digest::of(bytes);
        if &actual != self {
            return Err(OciError::DigestMismatch {
                what: what.into(),
                expected: self.0.clone(),
                actual: actual.0,
            });
        }
        Ok(())
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl TryFrom<String> for Digest {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Digest::parse(&s)
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A descriptor (index entry, manifest config or layer).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// Media type.
    #[serde(default)]
    pub media_type: String,
    /// Digest of the content.
    pub digest: Digest,
    /// Size in bytes.
    pub size: u64,
    /// Platform (index entries).
    #[serde(default)]
    pub platform: Option<Platform>,
    /// Annotations.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// An index entry's platform.
#[derive(Debug, Clone, Deserialize)]
pub struct Platform {
    /// `amd64`.
    #[serde(default)]
    pub architecture: String,
    /// `linux`.
    #[serde(default)]
    pub os: String,
}

/// An OCI index or a Docker manifest list.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    /// Media type (may be absent in an OCI layout's index.json).
    #[serde(default)]
    pub media_type: Option<String>,
    /// Entries.
    pub manifests: Vec<Descriptor>,
}

/// An OCI manifest or a Docker schema-2 manifest.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// Media type.
    #[serde(default)]
    pub media_type: Option<String>,
    /// The config blob.
    pub config: Descriptor,
    /// The layers, bottom first.
    pub layers: Vec<Descriptor>,
}

/// A manifest document: an index (pick a platform) or an image manifest.
#[derive(Debug, Clone)]
pub enum ManifestDoc {
    /// An index or manifest list.
    Index(Index),
    /// An image manifest.
    Image(Manifest),
}

impl ManifestDoc {
    /// Parses a manifest or an index (by media type, else by shape).
    pub fn parse(what: &str, bytes: &[u8]) -> Result<ManifestDoc, OciError> {
        let bad = |e: serde_json::Error| OciError::BadDocument {
            what: what.into(),
            message: format!("not an image manifest or index: {e}"),
        };
        let v: serde_json::Value = serde_json::from_slice(bytes).map_err(bad)?;
        if v.get("manifests").is_some() {
            Ok(ManifestDoc::Index(serde_json::from_value(v).map_err(bad)?))
        } else if v.get("layers").is_some() {
            Ok(ManifestDoc::Image(serde_json::from_value(v).map_err(bad)?))
        } else if v.get("schemaVersion").and_then(|s| s.as_u64()) == Some(1) {
            Err(OciError::BadDocument {
                what: what.into(),
                message: "Docker schema 1 manifests are not supported (push the image again with a current Docker)".into(),
            })
        } else {
            Err(OciError::BadDocument {
                what: what.into(),
                message: "neither an image manifest (no `layers`) nor an index (no `manifests`)"
                    .into(),
            })
        }
    }
}

/// Picks linux/amd64 from an index (the only platform ember runs).
pub fn pick_platform<'a>(what: &str, index: &'a Index) -> Result<&'a Descriptor, OciError> {
    let found: Vec<String> = index
        .manifests
        .iter()
        .map(|d| match &d.platform {
            Some(p) => format!("{}/{}", p.os, p.architecture),
            None => "(no platform)".into(),
        })
        .collect();
    index
        .manifests
        .iter()
        .find(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
        })
        .or_else(|| {
            // A single-image layout often has no platform: take it.
            (index.manifests.len() == 1 && index.manifests[0].platform.is_none())
                .then(|| &index.manifests[0])
        })
        .ok_or_else(|| OciError::BadDocument {
            what: what.into(),
            message: format!(
                "no linux/amd64 image in the index (it has: {})",
                found.join(", ")
            ),
        })
}

/// The image config (what ember reads of it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    /// `amd64`.
    #[serde(default)]
    pub architecture: String,
    /// `linux`.
    #[serde(default)]
    pub os: String,
    /// The run configuration.
    #[serde(default)]
    pub config: RunConfig,
    /// The layers' uncompressed digests.
    pub rootfs: RootFs,
}

/// `config` of the image config.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct RunConfig {
    /// `KEY=VALUE` strings.
    #[serde(default, deserialize_with = "null_default")]
    pub env: Vec<String>,
    /// The working directory.
    #[serde(default, deserialize_with = "null_default")]
    pub working_dir: String,
    /// The user (`name`, `uid`, `uid:gid`).
    #[serde(default, deserialize_with = "null_default")]
    pub user: String,
    /// Entrypoint.
    #[serde(default, deserialize_with = "null_default")]
    pub entrypoint: Vec<String>,
    /// Cmd.
    #[serde(default, deserialize_with = "null_default")]
    pub cmd: Vec<String>,
}

fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// `rootfs` of the image config.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootFs {
    /// `layers`.
    #[serde(rename = "type", default)]
    pub kind: String,
    /// Uncompressed layer digests, bottom first.
    pub diff_ids: Vec<Digest>,
}

impl ImageConfig {
    /// Parses and checks a config (linux/amd64, a diff id per layer).
    pub fn parse(what: &str, bytes: &[u8], layers: usize) -> Result<ImageConfig, OciError> {
        let c: ImageConfig = serde_json::from_slice(bytes).map_err(|e| OciError::BadDocument {
            what: what.into(),
            message: format!("not an image config: {e}"),
        })?;
        let bad = |message: String| OciError::BadDocument {
            what: what.into(),
            message,
        };
        if (!c.os.is_empty() && c.os != "linux")
            || (!c.architecture.is_empty() && c.architecture != "amd64")
        {
            return Err(bad(format!(
                "the image is for {}/{}; ember runs linux/amd64 images",
                c.os, c.architecture
            )));
        }
        if c.rootfs.diff_ids.len() != layers {
            return Err(bad(format!(
                "the config names {} layer(s) (rootfs.diff_ids) but the manifest has {layers}",
                c.rootfs.diff_ids.len()
            )));
        }
        Ok(c)
    }

    /// `Env` as pairs (entries without `=` are skipped).
    pub fn env(&self) -> BTreeMap<String, String> {
        self.config
            .env
            .iter()
            .filter_map(|e| {
                e.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect()
    }

    /// Entrypoint + Cmd (the command the image starts with), empty when neither is set.
    pub fn start_command(&self) -> Vec<String> {
        self.config
            .entrypoint
            .iter()
            .chain(&self.config.cmd)
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_and_verify() {
        let d = Digest::of(b"abc");
        assert_eq!(
            d.hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(d.verify("x", b"abc").is_ok());
        let e = d.verify("blob x", b"abd").unwrap_err().to_string();
        assert!(e.contains("digest mismatch"), "{e}");
        assert!(Digest::parse("md5:00").is_err());
        assert!(Digest::parse(&format!("sha256:{}", "A".repeat(64))).is_err());
    }

    #[test]
    fn config_fields_and_platform_pick() {
        let cfg = br#"{"architecture":"amd64","os":"linux","config":{"Env":["A=1","PATH=/bin"],"WorkingDir":"/app","User":"1000","Cmd":["python3"],"Entrypoint":null},"rootfs":{"type":"layers","diff_ids":[]}}"#;
        let c = ImageConfig::parse("config", cfg, 0).unwrap();
        assert_eq!(c.env()["A"], "1");
        assert_eq!(c.config.working_dir, "/app");
        assert_eq!(c.start_command(), vec!["python3"]);
        assert!(ImageConfig::parse("config", cfg, 1)
            .unwrap_err()
            .to_string()
            .contains("diff_ids"));
        let arm = br#"{"architecture":"arm64","os":"linux","rootfs":{"diff_ids":[]}}"#;
        assert!(ImageConfig::parse("c", arm, 0)
            .unwrap_err()
            .to_string()
            .contains("linux/amd64"));
        let d = "sha256:".to_string() + &"b".repeat(64);
        let idx = format!(
            r#"{{"manifests":[{{"digest":"{d}","size":1,"platform":{{"os":"linux","architecture":"arm64"}}}}]}}"#
        );
        let ManifestDoc::Index(i) = ManifestDoc::parse("idx", idx.as_bytes()).unwrap() else {
            panic!()
        };
        assert!(pick_platform("idx", &i)
            .unwrap_err()
            .to_string()
            .contains("linux/arm64"));
    }
}
