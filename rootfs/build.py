#!/usr/bin/env python3
"""Build an ember root file system image from a template recipe.

Two content-addressed layers under $EMBER_CACHE (default /var/cache/ember):

  rootfs-base/<key1>/tree     the Debian tree: mmdebstrap from the HOST's apt sources, stripped,
                              plus the recipe's pip packages and files.
                              key1 = sha256(recipe's build part + these build scripts)
  rootfs/<key2>/rootfs.ext4   the image: the tree + ember-agent as /sbin/ember-agent and /sbin/init,
                              as ext4 (4 KiB blocks, no journal, no metadata_csum, label ember-root).
                              key2 = sha256(key1 + the ember-agent binary's bytes)

Progress goes to stderr. On success the last (and only) line on stdout is the image's absolute
path. See rootfs/README.md for the recipe schema.
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
import tomllib
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


def parse_mode(value, where: str) -> int:
    if isinstance(value, int):
        mode = value
    elif isinstance(value, str) and re.fullmatch(r"0?[0-7]{3,4}", value):
        mode = int(value, 8)
    else:
        raise BuildError(f"{where}: mode {value!r} is not an octal string such as \"0644\"")
    if mode > 0o7777:
        raise BuildError(f"{where}: mode {value!r} out of range")
    return mode


def check_keys(table: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise BuildError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")


def string_list(table: dict, key: str, where: str) -> list[str]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BuildError(f"{where}.{key} must be a list of non-empty strings")
    return value


def load_recipe(path: Path) -> dict:
    """Reads and validates a template; returns it normalised (file contents inlined as bytes)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError as e:
        raise BuildError(f"template {path} not found") from e
    except tomllib.TOMLDecodeError as e:
        raise BuildError(f"template {path} is not valid TOML: {e}") from e

    check_keys(raw, {"name", "description", "debian", "pip", "files", "warmup"}, str(path))
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise BuildError(f"{path}: name {name!r} must be letters, digits, '.', '_' or '-'")

    debian = raw.get("debian")
    if not isinstance(debian, dict):
        raise BuildError(f"{path}: a [debian] table is required")
    check_keys(debian, {"suite", "variant", "packages"}, f"{path} [debian]")
    suite = debian.get("suite")
    if not isinstance(suite, str) or not re.fullmatch(r"[a-z][a-z0-9-]*", suite):
        raise BuildError(f"{path} [debian]: suite must be a Debian code name such as \"bookworm\"")
    variant = debian.get("variant", "minbase")
    if variant not in ("minbase", "essential", "apt", "required", "important", "standard"):
        raise BuildError(f"{path} [debian]: unsupported variant {variant!r}")
    packages = string_list(debian, "packages", f"{path} [debian]")
    for p in packages:
        if not re.fullmatch(r"[a-z0-9][a-z0-9+.-]*(:[a-z0-9]+)?(=[A-Za-z0-9.+:~-]+)?", p):
            raise BuildError(f"{path} [debian]: {p!r} is not a Debian package name")

    pip = raw.get("pip", {})
    if not isinstance(pip, dict):
        raise BuildError(f"{path}: [pip] must be a table")
    check_keys(pip, {"packages"}, f"{path} [pip]")
    pip_packages = string_list(pip, "packages", f"{path} [pip]")
    for p in pip_packages:
        if p.startswith("-"):
            raise BuildError(f"{path} [pip]: {p!r}: options are not allowed, only requirements")

    files = []
    for i, entry in enumerate(raw.get("files", [])):
        where = f"{path} [[files]] #{i + 1}"
        if not isinstance(entry, dict):
            raise BuildError(f"{where}: must be a table")
        check_keys(entry, {"path", "content", "source", "mode"}, where)
        dest = entry.get("path")
        if not isinstance(dest, str) or not dest.startswith("/") or ".." in dest.split("/") or dest == "/":
            raise BuildError(f"{where}: path must be an absolute path in the guest without '..'")
        if ("content" in entry) == ("source" in entry):
            raise BuildError(f"{where}: give exactly one of content (text) or source (a file)")
        if "content" in entry:
            if not isinstance(entry["content"], str):
                raise BuildError(f"{where}: content must be a string")
            data = entry["content"].encode()
        else:
            src = (path.parent / entry["source"]).resolve()
            try:
                data = src.read_bytes()
            except OSError as e:
                raise BuildError(f"{where}: cannot read source {src}: {e}") from e
        files.append({"path": dest, "data": data, "mode": parse_mode(entry.get("mode", "0644"), where)})

    warmup = raw.get("warmup", {})
    if not isinstance(warmup, dict):
        raise BuildError(f"{path}: [warmup] must be a table")
    check_keys(warmup, {"code"}, f"{path} [warmup]")
    code = warmup.get("code", "")
    if not isinstance(code, str):
        raise BuildError(f"{path} [warmup]: code must be a string")

    return {
        "name": name,
        "description": raw.get("description", ""),
        "suite": suite,
        "variant": variant,
        "packages": packages,
        "pip": pip_packages,
        "files": files,
        "warmup": code,
    }


