//! Images on disk: an OCI image layout directory (`oci:DIR`), a tar of one (`oci-archive:`)
//! and a `docker save` archive (`docker-archive:`), read into the [`BlobStore`] with every
//! digest checked. Names inside archives are never used as host paths: blobs are stored under
//! their digests, and only `index.json`, `oci-layout`, `manifest.json` and `blobs/sha256/*`
//! are read at all.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::spec::{
    media, pick_platform, Descriptor, Digest, ImageConfig, ManifestDoc, MAX_DOCUMENT,
};
use crate::store::BlobStore;
use crate::{io_err, Layer, OciError, Progress, PulledImage};

/// The largest layer blob accepted (bytes); the unpacker's caps bound what it expands to.
pub const MAX_BLOB: u64 = 16 << 30;

/// Resolves an index or manifest (`bytes`, named `digest` when known) to an image, fetching
/// each blob it needs into the store with `fetch` (which verifies it).
pub(crate) fn resolve(
    reference: &str,
    bytes: Vec<u8>,
    digest: Option<Digest>,
    store: &BlobStore,
    fetch: &mut dyn FnMut(&Descriptor, u64) -> Result<(), OciError>,
    progress: Progress,
) -> Result<PulledImage, OciError> {
    let mut bytes = bytes;
    let mut digest = digest;
    for _ in 0..3 {
        let what = match &digest {
            Some(d) => format!("{reference}: manifest {d}"),
            None => format!("{reference}: index.json"),
        };
        match ManifestDoc::parse(&what, &bytes)? {
            ManifestDoc::Index(index) => {
                let d = pick_platform(&what, &index)?.clone();
                fetch(&d, MAX_DOCUMENT)?;
                bytes = store.read(&d.digest)?;
                d.digest.verify(&format!("{reference}: manifest"), &bytes)?;
                digest = Some(d.digest);
            }
            ManifestDoc::Image(m) => {
                fetch(&m.config, MAX_DOCUMENT)?;
                let cfg_bytes = store.read(&m.config.digest)?;
                m.config
                    .digest
                    .verify(&format!("{reference}: config"), &cfg_bytes)?;
                let config = ImageConfig::parse(
                    &format!("{reference}: config {}", m.config.digest),
                    &cfg_bytes,
                    m.layers.len(),
                )?;
                let mut layers = Vec::new();
                for (i, (l, diff_id)) in m.layers.iter().zip(&config.rootfs.diff_ids).enumerate() {
                    progress(format!(
                        "layer {}/{}: {} ({} MiB)",
                        i + 1,
                        m.layers.len(),
                        short(&l.digest),
                        l.size >> 20
                    ));
                    fetch(l, MAX_BLOB)?;
                    layers.push(Layer {
                        digest: l.digest.clone(),
                        media_type: l.media_type.clone(),
                        diff_id: diff_id.clone(),
                        size: l.size,
                    });
                }
                return Ok(PulledImage {
                    reference: reference.into(),
                    config_digest: m.config.digest.clone(),
                    manifest_digest: digest,
                    config,
                    layers,
                });
            }
        }
    }
    Err(OciError::BadDocument {
        what: reference.into(),
        message: "indexes nested more than 3 deep".into(),
    })
}

/// `sha256:0123456789ab` (for progress lines).
pub(crate) fn short(d: &Digest) -> String {
    format!("sha256:{}", &d.hex()[..12])
}

/// `oci:DIR`.
pub fn oci_layout(
    dir: &Path,
    store: &BlobStore,
    progress: Progress,
) -> Result<PulledImage, OciError> {
    let reference = format!("oci:{}", dir.display());
    let index_path = dir.join("index.json");
    let bytes = read_small(&index_path)?;
    let mut fetch = |d: &Descriptor, max: u64| -> Result<(), OciError> {
        if d.size > max {
            return Err(OciError::TooLarge {
                layer: format!("{reference}: blob {}", d.digest),
                message: format!("{} bytes is over the cap of {max}", d.size),
            });
        }
        let src = dir.join("blobs/sha256").join(d.digest.hex());
        store.put_file(
            &format!("{reference}: blob {}", d.digest),
            &d.digest,
            &src,
            max,
        )?;
        Ok(())
    };
    resolve(&reference, bytes, None, store, &mut fetch, progress)
}

