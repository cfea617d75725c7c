#!/usr/bin/env python3
"""Test images for tests/oci.rs: OCI layouts from directories, their docker-archive and
oci-archive forms, hostile layers, and a push to a registry (Docker Registry HTTP API v2:
monolithic blob uploads + a manifest PUT). Only ever talks to the registry it is given (the
test's own, in its network namespace).

  mkimage.py layout OUT --layer-dir DIR [--layer-dir[-fixed] DIR2 | --layer-tar T.tar] [--gzip-last]
                    [--env K=V]... [--workdir D] [--cmd ARG]...
  mkimage.py docker-archive LAYOUT OUT.tar
  mkimage.py oci-archive LAYOUT OUT.tar
  mkimage.py hostile KIND OUT.tar [--outside DIR]   one hostile layer (a tar) of KIND
  mkimage.py push LAYOUT HOST:PORT REPO TAG          prints the manifest digest
"""

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
TAR = "application/vnd.oci.image.layer.v1.tar"
TAR_GZ = "application/vnd.oci.image.layer.v1.tar+gzip"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sha_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def put_blob(layout: Path, data: bytes) -> str:
    d = sha(data)
    p = layout / "blobs/sha256" / d[7:]
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return d


def put_blob_file(layout: Path, src: Path) -> str:
    d = sha_file(src)
    p = layout / "blobs/sha256" / d[7:]
    p.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(src), p)
    return d


def layout(out: Path, layers: list[tuple[str, str]], gzip_last: bool, env: list[str], workdir: str, cmd: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    descs, diff_ids = [], []
    for i, (kind, src) in enumerate(layers):
        tmp = out / f".layer{i}.tar"
        if kind in ("dir", "dir-fixed"):
            # GNU tar for speed (creating a test fixture; ember's unpacker reads it). The files
            # keep their mtimes: Python's bytecode is checked against its source's mtime.
            fixed = ["--mtime=@1700000000"] if kind == "dir-fixed" else []
            # --xattrs makes a pax archive, whose headers would carry atime and ctime: left out,
            # so that the same tree makes the same layer.
            subprocess.run(["tar", "-C", src, "--numeric-owner", "--xattrs", "--sort=name", *fixed,
                            "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
                            "-cf", str(tmp), "."], check=True)
        else:
            shutil.copyfile(src, tmp)
        diff_ids.append(sha_file(tmp))
        if gzip_last and i == len(layers) - 1:
            gz = out / f".layer{i}.tar.gz"
            with open(tmp, "rb") as f, open(gz, "wb") as g:
                with gzip.GzipFile(fileobj=g, mode="wb", mtime=0, compresslevel=1) as z:
                    shutil.copyfileobj(f, z)
            tmp.unlink()
            size = gz.stat().st_size
            descs.append({"mediaType": TAR_GZ, "digest": put_blob_file(out, gz), "size": size})
        else:
            size = tmp.stat().st_size
            descs.append({"mediaType": TAR, "digest": put_blob_file(out, tmp), "size": size})
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": env, "WorkingDir": workdir, "Cmd": cmd or None},
              "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    cfg = json.dumps(config, sort_keys=True).encode()
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "digest": put_blob(out, cfg), "size": len(cfg)},
                "layers": descs}
    mbytes = json.dumps(manifest, sort_keys=True).encode()
    index = {"schemaVersion": 2, "manifests": [{"mediaType": OCI_MANIFEST, "digest": put_blob(out, mbytes),
                                                 "size": len(mbytes),
                                                 "platform": {"os": "linux", "architecture": "amd64"}}]}
    (out / "index.json").write_text(json.dumps(index))


def read_layout(lay: Path) -> tuple[dict, bytes, dict]:
    index = json.loads((lay / "index.json").read_text())
    mdig = index["manifests"][0]["digest"]
    mbytes = (lay / "blobs/sha256" / mdig[7:]).read_bytes()
    return index, mbytes, json.loads(mbytes)


def docker_archive(lay: Path, out: Path) -> None:
    """`docker save` form: uncompressed layers as <hex>/layer.tar, the config as <hex>.json."""
    _, _, m = read_layout(lay)
    cfg_hex = m["config"]["digest"][7:]
    with tarfile.open(out, "w") as t:
        t.add(lay / "blobs/sha256" / cfg_hex, arcname=f"{cfg_hex}.json")
        names = []
        for d in m["layers"]:
            blob = lay / "blobs/sha256" / d["digest"][7:]
            if d["mediaType"].endswith("+gzip"):
                raw = gzip.decompress(blob.read_bytes())
                info = tarfile.TarInfo(f"{sha(raw)[7:]}/layer.tar")
                info.size = len(raw)
                t.addfile(info, io.BytesIO(raw))
                names.append(info.name)
            else:
                name = f"{d['digest'][7:]}/layer.tar"
                t.add(blob, arcname=name)
                names.append(name)
        man = json.dumps([{"Config": f"{cfg_hex}.json", "RepoTags": ["ember-oci-test:latest"], "Layers": names}]).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(man)
        t.addfile(info, io.BytesIO(man))


def oci_archive(lay: Path, out: Path) -> None:
    with tarfile.open(out, "w") as t:
        for name in ["oci-layout", "index.json"]:
            t.add(lay / name, arcname=name)
        for p in sorted((lay / "blobs/sha256").iterdir()):
            t.add(p, arcname=f"blobs/sha256/{p.name}")


