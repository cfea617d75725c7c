#!/usr/bin/env python3
"""Reports import circles between the modules of each crate in the workspace.

A crate is a directory with a Cargo.toml and a src/ directory. Each of its targets (src/lib.rs,
src/main.rs, src/bin/*.rs, and any [lib]/[[bin]] path under src/) is read from its root file
through its `mod NAME;` declarations, so every module file is known by its module path.

An edge A -> B is an import of B by A: a path starting with `crate::`, `super::` or `self::`
(in a `use` declaration, use groups expanded, or anywhere in code; `super` resolved from the
module the path is written in, inline `mod tests { ... }` included; comments and strings are
ignored). The edge is counted between the two sibling modules under the modules' common
ancestor: `crate::snapshot::X` written in vm.rs is `vm -> snapshot`, `super::mptable::Y` in
boot/regs.rs is `boot::regs -> boot::mptable`, `crate::vm::Z` in boot/regs.rs is
`boot -> vm`. A parent's use of its own children (`mod child;`, `use self::child::X`,
`crate::parent::child::X` from the parent) is not an edge; a child's use of its parent
(`super::X`) is an edge to the parent, which can never close a circle on its own.

Strongly-connected components of more than one module are circles. Exit status 1 lists each,
with one example line per edge inside it; exit status 0 prints "no import circles in N crates".

--no-tests leaves out code under `#[cfg(test)]` (test modules, test-only imports).

Usage: check-imports.py [--no-tests] [WORKSPACE_DIR]   (default: the directory above this script's)
"""

import os
import re
import sys

try:
    import tomllib
except ImportError:  # Python < 3.11: only the conventional target paths are read.
    tomllib = None

SKIP_DIRS = {"target", "node_modules", ".git"}
PATH_ROOTS = ("crate", "super", "self")


# --- lexing ----------------------------------------------------------------------------------

IDENT_START = re.compile(r"[A-Za-z_]")
IDENT = re.compile(r"(?:r#)?[A-Za-z_][A-Za-z0-9_]*")


def tokenize(text):
    """Rust source as (kind, value, line) tokens: 'ident', 'str', 'punct' ('::' is one token).

    Comments are dropped, string/char literals become one 'str' token (value: the literal's
    contents for plain strings, which `#[path = "..."]` needs), lifetimes are dropped.
    """
    tokens = []
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if text[i] == "\n":
                        line += 1
                    i += 1
        else:
            raw = re.match(r'(?:b|c)?r(#*)"', text[i:i + 260])
            if raw:
                start_line = line
                end = '"' + raw.group(1)
                j = text.find(end, i + raw.end())
                j = n if j < 0 else j
                body = text[i + raw.end():j]
                line += body.count("\n")
                tokens.append(("str", body, start_line))
                i = j + len(end)
            elif c == '"' or (c in "bc" and text.startswith('"', i + 1)):
                start_line = line
                j = i + (1 if c == '"' else 2)
                body = []
                while j < n and text[j] != '"':
                    if text[j] == "\\":
                        body.append(text[j:j + 2])
                        j += 2
                        continue
                    body.append(text[j])
                    j += 1
                s = "".join(body)
                line += s.count("\n")
                tokens.append(("str", s, start_line))
                i = j + 1
            elif c == "'" or (c == "b" and text.startswith("'", i + 1)):
                j = i + (1 if c == "'" else 2)
                if j < n and text[j] == "\\":
                    k = text.find("'", j + 2)
                    i = n if k < 0 else k + 1
                    tokens.append(("str", "", line))
                elif j + 1 < n and text[j + 1] == "'":
                    i = j + 2
                    tokens.append(("str", "", line))
                else:  # a lifetime or a label
                    m = IDENT.match(text, j)
                    i = m.end() if m else j
            elif IDENT_START.match(c):
                m = IDENT.match(text, i)
                tokens.append(("ident", m.group(0), line))
                i = m.end()
            elif c.isdigit():
                m = re.compile(r"[0-9][0-9A-Za-z_.]*").match(text, i)
                i = m.end()
            elif text.startswith("::", i):
                tokens.append(("punct", "::", line))
                i += 2
            else:
                tokens.append(("punct", c, line))
                i += 1
    return tokens


