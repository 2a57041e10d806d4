"""Which (op, case, topology, dtype) items to run: the selection (suites, ops, cases, topologies, dtypes,
`--impl`) checked and expanded into the plan the ranks run."""

from __future__ import annotations

import fnmatch
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from shardcheck.harness.core.bad_input import BAD_INPUT_CHECK
from shardcheck.harness.core.case import Case
from shardcheck.harness.core.fuzz_space import FuzzSpace
from shardcheck.harness.core.model_case import PLANNED_CHECKS, StepCase
from shardcheck.harness.core.modules import resolve_impl
from shardcheck.harness.core.options import DEFAULT_WORLD_SIZES, RunSettings, UsageError
from shardcheck.harness.core.plan_data import DTYPES, Item, Plan, Xfail
from shardcheck.harness.core.topology import Topology, default_topologies, expert_topologies
from shardcheck.harness.driver.corpus import CorpusEntry
from shardcheck.harness.rank.fuzz_cases import fuzz_case
from shardcheck.harness.rank.suite_loader import (
    default_impl,
    external_suite_files,
    runs_by_default,
    suite_cases,
    suite_family,
    suite_file,
    suite_fuzz_spaces,
    suite_names,
)

DEFAULT_DTYPES = ("float64", "float32", "bfloat16")


def expand_suites(wanted: list[str], suite_paths: list[str] = ()) -> list[str]:
    """Suite names for `--suite`: a family's name selects every suite of that family (model_utils:
    its TP, CP and Megatron suites), any other name that suite alone."""
    by_family: dict[str, list[str]] = {}
    for name in suite_names(suite_paths):
        by_family.setdefault(suite_family(name, suite_paths), []).append(name)
    out = []
    for name in wanted:
        if name not in by_family:
            suite_file(name, suite_paths)  # an unknown name: UsageError
        out += by_family.get(name, [name])
    return list(dict.fromkeys(out))


def item_seed(seed: int, op: str, case_id: str, dtype: str) -> int:
    """Fresh, reproducible inputs per case and dtype, the same on every rank."""
    return zlib.crc32(f"{seed}/{op}/{case_id}/{dtype}".encode())


def expected_checks(case: Case, bench: bool = False) -> list[str]:
    if bench:
        return ["bench"] + (["property:comm"] if case.comm else [])
    if case.bad_input is not None:  # the op raises (usually): one row; an answer it returns adds its own
        return [BAD_INPUT_CHECK]
    if isinstance(case, StepCase):  # named by running the model, which the ranks do: the planner does not
        return list(PLANNED_CHECKS)
    if not case.output_names and not case.comm:  # a properties-only case: its properties are named when they
        return ["property:properties"]  # run; this row stands for them when the op raises, is skipped or hangs
    return case.forward_checks + [f"grad:{n}" for n in case.grad_inputs] + (["property:comm"] if case.comm else [])


def known_failure(case: Case, topology: Topology, dtype: str) -> Xfail | None:
    """The case's KnownFailure resolved for its item at `topology` and `dtype`: None where it has none or its
    `when` leaves that item out."""
    mark = case.xfail
    if mark is None:
        return None
    try:
        applies = mark.applies(topology, dtype)
    except Exception as exc:  # the suite's own callable: one line naming the case, never a traceback
        raise UsageError(
            f"{case.op} [{case.case_id}]: KnownFailure.when({topology}, {dtype!r}) raised {type(exc).__name__}: {exc}"
        ) from None
    return Xfail(reason=mark.reason, reference=mark.reference, checks=list(mark.checks)) if applies else None


