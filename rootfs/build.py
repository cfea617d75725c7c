#!/usr/bin/env python3
"""Build an ember root file system image from a template recipe.

Content-addressed entries under $EMBER_CACHE (default /var/cache/ember):

  rootfs-base/<key1>/tree     the Debian tree: mmdebstrap from the HOST's apt sources, stripped,
                              plus the recipe's pip packages and files, the `user` account,
                              /workspace, Python bytecode and matplotlib's font cache.
                              key1 = sha256(recipe's build part + these build scripts)
  rootfs/<key2>/rootfs.ext4   the image: the tree + ember-agent as /sbin/ember-agent and /sbin/init
                              + the Python driver (agent/python/*) in /usr/lib/ember, as ext4 (4 KiB
                              blocks, no journal, no metadata_csum, label ember-root); image.json.
                              key2 = sha256(key1 + agent bytes + driver files + [vm] disk_mib)
  rootfs-template/<key3>/     rootfs.ext4 (a hard link to the image) + manifest.json (VM shape,
                              warm-up, contexts, env, ...: what the template builder reads).
                              key3 = sha256(key2 + the rest of the recipe)

Progress goes to stderr. On success the last (and only) line on stdout is the absolute path of
rootfs-template/<key3>/rootfs.ext4 (manifest.json is beside it). See rootfs/README.md for the recipe's
keys. The recipe is read as ember checked and normalised it (`ember template check --json`): the
schema is Rust's (runtime/src/template/schema.rs), not this script's.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

# Layer 1 (the Debian tree) and the helpers it shares with the rest: a module of its own, whose
# file (not this one) goes into the tree's key.
from debian_tree import (  # noqa: E402
    BuildError, log, run, sha256_file, ensure_tools, remove_tree, lock, build_base,
    chroot_run, chroot_check, USER_NAME, USER_ID, USER_HOME, USER_SHELL, WORKSPACE,
    MPL_CONFIG_DIR,
)

ROOTFS_DIR = Path(__file__).resolve().parent
REPO_ROOT = ROOTFS_DIR.parent
TEMPLATES_DIR = ROOTFS_DIR / "templates"
# What builds layer 1, hashed into its key: not build.py, whose layers 2 and 3 a tree does not
# depend on.
BUILD_SCRIPTS = [ROOTFS_DIR / "build.sh", ROOTFS_DIR / "debian_tree.py"]

# Bump when the meaning of a cached layer changes in a way the hashed inputs do not show.
LAYOUT_VERSION = "ember-rootfs-1"

AGENT_TARGET = "x86_64-unknown-linux-gnu"
AGENT_RUSTFLAGS = "-C target-feature=+crt-static"

BLOCK = 4096
INODE_SIZE = 256
HEADROOM = 64 * 1024 * 1024
LABEL = "ember-root"
# With an explicit disk size, at least one inode per this many bytes (mke2fs's default ratio).
BYTES_PER_INODE = 16384

# What every image carries besides the recipe's packages (see rootfs/README.md).
DRIVER_SRC = REPO_ROOT / "agent" / "python"   # the Python driver's files (another crate's)
DRIVER_DEST = "/usr/lib/ember"
MANIFEST_VERSION = 1




# ---------------------------------------------------------------------------------------------
# Recipe
#
# The template schema is Rust's (runtime/src/template/schema.rs). This script reads a recipe only
# as that code checked and normalised it: `ember template check --json FILE` prints it (and is
# what `--template` runs), `ember template build` hands it over with --recipe-json. Nothing here
# re-checks a recipe or knows its defaults.

# The version of that document (`ember_recipe`; RECIPE_FORMAT in schema.rs).
RECIPE_FORMAT = 1


def ember_command() -> list[str]:
    """How to run `ember`: $EMBER_BIN, else cargo from this checkout (a no-op when it is built)."""
    exe = os.environ.get("EMBER_BIN")
    if exe:
        return [exe]
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo/bin/cargo")
    return [cargo, "run", "--quiet", "--package", "ember-cli", "--bin", "ember", "--"]


def check_recipe(path: Path) -> dict:
    """`ember template check --json PATH`: the recipe checked and normalised, as a JSON document."""
    cmd = [*ember_command(), "template", "check", "--json", str(path)]
    log(f"checking the recipe {path} (ember template check)")
    try:
        res = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise BuildError(f"cannot run {cmd[0]} to check the recipe (set EMBER_BIN to an ember binary): {e}") from e
    if res.returncode != 0:
        message = res.stderr.strip().removeprefix("ember: error: ")
        raise BuildError(message or f"{shlex.join(cmd)} failed with exit status {res.returncode}")
    try:
        return json.loads(res.stdout)
    except json.JSONDecodeError as e:
        raise BuildError(f"{shlex.join(cmd)} printed no JSON document: {e}") from e


def read_recipe_json(path: Path) -> dict:
    """A document `ember template check --json` printed, from a file (--recipe-json)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BuildError(f"--recipe-json {path}: {e}") from e


