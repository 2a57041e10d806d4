"""Which (op, case, topology, dtype) items to run: suite discovery, --impl resolution, the plan."""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import json
import pkgutil
import sys
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import torch

import suites
from harness.case import BAD_INPUT_CHECK, Case
from harness.topology import Topology, UsageError, default_topologies

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DTYPES = ("float64", "float32", "bfloat16")
DEFAULT_WORLD_SIZES = (1, 2, 4)


def suite_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(suites.__path__) if not m.name.startswith("_"))


def expand_suites(wanted: list[str]) -> list[str]:
    """Suite names for `--suite`: a family's name selects every suite of that family (model_utils:
    its TP, CP and Megatron suites), any other name that suite alone."""
    by_family: dict[str, list[str]] = {}
    for name in suite_names():
        by_family.setdefault(load_suite(name).FAMILY, []).append(name)
    out = []
    for name in wanted:
        out += by_family[name] if name in by_family else [load_suite(name).__name__.split(".")[-1]]
    return list(dict.fromkeys(out))


def load_suite(name: str) -> ModuleType:
    if name not in suite_names():
        raise UsageError(f"unknown suite {name!r}; known: {', '.join(suite_names())}")
    return importlib.import_module(f"suites.{name}")


BENCH_FALLBACK_CASES = 2  # per op without benchmark cases


def suite_cases(name: str, quick: bool, bench: bool = False) -> list[Case]:
    """The suite's correctness cases, or its benchmark cases: `bench_cases()` (realistic sizes),
    plus, for every op that has none, its first correctness cases, so that every op present
    (and every op added later) is measured without further work."""
    suite = load_suite(name)
    cases = suite.cases(quick=quick)
    if bench:
        sized = suite.bench_cases(quick=quick) if hasattr(suite, "bench_cases") else []
        covered = {c.op for c in sized}
        fallback = [c for c in cases if c.op not in covered and c.bad_input is None]
        cases = sized + [c for i, c in enumerate(fallback)
                         if sum(f.op == c.op for f in fallback[:i]) < BENCH_FALLBACK_CASES]
    seen = set()
    for case in cases:
        key = (case.op, case.case_id)
        if key in seen:
            raise UsageError(f"suite {name}: duplicate case id {case.case_id!r} for {case.op}")
        seen.add(key)
    return cases


def resolve_impl(family: str, spec: str) -> ModuleType:
    """Import the module under test: a dotted module name or a path to a .py file."""
    try:
        if spec.endswith(".py") or "/" in spec:
            path = Path(spec).resolve()
            if not path.is_file():
                raise UsageError(f"--impl {family}={spec}: no such file")
            mod_name = f"shardcheck_impl_{family}_{zlib.crc32(str(path).encode()):08x}"
            if mod_name in sys.modules:
                return sys.modules[mod_name]
            module_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[mod_name] = module
            module_spec.loader.exec_module(module)
            return module
        return importlib.import_module(spec)
    except UsageError:
        raise
    except BaseException as exc:  # an import can raise anything, SystemExit included
        raise UsageError(f"--impl {family}={spec}: cannot import: {type(exc).__name__}: {exc}".splitlines()[0]) from None


def item_seed(seed: int, op: str, case_id: str, dtype: str) -> int:
    """Fresh, reproducible inputs per case and dtype, the same on every rank."""
    return zlib.crc32(f"{seed}/{op}/{case_id}/{dtype}".encode())


@dataclass
class Item:
    id: int
    suite: str
    op: str
    case_id: str
    dtype: str
    topology: tuple[int, int, int]
    world_size: int
    seed: int
    checks: list[str]  # checks every participating rank must report
    params: dict = field(default_factory=dict)  # the case's parameters, recorded in each row


@dataclass
class Plan:
    run_id: str
    quick: bool
    seed: int
    timeout: float
    device: str
    backend: str
    impl: dict[str, str]
    items: list[Item] = field(default_factory=list)
    bench: bool = False  # measure time, memory and collectives instead of checking values
    bench_iters: int = 10  # timed iterations, the same on every rank
    bench_warmup: int = 2
    failure_artefacts: int = 0  # failing items whose tensors the ranks still save (harness/artefacts.py)
    missing_ops: dict[str, str] = field(default_factory=dict)  # {op: suite} selected but not in the module under test

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        raw = json.loads(text)
        raw["items"] = [Item(**{**i, "topology": tuple(i["topology"])}) for i in raw["items"]]
        return cls(**raw)