def check_known_failure(case: Case) -> None:
    """A KnownFailure pattern that can match none of the case's checks is a typo that would leave the mark
    silently unused (properties are named when they run: `property:` patterns are taken on trust)."""
    if case.xfail is None:
        return
    if isinstance(case, StepCase):  # its checks are named by one step of the model: run here for a marked case alone
        try:
            case.output_names  # noqa: B018 (named by running one step: raises where the ranks would)
        except Exception:  # the ranks report it (a reference error row): nothing to decide here
            return
    checks = (
        case.forward_checks
        + [f"grad:{n}" for n in case.grad_inputs]
        + (["property:comm"] if case.comm else [])
        + ([BAD_INPUT_CHECK] if case.bad_input is not None else [])
    )
    for pattern in case.xfail.checks:
        if not pattern.startswith("property:") and not any(fnmatch.fnmatchcase(c, pattern) for c in checks):
            raise UsageError(
                f"{case.op} [{case.case_id}]: KnownFailure check pattern {pattern!r} matches none of "
                f"its checks ({', '.join(checks) or 'none'})"
            )


def resolve_modules(
    ops: list[tuple[str, str]], impl: dict[str, str], suite_paths: list[str], uses: Iterable[str] = ()
) -> tuple[dict[str, str], dict[str, str | None], dict[str, str]]:
    """(impl, defaults, missing) of the selected (suite, op id)s: every family's module under test (`impl` with the
    defaults filled in), each family's default module, and {op: suite} of the ops the module does not define.
    Every module must import and define some selected op (UsageError otherwise).  `uses`: other families the
    selected cases call (Case.uses), resolved the same way."""
    # Without --impl a family runs on its default: our seed module, or the IMPLEMENTATION its suite names.
    impl = dict(impl)
    modules, defaults, origins = {}, {}, {}
    for family in sorted({op.split(".", 1)[0] for _, op in ops} | set(uses)):
        defaults[family] = default_impl(family, suite_paths)
        if family in impl:
            origins[family] = f"--impl {family}={impl[family]}"
        elif defaults[family] is not None:
            impl[family] = defaults[family]
            origins[family] = f"{family}'s default implementation {impl[family]}"
        else:
            suite_name = next((n for n, op in ops if op.split(".", 1)[0] == family), family)
            raise UsageError(
                f"family {family!r} has no implementation: set IMPLEMENTATION in suite "
                f"{suite_file(suite_name, suite_paths)} or pass --impl {family}=MODULE"
            )
        modules[family] = resolve_impl(family, impl[family], origins[family])
    # An op the module under test does not define is one finding (harness/rank/signatures.py), not a TypeError
    # per item; a module that defines none of its family's selected ops is the wrong module, whatever else the run
    # selects (checked here, before any rank starts).
    missing = {
        op: suite_name for suite_name, op in ops if not hasattr(modules[op.split(".", 1)[0]], op.split(".", 1)[1])
    }
    for family in sorted({op.split(".", 1)[0] for _, op in ops}):
        selected = sorted({op for _, op in ops if op.split(".", 1)[0] == family})
        if all(op in missing for op in selected):
            names = ", ".join(repr(op.split(".", 1)[1]) for op in selected[:3]) + (", ..." if len(selected) > 3 else "")
            raise UsageError(
                f"{origins[family]}: module defines none of the {len(selected)} selected {family} op(s) "
                f"(no {names}); is it the right file?"
            )
    return impl, defaults, missing


def select_suites(
    suites_wanted: list[str],
    ops: list[str],
    impl: dict[str, str],
    suite_paths: list[str] = (),
) -> tuple[list[str], list[str]]:
    """(suite names, absolute external suite files) of a selection: `--suite` (a family selects its suites), else
    the external suites when some are given and no `--op` is, else every suite that runs by default (and those of
    the families `--op` names).  An `--impl` of an unknown family:
    UsageError."""
    external = external_suite_files(suite_paths)
    suite_paths = [str(p) for p in external.values()]
    if suites_wanted:
        names = expand_suites(suites_wanted, suite_paths)
    elif external and not ops:
        names = sorted(external)
    else:  # every suite that runs by default, and those of the families --op names
        named = {op.partition(".")[0] for op in ops}
        names = [
            n
            for n in suite_names(suite_paths)
            if runs_by_default(n, suite_paths) or suite_family(n, suite_paths) in named
        ]
    families = {suite_family(n, suite_paths) for n in suite_names(suite_paths)}
    for family in impl:
        if family not in families:
            raise UsageError(f"--impl: unknown family {family!r}; known: {', '.join(sorted(families))}")
    return names, suite_paths


