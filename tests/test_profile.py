"""`shardcheck run --profile` (where a run's time goes), and the collective counter on a 1-rank world, where
every mesh dim is the default group."""

from __future__ import annotations

import ast
import pstats
from pathlib import Path

from helpers import shardcheck

import shardcheck.harness as harness_pkg
from shardcheck.harness.core.measure import CommCounter
from shardcheck.reports.profile import DRIVER_PARTS, RANK_PARTS


def test_profile_writes_every_ranks_profile_and_a_breakdown(tmp_path):
    run = shardcheck(
        "run",
        "--op",
        "model_utils.DistributedLogprob",
        "--quick",
        "--dtype",
        "float64",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--topology",
        "dp=1,cp=1,tp=1",
        "--profile",
        out=tmp_path / "run",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    profile = run.out / "profile"
    ranks = sorted(p.name.split("-")[:2] for p in profile.glob("w*-rank*.prof"))
    assert ranks == [["w1", "rank0"], ["w2", "rank0"], ["w2", "rank1"]]  # one launch per size, every rank
    stats = pstats.Stats(str(next(profile.glob("w2-rank1-*.prof"))))
    assert any(name == "_call_op" for (_, _, name) in stats.stats)  # the op under test ran under the profiler
    breakdown = (profile / "breakdown.md").read_text()
    assert "| op forward |" in breakdown and "| golden |" in breakdown and "world 2 (2 ranks)" in breakdown
    item_loop = next(line for line in breakdown.splitlines() if line.startswith("| item loop |"))
    seconds = [float(x) for x in item_loop.strip("|").split("|")[1:]]
    assert len(seconds) == 2 and min(seconds) >= 0 and sum(seconds) > 0  # a launch's few quick items may round to 0
    assert (profile / "driver.prof").is_file() and "profile ->" in run.stdout
    # the two launches ran side by side in threads of their own: each thread's profile is kept and merged, so the
    # driver's merging of their events is counted (cProfile follows one thread: it read 0 before)
    threads = sorted(p.name for p in profile.glob("driver-launch-w*.prof"))
    assert threads == ["driver-launch-w1.prof", "driver-launch-w2.prof"]
    polls = [
        calls
        for path in threads
        for (file, _, name), (_, calls, *_) in pstats.Stats(str(profile / path)).stats.items()
        if file.endswith("harness/driver/collect.py") and name == "poll"
    ]
    assert polls and min(polls) > 0
    assert "the main thread and 2 launch threads, summed" in breakdown
    merged = next(line for line in breakdown.splitlines() if line.startswith("| events merged into rows |"))
    assert float(merged.strip("|").split("|")[1]) > 0, merged


def _counted(group_dims: dict[str, str], seen: dict) -> CommCounter:
    counter = CommCounter(group_dims)
    for phase, kinds in seen.items():
        for key, calls in kinds.items():
            counter.counts[phase][key] = {"calls": calls, "bytes": 8 * calls}
    return counter


def test_shared_group_counts_under_the_dim_the_contract_lists():
    counter = _counted({"0": "dp|cp|tp"}, {"forward": {"all_reduce@dp|cp|tp": 2, "all_gather@dp|cp|tp": 1}})
    allowed = {"forward": {"all_reduce@cp": (2, 16), "all_gather@tp": (1, 8)}}
    assert counter.as_dict(allowed) == {
        "forward": {"all_gather@tp": {"calls": 1, "bytes": 8}, "all_reduce@cp": {"calls": 2, "bytes": 16}}
    }
    # without a contract (or one listing none of them): the first dim, so more than allowed is still seen
    assert counter.as_dict() == {
        "forward": {"all_gather@dp": {"calls": 1, "bytes": 8}, "all_reduce@dp": {"calls": 2, "bytes": 16}}
    }
    # counts of the same kind and dim from a shared and an own group add up
    both = _counted({}, {"backward": {"all_reduce@tp": 1, "all_reduce@dp|cp|tp": 1}})
    assert both.as_dict({"backward": {"all_reduce@tp": (2, 16)}}) == {
        "backward": {"all_reduce@tp": {"calls": 2, "bytes": 16}}
    }


def test_every_part_of_the_breakdown_names_a_function_that_exists():
    """The parts are found by (file, function name): a function moved or renamed would read 0 without a word."""
    root = Path(harness_pkg.__file__).parent.parent  # the repository root: the parts name files under it
    for part, wanted in {**RANK_PARTS, **DRIVER_PARTS}.items():
        for file, name in wanted:
            tree = ast.parse((root / file).read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            assert name in defined, f"{part}: {file} defines no {name}"