def base_key(recipe: dict) -> str:
    """Key of layer 1: what goes into the tree (not the warm-up) and the scripts that build it."""
    build_part = {
        "suite": recipe["suite"],
        "variant": recipe["variant"],
        "packages": recipe["packages"],
        "pip": recipe["pip"],
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


def image_key(key1: str, agent: Path) -> str:
    h = hashlib.sha256()
    h.update(key1.encode() + b"\0")
    with open(agent, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
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
    run(["nice", *cmd])


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

    # Fail early if the tree cannot run Python at all.
    if "python3" in recipe["packages"]:
        chroot_check(tree, ["/usr/bin/python3", "-B", "-c", "print(1)"], "1")


def chroot_check(tree: Path, argv: list[str], expect: str | None) -> None:
    res = subprocess.run(["chroot", str(tree), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"})
    if res.returncode != 0 or (expect is not None and res.stdout.strip() != expect):
        raise BuildError(f"check `chroot {tree} {shlex.join(argv)}` failed (status {res.returncode}): "
                         f"{(res.stdout + res.stderr).strip()[:500]}")


# ---------------------------------------------------------------------------------------------
# The agent


def build_agent() -> Path:
    """Builds ember-agent statically (the explicit --target keeps RUSTFLAGS off host build scripts)."""
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo/bin/cargo")
    env = dict(os.environ, RUSTFLAGS=AGENT_RUSTFLAGS)
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


def install_agent(staging: Path, agent: Path) -> None:
    sbin = staging / "sbin"
    if sbin.is_symlink():
        sbin = staging / os.readlink(sbin).lstrip("/")
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


def build_image(recipe: dict, key1: str, base_tree: Path, agent: Path, key2: str, cache: Path,
                rebuild: bool) -> Path:
    final_dir = cache / "rootfs" / key2
    image = final_dir / "rootfs.ext4"
    with lock(cache, f"image-{key2}"):
        if image.exists() and not rebuild:
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
            chroot_check(staging, ["/sbin/ember-agent", "--help"], None)
            chroot_check(staging, ["/sbin/init", "--version"], None)

            data, inodes = tree_size(staging)
            inodes = inodes + max(1024, inodes // 10)
            size = data + inodes * INODE_SIZE + data // 50 + HEADROOM
            size = math.ceil(size / (4 << 20)) * (4 << 20)
            fs_uuid = str(uuid.UUID(key2[:32]))
            final_dir.mkdir(parents=True, exist_ok=True)
            tmp_image = final_dir / f"rootfs.ext4.tmp.{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                tmp_image.unlink()
            log(f"mkfs.ext4: {data / 2**20:.0f} MiB of data, {inodes} inodes, image {size >> 20} MiB")
            try:
                run(["mkfs.ext4", "-q", "-F", "-t", "ext4", "-b", str(BLOCK), "-I", str(INODE_SIZE),
                     "-N", str(inodes), "-m", "0", "-L", LABEL, "-U", fs_uuid,
                     "-O", "^has_journal,^metadata_csum,^resize_inode",
                     "-E", f"root_owner=0:0,hash_seed={fs_uuid}",
                     "-d", str(staging), str(tmp_image), f"{size // 1024}k"])
                verify_image(tmp_image, staging)
                manifest = {
                    "template": recipe["name"],
                    "description": recipe["description"],
                    "key": key2,
                    "base_key": key1,
                    "agent_sha256": sha256_file(agent),
                    "image_bytes": size,
                    "label": LABEL,
                    "uuid": fs_uuid,
                    "warmup": recipe["warmup"],
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "build_seconds": round(time.monotonic() - t0, 1),
                }
                (final_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
                os.chmod(tmp_image, 0o644)
                tmp_image.rename(image)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp_image.unlink()
        finally:
            remove_tree(work)
        log(f"layer 2 (image) built in {time.monotonic() - t0:.1f}s: {image}")
        return image


def verify_image(image: Path, staging: Path) -> None:
    """fsck, and the agent and /sbin/init inside the image are what was installed."""
    run(["e2fsck", "-fn", str(image)], stderr=subprocess.PIPE)
    res = run(["debugfs", "-R", "stat /usr/sbin/init", str(image)],
              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if 'Fast link dest: "ember-agent"' not in res.stdout:
        raise BuildError(f"{image}: /usr/sbin/init is not a symlink to ember-agent:\n{res.stdout}")
    dumped = image.parent / f".agent-check.{os.getpid()}"
    try:
        run(["debugfs", "-R", f"dump /usr/sbin/ember-agent {dumped}", str(image)],
            stderr=subprocess.DEVNULL)
        if sha256_file(dumped) != sha256_file(staging / "usr/sbin/ember-agent"):
            raise BuildError(f"{image}: /usr/sbin/ember-agent differs from the installed binary")
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
    parser.add_argument("--template", default="default",
                        help="template name in rootfs/templates/ or a path to a .toml (default: default)")
    parser.add_argument("--print-key", action="store_true",
                        help="print the image's cache key and exit without building the image "
                             "(the agent is still built: its bytes are part of the key)")
    parser.add_argument("--rebuild", action="store_true",
                        help="rebuild both layers even if cached (e.g. to pick up Debian updates)")
    args = parser.parse_args(argv)

    cache = Path(os.environ.get("EMBER_CACHE") or "/var/cache/ember").resolve()
    recipe = load_recipe(template_path(args.template))
    key1 = base_key(recipe)
    agent = build_agent()
    key2 = image_key(key1, agent)
    if args.print_key:
        log(f"template {recipe['name']}: layer 1 key {key1}")
        print(key2)
        return 0
    log(f"template {recipe['name']}: layer 1 key {key1[:16]}, image key {key2[:16]}, cache {cache}")
    base_tree = build_base(recipe, key1, cache, args.rebuild)
    image = build_image(recipe, key1, base_tree, agent, key2, cache, args.rebuild)
    print(image)
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
