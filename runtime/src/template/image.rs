//! `[image]` recipes: the root tree comes from an OCI/Docker image (docs/images.md).
//!
//! [`image_tree`] pulls the image into `$EMBER_CACHE/oci/` (every blob verified), unpacks its
//! layers with [`ember_oci::unpack`] into `$EMBER_CACHE/rootfs-base/<tree key>/tree` — layer 1
//! of the rootfs build, where `rootfs/build.py` finds it — and [`ember_oci::inspect`]s it. The
//! tree key is the hash of the image's **config digest** (its identity, the same from a
//! registry, `docker save`, an OCI archive or a layout), the unpacker's version and the
//! recipe's `[[files]]`, so the same image is unpacked once whatever it came from. The build
//! then checks what the template asks for against what the tree has ([`check_features`]) and
//! folds the image config into the recipe ([`apply_config`]): a missing piece is an error here,
//! before any VM boots.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::schema::{Recipe, ServiceSpec};
use crate::images::ImageError;
use crate::paths;

/// Bump when the tree's layout (what [`ember_oci::inspect::prepare`] adds) changes.
const TREE_LAYOUT: &str = "ember-oci-tree-1";

/// The unpacked, prepared tree of an image, and what is known about it.
#[derive(Debug, Clone)]
pub struct ImageTree {
    /// `$EMBER_CACHE/rootfs-base/<key>/tree`.
    pub tree: PathBuf,
    /// The tree key (layer 1's key).
    pub key: String,
    /// The pull's result.
    pub image: ember_oci::PulledImage,
    /// What the tree offers.
    pub features: ember_oci::inspect::Features,
}

impl ImageTree {
    /// What `rootfs/build.py` reads (`image` in the recipe document) and manifest.json keeps.
    pub fn facts(&self) -> serde_json::Value {
        serde_json::json!({
            "tree_key": self.key,
            "tree": self.tree,
            "ref": self.image.reference,
            "config_digest": self.image.config_digest,
            "manifest_digest": self.image.manifest_digest,
            "unpacker": ember_oci::UNPACKER_VERSION,
            "working_dir": self.image.config.config.working_dir,
            "user": self.image.config.config.user,
            "start_command": self.image.config.start_command(),
            "features": self.features,
        })
    }
}

