#!/usr/bin/env python3
"""Keep the docs true: every code anchor in the markdown must name real code.

Usage: ``python scripts/check_docs.py [--coverage] [--root DIR] [--package NAME]``

Scanned files: ``docs/**/*.md`` and every top-level ``*.md`` (``README.md`` included). Fenced
code blocks (```` ``` ```` / ``~~~``) are skipped: they hold commands, output and tracebacks.

Anchor grammar (only inside inline backtick code spans, the whole span being the anchor)::

    anchor  := path [ ":" symbol | "::" test ]   e.g. `dgemma/models/masks.py:causal_mask`
    path    := repo-root-relative file ending in ".py"  (no "..", no leading "/")
    symbol  := NAME { "." NAME } [ "()" ]        e.g. `dgemma/models/kv_cache.py:KVCache.truncate`
    test    := NAME { "::" NAME } [ "[" ... "]" ]  a pytest node id, resolved like a symbol

The placeholders ``path/file.py`` and ``path/to/file.py`` (to show the syntax itself) are never
anchors. A bare ``path`` anchor needs a ``/`` (``dir/file.py``; a lone ``__init__.py`` is prose)
and the file must exist. Symbols are resolved with ``ast`` (nothing is imported or executed):

* module level: ``def``/``async def``/``class`` and names bound by assignment (plain,
  annotated, tuple targets), also inside module-level ``if``/``try``/``with`` blocks.
  Names bound by ``import``/``from x import y`` are *not* definitions: cite the defining module
  (the error says where the name comes from).
* ``Class.member``: methods, nested classes, class-level assignments and dataclass fields, and
  ``self.attr`` assigned in ``__init__``/``__post_init__``; nests (``Outer.Inner.method``).
  Functions have no members.

Line-number citations are errors anywhere outside fenced blocks: ``file.py:123``,
``file.py#L12``, ``file.py, line 40``, ``line 40 of file.py``. Cite a symbol instead.

``--coverage`` also fails on every public symbol cited by no ``path:Symbol`` anchor. Public means:
a function or class defined at module level in ``<package>/**/*.py`` whose name does not start
with ``_``; if the module defines a literal ``__all__``, only names listed there. Re-exports (e.g.
in ``__init__.py``) are imports, so they count at their defining module only; constants may be
cited but are never required; ``cli/`` modules get no special case (their ``run``/``main`` are the
documented entry points, helpers are ``_private``). Citing ``Class.method`` covers ``Class``.

Problems print as ``FILE:LINE: message`` (the markdown's own line); exit status 1 on any.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from pathlib import Path

SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")
ANCHOR = re.compile(r"^(?P<path>[\w./-]+\.py)(?:(?P<sep>::?)(?P<sym>.*))?$")
SYMBOL = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?$")
TEST_ID = re.compile(r"^[A-Za-z_]\w*(?:::[A-Za-z_]\w*)*(?:\[.*\])?$")
LINE_CITE = re.compile(  # file.py:12  file.py#L12  file.py, line 12  (line 12)  line 12 of file.py
    r"[\w./-]+\.py(?::\d+|#L\d+|[\"'`)]*[,\s]\s*\(?(?:(?i:lines?)|L)\s*\d+)"
    r"|\b(?i:lines?)\s+\d+(?:\s*[-–]\s*\d+)?\s+(?:of|in)\s+`?[\w./-]+\.py"
)
PLACEHOLDERS = {"path/file.py", "path/to/file.py"}
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


class Scope:
    """Names defined in a module or class body: name -> child Scope (class, or a memberless
    "function") or None (assigned names); ``imports`` maps imported names to their module."""

    def __init__(self, kind: str):
        self.kind, self.names, self.imports = kind, {}, {}

    def define(self, name: str, child: "Scope | None" = None) -> None:
        if name not in self.names or child is not None:
            self.names[name] = child


def _targets(node: ast.AST):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


def _self_attrs(func: ast.FunctionDef):
    """Names ``x`` of every ``self.x = ...`` / ``self.x: T = ...`` inside ``func``."""
    for sub in ast.walk(func):
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        else:
            continue
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                    yield n.attr


def _collect(body: list[ast.stmt], scope: Scope) -> Scope:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope.define(node.name, Scope("function"))
            if scope.kind == "class" and node.name in ("__init__", "__post_init__"):
                for attr in _self_attrs(node):
                    scope.define(attr)
        elif isinstance(node, ast.ClassDef):
            scope.define(node.name, _collect(node.body, Scope("class")))
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for name in _targets(t):
                    scope.define(name)
        elif isinstance(node, ast.AnnAssign):
            for name in _targets(node.target):
                scope.define(name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                origin = getattr(node, "module", None) or a.name
                scope.imports[(a.asname or a.name).split(".")[0]] = origin
        elif isinstance(node, (ast.If, ast.Try, ast.With)) and scope.kind == "module":
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                _collect(block, scope)
            for handler in getattr(node, "handlers", []):
                _collect(handler.body, scope)
    return scope


class Checker:
    def __init__(self, root: Path):
        self.root, self.modules, self.cited = root, {}, set()
        self.errors: list[str] = []
        self.anchors = 0

    def module(self, rel: str) -> "Scope | str":
        if rel not in self.modules:
            path = self.root / rel
            try:
                self.modules[rel] = _collect(ast.parse(path.read_text(), str(path)).body, Scope("module"))
            except SyntaxError as e:
                self.modules[rel] = f"{rel} does not parse: {e.msg} (line {e.lineno})"
        return self.modules[rel]

    def resolve(self, rel: str, dotted: str) -> "str | None":
        """Return an error message, or None when ``dotted`` names a definition in ``rel``."""
        scope = self.module(rel)
        if isinstance(scope, str):
            return scope
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            where = rel if i == 0 else f"{rel}:{'.'.join(parts[:i])}"
            if scope is None or scope.kind == "function":
                return f"{where} is not a class, so it has no member {part!r}"
            if part not in scope.names:
                msg = f"{where} has no {'symbol' if i == 0 else 'member'} {part!r}"
                if i == 0 and part in scope.imports:
                    return msg + f" (it is imported from {scope.imports[part]}; cite the defining module)"
                near = difflib.get_close_matches(part, list(scope.names), n=1)
                return msg + (f"; did you mean {near[0]!r}?" if near else "")
            scope = scope.names[part]
        self.cited.add((rel, parts[0]))
        return None

    def check_span(self, where: str, text: str) -> None:
        m = ANCHOR.match(text.strip())
        if not m or m["path"] in PLACEHOLDERS or (m["sep"] is None and "/" not in m["path"]):
            return  # not an anchor: prose, a placeholder, or a lone file name
        rel, sep, sym = m["path"], m["sep"], m["sym"]
        if sym is not None and sym[:1].isdigit():
            return  # a line-number citation: already reported by LINE_CITE
        self.anchors += 1
        if rel.startswith("/") or ".." in Path(rel).parts:
            err = f"anchor path {rel!r} must be relative to the repo root"
        elif not (self.root / rel).is_file():
            err = f"{rel}: no such file"
        elif sym is None:
            err = None
        elif not (SYMBOL if sep == ":" else TEST_ID).match(sym):
            err = f"malformed anchor {text.strip()!r}; use path/file.py:Symbol"
        elif sep == ":":
            err = self.resolve(rel, sym.removesuffix("()"))
        else:  # pytest node id: path::Class::test[param]
            err = self.resolve(rel, sym.split("[")[0].replace("::", "."))
        if err:
            self.errors.append(f"{where}: {err}")

    def check_markdown(self, md: Path) -> None:
        name = md.relative_to(self.root).as_posix()
        fence = None
        for lineno, line in enumerate(md.read_text(encoding="utf-8").splitlines(), 1):
            m = FENCE.match(line)
            if fence is None and m:
                fence = m[1]
            elif fence is not None:
                if m and m[1][0] == fence[0] and len(m[1]) >= len(fence) and not line.strip(fence[0] + " "):
                    fence = None
            else:
                where = f"{name}:{lineno}"
                for cite in LINE_CITE.finditer(line):
                    hint = "cite a symbol (path/file.py:Symbol)"
                    self.errors.append(f"{where}: line-number citation {cite[0]!r}; {hint}")
                for span in SPAN.finditer(line):
                    self.check_span(where, span[2])

    def public_symbols(self, package: str):
        for path in sorted((self.root / package).rglob("*.py")):
            rel = path.relative_to(self.root).as_posix()
            for name, _ in public_definitions(ast.parse(path.read_text(), rel)):
                yield rel, name


def public_definitions(tree: ast.Module):
    """``(name, node)`` of a module's public functions and classes: not ``_``-prefixed, and listed
    in a literal ``__all__`` when the module has one (also the API page's rule)."""
    exported = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            try:
                exported = set(ast.literal_eval(node.value))
            except ValueError:
                pass
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not node.name.startswith("_") and (exported is None or node.name in exported):
                yield node.name, node


def markdown_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.md")) + sorted((root / "docs").rglob("*.md"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="repo root")
    parser.add_argument("--package", default="dgemma", help="package whose public API --coverage checks")
    parser.add_argument("--coverage", action="store_true", help="also fail on public symbols cited nowhere")
    args = parser.parse_args(argv)
    checker = Checker(args.root.resolve())
    files = markdown_files(checker.root)
    for md in files:
        checker.check_markdown(md)
    public = list(checker.public_symbols(args.package)) if args.coverage else []
    uncited = [sym for sym in public if sym not in checker.cited]
    for err in checker.errors:
        print(err)
    for rel, name in uncited:
        print(f"{rel}:{name}: public symbol cited by no doc anchor")
    if checker.errors or uncited:
        print(f"{len(checker.errors)} anchor problem(s), {len(uncited)} uncited public symbol(s)", file=sys.stderr)
        return 1
    extra = f", {len(public)} public symbols cited" if args.coverage else ""
    print(f"{checker.anchors} anchors in {len(files)} files OK{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
