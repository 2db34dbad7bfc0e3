#!/usr/bin/env python3
"""Fails when files of one crate import each other in a circle (issue 45).

    python3 .ci/import_circles.py [--graph] [CRATE_SRC_DIR ...]

A file depends on the files that *define* what it names: every `use` path and every path written
out in the code (`crate::x::Y`, `super::Y`, `self::m::Y`, a child module's name), resolved to the
file that defines the item, following re-exports (`pub use`, `pub(crate) use`, globs among them)
to the definition. A re-export itself is no dependency (a `mod.rs` that only re-exports depends on
nothing), nor is a `mod` declaration; a test module inside a file belongs to that file. Paths into
other crates are not followed. Comments, doc comments and string literals are not read.

A circle is a strongly connected set of two or more files; each is printed with the names that
close it, and the exit status is 1. `--graph` prints every file's dependencies as well;
`--layers` prints the files by layer (0: a file that depends on no other file of its crate; n: one
whose dependencies are all below n).
Without arguments it checks every crate of the workspace.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = ["src", "cli/src", "cluster/src", "bench-drivers/src", "testkit/src"]

ITEM = re.compile(
    r"\b(?:fn|struct|enum|trait|type|const|static|union)\s+([A-Za-z_]\w*)|\bmacro_rules!\s*([A-Za-z_]\w*)"
)
INLINE_MOD = re.compile(r"\bmod\s+([A-Za-z_]\w*)\s*\{")
USE = re.compile(r"\b((?:pub(?:\s*\([^)]*\))?\s+)?)use\s+([^;]+);")
PATH = re.compile(r"(?<![\w:])((?:crate|super|self|[a-z_]\w*)(?:\s*::\s*(?:[A-Za-z_]\w*|\*))+)")
KEYWORDS = {"std", "core", "alloc"}


def strip(text):
    """The source with comments, string and char literals blanked out (offsets kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1]))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or re.match(r"'\\[xu][^']*'", text[i:i + 12]):
            m = re.match(r"'(\\[xu][^']*|\\.|[^\\'])'", text[i:])
            out.append(" " * len(m.group(0)))
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand(tree):
    """`a::{b, c::{d, *}}` as the paths [a, b], [a, c, d], [a, c, *]; `x as y` keeps x."""
    tree = re.sub(r"\s+", " ", tree).strip()
    paths = []

    def walk(prefix, s):
        s = s.strip()
        if not s:
            return
        brace = s.find("{")
        if brace < 0:
            s = re.sub(r"\s+as\s+\w+$", "", s)
            paths.append(prefix + [p.strip() for p in s.split("::") if p.strip()])
            return
        head = [p.strip() for p in s[:brace].split("::") if p.strip()]
        inner = s[brace + 1:s.rfind("}")]
        depth, start = 0, 0
        for k, ch in enumerate(inner + ","):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                part = inner[start:k].strip()
                if part == "self":
                    paths.append(prefix + head)
                elif part:
                    walk(prefix + head, part)
                start = k + 1

    walk([], tree)
    return paths