/// Pulls, unpacks (once per key) and inspects the image of an `[image]` recipe.
pub fn image_tree(
    recipe: &Recipe,
    progress: &mut dyn FnMut(String),
) -> Result<ImageTree, ImageError> {
    let spec = recipe
        .image
        .as_ref()
        .ok_or_else(|| ImageError::Feature("not an [image] recipe".into()))?;
    let reference = ember_oci::ImageRef::parse(&spec.reference)?;
    let limits = ember_oci::Limits::from_env().map_err(ImageError::Feature)?;
    let cache = paths::cache_dir();
    let store = ember_oci::BlobStore::new(cache.join("oci"));
    let image = ember_oci::pull(&reference, &store, progress)?;
    progress(format!(
        "image {}: config {}{}",
        image.reference,
        image.config_digest,
        image
            .manifest_digest
            .as_ref()
            .map(|m| format!(", manifest {m}"))
            .unwrap_or_default()
    ));
    let mut files = Vec::new();
    let mut hashed = Vec::new();
    for f in &recipe.files {
        let data = match (&f.content, &f.source) {
            (Some(c), _) => c.clone().into_bytes(),
            (None, Some(src)) => std::fs::read(src).map_err(|source| ImageError::Run {
                script: PathBuf::from(src),
                source,
            })?,
            (None, None) => Vec::new(),
        };
        hashed.push(serde_json::json!({"path": f.path, "mode": f.mode.0, "sha256": hex(&Sha256::digest(&data))}));
        files.push(ember_oci::inspect::ExtraFile {
            path: f.path.clone(),
            data,
            mode: f.mode.0,
        });
    }
    let key_doc = serde_json::json!({
        "layout": TREE_LAYOUT,
        "unpacker": ember_oci::UNPACKER_VERSION,
        "config": image.config_digest,
        "files": hashed,
    });
    let key = hex(&Sha256::digest(key_doc.to_string().as_bytes()));
    let final_dir = cache.join("rootfs-base").join(&key);
    let tree = final_dir.join("tree");
    let locks = cache.join("locks");
    std::fs::create_dir_all(&locks).map_err(|source| ImageError::Run {
        script: locks.clone(),
        source,
    })?;
    let _lock = flock(&locks.join(format!("base-{key}.lock")))?;
    if final_dir.join("recipe.json").is_file() {
        progress(format!("image tree cached: {}", final_dir.display()));
        // What the unpack neutralised, again: a build log always says it.
        let meta: serde_json::Value = std::fs::read(final_dir.join("recipe.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        for n in meta["notes"].as_array().into_iter().flatten() {
            progress(format!("note: {}", n.as_str().unwrap_or_default()));
        }
    } else {
        let work = cache
            .join("tmp")
            .join(format!("oci-{}.{}", &key[..16], std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        let new_tree = work.join("tree");
        std::fs::create_dir_all(&new_tree).map_err(|source| ImageError::Run {
            script: new_tree.clone(),
            source,
        })?;
        let result = (|| -> Result<(), ImageError> {
            let t0 = std::time::Instant::now();
            let report = ember_oci::unpack::unpack_layers(
                &store,
                &image.layers,
                &new_tree,
                &limits,
                progress,
            )?;
            let mut notes = report.notes();
            notes.extend(ember_oci::inspect::prepare(&new_tree, &files)?);
            for n in &notes {
                progress(format!("note: {n}"));
            }
            progress(format!(
                "unpacked {} entries, {} MiB in {:.1}s",
                report.entries,
                report.bytes >> 20,
                t0.elapsed().as_secs_f64()
            ));
            let meta = serde_json::json!({
                "key": key,
                "template": recipe.name(),
                "image": {"ref": image.reference, "config_digest": image.config_digest, "manifest_digest": image.manifest_digest},
                "unpacker": ember_oci::UNPACKER_VERSION,
                "report": report,
                "notes": notes,
                "files": recipe.files.iter().map(|f| f.path.clone()).collect::<Vec<_>>(),
                "build_seconds": (t0.elapsed().as_secs_f64() * 10.0).round() / 10.0,
            });
            let rj = work.join("recipe.json");
            std::fs::write(&rj, serde_json::to_vec_pretty(&meta).unwrap_or_default())
                .map_err(|source| ImageError::Run { script: rj, source })?;
            if let Some(parent) = final_dir.parent() {
                std::fs::create_dir_all(parent).map_err(|source| ImageError::Run {
                    script: parent.into(),
                    source,
                })?;
            }
            if final_dir.exists() {
                let _ = std::fs::remove_dir_all(&final_dir);
            }
            std::fs::rename(&work, &final_dir).map_err(|source| ImageError::Run {
                script: final_dir.clone(),
                source,
            })
        })();
        if let Err(e) = result {
            // remove_dir_all never follows symlinks: the tree's own links cannot lead it out.
            let _ = std::fs::remove_dir_all(&work);
            return Err(e);
        }
    }
    let features = ember_oci::inspect::inspect(&tree)?;
    Ok(ImageTree {
        tree,
        key,
        image,
        features,
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn flock(path: &Path) -> Result<std::fs::File, ImageError> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|source| ImageError::Run {
            script: path.into(),
            source,
        })?;
    loop {
        // SAFETY: flock on a descriptor we own; no memory is involved.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(f);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(ImageError::Run {
                script: path.into(),
                source: e,
            });
        }
    }
}

/// Whether the recipe asks for Python (`run_code`): a python context, a python spare, or
/// warm-up code (which runs in the Python zygote).
pub fn wants_python(recipe: &Recipe) -> bool {
    let w = &recipe.warmup;
    w.contexts.iter().any(|c| c.language == "python")
        || w.spare.get("python").copied().unwrap_or(0) > 0
        || !w.code.is_empty()
}

/// The build-time feature checks: what the recipe asks for against what the tree has. The
/// error names the fix.
pub fn check_features(recipe: &Recipe, t: &ImageTree) -> Result<(), ImageError> {
    let f = &t.features;
    let name = recipe.name();
    let no_code =
        "or build it without code contexts: `--no-code` (`ember template build --from-image`), \
                   or in a recipe `[warmup] contexts = []` and `spare = { python = 0, bash = 0 }` \
                   (exec and files work on any image)";
    if wants_python(recipe) {
        let Some((major, minor)) = f.python().filter(|_| f.python3) else {
            return Err(ImageError::Feature(format!(
                "template {name}: run_code needs Python >= 3.8 with IPython, and image {} has no \
                 /usr/bin/python3 (nor /usr/local/bin/python3): use an image with Python and \
                 IPython (add `RUN pip install ipython` to its Dockerfile), {no_code}",
                t.image.reference
            )));
        };
        if (major, minor) < (3, 8) {
            return Err(ImageError::Feature(format!(
                "template {name}: run_code needs Python >= 3.8; image {} has Python {major}.{minor}: \
                 use a newer Python, {no_code}",
                t.image.reference
            )));
        }
        if !f.ipython {
            return Err(ImageError::Feature(format!(
                "template {name}: run_code needs IPython and image {} (Python {major}.{minor}) does \
                 not have it: add `RUN pip install ipython` to the image's Dockerfile, {no_code}",
                t.image.reference
            )));
        }
    }
    let w = &recipe.warmup;
    if (w.contexts.iter().any(|c| c.language == "bash")
        || w.spare.get("bash").copied().unwrap_or(0) > 0)
        && !f.bash
    {
        return Err(ImageError::Feature(format!(
            "template {name}: bash contexts need /bin/bash and image {} has none: install bash in \
             the image, or set `[warmup] spare = {{ bash = 0 }}` and no bash contexts",
            t.image.reference
        )));
    }
    for s in &w.services {
        let prog = &s.argv[0];
        let present =
            !prog.starts_with('/') || ember_oci::inspect::exists(&t.tree, prog).unwrap_or(false);
        if !present {
            let hint = if prog.contains("chrom") {
                " (the browser feature needs Chromium in the image)"
            } else {
                ""
            };
            return Err(ImageError::Feature(format!(
                "template {name}: service {} runs {prog}, which image {} does not have{hint}",
                s.name, t.image.reference
            )));
        }
    }
    Ok(())
}

/// Folds the image config into the recipe: `Env` under `[env]` (the recipe wins),
/// `WorkingDir` as the contexts' default cwd, and with `[image] start`, `Entrypoint` + `Cmd`
/// as the service `start`.
pub fn apply_config(recipe: &mut Recipe, t: &ImageTree) -> Result<(), ImageError> {
    let cfg = &t.image.config;
    let mut env: BTreeMap<String, String> = cfg.env();
    env.retain(|k, v| {
        !k.is_empty()
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !k.starts_with(|c: char| c.is_ascii_digit())
            && !v.contains('\0')
    });
    env.extend(std::mem::take(&mut recipe.env));
    recipe.env = env;
    let wd = &cfg.config.working_dir;
    if wd.starts_with('/') && !wd.split('/').any(|c| c == "..") {
        for c in &mut recipe.warmup.contexts {
            if c.cwd.is_none() {
                c.cwd = Some(wd.clone());
            }
        }
    }
    if recipe.image.as_ref().is_some_and(|i| i.start) {
        let argv = cfg.start_command();
        if argv.is_empty() {
            return Err(ImageError::Feature(format!(
                "template {}: [image] start is set but image {} has no Entrypoint or Cmd",
                recipe.name(),
                t.image.reference
            )));
        }
        if !recipe.warmup.services.iter().any(|s| s.name == "start") {
            recipe.warmup.services.push(ServiceSpec {
                name: "start".into(),
                argv,
                user: "root".into(),
                env: BTreeMap::new(),
                cwd: (wd.starts_with('/')).then(|| wd.clone()),
                ready: None,
                ready_timeout_s: 300,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recipe(text: &str) -> Recipe {
        Recipe::parse(text, Path::new("/recipes/t.toml")).unwrap_or_else(|e| panic!("{e}"))
    }

    fn tree(features: ember_oci::inspect::Features, config: &str) -> ImageTree {
        let d = |c: char| {
            ember_oci::Digest::parse(&format!("sha256:{}", c.to_string().repeat(64))).unwrap()
        };
        ImageTree {
            tree: PathBuf::from("/nonexistent"),
            key: "k".into(),
            image: ember_oci::PulledImage {
                reference: "oci:/x".into(),
                config_digest: d('a'),
                manifest_digest: None,
                config: ember_oci::ImageConfig::parse("c", config.as_bytes(), 0).unwrap(),
                layers: vec![],
            },
            features,
        }
    }

    const CONFIG: &str = r#"{"config":{"Env":["PATH=/bin","A=image"],"WorkingDir":"/app","Cmd":["/bin/server","--port","8080"]},"rootfs":{"diff_ids":[]}}"#;

    #[test]
    fn run_code_needs_python_and_ipython_and_the_error_names_the_fix() {
        let r = recipe("[image]\nref = \"busybox\"\n");
        assert!(wants_python(&r));
        let none = tree(Default::default(), CONFIG);
        let e = check_features(&r, &none).unwrap_err().to_string();
        assert!(
            e.contains("run_code needs Python")
                && e.contains("pip install ipython")
                && e.contains("--no-code"),
            "{e}"
        );
        let old = ember_oci::inspect::Features {
            python3: true,
            python_version: Some("3.7".into()),
            ipython: true,
            bash: true,
            ..Default::default()
        };
        assert!(check_features(&r, &tree(old, CONFIG))
            .unwrap_err()
            .to_string()
            .contains("Python 3.7"));
        let no_ipython = ember_oci::inspect::Features {
            python3: true,
            python_version: Some("3.12".into()),
            bash: true,
            ..Default::default()
        };
        assert!(check_features(&r, &tree(no_ipython, CONFIG))
            .unwrap_err()
            .to_string()
            .contains("IPython"));
        let ok = ember_oci::inspect::Features {
            python3: true,
            python_version: Some("3.12".into()),
            ipython: true,
            bash: true,
            ..Default::default()
        };
        check_features(&r, &tree(ok, CONFIG)).unwrap();
        // Without code contexts nothing is asked of the image.
        let bare = recipe("[image]\nref = \"busybox\"\n[warmup]\ncontexts = []\nspare = { python = 0, bash = 0 }\n");
        assert!(!wants_python(&bare));
        check_features(&bare, &none).unwrap();
        // A service's program must be in the image.
        let svc = recipe("[image]\nref = \"x\"\n[warmup]\ncontexts = []\nspare = { python = 0, bash = 0 }\n[[warmup.services]]\nname = \"b\"\nargv = [\"/usr/lib/chromium/chromium\"]\n");
        let e = check_features(&svc, &none).unwrap_err().to_string();
        assert!(e.contains("needs Chromium"), "{e}");
    }

    #[test]
    fn the_image_config_goes_into_the_recipe() {
        let mut r = recipe("[image]\nref = \"x\"\nstart = true\n[env]\nA = \"recipe\"\n");
        apply_config(&mut r, &tree(Default::default(), CONFIG)).unwrap();
        assert_eq!(r.env["A"], "recipe", "the recipe's [env] wins");
        assert_eq!(r.env["PATH"], "/bin");
        assert_eq!(r.warmup.contexts[0].cwd.as_deref(), Some("/app"));
        let s = &r.warmup.services[0];
        assert_eq!(
            (s.name.as_str(), s.argv.join(" ")),
            ("start", "/bin/server --port 8080".into())
        );
        let mut r = recipe("[image]\nref = \"x\"\nstart = true\n");
        let e = apply_config(
            &mut r,
            &tree(Default::default(), r#"{"rootfs":{"diff_ids":[]}}"#),
        )
        .unwrap_err();
        assert!(e.to_string().contains("no Entrypoint or Cmd"), "{e}");
    }
}
