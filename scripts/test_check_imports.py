"""Tests for check-imports.py: tiny fake crates in a temporary directory.

Run: python3 -m unittest discover -s scripts -p 'test_check_imports.py'
"""

import importlib.util
import io
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

sys.dont_write_bytecode = True
_spec = importlib.util.spec_from_file_location(
    "check_imports", os.path.join(os.path.dirname(os.path.abspath(__file__)), "check-imports.py"))
check_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_imports)


class FakeWorkspace:
    """A workspace directory with crates made of the given files."""

    def __init__(self, crates):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = self.tmp.name
        with open(os.path.join(self.root, "Cargo.toml"), "w") as f:
            f.write('[workspace]\nmembers = [{}]\n'.format(
                ", ".join('"{}"'.format(c) for c in crates)))
        for crate, files in crates.items():
            with open(self.write(crate, "Cargo.toml"), "w") as f:
                f.write('[package]\nname = "{}"\nversion = "0.1.0"\n'.format(
                    crate.replace("/", "-")))
            for path, text in files.items():
                with open(self.write(crate, "src", path), "w") as f:
                    f.write(text)

    def write(self, *parts):
        path = os.path.join(self.root, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def run(self, *flags):
        out = io.StringIO()
        with redirect_stdout(out):
            code = check_imports.main(["check-imports.py", *flags, self.root])
        return code, out.getvalue()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.tmp.cleanup()


LIB = "pub mod builder;\npub mod persist;\npub mod vm;\n"


class CheckImportsTest(unittest.TestCase):
    def test_one_way_dependencies_pass(self):
        files = {
            "lib.rs": LIB,
            "vm.rs": "//! Uses [`crate::builder`] in docs only.\nuse crate::persist;\n"
                     "pub struct Vm;\nfn f() { let s = \"crate::builder::x\"; }\n",
            "persist.rs": "pub fn write() {}\n/* crate::vm::Vm in a comment */\n",
            "builder.rs": "use crate::{persist::write, vm::{self, Vm}};\n",
        }
        with FakeWorkspace({"a": files, "b": {"lib.rs": "pub mod x;\n", "x.rs": ""}}) as ws:
            code, out = ws.run()
        self.assertEqual(code, 0, out)
        self.assertEqual(out.strip(), "no import circles in 2 crates")

    def test_circle_between_siblings_is_reported_with_an_example_per_edge(self):
        files = {
            "lib.rs": LIB,
            "vm.rs": "use crate::persist::write;\npub struct Vm;\n",
            "persist.rs": "pub fn write() {}\nfn g() {\n    crate::builder::build();\n}\n",
            "builder.rs": "pub fn build() -> super::vm::Vm { todo!() }\n",
        }
        with FakeWorkspace({"a": files}) as ws:
            code, out = ws.run()
        self.assertEqual(code, 1, out)
        self.assertIn("a (lib): import circle between builder, persist, vm", out)
        self.assertIn("vm -> persist: a/src/vm.rs:1: use crate::persist::write;", out)
        self.assertIn("persist -> builder: a/src/persist.rs:3: crate::builder::build();", out)
        self.assertIn("builder -> vm: a/src/builder.rs:1: pub fn build() -> super::vm::Vm", out)

    def test_parent_and_children_are_not_a_circle(self):
        files = {
            "lib.rs": "pub mod boot;\npub use boot::load;\n",
            "boot/mod.rs": "pub mod regs;\nuse self::regs::setup;\n"
                           "pub fn load() { regs::setup(); crate::boot::regs::setup(); }\n",
            "boot/regs.rs": "use super::load;\npub fn setup() { super::super::boot::load(); }\n",
        }
        with FakeWorkspace({"a": files}) as ws:
            code, out = ws.run()
        self.assertEqual(code, 0, out)

    def test_inline_test_module_super_is_its_own_file(self):
        files = {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "pub fn f() {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n"
                    "    #[test]\n    fn t() { f(); }\n}\n",
            "b.rs": "use crate::a::f;\n",
        }
        with FakeWorkspace({"a": files}) as ws:
            code, out = ws.run()
        self.assertEqual(code, 0, out)

    def test_nested_siblings_and_children_of_non_mod_rs_files(self):
        files = {
            "lib.rs": "mod net;\n",
            "net.rs": "mod tap;\nmod route;\n",
            "net/tap.rs": "use super::route::Route;\n",
            "net/route.rs": "pub struct Route;\nfn f() { super::tap::open(); }\n",
        }
        with FakeWorkspace({"a": files}) as ws:
            code, out = ws.run()
        self.assertEqual(code, 1, out)
        self.assertIn("import circle between net::route, net::tap", out)

    def test_a_child_using_another_top_level_module_counts_as_its_parent(self):
        files = {
            "lib.rs": "mod boot;\nmod vm;\n",
            "boot/mod.rs": "mod regs;\n",
            "boot/regs.rs": "use crate::vm::Vm;\n",
            "vm.rs": "pub struct Vm;\nfn f() { crate::boot::regs::x(); }\n",
        }
        with FakeWorkspace({"a": files}) as ws:
            code, out = ws.run()
        self.assertEqual(code, 1, out)
        self.assertIn("import circle between boot, vm", out)
        self.assertIn("boot -> vm: a/src/boot/regs.rs:1:", out)

    def test_binary_and_library_are_separate_targets(self):
        files = {
            "lib.rs": "pub mod x;\npub mod y;\n",
            "x.rs": "use crate::y::Y;\npub struct X;\n",
            "y.rs": "pub struct Y;\n",
            # The binary's own `x`/`y` would form a circle; the library's do not.
            "main.rs": "mod x2;\nmod y2;\nfn main() {}\n",
            "x2.rs": "use crate::y2::Y;\n",
            "y2.rs": "pub struct Y;\nuse crate::x2 as other;\n",
        }
        with FakeWorkspace({"a": files}) as ws:
            code, out = ws.run()
        self.assertEqual(code, 1, out)
        self.assertIn("a (bin): import circle between x2, y2", out)
        self.assertNotIn("(lib)", out)

    def test_no_tests_leaves_out_test_only_imports(self):
        files = {
            "lib.rs": "mod client;\nmod server;\n#[cfg(test)]\nmod testing;\n",
            "client.rs": "pub struct Client;\n#[cfg(test)]\nmod tests {\n"
                         "    use crate::server::Server;\n}\n",
            "server.rs": "use crate::client::Client;\npub struct Server;\n"
                         "#[cfg(test)]\nuse crate::testing::fake;\n",
            "testing.rs": "use crate::server::Server;\npub fn fake() {}\n",
        }
        with FakeWorkspace({"a": files}) as ws:
            code, out = ws.run()
            self.assertEqual(code, 1, out)
            self.assertIn("import circle between client, server, testing", out)
            self.assertIn("client -> server: a/src/client.rs:4:", out)
            code, out = ws.run("--no-tests")
        self.assertEqual(code, 0, out)

    def test_strings_lifetimes_and_raw_strings_do_not_confuse_the_lexer(self):
        files = {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "fn f<'x>(s: &'x str) -> char { let _ = r#\"crate::b::\"#; 'c' }\n"
                    "fn g() -> u8 { b'\\'' }\nfn h() { let _ = \"\\\"crate::b::x\"; }\n",
            "b.rs": "use crate::a;\n",
        }
        with FakeWorkspace({"a": files}) as ws:
            code, out = ws.run()
        self.assertEqual(code, 0, out)


if __name__ == "__main__":
    unittest.main()
