"""Unit tests of rootfs/build.py that need neither root nor the network.

Run: python3 -m unittest discover -s rootfs -p 'test_*.py'
"""

import os
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import build  # noqa: E402


def write(dir_: Path, name: str, text: str) -> Path:
    path = dir_ / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


MINIMAL = '[debian]\nsuite = "bookworm"\npackages = ["python3"]\n'


class RecipeTests(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

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

    def test_services_are_left_out_when_none(self):
        recipe = build.load_recipe(write(self.dir, "t.toml", MINIMAL))
        self.assertNotIn("services", recipe["warmup"])
        text = MINIMAL + '[[warmup.services]]\nname = "s"\nargv = ["/bin/sleep", "1"]\nenv = { A = "b" }\n'
        recipe = build.load_recipe(write(self.dir, "s.toml", text))
        self.assertEqual(recipe["warmup"]["services"], [
            {"name": "s", "argv": ["/bin/sleep", "1"], "env": {"A": "b"}, "user": "root", "ready_timeout_s": 300},
        ])

    def test_new_sections_default(self):
        recipe = build.load_recipe(write(self.dir, "t.toml", MINIMAL))
        self.assertEqual(recipe["vm"], {"network": True, "vcpus": 1, "memory_mib": 512, "disk_mib": None})
        self.assertEqual(recipe["warmup"], {"code": "", "contexts": [{"id": "default", "language": "python"}],
                                            "spare": {"python": 1, "bash": 1}})
        self.assertEqual(recipe["env"], {})
        self.assertEqual(recipe["outputs"], "/workspace/outputs")
        self.assertEqual(recipe["checks"], [])

    def test_new_sections_parse(self):
        text = ('outputs = "/workspace//out/"\n' + MINIMAL +
                '[vm]\nvcpus = 2\nmemory_mib = 1024\ndisk_mib = 900\n'
                '[warmup]\ncode = "import os"\nspare = { bash = 0 }\n'
                'contexts = [{ id = "default" }, { id = "sh", language = "bash", cwd = "/tmp", env = { A = "1" } }]\n'
                '[env]\nMPLCONFIGDIR = "/etc/ember/matplotlib"\nB = ""\n'
                '[checks]\npython = ["import json"]\n')
        recipe = build.load_recipe(write(self.dir, "t.toml", text))
        self.assertEqual(recipe["outputs"], "/workspace/out")
        self.assertEqual(recipe["vm"], {"network": True, "vcpus": 2, "memory_mib": 1024, "disk_mib": 900})
        self.assertEqual(recipe["warmup"]["contexts"], [
            {"id": "default", "language": "python"},
            {"id": "sh", "language": "bash", "cwd": "/tmp", "env": {"A": "1"}}])
        self.assertEqual(recipe["warmup"]["spare"], {"python": 1, "bash": 0})
        self.assertEqual(recipe["env"], {"B": "", "MPLCONFIGDIR": "/etc/ember/matplotlib"})
        self.assertEqual(recipe["checks"], ["import json"])

    def test_defaults_and_files(self):
        write(self.dir, "motd", "hi\n")
        path = write(self.dir, "t.toml", MINIMAL + '[[files]]\npath = "/etc/motd"\nsource = "motd"\n'
                     '[[files]]\npath = "/etc/x"\ncontent = "x"\nmode = "0600"\n')
        recipe = build.load_recipe(path)
        self.assertEqual(recipe["name"], "t")
        self.assertEqual(recipe["files"][0], {"path": "/etc/motd", "data": b"hi\n", "mode": 0o644})
        self.assertEqual(recipe["files"][1]["mode"], 0o600)

    def test_schema_errors_are_clear(self):
        cases = {
            "[debian]\nsuite = \"bookworm\"\npackage = [\"x\"]\n": "unknown key(s) package",
            "[debian]\npackages = []\n": "suite must be",
            MINIMAL + "[pip]\npackages = [\"--index-url=x\"]\n": "options are not allowed",
            MINIMAL + "[[files]]\npath = \"etc/x\"\ncontent = \"\"\n": "absolute path",
            MINIMAL + "[[files]]\npath = \"/x\"\ncontent = \"\"\nmode = \"rw\"\n": "octal",
            MINIMAL + "[[files]]\npath = \"/x\"\n": "exactly one of content",
            MINIMAL + "[warmup]\ncode = 1\n": "code must be a string",
            MINIMAL + "[warmup]\ncod = \"x\"\n": "unknown key(s) cod",
            MINIMAL + "[warmup]\ncontexts = [{ id = \"a\", lang = \"python\" }]\n": "unknown key(s) lang",
            MINIMAL + "[warmup]\ncontexts = [{ language = \"python\" }]\n": "id must be",
            MINIMAL + "[warmup]\ncontexts = [{ id = \"a\", language = \"ruby\" }]\n": "language must be one of",
            MINIMAL + "[warmup]\ncontexts = [{ id = \"a\" }, { id = \"a\" }]\n": "duplicate context id",
            MINIMAL + "[warmup]\ncontexts = \"default\"\n": "contexts must be a list",
            MINIMAL + "[warmup]\nspare = { ruby = 1 }\n": "unknown key(s) ruby",
            MINIMAL + "[warmup]\nspare = { python = -1 }\n": "python must be an integer",
            MINIMAL + "[[warmup.services]]\nname = \"s\"\n": "argv (the program and its arguments) is required",
            MINIMAL + "[[warmup.services]]\nname = \"s\"\nargv = []\n": "argv must be a non-empty list",
            MINIMAL + "[[warmup.services]]\nname = \"a b\"\nargv = [\"x\"]\n": "name must be",
            MINIMAL + "[[warmup.services]]\nname = \"s\"\nargv = [\"x\"]\nuser = \"nobody\"\n": "user must be",
            MINIMAL + "[[warmup.services]]\nname = \"s\"\nargv = [\"x\"]\nready = \"x\"\n": "ready must be a non-empty list",
            MINIMAL + "[[warmup.services]]\nname = \"s\"\nargv = [\"x\"]\nport = 1\n": "unknown key(s) port",
            MINIMAL + "[[warmup.services]]\nname = \"s\"\nargv = [\"x\"]\nready_timeout_s = 0\n": "ready_timeout_s must be",
            MINIMAL + "[[warmup.services]]\nname = \"s\"\nargv = [\"x\"]\n[[warmup.services]]\nname = \"s\"\nargv = [\"y\"]\n": "duplicate service name",
            MINIMAL + "[vm]\ncpus = 2\n": "unknown key(s) cpus",
            MINIMAL + "[vm]\nvcpus = 0\n": "vcpus must be an integer",
            MINIMAL + "[vm]\nvcpus = true\n": "vcpus must be an integer",
            MINIMAL + "[vm]\nmemory_mib = \"512\"\n": "memory_mib must be an integer",
            MINIMAL + "[vm]\ndisk_mib = 1.5\n": "disk_mib must be an integer",
            MINIMAL + "[vm]\nnetwork = 1\n": "network must be true or false",
            MINIMAL + "[env]\n\"A-B\" = \"x\"\n": "not an environment variable name",
            MINIMAL + "[env]\nA = 1\n": "A must be a string",
            MINIMAL + "[checks]\npython = \"import x\"\n": "must be a list",
            MINIMAL + "[checks]\nimports = []\n": "unknown key(s) imports",
            "outputs = \"out\"\n" + MINIMAL: "outputs must be an absolute guest path",
            "env = 1\n" + MINIMAL: "[env] must be a table",
            "vm = 1\n" + MINIMAL: "[vm] must be a table",
            "extra = 1\n" + MINIMAL: "unknown key(s) extra",
            "name = \"a b\"\n" + MINIMAL: "name",
            "[debian\n": "not valid TOML",
        }
        for text, message in cases.items():
            with self.subTest(text=text):
                with self.assertRaises(build.BuildError) as ctx:
                    build.load_recipe(write(self.dir, "bad.toml", text))
                self.assertIn(message, str(ctx.exception))

    def test_key_ignores_warmup_but_not_packages(self):
        base = build.load_recipe(write(self.dir, "a.toml", MINIMAL + '[warmup]\ncode = "import a"\n'))
        warm = build.load_recipe(write(self.dir, "b.toml", MINIMAL + '[warmup]\ncode = "import b"\n'))
        more = build.load_recipe(write(self.dir, "c.toml", MINIMAL.replace('"python3"', '"python3", "curl"')))
        self.assertEqual(build.base_key(base), build.base_key(warm))
        self.assertNotEqual(build.base_key(base), build.base_key(more))
        self.assertRegex(build.base_key(base), "^[0-9a-f]{64}$")

    def keys(self, text: str, drivers=None) -> tuple[str, str, str]:
        recipe = build.load_recipe(write(self.dir, "k.toml", text))
        agent = write(self.dir, "agent", "agent bytes")
        key1 = build.base_key(recipe)
        key2 = build.image_key(key1, agent, recipe, drivers or [])
        return key1, key2, build.template_key(key2, recipe)

    def test_image_key_rules(self):
        k1, k2, k3 = self.keys(MINIMAL)
        # disk_mib changes the image (layer 2) but not the tree (layer 1).
        d1, d2, d3 = self.keys(MINIMAL + "[vm]\ndisk_mib = 2048\n")
        self.assertEqual(d1, k1)
        self.assertNotEqual(d2, k2)
        # vcpus/memory, warm-up, contexts, spare, env, outputs, description: only the template key.
        for extra in ('[vm]\nvcpus = 2\nmemory_mib = 2048\n',
                      '[warmup]\ncode = "import numpy"\n',
                      '[warmup]\ncontexts = [{ id = "x", language = "bash" }]\n',
                      '[warmup]\nspare = { python = 3 }\n',
                      '[env]\nMPLCONFIGDIR = "/x"\n'):
            with self.subTest(extra=extra):
                e1, e2, e3 = self.keys(MINIMAL + extra)
                self.assertEqual((e1, e2), (k1, k2))
                self.assertNotEqual(e3, k3)
        o1, o2, o3 = self.keys('outputs = "/out"\ndescription = "x"\n' + MINIMAL)
        self.assertEqual((o1, o2), (k1, k2))
        self.assertNotEqual(o3, k3)
        # Build checks run when the tree is built: layer 1.
        c1, _, _ = self.keys(MINIMAL + '[checks]\npython = ["import json"]\n')
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
        _, none_key, _ = self.keys(MINIMAL)
        _, one_key, _ = self.keys(MINIMAL, files)
        self.assertNotEqual(none_key, one_key)
        write(src, "ember_driver.py", "print(2)\n")
        _, changed_key, _ = self.keys(MINIMAL, build.driver_files(src))
        self.assertNotEqual(changed_key, one_key)
        write(src, "helper.py", "")
        _, two_key, _ = self.keys(MINIMAL, build.driver_files(src))
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
        recipe = build.load_recipe(build.TEMPLATES_DIR / "python-data.toml")
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


class TreeTests(unittest.TestCase):
    @unittest.skipUnless(os.geteuid() == 0, "chown to uid 1000 needs root")
    def test_add_user(self):
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp)
            write(tree, "etc/passwd", "root:x:0:0:root:/root:/bin/bash\n")
            write(tree, "etc/group", "root:x:0:\nusers:x:100:\n")
            write(tree, "etc/shadow", "root:*:19000:0:99999:7:::\n")
            write(tree, "etc/skel/.bashrc", "# bashrc\n")
            build.add_user(tree)
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
                build.add_user(tree)  # twice: uid 1000 is taken


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
            deb822, one_line = build.host_sources("bookworm", apt)
            self.assertIn("Types: deb\n", deb822)
            self.assertIn("Suites: bookworm bookworm-updates\n", deb822)
            self.assertNotIn("nodistro", deb822)
            self.assertEqual(one_line, ["deb [arch=amd64] http://archive.invalid/security bookworm-security main"])
            with self.assertRaises(build.BuildError) as ctx:
                build.host_sources("sid", apt)
            self.assertIn("no 'deb' entry for suite 'sid'", str(ctx.exception))


class ElfTests(unittest.TestCase):
    def test_dynamic_shell_has_an_interpreter(self):
        self.assertTrue(build.has_interpreter(Path("/bin/sh").resolve()))

    def test_not_elf_is_an_error(self):
        with self.assertRaises(build.BuildError):
            build.has_interpreter(Path(__file__))


if __name__ == "__main__":
    unittest.main()