def expected_checks(case: Case, bench: bool = False) -> list[str]:
    if bench:
        return ["bench"] + (["property:comm"] if case.comm else [])
    if case.bad_input is not None:  # the op raises (usually): one row; an answer it returns adds its own
        return [BAD_INPUT_CHECK]
    return case.forward_checks + [f"grad:{n}" for n in case.grad_inputs] + (["property:comm"] if case.comm else [])


def build_plan(*, run_id: str, suites_wanted: list[str], ops: list[str], case_patterns: list[str],
               world_sizes: list[int] | None,
               topologies: list[Topology], dtypes: list[str], impl: dict[str, str], quick: bool, seed: int,
               timeout: float, device: str, backend: str, bench: bool = False, bench_iters: int = 10,
               bench_warmup: int = 2) -> Plan:
    for d in dtypes:
        if d not in DTYPES:
            raise UsageError(f"unknown dtype {d!r}; known: {', '.join(DTYPES)}")
    if world_sizes is not None and any(w <= 0 for w in world_sizes):
        raise UsageError(f"world sizes must be positive, got {world_sizes}")
    names = expand_suites(suites_wanted) if suites_wanted else suite_names()
    families = {load_suite(n).FAMILY: n for n in suite_names()}
    for family in impl:
        if family not in families:
            raise UsageError(f"--impl: unknown family {family!r}; known: {', '.join(sorted(families))}")
    cases = [(n, c) for n in names for c in suite_cases(n, quick, bench)]
    known_ops = sorted({c.op for _, c in cases})
    for op in ops:
        if op not in known_ops:
            raise UsageError(f"unknown op {op!r}; known: {', '.join(known_ops)}")
    if ops:
        cases = [(n, c) for n, c in cases if c.op in ops]
    if case_patterns:
        cases = [(n, c) for n, c in cases if any(fnmatch.fnmatchcase(c.case_id, p) for p in case_patterns)]
    if not cases:
        raise UsageError("nothing to run: no case matches the selected suites, ops and cases")

    requested_worlds = set(world_sizes or [])
    if topologies:
        world_sizes = sorted(set(world_sizes or []) | {t.size for t in topologies})
    else:
        world_sizes = sorted(world_sizes or DEFAULT_WORLD_SIZES)
        topologies = default_topologies(world_sizes)

    def world_for(t: Topology) -> int:
        fits = [w for w in world_sizes if w % t.size == 0]
        if not fits:
            raise UsageError(f"topology {t} (size {t.size}) divides none of the world sizes {world_sizes}")
        return max(fits)  # fewer launches: each launch runs every topology that divides it

    # Launch sizes a world_group case may use: the world sizes asked for (a hand-started worker passes its
    # own), else those of the topologies.
    group_worlds = requested_worlds or set(world_sizes)

    # Every module under test must import and name every op its selected cases call.
    modules = {}
    for family in sorted({c.family for _, c in cases}):
        spec = impl.get(family, f"distributed_impl.{family}")
        modules[family] = resolve_impl(family, spec)
        impl[family] = spec
    # An op the module under test does not define is one finding (harness/signatures.py), not a TypeError
    # per item; a module that defines none of the selected ops is the wrong module.
    missing = {case.op: suite_name for suite_name, case in cases if not hasattr(modules[case.family], case.name)}
    if len(missing) == len({case.op for _, case in cases}):
        family, name = next(iter(missing)).split(".", 1)
        raise UsageError(f"--impl {family}={impl[family]}: module has none of the selected ops "
                         f"(no {name!r}, needed by {family}.{name}); is it the right file?")
    cases = [(n, c) for n, c in cases if c.op not in missing]

    plan = Plan(run_id=run_id, quick=quick, seed=seed, timeout=timeout, device=device, backend=backend, impl=impl,
                bench=bench, bench_iters=bench_iters, bench_warmup=bench_warmup, missing_ops=missing)
    for suite_name, case in cases:
        for dtype in dtypes:
            if dtype not in case.dtypes:
                continue
            for topo in topologies:
                if not case.runs_on(topo):
                    continue
                if case.world_group and topo.size not in group_worlds:
                    continue  # its default-group collectives need a launch of exactly this size
                plan.items.append(Item(
                    id=len(plan.items), suite=suite_name, op=case.op, case_id=case.case_id, dtype=dtype,
                    topology=(topo.dp, topo.cp, topo.tp), world_size=topo.size if case.world_group else world_for(topo),
                    seed=item_seed(seed, case.op, case.case_id, dtype), checks=expected_checks(case, bench),
                    params=case.params))
    if not plan.items:
        raise UsageError("nothing to run: no case supports the selected topologies and dtypes")
    return plan