@dataclass
class Selection:
    """What a run selects (suites, ops, cases, topologies, dtypes, modules under test) and how it runs them
    (`settings`): the one argument of build_plan.  `suite_paths`: external suites (files or folders); without
    `suites_wanted` a run with external suites runs those (name built-in ones with --suite to add them), unless `ops`
    are named, which are looked up in every suite.  `corpus`: saved fuzz failures (harness/driver/corpus.py, found in
    `corpus_dir`); those of the selected suites, ops and cases whose topology and dtype the run has come first."""

    run_id: str
    settings: RunSettings
    suites_wanted: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    case_patterns: list[str] = field(default_factory=list)
    world_sizes: list[int] | None = None
    topologies: list[Topology] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=lambda: list(DEFAULT_DTYPES))
    impl: dict[str, str] = field(default_factory=dict)
    quick: bool = False
    suite_paths: Sequence[str] = ()
    corpus: Sequence[CorpusEntry] = ()
    corpus_dir: str = ""
    # The topologies the user named (--topology), where `topologies` holds more (a hand-launched worker's defaults):
    # those an expert-parallel check holds to; None: `topologies`.
    named_topologies: list[Topology] | None = None


Replay = tuple[str, Case, CorpusEntry]  # a saved fuzz failure: (suite, its case, its corpus entry)


def build_plan(selection: Selection) -> Plan:
    """The plan of a selection: its items, each in the world size that runs it."""
    sel = selection
    _check_selection(sel)
    names, suite_paths = select_suites(sel.suites_wanted, sel.ops, sel.impl, list(sel.suite_paths))
    cases, replays = _selected_cases(sel, names, suite_paths)
    worlds = Worlds.of(sel.world_sizes, list(sel.topologies))
    impl, defaults, missing = resolve_modules(
        [(n, c.op) for n, c in cases] + [(n, c.op) for n, c, _ in replays],
        sel.impl,
        suite_paths,
        uses={f for _, c in cases for f in c.uses},
    )
    cases = [(n, c) for n, c in cases if c.op not in missing]
    replays = [r for r in replays if r[1].op not in missing]
    plan = Plan(
        run_id=sel.run_id,
        quick=sel.quick,
        settings=sel.settings,
        impl=impl,
        missing_ops=missing,
        suite_paths=suite_paths,
        default_impl=defaults,
        corpus=sel.corpus_dir,
        uses={c.op: sorted(c.uses) for _, c in cases if c.uses},
    )
    _add_replays(plan, replays, worlds)  # the saved failures first: a regression shows at once
    for suite_name, case in cases:
        _add_case(plan, suite_name, case, sel.dtypes, worlds)
    named = sel.topologies if sel.named_topologies is None else sel.named_topologies
    _check_data_mesh_splits(plan, named)
    _check_expert_topologies(plan, named, [c for _, c in cases])
    if not plan.items:
        raise UsageError("nothing to run: no case supports the selected topologies and dtypes")
    return plan


def _check_data_mesh_splits(plan: Plan, given: list[Topology]) -> None:
    """A given HSDP topology (dp_replicate > 1) that no selected case runs: bad usage, one line, not a run that
    silently runs nothing there (a case runs HSDP topologies when it says so: Case.hsdp)."""
    for topo in given:
        if topo.dp_replicate > 1 and not any(i.full_topology == topo for i in plan.items):
            raise UsageError(
                f"topology {topo}: no selected case runs a data mesh split replicate x shard (HSDP; a case opts in "
                "with hsdp=True)"
            )


def _check_expert_topologies(plan: Plan, given: list[Topology], cases: list[Case]) -> None:
    """A given topology with ep > 1 that no selected case can run (none runs expert parallelism, or the ep does not
    divide its experts: a case's `params["experts"]`): bad usage, one line, rather than a run that silently runs
    nothing there."""
    for topo in given:
        if topo.ep == 1:
            continue
        items = [i for i in plan.items if i.full_topology == topo]
        if not items:
            experts = [c for c in cases if c.expert_parallel and c.params.get("experts", topo.ep) % topo.ep]
            if experts:
                c = experts[0]
                raise UsageError(
                    f"topology {topo}: ep={topo.ep} does not divide the {c.params['experts']} experts of "
                    f"{c.op} [{c.case_id}]"
                )
            raise UsageError(f"topology {topo}: no selected case runs expert parallelism at it (ep={topo.ep})")
        if all(i.skip for i in items):
            raise UsageError(f"topology {topo}: {items[0].op} [{items[0].case_id}]: {items[0].skip}")


