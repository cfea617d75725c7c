"""Unit tests of rootfs/build.py that need neither root nor the network.

Run: python3 -m unittest discover -s rootfs -p 'test_*.py'
"""

import os
import shutil
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import build  # noqa: E402
import debian_tree  # noqa: E402


def write(dir_: Path, name: str, text: str) -> Path:
    path = dir_ / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def checked(**changes) -> dict:
    """A recipe as `ember template check --json` prints it (the minimal one: [debian] with
    python3, everything else defaulted), with `changes` merged into its tables."""
    recipe = {
        "name": "t", "description": "", "outputs": "/workspace/outputs",
        "debian": {"suite": "bookworm", "variant": "minbase", "packages": ["python3"]},
        "pip": {"packages": []}, "files": [], "checks": {"python": []},
        "vm": {"vcpus": 1, "memory_mib": 512, "disk_mib": None, "network": True},
        "warmup": {"code": "", "contexts": [{"id": "default", "language": "python"}],
                   "spare": {"bash": 1, "python": 1}},
        "env": {},
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(recipe.get(key), dict) and key != "env":
            recipe[key] = {**recipe[key], **value}
        else:
            recipe[key] = value
    return {"ember_recipe": build.RECIPE_FORMAT, "file": "/recipes/t.toml", "recipe": recipe}


def ember_available() -> bool:
    return bool(os.environ.get("EMBER_BIN")) or shutil.which("cargo") is not None \
        or (Path.home() / ".cargo/bin/cargo").exists()


class RecipeTests(unittest.TestCase):
    """The build's view of a checked recipe (the checking is Rust's: runtime/src/template/schema.rs)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def test_checked_recipe_is_flattened(self):
        write(self.dir, "motd", "hi\n")
        recipe = build.recipe_from_json(checked(
            files=[{"path": "/etc/motd", "source": str(self.dir / "motd"), "mode": 0o644},
                   {"path": "/etc/x", "content": "x", "mode": 0o600}],
            pip={"packages": ["six==1.16.0"]}, checks={"python": ["import json"]}))
        self.assertEqual(recipe["name"], "t")
        self.assertEqual((recipe["suite"], recipe["variant"], recipe["packages"]), ("bookworm", "minbase", ["python3"]))
        self.assertEqual(recipe["pip"], ["six==1.16.0"])
        self.assertEqual(recipe["checks"], ["import json"])
        self.assertEqual(recipe["files"], [{"path": "/etc/motd", "data": b"hi\n", "mode": 0o644},
                                           {"path": "/etc/x", "data": b"x", "mode": 0o600}])
        self.assertEqual(recipe["vm"], {"vcpus": 1, "memory_mib": 512, "disk_mib": None, "network": True})
        self.assertEqual(recipe["outputs"], "/workspace/outputs")

    def test_only_checked_recipes_of_this_format_are_read(self):
        for doc in ({**checked(), "ember_recipe": build.RECIPE_FORMAT + 1}, {"recipe": {}}, []):
            with self.subTest(doc=doc):
                with self.assertRaises(build.BuildError) as ctx:
                    build.recipe_from_json(doc)
                self.assertIn("not a checked recipe", str(ctx.exception))
        path = write(self.dir, "r.json", "{")
        with self.assertRaises(build.BuildError):
            build.read_recipe_json(path)

    def test_key_ignores_warmup_but_not_packages(self):
        base = build.recipe_from_json(checked(warmup={"code": "import a"}))
        warm = build.recipe_from_json(checked(warmup={"code": "import b"}))
        more = build.recipe_from_json(checked(debian={"packages": ["python3", "curl"]}))
        self.assertEqual(build.base_key(base), build.base_key(warm))
        self.assertNotEqual(build.base_key(base), build.base_key(more))
        self.assertRegex(build.base_key(base), "^[0-9a-f]{64}$")

    def keys(self, doc: dict, drivers=None) -> tuple[str, str, str]:
        recipe = build.recipe_from_json(doc)
        agent = write(self.dir, "agent", "agent bytes")
        key1 = build.base_key(recipe)
        key2 = build.image_key(key1, agent, recipe, drivers or [])
        return key1, key2, build.template_key(key2, recipe)

    def test_image_key_rules(self):
        k1, k2, k3 = self.keys(checked())
        # disk_mib changes the image (layer 2) but not the tree (layer 1).
        d1, d2, d3 = self.keys(checked(vm={"disk_mib": 2048}))
        self.assertEqual(d1, k1)
        self.assertNotEqual(d2, k2)
        # vcpus/memory, warm-up, contexts, spare, env, outputs, description: only the template key.
        for extra in ({"vm": {"vcpus": 2, "memory_mib": 2048}},
                      {"warmup": {"code": "import numpy"}},
                      {"warmup": {"contexts": [{"id": "x", "language": "bash"}]}},
                      {"warmup": {"spare": {"bash": 1, "python": 3}}},
                      {"env": {"MPLCONFIGDIR": "/x"}},
                      {"outputs": "/out", "description": "x"}):
            with self.subTest(extra=extra):
                e1, e2, e3 = self.keys(checked(**extra))
                self.assertEqual((e1, e2), (k1, k2))
                self.assertNotEqual(e3, k3)
        # Build checks run when the tree is built: layer 1.
        c1, _, _ = self.keys(checked(checks={"python": ["import json"]}))
        self.assertNotEqual(c1, k1)

    def test_driver_files_are_hashed(self):
        src = self.dir / "python"
        self.assertEqual(build.driver_files(src), [])  # missing directory: the empty set
        src.mkdir()
        self.assertEqual(build.driver_files(src), [])
        write(src, "ember_driver.py", "print(1)\n")
        write(src, ".hidden", "x")
        write(src, "x.pyc", "x")
        write(src, "__pycache__/ember_driver.cpython-311.pyc", "x")
        files = build.driver_files(src)
        self.assertEqual([name for name, _ in files], ["ember_driver.py"])
        _, none_key, _ = self.keys(checked())
        _, one_key, _ = self.keys(checked(), files)
        self.assertNotEqual(none_key, one_key)
        write(src, "ember_driver.py", "print(2)\n")
        _, changed_key, _ = self.keys(checked(), build.driver_files(src))
        self.assertNotEqual(changed_key, one_key)
        write(src, "helper.py", "")
        _, two_key, _ = self.keys(checked(), build.driver_files(src))
        self.assertNotEqual(two_key, changed_key)

    def test_image_size(self):
        mib = 1 << 20
        size, inodes = build.image_size(300 * mib, 20000, None)
        self.assertEqual(size % (4 * mib), 0)
        self.assertGreaterEqual(size, 300 * mib + build.HEADROOM)
        self.assertEqual(inodes, 22000)
        size, inodes = build.image_size(300 * mib, 20000, 1024)
        self.assertEqual(size, 1024 * mib)
        self.assertEqual(inodes, 1024 * mib // build.BYTES_PER_INODE)
        with self.assertRaises(build.BuildError) as ctx:
            build.image_size(300 * mib, 20000, 256)
        self.assertIn("does not fit in [vm] disk_mib = 256", str(ctx.exception))

    def test_manifest_fields(self):
        recipe = build.recipe_from_json(checked(
            vm={"memory_mib": 1024, "disk_mib": 2560}, env={"MPLCONFIGDIR": "/etc/ember/matplotlib"}))
        facts = {"image_bytes": 2560 << 20, "content_bytes": 1, "label": "ember-root", "uuid": "u",
                 "agent_sha256": "a", "drivers": {"/usr/lib/ember/ember_driver.py": "d"}, "built_at": "t"}
        m = build.manifest(recipe, "k1", "k2", "k3", facts)
        self.assertEqual(m["vm"], {"vcpus": 1, "memory_mib": 1024, "network": True, "disk_mib": 2560})
        self.assertEqual(m["key"], "k3")
        self.assertEqual(m["image"], "rootfs.ext4")
        self.assertEqual(m["python_driver"], "/usr/lib/ember/ember_driver.py")
        self.assertEqual(m["user"]["uid"], 1000)
        self.assertEqual(m["outputs"], "/workspace/outputs")
        self.assertEqual(m["env"]["MPLCONFIGDIR"], "/etc/ember/matplotlib")
        self.assertEqual(m["warmup"]["spare"], {"python": 1, "bash": 1})


@unittest.skipUnless(ember_available(), "needs ember ($EMBER_BIN) or cargo to check recipes")
class CheckedRecipeTests(unittest.TestCase):
    """Recipes as ember checks them (`ember template check --json`, $EMBER_BIN or cargo run)."""

    def test_default_template_loads(self):
        recipe = build.load_recipe(build.TEMPLATES_DIR / "default.toml")
        self.assertEqual(recipe["name"], "default")
        self.assertEqual(recipe["suite"], "bookworm")
        self.assertEqual(recipe["variant"], "minbase")
        self.assertIn("python3", recipe["packages"])
        self.assertEqual(recipe["pip"], [])
        self.assertIn("python3-ipython", recipe["packages"])
        self.assertEqual(recipe["warmup"]["code"], "import json")
        self.assertEqual(recipe["warmup"]["contexts"], [{"id": "default", "language": "python"}])
        self.assertEqual(recipe["warmup"]["spare"], {"python": 1, "bash": 1})
        self.assertEqual(recipe["vm"], {"network": True, "vcpus": 1, "memory_mib": 512, "disk_mib": 1024})
        self.assertNotIn("services", recipe["warmup"])

    def test_python_data_template_loads(self):
        recipe = build.load_recipe(build.TEMPLATES_DIR / "python-data.toml")
        self.assertEqual(recipe["name"], "python-data")
        for pkg in ("python3-ipython", "python3-pandas", "python3-matplotlib", "python3-matplotlib-inline"):
            self.assertIn(pkg, recipe["packages"])
        self.assertEqual(recipe["env"]["MPLCONFIGDIR"], build.MPL_CONFIG_DIR)
        self.assertIn("savefig", recipe["warmup"]["code"])
        compile(recipe["warmup"]["code"], "warmup", "exec")

    def test_browser_template_loads(self):
        recipe = build.load_recipe(build.TEMPLATES_DIR / "browser.toml")
        self.assertEqual(recipe["name"], "browser")
        for pkg in ("chromium-headless-shell", "socat", "python3-ipython", "python3-pandas", "python3-matplotlib"):
            self.assertIn(pkg, recipe["packages"])
        names = [s["name"] for s in recipe["warmup"]["services"]]
        self.assertEqual(names, ["chromium", "cdp-relay"])
        chromium = recipe["warmup"]["services"][0]
        self.assertEqual(chromium["user"], "user")
        self.assertIn("--no-sandbox", chromium["argv"])
        self.assertIn("--remote-debugging-port=9223", chromium["argv"])
        self.assertEqual(chromium["argv"][-1], "about:blank")
        relay = recipe["warmup"]["services"][1]
        self.assertIn("TCP:127.0.0.1:9223", relay["argv"])
        self.assertEqual(relay["ready"][0], "/bin/bash")
        self.assertEqual(relay["ready_timeout_s"], 1800)
        self.assertIn("HTTP/1.1", relay["ready"][-1])

    def test_a_misspelt_key_fails_with_file_key_and_suggestion(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = write(Path(tmp), "bad.toml",
                         '[debian]\nsuite = "bookworm"\n[warmup]\nservces = []\n')
            with self.assertRaises(build.BuildError) as ctx:
                build.load_recipe(path)
        message = str(ctx.exception)
        self.assertIn(f"{path}:4", message)
        self.assertIn("unknown key `warmup.servces`: did you mean `services`?", message)



class TreeTests(unittest.TestCase):
    @unittest.skipUnless(os.geteuid() == 0, "chown to uid 1000 needs root")
    def test_add_user(self):
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp)
            write(tree, "etc/passwd", "root:x:0:0:root:/root:/bin/bash\n")
            write(tree, "etc/group", "root:x:0:\nusers:x:100:\n")
            write(tree, "etc/shadow", "root:*:19000:0:99999:7:::\n")
            write(tree, "etc/skel/.bashrc", "# bashrc\n")
            debian_tree.add_user(tree)
            self.assertIn("user:x:1000:1000::/home/user:/bin/bash\n", (tree / "etc/passwd").read_text())
            self.assertTrue((tree / "etc/group").read_text().endswith("user:x:1000:\n"))
            self.assertIn("\nuser:!:::::::\n", (tree / "etc/shadow").read_text())
            self.assertFalse((tree / "etc/gshadow").exists())
            home = (tree / "home/user").stat()
            self.assertEqual((home.st_uid, home.st_gid, home.st_mode & 0o7777), (1000, 1000, 0o755))
            self.assertEqual((tree / "home/user/.bashrc").stat().st_uid, 1000)
            for d in ("workspace", "workspace/outputs"):
                self.assertEqual((tree / d).stat().st_mode & 0o7777, 0o777)
            with self.assertRaises(build.BuildError):
                debian_tree.add_user(tree)  # twice: uid 1000 is taken


class ImageTreeTests(unittest.TestCase):
    def test_resolve_in_root_keeps_symlinks_inside_the_tree(self):
        with tempfile.TemporaryDirectory() as d:
            root = Path(d) / "tree"
            (root / "usr/sbin").mkdir(parents=True)
            os.symlink("usr/sbin", root / "sbin")
            os.symlink("/etc", root / "abs")              # absolute: the tree's /etc
            os.symlink("../../../..", root / "up")          # climbs: stops at the tree's root
            self.assertEqual(build.resolve_in_root(root, "sbin"), root / "usr/sbin")
            self.assertEqual(build.resolve_in_root(root, "abs/passwd"), root / "etc/passwd")
            self.assertEqual(build.resolve_in_root(root, "up/usr/lib/ember"), root / "usr/lib/ember")
            os.symlink("loop", root / "loop")
            with self.assertRaises(build.BuildError):
                build.resolve_in_root(root, "loop/x")

    def test_an_image_recipe_uses_the_tree_ember_unpacked(self):
        doc = checked()
        del doc["recipe"]["debian"]
        doc["image"] = {"tree_key": "k" * 64, "ref": "oci:/x", "config_digest": "sha256:" + "a" * 64}
        r = build.recipe_from_json(doc)
        self.assertEqual(build.base_key(r), "k" * 64)
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaisesRegex(build.BuildError, "ember template build"):
                build.build_base(r, "k" * 64, Path(d), False)
        with self.assertRaisesRegex(build.BuildError, "exactly one"):
            build.recipe_from_json({**checked(), "image": doc["image"]})


class HostSourcesTests(unittest.TestCase):
    def test_picks_the_suite_from_deb822_and_one_line_files(self):
        with tempfile.TemporaryDirectory() as tmp:
            apt = Path(tmp)
            write(apt, "sources.list.d/debian.sources",
                  "Types: deb deb-src\nURIs: http://archive.invalid/debian\n"
                  "Suites: bookworm bookworm-updates trixie\nComponents: main\n"
                  "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
                  "# comment\nTypes: deb\nURIs: http://other.invalid/x\nSuites: nodistro\nComponents: main\n")
            write(apt, "sources.list.d/extra.list",
                  "deb [arch=amd64] http://archive.invalid/security bookworm-security main\n"
                  "deb http://other.invalid/y stable main\n# deb http://x bookworm main\n")
            write(apt, "sources.list.d/old.list.disabled", "deb http://x bookworm main\n")
            deb822, one_line = debian_tree.host_sources("bookworm", apt)
            self.assertIn("Types: deb\n", deb822)
            self.assertIn("Suites: bookworm bookworm-updates\n", deb822)
            self.assertNotIn("nodistro", deb822)
            self.assertEqual(one_line, ["deb [arch=amd64] http://archive.invalid/security bookworm-security main"])
            with self.assertRaises(build.BuildError) as ctx:
                debian_tree.host_sources("sid", apt)
            self.assertIn("no 'deb' entry for suite 'sid'", str(ctx.exception))


class ElfTests(unittest.TestCase):
    def test_dynamic_shell_has_an_interpreter(self):
        self.assertTrue(build.has_interpreter(Path("/bin/sh").resolve()))

    def test_not_elf_is_an_error(self):
        with self.assertRaises(build.BuildError):
            build.has_interpreter(Path(__file__))


if __name__ == "__main__":
    unittest.main()