def hostile(kind: str, out: Path, outside: str) -> None:
    """One layer of KIND (see tests/oci.rs)."""
    t = tarfile.open(out, "w", format=tarfile.GNU_FORMAT)

    def add(name, data=b"", type_=tarfile.REGTYPE, link="", mode=0o644, size=None):
        info = tarfile.TarInfo(name)
        info.type = type_
        info.linkname = link
        info.mode = mode
        info.size = len(data) if size is None else size
        info.mtime = 1700000000
        t.addfile(info, io.BytesIO(data) if type_ == tarfile.REGTYPE else None)

    if kind == "dotdot":
        add(f"../../../../../../../..{outside}/pwned", b"pwned")
    elif kind == "absolute":
        add(f"{outside}/pwned", b"pwned")
    elif kind == "hardlink-out":
        add("h", type_=tarfile.LNKTYPE, link=f"../../../../../../..{outside}/canary")
    elif kind == "symlink-dangling":
        add("escape", type_=tarfile.SYMTYPE, link=outside)
        add("escape/pwned", b"pwned")
    elif kind == "tar-bomb":
        for i in range(20000):
            add(f"bomb/{i}", b"")
    elif kind == "unique":
        # A layer no other test makes (fresh bytes: not in any blob store yet).
        add("unique", os.urandom(64).hex().encode())
    elif kind == "neutralised":
        # What is kept contained rather than refused: a setuid binary, device nodes and a FIFO,
        # a symlink to the host directory with a write through it (lands in the image).
        add("bin/suid-sh", b"#!/bin/sh\necho suid\n", mode=0o4755)
        add("dev-in-image/mem", type_=tarfile.CHRTYPE, mode=0o666)
        add("dev-in-image/sda", type_=tarfile.BLKTYPE, mode=0o666)
        add("dev-in-image/fifo", type_=tarfile.FIFOTYPE, mode=0o666)
        parts = outside.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            add("/".join(parts[:i]) + "/", type_=tarfile.DIRTYPE, mode=0o755)
        add("escape", type_=tarfile.SYMTYPE, link=outside)
        add("escape/canary", b"pwned")
    else:
        raise SystemExit(f"unknown hostile kind {kind}")
    t.close()


def sparse_header(out: Path) -> None:
    """A layer whose one file declares 10 GiB (only the header is stored): the unpacker must
    refuse it from the header, before writing anything."""
    info = tarfile.TarInfo("huge.img")
    info.size = 10 << 30
    info.mtime = 1700000000
    with open(out, "wb") as f:
        f.write(info.tobuf(format=tarfile.GNU_FORMAT))
        f.write(b"\0" * 4096)


def push(lay: Path, host: str, repo: str, tag: str) -> str:
    index, mbytes, m = read_layout(lay)
    base = f"http://{host}/v2/{repo}"
    for d in [m["config"], *m["layers"]]:
        req = urllib.request.Request(f"{base}/blobs/uploads/", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=60) as r:
            loc = r.headers["Location"]
        if loc.startswith("/"):
            loc = f"http://{host}{loc}"
        sep = "&" if "?" in loc else "?"
        data = (lay / "blobs/sha256" / d["digest"][7:]).read_bytes()
        req = urllib.request.Request(f"{loc}{sep}digest={d['digest']}", method="PUT", data=data,
                                     headers={"Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.status in (201, 204), r.status
    req = urllib.request.Request(f"{base}/manifests/{tag}", method="PUT", data=mbytes,
                                 headers={"Content-Type": OCI_MANIFEST})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 201, r.status
    return sha(mbytes)


def main(argv: list[str]) -> None:
    cmd = argv[0]
    if cmd == "layout":
        out = Path(argv[1])
        layers, env, cmdv, workdir, gz = [], [], [], "", False
        i = 2
        while i < len(argv):
            a = argv[i]
            if a == "--gzip-last":
                gz = True
                i += 1
                continue
            v = argv[i + 1]
            if a == "--layer-dir":
                layers.append(("dir", v))
            elif a == "--layer-dir-fixed":
                # Every mtime set to one value: the same files give the same layer, run after
                # run (not for trees with Python bytecode, which is checked against mtimes).
                layers.append(("dir-fixed", v))
            elif a == "--layer-tar":
                layers.append(("tar", v))
            elif a == "--env":
                env.append(v)
            elif a == "--workdir":
                workdir = v
            elif a == "--cmd":
                cmdv.append(v)
            else:
                raise SystemExit(f"unknown option {a}")
            i += 2
        layout(out, layers, gz, env, workdir, cmdv)
    elif cmd == "docker-archive":
        docker_archive(Path(argv[1]), Path(argv[2]))
    elif cmd == "oci-archive":
        oci_archive(Path(argv[1]), Path(argv[2]))
    elif cmd == "hostile":
        if argv[1] == "sparse-10g":
            sparse_header(Path(argv[2]))
        else:
            outside = argv[argv.index("--outside") + 1] if "--outside" in argv else "/tmp/ember-oci-outside"
            hostile(argv[1], Path(argv[2]), outside)
    elif cmd == "push":
        print(push(Path(argv[1]), argv[2], argv[3], argv[4]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
