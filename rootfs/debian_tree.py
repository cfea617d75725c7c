"""Layer 1 of a Debian template's root file system: the tree (rootfs/README.md).

What makes the Debian tree — mmdebstrap from the host's apt sources, pip, the user, the Python
steps, the recipe's checks — and the helpers it runs on. It is a module of its own because the
tree's cache key (`build.base_key`) hashes this file, not build.py: a change to how the image or
the template entry is made (layer 2 or 3) then rebuilds neither tree. Change anything here and
every Debian tree is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

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

# The tree's user and directories (the image's manifest names them too).
USER_NAME, USER_ID, USER_HOME, USER_SHELL = "user", 1000, "/home/user", "/bin/bash"
WORKSPACE = "/workspace"
DEFAULT_OUTPUTS = "/workspace/outputs"
# Where the matplotlib font cache is built into the image (a recipe's [env] points MPLCONFIGDIR here).
MPL_CONFIG_DIR = "/etc/ember/matplotlib"

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
    # Man pages are never unpacked, so /usr/share/man/man1 does not exist, and a postinst that
    # registers a man page as an alternative's slave link fails on it (openjdk's `java`, which
    # the code-interpreter template installs): the directory, empty, before those packages.
    cmd.append('--essential-hook=mkdir -p "$1/usr/share/man/man1"')
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
