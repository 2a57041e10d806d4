"""The suites and their cases: the built-in ones (`suites/<name>.py`, one or more per family) and external
ones, files of the user's named by `--suite-path` or `[tool.shardcheck] suite-paths` in pyproject.toml.

A suite module defines `FAMILY` (its ops are `FAMILY.Name`), `cases(quick)`, optionally `bench_cases(quick)`
and `IMPLEMENTATION`: the family's default module under test (a dotted name, or a .py path relative to the
suite file).  A suite's name is its file stem.  An external suite is imported from its path, its folder
appended to sys.path so that it may import its siblings; the driver and every rank load it the same way
from the same absolute paths (`Plan.suite_paths`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil
import re
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from shardcheck import suites
from shardcheck.harness.core.case import Case
from shardcheck.harness.core.fuzz_space import FuzzSpace
from shardcheck.harness.core.model_case import ModelCase
from shardcheck.harness.core.modules import import_file, is_path
from shardcheck.harness.core.options import UsageError

BENCH_FALLBACK_CASES = 2  # per op without benchmark cases
BUILTIN_DIR = Path(suites.__file__).resolve().parent
CONFIG_KEYS = ("suite-paths", "fuzz-corpus")


@functools.cache  # the package's files do not change while a process runs
def _builtin_suite_names() -> tuple[str, ...]:
    return tuple(sorted(m.name for m in pkgutil.iter_modules(suites.__path__) if not m.name.startswith("_")))


def builtin_suite_names() -> list[str]:
    return list(_builtin_suite_names())


def _stamp(given: str) -> tuple[str, int | None]:
    """What a suite path names now: the resolved path (a relative one moves with the working directory) and its
    mtime (None: absent)."""
    path = Path(given).expanduser().resolve()
    return str(path), path.stat().st_mtime_ns if path.exists() else None


def external_suite_files(suite_paths: Sequence[str]) -> dict[str, Path]:
    """{suite name: absolute file} of the external suites under `suite_paths` (.py files, or folders whose .py
    files not starting with `_` are suites).  A name taken twice, or a built-in suite's, is a UsageError.  Read once
    per state of the paths (a folder's mtime moves when a file is added or removed): planning asks it per item."""
    return dict(_external_suite_files(tuple(suite_paths), tuple(map(_stamp, suite_paths))))


@functools.lru_cache(maxsize=64)
def _external_suite_files(suite_paths: tuple[str, ...], stamps: tuple) -> dict[str, Path]:
    builtin = set(builtin_suite_names())
    found: dict[str, Path] = {}
    for given in suite_paths:
        path = Path(given).expanduser().resolve()
        if path.is_dir():
            files = sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
            if not files:
                raise UsageError(f"suite path {given}: the folder holds no suite (a .py file not starting with _)")
        elif path.is_file():
            if path.suffix != ".py":
                raise UsageError(f"suite path {given}: not a .py file")
            files = [path]
        else:
            raise UsageError(f"suite path {given}: no such file or directory")
        for file in files:
            name = file.stem
            if name in builtin:
                raise UsageError(
                    f"suite {file}: its name {name!r} is a built-in suite's ({BUILTIN_DIR / file.name}); "
                    "rename the file"
                )
            if name in found and found[name] != file:
                raise UsageError(f"two suites named {name!r}: {found[name]} and {file}; rename one of the files")
            found[name] = file
    return found


def suite_names(suite_paths: Sequence[str] = ()) -> list[str]:
    """Every suite's name: the built-in ones, then the external ones."""
    return builtin_suite_names() + sorted(external_suite_files(suite_paths))


def suite_file(name: str, suite_paths: Sequence[str] = ()) -> Path:
    external = external_suite_files(suite_paths)
    if name in external:
        return external[name]
    if name in builtin_suite_names():
        return BUILTIN_DIR / f"{name}.py"
    raise UsageError(f"unknown suite {name!r}; known: {', '.join(suite_names(suite_paths))}")


def is_external(name: str, suite_paths: Sequence[str] = ()) -> bool:
    return name in external_suite_files(suite_paths)


def _import_file(path: Path) -> ModuleType:
    """An external suite imported from its file, once per process (its folder first on sys.path)."""
    try:
        return import_file(path, f"shardcheck_suite_{path.stem}")
    except BaseException as exc:  # an import can raise anything, SystemExit included
        raise UsageError(f"suite {path}: cannot import: {type(exc).__name__}: {exc}".splitlines()[0]) from None


def _check_module(module: ModuleType, path: Path) -> None:
    family = getattr(module, "FAMILY", None)
    if not isinstance(family, str) or not family.isidentifier():
        raise UsageError(f"suite {path}: FAMILY must be a name (a str such as 'my_loss'), got {family!r}")
    for fn in ("cases", "bench_cases"):
        if (fn == "cases" or hasattr(module, fn)) and not callable(getattr(module, fn, None)):
            raise UsageError(f"suite {path}: defines no function {fn}(quick) -> list[Case]")
    impl = getattr(module, "IMPLEMENTATION", None)
    if impl is not None and (not isinstance(impl, str) or not impl):
        raise UsageError(f"suite {path}: IMPLEMENTATION must be a module name or a .py path, got {impl!r}")


_FAMILY_LINE = re.compile(r"""^FAMILY\s*=\s*["']([A-Za-z_]\w*)["']""", re.M)


def suite_family(name: str, suite_paths: Sequence[str] = ()) -> str:
    """The suite's FAMILY, read from its source where it is a plain string assignment (selecting one suite need not
    import every other one), else from the imported module."""
    found = _FAMILY_LINE.findall(suite_file(name, suite_paths).read_text())
    return found[0] if len(found) == 1 else load_suite(name, suite_paths).FAMILY


_OPT_IN_LINE = re.compile(r"^RUN_BY_DEFAULT\s*=\s*False\b", re.M)


def runs_by_default(name: str, suite_paths: Sequence[str] = ()) -> bool:
    """Whether a run that names no suite runs this one: every suite but one that says `RUN_BY_DEFAULT = False` (a
    third-party framework's models, minutes of a run, run when named with --suite or --op).  Read from the source:
    choosing suites need not import them."""
    return not _OPT_IN_LINE.search(suite_file(name, suite_paths).read_text())


def load_suite(name: str, suite_paths: Sequence[str] = ()) -> ModuleType:
    path = suite_file(name, suite_paths)
    module = importlib.import_module(f"shardcheck.suites.{name}") if path.parent == BUILTIN_DIR else _import_file(path)
    _check_module(module, path)
    return module


def _call_cases(suite: ModuleType, name: str, fn: str, quick: bool) -> list[Case]:
    try:
        cases = list(getattr(suite, fn)(quick=quick))
    except Exception as exc:
        raise UsageError(f"suite {name}: {fn}() raised {type(exc).__name__}: {exc}".splitlines()[0]) from None
    try:  # a model case is the ordinary Case it builds
        cases = [c.case() if isinstance(c, ModelCase) else c for c in cases]
    except Exception as exc:
        raise UsageError(f"suite {name}: a model case raised {type(exc).__name__}: {exc}".splitlines()[0]) from None
    for case in cases:
        if not isinstance(case, Case):
            raise UsageError(f"suite {name}: {fn}() returned a {type(case).__name__}, expected Case objects")
        family, dot, op_name = case.op.partition(".")
        if family != suite.FAMILY or not dot or not op_name:
            raise UsageError(
                f"suite {name}: case {case.case_id!r} has op {case.op!r}; ops of the suite's FAMILY "
                f"are named {suite.FAMILY}.<name in the module under test>"
            )
    return cases


def suite_cases(name: str, quick: bool, bench: bool = False, suite_paths: Sequence[str] = ()) -> list[Case]:
    """The suite's correctness cases, or its benchmark cases: `bench_cases()` (realistic sizes),
    plus, for every op that has none, its first correctness cases, so that every op present
    (and every op added later) is measured without further work."""
    suite = load_suite(name, suite_paths)
    cases = _call_cases(suite, name, "cases", quick)
    if bench:
        sized = _call_cases(suite, name, "bench_cases", quick) if hasattr(suite, "bench_cases") else []
        covered = {c.op for c in sized}
        fallback = [c for c in cases if c.op not in covered and c.bad_input is None]
        cases = sized + [
            c for i, c in enumerate(fallback) if sum(f.op == c.op for f in fallback[:i]) < BENCH_FALLBACK_CASES
        ]
    seen = set()
    for case in cases:
        if bench:
            _check_sweep(name, case)
        key = (case.op, case.case_id)
        if key in seen:
            raise UsageError(f"suite {name}: duplicate case id {case.case_id!r} for {case.op}")
        seen.add(key)
    return cases


SWEEP_AXES = ("dp", "cp", "tp")  # a sweep over a mesh dim reads the topology, not the params


def _check_sweep(suite: str, case: Case) -> None:
    """A benchmark's `params["sweep"]` names the parameter its plot varies: a mesh dim, or a number in its params."""
    if "sweep" not in case.params:
        return
    axis = case.params["sweep"]
    if axis in SWEEP_AXES:
        return
    value = case.params.get(axis) if isinstance(axis, str) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        why = "which its params lack" if isinstance(axis, str) and axis not in case.params else "not a number there"
        raise UsageError(
            f"suite {suite}: bench case {case.op} [{case.case_id}]: params['sweep'] = {axis!r}, {why} "
            f"(name a numeric key of params, or one of {', '.join(SWEEP_AXES)})"
        )


def suite_fuzz_spaces(name: str, suite_paths: Sequence[str] = ()) -> dict[str, FuzzSpace] | None:
    """{op: its FuzzSpace} of the suite's `fuzz_spaces()`, or None when the suite defines none (`shardcheck fuzz`
    skips it and says so).  A malformed declaration is a UsageError."""
    suite = load_suite(name, suite_paths)
    if not hasattr(suite, "fuzz_spaces"):
        return None
    try:
        spaces = list(suite.fuzz_spaces())
    except Exception as exc:
        raise UsageError(f"suite {name}: fuzz_spaces() raised {type(exc).__name__}: {exc}".splitlines()[0]) from None
    out: dict[str, FuzzSpace] = {}
    for space in spaces:
        if not isinstance(space, FuzzSpace):
            raise UsageError(
                f"suite {name}: fuzz_spaces() returned a {type(space).__name__}, expected FuzzSpace objects"
            )
        if space.op.partition(".")[0] != suite.FAMILY or space.op in out:
            raise UsageError(
                f"suite {name}: fuzz space of {space.op!r}: "
                + ("declared twice" if space.op in out else f"not an op of FAMILY {suite.FAMILY}")
            )
        out[space.op] = space
    return out


def default_impl(family: str, suite_paths: Sequence[str] = ()) -> str | None:
    """The module a family's ops run on without `--impl`, and that an `--impl` module's signatures are compared
    with: the IMPLEMENTATION its suites name (a path made absolute), else our `shardcheck.distributed_impl.<family>`
    for a built-in family; None for a new family whose suites name none.  Suites naming different ones: UsageError."""
    named: dict[str, str] = {}  # implementation -> the suite naming it
    for name in suite_names(suite_paths):
        if suite_family(name, suite_paths) != family:  # (from the source: other families' suites stay unimported)
            continue
        suite = load_suite(name, suite_paths)
        path = suite_file(name, suite_paths)
        spec = getattr(suite, "IMPLEMENTATION", None)
        if spec is None and path.parent == BUILTIN_DIR:
            spec = f"shardcheck.distributed_impl.{family}"
        elif spec is not None and is_path(spec):
            spec = str((path.parent / spec).resolve())
            if not Path(spec).is_file():
                raise UsageError(f"suite {path}: IMPLEMENTATION {suite.IMPLEMENTATION!r}: no such file ({spec})")
        if spec is not None:
            named.setdefault(spec, str(path))
    if len(named) > 1:
        raise UsageError(
            f"family {family!r} has two default implementations: "
            + " and ".join(f"{spec} (suite {path})" for spec, path in named.items())
            + f"; a family has one (pass --impl {family}=MODULE to choose)"
        )
    return next(iter(named), None)


def _config(directory: Path) -> tuple[dict, str]:
    """`[tool.shardcheck]` of `directory`/pyproject.toml ({} without the file or the table) and where it is, for
    messages.  A malformed table, or an unknown key: UsageError."""
    pyproject = directory / "pyproject.toml"
    where = f"{pyproject} [tool.shardcheck]"
    if not pyproject.is_file():
        return {}, where
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the tomli package, if installed
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            if "[tool.shardcheck]" in pyproject.read_text(errors="replace"):
                raise UsageError(
                    f"{pyproject}: reading [tool.shardcheck] needs Python 3.11 or the tomli package"
                ) from None
            return {}, where
    try:
        config = tomllib.loads(pyproject.read_text()).get("tool", {}).get("shardcheck", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{pyproject}: cannot read: {exc}".splitlines()[0]) from None
    if not isinstance(config, dict):
        raise UsageError(f"{where}: expected a table, got {type(config).__name__}")
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(CONFIG_KEYS)}")
    return config, where


def config_suite_paths(directory: Path) -> list[str]:
    """The absolute paths `[tool.shardcheck] suite-paths` names in `directory`/pyproject.toml (relative to it);
    [] without the file or the key.  A malformed table, or a path that does not exist: UsageError."""
    config, where = _config(directory)
    paths = config.get("suite-paths", [])
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise UsageError(f"{where}: suite-paths must be a list of paths (strings), got {paths!r}")
    out = []
    for given in paths:
        path = (directory / Path(given).expanduser()).resolve()
        if not path.exists():
            raise UsageError(f"{where}: suite-paths: {given}: no such file or directory ({path})")
        out.append(str(path))
    return out


def config_fuzz_corpus(directory: Path) -> Path | None:
    """The folder `[tool.shardcheck] fuzz-corpus` names in `directory`/pyproject.toml (relative to it), or None."""
    config, where = _config(directory)
    given = config.get("fuzz-corpus")
    if given is None:
        return None
    if not isinstance(given, str) or not given:
        raise UsageError(f"{where}: fuzz-corpus must be a folder (a string), got {given!r}")
    return (directory / Path(given).expanduser()).resolve()