def _check_selection(sel: Selection) -> None:
    for d in sel.dtypes:
        if d not in DTYPES:
            raise UsageError(f"unknown dtype {d!r}; known: {', '.join(DTYPES)}")
    if sel.world_sizes is not None and any(w <= 0 for w in sel.world_sizes):
        raise UsageError(f"world sizes must be positive, got {sel.world_sizes}")


def _selected_cases(
    sel: Selection, names: list[str], suite_paths: list[str]
) -> tuple[list[tuple[str, Case]], list[Replay]]:
    """(suite, case) of the selected suites' cases, and the corpus's saved failures among them, filtered by `--op`,
    `--case` and (the replays) `--dtype`; UsageError when nothing is left."""
    bench = sel.settings.bench
    cases = [(n, c) for n in names for c in suite_cases(n, sel.quick, bench, suite_paths)]
    replays = [] if bench else corpus_cases(sel.corpus, names, suite_paths)
    known_ops = sorted({c.op for _, c in cases})
    for op in sel.ops:
        if op not in known_ops:
            raise UsageError(f"unknown op {op!r}; known: {', '.join(known_ops)}")
    if sel.ops:
        cases = [(n, c) for n, c in cases if c.op in sel.ops]
        replays = [r for r in replays if r[1].op in sel.ops]
    if sel.case_patterns:
        cases = [(n, c) for n, c in cases if any(fnmatch.fnmatchcase(c.case_id, p) for p in sel.case_patterns)]
        replays = [r for r in replays if any(fnmatch.fnmatchcase(r[1].case_id, p) for p in sel.case_patterns)]
    replays = [r for r in replays if r[2].params["dtype"] in sel.dtypes]
    if not cases and not replays:
        raise UsageError("nothing to run: no case matches the selected suites, ops and cases")
    return cases, replays


@dataclass(frozen=True)
class Worlds:
    """The topologies of a plan and the world sizes that launch them."""

    sizes: list[int]  # every launch size
    topologies: list[Topology]
    requested: frozenset[int]  # the world sizes asked for (a hand-started worker passes its own)

    @classmethod
    def of(cls, world_sizes: list[int] | None, topologies: list[Topology]) -> Worlds:
        """Given topologies run in the world sizes given and their own sizes; else every topology of the world sizes
        (default DEFAULT_WORLD_SIZES)."""
        requested = frozenset(world_sizes or [])
        if topologies:
            return cls(sorted(requested | {t.size for t in topologies}), topologies, requested)
        sizes = sorted(world_sizes or DEFAULT_WORLD_SIZES)
        return cls(sizes, default_topologies(sizes) + expert_topologies(sizes), requested)

    def group_worlds(self) -> set[int]:
        """Launch sizes a world_group case may use: the world sizes asked for, else those of the topologies."""
        return set(self.requested or self.sizes)

    def world_for(self, t: Topology, case: Case) -> int:
        """The launch size that runs `case` at `t`: a world_group case's own size (its default-group collectives
        need it).  Else the topology's own size when one is asked for (or, without --world-sizes, always): no spare
        rank waits at every item's barrier, and launches of different sizes run side by side
        (harness/driver/launch.py).  Else the largest that it divides (a hand-started worker's world runs every
        topology dividing it)."""
        if case.world_group:
            return t.size
        fits = [w for w in self.sizes if w % t.size == 0]
        if not fits:
            raise UsageError(f"topology {t} (size {t.size}) divides none of the world sizes {self.sizes}")
        return t.size if t.size in self.group_worlds() else max(fits)