def recipe_from_json(doc: dict) -> dict:
    """The build's view of a checked recipe: flat, with the files' contents inlined as bytes."""
    if not isinstance(doc, dict) or doc.get("ember_recipe") != RECIPE_FORMAT:
        raise BuildError(f"not a checked recipe of format {RECIPE_FORMAT} (ember_recipe = "
                         f"{doc.get('ember_recipe') if isinstance(doc, dict) else None!r}): "
                         f"is ember older or newer than this script?")
    r = doc["recipe"]
    image = doc.get("image")
    if (r.get("debian") is None) == (image is None):
        raise BuildError("the recipe document needs exactly one of recipe.debian and image "
                         "(an [image] recipe is built by `ember template build`, which pulls and "
                         "unpacks the image first)")
    debian = r.get("debian") or {"suite": None, "variant": None, "packages": []}
    files = []
    for f in r["files"]:
        if "content" in f:
            data = f["content"].encode()
        else:
            try:
                data = Path(f["source"]).read_bytes()
            except OSError as e:
                raise BuildError(f"{doc.get('file')}: cannot read {f['source']} (for {f['path']}): {e}") from e
        files.append({"path": f["path"], "data": data, "mode": f["mode"]})
    return {
        "name": r["name"],
        "description": r["description"],
        "suite": debian["suite"],
        "variant": debian["variant"],
        "packages": debian["packages"],
        # An [image] recipe: the tree is unpacked by ember (Rust, runtime/src/template/image.rs)
        # into rootfs-base/<image.tree_key>/ before this script runs; nothing here runs code
        # from it (no chroot), and paths in it are resolved inside it (resolve_in_root).
        "image": image,
        "pip": r["pip"]["packages"],
        "files": files,
        "checks": r["checks"]["python"],
        "vm": r["vm"],
        "warmup": r["warmup"],
        "env": r["env"],
        "outputs": r["outputs"],
    }


def load_recipe(path: Path) -> dict:
    """The recipe in `path`, checked by ember (`check_recipe`), in the build's view."""
    return recipe_from_json(check_recipe(path))


def base_key(recipe: dict) -> str:
    """Key of layer 1: what goes into the tree (not the warm-up) and the scripts that build it.
    For an [image] recipe: the key ember unpacked the image's tree under (its config digest, the
    unpacker's version and the recipe's files)."""
    if recipe["image"] is not None:
        return recipe["image"]["tree_key"]
    build_part = {
        "suite": recipe["suite"],
        "variant": recipe["variant"],
        "packages": recipe["packages"],
        "pip": recipe["pip"],
        "checks": recipe["checks"],
        "files": [
            {"path": f["path"], "mode": f["mode"], "sha256": hashlib.sha256(f["data"]).hexdigest()}
            for f in recipe["files"]
        ],
    }
    h = hashlib.sha256()
    h.update(LAYOUT_VERSION.encode() + b"\0")
    h.update(json.dumps(build_part, sort_keys=True).encode() + b"\0")
    for script in BUILD_SCRIPTS:
        h.update(script.name.encode() + b"\0" + script.read_bytes() + b"\0")
    return h.hexdigest()


