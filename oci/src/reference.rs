//! Image references: `docker-archive:PATH`, `oci-archive:PATH`, `oci:DIR`, or a registry
//! reference `[HOST[:PORT]/]NAME[:TAG][@sha256:HEX]` (Docker Hub and `library/` implied as
//! `docker pull` does).

use std::fmt;
use std::path::PathBuf;

use crate::spec::Digest;
use crate::OciError;

/// Docker Hub's registry host (for names without a host).
pub const DOCKER_HUB: &str = "registry-1.docker.io";

/// What `--from-image` / `[image] ref` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRef {
    /// A registry reference.
    Registry(RegistryRef),
    /// `docker-archive:PATH`: a `docker save` tar.
    DockerArchive(PathBuf),
    /// `oci-archive:PATH`: a tar of an OCI image layout.
    OciArchive(PathBuf),
    /// `oci:DIR`: an OCI image layout directory.
    OciLayout(PathBuf),
}

/// A registry reference, split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryRef {
    /// `host[:port]` (Docker Hub's API host for names without one).
    pub registry: String,
    /// The repository (`library/python`).
    pub repository: String,
    /// The tag (`latest` when neither tag nor digest is given).
    pub tag: Option<String>,
    /// The pinned manifest digest.
    pub digest: Option<Digest>,
}

impl RegistryRef {
    /// The tag or digest to ask the registry for.
    pub fn reference(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => d.to_string(),
            (None, Some(t)) => t.clone(),
            (None, None) => "latest".into(),
        }
    }
}

impl fmt::Display for RegistryRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

impl ImageRef {
    /// Parses a reference; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<ImageRef, OciError> {
        let bad = |message: &str| OciError::BadReference {
            reference: text.into(),
            message: message.into(),
        };
        let path_of = |rest: &str, kind: &str| {
            if rest.is_empty() {
                Err(bad(&format!("`{kind}:` needs a path after it")))
            } else {
                Ok(PathBuf::from(rest))
            }
        };
        if let Some(rest) = text.strip_prefix("docker-archive:") {
            return Ok(ImageRef::DockerArchive(path_of(rest, "docker-archive")?));
        }
        if let Some(rest) = text.strip_prefix("oci-archive:") {
            return Ok(ImageRef::OciArchive(path_of(rest, "oci-archive")?));
        }
        if let Some(rest) = text.strip_prefix("oci:") {
            return Ok(ImageRef::OciLayout(path_of(rest, "oci")?));
        }
        if let Some(rest) = text.strip_prefix("docker://") {
            return ImageRef::parse(rest);
        }
        if text.is_empty()
            || text.len() > 512
            || text.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(bad("not a reference (empty, too long, or with spaces)"));
        }
        let (name, digest) = match text.split_once('@') {
            Some((n, d)) => (n, Some(Digest::parse(d).map_err(|m| bad(&m))?)),
            None => (text, None),
        };
        // A tag is after the last ':' that comes after the last '/'.
        let slash = name.rfind('/').map(|i| i + 1).unwrap_or(0);
        let (name, tag) = match name[slash..].rfind(':') {
            Some(i) => (&name[..slash + i], Some(name[slash + i + 1..].to_string())),
            None => (name, None),
        };
        if let Some(t) = &tag {
            let ok = !t.is_empty()
                && t.len() <= 128
                && t.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
                && !t.starts_with(['.', '-']);
            if !ok {
                return Err(bad(&format!("tag {t:?} is not valid")));
            }
        }
        let (registry, repository) = match name.split_once('/') {
            Some((host, rest)) if host.contains(['.', ':']) || host == "localhost" => {
                (host.to_string(), rest.to_string())
            }
            _ => {
                let repo = if name.contains('/') {
                    name.to_string()
                } else {
                    format!("library/{name}")
                };
                (DOCKER_HUB.to_string(), repo)
            }
        };
        let repo_ok = !repository.is_empty()
            && repository.split('/').all(|c| {
                !c.is_empty()
                    && c.chars().all(|ch| {
                        ch.is_ascii_lowercase() || ch.is_ascii_digit() || "._-".contains(ch)
                    })
                    && c.starts_with(|ch: char| ch.is_ascii_alphanumeric())
            });
        if !repo_ok {
            return Err(bad(&format!(
                "repository {repository:?} is not valid (lowercase letters, digits, '.', '_', '-', '/')"
            )));
        }
        if registry.is_empty() || registry.contains(['/', '@']) {
            return Err(bad(&format!("registry {registry:?} is not valid")));
        }
        Ok(ImageRef::Registry(RegistryRef {
            registry,
            repository,
            tag,
            digest,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(text: &str) -> RegistryRef {
        match ImageRef::parse(text).unwrap() {
            ImageRef::Registry(r) => r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn registry_references_are_split_as_docker_does() {
        let r = reg("python");
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str()),
            (DOCKER_HUB, "library/python")
        );
        assert_eq!(r.reference(), "latest");
        let r = reg("localhost:5000/team/py:3.11-slim");
        assert_eq!(r.registry, "localhost:5000");
        assert_eq!(r.repository, "team/py");
        assert_eq!(r.tag.as_deref(), Some("3.11-slim"));
        let d = format!("sha256:{}", "a".repeat(64));
        let r = reg(&format!("127.0.0.1:5000/x@{d}"));
        assert_eq!(r.reference(), d);
        assert_eq!(reg("user/app:1").repository, "user/app");
    }

    #[test]
    fn local_sources_and_bad_references() {
        assert_eq!(
            ImageRef::parse("oci:/tmp/x").unwrap(),
            ImageRef::OciLayout("/tmp/x".into())
        );
        assert_eq!(
            ImageRef::parse("docker-archive:a.tar").unwrap(),
            ImageRef::DockerArchive("a.tar".into())
        );
        assert_eq!(
            ImageRef::parse("oci-archive:b.tar").unwrap(),
            ImageRef::OciArchive("b.tar".into())
        );
        for bad in ["", "oci:", "Upper/Case", "x:bad tag", "x@sha256:12", "x:-t"] {
            assert!(ImageRef::parse(bad).is_err(), "{bad:?} parsed");
        }
    }
}
