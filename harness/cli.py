"""`shardcheck run | list | report | compare | dashboard`.  Exit codes: 0 all pass (no regression;
warnings allowed unless `run --strict`), 1 a check failed (a regression), 2 bad usage."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import gc
import glob
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shardcheck.harness.cli_parser import DEFAULT_FUZZ_EXAMPLES, make_parser
from shardcheck.harness.core.modules import is_ours
from shardcheck.harness.core.options import (
    DEFAULT_WORLD_SIZES,
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    RunSettings,
    UsageError,
    impl_map,
    str_list,
)
from shardcheck.harness.core.records import Status
from shardcheck.harness.core.topology import Topology, default_topologies, expert_topologies

if TYPE_CHECKING:
    from shardcheck.harness.core.plan_data import Plan
    from shardcheck.harness.core.records import RecordWriter
    from shardcheck.harness.driver.pool import WorkerPool


def _check_writable_file(path: Path, option: str) -> None:
    """Bad usage before the run, not a lost result after it."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{option} {path}: directory {parent} is not writable")


def _needs_rows(run_dir: Path) -> None:
    """One clear line (a UsageError) for a folder that holds no run's result rows."""
    results = run_dir / "results.jsonl"
    if not results.is_file():
        raise UsageError(f"{run_dir}: no results.jsonl (not a shardcheck run directory)")
    if not results.read_text().strip():
        raise UsageError(f"{run_dir}: results.jsonl holds no result rows (the run recorded no check)")


def cmd_compare(args) -> int:
    from shardcheck.reports.regression import compare_runs, machine_note

    for d in (args.base, args.new):
        _needs_rows(d)
    try:
        result = compare_runs(args.base, args.new, args.max_slowdown, args.max_memory_growth)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read runs: {exc}") from None
    print(f"## shardcheck compare: {args.base} -> {args.new}\n")
    for note in (machine_note(args.base, args.new), result.selection):
        if note:
            print(f"**Note:** {note}\n")
    print(result.table.to_markdown(index=False) if len(result.table) else "No changes beyond the thresholds.")
    if result.not_run:
        print("\nREGRESSION: checks NEW selected and did not run:")
        print("\n".join(f"- {line}" for line in result.not_run))
    print(
        f"\n**{result.regressions} regression(s)**, **{result.new_failures} new failure(s)** "
        f"(max slowdown {args.max_slowdown:g}% beyond the spread, max memory growth {args.max_memory_growth:g}%)"
    )
    return EXIT_FAIL if result.failed else EXIT_OK


def _default_dtypes(settings: RunSettings) -> list[str]:
    from shardcheck.harness.driver.planner import DEFAULT_DTYPES

    if settings.bench:  # what training runs in on a GPU; float32 on CPU, where bf16 math is emulated and slow
        return ["bfloat16"] if settings.device == "cuda" else ["float32"]
    return list(DEFAULT_DTYPES)


def cmd_run(args) -> int:
    if not args.profile:
        return _run(args)
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        return _run(args)
    finally:
        profile.disable()
        if getattr(args, "profile_dir", None) is not None:  # the run got as far as its plan
            from shardcheck.reports.profile import breakdown

            profile.dump_stats(args.profile_dir / "driver.prof")
            (args.profile_dir / "breakdown.md").write_text(breakdown(args.profile_dir))
            print(f"shardcheck: profile -> {args.profile_dir / 'breakdown.md'}")


def _pool(args, run_dir: Path):
    """The ranks' pool of a command, as a context manager: main's `pool` (left open on exit: it outlives the
    command), else one of the command's own in `run_dir` (closed on exit)."""
    from shardcheck.harness.driver.pool import WorkerPool

    return contextlib.nullcontext(args.pool) if args.pool is not None else WorkerPool(run_dir)


