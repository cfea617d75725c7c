//! OCI and Docker images as the source of an ember template's root tree (issue 30).
//!
//! One idea per module, data flowing one way:
//! - [`reference`]: what the user typed (`REF`): a registry reference, `docker-archive:PATH`,
//!   `oci-archive:PATH` or `oci:DIR`.
//! - [`spec`]: the JSON documents (index, manifest, config) and digests.
//! - [`store`]: the local blob store (`$EMBER_CACHE/oci/blobs/sha256/`); every blob is
//!   written through a hasher and kept only when its digest matches.
//! - [`source`]: archives and layouts read into the store; [`registry`]: the Docker Registry
//!   HTTP API v2 client (token and basic auth from the usual auth files). Both end in a
//!   [`PulledImage`]: the config digest (the image's identity), the manifest digest when there
//!   is one, the config, and the layers as blobs in the store.
//! - [`unpack`]: layers applied in order into a directory with every path resolved by the
//!   kernel inside that directory (`openat2` with `RESOLVE_IN_ROOT`): whiteouts, hard links,
//!   ownership, modes, `user.*` xattrs; devices and FIFOs dropped, setuid/setgid bits and file
//!   capabilities removed, sizes capped. Nothing from the image is ever executed on the host.
//! - [`inspect`]: what a tree offers (Python version, IPython, Chromium, a shell), read from
//!   its files.
//!
//! The image's identity is its **config digest**: the config names every layer by the digest
//! of its *uncompressed* tar (`rootfs.diff_ids`), and the unpacker checks each layer against
//! it. A `docker save` archive (uncompressed layers, no manifest of its own), an OCI archive
//! and the registry's gzip-compressed manifest of the same image therefore share it, while
//! their manifest digests differ (docs/images.md).

pub mod inspect;
pub mod reference;
pub mod registry;
pub mod source;
pub mod spec;
pub mod store;
pub mod unpack;

pub use reference::ImageRef;
pub use spec::{Digest, ImageConfig};
pub use store::BlobStore;
pub use unpack::{Limits, UnpackReport};

use std::path::PathBuf;

/// The unpacker's version: part of every cached tree's key. Bump it when the unpacker's
/// output for the same layers changes.
pub const UNPACKER_VERSION: u32 = 1;

/// Errors of this crate; each names the image, layer, entry or file it is about.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The reference could not be parsed.
    #[error("image reference {reference:?}: {message}")]
    BadReference {
        /// What was given.
        reference: String,
        /// What is wrong.
        message: String,
    },
    /// A document (index, manifest, config, docker manifest.json) is not what it should be.
    #[error("{what}: {message}")]
    BadDocument {
        /// Which document.
        what: String,
        /// What is wrong.
        message: String,
    },
    /// Content does not hash to the digest that names it.
    #[error("{what}: digest mismatch: expected {expected}, got {actual} (the image is corrupt or was tampered with)")]
    DigestMismatch {
        /// What was checked.
        what: String,
        /// The digest that names it.
        expected: String,
        /// What its bytes hash to.
        actual: String,
    },
    /// The registry answered with an error or could not be reached.
    #[error("registry {registry}: {message}")]
    Registry {
        /// The registry host.
        registry: String,
        /// What happened.
        message: String,
    },
    /// A layer entry that is refused (the message says why and what the entry was).
    #[error("layer {layer}: entry {entry:?}: {message}")]
    Refused {
        /// The layer (index and digest).
        layer: String,
        /// The entry's name as the tar has it.
        entry: String,
        /// Why.
        message: String,
    },
    /// A size or count cap was reached.
    #[error("layer {layer}: {message}")]
    TooLarge {
        /// The layer (index and digest).
        layer: String,
        /// Which cap, and its value.
        message: String,
    },
    /// A file could not be read or written.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

pub(crate) fn io_err(
    what: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> OciError {
    let path = path.into();
    move |source| OciError::Io { what, path, source }
}

/// An image pulled into the [`BlobStore`]: everything a template build needs.
#[derive(Debug, Clone)]
pub struct PulledImage {
    /// Where it came from (as given).
    pub reference: String,
    /// The digest of the image config: the image's identity.
    pub config_digest: Digest,
    /// The manifest's digest, when the source has a manifest (not a legacy `docker save`).
    pub manifest_digest: Option<Digest>,
    /// The parsed config.
    pub config: ImageConfig,
    /// The layers, bottom first.
    pub layers: Vec<Layer>,
}

/// One layer blob in the store.
#[derive(Debug, Clone)]
pub struct Layer {
    /// The blob's digest (compressed, as stored).
    pub digest: Digest,
    /// Its media type (decides the decompressor; `tar` when unknown and sniffed).
    pub media_type: String,
    /// The digest of the uncompressed tar (from the config's `rootfs.diff_ids`).
    pub diff_id: Digest,
    /// The blob's size in bytes.
    pub size: u64,
}

/// Progress a pull or an unpack reports (human text, one line each).
pub type Progress<'a> = &'a mut dyn FnMut(String);

/// Pulls `reference` into `store` (a registry pull, or a read of an archive or a layout).
pub fn pull(
    reference: &ImageRef,
    store: &BlobStore,
    progress: Progress,
) -> Result<PulledImage, OciError> {
    match reference {
        ImageRef::Registry(r) => registry::pull(r, store, progress),
        ImageRef::OciLayout(dir) => source::oci_layout(dir, store, progress),
        ImageRef::OciArchive(path) => source::oci_archive(path, store, progress),
        ImageRef::DockerArchive(path) => source::docker_archive(path, store, progress),
    }
}