# --- one file: its child modules and the paths it names -------------------------------------


def parse_use_tree(tokens, i, prefix, out):
    """Parses a use tree at tokens[i]; appends (segments, line) for each leaf. Returns the index
    after the tree."""
    segs = list(prefix)
    n = len(tokens)
    while i < n:
        kind, val, line = tokens[i]
        if kind == "punct" and val == "::":
            i += 1
        elif kind == "punct" and val == "{":
            i += 1
            while i < n and tokens[i][1] != "}":
                if tokens[i][1] == ",":
                    i += 1
                    continue
                i = parse_use_tree(tokens, i, segs, out)
            return i + 1
        elif kind == "punct" and val == "*":
            out.append((segs, line))
            return i + 1
        elif kind == "ident":
            segs = segs + [val]
            i += 1
            if i < n and tokens[i][1] == "::":
                continue
            if i < n and tokens[i][:2] == ("ident", "as"):
                i += 2  # `as NAME`
            out.append((segs, line))
            return i
        else:  # ',', '}' or ';': the end of this tree
            if segs != list(prefix):
                out.append((segs, line))
            return i
    return i


def parse_attribute(tokens, i):
    """Reads the attribute starting at tokens[i] ('#'). Returns (index after it, inner, body
    tokens), or None when tokens[i] does not start one."""
    n = len(tokens)
    j = i + 1
    inner = j < n and tokens[j][1] == "!"
    if inner:
        j += 1
    if not (j < n and tokens[j][1] == "["):
        return None
    depth, j, body = 1, j + 1, []
    while j < n and depth:
        v = tokens[j][1]
        if tokens[j][0] == "punct" and v == "[":
            depth += 1
        elif tokens[j][0] == "punct" and v == "]":
            depth -= 1
            if not depth:
                break
        body.append(tokens[j])
        j += 1
    return j + 1, inner, body


def is_cfg_test(body):
    """`cfg(test)`, `cfg(all(test, ...))`: code that only test builds have."""
    idents = [t[1] for t in body if t[0] == "ident"]
    return bool(idents) and idents[0] == "cfg" and "test" in idents and "not" not in idents


def scan_file(text):
    """Returns (mods, inline, paths, file_is_test) of one file.

    mods: [(inline_path, name, path_attr, test)] for each `mod NAME;` (inline_path: the inline
    modules it is written in); inline: [inline_path] for each `mod NAME { ... }`;
    paths: [(inline_path, segments, line, first_line, test)] for each path starting with
    crate/super/self (first_line: where its `use` starts); test: only in `#[cfg(test)]` code.
    """
    tokens = tokenize(text)
    mods, inline, paths = [], [], []
    stack = []  # (inline module name or None for another block, brace depth inside it, test)
    depth = 0
    path_attr, cfg_test, file_test = None, False, False
    i, n = 0, len(tokens)
    while i < n:
        kind, val, line = tokens[i]
        here = tuple(s[0] for s in stack if s[0] is not None)
        in_test = file_test or any(s[2] for s in stack)
        if kind == "punct" and val == "#":
            attr = parse_attribute(tokens, i)
            if attr is not None:
                i, inner, body = attr
                if is_cfg_test(body):
                    if inner and not stack:
                        file_test = True
                    elif not inner:
                        cfg_test = True
                elif len(body) == 3 and body[0][1] == "path" and body[2][0] == "str":
                    path_attr = body[2][1]
                continue
        if kind == "punct" and val == "{":
            depth += 1
            if cfg_test:
                stack.append((None, depth, True))
            path_attr, cfg_test = None, False
        elif kind == "punct" and val == "}":
            if stack and stack[-1][1] == depth:
                stack.pop()
            depth -= 1
            path_attr, cfg_test = None, False
        elif kind == "punct" and val == ";":
            path_attr, cfg_test = None, False
        elif kind == "ident" and val == "mod" and i + 2 < n and tokens[i + 1][0] == "ident":
            name = tokens[i + 1][1]
            if name.startswith("r#"):
                name = name[2:]
            nxt = tokens[i + 2][1]
            if nxt == ";":
                mods.append((here, name, path_attr, in_test or cfg_test))
                path_attr, cfg_test = None, False
                i += 3
                continue
            if nxt == "{":
                depth += 1
                stack.append((name, depth, cfg_test))
                inline.append(here + (name,))
                path_attr, cfg_test = None, False
                i += 3
                continue
        elif kind == "ident" and val == "use" and not (i > 0 and tokens[i - 1][1] == "::"):
            out = []
            j = i + 1
            if j < n and tokens[j][1] == "::":  # `use ::std::...`
                j += 1
            j = parse_use_tree(tokens, j, [], out)
            for segs, ln in out:
                if segs and segs[0] in PATH_ROOTS:
                    paths.append((here, segs, ln, line, in_test or cfg_test))
            i = j
            continue
        elif kind == "ident" and val in PATH_ROOTS and i + 1 < n and tokens[i + 1][1] == "::" \
                and not (i > 0 and tokens[i - 1][1] == "::"):
            segs = [val]
            j = i + 1
            while j + 1 < n and tokens[j][1] == "::" and tokens[j + 1][0] == "ident":
                segs.append(tokens[j + 1][1])
                j += 2
            paths.append((here, segs, line, line, in_test or cfg_test))
            i = j
            continue
        i += 1
    return mods, inline, paths, file_test