@contextlib.contextmanager
def _collector_off(freeze: bool):
    """The driver's heavy imports (torch, DTensor, the suites, pandas, matplotlib) and planning with Python's cyclic
    collector off: it would walk the million objects they make again and again (~18 % of the time).  `freeze` (the
    process is this command's alone): they live to its end, so later collections skip them as well."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _undone_on_error(args, pool: WorkerPool, run_dir: Path):
    """A run that never began (bad usage, an interrupt while planning) leaves nothing behind: its own pool's launches
    ended (main's `pool` outlives the run: its launches are not ours to end) and its new run directory removed."""
    existed = run_dir.exists()
    try:
        yield
    except BaseException:
        if args.pool is None:
            pool.close()
        if not existed:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


# Megatron-Core imported once by the ranks' fork server, not by each rank (harness/rank/preload_megatron.py), for a
# run that selects every suite or the suite whose cases build Megatron's GPTModel on every rank.
MEGATRON_PRELOAD = "shardcheck.harness.rank.preload_megatron"
MEGATRON_SUITE = "model_utils_megatron"


def _selects_megatron(args) -> bool:
    """Whether the selection includes the Megatron model cases: every suite (no selection), or that suite named."""
    if not (args.suite or args.op or args.case or args.suite_path):
        return True
    return MEGATRON_SUITE in str_list(args.suite)


def _plan(args, pool: WorkerPool, run_id: str, topologies: list[Topology]) -> Plan:
    """The run's settings, made once from its options, and its plan.  Where the world sizes are known before planning
    (given, or the default run's), the ranks' start-up (on CPU the fork server's imports) overlaps the driver's
    imports and planning."""
    settings = RunSettings.of_args(args, *_device_and_backend(args.device, topologies, args.world_sizes))
    known_worlds = args.world_sizes or sorted({t.size for t in topologies})
    if not known_worlds and not (args.suite or args.op or args.case or args.suite_path):
        known_worlds = list(DEFAULT_WORLD_SIZES)
    if args.pool is None and _selects_megatron(args):  # (main's `pool`: its fork server serves other runs too)
        from shardcheck.harness.driver.pool import preload_in_ranks

        preload_in_ranks([MEGATRON_PRELOAD])
    if known_worlds:
        pool.start(known_worlds, settings.launch)
    from shardcheck.harness.driver.run import plan_from_args

    return plan_from_args(
        args,
        settings,
        run_id=run_id,
        world_sizes=args.world_sizes,
        topologies=topologies,
        default_dtypes=_default_dtypes(settings),
    )


def _open_run(args, pool: WorkerPool, run_dir: Path, plan: Plan) -> tuple[RecordWriter, dict]:
    """The run directory opened for `plan` (harness/driver/run.py), said on stderr; the launches it needs kept."""
    from shardcheck.harness.driver.run import open_run

    worlds = sorted({i.world_size for i in plan.items if not i.skip})  # (planned skips need no ranks)
    if args.pool is None:  # (main's `pool` outlives this run: its launches are not ours to end)
        pool.keep_only(worlds)
    if args.profile:
        args.profile_dir = (run_dir / "profile").resolve()
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        plan.profile = str(args.profile_dir)
    writer, meta = open_run(run_dir, plan, args.argv)
    print(
        f"shardcheck: {len(plan.items)} cases on world size(s) {', '.join(map(str, worlds))} "
        f"({plan.device}, {plan.backend}) -> {run_dir}",
        file=sys.stderr,
    )
    if meta["shim_notes"]:
        print("shardcheck: " + "; ".join(meta["shim_notes"]), file=sys.stderr)
    if any(not is_ours(spec, fam) for fam, spec in plan.impl.items()):
        # someone else's module (maybe inside a model case's step): say which, every family
        print(
            "shardcheck: modules under test: " + ", ".join(f"{f}={s}" for f, s in sorted(plan.impl.items())),
            file=sys.stderr,
        )
    return writer, meta


def _no_gpu_here() -> bool:
    """True when this machine has no GPU device node (NVIDIA or AMD): the run is on CPU, known without torch."""
    return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def _run(args) -> int:
    if args.junit_xml:
        _check_writable_file(args.junit_xml, "--junit-xml")
    topologies = [Topology.parse(t) for t in args.topology or []]
    run_id = dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
    run_dir = _run_dir(args.out, run_id)
    with _pool(args, run_dir) as pool:
        with _undone_on_error(args, pool, run_dir), _collector_off(freeze=args.own_process):
            if args.model_config is not None:
                from shardcheck.harness.driver.model_config import add_model_config_suite

                add_model_config_suite(args, run_dir)  # a torchtitan job names its topology where the run does not
                topologies = [Topology.parse(t) for t in args.topology or []]
            plan = _plan(args, pool, run_id, topologies)
            plan.model_config = args.model_config or ""
            from shardcheck.harness.driver.launch import run_plan
            from shardcheck.harness.driver.run import close_run
            from shardcheck.reports.sinks import finish  # noqa: F401  (its imports: pandas, matplotlib)
        writer, meta = _open_run(args, pool, run_dir, plan)
        try:
            show_progress = not args.no_progress and sys.stderr.isatty()
            run_plan(plan, run_dir, writer, show_progress=show_progress, hang_budget=not args.no_hang_budget, pool=pool)
        finally:
            close_run(run_dir, writer, meta)
    return _end_of_run(args, run_dir, run_id, writer.counts)


def _end_of_run(args, run_dir: Path, run_id: str, counts: dict[str, int]) -> int:
    """The run settled once (a findings line demoted to warn: its rows too, harness/findings/verdicts.py) and handed
    to its outputs (reports/sinks.py), its findings and failing items printed; the exit code."""
    from shardcheck.harness.driver.run import exit_code
    from shardcheck.reports.console import print_failures, print_findings, print_harness_errors, print_skip_reasons
    from shardcheck.reports.sinks import Outputs, finish

    settled = finish(run_dir, counts, Outputs(run_id, args.junit_xml, os.environ.get("GITHUB_STEP_SUMMARY")))
    counts, rows = settled.counts, settled.rows
    print_findings(settled.findings)
    known = "".join(
        f", {counts[s]} {s}ed" for s in (Status.XFAIL, Status.XPASS) if counts[Status.XFAIL] or counts[Status.XPASS]
    )
    print(
        f"shardcheck: {counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed, "
        f"{counts['error']} errors, {counts['skip']} skipped{known} -> {run_dir / 'report.html'}"
    )
    print_skip_reasons(rows)
    print_harness_errors(rows)
    if counts[Status.FAIL] or counts[Status.ERROR] or counts[Status.XPASS]:
        print_failures(run_dir, rows)
    elif counts[Status.WARN] and args.strict:
        print(f"shardcheck: --strict: {counts['warn']} warning(s) fail the run")
    return exit_code(counts, args.strict)


def _device_and_backend(
    wanted: str | None, topologies: list[Topology], world_sizes: list[int] | None
) -> tuple[str, str]:
    """The run's device (`--device`, else cuda when available) and its process groups' backend."""
    if wanted == "cpu" or (wanted is None and _no_gpu_here()):
        return "cpu", "gloo"  # known without importing torch: the ranks' start-up can begin at once
    import torch

    device = wanted or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    max_world = max([t.size for t in topologies] + (world_sizes or [4]))
    # nccl needs a GPU per rank; otherwise gloo (with CUDA tensors on a shared GPU).
    backend = "nccl" if device == "cuda" and torch.cuda.device_count() >= max_world else "gloo"
    return device, backend


def _run_dir(out: Path | None, run_id: str) -> Path:
    run_dir = out or Path("shardcheck-runs") / run_id
    if (run_dir / "results.jsonl").exists():
        raise UsageError(f"--out {run_dir}: already holds a run; choose another directory")
    return run_dir


def cmd_fuzz(args) -> int:
    from shardcheck.harness.driver.corpus import corpus_dir, load_corpus
    from shardcheck.harness.driver.fuzz import FuzzSession
    from shardcheck.harness.driver.planner import plan_fuzz
    from shardcheck.harness.driver.run import suite_paths
    from shardcheck.harness.rank import shims

    if args.examples is not None and args.examples <= 0:
        raise UsageError(f"--examples must be positive, got {args.examples}")
    if args.time is not None and args.time <= 0:
        raise UsageError(f"--time must be positive, got {args.time:g}")
    if args.world_sizes is not None and any(w <= 0 for w in args.world_sizes):
        raise UsageError(f"world sizes must be positive, got {args.world_sizes}")
    topologies = [Topology.parse(t) for t in args.topology or []]
    settings = RunSettings.of_args(args, *_device_and_backend(args.device, topologies, args.world_sizes))
    sizes = args.world_sizes or list(DEFAULT_WORLD_SIZES)
    # the expert-parallel ones too: a space whose cases run expert parallelism draws them (others never see them)
    topologies = topologies or default_topologies(sizes) + expert_topologies(sizes)
    run_id = "fuzz-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
    run_dir = _run_dir(args.out, run_id)
    corpus = corpus_dir(args.corpus).resolve()
    load_corpus(corpus)  # a corrupt corpus is bad usage before the search, not after it
    if settings.shims:
        shims.install(settings.device)
    base, spaces, skipped = plan_fuzz(
        run_id=run_id,
        suites_wanted=str_list(args.suite),
        ops=str_list(args.op),
        impl=impl_map(args.impl),
        settings=settings,
        suite_paths=suite_paths(args),
        corpus_dir=str(corpus),
    )
    for what, reason in skipped.items():
        print(f"skip {what}: {reason}")
    if not spaces:
        raise UsageError("nothing to fuzz: no selected op has a fuzz space")
    examples = args.examples or (MAX_FUZZ_EXAMPLES if args.time else DEFAULT_FUZZ_EXAMPLES)
    with _pool(args, run_dir.resolve()) as pool:
        session = FuzzSession(
            base,
            topologies,
            run_dir.resolve(),
            pool,
            examples=examples,
            seconds=args.time,
            hang_budget=not args.no_hang_budget,
        )
        return _fuzz(args, session, spaces, run_dir, corpus)


def _fuzz(args, session, spaces, run_dir: Path, corpus: Path) -> int:
    """cmd_fuzz's search and its report, on the session's ranks: each op's shrunk failure saved to the corpus, then
    replayed as `shardcheck run` replays the corpus (its rows, the report, the rerun line)."""
    import json

    from shardcheck.harness.driver.launch import run_plan
    from shardcheck.harness.driver.run import close_run, open_run
    from shardcheck.reports.console import print_failures, print_findings
    from shardcheck.reports.sinks import Outputs, finish

    searches = _search(args, session, spaces, run_dir)
    (run_dir / "fuzz.json").write_text(
        json.dumps({"seed": args.seed, "impl": session.base.impl, "ops": [s.to_json() for s in searches]}, indent=1)
    )
    failures = [s for s in searches if s.failure]
    if not failures:
        print(f"shardcheck fuzz: no failure in {sum(s.examples for s in searches)} examples -> {run_dir}")
        return EXIT_OK
    plan = _saved_failures(args, session.base, spaces, failures, corpus)
    writer, meta = open_run(run_dir, plan, args.argv)
    try:
        run_plan(plan, run_dir, writer, show_progress=False, hang_budget=not args.no_hang_budget, pool=session.pool)
    finally:
        close_run(run_dir, writer, meta)
    settled = finish(run_dir, writer.counts, Outputs(plan.run_id))  # the shrunk cases' run: its pages
    counts = settled.counts
    print_findings(settled.findings)
    print(
        f"shardcheck fuzz: {len(failures)} op(s) failed; the shrunk cases: {counts['pass']} passed, "
        f"{counts['fail']} failed, {counts['error']} errors -> {run_dir / 'report.html'}"
    )
    print_failures(run_dir, settled.rows)
    return EXIT_FAIL


def _search(args, session, spaces, run_dir: Path) -> list:
    """Each op's search (harness/driver/fuzz.py), a line per op; with progress, a line per example on a terminal."""
    budget = [f"{args.examples} examples per op"] if args.examples else []
    budget += [f"{args.time:g} s in all"] if args.time else []
    budget = " and ".join(budget)
    base = session.base
    print(
        f"shardcheck fuzz: {len(spaces)} op(s), {budget or f'{session.examples} examples per op'}, seed {args.seed}, "
        f"topologies {' '.join(map(str, session.topologies))} ({base.device}, {base.backend}) -> {run_dir}",
        file=sys.stderr,
    )
    show = not args.no_progress and sys.stderr.isatty()

    def progress(search, example) -> None:
        if show:
            state = "ok" if example.signature is None else " ".join(example.signature)
            print(f"\r  {search.op}: example {search.examples}: {state}\033[K", end="", file=sys.stderr, flush=True)

    searches = []
    for suite, space in spaces:
        found = session.search(suite, space, on_example=progress)
        if show:
            print("\r\033[K", end="", file=sys.stderr)
        searches.append(found)
        print(found.summary())
    return searches


def _saved_failures(args, base: Plan, spaces, failures: list, corpus: Path) -> Plan:
    """Each shrunk failure saved to the corpus; the plan that replays them."""
    from shardcheck.harness.driver.corpus import CorpusEntry, save_entry
    from shardcheck.harness.driver.planner import build_fuzz_case, fuzz_item

    plan = dataclasses.replace(base, items=[])
    for found in failures:
        entry = CorpusEntry(
            suite=found.suite,
            op=found.op,
            params=found.failure.params,
            seed=args.seed,
            signature=list(found.failure.signature),
            impl=base.impl.get(found.op.split(".", 1)[0]),
        )
        print(f"shardcheck fuzz: saved {save_entry(corpus, entry)}")
        case = build_fuzz_case(found.suite, _space(spaces, found.op), entry.params, "shrunk params")
        plan.items.append(fuzz_item(len(plan.items), found.suite, case, entry.params, args.seed))
    return plan


MAX_FUZZ_EXAMPLES = 1_000_000  # --time alone: examples are drawn until the time is up


def _space(spaces, op: str):
    return next(space for _, space in spaces if space.op == op)


def cmd_list(args) -> int:
    from shardcheck.harness.driver.corpus import corpus_dir, load_corpus
    from shardcheck.harness.driver.planner import DEFAULT_DTYPES, DEFAULT_WORLD_SIZES
    from shardcheck.harness.driver.run import suite_paths
    from shardcheck.harness.rank.suite_loader import external_suite_files, suite_cases, suite_names

    paths = suite_paths(args)
    external = external_suite_files(paths)
    for name in suite_names(paths):
        cases = suite_cases(name, args.quick, suite_paths=paths)
        print(f"suite {name}" + (f" (external: {external[name]}):" if name in external else ":"))
        for op in dict.fromkeys(c.op for c in cases):
            of_op = [c for c in cases if c.op == op]
            # which of its cases also run at ep > 1 (Case.expert_parallel) or HSDP topologies (Case.hsdp)
            splits = [f"{sum(c.expert_parallel for c in of_op)} expert-parallel"] * any(
                c.expert_parallel for c in of_op
            )
            splits += [f"{sum(c.hsdp for c in of_op)} HSDP"] * any(c.hsdp for c in of_op)
            print(f"  {op}  ({len(of_op)} case{'s' if len(of_op) != 1 else ''}{''.join('; ' + s for s in splits)})")
    print("default topologies: " + " ".join(str(t) for t in default_topologies(list(DEFAULT_WORLD_SIZES))))
    experts = expert_topologies(list(DEFAULT_WORLD_SIZES))
    print("expert-parallel topologies (cases that run ep): " + " ".join(str(t) for t in experts))
    print("HSDP topologies (cases that run HSDP): given with --topology, e.g. dp=4,dp_replicate=2 (dp4r2-cp1-tp1)")
    print("default dtypes: " + ",".join(DEFAULT_DTYPES))
    corpus = corpus_dir(args.corpus)
    entries = load_corpus(corpus)
    per_suite = ", ".join(
        f"{suite} {sum(e.suite == suite for e in entries)}" for suite in sorted({e.suite for e in entries})
    )
    print(
        f"fuzz corpus {corpus}: {len(entries)} saved case{'s' if len(entries) != 1 else ''}"
        + (f" ({per_suite}); `run` replays them first" if entries else "")
    )
    return EXIT_OK


def cmd_report(args) -> int:
    from shardcheck.harness.core.records import load
    from shardcheck.reports.report import REPORT_COLUMNS, build

    for d in args.dirs:
        _needs_rows(d)
        rows = load(d)
        if rows.empty:
            raise UsageError(f"{d}: results.jsonl holds no result rows (the run recorded no check)")
        lacking = [c for c in REPORT_COLUMNS if c not in rows]
        if lacking:
            raise UsageError(f"{d}: results.jsonl rows lack {', '.join(lacking)} (rows `shardcheck run` did not write)")
    for d in args.dirs:
        for path in build(d):
            print(path)
    return EXIT_OK


def cmd_dashboard(args) -> int:
    from shardcheck.reports.dashboard import build_dashboard

    for d in args.runs:
        _needs_rows(d)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {args.out}: {exc.strerror}") from None
    try:
        page, regressions = build_dashboard(args.runs, args.out, args.max_slowdown, args.max_memory_growth)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read runs: {exc}") from None
    print(f"shardcheck dashboard: {len(args.runs)} runs, {regressions} regression mark(s) -> {page}")
    return EXIT_OK


def cmd_examples(args) -> int:
    """The example suites shipped with shardcheck copied into a new folder, so that the docs' `--suite-path
    examples/...` commands run from the folder above it, from a wheel as from a checkout."""
    source = Path(__file__).resolve().parents[1] / "examples"  # shardcheck/examples in a wheel; a checkout's own
    if args.dir.exists():
        raise UsageError(f"{args.dir} exists; name a new folder")
    try:
        shutil.copytree(source, args.dir, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    except OSError as exc:
        raise UsageError(f"{args.dir}: {exc.strerror}") from None
    for path in sorted(p for p in args.dir.iterdir() if p.is_dir()):
        print(path)
    return EXIT_OK


def cmd_zoo(args) -> int:
    """The field bug zoo's pairs (all, or those named) in one run, then the recall table (docs/zoo.md); exit 1 when
    a pair that can run is not caught or its fixed twin does not pass in every dtype."""
    from shardcheck.harness.driver.zoo import entries, run_argv, zoo_dir
    from shardcheck.reports.zoo import markdown, recall, write

    found = entries(zoo_dir(), args.names)
    runnable = [e for e in found if e.bug.needs is None]
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
    run_dir = args.out or Path("shardcheck-runs") / f"zoo-{stamp}"
    if runnable and main(run_argv(zoo_dir(), runnable, run_dir, args.timeout), pool=args.pool) == EXIT_USAGE:
        return EXIT_USAGE
    lines = recall(run_dir if runnable else None, {e.name: e.bug for e in found})
    command = " ".join(["shardcheck zoo", *args.names])
    md, _ = write(run_dir, lines, command)
    print(markdown(lines, command) + f"shardcheck zoo: -> {md}")
    broken = [r for r in lines if r.false_alarm or not (r.caught or r.missed.startswith("needs"))]
    return EXIT_FAIL if broken else EXIT_OK


def main(argv: list[str] | None = None, pool: WorkerPool | None = None, own_process: bool = False) -> int:
    """The command line `shardcheck ARGV` (default: sys.argv); its exit code.  `pool`: the ranks of `run` and `fuzz`
    come from it and go back to it (a caller running many commands pays one start-up per world size and settings)
    instead of a pool of the command's own.  `own_process`: the process ends with the command (`console`)."""
    try:
        args = make_parser().parse_args(argv)
        args.pool, args.argv, args.own_process = pool, sys.argv if argv is None else ["shardcheck", *argv], own_process
        if args.command is None:
            raise UsageError(
                "missing command: run, fuzz, list, report, compare, dashboard, examples or zoo (see shardcheck --help)"
            )
        commands = {
            "run": cmd_run,
            "fuzz": cmd_fuzz,
            "list": cmd_list,
            "report": cmd_report,
            "examples": cmd_examples,
            "compare": cmd_compare,
            "dashboard": cmd_dashboard,
            "zoo": cmd_zoo,
        }
        return commands[args.command](args)
    except UsageError as exc:
        print(f"shardcheck: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("shardcheck: interrupted", file=sys.stderr)
        return 130


def console() -> int:
    """The `shardcheck` executable: `main` in a process of its own, then nothing for the interpreter's last garbage
    collection to walk (every object torch, pandas and matplotlib made: about 0.6 s on a 2-core machine, for nothing,
    since everything of ours is closed by now)."""
    code = main(own_process=True)
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(console())
