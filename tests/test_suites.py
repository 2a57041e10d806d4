"""The suites as code: discovered by name, helpers in private modules, only seed names taken from the module
under test."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

from shardcheck.harness.rank.suite_loader import load_suite, suite_names

SUITES = ROOT / "suites"


def test_private_modules_are_helpers_not_suites():
    private = {p.stem for p in SUITES.glob("_*.py") if p.stem != "__init__"}
    assert private and not private & set(suite_names())
    assert set(suite_names()) == {p.stem for p in SUITES.glob("*.py") if not p.stem.startswith("_")}


def test_no_suite_imports_another_suite_or_a_private_name():
    """Shared code lives in private modules (suites/_*.py) under public names: no suite is another's library."""
    for path in sorted(SUITES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardcheck.suites."):
                assert node.module.split(".")[-1].startswith("_"), f"{path.name} imports the suite {node.module}"
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports private {private} from {node.module}"


def _names_taken_from_the_module(path: Path) -> set[str]:
    """Attributes a suite reads off the module under test: `impl.X`, `ctx.impl.X`, `getattr(impl, "X")`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and (
            (isinstance(node.value, ast.Name) and node.value.id == "impl")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "impl")
        ):
            names.add(node.attr)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "impl"
            and isinstance(node.args[1], ast.Constant)
        ):
            names.add(node.args[1].value)
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}  # every module has __file__, __name__


# Seed names that no case has as its op, called inside other ops' cases.
SEED_NAMES_WITHOUT_CASES = {"cp_utils": {"get_train_context"}, "decoder": {"loss"}, "moe": {"loss"}}


def test_suites_take_only_the_seed_names_from_the_module_under_test():
    """Config classes, sampling parameters and helpers come from the suite or the reference: a module that defines
    only the seed's names must be enough."""
    ops = {family: set(names) for family, names in SEED_NAMES_WITHOUT_CASES.items()}
    for name in suite_names():
        for case in load_suite(name).cases():  # Cases and ModelCases: both name their op "family.name"
            family, _, op_name = case.op.partition(".")
            ops.setdefault(family, set()).add(op_name)
    for path in sorted((ROOT / "suites").glob("*.py")):
        family = next((f for f in ops if path.stem.startswith(f) or path.stem.startswith(f"_{f}")), None)
        taken = _names_taken_from_the_module(path)
        assert family is not None or not taken, path
        assert taken <= ops.get(family, set()), f"{path.name} takes {sorted(taken - ops[family])} from the module"
