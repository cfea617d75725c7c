"""Unit tests of rootfs/build.py that need neither root nor the network.

Run: python3 -m unittest discover -s rootfs -p 'test_*.py'
"""

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
        self.assertEqual(recipe["warmup"], "import json")

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