def _add_replays(plan: Plan, replays: list[Replay], worlds: Worlds) -> None:
    """The items of the corpus's saved failures whose topology the run has."""
    for suite_name, case, entry in replays:
        topo = Topology(*entry.params["topology"])
        if topo in worlds.topologies:
            world = worlds.world_for(topo, case)
            plan.items.append(fuzz_item(len(plan.items), suite_name, case, entry.params, entry.seed, world))


def _add_case(plan: Plan, suite_name: str, case: Case, dtypes: list[str], worlds: Worlds) -> None:
    """A case's items: one per dtype and topology it runs at; those whose inputs it cannot lay out skip."""
    if not plan.bench:
        check_known_failure(case)
    made: list[dict | None] = []  # this case's inputs, drawn once (only where a topology needs its shapes)
    fits: dict[Topology, str] = {}  # its misfit by topology: the same for every dtype
    for dtype in dtypes:
        if dtype not in case.dtypes:
            continue
        for topo in worlds.topologies:
            if not case.runs_on(topo):
                continue
            if case.world_group and topo.size not in worlds.group_worlds():
                continue  # its default-group collectives need a launch of exactly this size
            where = Placement(topo, dtype, worlds.world_for(topo, case))
            item = _item(len(plan.items), suite_name, case, where, plan.seed, bench=plan.bench)
            if topo not in fits:
                fits[topo] = _misfit(case, topo, item.seed, made)
            item.skip = fits[topo]
            plan.items.append(item)


def _misfit(case: Case, topo: Topology, seed: int, made: list[dict | None]) -> str:
    """Why `case` cannot lay its inputs out at `topo` ("" where it can): the item is then recorded `skip` with
    that reason instead of raising on every rank (a head-tail layout of 16 positions at CP 16).  The inputs are
    the ones the ranks make (a packed layout reads its sequences' boundaries), drawn once per case into `made`:
    a case's shapes and boundaries are its own, not its seed's or dtype's, and drawing inputs was most of the
    planning time (docs/performance.md#planning).  A case whose shapes did vary with the seed would still be
    caught on the ranks, as a harness error row."""
    if topo.size == 1 or not (case.input_layouts or case.cp_lengths) or case.skip_reason:
        return ""
    if not case.input_layouts:  # cp_lengths alone: no inputs needed
        return case.misfit(topo, {})
    if not made:
        try:
            make = case.planning_inputs if isinstance(case, StepCase) else case.make_inputs  # (no model built)
            made.append(make(torch.Generator().manual_seed(seed)))
        except Exception:  # the ranks report it (a reference error row): nothing to decide here
            made.append(None)
    return case.misfit(topo, made[0]) if made[0] is not None else ""


@dataclass(frozen=True)
class Placement:
    """Where an item runs: its topology and dtype, in a launch of `world_size` ranks."""

    topology: Topology
    dtype: str
    world_size: int


def _item(
    item_id: int,
    suite_name: str,
    case: Case,
    where: Placement,
    seed: int,
    *,
    bench: bool = False,
    fuzz: dict | None = None,
) -> Item:
    topo = where.topology
    return Item(
        id=item_id,
        suite=suite_name,
        op=case.op,
        case_id=case.case_id,
        dtype=where.dtype,
        topology=(topo.dp, topo.cp, topo.tp),
        dp_replicate=topo.dp_replicate,
        ep=topo.ep,
        world_size=where.world_size,
        seed=item_seed(seed, case.op, case.case_id, where.dtype),
        checks=expected_checks(case, bench),
        params=case.params,
        xfail=known_failure(case, topo, where.dtype),
        fuzz=fuzz,
    )


# ---- fuzz cases ----------------------------------------------------------------------------------------------


def build_fuzz_case(suite_name: str, space: FuzzSpace, params: dict, where: str) -> Case:
    """The fuzz case of `params`; its space raising on them is a UsageError naming `where` they come from."""
    try:
        return fuzz_case(space, params)
    except Exception as exc:
        raise UsageError(
            f"{where}: suite {suite_name}'s fuzz space of {space.op} cannot build the case: "
            f"{type(exc).__name__}: {exc}".splitlines()[0]
        ) from None