# --- one target: its module tree and edges ---------------------------------------------------


class Target:
    def __init__(self, crate_dir, name, root_file):
        self.crate_dir = crate_dir
        self.name = name
        self.root_file = root_file
        self.files = {}  # module path (tuple) -> file
        self.inline = {}  # inline module path -> module path of its file
        # (module path of the file, full module path, segments, file, line, first line, test)
        self.uses = []
        self.lines = {}

    def load(self):
        self._load_module((), self.root_file, is_dir_owner=True, test=False)

    def _load_module(self, modpath, path, is_dir_owner, test):
        if modpath in self.files or not os.path.isfile(path):
            return
        self.files[modpath] = path
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        self.lines[path] = text.split("\n")
        mods, inline, paths, file_test = scan_file(text)
        test = test or file_test
        for ipath in inline:
            self.inline[modpath + ipath] = modpath
        base = os.path.dirname(path) if is_dir_owner else os.path.splitext(path)[0]
        for ipath, name, attr, child_test in mods:
            child = modpath + ipath + (name,)
            child_test = test or child_test
            if attr is not None:
                d = os.path.dirname(path) if not ipath else os.path.join(base, *ipath)
                self._load_module(child, os.path.normpath(os.path.join(d, attr)),
                                  is_dir_owner=os.path.basename(attr) == "mod.rs",
                                  test=child_test)
                continue
            d = os.path.join(base, *ipath)
            flat = os.path.join(d, name + ".rs")
            nested = os.path.join(d, name, "mod.rs")
            if os.path.isfile(flat):
                self._load_module(child, flat, is_dir_owner=False, test=child_test)
            elif os.path.isfile(nested):
                self._load_module(child, nested, is_dir_owner=True, test=child_test)
        for ipath, segs, line, first, path_test in paths:
            self.uses.append((modpath, modpath + ipath, segs, path, line, first,
                              test or path_test))

    def resolve(self, here, segs):
        """The file module a path names (its longest known module prefix), or None."""
        head, rest = segs[0], segs[1:]
        if head == "crate":
            base = ()
        elif head == "self":
            base = here
        else:
            base = here[:-1] if here else None
            while rest and rest[0] == "super":
                rest = rest[1:]
                base = base[:-1] if base else None
            if base is None:
                return None
        best = base
        cur = base
        for s in rest:
            cur = cur + (s,)
            if cur in self.files or cur in self.inline:
                best = cur
            else:
                break
        while best not in self.files:
            if best in self.inline:
                best = self.inline[best]
            else:
                return None
        return best

    def edges(self, tests=True):
        """{(from, to): (file, line, first line)} between sibling modules, the first example
        of each; without `#[cfg(test)]` code unless `tests`."""
        out = {}
        for filemod, here, segs, path, line, first, test in self.uses:
            if test and not tests:
                continue
            target = self.resolve(here, segs)
            if target is None:
                continue
            edge = sibling_edge(filemod, target)
            if edge is None:
                continue
            prev = out.get(edge)
            if prev is None or (path, line) < prev[:2]:
                out[edge] = (path, line, first)
        return out