fn read_small(path: &Path) -> Result<Vec<u8>, OciError> {
    let f = File::open(path).map_err(io_err("cannot open", path))?;
    let mut out = Vec::new();
    f.take(MAX_DOCUMENT + 1)
        .read_to_end(&mut out)
        .map_err(io_err("cannot read", path))?;
    if out.len() as u64 > MAX_DOCUMENT {
        return Err(OciError::BadDocument {
            what: path.display().to_string(),
            message: format!("larger than {MAX_DOCUMENT} bytes"),
        });
    }
    Ok(out)
}

/// A member name of an archive, normalised (`./` and leading `/` dropped), or None when it has
/// `..` (such members are never read).
fn member_name(raw: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(raw).ok()?;
    let parts: Vec<&str> = s
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .collect();
    if parts.contains(&"..") {
        return None;
    }
    Some(parts.join("/"))
}

/// What [`scan_archive`] found: the documents asked for (and `@<member>` → digest of each
/// legacy member stored), and the archive's links (member → target member).
type Scanned = (BTreeMap<String, Vec<u8>>, BTreeMap<String, String>);

/// Reads every `blobs/sha256/<hex>` member of the tar at `path` into the store (verified
/// against its name) and returns the small documents asked for by name.
fn scan_archive(
    path: &Path,
    reference: &str,
    store: &BlobStore,
    documents: &[&str],
    progress: Progress,
) -> Result<Scanned, OciError> {
    let f = File::open(path).map_err(io_err("cannot open", path))?;
    let mut ar = tar::Archive::new(f);
    let mut docs = BTreeMap::new();
    let mut links = BTreeMap::new();
    let entries = ar
        .entries()
        .map_err(io_err("cannot read the archive", path))?;
    for e in entries {
        let mut e = e.map_err(io_err("cannot read the archive", path))?;
        let Some(name) = member_name(&e.path_bytes()) else {
            continue;
        };
        let kind = e.header().entry_type();
        if kind.is_symlink() || kind.is_hard_link() {
            if let Some(Some(target)) = e.link_name_bytes().map(|t| {
                let t = if kind.is_symlink() {
                    // Relative to the member's directory.
                    let dir = name.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
                    format!("{dir}/{}", String::from_utf8_lossy(&t))
                } else {
                    String::from_utf8_lossy(&t).into_owned()
                };
                normalise(&t)
            }) {
                links.insert(name, target);
            }
            continue;
        }
        if !kind.is_file() {
            continue;
        }
        if documents.contains(&name.as_str()) {
            let mut buf = Vec::new();
            (&mut e)
                .take(MAX_DOCUMENT + 1)
                .read_to_end(&mut buf)
                .map_err(io_err("cannot read the archive", path))?;
            if buf.len() as u64 > MAX_DOCUMENT {
                return Err(OciError::BadDocument {
                    what: format!("{reference}: {name}"),
                    message: format!("larger than {MAX_DOCUMENT} bytes"),
                });
            }
            docs.insert(name, buf);
        } else if let Some(hex) = name.strip_prefix("blobs/sha256/") {
            let Ok(d) = Digest::parse(&format!("sha256:{hex}")) else {
                continue;
            };
            if !store.has(&d) {
                if e.size() > 1 << 20 {
                    progress(format!("reading {} ({} MiB)", short(&d), e.size() >> 20));
                }
                store.put(&format!("{reference}: {name}"), &d, &mut e, MAX_BLOB)?;
            }
        } else if name.ends_with(".tar") || name.ends_with(".json") {
            // A legacy `docker save` member (`<id>/layer.tar`, `<hex>.json`): stored by the
            // digest of its content, found again by its name.
            let d = store.put_computed(&format!("{reference}: {name}"), &mut e, MAX_BLOB)?;
            docs.insert(format!("@{name}"), d.to_string().into_bytes());
        }
    }
    Ok((docs, links))
}

fn normalise(p: &str) -> Option<String> {
    let mut out: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop()?;
            }
            c => out.push(c),
        }
    }
    Some(out.join("/"))
}

