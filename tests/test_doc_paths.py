"""The README and docs/ name only what the tree holds: every repository path they mention (`harness/rank/worker.py`,
`tests/broken/<suite>/`, `docs/checks.md:12`), every relative link and every dotted module name
(`shardcheck.harness.core.records.load`) exists; and README's "Layout of the code" names every module of harness/.

A repository path starts with one of the repository's top-level folders and is not the tail of a longer path
(`/home/me/shardcheck/docs/...` is someone's checkout, `failures/<item>/...` a run directory's file).  `<placeholder>`
and `...` stand for any name: the path must then match at least one file or folder."""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

from helpers import ROOT

TOP_FOLDERS = (
    "harness",
    "reports",
    "suites",
    "reference",
    "distributed_impl",
    "examples",
    "zoo",
    "tests",
    "docs",
    "shardcheck",
)
PATH = re.compile(r"(?<![\w./-])(?:\.ci|" + "|".join(TOP_FOLDERS) + r")/[\w./<>*#:-]*")
DOTTED = re.compile(r"(?<![\w.])shardcheck\.(?:harness|reports|suites|reference|distributed_impl)(?:\.\w+)*")
LINK = re.compile(r"\]\(([^)\s]+)\)")

# Names that look like repository paths and are not: a user's own project in an example.
NOT_REPOSITORY_PATHS = {
    "tests/shardcheck",  # docs/writing-a-suite.md: the `suite-paths` of a user's pyproject.toml
}


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _clean(path: str) -> str:
    """The path without its `#anchor`, `:LINE` suffix and the sentence's trailing punctuation."""
    path = path.split("#")[0]
    path = re.sub(r"(:\d+)+$", "", path.rstrip(".,:;"))
    return path.rstrip(".,:;")


def _exists(path: str) -> bool:
    """Whether `path` (relative to the repository root) exists; placeholders match any name; a pytest node id
    (`tests/test_x.py::test_y`) names a test of that file."""
    path, _, test = path.partition("::")
    if test:
        return (ROOT / path).is_file() and test.split("::")[0].split("[")[0] in _top_level_names(ROOT / path)
    pattern = re.sub(r"\*+", "*", re.sub(r"<[^>]*>", "*", path).replace("...", "*")).rstrip("/")
    if "*" in pattern:
        return any(ROOT.glob(pattern))
    return (ROOT / pattern).exists()


def _named_paths(text: str) -> set[str]:
    return {_clean(match) for match in PATH.findall(text)} - NOT_REPOSITORY_PATHS - {""}


@cache
def _package_dirs() -> dict[str, Path]:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in mapping.items()}


def _top_level_names(module: Path) -> set[str]:
    """The names a module defines or imports at its top level (inside top-level `if` / `try` blocks too)."""
    names: set[str] = set()
    pending = list(ast.parse(module.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(n.id for target in node.targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            pending.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            pending.extend(stmt for handler in getattr(node, "handlers", []) for stmt in handler.body)
    return names


def _dotted_name_exists(dotted: str) -> bool:
    """`shardcheck.harness.core.records.load`: the module file through pyproject's package-dir mapping, then its
    first attribute (if any) among the module's top-level names."""
    parts = dotted.split(".")
    package = ".".join(parts[:2])
    where = _package_dirs()[package]
    rest = parts[2:]
    while rest and (where / rest[0]).is_dir():
        where = where / rest.pop(0)
    if rest and (where / f"{rest[0]}.py").is_file():
        where = where / f"{rest.pop(0)}.py"
    module = where if where.suffix == ".py" else where / "__init__.py"
    if not module.is_file():
        return False
    return not rest or rest[0] in _top_level_names(module)


def test_every_path_the_docs_name_exists():
    missing = []
    for document in _documents():
        for number, line in enumerate(document.read_text().splitlines(), 1):
            where = f"{document.relative_to(ROOT)}:{number}"
            missing += [f"{where}: {path}" for path in sorted(_named_paths(line)) if not _exists(path)]
    assert not missing, "paths named in the docs that the tree lacks:\n" + "\n".join(missing)


def test_every_relative_link_of_the_docs_resolves():
    missing = []
    for document in _documents():
        for number, line in enumerate(document.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):  # a URL, an anchor on the same page
                    continue
                if not (document.parent / target.split("#")[0]).exists():
                    missing.append(f"{document.relative_to(ROOT)}:{number}: {target}")
    assert not missing, "links in the docs to files the tree lacks:\n" + "\n".join(missing)


def test_every_dotted_module_name_of_the_docs_exists():
    missing = []
    for document in _documents():
        for number, line in enumerate(document.read_text().splitlines(), 1):
            for dotted in DOTTED.findall(line):
                if not _dotted_name_exists(dotted):
                    missing.append(f"{document.relative_to(ROOT)}:{number}: {dotted}")
    assert not missing, "module names in the docs that the tree lacks:\n" + "\n".join(missing)


def _layout_entries() -> dict[str, str]:
    """README's "Layout of the code" block as {folder: its text}: an entry starts at a line's first column with the
    folder's path and runs on over the indented lines below it."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Layout of the code", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    folder = ""
    for line in block.splitlines():
        if line[:1].strip():
            folder, _, line = line.partition(" ")
        entries[folder] = entries.get(folder, "") + " " + line
    return entries


def test_the_layout_names_every_module_of_the_harness_under_its_folder():
    """Each folder of harness/ has an entry in the layout naming each of its modules; a new module is added there."""
    entries = _layout_entries()
    missing = []
    for module in sorted((ROOT / "harness").rglob("*.py")):
        folder = module.parent.relative_to(ROOT).as_posix() + "/"
        if module.stem != "__init__" and module.stem not in re.findall(r"\w+", entries.get(folder, "")):
            missing.append(f"{folder}: {module.stem}")
    assert not missing, "modules README.md's layout leaves out:\n" + "\n".join(missing)