def sibling_edge(src, dst):
    """The edge an import of `dst` from `src` makes, or None (itself, or parent to child)."""
    k = 0
    while k < len(src) and k < len(dst) and src[k] == dst[k]:
        k += 1
    if k == len(src):  # dst is src or below it
        return None
    if k == len(dst):  # a child (or deeper) using an ancestor: an edge to that ancestor
        return (src[:k + 1], dst)
    return (src[:k + 1], dst[:k + 1])


def strongly_connected(nodes, edges):
    """Tarjan's algorithm; components with more than one node, each sorted."""
    graph = {v: [] for v in nodes}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(comps)


# --- the workspace ---------------------------------------------------------------------------


def find_crates(root):
    crates = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        if "Cargo.toml" in files and os.path.isdir(os.path.join(d, "src")):
            crates.append(d)
    return sorted(crates)


def crate_targets(crate_dir):
    src = os.path.join(crate_dir, "src")
    roots = {}

    def add(name, path):
        path = os.path.normpath(path)
        inside = os.path.commonpath([os.path.abspath(path), os.path.abspath(src)])
        if os.path.isfile(path) and inside == os.path.abspath(src) \
                and path not in roots.values():
            roots[name] = path

    if tomllib is not None:
        try:
            with open(os.path.join(crate_dir, "Cargo.toml"), "rb") as f:
                manifest = tomllib.load(f)
        except (OSError, ValueError):
            manifest = {}
        lib = manifest.get("lib", {})
        if "path" in lib:
            add("lib", os.path.join(crate_dir, lib["path"]))
        for b in manifest.get("bin", []):
            if "path" in b:
                add("bin " + b.get("name", b["path"]), os.path.join(crate_dir, b["path"]))
    add("lib", os.path.join(src, "lib.rs"))
    add("bin", os.path.join(src, "main.rs"))
    bindir = os.path.join(src, "bin")
    if os.path.isdir(bindir):
        for e in sorted(os.listdir(bindir)):
            p = os.path.join(bindir, e)
            if e.endswith(".rs"):
                add("bin " + e[:-3], p)
            elif os.path.isfile(os.path.join(p, "main.rs")):
                add("bin " + e, os.path.join(p, "main.rs"))
    return [Target(crate_dir, name, path) for name, path in roots.items()]


def modname(m):
    return "::".join(m) if m else "crate"


def check(root, tests=True):
    """Returns (number of crates, [report lines per circle])."""
    crates = find_crates(root)
    circles = []
    for crate_dir in crates:
        rel = os.path.relpath(crate_dir, root)
        for t in crate_targets(crate_dir):
            t.load()
            edges = t.edges(tests)
            for comp in strongly_connected(t.files.keys(), edges.keys()):
                members = set(comp)
                lines = ["{} ({}): import circle between {}".format(
                    rel, t.name, ", ".join(modname(m) for m in comp))]
                for (a, b), (path, line, first) in sorted(edges.items()):
                    if a in members and b in members:
                        text = t.lines[path][line - 1].strip()
                        if first != line:  # a `use` over several lines: show where it starts
                            text = "{} ... {}".format(t.lines[path][first - 1].strip(), text)
                        lines.append("  {} -> {}: {}:{}: {}".format(
                            modname(a), modname(b), os.path.relpath(path, root), line, text))
                circles.append(lines)
    return len(crates), circles


def main(argv):
    args = argv[1:]
    tests = "--no-tests" not in args
    args = [a for a in args if a != "--no-tests"]
    if any(a.startswith("-") for a in args) or len(args) > 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.normpath(args[0] if args else os.path.join(here, ".."))
    n, circles = check(root, tests)
    if circles:
        for lines in circles:
            print("\n".join(lines))
        print("{} import circle(s) in {} crates".format(len(circles), n))
        return 1
    print("no import circles in {} crates".format(n))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
