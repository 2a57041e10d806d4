"""The shape of the harness's code, as the renovation left it: no module over 600 lines, no function over 60,
no function taking more than 6 positional parameters, every attribute of a class set in its `__init__` (or a
dataclass field). A room that grows past these is split before it is built on."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "harness"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
MAX_POSITIONAL = 6


def _modules() -> list[Path]:
    return sorted(p for p in HARNESS.rglob("*.py") if "__pycache__" not in p.parts)


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _positional(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    if in_class and names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (1 if fn.args.vararg else 0)


def _methods(tree: ast.AST) -> set[int]:
    return {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}


def shape_violations() -> list[str]:
    out: list[str] = []
    for path in _modules():
        rel = path.relative_to(ROOT)
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            out.append(f"{rel}: {len(text.splitlines())} lines > {MAX_MODULE_LINES}")
        tree = ast.parse(text)
        methods = _methods(tree)
        for fn in _functions(tree):
            lines = fn.end_lineno - fn.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{rel}:{fn.lineno} {fn.name}: {lines} lines > {MAX_FUNCTION_LINES}")
            n = _positional(fn, id(fn) in methods)
            if n > MAX_POSITIONAL:
                out.append(f"{rel}:{fn.lineno} {fn.name}: {n} positional parameters > {MAX_POSITIONAL}")
        out += _attributes_outside_init(tree, rel)
    return out


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in ("dataclass", "dataclass_transform"):
            return True
    return any(
        getattr(b, "id", getattr(b, "attr", "")) in ("NamedTuple", "TypedDict", "Enum", "StrEnum") for b in cls.bases
    )


def _self_attributes(fn: ast.FunctionDef) -> set[str]:
    names = set()
    for node in ast.walk(fn):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def _attributes_outside_init(tree: ast.AST, rel: Path) -> list[str]:
    out = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        declared = {
            t.id
            for stmt in cls.body
            for t in ([stmt.target] if isinstance(stmt, ast.AnnAssign) else getattr(stmt, "targets", []))
            if isinstance(t, ast.Name)
        }
        functions = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
        init = {a for f in functions if f.name in ("__init__", "__post_init__", "__new__") for a in _self_attributes(f)}
        known = init | declared
        for f in functions:
            if f.name in ("__init__", "__post_init__", "__new__"):
                continue
            for attr in sorted(_self_attributes(f) - known):
                out.append(f"{rel}:{f.lineno} {cls.name}.{attr} first set in {f.name}, not in __init__")
    return out


def test_harness_code_shape():
    violations = shape_violations()
    assert not violations, "\n".join(violations)


if __name__ == "__main__":
    print("\n".join(shape_violations()))