class Crate:
    def __init__(self, src):
        self.src = src
        self.files = {}  # module path (tuple) -> file
        for dirpath, _, names in os.walk(src):
            for name in names:
                if not name.endswith(".rs"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, src)[:-3].split(os.sep)
                if rel[-1] == "mod" or (len(rel) == 1 and rel[0] in ("lib", "main")):
                    rel = rel[:-1]
                if len(rel) == 1 and rel[0] in ("lib", "main"):
                    rel = []
                module = tuple(rel)
                if module in self.files:
                    continue  # lib.rs beside main.rs: the library is the crate
                self.files[module] = path
        self.text = {}
        self.items = {}  # file -> names defined there (inline modules included, by their path)
        self.inline = {}  # file -> [(start, end, module path)]
        self.reexports = {}  # file -> [(module path of the statement, path)]
        self.uses = {}  # file -> [(module path, path, position)]
        for module, path in self.files.items():
            self.read(module, path)

    def read(self, module, path):
        text = strip(open(path, encoding="utf-8").read())
        self.text[path] = text
        # inline modules: their brace ranges
        spans = []
        for m in INLINE_MOD.finditer(text):
            depth, j = 0, m.end() - 1
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            spans.append((m.end(), j, m.group(1)))

        def module_at(pos):
            inner = [s for s in spans if s[0] <= pos < s[1]]
            inner.sort()
            return tuple(module) + tuple(s[2] for s in inner)

        self.inline[path] = [(s, e, module_at(s - 1) + (name,)) for s, e, name in spans]
        items = set()
        for m in ITEM.finditer(text):
            items.add((module_at(m.start()), m.group(1) or m.group(2)))
        for s, e, name in spans:
            items.add((module_at(s - 1), name))
        self.items[path] = items
        self.reexports[path] = []
        self.uses[path] = []
        taken = []
        for m in USE.finditer(text):
            taken.append((m.start(), m.end()))
            at = module_at(m.start())
            for p in expand(m.group(2)):
                if m.group(1).strip():
                    self.reexports[path].append((at, p))
                else:
                    self.uses[path].append((at, p, m.start()))
        for m in PATH.finditer(text):
            if any(s <= m.start() < e for s, e in taken):
                continue
            p = [s.strip() for s in m.group(1).split("::")]
            self.uses[path].append((module_at(m.start()), p, m.start()))

    def file_of(self, module):
        """The file a module (perhaps inline) lives in."""
        module = tuple(module)
        while module not in self.files:
            if not module:
                return None
            module = module[:-1]
        return self.files[module]

    def is_module(self, module):
        module = tuple(module)
        if module in self.files:
            return True
        f = self.file_of(module)
        return f is not None and any(m == module for _, _, m in self.inline[f])

    def absolute(self, at, path):
        """`path` written in module `at` as an absolute module path plus the rest, or None."""
        path = list(path)
        if not path:
            return None
        head = path[0]
        if head == "crate":
            return [] + path[1:]
        if head in ("super", "self"):
            base = list(at)
            while path and path[0] in ("super", "self"):
                if path[0] == "super":
                    if not base:
                        return None
                    base = base[:-1]
                path = path[1:]
            return base + path
        if head in KEYWORDS:
            return None
        # a name in scope: a child module, or an item of this module (uniform paths)
        if self.is_module(list(at) + [head]):
            return list(at) + path
        return None

    def definers(self, at, path, seen=None, strict=False):
        """The files that define what `path` (written in module `at`) names (`strict`: only
        where it is found defined; otherwise the module's file when it is not)."""
        seen = seen or set()
        key = (tuple(at), tuple(path))
        if key in seen:
            return set()
        seen.add(key)
        full = self.absolute(at, path)
        if full is None:
            return set()
        # the longest prefix that is a module
        k = len(full)
        while k > 0 and not self.is_module(full[:k]):
            k -= 1
        module, rest = tuple(full[:k]), full[k:]
        f = self.file_of(module)
        if f is None:
            return set()
        if not rest or rest == ["*"]:
            return {f}
        name = rest[0]
        if (module, name) in self.items[f]:
            return {f}
        # re-exported: follow it to where it is defined
        found = set()
        for rat, rpath in self.reexports[f]:
            if rat != module:
                continue
            if rpath[-1] == name:
                found |= self.definers(rat, rpath, seen)
            elif rpath[-1] == "*":
                target = self.absolute(rat, rpath[:-1])
                if target is not None:
                    found |= self.definers([], target + [name], seen, strict=True)
        return found or (set() if strict else {f})

    def graph(self):
        edges = {f: {} for f in self.files.values()}
        for f, uses in self.uses.items():
            for at, path, _ in uses:
                for d in self.definers(at, path):
                    if d != f:
                        edges[f].setdefault(d, set()).add("::".join(path))
        return edges


def circles(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main(argv):
    show = "--graph" in argv
    layers = "--layers" in argv
    dirs = [a for a in argv if not a.startswith("--")] or [os.path.join(ROOT, c) for c in CRATES]
    failed = False
    for src in dirs:
        crate = Crate(src)
        edges = crate.graph()
        rel = lambda f: os.path.relpath(f, ROOT)
        if show:
            for f in sorted(edges):
                print(f"{rel(f)}: {', '.join(sorted(rel(d) for d in edges[f]))}")
        comps = circles(edges)
        if layers and not comps:
            height = {}

            def h(f):
                if f not in height:
                    height[f] = 1 + max((h(d) for d in edges[f]), default=-1)
                return height[f]

            by = {}
            for f in edges:
                by.setdefault(h(f), []).append(rel(f))
            for n in sorted(by):
                print(f"{rel(src)} layer {n}: {', '.join(sorted(by[n]))}")
        for comp in comps:
            failed = True
            members = set(comp)
            print(f"import circle in {rel(src)}: {', '.join(rel(f) for f in comp)}")
            for f in comp:
                for d, names in sorted(edges[f].items()):
                    if d in members:
                        print(f"  {rel(f)} -> {rel(d)}: {', '.join(sorted(names))}")
    if failed:
        print("files of one crate import each other in a circle: see .ci/import_circles.py and CONTRIBUTING.md")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
