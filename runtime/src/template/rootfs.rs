//! The root filesystem of a template: its recipe checked ([`Recipe::load`]), an `[image]`
//! recipe's tree pulled and unpacked first ([`super::image`]), and `rootfs/build.sh` run on the
//! normalised recipe (`--recipe-json`), which builds (or finds cached) the image and its
//! `manifest.json`.

use std::io::Write;
use std::path::PathBuf;

use super::schema::{recipe_path, Recipe};
use crate::images;

/// The root filesystem image of `template` (a name in `rootfs/templates/` or a recipe file),
/// built if the cache lacks it. The recipe is checked here ([`Recipe::load`]: the schema is
/// Rust's) and `rootfs/build.sh` builds from the normalised recipe it is handed
/// (`--recipe-json`), never from the TOML.
pub fn default_rootfs(template: &str) -> Result<PathBuf, images::ImageError> {
    default_rootfs_with(template, &mut |line| eprintln!("[image] {line}"))
}

/// [`default_rootfs`], reporting an `[image]` recipe's pull and unpack through `progress`.
/// For such a recipe the tree comes from the image ([`super::image`]): it is pulled, unpacked
/// and checked for the features the recipe asks for before the rootfs build runs, and its
/// facts go to the build as the document's `image`.
pub fn default_rootfs_with(
    template: &str,
    progress: &mut dyn FnMut(String),
) -> Result<PathBuf, images::ImageError> {
    let script = images::source_root()?.join("rootfs/build.sh");
    let file = recipe_path(template)?;
    let mut recipe = Recipe::load(&file).map_err(|e| images::ImageError::Recipe(Box::new(e)))?;
    let mut image_facts = None;
    if recipe.image.is_some() {
        let tree = super::image::image_tree(&recipe, progress)?;
        super::image::check_features(&recipe, &tree)?;
        super::image::apply_config(&mut recipe, &tree)?;
        image_facts = Some(tree.facts());
    }
    let hand_off = |source| images::ImageError::RecipeHandOff {
        path: std::env::temp_dir(),
        source,
    };
    let mut json = tempfile::Builder::new()
        .prefix("ember-recipe-")
        .suffix(".json")
        .tempfile()
        .map_err(hand_off)?;
    let mut doc = recipe.builder_json(&file);
    if let Some(facts) = image_facts {
        doc["image"] = facts;
    }
    serde_json::to_writer(&mut json, &doc).map_err(|e| hand_off(e.into()))?;
    json.flush().map_err(hand_off)?;
    let path = json.path().to_string_lossy().into_owned();
    images::run_script(&script, &["--recipe-json", &path])
}
