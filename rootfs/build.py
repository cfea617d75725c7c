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
import fcntl
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

ROOTFS_DIR = Path(__file__).resolve().parent
REPO_ROOT = ROOTFS_DIR.parent
TEMPLATES_DIR = ROOTFS_DIR / "templates"
BUILD_SCRIPTS = [ROOTFS_DIR / "build.sh", ROOTFS_DIR / "build.py"]

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
USER_NAME, USER_ID, USER_HOME, USER_SHELL = "user", 1000, "/home/user", "/bin/bash"
WORKSPACE = "/workspace"
DEFAULT_OUTPUTS = "/workspace/outputs"
# Where the matplotlib font cache is built into the image (a recipe's [env] points MPLCONFIGDIR here).
MPL_CONFIG_DIR = "/etc/ember/matplotlib"
MANIFEST_VERSION = 1


MERGED_USR_HOOKS = "/usr/share/mmdebstrap/hooks/merged-usr"
# dpkg never unpacks these (the rules also stay in the image for later installs).
DPKG_EXCLUDES = [
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/lintian/*",
    "path-exclude=/usr/share/linda/*",
]
# Host apt settings worth following inside mmdebstrap (how this host reaches its archive).
FORWARDED_APT_OPTIONS = re.compile(
    r"^Acquire::(Check-Valid-Until|Check-Date|Retries|https?::Proxy(::[^ ]+)?) "
)
# Host environment that tells pip how to reach its index.
FORWARDED_PIP_ENV = [
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_TRUSTED_HOST",
    "PIP_DEFAULT_TIMEOUT",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
]

START = time.monotonic()


class BuildError(Exception):
    """A failure with a message for the user."""


def log(msg: str) -> None:
    print(f"[rootfs {time.monotonic() - START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Runs a command with its stdout on our stderr (stdout is reserved for the result)."""
    kwargs.setdefault("stdout", sys.stderr)
    kwargs.setdefault("check", True)
    try:
        return subprocess.run(cmd, **kwargs)
    except FileNotFoundError as e:
        raise BuildError(f"cannot run {cmd[0]}: {e}") from e
    except subprocess.CalledProcessError as e:
        raise BuildError(f"{shlex.join(cmd)[:300]} failed with exit status {e.returncode}") from e


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
# Host tools and sources


def ensure_tools() -> None:
    missing = [pkg for tool, pkg in (("mmdebstrap", "mmdebstrap"), ("mkfs.ext4", "e2fsprogs"),
                                     ("debugfs", "e2fsprogs"), ("e2fsck", "e2fsprogs"))
               if shutil.which(tool) is None]
    missing = sorted(set(missing))
    if not missing:
        return
    log(f"installing {' '.join(missing)} with apt-get")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.run(cmd, stdout=sys.stderr, env=env).returncode != 0:
        run(["apt-get", "update"], env=env)
        run(cmd, env=env)


def deb822_stanzas(text: str) -> list[str]:
    stanzas, current = [], []
    for line in text.splitlines():
        if line.strip() == "":
            if current:
                stanzas.append(current)
            current = []
        elif not line.lstrip().startswith("#"):
            current.append(line)
    if current:
        stanzas.append(current)
    return stanzas


def suite_matches(host_suite: str, suite: str) -> bool:
    return host_suite == suite or host_suite.startswith(suite + "-") or host_suite.startswith(suite + "/")


def host_sources(suite: str, etc_apt: Path = Path("/etc/apt")) -> tuple[str, list[str]]:
    """The host's apt entries for `suite` (and its -updates/-security): deb822 text, one-line entries.

    No mirror is named by ember: whatever the host uses is what the image is built from.
    """
    deb822_out: list[str] = []
    one_line: list[str] = []
    files = sorted(glob.glob(str(etc_apt / "sources.list.d/*.sources")))
    for path in files:
        for stanza in deb822_stanzas(Path(path).read_text()):
            fields: dict[str, str] = {}
            order: list[str] = []
            key = None
            for line in stanza:
                if line[:1] in (" ", "\t") and key:
                    fields[key] += "\n" + line
                    continue
                key, _, value = line.partition(":")
                key = key.strip()
                fields[key] = value.strip()
                order.append(key)
            if fields.get("Enabled", "yes").lower() == "no":
                continue
            if "deb" not in fields.get("Types", "").split():
                continue
            suites = [s for s in fields.get("Suites", "").split() if suite_matches(s, suite)]
            if not suites:
                continue
            fields["Types"] = "deb"
            fields["Suites"] = " ".join(suites)
            deb822_out.append("\n".join(f"{k}: {fields[k]}" for k in order))
    for path in [str(etc_apt / "sources.list"), *sorted(glob.glob(str(etc_apt / "sources.list.d/*.list")))]:
        if not os.path.exists(path):
            continue
        for line in Path(path).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line.startswith("deb "):
                continue
            words = line.split()
            rest = words[1:]
            if rest and rest[0].startswith("["):
                while rest and not rest[0].endswith("]"):
                    rest = rest[1:]
                rest = rest[1:]
            if len(rest) >= 2 and suite_matches(rest[1], suite):
                one_line.append(line)
    if not deb822_out and not one_line:
        raise BuildError(
            f"the host's apt sources ({etc_apt}/sources.list, {etc_apt}/sources.list.d/) have no "
            f"'deb' entry for suite {suite!r}; ember builds only from the host's own sources"
        )
    return "\n\n".join(deb822_out) + ("\n" if deb822_out else ""), one_line


def host_apt_options() -> list[str]:
    out = run(["apt-config", "dump"], stdout=subprocess.PIPE, text=True).stdout
    opts = []
    for line in out.splitlines():
        if FORWARDED_APT_OPTIONS.match(line):
            opts.append(line.rstrip(";"))
    return opts


# ---------------------------------------------------------------------------------------------
# Safe removal of build directories (they may hold mount points while mmdebstrap runs)


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mount_point = line.split()[4].encode().decode("unicode_escape")
            if mount_point == prefix or mount_point.startswith(prefix + "/"):
                found.append(mount_point)
    return found


def remove_tree(path: Path) -> None:
    if not path.exists() and not path.is_symlink():
        return
    mounts = mounts_under(path)
    if mounts:
        raise BuildError(f"refusing to delete {path}: still mounted: {', '.join(mounts)} (unmount them first)")
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=True, stdout=sys.stderr)


@contextlib.contextmanager
def lock(cache: Path, name: str):
    (cache / "locks").mkdir(parents=True, exist_ok=True)
    with open(cache / "locks" / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------------------------------------
# Layer 1: the Debian tree


def build_base(recipe: dict, key1: str, cache: Path, rebuild: bool) -> Path:
    final = cache / "rootfs-base" / key1
    tree = final / "tree"
    if recipe["image"] is not None:
        if not (final / "recipe.json").exists():
            raise BuildError(f"the tree of image {recipe['image']['ref']} is not in {final}: "
                             f"[image] recipes are built by `ember template build`, which unpacks it")
        log(f"layer 1 (image {recipe['image']['ref']}, config {recipe['image']['config_digest'][:19]}) "
            f"unpacked by ember: {final}")
        return tree
    with lock(cache, f"base-{key1}"):
        if (final / "recipe.json").exists() and not rebuild:
            log(f"layer 1 (Debian tree) cached: {final}")
            return tree
        if os.geteuid() != 0:
            raise BuildError("building the Debian tree needs root (mmdebstrap in root mode, chroot)")
        ensure_tools()
        t0 = time.monotonic()
        work = cache / "tmp" / f"base-{key1[:16]}.{os.getpid()}"
        remove_tree(work)
        work.mkdir(parents=True)
        try:
            new_tree = work / "tree"
            debootstrap(recipe, new_tree, work)
            finish_tree(recipe, new_tree)
            meta = {
                "key": key1,
                "template": recipe["name"],
                "suite": recipe["suite"],
                "variant": recipe["variant"],
                "packages": recipe["packages"],
                "pip": recipe["pip"],
                "checks": recipe["checks"],
                "files": [f["path"] for f in recipe["files"]],
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.monotonic() - t0, 1),
            }
            (work / "recipe.json").write_text(json.dumps(meta, indent=2) + "\n")
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                old = cache / "tmp" / f"old-base-{key1[:16]}.{os.getpid()}"
                final.rename(old)
                remove_tree(old)
            work.rename(final)
        finally:
            remove_tree(work)
        log(f"layer 1 (Debian tree) built in {time.monotonic() - t0:.1f}s: {final}")
        return tree


def debootstrap(recipe: dict, tree: Path, work: Path) -> None:
    deb822, one_line = host_sources(recipe["suite"])
    mirrors: list[str] = []
    if deb822:
        sources_file = work / "host.sources"
        sources_file.write_text(deb822)
        mirrors.append(str(sources_file))
    mirrors.extend(one_line)

    packages = list(recipe["packages"])
    if recipe["pip"] and "python3-pip" not in packages:
        packages.append("python3-pip")
    cmd = ["mmdebstrap", f"--variant={recipe['variant']}", "--mode=root", "--format=directory"]
    if packages:
        cmd.append("--include=" + ",".join(packages))
    if os.path.isdir(MERGED_USR_HOOKS):
        # merged /usr by symlinks, without the usrmerge package (which drags in perl, ~50 MB).
        cmd.append(f"--hook-dir={MERGED_USR_HOOKS}")
    cmd += [f"--dpkgopt={o}" for o in DPKG_EXCLUDES]
    cmd += [f"--aptopt={o}" for o in host_apt_options()]
    if recipe["pip"]:
        cmd.append("--customize-hook=" + pip_hook(recipe["pip"]))
    cmd += [recipe["suite"], str(tree), *mirrors]
    log(f"mmdebstrap {recipe['suite']} ({recipe['variant']}) with {', '.join(packages) or 'no extra packages'}"
        + (f"; pip: {', '.join(recipe['pip'])}" if recipe["pip"] else ""))
    # The archive or a mirror answers 5xx now and then (seen: 503 from the security suite's
    # InRelease); a retry after a pause is what a person would do. Each try starts from an empty
    # target: mmdebstrap refuses a non-empty one.
    for attempt in range(1, DEBOOTSTRAP_TRIES + 1):
        try:
            run(["nice", *cmd])
            return
        except BuildError as e:
            if attempt == DEBOOTSTRAP_TRIES:
                raise
            pause = 15 * attempt
            log(f"mmdebstrap failed ({e}); trying again in {pause} s ({attempt}/{DEBOOTSTRAP_TRIES})")
            time.sleep(pause)
            remove_tree(tree)


# How many times mmdebstrap is tried before a build fails.
DEBOOTSTRAP_TRIES = 3


def host_ca_bundle() -> str | None:
    """The CA bundle the host trusts for reaching its package index (it may add a proxy's CA)."""
    candidates = [os.environ.get("PIP_CERT"), os.environ.get("REQUESTS_CA_BUNDLE"),
                  os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"]
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def pip_hook(requirements: list[str]) -> str:
    """A mmdebstrap customize hook (run by sh, $1 = the tree) that pip-installs the requirements.

    pip runs in the chroot with a clean environment plus the host's index and proxy settings, and
    trusts the host's CA bundle for the download only: the bundle is copied in for the run and
    removed afterwards, so it never reaches the image.
    """
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"]
    env += [f"{k}={os.environ[k]}" for k in FORWARDED_PIP_ENV if k in os.environ]
    ca = host_ca_bundle()
    ca_in_tree = "/tmp/.ember-build-ca.pem"
    if ca:
        env.append(f"PIP_CERT={ca_in_tree}")
    pip = ["env", "-i", *env, "python3", "-m", "pip", "install", "--no-cache-dir", "--no-input",
           "--break-system-packages", "--root-user-action=ignore", "--disable-pip-version-check",
           "--", *requirements]
    script = 'chroot "$1" ' + shlex.join(pip) + "; rc=$?; "
    if ca:
        script = f'cp {shlex.quote(ca)} "$1{ca_in_tree}" && ' + script + f'rm -f "$1{ca_in_tree}"; '
    return script + "exit $rc"


def finish_tree(recipe: dict, tree: Path) -> None:
    """Strips what a sandbox never reads and removes host traces; adds the recipe's files."""
    for pattern in ["usr/share/man/*", "usr/share/info/*", "usr/share/lintian/*", "usr/share/linda/*",
                    "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb", "var/lib/apt/lists/*_*",
                    "var/cache/debconf/*-old", "var/lib/dpkg/*-old", "var/log/*.log", "var/log/apt/*",
                    "etc/apt/apt.conf.d/99mmdebstrap", "root/.cache", "root/.wget-hsts"]:
        for p in glob.glob(str(tree / pattern)):
            p = Path(p)
            if p.is_dir() and not p.is_symlink():
                remove_tree(p)
            else:
                p.unlink()
    locale = tree / "usr/share/locale"
    if locale.is_dir():
        for p in locale.iterdir():
            if p.name != "locale.alias":
                remove_tree(p) if p.is_dir() else p.unlink()
    doc = tree / "usr/share/doc"
    if doc.is_dir():
        for p in doc.rglob("*"):
            if p.is_file() and p.name != "copyright":
                p.unlink()

    # mmdebstrap copies the build host's hostname and resolv.conf; neither belongs in a guest.
    for name, text in (("hostname", "ember\n"),
                       ("hosts", "127.0.0.1\tlocalhost ember\n::1\tlocalhost ip6-localhost ip6-loopback\n")):
        (tree / "etc" / name).write_text(text)
        os.chmod(tree / "etc" / name, 0o644)
    resolv = tree / "etc/resolv.conf"
    if resolv.exists() or resolv.is_symlink():
        resolv.unlink()
    # The root is read-only; /run is a tmpfs, so whoever sets up networking writes it there.
    resolv.symlink_to("/run/resolv.conf")

    add_user(tree)

    for f in recipe["files"]:
        dest = tree / f["path"].lstrip("/")
        # Never follow a link: /var/run -> /run in the tree would lead onto the build host.
        prefix = tree
        for part in Path(f["path"].lstrip("/")).parent.parts:
            prefix = prefix / part
            if prefix.is_symlink():
                raise BuildError(f"files: {f['path']} goes through the symlink /{prefix.relative_to(tree)}; "
                                 "give the path it points to")
        if dest.is_symlink() or (dest.exists() and not dest.is_file()):
            raise BuildError(f"files: {f['path']} exists in the tree and is not a regular file")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f["data"])
        os.chown(dest, 0, 0)
        os.chmod(dest, f["mode"])

    if (tree / "usr/bin/python3").exists():
        python_steps(recipe, tree)


def add_user(tree: Path) -> None:
    """The unprivileged account (uid/gid 1000) for exec's `user` option, and its home.

    Written straight into the account files (no useradd: deterministic, and works in any variant)."""
    etc = tree / "etc"
    for name in ("passwd", "group", "shadow", "gshadow"):
        f = etc / name
        if f.exists():
            for line in f.read_text().splitlines():
                fields = line.split(":")
                if fields[0] == USER_NAME or (name in ("passwd", "group") and len(fields) > 2
                                              and fields[2] == str(USER_ID)):
                    raise BuildError(f"/etc/{name} already has {line!r}; cannot add {USER_NAME} ({USER_ID})")
    lines = {
        "passwd": f"{USER_NAME}:x:{USER_ID}:{USER_ID}::{USER_HOME}:{USER_SHELL}",
        "group": f"{USER_NAME}:x:{USER_ID}:",
        # Locked (no password login); lastchg empty: no password aging (0 would force a change).
        "shadow": ":".join([USER_NAME, "!"] + [""] * 7),
        "gshadow": f"{USER_NAME}:!::",
    }
    for name, line in lines.items():
        f = etc / name
        if not f.exists() and name == "gshadow":
            continue
        text = f.read_text() if f.exists() else ""
        f.write_text(text + ("" if text.endswith("\n") or not text else "\n") + line + "\n")
    home = tree / USER_HOME.lstrip("/")
    home.mkdir(parents=True, exist_ok=True)
    skel = tree / "etc/skel"
    if skel.is_dir():
        for p in skel.iterdir():
            if p.is_file() and not p.is_symlink():
                shutil.copyfile(p, home / p.name)
                os.chown(home / p.name, USER_ID, USER_ID)
                os.chmod(home / p.name, 0o644)
    os.chown(home, USER_ID, USER_ID)
    os.chmod(home, 0o755)
    # The sandbox's working directory: code runs as root by default and as `user` on request;
    # both must be able to write there (and to delete what the other wrote).
    for d in (WORKSPACE, DEFAULT_OUTPUTS):
        p = tree / d.lstrip("/")
        p.mkdir(parents=True, exist_ok=True)
        os.chown(p, USER_ID, USER_ID)
        os.chmod(p, 0o777)


# Compiles what has no bytecode yet on the interpreter's own path (Debian's py3compile normally
# did it in the packages' postinst); prints "<missing before> <failed>".
COMPILE_SCRIPT = r"""
import compileall, importlib.util, os, sys
dirs = [d for d in sys.path if d.startswith("/usr/") and os.path.isdir(d)]
def missing():
    n = 0
    for d in dirs:
        for root, subdirs, files in os.walk(d):
            subdirs[:] = [s for s in subdirs if s != "__pycache__" and s.isidentifier()]
            for f in files:
                if f.endswith(".py") and not os.path.exists(importlib.util.cache_from_source(os.path.join(root, f))):
                    n += 1
    return n
before = missing()
if before:
    for d in dirs:
        compileall.compile_dir(d, quiet=2, workers=1)
print(before, missing())
"""

# Builds matplotlib's font cache into the image and renders one figure (Agg).
MPL_SCRIPT = r"""
import io, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig = plt.figure(); plt.plot([1, 2]); fig.savefig(io.BytesIO(), format="png"); plt.close(fig)
print(matplotlib.get_cachedir())
"""


def python_steps(recipe: dict, tree: Path) -> None:
    """Python checks, bytecode and matplotlib's font cache: the guest can afford none at import."""
    chroot_check(tree, ["/usr/bin/python3", "-B", "-c", "print(1)"], "1")

    res = chroot_run(tree, ["/usr/bin/python3", "-c", COMPILE_SCRIPT])
    words = res.stdout.split()
    if res.returncode != 0 or len(words) != 2:
        raise BuildError(f"compiling Python bytecode in the tree failed: {(res.stdout + res.stderr).strip()[-500:]}")
    before, after = int(words[0]), int(words[1])
    log(f"python bytecode: {before} module(s) had none" + (f"; compiled, {after} fail to compile (skipped)"
                                                            if before else ""))

    if glob.glob(str(tree / "usr/lib/python3/dist-packages/IPython/__init__.py")) or \
            glob.glob(str(tree / "usr/local/lib/python3*/dist-packages/IPython/__init__.py")):
        chroot_check(tree, ["/usr/bin/python3", "-c", "import IPython; print('ok')"], "ok")

    if glob.glob(str(tree / "usr/lib/python3/dist-packages/matplotlib/__init__.py")) or \
            glob.glob(str(tree / "usr/local/lib/python3*/dist-packages/matplotlib/__init__.py")):
        cfg = tree / MPL_CONFIG_DIR.lstrip("/")
        cfg.mkdir(parents=True, exist_ok=True)
        env = {"MPLCONFIGDIR": MPL_CONFIG_DIR}
        t0 = time.monotonic()
        for attempt in ("build", "check"):
            res = chroot_run(tree, ["/usr/bin/python3", "-c", MPL_SCRIPT], env)
            if res.returncode != 0 or res.stdout.strip() != MPL_CONFIG_DIR:
                raise BuildError(f"matplotlib in the tree ({attempt}, MPLCONFIGDIR={MPL_CONFIG_DIR}) failed: "
                                 f"{(res.stdout + res.stderr).strip()[-500:]}")
            if attempt == "check" and "font cache" in res.stderr:
                raise BuildError(f"matplotlib rebuilt its font cache on a second import: {res.stderr.strip()[-300:]}")
        if not glob.glob(str(cfg / "fontlist-*.json")):
            raise BuildError(f"matplotlib wrote no fontlist-*.json into {MPL_CONFIG_DIR}")
        for root, dirs, files in os.walk(cfg):
            for name in dirs + files:
                os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
        log(f"matplotlib font cache built in {MPL_CONFIG_DIR} ({time.monotonic() - t0:.1f}s)")

    # Not with the recipe's [env]: that is not part of layer 1's key.
    check_env = {"MPLCONFIGDIR": MPL_CONFIG_DIR} if (tree / MPL_CONFIG_DIR.lstrip("/")).is_dir() else {}
    for code in recipe["checks"]:
        res = chroot_run(tree, ["/usr/bin/python3", "-c", code], check_env)
        if res.returncode != 0:
            raise BuildError(f"[checks] python {code!r} failed in the tree (status {res.returncode}): "
                             f"{(res.stdout + res.stderr).strip()[-500:]}")
        log(f"check passed: {code}")


def chroot_run(tree: Path, argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8", **(env or {})}
    try:
        return subprocess.run(["chroot", str(tree), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=full_env)
    except FileNotFoundError as e:
        raise BuildError(f"cannot run chroot: {e}") from e


def chroot_check(tree: Path, argv: list[str], expect: str | None) -> None:
    res = chroot_run(tree, argv)
    if res.returncode != 0 or (expect is not None and res.stdout.strip() != expect):
        raise BuildError(f"check `chroot {tree} {shlex.join(argv)}` failed (status {res.returncode}): "
                         f"{(res.stdout + res.stderr).strip()[:500]}")


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
