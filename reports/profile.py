"""Where a run's time goes (`shardcheck run --profile`): the cProfile of the driver and of every rank, summed
into the parts of a run, written to <run>/profile/breakdown.md.

Rank side, summed over the ranks of each launch (cumulative seconds; `events` are written from inside `checks`,
and a failing check's precision run of the reference is inside `checks` too, so rows overlap there): golden
(the float64 reference and the low-precision reference run, once per case and dtype on each rank; the imports a
reference makes the first time it runs, Megatron-Core's, count there too), inputs sliced, op forward and backward
(the code under test and its collectives: harness/rank/item_run.py), checks (comparison against the golden,
properties, communication contract), events, barrier (waiting at the item's store barrier for the slowest rank),
mesh built, and the rest of the process (imports, process group, plan).  Driver: planning, waiting on the
launches, merging events into rows, the report; launches run side by side in threads of their own, each profiled
on its own (driver-launch-w<N>.prof) and summed here with the main thread's.  Open a .prof with
`python -m pstats` or snakeviz for more."""

from __future__ import annotations

import pstats
from collections import defaultdict
from pathlib import Path

# part -> (file name ending, function name) whose cumulative time is the part's
RANK_PARTS = {
    "golden": [("harness/rank/golden.py", "get")],
    "inputs sliced": [("harness/rank/item_run.py", "_local_inputs")],
    "op forward": [("harness/rank/item_run.py", "_call_op")],
    "op backward": [("harness/rank/item_run.py", "_backward_step")],
    "checks": [
        ("harness/rank/item_run.py", "_judge_output"),
        ("harness/rank/item_run.py", "_judge_gradients"),
        ("harness/rank/item_run.py", "emit_comm"),
        ("harness/rank/item_run.py", "_emit_properties"),
        ("harness/rank/item_run.py", "_emit_used_signatures"),
    ],
    "benchmark": [("harness/rank/bench.py", "run_bench_item")],
    "events": [("harness/core/events.py", "_write")],
    "barrier": [("harness/rank/worker.py", "barrier")],
    "mesh built": [("harness/rank/worker.py", "mesh")],
}
DRIVER_PARTS = {
    "plan": [("harness/driver/run.py", "plan_from_args")],
    "launches (waiting on the ranks)": [("harness/driver/launch.py", "run_plan")],
    "events merged into rows": [("harness/driver/collect.py", "poll")],
    "findings and reports": [("reports/sinks.py", "finish")],
}


def _cumulative(stats: pstats.Stats, wanted: list[tuple[str, str]]) -> float:
    total = 0.0
    for (filename, _, name), (_, _, _, cumtime, _) in stats.stats.items():
        if any(filename.endswith(f) and name == n for f, n in wanted):
            total += cumtime
    return total


def breakdown(profile_dir: Path) -> str:
    """The Markdown table of the parts of a run, from the .prof files in `profile_dir`."""
    by_launch: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for path in sorted(profile_dir.glob("w*-rank*.prof")):
        stats = pstats.Stats(str(path))
        launch = path.name.split("-")[0]  # w<world size>
        parts = by_launch[launch]
        parts["ranks"] += 1
        for part, wanted in RANK_PARTS.items():
            parts[part] += _cumulative(stats, wanted)
        parts["item loop"] += _cumulative(stats, [("harness/rank/worker.py", "run")])
    lines = ["## Rank side (seconds, summed over the ranks of the launch)", ""]
    launches = sorted(by_launch, key=lambda w: int(w[1:]))
    lines.append(
        "| part | " + " | ".join(f"world {w[1:]} ({int(by_launch[w]['ranks'])} ranks)" for w in launches) + " |"
    )
    lines.append("|---|" + "---:|" * len(launches))
    rows = [*RANK_PARTS, "item loop"]
    for part in rows:
        lines.append(f"| {part} | " + " | ".join(f"{by_launch[w][part]:.2f}" for w in launches) + " |")
    driver = profile_dir / "driver.prof"
    if driver.is_file():
        stats = pstats.Stats(str(driver))
        total = stats.total_tt  # the main thread's: the launch threads run inside its wall time
        threads = sorted(profile_dir.glob("driver-launch-w*.prof"))  # launches side by side: one per thread
        for path in threads:
            stats.add(str(path))
        lines += [
            "",
            "## Driver (seconds"
            + (f"; the main thread and {len(threads)} launch threads, summed" if threads else "")
            + ")",
            "",
            "| part | seconds |",
            "|---|---:|",
        ]
        for part, wanted in DRIVER_PARTS.items():
            lines.append(f"| {part} | {_cumulative(stats, wanted):.2f} |")
        lines.append(f"| total (imports included) | {total:.1f} |")
    return "\n".join(lines) + "\n"