def fuzz_item(
    item_id: int, suite_name: str, case: Case, params: dict, seed: int, world_size: int | None = None
) -> Item:
    """The one item of a fuzz case: its own topology and dtype (in a launch of its size unless told); inputs drawn
    from `seed` (the fuzz run's), so a saved case replays the same inputs under any `run --seed`."""
    topo = Topology(*params["topology"])
    return _item(
        item_id, suite_name, case, Placement(topo, params["dtype"], world_size or topo.size), seed, fuzz=params
    )


def corpus_cases(
    corpus: list[CorpusEntry], names: list[str], suite_paths: list[str]
) -> list[tuple[str, Case, CorpusEntry]]:
    """(suite, case, entry) of the corpus entries of the suites `names`.  An entry whose op has no fuzz space
    any more, or whose params its space refuses: UsageError naming it."""
    spaces = {}
    out = []
    for entry in corpus:
        if entry.suite not in names:
            continue
        if entry.suite not in spaces:
            spaces[entry.suite] = suite_fuzz_spaces(entry.suite, suite_paths) or {}
        where = f"fuzz corpus entry {entry.file_name()}"
        if entry.op not in spaces[entry.suite]:
            raise UsageError(f"{where}: suite {entry.suite} declares no fuzz space of {entry.op}")
        if entry.params["dtype"] not in DTYPES:
            raise UsageError(f"{where}: unknown dtype {entry.params['dtype']!r}")
        out.append(
            (entry.suite, build_fuzz_case(entry.suite, spaces[entry.suite][entry.op], entry.params, where), entry)
        )
    return out


def plan_fuzz_example(base: Plan, suite_name: str, space: FuzzSpace, params: dict) -> Plan:
    """`base` (the fuzz run's settings, no items) with the one item of the fuzz case `params` describes."""
    case = build_fuzz_case(suite_name, space, params, "drawn params")
    return replace(base, items=[fuzz_item(0, suite_name, case, params, base.seed)])


def plan_fuzz(
    *,
    run_id: str,
    suites_wanted: list[str],
    ops: list[str],
    impl: dict[str, str],
    settings: RunSettings,
    suite_paths: list[str] = (),
    corpus_dir: str = "",
) -> tuple[Plan, list[tuple[str, FuzzSpace]], dict[str, str]]:
    """What `shardcheck fuzz` searches: (the run's settings as a Plan without items, the (suite, space) of every
    selected op that has one, {suite or op: why it is skipped}).  The selection is `build_plan`'s: `--suite`
    (a family selects its suites), `--op`, external suites."""
    names, suite_paths = select_suites(suites_wanted, ops, impl, suite_paths)
    suite_ops = {n: sorted({c.op for c in suite_cases(n, False, False, suite_paths)}) for n in names}
    known_ops = {op for n in names for op in suite_ops[n]}  # an op may be in several suites (model_utils, _cp)
    for op in ops:
        if op not in known_ops:
            raise UsageError(f"unknown op {op!r}; known: {', '.join(sorted(known_ops))}")
    selected, skipped = [], {}
    for name in names:
        spaces = suite_fuzz_spaces(name, suite_paths)
        wanted = [op for op in suite_ops[name] if not ops or op in ops]
        if spaces is None:
            if wanted:
                skipped[name] = "the suite declares no fuzz space (no fuzz_spaces())"
            continue
        for op in wanted:
            if op in spaces:
                selected.append((name, spaces[op]))
            else:
                skipped[f"{op} (suite {name})"] = "the suite declares no fuzz space for it"
    plan = Plan(
        run_id=run_id,
        quick=False,
        settings=settings,
        impl=impl,
        suite_paths=suite_paths,
        corpus=corpus_dir,
    )
    if not selected:
        return plan, [], skipped
    plan.impl, plan.default_impl, missing = resolve_modules([(n, s.op) for n, s in selected], impl, suite_paths)
    plan.missing_ops = missing
    for op in missing:
        skipped[op] = "not defined in the module under test"
    return plan, [(n, s) for n, s in selected if s.op not in missing], skipped