/// `oci-archive:PATH`.
pub fn oci_archive(
    path: &Path,
    store: &BlobStore,
    progress: Progress,
) -> Result<PulledImage, OciError> {
    let reference = format!("oci-archive:{}", path.display());
    let (docs, _) = scan_archive(
        path,
        &reference,
        store,
        &["index.json", "oci-layout"],
        progress,
    )?;
    let Some(index) = docs.get("index.json").cloned() else {
        return Err(OciError::BadDocument {
            what: reference,
            message:
                "no index.json: not an OCI archive (a `docker save` tar is `docker-archive:PATH`)"
                    .into(),
        });
    };
    let mut fetch = |d: &Descriptor, _max: u64| -> Result<(), OciError> {
        if store.has(&d.digest) {
            Ok(())
        } else {
            Err(OciError::BadDocument {
                what: reference.clone(),
                message: format!("blob {} is missing from the archive", d.digest),
            })
        }
    };
    resolve(&reference, index, None, store, &mut fetch, progress)
}

/// `docker-archive:PATH` (`docker save`): its `manifest.json` names the config and the layers
/// by member name; there is no registry manifest, so the image has no manifest digest.
pub fn docker_archive(
    path: &Path,
    store: &BlobStore,
    progress: Progress,
) -> Result<PulledImage, OciError> {
    let reference = format!("docker-archive:{}", path.display());
    let (docs, links) = scan_archive(path, &reference, store, &["manifest.json"], progress)?;
    let bad = |message: String| OciError::BadDocument {
        what: format!("{reference}: manifest.json"),
        message,
    };
    let Some(manifest) = docs.get("manifest.json") else {
        return Err(bad(
            "missing: not a `docker save` archive (an OCI archive is `oci-archive:PATH`)".into(),
        ));
    };
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Entry {
        config: String,
        layers: Vec<String>,
    }
    let entries: Vec<Entry> = serde_json::from_slice(manifest)
        .map_err(|e| bad(format!("not a docker manifest.json: {e}")))?;
    let entry = match entries.as_slice() {
        [one] => one,
        [] => return Err(bad("lists no image".into())),
        many => {
            return Err(bad(format!(
                "lists {} images; save one image per archive",
                many.len()
            )))
        }
    };
    // A member's digest: from its blobs/sha256 name, or what scan_archive stored it as.
    let digest_of = |member: &str| -> Result<Digest, OciError> {
        let mut name = normalise(member).unwrap_or_default();
        for _ in 0..8 {
            if let Some(hex) = name.strip_prefix("blobs/sha256/") {
                if let Ok(d) = Digest::parse(&format!("sha256:{hex}")) {
                    if store.has(&d) {
                        return Ok(d);
                    }
                }
            }
            if let Some(d) = docs.get(&format!("@{name}")) {
                return Digest::parse(&String::from_utf8_lossy(d)).map_err(&bad);
            }
            match links.get(&name) {
                Some(t) => name = t.clone(),
                None => break,
            }
        }
        Err(bad(format!(
            "member {member:?} is missing from the archive"
        )))
    };
    let config_digest = digest_of(&entry.config)?;
    let cfg_bytes = store.read(&config_digest)?;
    let config = ImageConfig::parse(
        &format!("{reference}: config"),
        &cfg_bytes,
        entry.layers.len(),
    )?;
    let mut layers = Vec::new();
    for (i, (member, diff_id)) in entry.layers.iter().zip(&config.rootfs.diff_ids).enumerate() {
        let digest = digest_of(member)?;
        let size = std::fs::metadata(store.path(&digest))
            .map(|m| m.len())
            .unwrap_or(0);
        progress(format!(
            "layer {}/{}: {} ({} MiB)",
            i + 1,
            entry.layers.len(),
            short(&digest),
            size >> 20
        ));
        layers.push(Layer {
            digest,
            media_type: String::new(),
            diff_id: diff_id.clone(),
            size,
        });
    }
    let _ = media::OCI_LAYER_TAR;
    Ok(PulledImage {
        reference,
        config_digest,
        manifest_digest: None,
        config,
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_names_never_climb() {
        assert_eq!(
            member_name(b"./blobs/sha256/ab").as_deref(),
            Some("blobs/sha256/ab")
        );
        assert_eq!(member_name(b"/index.json").as_deref(), Some("index.json"));
        assert_eq!(member_name(b"blobs/../../etc/passwd"), None);
        assert_eq!(normalise("a/b/../c").as_deref(), Some("a/c"));
        assert_eq!(normalise("../x"), None);
    }
}