def driver_files(src: Path = DRIVER_SRC) -> list[tuple[str, Path]]:
    """The Python driver's files, (name, path) sorted by name: the regular files directly in
    agent/python/ except hidden ones and bytecode. A missing directory is the empty set."""
    if not src.is_dir():
        return []
    out = []
    for p in sorted(src.iterdir()):
        if p.name.startswith(".") or p.suffix in (".pyc", ".pyo") or not p.is_file():
            continue
        if not re.fullmatch(r"[A-Za-z0-9._-]+", p.name):
            raise BuildError(f"{p}: unexpected file name for a file installed in {DRIVER_DEST}")
        out.append((p.name, p))
    return out


def image_key(key1: str, agent: Path, recipe: dict, drivers: list[tuple[str, Path]]) -> str:
    """Key of layer 2: the tree, the agent's bytes, the driver files and the disk size."""
    h = hashlib.sha256()
    h.update(key1.encode() + b"\0")
    with open(agent, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    h.update(b"\0")
    h.update(json.dumps({
        "disk_mib": recipe["vm"]["disk_mib"],
        "drivers": [[name, sha256_file(path)] for name, path in drivers],
    }, sort_keys=True).encode())
    return h.hexdigest()


def template_part(recipe: dict) -> dict:
    """What manifest.json says about running the image, beyond the image itself."""
    return {
        "template": recipe["name"],
        "description": recipe["description"],
        "vm": {"vcpus": recipe["vm"]["vcpus"], "memory_mib": recipe["vm"]["memory_mib"],
               "network": recipe["vm"]["network"]},
        "warmup": recipe["warmup"],
        "env": recipe["env"],
        "outputs": recipe["outputs"],
    }


def template_key(key2: str, recipe: dict) -> str:
    """Key of the template entry: the image plus everything else manifest.json says."""
    h = hashlib.sha256()
    h.update(key2.encode() + b"\0")
    h.update(json.dumps(template_part(recipe), sort_keys=True).encode())
    return h.hexdigest()



# ---------------------------------------------------------------------------------------------
# The agent


def build_agent() -> Path:
    """Builds ember-agent statically (the explicit --target keeps RUSTFLAGS off host build scripts)."""
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo/bin/cargo")
    # The checkout's path is remapped so that the agent's bytes (and so the image and template
    # keys) do not depend on where the repository was cloned: CI's fresh clone then finds the
    # images and templates a developer (or an earlier run) built from the same sources.
    env = dict(os.environ, RUSTFLAGS=f"{AGENT_RUSTFLAGS} --remap-path-prefix={REPO_ROOT}=/ember")
    env.pop("CARGO_ENCODED_RUSTFLAGS", None)
    cmd = ["nice", cargo, "build", "--release", "-p", "ember-agent", "--bin", "ember-agent",
           "--target", AGENT_TARGET, "--message-format=json-render-diagnostics"]
    log("building ember-agent (static, release)")
    res = run(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    exe = None
    for line in res.stdout.splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("reason") == "compiler-artifact" and msg.get("target", {}).get("name") == "ember-agent" \
                and msg.get("executable"):
            exe = Path(msg["executable"])
    if exe is None or not exe.is_file():
        raise BuildError("cargo did not report an ember-agent executable")
    if has_interpreter(exe):
        raise BuildError(f"{exe} is dynamically linked (has PT_INTERP); it must be static")
    return exe


def prebuilt_agent(path: Path) -> Path:
    path = path.resolve()
    if not path.is_file():
        raise BuildError(f"--agent {path}: no such file")
    if has_interpreter(path):
        raise BuildError(f"--agent {path} is dynamically linked (has PT_INTERP); it must be static")
    log(f"using the prebuilt agent {path}")
    return path


def has_interpreter(path: Path) -> bool:
    """Whether an ELF64 little-endian file has a PT_INTERP program header (i.e. is not static)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise BuildError(f"{path} is not a 64-bit little-endian ELF file")
        phoff = int.from_bytes(head[32:40], "little")
        phentsize = int.from_bytes(head[54:56], "little")
        phnum = int.from_bytes(head[56:58], "little")
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return any(int.from_bytes(table[i * phentsize:i * phentsize + 4], "little") == 3 for i in range(phnum))


# ---------------------------------------------------------------------------------------------
# Layer 2: the image


def tree_size(tree: Path) -> tuple[int, int]:
    """Bytes of data blocks and number of inodes the tree needs on ext4 with 4 KiB blocks."""
    seen: set[int] = set()
    blocks = 0
    inodes = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in [*dirnames, *filenames, "."]:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            inodes += 1
            if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                blocks += max(1, math.ceil(st.st_size / BLOCK))
            elif stat.S_ISLNK(st.st_mode) and st.st_size >= 60:
                blocks += 1
    return blocks * BLOCK, inodes


def resolve_in_root(root: Path, rel: str) -> Path:
    """`rel` resolved as the guest would see it: every symlink on the way followed with `root` as
    `/` (absolute targets are inside the root, `..` stops at it), so a tree from an image can
    never lead a write out of itself. The last component is resolved too; what does not exist
    is returned as is (under the last directory that does)."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    done: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, part)
        if here.is_symlink():
            hops += 1
            if hops > 40:
                raise BuildError(f"{rel}: too many symlinks in the tree {root}")
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        done.append(part)
    out = root.joinpath(*done)
    if os.path.commonpath([str(out), str(root)]) != str(root):
        raise BuildError(f"{rel} resolves outside the tree {root}")
    return out


def install_agent(staging: Path, agent: Path) -> None:
    sbin = resolve_in_root(staging, "sbin")
    sbin.mkdir(parents=True, exist_ok=True)
    dest = sbin / "ember-agent"
    tmp = sbin / ".ember-agent.tmp"
    shutil.copyfile(agent, tmp)
    if shutil.which("strip"):
        # Line tables are useless in the guest (panic=abort) and triple the file.
        run(["strip", "--strip-debug", str(tmp)])
    os.chown(tmp, 0, 0)
    os.chmod(tmp, 0o755)
    tmp.rename(dest)
    init = sbin / "init"
    if init.exists() or init.is_symlink():
        init.unlink()  # a link into layer 1's tree: unlinking here leaves the cache alone
    init.symlink_to("ember-agent")


def install_drivers(staging: Path, drivers: list[tuple[str, Path]], compile_bytecode: bool = True) -> None:
    """The Python driver's files as /usr/lib/ember/<name> (0644), with their bytecode (not for
    an image's tree: compiling would run the image's Python on the host)."""
    dest_dir = resolve_in_root(staging, DRIVER_DEST)
    dest_dir.mkdir(parents=True, exist_ok=True)
    for name, src in drivers:
        dest = dest_dir / name
        tmp = dest_dir / f".{name}.tmp"
        shutil.copyfile(src, tmp)
        os.chown(tmp, 0, 0)
        os.chmod(tmp, 0o644)
        tmp.rename(dest)  # a file from layer 1 here would be a hard link: never write into it
    if not compile_bytecode:
        return
    if any(name.endswith(".py") for name, _ in drivers) and (staging / "usr/bin/python3").exists():
        res = chroot_run(staging, ["/usr/bin/python3", "-c",
                                   f"import compileall, sys; sys.exit(not compileall.compile_dir({DRIVER_DEST!r}, "
                                   "quiet=1, maxlevels=0))"])
        if res.returncode != 0:
            raise BuildError(f"the Python driver files do not compile: {(res.stdout + res.stderr).strip()[-800:]}")


def image_size(data: int, inodes: int, disk_mib: int | None) -> tuple[int, int]:
    """(image bytes, inode count) for `data` bytes of blocks and `inodes` inodes of content.

    Without disk_mib: the content (+10 % inodes, inode tables, +2 %) plus HEADROOM, rounded up to
    4 MiB. With it: exactly disk_mib MiB, with at least one inode per BYTES_PER_INODE."""
    inodes = inodes + max(1024, inodes // 10)
    if disk_mib is None:
        size = data + inodes * INODE_SIZE + data // 50 + HEADROOM
        return math.ceil(size / (4 << 20)) * (4 << 20), inodes
    size = disk_mib << 20
    inodes = max(inodes, size // BYTES_PER_INODE)
    needed = data + inodes * INODE_SIZE + data // 50
    if needed > size:
        raise BuildError(f"the content does not fit in [vm] disk_mib = {disk_mib}: it needs about "
                         f"{math.ceil(needed / 2**20)} MiB ({data / 2**20:.0f} MiB of data, {inodes} inodes); "
                         f"raise disk_mib or leave it out to size the image to the content")
    return size, inodes


def build_image(recipe: dict, key1: str, base_tree: Path, agent: Path, drivers: list[tuple[str, Path]],
                key2: str, cache: Path, rebuild: bool) -> Path:
    final_dir = cache / "rootfs" / key2
    image = final_dir / "rootfs.ext4"
    with lock(cache, f"image-{key2}"):
        if image.exists() and (final_dir / "image.json").exists() and not rebuild:
            log(f"layer 2 (image) cached: {image}")
            return image
        if os.geteuid() != 0:
            raise BuildError("building the image needs root (the tree is root-owned)")
        ensure_tools()
        t0 = time.monotonic()
        work = cache / "tmp" / f"image-{key2[:16]}.{os.getpid()}"
        remove_tree(work)
        work.mkdir(parents=True)
        try:
            staging = work / "tree"
            # Hard links: instant, and nothing below writes into an existing file.
            run(["cp", "-al", str(base_tree), str(staging)])
            install_agent(staging, agent)
            from_image = recipe["image"] is not None
            if not from_image:
                # An image's tree is never chrooted into: nothing of it runs on the host.
                chroot_check(staging, ["/sbin/ember-agent", "--help"], None)
                chroot_check(staging, ["/sbin/init", "--version"], None)
            install_drivers(staging, drivers, compile_bytecode=not from_image)
            if not drivers:
                log(f"no Python driver files in {DRIVER_SRC} (yet): none installed in {DRIVER_DEST}")

            data, content_inodes = tree_size(staging)
            size, inodes = image_size(data, content_inodes, recipe["vm"]["disk_mib"])
            fs_uuid = str(uuid.UUID(key2[:32]))
            final_dir.mkdir(parents=True, exist_ok=True)
            tmp_image = final_dir / f"rootfs.ext4.tmp.{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                tmp_image.unlink()
            log(f"mkfs.ext4: {data / 2**20:.0f} MiB of data, {inodes} inodes, image {size >> 20} MiB")
            try:
                try:
                    run(["mkfs.ext4", "-q", "-F", "-t", "ext4", "-b", str(BLOCK), "-I", str(INODE_SIZE),
                         "-N", str(inodes), "-m", "0", "-L", LABEL, "-U", fs_uuid,
                         "-O", "^has_journal,^metadata_csum,^resize_inode",
                         "-E", f"root_owner=0:0,hash_seed={fs_uuid}",
                         "-d", str(staging), str(tmp_image), f"{size // 1024}k"])
                except BuildError as e:
                    if recipe["vm"]["disk_mib"] is not None:
                        raise BuildError(f"{e} (the content, {data / 2**20:.0f} MiB, may not fit in "
                                         f"[vm] disk_mib = {recipe['vm']['disk_mib']})") from e
                    raise
                verify_image(tmp_image, staging, drivers,
                             "/" + str(resolve_in_root(staging, "sbin").relative_to(staging)))
                facts = {
                    "image_key": key2,
                    "base_key": key1,
                    "agent_sha256": sha256_file(agent),
                    "drivers": {f"{DRIVER_DEST}/{name}": sha256_file(path) for name, path in drivers},
                    "image_bytes": size,
                    "content_bytes": data,
                    "matplotlib_config_dir": MPL_CONFIG_DIR if glob.glob(
                        str(staging / MPL_CONFIG_DIR.lstrip("/") / "fontlist-*.json")) else None,
                    "label": LABEL,
                    "uuid": fs_uuid,
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "build_seconds": round(time.monotonic() - t0, 1),
                }
                write_json_atomic(final_dir / "image.json", facts)
                os.chmod(tmp_image, 0o644)
                tmp_image.rename(image)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp_image.unlink()
        finally:
            remove_tree(work)
        log(f"layer 2 (image) built in {time.monotonic() - t0:.1f}s: {image}")
        return image


def write_json_atomic(path: Path, value) -> None:
    tmp = path.parent / f".{path.name}.tmp.{os.getpid()}"
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    tmp.rename(path)


def manifest(recipe: dict, key1: str, key2: str, key3: str, facts: dict) -> dict:
    """manifest.json: everything the host-side template builder and runtime read (README.md)."""
    driver = f"{DRIVER_DEST}/ember_driver.py"
    part = template_part(recipe)
    return {
        "manifest_version": MANIFEST_VERSION,
        "template": part["template"],
        "description": part["description"],
        "key": key3,
        "image_key": key2,
        "base_key": key1,
        "image": "rootfs.ext4",
        "image_bytes": facts["image_bytes"],
        "content_bytes": facts["content_bytes"],
        "label": facts["label"],
        "uuid": facts["uuid"],
        "agent_sha256": facts["agent_sha256"],
        "vm": {**part["vm"], "disk_mib": facts["image_bytes"] >> 20},
        "warmup": part["warmup"],
        "env": part["env"],
        "outputs": part["outputs"],
        "workspace": WORKSPACE,
        "user": {"name": USER_NAME, "uid": USER_ID, "gid": USER_ID, "home": USER_HOME, "shell": USER_SHELL},
        "python_driver": driver if driver in facts["drivers"] else None,
        "matplotlib_config_dir": facts.get("matplotlib_config_dir"),
        "driver_files": facts["drivers"],
        **({"debian": {"suite": recipe["suite"], "variant": recipe["variant"], "packages": recipe["packages"]}}
           if recipe["image"] is None else
           {"image": {k: recipe["image"][k] for k in ("ref", "config_digest", "manifest_digest", "unpacker",
                                                      "working_dir", "user", "start_command", "features")}}),
        "pip": recipe["pip"],
        "image_built_at": facts["built_at"],
    }


def build_template(recipe: dict, key1: str, key2: str, key3: str, image: Path, cache: Path,
                   rebuild: bool) -> Path:
    """The template entry: the image (hard link) and manifest.json, in a directory of their own, so
    that templates sharing an image (differing only in [vm], [warmup], [env], ...) never share a
    manifest."""
    final = cache / "rootfs-template" / key3
    with lock(cache, f"template-{key3}"):
        if (final / "manifest.json").exists() and (final / "rootfs.ext4").exists() and not rebuild:
            log(f"template entry cached: {final}")
            return final / "rootfs.ext4"
        facts = json.loads((image.parent / "image.json").read_text())
        mpl = facts.get("matplotlib_config_dir")
        if mpl and recipe["env"].get("MPLCONFIGDIR") != mpl:
            log(f"warning: the image has matplotlib's font cache in {mpl} but [env] does not set "
                f"MPLCONFIGDIR = \"{mpl}\": code in the guest would rebuild it")
        work = cache / "tmp" / f"template-{key3[:16]}.{os.getpid()}"
        remove_tree(work)
        work.mkdir(parents=True)
        try:
            os.link(image, work / "rootfs.ext4")
            write_json_atomic(work / "manifest.json", manifest(recipe, key1, key2, key3, facts))
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                old = cache / "tmp" / f"old-template-{key3[:16]}.{os.getpid()}"
                final.rename(old)
                remove_tree(old)
            work.rename(final)
        finally:
            remove_tree(work)
        log(f"template entry: {final}")
        return final / "rootfs.ext4"


def verify_image(image: Path, staging: Path, drivers: list[tuple[str, Path]], sbin: str = "/usr/sbin") -> None:
    """fsck, and the agent, /sbin/init and the driver files inside the image are what was installed.
    `sbin` is where /sbin leads in the tree (/usr/sbin on merged-/usr trees)."""
    run(["e2fsck", "-fn", str(image)], stderr=subprocess.PIPE)
    res = run(["debugfs", "-R", f"stat {sbin}/init", str(image)],
              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if 'Fast link dest: "ember-agent"' not in res.stdout:
        raise BuildError(f"{image}: {sbin}/init is not a symlink to ember-agent:\n{res.stdout}")
    dumped = image.parent / f".agent-check.{os.getpid()}"
    try:
        run(["debugfs", "-R", f"dump {sbin}/ember-agent {dumped}", str(image)],
            stderr=subprocess.DEVNULL)
        if sha256_file(dumped) != sha256_file(staging / sbin.lstrip("/") / "ember-agent"):
            raise BuildError(f"{image}: {sbin}/ember-agent differs from the installed binary")
        for name, src in drivers:
            dumped.unlink()
            run(["debugfs", "-R", f"dump {DRIVER_DEST}/{name} {dumped}", str(image)], stderr=subprocess.DEVNULL)
            if sha256_file(dumped) != sha256_file(src):
                raise BuildError(f"{image}: {DRIVER_DEST}/{name} differs from {src}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            dumped.unlink()


# ---------------------------------------------------------------------------------------------


def template_path(name: str) -> Path:
    if "/" in name or name.endswith(".toml"):
        return Path(name).resolve()
    return TEMPLATES_DIR / f"{name}.toml"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rootfs/build.sh",
        description="Build an ember root file system image (ext4) from a template recipe. "
                    "The last line on stdout is the image's absolute path.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--template", default="default",
                        help="template name in rootfs/templates/ or a path to a .toml (default: default); "
                             "checked with `ember template check` ($EMBER_BIN, else cargo run)")
    source.add_argument("--recipe-json", metavar="PATH", type=Path,
                        help="the checked recipe as `ember template check --json` prints it (what "
                             "`ember template build` passes) instead of --template")
    parser.add_argument("--print-key", action="store_true",
                        help="print the template's cache key (image + manifest) and exit without building "
                             "(the agent is still built: its bytes are part of the key)")
    parser.add_argument("--agent", metavar="PATH", type=Path,
                        help="use this static ember-agent binary instead of building it with cargo "
                             "(its bytes are part of the image key all the same)")
    parser.add_argument("--rebuild", action="store_true",
                        help="rebuild both layers even if cached (e.g. to pick up Debian updates)")
    args = parser.parse_args(argv)

    cache = Path(os.environ.get("EMBER_CACHE") or "/var/cache/ember").resolve()
    if args.recipe_json:
        recipe = recipe_from_json(read_recipe_json(args.recipe_json))
    else:
        recipe = load_recipe(template_path(args.template))
    key1 = base_key(recipe)
    agent = prebuilt_agent(args.agent) if args.agent else build_agent()
    drivers = driver_files()
    key2 = image_key(key1, agent, recipe, drivers)
    key3 = template_key(key2, recipe)
    if args.print_key:
        log(f"template {recipe['name']}: layer 1 key {key1}, image key {key2}")
        print(key3)
        return 0
    log(f"template {recipe['name']}: layer 1 key {key1[:16]}, image key {key2[:16]}, "
        f"template key {key3[:16]}, cache {cache}")
    base_tree = build_base(recipe, key1, cache, args.rebuild)
    image = build_image(recipe, key1, base_tree, agent, drivers, key2, cache, args.rebuild)
    print(build_template(recipe, key1, key2, key3, image, cache, args.rebuild))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BuildError as e:
        print(f"rootfs/build.sh: error: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:
        print(f"rootfs/build.sh: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("rootfs/build.sh: interrupted", file=sys.stderr)
        sys.exit(130)
